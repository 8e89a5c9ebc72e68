//! The commands behind a lock: native compare-and-set commands where the server has them, Lua
//! scripts where it does not, and the per-connection memory of which is which.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::task::Poll;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{Cmd, ErrorKind, RedisError, ServerErrorKind, Value};

use super::cluster::{Cluster, Link};
use super::sentinel::{Sentinels, points_elsewhere};
use super::token::OwnerToken;

/// The queue of a waiter's try that queues (see [Fair waiting](super#fair-waiting)), in Lua,
/// run before the lock is taken: with the locals `lock` (the lock key), `q` (its queue, a
/// sorted set of waiter ids scored by arrival, or nil when the try does not queue), `turn`
/// (the record of the head's turn), `me` (this waiter's id) and `keep` (how long the queue
/// is kept, in ms), it sets `wait` to the ms left of another waiter's turn while the lock is
/// free and that waiter is at the head, and `queued` to 0 when the server refused a command
/// of the queue (then nothing is queued, and the try goes on as one that does not queue).
/// A head that does not take the free lock within its turn (500 ms from the first try that
/// finds it free and not its own) is taken out, and the next head is woken on the lock's
/// channel. A try that does not take the lock queues `me` (keeping its place when already
/// queued).
macro_rules! queue_lua {
    () => {
        "local queued, wait, head = 1, nil, nil
if q then
  local t = redis.pcall('TIME')
  local pt = redis.pcall('PTTL', lock)
  local h = redis.pcall('ZRANGE', q, 0, 0, 'WITHSCORES')
  if t.err or type(pt) ~= 'number' or h.err then
    queued = 0
  else
    local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
    local evicted = false
    for _ = 1, 8 do
      if pt ~= -2 or not h[1] or h[1] == me then
        break
      end
      local clock = h[1] .. '@' .. h[2]
      local c = redis.pcall('GET', turn)
      local due = nil
      if type(c) == 'string' then
        local id, d = string.match(c, '^(.*)#(%d+)$')
        if id == clock then
          due = tonumber(d)
        end
      end
      if not due then
        due = now + 500
        redis.pcall('SET', turn, clock .. '#' .. due, 'PX', 1000)
      end
      if due > now then
        wait = due - now
        break
      end
      redis.pcall('ZREM', q, h[1])
      evicted = true
      h = redis.pcall('ZRANGE', q, 0, 0, 'WITHSCORES')
      if h.err then
        h = {}
      end
    end
    if evicted and h[1] and h[1] ~= me then
      redis.pcall('PUBLISH', lock, '')
    end
    head = h[1]
    if pt == -2 and head and head ~= me and not wait then
      wait = 1
    end
    if pt ~= -2 or wait then
      redis.pcall('ZADD', q, 'NX', now, me)
      local left = redis.pcall('PTTL', q)
      if type(left) == 'number' and left < tonumber(keep) then
        redis.pcall('PEXPIRE', q, keep)
      end
    end
  end
end
"
    };
}

/// Takes a free lock and bumps its fencing counter in one step.
/// `KEYS[1]` lock, `KEYS[2]` counter, `KEYS[3]` (optional) the lock's waiting mark, `KEYS[4]`
/// and `KEYS[5]` (optional, with the mark) its queue and the record of the head's turn;
/// `ARGV[1]` token, `ARGV[2]` lease in ms, `ARGV[3]` (optional, a waiter's try) the mark's
/// time to live in ms, `ARGV[4]` (with the queue) the waiter's id. Returns the new counter
/// value; when the lock is held, nil, or for a waiter's try `{pttl, marked, queued}` (pttl -3
/// when the user may not run `PTTL`: asked with `pcall`, so that the grant stays optional;
/// while the lock is free but another waiter's turn runs, the ms left of that turn), after
/// setting the waiting mark for `ARGV[3]` ms (also with `pcall`; `marked` 0 when the server
/// refused it), which tells the holder's release that someone waits (see [`RELEASE_LUA`]).
/// A try with the queue takes the lock only when its waiter is at the head of the queue, or
/// nobody queues (see `queue_lua!`); `queued` 0 when the server refused the queue.
pub(crate) const ACQUIRE_FENCED_LUA: &str = concat!(
    "local lock, q, turn, me, keep = KEYS[1], KEYS[4], KEYS[5], ARGV[4], ARGV[3]
",
    queue_lua!(),
    "if not wait and redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  if head and head == me then
    redis.pcall('ZREM', q, me)
    redis.pcall('DEL', turn)
  end
  return redis.call('INCR', KEYS[2])
end
if ARGV[3] then
  local m = 1
  if KEYS[3] and redis.pcall('SET', KEYS[3], '1', 'PX', ARGV[3]).err then
    m = 0
  end
  local t = wait or redis.pcall('PTTL', KEYS[1])
  if type(t) ~= 'number' then
    t = -3
  end
  return {t, m, queued}
end
return false"
);

/// [`ACQUIRE_FENCED_LUA`] with a shared counter (`fencing_counters`): `KEYS[1]` lock,
/// `KEYS[2]` the key's counter, `KEYS[3]` the store's record of its counters' mode, `KEYS[4]`
/// (optional) the lock's waiting mark, `KEYS[5]` and `KEYS[6]` (optional, with the mark) its
/// queue and the record of the head's turn; `ARGV[1]` token, `ARGV[2]` lease in ms, `ARGV[3]`
/// the mode this backend joined (`N:epoch`), `ARGV[4]` (optional) as `ARGV[3]` above,
/// `ARGV[5]` (with the queue) the waiter's id. When the record holds another mode, nothing
/// is taken and the answer is the error `DLOCKCOUNTERS <the record>` (see
/// [`crate::counters`]). Otherwise as [`ACQUIRE_FENCED_LUA`].
pub(crate) const ACQUIRE_COUNTED_LUA: &str = concat!(
    "local m = redis.call('GET', KEYS[3])
if m ~= ARGV[3] then
  return redis.error_reply('DLOCKCOUNTERS ' .. (m or 'none'))
end
local lock, q, turn, me, keep = KEYS[1], KEYS[5], KEYS[6], ARGV[5], ARGV[4]
",
    queue_lua!(),
    "if not wait and redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  if head and head == me then
    redis.pcall('ZREM', q, me)
    redis.pcall('DEL', turn)
  end
  return redis.call('INCR', KEYS[2])
end
if ARGV[4] then
  local m = 1
  if KEYS[4] and redis.pcall('SET', KEYS[4], '1', 'PX', ARGV[4]).err then
    m = 0
  end
  local t = wait or redis.pcall('PTTL', KEYS[1])
  if type(t) ~= 'number' then
    t = -3
  end
  return {t, m, queued}
end
return false"
);

/// Joins the store's shared counters (`fencing_counters`): `KEYS[1]` the record of their
/// mode (`N:epoch`); `ARGV[1]` this backend's `N`, `ARGV[2]` the largest epoch. Returns the
/// epoch: the record's when it names `ARGV[1]`; otherwise (no record, or another `N`) the
/// next one, written with `ARGV[1]` (a switch). An unreadable record, or no epoch left,
/// answers the error `DLOCKCOUNTERS <why>`.
pub(crate) const JOIN_COUNTERS_LUA: &str = "\
local m = redis.call('GET', KEYS[1])
local e = 0
if m then
  local n, me = string.match(m, '^(%d+):(%d+)$')
  if not n then
    return redis.error_reply('DLOCKCOUNTERS the record of the counters is not N:epoch')
  end
  e = tonumber(me)
  if n == ARGV[1] and e > 0 then
    return e
  end
end
if e >= tonumber(ARGV[2]) then
  return redis.error_reply('DLOCKCOUNTERS no epoch is left for a switch')
end
e = e + 1
redis.call('SET', KEYS[1], ARGV[1] .. ':' .. e)
return e";

/// Deletes the lock if `ARGV[1]` owns it: 1 + the subscribers woken when deleted, 0 no such
/// key, -1 another owner. A deletion is announced on the channel named as the lock key, with
/// the releasing backend's announcer id `ARGV[2]` as the message, which wakes the lock's
/// waiters (with `pcall`: a user refused `PUBLISH` still releases, and its waiters poll).
/// With `KEYS[2]`, the lock's waiting mark, the announcement is sent only while the mark
/// lives (a waiter's try set it), or when it cannot be read: a release nobody waits for
/// publishes nothing, which on a Cluster is a broadcast to every node.
pub(crate) const RELEASE_LUA: &str = "\
local v = redis.call('GET', KEYS[1])
if v == ARGV[1] then
  redis.call('DEL', KEYS[1])
  if KEYS[2] and redis.pcall('EXISTS', KEYS[2]) == 0 then
    return 1
  end
  local n = redis.pcall('PUBLISH', KEYS[1], ARGV[2] or '')
  if type(n) == 'number' then
    return 1 + n
  end
  return 1
end
if v then
  return -1
end
return 0";

/// Sets the lease of the lock to `ARGV[2]` ms from now if `ARGV[1]` owns it: 1 done, 0 not
/// owned (missing or another owner). Never creates the key.
pub(crate) const EXTEND_LUA: &str = "\
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0";

/// A Lua script, its SHA-1 (for `EVALSHA`), and the commands it runs (which a user needs
/// permission for, besides `EVALSHA` and `EVAL`).
#[derive(Debug)]
pub(crate) struct Script {
    code: &'static str,
    sha: String,
    commands: &'static [&'static str],
}

impl Script {
    pub(crate) fn new(code: &'static str, commands: &'static [&'static str]) -> Script {
        Script {
            code,
            sha: redis::Script::new(code).get_hash().to_owned(),
            commands,
        }
    }

    /// The commands the script runs.
    #[cfg(test)]
    pub(crate) fn commands(&self) -> &'static [&'static str] {
        self.commands
    }
}

/// The fencing counter an acquisition increments.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Counter<'a> {
    /// The key's own counter.
    PerKey(&'a [u8]),
    /// A counter shared under `fencing_counters`, checked against the store's record of the
    /// counters' mode (see [`ACQUIRE_COUNTED_LUA`]).
    Shared {
        /// The counter's key.
        counter: &'a [u8],
        /// The key of the record of the mode.
        record: &'a [u8],
        /// The mode this backend joined, `N:epoch`.
        mode: &'a [u8],
    },
}

/// The scripts of one backend.
#[derive(Debug)]
pub(crate) struct Scripts {
    pub(crate) acquire_fenced: Script,
    pub(crate) acquire_counted: Script,
    pub(crate) join_counters: Script,
    pub(crate) release: Script,
    pub(crate) extend: Script,
}

impl Scripts {
    pub(crate) fn new() -> Scripts {
        Scripts {
            acquire_fenced: Script::new(ACQUIRE_FENCED_LUA, &["set", "incr"]),
            acquire_counted: Script::new(ACQUIRE_COUNTED_LUA, &["get", "set", "incr"]),
            join_counters: Script::new(JOIN_COUNTERS_LUA, &["get", "set"]),
            release: Script::new(RELEASE_LUA, &["get", "del"]),
            extend: Script::new(EXTEND_LUA, &["get", "pexpire"]),
        }
    }
}

/// Whether the current connection has a native command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Support {
    Unknown,
    Yes,
    No,
}

/// What the current physical connection is known to have. `generation` changes whenever the
/// connection may have been replaced (any failure that is not an answer of the server), and
/// everything is discovered again after that.
#[derive(Debug, Clone, Copy)]
struct Caps {
    generation: u64,
    delex: Support,
    delifeq: Support,
    set_ifeq: Support,
    /// The connection's `CLIENT ID`, once learnt (see [`Conn::fence_ticket`]).
    client_id: Option<i64>,
}

impl Caps {
    fn new(generation: u64) -> Caps {
        Caps {
            generation,
            delex: Support::Unknown,
            delifeq: Support::Unknown,
            set_ifeq: Support::Unknown,
            client_id: None,
        }
    }
}

/// What connection fencing has done on one backend (see [`Conn::kill_client`]).
#[derive(Debug, Default)]
pub(crate) struct FenceState {
    /// Off for good: the user may not run `CLIENT ID` or `CLIENT KILL`, or the server does
    /// not know them (warned once).
    pub(crate) disabled: AtomicBool,
    /// Connections killed.
    pub(crate) killed: AtomicU64,
    /// Commands with an unknown outcome whose connection could not be killed.
    pub(crate) not_fenced: AtomicU64,
}

/// What an acquisition's command found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Taking {
    /// Taken, with its fencing token when fenced.
    Taken(Option<u64>),
    /// Held elsewhere; the holder's time to live in ms (`PTTL`: -1 no expiry, -2 gone), when
    /// asked for and read.
    Held(Option<i64>),
}

/// How a release or extension was carried out, for diagnostics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum CommandPath {
    /// `DELEX key IFEQ token` (Redis 8.4 and later).
    Delex,
    /// `DELIFEQ key token` (Valkey 9.0 and later).
    Delifeq,
    /// `SET key token IFEQ token PX ms` (Redis 8.4, Valkey 8.1 and later).
    SetIfeq,
    /// A Lua script through `EVALSHA` (`EVAL` after `NOSCRIPT`).
    Lua,
}

pub use crate::backend::ReleaseOutcome;

/// One lock's renewal in a batch (see [`Conn::extend_many`]).
pub(crate) struct Extension<'a> {
    /// The lock's key.
    pub(crate) key: &'a [u8],
    /// Its owner.
    pub(crate) token: &'a OwnerToken,
    /// The lease the renewal asks for, from now.
    pub(crate) lease: Duration,
    /// A reader's share or a semaphore's permit: renewed by this script, with this second key
    /// (see `read.rs`, `permits.rs`).
    pub(crate) script: Option<(&'a Script, &'a [u8])>,
}

/// The connection and the memory of what it supports.
pub(crate) struct Conn {
    /// The connection in use (a connection manager, or a cluster connection); replaced (when
    /// it can be, see `rebuild` and `cluster`) after a runtime it may have run on shut down.
    manager: Mutex<Link>,
    /// On a Redis Cluster: how to connect to it again.
    cluster: Option<Cluster>,
    /// How to make a new manager, when the backend made its own (not for a manager the
    /// application passed in). Behind Sentinel, the client of the master in use: replaced
    /// when the sentinels name another one. Shared with the backend's subscriber (see
    /// [`Conn::client_slot`]).
    rebuild: ClientSlot,
    /// Behind Sentinel: the sentinels, the address of the master in use, and when the
    /// sentinels are next asked whether it still is (see [`Conn::rediscover`]).
    sentinel: Option<Following>,
    /// Behind Sentinel: set by a failure that may mean the master moved (no answer, or an
    /// answer that the node is no writable master any more), cleared by the next command,
    /// which first asks the sentinels where the master is (see [`Conn::rediscover`]).
    rediscover: Arc<AtomicBool>,
    caps: Mutex<Caps>,
    pub(crate) scripts: Scripts,
    /// Set when a runtime that may have run the connection's task has shut down: the next
    /// command first replaces the manager (or checks it, see [`Conn::repair`]).
    suspect: Arc<AtomicBool>,
    /// Set by a failure that is not an answer of the server, cleared by the next answer:
    /// while set, the manager may be reconnecting, and each command watches its runtime
    /// (see [`Conn::watch_runtime`]) before it polls the reconnection.
    reconnecting: AtomicBool,
    /// End the tasks that watch the runtimes the current manager may run on: the one it was
    /// made on, and those of commands that found the connection broken (the manager's
    /// reconnection may run there). At most [`MAX_WATCHES`], the newest.
    watches: Mutex<Vec<tokio_util::sync::DropGuard>>,
    /// Set after an answer to a native command that the client could not read: from then on
    /// the native deletes are probed by their bare names before the real call (see
    /// [`Conn::native_delete`]).
    probe_first: AtomicBool,
    /// Connection fencing: whether it is on, and what it did.
    pub(crate) fence: FenceState,
    /// Set once the server refused a release's `PUBLISH` (warned once).
    publish_refused: AtomicBool,
    /// Set once the server refused a waiter's mark (warned once).
    mark_refused: AtomicBool,
    /// Set once the server refused a command of a lock's queue of waiters (see
    /// [Fair waiting](super#fair-waiting)): waiters then do not queue.
    queue_refused: AtomicBool,
    /// The message of this connection's release announcements, random per backend: its
    /// subscribers tell their own backend's releases from others' by it (see
    /// [Fair waiting](super#fair-waiting)).
    announcer: Arc<[u8]>,
    /// Whether waiters mark the locks they wait for, and releases announce themselves only
    /// to marked locks (the tagged key layout, whose mark `<lock key>:waiting` shares the
    /// lock's Cluster slot; see [Waiting](super#waiting)).
    marks_waits: bool,
    /// On a Cluster: until when releases leave the waiting mark out, after one was refused
    /// for it while a slot moved (see [`Conn::release_waking`]).
    unmarked_until: Mutex<Option<Instant>>,
}

/// How long a Cluster backend's releases leave the waiting mark out after a slot's migration
/// refused one for it: one refusal costs the driver's retries (about 3 s), and migrations
/// move many slots one after another.
const UNMARKED_AFTER_TRYAGAIN: Duration = Duration::from_secs(10);

/// The suffix of a lock's waiting mark (see [`Conn::marks_waits`]): `<lock key>:waiting`.
pub(crate) const WAITING_MARK: &[u8] = b":waiting";

/// How long a waiting mark outlives the waiter's planned pause before its next try, which
/// sets it again: time for a late try.
const MARK_SLACK: Duration = Duration::from_secs(1);

/// The suffix of a lock's queue of waiters (see [Fair waiting](super#fair-waiting)):
/// `<lock key>:queue`, a sorted set of waiter ids scored by arrival.
pub(crate) const QUEUE: &[u8] = b":queue";

/// The suffix of the record of the turn of the waiter at the head of a lock's queue:
/// `<lock key>:turn`.
pub(crate) const TURN: &[u8] = b":turn";

/// A waiter's try (see [`Conn::take`]): `pause` is the longest it waits before its next try;
/// `queued`, whether it queues (see [Fair waiting](super#fair-waiting)).
#[derive(Debug, Clone, Copy)]
pub(crate) struct WaiterTry {
    pub(crate) pause: Duration,
    pub(crate) queued: bool,
}

impl WaiterTry {
    /// The waiting mark's time to live in ms, as text: the pause and [`MARK_SLACK`].
    pub(crate) fn mark_ms(self) -> String {
        millis(self.pause.saturating_add(MARK_SLACK)).to_string()
    }
}

/// A connection's master behind Sentinel.
struct Following {
    sentinels: Sentinels,
    /// The address of the master in use.
    master: Mutex<(String, u16)>,
    /// When the sentinels are next asked whether it still is the master.
    next_check: Mutex<Instant>,
}

/// Sets a connection's `suspect` flag when dropped (see [`Conn::suspect_on_drop`]), unless
/// disarmed.
pub(crate) struct SuspectOnDrop(Option<Arc<AtomicBool>>);

impl SuspectOnDrop {
    fn disarm(mut self) {
        self.0 = None;
    }
}

impl Drop for SuspectOnDrop {
    fn drop(&mut self) {
        if let Some(flag) = &self.0 {
            flag.store(true, Ordering::SeqCst);
        }
    }
}

impl std::fmt::Debug for Conn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let caps = self.caps();
        f.debug_struct("Conn")
            .field("delex", &caps.delex)
            .field("delifeq", &caps.delifeq)
            .field("set_ifeq", &caps.set_ifeq)
            .finish_non_exhaustive()
    }
}

/// An error answered by the server that says it does not know the command.
pub(crate) fn is_unknown_command(err: &RedisError) -> bool {
    err.kind() == ErrorKind::Server(ServerErrorKind::ResponseError)
        && err.detail().is_some_and(|d| {
            d.trim_start()
                .to_ascii_lowercase()
                .starts_with("unknown command")
        })
}

/// An error answered by the server that says the command got too few or too many arguments.
fn is_arity_error(err: &RedisError) -> bool {
    err.kind() == ErrorKind::Server(ServerErrorKind::ResponseError)
        && err
            .detail()
            .is_some_and(|d| d.to_ascii_lowercase().contains("wrong number of arguments"))
}

/// An error answered by the server that says the command's arguments are not valid syntax.
pub(crate) fn is_syntax_error(err: &RedisError) -> bool {
    err.kind() == ErrorKind::Server(ServerErrorKind::ResponseError)
        && err.detail().is_some_and(|d| {
            d.trim_start()
                .to_ascii_lowercase()
                .starts_with("syntax error")
        })
}

/// A command of a script refused by the user's ACL. The server answers `ERR`, not `NOPERM`:
/// "ACL failure in script: User u has no permissions to run the 'incr' command" (Redis 7.2+,
/// Valkey), "The user executing the script can't run this command or subcommand" (Redis 7.0,
/// which does not say which), or "... can't access at least one of the keys ...".
fn is_script_acl_failure(err: &RedisError) -> bool {
    err.kind() == ErrorKind::Server(ServerErrorKind::ResponseError)
        && err.detail().is_some_and(|d| {
            d.contains("ACL failure in script") || d.contains("The user executing the script can't")
        })
}

/// A script's ACL failure as the `NOPERM` it is, naming the script's commands when the server
/// did not name the refused one.
fn script_noperm(script: &Script, err: &RedisError) -> RedisError {
    let detail = err.detail().unwrap_or_default();
    let named = refused_command(detail).is_some();
    let listed = script
        .commands
        .iter()
        .map(|c| format!("`{c}`"))
        .collect::<Vec<_>>()
        .join(", ");
    let detail = if named {
        format!("{detail} (in a script, which runs {listed})")
    } else {
        format!("{detail} (the server does not say which; the script runs {listed})")
    };
    RedisError::from((ErrorKind::Server(ServerErrorKind::NoPerm), "NOPERM", detail))
}

/// The command a `NOPERM` answer names ("... to run the 'incr' command"), if it names one.
pub(crate) fn refused_command(detail: &str) -> Option<&str> {
    let (_, rest) = detail.split_once("to run the '")?;
    let (command, rest) = rest.split_once('\'')?;
    rest.starts_with(" command").then_some(command)
}

/// Whether the failure is an answer of the server (as opposed to an I/O failure, a timeout, a
/// dropped connection, after which the connection may be a new one).
fn is_server_answer(err: &RedisError) -> bool {
    matches!(err.kind(), ErrorKind::Server(_) | ErrorKind::Extension)
}

/// The most runtimes watched for one connection (see [`Conn::watch_runtime`]).
const MAX_WATCHES: usize = 8;

/// The detail of the error that stands for a panic inside the driver.
const DRIVER_PANIC: &str = "the redis driver failed inside (a reconnection begun on a Tokio \
                            runtime that has since shut down); the connection is made again \
                            for the next command";

/// Runs a driver future, answering a panic inside it as an I/O failure (see [`Conn::query`]).
async fn unwind_to_error<T>(
    future: impl Future<Output = Result<T, RedisError>>,
) -> Result<T, RedisError> {
    let mut future = std::pin::pin!(future);
    std::future::poll_fn(|cx| {
        match std::panic::catch_unwind(AssertUnwindSafe(|| future.as_mut().poll(cx))) {
            Ok(poll) => poll,
            Err(_) => Poll::Ready(Err(RedisError::from((
                ErrorKind::Io,
                "driver failed",
                DRIVER_PANIC.to_owned(),
            )))),
        }
    })
    .await
}

fn is_driver_panic(err: &RedisError) -> bool {
    err.kind() == ErrorKind::Io && err.detail() == Some(DRIVER_PANIC)
}

/// `EVALSHA sha n keys... args...` (or `EVAL code ...`), its buffers sized up front: built
/// argument by argument from empty ones, they grew several times per command.
fn script_command(name: &str, script: &str, keys: &[&[u8]], args: &[&[u8]]) -> Cmd {
    let count = 3 + keys.len() + args.len();
    let data =
        name.len() + script.len() + 20 + keys.iter().chain(args).map(|a| a.len()).sum::<usize>();
    let mut cmd = Cmd::with_capacity(count, data);
    cmd.arg(name)
        .arg(script)
        .arg(keys.len())
        .arg(keys)
        .arg(args);
    cmd
}

/// `WAIT replicas timeout`, for `wait` (see [`Conn::take`]).
fn wait_command(wait: Option<(u32, Duration)>) -> Option<Cmd> {
    wait.map(|(replicas, timeout)| {
        let mut cmd = redis::cmd("WAIT");
        cmd.arg(replicas).arg(millis(timeout));
        cmd
    })
}

/// The number of replicas a `WAIT` answered (`None`: no `WAIT` was sent).
fn acked(reply: Option<Value>) -> Result<Option<u64>, RedisError> {
    match reply {
        None => Ok(None),
        Some(Value::Int(n)) => Ok(Some(u64::try_from(n).unwrap_or(0))),
        Some(other) => as_result(other).and_then(|other| Err(unexpected("WAIT", &other))),
    }
}

fn millis(lease: Duration) -> u64 {
    u64::try_from(lease.as_millis()).unwrap_or(u64::MAX).max(1)
}

/// A native conditional delete.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Native {
    /// `DELEX key IFEQ token`.
    Delex,
    /// `DELIFEQ key token`.
    Delifeq,
}

impl Native {
    fn name(self) -> &'static str {
        match self {
            Native::Delex => "DELEX",
            Native::Delifeq => "DELIFEQ",
        }
    }

    fn path(self) -> CommandPath {
        match self {
            Native::Delex => CommandPath::Delex,
            Native::Delifeq => CommandPath::Delifeq,
        }
    }

    fn known(self, caps: Caps) -> Support {
        match self {
            Native::Delex => caps.delex,
            Native::Delifeq => caps.delifeq,
        }
    }

    fn support(self, caps: &mut Caps) -> &mut Support {
        match self {
            Native::Delex => &mut caps.delex,
            Native::Delifeq => &mut caps.delifeq,
        }
    }
}

/// How much of the arguments a server's "unknown command" answer quotes: Redis and Valkey
/// append `'arg' ` for each argument, each cut (as C strings, at a NUL) to what is left of
/// 128 bytes, until 128 are written.
const QUOTED_ARGS: usize = 128;

/// Whether the arguments a server would quote in its "unknown command" answer to a command
/// with these arguments are valid UTF-8, so that the client can read that answer (it refuses
/// an error line that is not). Conservative: every argument it might quote must be text in
/// full, and the cut must fall between characters.
fn quoted_args_are_text(args: &[&[u8]]) -> bool {
    let mut quoted = Vec::with_capacity(QUOTED_ARGS + 8);
    for arg in args {
        if quoted.len() >= QUOTED_ARGS {
            break;
        }
        if std::str::from_utf8(arg).is_err() {
            return false;
        }
        let room = QUOTED_ARGS - quoted.len();
        let shown = arg.split(|b| *b == 0).next().unwrap_or_default();
        quoted.push(b'\'');
        quoted.extend_from_slice(&shown[..shown.len().min(room)]);
        quoted.extend_from_slice(b"' ");
    }
    std::str::from_utf8(&quoted).is_ok()
}

/// The client (and manager configuration) a backend connects with, replaced behind Sentinel
/// when the sentinels name another master; `None` for a manager the application passed in.
pub(crate) type ClientSlot = Arc<Mutex<Option<(redis::Client, ConnectionManagerConfig)>>>;

/// What went in a native delete's round trip besides the delete.
enum Behind {
    /// Nothing: the announcement, if any, follows.
    Nothing,
    /// The announcement, which reached this many subscribers.
    Announced(u64),
    /// A read of the lock's waiting mark (`EXISTS`), with its answer.
    Mark(Option<Value>),
}

impl Conn {
    /// The client the connection is made with, as it is replaced: the subscriber of
    /// wake-ups reconnects with it, so that behind Sentinel it follows the master too.
    pub(crate) fn client_slot(&self) -> ClientSlot {
        Arc::clone(&self.rebuild)
    }

    /// A connection on `manager`; with `rebuild`, the client and configuration it was made
    /// from, to replace it when needed.
    pub(crate) fn new(
        manager: impl Into<Link>,
        rebuild: Option<(redis::Client, ConnectionManagerConfig)>,
    ) -> Conn {
        Conn {
            manager: Mutex::new(manager.into()),
            cluster: None,
            rebuild: Arc::new(Mutex::new(rebuild)),
            sentinel: None,
            rediscover: Arc::new(AtomicBool::new(false)),
            caps: Mutex::new(Caps::new(0)),
            scripts: Scripts::new(),
            suspect: Arc::new(AtomicBool::new(false)),
            reconnecting: AtomicBool::new(false),
            watches: Mutex::new(Vec::new()),
            probe_first: AtomicBool::new(false),
            fence: FenceState::default(),
            publish_refused: AtomicBool::new(false),
            mark_refused: AtomicBool::new(false),
            queue_refused: AtomicBool::new(false),
            announcer: Arc::from(format!("{:016x}", fastrand::u64(..)).into_bytes()),
            marks_waits: false,
            unmarked_until: Mutex::new(None),
        }
    }

    /// Waiters set a waiting mark on the locks they wait for, and releases announce
    /// themselves only while a lock's mark lives (the tagged key layout; see
    /// [Waiting](super#waiting)).
    pub(crate) fn marking_waits(mut self, marks: bool) -> Conn {
        self.marks_waits = marks;
        self
    }

    /// Whether releases leave the waiting mark out for now (a Cluster's slot migration
    /// refused one for it lately).
    fn unmarked_for_now(&self) -> bool {
        self.is_cluster()
            && self
                .unmarked_until
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .is_some_and(|until| Instant::now() < until)
    }

    /// The waiting mark of the lock under `key`, when this connection marks waits (and the
    /// server did not refuse a mark, see [`Conn::refuse_marks`]).
    pub(crate) fn waiting_mark(&self, key: &[u8]) -> Option<Vec<u8>> {
        (self.marks_waits && !self.mark_refused.load(Ordering::Relaxed))
            .then(|| [key, WAITING_MARK].concat())
    }

    /// The queue of the lock under `key` and the record of its head's turn, when this
    /// connection's waiters queue: it marks waits (the tagged key layout, whose
    /// `<lock key>:queue` and `<lock key>:turn` share the lock's Cluster slot) and the server
    /// refused neither a mark nor a command of the queue (see [Fair waiting](super#fair-waiting)).
    pub(crate) fn queue_keys(&self, key: &[u8]) -> Option<(Vec<u8>, Vec<u8>)> {
        (!self.queue_refused.load(Ordering::Relaxed))
            .then(|| self.waiting_mark(key))
            .flatten()
            .map(|_| ([key, QUEUE].concat(), [key, TURN].concat()))
    }

    /// Takes this backend's waiters out of the queue of the lock under `key` (its last waiter
    /// of the key is gone). Best effort: a waiter left queued is taken out when its turn comes
    /// and it does not take the lock.
    pub(crate) async fn leave_queue(&self, key: &[u8]) {
        if let Some((queue, _)) = self.queue_keys(key) {
            let mut zrem = redis::cmd("ZREM");
            zrem.arg(queue).arg(&self.announcer[..]);
            if let Err(err) = self.query(&zrem).await {
                tracing::debug!(error = %err, "leaving a redis lock's queue of waiters failed");
            }
        }
    }

    /// The message of this connection's release announcements.
    pub(crate) fn announcer(&self) -> Arc<[u8]> {
        Arc::clone(&self.announcer)
    }

    /// A connection to the master `addr` found through `sentinels`, made again for the master
    /// they name whenever it may have moved.
    pub(crate) fn with_sentinels(mut self, sentinels: Sentinels, addr: (String, u16)) -> Conn {
        let next = Instant::now() + sentinels.check_every;
        self.sentinel = Some(Following {
            sentinels,
            master: Mutex::new(addr),
            next_check: Mutex::new(next),
        });
        self
    }

    /// A connection to a Redis Cluster, made again from `cluster` when needed (without
    /// connection fencing: see [Cluster](super#cluster)).
    pub(crate) fn with_cluster(mut self, cluster: Cluster) -> Conn {
        self.cluster = Some(cluster);
        self
    }

    /// Whether the connection is to a Redis Cluster.
    pub(crate) fn is_cluster(&self) -> bool {
        self.cluster.is_some()
    }

    /// Whether the master of a key can change under this connection (a Cluster, or Sentinel).
    pub(crate) fn can_move(&self) -> bool {
        self.cluster.is_some() || self.sentinel.is_some()
    }

    /// The master in use, behind Sentinel.
    pub(crate) fn master_addr(&self) -> Option<(String, u16)> {
        self.sentinel.as_ref().map(|f| {
            f.master
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clone()
        })
    }

    /// Behind Sentinel: the next command asks the sentinels where the master is first.
    pub(crate) fn suspect_master(&self) {
        if self.sentinel.is_some() {
            self.rediscover.store(true, Ordering::SeqCst);
        }
    }

    /// Behind Sentinel, after a failure that may mean the master moved, and otherwise every
    /// `check_master_every`: asks the sentinels where the master is, and when they name
    /// another node (one that reports `ROLE` master), makes the manager again for it, so this
    /// command and the next go there. The periodic check is what moves a backend whose
    /// connection to the old master still works: after a failover the sentinels demote a
    /// live old master only some seconds later, and until then it takes writes that the new
    /// master never sees. The caps learnt about the old master are forgotten with it. When no
    /// sentinel leads to a master (a failover under way), the command goes out on the
    /// manager it has, and the next one asks again. Only one command at a time asks; the
    /// others go on meanwhile. A periodic check (not one after a failure) takes at most half
    /// the `timeout`, whatever the sentinels do.
    async fn rediscover(&self) {
        let Some(Following {
            sentinels,
            master: current,
            next_check,
        }) = &self.sentinel
        else {
            return;
        };
        let failed = self.rediscover.swap(false, Ordering::SeqCst);
        let due = {
            let mut next = next_check.lock().unwrap_or_else(PoisonError::into_inner);
            let now = Instant::now();
            if failed || now >= *next {
                *next = now + sentinels.check_every;
                true
            } else {
                false
            }
        };
        if !due {
            return;
        }
        // Ask again next time if this is dropped before the answer.
        let unfinished = SuspectOnDrop(Some(Arc::clone(&self.rediscover)));
        let known = current
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let asking = sentinels.discover(Some(&known));
        let answer = if failed {
            asking.await
        } else {
            // A periodic check rides on a caller's command, whose limit is `timeout` as well:
            // it takes at most half of it, so that a silent sentinel cannot make the command
            // fail. The master in use stays; the next check asks the next sentinel.
            match tokio::time::timeout(sentinels.timeout / 2, asking).await {
                Ok(answer) => answer,
                Err(_) => {
                    unfinished.disarm();
                    tracing::warn!(
                        limit = ?sentinels.timeout / 2,
                        "a redis sentinel did not answer the periodic master check in time; \
                         the next check asks the next sentinel"
                    );
                    return;
                }
            }
        };
        match answer {
            Ok(found) => {
                let moved = {
                    let mut current = current.lock().unwrap_or_else(PoisonError::into_inner);
                    let moved = *current != found.addr;
                    *current = found.addr.clone();
                    moved
                };
                if moved {
                    tracing::warn!(
                        host = %found.addr.0,
                        port = found.addr.1,
                        "the redis sentinels name a new master; connecting to it"
                    );
                    let config = self
                        .rebuild
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .as_ref()
                        .map(|(_, config)| config.clone());
                    if let (Some(config), Some(client)) = (config, found.client) {
                        *self.rebuild.lock().unwrap_or_else(PoisonError::into_inner) =
                            Some((client, config));
                        self.replace();
                    }
                }
                unfinished.disarm();
            }
            Err(err) => {
                tracing::warn!(
                    error = %err,
                    "no redis master found through the sentinels (a failover under way?); \
                     asking again at the next command"
                );
            }
        }
    }

    /// Marks the connection suspect when the current runtime shuts down (the one the manager
    /// was made on, whose tasks run its connection, or one whose command found the connection
    /// broken, where the reconnection may run), so that the next command replaces or checks
    /// the manager first (see [Runtimes](super#runtimes)). `fresh`: the manager is new, and
    /// the earlier watches are ended.
    pub(crate) fn watch_runtime(&self, fresh: bool) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let done = tokio_util::sync::CancellationToken::new();
        let watching = done.clone();
        let mark = self.suspect_on_drop();
        drop(runtime.spawn(async move {
            watching.cancelled().await;
            // Ended on purpose (a newer manager, or the backend is gone), not by a shutdown.
            mark.disarm();
        }));
        let mut watches = self.watches.lock().unwrap_or_else(PoisonError::into_inner);
        if fresh {
            watches.clear();
        }
        if watches.len() >= MAX_WATCHES {
            watches.remove(0);
        }
        watches.push(done.drop_guard());
    }

    /// A value that, once dropped, makes the next command check the connection first. Tasks
    /// on a runtime that may also run the connection's task hold one: when that runtime shuts
    /// down, they are dropped with the connection's task.
    pub(crate) fn suspect_on_drop(&self) -> SuspectOnDrop {
        SuspectOnDrop(Some(Arc::clone(&self.suspect)))
    }

    /// The connection to send the next command on.
    fn manager(&self) -> Link {
        self.manager
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// After a runtime that may have run the connection's task (or a reconnection of the
    /// manager) shut down. A manager the backend made is replaced by a new one, which
    /// connects on the current runtime when the next command needs it: the old one may be
    /// left with a connection whose task is gone, or a reconnection whose timers belonged to
    /// the runtime that is gone (polling it again would panic inside the driver). A manager
    /// the application passed in is checked with a `PING` instead, whose failure makes it
    /// reconnect; its outcome is otherwise ignored (a user without permission for `PING`
    /// gets an error that changes nothing).
    ///
    /// Every command starts here, and nearly always there is nothing to do: that is decided
    /// without an await, and the work itself is boxed, so that its future (as large as a
    /// command's, with a sentinel discovery and a `PING` in it) takes no room in every
    /// command's future.
    async fn repair(&self) {
        if self.sentinel.is_none() && !self.suspect.load(Ordering::SeqCst) {
            return;
        }
        Box::pin(self.repair_now()).await;
    }

    /// [`repair`](Conn::repair)'s work.
    async fn repair_now(&self) {
        self.rediscover().await;
        if self.suspect.swap(false, Ordering::SeqCst) {
            if self.replace() {
                return;
            }
            // Suspect again if this is dropped before the check is done.
            let unfinished = self.suspect_on_drop();
            let mut manager = self.manager();
            let outcome =
                unwind_to_error(redis::cmd("PING").query_async::<Value>(&mut manager)).await;
            self.forget_on_failure(&outcome);
            unfinished.disarm();
        }
    }

    /// Replaces the manager with a new one that connects on the current runtime when first
    /// used; `false` when the backend cannot make one (the application passed its manager).
    fn replace(&self) -> bool {
        if let Some(cluster) = &self.cluster {
            *self.manager.lock().unwrap_or_else(PoisonError::into_inner) =
                Link::Cluster(cluster.lazy());
            self.forget();
            self.watch_runtime(true);
            return true;
        }
        let Some((client, config)) = self
            .rebuild
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
        else {
            return false;
        };
        match ConnectionManager::new_lazy_with_config(client, config) {
            Ok(manager) => {
                *self.manager.lock().unwrap_or_else(PoisonError::into_inner) = manager.into();
                self.forget();
                self.watch_runtime(true);
                true
            }
            Err(err) => {
                tracing::warn!(error = %err, "could not make a new redis connection manager");
                false
            }
        }
    }

    fn caps(&self) -> Caps {
        *self.caps.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Records what a command showed about the connection of `generation`, unless the
    /// connection has been replaced since.
    fn learn(&self, generation: u64, learn: impl FnOnce(&mut Caps)) {
        let mut caps = self.caps.lock().unwrap_or_else(PoisonError::into_inner);
        if caps.generation == generation {
            learn(&mut caps);
        }
    }

    fn forget_on_failure<T>(&self, outcome: &Result<T, RedisError>) {
        // On a cluster, a node that answers it is a replica was a master when the driver read
        // the slot map: the driver keeps a READONLY connection to every node, on which a
        // replica runs a script itself (a script without flags is no write command to
        // Redis 7's redirection) instead of answering MOVED, so the driver would never
        // learn of the failover. The next command connects again, with a new slot map.
        if self.cluster.is_some()
            && let Err(err) = outcome
            && points_elsewhere(err)
        {
            self.suspect.store(true, Ordering::SeqCst);
        }
        if self.sentinel.is_some()
            && let Err(err) = outcome
            && (!is_server_answer(err) || points_elsewhere(err))
        {
            self.rediscover.store(true, Ordering::SeqCst);
        }
        match outcome {
            Err(err) if !is_server_answer(err) => {
                self.forget();
                // The manager reconnects, maybe on this runtime.
                self.reconnecting.store(true, Ordering::SeqCst);
                self.watch_runtime(false);
            }
            _ => self.reconnecting.store(false, Ordering::SeqCst),
        }
    }

    /// Before a command: while the manager may be reconnecting, this runtime may poll the
    /// reconnection first (and start its timers), so it is watched.
    fn watch_if_reconnecting(&self) {
        if self.reconnecting.load(Ordering::SeqCst) {
            self.watch_runtime(false);
        }
    }

    /// Forgets what the connection supports: it may be another one now.
    fn forget(&self) {
        let mut caps = self.caps.lock().unwrap_or_else(PoisonError::into_inner);
        *caps = Caps::new(caps.generation.wrapping_add(1));
    }

    /// Sends one command. A failure that is not the server's answer forgets what the
    /// connection was known to support: the connection manager replaces the connection after
    /// it, and the next server may be another version.
    ///
    /// A panic inside the driver (its reconnection polled after the runtime it began on shut
    /// down) is caught and answered as an I/O failure; the manager is replaced, so the next
    /// command connects again.
    ///
    /// While the connection's `CLIENT ID` is not known (a new connection) and fencing is on,
    /// `CLIENT ID` goes ahead of the command in one pipeline: learnt with no round trip of its
    /// own.
    pub(crate) async fn query(&self, cmd: &Cmd) -> Result<Value, RedisError> {
        self.query_then(cmd, None).await.map(|(reply, _)| reply)
    }

    /// `cmd` sent to the node at `addr` of a cluster (to the server, on one server).
    pub(crate) async fn query_at(
        &self,
        addr: &(String, u16),
        cmd: &Cmd,
    ) -> Result<Value, RedisError> {
        self.repair().await;
        self.watch_if_reconnecting();
        let mut manager = self.manager();
        let outcome = unwind_to_error(manager.query_at(addr, cmd)).await;
        self.after_driver_panic(&outcome);
        self.forget_on_failure(&outcome);
        outcome
    }

    /// [`Conn::query`], with `then` sent right behind `cmd` in the same pipeline, so on the
    /// same connection (as `WAIT` must be, to wait for the write of `cmd`): the second value
    /// is `then`'s reply (an error answer as [`Value::ServerError`]).
    async fn query_then(
        &self,
        cmd: &Cmd,
        then: Option<&Cmd>,
    ) -> Result<(Value, Option<Value>), RedisError> {
        let ask_id = self.caps().client_id.is_none() && self.fencing_on();
        if !ask_id && then.is_none() {
            self.repair().await;
            self.watch_if_reconnecting();
            let mut manager = self.manager();
            let outcome = unwind_to_error(cmd.query_async::<Value>(&mut manager)).await;
            self.after_driver_panic(&outcome);
            self.forget_on_failure(&outcome);
            return outcome.map(|reply| (reply, None));
        }
        let mut cmds = vec![cmd.clone()];
        cmds.extend(then.cloned());
        let mut replies = self.pipeline(cmds).await?.into_iter();
        match replies.next() {
            Some(reply) => as_result(reply).map(|reply| (reply, replies.next())),
            None => Err(unexpected("a pipeline", &Value::Nil)),
        }
    }

    /// Sends `cmds`, commands on keys of one lock each, in one [`Conn::pipeline`] (one round
    /// trip); on a Cluster, whose pipelines must stay in one slot, each in a pipeline of its
    /// own, all at once. Each reply in its place, an error answer (or on a Cluster, a failure
    /// to reach the node) as its `Err`; `Err` as a whole only when the one pipeline got no
    /// answer.
    pub(super) async fn pipelines(
        &self,
        cmds: Vec<Cmd>,
    ) -> Result<Vec<Result<Value, RedisError>>, RedisError> {
        if !self.is_cluster() {
            return Ok(self
                .pipeline(cmds)
                .await?
                .into_iter()
                .map(as_result)
                .collect());
        }
        let each = cmds.into_iter().map(|cmd| async move {
            let mut replies = self.pipeline(vec![cmd]).await?;
            match replies.pop() {
                Some(reply) => as_result(reply),
                None => Err(unexpected("a pipeline", &Value::Nil)),
            }
        });
        Ok(futures_util::future::join_all(each).await)
    }

    /// Sends `cmds` in one pipeline (one round trip), each reply in its place (an error
    /// answer as [`Value::ServerError`]); `Err` only when the pipeline got no answer. While
    /// the connection's `CLIENT ID` is not known and fencing is on, `CLIENT ID` goes first
    /// (see [`Conn::query`]).
    async fn pipeline(&self, cmds: Vec<Cmd>) -> Result<Vec<Value>, RedisError> {
        self.repair().await;
        self.watch_if_reconnecting();
        let mut manager = self.manager();
        let caps = self.caps();
        let ask_id = caps.client_id.is_none() && self.fencing_on();
        let count = cmds.len();
        let mut pipe = redis::Pipeline::with_capacity(count + usize::from(ask_id));
        if ask_id {
            pipe.cmd("CLIENT").arg("ID");
        }
        for cmd in cmds {
            pipe.add_command(cmd);
        }
        pipe.ignore_errors();
        let outcome = unwind_to_error(pipe.query_async::<Vec<Value>>(&mut manager))
            .await
            .and_then(|mut replies| {
                if ask_id && !replies.is_empty() {
                    let id = replies.remove(0);
                    self.record_client_id(caps.generation, as_result(id));
                }
                if replies.len() == count {
                    Ok(replies)
                } else {
                    Err(unexpected("a pipeline", &Value::Array(replies)))
                }
            });
        self.after_driver_panic(&outcome);
        self.forget_on_failure(&outcome);
        if let Ok(replies) = &outcome {
            // An answer that says the master moved (behind Sentinel) counts as it does
            // alone.
            for reply in replies {
                if let Value::ServerError(err) = reply {
                    self.forget_on_failure(&Err::<(), _>(RedisError::from(err.clone())));
                }
            }
        }
        outcome
    }

    /// Sends `cmd` and, in the same pipeline, `PUBLISH channel <announcer>`, the announcement that wakes
    /// the waiters of a lock given back (see [Waiting](super#waiting)). `cmd`'s answer is the
    /// outcome; the announcement's is only logged (a user refused `PUBLISH` is warned once, and
    /// its releases wake nobody: waiters notice them at their next poll). The announcement is
    /// sent whatever `cmd` finds: a waiter woken for nothing tries once and waits again.
    /// Also answers how many subscribers the announcement reached (0 when it failed).
    async fn query_announcing(
        &self,
        cmd: &Cmd,
        channel: &[u8],
    ) -> Result<(Value, u64), RedisError> {
        let mut publish = redis::cmd("PUBLISH");
        publish.arg(channel).arg(&self.announcer[..]);
        let (reply, announced) = self.query_then(cmd, Some(&publish)).await?;
        let woke = match announced.map(as_result) {
            Some(Ok(Value::Int(n))) => n.max(0).unsigned_abs(),
            Some(Err(err)) => {
                self.announcement_refused(&err);
                0
            }
            _ => 0,
        };
        Ok((reply, woke))
    }

    /// `PUBLISH channel <announcer>` on its own: a release's announcement (see
    /// [`Conn::query_announcing`]). Best effort: answers how many subscribers it reached.
    pub(crate) async fn announce(&self, channel: &[u8]) -> u64 {
        let mut publish = redis::cmd("PUBLISH");
        publish.arg(channel).arg(&self.announcer[..]);
        match self.query(&publish).await {
            Ok(Value::Int(n)) => n.max(0).unsigned_abs(),
            Ok(_) => 0,
            Err(err) => {
                self.announcement_refused(&err);
                0
            }
        }
    }

    fn announcement_refused(&self, err: &RedisError) {
        if err.kind() == ErrorKind::Server(ServerErrorKind::NoPerm)
            && !self.publish_refused.swap(true, Ordering::Relaxed)
        {
            tracing::warn!(
                error = %err,
                "redis releases cannot wake waiters: the server refused PUBLISH (grant the \
                 Redis user `+publish` and the channels `&<prefix>{{*`, see Permissions in the \
                 dlock::redis docs); waiters notice releases at their next poll"
            );
        } else {
            tracing::debug!(error = %err, "a release's announcement failed");
        }
    }

    /// The server refused a waiting mark (see [`Conn::marking_waits`]): a user whose key
    /// pattern covers the locks but not their marks. Warned once; from then on the backend
    /// marks nothing, and its releases announce themselves unmarked. Other backends' releases
    /// do not wake its waiters, which notice a release when the holder's lease would have
    /// ended or at their fallback poll.
    pub(crate) fn refuse_marks(&self, why: &str) {
        if !self.mark_refused.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                error = why,
                "redis waiters cannot mark the keys they wait for: the server refused \
                 `<lock key>:waiting` (grant the Redis user the keys `~<prefix>{{*`, see \
                 Permissions in the dlock::redis docs); releases elsewhere then do not wake \
                 them, and they notice a release when the holder's lease would have ended or \
                 at their fallback poll"
            );
        }
    }

    /// Whether `err`, the answer to a command that carried a waiting mark, may be the server
    /// refusing the mark (`NOPERM`, a user whose key pattern covers the locks but not their
    /// marks): the refused command ran nothing, and the caller sends it once more without the
    /// mark, then hands the outcome to [`Conn::after_unmarked`] (see [`Conn::eval_marked`]).
    fn mark_maybe_refused(err: &RedisError) -> bool {
        err.kind() == ErrorKind::Server(ServerErrorKind::NoPerm)
    }

    /// The outcome `again` of a command sent once more without its mark after `first`: when
    /// it was not refused as well, the mark was what the user may not touch (see
    /// [`Conn::refuse_marks`]).
    fn after_unmarked<T>(&self, first: &RedisError, again: &Result<T, RedisError>) {
        if !again.as_ref().is_err_and(Conn::mark_maybe_refused) {
            self.refuse_marks(&first.to_string());
        }
    }

    /// The lease left (ms) in a waiter's try answered `{pttl, marked}` by a script that found
    /// the key held; a refused mark (`marked` 0) is taken note of, `refused` saying where (see
    /// [`Conn::refuse_marks`]).
    pub(crate) fn waiter_reply(&self, items: &[Value], refused: &str) -> Option<i64> {
        if let Some(Value::Int(0)) = items.get(1) {
            self.refuse_marks(refused);
        }
        if let Some(Value::Int(0)) = items.get(2)
            && !self.queue_refused.swap(true, Ordering::Relaxed)
        {
            tracing::warn!(
                "redis waiters do not queue: the server refused a command of a lock's queue of \
                 waiters (grant the Redis user `+zadd +zrange +zrem +time +get +del +pexpire`, \
                 see Permissions in the dlock::redis docs); waits are served less evenly"
            );
        }
        match items.first() {
            Some(Value::Int(ms)) => Some(*ms),
            _ => None,
        }
    }

    /// Whether uncertain commands are fenced: the backend can open another connection (it
    /// was built from a client), and the user may run `CLIENT ID` and `CLIENT KILL`.
    pub(crate) fn fencing_on(&self) -> bool {
        self.rebuild
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_some()
            && !self.fence.disabled.load(Ordering::Relaxed)
    }

    /// Turns fencing off for good, saying why once.
    fn disable_fencing(&self, why: &str) {
        if !self.fence.disabled.swap(true, Ordering::SeqCst) {
            tracing::warn!(
                reason = why,
                "redis connection fencing is off: a renewal or release whose outcome is unknown \
                 (timed out or cancelled) can no longer be kept from landing later by killing \
                 its connection; grant the Redis user `+client|id +client|kill` to have it"
            );
        }
    }

    /// Records the answer to `CLIENT ID` for the connection of `generation`.
    fn record_client_id(&self, generation: u64, reply: Result<Value, RedisError>) {
        match reply {
            Ok(Value::Int(id)) => self.learn(generation, |c| c.client_id = Some(id)),
            Err(err) => {
                if err.kind() == ErrorKind::Server(ServerErrorKind::NoPerm) {
                    self.disable_fencing("the Redis user may not run CLIENT ID");
                } else if is_server_answer(&err) {
                    self.disable_fencing("the server refused CLIENT ID");
                }
            }
            _ => {}
        }
    }

    /// The `CLIENT ID` of the connection the next command goes out on, when fencing is on;
    /// asked with a round trip of its own only when the connection is new and this is its
    /// first command (any other first command learns it in passing, see [`Conn::query`]).
    /// `None` when fencing is off or the question failed: the command is then sent unfenced.
    ///
    /// Cancel safe, and nothing uncertain is left by a timeout here: the fenced command has
    /// not been sent yet.
    pub(crate) async fn fence_ticket(&self) -> Option<i64> {
        if let Some(known) = self.known_fence_ticket() {
            return known;
        }
        let caps = self.caps();
        self.repair().await;
        self.watch_if_reconnecting();
        let mut manager = self.manager();
        let mut ask = redis::cmd("CLIENT");
        ask.arg("ID");
        let outcome = unwind_to_error(ask.query_async::<Value>(&mut manager)).await;
        self.after_driver_panic(&outcome);
        self.forget_on_failure(&outcome);
        self.record_client_id(caps.generation, outcome);
        self.caps().client_id.filter(|_| self.fencing_on())
    }

    /// [`fence_ticket`](Conn::fence_ticket)'s answer when it needs no round trip (fencing off,
    /// or the connection's `CLIENT ID` known); `None` when it must ask the server.
    pub(crate) fn known_fence_ticket(&self) -> Option<Option<i64>> {
        if !self.fencing_on() {
            return Some(None);
        }
        self.caps().client_id.map(Some)
    }

    /// Kills the connection `id` from a connection of its own (opened for this, then closed),
    /// so that a command it sent and whose outcome is unknown either ran already or never
    /// will; then the manager is made again, so the next command connects anew. `Ok(true)`:
    /// killed; `Ok(false)`: no such connection (closed already, or the id was stale). A user
    /// who may not run `CLIENT KILL` turns fencing off (warned once).
    pub(crate) async fn kill_client(&self, id: i64, timeout: Duration) -> Result<bool, RedisError> {
        let Some((client, _)) = self
            .rebuild
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
        else {
            return Ok(false);
        };
        let config = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(timeout))
            .set_response_timeout(Some(timeout));
        let killed = async {
            let mut conn = client
                .get_multiplexed_async_connection_with_config(&config)
                .await?;
            redis::cmd("CLIENT")
                .arg("KILL")
                .arg("ID")
                .arg(id)
                .query_async::<i64>(&mut conn)
                .await
        }
        .await;
        match killed {
            Ok(n) => {
                // The connection may be the manager's current one: make a new manager, so
                // that no command meets the killed connection.
                self.replace();
                Ok(n > 0)
            }
            Err(err) => {
                if err.kind() == ErrorKind::Server(ServerErrorKind::NoPerm) {
                    self.disable_fencing("the Redis user may not run CLIENT KILL");
                }
                Err(err)
            }
        }
    }

    /// Replaces the manager after a panic inside it (it is poisoned for good).
    fn after_driver_panic<T>(&self, outcome: &Result<T, RedisError>) {
        if outcome.as_ref().is_err_and(is_driver_panic) && !self.replace() {
            tracing::warn!(
                "the redis connection manager passed in failed inside (a Tokio runtime it \
                 reconnected on shut down); build the backend from a client to let it make \
                 a new one"
            );
        }
    }

    /// Runs a script with `EVALSHA`, and with `EVAL` when the server answers `NOSCRIPT` (after
    /// a restart, a `SCRIPT FLUSH`, or on a new replica). No other failure is retried.
    pub(crate) async fn eval(
        &self,
        script: &Script,
        keys: &[&[u8]],
        args: &[&[u8]],
    ) -> Result<Value, RedisError> {
        self.eval_then(script, keys, args, None)
            .await
            .map(|(reply, _)| reply)
    }

    /// [`Conn::eval`], with `then` behind it on the same connection (see
    /// [`Conn::query_then`]).
    async fn eval_then(
        &self,
        script: &Script,
        keys: &[&[u8]],
        args: &[&[u8]],
        then: Option<&Cmd>,
    ) -> Result<(Value, Option<Value>), RedisError> {
        let evalsha: Cmd = script_command("EVALSHA", &script.sha, keys, args);
        let outcome = match self.query_then(&evalsha, then).await {
            Err(err) if err.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                let eval: Cmd = script_command("EVAL", script.code, keys, args);
                self.query_then(&eval, then).await
            }
            other => other,
        };
        match outcome {
            Err(err) if is_script_acl_failure(&err) => Err(script_noperm(script, &err)),
            other => other,
        }
    }

    /// [`Conn::eval_then`] on `marked`, keys that carry a lock's waiting mark, and once more on
    /// `unmarked`, the same without it, when the server refuses the first for the mark (see
    /// [`Conn::mark_maybe_refused`]). Equal key lists run once.
    async fn eval_marked(
        &self,
        script: &Script,
        marked: &[&[u8]],
        unmarked: &[&[u8]],
        args: &[&[u8]],
        then: Option<&Cmd>,
    ) -> Result<(Value, Option<Value>), RedisError> {
        match self.eval_then(script, marked, args, then).await {
            Err(err) if marked != unmarked && Conn::mark_maybe_refused(&err) => {
                let again = self.eval_then(script, unmarked, args, then).await;
                self.after_unmarked(&err, &again);
                again
            }
            other => other,
        }
    }

    /// [`Conn::eval_marked`], with `WAIT` behind it on the same connection when `wait` asks for it
    /// (see [`Conn::take`]): the second value is how many replicas acknowledged the writes of
    /// the connection so far, the script's included (`None` without `wait`).
    pub(crate) async fn eval_waiting(
        &self,
        script: &Script,
        marked: &[&[u8]],
        unmarked: &[&[u8]],
        args: &[&[u8]],
        wait: Option<(u32, Duration)>,
    ) -> Result<(Value, Option<u64>), RedisError> {
        let wait_cmd = wait_command(wait);
        let (reply, waited) = self
            .eval_marked(script, marked, unmarked, args, wait_cmd.as_ref())
            .await?;
        Ok((reply, acked(waited)?))
    }

    /// `SET key token NX PX lease`, or with a fencing counter, the script that also bumps it.
    /// `Taken(fencing)` when taken; `Held(ttl)` when the lock is held, with the holder's
    /// time to live in ms when `waiter` is set (a waiter's try) and it could be read. A
    /// waiter's try that finds the lock held also sets its waiting mark, when this connection
    /// marks waits (see [`Conn::marking_waits`]), for the waiter's pause and [`MARK_SLACK`].
    /// With `wait`, `WAIT replicas timeout` follows on the same connection: the second value
    /// is how many replicas acknowledged the write (`None` without `wait`). `WAIT` counts the
    /// replicas that have every write of the connection so far, the acquisition's included.
    pub(crate) async fn take(
        &self,
        key: &[u8],
        fence_key: Option<Counter<'_>>,
        token: &OwnerToken,
        lease: Duration,
        waiter: Option<WaiterTry>,
        wait: Option<(u32, Duration)>,
    ) -> Result<(Taking, Option<u64>), RedisError> {
        let ms = millis(lease).to_string();
        let wait_cmd = wait_command(wait);
        let mark = waiter.and_then(|_| self.waiting_mark(key));
        let mark_ms = waiter.map(WaiterTry::mark_ms);
        let queue = waiter
            .filter(|waiter| waiter.queued)
            .and_then(|_| self.queue_keys(key));
        match fence_key {
            None => {
                let mut set = redis::cmd("SET");
                set.arg(key)
                    .arg(token.as_bytes())
                    .arg("NX")
                    .arg("PX")
                    .arg(&ms);
                let (reply, waited) = self.query_then(&set, wait_cmd.as_ref()).await?;
                match reply {
                    Value::Nil if waiter.is_some() => {
                        // Separate commands: the plain `SET` path runs no script. Best
                        // effort. The mark goes first: a release after the `SET` that
                        // missed it is seen by the `PTTL` as a key gone.
                        let mut pttl = redis::cmd("PTTL");
                        pttl.arg(key);
                        let ttl = match (&mark, &mark_ms) {
                            (Some(mark), Some(mark_ms)) => {
                                let mut set_mark = redis::cmd("SET");
                                set_mark.arg(&mark[..]).arg("1").arg("PX").arg(mark_ms);
                                let replies = self.pipeline(vec![set_mark, pttl]).await.ok();
                                let mut replies = replies.into_iter().flatten();
                                if let Some(Value::ServerError(err)) = replies.next() {
                                    self.refuse_marks(&format!("{err:?}"));
                                }
                                replies.next()
                            }
                            _ => self.query(&pttl).await.ok(),
                        };
                        let ms = match ttl {
                            Some(Value::Int(ms)) => Some(ms),
                            _ => None,
                        };
                        Ok((Taking::Held(ms), None))
                    }
                    Value::Nil => Ok((Taking::Held(None), None)),
                    _ => Ok((Taking::Taken(None), acked(waited)?)),
                }
            }
            Some(counter) => {
                let mut args: Vec<&[u8]> = vec![token.as_bytes(), ms.as_bytes()];
                let (script, keys) = match counter {
                    Counter::PerKey(fence_key) => {
                        (&self.scripts.acquire_fenced, vec![key, fence_key])
                    }
                    Counter::Shared {
                        counter,
                        record,
                        mode,
                    } => {
                        args.push(mode);
                        (&self.scripts.acquire_counted, vec![key, counter, record])
                    }
                };
                if let Some(mark_ms) = &mark_ms {
                    args.push(mark_ms.as_bytes());
                }
                let mut marked = keys.clone();
                marked.extend(mark.as_deref());
                if let (Some(_), Some((queue, turn))) = (&mark, &queue) {
                    marked.extend([&queue[..], &turn[..]]);
                    args.push(&self.announcer[..]);
                }
                let (reply, waited) = self
                    .eval_marked(script, &marked, &keys, &args, wait_cmd.as_ref())
                    .await?;
                match reply {
                    Value::Nil => Ok((Taking::Held(None), None)),
                    Value::Int(n) => Ok((Taking::Taken(u64::try_from(n).ok()), acked(waited)?)),
                    Value::Array(items) => Ok((
                        Taking::Held(
                            self.waiter_reply(&items, "the acquisition script's SET of the mark"),
                        ),
                        None,
                    )),
                    other => Err(unexpected("the acquisition script", &other)),
                }
            }
        }
    }

    /// [`take`](Conn::take) without the holder's time to live: `Ok(None)` when the lock is
    /// held; `Ok(Some(fencing))` when taken.
    pub(crate) async fn acquire(
        &self,
        key: &[u8],
        fence_key: Option<&[u8]>,
        token: &OwnerToken,
        lease: Duration,
    ) -> Result<Option<Option<u64>>, RedisError> {
        Ok(
            match self
                .take(
                    key,
                    fence_key.map(Counter::PerKey),
                    token,
                    lease,
                    None,
                    None,
                )
                .await?
                .0
            {
                Taking::Taken(fencing) => Some(fencing),
                Taking::Held(_) => None,
            },
        )
    }

    /// Whether the connection has the native delete `command` (`DELEX` or `DELIFEQ`), probed
    /// by sending the bare command name: a server without it answers "unknown command", one
    /// with it "wrong number of arguments", and neither touches a key or needs a key
    /// permission. Used only when the real call could not be sent as its own probe (see
    /// [`quoted_args_are_text`]), or after an answer that could not be read.
    async fn probe_native_delete(&self, command: Native) -> Result<bool, RedisError> {
        let generation = self.caps().generation;
        let has = match self.query(&redis::cmd(command.name())).await {
            Ok(_) => true,
            Err(err) if is_unknown_command(&err) => false,
            Err(err) if is_arity_error(&err) => true,
            Err(err) => return Err(err),
        };
        let support = if has { Support::Yes } else { Support::No };
        self.learn(generation, |c| *command.support(c) = support);
        Ok(has)
    }

    /// One native conditional delete, sent as it is when the connection may have it: `None`
    /// when the server does not know the command (which then did nothing), and the outcome
    /// otherwise. The server's "unknown command" answer quotes the first arguments; when
    /// those would not be valid text (a binary token, a key cut inside a character) the
    /// client could not read that answer, so the bare name is probed first instead.
    async fn native_delete(
        &self,
        command: Native,
        key: &[u8],
        token: &OwnerToken,
    ) -> Result<Option<(ReleaseOutcome, u64)>, RedisError> {
        let caps = self.caps();
        let known = command.known(caps);
        if known == Support::No {
            return Ok(None);
        }
        let args: &[&[u8]] = match command {
            Native::Delex => &[key, b"IFEQ", token.as_bytes()],
            Native::Delifeq => &[key, token.as_bytes()],
        };
        let size = command.name().len() + args.iter().map(|a| a.len()).sum::<usize>();
        let mut cmd: Cmd = Cmd::with_capacity(args.len() + 1, size);
        cmd.arg(command.name());
        for arg in args {
            cmd.arg(*arg);
        }
        let probe_first = known == Support::Unknown
            && (self.probe_first.load(Ordering::Relaxed) || !quoted_args_are_text(args));
        if probe_first && !self.probe_native_delete(command).await? {
            return Ok(None);
        }
        // Where the command is known, the announcement of the release goes in the same
        // round trip (see [`Conn::query_announcing`]); on a first call, after it. On a
        // Cluster, where `PUBLISH` reaches every node over the cluster bus, the waiting mark
        // is read in that round trip instead, and the announcement follows only while the
        // mark lives (a waiter whose try found the lock taken set it in the same step), as
        // the release script does.
        let announced = known == Support::Yes;
        let mark = self
            .waiting_mark(key)
            .filter(|_| announced && self.is_cluster() && !self.unmarked_for_now());
        let answer = match &mark {
            Some(mark) => {
                let mut exists = redis::cmd("EXISTS");
                exists.arg(mark);
                self.query_then(&cmd, Some(&exists))
                    .await
                    .map(|(reply, marked)| (reply, Behind::Mark(marked)))
            }
            None if announced => self
                .query_announcing(&cmd, key)
                .await
                .map(|(reply, woke)| (reply, Behind::Announced(woke))),
            None => self.query(&cmd).await.map(|reply| (reply, Behind::Nothing)),
        };
        match answer {
            Ok((reply, behind)) => {
                self.learn(caps.generation, |c| *command.support(c) = Support::Yes);
                let outcome = self.native_outcome(key, reply).await?;
                let released = outcome == ReleaseOutcome::Released;
                let woke = match behind {
                    Behind::Announced(woke) => woke,
                    // Nobody waits.
                    Behind::Mark(Some(Value::Int(0))) => 0,
                    // A waiter's mark, or no answer about it: announced.
                    Behind::Mark(_) | Behind::Nothing if released => self.announce(key).await,
                    Behind::Mark(_) | Behind::Nothing => 0,
                };
                Ok(Some((outcome, woke)))
            }
            Err(err) if is_unknown_command(&err) => {
                if known == Support::Yes {
                    // The server behind the connection changed since it answered: forget
                    // everything learnt about the old one.
                    self.forget();
                } else {
                    self.learn(caps.generation, |c| *command.support(c) = Support::No);
                }
                Ok(None)
            }
            Err(err) => {
                if known == Support::Unknown && err.kind() == ErrorKind::Parse {
                    // An answer the client could not read (an unknown-command error quoting
                    // bytes that are not text, from a server that quotes differently): find
                    // out with the bare names from now on. The connection is made again.
                    self.probe_first.store(true, Ordering::Relaxed);
                }
                Err(err)
            }
        }
    }

    /// Deletes the lock if `token` owns it: `DELEX`, then `DELIFEQ`, then Lua, each sent as
    /// it is, moving on only when the server does not know a command.
    pub(crate) async fn release(
        &self,
        key: &[u8],
        token: &OwnerToken,
    ) -> Result<(ReleaseOutcome, CommandPath), RedisError> {
        self.release_waking(key, token)
            .await
            .map(|(outcome, path, _)| (outcome, path))
    }

    /// [`Conn::release`], which also answers how many subscribers of the key's channel its
    /// announcement reached (the backends with waiters on the key, see [Fair
    /// waiting](super#fair-waiting)).
    pub(crate) async fn release_waking(
        &self,
        key: &[u8],
        token: &OwnerToken,
    ) -> Result<(ReleaseOutcome, CommandPath, u64), RedisError> {
        for command in [Native::Delex, Native::Delifeq] {
            if let Some((outcome, woke)) = self.native_delete(command, key, token).await? {
                return Ok((outcome, command.path(), woke));
            }
        }
        let args: [&[u8]; 2] = [token.as_bytes(), &self.announcer];
        let reply = self
            .eval_release(&self.scripts.release, key, &[key], &args)
            .await?;
        let (outcome, woke) = match reply {
            Value::Int(n) if n >= 1 => (ReleaseOutcome::Released, (n - 1).unsigned_abs()),
            Value::Int(0) => (ReleaseOutcome::AlreadyReleased, 0),
            Value::Int(-1) => (ReleaseOutcome::NotOwned, 0),
            other => return Err(unexpected("the release script", &other)),
        };
        Ok((outcome, CommandPath::Lua, woke))
    }

    /// Runs a release `script` on `keys` (the lock's `key` first), with the lock's waiting mark
    /// as the last key when this connection marks waits: the script announces the release
    /// only while the mark lives. A Cluster slot in migration refuses a script whose keys are
    /// not all on the node asked (`TRYAGAIN`), as the mark of a lock nobody waits for never
    /// is: the script runs again on `keys` alone (which follow `ASK`) and announces unmarked,
    /// as do the backend's releases for a while.
    pub(crate) async fn eval_release(
        &self,
        script: &Script,
        key: &[u8],
        keys: &[&[u8]],
        args: &[&[u8]],
    ) -> Result<Value, RedisError> {
        let mark = self.waiting_mark(key).filter(|_| !self.unmarked_for_now());
        let mut marked = keys.to_vec();
        marked.extend(mark.as_deref());
        let reply = self.eval_marked(script, &marked, keys, args, None).await;
        match reply.map(|(reply, _)| reply) {
            Err(err) if mark.is_some() && err.code() == Some("TRYAGAIN") => {
                *self
                    .unmarked_until
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner) =
                    Some(Instant::now() + UNMARKED_AFTER_TRYAGAIN);
                self.eval(script, keys, args).await
            }
            other => other,
        }
    }

    /// A native conditional delete answers 1 or 0; a 0 is told apart (missing or another
    /// owner) by one more read, which is not atomic with the delete: a lock released by its
    /// other owner in between reads as `AlreadyReleased`.
    async fn native_outcome(&self, key: &[u8], reply: Value) -> Result<ReleaseOutcome, RedisError> {
        match reply {
            Value::Int(1) => Ok(ReleaseOutcome::Released),
            Value::Int(0) => {
                let mut exists = redis::cmd("EXISTS");
                exists.arg(key);
                match self.query(&exists).await? {
                    Value::Int(0) => Ok(ReleaseOutcome::AlreadyReleased),
                    _ => Ok(ReleaseOutcome::NotOwned),
                }
            }
            other => Err(unexpected("the conditional delete", &other)),
        }
    }

    /// Sets the lock's lease to `lease` from now if `token` owns it: `SET .. IFEQ .. PX`, or
    /// Lua when the server answers that with a syntax error. `Ok(false)`: not owned (missing,
    /// expired or another owner); the key is never created or touched then.
    pub(crate) async fn extend(
        &self,
        key: &[u8],
        token: &OwnerToken,
        lease: Duration,
    ) -> Result<(bool, CommandPath), RedisError> {
        let ms = millis(lease).to_string();
        let caps = self.caps();
        if caps.set_ifeq != Support::No {
            let mut set = redis::cmd("SET");
            set.arg(key)
                .arg(token.as_bytes())
                .arg("IFEQ")
                .arg(token.as_bytes())
                .arg("PX")
                .arg(&ms);
            match self.query(&set).await {
                Ok(reply) => {
                    self.learn(caps.generation, |c| c.set_ifeq = Support::Yes);
                    return Ok((reply != Value::Nil, CommandPath::SetIfeq));
                }
                Err(err) if is_syntax_error(&err) => {
                    self.learn(caps.generation, |c| c.set_ifeq = Support::No);
                }
                Err(err) => return Err(err),
            }
        }
        let reply = self
            .eval(
                &self.scripts.extend,
                &[key],
                &[token.as_bytes(), ms.as_bytes()],
            )
            .await?;
        match reply {
            Value::Int(n) => Ok((n == 1, CommandPath::Lua)),
            other => Err(unexpected("the extension script", &other)),
        }
    }

    /// Renews many locks in one round trip: [`Conn::extend`] for each (or the read script for
    /// a reader's share), sent as one pipeline. The scripts a server did not have
    /// (`NOSCRIPT`), and the `SET .. IFEQ` renewals of a server that refuses them, go again
    /// with `EVAL` in a second pipeline. Each lock's outcome is in its place: `Ok(true)`
    /// renewed, `Ok(false)` not owned (the key is never created or touched then), `Err` its
    /// error answer. `Err` as a whole when the pipeline got no answer.
    pub(crate) async fn extend_many(
        &self,
        items: &[Extension<'_>],
    ) -> Result<Vec<Result<bool, RedisError>>, RedisError> {
        let caps = self.caps();
        let native = caps.set_ifeq != Support::No;
        let ms: Vec<String> = items
            .iter()
            .map(|item| millis(item.lease).to_string())
            .collect();
        // What each lock's renewal runs: `None` for `SET .. IFEQ`.
        let mut scripts: Vec<Option<&Script>> = items
            .iter()
            .map(|item| match item.script {
                Some((script, _)) => Some(script),
                None if native => None,
                None => Some(&self.scripts.extend),
            })
            .collect();
        fn keys<'a>(item: &Extension<'a>) -> Vec<&'a [u8]> {
            match item.script {
                Some((_, second)) => vec![item.key, second],
                None => vec![item.key],
            }
        }
        let script_cmd = |name: &str, script: &Script, item: &Extension<'_>, ms: &str| {
            let code = if name == "EVAL" {
                script.code
            } else {
                &script.sha
            };
            script_command(
                name,
                code,
                &keys(item),
                &[item.token.as_bytes(), ms.as_bytes()],
            )
        };
        let cmds = items
            .iter()
            .zip(&ms)
            .zip(&scripts)
            .map(|((item, ms), script)| match script {
                Some(script) => script_cmd("EVALSHA", script, item, ms),
                None => {
                    let mut set = redis::cmd("SET");
                    set.arg(item.key)
                        .arg(item.token.as_bytes())
                        .arg("IFEQ")
                        .arg(item.token.as_bytes())
                        .arg("PX")
                        .arg(ms);
                    set
                }
            })
            .collect();
        let mut replies = self.pipelines(cmds).await?;
        let mut again = Vec::new();
        for (i, reply) in replies.iter().enumerate() {
            let Err(err) = reply else {
                if scripts[i].is_none() {
                    self.learn(caps.generation, |c| c.set_ifeq = Support::Yes);
                }
                continue;
            };
            if scripts[i].is_none() && is_syntax_error(err) {
                self.learn(caps.generation, |c| c.set_ifeq = Support::No);
                scripts[i] = Some(&self.scripts.extend);
                again.push(i);
            } else if err.kind() == ErrorKind::Server(ServerErrorKind::NoScript) {
                again.push(i);
            }
        }
        if !again.is_empty() {
            let cmds = again
                .iter()
                .filter_map(|&i| Some(script_cmd("EVAL", scripts[i]?, &items[i], &ms[i])))
                .collect();
            let second = self.pipelines(cmds).await?;
            for (i, reply) in again.into_iter().zip(second) {
                replies[i] = reply;
            }
        }
        Ok(replies
            .into_iter()
            .zip(scripts)
            .map(|(reply, script)| match (reply, script) {
                (Ok(Value::Int(n)), Some(_)) => Ok(n == 1),
                (Ok(reply), None) => Ok(reply != Value::Nil),
                (Ok(other), Some(_)) => Err(unexpected("the extension script", &other)),
                (Err(err), Some(script)) if is_script_acl_failure(&err) => {
                    Err(script_noperm(script, &err))
                }
                (Err(err), _) => Err(err),
            })
            .collect())
    }

    /// The value under `key` and its remaining time to live, read atomically.
    pub(crate) async fn owner_and_ttl(
        &self,
        key: &[u8],
    ) -> Result<(Option<Vec<u8>>, i64), RedisError> {
        let mut pipe = redis::pipe();
        pipe.atomic().cmd("GET").arg(key).cmd("PTTL").arg(key);
        self.repair().await;
        self.watch_if_reconnecting();
        let mut manager = self.manager();
        let outcome = unwind_to_error(pipe.query_async::<(Option<Vec<u8>>, i64)>(&mut manager))
            .await
            .map_err(first_queued_error);
        self.after_driver_panic(&outcome);
        self.forget_on_failure(&outcome);
        outcome
    }
}

/// The error of the first command a transaction refused to queue (a `NOPERM`, say) in place of
/// the `EXECABORT` that hides it.
fn first_queued_error(err: RedisError) -> RedisError {
    if err.kind() != ErrorKind::Server(ServerErrorKind::ExecAbort) {
        return err;
    }
    let first = err
        .clone()
        .into_server_errors()
        .and_then(|errors| errors.first().map(|(_, first)| first.clone()));
    match first {
        Some(first) => RedisError::from(first),
        None => err,
    }
}

/// A reply of a pipeline that ignores errors, with an error answer as the error it is.
fn as_result(reply: Value) -> Result<Value, RedisError> {
    match reply {
        Value::ServerError(err) => Err(RedisError::from(err)),
        reply => Ok(reply),
    }
}

fn unexpected(what: &str, reply: &Value) -> RedisError {
    RedisError::from((
        ErrorKind::UnexpectedReturnType,
        "unexpected reply",
        format!("{what} answered {reply:?}"),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn script_hashes_are_sha1_of_the_code() {
        let s = Script::new(RELEASE_LUA, &["get", "del"]);
        assert_eq!(s.sha.len(), 40);
        assert_eq!(s.sha, redis::Script::new(RELEASE_LUA).get_hash());
    }

    #[test]
    fn error_classes() {
        let unknown = redis::make_extension_error("ERR".into(), None);
        assert!(!is_unknown_command(&unknown));
        let io = RedisError::from(std::io::Error::new(
            std::io::ErrorKind::ConnectionReset,
            "reset",
        ));
        assert!(!is_server_answer(&io));
        assert!(!is_unknown_command(&io) && !is_syntax_error(&io));
    }

    #[test]
    fn refused_commands() {
        assert_eq!(
            refused_command("User u has no permissions to run the 'delex' command"),
            Some("delex")
        );
        assert_eq!(
            refused_command("this user has no permissions to run the 'config|get' command"),
            Some("config|get")
        );
        assert_eq!(refused_command("No permissions to access a key"), None);
        let script = Script::new(RELEASE_LUA, &["get", "del"]);
        let old = redis::make_extension_error(
            "ERR".into(),
            Some("The user executing the script can't run this command or subcommand".into()),
        );
        let err = script_noperm(&script, &old);
        assert_eq!(err.code(), Some("NOPERM"));
        assert!(err.detail().unwrap().contains("`get`, `del`"), "{err}");
    }

    fn answer(kind: ServerErrorKind, code: &'static str, detail: &str) -> RedisError {
        RedisError::from((ErrorKind::Server(kind), code, detail.to_owned()))
    }

    fn err(detail: &str) -> RedisError {
        answer(ServerErrorKind::ResponseError, "ERR", detail)
    }

    #[test]
    fn server_answers_are_told_apart() {
        let unknown = err("unknown command 'DELEX', with args beginning with: ");
        assert!(is_unknown_command(&unknown));
        assert!(is_unknown_command(&err("  Unknown Command 'X'")));
        assert!(!is_unknown_command(&err("syntax error")));
        assert!(!is_arity_error(&unknown) && !is_syntax_error(&unknown));

        let arity = err("wrong number of arguments for 'delex' command");
        assert!(is_arity_error(&arity));
        assert!(is_arity_error(&err("ERR Wrong Number Of Arguments")));
        assert!(!is_unknown_command(&arity) && !is_syntax_error(&arity));

        let syntax = err("syntax error");
        assert!(is_syntax_error(&syntax));
        assert!(is_syntax_error(&err(" Syntax error, try again")));
        assert!(!is_arity_error(&syntax));

        // The same words from something other than a plain error answer count for nothing.
        let noperm = answer(
            ServerErrorKind::NoPerm,
            "NOPERM",
            "unknown command wrong number of arguments syntax error",
        );
        assert!(!is_unknown_command(&noperm));
        assert!(!is_arity_error(&noperm));
        assert!(!is_syntax_error(&noperm));
        assert!(!is_script_acl_failure(&answer(
            ServerErrorKind::NoPerm,
            "NOPERM",
            "ACL failure in script",
        )));
        let io = RedisError::from(std::io::Error::new(
            std::io::ErrorKind::ConnectionReset,
            "reset",
        ));
        assert!(!is_arity_error(&io) && !is_script_acl_failure(&io));

        assert!(is_server_answer(&syntax));
        assert!(is_server_answer(&noperm));
        assert!(is_server_answer(&redis::make_extension_error(
            "WEIRD".into(),
            None
        )));
    }

    #[test]
    fn script_acl_failures_become_noperm_naming_the_commands() {
        let script = Script::new(ACQUIRE_FENCED_LUA, &["set", "incr"]);
        let named = err(
            "ACL failure in script: User u has no permissions to run the 'incr' command script: abc",
        );
        assert!(is_script_acl_failure(&named));
        let noperm = script_noperm(&script, &named);
        assert_eq!(noperm.kind(), ErrorKind::Server(ServerErrorKind::NoPerm));
        let detail = noperm.detail().unwrap();
        assert!(
            detail.contains("(in a script, which runs `set`, `incr`)"),
            "{detail}"
        );
        let unnamed = err("The user executing the script can't run this command or subcommand");
        assert!(is_script_acl_failure(&unnamed));
        let detail = script_noperm(&script, &unnamed)
            .detail()
            .unwrap()
            .to_owned();
        assert!(
            detail.contains("(the server does not say which; the script runs `set`, `incr`)"),
            "{detail}"
        );
        assert!(!is_script_acl_failure(&err("unknown command")));
        assert_eq!(refused_command("to run the 'x' commander"), Some("x"));
        assert_eq!(refused_command("to run the 'x' verb"), None);
        assert_eq!(refused_command("to run the 'x"), None);
    }

    #[test]
    fn what_an_unknown_command_answer_quotes_must_be_text() {
        assert!(quoted_args_are_text(&[b"dlock:{k}", b"IFEQ", b"0123abcd"]));
        assert!(quoted_args_are_text(&["dlock:{é}".as_bytes(), b"tok"]));
        assert!(!quoted_args_are_text(&[b"k", b"IFEQ", &[0xff, 0x00]]));
        assert!(!quoted_args_are_text(&[&[0xc3], b"tok"]));
        // A key of 128 bytes or more fills the quote: the token is never shown.
        let long = vec![b'a'; 130];
        assert!(quoted_args_are_text(&[&long, b"IFEQ", &[0xff]]));
        // A cut inside a character is not text; at a character boundary it is.
        let mut cut = vec![b'a'; 127];
        cut.extend_from_slice("é".as_bytes());
        assert!(!quoted_args_are_text(&[&cut, b"t"]));
        let mut whole = vec![b'a'; 126];
        whole.extend_from_slice("é".as_bytes());
        assert!(quoted_args_are_text(&[&whole, &[0xff]]));
        // The second argument's room is what the first left: `'k' ` is 4 bytes.
        let mut second = vec![b'b'; 123];
        second.extend_from_slice("é".as_bytes());
        assert!(!quoted_args_are_text(&[b"k", &second]));
    }

    #[test]
    fn leases_are_whole_milliseconds_of_at_least_one() {
        assert_eq!(millis(Duration::from_micros(10)), 1);
        assert_eq!(millis(Duration::from_millis(1500)), 1500);
        assert_eq!(millis(Duration::MAX), u64::MAX);
    }

    #[test]
    fn a_refused_transaction_reports_its_first_refusal() {
        let plain = err("syntax error");
        assert_eq!(first_queued_error(plain).detail(), Some("syntax error"));
        let unexpected = unexpected("the release script", &Value::Okay);
        assert_eq!(unexpected.kind(), ErrorKind::UnexpectedReturnType);
        assert!(
            unexpected
                .detail()
                .unwrap()
                .starts_with("the release script answered"),
            "{unexpected}"
        );
    }

    #[test]
    fn scripts_name_what_they_run() {
        let scripts = Scripts::new();
        assert_eq!(scripts.acquire_fenced.code, ACQUIRE_FENCED_LUA);
        assert_eq!(scripts.acquire_fenced.commands, ["set", "incr"]);
        assert_eq!(scripts.acquire_counted.code, ACQUIRE_COUNTED_LUA);
        assert_eq!(scripts.acquire_counted.commands, ["get", "set", "incr"]);
        assert_eq!(scripts.join_counters.commands, ["get", "set"]);
        assert_eq!(scripts.release.code, RELEASE_LUA);
        assert_eq!(scripts.release.commands, ["get", "del"]);
        assert_eq!(scripts.extend.code, EXTEND_LUA);
        assert_eq!(scripts.extend.commands, ["get", "pexpire"]);
        assert_eq!(
            scripts.extend.sha,
            redis::Script::new(EXTEND_LUA).get_hash()
        );
    }

    #[test]
    fn a_suspect_flag_is_set_when_dropped_unless_disarmed() {
        let flag = Arc::new(AtomicBool::new(false));
        SuspectOnDrop(Some(Arc::clone(&flag))).disarm();
        assert!(!flag.load(Ordering::SeqCst));
        drop(SuspectOnDrop(Some(Arc::clone(&flag))));
        assert!(flag.load(Ordering::SeqCst));
    }
}

#[cfg(test)]
pub(super) mod live_tests;
