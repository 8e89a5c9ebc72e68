//! Metrics: exact counts and attributes for each outcome, recorded into an in-memory exporter.
#![cfg(feature = "sqlite")]

use std::sync::OnceLock;
use std::time::Duration;

use dlock::{CancellationToken, LockError, LockProvider};
use dlock_testkit::unique_key;
use opentelemetry::KeyValue;
use opentelemetry::metrics::MeterProvider as _;
use opentelemetry_sdk::metrics::data::{AggregatedMetrics, MetricData};
use opentelemetry_sdk::metrics::{InMemoryMetricExporter, PeriodicReader, SdkMeterProvider};

struct Recorder {
    provider: SdkMeterProvider,
    exporter: InMemoryMetricExporter,
}

impl Recorder {
    fn new() -> Self {
        let exporter = InMemoryMetricExporter::default();
        let provider = SdkMeterProvider::builder()
            .with_reader(PeriodicReader::builder(exporter.clone()).build())
            .build();
        Recorder { provider, exporter }
    }

    /// (attributes sorted, value) of every data point of `name` in the meter `dlock`: sums for
    /// counters, counts for histograms.
    fn points(&self, name: &str) -> Vec<(Vec<(String, String)>, u64)> {
        self.points_in("dlock", name)
    }

    /// [`points`](Recorder::points) in the meter named `meter`.
    fn points_in(&self, meter: &str, name: &str) -> Vec<(Vec<(String, String)>, u64)> {
        self.provider.force_flush().unwrap();
        let exported = self.exporter.get_finished_metrics().unwrap();
        let Some(last) = exported.last() else {
            return Vec::new();
        };
        let mut points = Vec::new();
        for scope in last
            .scope_metrics()
            .filter(|scope| scope.scope().name() == meter)
        {
            for metric in scope.metrics().filter(|m| m.name() == name) {
                match metric.data() {
                    AggregatedMetrics::U64(MetricData::Sum(sum)) => {
                        for p in sum.data_points() {
                            points.push((attrs(p.attributes()), p.value()));
                        }
                    }
                    AggregatedMetrics::I64(MetricData::Sum(sum)) => {
                        for p in sum.data_points() {
                            let value = u64::try_from(p.value()).unwrap_or_else(|_| {
                                panic!("{name} went below zero: {}", p.value())
                            });
                            points.push((attrs(p.attributes()), value));
                        }
                    }
                    AggregatedMetrics::F64(MetricData::Histogram(h)) => {
                        for p in h.data_points() {
                            points.push((attrs(p.attributes()), p.count()));
                        }
                    }
                    other => panic!("unexpected data for {name}: {other:?}"),
                }
            }
        }
        points.sort();
        points
    }
}

/// The recorder installed as the global meter provider, shared by the tests that need one
/// (each looks at a meter or attributes of its own).
fn global_recorder() -> &'static Recorder {
    static GLOBAL: OnceLock<Recorder> = OnceLock::new();
    GLOBAL.get_or_init(|| {
        let recorder = Recorder::new();
        opentelemetry::global::set_meter_provider(recorder.provider.clone());
        recorder
    })
}

/// Waits until `name`'s points in `meter` are `expected`, failing after 10 s.
async fn until(
    recorder: &Recorder,
    meter: &str,
    name: &str,
    expected: Vec<(Vec<(String, String)>, u64)>,
) {
    let came = dlock_testkit::eventually(Duration::from_secs(10), || {
        recorder.points_in(meter, name) == expected
    })
    .await;
    assert!(
        came,
        "{name}: {:?}, expected {expected:?}",
        recorder.points_in(meter, name)
    );
}

fn attrs<'a>(kvs: impl Iterator<Item = &'a KeyValue>) -> Vec<(String, String)> {
    let mut v: Vec<_> = kvs
        .map(|kv| (kv.key.to_string(), kv.value.to_string()))
        .collect();
    v.sort();
    v
}

fn status(s: &str) -> Vec<(String, String)> {
    vec![
        ("lock_type".into(), "sqlite".into()),
        ("status".into(), s.into()),
    ]
}

async fn provider(dir: &tempfile::TempDir, recorder: &Recorder, opt_in: bool) -> LockProvider {
    let backend = dlock::sqlite::SqliteBackend::builder(dir.path().join("m.db"))
        .lease(Duration::from_millis(600))
        .open()
        .await
        .unwrap();
    LockProvider::builder(backend)
        .meter(recorder.provider.meter("dlock"))
        .metric_key_prefix(opt_in)
        .metric_resource_id(opt_in)
        .build()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_outcome_is_counted_once_with_its_status() {
    let dir = tempfile::tempdir().unwrap();
    let recorder = Recorder::new();
    let locks = provider(&dir, &recorder, false).await;
    let key = unique_key("m");

    let guard = locks.try_acquire(&key).await.unwrap(); // acquired
    let _ = locks.try_acquire(&key).await; // already_held
    let _ = locks.try_acquire(&key).await; // already_held
    let _ = locks.acquire(&key, Duration::from_millis(50)).await; // timeout
    let token = CancellationToken::new();
    token.cancel();
    let _ = locks.lock(&key).cancel_on(&token).acquire().await; // canceled
    let _ = locks
        .lock(&unique_key("m"))
        .lease(Duration::from_millis(1))
        .try_acquire()
        .await; // error (lease too short)
    let _ = locks.try_acquire("").await; // invalid key: not counted
    guard.release().await.unwrap();

    assert_eq!(
        recorder.points("distributed_lock.acquisitions"),
        vec![
            (status("acquired"), 1),
            (status("already_held"), 2),
            (status("canceled"), 1),
            (status("error"), 1),
            (status("timeout"), 1),
        ]
    );
    assert_eq!(
        recorder.points("distributed_lock.wait_duration"),
        recorder.points("distributed_lock.acquisitions")
    );
    assert_eq!(
        recorder.points("distributed_lock.hold_duration"),
        vec![(vec![("lock_type".into(), "sqlite".into())], 1)]
    );
    assert!(recorder.points("distributed_lock.lost").is_empty());
}

/// With the opt-in attributes, every instrument carries the key's prefix and the key. A loss
/// is counted when it is detected (here a renewal finds the row taken over), while the guard is
/// still held, and not again when it is released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hold_is_recorded_on_drop_and_loss_counted_at_detection_once() {
    let dir = tempfile::tempdir().unwrap();
    let recorder = Recorder::new();
    let locks = provider(&dir, &recorder, true).await;
    let attributes = |key: &str| {
        vec![
            ("key_prefix".to_owned(), "jobs".to_owned()),
            ("lock_type".to_owned(), "sqlite".to_owned()),
            ("resource_id".to_owned(), key.to_owned()),
        ]
    };

    // The loss also carries the key's 64-bit id, as the .NET library tags it.
    let lost_attributes = |key: &str| {
        let mut v = attributes(key);
        v.push(("lock_id".to_owned(), dlock::lock_id(key).to_string()));
        v.sort();
        v
    };

    let dropped = locks.try_acquire("jobs:dropped").await.unwrap();
    drop(dropped);

    let lost = locks.try_acquire("jobs:lost").await.unwrap();
    let conn = rusqlite::Connection::open(dir.path().join("m.db")).unwrap();
    conn.execute(
        "UPDATE __distributed_locks SET owner = X'00' WHERE name = ?1",
        [b"jobs:lost".as_slice()],
    )
    .unwrap();
    tokio::time::timeout(Duration::from_secs(3), lost.lost_token().cancelled())
        .await
        .expect("lost detected");
    // Counted now, with the guard still held (its hold is not recorded yet).
    until(
        &recorder,
        "dlock",
        "distributed_lock.lost",
        vec![(lost_attributes("jobs:lost"), 1)],
    )
    .await;
    until(
        &recorder,
        "dlock",
        "distributed_lock.hold_duration",
        vec![(attributes("jobs:dropped"), 1)],
    )
    .await;
    assert!(matches!(lost.release().await, Err(LockError::Lost { .. })));

    assert_eq!(
        recorder.points("distributed_lock.hold_duration"),
        vec![
            (attributes("jobs:dropped"), 1),
            (attributes("jobs:lost"), 1)
        ]
    );
    assert_eq!(
        recorder.points("distributed_lock.lost"),
        vec![(lost_attributes("jobs:lost"), 1)]
    );
    let acquired = |key: &str| {
        let mut v = attributes(key);
        v.push(("status".to_owned(), "acquired".to_owned()));
        v
    };
    assert_eq!(
        recorder.points("distributed_lock.acquisitions"),
        vec![(acquired("jobs:dropped"), 1), (acquired("jobs:lost"), 1)]
    );
}

/// A provider given a meter name records into the global meter provider's meter of that name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_meter_name_names_the_meter() {
    let dir = tempfile::tempdir().unwrap();
    let recorder = global_recorder();
    let backend = dlock::sqlite::SqliteBackend::open(dir.path().join("m.db"))
        .await
        .unwrap();
    let locks = LockProvider::builder(backend)
        .meter_name("dlock.tests.named")
        .build();
    let guard = locks.try_acquire(&unique_key("m")).await.unwrap();
    guard.release().await.unwrap();
    assert_eq!(
        recorder.points_in("dlock.tests.named", "distributed_lock.acquisitions"),
        vec![(status("acquired"), 1)]
    );
    assert_eq!(
        recorder.points_in("dlock.tests.named", "distributed_lock.hold_duration"),
        vec![(vec![("lock_type".into(), "sqlite".into())], 1)]
    );
}

/// A loss that only the release finds (the row was taken over between two renewals) is counted
/// too: the hold is recorded once the release has run, not before it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_loss_found_by_the_release_is_counted() {
    let dir = tempfile::tempdir().unwrap();
    let recorder = Recorder::new();
    // A long lease: no renewal runs during the test, so only the release can find the loss.
    let backend = dlock::sqlite::SqliteBackend::builder(dir.path().join("m.db"))
        .lease(Duration::from_secs(60))
        .open()
        .await
        .unwrap();
    let locks = LockProvider::builder(backend)
        .meter(recorder.provider.meter("dlock"))
        .build();
    let key = unique_key("m");
    for dropped in [false, true] {
        let guard = locks.try_acquire(&key).await.unwrap();
        let conn = rusqlite::Connection::open(dir.path().join("m.db")).unwrap();
        let taken = conn
            .execute(
                "UPDATE __distributed_locks SET owner = X'00' WHERE name = ?1",
                [key.as_bytes()],
            )
            .unwrap();
        assert_eq!(taken, 1);
        assert!(!guard.is_lost(), "no renewal has looked yet");
        if dropped {
            let lost = guard.lost_token().clone();
            drop(guard);
            tokio::time::timeout(Duration::from_secs(3), lost.cancelled())
                .await
                .expect("the background release finds the loss");
        } else {
            assert!(matches!(guard.release().await, Err(LockError::Lost { .. })));
        }
        conn.execute(
            "UPDATE __distributed_locks SET owner = NULL WHERE name = ?1",
            [key.as_bytes()],
        )
        .unwrap();
    }
    let sqlite = vec![("lock_type".to_owned(), "sqlite".to_owned())];
    assert!(
        dlock_testkit::eventually(Duration::from_secs(3), || recorder
            .points("distributed_lock.lost")
            == vec![(sqlite.clone(), 2)])
        .await,
        "lost: {:?}",
        recorder.points("distributed_lock.lost")
    );
}

/// Transaction-bound acquisitions and holds are recorded like a provider's, in the global meter
/// provider's meter `dlock` (no provider is involved). The only test of this binary that takes
/// transaction-bound locks or records into that meter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transaction_bound_acquisitions_and_holds_are_recorded() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("tx.db");
    // A session lock that a transaction lock meets, taken by a provider that records elsewhere.
    let elsewhere = Recorder::new();
    let locks = LockProvider::builder(dlock::sqlite::SqliteBackend::open(&file).await.unwrap())
        .meter(elsewhere.provider.meter("dlock"))
        .build();
    let (free, held) = (unique_key("tx"), unique_key("tx"));
    let session = locks.try_acquire(&held).await.unwrap();
    let recorder = global_recorder();
    let lock = tokio::task::spawn_blocking(move || {
        let mut conn = rusqlite::Connection::open(&file).unwrap();
        let tx = conn.transaction().unwrap();
        let lock = dlock::sqlite::try_acquire_in_transaction(&tx, &free).unwrap(); // acquired
        assert_eq!(lock.key(), free);
        assert_eq!(lock.backend(), "sqlite");
        let refused = dlock::sqlite::try_acquire_in_transaction(&tx, &held); // already_held
        assert!(
            matches!(refused, Err(LockError::AlreadyHeld { .. })),
            "{refused:?}"
        );
        let waited = dlock::sqlite::acquire_in_transaction(&tx, &held, Duration::from_millis(30)); // timeout
        assert!(
            matches!(waited, Err(LockError::Timeout { .. })),
            "{waited:?}"
        );
        let _ = dlock::sqlite::try_acquire_in_transaction(&tx, ""); // invalid key: not counted
        tx.commit().unwrap();
        lock
    })
    .await
    .unwrap();
    session.release().await.unwrap();
    // The hold is recorded when the last clone of the lock is dropped.
    let clone = lock.clone();
    drop(lock);
    assert!(recorder.points("distributed_lock.hold_duration").is_empty());
    drop(clone);
    assert_eq!(
        recorder.points("distributed_lock.hold_duration"),
        vec![(vec![("lock_type".into(), "sqlite".into())], 1)]
    );
    assert_eq!(
        recorder.points("distributed_lock.acquisitions"),
        vec![
            (status("acquired"), 1),
            (status("already_held"), 1),
            (status("timeout"), 1),
        ]
    );
    assert_eq!(
        recorder.points("distributed_lock.wait_duration"),
        recorder.points("distributed_lock.acquisitions")
    );
}

/// The gauges on a real store, with the opt-in attributes: `distributed_lock.held` counts the
/// locks held now (a lost one until its guard is released), `distributed_lock.waiting` the
/// acquisitions waiting now (here for a lock another provider of the file holds).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gauges_count_held_locks_and_waiting_acquisitions() {
    let dir = tempfile::tempdir().unwrap();
    let recorder = Recorder::new();
    let locks = provider(&dir, &recorder, true).await;
    // Another process's provider, recording elsewhere (the global meter is another test's).
    let other_recorder = Recorder::new();
    let elsewhere = LockProvider::builder(
        dlock::sqlite::SqliteBackend::open(dir.path().join("m.db"))
            .await
            .unwrap(),
    )
    .meter(other_recorder.provider.meter("dlock"))
    .build();
    let attributes = |key: &str| {
        vec![
            ("key_prefix".to_owned(), "jobs".to_owned()),
            ("lock_type".to_owned(), "sqlite".to_owned()),
            ("resource_id".to_owned(), key.to_owned()),
        ]
    };

    let a = locks.try_acquire("jobs:a").await.unwrap();
    let b = locks.try_acquire_read("jobs:b").await.unwrap();
    let other = elsewhere.try_acquire("jobs:c").await.unwrap();
    assert_eq!(
        recorder.points("distributed_lock.held"),
        vec![(attributes("jobs:a"), 1), (attributes("jobs:b"), 1)]
    );
    let waiter = {
        let locks = locks.clone();
        tokio::spawn(async move { locks.acquire("jobs:c", Duration::from_secs(20)).await })
    };
    until(
        &recorder,
        "dlock",
        "distributed_lock.waiting",
        vec![(attributes("jobs:c"), 1)],
    )
    .await;
    other.release().await.unwrap();
    let c = waiter.await.unwrap().unwrap();
    assert_eq!(
        recorder.points("distributed_lock.waiting"),
        vec![(attributes("jobs:c"), 0)]
    );
    assert_eq!(
        recorder.points("distributed_lock.held"),
        vec![
            (attributes("jobs:a"), 1),
            (attributes("jobs:b"), 1),
            (attributes("jobs:c"), 1)
        ]
    );

    // A lost lock stays counted until its guard is released.
    let conn = rusqlite::Connection::open(dir.path().join("m.db")).unwrap();
    conn.execute(
        "DELETE FROM __distributed_locks WHERE name = ?1",
        [b"jobs:a".as_slice()],
    )
    .unwrap();
    tokio::time::timeout(Duration::from_secs(3), a.lost_token().cancelled())
        .await
        .expect("lost detected");
    assert_eq!(recorder.points("distributed_lock.held").len(), 3);
    assert!(matches!(a.release().await, Err(LockError::Lost { .. })));
    b.release().await.unwrap();
    drop(c);
    until(
        &recorder,
        "dlock",
        "distributed_lock.held",
        vec![
            (attributes("jobs:a"), 0),
            (attributes("jobs:b"), 0),
            (attributes("jobs:c"), 0),
        ],
    )
    .await;
}
