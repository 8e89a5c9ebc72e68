//! Semaphores kept natively (see [Semaphores](super#semaphores)): a sorted set of permits
//! scored by lease end, the semaphore's count record, its waiting mark and its fencing counter,
//! under keys that share the semaphore's hash tag. One Lua script per operation, keys only
//! through `KEYS`, the server's clock (`TIME`) for every lease.

use std::sync::{Arc, LazyLock};
use std::time::{Duration, Instant};

use redis::{ErrorKind, RedisError, Value};

use super::commands::{CommandPath, Counter, Script};
use super::read::companion_key;
use super::{Cleanup, KeyLayout, Kind, NAME, OwnerToken, RedisBackend, Shared, check_lease};
use crate::LockError;
use crate::backend::{
    BoxFuture, LockRequest, PermitRequest, PermitStore, PermitTry, ReleaseOutcome, ReleaseWatch,
    WaitTry,
};

/// The server's time in milliseconds, in a script (`TIME`: seconds and microseconds), and a
/// helper that writes a whole number of milliseconds as an argument (a Lua number could be
/// written with an exponent, which `PEXPIREAT` refuses).
macro_rules! now_ms {
    () => {
        "local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function ms(x)
  return string.format('%d', x)
end
"
    };
}

/// Sets the time to live of the permits `KEYS[1]` to the latest lease end, and of the count
/// record `KEYS[2]` to the later of that and the end of the waiting mark (`mark`, its time to
/// live in ms: the record lives while a permit or the mark does); deletes the record when
/// neither is left. Needs `now` and `mark`.
macro_rules! settle {
    () => {
        "local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
local ends = now
if last[2] then
  ends = tonumber(last[2])
  redis.call('PEXPIREAT', KEYS[1], ms(ends))
end
if mark > 0 and now + mark > ends then
  ends = now + mark
end
if ends > now then
  redis.call('PEXPIREAT', KEYS[2], ms(ends))
else
  redis.call('DEL', KEYS[2])
end
"
    };
}

/// One try for a permit. `KEYS[1]` the permits (a sorted set: owner token, lease end in server
/// milliseconds), `KEYS[2]` the count record, `KEYS[3]` the waiting mark, `KEYS[4]` the fencing
/// counter (absent without fencing), `KEYS[5]` the record of the shared counters' mode (with
/// `fencing_counters` only); `ARGV[1]` token, `ARGV[2]` lease in ms, `ARGV[3]` max_count,
/// `ARGV[4]` `0` for a single try, or for a waiting try the waiting mark's time to live in ms,
/// `ARGV[5]` (with `KEYS[5]`) the mode this backend joined (as in
/// [`READ_ACQUIRE_LUA`](super::read::READ_ACQUIRE_LUA)).
///
/// Drops the expired permits, then answers `{-1, record}` when the record names another count
/// while a permit or the mark lives (nothing changed); `{0, ms}` when `max_count` permits are
/// live, or for a single try while the mark lives (`ms`: until the earliest lease end, or the
/// mark's end), after setting the mark for a waiting try; otherwise adds the permit, clears
/// the mark for a waiting try, bumps the counter and answers `{1, counter}` (0 without
/// fencing). The record then holds `ARGV[3]`. A per-semaphore counter that did not exist
/// starts at the server's time in microseconds (milliseconds × 1000), not at 1: above every
/// token the semaphore's slots issued under earlier versions, and above the tokens of a
/// counter the server lost (restarted without persistence), unless it granted a million
/// permits a second on average since its first.
pub(crate) const PERMIT_ACQUIRE_LUA: &str = concat!(
    "if KEYS[5] then
  local m = redis.call('GET', KEYS[5])
  if m ~= ARGV[5] then
    return redis.error_reply('DLOCKCOUNTERS ' .. (m or 'none'))
  end
end
",
    now_ms!(),
    "redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local live = redis.call('ZCARD', KEYS[1])
local mark = redis.call('PTTL', KEYS[3])
local rec = redis.call('GET', KEYS[2])
if rec and rec ~= ARGV[3] and (live > 0 or mark > 0) then
  return {-1, rec}
end
local waiting = ARGV[4] ~= '0'
local full = live >= tonumber(ARGV[3])
if full or (mark > 0 and not waiting) then
  local retry = mark
  if full then
    local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
    retry = tonumber(first[2]) - now
  end
  if waiting then
    mark = tonumber(ARGV[4])
    redis.call('SET', KEYS[3], '1', 'PX', ARGV[4])
    redis.call('SET', KEYS[2], ARGV[3])
",
    settle!(),
    "  end
  return {0, retry}
end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
if waiting then
  redis.call('DEL', KEYS[3])
  mark = -2
end
local fence = 0
if KEYS[4] then
  fence = redis.call('INCR', KEYS[4])
  if fence == 1 and not KEYS[5] then
    fence = now * 1000
    redis.call('SET', KEYS[4], ms(fence))
  end
end
redis.call('SET', KEYS[2], ARGV[3])
",
    settle!(),
    "return {1, fence}"
);

/// Sets a permit's lease to `ARGV[2]` ms from now if it is live: 1 done, 0 lost (gone, or
/// expired: an expired permit is never revived, another holder may have been admitted in its
/// place). `KEYS[1]` permits, `KEYS[2]` count record; `ARGV[1]` token. The permits live until
/// the latest lease end, and the record at least as long.
pub(crate) const PERMIT_EXTEND_LUA: &str = concat!(
    now_ms!(),
    "local s = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not s or tonumber(s) <= now then
  return 0
end
redis.call('ZADD', KEYS[1], 'XX', now + tonumber(ARGV[2]), ARGV[1])
local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
local ends = tonumber(last[2])
redis.call('PEXPIREAT', KEYS[1], ms(ends))
if redis.call('PTTL', KEYS[2]) < ends - now then
  redis.call('PEXPIREAT', KEYS[2], ms(ends))
end
return 1"
);

/// Gives a permit back: 1 released, 0 it was gone or expired. `KEYS[1]` permits, `KEYS[2]`
/// count record, `KEYS[3]` waiting mark; `ARGV[1]` token, `ARGV[2]` the releasing backend's
/// announcer id. A live permit given back while the mark lives is announced on the channel
/// named as the permits' key, which wakes the waiter at the head of the queue (with `pcall`,
/// as a lock's release: a user refused `PUBLISH` still releases).
pub(crate) const PERMIT_RELEASE_LUA: &str = concat!(
    now_ms!(),
    "local s = redis.call('ZSCORE', KEYS[1], ARGV[1])
if s then
  redis.call('ZREM', KEYS[1], ARGV[1])
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local mark = redis.call('PTTL', KEYS[3])
",
    settle!(),
    "if not s or tonumber(s) <= now then
  return 0
end
if mark > 0 then
  redis.pcall('PUBLISH', KEYS[1], ARGV[2])
end
return 1"
);

/// Whether a permit is live: 1 or 0. `KEYS[1]` permits; `ARGV[1]` token.
pub(crate) const PERMIT_VERIFY_LUA: &str = concat!(
    "local s = redis.call('ZSCORE', KEYS[1], ARGV[1])
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

/// How many permits are live, without changing anything: `{1, n}`, or `{-1, record}` when the
/// count record names another count than `ARGV[1]` while a permit or the waiting mark lives.
/// `KEYS[1]` permits, `KEYS[2]` count record, `KEYS[3]` waiting mark.
pub(crate) const PERMIT_HOLDERS_LUA: &str = concat!(
    now_ms!(),
    "local live = redis.call('ZCOUNT', KEYS[1], '(' .. ms(now), '+inf')
local rec = redis.call('GET', KEYS[2])
if rec and rec ~= ARGV[1] and (live > 0 or redis.call('PTTL', KEYS[3]) > 0) then
  return {-1, rec}
end
return {1, live}"
);

struct Scripts {
    acquire: Script,
    extend: Script,
    release: Script,
    verify: Script,
    holders: Script,
}

static SCRIPTS: LazyLock<Scripts> = LazyLock::new(|| Scripts {
    acquire: Script::new(
        PERMIT_ACQUIRE_LUA,
        &[
            "get",
            "time",
            "zremrangebyscore",
            "zcard",
            "pttl",
            "zrange",
            "set",
            "zadd",
            "del",
            "incr",
            "pexpireat",
        ],
    ),
    extend: Script::new(
        PERMIT_EXTEND_LUA,
        &["time", "zscore", "zadd", "zrange", "pexpireat", "pttl"],
    ),
    release: Script::new(
        PERMIT_RELEASE_LUA,
        &[
            "time",
            "zscore",
            "zrem",
            "zremrangebyscore",
            "pttl",
            "zrange",
            "pexpireat",
            "del",
            "publish",
        ],
    ),
    verify: Script::new(PERMIT_VERIFY_LUA, &["zscore", "time"]),
    holders: Script::new(PERMIT_HOLDERS_LUA, &["time", "zcount", "get", "pttl"]),
});

/// The sorted set of the permits of the semaphore `name` (member: owner token, score: lease
/// end in server milliseconds), `<lock key of name>:permits` (see
/// [`companion_key`]): never a lock key, and in the tagged layout under the name's hash tag.
/// Its channel announces the permits given back.
pub(super) fn permits_key(shared: &Shared, name: &str) -> Vec<u8> {
    companion_key(shared.layout, &shared.lock_key(name), SUFFIX)
}

/// What follows a semaphore's lock key in its permits' key.
const SUFFIX: &[u8] = b":permits";

/// The count record of the semaphore whose permits are under `permits`.
pub(super) fn record_key(layout: KeyLayout, permits: &[u8]) -> Vec<u8> {
    companion_key(layout, permits, b":count")
}

/// The waiting mark of the semaphore whose permits are under `permits`.
pub(super) fn mark_key(layout: KeyLayout, permits: &[u8]) -> Vec<u8> {
    companion_key(layout, permits, b":waiting")
}

/// The semaphore name of a permits key, if `key` is one (see [`permits_key`]).
pub(super) fn semaphore_name(layout: KeyLayout, prefix: &[u8], key: &[u8]) -> Option<String> {
    let lock_key = key.strip_suffix(SUFFIX)?;
    let lock_key = match layout {
        KeyLayout::Tagged => lock_key,
        KeyLayout::Plain => lock_key.strip_suffix(&[super::PLAIN_FENCE_MARK])?,
    };
    super::inspect::lock_name(layout, prefix, lock_key)
}

fn millis(duration: Duration) -> String {
    u64::try_from(duration.as_millis())
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

/// A script's `{code, n}` answer.
fn pair(reply: &Value) -> Option<(i64, &Value)> {
    match reply {
        Value::Array(items) if items.len() == 2 => match &items[0] {
            Value::Int(code) => Some((*code, &items[1])),
            _ => None,
        },
        _ => None,
    }
}

/// The count a script quoted from the record, as the caller's error.
fn conflict(request: &PermitRequest<'_>, record: &Value) -> LockError {
    let text = match record {
        Value::BulkString(bytes) => String::from_utf8_lossy(bytes).into_owned(),
        other => format!("{other:?}"),
    };
    match text.parse::<u32>() {
        Ok(recorded) => request.count_conflict(recorded),
        Err(_) => LockError::backend(
            NAME,
            format!(
                "the count record of the semaphore `{}` holds `{}`, which is no count: it was \
                 written by something other than dlock",
                request.key.escape_debug(),
                text.escape_debug()
            ),
            None,
            None,
        ),
    }
}

/// One try for a permit (see [`PermitStore`] for what it guarantees, and
/// [`PERMIT_ACQUIRE_LUA`] for the script).
async fn try_acquire(
    shared: &Arc<Shared>,
    request: PermitRequest<'_>,
) -> Result<PermitTry, LockError> {
    if request.max_count == 0 {
        return Err(LockError::config(
            "a semaphore needs a max_count of at least 1",
        ));
    }
    let lease = request.lease.unwrap_or(shared.lease);
    check_lease(lease)?;
    let permits: Arc<[u8]> = Arc::from(permits_key(shared, request.key));
    // An abandoned try of this semaphore may still be giving its permit back.
    shared.settling.wait(&permits, shared.timeout).await;
    let token = OwnerToken::random()?;
    let record = record_key(shared.layout, &permits);
    let mark = mark_key(shared.layout, &permits);
    let plan = super::bounded::plan(shared, request.key, &permits).await?;
    let mut keys: Vec<&[u8]> = vec![&permits, &record, &mark];
    let ms = millis(lease);
    let max = request.max_count.to_string();
    let mark_ms = request.waiting.map_or_else(|| "0".to_owned(), millis);
    let mut args: Vec<&[u8]> = vec![
        token.as_bytes(),
        ms.as_bytes(),
        max.as_bytes(),
        mark_ms.as_bytes(),
    ];
    match plan.counter() {
        None => {}
        Some(Counter::PerKey(fence)) => keys.push(fence),
        Some(Counter::Shared {
            counter,
            record,
            mode,
        }) => {
            keys.extend([counter, record]);
            args.push(mode);
        }
    }
    // From here until the answer is read, a drop (or a failure) may leave the permit taken:
    // the cleanup gives it back in the background.
    let mut cleanup = Cleanup {
        shared: Arc::clone(shared),
        key: Arc::clone(&permits),
        token: token.clone(),
        armed: true,
        kind: Kind::Permit,
    };
    let what = "acquiring a semaphore permit";
    let sent = Instant::now();
    let eval = shared
        .conn
        .eval_waiting(&SCRIPTS.acquire, &keys, &keys, &args, shared.wait);
    let (reply, acked) = match shared.bounded(what, eval).await {
        // A cluster still moving the semaphore's slot after the driver's retries refused the
        // script without running it: a waiter tries again soon.
        Err(ref err)
            if request.waiting.is_some()
                && shared.conn.is_cluster()
                && super::cluster::refused_in_motion(err) =>
        {
            cleanup.armed = false;
            return Ok(PermitTry::Full {
                retry_within: Some(super::cluster::IN_MOTION_RETRY),
            });
        }
        other => other.map_err(|err| plan.refine(shared, err))?,
    };
    let fencing_token = match pair(&reply) {
        Some((1, Value::Int(count))) => {
            if shared.fencing {
                plan.token(u64::try_from(*count).ok())?
            } else {
                None
            }
        }
        Some((0, Value::Int(ms))) => {
            cleanup.armed = false;
            return Ok(PermitTry::Full {
                retry_within: super::expiry_hint(Some(*ms)),
            });
        }
        Some((-1, recorded)) => {
            cleanup.armed = false;
            return Err(conflict(&request, recorded));
        }
        _ => {
            return Err(super::redis_error(
                what,
                unexpected("the permit acquisition script", &reply),
                &shared.prefix,
            ));
        }
    };
    let as_lock = LockRequest::new(request.key)
        .with_lease(request.lease)
        .with_renewal(request.renew);
    match super::hold(shared, &as_lock, cleanup, lease, sent, fencing_token, acked).await? {
        WaitTry::Acquired(acquired) => Ok(PermitTry::Acquired(acquired)),
        WaitTry::Held { retry_within } => Ok(PermitTry::Full { retry_within }),
    }
}

/// Gives permit `token` of the semaphore whose permits are under `permits` back.
pub(super) async fn release(
    shared: &Shared,
    permits: &[u8],
    token: &OwnerToken,
) -> Result<(ReleaseOutcome, CommandPath), RedisError> {
    let record = record_key(shared.layout, permits);
    let mark = mark_key(shared.layout, permits);
    let announcer = shared.conn.announcer();
    let reply = shared
        .conn
        .eval(
            &SCRIPTS.release,
            &[permits, &record, &mark],
            &[token.as_bytes(), &announcer],
        )
        .await?;
    let outcome = match reply {
        Value::Int(1) => ReleaseOutcome::Released,
        Value::Int(0) => ReleaseOutcome::AlreadyReleased,
        other => return Err(unexpected("the permit release script", &other)),
    };
    Ok((outcome, CommandPath::Lua))
}

/// Sets permit `token`'s lease to `lease` from now, if it is live: `true` when done.
pub(super) async fn extend(
    shared: &Shared,
    permits: &[u8],
    token: &OwnerToken,
    lease: Duration,
) -> Result<(bool, CommandPath), RedisError> {
    let record = record_key(shared.layout, permits);
    let ms = millis(lease);
    let reply = shared
        .conn
        .eval(
            &SCRIPTS.extend,
            &[permits, &record],
            &[token.as_bytes(), ms.as_bytes()],
        )
        .await?;
    match reply {
        Value::Int(n) => Ok((n == 1, CommandPath::Lua)),
        other => Err(unexpected("the permit extension script", &other)),
    }
}

/// The script that renews a permit (see [`extend`]), for a batch of renewals
/// ([`Conn::extend_many`](super::commands::Conn::extend_many)), with its keys
/// `[permits, record_key(permits)]`.
pub(super) fn extend_script() -> &'static Script {
    &SCRIPTS.extend
}

/// Whether permit `token` is live.
pub(super) async fn verify(
    shared: &Shared,
    permits: &[u8],
    token: &OwnerToken,
) -> Result<bool, RedisError> {
    let reply = shared
        .conn
        .eval(&SCRIPTS.verify, &[permits], &[token.as_bytes()])
        .await?;
    match reply {
        Value::Int(n) => Ok(n == 1),
        other => Err(unexpected("the permit verification script", &other)),
    }
}

/// The live permits of the semaphore `key`, read in one script.
async fn holders(shared: &Shared, key: &str, max_count: u32) -> Result<u32, LockError> {
    let permits = permits_key(shared, key);
    let record = record_key(shared.layout, &permits);
    let mark = mark_key(shared.layout, &permits);
    let max = max_count.to_string();
    let what = "counting a semaphore's permits";
    let (keys, args): ([&[u8]; 3], [&[u8]; 1]) = ([&permits, &record, &mark], [max.as_bytes()]);
    let eval = shared.conn.eval(&SCRIPTS.holders, &keys, &args);
    let reply = shared.bounded(what, eval).await?;
    match pair(&reply) {
        Some((1, Value::Int(n))) => Ok(u32::try_from(*n).unwrap_or(u32::MAX)),
        Some((-1, recorded)) => {
            let request = PermitRequest::new(key, max_count);
            Err(conflict(&request, recorded))
        }
        _ => Err(super::redis_error(
            what,
            unexpected("the permit count script", &reply),
            &shared.prefix,
        )),
    }
}

/// Semaphores on one server, behind Sentinel or on a Cluster (see
/// [Semaphores](super#semaphores)).
impl PermitStore for RedisBackend {
    /// One script: drops the expired permits, checks the count record and the waiting mark,
    /// and adds the permit (see [Semaphores](super#semaphores)).
    fn try_acquire_permit<'a>(
        &'a self,
        request: PermitRequest<'a>,
    ) -> BoxFuture<'a, Result<PermitTry, LockError>> {
        Box::pin(try_acquire(&self.shared, request))
    }

    /// Subscribes to the semaphore's channel (named as its permits' key) on the backend's
    /// subscriber connection: a permit given back while the waiting mark lives is announced
    /// there.
    fn watch_permits<'a>(
        &'a self,
        request: PermitRequest<'a>,
    ) -> BoxFuture<'a, Option<Box<dyn ReleaseWatch>>> {
        Box::pin(async move {
            let shared = &self.shared;
            let channel = permits_key(shared, request.key);
            shared
                .wakes
                .watch(&channel, || super::inspect::cluster_nodes(shared))
                .await
        })
    }

    /// One read-only script (`ZCOUNT` of the live permits, and the count record).
    fn holders<'a>(
        &'a self,
        key: &'a str,
        max_count: u32,
    ) -> BoxFuture<'a, Result<u32, LockError>> {
        Box::pin(holders(&self.shared, key, max_count))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permit_keys_share_the_tag_and_are_never_lock_keys() {
        for layout in [KeyLayout::Tagged, KeyLayout::Plain] {
            let lock_key = match layout {
                KeyLayout::Tagged => super::super::storage_key(b"p:", "a{b}"),
                KeyLayout::Plain => b"p:a{b}".to_vec(),
            };
            let permits = companion_key(layout, &lock_key, SUFFIX);
            let record = record_key(layout, &permits);
            let mark = mark_key(layout, &permits);
            for key in [&permits, &record, &mark] {
                assert!(key.starts_with(&lock_key));
                assert_eq!(super::super::inspect::lock_name(layout, b"p:", key), None);
            }
            assert_eq!(
                semaphore_name(layout, b"p:", &permits).as_deref(),
                Some("a{b}")
            );
            assert_eq!(semaphore_name(layout, b"p:", &record), None);
            assert_eq!(semaphore_name(layout, b"p:", &mark), None);
            assert_eq!(semaphore_name(layout, b"p:", &lock_key), None);
        }
        let tagged = companion_key(
            KeyLayout::Tagged,
            &super::super::storage_key(b"p:", "k"),
            SUFFIX,
        );
        assert_eq!(tagged, b"p:{k}:permits".to_vec());
        assert_eq!(
            record_key(KeyLayout::Tagged, &tagged),
            b"p:{k}:permits:count".to_vec()
        );
        assert_eq!(
            mark_key(KeyLayout::Plain, b"p:k\xff:permits"),
            b"p:k\xff:permits\xff:waiting".to_vec()
        );
    }
}

#[cfg(test)]
mod live_tests;
