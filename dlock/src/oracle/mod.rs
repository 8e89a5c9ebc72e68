//! Oracle: `DBMS_LOCK` user locks on a few multiplexed sessions, native waits, and
//! transaction-bound locks.
//!
//! # Lock ids
//!
//! A key is locked as the `DBMS_LOCK` user lock with the integer id [`dbms_lock_id`]: the low
//! 30 bits of [`lock_id(key)`](crate::lock_id), a number in `0..=1073741823`, the range Oracle
//! leaves to applications (ids from 1073741824 up belong to `DBMS_LOCK.ALLOCATE_UNIQUE`).
//!
//! The scheme was chosen over `ALLOCATE_UNIQUE` (which maps a name of up to 128 characters to a
//! handle) because `ALLOCATE_UNIQUE` **commits the caller's transaction**, writes a row to
//! `SYS.DBMS_LOCK_ALLOCATED`, and costs a round trip per new name: it would break the
//! transaction-bound locks, which must not commit the caller's work, and it would slow every
//! first acquisition. Integer ids cost nothing, work the same in session and transaction scope,
//! and any client can compute them (SHA-256 of the UTF-8 key, first 8 bytes little-endian,
//! low 30 bits).
//!
//! The price is a 2^30 id space: two distinct keys share an id with probability 2^-30 per pair,
//! so among `n` keys in use at once the chance that any two collide is about `n² / 2^31`
//! (1 000 keys: 0.05 %; 10 000 keys: 4.5 %). A collision never lets two holders in: the two keys
//! merely exclude each other (one waits for, or is refused by, the other). On one session a
//! second key with the same id is refused as contention (`DBMS_LOCK.REQUEST` returns 4,
//! "already own"), so releasing one of them can never release the other. If your fleet locks
//! many thousands of keys at once and false contention matters, prefer PostgreSQL or SQL
//! Server, whose lock names are 64-bit ids or full digests.
//!
//! # Connections
//!
//! As for [SQL Server](crate::mssql): `connections` lock sessions (default 4) take every try
//! (`timeout => 0`) and hold the locks so taken; at most `wait_connections` sessions (default 4)
//! run native waits and keep the lock a wait got until release. `DBMS_LOCK.REQUEST` takes its
//! timeout in whole seconds: a wait asks the server for the whole seconds of its timeout, then
//! tries with short pauses through the fraction left and once more at the deadline, so
//! timeouts are kept to the millisecond (a wait shorter than a second is a few tries). The
//! `oracle` crate is blocking: every call runs on Tokio's blocking thread pool
//! (`spawn_blocking`), one call at a time per session.
//!
//! A wait that is abandoned (timeout, cancellation token, dropped future) is interrupted with
//! `OCIBreak` and its session is closed, which releases anything it was granted meanwhile.
//!
//! ```no_run
//! use std::time::Duration;
//!
//! # async fn demo() -> Result<(), dlock::LockError> {
//! let locks = dlock::LockProvider::connect("oracle://app:secret@db.internal:1521/FREEPDB1").await?;
//! let guard = locks.acquire("invoices:42", Duration::from_secs(10)).await?;
//! guard.release().await?;
//! # Ok(()) }
//! ```
//!
//! # Return codes and errors
//!
//! | `DBMS_LOCK.REQUEST` returns | meaning | answer |
//! |---|---|---|
//! | 0 | success | the lock |
//! | 1 | timeout | [`LockError::AlreadyHeld`] for a try, [`LockError::Timeout`] for a wait |
//! | 2 | deadlock | [`LockError::Backend`], `db_code` `"DBMS_LOCK 2"` |
//! | 3 | parameter error | [`LockError::Backend`], `db_code` `"DBMS_LOCK 3"` |
//! | 4 | already own the lock | contention ([`LockError::AlreadyHeld`] / [`LockError::Timeout`]) |
//! | 5 | illegal lock handle | [`LockError::Backend`], `db_code` `"DBMS_LOCK 5"` |
//!
//! `DBMS_LOCK.RELEASE` returns 0 (released), 3 (parameter error), 4 (not owned: already gone,
//! not an error) or 5 (illegal handle).
//!
//! - No Oracle client library (`DPI-1047`): [`LockError::Config`] saying to install Oracle
//!   Instant Client and how it is found (below).
//! - No `EXECUTE` privilege on `DBMS_LOCK` (`PLS-00201`, `ORA-06550`, `ORA-01031`):
//!   [`LockError::Backend`] naming the grant: `GRANT EXECUTE ON SYS.DBMS_LOCK TO <user>`.
//! - Other server errors: [`LockError::Backend`] with `db_code` `"ORA-nnnnn"`; unreachable
//!   servers and dead sessions: [`LockError::Unavailable`].
//!
//! # Oracle client library
//!
//! The `oracle` crate builds without any Oracle software, and loads the Oracle client library
//! (`libclntsh.so` on Linux, `libclntsh.dylib` on macOS, `oci.dll` on Windows) when the first
//! connection opens. Install Oracle Instant Client (the Basic or Basic Light package) and make
//! it findable: on Linux put its directory in `LD_LIBRARY_PATH` or register it with `ldconfig`;
//! on macOS put it in `~/lib` or `/usr/local/lib`; on Windows add it to `PATH`.
//!
//! # Lost locks
//!
//! Every session that holds locks runs `SELECT 1 FROM DUAL` every `keepalive` (default 5 s),
//! answered within 2 s. When a session dies, the
//! [`lost_token`](crate::LockGuard::lost_token) of every guard on it is cancelled; Oracle
//! frees a session's user locks when the session ends.
//!
//! # Fencing tokens
//!
//! Opt-in (`fencing=true`, or [`OracleBuilder::fencing`]); without it
//! [`fencing_token`](crate::LockGuard::fencing_token) is `None`. The backend keeps one counter
//! row per lock id in the table `dlock_fencing (id NUMBER(10) PRIMARY KEY, token NUMBER(19))`
//! (created if missing), and increments and commits it in the same PL/SQL block as the
//! `DBMS_LOCK.REQUEST` that takes the lock, only when the lock is granted, so an acquisition
//! costs one round trip either way, tries and waits alike (a wait's token is taken after the
//! grant, on the session that holds the lock; the lock survives the commit, being requested
//! with `release_on_commit => FALSE`). Should the increment fail, the block rolls it back and
//! gives the lock back before it reports the error: no lock is kept without its token. Tokens
//! increase strictly for each key across holders, processes and server restarts. Two keys
//! that share a lock id (see above) share its counter, which still increases for each of
//! them. Every process that locks a key must use the same table: `DBMS_LOCK` ids are the
//! instance's, while the table is the connecting user's, so other users share the lock but
//! count its tokens apart, not ordered with each other. Transaction-bound locks issue
//! no token.
//!
//! # Read locks
//!
//! [`try_acquire_read`](crate::LockProvider::try_acquire_read) and
//! [`acquire_read`](crate::LockProvider::acquire_read) request the key's lock id with
//! `DBMS_LOCK.REQUEST(lockmode => DBMS_LOCK.S_MODE)` (given back with `DBMS_LOCK.RELEASE`, as
//! the exclusive lock): readers share the key and exclude its exclusive lock (`X_MODE`), and
//! the other way round. A session that holds a lock id answers "already own" (4) to a second
//! request of it, so the readers of one backend that land on one lock connection share its
//! one shared lock, given back when the last of them leaves; a read try goes to a lock
//! connection that does not hold the key yet while there is one. With fencing, a read lock
//! takes its token from the key's counter in the same block, so a writer's token exceeds every
//! token issued before it.
//!
//! **Writers are not starved:** Oracle queues the waiters of a lock in the order they arrive,
//! and a request that conflicts with a waiter ahead of it waits behind it, so readers that ask
//! while a writer waits follow the writer. In one backend, a waiting writer also holds back
//! later readers of the same backend. This ordering is the server's; it has not been checked
//! against a live server here (see `docs/backends.md`). Transaction-bound locks have no read
//! form.
//!
//! # Semaphores
//!
//! The backend keeps semaphores itself ([`LockBackend::semaphores`](crate::backend::LockBackend::semaphores)):
//! a permit is a session `DBMS_LOCK` lock, like a lock, and a try is **one PL/SQL block**.
//!
//! - **Lock ids.** The semaphore `key` takes the base `b` = [`dbms_lock_id`]`("dlock\0permits\0"
//!   + key)`, and its locks are `lock_of(x) = (b + x × 2654435761) mod 2^30`, distinct for
//!   every `x` of one semaphore: slots `x` = 0 to `n - 1` (`X_MODE`), the count record
//!   `x` = 1024 to 1034 (`S_MODE`, one per bit of `n`), the gate `x` = 1100.
//! - **The count record.** Oracle lists locks only to a user with `SELECT` on `V$LOCK`, so each
//!   session that holds permits holds the record's bits in shared mode, and a try reads them
//!   with a no-wait `X_MODE` request on each (given back at once when it was free). Another
//!   count is refused with [`LockError::Config`] naming both, taking nothing. `DBMS_LOCK` counts
//!   no re-entries: a session gives the bits back with its last permit of the semaphore.
//! - **One try.** Holding the gate (so tries of one semaphore run one at a time), the block
//!   reads the record; unless it names another count, or (for a single try) a session holds
//!   the semaphore's queue lock
//!   ([`PermitRequest::queue_key`](crate::backend::PermitRequest::queue_key)), it walks the
//!   slots from a random one on with no-wait requests (a slot this session holds answers 4,
//!   "already own", and is passed over) and takes the first free one with the record's bits.
//! - **Bound.** The server cannot count the held slots, so a try that finds the semaphore
//!   full has asked for every slot: `max_count` is at most **1,024**, and a larger one is a
//!   [`LockError::Config`] naming the bound.
//! - **Release, loss, fencing.** A release gives back the slot (and, with the session's last
//!   permit of the semaphore, the record's bits). A permit ends with its session and is
//!   reported lost with it. With `fencing=true`, the semaphore's counter (`dlock_fencing` row
//!   `lock_of(1100)`) is incremented and committed in the block, under the gate. Lock ids are
//!   30-bit, as the locks' are: two semaphores' locks collide with the odds the lock ids do
//!   (see above), which makes them exclude each other, never admit more.
//!
//! The blocks are pinned by the unit tests and run by `tests/oracle.rs` against the server of
//! `DLOCK_ORACLE_URL`. A block that fails after it may have taken a slot drops its session.
//!
//! # URL
//!
//! `oracle://user:password@host:port/service_name` (port 1521 by default; user and password
//! percent-decoded), connected as the Easy Connect string `//host:port/service_name` over TCP.
//! For TLS (TCPS) with a wallet, use [`OracleBackend::builder`] with an Easy Connect Plus string
//! (Oracle Client 19c and later) such as
//! `tcps://db.internal:2484/app?wallet_location=/etc/oracle/wallet&ssl_server_dn_match=on`, or
//! a `tnsnames.ora` alias whose `sqlnet.ora` names the wallet. The account needs
//! `CREATE SESSION` and `EXECUTE` on `SYS.DBMS_LOCK`, nothing else; with fencing, also
//! `SELECT`, `INSERT` and `UPDATE` on the fencing table (the backend creates it when it is
//! missing, which needs `CREATE TABLE` and a quota on a tablespace; a user that may neither
//! see nor create it gets a [`LockError::Config`] with the statements to run when the backend
//! opens). (From Oracle's
//! documentation; not verified here, see `docs/production.md`.) Options:
//!
//! | option | default | meaning |
//! |---|---|---|
//! | `fencing` | `false` | issue fencing tokens (see above) |
//! | `keepalive` | `5s` | liveness check cadence of sessions that hold locks |
//! | `connections` | `4` | lock sessions (1 to 64) |
//! | `wait_connections` | `4` | sessions for native waits (0 to 64) |
//! | `connect_timeout` | `10s` | how long opening a session may take |
//! | `statement_timeout` | `10s` | the most one short statement (a try, a release) may take before its connection is dropped and its locks reported lost (10 ms to 365 days) |
//!
//! # Transaction-bound locks
//!
//! [`try_acquire_in_transaction`] and [`acquire_in_transaction`] call `DBMS_LOCK.REQUEST` with
//! `release_on_commit => TRUE` on the caller's own [`oracle::Connection`]: the lock ends with
//! the caller's next commit or rollback. They are blocking, like the `oracle` crate: call them
//! where you use that connection (inside `spawn_blocking` in async code).

mod session;
mod statements;
mod url;

use std::time::{Duration, Instant};

use crate::LockError;
use crate::backend::BoxFuture;
use crate::session::{
    Dial, Driver, Opened, SessionBackend, SessionBuilder, SessionOptions, contention,
};
use session::{OracleConnector, OracleTarget, map_error, run_call};
pub use statements::dbms_lock_id;
use statements::{Grant, MAXWAIT_SECS, NAME, Scope, request_call, request_result};

pub use crate::TransactionLock;

/// The `oracle` driver this module is built against, for the transaction-bound functions'
/// `Connection`.
pub use ::oracle as driver;

/// The Oracle engine: the type parameter of [`OracleBackend`] and [`OracleBuilder`].
#[derive(Debug, Clone, Copy)]
pub enum Oracle {}

/// The Oracle backend. Made by [`LockProvider::connect`](crate::LockProvider::connect) with an
/// `oracle://` URL, or by [`OracleBackend::builder`]. See the [module docs](self).
pub type OracleBackend = SessionBackend<Oracle>;

/// Builds an [`OracleBackend`] with options.
pub type OracleBuilder = SessionBuilder<Oracle>;

impl Driver for Oracle {
    const BACKEND: &'static str = "OracleBackend";
    const BUILDER: &'static str = "OracleBuilder";

    type Target = OracleTarget;
    type Connector = OracleConnector;

    fn parse_url(url: &str) -> Result<(OracleTarget, SessionOptions), LockError> {
        url::parse_url(url)
    }

    fn open(target: OracleTarget, options: &SessionOptions) -> BoxFuture<'static, Opened<Self>> {
        let connector = OracleConnector {
            dial: Dial::new(target, options),
            gate_wait: options.statement_timeout,
        };
        let refused = crate::session::refuse_fencing_counters(NAME, options);
        Box::pin(async move {
            refused?;
            let first = crate::session::Connector::open(&connector).await?;
            if connector.dial.fencing {
                first.create_fencing_table().await?;
            }
            Ok((connector, first))
        })
    }

    fn fmt_target(target: &OracleTarget, f: &mut std::fmt::DebugStruct<'_, '_>) {
        f.field("user", &target.user)
            .field("connect_string", &target.connect_string);
    }
}

impl SessionBackend<Oracle> {
    /// A builder for `user` / `password` at `connect_string` (an Easy Connect string such as
    /// `//db.internal:1521/FREEPDB1`, or a TNS alias).
    pub fn builder(
        user: impl Into<String>,
        password: impl Into<String>,
        connect_string: impl Into<String>,
    ) -> OracleBuilder {
        SessionBuilder::new(OracleTarget {
            user: user.into(),
            password: password.into(),
            connect_string: connect_string.into(),
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Transaction-bound locks (blocking).

/// One attempt to lock `key` until the caller's next commit or rollback on `conn`
/// (`DBMS_LOCK.REQUEST` with `timeout => 0`, `release_on_commit => TRUE`). Blocking.
///
/// Returns [`LockError::AlreadyHeld`] when the key (or a key sharing its id) is held
/// elsewhere, or already by this session.
///
/// ```no_run
/// # fn demo(conn: &oracle::Connection) -> Result<(), Box<dyn std::error::Error>> {
/// dlock::oracle::try_acquire_in_transaction(conn, "invoices:42")?;
/// conn.execute("UPDATE invoices SET paid = 1 WHERE id = 42", &[])?;
/// conn.commit()?; // releases the lock
/// # Ok(()) }
/// ```
pub fn try_acquire_in_transaction(
    conn: &oracle::Connection,
    key: &str,
) -> Result<TransactionLock, LockError> {
    crate::transaction::observe_blocking(NAME, key, Duration::ZERO, || {
        lock_in_transaction(conn, key, Duration::ZERO)
    })
}

/// Locks `key` until the caller's next commit or rollback on `conn`, waiting up to `timeout`
/// (whole seconds on the server, the fraction left as a sleep and a last try; `Duration::MAX`
/// waits without limit). Returns
/// [`LockError::Timeout`] when it stays held elsewhere ([`LockError::AlreadyHeld`] for a zero
/// timeout). Blocking.
pub fn acquire_in_transaction(
    conn: &oracle::Connection,
    key: &str,
    timeout: Duration,
) -> Result<TransactionLock, LockError> {
    crate::transaction::observe_blocking(NAME, key, timeout, || {
        lock_in_transaction(conn, key, timeout)
    })
}

fn lock_in_transaction(
    conn: &oracle::Connection,
    key: &str,
    timeout: Duration,
) -> Result<TransactionLock, LockError> {
    crate::key::validate_key(key)?;
    let id = dbms_lock_id(key);
    let deadline = crate::time::deadline(Instant::now(), timeout);
    loop {
        // Whole seconds wait on the server (split below MAXWAIT so they end at the deadline);
        // a fraction of a second left is slept here, followed by one last try.
        let (secs, last) = match deadline {
            None => (MAXWAIT_SECS, false),
            Some(deadline) => {
                let left = deadline.saturating_duration_since(Instant::now());
                let whole = i64::try_from(left.as_secs())
                    .unwrap_or(MAXWAIT_SECS)
                    .min(MAXWAIT_SECS - 1);
                if whole == 0 {
                    std::thread::sleep(left);
                }
                (whole, whole == 0)
            }
        };
        let call = request_call(id, Scope::Transaction, secs);
        let code = run_call(conn, &call)
            .map_err(|err| map_error("taking a transaction-bound lock", &err).error)?;
        match request_result(code)? {
            Grant::Granted => return Ok(TransactionLock::new(NAME, key, None)),
            // 4: this session already owns the id (the same key, or one sharing its id).
            Grant::NotGranted if last || code == Some(4) => return Err(contention(key, timeout)),
            Grant::NotGranted => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contention_errors() {
        assert!(matches!(
            contention("k", Duration::ZERO),
            LockError::AlreadyHeld { .. }
        ));
        assert!(matches!(
            contention("k", Duration::from_secs(1)),
            LockError::Timeout { .. }
        ));
    }
}
