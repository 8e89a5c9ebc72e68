//! The Redis backend on four real servers: Redis 7 (Lua paths), Valkey 8.1 (native renewal, Lua
//! release), Valkey 9.1 (native renewal, `DELIFEQ`) and Redis 8.4+ (native renewal, `DELEX`).
//! Each flavour runs the conformance suite and the fault tests below, and asserts which
//! commands the server actually ran (from `INFO commandstats`, read by the tests only).
#![cfg(feature = "redis")]

mod conformance;
mod support;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use dlock::backend::LockBackend;
use dlock::redis::{OwnerToken, RedisBackend, ReleaseOutcome};
use dlock::{LockError, LockGuard, LockProvider};
use support::redis::{Flavor, RedisServer};
use support::unique_key;

const LEASE: Duration = Duration::from_secs(1);

/// What each flavour is expected to run.
struct Expect {
    /// The release command: "delex", "delifeq" or "evalsha".
    release: &'static str,
    /// The renewal command: "set" (IFEQ) or "evalsha".
    extend: &'static str,
    /// Errors the server answers while the backend finds its paths, once per connection: the
    /// bare `DELEX` / `DELIFEQ` probes (unknown command, or wrong number of arguments where the
    /// command exists) and a `SET .. IFEQ` that is a syntax error.
    probe_errors: u64,
}

fn expect(flavor: Flavor) -> Expect {
    match flavor {
        Flavor::Redis7 => Expect {
            release: "evalsha",
            extend: "evalsha",
            probe_errors: 3,
        },
        Flavor::Valkey81 => Expect {
            release: "evalsha",
            extend: "set",
            probe_errors: 2,
        },
        Flavor::Valkey91 => Expect {
            release: "delifeq",
            extend: "set",
            probe_errors: 2,
        },
        Flavor::Redis8 => Expect {
            release: "delex",
            extend: "set",
            probe_errors: 1,
        },
    }
}

struct RedisHarness {
    server: RedisServer,
    backend: RedisBackend,
}

impl RedisHarness {
    fn start(flavor: Flavor) -> Option<RedisHarness> {
        let server = RedisServer::start(flavor)?;
        let rt = tokio::runtime::Handle::current();
        let url = server.url(&format!("lease={}ms", LEASE.as_millis()));
        let backend = tokio::task::block_in_place(|| rt.block_on(RedisBackend::connect(&url)))
            .expect("connect");
        Some(RedisHarness { server, backend })
    }

    fn url(&self) -> String {
        self.server.url(&format!("lease={}ms", LEASE.as_millis()))
    }
}

impl conformance::Harness for RedisHarness {
    async fn provider(&self) -> LockProvider {
        LockProvider::connect(&self.url()).await.expect("connect")
    }

    async fn break_lock(&self, guard: &LockGuard) {
        // Another owner takes the key over, keeping its time to live.
        let mut conn = self
            .server
            .client()
            .get_multiplexed_async_connection()
            .await
            .unwrap();
        let key = self.backend.storage_key(guard.key());
        let set: Option<String> = redis::cmd("SET")
            .arg(&key)
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
        // The other owner kept the key's time to live: free once that lease runs out.
        LEASE + Duration::from_secs(1)
    }

    fn fencing(&self) -> bool {
        true
    }
}

fn now_ms() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis()
}

async fn admin(server: &RedisServer) -> redis::aio::MultiplexedConnection {
    server
        .client()
        .get_multiplexed_async_connection()
        .await
        .expect("admin connection")
}

fn calls(server: &RedisServer, command: &str) -> u64 {
    server.command_calls().get(command).copied().unwrap_or(0)
}

fn probe_errors(server: &RedisServer) -> u64 {
    server.error_counts().get("ERR").copied().unwrap_or(0)
}

/// Releases and renewals take the flavour's native commands where it has them, Lua otherwise;
/// the probes that fail happen once per connection, not once per call.
async fn paths_taken(server: &RedisServer) {
    let e = expect(server.flavor);
    let backend = RedisBackend::connect(&server.url("fencing=false"))
        .await
        .unwrap();
    let before = server.command_calls();
    let before_errors = probe_errors(server);
    let key = unique_key("paths");
    for _ in 0..5 {
        let token = OwnerToken::random().unwrap();
        assert!(backend.try_take(&key, &token, LEASE).await.unwrap());
        assert!(backend.reset_expiry(&key, &token, LEASE).await.unwrap());
        assert_eq!(
            backend.release(&key, &token).await.unwrap(),
            ReleaseOutcome::Released
        );
    }
    let after = server.command_calls();
    let delta = |c: &str| after.get(c).copied().unwrap_or(0) - before.get(c).copied().unwrap_or(0);
    // 5 SET NX, plus 5 SET IFEQ where renewal is native, or the one that was a syntax error
    // (the server counts it as a call) where it is not.
    let native_extend = e.extend == "set";
    assert_eq!(
        delta("set"),
        5 + if native_extend { 5 } else { 1 },
        "{after:?}"
    );
    let lua = u64::from(e.release == "evalsha") + u64::from(e.extend == "evalsha");
    // The first EVALSHA of each script meets NOSCRIPT (a fresh server) and is followed by EVAL.
    assert_eq!(delta("evalsha"), 5 * lua, "{after:?}");
    assert_eq!(delta("eval"), lua, "{after:?}");
    assert_eq!(delta("delex"), if e.release == "delex" { 5 } else { 0 });
    assert_eq!(delta("delifeq"), if e.release == "delifeq" { 5 } else { 0 });
    assert_eq!(
        probe_errors(server) - before_errors,
        e.probe_errors,
        "unknown-command / syntax-error probes, once per connection"
    );
}

/// A `SCRIPT FLUSH` costs one `EVAL` per script, and nothing else changes.
async fn noscript_recovery(server: &RedisServer) {
    let locks = LockProvider::connect(&server.url("lease=1s"))
        .await
        .unwrap();
    let key = unique_key("noscript");
    let first = locks.try_acquire(&key).await.unwrap();
    let t1 = first.fencing_token().unwrap();
    first.release().await.unwrap();
    let mut conn = admin(server).await;
    let _: () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query_async(&mut conn)
        .await
        .unwrap();
    let evals = calls(server, "eval");
    let guard = locks.try_acquire(&key).await.unwrap();
    assert!(guard.fencing_token().unwrap() > t1);
    guard.release().await.unwrap();
    let lua_release = u64::from(expect(server.flavor).release == "evalsha");
    assert_eq!(
        calls(server, "eval") - evals,
        1 + lua_release,
        "one EVAL per flushed script"
    );
}

/// Killing the lock's connection: renewal reconnects in time and the lock is kept; the
/// capabilities are discovered again on the new connection.
async fn client_kill(server: &RedisServer) {
    let lease = Duration::from_millis(1500);
    let backend = RedisBackend::connect(&server.url(&format!("lease={}ms", lease.as_millis())))
        .await
        .unwrap();
    let locks = LockProvider::from_backend(backend.clone());
    let key = unique_key("kill");
    // A release and a renewal first, so the connection has found all its paths.
    locks
        .try_acquire(&key)
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    let guard = locks.try_acquire(&key).await.unwrap();
    let mut conn = admin(server).await;
    // The key's time to live only goes down until a renewal sets it again.
    let storage_key = backend.storage_key(&key);
    let mut last_ttl = i64::MAX;
    support::wait_until("the lock is renewed", lease, async || {
        let ttl: i64 = redis::cmd("PTTL")
            .arg(&storage_key)
            .query_async(&mut conn)
            .await
            .unwrap();
        let renewed = ttl > last_ttl;
        last_ttl = ttl;
        renewed
    })
    .await;
    let errors = probe_errors(server);
    let killed: i64 = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("TYPE")
        .arg("normal")
        .arg("SKIPME")
        .arg("yes")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(killed >= 1);
    let other = LockProvider::connect(&server.url("")).await.unwrap();
    // Two leases later, still held: a renewal met the dead connection, and a retry on the
    // new one got through before the local deadline.
    let outcome = other.acquire(&key, LEASE * 3).await;
    assert!(
        matches!(outcome, Err(LockError::Timeout { .. })),
        "{outcome:?}"
    );
    assert!(!guard.is_lost());
    guard.release().await.unwrap();
    // Connecting costs errors of its own on some servers (Redis 7.0 does not know the
    // client's `CLIENT SETINFO`), and the connection manager may have taken more than one
    // attempt: count the probes modulo that.
    let delta = probe_errors(server) - errors;
    let before_connect = probe_errors(server);
    drop(RedisBackend::connect(&server.url("")).await.unwrap());
    let per_connection = probe_errors(server) - before_connect;
    let probes = expect(server.flavor).probe_errors;
    assert!(
        delta >= probes
            && if per_connection == 0 {
                delta == probes
            } else {
                (delta - probes).is_multiple_of(per_connection)
            },
        "after a reconnect the paths are probed again: {delta} errors, {probes} probes, {per_connection} per connection"
    );
}

/// After a restart the lock is gone (no persistence): the holder learns it from the renewal,
/// and the provider works on the new server.
async fn server_restart(server: &mut RedisServer) {
    let locks = LockProvider::connect(&server.url("lease=1s"))
        .await
        .unwrap();
    let key = unique_key("restart");
    let guard = locks.try_acquire(&key).await.unwrap();
    server.restart();
    let fired = tokio::time::timeout(LEASE * 2, guard.lost_token().cancelled()).await;
    assert!(fired.is_ok(), "lost token after the restart");
    assert!(matches!(guard.release().await, Err(LockError::Lost { .. })));
    let again = locks
        .acquire(&key, Duration::from_secs(5))
        .await
        .expect("works after the restart");
    again.release().await.unwrap();
    assert!(calls(server, expect(server.flavor).release) >= 1);
}

/// Locks with different leases on one backend are each renewed on their own schedule: one
/// with a 30 s lease is taken first (the renewal driver then plans to look in 10 s), then one
/// with a 300 ms lease, which must still be renewed every 100 ms and never lost; both stay
/// held for 2 s (more than six short leases) and another provider cannot take either.
async fn mixed_leases(server: &RedisServer) {
    let url = server.url("lease=30s");
    let (a, b) = (
        LockProvider::connect(&url).await.unwrap(),
        LockProvider::connect(&url).await.unwrap(),
    );
    let (long_key, short_key) = (unique_key("long"), unique_key("short"));
    let long = a.try_acquire(&long_key).await.unwrap();
    let short = a
        .lock(&short_key)
        .lease(Duration::from_millis(300))
        .try_acquire()
        .await
        .unwrap();
    let outcome = b.acquire(&short_key, Duration::from_secs(2)).await;
    assert!(
        matches!(outcome, Err(LockError::Timeout { .. })),
        "{outcome:?}"
    );
    assert!(!short.is_lost() && !long.is_lost());
    assert!(matches!(
        b.try_acquire(&long_key).await,
        Err(LockError::AlreadyHeld { .. })
    ));
    short.release().await.unwrap();
    long.release().await.unwrap();
    b.try_acquire(&short_key)
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
}

/// A holder process killed with SIGKILL: its key frees itself when the lease runs out (not
/// before), and the next holder's fencing token is larger.
async fn sigkill_holder(server: &RedisServer) {
    let lease = Duration::from_secs(1);
    let url = server.url("lease=1s");
    let key = unique_key("sigkill");
    let holder = support::Holder::start(&url, &key);
    let first = holder.fencing_token.expect("redis issues tokens");
    let locks = LockProvider::connect(&url).await.unwrap();
    assert!(matches!(
        locks.try_acquire(&key).await,
        Err(LockError::AlreadyHeld { .. })
    ));
    holder.kill();
    let killed_at = Instant::now();
    let guard = locks
        .acquire(&key, lease * 5)
        .await
        .expect("the lease of a killed holder runs out");
    assert!(
        killed_at.elapsed() <= lease + Duration::from_secs(1),
        "{:?}",
        killed_at.elapsed()
    );
    assert!(guard.fencing_token().unwrap() > first);
    guard.release().await.unwrap();
}

/// A holder stopped with SIGSTOP past its local deadline: when it resumes, its lost token
/// fires at once, before the server lets anyone else take the lock.
async fn sigstop_holder(server: &RedisServer) {
    let lease = Duration::from_secs(3);
    let url = server.url(&format!("lease={}ms", lease.as_millis()));
    let key = unique_key("sigstop");
    let backend = RedisBackend::connect(&url).await.unwrap();
    let storage_key = backend.storage_key(&key);
    let mut child = Command::new(support::worker_bin())
        .args(["hold", &url, &key])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let pid = child.id().to_string();
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    let stdout = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            let _ = tx.send(line);
        }
    });
    let held = rx.recv_timeout(Duration::from_secs(10)).unwrap();
    assert!(held.starts_with("held "), "{held}");
    let mut conn = admin(server).await;
    assert!(
        Command::new("kill")
            .args(["-STOP", &pid])
            .status()
            .unwrap()
            .success()
    );
    let ttl: i64 = redis::cmd("PTTL")
        .arg(&storage_key)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(ttl > 0, "held while stopped: {ttl}");
    // Resume a tenth of a lease before the server's expiry: past the holder's local deadline
    // (80% of the lease after its last renewal was sent), before anyone can take the lock.
    let expires = Instant::now() + Duration::from_millis(ttl as u64);
    tokio::time::sleep_until((expires - lease / 10).into()).await;
    assert!(
        Command::new("kill")
            .args(["-CONT", &pid])
            .status()
            .unwrap()
            .success()
    );
    let contender = LockProvider::connect(&server.url("")).await.unwrap();
    let guard = contender
        .acquire(&key, lease * 2)
        .await
        .expect("free once the stopped holder's lease ran out");
    let acquired_at = now_ms();
    let lost = rx
        .recv_timeout(Duration::from_secs(5))
        .expect("the resumed holder reports the loss");
    let lost_at: u128 = lost
        .strip_prefix("lost ")
        .unwrap_or_else(|| panic!("{lost}"))
        .parse()
        .unwrap();
    assert!(
        lost_at < acquired_at,
        "the holder learned of the loss at {lost_at}, after another process took the lock at {acquired_at}"
    );
    guard.release().await.unwrap();
    let _ = child.kill();
    let _ = child.wait();
}

/// When renewals keep failing (here: the user's permissions are revoked, so every renewal
/// answers NOPERM), the lost token fires while the server still has the lock: before anyone
/// else can take it.
async fn failing_renewals(server: &RedisServer) {
    let mut conn = admin(server).await;
    let _: () = redis::cmd("ACL")
        .arg(&["SETUSER", "holder", "on", ">pw", "~*", "+@all"])
        .query_async(&mut conn)
        .await
        .unwrap();
    let url = format!("redis://holder:pw@127.0.0.1:{}/?lease=2s", server.port());
    let locks = LockProvider::connect(&url).await.unwrap();
    let backend = RedisBackend::connect(&url).await.unwrap();
    let key = unique_key("failing");
    let guard = locks.try_acquire(&key).await.unwrap();
    let _: () = redis::cmd("ACL")
        .arg(&["SETUSER", "holder", "-@all"])
        .query_async(&mut conn)
        .await
        .unwrap();
    let fired = tokio::time::timeout(Duration::from_secs(3), guard.lost_token().cancelled()).await;
    assert!(fired.is_ok(), "lost token fired");
    let ttl: i64 = redis::cmd("PTTL")
        .arg(backend.storage_key(&key))
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(
        ttl > 0,
        "the lock had already expired ({ttl}) when the holder learned of the loss"
    );
}

/// A user without EVAL/EVALSHA gets NOPERM, clearly, and never a silent fallback. Where the
/// server has native release and renewal, fencing=false needs no script at all.
async fn noperm_without_eval(server: &RedisServer) {
    let mut conn = admin(server).await;
    let _: () = redis::cmd("ACL")
        .arg(&[
            "SETUSER", "nolua", "on", ">secret", "~*", "+@all", "-eval", "-evalsha",
        ])
        .query_async(&mut conn)
        .await
        .unwrap();
    let url = |options: &str| {
        format!(
            "redis://nolua:secret@127.0.0.1:{}/?{options}",
            server.port()
        )
    };
    let key = unique_key("noperm");
    // Fencing takes the lock with a script.
    let locks = LockProvider::connect(&url("")).await.unwrap();
    let err = locks.try_acquire(&key).await.unwrap_err();
    assert_eq!(err.db_code(), Some("NOPERM"), "{err}");
    assert!(err.to_string().contains("+evalsha"), "{err}");
    assert!(!err.to_string().contains("secret"), "{err}");
    // Without fencing, acquisition is a SET; release needs a script unless native.
    let backend = RedisBackend::connect(&url("fencing=false")).await.unwrap();
    let token = OwnerToken::random().unwrap();
    assert!(backend.try_take(&key, &token, LEASE).await.unwrap());
    let e = expect(server.flavor);
    let renewed = backend.reset_expiry(&key, &token, LEASE).await;
    if e.extend == "set" {
        assert!(renewed.unwrap());
    } else {
        assert_eq!(renewed.unwrap_err().db_code(), Some("NOPERM"));
    }
    let released = backend.release(&key, &token).await;
    if e.release == "evalsha" {
        assert_eq!(released.unwrap_err().db_code(), Some("NOPERM"));
        // Nothing else deleted it.
        assert!(backend.verify_still_held(&key, &token).await.unwrap());
    } else {
        assert_eq!(released.unwrap(), ReleaseOutcome::Released);
    }
}

/// 1,000 acquisitions canceled at random points leave no lock behind.
async fn random_cancellations(server: &RedisServer) {
    let locks = LockProvider::connect(&server.url("lease=30s"))
        .await
        .unwrap();
    let backend = RedisBackend::connect(&server.url("")).await.unwrap();
    let base = unique_key("cancel");
    let mut rng = fastrand_seed();
    let mut completed = 0;
    for batch in 0..20 {
        let tasks: Vec<_> = (0..50)
            .map(|i| {
                let locks = locks.clone();
                let key = format!("{base}:{}", (batch * 50 + i) % 97);
                let budget = Duration::from_micros(next(&mut rng) % 1500);
                tokio::spawn(async move {
                    match tokio::time::timeout(budget, locks.try_acquire(&key)).await {
                        Ok(Ok(guard)) => {
                            drop(guard);
                            1
                        }
                        _ => 0,
                    }
                })
            })
            .collect();
        for t in tasks {
            completed += t.await.unwrap();
        }
    }
    let pattern = {
        let mut p = backend.storage_key(&base);
        p.pop(); // the closing brace
        p.extend_from_slice(b"*");
        p
    };
    let mut conn = admin(server).await;
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let keys: Vec<Vec<u8>> = redis::cmd("KEYS")
            .arg(&pattern)
            .query_async(&mut conn)
            .await
            .unwrap();
        let locks_left: Vec<_> = keys.iter().filter(|k| k.ends_with(b"}")).collect();
        if locks_left.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{} lock keys left behind ({completed} of 1000 acquisitions completed)",
            locks_left.len()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(support::eventually(Duration::from_secs(5), || locks.local_key_count() == 0).await);
}

/// The raw-token API: outcomes, and renewal that never recreates or touches another owner.
async fn raw_token_api(server: &RedisServer) {
    let backend = RedisBackend::connect(&server.url("")).await.unwrap();
    let mut conn = admin(server).await;
    let key = unique_key("raw");
    let storage = backend.storage_key(&key);
    let mine = OwnerToken::from_text("process-a").unwrap();
    let theirs = OwnerToken::from_bytes(vec![0u8, 1, 2]).unwrap();
    // Missing: not renewed, not created.
    assert!(!backend.reset_expiry(&key, &mine, LEASE).await.unwrap());
    let exists: i64 = redis::cmd("EXISTS")
        .arg(&storage)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(exists, 0, "renewal recreated a missing lock");
    assert_eq!(
        backend.release(&key, &mine).await.unwrap(),
        ReleaseOutcome::AlreadyReleased
    );
    // Another owner's lock: untouched.
    assert!(
        backend
            .try_take(&key, &theirs, Duration::from_secs(60))
            .await
            .unwrap()
    );
    assert!(!backend.try_take(&key, &mine, LEASE).await.unwrap());
    assert!(!backend.reset_expiry(&key, &mine, LEASE).await.unwrap());
    let ttl: i64 = redis::cmd("PTTL")
        .arg(&storage)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(ttl > 50_000, "another owner's lease was touched: {ttl}");
    assert_eq!(
        backend.release(&key, &mine).await.unwrap(),
        ReleaseOutcome::NotOwned
    );
    assert_eq!(
        backend.owner_token(&key).await.unwrap(),
        Some(theirs.clone())
    );
    assert!(!backend.verify_still_held(&key, &mine).await.unwrap());
    assert_eq!(backend.remaining_lease(&key, &mine).await.unwrap(), None);
    // The token is shared: another process (another backend) renews and releases it.
    let other = RedisBackend::connect(&server.url("")).await.unwrap();
    assert!(
        other
            .reset_expiry(&key, &theirs, Duration::from_secs(2))
            .await
            .unwrap()
    );
    let left = backend
        .remaining_lease(&key, &theirs)
        .await
        .unwrap()
        .unwrap();
    assert!(
        left <= Duration::from_secs(2) && left > Duration::from_secs(1),
        "{left:?}"
    );
    assert!(backend.verify_still_held(&key, &theirs).await.unwrap());
    assert_eq!(
        other.release(&key, &theirs).await.unwrap(),
        ReleaseOutcome::Released
    );
    assert_eq!(backend.owner_token(&key).await.unwrap(), None);
    // Expired: not renewed, not recreated.
    assert!(
        backend
            .try_take(&key, &mine, Duration::from_millis(100))
            .await
            .unwrap()
    );
    assert!(
        support::eventually(Duration::from_secs(3), || server
            .raw(&["EXISTS", std::str::from_utf8(&storage).unwrap()])
            .is_some_and(|r| r.starts_with(":0")))
        .await
    );
    assert!(!backend.reset_expiry(&key, &mine, LEASE).await.unwrap());
    assert_eq!(backend.owner_token(&key).await.unwrap(), None);
    // Empty keys are refused before any I/O.
    assert!(matches!(
        backend.release("", &mine).await,
        Err(LockError::InvalidKey { .. })
    ));
}

/// Renewal keeps a lock past several leases; fencing=false issues no tokens.
async fn renewal_and_options(server: &RedisServer) {
    let a = LockProvider::connect(&server.url("lease=500ms&fencing=false"))
        .await
        .unwrap();
    let b = LockProvider::connect(&server.url("lease=500ms"))
        .await
        .unwrap();
    let key = unique_key("renew");
    let guard = a.try_acquire(&key).await.unwrap();
    assert_eq!(guard.fencing_token(), None);
    let outcome = b.acquire(&key, Duration::from_millis(1500)).await;
    assert!(
        matches!(outcome, Err(LockError::Timeout { .. })),
        "{outcome:?}"
    );
    assert!(!guard.is_lost());
    guard.release().await.unwrap();
    // The per-acquisition lease reaches the server.
    let backend = RedisBackend::connect(&server.url("")).await.unwrap();
    let g = b
        .lock(&key)
        .lease(Duration::from_secs(7))
        .try_acquire()
        .await
        .unwrap();
    let mut conn = admin(server).await;
    let ttl: i64 = redis::cmd("PTTL")
        .arg(backend.storage_key(&key))
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!((5000..=7000).contains(&ttl), "{ttl}");
    g.release().await.unwrap();
    // The provider's own backend trait: a dropped handle stops renewing.
    let acquired = backend
        .try_acquire(
            dlock::backend::LockRequest::new(&key).with_lease(Some(Duration::from_millis(300))),
        )
        .await
        .unwrap()
        .unwrap();
    drop(acquired);
    let c = LockProvider::connect(&server.url("")).await.unwrap();
    let g = c
        .acquire(&key, Duration::from_secs(3))
        .await
        .expect("a dropped handle's lease runs out");
    g.release().await.unwrap();
}

/// A backend on the application's own connection manager and options from code.
async fn existing_manager(server: &RedisServer) {
    let manager = redis::aio::ConnectionManager::new(server.client())
        .await
        .unwrap();
    let backend = RedisBackend::builder_on_manager(manager.clone())
        .prefix("app-locks:")
        .lease(Duration::from_secs(2))
        .connect()
        .await
        .unwrap();
    let storage = backend.storage_key("jobs:{nightly}");
    assert_eq!(storage, b"app-locks:{jobs:%7Bnightly%7D}".to_vec());
    let locks = LockProvider::from_backend(backend);
    let guard = locks.try_acquire("jobs:{nightly}").await.unwrap();
    let mut conn = manager.clone();
    let ttl: i64 = redis::cmd("PTTL")
        .arg(&storage)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!((1..=2000).contains(&ttl), "{ttl}");
    guard.release().await.unwrap();
    let exists: i64 = redis::cmd("EXISTS")
        .arg(&storage)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(exists, 0);
    assert!(matches!(
        RedisBackend::builder_on_manager(manager)
            .prefix("bad{")
            .connect()
            .await,
        Err(LockError::Config { .. })
    ));
}

fn fastrand_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(1);
    h.finish() | 1
}

fn next(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

macro_rules! flavor_tests {
    ($module:ident, $flavor:expr) => {
        mod $module {
            use super::*;

            fn start() -> Option<RedisServer> {
                RedisServer::start($flavor)
            }

            macro_rules! harness {
                () => {
                    match RedisHarness::start($flavor) {
                        Some(h) => std::future::ready(h),
                        None => return,
                    }
                };
            }

            crate::conformance_suite!(harness!());

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn paths() {
                let Some(server) = start() else { return };
                paths_taken(&server).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn noscript() {
                let Some(server) = start() else { return };
                noscript_recovery(&server).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn killed_connection() {
                let Some(server) = start() else { return };
                client_kill(&server).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn restart() {
                let Some(mut server) = start() else { return };
                server_restart(&mut server).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn different_leases() {
                let Some(server) = start() else { return };
                mixed_leases(&server).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn killed_holder() {
                let Some(server) = start() else { return };
                sigkill_holder(&server).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn stopped_holder() {
                let Some(server) = start() else { return };
                sigstop_holder(&server).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn renewals_failing() {
                let Some(server) = start() else { return };
                failing_renewals(&server).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn noperm() {
                let Some(server) = start() else { return };
                noperm_without_eval(&server).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn cancellations() {
                let Some(server) = start() else { return };
                random_cancellations(&server).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn raw_tokens() {
                let Some(server) = start() else { return };
                raw_token_api(&server).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn renewal() {
                let Some(server) = start() else { return };
                renewal_and_options(&server).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn application_manager() {
                let Some(server) = start() else { return };
                existing_manager(&server).await;
            }

            #[test]
            fn multi_process() {
                let Some(server) = start() else { return };
                support::run_multi_process(
                    &server.url("lease=5s"),
                    "jobs:multi-process",
                    4,
                    40,
                    support::Fencing::Every,
                );
            }
        }
    };
}

flavor_tests!(redis7, Flavor::Redis7);
flavor_tests!(valkey81, Flavor::Valkey81);
flavor_tests!(valkey91, Flavor::Valkey91);
flavor_tests!(redis8, Flavor::Redis8);

#[tokio::test]
async fn bad_urls_and_unreachable_servers() {
    for url in [
        "redis://127.0.0.1:1/?lease=soon",
        "redis://127.0.0.1:1/?lease=10ms",
        "redis://127.0.0.1:1/?prefix=a{b",
        "redis://127.0.0.1:1/?nope=1",
    ] {
        let err = LockProvider::connect(url).await.unwrap_err();
        assert_eq!(err.code(), "DistributedLock.Configuration", "{url}: {err}");
    }
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let err = LockProvider::connect(&format!(
        "redis://user:hunter2@127.0.0.1:{port}/?timeout=1s"
    ))
    .await
    .unwrap_err();
    assert_eq!(err.status(), 503, "{err}");
    assert!(!err.to_string().contains("hunter2"), "{err}");
}
