//! The permit store against throwaway Redis 7, Redis 8.4+ and Valkey 9.1 servers (those of
//! [`live_tests`](super::super::commands::live_tests)): the bound under concurrent tries, leases
//! on the server's clock, the count record, the waiting mark, fencing, huge counts in one
//! script call, the keys' times to live, and wake-ups. Each test runs on every flavour.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use super::super::commands::Extension;
use super::super::commands::live_tests::{Flavor, Server};
use super::*;
use crate::backend::{Acquired, LockBackend};

/// A backend on `server` with these URL options.
async fn backend(server: &Server, options: &str) -> RedisBackend {
    RedisBackend::connect(&server.url(options))
        .await
        .expect("a backend")
}

fn store(backend: &RedisBackend) -> &dyn PermitStore {
    backend
        .semaphores()
        .expect("redis keeps semaphores natively (LockBackend::semaphores)")
}

async fn attempt(backend: &RedisBackend, request: PermitRequest<'_>) -> PermitTry {
    store(backend)
        .try_acquire_permit(request)
        .await
        .unwrap_or_else(|err| panic!("a try for {request:?}: {err}"))
}

/// A permit that must be granted.
async fn take(backend: &RedisBackend, request: PermitRequest<'_>) -> Acquired {
    match attempt(backend, request).await {
        PermitTry::Acquired(acquired) => acquired,
        full => panic!("{request:?} was answered {full:?}, not a permit"),
    }
}

/// A try that must find the semaphore full; its `retry_within`.
async fn full(backend: &RedisBackend, request: PermitRequest<'_>) -> Option<Duration> {
    match attempt(backend, request).await {
        PermitTry::Full { retry_within } => retry_within,
        PermitTry::Acquired(acquired) => panic!(
            "{request:?} got a permit (token {:?}) where the semaphore is full",
            acquired.fencing_token
        ),
    }
}

async fn release(acquired: Acquired) -> ReleaseOutcome {
    acquired.handle.release_outcome().await.expect("a release")
}

/// The permits', record's and mark's keys of the semaphore `name`.
fn keys(backend: &RedisBackend, name: &str) -> (Vec<u8>, Vec<u8>, Vec<u8>) {
    let shared = &backend.shared;
    let permits = permits_key(shared, name);
    let record = record_key(shared.layout, &permits);
    let mark = mark_key(shared.layout, &permits);
    (permits, record, mark)
}

async fn admin_query<T: redis::FromRedisValue>(
    admin: &mut redis::aio::MultiplexedConnection,
    cmd: &redis::Cmd,
) -> T {
    cmd.query_async(admin)
        .await
        .unwrap_or_else(|err| panic!("{cmd:?}: {err}"))
}

/// The live permits of the set `permits`, by the server's clock.
async fn live(admin: &mut redis::aio::MultiplexedConnection, permits: &[u8]) -> i64 {
    let mut eval = redis::cmd("EVAL");
    eval.arg(
        "local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
return redis.call('ZCOUNT', KEYS[1], '(' .. string.format('%d', now), '+inf')",
    )
    .arg(1)
    .arg(permits);
    admin_query(admin, &eval).await
}

async fn get(admin: &mut redis::aio::MultiplexedConnection, key: &[u8]) -> Option<String> {
    admin_query(admin, redis::cmd("GET").arg(key)).await
}

async fn pttl(admin: &mut redis::aio::MultiplexedConnection, key: &[u8]) -> i64 {
    admin_query(admin, redis::cmd("PTTL").arg(key)).await
}

/// The members of the set `permits` with their lease ends.
async fn members(
    admin: &mut redis::aio::MultiplexedConnection,
    permits: &[u8],
) -> Vec<(String, u64)> {
    admin_query(
        admin,
        redis::cmd("ZRANGE")
            .arg(permits)
            .arg(0)
            .arg(-1)
            .arg("WITHSCORES"),
    )
    .await
}

async fn server_ms(admin: &mut redis::aio::MultiplexedConnection) -> u64 {
    let (secs, micros): (u64, u64) = admin_query(admin, &redis::cmd("TIME")).await;
    secs * 1000 + micros / 1000
}

/// Waits until `condition` holds; panics with `what` after `limit`.
async fn eventually<F: std::future::Future<Output = bool>>(
    limit: Duration,
    what: &str,
    mut condition: impl FnMut() -> F,
) {
    let deadline = Instant::now() + limit;
    while !condition().await {
        assert!(Instant::now() < deadline, "{what} (waited {limit:?})");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Every command the server counted so far (`INFO commandstats`), by name.
async fn command_calls(admin: &mut redis::aio::MultiplexedConnection) -> HashMap<String, u64> {
    let info: String = admin_query(admin, redis::cmd("INFO").arg("commandstats")).await;
    info.lines()
        .filter_map(|line| {
            let (name, rest) = line.strip_prefix("cmdstat_")?.split_once(':')?;
            let calls = rest
                .strip_prefix("calls=")?
                .split(',')
                .next()?
                .parse()
                .ok()?;
            Some((name.to_owned(), calls))
        })
        .collect()
}

/// Each flavour's test of `name(&Server)`.
macro_rules! on_every_flavor {
    ($($name:ident),* $(,)?) => {
        $(
            mod $name {
                use super::*;

                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn redis7() {
                    if let Some(server) = Server::start(Flavor::Redis7) {
                        super::$name(&server).await;
                    }
                }

                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn redis8() {
                    if let Some(server) = Server::start(Flavor::Redis8) {
                        super::$name(&server).await;
                    }
                }

                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn valkey91() {
                    if let Some(server) = Server::start(Flavor::Valkey91) {
                        super::$name(&server).await;
                    }
                }
            }
        )*
    };
}

on_every_flavor!(
    bound_under_concurrent_tries,
    expired_permits_free_their_place_and_stay_expired,
    count_record,
    waiting_mark,
    fencing_tokens_increase,
    huge_counts_in_one_script_call,
    every_key_expires,
    releases_wake_the_head_waiter,
    replicas_that_do_not_acknowledge,
    wrong_owner_and_verification,
    listed_with_their_holders,
    plain_layout,
    permissions,
);

/// Twelve tasks on four backends (four connections) try for three permits for a second and a
/// half, mixing single and waiting tries: the server never holds more than three live permits
/// (read by the tests' own connection), no more than three holders are ever inside at once,
/// and three were (so the bound was reached, not just respected).
async fn bound_under_concurrent_tries(server: &Server) {
    const MAX: u32 = 3;
    let backends = [
        backend(server, "lease=10s").await,
        backend(server, "lease=10s").await,
        backend(server, "lease=10s").await,
        backend(server, "lease=10s").await,
    ];
    let name = "bound";
    let (permits, ..) = keys(&backends[0], name);
    let inside = Arc::new(AtomicUsize::new(0));
    let peak = Arc::new(AtomicUsize::new(0));
    let grants = Arc::new(AtomicU64::new(0));
    let stop = Instant::now() + Duration::from_millis(1500);
    let mut tasks = tokio::task::JoinSet::new();
    for (b, backend) in backends.iter().enumerate() {
        for t in 0..3 {
            let backend = backend.clone();
            let (inside, peak, grants) = (inside.clone(), peak.clone(), grants.clone());
            tasks.spawn(async move {
                let mut round = 0u32;
                while Instant::now() < stop {
                    round += 1;
                    let waiting = (u32::try_from(b + t).unwrap() + round).is_multiple_of(3);
                    let request = PermitRequest::new(name, MAX)
                        .with_waiting(waiting.then_some(Duration::from_millis(200)));
                    match attempt(&backend, request).await {
                        PermitTry::Acquired(acquired) => {
                            let now_inside = inside.fetch_add(1, Ordering::SeqCst) + 1;
                            peak.fetch_max(now_inside, Ordering::SeqCst);
                            assert!(
                                now_inside <= MAX as usize,
                                "{now_inside} holders of a semaphore of {MAX}"
                            );
                            grants.fetch_add(1, Ordering::Relaxed);
                            tokio::time::sleep(Duration::from_millis(fastrand::u64(1..4))).await;
                            inside.fetch_sub(1, Ordering::SeqCst);
                            assert_eq!(release(acquired).await, ReleaseOutcome::Released);
                        }
                        PermitTry::Full { .. } => {
                            tokio::time::sleep(Duration::from_millis(fastrand::u64(0..2))).await;
                        }
                    }
                }
            });
        }
    }
    let mut admin = server.admin().await;
    let mut samples = 0u64;
    while Instant::now() < stop {
        let n = live(&mut admin, &permits).await;
        assert!(
            n <= i64::from(MAX),
            "the server holds {n} live permits of {MAX}"
        );
        samples += 1;
    }
    while let Some(done) = tasks.join_next().await {
        done.expect("a task");
    }
    let grants = grants.load(Ordering::Relaxed);
    eprintln!(
        "{grants} permits granted, peak {} inside, {samples} server samples",
        peak.load(Ordering::SeqCst)
    );
    assert_eq!(
        peak.load(Ordering::SeqCst),
        MAX as usize,
        "the bound was reached"
    );
    assert!(grants >= 50, "only {grants} permits granted in 1.5 s");
    assert_eq!(live(&mut admin, &permits).await, 0);
}

/// A permit left to expire (no renewal) stops counting at its lease end on the server's
/// clock, while its member is still in the set (another permit keeps the set alive); its
/// renewal (the renewal driver's batch, and a guard's extension) then finds it lost and never
/// moves it back to life, and its release answers that it was already gone.
async fn expired_permits_free_their_place_and_stay_expired(server: &Server) {
    let backend = backend(server, "lease=10s").await;
    let name = "expiry";
    let (permits, record, _) = keys(&backend, name);
    let mut admin = server.admin().await;
    let lease = Duration::from_millis(300);
    let first = take(
        &backend,
        PermitRequest::new(name, 2)
            .with_lease(Some(lease))
            .with_renewal(false),
    )
    .await;
    let (token, ends) = members(&mut admin, &permits).await[0].clone();
    let other = take(&backend, PermitRequest::new(name, 2)).await;
    full(&backend, PermitRequest::new(name, 2)).await;
    let members_then = members(&mut admin, &permits).await;
    assert_eq!(members_then.len(), 2);
    // Past its lease on the server's clock, with nothing removing its member yet.
    eventually(
        Duration::from_secs(5),
        "the lease ends on the server",
        || {
            let mut admin = admin.clone();
            async move { server_ms(&mut admin).await > ends }
        },
    )
    .await;
    assert_eq!(
        members(&mut admin, &permits).await,
        members_then,
        "still there"
    );
    // The renewal driver's command: the expired member is not revived.
    let owner = OwnerToken::from_text(&token).unwrap();
    let renewed = backend
        .shared
        .conn
        .extend_many(&[Extension {
            key: &permits,
            token: &owner,
            lease: Duration::from_secs(30),
            script: Some((extend_script(), &record)),
        }])
        .await
        .expect("a batch");
    assert!(matches!(renewed[..], [Ok(false)]), "{renewed:?}");
    assert_eq!(
        members(&mut admin, &permits).await,
        members_then,
        "not revived"
    );
    // Nor by the guard's extension, which finds it lost and fires its lost token.
    let control = first.handle.lease_control().expect("a leased permit");
    assert!(!control.extend(Duration::from_secs(30)).await.unwrap());
    assert!(first.lost.is_cancelled());
    assert!(!control.verify_still_held().await.unwrap());
    assert_eq!(
        members(&mut admin, &permits).await,
        members_then,
        "not revived"
    );
    // Its place is free: one more permit, not two.
    assert_eq!(live(&mut admin, &permits).await, 1);
    let second = take(&backend, PermitRequest::new(name, 2)).await;
    full(&backend, PermitRequest::new(name, 2)).await;
    assert_eq!(live(&mut admin, &permits).await, 2);
    assert_eq!(
        members(&mut admin, &permits).await.len(),
        2,
        "the expired one is gone"
    );
    assert_eq!(release(first).await, ReleaseOutcome::AlreadyReleased);
    assert_eq!(live(&mut admin, &permits).await, 2, "the others stay");
    assert_eq!(release(second).await, ReleaseOutcome::Released);
    assert_eq!(release(other).await, ReleaseOutcome::Released);
}

/// The count record: a try with another count is refused, naming both counts and changing
/// nothing, while a permit is live or the waiting mark is; once neither is (released, or
/// expired), a try with another count replaces the record. `holders` applies the same rule.
async fn count_record(server: &Server) {
    let backend = backend(server, "lease=10s").await;
    let store = store(&backend);
    let name = "record";
    let (permits, record, mark) = keys(&backend, name);
    let mut admin = server.admin().await;
    let held = take(&backend, PermitRequest::new(name, 2)).await;
    assert_eq!(get(&mut admin, &record).await.as_deref(), Some("2"));
    let err = store
        .try_acquire_permit(PermitRequest::new(name, 5))
        .await
        .expect_err("another count while a permit is live");
    assert_eq!(err.code(), "DistributedLock.Configuration", "{err}");
    let text = err.to_string();
    assert!(
        text.contains("max_count 2") && text.contains("max_count 5"),
        "{text}"
    );
    assert_eq!(live(&mut admin, &permits).await, 1, "nothing taken");
    assert_eq!(
        get(&mut admin, &record).await.as_deref(),
        Some("2"),
        "nor changed"
    );
    assert_eq!(store.holders(name, 2).await.unwrap(), 1);
    let err = store
        .holders(name, 5)
        .await
        .expect_err("holders of another count");
    assert!(err.to_string().contains("max_count 2"), "{err}");
    // The same count is served.
    let second = take(&backend, PermitRequest::new(name, 2)).await;
    full(&backend, PermitRequest::new(name, 2)).await;
    release(held).await;
    release(second).await;
    // Nobody holds or waits: a new count is taken.
    let five = take(&backend, PermitRequest::new(name, 5)).await;
    assert_eq!(get(&mut admin, &record).await.as_deref(), Some("5"));
    assert_eq!(store.holders(name, 5).await.unwrap(), 1);
    release(five).await;
    assert_eq!(
        store.holders(name, 1).await.unwrap(),
        0,
        "an idle semaphore"
    );

    // A live waiting mark keeps the record, with no permit live.
    let one = take(&backend, PermitRequest::new(name, 1)).await;
    let mark_for = Duration::from_millis(400);
    full(
        &backend,
        PermitRequest::new(name, 1).with_waiting(Some(mark_for)),
    )
    .await;
    release(one).await;
    assert_eq!(live(&mut admin, &permits).await, 0);
    assert!(pttl(&mut admin, &mark).await > 0, "the mark lives");
    let err = store
        .try_acquire_permit(PermitRequest::new(name, 3))
        .await
        .expect_err("another count while the mark lives");
    assert!(err.to_string().contains("max_count 1"), "{err}");
    assert!(store.holders(name, 3).await.is_err());
    eventually(Duration::from_secs(5), "the mark lapses", || {
        let mut admin = admin.clone();
        let mark = mark.clone();
        async move { pttl(&mut admin, &mark).await == -2 }
    })
    .await;
    let three = take(&backend, PermitRequest::new(name, 3)).await;
    release(three).await;

    // An expired permit holds the record no longer.
    let lease = Duration::from_millis(200);
    let expiring = take(
        &backend,
        PermitRequest::new(name, 2)
            .with_lease(Some(lease))
            .with_renewal(false),
    )
    .await;
    tokio::time::sleep(lease).await;
    eventually(Duration::from_secs(5), "the permit expires", || {
        let mut admin = admin.clone();
        let permits = permits.clone();
        async move { live(&mut admin, &permits).await == 0 }
    })
    .await;
    let four = take(&backend, PermitRequest::new(name, 4)).await;
    assert_eq!(get(&mut admin, &record).await.as_deref(), Some("4"));
    release(four).await;
    drop(expiring);
}

/// The waiting mark: a waiting try that finds the semaphore full leaves it for the time asked;
/// while it lives, single tries are answered full even with a permit free (`retry_within`
/// the mark's end), a waiting try is never refused for it, and a granted waiting try clears it.
async fn waiting_mark(server: &Server) {
    let backend = backend(server, "lease=10s").await;
    let name = "mark";
    let (permits, _, mark) = keys(&backend, name);
    let mut admin = server.admin().await;
    let holder = take(&backend, PermitRequest::new(name, 1)).await;
    // A single try leaves no mark.
    let within = full(&backend, PermitRequest::new(name, 1)).await;
    let within = within.expect("the earliest lease end");
    assert!(
        within > Duration::from_secs(9) && within <= Duration::from_millis(10_001),
        "{within:?}"
    );
    assert_eq!(pttl(&mut admin, &mark).await, -2);
    let waiting = PermitRequest::new(name, 1).with_waiting(Some(Duration::from_secs(3)));
    full(&backend, waiting).await;
    let left = pttl(&mut admin, &mark).await;
    assert!(
        (2_000..=3_000).contains(&left),
        "the mark lives 3 s: {left}"
    );
    assert_eq!(release(holder).await, ReleaseOutcome::Released);
    assert_eq!(live(&mut admin, &permits).await, 0);
    // Free, but a waiter is ahead.
    let within = full(&backend, PermitRequest::new(name, 1)).await;
    let within = within.expect("the mark's end");
    assert!(within <= Duration::from_millis(3_001), "{within:?}");
    assert_eq!(live(&mut admin, &permits).await, 0, "nothing taken");
    // The waiter takes it and clears the mark; single tries are served again.
    let waiter = take(&backend, waiting).await;
    assert_eq!(pttl(&mut admin, &mark).await, -2);
    let two = PermitRequest::new(name, 1);
    full(&backend, two).await;
    release(waiter).await;
    let single = take(&backend, two).await;
    release(single).await;
    // With permits free, a waiting try is granted at once and leaves no mark.
    let direct = take(&backend, waiting).await;
    assert_eq!(pttl(&mut admin, &mark).await, -2);
    release(direct).await;
}

/// Fencing tokens strictly increase across holders of the semaphore, across backends, and
/// across a change of its count once it was idle (one counter per semaphore, kept). A new
/// counter starts at the server's time in microseconds, so a counter the server lost starts
/// again above every token issued. With `fencing=false` none is issued and no counter is
/// kept; with `fencing_counters`, tokens come from the shared counters and no per-semaphore
/// counter is made.
async fn fencing_tokens_increase(server: &Server) {
    let a = backend(server, "lease=10s").await;
    let b = backend(server, "lease=10s").await;
    let name = "fencing";
    let mut admin = server.admin().await;
    let before = server_ms(&mut admin).await;
    let mut last = 0;
    for round in 0..6u32 {
        let count = if round < 3 { 2 } else { 7 };
        let x = take(&a, PermitRequest::new(name, count)).await;
        let y = take(&b, PermitRequest::new(name, count)).await;
        let (tx, ty) = (x.fencing_token.unwrap(), y.fencing_token.unwrap());
        assert!(last < tx && tx < ty, "{last} {tx} {ty}");
        if round == 0 {
            assert!(tx >= before * 1000, "the first token {tx}, at {before} ms");
        }
        last = ty;
        release(y).await;
        release(x).await;
    }
    let (permits, ..) = keys(&a, name);
    let fence = companion_key(KeyLayout::Tagged, &permits, b":fence");
    assert_eq!(get(&mut admin, &fence).await, Some(last.to_string()));
    // A server that lost the counter (a restart without persistence) starts it again from its
    // clock: above every token issued.
    let () = admin_query(&mut admin, redis::cmd("DEL").arg(&fence)).await;
    let again = take(&b, PermitRequest::new(name, 7)).await;
    assert!(
        again.fencing_token.unwrap() > last,
        "{again:?} after {last}"
    );
    release(again).await;

    let unfenced = backend(server, "lease=10s&fencing=false").await;
    let name = "unfenced";
    let p = take(&unfenced, PermitRequest::new(name, 1)).await;
    assert_eq!(p.fencing_token, None);
    release(p).await;
    let (permits, ..) = keys(&unfenced, name);
    let fence = companion_key(KeyLayout::Tagged, &permits, b":fence");
    assert_eq!(
        get(&mut admin, &fence).await,
        None,
        "no counter without fencing"
    );

    let shared = backend(server, "lease=10s&fencing_counters=4&prefix=bounded:").await;
    let name = "bounded";
    let mut last = 0;
    for _ in 0..3 {
        let p = take(&shared, PermitRequest::new(name, 1)).await;
        let token = p.fencing_token.unwrap();
        assert!(token > last, "{last} {token}");
        last = token;
        release(p).await;
    }
    let (permits, ..) = keys(&shared, name);
    let fence = companion_key(KeyLayout::Tagged, &permits, b":fence");
    assert_eq!(
        get(&mut admin, &fence).await,
        None,
        "no per-semaphore counter"
    );
    let counter = shared.fencing_key(name);
    assert!(
        get(&mut admin, &counter).await.is_some(),
        "the shared counter"
    );
}

/// `max_count` of `u32::MAX` and 1,000,000 are served, each try one `EVALSHA` and nothing
/// else (read from the server's command counts; the commands inside the script are counted
/// by the server under their own names and left out), whether it grants a permit or finds the
/// semaphore full.
async fn huge_counts_in_one_script_call(server: &Server) {
    let backend = backend(server, "lease=10s").await;
    let mut admin = server.admin().await;
    // Loads the script and learns the connection's `CLIENT ID`.
    let warm = take(&backend, PermitRequest::new("warm", 1)).await;
    release(warm).await;
    let inside: Vec<&str> = SCRIPTS.acquire.commands().to_vec();
    let one_try = |before: HashMap<String, u64>, after: HashMap<String, u64>| {
        let sent: Vec<(String, u64)> = after
            .iter()
            .map(|(name, n)| (name.clone(), n - before.get(name).copied().unwrap_or(0)))
            .filter(|(name, n)| *n > 0 && name != "info" && !inside.contains(&name.as_str()))
            .collect();
        assert_eq!(sent, vec![("evalsha".to_owned(), 1)], "one try's commands");
    };
    for count in [u32::MAX, 1_000_000] {
        let name = format!("huge-{count}");
        let before = command_calls(&mut admin).await;
        let taken = Instant::now();
        let permit = take(&backend, PermitRequest::new(&name, count)).await;
        let took = taken.elapsed();
        one_try(before, command_calls(&mut admin).await);
        assert_eq!(store(&backend).holders(&name, count).await.unwrap(), 1);
        eprintln!("max_count {count}: a try took {took:?}");
        release(permit).await;
    }
    let holder = take(&backend, PermitRequest::new("huge-full", 1)).await;
    let before = command_calls(&mut admin).await;
    full(&backend, PermitRequest::new("huge-full", 1)).await;
    one_try(before, command_calls(&mut admin).await);
    release(holder).await;
}

/// Every key a semaphore leaves has a time to live that covers what it holds (the permits'
/// set until its latest lease end, the record at least as long and while the mark lives, the
/// mark for the time asked), through grants, renewals, extensions, waits and releases; once
/// the semaphore is idle only its fencing counter is left, as a lock's is.
async fn every_key_expires(server: &Server) {
    let backend = backend(server, "lease=2s").await;
    let name = "ttl";
    let (permits, record, mark) = keys(&backend, name);
    let fence = companion_key(KeyLayout::Tagged, &permits, b":fence");
    let mut admin = server.admin().await;
    let reader = admin.clone();
    let expire_time = |key: Vec<u8>| {
        let mut admin = reader.clone();
        async move {
            let at: i64 = admin_query(&mut admin, redis::cmd("PEXPIRETIME").arg(key)).await;
            at
        }
    };
    // Read in one step, so that no renewal falls between the reads.
    let covered = |what: &'static str| {
        let (permits, record) = (permits.clone(), record.clone());
        let mut admin = reader.clone();
        async move {
            let mut eval = redis::cmd("EVAL");
            eval.arg(
                "local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
return {last[2] or '0', redis.call('PEXPIRETIME', KEYS[1]), redis.call('PEXPIRETIME', KEYS[2])}",
            )
            .arg(2)
            .arg(&permits)
            .arg(&record);
            let (latest, permits_at, record_at): (String, i64, i64) =
                admin_query(&mut admin, &eval).await;
            let latest: i64 = latest.parse().expect("a whole lease end");
            assert!(latest > 0, "{what}: no permit");
            assert_eq!(permits_at, latest, "{what}: the permits' time to live");
            assert!(
                record_at >= latest,
                "{what}: the record ({record_at}) outlives the latest lease ({latest})"
            );
        }
    };
    let a = take(&backend, PermitRequest::new(name, 2)).await;
    covered("one permit").await;
    let b = take(
        &backend,
        PermitRequest::new(name, 2).with_lease(Some(Duration::from_secs(5))),
    )
    .await;
    covered("a longer lease").await;
    // An extension of `a` beyond `b`'s end moves both times to live.
    let control = a.handle.lease_control().unwrap();
    assert!(control.extend(Duration::from_secs(8)).await.unwrap());
    covered("an extension").await;
    // A shorter extension of `a` brings the permits' time to live back to `b`'s end.
    assert!(control.extend(Duration::from_secs(1)).await.unwrap());
    covered("a shorter extension").await;
    // Renewals (every third of the lease) keep it covered.
    let renewed_past = members(&mut admin, &permits).await;
    eventually(Duration::from_secs(5), "a renewal moves a lease", || {
        let mut admin = admin.clone();
        let (permits, then) = (permits.clone(), renewed_past.clone());
        async move { members(&mut admin, &permits).await != then }
    })
    .await;
    covered("a renewal").await;
    // A waiter's mark: the record lives while the mark does, after the permits are gone.
    full(
        &backend,
        PermitRequest::new(name, 2).with_waiting(Some(Duration::from_secs(60))),
    )
    .await;
    let mark_at = expire_time(mark.clone()).await;
    assert!(mark_at > 0, "the mark expires");
    release(a).await;
    release(b).await;
    assert_eq!(pttl(&mut admin, &permits).await, -2, "no permit left");
    assert_eq!(
        expire_time(record.clone()).await,
        mark_at,
        "the record lives with the mark"
    );
    let () = admin_query(&mut admin, redis::cmd("DEL").arg(&mark)).await;
    // A try after the mark is gone and a release leave nothing but the counter.
    let last = take(&backend, PermitRequest::new(name, 2)).await;
    release(last).await;
    let left: Vec<Vec<u8>> = admin_query(&mut admin, redis::cmd("KEYS").arg("dlock:*")).await;
    assert_eq!(
        left,
        vec![fence.clone()],
        "only the fencing counter is left"
    );

    // Expired permits: the keys expire by themselves, with no release.
    let gone = take(
        &backend,
        PermitRequest::new(name, 2)
            .with_lease(Some(Duration::from_millis(200)))
            .with_renewal(false),
    )
    .await;
    for key in [&permits, &record] {
        let left = pttl(&mut admin, key).await;
        assert!((1..=200).contains(&left), "{left}");
    }
    eventually(Duration::from_secs(5), "the keys expire", || {
        let mut admin = admin.clone();
        async move {
            let left: Vec<Vec<u8>> =
                admin_query(&mut admin, redis::cmd("KEYS").arg("dlock:*")).await;
            left.len() == 1
        }
    })
    .await;
    drop(gone);
    // No key without a time to live but the counter, at any point above.
    let keys: Vec<Vec<u8>> = admin_query(&mut admin, redis::cmd("KEYS").arg("*")).await;
    for key in keys {
        if key != fence && !key.ends_with(b":fence") {
            assert!(
                pttl(&mut admin, &key).await > 0,
                "{:?}",
                String::from_utf8_lossy(&key)
            );
        }
    }
}

/// A permit given back while the waiting mark lives is announced on the semaphore's channel:
/// the head waiter's watch wakes. A release nobody waits for publishes nothing.
async fn releases_wake_the_head_waiter(server: &Server) {
    let backend = backend(server, "lease=10s").await;
    let name = "wake";
    let mut admin = server.admin().await;
    let quiet = take(&backend, PermitRequest::new(name, 1)).await;
    let before = command_calls(&mut admin).await;
    release(quiet).await;
    let after = command_calls(&mut admin).await;
    assert_eq!(
        after.get("publish").copied().unwrap_or(0),
        before.get("publish").copied().unwrap_or(0),
        "an unmarked release publishes nothing"
    );
    let holder = take(&backend, PermitRequest::new(name, 1)).await;
    let waiting = PermitRequest::new(name, 1).with_waiting(Some(Duration::from_secs(5)));
    full(&backend, waiting).await;
    let mut watch = store(&backend)
        .watch_permits(waiting)
        .await
        .expect("a backend from a URL wakes waiters");
    assert!(watch.is_live());
    watch.mark_seen();
    release(holder).await;
    tokio::time::timeout(Duration::from_secs(5), watch.woken())
        .await
        .expect("the release wakes the head waiter");
    let waiter = take(&backend, waiting).await;
    release(waiter).await;
}

/// With `wait_replicas` and no replica to acknowledge, a granted permit is given back and the
/// try answers `Unavailable`: the semaphore keeps no permit.
async fn replicas_that_do_not_acknowledge(server: &Server) {
    let backend = backend(server, "lease=10s&wait_replicas=1&wait_timeout=100ms").await;
    let name = "replicas";
    let err = store(&backend)
        .try_acquire_permit(PermitRequest::new(name, 1))
        .await
        .expect_err("no replica acknowledges");
    assert!(matches!(err, LockError::Unavailable { .. }), "{err}");
    assert!(err.to_string().contains("replicas"), "{err}");
    let (permits, ..) = keys(&backend, name);
    let mut admin = server.admin().await;
    eventually(Duration::from_secs(5), "the permit is given back", || {
        let mut admin = admin.clone();
        let permits = permits.clone();
        async move { live(&mut admin, &permits).await == 0 }
    })
    .await;
    assert_eq!(live(&mut admin, &permits).await, 0);
}

/// A release or verification acts on its own permit only: another holder's permit of the
/// same semaphore stays, and a semaphore and a lock of the same name are unrelated.
async fn wrong_owner_and_verification(server: &Server) {
    let backend = backend(server, "lease=10s").await;
    let name = "owners";
    let a = take(&backend, PermitRequest::new(name, 2)).await;
    let b = take(&backend, PermitRequest::new(name, 2)).await;
    let lock = backend
        .try_acquire(crate::backend::LockRequest::new(name))
        .await
        .unwrap()
        .expect("the lock of the same name is free");
    let control = b.handle.lease_control().unwrap();
    assert!(control.verify_still_held().await.unwrap());
    assert_eq!(release(a).await, ReleaseOutcome::Released);
    assert!(
        control.verify_still_held().await.unwrap(),
        "b's permit stays"
    );
    assert_eq!(store(&backend).holders(name, 2).await.unwrap(), 1);
    lock.handle.release().await.unwrap();
    assert_eq!(release(b).await, ReleaseOutcome::Released);
    assert_eq!(store(&backend).holders(name, 2).await.unwrap(), 0);
}

/// `store_locks` lists a semaphore in use as one entry: its permits' key, its name, its live
/// permits (as `readers`), its latest fencing token and the latest lease left; a lock of the
/// same name is listed apart, and an idle semaphore not at all.
async fn listed_with_their_holders(server: &Server) {
    let backend = backend(server, "lease=10s").await;
    let name = "listed";
    let (permits, ..) = keys(&backend, name);
    let a = take(&backend, PermitRequest::new(name, 3)).await;
    let b = take(&backend, PermitRequest::new(name, 3)).await;
    let lock = backend
        .try_acquire(crate::backend::LockRequest::new(name))
        .await
        .unwrap()
        .expect("the lock of the same name is free");
    let listed = backend.store_locks(&[]).await.unwrap();
    assert_eq!(listed.len(), 2, "{listed:?}");
    let entry = listed
        .iter()
        .find(|l| l.resource.as_bytes() == &permits[..])
        .unwrap_or_else(|| panic!("the semaphore is not listed: {listed:?}"));
    assert_eq!(entry.key.as_deref(), Some(name));
    assert_eq!(entry.readers, 2);
    assert_eq!(entry.fencing_token, b.fencing_token);
    let left = entry.remaining_lease.expect("a lease");
    assert!(left > Duration::from_secs(9), "{left:?}");
    let other = listed
        .iter()
        .find(|l| l.resource != entry.resource)
        .unwrap();
    assert_eq!(other.key.as_deref(), Some(name));
    assert_eq!(other.readers, 0, "the lock is exclusive");
    release(a).await;
    release(b).await;
    lock.handle.release().await.unwrap();
    assert_eq!(backend.store_locks(&[]).await.unwrap(), vec![]);
}

/// With `key_layout=plain`, a semaphore's keys follow the lock's name with byte 0xFF (no lock
/// name can reach them), and everything works as in the tagged layout.
async fn plain_layout(server: &Server) {
    let backend = backend(server, "lease=10s&key_layout=plain").await;
    let name = "plain";
    let (permits, record, mark) = keys(&backend, name);
    assert_eq!(permits, b"dlock:plain\xff:permits".to_vec());
    assert_eq!(record, b"dlock:plain\xff:permits\xff:count".to_vec());
    assert_eq!(mark, b"dlock:plain\xff:permits\xff:waiting".to_vec());
    let mut admin = server.admin().await;
    let a = take(&backend, PermitRequest::new(name, 1)).await;
    assert_eq!(live(&mut admin, &permits).await, 1);
    assert!(a.fencing_token.is_some());
    full(
        &backend,
        PermitRequest::new(name, 1).with_waiting(Some(Duration::from_secs(2))),
    )
    .await;
    assert!(pttl(&mut admin, &mark).await > 0);
    let err = store(&backend)
        .try_acquire_permit(PermitRequest::new(name, 2))
        .await
        .expect_err("another count");
    assert!(err.to_string().contains("max_count 1"), "{err}");
    let listed = backend.store_locks(&[]).await.unwrap();
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0].key.as_deref(), Some(name));
    assert_eq!(release(a).await, ReleaseOutcome::Released);
    let b = take(
        &backend,
        PermitRequest::new(name, 1).with_waiting(Some(Duration::from_secs(2))),
    )
    .await;
    release(b).await;
}

/// What the module docs (and the README) grant for semaphores, besides a lock's commands.
const GRANTED: &str = "+evalsha +eval +get +set +time +zadd +zscore +zrem +zremrangebyscore \
                       +zrange +zcard +zcount +pttl +pexpireat +del +incr +publish";

/// Every operation of the permit store once, as `user`: grants, full answers, the waiting
/// mark, extension, verification, the count, releases (idle and marked), on the semaphore
/// `name`. The scripts are flushed first, so that `EVAL` is needed too.
async fn every_operation(server: &Server, user: &str, name: &str) -> Result<(), LockError> {
    let mut admin = server.admin().await;
    let () = admin_query(&mut admin, redis::cmd("SCRIPT").arg("FLUSH")).await;
    let backend = RedisBackend::connect(&server.url_as(user, "lease=10s")).await?;
    let store = store(&backend);
    let attempt = async |request: PermitRequest<'_>| store.try_acquire_permit(request).await;
    let PermitTry::Acquired(first) = attempt(PermitRequest::new(name, 1)).await? else {
        panic!("a free semaphore");
    };
    let waiting = PermitRequest::new(name, 1).with_waiting(Some(Duration::from_secs(5)));
    assert!(matches!(attempt(waiting).await?, PermitTry::Full { .. }));
    let control = first.handle.lease_control().unwrap();
    assert!(control.extend(Duration::from_secs(20)).await?);
    assert!(control.verify_still_held().await?);
    assert_eq!(store.holders(name, 1).await?, 1);
    first.handle.release_outcome().await?;
    let PermitTry::Acquired(second) = attempt(waiting).await? else {
        panic!("the head waiter takes the permit");
    };
    second.handle.release_outcome().await?;
    Ok(())
}

/// A user granted a lock's commands and exactly those the docs list for semaphores runs every
/// operation; one without any of them but `+publish` is refused with `NOPERM` naming the
/// command (Redis 7.0 names the script's commands); without `+publish` nothing fails (the
/// release's wake-up is asked with `pcall`).
async fn permissions(server: &Server) {
    let all = format!("+set +client|id {GRANTED}");
    let user = server.user("sem", &all).await;
    every_operation(server, &user, "granted")
        .await
        .expect("every operation with the documented grants");
    for command in GRANTED.split_whitespace() {
        let fewer: String = all
            .split_whitespace()
            .filter(|c| c != &command)
            .collect::<Vec<_>>()
            .join(" ");
        let user = server.user("fewer", &fewer).await;
        let outcome = every_operation(server, &user, command).await;
        if command == "+publish" {
            outcome.expect("without +publish nothing fails");
            continue;
        }
        let err = outcome.expect_err(command);
        assert_eq!(err.db_code(), Some("NOPERM"), "{command}: {err}");
        let name = command.trim_start_matches('+');
        assert!(err.to_string().contains(name), "{command}: {err}");
    }
}
