//! The etcd backend on real etcd servers: the conformance suite on a single server, the
//! queue's promises (FIFO waits, fencing tokens from create revisions, no key left by an
//! abandoned acquisition), loss by a deleted key, a revoked lease and a dead server, and on a
//! three-member cluster the exclusion checker across processes while the leader is killed.
#![cfg(feature = "etcd")]

mod support;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dlock::etcd::EtcdBackend;
use dlock::etcd::etcd_client::{self, GetOptions};
use dlock::{LockError, LockGuard, LockProvider, ReleaseOutcome};
use dlock_testkit::etcd::EtcdCluster;
use dlock_testkit::unique_key;

const LEASE: Duration = Duration::from_secs(3);

struct EtcdHarness {
    cluster: EtcdCluster,
    backend: EtcdBackend,
}

impl EtcdHarness {
    async fn start() -> Option<EtcdHarness> {
        EtcdHarness::on(1).await
    }

    async fn on(members: usize) -> Option<EtcdHarness> {
        let cluster = tokio::task::spawn_blocking(move || EtcdCluster::start(members))
            .await
            .expect("start etcd")?;
        let backend = EtcdBackend::connect(&url(&cluster)).await.expect("connect");
        Some(EtcdHarness { cluster, backend })
    }

    fn url(&self) -> String {
        url(&self.cluster)
    }
}

fn url(cluster: &EtcdCluster) -> String {
    cluster.url(&format!("lease={}ms", LEASE.as_millis()))
}

/// The keys queued for `key`, in queue order: (key, create revision, lease).
async fn queue(backend: &EtcdBackend, key: &str) -> Vec<(Vec<u8>, i64, i64)> {
    let options = GetOptions::new().with_prefix().with_sort(
        etcd_client::SortTarget::Create,
        etcd_client::SortOrder::Ascend,
    );
    let answer = backend
        .client()
        .kv_client()
        .get(backend.queue_prefix(key), Some(options))
        .await
        .expect("read the queue");
    answer
        .kvs()
        .iter()
        .map(|kv| (kv.key().to_vec(), kv.create_revision(), kv.lease()))
        .collect()
}

/// The key that holds `key` (the head of its queue).
async fn holder(backend: &EtcdBackend, key: &str) -> (Vec<u8>, i64, i64) {
    queue(backend, key)
        .await
        .into_iter()
        .next()
        .expect("the lock has a holder")
}

impl dlock_testkit::Harness for EtcdHarness {
    async fn provider(&self) -> LockProvider {
        LockProvider::connect(&self.url()).await.expect("connect")
    }

    async fn break_lock(&self, guard: &LockGuard) {
        // An operator deletes the holder's key.
        let (key, _, _) = holder(&self.backend, guard.key()).await;
        let deleted = self
            .backend
            .client()
            .kv_client()
            .delete(key, None)
            .await
            .expect("delete");
        assert_eq!(deleted.deleted(), 1);
    }

    fn lost_within(&self) -> Duration {
        // The holder's watch sees the delete.
        Duration::from_secs(2)
    }

    fn fencing(&self) -> bool {
        true
    }

    /// etcd lists each queue's holder (one range read of the prefix).
    fn store_inspection(&self) -> dlock_testkit::StoreInspection {
        dlock_testkit::StoreInspection::Listed
    }

    async fn shared_providers(&self, count: usize) -> Vec<LockProvider> {
        let backend = EtcdBackend::connect(&self.url()).await.expect("connect");
        (0..count)
            .map(|_| LockProvider::from_backend(backend.clone()))
            .collect()
    }
}

mod conformance {
    use super::*;

    dlock_testkit::conformance_suite!(optional EtcdHarness::start());
}

/// Successive holders from several providers (processes) get strictly increasing tokens, each
/// the create revision of the holder's key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fencing_tokens_increase_across_providers() {
    let Some(h) = EtcdHarness::start().await else {
        return;
    };
    let key = unique_key("fence");
    let order = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for _ in 0..3 {
        let provider = dlock_testkit::Harness::provider(&h).await;
        let (key, order, backend) = (key.clone(), Arc::clone(&order), h.backend.clone());
        tasks.push(tokio::spawn(async move {
            for _ in 0..10 {
                let guard = provider
                    .acquire(&key, Duration::from_secs(20))
                    .await
                    .expect("acquire");
                let token = guard.fencing_token().expect("a fencing token");
                let (_, revision, _) = holder(&backend, &key).await;
                assert_eq!(
                    token, revision as u64,
                    "the token is the key's create revision"
                );
                order.lock().unwrap().push(token);
                guard.release().await.expect("release");
            }
        }));
    }
    for task in tasks {
        task.await.expect("task");
    }
    let order = order.lock().unwrap();
    assert_eq!(order.len(), 30);
    assert!(
        order.windows(2).all(|w| w[0] < w[1]),
        "tokens in holding order: {order:?}"
    );
}

/// Waiters from separate providers are served in the order they queued, and each one's
/// queue key is the one right after its predecessor's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_are_served_in_arrival_order() {
    let Some(h) = EtcdHarness::start().await else {
        return;
    };
    let key = unique_key("fifo");
    let first = dlock_testkit::Harness::provider(&h).await;
    let held = first.try_acquire(&key).await.expect("free key");
    let served = Arc::new(Mutex::new(Vec::new()));
    let mut waiters = Vec::new();
    for i in 0..5 {
        let provider = dlock_testkit::Harness::provider(&h).await;
        let (k, served) = (key.clone(), Arc::clone(&served));
        waiters.push(tokio::spawn(async move {
            let guard = provider
                .acquire(&k, Duration::from_secs(30))
                .await
                .expect("served");
            served.lock().unwrap().push(i);
            // Held briefly, so that a waiter served out of turn would show.
            tokio::time::sleep(Duration::from_millis(20)).await;
            guard.release().await.expect("release");
        }));
        // Queued (its key is in the store) before the next one starts.
        let backend = h.backend.clone();
        let key = key.clone();
        dlock_testkit::wait_until(
            "the waiter has queued",
            Duration::from_secs(5),
            async || queue(&backend, &key).await.len() == i + 2,
        )
        .await;
    }
    // A try never jumps the queue, from a provider that holds nothing.
    let outsider = dlock_testkit::Harness::provider(&h).await;
    assert!(matches!(
        outsider.try_acquire(&key).await,
        Err(LockError::AlreadyHeld { .. })
    ));
    held.release().await.expect("release");
    for waiter in waiters {
        waiter.await.expect("waiter");
    }
    assert_eq!(*served.lock().unwrap(), vec![0, 1, 2, 3, 4]);
    assert!(
        queue(&h.backend, &key).await.is_empty(),
        "no key left behind"
    );
}

/// A holder whose key is deleted hears of it at once; its release answers that it no longer
/// held the lock (`NotOwned` once someone else holds it, `AlreadyReleased` when nobody does).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleted_key_is_a_loss_and_release_says_so() {
    let Some(h) = EtcdHarness::start().await else {
        return;
    };
    let (a, b) = (
        dlock_testkit::Harness::provider(&h).await,
        dlock_testkit::Harness::provider(&h).await,
    );
    for taken_over in [true, false] {
        let key = unique_key("deleted");
        let guard = a.try_acquire(&key).await.expect("free key");
        let deleted = Instant::now();
        dlock_testkit::Harness::break_lock(&h, &guard).await;
        tokio::time::timeout(Duration::from_secs(2), guard.lost_token().cancelled())
            .await
            .expect("the lost token fires when the key is deleted");
        eprintln!("deleted key noticed in {:?}", deleted.elapsed());
        let next = if taken_over {
            Some(b.try_acquire(&key).await.expect("the key is free again"))
        } else {
            None
        };
        let outcome = guard.release_outcome().await.expect("release");
        let expected = if taken_over {
            ReleaseOutcome::NotOwned
        } else {
            ReleaseOutcome::AlreadyReleased
        };
        assert_eq!(outcome, expected);
        if let Some(next) = next {
            assert!(!next.is_lost(), "the new holder is untouched");
            assert_eq!(queue(&h.backend, &key).await.len(), 1);
            next.release().await.expect("release");
        }
        assert!(queue(&h.backend, &key).await.is_empty());
    }
}

/// A revoked lease (what an expiry does) is a loss: the keep-alive answers TTL 0 and the key
/// is gone; the release reports the loss and the key is free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn revoked_lease_is_a_loss() {
    let Some(h) = EtcdHarness::start().await else {
        return;
    };
    let a = dlock_testkit::Harness::provider(&h).await;
    let key = unique_key("revoked");
    let guard = a.try_acquire(&key).await.expect("free key");
    let (_, _, lease) = holder(&h.backend, &key).await;
    h.backend
        .client()
        .lease_client()
        .revoke(lease)
        .await
        .expect("revoke");
    let revoked = Instant::now();
    tokio::time::timeout(Duration::from_secs(2), guard.lost_token().cancelled())
        .await
        .expect("the lost token fires when the lease is revoked");
    eprintln!("revoked lease noticed in {:?}", revoked.elapsed());
    assert!(matches!(guard.release().await, Err(LockError::Lost { .. })));
    let b = dlock_testkit::Harness::provider(&h).await;
    b.try_acquire(&key)
        .await
        .expect("free again")
        .release()
        .await
        .expect("release");
}

/// A server that dies is a loss at the local deadline (four fifths of the lease after the
/// last confirmed keep-alive was sent), never a lock silently kept; once it is back, the
/// release reports the loss and the key is free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_server_is_a_loss_at_the_local_deadline() {
    let Some(mut h) = EtcdHarness::start().await else {
        return;
    };
    let a = dlock_testkit::Harness::provider(&h).await;
    let key = unique_key("dead");
    let guard = a.try_acquire(&key).await.expect("free key");
    let left = guard.remaining_lease().expect("a leased lock");
    let killed = Instant::now();
    h.cluster.kill(0);
    tokio::time::timeout(LEASE, guard.lost_token().cancelled())
        .await
        .expect("the lost token fires at the local deadline");
    let noticed = killed.elapsed();
    eprintln!("server killed: lost after {noticed:?}, with {left:?} of the lease left");
    assert!(
        noticed <= left + Duration::from_millis(200),
        "lost {noticed:?} after the kill, with {left:?} of the lease left"
    );
    h.cluster.restart(0);
    assert!(matches!(guard.release().await, Err(LockError::Lost { .. })));
    let b = dlock_testkit::Harness::provider(&h).await;
    b.acquire(&key, LEASE * 2)
        .await
        .expect("free again")
        .release()
        .await
        .expect("release");
}

/// Acquisitions dropped while they wait take their keys out of the queue (the lease is
/// revoked in the background): the holder's key is all that is left, and once it is
/// released, nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_acquisitions_leave_no_key() {
    let Some(h) = EtcdHarness::start().await else {
        return;
    };
    let key = unique_key("dropped");
    let a = dlock_testkit::Harness::provider(&h).await;
    let held = a.try_acquire(&key).await.expect("free key");
    let b = dlock_testkit::Harness::provider(&h).await;
    for round in 0..5 {
        let waiting = {
            let (b, key) = (b.clone(), key.clone());
            tokio::spawn(async move { b.acquire(&key, Duration::from_secs(30)).await })
        };
        let backend = h.backend.clone();
        let k = key.clone();
        dlock_testkit::wait_until(
            "the waiter has queued",
            Duration::from_secs(5),
            async || queue(&backend, &k).await.len() == 2,
        )
        .await;
        waiting.abort();
        assert!(waiting.await.is_err(), "round {round}: aborted");
        dlock_testkit::wait_until(
            "the abandoned key is gone",
            Duration::from_secs(2),
            async || queue(&backend, &k).await.len() == 1,
        )
        .await;
    }
    // Timeouts at every point of an acquisition, from the grant to the watch.
    for i in 0..30u64 {
        let budget = Duration::from_micros(i * 300);
        let _ = tokio::time::timeout(budget, b.acquire(&key, Duration::from_secs(5))).await;
    }
    let backend = h.backend.clone();
    dlock_testkit::wait_until(
        "only the holder's key is left",
        Duration::from_secs(2),
        async || queue(&backend, &key).await.len() == 1,
    )
    .await;
    held.release().await.expect("release");
    assert!(queue(&h.backend, &key).await.is_empty());
}

/// On a three-member cluster, the exclusion checker runs across worker processes while the
/// leader is killed and then restarted: no two sections overlap, tokens strictly increase,
/// every acquisition succeeds. A lock held through the failover stays held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_keeps_exclusion_when_the_leader_dies() {
    let Some(mut h) = EtcdHarness::on(3).await else {
        return;
    };
    let url = h.cluster.url("lease=3s&timeout=3s");
    let key = unique_key("failover");
    // A lock held across the failover.
    let a = LockProvider::connect(&url).await.expect("connect");
    let through = a.try_acquire(&unique_key("through")).await.expect("free");
    let run = {
        let (url, key) = (url.clone(), key.clone());
        std::thread::spawn(move || {
            support::run_exclusion_through_faults(&url, &key, 3, 2, 1, 150, support::Fencing::Every)
        })
    };
    // Kill the leader once the run is under way.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let leader = h.cluster.leader().expect("a leader");
    let killed = Instant::now();
    h.cluster.kill(leader);
    let mut new_leader = None;
    while killed.elapsed() < Duration::from_secs(10) {
        new_leader = h.cluster.leader();
        if new_leader.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    eprintln!(
        "leader {leader} killed; member {new_leader:?} leads after {:?}",
        killed.elapsed()
    );
    assert!(new_leader.is_some_and(|l| l != leader));
    tokio::time::sleep(Duration::from_millis(1000)).await;
    h.cluster.restart(leader);
    let summary = tokio::task::spawn_blocking(move || run.join().expect("checker"))
        .await
        .expect("join");
    assert!(summary.starts_with("ok "), "{summary}");
    assert!(
        !through.is_lost(),
        "a lock held through the failover is kept"
    );
    assert!(through.verify_still_held().await.expect("verify"));
    through.release().await.expect("release");
}

/// A follower killed and started again on its data during a run: the exclusion checker finds
/// no overlap and strictly increasing tokens, and a lock held through it is kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_keeps_exclusion_when_a_follower_restarts() {
    let Some(mut h) = EtcdHarness::on(3).await else {
        return;
    };
    let url = h.cluster.url("lease=3s&timeout=3s");
    let key = unique_key("follower");
    let a = LockProvider::connect(&url).await.expect("connect");
    let through = a.try_acquire(&unique_key("through")).await.expect("free");
    let run = {
        let (url, key) = (url.clone(), key.clone());
        std::thread::spawn(move || {
            support::run_exclusion_through_faults(&url, &key, 3, 2, 1, 150, support::Fencing::Every)
        })
    };
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let leader = h.cluster.leader().expect("a leader");
    let follower = (leader + 1) % h.cluster.size();
    h.cluster.kill(follower);
    tokio::time::sleep(Duration::from_millis(1000)).await;
    tokio::task::block_in_place(|| h.cluster.restart(follower));
    let summary = tokio::task::spawn_blocking(move || run.join().expect("checker"))
        .await
        .expect("join");
    assert!(summary.starts_with("ok "), "{summary}");
    assert!(
        !through.is_lost(),
        "a lock held through a follower's restart is kept"
    );
    assert!(through.verify_still_held().await.expect("verify"));
    through.release().await.expect("release");
}

/// With three members and the first one the URL lists dead (killed), a majority is up, and a
/// replica starting then must work on every path: connecting (each of 40 connects must
/// succeed, where one in three failed when the connect check was sent once and the client's
/// balancer picked the dead member), health checks, tries, waits, keep-alives over several
/// leases, lease control and releases, and store inspection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_starts_and_works_while_the_first_member_is_down() {
    let Some(mut h) = EtcdHarness::on(3).await else {
        return;
    };
    // Member 0 is not the leader, so that what follows is about a dead endpoint, not an
    // election.
    tokio::task::block_in_place(|| {
        assert!(
            h.cluster.make_leader(1, Duration::from_secs(10)),
            "leader moved"
        );
    });
    h.cluster.kill(0);
    let url = url_of(&h.cluster, &[0, 1, 2], "lease=1s&timeout=3s");
    let mut failed = Vec::new();
    for i in 0..40 {
        if let Err(err) = LockProvider::connect(&url).await {
            failed.push(format!("connect {i}: {err}"));
        }
    }
    // The other paths, on providers that did connect (each connect is asserted below).
    let connected = async || {
        loop {
            if let Ok(provider) = LockProvider::connect(&url).await {
                break provider;
            }
        }
    };
    let (a, b) = (connected().await, connected().await);
    for i in 0..40 {
        if let Err(err) = a.ping().await {
            failed.push(format!("ping {i}: {err}"));
        }
    }
    assert!(
        failed.is_empty(),
        "{} of 40 connects and 40 pings failed with a majority up: {failed:#?}",
        failed.len()
    );
    let mut last = 0;
    for i in 0..20 {
        let key = unique_key("first-down");
        let guard = a
            .try_acquire(&key)
            .await
            .unwrap_or_else(|err| panic!("try {i}: {err}"));
        let token = guard.fencing_token().expect("a token");
        assert!(token > last, "{token} after {last}");
        last = token;
        match b.try_acquire(&key).await {
            Err(LockError::AlreadyHeld { .. }) => {}
            other => panic!("try {i} of a held key: {other:?}"),
        }
        assert!(guard.verify_still_held().await.expect("verify"));
        guard
            .release()
            .await
            .unwrap_or_else(|err| panic!("release {i}: {err}"));
    }
    // A lock kept over three leases of keep-alives, extended, verified; a waiter meanwhile.
    let key = unique_key("first-down-held");
    let guard = a.try_acquire(&key).await.expect("free");
    let waiter = tokio::spawn({
        let (b, key) = (b.clone(), key.clone());
        async move { b.acquire(&key, Duration::from_secs(30)).await }
    });
    for _ in 0..6 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(!guard.is_lost(), "a kept lock was lost");
        assert!(guard.verify_still_held().await.expect("verify"));
        guard.extend(Duration::from_secs(1)).await.expect("extend");
        assert!(!waiter.is_finished(), "the waiter got a held lock");
    }
    let token = guard.fencing_token();
    guard.release().await.expect("release");
    let next = waiter
        .await
        .expect("join")
        .expect("the waiter gets the lock");
    assert!(next.fencing_token() > token);
    let listed = b.store_locks().await.expect("store inspection");
    let held = listed
        .iter()
        .find(|lock| lock.key.as_deref() == Some(key.as_str()))
        .unwrap_or_else(|| panic!("{key} is not listed: {listed:?}"));
    assert_eq!(held.fencing_token, next.fencing_token());
    next.release().await.expect("release");
    let listed = a.store_locks().await.expect("store inspection");
    assert!(
        listed
            .iter()
            .all(|lock| lock.key.as_deref() != Some(key.as_str())),
        "a released lock is listed: {listed:?}"
    );
}

/// The `etcd://` URL of some of `cluster`'s members.
fn url_of(cluster: &EtcdCluster, members: &[usize], options: &str) -> String {
    let endpoints = cluster.endpoints();
    let hosts: Vec<&str> = members
        .iter()
        .map(|&i| endpoints[i].trim_start_matches("http://"))
        .collect();
    format!("etcd://{}?{options}", hosts.join(","))
}

/// The leader of a three-member cluster is cut off from the other two (a network namespace
/// and nftables drop rules; its clients still reach it over another link):
/// - a provider that can reach only the cut-off member is granted nothing, and its holder is
///   told of the loss before the majority grants the same key to anyone else;
/// - the majority elects a leader and grants the key, with a larger fencing token;
/// - the exclusion checker, its workers naming every member, runs through the cut and the
///   heal with no overlap and strictly increasing tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cut_off_leader_grants_nothing_and_its_holders_are_told() {
    let Some(netns) = dlock_testkit::netns::Netns::new() else {
        return;
    };
    let Some(cluster) = tokio::task::block_in_place(|| EtcdCluster::start_split(&netns)) else {
        return;
    };
    assert!(
        tokio::task::block_in_place(|| cluster.make_leader(2, Duration::from_secs(10))),
        "member 2 did not take the leadership"
    );
    let options = "lease=3s&timeout=2s";
    let minority = LockProvider::connect(&url_of(&cluster, &[2], options))
        .await
        .expect("connect to the member to be cut off");
    let majority = LockProvider::connect(&url_of(&cluster, &[0, 1], options))
        .await
        .expect("connect to the majority");
    let key = unique_key("cut");
    let held = minority.try_acquire(&key).await.expect("free");
    let run = {
        let (url, prefix) = (cluster.url("lease=3s&timeout=3s"), unique_key("cut-run"));
        std::thread::spawn(move || {
            support::run_exclusion_through_faults(
                &url,
                &prefix,
                3,
                2,
                1,
                200,
                support::Fencing::Every,
            )
        })
    };
    tokio::time::sleep(Duration::from_millis(800)).await;

    // When the holder's lost token fires, as seen by a task of its own waiting on it (for the
    // report; the order is checked by the taker at its grant).
    let lost = held.lost_token().clone();
    let told = tokio::spawn({
        let lost = lost.clone();
        async move {
            lost.cancelled().await;
            Instant::now()
        }
    });
    netns.cut();
    let cut = Instant::now();
    // The majority asks for the held key from the moment of the cut. At the moment its grant
    // returns, the taker reads whether the holder has been told already (its lost token has
    // fired; not the clock-reading `is_lost`, which would call it lost itself).
    let taker = {
        let (majority, key, lost) = (majority.clone(), key.clone(), lost.clone());
        tokio::spawn(async move {
            let taken = majority.acquire(&key, Duration::from_secs(20)).await;
            (taken, Instant::now(), lost.is_cancelled())
        })
    };
    // The cut-off member grants nothing.
    match minority.try_acquire(&unique_key("minority")).await {
        Ok(_) => panic!("a member cut off from the majority granted a lock"),
        Err(err) => eprintln!("cut-off member, a new lock: {err}"),
    }
    let told_at = tokio::time::timeout(Duration::from_secs(10), told)
        .await
        .expect("the holder on the cut-off member is told of the loss")
        .expect("join");
    eprintln!("holder told of the loss {:?} after the cut", told_at - cut);
    let (taken, granted_at, told_by_then) = taker.await.expect("join");
    let taken = taken.expect("the majority grants the key");
    eprintln!(
        "the majority granted the key {:?} after the cut",
        granted_at - cut
    );
    assert!(
        told_by_then,
        "the majority granted the key {:?} after the cut, before the holder was told of the \
         loss (its lost token fired {:?} after the cut)",
        granted_at - cut,
        told_at - cut
    );
    assert!(held.is_lost());
    assert!(taken.fencing_token() > held.fencing_token());
    assert!(!taken.is_lost());

    netns.heal();
    let summary = tokio::task::spawn_blocking(move || run.join().expect("checker"))
        .await
        .expect("join");
    assert!(summary.starts_with("ok "), "{summary}");
    taken.release().await.expect("release");
    let released = held.release().await;
    assert!(
        matches!(released, Err(LockError::Lost { .. })),
        "the lost lock's release says so: {released:?}"
    );
}

/// The watch streams the members have opened (`grpc_server_started_total` of the `Watch`
/// method, from each member's `/metrics`).
async fn watches_opened(cluster: &EtcdCluster) -> u64 {
    let mut sum = 0.0;
    for endpoint in cluster.endpoints() {
        let text = reqwest::get(format!("{endpoint}/metrics"))
            .await
            .expect("metrics")
            .text()
            .await
            .expect("metrics text");
        sum += text
            .lines()
            .filter(|l| l.starts_with("grpc_server_started_total{"))
            .filter(|l| l.contains("grpc_method=\"Watch\""))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>();
    }
    sum as u64
}

/// A lock released within moments of its acquisition opens no watch stream (a stream and a
/// round trip each); one held on does, and a delete of its key made before the watch opened
/// is still reported: the watch reads the key's history from its creation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn brief_locks_open_no_watch_and_an_early_delete_is_still_seen() {
    let Some(h) = EtcdHarness::start().await else {
        return;
    };
    let locks = LockProvider::from_backend(h.backend.clone());
    let before = watches_opened(&h.cluster).await;
    for i in 0..20 {
        let guard = locks
            .try_acquire(&unique_key(&format!("brief-{i}")))
            .await
            .expect("free key");
        guard.release().await.expect("release");
    }
    let after = watches_opened(&h.cluster).await;
    assert_eq!(after - before, 0, "watches opened for 20 brief locks");

    let guard = locks
        .try_acquire(&unique_key("held"))
        .await
        .expect("free key");
    // Deleted at once, before the watch opens; the lease lives on, so only the watch can
    // tell.
    dlock_testkit::Harness::break_lock(&h, &guard).await;
    tokio::time::timeout(Duration::from_secs(2), guard.lost_token().cancelled())
        .await
        .expect("the delete made before the watch opened is reported");
    assert!(
        watches_opened(&h.cluster).await > after,
        "the held lock's watch opened"
    );
}

/// The late-answer rule at its boundary on etcd: an acquisition whose answer comes later than
/// 40 % of its lease after it was sent is given back and answered `Lost`. An acquisition here
/// is two round trips (the lease grant, then the queueing transaction), each answer held back
/// by a proxy: held back 17.5 % of a 4 s lease each (35 % in all, 1.4 s of the 1.6 s allowed;
/// 200 ms left for the round trips and the scheduler), the lock is handed out and held; held
/// back 22.5 % each (45 %), it is refused as `Lost` and the key is free again at once. A rule
/// moved to 80 % fails the second half, one moved to 30 % the first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn late_answer_at_the_boundary() {
    const LEASE: Duration = Duration::from_secs(4);
    let Some(cluster) = tokio::task::spawn_blocking(|| EtcdCluster::start(1))
        .await
        .expect("start etcd")
    else {
        return;
    };
    let member = cluster.endpoints()[0].clone();
    let port: u16 = member
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .expect("the member's port");
    let proxy = dlock_testkit::redis::DelayProxy::start(port);
    let slow = LockProvider::connect(&format!(
        "etcd://127.0.0.1:{}?lease=4s&timeout=3s",
        proxy.port()
    ))
    .await
    .expect("connect through the proxy");
    let other = LockProvider::connect(&url(&cluster))
        .await
        .expect("connect");
    // The connection and its paths set up while answers are prompt.
    slow.try_acquire(&unique_key("warm"))
        .await
        .expect("free")
        .release()
        .await
        .expect("release");

    // Just under: kept.
    let key = unique_key("boundary-under");
    proxy.set_reply_delay(LEASE * 175 / 1000);
    let sent = Instant::now();
    let guard = slow.try_acquire(&key).await.unwrap_or_else(|e| {
        panic!(
            "an answer after {:?} (35 % of the lease): {e}",
            sent.elapsed()
        )
    });
    let took = sent.elapsed();
    proxy.set_reply_delay(Duration::ZERO);
    eprintln!("held back 35 %: answered after {took:?}");
    assert!(
        took >= LEASE * 35 / 100,
        "premise: both answers held back ({took:?})"
    );
    assert!(!guard.is_lost());
    assert!(matches!(
        other.try_acquire(&key).await,
        Err(LockError::AlreadyHeld { .. })
    ));
    guard
        .release()
        .await
        .expect("the lock answered at 35 % is held");

    // Just over: refused and given back.
    let key = unique_key("boundary-over");
    proxy.set_reply_delay(LEASE * 225 / 1000);
    let sent = Instant::now();
    match slow.try_acquire(&key).await {
        Err(LockError::Lost { reason, .. }) => assert!(reason.contains("lease"), "{reason}"),
        other => panic!(
            "a lock answered after {:?} (45 % of the lease): {other:?}, not Lost",
            sent.elapsed()
        ),
    }
    proxy.set_reply_delay(Duration::ZERO);
    // Given back, well before the 4 s lease would have freed it.
    let theirs = other
        .acquire(&key, LEASE / 2)
        .await
        .expect("the late lock was given back");
    theirs.release().await.expect("release");
}
