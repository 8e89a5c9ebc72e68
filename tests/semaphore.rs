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

/// How many unary requests of each method the etcd member at `endpoint` has handled, read
/// from its `/metrics` (gRPC server counters): (LeaseGrant, Txn, Range).
#[cfg(feature = "etcd")]
fn etcd_requests(endpoint: &str) -> (u64, u64, u64) {
    use std::io::{Read, Write};
    let host = endpoint.trim_start_matches("http://");
    let mut stream = std::net::TcpStream::connect(host).expect("connect to the etcd member");
    write!(
        stream,
        "GET /metrics HTTP/1.0\r\nHost: {host}\r\nConnection: close\r\n\r\n"
    )
    .expect("ask for the metrics");
    let mut text = String::new();
    stream.read_to_string(&mut text).expect("read the metrics");
    let handled = |method: &str| -> u64 {
        text.lines()
            .filter(|line| {
                line.starts_with("grpc_server_handled_total{")
                    && line.contains(&format!("grpc_method=\"{method}\""))
            })
            .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>() as u64
    };
    let counts = (handled("LeaseGrant"), handled("Txn"), handled("Range"));
    assert!(
        text.contains("grpc_server_handled_total"),
        "the member's /metrics has no gRPC counters"
    );
    counts
}

/// Defect 2 of issue 43 on etcd: a try for a permit is a lease grant and one transaction,
/// whatever the count (u32::MAX included); a refused one, one transaction more (its key
/// deleted at once).
#[cfg(feature = "etcd")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_a_try_is_a_grant_and_one_transaction() {
    let Some(cluster) = dlock_testkit::etcd::EtcdCluster::start(1) else {
        return;
    };
    let endpoint = &cluster.endpoints()[0];
    let locks = LockProvider::connect(&cluster.url(""))
        .await
        .expect("connect");
    assert!(locks.native_semaphores());
    for count in [1, 1_000_000, u32::MAX] {
        let key = unique_key("etcd-rounds");
        let before = etcd_requests(endpoint);
        let held = locks
            .try_acquire_semaphore(&key, count)
            .await
            .expect("a permit");
        let after = etcd_requests(endpoint);
        assert_eq!(
            (after.0 - before.0, after.1 - before.1, after.2 - before.2),
            (1, 1, 0),
            "(grants, transactions, reads) of one try of a semaphore of {count}"
        );
        if count == 1 {
            let before = etcd_requests(endpoint);
            assert!(matches!(
                locks.try_acquire_semaphore(&key, 1).await,
                Err(LockError::AlreadyHeld { .. })
            ));
            let after = etcd_requests(endpoint);
            assert_eq!(
                (after.0 - before.0, after.1 - before.1, after.2 - before.2),
                (1, 2, 0),
                "(grants, transactions, reads) of a refused try"
            );
        }
        held.release().await.expect("release");
    }
}

/// etcd waits are its own FIFO: waiters of several providers are served in the order they
/// began, and a try does not jump the queue.
#[cfg(feature = "etcd")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_waiters_are_served_in_order() {
    let Some(cluster) = dlock_testkit::etcd::EtcdCluster::start(1) else {
        return;
    };
    let url = cluster.url("");
    let key = unique_key("etcd-fifo");
    let holder = LockProvider::connect(&url).await.expect("connect");
    let held = holder
        .try_acquire_semaphore(&key, 1)
        .await
        .expect("a permit");
    let backend = dlock::etcd::EtcdBackend::connect(&url)
        .await
        .expect("connect");
    let prefix = backend.semaphore_prefix(&key);
    let keys = async || {
        let options = dlock::etcd::etcd_client::GetOptions::new()
            .with_prefix()
            .with_count_only();
        backend
            .client()
            .kv_client()
            .get(prefix.clone(), Some(options))
            .await
            .expect("count the semaphore's keys")
            .count()
    };
    assert_eq!(keys().await, 1);
    let mut waiters = Vec::new();
    for queued in 2..5 {
        let locks = LockProvider::connect(&url).await.expect("connect");
        let wait = {
            let (locks, key) = (locks.clone(), key.clone());
            tokio::spawn(async move {
                locks
                    .acquire_semaphore(&key, 1, Duration::from_secs(30))
                    .await
            })
        };
        // Its key is in the queue before the next waiter starts.
        dlock_testkit::wait_until("the waiter queued", Duration::from_secs(5), async || {
            keys().await == queued
        })
        .await;
        waiters.push(wait);
    }
    assert!(matches!(
        holder.try_acquire_semaphore(&key, 1).await,
        Err(LockError::AlreadyHeld { .. })
    ));
    held.release().await.expect("release");
    let mut tokens = Vec::new();
    for (i, wait) in waiters.into_iter().enumerate() {
        let guard = tokio::time::timeout(Duration::from_secs(10), wait)
            .await
            .unwrap_or_else(|_| panic!("waiter {i} is served in turn"))
            .expect("join")
            .expect("a permit");
        tokens.push(guard.fencing_token().expect("etcd issues tokens"));
        guard.release().await.expect("release");
    }
    assert!(tokens.windows(2).all(|w| w[0] < w[1]), "{tokens:?}");
}
