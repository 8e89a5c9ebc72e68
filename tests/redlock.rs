//! Redlock over three real Redis 7 servers: the conformance suite, the exclusion checker across
//! processes, and what happens when nodes are stopped and started again.
#![cfg(feature = "redis")]

mod support;

use std::time::Duration;

use dlock::redis::{RedisBackend, RedlockBackend};
use dlock::{Backoff, LockError, LockProvider};
use dlock_testkit::redis::{Deployment, Flavor, LeaseHarness, RedisServer};
use dlock_testkit::unique_key;
use support::{Fencing, run_exclusion};

const LEASE: Duration = Duration::from_secs(1);

struct Nodes {
    servers: Vec<RedisServer>,
}

impl Nodes {
    fn start() -> Option<Nodes> {
        let mut servers = Vec::new();
        for _ in 0..3 {
            servers.push(RedisServer::start(Flavor::Redis7)?);
        }
        Some(Nodes { servers })
    }

    fn url(&self) -> String {
        self.url_with(&format!("lease={}ms", LEASE.as_millis()))
    }

    /// The tries the nodes saw: calls of the acquisition script (the locks are fenced).
    fn tries(&self) -> u64 {
        self.servers
            .iter()
            .map(|server| {
                let calls = server.command_calls();
                calls.get("evalsha").copied().unwrap_or(0) + calls.get("eval").copied().unwrap_or(0)
            })
            .sum()
    }

    /// A single-node backend on node `i`, with the options of the Redlock URL.
    async fn node(&self, i: usize) -> RedisBackend {
        RedisBackend::connect(&self.servers[i].url(&format!("lease={}ms", LEASE.as_millis())))
            .await
            .expect("connect")
    }
}

impl Deployment for Nodes {
    type Backend = RedlockBackend;

    fn url_with(&self, options: &str) -> String {
        let hosts: Vec<String> = self
            .servers
            .iter()
            .map(|s| format!("127.0.0.1:{}", s.port()))
            .collect();
        format!("redlock://{}/?{options}", hosts.join(","))
    }

    async fn take_over(&self, _: &RedlockBackend, key: &str) {
        // On two of the three nodes: a quorum lost.
        for i in 0..2 {
            let node = self.node(i).await;
            self.servers[i].take_over(&node, key).await;
        }
    }

    /// Redlock lists nothing: each node has only its part of the truth.
    fn store_inspection(&self) -> dlock_testkit::StoreInspection {
        dlock_testkit::StoreInspection::Unsupported
    }
}

dlock_testkit::conformance_suite!(optional async {
    Some(LeaseHarness::start(tokio::task::block_in_place(nodes)?).await)
});

fn nodes() -> Option<Nodes> {
    Nodes::start()
}

/// 4 processes × 8 tasks on 4 hot keys: no overlap, tokens strictly increasing.
#[test]
fn exclusion_across_processes() {
    let Some(nodes) = nodes() else { return };
    let summary = run_exclusion(
        &nodes.url(),
        &unique_key("redlock"),
        4,
        8,
        4,
        4_000,
        Fencing::Every,
    );
    assert!(summary.starts_with("ok sections=4000 "), "{summary}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_node_down_still_locks_two_down_do_not() {
    let Some(mut nodes) = nodes() else { return };
    let locks = LockProvider::connect(&nodes.url()).await.expect("connect");
    let key = unique_key("quorum");
    nodes.servers[2].stop();
    let guard = locks
        .try_acquire(&key)
        .await
        .expect("a quorum of two is up");
    let other = LockProvider::connect(&nodes.url())
        .await
        .expect("connect with one node down");
    assert!(matches!(
        other.try_acquire(&key).await,
        Err(LockError::AlreadyHeld { .. })
    ));
    guard.release().await.expect("release on the quorum");
    nodes.servers[1].stop();
    // A node that is gone answers with an error, or not in time (its connection retrying):
    // either way one node of three cannot lock.
    match locks.try_acquire(&key).await {
        Err(LockError::Unavailable { .. } | LockError::Lost { .. }) => {}
        other => panic!("one node of three cannot lock: {other:?}"),
    }
    match locks.acquire(&key, Duration::from_millis(600)).await {
        Err(LockError::Timeout { .. } | LockError::Unavailable { .. }) => {}
        other => panic!("a wait on one node of three cannot lock: {other:?}"),
    }
    // A backend cannot even be made on one node of three.
    match RedlockBackend::connect(&nodes.url()).await {
        Err(LockError::Unavailable { .. }) => {}
        other => panic!("expected Unavailable, got {other:?}"),
    }
    // Back up: locks again, through the same provider.
    nodes.servers[1].restart();
    nodes.servers[2].restart();
    let again = locks
        .acquire(&key, Duration::from_secs(10))
        .await
        .expect("the nodes are back");
    again.release().await.expect("release");
}

/// Pauses (`STOP`) or resumes (`CONT`) node `i`'s process: its connections stay open, and it
/// answers nothing meanwhile.
fn signal(nodes: &Nodes, i: usize, signal: &str) {
    let pid = nodes.servers[i].pid().expect("a running node");
    let status = std::process::Command::new("kill")
        .arg(format!("-{signal}"))
        .arg(pid.to_string())
        .status()
        .expect("run kill");
    assert!(status.success(), "kill -{signal} {pid}");
}

/// A node that stops answering, with its connection open, costs an acquisition at most the
/// node wait (a fifth of the lease), not the node's command timeout: with one node paused the
/// other two grant the lock; with two paused a try gives up within the wait, and the key comes
/// free once they answer again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paused_nodes_cost_an_acquisition_at_most_the_node_wait() {
    let Some(nodes) = nodes() else { return };
    // Lease 1 s: the node wait is 200 ms, the command timeout 5 s.
    let locks = LockProvider::connect(&nodes.url()).await.expect("connect");
    let key = unique_key("paused");
    // Every node connected before any is paused.
    let warm = locks.try_acquire(&key).await.expect("free");
    warm.release().await.expect("release");
    signal(&nodes, 0, "STOP");
    let started = std::time::Instant::now();
    let guard = locks.try_acquire(&key).await.expect("two nodes answer");
    let took = started.elapsed();
    assert!(
        took < Duration::from_secs(2),
        "one paused node cost {took:?}"
    );
    // Released on the two that answer; the paused one's release runs out its timeout.
    let _ = guard.release().await;
    signal(&nodes, 1, "STOP");
    let started = std::time::Instant::now();
    match locks.try_acquire(&key).await {
        Err(LockError::Lost { reason, .. }) => {
            assert!(reason.contains("did not answer"), "{reason}");
        }
        other => panic!("one node of three answering cannot lock: {other:?}"),
    }
    let took = started.elapsed();
    assert!(
        took < Duration::from_secs(2),
        "two paused nodes cost {took:?}"
    );
    signal(&nodes, 0, "CONT");
    signal(&nodes, 1, "CONT");
    let again = locks
        .acquire(&key, Duration::from_secs(10))
        .await
        .expect("the key comes free once the nodes answer");
    again.release().await.expect("release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_loses_its_lock_when_a_quorum_of_nodes_goes_down() {
    let Some(mut nodes) = nodes() else { return };
    let locks = LockProvider::connect(&nodes.url()).await.expect("connect");
    let key = unique_key("lost");
    let guard = locks.try_acquire(&key).await.expect("free");
    // One node down: the lock still holds on the other two.
    nodes.servers[0].stop();
    tokio::time::sleep(LEASE * 2).await;
    assert!(!guard.is_lost(), "two of three nodes still hold the lock");
    assert!(guard.verify_still_held().await.expect("a quorum answers"));
    // A second node down: fewer than a quorum, so the lock is lost within the lease.
    nodes.servers[1].stop();
    tokio::time::timeout(LEASE * 3, guard.lost_token().cancelled())
        .await
        .expect("the lost token fires");
    assert!(matches!(
        guard.release().await,
        Err(LockError::Lost { .. }) | Err(LockError::Unavailable { .. })
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fencing_tokens_increase_across_quorums_that_differ() {
    let Some(mut nodes) = nodes() else { return };
    let locks = LockProvider::connect(&nodes.url()).await.expect("connect");
    let key = unique_key("fence");
    let mut last = 0;
    // Each round takes the lock on a different pair of nodes: any two pairs share one.
    for round in 0..9 {
        let down = round % 3;
        nodes.servers[down].stop();
        let guard = locks
            .acquire(&key, Duration::from_secs(10))
            .await
            .expect("a quorum is up");
        let token = guard.fencing_token().expect("fenced");
        assert!(token > last, "round {round}: token {token} after {last}");
        last = token;
        guard.release().await.expect("release");
        // The node comes back empty, as after a restart without persistence. The next
        // round's pair still holds a node of this round's pair, whose counter was raised to
        // this round's token: the next token is larger all the same.
        nodes.servers[down].restart();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn urls_and_node_sets_are_checked() {
    for bad in ["redlock://", "redlock://a:1,,b:2", "redlock://a:1,a:1"] {
        match LockProvider::connect(bad).await {
            Err(LockError::Config { .. }) => {}
            other => panic!("{bad}: expected Config, got {other:?}"),
        }
    }
    assert!(matches!(
        RedlockBackend::from_nodes(Vec::new()),
        Err(LockError::Config { .. })
    ));
    let Some(nodes) = nodes() else { return };
    let backend = RedlockBackend::from_nodes(vec![
        nodes.node(0).await,
        nodes.node(1).await,
        nodes.node(2).await,
    ])
    .expect("three nodes");
    assert_eq!((backend.nodes(), backend.quorum()), (3, 2));
    let locks = LockProvider::from_backend(backend);
    locks.ping().await.expect("a quorum answers");
    let guard = locks
        .try_acquire(&unique_key("from-nodes"))
        .await
        .expect("free");
    guard.release().await.expect("release");
}

/// Far longer than any wait below may take.
const FALLBACK: Duration = Duration::from_secs(3600);
/// How long a waiter that was woken may take, at most (a loaded machine).
const LIMIT: Duration = Duration::from_secs(20);

/// A waiter with an hour-long fallback poll: it gets a key in time only when woken by a
/// release, or when it tries again as the holders' leases run out.
async fn slow_waiter(url: &str) -> LockProvider {
    let backend = RedlockBackend::connect(url).await.expect("connect");
    LockProvider::builder(backend)
        .backoff(Backoff::default().with_fallback_poll(FALLBACK).unwrap())
        .build()
}

/// A Redlock waiter subscribes on every node, does not poll while the key is held, and a
/// release wakes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_wakes_the_waiter_without_polling() {
    let Some(nodes) = nodes() else { return };
    let url = nodes.url_with("lease=60s");
    let holder = LockProvider::connect(&url).await.expect("connect");
    let waiters = slow_waiter(&url).await;
    let key = unique_key("woken");
    let channel = nodes.node(0).await.storage_key(&key);
    let guard = holder.try_acquire(&key).await.unwrap();
    let waiter = {
        let (waiters, key) = (waiters.clone(), key.clone());
        tokio::spawn(async move { waiters.acquire(&key, Duration::from_secs(600)).await })
    };
    for server in &nodes.servers {
        dlock_testkit::wait_until("the waiter subscribes on every node", LIMIT, async || {
            tokio::task::block_in_place(|| server.subscribers(&channel)) == 1
        })
        .await;
    }
    let before = nodes.tries();
    // Held for a while: a polling waiter would try again meanwhile.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        nodes.tries(),
        before,
        "the waiter polled while the key was held"
    );
    let held = guard.fencing_token();
    guard.release().await.unwrap();
    let got = tokio::time::timeout(LIMIT, waiter)
        .await
        .expect("the release woke the waiter")
        .unwrap()
        .unwrap();
    assert!(got.fencing_token() > held);
    got.release().await.unwrap();
}

/// A holder whose leases simply run out (not renewed, never released): the waiter, woken by
/// nothing, tries again when enough of the nodes' leases have run out, not at its hour-long
/// fallback poll.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_tries_again_when_the_quorums_leases_run_out() {
    let Some(nodes) = nodes() else { return };
    let url = nodes.url_with("lease=60s");
    let holder = LockProvider::connect(&url).await.expect("connect");
    let waiters = slow_waiter(&url).await;
    let key = unique_key("expires");
    let guard = holder
        .lock(&key)
        .lease(Duration::from_secs(2))
        .renewal(false)
        .try_acquire()
        .await
        .unwrap();
    let got = tokio::time::timeout(LIMIT, waiters.acquire(&key, Duration::from_secs(600)))
        .await
        .expect("the waiter got the key when the leases ran out")
        .unwrap();
    assert!(got.fencing_token() > guard.fencing_token());
    drop(guard);
    got.release().await.unwrap();
}

/// Redlock keeps no native semaphores: the provider keeps them as slots, each a Redlock lock.
/// Why, shown on the nodes themselves: counting permits node by node and calling a permit
/// held when a quorum counted it does not bound the holders. With three nodes (quorum two) and
/// `max_count` 3, every node's own permit store grants four holders a quorum each: eight of
/// the nine places, no node past its count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quorums_of_node_permits_do_not_bound_the_holders() {
    use dlock::backend::{LockBackend, PermitRequest, PermitTry};
    let Some(nodes) = nodes() else { return };
    let redlock = RedlockBackend::connect(&nodes.url())
        .await
        .expect("connect");
    assert!(
        redlock.semaphores().is_none(),
        "redlock keeps semaphores as slots of Redlock locks"
    );
    let backends = [
        nodes.node(0).await,
        nodes.node(1).await,
        nodes.node(2).await,
    ];
    let key = unique_key("quorum-permits");
    // Holder h asks the nodes of its pair, the pairs chosen so that no node sees more than
    // three of them.
    let pairs = [[0, 1], [1, 2], [2, 0], [0, 1]];
    let mut held = Vec::new();
    for (h, pair) in pairs.iter().enumerate() {
        for &n in pair {
            let store = backends[n].semaphores().expect("a node keeps permits");
            match store
                .try_acquire_permit(PermitRequest::new(&key, 3))
                .await
                .expect("a try")
            {
                PermitTry::Acquired(permit) => held.push(permit),
                other => panic!("holder {h} on node {n}: {other:?}"),
            }
        }
    }
    assert_eq!(
        held.len(),
        8,
        "four holders, each counted on a quorum of two nodes"
    );
    for backend in &backends {
        let n = backend
            .semaphores()
            .unwrap()
            .holders(&key, 3)
            .await
            .unwrap();
        assert!(n <= 3, "no node past its count: {n}");
    }
    for permit in held {
        permit.handle.release().await.expect("release");
    }
}
