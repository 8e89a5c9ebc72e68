//! The session engine: what the session-lock backends (PostgreSQL, MySQL, SQL Server,
//! Oracle) share: a few multiplexed lock connections ("lanes"), a bounded set of connections for
//! native waits, and liveness checks that cancel the lost token of every lock on a connection
//! that dies.
//!
//! Every engine is one [`SessionBackend`], configured by one [`SessionBuilder`]: the options
//! (`keepalive`, `connections`, `wait_connections`, `connect_timeout`, `statement_timeout`,
//! and `fencing`) have one set of defaults, setters, URL names and checks. An engine
//! plugs in with a connector (opens sessions, maps keys to resources), a session (one server
//! connection: lock, unlock, ping, interrupt) and a driver (its connect target, its URL, its
//! first session). Nothing here knows SQL.
//!
//! | file | what it holds |
//! |---|---|
//! | `backend.rs` | [`SessionBackend`], [`SessionBuilder`] |
//! | `traits.rs` | what an engine implements; [`Engine`] |
//! | `options.rs` | the options, their defaults, URL names and checks |
//! | `acquire.rs` | how an acquisition runs: a try on a lane, then a wait or polling |
//! | `claims.rs` | the in-process claim every acquisition takes first |
//! | `lane.rs` | the lanes: lock connections, each one session behind an async mutex, run on the caller's task |
//! | `wait.rs` | native waits on their own sessions, and the idle wait sessions |
//!
//! - **Lanes** (`connections` of them) each own one session behind an async mutex. They run
//!   the tries (a lock statement with a zero wait) on the caller's own task and keep the locks
//!   so taken; a try or release whose caller leaves half-way finishes on a task of its own, and
//!   a keeper task pings each lane session every keepalive. Statements run one at a time per
//!   lane, never wait on the server, and are each bounded by `statement_timeout`
//!   (default 10 s), as is the release of a lock a wait got.
//! - **Waits** run on their own sessions (at most `wait_connections` at once), because a
//!   server-side wait blocks its connection. A granted wait keeps its lock on that session
//!   until release; the session then goes back to an idle list for the next wait. When every
//!   wait session is busy, waits poll the lanes with backoff instead.
//! - A wait that is abandoned (timeout, cancel, dropped future) interrupts the server's
//!   statement (in the driver, or by a request that a lane runs from
//!   its own session) and always drops its session, which ends whatever the session may have
//!   been granted; an interrupted session is never reused.
//! - Sessions holding locks are pinged every `keepalive`; a failed ping, a failed statement
//!   or a statement that outlives its bound drops the session and cancels the lost token of
//!   every lock it held (the server frees a session's locks when the session ends).
//! - A grant may carry a fencing token issued in the same round trip.
//! - Every acquisition claims its resource in process first, so no two
//!   acquisitions of one backend ever ask the server for the same resource at once, however
//!   many providers share the backend. Servers let a session take a lock it holds again
//!   (PostgreSQL, MySQL and SQL Server count re-entries, Oracle answers "already own"), and
//!   every lane is one session that many acquisitions share: without the claim, two providers
//!   built on clones of one backend would both be granted a key on a shared lane. A waiting
//!   acquisition whose resource another acquisition of the backend holds waits for that claim
//!   to end (no server round trips), then for the server.
//! - **Read locks** use the engine's shared mode. Shared claims of a resource share it with
//!   each other, an exclusive claim excludes every claim and is excluded by them, so a
//!   session that the server would let re-enter in the other mode (shared, then exclusive)
//!   never is. An exclusive acquisition that waits for a claimed resource holds back later
//!   shared claims of it, so the readers of one backend cannot starve one of its writers. A
//!   lane holds a resource shared at most once: further readers that land on it join that
//!   hold (the last to leave gives it back), and a shared try goes to a lane that does not
//!   hold the resource yet while there is one, so the server answers it behind any writer
//!   queued there. Shared waits run on wait sessions of their own, where the server queues
//!   them. MySQL and MariaDB have no shared mode, and answer `Unsupported`.
//! - **Semaphores** (the backend's `PermitStore`): a permit is a slot lock held by a lane's
//!   session, kept and given back by its lane like a lock (it ends with the session, and its
//!   lost token fires with the session's). A try is one statement that the engine runs on the
//!   server: it checks the count record, answers full while any session holds the
//!   semaphore's queue lock (the waiting mark, for single tries), and takes the first free slot
//!   from a random one on, skipping the slots its session holds already, since the server would
//!   grant them again. Permits need no claim: no two handles of a lane ever hold one slot. A
//!   try that fails after it may have taken a slot drops its session. Engines whose server
//!   cannot count the held slots bound `max_count` (`Connector::MAX_PERMITS`).
//! - Every task that keeps locks alive (a lane, a wait task) cancels the lost token of each
//!   lock it keeps when it stops for any reason, its runtime being dropped included: its
//!   session, and with it the locks, end with it. A lane found stopped is started again on the
//!   runtime of the acquisition that finds it, so a backend keeps working when the runtime
//!   that opened it is gone.
//! - A session's socket is driven by the reactor of the runtime it was opened on: used from
//!   another runtime, each answer is read there and handed across threads, a wake-up that on
//!   an idle machine costs more than the round trip. An idle lane (holding nothing) used for
//!   `lane::REHOME_AFTER` tries in a row from one other runtime opens a fresh session there
//!   and drops the old one; a wait takes an idle wait session of its own runtime first.

mod acquire;
mod backend;
mod claims;
mod lane;
mod options;
mod traits;
mod wait;

#[cfg(test)]
mod model;

#[cfg(test)]
pub(crate) use backend::check_session_url;
pub use backend::{SessionBackend, SessionBuilder};
pub use traits::{Engine, Fencing};

#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) use claims::SETTLE_LIMIT;
#[cfg(test)]
pub(crate) use options::EngineKey;
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) use options::SessionKey;
#[cfg(any(feature = "mysql", feature = "mssql", feature = "oracle"))]
pub(crate) use options::refuse_fencing_counters;
pub(crate) use options::{SessionOptions, read_engine_query};
pub(crate) use traits::{
    Connector, Dial, Driver, Failure, Grant, Mode, Opened, PermitAnswer, PermitCount, Session,
};

/// The answer of a lock that stayed held elsewhere: [`LockError::AlreadyHeld`] for a try (a
/// zero timeout), [`LockError::Timeout`] for a wait.
#[cfg(any(feature = "mssql", feature = "oracle"))]
pub(crate) fn contention(key: &str, timeout: std::time::Duration) -> crate::LockError {
    if timeout.is_zero() {
        crate::LockError::AlreadyHeld { key: key.into() }
    } else {
        crate::LockError::Timeout {
            key: key.into(),
            timeout,
        }
    }
}
