//! Redis Cluster, Sentinel and Redlock over TLS (`rediss+cluster://`, `rediss+sentinel://`,
//! `rediss+redlock://`), on real deployments whose nodes, cluster bus, replication and
//! sentinels speak TLS with a certificate of a test CA: the conformance suite on a TLS
//! cluster, wake-ups through subscribers that connect over TLS, a forced failover behind TLS
//! sentinels, a Redlock quorum over TLS nodes, and the refusals (a certificate of another CA, the system's roots, `ca` without TLS).
#![cfg(feature = "redis")]

use std::time::{Duration, Instant};

use dlock::redis::RedisBackend;
use dlock::{LockError, LockProvider};
use dlock_testkit::redis::{
    Flavor, LeaseHarness, RedisCluster, RedisServer, SentinelDeployment, counts_one_subscriber,
    woken_only,
};
use dlock_testkit::tls::{Pki, ServerCert};
use dlock_testkit::{unique_key, wait_until};

/// The shared TLS cluster, started off the runtime's worker threads (a missing binary fails
/// the test there).
fn cluster() -> Option<&'static RedisCluster> {
    tokio::task::block_in_place(RedisCluster::shared_tls)
}

dlock_testkit::conformance_suite!(optional async {
    let harness = LeaseHarness::start(cluster()?).await;
    assert!(harness.backend().is_cluster());
    Some(harness)
});

/// `holder` takes `key`; a waiter of `waiters` waits until `node` (a plain client of the
/// node that serves the key) counts its subscription; the release wakes it. Returns how long
/// the waiter took after the release.
async fn woken(
    holder: &LockProvider,
    waiters: &LockProvider,
    backend: &RedisBackend,
    node: redis::Client,
    key: &str,
) -> Duration {
    let limit = Duration::from_secs(20);
    let guard = holder.try_acquire(key).await.unwrap();
    let waiter = {
        let (waiters, key) = (waiters.clone(), key.to_owned());
        tokio::spawn(async move { waiters.acquire(&key, Duration::from_secs(600)).await })
    };
    let channel = String::from_utf8_lossy(&backend.storage_key(key)).into_owned();
    wait_until("the waiter subscribes over TLS", limit, async || {
        counts_one_subscriber(&node, &channel).await
    })
    .await;
    let released = Instant::now();
    guard.release().await.unwrap();
    let next = tokio::time::timeout(limit, waiter)
        .await
        .expect("the release woke the waiter")
        .unwrap()
        .unwrap();
    let took = released.elapsed();
    next.release().await.unwrap();
    took
}

/// On a TLS cluster, locks spread over the masters, each key's tokens increase, and on each
/// master a waiter whose subscriber connects over TLS to the master of the key's slot is
/// woken by the release (its fallback poll is an hour).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_cluster_locks_on_every_master_and_wakes_waiters() {
    let Some(cluster) = cluster() else {
        return;
    };
    let url = cluster.url("lease=60s");
    assert!(url.starts_with("rediss+cluster://"), "{url}");
    let backend = RedisBackend::connect(&url).await.expect("connect over TLS");
    let locks = LockProvider::from_backend(backend.clone());
    let mut masters = std::collections::HashSet::new();
    for i in 0..24 {
        let key = unique_key(&format!("tls-spread-{i}"));
        let first = locks.try_acquire(&key).await.unwrap();
        let token = first.fencing_token().expect("a fencing token");
        first.release().await.unwrap();
        let second = locks.try_acquire(&key).await.unwrap();
        assert!(second.fencing_token().expect("a fencing token") > token);
        second.release().await.unwrap();
        let storage = backend.storage_key(&key);
        masters.insert(tokio::task::block_in_place(|| {
            cluster.owner_of(cluster.slot_of(&storage))
        }));
    }
    assert_eq!(masters.len(), 3, "24 keys land on every master");

    // One key on each master: every master's subscriber connects over TLS, not only the
    // one of the URL's first node.
    let mut on_master = std::collections::HashMap::new();
    for i in 0..300 {
        let key = unique_key(&format!("tls-woken-{i}"));
        let storage = backend.storage_key(&key);
        let master = tokio::task::block_in_place(|| cluster.owner_of(cluster.slot_of(&storage)));
        on_master.entry(master).or_insert(key);
        if on_master.len() == 3 {
            break;
        }
    }
    assert_eq!(on_master.len(), 3, "keys found for every master");
    let holder = LockProvider::connect(&url).await.unwrap();
    let waiters = woken_only(backend.clone());
    for (master, key) in on_master {
        let took = woken(
            &holder,
            &waiters,
            &backend,
            cluster.node(master).client(),
            &key,
        )
        .await;
        assert!(took < Duration::from_secs(5), "woken after {took:?}");
    }
}

/// `rediss+cluster://` checks the nodes' certificates: signed by another CA, or by a CA
/// that only the URL's `ca` names (the system's roots then), the connection is refused with
/// a configuration error that says why; `ca` without TLS is refused before connecting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_cluster_refuses_certificates_it_cannot_trust() {
    let Some(cluster) = cluster() else {
        return;
    };
    let url = cluster.url("timeout=3s");
    let (good_ca, other_ca) = (
        Pki::shared().ca.display().to_string(),
        Pki::shared().other_ca.display().to_string(),
    );
    let wrong = url.replace(&good_ca, &other_ca);
    assert_ne!(wrong, url);
    let refused = RedisBackend::connect(&wrong)
        .await
        .expect_err("a certificate of another CA");
    assert_refused_certificate(&refused);
    let system_roots = url.replace(&format!("ca={good_ca}&"), "");
    assert!(!system_roots.contains("ca="), "{system_roots}");
    let refused = RedisBackend::connect(&system_roots)
        .await
        .expect_err("a test CA is not among the system's roots");
    assert_refused_certificate(&refused);

    let err = refused_as_config(&url.replace("rediss+cluster://", "redis+cluster://")).await;
    assert!(err.to_string().contains("needs a TLS connection"), "{err}");
}

/// The error of a URL with `ca` but without TLS: a configuration error.
async fn refused_as_config(url: &str) -> LockError {
    let err = LockProvider::connect(url)
        .await
        .expect_err("ca without TLS");
    assert!(matches!(err, LockError::Config { .. }), "{err}");
    err
}

fn assert_refused_certificate(err: &LockError) {
    let text = err.to_string();
    assert!(
        text.contains("certificate") || text.contains("issuer") || text.contains("Certificate"),
        "the refusal names the certificate: {text}"
    );
    assert!(
        matches!(err, LockError::Config { .. }),
        "a refused certificate is a configuration error: {text}"
    );
}

/// Behind TLS sentinels (`rediss+sentinel://`): the sentinels are asked over TLS, name the
/// master's TLS port, and the backend locks there; a waiter is woken over TLS; after a
/// forced failover the same backend locks on the promoted replica, over TLS, and wakes
/// waiters there. The periodic master check keeps its TLS connection to a sentinel. A
/// certificate of another CA is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_sentinels_lead_to_the_master_and_follow_a_failover() {
    let tls = Pki::shared().server(ServerCert::Good);
    let Some(deployment) = tokio::task::block_in_place(|| {
        SentinelDeployment::start_tls(Duration::from_secs(20), &tls)
    }) else {
        dlock_testkit::conformance::no_harness()
    };
    tokio::task::block_in_place(|| deployment.wait_ready());
    let url = deployment.url("lease=60s");
    assert!(url.starts_with("rediss+sentinel://"), "{url}");
    let backend = RedisBackend::connect(&url).await.expect("connect over TLS");
    let old = deployment.master_port();
    assert_eq!(backend.sentinel_master().map(|m| m.1), Some(old));
    assert_eq!(old, deployment.nodes[0].tls_port(), "the master's TLS port");
    let holder = LockProvider::connect(&url).await.unwrap();
    let waiters = woken_only(backend.clone());
    let took = woken(
        &holder,
        &waiters,
        &backend,
        deployment.node(old).client(),
        &unique_key("tls-sentinel-woken"),
    )
    .await;
    assert!(took < Duration::from_secs(5), "woken after {took:?}");

    // The periodic master check asks on a TLS connection it keeps: no handshake per check.
    let checking = LockProvider::connect(&deployment.url("lease=60s&check_master_every=10ms"))
        .await
        .unwrap();
    let mut traffic = tokio::task::block_in_place(|| deployment.traffic()).expect("meter");
    let key = unique_key("tls-sentinel-checks");
    let opened = traffic
        .connections_for(40, async || {
            let guard = checking.try_acquire(&key).await.expect("acquired");
            guard.release().await.expect("released");
        })
        .await;
    assert!(opened <= 1, "{opened} TLS connections for 40 checks");

    let new = tokio::task::block_in_place(|| deployment.failover());
    assert_ne!(new, old);
    assert_eq!(
        new,
        deployment.nodes[1].tls_port(),
        "the replica's TLS port"
    );
    let key = unique_key("tls-sentinel-after");
    wait_until(
        "acquisitions work on the new master",
        Duration::from_secs(15),
        async || {
            let on_new = backend.sentinel_master().map(|m| m.1) == Some(new);
            match waiters.try_acquire(&key).await {
                Ok(guard) => guard.release().await.is_ok() && on_new,
                Err(_) => false,
            }
        },
    )
    .await;
    let took = woken(
        &holder,
        &waiters,
        &backend,
        deployment.node(new).client(),
        &unique_key("tls-sentinel-woken-after"),
    )
    .await;
    assert!(took < Duration::from_secs(5), "woken after {took:?}");

    let wrong = url.replace(
        &Pki::shared().ca.display().to_string(),
        &Pki::shared().other_ca.display().to_string(),
    );
    let err = RedisBackend::connect(&format!("{wrong}&timeout=3s"))
        .await
        .expect_err("sentinels with a certificate of another CA");
    assert_refused_certificate(&err);
}

/// Redlock over three nodes that speak TLS (`rediss+redlock://`): the lock is taken on every
/// node over TLS, a second provider is refused while it is held, a waiter is woken by the
/// release with a larger token. A certificate of another CA is refused as configuration, and
/// so is `ca` on `redlock://`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_redlock_takes_its_quorum_over_tls() {
    let tls = Pki::shared().server(ServerCert::Good);
    let Some(servers) = tokio::task::block_in_place(|| {
        (0..3)
            .map(|_| RedisServer::start_tls(Flavor::Redis7, &tls, false))
            .collect::<Option<Vec<_>>>()
    }) else {
        dlock_testkit::conformance::no_harness()
    };
    let hosts: Vec<String> = servers
        .iter()
        .map(|s| format!("127.0.0.1:{}", s.tls_port()))
        .collect();
    let ca = Pki::shared().ca.display().to_string();
    let url = format!("rediss+redlock://{}/?ca={ca}&lease=5s", hosts.join(","));
    let holder = LockProvider::connect(&url).await.expect("connect over TLS");
    let other = LockProvider::connect(&url).await.unwrap();
    let key = unique_key("tls-redlock");
    let guard = holder.try_acquire(&key).await.expect("free");
    let first = guard.fencing_token().expect("a token");
    assert!(matches!(
        other.try_acquire(&key).await,
        Err(LockError::AlreadyHeld { .. })
    ));
    // Every node holds the key: each was reached over TLS.
    for server in &servers {
        let plain = RedisBackend::connect(&server.url("")).await.unwrap();
        let mut conn = server
            .client()
            .get_multiplexed_async_connection()
            .await
            .unwrap();
        let exists: bool = redis::cmd("EXISTS")
            .arg(plain.storage_key(&key))
            .query_async(&mut conn)
            .await
            .unwrap();
        assert!(exists, "the node on {} holds the key", server.tls_port());
    }
    let waiter = {
        let (other, key) = (other.clone(), key.clone());
        tokio::spawn(async move { other.acquire(&key, Duration::from_secs(20)).await })
    };
    guard.release().await.unwrap();
    let next = waiter.await.unwrap().expect("the waiter gets the lock");
    assert!(next.fencing_token().expect("a token") > first);
    next.release().await.unwrap();

    let wrong = url.replace(&ca, &Pki::shared().other_ca.display().to_string());
    let err = LockProvider::connect(&format!("{wrong}&timeout=3s"))
        .await
        .expect_err("nodes with a certificate of another CA");
    assert_refused_certificate(&err);
    refused_as_config(&url.replace("rediss+redlock://", "redlock://")).await;
}
