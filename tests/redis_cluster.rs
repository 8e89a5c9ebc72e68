//! Redis Cluster (`redis+cluster://`), on a real cluster of three masters (with a replica
//! each where a case needs them) started by the test kit: the conformance suite, keys on
//! every master, the plain key layout's slots, and the cluster builder.
#![cfg(feature = "redis")]

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use dlock::redis::RedisBackend;
use dlock::{LockError, LockGuard, LockProvider};
use dlock_testkit::redis::RedisCluster;
use dlock_testkit::unique_key;

const LEASE: Duration = Duration::from_secs(1);

/// A cluster of `masters` masters with `replicas` replicas each, started off the runtime.
fn cluster(replicas: usize) -> Option<RedisCluster> {
    let cluster = tokio::task::block_in_place(|| {
        RedisCluster::start_with(3, replicas, Duration::from_secs(1))
    });
    if cluster.is_none() {
        eprintln!("skipped: redis-server or redis-cli is not installed");
    }
    cluster
}

struct ClusterHarness {
    cluster: RedisCluster,
    backend: RedisBackend,
}

impl ClusterHarness {
    fn start() -> Option<ClusterHarness> {
        // No replicas: the suite is about the protocol, and three nodes start faster than six.
        let cluster = cluster(0)?;
        let rt = tokio::runtime::Handle::current();
        let url = cluster.url(&format!("lease={}ms", LEASE.as_millis()));
        let backend = tokio::task::block_in_place(|| rt.block_on(RedisBackend::connect(&url)))
            .expect("connect");
        assert!(backend.is_cluster());
        Some(ClusterHarness { cluster, backend })
    }

    fn url(&self) -> String {
        self.cluster.url(&format!("lease={}ms", LEASE.as_millis()))
    }
}

impl dlock_testkit::Harness for ClusterHarness {
    async fn provider(&self) -> LockProvider {
        LockProvider::connect(&self.url()).await.expect("connect")
    }

    async fn break_lock(&self, guard: &LockGuard) {
        // Another owner takes the key over on the master of its slot, keeping its time to live.
        let key = self.backend.storage_key(guard.key());
        let cluster = &self.cluster;
        let master = tokio::task::block_in_place(|| cluster.owner_of(cluster.slot_of(&key)));
        let mut conn = cluster
            .node(master)
            .client()
            .get_multiplexed_async_connection()
            .await
            .unwrap();
        let set: Option<String> = redis::cmd("SET")
            .arg(key)
            .arg("someone-else")
            .arg("XX")
            .arg("KEEPTTL")
            .query_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(set.as_deref(), Some("OK"));
    }

    fn lost_within(&self) -> Duration {
        LEASE / 3 + Duration::from_secs(1)
    }

    fn retake_within(&self) -> Duration {
        LEASE + Duration::from_secs(1)
    }

    fn fencing(&self) -> bool {
        true
    }

    fn read_locks(&self) -> bool {
        true
    }

    async fn shared_providers(&self, count: usize) -> Vec<LockProvider> {
        let backend = RedisBackend::connect(&self.url()).await.expect("connect");
        (0..count)
            .map(|_| LockProvider::from_backend(backend.clone()))
            .collect()
    }
}

dlock_testkit::conformance_suite!(optional async { ClusterHarness::start() });

/// Locks land on every master (by their slots), each key's fencing tokens strictly increase
/// from holder to holder wherever its slot lives, and every lock is listed by
/// `store_locks`, which scans each master.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_spread_over_every_master() {
    let Some(cluster) = cluster(0) else {
        return;
    };
    let url = cluster.url("lease=5s");
    let backend = RedisBackend::connect(&url).await.expect("connect");
    let (a, b) = (
        LockProvider::from_backend(backend.clone()),
        LockProvider::connect(&url).await.expect("connect"),
    );
    let prefix = unique_key("spread");
    let keys: Vec<String> = (0..30).map(|i| format!("{prefix}:{i}")).collect();
    let mut owners = BTreeMap::<u16, usize>::new();
    for key in &keys {
        let storage = backend.storage_key(key);
        let fence = backend.fencing_key(key);
        let (owner, same) = tokio::task::block_in_place(|| {
            (
                cluster.owner_of(cluster.slot_of(&storage)),
                cluster.slot_of(&storage) == cluster.slot_of(&fence),
            )
        });
        assert!(same, "a lock and its counter share a slot");
        *owners.entry(owner).or_default() += 1;
    }
    assert_eq!(owners.len(), 3, "keys on every master: {owners:?}");
    let mut last = vec![0u64; keys.len()];
    for round in 0..3 {
        let locks = if round % 2 == 0 { &a } else { &b };
        let mut guards = Vec::new();
        for (i, key) in keys.iter().enumerate() {
            let guard = locks.try_acquire(key).await.expect("free");
            let token = guard.fencing_token().expect("fenced");
            assert!(token > last[i], "{key}: {token} after {}", last[i]);
            last[i] = token;
            guards.push(guard);
        }
        // Every held lock is listed, whichever master it is on.
        let listed: HashSet<String> = b
            .store_locks()
            .await
            .expect("store_locks")
            .into_iter()
            .filter_map(|l| l.key)
            .collect();
        for key in &keys {
            assert!(listed.contains(key), "{key} is not listed");
        }
        for guard in guards {
            guard.release().await.expect("release");
        }
    }
}

/// `key_layout=plain` puts a lock and its fencing counter in different slots unless the
/// name carries a hash tag: the acquisition answers a typed error that says so (CROSSSLOT),
/// and never a lock. With a hash tag in the name, or without fencing, it works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_layout_needs_hash_tags_for_fencing() {
    let Some(cluster) = cluster(0) else {
        return;
    };
    let plain = LockProvider::connect(&cluster.url("key_layout=plain"))
        .await
        .expect("connect");
    // Find a name whose counter lands in another slot (almost every name).
    let backend = RedisBackend::connect(&cluster.url("key_layout=plain"))
        .await
        .expect("connect");
    let key = (0..)
        .map(|i| unique_key(&format!("plain{i}")))
        .find(|k| {
            tokio::task::block_in_place(|| {
                cluster.slot_of(&backend.storage_key(k)) != cluster.slot_of(&backend.fencing_key(k))
            })
        })
        .unwrap();
    match plain.try_acquire(&key).await {
        Err(LockError::Backend {
            db_code, message, ..
        }) => {
            assert_eq!(db_code.as_deref(), Some("CROSSSLOT"), "{message}");
            assert!(message.contains("hash tag"), "{message}");
        }
        other => panic!("expected a CROSSSLOT error, got {other:?}"),
    }
    // Nothing was taken.
    let unfenced = LockProvider::connect(&cluster.url("key_layout=plain&fencing=false"))
        .await
        .expect("connect");
    unfenced
        .try_acquire(&key)
        .await
        .expect("free")
        .release()
        .await
        .unwrap();
    let tagged = format!("{{{key}}}");
    let guard = plain
        .try_acquire(&tagged)
        .await
        .expect("a tagged name works");
    assert!(guard.fencing_token().is_some());
    guard.release().await.unwrap();
}

/// A backend built from a `redis::cluster::ClusterClient`; `wait_replicas` waits for the
/// replica of the key's master; a URL that names no reachable node is `Unavailable`, one
/// with `ca` is a configuration error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_builder_and_wait_replicas() {
    let Some(cluster) = cluster(1) else {
        return;
    };
    let nodes: Vec<String> = cluster
        .ports()
        .iter()
        .map(|p| format!("redis://127.0.0.1:{p}/"))
        .collect();
    let client = redis::cluster::ClusterClient::new(nodes).unwrap();
    let backend = RedisBackend::cluster_builder(client)
        .lease(Duration::from_secs(5))
        .wait_replicas(1)
        .connect()
        .await
        .expect("connect");
    assert!(backend.is_cluster());
    let locks = LockProvider::from_backend(backend.clone());
    let prefix = unique_key("built");
    for i in 0..12 {
        let key = format!("{prefix}:{i}");
        let guard = locks
            .try_acquire(&key)
            .await
            .expect("acknowledged by the replica");
        let storage = backend.storage_key(&key);
        let replica = tokio::task::block_in_place(|| {
            let master = cluster.owner_of(cluster.slot_of(&storage));
            cluster.replicas_of(master)[0]
        });
        // Counted only once the replica had it.
        let mut conn = cluster
            .node(replica)
            .client()
            .get_multiplexed_async_connection()
            .await
            .unwrap();
        let _: () = redis::cmd("READONLY").query_async(&mut conn).await.unwrap();
        let on_replica: i64 = redis::cmd("EXISTS")
            .arg(&storage)
            .query_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(on_replica, 1, "the replica has {key}");
        guard.release().await.unwrap();
    }
    // Two replicas are more than any master has: refused, and given back.
    let strict = LockProvider::connect(&cluster.url("wait_replicas=2&wait_timeout=100ms"))
        .await
        .expect("connect");
    match strict.try_acquire(&format!("{prefix}:strict")).await {
        Err(LockError::Unavailable { message, .. }) => {
            assert!(message.contains("only 1 of the 2 replicas"), "{message}");
        }
        other => panic!("expected Unavailable, got {other:?}"),
    }
    match LockProvider::connect("redis+cluster://127.0.0.1:1,127.0.0.1:2?timeout=1s").await {
        Err(LockError::Unavailable { .. }) => {}
        other => panic!("expected Unavailable, got {other:?}"),
    }
    match LockProvider::connect(&cluster.url("ca=/nonexistent.pem")).await {
        Err(LockError::Config { .. }) => {}
        other => panic!("expected a configuration error, got {other:?}"),
    }
}
