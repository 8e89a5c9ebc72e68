//! Semaphores across processes: a permit holder killed with SIGKILL (a `dlock-worker
//! hold-permit` child) frees its permit when its lease runs out or its session ends, on every
//! kind of store, whether the backend keeps semaphores natively (SQLite, etcd) or as slot
//! locks (the others, for now).

mod support;

use std::time::{Duration, Instant};

use dlock::{LockError, LockProvider};
use dlock_testkit::unique_key;
use support::Holder;

/// A semaphore of two: a child process holds one permit and this process the other; the
/// child is killed. The permit is free again once `freed_within` has passed (a lease store:
/// the lease; a session store: at once), not before `not_before`, and a wait gets it with a
/// fencing token above the child's where the backend issues them per semaphore.
async fn killed_holder(url: &str, not_before: Duration, freed_within: Duration) {
    let key = unique_key("permit-killed");
    let holder = Holder::start_permit(url, &key, 2);
    let locks = LockProvider::connect(url).await.expect("connect");
    let mine = locks
        .try_acquire_semaphore(&key, 2)
        .await
        .expect("the second permit");
    assert!(matches!(
        locks.try_acquire_semaphore(&key, 2).await,
        Err(LockError::AlreadyHeld { .. })
    ));
    let killed_token = holder.fencing_token;
    holder.kill();
    let killed_at = Instant::now();
    let freed = locks
        .acquire_semaphore(&key, 2, freed_within + Duration::from_secs(5))
        .await
        .expect("the killed holder's permit frees itself");
    let after = killed_at.elapsed();
    eprintln!("{url}: the killed holder's permit was free {after:?} after the kill");
    assert!(
        after >= not_before,
        "the killed holder's permit was free after {after:?}, before its lease could have ended"
    );
    assert!(
        after <= freed_within,
        "the killed holder's permit stayed held {after:?}"
    );
    if locks.native_semaphores()
        && let (Some(killed), Some(now)) = (killed_token, freed.fencing_token())
    {
        assert!(
            now > killed,
            "token {now} after the killed holder's {killed}"
        );
    }
    assert_eq!(freed.key(), key);
    freed.release().await.expect("release");
    mine.release().await.expect("release");
}

#[cfg(feature = "sqlite")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_killed_permit_holder() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}/permits.db?lease=1s", dir.path().display());
    // Renewed at most a third of the lease before the kill: two thirds at least were left.
    killed_holder(&url, Duration::from_millis(600), Duration::from_secs(3)).await;
}

#[cfg(feature = "etcd")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_killed_permit_holder() {
    let Some(cluster) = dlock_testkit::etcd::EtcdCluster::start(1) else {
        return;
    };
    // The etcd lease's TTL is whole seconds (and at least the server's minimum).
    killed_holder(
        &cluster.url("lease=2s"),
        Duration::from_millis(1300),
        Duration::from_secs(6),
    )
    .await;
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_permit_holder() {
    let Some(server) =
        dlock_testkit::redis::RedisServer::start(dlock_testkit::redis::Flavor::Redis7)
    else {
        return;
    };
    killed_holder(
        &server.url("lease=1s"),
        Duration::from_millis(600),
        Duration::from_secs(3),
    )
    .await;
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_killed_permit_holder() {
    let server = dlock_testkit::postgres::PgServer::start();
    // A session lock: free once the server has seen the connection close.
    killed_holder(&server.url(""), Duration::ZERO, Duration::from_secs(3)).await;
}
