//! Redis Cluster (`redis+cluster://`), on real clusters of three masters started by the test
//! kit: the conformance suite on one cluster shared by its cases, and, each on a cluster of
//! its own (with a replica per master where it needs them), keys on every master, the plain
//! key layout's slots, the cluster builder and `wait_replicas`, wake-ups from every master, a
//! slot migrated under load, releases in a moving slot, and failovers (takeover with and without `wait_replicas`, a
//! killed master). A cluster of its own costs a case two seconds or more: a Redis master turns
//! its cluster state ok only two seconds after it started.
#![cfg(feature = "redis")]

use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dlock::redis::RedisBackend;
use dlock::{LockError, LockProvider};
use dlock_testkit::redis::{LeaseHarness, RedisCluster, woken_only};
use dlock_testkit::{unique_key, wait_until};

/// A cluster of three masters with `replicas` replicas each, of the caller's own.
fn cluster(replicas: usize) -> Option<RedisCluster> {
    started(|| RedisCluster::start_with(3, replicas, Duration::from_secs(1)))
}

/// Runs `start` off the runtime's worker threads (it blocks; a missing binary fails the test
/// there).
fn started<T>(start: impl FnOnce() -> Option<T>) -> Option<T> {
    tokio::task::block_in_place(start)
}

dlock_testkit::conformance_suite!(optional async {
    // One cluster of three masters for every case (no replicas: the suite is about the
    // protocol), each case on keys of its own: a cluster takes two seconds to settle, most
    // cases less.
    let harness = LeaseHarness::start(started(RedisCluster::shared)?).await;
    assert!(harness.backend().is_cluster());
    Some(harness)
});

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

/// Locks on every master renewed together: their renewals, due at once, go out one pipeline
/// per lock (a Cluster pipeline stays in one slot), and every lock outlives many leases.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locks_on_every_master_are_renewed_together() {
    let Some(cluster) = cluster(0) else {
        return;
    };
    // Renewed every second, up to 100 ms early with others: the 40 acquisitions, made at
    // once, are renewed together.
    let url = cluster.url("lease=3s");
    let backend = RedisBackend::connect(&url).await.expect("connect");
    let locks = LockProvider::from_backend(backend.clone());
    let prefix = unique_key("renewed");
    let keys: Vec<String> = (0..40).map(|i| format!("{prefix}:{i}")).collect();
    let masters: HashSet<u16> = tokio::task::block_in_place(|| {
        keys.iter()
            .map(|key| cluster.owner_of(cluster.slot_of(&backend.storage_key(key))))
            .collect()
    });
    assert_eq!(masters.len(), 3, "keys on every master");
    let guards = futures::future::join_all(keys.iter().map(|key| locks.try_acquire(key))).await;
    let guards: Vec<_> = guards.into_iter().map(|g| g.expect("free")).collect();
    for guard in &guards {
        let left = guard.remaining_lease().expect("leased");
        assert!(left <= Duration::from_secs(3), "{left:?}");
    }
    // Held past the local deadline (2.4 s) and the lease: only if renewed.
    tokio::time::sleep(Duration::from_secs(4)).await;
    for guard in &guards {
        assert!(!guard.is_lost(), "{} was lost", guard.key());
        assert!(guard.verify_still_held().await.expect("verify"));
    }
    for guard in guards {
        guard.release().await.expect("release");
    }
}

/// Shared fencing counters live outside the locks' slots: refused on a Cluster, at connect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fencing_counters_are_refused() {
    let Some(cluster) = cluster(0) else {
        return;
    };
    match RedisBackend::connect(&cluster.url("fencing_counters=16")).await {
        Err(LockError::Config { message }) => {
            assert!(message.contains("Redis Cluster"), "{message}");
        }
        other => panic!("expected a Config error, got {other:?}"),
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

/// One critical section of the exclusion checker.
struct Section {
    key: usize,
    start: Instant,
    end: Instant,
    token: u64,
    /// The holder was told of the loss (`is_lost()`, which the lost token also sets) before
    /// the section ended: the only excuse from the overlap and token checks.
    told: bool,
    /// The release answered an error (counted, and bounded, apart: a failed release is no
    /// excuse, as the section may have overlapped another all the same).
    release_failed: bool,
}

#[derive(Debug, Default)]
#[allow(dead_code)] // Every field is read through `Debug`, in the printed report.
struct Report {
    sections: usize,
    /// Sections whose holder was told of the loss before they ended (excused).
    told_of_loss: usize,
    /// Sections whose release answered an error (checked all the same).
    release_errors: usize,
    /// Failed acquisitions and releases, and each distinct message (its first 120 bytes)
    /// with its count.
    errors: usize,
    error_kinds: BTreeMap<String, usize>,
    overlaps: usize,
    token_inversions: usize,
    longest_gap: Duration,
}

/// Providers (one backend each, as processes would have) × tasks that take `keys` in short
/// sections until stopped, recording each section.
struct Contention {
    keys: Vec<String>,
    sections: Arc<Mutex<Vec<Section>>>,
    errors: Arc<Mutex<Vec<String>>>,
    stop: Arc<AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Contention {
    async fn start(url: &str, providers: usize, tasks: usize, keys: Vec<String>) -> Contention {
        let sections = Arc::new(Mutex::new(Vec::<Section>::new()));
        let errors = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let mut handles = Vec::new();
        for p in 0..providers {
            let locks = LockProvider::connect(url).await.expect("connect");
            for t in 0..tasks {
                let (locks, keys, sections, errors, stop) = (
                    locks.clone(),
                    keys.clone(),
                    Arc::clone(&sections),
                    Arc::clone(&errors),
                    Arc::clone(&stop),
                );
                handles.push(tokio::spawn(async move {
                    let mut n = p * tasks + t;
                    while !stop.load(Ordering::SeqCst) {
                        n += 1;
                        let key = n % keys.len();
                        let guard = match locks.acquire(&keys[key], Duration::from_secs(10)).await {
                            Ok(guard) => guard,
                            Err(err) => {
                                errors.lock().unwrap().push(err.to_string());
                                tokio::time::sleep(Duration::from_millis(10)).await;
                                continue;
                            }
                        };
                        let start = Instant::now();
                        let token = guard.fencing_token().expect("fenced");
                        tokio::time::sleep(Duration::from_millis(2)).await;
                        let told = guard.is_lost();
                        let end = Instant::now();
                        let released = guard.release().await;
                        if let Err(err) = &released {
                            errors.lock().unwrap().push(format!("release: {err}"));
                        }
                        sections.lock().unwrap().push(Section {
                            key,
                            start,
                            end,
                            token,
                            told,
                            release_failed: released.is_err(),
                        });
                    }
                }));
            }
        }
        Contention {
            keys,
            sections,
            errors,
            stop,
            tasks: handles,
        }
    }

    /// Sections finished so far.
    fn count(&self) -> usize {
        self.sections.lock().unwrap().len()
    }

    /// Waits until `more` further sections have finished (at most `limit`).
    async fn progress(&self, more: usize, limit: Duration) {
        let target = self.count() + more;
        let started = Instant::now();
        wait_until("sections complete", limit, async || {
            let done = self.count() >= target;
            if !done && started.elapsed() > limit - Duration::from_millis(100) {
                let errors = self.errors.lock().unwrap();
                eprintln!(
                    "stuck; {} errors, the last: {:?}",
                    errors.len(),
                    errors.last()
                );
            }
            done
        })
        .await;
    }

    /// Stops the tasks and checks the sections: overlaps among the sections whose holder was
    /// not told of the loss before they ended (a failed release is no excuse: those are
    /// counted apart), and fencing tokens in the order of the sections.
    async fn finish(self) -> Report {
        self.stop.store(true, Ordering::SeqCst);
        for task in self.tasks {
            task.await.expect("no panic");
        }
        let mut sections = std::mem::take(&mut *self.sections.lock().unwrap());
        sections.sort_by_key(|s| s.start);
        let mut report = Report {
            sections: sections.len(),
            told_of_loss: sections.iter().filter(|s| s.told).count(),
            release_errors: sections.iter().filter(|s| s.release_failed).count(),
            ..Report::default()
        };
        for error in std::mem::take(&mut *self.errors.lock().unwrap()) {
            report.errors += 1;
            let short: String = error.chars().take(120).collect();
            *report.error_kinds.entry(short).or_default() += 1;
        }
        for key in 0..self.keys.len() {
            let checked: Vec<&Section> = sections
                .iter()
                .filter(|s| s.key == key && !s.told)
                .collect();
            for (i, a) in checked.iter().enumerate() {
                for b in &checked[i + 1..] {
                    if b.start < a.end && a.start < b.end {
                        report.overlaps += 1;
                    }
                }
            }
            for pair in checked.windows(2) {
                if pair[1].token <= pair[0].token {
                    report.token_inversions += 1;
                }
            }
            let all: Vec<&Section> = sections.iter().filter(|s| s.key == key).collect();
            for pair in all.windows(2) {
                report.longest_gap = report.longest_gap.max(pair[1].start - pair[0].end);
            }
        }
        report
    }
}

/// The slot of a contended key moves between masters while four providers × two tasks take
/// it in short sections: first step by step (`SETSLOT IMPORTING / MIGRATING`, then `MIGRATE`
/// one key at a time, so that the lock and its counter are for a while on different masters
/// and its scripts are answered `TRYAGAIN`, its single-key commands `ASK`), then at once to a
/// third master (stale slot maps answered `MOVED`). The driver follows every redirection:
/// no acquisition or release fails, no two holders overlap, and fencing tokens strictly
/// increase across both moves (the counter moves with the lock).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slot_migration_under_load() {
    let Some(cluster) = cluster(0) else {
        return;
    };
    let url = cluster.url("lease=2s");
    let backend = RedisBackend::connect(&url).await.expect("connect");
    let hot = unique_key("migrating");
    let storage = backend.storage_key(&hot);
    let (slot, from) = tokio::task::block_in_place(|| {
        let slot = cluster.slot_of(&storage);
        (slot, cluster.owner_of(slot))
    });
    let masters = tokio::task::block_in_place(|| cluster.masters());
    let others: Vec<u16> = masters.into_iter().filter(|p| *p != from).collect();
    let (to, third) = (others[0], others[1]);
    let contention = Contention::start(&url, 4, 2, vec![hot.clone()]).await;
    let limit = Duration::from_secs(20);
    contention.progress(50, limit).await;

    // Step by step: the lock and its counter move one at a time. Meanwhile, a fenced
    // acquisition (a script on both keys) is refused with TRYAGAIN by both masters whenever
    // one of its keys is missing on the node asked (the free lock's key always is), until
    // the slot has moved; renewals and releases (one key) follow ASK.
    let tryagain = || {
        [from, to]
            .iter()
            .map(|p| {
                cluster
                    .node(*p)
                    .error_counts()
                    .get("TRYAGAIN")
                    .copied()
                    .unwrap_or(0)
            })
            .sum::<u64>()
    };
    let before = tokio::task::block_in_place(tryagain);
    let migrating = Instant::now();
    tokio::task::block_in_place(|| cluster.begin_migration(slot, from, to));
    // Long enough for the driver's retries of some acquisitions to run out (16 of them, 20 ms
    // doubling to 500 ms, jittered: about 3 s; the four providers' acquisitions are refused
    // about 80 times by then): their waits try again by themselves.
    wait_until(
        "acquisitions are refused while the slot moves",
        limit,
        async || tokio::task::block_in_place(tryagain) > before + 80,
    )
    .await;
    while tokio::task::block_in_place(|| cluster.migrate_keys(slot, from, to, 1)) > 0 {}
    tokio::task::block_in_place(|| cluster.finish_migration(slot, from, to));
    let step_by_step = migrating.elapsed();
    contention.progress(50, limit).await;

    // At once, to the third master.
    tokio::task::block_in_place(|| cluster.migrate_slot(slot, to, third));
    contention.progress(50, limit).await;
    let report = contention.finish().await;
    eprintln!(
        "cluster-figures slot migration: {report:?}; the step-by-step migration took \
         {step_by_step:?}"
    );
    assert_eq!(report.errors, 0, "{report:?}");
    assert_eq!(report.told_of_loss, 0, "{report:?}");
    assert_eq!(report.overlaps, 0, "{report:?}");
    assert_eq!(report.token_inversions, 0, "{report:?}");
    // The lock and its counter live on the third master now.
    let on_third = tokio::task::block_in_place(|| {
        cluster.command(third, &[b"EXISTS", &backend.fencing_key(&hot)])
    });
    assert_eq!(on_third.ok(), Some(redis::Value::Int(1)));
}

/// A lock nobody waits for is released while its slot moves. Its release script also reads the
/// key's waiting mark, which is on neither master, so they refuse it (`TRYAGAIN`: a script's
/// keys must all be on the node asked while the slot migrates); past the driver's retries the
/// release goes again with the lock's key alone, and the backend's next releases leave the
/// mark out for a while, so they are not refused. Once with the lock's key on the old master,
/// once with it taken on the new one (an unfenced `SET`, which follows `ASK`): each release
/// succeeds and leaves no key behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn releases_go_through_while_the_slot_moves() {
    let Some(cluster) = cluster(0) else {
        return;
    };
    let url = cluster.url("lease=10s&fencing=false");
    let locks = LockProvider::connect(&url).await.expect("connect");
    let backend = RedisBackend::connect(&url).await.expect("connect");
    let key = unique_key("moving-release");
    let storage = backend.storage_key(&key);
    let (slot, from) = tokio::task::block_in_place(|| {
        let slot = cluster.slot_of(&storage);
        (slot, cluster.owner_of(slot))
    });
    let to = tokio::task::block_in_place(|| cluster.masters())
        .into_iter()
        .find(|p| *p != from)
        .expect("another master");
    // Whether the lock's key is on the master on `port`: a migrating master answers `ASK`
    // for a key it does not have.
    let exists = |port: u16| match tokio::task::block_in_place(|| {
        cluster.command(port, &[b"EXISTS".as_slice(), storage.as_slice()])
    }) {
        Ok(redis::Value::Int(n)) => n == 1,
        Err(err) if err.code() == Some("ASK") => false,
        other => panic!("EXISTS answered {other:?}"),
    };
    let refusals = || {
        tokio::task::block_in_place(|| {
            [from, to]
                .iter()
                .map(|p| {
                    let counts = cluster.node(*p).error_counts();
                    counts.get("TRYAGAIN").copied().unwrap_or(0)
                })
                .sum::<u64>()
        })
    };
    let held = locks
        .try_acquire(&key)
        .await
        .expect("taken before the move");
    tokio::task::block_in_place(|| cluster.begin_migration(slot, from, to));
    let (before, started) = (refusals(), Instant::now());
    held.release().await.expect("released on the old master");
    let on_old = started.elapsed();
    assert!(refusals() > before, "the marked release was refused");
    assert!(!exists(from), "released on the old master");
    let held = locks
        .try_acquire(&key)
        .await
        .expect("taken on the new master");
    assert!(!exists(from), "taken on the new master, not the old");
    let (before, started) = (refusals(), Instant::now());
    held.release().await.expect("released on the new master");
    let on_new = started.elapsed();
    assert_eq!(refusals(), before, "the next release left the mark out");
    tokio::task::block_in_place(|| cluster.finish_migration(slot, from, to));
    assert!(!exists(to), "nothing left behind");
    eprintln!("cluster-figures releases in a moving slot took {on_old:?} and {on_new:?}");
}

/// What a failover run found, besides the sections.
#[derive(Debug)]
#[allow(dead_code)] // Every field is read through `Debug`, in the printed report.
struct Failover {
    report: Report,
    /// From the failover's start until every live node agreed on the new master.
    promoted: Duration,
    /// A lock held across the failover (its key replicated before): still held and
    /// excluding afterwards, or told lost (and after how long).
    held_lock: String,
}

/// Four providers × two tasks take two hot keys of one master's slots in short sections
/// while that master fails over to its replica: `CLUSTER FAILOVER TAKEOVER` on the replica
/// (promoted at once, while the old master still runs and takes writes until it hears of
/// the new epoch), or SIGKILL of the master (the replica is promoted after the node timeout
/// and an election). A lock held across it says what happens to held locks.
async fn failover_run(options: &str, kill: bool) -> Option<Failover> {
    let mut cluster = cluster(1)?;
    let url = cluster.url(options);
    let backend = RedisBackend::connect(&url).await.expect("connect");
    let prefix = unique_key("failover");
    let owner = |key: &str| {
        let storage = backend.storage_key(key);
        tokio::task::block_in_place(|| cluster.owner_of(cluster.slot_of(&storage)))
    };
    let first = format!("{prefix}:0");
    let master = owner(&first);
    let mut same = (1..)
        .map(|i| format!("{prefix}:{i}"))
        .filter(|k| owner(k) == master);
    let (second, held_key) = (same.next().unwrap(), same.next().unwrap());
    let replica = tokio::task::block_in_place(|| cluster.replicas_of(master))[0];

    // The lock held across: taken, then awaited on the replica.
    let holder = LockProvider::from_backend(backend.clone());
    let held = holder.try_acquire(&held_key).await.expect("free");
    let storage = backend.storage_key(&held_key);
    let mut replica_conn = cluster
        .node(replica)
        .client()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let _: () = redis::cmd("READONLY")
        .query_async(&mut replica_conn)
        .await
        .unwrap();
    wait_until(
        "the replica has the held key",
        Duration::from_secs(5),
        async || {
            redis::cmd("EXISTS")
                .arg(&storage)
                .query_async::<i64>(&mut replica_conn)
                .await
                == Ok(1)
        },
    )
    .await;

    let contention = Contention::start(&url, 4, 2, vec![first, second]).await;
    let limit = Duration::from_secs(30);
    contention.progress(100, limit).await;
    let started = Instant::now();
    let watch = {
        let lost = held.lost_token().clone();
        tokio::spawn(async move {
            lost.cancelled().await;
            started.elapsed()
        })
    };
    let new = if kill {
        tokio::task::block_in_place(|| cluster.kill_master(master))
    } else {
        tokio::task::block_in_place(|| cluster.failover(master, true))
    };
    let promoted = started.elapsed();
    assert_eq!(new, replica);
    // Every provider locks on the new master for a while.
    contention.progress(200, limit).await;
    let report = contention.finish().await;
    let held_lock = if held.is_lost() {
        let told = watch.await.unwrap();
        format!("told lost {told:?} after the failover began")
    } else {
        let other = LockProvider::connect(&url).await.expect("connect");
        let excluded = matches!(
            other.try_acquire(&held_key).await,
            Err(LockError::AlreadyHeld { .. })
        );
        let verified = held.verify_still_held().await;
        format!("still held (verified: {verified:?}, excludes another provider: {excluded})")
    };
    drop(held);
    Some(Failover {
        report,
        promoted,
        held_lock,
    })
}

/// Without `wait_replicas`, a failover is not promised to keep exclusion, and this run
/// shows what it does rather than asserting it: with `TAKEOVER`, the old master takes writes
/// until it hears of the promotion, which the new master never sees, so holders can overlap
/// and fencing tokens can repeat. The run must recover: every provider locks on the new
/// master afterwards. What it found is printed; RELIABILITY.md records it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exclusion_across_a_takeover() {
    let Some(run) = failover_run("lease=2s", false).await else {
        return;
    };
    eprintln!("cluster-figures takeover wait_replicas=0: {run:?}");
    assert!(run.report.sections > 300, "{run:?}");
}

/// With `wait_replicas=1` (each master has one replica), an acquisition counts only once
/// the master's replica has it: the promoted replica holds every counted lock and counter,
/// and the old master, left without its replica at the promotion, counts no acquisition
/// after it. No overlaps, and fencing tokens strictly increase across the takeover.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exclusion_across_a_takeover_with_wait_replicas() {
    let Some(run) = failover_run("lease=2s&wait_replicas=1&wait_timeout=200ms", false).await else {
        return;
    };
    eprintln!("cluster-figures takeover wait_replicas=1: {run:?}");
    assert!(run.report.sections > 300, "{run:?}");
    assert_eq!(run.report.overlaps, 0, "{run:?}");
    assert_eq!(run.report.token_inversions, 0, "{run:?}");
    // A release fails only for a section that straddles the move of its slot to the new
    // master (granted by one, answered by the other or by the demoted one). Each of the
    // 4 × 2 tasks holds one section at a time, and the slot moves once, so at most one
    // release per task fails.
    assert!(run.report.release_errors <= 8, "{run:?}");
}

/// The master is killed (SIGKILL): its replica is promoted after the node timeout (1 s)
/// and an election; meanwhile the slot has no master, and its commands wait or fail. What
/// happens to the sections and to a held lock is printed; the run must recover.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exclusion_across_a_killed_master() {
    let Some(run) = failover_run("lease=2s", true).await else {
        return;
    };
    eprintln!("cluster-figures killed master wait_replicas=0: {run:?}");
    assert!(run.report.sections > 300, "{run:?}");
}

/// Releases wake waiters on every master, and each waiter listens on the master of its key's
/// slot, which hears the release's `PUBLISH` first hand (`PUBSUB NUMSUB` counts only a node's
/// own subscribers: 1 there, 0 on the other masters).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn releases_on_every_master_wake_waiters() {
    let Some(cluster) = cluster(0) else {
        return;
    };
    let url = cluster.url("lease=60s");
    wake_a_waiter_on_every_master(&cluster, &url, |owner| owner).await;
}

/// A user who may not read the slot map (`-cluster|nodes`) still has its waiters woken: they
/// listen on the URL's first node, which hears every release over the cluster bus.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_slot_map_waiters_listen_on_the_first_node() {
    let Some(cluster) = cluster(0) else {
        return;
    };
    for port in cluster.ports() {
        tokio::task::block_in_place(|| {
            cluster.command(
                port,
                &[
                    b"ACL",
                    b"SETUSER",
                    b"waiter",
                    b"on",
                    b">pw",
                    b"~*",
                    b"&*",
                    b"+@all",
                    b"-cluster|nodes",
                ],
            )
        })
        .expect("ACL SETUSER");
    }
    let url =
        cluster
            .url("lease=60s")
            .replacen("redis+cluster://", "redis+cluster://waiter:pw@", 1);
    let first = cluster.ports()[0];
    wake_a_waiter_on_every_master(&cluster, &url, |_| first).await;
}

/// On a key of each master: a holder takes it, a waiter waits for it (fallback poll 1 h, the
/// holder's lease a minute, so only a wake-up lets it in within the limit) and subscribes on
/// the node `listens_on` names for the key's master, and on no other master; the release wakes
/// it.
async fn wake_a_waiter_on_every_master(
    cluster: &RedisCluster,
    url: &str,
    listens_on: impl Fn(u16) -> u16,
) {
    let backend = RedisBackend::connect(url).await.expect("connect");
    let waiters = woken_only(backend.clone());
    let holder = LockProvider::connect(url).await.expect("connect");
    // One key on each master.
    let prefix = unique_key("woken");
    let mut keys = BTreeMap::new();
    for i in 0.. {
        let key = format!("{prefix}:{i}");
        let storage = backend.storage_key(&key);
        let owner = tokio::task::block_in_place(|| cluster.owner_of(cluster.slot_of(&storage)));
        keys.entry(owner).or_insert(key);
        if keys.len() == 3 {
            break;
        }
    }
    let numsub = |port: u16, channel: &[u8]| {
        tokio::task::block_in_place(|| {
            match cluster.command(port, &[b"PUBSUB", b"NUMSUB", channel]) {
                Ok(redis::Value::Array(items)) => match items.get(1) {
                    Some(redis::Value::Int(n)) => *n,
                    other => panic!("PUBSUB NUMSUB answered {other:?}"),
                },
                other => panic!("PUBSUB NUMSUB answered {other:?}"),
            }
        })
    };
    for (&owner, key) in &keys {
        let guard = holder.try_acquire(key).await.expect("free");
        let waiter = {
            let (waiters, key) = (waiters.clone(), key.clone());
            tokio::spawn(async move { waiters.acquire(&key, Duration::from_secs(600)).await })
        };
        // The waiter has tried once and subscribed, where it should only.
        let channel = backend.storage_key(key);
        let node = listens_on(owner);
        wait_until(
            "the waiter subscribes",
            Duration::from_secs(10),
            async || numsub(node, &channel) == 1,
        )
        .await;
        for other in keys.keys().filter(|&&port| port != node) {
            assert_eq!(
                numsub(*other, &channel),
                0,
                "subscribed on {other}, not {node}"
            );
        }
        guard.release().await.expect("release");
        tokio::time::timeout(Duration::from_secs(20), waiter)
            .await
            .expect("the release woke the waiter")
            .unwrap()
            .expect("acquired")
            .release()
            .await
            .unwrap();
    }
}

/// `PUBLISH` commands the cluster's nodes ran.
fn publishes(cluster: &RedisCluster) -> u64 {
    tokio::task::block_in_place(|| {
        cluster
            .nodes
            .iter()
            .map(|n| n.command_calls().get("publish").copied().unwrap_or(0))
            .sum()
    })
}

/// On a Cluster of servers with a native conditional delete (`DELEX` on Redis 8.4+,
/// `DELIFEQ` on Valkey 9), a release nobody waits for publishes nothing (classic `PUBLISH`
/// is broadcast to every node), and one that a waiter waits for still wakes it: the delete's
/// pipeline reads the waiting mark, and the announcement follows only while it lives.
async fn native_releases_announce_only_when_awaited(flavor: dlock_testkit::redis::Flavor) {
    let Some(cluster) =
        started(|| RedisCluster::start_flavor(flavor, 3, 0, Duration::from_secs(1)))
    else {
        return;
    };
    for fencing in [false, true] {
        let url = cluster.url(&format!("lease=30s&fencing={fencing}"));
        let backend = RedisBackend::connect(&url).await.expect("connect");
        let locks = woken_only(backend.clone());
        // The first release finds out that the server has the command.
        let guard = locks.try_acquire(&unique_key("first")).await.unwrap();
        guard.release().await.unwrap();
        let before = publishes(&cluster);
        for i in 0..20 {
            let guard = locks
                .try_acquire(&unique_key(&format!("alone-{i}")))
                .await
                .unwrap();
            guard.release().await.unwrap();
        }
        let after = publishes(&cluster);
        assert_eq!(
            after - before,
            0,
            "{flavor:?}, fencing={fencing}: releases nobody waited for published"
        );

        awaited_release_wakes(&cluster, &url, &locks, false).await;
        assert!(
            publishes(&cluster) > after,
            "{flavor:?}: the awaited release was announced"
        );
    }
}

/// A provider on `url` holds a key (a reader's share with `read`); a waiter of `locks` (whose
/// backend marks waits, and whose fallback poll is an hour) waits for it, and once its waiting
/// mark is on the key, the holder's release must wake it within 5 s.
async fn awaited_release_wakes(
    cluster: &RedisCluster,
    url: &str,
    locks: &LockProvider,
    read: bool,
) {
    let key = unique_key("awaited");
    let holder = LockProvider::connect(url).await.unwrap();
    let guard = if read {
        holder.try_acquire_read(&key).await.unwrap()
    } else {
        holder.try_acquire(&key).await.unwrap()
    };
    let waiter = {
        let (locks, key) = (locks.clone(), key.clone());
        tokio::spawn(async move { locks.acquire(&key, Duration::from_secs(600)).await })
    };
    let backend = RedisBackend::connect(url).await.expect("connect");
    let mark = [backend.storage_key(&key), b":waiting".to_vec()].concat();
    wait_until(
        "the waiter marks the key",
        Duration::from_secs(20),
        async || {
            let port = cluster.owner_of(cluster.slot_of(&mark));
            let exists = cluster.command(port, &[b"EXISTS", &mark]);
            matches!(exists, Ok(redis::Value::Int(1)))
        },
    )
    .await;
    let released = Instant::now();
    guard.release().await.unwrap();
    let next = tokio::time::timeout(Duration::from_secs(20), waiter)
        .await
        .expect("the release woke the waiter")
        .unwrap()
        .unwrap();
    assert!(
        released.elapsed() < Duration::from_secs(5),
        "{:?}",
        released.elapsed()
    );
    next.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delifeq_releases_announce_only_when_awaited() {
    native_releases_announce_only_when_awaited(dlock_testkit::redis::Flavor::Valkey91).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delex_releases_announce_only_when_awaited() {
    native_releases_announce_only_when_awaited(dlock_testkit::redis::Flavor::Redis8).await;
}

/// The last reader's release frees the key, and publishes only while someone waits for it: the
/// read release script reads the waiting mark, as the lock's release does (`PUBLISH` is a
/// broadcast to every node of a Cluster). A writer that waits for the readers is still woken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_releases_announce_only_when_awaited() {
    let Some(cluster) = started(|| RedisCluster::start_with(3, 0, Duration::from_secs(1))) else {
        return;
    };
    let url = cluster.url("lease=30s");
    let backend = RedisBackend::connect(&url).await.expect("connect");
    let locks = woken_only(backend.clone());
    let before = publishes(&cluster);
    for i in 0..20 {
        let key = unique_key(&format!("read-alone-{i}"));
        let first = locks.try_acquire_read(&key).await.unwrap();
        let second = locks.try_acquire_read(&key).await.unwrap();
        first.release().await.unwrap();
        second.release().await.unwrap();
    }
    let after = publishes(&cluster);
    assert_eq!(
        after - before,
        0,
        "read releases nobody waited for published"
    );

    awaited_release_wakes(&cluster, &url, &locks, true).await;
    assert!(
        publishes(&cluster) > after,
        "the awaited read release was announced"
    );
}

/// A semaphore's permits on a cluster (the store of `LockBackend::semaphores`): each
/// semaphore's keys (its permits, count record, waiting mark and fencing counter) share its
/// slot, so one script reaches them; semaphores spread over the masters; on each, the bound,
/// the count record and the waiting mark hold, fencing tokens increase, a release wakes the
/// head waiter through the subscriber on the semaphore's master, and `store_locks` lists the
/// semaphore once with its holders.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn semaphores_on_every_master() {
    use dlock::backend::{LockBackend, PermitRequest, PermitTry};
    let Some(cluster) = started(RedisCluster::shared) else {
        return;
    };
    let url = cluster.url("lease=5s");
    let a = RedisBackend::connect(&url).await.expect("connect");
    let b = RedisBackend::connect(&url).await.expect("connect");
    let (sa, sb) = (a.semaphores().unwrap(), b.semaphores().unwrap());
    let prefix = unique_key("permits");
    let names: Vec<String> = (0..12).map(|i| format!("{prefix}:{i}")).collect();
    let mut owners = BTreeMap::<u16, usize>::new();
    for name in &names {
        let permits = [a.storage_key(name), b":permits".to_vec()].concat();
        let slots: HashSet<u16> = tokio::task::block_in_place(|| {
            [&b""[..], b":count", b":waiting", b":fence"]
                .iter()
                .map(|suffix| cluster.slot_of(&[&permits[..], suffix].concat()))
                .collect()
        });
        assert_eq!(slots.len(), 1, "a semaphore's keys share a slot");
        let slot = *slots.iter().next().unwrap();
        *owners
            .entry(tokio::task::block_in_place(|| cluster.owner_of(slot)))
            .or_default() += 1;
    }
    assert_eq!(owners.len(), 3, "semaphores on every master: {owners:?}");
    let take =
        async |store: &dyn dlock::backend::PermitStore, request: PermitRequest<'_>| match store
            .try_acquire_permit(request)
            .await
            .expect("a try")
        {
            PermitTry::Acquired(acquired) => acquired,
            other => panic!("{request:?}: {other:?}"),
        };
    let is_full = async |store: &dyn dlock::backend::PermitStore, request: PermitRequest<'_>| {
        matches!(
            store.try_acquire_permit(request).await.expect("a try"),
            PermitTry::Full { .. }
        )
    };
    let mut held = Vec::new();
    for name in &names {
        let first = take(sa, PermitRequest::new(name, 2)).await;
        let second = take(sb, PermitRequest::new(name, 2)).await;
        assert!(first.fencing_token.unwrap() < second.fencing_token.unwrap());
        assert!(is_full(sa, PermitRequest::new(name, 2)).await);
        let err = sb
            .try_acquire_permit(PermitRequest::new(name, 3))
            .await
            .expect_err("another count while held");
        assert!(err.to_string().contains("max_count 2"), "{err}");
        held.push((first, second));
    }
    let listed = a.store_locks(&[]).await.expect("store_locks");
    for name in &names {
        let entries: Vec<_> = listed
            .iter()
            .filter(|l| l.key.as_deref() == Some(name.as_str()))
            .collect();
        assert_eq!(entries.len(), 1, "{name}: {entries:?}");
        assert_eq!(entries[0].readers, 2, "{:?}", entries[0]);
        assert!(
            entries[0].resource.ends_with(":permits"),
            "{:?}",
            entries[0]
        );
    }
    // The head waiter of each semaphore is woken by a release on the semaphore's master.
    for (name, (first, second)) in names.iter().zip(held) {
        let waiting = PermitRequest::new(name, 2).with_waiting(Some(Duration::from_secs(5)));
        assert!(is_full(sa, waiting).await);
        let mut watch = sa
            .watch_permits(waiting)
            .await
            .expect("a URL's backend wakes waiters");
        assert!(watch.is_live(), "{name}");
        watch.mark_seen();
        assert!(is_full(sb, PermitRequest::new(name, 2)).await);
        second.handle.release().await.expect("release");
        tokio::time::timeout(Duration::from_secs(5), watch.woken())
            .await
            .unwrap_or_else(|_| panic!("{name}: the release does not wake the head waiter"));
        // Free, but the head waiter goes first.
        assert!(is_full(sb, PermitRequest::new(name, 2)).await);
        let third = take(sa, waiting).await;
        third.handle.release().await.expect("release");
        first.handle.release().await.expect("release");
        assert_eq!(sb.holders(name, 2).await.unwrap(), 0);
    }
}

/// With `key_layout=plain`, a semaphore's keys are the name's keys plus suffixes: on a
/// cluster, a name without a hash tag spreads them over slots and its try is refused
/// (`CROSSSLOT`, taking nothing); a name with one works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_layout_semaphores_need_hash_tags() {
    use dlock::backend::{LockBackend, PermitRequest, PermitTry};
    let Some(cluster) = started(RedisCluster::shared) else {
        return;
    };
    let plain = RedisBackend::connect(&cluster.url("key_layout=plain&lease=5s"))
        .await
        .expect("connect");
    let store = plain.semaphores().unwrap();
    let name = (0..)
        .map(|i| unique_key(&format!("plain-permits{i}")))
        .find(|k| {
            let permits = [plain.storage_key(k), b"\xff:permits".to_vec()].concat();
            let record = [&permits[..], b"\xff:count"].concat();
            tokio::task::block_in_place(|| cluster.slot_of(&permits) != cluster.slot_of(&record))
        })
        .unwrap();
    match store.try_acquire_permit(PermitRequest::new(&name, 1)).await {
        Err(LockError::Backend {
            db_code, message, ..
        }) => {
            assert_eq!(db_code.as_deref(), Some("CROSSSLOT"), "{message}");
            assert!(message.contains("semaphore"), "{message}");
        }
        other => panic!("expected a CROSSSLOT error, got {other:?}"),
    }
    let tagged = format!("{{{name}}}");
    match store
        .try_acquire_permit(PermitRequest::new(&tagged, 1))
        .await
        .expect("a tagged name works")
    {
        PermitTry::Acquired(permit) => {
            assert!(permit.fencing_token.is_some());
            permit.handle.release().await.unwrap();
        }
        other => panic!("{other:?}"),
    }
}

/// Releases sent while a master fails over to its replica (`CLUSTER FAILOVER`, which waits
/// until the replica has every write, so the held keys move with it): a node that stopped
/// being the master refuses a command it did not run (`READONLY`, `MOVED` past the driver's
/// own retries, `CLUSTERDOWN`), and such a release goes again on the new map. Every release
/// succeeds, and no key is left on the new master to run out its lease there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn releases_go_through_a_failover() {
    let Some(cluster) = cluster(1) else {
        return;
    };
    let url = cluster.url("lease=60s");
    let locks = LockProvider::connect(&url).await.expect("connect");
    let backend = RedisBackend::connect(&url).await.expect("connect");
    let master = tokio::task::block_in_place(|| cluster.masters())[0];
    // 200 keys in the master's slots, each held.
    let mut keys = Vec::new();
    while keys.len() < 200 {
        let key = unique_key("failover-release");
        let storage = backend.storage_key(&key);
        if tokio::task::block_in_place(|| cluster.owner_of(cluster.slot_of(&storage))) == master {
            keys.push((key, storage));
        }
    }
    let mut held = Vec::new();
    for (key, _) in &keys {
        held.push(locks.try_acquire(key).await.expect("free"));
    }
    // Released one after another, every 5 ms, while the master fails over.
    let releasing = tokio::spawn(async move {
        let mut failed = Vec::new();
        for guard in held {
            let key = guard.key().to_owned();
            if let Err(err) = guard.release().await {
                failed.push(format!("{key}: {err}"));
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        failed
    });
    let new = tokio::task::block_in_place(|| cluster.failover(master, false));
    let failed = releasing.await.expect("the releases");
    assert!(
        failed.is_empty(),
        "{} releases failed: {failed:#?}",
        failed.len()
    );
    let left: Vec<&str> = tokio::task::block_in_place(|| {
        keys.iter()
            .filter(|(_, storage)| {
                matches!(
                    cluster.command(new, &[b"EXISTS".as_slice(), storage.as_slice()]),
                    Ok(redis::Value::Int(1))
                )
            })
            .map(|(key, _)| key.as_str())
            .collect()
    });
    assert!(left.is_empty(), "keys left on the new master: {left:?}");
}
