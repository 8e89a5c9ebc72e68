//! The SQLite backend: the conformance suite, plus what only a lock file can do wrong.
#![cfg(feature = "sqlite")]

mod support;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use dlock::sqlite::{SqliteBackend, acquire_in_transaction, try_acquire_in_transaction};
use dlock::{LockError, LockGuard, LockProvider};
use dlock_testkit::unique_key;
use support::Holder;

const LEASE: Duration = Duration::from_millis(900);

struct SqliteHarness {
    dir: tempfile::TempDir,
}

impl SqliteHarness {
    async fn new() -> Self {
        SqliteHarness {
            dir: tempfile::tempdir().expect("temp dir"),
        }
    }

    fn path(&self) -> PathBuf {
        self.dir.path().join("locks.db")
    }

    fn url(&self) -> String {
        format!(
            "sqlite://{}?lease={}ms",
            self.path().display(),
            LEASE.as_millis()
        )
    }
}

impl dlock_testkit::Harness for SqliteHarness {
    async fn provider(&self) -> LockProvider {
        LockProvider::connect(&self.url())
            .await
            .expect("open lock file")
    }

    async fn break_lock(&self, guard: &LockGuard) {
        // Another owner takes the row over, as if the lease had run out and been taken.
        let conn = rusqlite::Connection::open(self.path()).expect("open");
        let changed = conn
            .execute(
                "UPDATE __distributed_locks SET owner = X'00' WHERE name = ?1",
                [guard.key().as_bytes()],
            )
            .expect("steal row");
        assert_eq!(changed, 1);
    }

    fn lost_within(&self) -> Duration {
        LEASE / 3 + Duration::from_secs(1)
    }

    fn retake_within(&self) -> Duration {
        // The taken-over row keeps its expiry: free once that lease runs out.
        LEASE + Duration::from_secs(1)
    }

    fn fencing(&self) -> bool {
        true
    }

    fn store_inspection(&self) -> dlock_testkit::StoreInspection {
        dlock_testkit::StoreInspection::Listed
    }

    fn read_locks(&self) -> bool {
        true
    }

    async fn shared_providers(&self, count: usize) -> Vec<LockProvider> {
        let backend = dlock::sqlite::SqliteBackend::connect(&self.url())
            .await
            .expect("open lock file");
        (0..count)
            .map(|_| LockProvider::from_backend(backend.clone()))
            .collect()
    }
}

dlock_testkit::conformance_suite!(SqliteHarness::new());

#[test]
fn multi_process_exclusion() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}/mp.db", dir.path().display());
    support::run_multi_process(&url, "jobs:multi-process", 4, 60, support::Fencing::Every);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_holder_frees_the_lock_when_its_lease_ends() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}/kill.db?lease=1s", dir.path().display());
    let key = unique_key("killed");
    let holder = Holder::start(&url, &key);
    let first_token = holder.fencing_token.expect("sqlite issues tokens");
    let locks = LockProvider::connect(&url).await.unwrap();
    assert!(matches!(
        locks.try_acquire(&key).await,
        Err(LockError::AlreadyHeld { .. })
    ));
    holder.kill();
    freed_when_the_lease_ends(&locks, &key, Instant::now(), first_token).await;
}

/// After a holder with a 1 s lease was SIGKILLed at `killed_at`, `locks` gets `key` not before
/// the holder's lease could have ended and not long after, with a larger fencing token.
async fn freed_when_the_lease_ends(
    locks: &LockProvider,
    key: &str,
    killed_at: Instant,
    first_token: u64,
) {
    let guard = locks
        .acquire(key, Duration::from_secs(10))
        .await
        .expect("the lease of a killed holder runs out");
    let freed_after = killed_at.elapsed();
    eprintln!("free {freed_after:?} after the kill (lease 1 s)");
    // Not before the lease: the holder renewed at most a third of the lease before it was
    // killed, so its lease had at least two thirds left (0.6 allows for scheduling).
    assert!(
        freed_after >= Duration::from_millis(600),
        "the killed holder's lock was free after {freed_after:?}, before its lease could have ended"
    );
    // And not long after it: lease + 2 s (polling and scheduling).
    assert!(
        freed_after <= Duration::from_secs(3),
        "the killed holder's lock stayed held {freed_after:?}"
    );
    assert!(guard.fencing_token().unwrap() > first_token);
    guard.release().await.unwrap();
}

/// A holder frozen (SIGSTOP) past its lease cannot renew: another process takes the lock
/// with a larger fencing token once the lease has run out, and the holder, resumed, reports
/// the loss within a second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_holder_learns_of_its_loss_when_resumed() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}/stop.db?lease=1s", dir.path().display());
    let key = unique_key("stopped");
    let holder = Holder::start(&url, &key);
    let first_token = holder.fencing_token.expect("sqlite issues tokens");
    holder.signal("STOP");
    let stopped_at = Instant::now();
    let locks = LockProvider::connect(&url).await.unwrap();
    let guard = locks
        .acquire(&key, Duration::from_secs(10))
        .await
        .expect("the stopped holder's lease runs out");
    assert!(
        stopped_at.elapsed() >= Duration::from_millis(500),
        "taken over after {:?}, before the lease could have run out",
        stopped_at.elapsed()
    );
    assert!(guard.fencing_token().unwrap() > first_token);
    holder.signal("CONT");
    let resumed_at = Instant::now();
    assert!(
        holder.lost_within(Duration::from_secs(3)).is_some(),
        "the resumed holder reports the loss"
    );
    assert!(
        resumed_at.elapsed() < Duration::from_secs(2),
        "{:?}",
        resumed_at.elapsed()
    );
    guard.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewal_keeps_a_lock_past_its_lease() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}/renew.db?lease=300ms", dir.path().display());
    let (a, b) = (
        LockProvider::connect(&url).await.unwrap(),
        LockProvider::connect(&url).await.unwrap(),
    );
    let key = unique_key("renew");
    let guard = a.try_acquire(&key).await.unwrap();
    // Three leases later it is still held: renewals ran.
    let outcome = b.acquire(&key, Duration::from_millis(1200)).await;
    assert!(
        matches!(outcome, Err(LockError::Timeout { .. })),
        "{outcome:?}"
    );
    assert!(!guard.is_lost());
    guard.release().await.unwrap();
}

/// A leader whose lock is taken over is told (its term's token fires), and contends again: it
/// leads a second term, with a larger fencing token, once the taker's lease has run out. A job
/// run under `run_exclusive` whose lock is taken over reports `Lost`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_that_loses_its_lock_contends_again_and_a_lost_job_is_reported() {
    let harness = SqliteHarness::new().await;
    let locks = LockProvider::connect(&harness.url()).await.unwrap();
    let key = unique_key("leader-lost");
    let shutdown = dlock::CancellationToken::new();
    let (terms_tx, mut terms) = tokio::sync::mpsc::unbounded_channel();
    let run = tokio::spawn({
        let (locks, key, shutdown) = (locks.clone(), key.clone(), shutdown.clone());
        async move {
            dlock::Leader::new(&locks, key)
                .run(&shutdown, |term| {
                    let terms_tx = terms_tx.clone();
                    async move {
                        let _ = terms_tx.send((
                            term.number(),
                            term.fencing_token(),
                            term.token().clone(),
                        ));
                        term.ended().await;
                    }
                })
                .await
        }
    });
    let (number, first_token, first) = terms.recv().await.expect("a first term");
    assert_eq!(number, 1);
    let conn = rusqlite::Connection::open(harness.path()).expect("open");
    let stolen = conn
        .execute(
            "UPDATE __distributed_locks SET owner = X'00' WHERE name = ?1",
            [key.as_bytes()],
        )
        .expect("steal row");
    assert_eq!(stolen, 1);
    tokio::time::timeout(Duration::from_secs(5), first.cancelled())
        .await
        .expect("the term ends when the lock is lost");
    let (number, second_token, second) =
        tokio::time::timeout(Duration::from_secs(10), terms.recv())
            .await
            .expect("a second term once the taker's lease ran out")
            .expect("a second term");
    assert_eq!(number, 2);
    assert!(
        second_token > first_token,
        "{first_token:?} then {second_token:?}"
    );
    assert!(!second.is_cancelled());
    shutdown.cancel();
    run.await.unwrap().expect("ends cleanly");

    let job = unique_key("job-lost");
    let (path, name) = (harness.path(), job.clone());
    let outcome = locks
        .run_exclusive(
            &job,
            Duration::from_secs(5),
            Duration::ZERO,
            |lost| async move {
                let conn = rusqlite::Connection::open(path).expect("open");
                conn.execute(
                    "UPDATE __distributed_locks SET owner = X'00' WHERE name = ?1",
                    [name.as_bytes()],
                )
                .expect("steal row");
                lost.cancelled().await;
            },
        )
        .await;
    assert!(
        matches!(outcome, Err(LockError::Lost { .. })),
        "{outcome:?}"
    );
}

/// `renew_every` sets the renewal cadence: with a 30 s lease renewed every 100 ms, the lease
/// the holder can count on stays near its four fifths (24 s) more than a second after the
/// acquisition. Renewed every third of the lease (10 s, the default), it could not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renew_every_sets_the_renewal_cadence() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!(
        "sqlite://{}/cadence.db?lease=30s&renew_every=100ms",
        dir.path().display()
    );
    let locks = LockProvider::connect(&url).await.unwrap();
    let guard = locks.try_acquire(&unique_key("cadence")).await.unwrap();
    let taken = Instant::now();
    dlock_testkit::wait_until(
        "a renewal moved the deadline after the first second",
        Duration::from_secs(5),
        async || {
            taken.elapsed() > Duration::from_millis(1200)
                && guard.remaining_lease().unwrap() > Duration::from_millis(23_500)
        },
    )
    .await;
    guard.release().await.unwrap();
}

#[tokio::test]
async fn fencing_tokens_survive_reopening_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}/fence.db", dir.path().display());
    let key = unique_key("fence");
    let first = {
        let locks = LockProvider::connect(&url).await.unwrap();
        let g = locks.try_acquire(&key).await.unwrap();
        let t = g.fencing_token().unwrap();
        g.release().await.unwrap();
        t
    };
    let locks = LockProvider::connect(&url).await.unwrap();
    let g = locks.try_acquire(&key).await.unwrap();
    assert!(g.fencing_token().unwrap() > first);
    g.release().await.unwrap();
}

#[tokio::test]
async fn lease_option_and_per_acquisition_lease() {
    let dir = tempfile::tempdir().unwrap();
    let backend = SqliteBackend::builder(dir.path().join("l.db"))
        .lease(Duration::from_secs(7))
        .open()
        .await
        .unwrap();
    assert_eq!(backend.lease(), Duration::from_secs(7));
    let locks = LockProvider::from_backend(backend);
    let key = unique_key("lease");
    let g = locks
        .lock(&key)
        .lease(Duration::from_secs(2))
        .try_acquire()
        .await
        .unwrap();
    // A lock with the default lease, taken just after: its lease ends 5 s later.
    let other = unique_key("lease-default");
    let d = locks.try_acquire(&other).await.unwrap();
    let conn = rusqlite::Connection::open(dir.path().join("l.db")).unwrap();
    let lease_end = |key: &str| -> i64 {
        conn.query_row(
            "SELECT lease_end FROM __distributed_locks WHERE name = ?1",
            [key.as_bytes()],
            |r| r.get(0),
        )
        .unwrap()
    };
    // 5 s apart, plus the time between the two acquisitions (minus the time since the 2 s
    // lease's renewal, if it came in between): 7 s and 2 s leases, not one lease for both.
    let apart = lease_end(&other) - lease_end(&key);
    assert!(
        (4_000..=6_000).contains(&apart),
        "lease ends {apart} ms apart"
    );
    g.release().await.unwrap();
    d.release().await.unwrap();
    assert!(matches!(
        locks
            .lock(&key)
            .lease(Duration::from_millis(1))
            .try_acquire()
            .await,
        Err(LockError::Config { .. })
    ));
}

#[tokio::test]
async fn bad_files_are_clear_errors_and_stay_untouched() {
    let dir = tempfile::tempdir().unwrap();
    // A directory.
    let err = LockProvider::connect(&format!("sqlite://{}", dir.path().display()))
        .await
        .unwrap_err();
    assert_eq!(err.code(), "DistributedLock.Configuration", "{err}");
    // A file in a directory that does not exist.
    let err = LockProvider::connect(&format!(
        "sqlite://{}/no/such/dir/l.db",
        dir.path().display()
    ))
    .await
    .unwrap_err();
    assert_eq!(err.code(), "DistributedLock.Configuration", "{err}");
    assert!(err.to_string().contains("cannot open"), "{err}");
    // A file that is not a database is reported and left exactly as it was.
    let junk = dir.path().join("notes.txt");
    let content = b"these are my notes, not a database\n".repeat(200);
    std::fs::write(&junk, &content).unwrap();
    let err = LockProvider::connect(&format!("sqlite://{}", junk.display()))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("not a SQLite database"), "{err}");
    assert_eq!(std::fs::read(&junk).unwrap(), content);
    assert!(!dir.path().join("notes.txt-wal").exists());
}

#[tokio::test]
async fn bad_urls_name_the_accepted_schemes() {
    for url in [
        "",
        "locks.db",
        "ftp://x",
        "sqlite://",
        "sqlite::memory:",
        "sqlite://x.db?lease=soon",
    ] {
        let err = LockProvider::connect(url).await.unwrap_err();
        assert_eq!(err.code(), "DistributedLock.Configuration", "{url}: {err}");
    }
    let err = LockProvider::connect("ftp://user:secret@host/")
        .await
        .unwrap_err();
    let message = err.to_string();
    assert!(
        message.contains("sqlite://") && message.contains("redis://"),
        "{message}"
    );
    assert!(
        !message.contains("secret"),
        "the URL's password leaked: {message}"
    );
}

#[test]
fn transaction_locks_end_with_their_transaction() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tx.db");
    let url = format!("sqlite://{}?busy_timeout=100ms", path.display());
    let locks = rt.block_on(LockProvider::connect(&url)).unwrap();
    let key = unique_key("tx");

    let mut conn = rusqlite::Connection::open(&path).unwrap();
    for finish in ["commit", "rollback"] {
        let tx = conn.transaction().unwrap();
        let lock = try_acquire_in_transaction(&tx, &key).unwrap();
        assert!(lock.fencing_token().expect("sqlite issues tokens") > 0);
        // While the transaction is open, a session lock on the key cannot be had.
        assert!(matches!(
            rt.block_on(locks.try_acquire(&key)),
            Err(LockError::AlreadyHeld { .. })
        ));
        match finish {
            "commit" => tx.commit().unwrap(),
            _ => tx.rollback().unwrap(),
        }
        let g = rt
            .block_on(locks.try_acquire(&key))
            .expect("free after {finish}");
        rt.block_on(g.release()).unwrap();
    }

    // A key held by a session lock cannot be taken in a transaction.
    let g = rt.block_on(locks.try_acquire(&key)).unwrap();
    let tx = conn.transaction().unwrap();
    assert!(matches!(
        try_acquire_in_transaction(&tx, &key),
        Err(LockError::AlreadyHeld { .. })
    ));
    let started = Instant::now();
    assert!(matches!(
        acquire_in_transaction(&tx, &key, Duration::from_millis(200)),
        Err(LockError::Timeout { .. })
    ));
    assert!(started.elapsed() >= Duration::from_millis(200));
    assert!(matches!(
        try_acquire_in_transaction(&tx, ""),
        Err(LockError::InvalidKey { .. })
    ));
    tx.rollback().unwrap();
    rt.block_on(g.release()).unwrap();
}

#[test]
fn renewal_restarts_on_a_new_runtime() {
    // A provider outlives the runtime it was first used on: its renewal task went with that
    // runtime, and the next acquisition on a new runtime must start it again.
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}/rt.db?lease=300ms", dir.path().display());
    let first = tokio::runtime::Runtime::new().unwrap();
    let locks = first.block_on(LockProvider::connect(&url)).unwrap();
    first.block_on(async {
        let g = locks.try_acquire("rt:first").await.unwrap();
        g.release().await.unwrap();
    });
    drop(first);

    let second = tokio::runtime::Runtime::new().unwrap();
    second.block_on(async {
        let other = LockProvider::connect(&url).await.unwrap();
        let guard = locks.try_acquire("rt:second").await.unwrap();
        // Three leases later the lock is still held and not lost: renewals ran.
        let outcome = other
            .acquire("rt:second", Duration::from_millis(1000))
            .await;
        assert!(
            matches!(outcome, Err(LockError::Timeout { .. })),
            "{outcome:?}"
        );
        assert!(!guard.is_lost());
        guard.release().await.unwrap();
    });
}

/// A guard taken on one runtime and dropped on another after the first is gone: its runtime
/// refuses the release, which then runs on the runtime it is dropped on, so the key is free at
/// once and not only when its lease runs out.
#[test]
fn a_guard_that_outlives_its_runtime_is_released_where_it_is_dropped() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}/moved.db?lease=30s", dir.path().display());
    let first = tokio::runtime::Runtime::new().unwrap();
    let locks = first.block_on(LockProvider::connect(&url)).unwrap();
    let guard = first.block_on(locks.try_acquire("moved")).unwrap();
    drop(first);

    let second = tokio::runtime::Runtime::new().unwrap();
    second.block_on(async {
        let other = LockProvider::connect(&url).await.unwrap();
        drop(guard);
        // Well inside the 30 s lease: only a release frees it this soon.
        let taken = other.acquire("moved", Duration::from_secs(5)).await;
        let taken = taken.expect("the dropped guard's release ran on this runtime");
        taken.release().await.unwrap();
    });
}

/// A small tmpfs of its own, unmounted on drop: a place that can fill up or turn read-only.
struct SmallDisk {
    dir: tempfile::TempDir,
}

impl SmallDisk {
    /// Never `None`: where mounting is not allowed the test fails as not run, whether `CI` is
    /// set or not.
    fn mount(size: &str) -> Option<SmallDisk> {
        let dir = tempfile::tempdir().unwrap();
        let mounted = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir.path())
            .status()
            .is_ok_and(|s| s.success());
        if !mounted {
            dlock_testkit::not_run(
                "cannot mount a tmpfs here",
                "run as root, as `bash .ci/run` does",
            );
        }
        Some(SmallDisk { dir })
    }

    fn path(&self) -> &std::path::Path {
        self.dir.path()
    }

    fn remount(&self, options: &str) {
        let status = std::process::Command::new("mount")
            .args(["-o", &format!("remount,{options}")])
            .arg(self.dir.path())
            .status()
            .unwrap();
        assert!(status.success(), "remount {options}");
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(self.dir.path())
            .status();
    }
}

/// A full disk and a read-only file system: acquisitions get typed errors (no panic, no
/// hang), a lock taken before is still held and released normally, and once space is back
/// the file works again with nothing lost (fencing tokens keep increasing).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_and_read_only_disks_are_errors_and_lose_nothing() {
    let Some(disk) = SmallDisk::mount("2m") else {
        return;
    };
    let url = format!("sqlite://{}/locks.db", disk.path().display());
    let locks = LockProvider::connect(&url).await.unwrap();
    let held = locks.try_acquire("jobs:held").await.unwrap();
    let first = held.fencing_token().unwrap();
    // Many distinct keys so that the file must grow.
    let mut keys = (0..).map(|i| format!("fill:{i}:{}", "x".repeat(512)));

    // Fill the disk to the last byte.
    let filler = disk.path().join("filler");
    let mut file = std::fs::File::create(&filler).unwrap();
    let block = vec![0u8; 64 * 1024];
    while std::io::Write::write_all(&mut file, &block).is_ok() {}
    while std::io::Write::write_all(&mut file, &block[..512]).is_ok() {}
    drop(file);
    // Held locks are rows that stay, so the file must grow until there is no room.
    let mut guards = Vec::new();
    let mut refused = None;
    for _ in 0..5_000 {
        let key = keys.next().unwrap();
        let started = Instant::now();
        match tokio::time::timeout(Duration::from_secs(10), locks.try_acquire(&key)).await {
            Ok(Ok(guard)) => guards.push(guard),
            Ok(Err(err)) => {
                assert!(started.elapsed() < Duration::from_secs(5));
                refused = Some(err);
                break;
            }
            Err(_) => panic!("an acquisition on a full disk hung"),
        }
    }
    let err = refused.expect("a full disk refuses new lock rows");
    eprintln!(
        "{} locks taken before the disk refused: {err}",
        guards.len()
    );
    assert!(
        matches!(
            err.code(),
            "DistributedLock.Backend" | "DistributedLock.Unavailable"
        ),
        "{err}"
    );
    assert!(!held.is_lost(), "the lock held before is not lost");

    // Space back: everything works, the locks held before still exclude others.
    std::fs::remove_file(&filler).unwrap();
    assert!(guards.iter().all(|g| !g.is_lost()), "no lock was lost");
    for guard in guards {
        guard.release().await.unwrap();
    }
    let other = LockProvider::connect(&url).await.unwrap();
    assert!(matches!(
        other.try_acquire("jobs:held").await,
        Err(LockError::AlreadyHeld { .. })
    ));
    held.release().await.unwrap();

    // Read-only (remounting needs every writer closed): opening the file or taking a lock is
    // an error, not a panic or a hang.
    drop((locks, other));
    disk.remount("ro");
    let started = Instant::now();
    let outcome = tokio::time::timeout(Duration::from_secs(10), async {
        let locks = LockProvider::connect(&url).await?;
        locks.try_acquire("jobs:held").await.map(drop)
    })
    .await
    .expect("no hang on a read-only file system");
    let err = outcome.expect_err("a read-only file takes no lock");
    assert!(started.elapsed() < Duration::from_secs(5));
    assert!(
        matches!(
            err.code(),
            "DistributedLock.Backend"
                | "DistributedLock.Unavailable"
                | "DistributedLock.Configuration"
        ),
        "{err}"
    );
    disk.remount("rw");
    let other = LockProvider::connect(&url).await.unwrap();
    let again = other.try_acquire("jobs:held").await.unwrap();
    assert!(
        again.fencing_token().unwrap() > first,
        "tokens keep increasing"
    );
    again.release().await.unwrap();
}

// ---------------------------------------------------------------------------------------------
// Fencing tokens are never issued twice (issue 14, class 5).

/// A transaction-bound lock whose transaction rolls back has still handed out its token: no
/// later holder, session or transaction, may get it again.
#[test]
fn tokens_of_rolled_back_transaction_locks_are_never_issued_again() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tx.db");
    let url = format!("sqlite://{}?busy_timeout=100ms", path.display());
    let locks = rt.block_on(LockProvider::connect(&url)).unwrap();
    let key = unique_key("tx-token");
    let mut conn = rusqlite::Connection::open(&path).unwrap();
    // A session lock first: the provider has looked for the `-fencing` file (not there yet)
    // just before the transaction-bound lock creates it.
    let g = rt.block_on(locks.try_acquire(&key)).unwrap();
    let mut issued = vec![g.fencing_token().unwrap()];
    rt.block_on(g.release()).unwrap();

    for round in 0..3 {
        let tx = conn.transaction().unwrap();
        issued.push(
            try_acquire_in_transaction(&tx, &key)
                .unwrap()
                .fencing_token()
                .expect("sqlite issues tokens"),
        );
        tx.rollback().unwrap();
        if round == 1 {
            // Two rolled-back transaction locks in a row.
            continue;
        }
        let g = rt.block_on(locks.try_acquire(&key)).unwrap();
        issued.push(g.fencing_token().unwrap());
        rt.block_on(g.release()).unwrap();
    }
    let tx = conn.transaction().unwrap();
    issued.push(
        try_acquire_in_transaction(&tx, &key)
            .unwrap()
            .fencing_token()
            .expect("sqlite issues tokens"),
    );
    tx.commit().unwrap();
    let g = rt.block_on(locks.try_acquire(&key)).unwrap();
    issued.push(g.fencing_token().unwrap());
    rt.block_on(g.release()).unwrap();

    assert!(
        issued.windows(2).all(|w| w[0] < w[1]),
        "tokens in the order they were handed out: {issued:?}"
    );
    // The tokens survive reopening the file.
    drop(locks);
    let locks = rt.block_on(LockProvider::connect(&url)).unwrap();
    let g = rt.block_on(locks.try_acquire(&key)).unwrap();
    assert!(g.fencing_token().unwrap() > *issued.last().unwrap());
    rt.block_on(g.release()).unwrap();
}

/// The lock file named through a symbolic link (another path, another process's URL) is the
/// same locks and the same fencing tokens: a transaction-bound lock taken through the link
/// and rolled back records its token where session acquisitions through the real path look
/// (SQLite resolves the link, and the `-fencing` file is named after the resolved file), so
/// the next token is larger.
#[cfg(unix)]
#[test]
fn a_lock_file_named_through_a_link_keeps_its_tokens() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("real.db");
    let link = dir.path().join("link.db");
    let locks = rt
        .block_on(LockProvider::connect(&format!(
            "sqlite://{}",
            path.display()
        )))
        .unwrap();
    std::os::unix::fs::symlink(&path, &link).unwrap();
    let through_link = rt
        .block_on(LockProvider::connect(&format!(
            "sqlite://{}",
            link.display()
        )))
        .unwrap();
    let key = unique_key("linked");
    let g = rt.block_on(locks.try_acquire(&key)).unwrap();
    let mut issued = vec![g.fencing_token().unwrap()];
    assert!(matches!(
        rt.block_on(through_link.try_acquire(&key)),
        Err(LockError::AlreadyHeld { .. })
    ));
    rt.block_on(g.release()).unwrap();
    for _ in 0..2 {
        let mut conn = rusqlite::Connection::open(&link).unwrap();
        let tx = conn.transaction().unwrap();
        issued.push(
            try_acquire_in_transaction(&tx, &key)
                .unwrap()
                .fencing_token()
                .unwrap(),
        );
        tx.rollback().unwrap();
        for provider in [&locks, &through_link] {
            let g = rt.block_on(provider.try_acquire(&key)).unwrap();
            issued.push(g.fencing_token().unwrap());
            rt.block_on(g.release()).unwrap();
        }
    }
    assert!(
        issued.windows(2).all(|w| w[0] < w[1]),
        "tokens in the order they were handed out: {issued:?}"
    );
    assert!(!dir.path().join("link.db-fencing").exists());
}

/// A process killed while its transaction-bound lock is held (the transaction never commits)
/// has handed out its token: the next holder gets a larger one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_of_a_killed_transaction_holder_are_never_issued_again() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("killed-tx.db");
    let url = format!("sqlite://{}", path.display());
    let locks = LockProvider::connect(&url).await.unwrap();
    let key = unique_key("killed-tx");
    let before = locks.try_acquire(&key).await.unwrap();
    let first = before.fencing_token().unwrap();
    before.release().await.unwrap();

    for _ in 0..3 {
        let mut child = Worker::spawn(&["tx-hold", path.to_str().unwrap(), &key], &[]);
        let held: u64 = child
            .line(Duration::from_secs(30))
            .strip_prefix("held ")
            .expect("the child holds the transaction lock")
            .parse()
            .unwrap();
        assert!(held > first);
        child.kill();
        let g = locks
            .acquire(&key, Duration::from_secs(10))
            .await
            .expect("free once the holder's transaction is gone");
        let next = g.fencing_token().unwrap();
        g.release().await.unwrap();
        assert!(
            next > held,
            "token {next} after the killed transaction holder's {held}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Leases on a clock that does not step (issue 14, class 6).

/// A child process of `dlock-worker`, with its stdout lines read by a thread.
struct Worker {
    child: std::process::Child,
    lines: std::sync::mpsc::Receiver<String>,
}

impl Worker {
    fn spawn(args: &[&str], env: &[(&str, &str)]) -> Worker {
        use std::io::BufRead;
        let mut child = std::process::Command::new(support::worker_bin())
            .args(args)
            .envs(env.iter().copied())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::inherit())
            .spawn()
            .expect("spawn the worker");
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Worker { child, lines }
    }

    fn line(&self, limit: Duration) -> String {
        self.lines
            .recv_timeout(limit)
            .expect("the worker says something in time")
    }

    fn kill(&mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }

    fn wait(mut self) -> std::process::ExitStatus {
        self.child.wait().unwrap()
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The environment that runs a child with its wall clock stepped by `offset` (libfaketime's
/// syntax: `+1h`, `-2d`), as an NTP step would, leaving the monotonic clocks alone. Never
/// `None`: where libfaketime is not installed the test fails as not run, whether `CI` is set
/// or not.
fn stepped_clock(offset: &str) -> Option<Vec<(&'static str, String)>> {
    let library = [
        "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1",
        "/usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1",
        "/usr/lib/faketime/libfaketime.so.1",
    ]
    .into_iter()
    .find(|p| std::path::Path::new(p).exists());
    let Some(library) = library else {
        dlock_testkit::not_run(
            "no libfaketime here",
            "install the Debian package `faketime`; `bash .ci/run` does",
        );
    };
    Some(vec![
        ("LD_PRELOAD", library.to_owned()),
        ("FAKETIME", offset.to_owned()),
        ("DONT_FAKE_MONOTONIC", "1".to_owned()),
    ])
}

/// The model of an NTP step is sound: under it, the wall clock moves and the monotonic clock
/// does not (checked with `date`, a plain libc program).
#[test]
fn the_stepped_clock_moves_the_wall_clock() {
    let Some(env) = stepped_clock("+1d") else {
        return;
    };
    let faked = std::process::Command::new("date")
        .arg("+%s")
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .output()
        .unwrap();
    let faked: i64 = String::from_utf8_lossy(&faked.stdout)
        .trim()
        .parse()
        .unwrap();
    let real = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    assert!(
        (faked - real - 86_400).abs() <= 5,
        "faked {faked}, real {real}"
    );
}

/// Another process whose wall clock stepped an hour ahead sees a lock whose holder keeps
/// renewing it as held, for several leases.
#[test]
fn a_peer_whose_clock_stepped_ahead_cannot_take_a_renewed_lock() {
    let Some(env) = stepped_clock("+1h") else {
        return;
    };
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}/step.db?lease=1s", dir.path().display());
    let key = unique_key("stepped-peer");
    let holder = Holder::start(&url, &key);
    // 2.5 leases of trying.
    let peer = Worker::spawn(&["take", &url, &key, "2500"], &env);
    let said = peer.line(Duration::from_secs(30));
    assert!(peer.wait().success());
    assert_eq!(
        said, "timeout",
        "a peer with its clock an hour ahead took a lock whose holder was renewing it"
    );
    assert!(
        holder.lost_within(Duration::ZERO).is_none(),
        "the holder kept its lock"
    );
}

/// A holder whose wall clock stepped an hour ahead (so, to the others, a clock an hour
/// behind), SIGKILLed: its lock is free when its lease ends, not an hour later, and not
/// before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_holder_whose_clock_stepped_frees_its_lock_when_its_lease_ends() {
    let Some(env) = stepped_clock("+1h") else {
        return;
    };
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}/step-kill.db?lease=1s", dir.path().display());
    let key = unique_key("stepped-holder");
    let mut holder = Worker::spawn(&["hold", &url, &key], &env);
    let first: u64 = holder
        .line(Duration::from_secs(30))
        .strip_prefix("held ")
        .expect("the holder holds the lock")
        .parse()
        .unwrap();
    let locks = LockProvider::connect(&url).await.unwrap();
    holder.kill();
    freed_when_the_lease_ends(&locks, &key, Instant::now(), first).await;
}

/// A release that finds the row taken over or removed reports the loss (the lost token fires
/// and the release is `Lost`), and leaves the new owner's row alone.
#[tokio::test]
async fn a_release_after_a_takeover_is_lost() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("takeover.db");
    let locks = LockProvider::connect(&format!("sqlite://{}", path.display()))
        .await
        .unwrap();
    let conn = rusqlite::Connection::open(&path).unwrap();
    for how in [
        "UPDATE __distributed_locks SET owner = X'00' WHERE name = ?1",
        "DELETE FROM __distributed_locks WHERE name = ?1",
    ] {
        let key = unique_key("takeover");
        let guard = locks.try_acquire(&key).await.unwrap();
        let lost = guard.lost_token().clone();
        assert_eq!(conn.execute(how, [key.as_bytes()]).unwrap(), 1);
        // The lease is 30 s: no renewal has looked at the row yet.
        assert!(!lost.is_cancelled());
        let outcome = guard.release().await;
        assert!(
            matches!(outcome, Err(LockError::Lost { .. })),
            "{how}: {outcome:?}"
        );
        assert!(lost.is_cancelled(), "the loss fired the lost token");
    }
    let owner: Vec<u8> = conn
        .query_row(
            "SELECT owner FROM __distributed_locks WHERE owner IS NOT NULL",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(owner, vec![0], "the new owner's row was left alone");
}

/// Rows written during another boot of the machine count as expired, whatever their lease.
#[tokio::test]
async fn locks_of_an_earlier_boot_are_free() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("boot.db");
    let url = format!("sqlite://{}", path.display());
    let (a, b) = (
        LockProvider::connect(&url).await.unwrap(),
        LockProvider::connect(&url).await.unwrap(),
    );
    let key = unique_key("boot");
    let guard = a.try_acquire(&key).await.unwrap();
    let first = guard.fencing_token().unwrap();
    let conn = rusqlite::Connection::open(&path).unwrap();
    // The same row, as a holder would have left it before a reboot, with a lease far ahead.
    conn.execute(
        "UPDATE __distributed_locks SET boot = X'00112233445566778899AABBCCDDEEFF', \
         lease_end = lease_end + 86400000 WHERE name = ?1",
        [key.as_bytes()],
    )
    .unwrap();
    let taken = b
        .try_acquire(&key)
        .await
        .expect("a lock of another boot is free");
    assert!(taken.fencing_token().unwrap() > first);
    assert!(matches!(guard.release().await, Err(LockError::Lost { .. })));
    taken.release().await.unwrap();
}

/// The statement of the earlier, wall-clock version, as its processes still run it.
const EARLIER_ACQUIRE_SQL: &str = "INSERT INTO __distributed_locks (name, owner, expires_at, fencing) \
    VALUES (?1, ?2, ?3, 1) \
    ON CONFLICT (name) DO UPDATE SET owner = excluded.owner, expires_at = excluded.expires_at, \
    fencing = __distributed_locks.fencing + 1 \
    WHERE __distributed_locks.owner IS NULL OR __distributed_locks.expires_at <= ?4 \
    RETURNING fencing";

/// A lock file of the earlier version is converted in place: fencing counters go on, a lock
/// held then keeps the rest of its lease, an expired one is free, and the earlier version's
/// statements fail on the converted file instead of misreading it.
#[tokio::test]
async fn a_lock_file_of_the_earlier_version_is_converted_in_place() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("earlier.db");
    let wall_now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    {
        let conn = rusqlite::Connection::open(&path).unwrap();
        conn.query_row("PRAGMA journal_mode = WAL", [], |_| Ok(()))
            .unwrap();
        conn.execute_batch(
            "CREATE TABLE __distributed_locks (name BLOB NOT NULL PRIMARY KEY, owner BLOB, \
             expires_at INTEGER NOT NULL DEFAULT 0, fencing INTEGER NOT NULL DEFAULT 0) WITHOUT ROWID",
        )
        .unwrap();
        let mut insert = conn
            .prepare("INSERT INTO __distributed_locks VALUES (?1, ?2, ?3, ?4)")
            .unwrap();
        insert
            .execute(rusqlite::params![
                b"old:free".as_slice(),
                None::<Vec<u8>>,
                0,
                41
            ])
            .unwrap();
        insert
            .execute(rusqlite::params![
                b"old:held".as_slice(),
                vec![1u8; 16],
                wall_now + 60_000,
                7
            ])
            .unwrap();
        insert
            .execute(rusqlite::params![
                b"old:expired".as_slice(),
                vec![2u8; 16],
                wall_now - 1_000,
                12
            ])
            .unwrap();
    }
    let locks = LockProvider::connect(&format!("sqlite://{}", path.display()))
        .await
        .unwrap();
    let free = locks.try_acquire("old:free").await.unwrap();
    assert_eq!(free.fencing_token(), Some(42));
    let expired = locks.try_acquire("old:expired").await.unwrap();
    assert_eq!(expired.fencing_token(), Some(13));
    assert!(matches!(
        locks.try_acquire("old:held").await,
        Err(LockError::AlreadyHeld { .. })
    ));
    // The held lock kept what was left of its lease: about 60 s, 30 s more than a lock taken
    // now with the default lease.
    let conn = rusqlite::Connection::open(&path).unwrap();
    let lease_end = |key: &str| -> i64 {
        conn.query_row(
            "SELECT lease_end FROM __distributed_locks WHERE name = ?1",
            [key.as_bytes()],
            |r| r.get(0),
        )
        .unwrap()
    };
    let more = lease_end("old:held") - lease_end("old:free");
    assert!((28_000..=30_500).contains(&more), "{more} ms");
    // A process of the earlier version gets an error, not a lock.
    let err = conn
        .query_row(
            EARLIER_ACQUIRE_SQL,
            rusqlite::params![
                b"old:free".as_slice(),
                vec![3u8; 16],
                wall_now + 30_000,
                wall_now
            ],
            |r| r.get::<_, i64>(0),
        )
        .unwrap_err();
    assert!(err.to_string().contains("expires_at"), "{err}");
    free.release().await.unwrap();
    expired.release().await.unwrap();
}

// ---------------------------------------------------------------------------------------------
// Bounds of durations (issue 14, class 3).

/// Leases and busy timeouts out of bounds are `Config` errors naming the bound, from every
/// input path; the largest accepted ones work; a refused acquisition strands nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn durations_out_of_bounds_are_config_errors_on_every_path() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bounds.db");
    let config = |outcome: Result<(), LockError>, names: &[&str]| {
        let err = outcome.expect_err("refused");
        let message = err.to_string();
        assert_eq!(err.code(), "DistributedLock.Configuration", "{message}");
        for name in names {
            assert!(message.contains(name), "`{name}` in: {message}");
        }
    };
    // URL.
    for (option, names) in [
        ("lease=8761h", &["lease", "365 days"][..]),
        ("lease=99ms", &["lease", "at least 100ms"][..]),
        ("busy_timeout=8761h", &["busy_timeout", "365 days"][..]),
    ] {
        let url = format!("sqlite://{}?{option}", path.display());
        config(LockProvider::connect(&url).await.map(drop), names);
    }
    // Builder.
    config(
        SqliteBackend::builder(&path)
            .lease(Duration::MAX)
            .open()
            .await
            .map(drop),
        &["lease", "365 days"],
    );
    config(
        SqliteBackend::builder(&path)
            .busy_timeout(Duration::MAX)
            .open()
            .await
            .map(drop),
        &["busy_timeout", "365 days"],
    );
    // Per acquisition.
    let locks = LockProvider::connect(&format!("sqlite://{}?busy_timeout=720h", path.display()))
        .await
        .expect("a busy timeout longer than SQLite's own limit (24.8 days) is accepted");
    let key = unique_key("bounds");
    config(
        locks
            .lock(&key)
            .lease(Duration::MAX)
            .try_acquire()
            .await
            .map(drop),
        &["lease", "365 days"],
    );
    let other = LockProvider::connect(&format!("sqlite://{}", path.display()))
        .await
        .unwrap();
    let g = other
        .try_acquire(&key)
        .await
        .expect("a refused acquisition strands nothing");
    g.release().await.unwrap();
    // The longest lease accepted works end to end.
    let g = locks
        .lock(&key)
        .lease(Duration::from_secs(365 * 86_400))
        .try_acquire()
        .await
        .unwrap();
    assert!(matches!(
        other.try_acquire(&key).await,
        Err(LockError::AlreadyHeld { .. })
    ));
    g.release().await.unwrap();
    other
        .try_acquire(&key)
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
}

// ---------------------------------------------------------------------------------------------
// Renewal owned by no runtime of the application (issue 14, class 4).

/// The runtime of the first acquisition is dropped while a lock taken on a second runtime is
/// held: the lock keeps being renewed, so no other provider can take it, and it is not lost.
#[test]
fn dropping_the_first_runtime_stops_no_renewal() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}/rt2.db?lease=300ms", dir.path().display());
    let first = tokio::runtime::Runtime::new().unwrap();
    let locks = first.block_on(LockProvider::connect(&url)).unwrap();
    first.block_on(async {
        let g = locks.try_acquire("rt2:first").await.unwrap();
        g.release().await.unwrap();
    });
    let second = tokio::runtime::Runtime::new().unwrap();
    let guard = second.block_on(locks.try_acquire("rt2:second")).unwrap();
    drop(first);
    second.block_on(async {
        let other = LockProvider::connect(&url).await.unwrap();
        // Four leases.
        match other
            .acquire("rt2:second", Duration::from_millis(1200))
            .await
        {
            Err(LockError::Timeout { .. }) => {}
            Ok(taken) => panic!(
                "another provider took the key (token {:?}) while its guard {}",
                taken.fencing_token(),
                if guard.is_lost() {
                    "had been told it was lost"
                } else {
                    "still believed it held it"
                }
            ),
            Err(err) => panic!("{err}"),
        }
        assert!(!guard.is_lost());
        guard.release().await.unwrap();
    });
}

// ---------------------------------------------------------------------------------------------
// Sustained contention (issue 14, class 8).

/// A poll of a key that someone holds is answered by a read: it does not wait for the file's
/// write lock (here kept by another connection for longer than the test).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poll_of_a_held_key_does_not_wait_for_the_write_lock() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("peek.db");
    let url = format!("sqlite://{}?busy_timeout=5s", path.display());
    let (a, b) = (
        LockProvider::connect(&url).await.unwrap(),
        LockProvider::connect(&url).await.unwrap(),
    );
    let key = unique_key("peek");
    let guard = a.try_acquire(&key).await.unwrap();
    let mut writer = rusqlite::Connection::open(&path).unwrap();
    let tx = writer
        .transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)
        .unwrap();
    let started = Instant::now();
    let outcome = b.try_acquire(&key).await;
    let took = started.elapsed();
    eprintln!("a poll of a held key answered in {took:?} while the write lock was taken");
    assert!(
        matches!(outcome, Err(LockError::AlreadyHeld { .. })),
        "{outcome:?}"
    );
    assert!(
        took < Duration::from_secs(1),
        "the poll took {took:?}: it waited for the write lock"
    );
    tx.rollback().unwrap();
    guard.release().await.unwrap();
}

/// A release that has to wait (the file was busy, then its runtime got no chance to run it
/// for three leases) keeps the lock renewed until it runs: nobody else takes the key
/// meanwhile, and the release succeeds.
#[test]
fn a_delayed_release_keeps_its_lock_renewed() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("slow-release.db");
    let url = format!("sqlite://{}?lease=300ms", path.display());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let locks = rt.block_on(LockProvider::connect(&url)).unwrap();
    let key = unique_key("slow-release");
    let guard = rt.block_on(locks.try_acquire(&key)).unwrap();
    // The file is busy: the release's first try fails, and it waits to try again.
    let mut writer = rusqlite::Connection::open(&path).unwrap();
    let tx = writer
        .transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)
        .unwrap();
    let mut release = Box::pin(guard.release());
    let first = rt.block_on(async { futures::poll!(release.as_mut()) });
    assert!(first.is_pending(), "the release waits for the file");
    tx.rollback().unwrap();
    // The runtime's only thread is busy for 1 s (three leases); another process tries to
    // take the key all along.
    let taker = std::thread::spawn({
        let (url, key) = (url.clone(), key.clone());
        move || {
            let rt = tokio::runtime::Runtime::new().unwrap();
            rt.block_on(async {
                let other = LockProvider::connect(&url).await.unwrap();
                let until = Instant::now() + Duration::from_secs(1);
                while Instant::now() < until {
                    if let Ok(taken) = other.try_acquire(&key).await {
                        return Some(taken.fencing_token());
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                None
            })
        }
    });
    std::thread::sleep(Duration::from_secs(1));
    let taken = taker.join().unwrap();
    assert_eq!(taken, None, "the key was taken while its release waited");
    let outcome = rt.block_on(release);
    assert!(outcome.is_ok(), "{outcome:?}");
}

// Read locks: each reader's own lease, and what breaks it.

/// A reader's provider on a fresh file with a 900 ms lease, and the file's path.
async fn read_file() -> (tempfile::TempDir, String, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("rw.db");
    let url = format!("sqlite://{}?lease={}ms", path.display(), LEASE.as_millis());
    (dir, url, path)
}

/// A reader whose renewals stopped (a holder paused or gone) keeps a writer out only until its
/// lease ends, and hears that it lost its share.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_reader_blocks_a_writer_only_until_its_lease_ends() {
    let (_dir, url, _) = read_file().await;
    let (a, b) = (
        LockProvider::connect(&url).await.unwrap(),
        LockProvider::connect(&url).await.unwrap(),
    );
    let key = unique_key("rw-expired");
    let reader = a.try_acquire_read(&key).await.unwrap();
    let taken = Instant::now();
    reader.stop_renewal().unwrap();
    assert!(matches!(
        b.try_acquire(&key).await,
        Err(LockError::AlreadyHeld { .. })
    ));
    let writer = b.acquire(&key, Duration::from_secs(10)).await.unwrap();
    let waited = taken.elapsed();
    assert!(
        waited >= LEASE * 4 / 5,
        "a writer got in after {waited:?}, inside the reader's lease"
    );
    assert!(
        waited <= LEASE + Duration::from_secs(2),
        "the expired reader kept the writer out {waited:?}"
    );
    assert!(reader.is_lost());
    assert!(!reader.verify_still_held().await.unwrap());
    assert!(matches!(
        reader.release().await,
        Err(LockError::Lost { .. })
    ));
    writer.release().await.unwrap();
}

/// A reader's share taken away behind its back (its row removed or its lease cut short) is
/// reported lost by the next renewal, and its release says so; the other readers keep theirs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_whose_share_is_taken_away_learns_it() {
    let (_dir, url, path) = read_file().await;
    let a = LockProvider::connect(&url).await.unwrap();
    let key = unique_key("rw-stolen");
    let victim = a.try_acquire_read(&key).await.unwrap();
    let other = a.try_acquire_read(&key).await.unwrap();
    let conn = rusqlite::Connection::open(&path).unwrap();
    let owners: Vec<Vec<u8>> = conn
        .prepare("SELECT owner FROM __distributed_lock_readers WHERE name = ?1")
        .unwrap()
        .query_map([key.as_bytes()], |row| row.get(0))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    assert_eq!(owners.len(), 2, "one row per reader");
    let cut = conn
        .execute(
            "UPDATE __distributed_lock_readers SET lease_end = 0 WHERE name = ?1 AND owner = ?2",
            rusqlite::params![key.as_bytes(), owners[0]],
        )
        .unwrap();
    assert_eq!(cut, 1);
    let lost = tokio::time::timeout(LEASE / 3 + Duration::from_secs(1), async {
        tokio::select! {
            () = victim.lost_token().cancelled() => 0,
            () = other.lost_token().cancelled() => 1,
        }
    })
    .await
    .expect("the renewal finds the share gone");
    let (lost, kept) = if lost == 0 {
        (victim, other)
    } else {
        (other, victim)
    };
    assert!(lost.is_lost() && !kept.is_lost());
    assert!(kept.verify_still_held().await.unwrap());
    assert!(matches!(lost.release().await, Err(LockError::Lost { .. })));
    // The share left still keeps writers out, and its release frees the key.
    assert!(matches!(
        a.try_acquire(&key).await,
        Err(LockError::AlreadyHeld { .. })
    ));
    kept.release().await.unwrap();
    a.try_acquire(&key).await.unwrap().release().await.unwrap();
}

/// A reader process SIGKILLed frees the key when its lease ends; a writer's token is above the
/// reader's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_reader_frees_the_key_when_its_lease_ends() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}/kill-read.db?lease=1s", dir.path().display());
    let key = unique_key("killed-reader");
    let holder = Holder::start_read(&url, &key);
    let first_token = holder.fencing_token.expect("sqlite issues tokens");
    let locks = LockProvider::connect(&url).await.unwrap();
    // Readers share with it; writers wait.
    locks
        .try_acquire_read(&key)
        .await
        .expect("a reader shares with the child")
        .release()
        .await
        .unwrap();
    assert!(matches!(
        locks.try_acquire(&key).await,
        Err(LockError::AlreadyHeld { .. })
    ));
    holder.kill();
    freed_when_the_lease_ends(&locks, &key, Instant::now(), first_token).await;
}

/// The exclusive statement of the release before read locks existed (the same text as today's,
/// run here by hand) finds a key held by readers held until the latest reader's lease end, and
/// takes it only after that.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn earlier_versions_exclusive_acquisitions_are_excluded_by_readers() {
    const EARLIER_ACQUIRE: &str = "INSERT INTO main.__distributed_locks (name, owner, lease_end, fencing, boot) \
        VALUES (?1, ?2, ?3, 1, ?5) \
        ON CONFLICT (name) DO UPDATE SET owner = excluded.owner, lease_end = excluded.lease_end, \
        boot = excluded.boot, fencing = __distributed_locks.fencing + 1 \
        WHERE __distributed_locks.owner IS NULL OR __distributed_locks.boot IS NOT excluded.boot \
        OR __distributed_locks.lease_end <= ?4 \
        RETURNING fencing";
    let (_dir, url, path) = read_file().await;
    let a = LockProvider::connect(&url).await.unwrap();
    let key = unique_key("rw-earlier");
    let first = a.try_acquire_read(&key).await.unwrap();
    let second = a.try_acquire_read(&key).await.unwrap();
    let conn = rusqlite::Connection::open(&path).unwrap();
    let (latest, boot): (i64, Vec<u8>) = conn
        .query_row(
            "SELECT max(lease_end), boot FROM __distributed_lock_readers WHERE name = ?1",
            [key.as_bytes()],
            |row| Ok((row.get(0)?, row.get(1)?)),
        )
        .unwrap();
    let (owner, row_end): (Vec<u8>, i64) = conn
        .query_row(
            "SELECT owner, lease_end FROM __distributed_locks WHERE name = ?1",
            [key.as_bytes()],
            |row| Ok((row.get(0)?, row.get(1)?)),
        )
        .unwrap();
    assert!(owner.is_empty(), "readers hold the row by the empty owner");
    assert_eq!(row_end, latest, "until the latest reader's lease end");
    let earlier = |now: i64| -> Option<i64> {
        conn.query_row(
            EARLIER_ACQUIRE,
            rusqlite::params![key.as_bytes(), [7u8; 16], now + 1000, now, boot],
            |row| row.get(0),
        )
        .ok()
    };
    assert_eq!(
        earlier(latest - 1),
        None,
        "held while a reader's lease lasts"
    );
    first.release().await.unwrap();
    second.release().await.unwrap();
    // Once the readers are gone, the row is free at once.
    let (owner, end): (Option<Vec<u8>>, i64) = conn
        .query_row(
            "SELECT owner, lease_end FROM __distributed_locks WHERE name = ?1",
            [key.as_bytes()],
            |row| Ok((row.get(0)?, row.get(1)?)),
        )
        .unwrap();
    assert_eq!((owner, end), (None, 0));
    let token = earlier(latest - 1).expect("free after the readers left");
    // And the exclusive holder it made keeps readers out.
    assert!(matches!(
        a.try_acquire_read(&key).await,
        Err(LockError::AlreadyHeld { .. })
    ));
    assert!(token > 0);
}

/// Tokens of one key increase across readers and writers: each reader's above every earlier
/// writer's and reader's, each writer's above every earlier reader's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fencing_tokens_increase_across_readers_and_writers() {
    let (_dir, url, _) = read_file().await;
    let (a, b) = (
        LockProvider::connect(&url).await.unwrap(),
        LockProvider::connect(&url).await.unwrap(),
    );
    let key = unique_key("rw-fence");
    let mut last = 0;
    for _ in 0..3 {
        let w = a.try_acquire(&key).await.unwrap();
        let t = w.fencing_token().unwrap();
        assert!(t > last, "writer {t} after {last}");
        w.release().await.unwrap();
        let r1 = a.try_acquire_read(&key).await.unwrap();
        let r2 = b.try_acquire_read(&key).await.unwrap();
        let (t1, t2) = (r1.fencing_token().unwrap(), r2.fencing_token().unwrap());
        assert!(t1 > t && t2 > t1, "readers {t1}, {t2} after writer {t}");
        r1.release().await.unwrap();
        r2.release().await.unwrap();
        last = t2;
    }
}

/// A waiting writer holds back readers that come after it, while the reader already in keeps
/// its share; a writer that gave up stops holding them back soon after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_writer_holds_new_readers_back_and_lets_go_when_it_gives_up() {
    let (_dir, url, path) = read_file().await;
    let (a, b, w) = (
        LockProvider::connect(&url).await.unwrap(),
        LockProvider::connect(&url).await.unwrap(),
        LockProvider::connect(&url).await.unwrap(),
    );
    let key = unique_key("rw-intent");
    let first = a.try_acquire_read(&key).await.unwrap();
    // No intent from a single try.
    assert!(matches!(
        w.try_acquire(&key).await,
        Err(LockError::AlreadyHeld { .. })
    ));
    b.try_acquire_read(&key)
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    let writer = {
        let (w, key) = (w.clone(), key.clone());
        tokio::spawn(async move { w.acquire(&key, Duration::from_secs(20)).await })
    };
    let conn = rusqlite::Connection::open(&path).unwrap();
    let intent = || -> bool {
        conn.query_row(
            "SELECT count(*) FROM __distributed_lock_intents WHERE name = ?1",
            [key.as_bytes()],
            |row| row.get::<_, i64>(0),
        )
        .unwrap()
            > 0
    };
    dlock_testkit::wait_until(
        "the writer leaves its intent",
        Duration::from_secs(5),
        async || intent(),
    )
    .await;
    assert!(matches!(
        b.try_acquire_read(&key).await,
        Err(LockError::AlreadyHeld { .. })
    ));
    assert!(
        first.verify_still_held().await.unwrap(),
        "the reader in keeps its share"
    );
    first.release().await.unwrap();
    let held = tokio::time::timeout(Duration::from_secs(5), writer)
        .await
        .expect("the writer gets the key once the reader in leaves")
        .unwrap()
        .unwrap();
    assert!(
        !intent(),
        "the writer clears its intent once it holds the key"
    );
    held.release().await.unwrap();

    // A writer that gives up leaves an intent that lapses within its bound.
    let reader = a.try_acquire_read(&key).await.unwrap();
    assert!(matches!(
        w.acquire(&key, Duration::from_millis(300)).await,
        Err(LockError::Timeout { .. })
    ));
    let gave_up = Instant::now();
    let again = b
        .acquire_read(&key, Duration::from_secs(10))
        .await
        .expect("readers get in again after a writer gave up");
    assert!(
        gave_up.elapsed() < Duration::from_secs(5),
        "a writer that gave up held readers back {:?}",
        gave_up.elapsed()
    );
    again.release().await.unwrap();
    reader.release().await.unwrap();
}

/// Waiters queued in the file for `key`.
fn queued(path: &std::path::Path, key: &str) -> i64 {
    rusqlite::Connection::open(path)
        .unwrap()
        .query_row(
            "SELECT count(*) FROM __distributed_lock_waiters WHERE name = ?1",
            [key.as_bytes()],
            |row| row.get(0),
        )
        .unwrap()
}

/// Waits queue across processes: when the holder's process has a waiter of its own ready,
/// a waiter of another backend that began waiting first still gets the key first (without
/// the queue, the holder's own waiter tries at once and wins nearly every time, while the
/// other polls with backoff). Once served, the waiters leave the queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_elsewhere_that_came_first_goes_before_the_holders_own() {
    let (_dir, url, path) = read_file().await;
    let (home, away) = (
        LockProvider::connect(&url).await.unwrap(),
        LockProvider::connect(&url).await.unwrap(),
    );
    let key = unique_key("fair-queue");
    let held = home.try_acquire(&key).await.unwrap();
    let order = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let wait = |locks: LockProvider, who: &'static str| {
        let (key, order) = (key.clone(), std::sync::Arc::clone(&order));
        tokio::spawn(async move {
            let guard = locks.acquire(&key, Duration::from_secs(20)).await.unwrap();
            order.lock().unwrap().push(who);
            tokio::time::sleep(Duration::from_millis(50)).await;
            guard.release().await.unwrap();
        })
    };
    let first = wait(away.clone(), "away");
    dlock_testkit::wait_until(
        "the other backend's waiter joins the queue",
        Duration::from_secs(5),
        async || queued(&path, &key) == 1,
    )
    .await;
    // The holder's own waiter queues in its provider behind the held lock.
    let second = wait(home.clone(), "home");
    tokio::task::yield_now().await;
    held.release().await.unwrap();
    first.await.unwrap();
    second.await.unwrap();
    assert_eq!(*order.lock().unwrap(), ["away", "home"]);
    assert_eq!(
        queued(&path, &key),
        0,
        "a served waiter left its place behind"
    );
}

/// A waiter that gave up leaves its place in the queue, which holds later waiters back only
/// until it lapses (half a second): the key is not stranded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_that_gave_up_does_not_strand_the_key() {
    let (_dir, url, path) = read_file().await;
    let (a, b, c) = (
        LockProvider::connect(&url).await.unwrap(),
        LockProvider::connect(&url).await.unwrap(),
        LockProvider::connect(&url).await.unwrap(),
    );
    let key = unique_key("fair-gave-up");
    let held = a.try_acquire(&key).await.unwrap();
    assert!(matches!(
        b.acquire(&key, Duration::from_millis(100)).await,
        Err(LockError::Timeout { .. })
    ));
    assert_eq!(
        queued(&path, &key),
        1,
        "the waiter that gave up kept its place"
    );
    held.release().await.unwrap();
    // A single try does not queue: it takes the free key.
    c.try_acquire(&key).await.unwrap().release().await.unwrap();
    // A wait is held back by the lapsing place, then gets the key well within its timeout.
    let guard = c.acquire(&key, Duration::from_secs(3)).await.unwrap();
    guard.release().await.unwrap();
}
