//! The renewal driver against a throwaway Redis 7 server (the servers of
//! [`live_tests`](super::super::commands::live_tests)): due locks are renewed and their
//! deadlines move, a renewal that finds the key gone or taken is a loss at once, failed
//! renewals are tried again, overdue locks are lost at their deadline, removed locks are no
//! longer renewed, registrations wake the driver only when due earlier than planned, and a
//! driver that stops (its runtime shut down, its backend dropped) declares every lock lost.

use super::super::commands::live_tests::{Flavor, Server, get, pttl, token};
use super::*;

const MS: Duration = Duration::from_millis(1);

/// A backend on `server` with locks of `lease` and commands bounded by `timeout`.
async fn backend(server: &Server, lease: Duration, timeout: Duration) -> Arc<Shared> {
    Arc::new(Shared {
        conn: server.conn("").await,
        lease,
        prefix: b"t:".to_vec(),
        layout: crate::redis::KeyLayout::Tagged,
        fencing: false,
        counters: None,
        per_key: crate::redis::bounded::PerKey::new(b"t:", crate::redis::KeyLayout::Tagged),
        timeout,
        renew_every: None,
        wait: None,
        renewals: Arc::default(),
        intents: Default::default(),
        wakes: crate::redis::subscribers::Subscribers::One(Arc::new(
            crate::redis::wake::Wakes::new(None, timeout, None),
        )),
        hold_offs: Default::default(),
        settling: Default::default(),
        owner_label: crate::redis::owner::OwnerLabel::new().unwrap(),
    })
}

/// Makes `owner` the holder of `key` for `lease`, as an acquisition does.
async fn take(server: &Server, key: &[u8], owner: &str, lease: Duration) {
    let mut admin = server.admin().await;
    let () = redis::cmd("SET")
        .arg(key)
        .arg(owner)
        .arg("PX")
        .arg(u64::try_from(lease.as_millis()).unwrap())
        .query_async(&mut admin)
        .await
        .expect("SET");
}

/// Registers `key`, held by `owner`, taken with a command sent at `sent`.
fn register(
    shared: &Arc<Shared>,
    key: &[u8],
    owner: &str,
    lease: Duration,
    sent: Instant,
) -> (u64, LeaseDeadline, CancellationToken) {
    let lost = CancellationToken::new();
    let (id, deadline) = Renewals::register(
        shared,
        Kind::Lock,
        Arc::from(key),
        token(owner),
        lease,
        sent,
        lost.clone(),
        true,
    )
    .expect("registered");
    (id, deadline, lost)
}

/// Waits until `condition` holds; panics with `what` after `limit`.
async fn until(what: &str, limit: Duration, mut condition: impl FnMut() -> bool) {
    let end = Instant::now() + limit;
    while !condition() {
        assert!(Instant::now() < end, "timed out waiting until {what}");
        tokio::time::sleep(5 * MS).await;
    }
}

/// Waits for `lost` to fire; the instant it was seen fired, or `None` after `limit`.
async fn fired(lost: &CancellationToken, limit: Duration) -> Option<Instant> {
    tokio::time::timeout(limit, lost.cancelled())
        .await
        .ok()
        .map(|()| Instant::now())
}

fn entries(shared: &Shared) -> usize {
    shared.renewals.state().entries.len()
}

#[tokio::test]
async fn due_locks_are_renewed_and_their_deadline_moves() {
    let Some(server) = Server::start(Flavor::Redis7) else {
        return;
    };
    // Renewed every 200 ms, trusted for 480 ms; the key itself lives 600 ms per renewal.
    let lease = 600 * MS;
    let shared = backend(&server, lease, Duration::from_secs(2)).await;
    let sent = Instant::now();
    take(&server, b"k", "a", lease).await;
    let (id, deadline, lost) = register(&shared, b"k", "a", lease, sent);
    assert_eq!(deadline.at(), later(sent, 480 * MS));

    let first = deadline.at();
    until("the deadline moves", Duration::from_secs(5), || {
        deadline.at() > first
    })
    .await;
    // Measured from before the renewal was sent, at least a renewal period after the start.
    assert!(deadline.at() >= later(sent, 200 * MS + 480 * MS));
    assert!(deadline.at() <= later(Instant::now(), 480 * MS));

    // Three leases later the key is still held: it was renewed again and again.
    tokio::time::sleep(3 * lease).await;
    let mut admin = server.admin().await;
    assert_eq!(get(&mut admin, b"k").await.as_deref(), Some(&b"a"[..]));
    let ttl = pttl(&mut admin, b"k").await;
    assert!(
        ttl > 0 && ttl <= 600,
        "the renewal asks for the lease: {ttl}"
    );
    assert!(!lost.is_cancelled());
    assert!(!deadline.has_passed());
    assert!(deadline.at() > later(sent, 3 * lease));

    // Removed: no longer renewed, and not declared lost either.
    shared.renewals.remove(id);
    assert_eq!(entries(&shared), 0);
    until("the key expires", Duration::from_secs(5), || {
        deadline.has_passed()
    })
    .await;
    let end = Instant::now() + Duration::from_secs(5);
    while get(&mut admin, b"k").await.is_some() {
        assert!(Instant::now() < end, "a removed lock is still renewed");
        tokio::time::sleep(20 * MS).await;
    }
    assert!(!lost.is_cancelled(), "removal is not a loss");
}

#[tokio::test]
async fn a_renewal_that_finds_the_key_gone_or_taken_is_a_loss_at_once() {
    let Some(server) = Server::start(Flavor::Redis7) else {
        return;
    };
    // Renewed after 1 s, trusted for 2.4 s.
    let lease = Duration::from_secs(3);
    let shared = backend(&server, lease, Duration::from_secs(2)).await;
    let sent = Instant::now();
    take(&server, b"taken", "b", Duration::from_secs(30)).await;
    take(&server, b"held", "a", lease).await;
    let (_, taken_deadline, taken) = register(&shared, b"taken", "a", lease, sent);
    let (_, _, gone) = register(&shared, b"gone", "a", lease, sent);
    let (_, held_deadline, held) = register(&shared, b"held", "a", lease, sent);

    for (what, lost) in [("taken", &taken), ("gone", &gone)] {
        let at = fired(lost, Duration::from_secs(5))
            .await
            .unwrap_or_else(|| panic!("the {what} lock is never declared lost"));
        assert!(
            at >= later(sent, 1000 * MS),
            "{what}: not before its first renewal"
        );
        assert!(
            at < later(sent, 2200 * MS),
            "{what}: at the renewal, not at the deadline"
        );
    }
    assert!(!taken_deadline.has_passed(), "the deadline is not moved");
    until("the held lock is renewed", Duration::from_secs(5), || {
        held_deadline.at() > later(sent, 2400 * MS)
    })
    .await;
    assert!(!held.is_cancelled());
    assert_eq!(entries(&shared), 1, "the lost entries are gone");
    let mut admin = server.admin().await;
    assert_eq!(get(&mut admin, b"taken").await.as_deref(), Some(&b"b"[..]));
    assert_eq!(get(&mut admin, b"gone").await, None);
}

#[tokio::test]
async fn failed_renewals_are_tried_again_until_one_succeeds() {
    let Some(server) = Server::start(Flavor::Redis7) else {
        return;
    };
    // Renewed after 1 s, tried again 150 ms after a failure, trusted for 2.4 s; each command
    // fails after 200 ms without an answer.
    let lease = Duration::from_secs(3);
    let shared = backend(&server, lease, 200 * MS).await;
    let sent = Instant::now();
    take(&server, b"k", "a", Duration::from_secs(30)).await;
    let (_, deadline, lost) = register(&shared, b"k", "a", lease, sent);

    // The server answers nobody from 0.5 s to 1.5 s: the first renewal (at 1 s) fails, and so
    // may the first retry.
    tokio::time::sleep_until(later(sent, 500 * MS).into()).await;
    let mut admin = server.admin().await;
    let () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(1000)
        .arg("ALL")
        .query_async(&mut admin)
        .await
        .expect("CLIENT PAUSE");

    until("a renewal succeeds", Duration::from_secs(5), || {
        deadline.at() > later(sent, 2400 * MS) || lost.is_cancelled()
    })
    .await;
    assert!(
        !lost.is_cancelled(),
        "a retry succeeded before the deadline"
    );
    // The renewal that moved it was sent after the first one failed (1 s + 200 ms).
    assert!(
        deadline.at() >= later(sent, 1200 * MS + 2400 * MS),
        "{:?} after the start",
        deadline.at() - sent
    );
}

#[tokio::test]
async fn with_the_server_stopped_locks_are_lost_at_their_deadline() {
    let Some(server) = Server::start(Flavor::Redis7) else {
        return;
    };
    // Renewed after 200 ms, tried again every 30 ms, trusted for 480 ms.
    let lease = 600 * MS;
    let shared = backend(&server, lease, 100 * MS).await;
    let sent = Instant::now();
    take(&server, b"k", "a", lease).await;
    let (_, deadline, lost) = register(&shared, b"k", "a", lease, sent);
    drop(server);

    let at = fired(&lost, Duration::from_secs(5))
        .await
        .expect("declared lost");
    assert!(at >= later(sent, 480 * MS), "not before its deadline");
    assert_eq!(deadline.at(), later(sent, 480 * MS), "never renewed");
    assert!(
        at < later(sent, 480 * MS + 1000 * MS),
        "at its deadline: {:?} after the start",
        at - sent
    );
    assert_eq!(entries(&shared), 0);
}

#[tokio::test]
async fn registrations_wake_the_driver_only_when_due_earlier_than_planned() {
    let Some(server) = Server::start(Flavor::Redis7) else {
        return;
    };
    let long = Duration::from_secs(30);
    let shared = backend(&server, long, Duration::from_secs(2)).await;
    let planned = || shared.renewals.state().planned;

    let sent = Instant::now();
    take(&server, b"long", "a", long).await;
    let (_, _, long_lost) = register(&shared, b"long", "a", long, sent);
    assert_eq!(planned(), Some(later(sent, Duration::from_secs(10))));

    // Due earlier: planned for it, and the driver wakes to renew it in time.
    let short = 600 * MS;
    let short_sent = Instant::now();
    take(&server, b"short", "a", short).await;
    let (_, short_deadline, short_lost) = register(&shared, b"short", "a", short, short_sent);
    assert_eq!(planned(), Some(later(short_sent, 200 * MS)));
    until("the short lock is renewed", Duration::from_secs(5), || {
        short_deadline.at() > later(short_sent, 480 * MS)
    })
    .await;
    assert!(!short_lost.is_cancelled());

    // Due later than planned: the plan stays.
    let before = planned().expect("a plan");
    assert!(before <= later(Instant::now(), 200 * MS));
    let (_, _, _later_lost) = register(&shared, b"later", "a", long, Instant::now());
    assert_eq!(planned(), Some(before));
    assert!(!long_lost.is_cancelled());
}

#[test]
fn a_driver_stopped_with_its_runtime_declares_every_lock_lost() {
    let Some(server) = Server::start(Flavor::Redis7) else {
        return;
    };
    let lease = Duration::from_secs(30);
    let first = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let shared = first.block_on(backend(&server, lease, Duration::from_secs(2)));
    let (a, b) = first.block_on(async {
        let a = register(&shared, b"a", "a", lease, Instant::now());
        let b = register(&shared, b"b", "a", lease, Instant::now());
        // The driver runs: it has planned its wake-up.
        until("the driver runs", Duration::from_secs(5), || {
            shared.renewals.state().planned.is_some()
        })
        .await;
        (a, b)
    });
    assert!(!a.2.is_cancelled() && !b.2.is_cancelled());
    drop(first);
    assert!(
        a.2.is_cancelled() && b.2.is_cancelled(),
        "both lost at once"
    );
    assert_eq!(entries(&shared), 0);
    assert_eq!(shared.renewals.state().driver, None);

    // Outside a runtime a lock cannot be renewed.
    let err = Renewals::register(
        &shared,
        Kind::Lock,
        Arc::from(&b"c"[..]),
        token("a"),
        lease,
        Instant::now(),
        CancellationToken::new(),
        true,
    )
    .expect_err("no runtime");
    assert_eq!(err.code(), "DistributedLock.Configuration", "{err}");

    // The next registration starts a new driver on its own runtime.
    let second = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let c = second.block_on(async { register(&shared, b"c", "a", lease, Instant::now()) });
    assert_eq!(shared.renewals.state().driver, Some(1));
    assert_eq!(entries(&shared), 1);
    drop(second);
    assert!(c.2.is_cancelled());
}

#[tokio::test]
async fn a_dropped_backend_ends_its_driver_and_its_locks_are_lost() {
    let Some(server) = Server::start(Flavor::Redis7) else {
        return;
    };
    let lease = Duration::from_secs(30);
    let shared = backend(&server, lease, Duration::from_secs(2)).await;
    let (_, _, lost) = register(&shared, b"k", "a", lease, Instant::now());
    // On this single-threaded runtime the driver runs while the test waits: it then sleeps
    // until the lock's renewal, 10 s away.
    tokio::time::sleep(50 * MS).await;
    let renewals = Arc::clone(&shared.renewals);
    drop(shared);
    assert!(
        fired(&lost, Duration::from_secs(5)).await.is_some(),
        "the driver ends with the backend"
    );
    assert_eq!(renewals.state().driver, None);
    assert!(renewals.state().entries.is_empty());
}

fn batches(shared: &Shared) -> u64 {
    shared.renewals.state().batches
}

/// Sets `keys` to `owner` for `lease` in one pipeline.
async fn take_all(server: &Server, keys: &[Vec<u8>], owner: &str, lease: Duration) {
    let mut admin = server.admin().await;
    let mut pipe = redis::pipe();
    for key in keys {
        pipe.cmd("SET")
            .arg(key)
            .arg(owner)
            .arg("PX")
            .arg(u64::try_from(lease.as_millis()).unwrap())
            .ignore();
    }
    let () = pipe.query_async(&mut admin).await.expect("SET");
}

/// 1,100 locks due at once go out in three pipelines, each lock with its own outcome: held
/// ones renewed, gone or taken ones lost. On Valkey 9.1 by `SET IFEQ`; on Redis 7, which
/// refuses that (the first round sends it, then the script with `EVAL`), by the Lua script,
/// sent again with `EVAL` in the second round after the server forgot it (`SCRIPT FLUSH`).
#[tokio::test]
async fn renewals_due_together_go_out_in_batches_each_with_its_outcome() {
    for flavor in [Flavor::Redis7, Flavor::Valkey91] {
        let Some(server) = Server::start(flavor) else {
            return;
        };
        // Renewed after 1 s, trusted for 2.4 s.
        let lease = Duration::from_secs(3);
        let shared = backend(&server, lease, Duration::from_secs(2)).await;
        let held: Vec<Vec<u8>> = (0..1_080)
            .map(|i| format!("held{i}").into_bytes())
            .collect();
        let taken: Vec<Vec<u8>> = (0..10).map(|i| format!("taken{i}").into_bytes()).collect();
        let gone: Vec<Vec<u8>> = (0..10).map(|i| format!("gone{i}").into_bytes()).collect();
        take_all(&server, &held, "a", lease).await;
        take_all(&server, &taken, "b", Duration::from_secs(30)).await;
        let mut admin = server.admin().await;
        let sent = Instant::now();
        let held: Vec<_> = held
            .iter()
            .map(|key| register(&shared, key, "a", lease, sent))
            .collect();
        let taken: Vec<_> = taken
            .iter()
            .map(|key| register(&shared, key, "a", lease, sent))
            .collect();
        let gone: Vec<_> = gone
            .iter()
            .map(|key| register(&shared, key, "a", lease, sent))
            .collect();

        until("every held lock is renewed", Duration::from_secs(5), || {
            held.iter()
                .all(|(_, deadline, _)| deadline.at() > later(sent, 2400 * MS))
        })
        .await;
        assert_eq!(
            batches(&shared),
            3,
            "{flavor:?}: 1,100 renewals in 3 batches"
        );
        for (what, locks) in [("taken", &taken), ("gone", &gone)] {
            for (_, deadline, lost) in locks {
                assert!(lost.is_cancelled(), "{flavor:?}: a {what} lock is lost");
                assert_eq!(deadline.at(), later(sent, 2400 * MS));
            }
        }
        assert!(held.iter().all(|(_, _, lost)| !lost.is_cancelled()));
        assert_eq!(entries(&shared), held.len());
        // The server's leases were set again: a key not renewed would have under 2 s left.
        for key in [&b"held0"[..], b"held539", b"held1079"] {
            let ttl = pttl(&mut admin, key).await;
            assert!(ttl > 2_000 && ttl <= 3_000, "{flavor:?}: {ttl} ms left");
        }
        assert_eq!(get(&mut admin, b"taken0").await.as_deref(), Some(&b"b"[..]));
        assert_eq!(get(&mut admin, b"gone0").await, None);

        // The second round, after the server forgot its scripts.
        let () = redis::cmd("SCRIPT")
            .arg("FLUSH")
            .query_async(&mut admin)
            .await
            .expect("SCRIPT FLUSH");
        let first: Vec<Instant> = held.iter().map(|(_, deadline, _)| deadline.at()).collect();
        until(
            "every held lock is renewed again",
            Duration::from_secs(5),
            || {
                held.iter()
                    .zip(&first)
                    .all(|((_, deadline, _), first)| deadline.at() > *first)
            },
        )
        .await;
        assert_eq!(batches(&shared), 6, "{flavor:?}");
        assert!(held.iter().all(|(_, _, lost)| !lost.is_cancelled()));
    }
}

/// A renewal due within a tenth of its period of one the driver wakes for goes with it; one
/// due later waits for its own time.
#[tokio::test]
async fn renewals_due_close_together_share_a_batch() {
    let Some(server) = Server::start(Flavor::Redis7) else {
        return;
    };
    // Renewed every 1 s, up to 100 ms early with others.
    let lease = Duration::from_secs(3);
    let shared = backend(&server, lease, Duration::from_secs(2)).await;
    take_all(
        &server,
        &[b"a".to_vec(), b"b".to_vec(), b"c".to_vec()],
        "a",
        Duration::from_secs(30),
    )
    .await;
    let start = Instant::now();
    let (_, a, _) = register(&shared, b"a", "a", lease, start);
    let (_, b, _) = register(&shared, b"b", "a", lease, later(start, 50 * MS));
    let (_, c, _) = register(&shared, b"c", "a", lease, later(start, 600 * MS));

    until("a and b are renewed", Duration::from_secs(5), || {
        a.at() > later(start, 2400 * MS) && b.at() > later(start, 50 * MS + 2400 * MS)
    })
    .await;
    assert_eq!(batches(&shared), 1, "a and b went together");
    // b went with a, before its own time.
    assert!(b.at() < later(start, 50 * MS + 1000 * MS + 2400 * MS));
    assert!(c.at() == later(start, 600 * MS + 2400 * MS), "c waits");

    until("c is renewed", Duration::from_secs(5), || {
        c.at() > later(start, 600 * MS + 2400 * MS)
    })
    .await;
    assert!(
        c.at() >= later(start, 600 * MS + 900 * MS + 2400 * MS),
        "not before its early window"
    );
    assert_eq!(batches(&shared), 2);
}
