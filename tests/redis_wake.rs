//! Redis and Valkey waiters are woken by releases: each test gives the waiter a fallback poll
//! (an hour) and a holder's lease far longer than the test's own limit, so a waiter that gets
//! the key in time was woken, or retried at the lease's end, rather than polled. Run on Redis 7
//! (Lua release) and Valkey 9.1 (`DELIFEQ` release, announced in the same pipeline).
#![cfg(feature = "redis")]

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use dlock::redis::RedisBackend;
use dlock::{Backoff, LockError, LockGuard, LockProvider};
use dlock_testkit::redis::{Flavor, RedisServer};
use dlock_testkit::{unique_key, wait_until};

/// Far longer than any wait below may take.
const FALLBACK: Duration = Duration::from_secs(3600);
/// The holders' lease: longer than the limit the tests give a waiter.
const LEASE: &str = "lease=60s";
/// How long a waiter that was woken may take, at most (a loaded machine).
const LIMIT: Duration = Duration::from_secs(20);

fn slow_backoff() -> Backoff {
    Backoff::default().with_fallback_poll(FALLBACK).unwrap()
}

async fn provider(server: &RedisServer, options: &str) -> LockProvider {
    let backend = RedisBackend::connect(&server.url(options)).await.unwrap();
    LockProvider::builder(backend)
        .backoff(slow_backoff())
        .build()
}

async fn admin(server: &RedisServer) -> redis::aio::MultiplexedConnection {
    server
        .client()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

async fn subscribers(server: &RedisServer, channel: &[u8]) -> i64 {
    tokio::task::block_in_place(|| server.subscribers(channel))
}

/// Waits (up to 20 s) until `channel` has `n` subscribers.
async fn await_subscribers(server: &RedisServer, channel: &[u8], n: i64) {
    for _ in 0..2000 {
        if subscribers(server, channel).await == n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the channel never had {n} subscriber(s)");
}

/// The tries the server saw: calls of the acquisition script when the locks are fenced, of
/// `SET` when not (a waiter's try that meets contention also sets the key's waiting mark).
fn tries(server: &RedisServer, fenced: bool) -> u64 {
    let calls = server.command_calls();
    let count = |name: &str| calls.get(name).copied().unwrap_or(0);
    if fenced {
        count("evalsha") + count("eval")
    } else {
        count("set")
    }
}

fn spawn_waiter(
    locks: &LockProvider,
    key: &str,
) -> tokio::task::JoinHandle<Result<LockGuard, LockError>> {
    let (locks, key) = (locks.clone(), key.to_owned());
    tokio::spawn(async move { locks.acquire(&key, Duration::from_secs(600)).await })
}

/// A release wakes the waiter: it gets the key although its fallback poll is an hour and the
/// holder's lease a minute, and it did not poll meanwhile. `options` are the providers' URL
/// options (fenced or not: the waiter marks the key in its script, or with a `SET` of its own).
async fn woken_by_release(server: &RedisServer, options: &str) {
    let fenced = !options.contains("fencing=false");
    let holder = provider(server, options).await;
    let waiters = provider(server, options).await;
    let backend = RedisBackend::connect(&server.url(options)).await.unwrap();
    let key = unique_key("woken");
    let channel = backend.storage_key(&key);
    let guard = holder.try_acquire(&key).await.unwrap();
    let waiter = spawn_waiter(&waiters, &key);
    await_subscribers(server, &channel, 1).await;
    let before = tries(server, fenced);
    // Held for a while: a polling waiter would try again meanwhile.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let polled = tries(server, fenced) - before;
    assert_eq!(polled, 0, "the waiter polled while the key was held");
    guard.release().await.unwrap();
    let got = tokio::time::timeout(LIMIT, waiter)
        .await
        .expect("the release woke the waiter")
        .unwrap()
        .unwrap();
    // Its tries after the release: one, or a few when woken early by the subscription (two
    // commands each without fencing: the try and its mark).
    let after = tries(server, fenced) - before;
    let most = if fenced { 4 } else { 8 };
    assert!(after <= most, "{after} tries after the release");
    got.release().await.unwrap();
    // The waiter's watch ended with its wait.
    await_subscribers(server, &channel, 0).await;
}

/// Releases that nobody waits for announce nothing (on a Cluster, each announcement is a
/// broadcast to every node): a waiter's try marks the key, and only a release of a marked key
/// publishes. The mark lapses soon after its waiter gives up, and releases fall silent again.
/// Servers with a native conditional delete (`DELIFEQ`, `DELEX`) announce every release in
/// the same pipeline (`gated` false); the mark still comes and goes.
async fn unwaited_releases_announce_nothing(server: &RedisServer, gated: bool) {
    let locks = provider(server, LEASE).await;
    let others = provider(server, LEASE).await;
    let backend = RedisBackend::connect(&server.url(LEASE)).await.unwrap();
    let key = unique_key("unwaited");
    let mark = [backend.storage_key(&key), b":waiting".to_vec()].concat();
    let publishes = || calls(server, "publish");
    let before = publishes();
    cycles(&locks, &key, 20).await;
    let expected = if gated { 0 } else { 20 };
    assert_eq!(publishes() - before, expected, "releases nobody waited for");
    // A waiter that gives up leaves a mark that lapses within its pause and a second.
    let guard = locks.try_acquire(&key).await.unwrap();
    let gave_up = others.acquire(&key, Duration::from_millis(300)).await;
    assert!(
        matches!(gave_up, Err(LockError::Timeout { .. })),
        "{gave_up:?}"
    );
    let mut admin = admin(server).await;
    let pttl: i64 = redis::cmd("PTTL")
        .arg(&mark)
        .query_async(&mut admin)
        .await
        .unwrap();
    assert!(
        (1..=1_300).contains(&pttl),
        "the waiting mark lives {pttl} ms"
    );
    let before = publishes();
    wait_until("the waiting mark lapses", LIMIT, async || {
        let exists: i64 = redis::cmd("EXISTS")
            .arg(&mark)
            .query_async(&mut admin)
            .await
            .unwrap();
        exists == 0
    })
    .await;
    guard.release().await.unwrap();
    assert_eq!(
        publishes() - before,
        u64::from(!gated),
        "a release after the mark lapsed"
    );
}

/// A user whose key patterns cover the lock keys (and, with fencing, their counters and read
/// locks' keys) but not their waiting marks: its waiter's mark is refused, which is warned once
/// per backend (releases will not wake it), and the waiter still gets the key, when the
/// holder's lease ends (2 s, not renewed) at the latest. Without fencing the mark is a `SET` of
/// its own; with fencing it is a key of the acquisition script, which the server refuses as a
/// whole, and which goes again without it: for a lock and for a read lock.
async fn refused_mark(server: &RedisServer, fenced: bool) {
    // One at a time: the logs are the whole binary's, and these tests count their warnings.
    static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    let _alone = ONE_AT_A_TIME.lock().await;
    let logs = support::logs(tracing::Level::WARN, false);
    let mut admin = admin(server).await;
    let mut acl = redis::cmd("ACL");
    acl.arg("SETUSER")
        .arg("nomark")
        .arg("reset")
        .arg("on")
        .arg(">secret")
        .arg("~*}")
        .arg("&*")
        .arg("+@all");
    if fenced {
        acl.arg("~*}:fence").arg("~*}:readers").arg("~*}:writer");
    }
    let () = acl.query_async(&mut admin).await.unwrap();
    let options = if fenced {
        "lease=60s"
    } else {
        "lease=60s&fencing=false"
    };
    let url = server
        .url(options)
        .replacen("redis://", "redis://nomark:secret@", 1);
    let holder = provider(server, options).await;
    let warning = "redis waiters cannot mark the keys they wait for";
    let readers = if fenced {
        [false, true].as_slice()
    } else {
        &[false]
    };
    for &read in readers {
        let waiters = LockProvider::builder(RedisBackend::connect(&url).await.unwrap())
            .backoff(slow_backoff())
            .build();
        let key = unique_key("nomark");
        let guard = holder
            .lock(&key)
            .lease(Duration::from_secs(2))
            .renewal(false)
            .try_acquire()
            .await
            .unwrap();
        let from = logs.len();
        let waiter = {
            let (locks, key) = (waiters.clone(), key.clone());
            tokio::spawn(async move {
                let wait = Duration::from_secs(600);
                if read {
                    locks.acquire_read(&key, wait).await
                } else {
                    locks.acquire(&key, wait).await
                }
            })
        };
        wait_until("the refused mark is warned", LIMIT, async || {
            logs.text_from(from).contains(warning)
        })
        .await;
        let got = tokio::time::timeout(LIMIT, waiter)
            .await
            .expect("the waiter got the key")
            .unwrap()
            .unwrap();
        drop(guard);
        got.release().await.unwrap();
        assert_eq!(
            logs.text_from(from).matches(warning).count(),
            1,
            "warned once per backend"
        );
    }
}

/// `n` acquisitions and releases of `key`, one after the other, nobody waiting.
async fn cycles(locks: &LockProvider, key: &str, n: usize) {
    for _ in 0..n {
        let guard = locks.try_acquire(key).await.unwrap();
        guard.release().await.unwrap();
    }
}

/// With `key_layout=plain`, the layout other clients share, every release announces itself:
/// a client that is not dlock may wait for the key without marking it.
async fn plain_releases_always_announce(server: &RedisServer) {
    let locks = provider(server, "lease=60s&key_layout=plain").await;
    let key = unique_key("plain");
    let before = calls(server, "publish");
    cycles(&locks, &key, 5).await;
    assert_eq!(calls(server, "publish") - before, 5);
}

/// A holder that never releases (its lease simply runs out, not renewed): the waiter, woken by
/// nothing, tries again when the lease ends, not at its hour-long fallback poll.
async fn lease_runs_out(server: &RedisServer) {
    let holder = provider(server, LEASE).await;
    let waiters = provider(server, LEASE).await;
    let key = unique_key("expires");
    let guard = holder
        .lock(&key)
        .lease(Duration::from_secs(2))
        .renewal(false)
        .try_acquire()
        .await
        .unwrap();
    let waiter = spawn_waiter(&waiters, &key);
    let got = tokio::time::timeout(LIMIT, waiter)
        .await
        .expect("the waiter got the key when the lease ran out")
        .unwrap()
        .unwrap();
    assert!(got.fencing_token() > guard.fencing_token());
    drop(guard);
    got.release().await.unwrap();
}

/// The subscriber connection is killed while a waiter waits: it reconnects and subscribes
/// again, and the release still reaches the waiter.
async fn subscriber_killed(server: &RedisServer) {
    let holder = provider(server, LEASE).await;
    let waiters = provider(server, LEASE).await;
    let backend = RedisBackend::connect(&server.url(LEASE)).await.unwrap();
    let key = unique_key("killed");
    let channel = backend.storage_key(&key);
    let guard = holder.try_acquire(&key).await.unwrap();
    let waiter = spawn_waiter(&waiters, &key);
    await_subscribers(server, &channel, 1).await;
    let mut admin = admin(server).await;
    let killed: i64 = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("TYPE")
        .arg("pubsub")
        .query_async(&mut admin)
        .await
        .unwrap();
    assert_eq!(killed, 1);
    // Subscribed again on a new connection.
    await_subscribers(server, &channel, 1).await;
    guard.release().await.unwrap();
    let got = tokio::time::timeout(LIMIT, waiter)
        .await
        .expect("the waiter was woken after its subscriber reconnected")
        .unwrap()
        .unwrap();
    got.release().await.unwrap();
}

/// A hundred waiters over ten providers (ten backends, ten subscribers): each gets the key
/// once, never two at a time, with fencing tokens that only go up.
async fn hundred_waiters(server: &RedisServer) {
    let key = unique_key("hundred");
    let mut providers = Vec::new();
    for _ in 0..10 {
        providers.push(provider(server, LEASE).await);
    }
    let holding = Arc::new(AtomicBool::new(false));
    let last_token = Arc::new(AtomicU64::new(0));
    let first = providers[0].try_acquire(&key).await.unwrap();
    let mut tasks = Vec::new();
    for i in 0..100 {
        let locks = providers[i % 10].clone();
        let (key, holding, last_token) =
            (key.clone(), Arc::clone(&holding), Arc::clone(&last_token));
        tasks.push(tokio::spawn(async move {
            let guard = locks.acquire(&key, Duration::from_secs(300)).await?;
            assert!(!holding.swap(true, Ordering::SeqCst), "two holders at once");
            let token = guard.fencing_token().unwrap();
            let previous = last_token.swap(token, Ordering::SeqCst);
            assert!(token > previous, "token {token} after {previous}");
            tokio::task::yield_now().await;
            holding.store(false, Ordering::SeqCst);
            guard.release().await
        }));
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    first.release().await.unwrap();
    for task in tasks {
        tokio::time::timeout(Duration::from_secs(120), task)
            .await
            .expect("every waiter got the key in turn")
            .unwrap()
            .unwrap();
    }
    for locks in &providers {
        assert_eq!(locks.local_key_count(), 0);
    }
}

/// Waiting futures dropped mid-wait leave nothing: no subscription, no key, no local entry;
/// the key is free once its holder lets go.
async fn dropped_waiters(server: &RedisServer) {
    let holder = provider(server, LEASE).await;
    let waiters = provider(server, LEASE).await;
    let backend = RedisBackend::connect(&server.url(LEASE)).await.unwrap();
    let key = unique_key("dropped");
    let channel = backend.storage_key(&key);
    let guard = holder.try_acquire(&key).await.unwrap();
    let read_waiter = {
        let (locks, key) = (waiters.clone(), key.clone());
        tokio::spawn(async move { locks.acquire_read(&key, Duration::from_secs(600)).await })
    };
    let waiter = spawn_waiter(&waiters, &key);
    await_subscribers(server, &channel, 1).await;
    waiter.abort();
    read_waiter.abort();
    assert!(waiter.await.unwrap_err().is_cancelled());
    assert!(read_waiter.await.unwrap_err().is_cancelled());
    await_subscribers(server, &channel, 0).await;
    assert_eq!(waiters.local_key_count(), 0);
    guard.release().await.unwrap();
    let mut admin = admin(server).await;
    let exists: i64 = redis::cmd("EXISTS")
        .arg(&channel)
        .query_async(&mut admin)
        .await
        .unwrap();
    assert_eq!(exists, 0, "nothing holds the key");
    waiters
        .try_acquire(&key)
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
}

/// Readers and writers wake each other: a writer waiting for two readers gets the key when
/// the last one leaves, and a reader waiting for that writer when it leaves.
async fn readers_and_writers(server: &RedisServer) {
    let readers = provider(server, LEASE).await;
    let writers = provider(server, LEASE).await;
    let key = unique_key("rw");
    let a = readers.try_acquire_read(&key).await.unwrap();
    let b = readers.try_acquire_read(&key).await.unwrap();
    let writer = spawn_waiter(&writers, &key);
    let backend = RedisBackend::connect(&server.url(LEASE)).await.unwrap();
    let channel = backend.storage_key(&key);
    await_subscribers(server, &channel, 1).await;
    a.release().await.unwrap();
    b.release().await.unwrap();
    let written = tokio::time::timeout(LIMIT, writer)
        .await
        .expect("the last reader's release woke the writer")
        .unwrap()
        .unwrap();
    let reader = {
        let (locks, key) = (readers.clone(), key.clone());
        tokio::spawn(async move { locks.acquire_read(&key, Duration::from_secs(600)).await })
    };
    await_subscribers(server, &channel, 1).await;
    written.release().await.unwrap();
    let read = tokio::time::timeout(LIMIT, reader)
        .await
        .expect("the writer's release woke the reader")
        .unwrap()
        .unwrap();
    read.release().await.unwrap();
}

/// A user refused `SUBSCRIBE`, `PUBLISH` and `PTTL` (and every channel) still waits and
/// releases: its waiters poll with backoff (their hour-long fallback poll is not used, since
/// no wake-up can come).
async fn without_grants(server: &RedisServer) {
    let mut admin = admin(server).await;
    let () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg("nopubsub")
        .arg("reset")
        .arg("on")
        .arg(">secret")
        .arg("~*")
        .arg("resetchannels")
        .arg("+@all")
        .arg("-subscribe")
        .arg("-publish")
        .arg("-pttl")
        .query_async(&mut admin)
        .await
        .unwrap();
    let url = server
        .url("lease=2s")
        .replacen("redis://", "redis://nopubsub:secret@", 1);
    let holder = LockProvider::connect(&url).await.unwrap();
    let waiters = LockProvider::builder(RedisBackend::connect(&url).await.unwrap())
        .backoff(slow_backoff())
        .build();
    let key = unique_key("nogrants");
    let guard = holder.try_acquire(&key).await.unwrap();
    let waiter = spawn_waiter(&waiters, &key);
    tokio::time::sleep(Duration::from_millis(200)).await;
    guard.release().await.unwrap();
    let got = tokio::time::timeout(LIMIT, waiter)
        .await
        .expect("the waiter polled its way to the key")
        .unwrap()
        .unwrap();
    got.release().await.unwrap();
}

/// Fair waiting: when the holder's process has a waiter of its own ready, a waiter of another
/// backend woken by the release gets the key first (the releasing backend's waiter holds off
/// a moment, since the release's announcement reached a subscriber elsewhere). Without that,
/// the holder's own waiter tries as soon as the release is done and nearly always wins.
async fn waiter_elsewhere_goes_first(server: &RedisServer) {
    let home = provider(server, LEASE).await;
    let away = provider(server, LEASE).await;
    let backend = RedisBackend::connect(&server.url(LEASE)).await.unwrap();
    let key = unique_key("fair");
    let channel = backend.storage_key(&key);
    let held = home.try_acquire(&key).await.unwrap();
    let order = Arc::new(std::sync::Mutex::new(Vec::new()));
    let wait = |locks: &LockProvider, who: &'static str| {
        let (locks, key, order) = (locks.clone(), key.clone(), Arc::clone(&order));
        tokio::spawn(async move {
            let guard = locks.acquire(&key, LIMIT).await.unwrap();
            order.lock().unwrap().push(who);
            tokio::time::sleep(Duration::from_millis(20)).await;
            guard.release().await.unwrap();
        })
    };
    let first = wait(&away, "away");
    await_subscribers(server, &channel, 1).await;
    // The holder's own waiter queues in its provider behind the held lock.
    let second = wait(&home, "home");
    tokio::task::yield_now().await;
    held.release().await.unwrap();
    first.await.unwrap();
    second.await.unwrap();
    assert_eq!(*order.lock().unwrap(), ["away", "home"]);
}

/// How often `command` ran on the server.
fn calls(server: &RedisServer, command: &str) -> u64 {
    server.command_calls().get(command).copied().unwrap_or(0)
}

/// A waiter that gets the key hands its subscription on to the next waiter of its provider:
/// the channel stays subscribed while that one queues (a release elsewhere in between would
/// be heard). The waits queue with the key (see Fair waiting in `dlock::redis`), so the
/// channel is not subscribed again to go behind the other backends' subscribers (the order
/// of delivery does not decide who goes next). Once nobody waits, nothing stays subscribed.
async fn subscription_handed_on(server: &RedisServer) {
    let home = provider(server, LEASE).await;
    let away = provider(server, LEASE).await;
    let backend = RedisBackend::connect(&server.url(LEASE)).await.unwrap();
    let key = unique_key("handed-on");
    let channel = backend.storage_key(&key);
    let held = away.try_acquire(&key).await.unwrap();
    let first = spawn_waiter(&home, &key);
    await_subscribers(server, &channel, 1).await;
    let second = spawn_waiter(&home, &key);
    // The second queues in its provider behind the first (a setup step: were it late, the
    // first would drop the subscription and the assertions below fail, not pass).
    tokio::time::sleep(Duration::from_millis(100)).await;
    let (subscribes, unsubscribes) = (calls(server, "subscribe"), calls(server, "unsubscribe"));
    held.release().await.unwrap();
    let first = tokio::time::timeout(LIMIT, first)
        .await
        .expect("the release woke the first waiter")
        .unwrap()
        .unwrap();
    assert_eq!(
        subscribers(server, &channel).await,
        1,
        "the subscription was not kept for the queued waiter"
    );
    first.release().await.unwrap();
    let second = tokio::time::timeout(LIMIT, second)
        .await
        .expect("the second waiter got the key")
        .unwrap()
        .unwrap();
    // Subscribed once, by the first waiter (the second's channel is dropped once it has the
    // key and nobody waits).
    assert_eq!(
        calls(server, "subscribe"),
        subscribes,
        "the channel was subscribed again while its waiters queue"
    );
    assert!(calls(server, "unsubscribe") <= unsubscribes + 1);
    second.release().await.unwrap();
    await_subscribers(server, &channel, 0).await;
    drop(backend);
}

macro_rules! flavor_tests {
    ($module:ident, $flavor:expr, gated = $gated:expr) => {
        mod $module {
            use super::*;

            fn start() -> Option<RedisServer> {
                RedisServer::start($flavor)
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_release_wakes_the_waiter() {
                let Some(server) = start() else { return };
                woken_by_release(&server, LEASE).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_release_wakes_an_unfenced_waiter() {
                let Some(server) = start() else { return };
                woken_by_release(&server, "lease=60s&fencing=false").await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn releases_nobody_waits_for_announce_nothing() {
                let Some(server) = start() else { return };
                unwaited_releases_announce_nothing(&server, $gated).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_refused_waiting_mark_is_warned() {
                let Some(server) = start() else { return };
                refused_mark(&server, false).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_refused_waiting_mark_in_a_script_is_warned() {
                let Some(server) = start() else { return };
                refused_mark(&server, true).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn plain_layout_releases_always_announce() {
                let Some(server) = start() else { return };
                plain_releases_always_announce(&server).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_waiter_elsewhere_goes_before_the_holders_own() {
                let Some(server) = start() else { return };
                waiter_elsewhere_goes_first(&server).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_waiter_that_gets_the_key_hands_its_subscription_on() {
                let Some(server) = start() else { return };
                subscription_handed_on(&server).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_lease_that_runs_out_lets_the_waiter_in() {
                let Some(server) = start() else { return };
                lease_runs_out(&server).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_killed_subscriber_reconnects() {
                let Some(server) = start() else { return };
                subscriber_killed(&server).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_hundred_waiters_take_turns() {
                let Some(server) = start() else { return };
                hundred_waiters(&server).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn dropped_waiters_leave_nothing() {
                let Some(server) = start() else { return };
                dropped_waiters(&server).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn readers_and_writers_wake_each_other() {
                let Some(server) = start() else { return };
                readers_and_writers(&server).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn waits_poll_without_pubsub_grants() {
                let Some(server) = start() else { return };
                without_grants(&server).await;
            }
        }
    };
}

flavor_tests!(redis7, Flavor::Redis7, gated = true);
flavor_tests!(valkey91, Flavor::Valkey91, gated = false);
