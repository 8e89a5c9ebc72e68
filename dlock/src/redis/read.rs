//! Read locks: readers' shares of a key, in a sorted set scored by lease end, and the intent of
//! a waiting writer (see [Read locks](super#read-locks)). One Lua script per operation, keys
//! only through `KEYS`.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, LazyLock, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use redis::{ErrorKind, RedisError, Value};

use super::commands::{CommandPath, Counter, Script, WaiterTry};
use super::{Cleanup, KeyLayout, Kind, OwnerToken, PLAIN_FENCE_MARK, Shared, check_lease};
use crate::LockError;
use crate::backend::{LockRequest, ReleaseOutcome, WaitTry};

/// The server's time in milliseconds, in a script (`TIME`: seconds and microseconds).
macro_rules! now_ms {
    () => {
        "local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"
    };
}

/// Drops the expired readers of `KEYS[2]` and sets the lock `KEYS[1]` (held by readers: the
/// empty value) and the set to live until the latest reader's lease end, or deletes both when
/// no reader is left. Needs `now`.
macro_rules! settle {
    () => {
        "redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
local last = redis.call('ZRANGE', KEYS[2], -1, -1, 'WITHSCORES')
if last[2] then
  local ttl = tonumber(last[2]) - now
  redis.call('SET', KEYS[1], '', 'PX', ttl)
  redis.call('PEXPIRE', KEYS[2], ttl)
else
  redis.call('DEL', KEYS[1], KEYS[2])
end
"
    };
}

/// Takes a reader's share: `KEYS[1]` lock, `KEYS[2]` readers, `KEYS[3]` writer's intent,
/// `KEYS[4]` the lock's waiting mark (the lock's key again when the backend marks nothing),
/// `KEYS[5]` fencing counter (absent without fencing),
/// `KEYS[6]` the store's record of its shared counters' mode (with `fencing_counters` only);
/// `ARGV[1]` token, `ARGV[2]` lease in ms, `ARGV[3]` `0`, or for a waiter's try the waiting
/// mark's time to live in ms (the try then asks for how long the contention may last, and
/// sets the mark, see [`ACQUIRE_FENCED_LUA`](super::commands::ACQUIRE_FENCED_LUA)), `ARGV[4]`
/// (with `KEYS[6]`) the mode this backend joined: when the record holds another, nothing is
/// taken and the answer is the error `DLOCKCOUNTERS <the record>`.
/// Returns the new counter value (0 without fencing), or when a writer holds the key (any
/// non-empty value) or waits for it, nil, or for a waiter's try `{pttl, marked}` of the
/// writer's lock or intent (pttl -3 when the user may not run `PTTL`, asked with `pcall`;
/// `marked` 0 when the server refused the mark).
pub(crate) const READ_ACQUIRE_LUA: &str = concat!(
    "if KEYS[6] then
  local m = redis.call('GET', KEYS[6])
  if m ~= ARGV[4] then
    return redis.error_reply('DLOCKCOUNTERS ' .. (m or 'none'))
  end
end
local function held(k)
  if (ARGV[3] or '0') == '0' then
    return false
  end
  local m = 1
  if KEYS[4] ~= KEYS[1] and redis.pcall('SET', KEYS[4], '1', 'PX', ARGV[3]).err then
    m = 0
  end
  local t = redis.pcall('PTTL', k)
  if type(t) ~= 'number' then
    t = -3
  end
  return {t, m}
end
local v = redis.call('GET', KEYS[1])
if v and v ~= '' then
  return held(KEYS[1])
end
if redis.call('EXISTS', KEYS[3]) == 1 then
  return held(KEYS[3])
end
",
    now_ms!(),
    "redis.call('ZADD', KEYS[2], now + tonumber(ARGV[2]), ARGV[1])
",
    settle!(),
    "if KEYS[5] then
  return redis.call('INCR', KEYS[5])
end
return 0"
);

/// Sets a reader's lease to `ARGV[2]` ms from now if its share is live: 1 done, 0 lost (the
/// key is no longer held by readers, or the share is gone or expired: an expired share is
/// never revived, a writer may have held the key since). `KEYS[1]` lock, `KEYS[2]` readers;
/// `ARGV[1]` token.
pub(crate) const READ_EXTEND_LUA: &str = concat!(
    "if redis.call('GET', KEYS[1]) ~= '' then
  return 0
end
",
    now_ms!(),
    "local s = redis.call('ZSCORE', KEYS[2], ARGV[1])
if not s or tonumber(s) <= now then
  return 0
end
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[2]), ARGV[1])
",
    settle!(),
    "return 1"
);

/// Gives a reader's share back: 1 released, 0 its share was gone or expired and no writer
/// holds the key, -1 a writer holds it. `KEYS[1]` lock, `KEYS[2]` readers, `KEYS[3]`
/// (optional) the lock's waiting mark; `ARGV[1]` token. When no reader is left, the key is
/// free: announced on the channel named as the lock key, which wakes its waiters (with
/// `pcall`, as the lock's release), and with `KEYS[3]` only while the mark lives or cannot be
/// read, as [`RELEASE_LUA`](super::commands::RELEASE_LUA) does.
pub(crate) const READ_RELEASE_LUA: &str = concat!(
    "local v = redis.call('GET', KEYS[1])
local s = redis.call('ZSCORE', KEYS[2], ARGV[1])
if s then
  redis.call('ZREM', KEYS[2], ARGV[1])
end
if v ~= '' then
  if v then
    return -1
  end
  return 0
end
",
    now_ms!(),
    settle!(),
    "if not last[2] and not (KEYS[3] and redis.pcall('EXISTS', KEYS[3]) == 0) then
  redis.pcall('PUBLISH', KEYS[1], '')
end
if s and tonumber(s) > now then
  return 1
end
return 0"
);

/// Whether a reader's share is live: 1 or 0. `KEYS[1]` lock, `KEYS[2]` readers; `ARGV[1]`
/// token.
pub(crate) const READ_VERIFY_LUA: &str = concat!(
    "if redis.call('GET', KEYS[1]) ~= '' then
  return 0
end
local s = redis.call('ZSCORE', KEYS[2], ARGV[1])
if not s then
  return 0
end
",
    now_ms!(),
    "if tonumber(s) > now then
  return 1
end
return 0"
);

/// A waiting writer's intent: when readers hold `KEYS[1]`, sets `KEYS[2]` for `ARGV[1]` ms
/// and returns 1; otherwise 0.
pub(crate) const WRITER_WAITS_LUA: &str = "\
if redis.call('GET', KEYS[1]) == '' then
  redis.call('SET', KEYS[2], '1', 'PX', ARGV[1])
  return 1
end
return 0";

struct Scripts {
    acquire: Script,
    extend: Script,
    release: Script,
    verify: Script,
    writer_waits: Script,
}

static SCRIPTS: LazyLock<Scripts> = LazyLock::new(|| Scripts {
    acquire: Script::new(
        READ_ACQUIRE_LUA,
        &[
            "get",
            "exists",
            "time",
            "zadd",
            "zremrangebyscore",
            "zrange",
            "set",
            "pexpire",
            "del",
            "incr",
        ],
    ),
    extend: Script::new(
        READ_EXTEND_LUA,
        &[
            "get",
            "time",
            "zscore",
            "zadd",
            "zremrangebyscore",
            "zrange",
            "set",
            "pexpire",
            "del",
        ],
    ),
    release: Script::new(
        READ_RELEASE_LUA,
        &[
            "get",
            "zscore",
            "zrem",
            "time",
            "zremrangebyscore",
            "zrange",
            "set",
            "pexpire",
            "del",
        ],
    ),
    verify: Script::new(READ_VERIFY_LUA, &["get", "zscore", "time"]),
    writer_waits: Script::new(WRITER_WAITS_LUA, &["get", "set"]),
});

/// A key that goes with the lock stored under `lock_key`: `lock_key` + `suffix` when tagged
/// (never a lock key: those end with `}`; the hash tag is the lock's), `lock_key` + byte 0xFF
/// + `suffix` when plain (never a lock key: those are UTF-8), as the fencing counter.
pub(super) fn companion_key(layout: KeyLayout, lock_key: &[u8], suffix: &[u8]) -> Vec<u8> {
    let mut key = Vec::with_capacity(lock_key.len() + suffix.len() + 1);
    key.extend_from_slice(lock_key);
    if layout == KeyLayout::Plain {
        key.push(PLAIN_FENCE_MARK);
    }
    key.extend_from_slice(suffix);
    key
}

/// The sorted set of a lock's readers (member: owner token, score: lease end in server
/// milliseconds).
pub(super) fn readers_key(layout: KeyLayout, lock_key: &[u8]) -> Vec<u8> {
    companion_key(layout, lock_key, b":readers")
}

/// The key of a waiting writer's intent on a lock.
pub(super) fn intent_key(layout: KeyLayout, lock_key: &[u8]) -> Vec<u8> {
    companion_key(layout, lock_key, b":writer")
}

fn millis(lease: Duration) -> String {
    u64::try_from(lease.as_millis())
        .unwrap_or(u64::MAX)
        .max(1)
        .to_string()
}

fn unexpected(what: &str, reply: &Value) -> RedisError {
    RedisError::from((
        ErrorKind::UnexpectedReturnType,
        "unexpected reply",
        format!("{what} answered {reply:?}"),
    ))
}

/// The keys this backend left a waiting writer's intent on, to clear them once the writer gets
/// the key; and whether the server refused the intent script (a user without scripts: then
/// writers leave no intent).
#[derive(Debug, Default)]
pub(super) struct Intents {
    any: AtomicBool,
    refused: AtomicBool,
    keys: Mutex<HashSet<Vec<u8>>>,
}

/// The most keys remembered; past it, the intents are left to expire.
const INTENTS_KEPT: usize = 1024;

impl Intents {
    fn keys(&self) -> MutexGuard<'_, HashSet<Vec<u8>>> {
        self.keys.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// One read acquisition: the share, under the answer window of a lock's acquisition.
pub(super) async fn try_acquire(
    shared: &Arc<Shared>,
    request: LockRequest<'_>,
) -> Result<WaitTry, LockError> {
    let lease = request.lease.unwrap_or(shared.lease);
    check_lease(lease)?;
    let token = shared.owner_label.token()?;
    let lock_key: Arc<[u8]> = Arc::from(shared.lock_key(request.key));
    // An abandoned acquisition of this key may still be giving it back.
    shared.settling.wait(&lock_key, shared.timeout).await;
    let readers = readers_key(shared.layout, &lock_key);
    let intent = intent_key(shared.layout, &lock_key);
    let plan = super::bounded::plan(shared, request.key, &lock_key).await?;
    let mark = shared.conn.waiting_mark(&lock_key);
    let keys: Vec<&[u8]> = vec![&lock_key, &readers, &intent];
    let mut counters: Vec<&[u8]> = Vec::new();
    let mut mode = None;
    match plan.counter() {
        None => {}
        Some(Counter::PerKey(fence)) => counters.push(fence),
        Some(Counter::Shared {
            counter,
            record,
            mode: joined,
        }) => {
            counters.extend([counter, record]);
            mode = Some(joined);
        }
    }
    let ms = millis(lease);
    // From here until the answer is read, a drop (or a failure) may leave the share taken:
    // the cleanup gives it back in the background.
    let mut cleanup = Cleanup {
        shared: Arc::clone(shared),
        key: Arc::clone(&lock_key),
        token: token.clone(),
        armed: true,
        kind: Kind::Read,
    };
    let mark_ms = request.poll_pause.map_or_else(
        || "0".to_owned(),
        |pause| {
            WaiterTry {
                pause,
                queued: false,
            }
            .mark_ms()
        },
    );
    let mut args: Vec<&[u8]> = vec![token.as_bytes(), ms.as_bytes(), mark_ms.as_bytes()];
    args.extend(mode);
    let sent = Instant::now();
    // Without a mark, the lock's key again in its place (see [`READ_ACQUIRE_LUA`]).
    let mut marked = keys.clone();
    marked.push(mark.as_deref().unwrap_or(&lock_key));
    marked.extend(&counters);
    let mut unmarked = keys;
    unmarked.push(&lock_key);
    unmarked.extend(&counters);
    let eval = shared
        .conn
        .eval_waiting(&SCRIPTS.acquire, &marked, &unmarked, &args, shared.wait);
    let (reply, acked) = shared
        .bounded("acquiring a read lock", eval)
        .await
        .map_err(|err| plan.refine(shared, err))?;
    let fencing_token = match reply {
        Value::Nil => {
            cleanup.armed = false;
            return Ok(WaitTry::Held { retry_within: None });
        }
        Value::Array(items) => {
            cleanup.armed = false;
            let ttl = shared
                .conn
                .waiter_reply(&items, "the read acquisition script's SET of the mark");
            return Ok(WaitTry::Held {
                retry_within: super::expiry_hint(ttl),
            });
        }
        Value::Int(n) if shared.fencing => plan.token(u64::try_from(n).ok())?,
        Value::Int(_) => None,
        other => {
            return Err(super::redis_error(
                "acquiring a read lock",
                unexpected("the read acquisition script", &other),
                &shared.prefix,
            ));
        }
    };
    super::hold(shared, &request, cleanup, lease, sent, fencing_token, acked).await
}

/// Gives reader `token`'s share of the lock under `key` back.
pub(super) async fn release(
    shared: &Shared,
    key: &[u8],
    token: &OwnerToken,
) -> Result<(ReleaseOutcome, CommandPath), RedisError> {
    let readers = readers_key(shared.layout, key);
    let reply = shared
        .conn
        .eval_release(&SCRIPTS.release, key, &[key, &readers], &[token.as_bytes()])
        .await?;
    let outcome = match reply {
        Value::Int(1) => ReleaseOutcome::Released,
        Value::Int(0) => ReleaseOutcome::AlreadyReleased,
        Value::Int(-1) => ReleaseOutcome::NotOwned,
        other => return Err(unexpected("the read release script", &other)),
    };
    Ok((outcome, CommandPath::Lua))
}

/// Sets reader `token`'s lease on the lock under `key` to `lease` from now, if its share is
/// live: `true` when done.
pub(super) async fn extend(
    shared: &Shared,
    key: &[u8],
    token: &OwnerToken,
    lease: Duration,
) -> Result<(bool, CommandPath), RedisError> {
    let readers = readers_key(shared.layout, key);
    let ms = millis(lease);
    let reply = shared
        .conn
        .eval(
            &SCRIPTS.extend,
            &[key, &readers],
            &[token.as_bytes(), ms.as_bytes()],
        )
        .await?;
    match reply {
        Value::Int(n) => Ok((n == 1, CommandPath::Lua)),
        other => Err(unexpected("the read extension script", &other)),
    }
}

/// The script that renews a reader's share (see [`extend`]), for a batch of renewals
/// ([`Conn::extend_many`](super::commands::Conn::extend_many)), with its keys `[key, readers_key(key)]`.
pub(super) fn extend_script() -> &'static Script {
    &SCRIPTS.extend
}

/// Whether reader `token` holds a live share of the lock under `key`.
pub(super) async fn verify(
    shared: &Shared,
    key: &[u8],
    token: &OwnerToken,
) -> Result<bool, RedisError> {
    let readers = readers_key(shared.layout, key);
    let reply = shared
        .conn
        .eval(&SCRIPTS.verify, &[key, &readers], &[token.as_bytes()])
        .await?;
    match reply {
        Value::Int(n) => Ok(n == 1),
        other => Err(unexpected("the read verification script", &other)),
    }
}

/// A waiting writer found the lock under `key` held: if readers hold it, leaves the writer's
/// intent for a few of its pauses ([`crate::lease::writer_intent`]), and answers how long the
/// intent lasts. Best effort: a failure leaves it to the next poll, and a server that refuses
/// the script (a user without scripts, who takes no read locks) is not asked again.
pub(super) async fn writer_waits(shared: &Shared, key: &[u8], pause: Duration) -> Option<Duration> {
    let intents = &shared.intents;
    if intents.refused.load(Ordering::Relaxed) {
        return None;
    }
    let intent = intent_key(shared.layout, key);
    let lasts = crate::lease::writer_intent(pause);
    let ms = millis(lasts);
    let (keys, args) = ([key, &intent[..]], [ms.as_bytes()]);
    let eval = shared.conn.eval(&SCRIPTS.writer_waits, &keys, &args);
    match shared.bounded("holding readers back", eval).await {
        Ok(Value::Int(1)) => {
            let mut keys = intents.keys();
            if keys.len() >= INTENTS_KEPT {
                keys.clear();
            }
            keys.insert(key.to_vec());
            intents.any.store(true, Ordering::Relaxed);
            Some(lasts)
        }
        Ok(_) => None,
        Err(err) if err.db_code() == Some("NOPERM") => {
            intents.refused.store(true, Ordering::Relaxed);
            tracing::debug!(error = %err, "waiting writers leave no intent: the server refused its script");
            None
        }
        Err(err) => {
            tracing::debug!(error = %err, "a waiting writer's intent could not be written");
            None
        }
    }
}

/// A writer got the lock under `key`: clears the intent this backend left on it, if any
/// (best effort: otherwise it expires soon).
pub(super) async fn writer_got(shared: &Shared, key: &[u8]) {
    let intents = &shared.intents;
    if !intents.any.load(Ordering::Relaxed) {
        return;
    }
    {
        let mut keys = intents.keys();
        if !keys.remove(key) {
            return;
        }
        if keys.is_empty() {
            intents.any.store(false, Ordering::Relaxed);
        }
    }
    let mut del = redis::cmd("DEL");
    del.arg(intent_key(shared.layout, key));
    if let Err(err) = shared
        .bounded("clearing a writer's intent", shared.conn.query(&del))
        .await
    {
        tracing::debug!(error = %err, "a writer's intent could not be cleared; it expires soon");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn companion_keys_share_the_tag_or_cannot_be_lock_keys() {
        assert_eq!(
            readers_key(KeyLayout::Tagged, b"p:{k}"),
            b"p:{k}:readers".to_vec()
        );
        assert_eq!(intent_key(KeyLayout::Tagged, b"p:{k}"), b"p:{k}:writer");
        assert_eq!(
            readers_key(KeyLayout::Plain, b"p:k"),
            b"p:k\xff:readers".to_vec()
        );
        assert_eq!(intent_key(KeyLayout::Plain, b"p:k"), b"p:k\xff:writer");
    }
}
