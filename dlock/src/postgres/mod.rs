//! PostgreSQL: session advisory locks on a few multiplexed connections, native waits, and
//! transaction-bound locks.
//!
//! A key is locked as the advisory lock [`lock_id(key)`](crate::lock_id) (a `bigint`, the
//! single-key form of `pg_advisory_lock`), so every client that derives ids the same way, in
//! any language, locks the same thing. Two distinct keys share an id with probability 2^-64 per
//! pair; they would then exclude each other (never the reverse: one key always maps to one id).
//!
//! # Connections
//!
//! The backend opens its own connections (from the URL, or with the connect options of a
//! [`PgPool`](sqlx::PgPool) the application already has, so it never takes connections out of that pool):
//!
//! | connections | how many | what they do |
//! |---|---|---|
//! | lock connections | `connections` (default 4) | hold the session locks taken without waiting: `pg_try_advisory_lock`, and every `acquire` of a free key |
//! | wait connections | at most `wait_connections` (default 4) | run the server's blocking wait, `pg_advisory_lock` under `lock_timeout`; a wait that is granted keeps its lock on that connection until release |
//!
//! So one provider never has more than `connections + wait_connections` (8 by default) server
//! connections, however many locks it holds: ten thousand held locks share the four lock
//! connections. A lock connection runs one short statement at a time for all the locks pinned
//! to it, and never waits on the server, so a wait never delays the locks that share a
//! connection. When every wait connection is busy (waiting, or holding the lock its wait got),
//! further waits poll `pg_try_advisory_lock` on the lock connections with backoff and jitter
//! until one is free again. `wait_connections=0` makes every wait poll.
//!
//! Every acquisition claims its lock id in the backend before it asks the server, and keeps the
//! claim while it holds the lock; the claims are shared by every provider made from clones of
//! the backend. So the re-entrancy of session advisory locks (a session may take its own lock
//! again) can never let two tasks or two providers of one process in at once, even with one
//! lock connection.
//!
//! Lock and wait connections run with `statement_timeout`, `idle_session_timeout` and
//! `idle_in_transaction_session_timeout` turned off for their session (a pool's or role's
//! `statement_timeout` would otherwise cut waits short, and an idle timeout would drop held
//! locks); waits are bounded by `lock_timeout` instead.
//!
//! ```no_run
//! use std::time::Duration;
//!
//! # async fn demo() -> Result<(), dlock::LockError> {
//! let locks = dlock::LockProvider::connect(
//!     "postgres://app:secret@db.internal:5432/app?fencing=true&keepalive=2s",
//! )
//! .await?;
//! let guard = locks.acquire("invoices:42", Duration::from_secs(10)).await?;
//! let token = guard.fencing_token(); // Some(n) with fencing=true
//! # let _ = token;
//! guard.release().await?;
//! # Ok(()) }
//! ```
//!
//! # Waits and cancellation
//!
//! `acquire` first tries on a lock connection; only a key that is held elsewhere starts a
//! server-side wait, on a wait connection, with `lock_timeout` set to what is left of the
//! timeout. PostgreSQL queues the waiters of a key and grants the lock to one of them as soon
//! as it is free: no polling, no thundering herd. If the wait's `lock_timeout` fires at the
//! moment the lock is granted (SQLSTATE 55P03 with the lock in fact held), the backend looks
//! in `pg_locks` before it answers [`LockError::Timeout`], and keeps the lock if it has it.
//!
//! Dropping an acquisition is safe at every point. A try whose answer nobody reads is undone
//! on its lock connection (`pg_advisory_unlock`). A wait that is abandoned (timeout, cancel
//! token, dropped future) is cancelled on the server (`pg_cancel_backend`, aimed by process id
//! and session start time) and its connection is closed, which ends the lock if the server
//! granted it in the meantime; the connection is not reused, so a late cancel can never hit a
//! later statement. Until `pg_locks` shows that session neither waiting for nor holding an
//! advisory lock (at most 5 s), later acquisitions of the key through the same backend wait
//! for it, so a cancelled wait never makes the key look held for a moment after it ended.
//!
//! # Lost locks
//!
//! Every connection that holds locks is checked every `keepalive` (default 5 s) with a ping
//! that must answer within one second. When a connection dies (server restart,
//! `pg_terminate_backend`, a cut network), the [`lost_token`](crate::LockGuard::lost_token)
//! of every guard on it is cancelled within `keepalive` + 1 s, the connection is dropped
//! (the server frees a session's locks when it ends), and later acquisitions open fresh
//! connections. Releasing a lost lock is not an error of its own: [`LockGuard::release`]
//! reports the loss once, as [`LockError::Lost`].
//!
//! A lock connection checks itself between statements; if the network is cut while one of its
//! short statements (a try, an unlock) is in flight, that statement is given up after
//! `statement_timeout` (default 10 s), and the connection's locks are reported lost then.
//!
//! [`LockGuard::release`]: crate::LockGuard::release
//!
//! # Fencing tokens
//!
//! Opt-in (`fencing=true`, or [`PostgresBuilder::fencing`]): the backend keeps one counter row
//! per lock id in the table `dlock_fencing (id bigint primary key, token bigint)` (created if
//! missing) and increments it in the same statement that takes the lock, so an acquisition
//! costs one round trip either way. Tokens increase strictly for each key across holders,
//! processes and server restarts (the row is an ordinary committed row). Every process that
//! locks a key must reach the same table: advisory locks are the database's, while the table
//! is found on the role's `search_path`, so a role whose `search_path` finds another
//! `dlock_fencing` shares the lock but counts its tokens apart, not ordered with the others'.
//!
//! **Bounded counters.** One row per key ever locked grows the table without bound for a
//! service that locks per request. With `fencing_counters=N` (1 to 65,536;
//! [`PostgresBuilder::fencing_counters`]) the table holds at most `N` counter rows, ids `0` to
//! `N - 1`, plus the row `-9223372036854775808` recording their mode (`N << 16 | epoch`); the
//! key `k` increments row [`fencing_counter`](crate::fencing_counter)`(k, N)` (its lock id
//! modulo `N`), in the same statement, still one round trip. Tokens still increase strictly
//! per key; they are `epoch × 2^48 + count`. Opening a backend whose `N` is not the
//! recorded one switches the table (one transaction that locks the mode row): the counter
//! rows start the next epoch, so no token is lower than one issued before, and the backends
//! of the old `N` are refused ([`LockError::Config`], the lock given back) from then on,
//! since every increment checks its row's epoch (`ON CONFLICT DO UPDATE ... WHERE`, which sees
//! the latest committed row even after a wait). A backend with per-key counters refuses to
//! open on a switched table. Stop the per-key processes (and those of earlier versions)
//! before the first one with `fencing_counters` starts; see
//! [`fencing_counter`](crate::fencing_counter) for the rules. Once every process runs with
//! the same `N`, the old per-key rows are no longer read, and
//! `DELETE FROM dlock_fencing WHERE id >= N OR (id < 0 AND id <> -9223372036854775808)`
//! removes them (not while a process of an earlier `N` may still run: it would recreate its
//! rows in its old epoch). Counter and mode rows share the id space of lock ids (64-bit
//! hashes), as two keys' lock ids do.
//!
//! # Read locks
//!
//! [`try_acquire_read`](crate::LockProvider::try_acquire_read) and
//! [`acquire_read`](crate::LockProvider::acquire_read) take the key's advisory lock in
//! PostgreSQL's shared mode (`pg_try_advisory_lock_shared`, `pg_advisory_lock_shared` under
//! `lock_timeout`, `pg_advisory_unlock_shared`): readers share the key, across processes too,
//! and exclude its exclusive lock (and the other way round). Any client that takes the same id
//! with the same functions takes part.
//!
//! The readers of one backend that land on one lock connection share that connection's one
//! shared lock: the server sees it once, and it is given back when the last of them leaves. A
//! read try goes to a lock connection that does not hold the key shared yet while there is
//! one, so the server answers it. The claims keep a reader and a writer of one backend apart
//! although they may share a connection (a session holding the shared lock would be granted
//! the exclusive one too, and the reverse).
//!
//! **Writers are not starved.** PostgreSQL queues a request behind any waiter it conflicts
//! with: while a writer waits for a key that readers hold, a new reader's wait queues behind
//! the writer, and a new reader's try answers [`LockError::AlreadyHeld`] even though only
//! readers hold the key (`tests/postgres.rs` pins the server's answer). The writer gets the key
//! as soon as the readers before it have left. In one backend, a waiting writer also holds
//! back later readers of the same backend before they reach the server, and in one provider
//! the in-process table does. The one reader that passes a queued writer is one that joins a
//! shared lock its lock connection already holds (every lock connection holds the key: more
//! readers of one key at once than `connections`); it ends its read in its own time, and the
//! writer follows the readers who were there first.
//!
//! With fencing, a read lock taken on the server increments the key's counter as the
//! exclusive lock does, so a writer's token exceeds every token issued before it; readers that
//! join a connection's shared lock get that lock's token.
//!
//! Transaction-bound locks have no read form: [`try_acquire_in_transaction`] and
//! [`acquire_in_transaction`] take the exclusive lock.
//!
//! # Semaphores
//!
//! The backend keeps semaphores itself ([`LockBackend::semaphores`](crate::backend::LockBackend::semaphores)):
//! a permit is a session lock of a lock connection, like a lock, and a try is **one
//! statement, whatever the count** (1 to [`u32::MAX`]).
//!
//! - **Slots.** The semaphore `key` of `n` permits is the advisory locks of the two-key form
//!   `(class, 0)` to `(class, n - 1)` (`pg_advisory_lock(int4, int4)`; `objsubid` 2 in
//!   `pg_locks`, a space no lock key uses), where `class` is the high 32 bits of
//!   [`lock_id`](crate::lock_id())`("dlock\0permits\0" + key)`. Two semaphores whose classes
//!   collide (probability 2^-32 per pair) share their slots: they then admit fewer holders
//!   together, and refuse each other's count if it differs, never more holders.
//! - **The count record.** Each holder also holds `(class, n)` in shared mode: the record is in
//!   `pg_locks`, ends with the last holder's release or session, and needs no table.
//! - **One try.** The statement takes the semaphore's *gate*, the transaction-level advisory
//!   lock `pg_advisory_xact_lock(lock_id("dlock\0permits\0" + key))`, held until the
//!   statement ends, so tries of one semaphore run one at a time (a try of another count cannot
//!   slip in between the check and the grant). It reads `pg_locks` once: the live slots, a
//!   record of another count (then it answers [`LockError::Config`] naming both counts, taking
//!   nothing), the semaphore's queue lock (below), and the slots this session holds already.
//!   If fewer than `n` slots are live, it walks the slots from a random one on with
//!   `pg_try_advisory_lock`, skipping this session's own (the server would grant a session
//!   its own advisory lock again, and a lock connection is shared by every acquisition of
//!   the backend), and takes the first free one with its share of the record. Under the gate
//!   no other try takes a slot, so the walk meets a free slot within one step more than there
//!   are holders: the server's work grows with the holders, not with `n`, and nothing on the
//!   client grows with either.
//! - **Waiting.** A waiting acquisition queues on the semaphore's queue lock
//!   ([`PermitRequest::queue_key`](crate::backend::PermitRequest::queue_key), an ordinary
//!   advisory lock), through the server's FIFO lock waits. While any session holds it, a
//!   single try is answered as held even when a permit is free, so tries in a loop cannot take
//!   the permit the waiter at the head of the queue is polling for.
//! - **Release and loss.** A release gives back the slot, then the share of the record
//!   (`pg_advisory_unlock`, `pg_advisory_unlock_shared`). A permit ends with its connection,
//!   and is reported lost with it, as a lock.
//! - **Fencing.** With `fencing=true`, the semaphore's counter row (`id` = the gate's lock id)
//!   is incremented in the same statement, under the gate: tokens increase strictly per
//!   semaphore, in the order of the grants (with `fencing_counters=N`, its shared counter).
//! - **Inspection.** [`store_locks`](crate::LockProvider::store_locks) lists a semaphore as
//!   one entry, `semaphore <class> of <n>`, with its holders as readers.
//!
//! A statement that fails after it may have taken a slot drops its connection (session
//! advisory locks outlive a failed statement; the server frees them with the session), and
//! the connection's other locks are reported lost. Semaphores of earlier versions were slot
//! locks of the one-key form: see MIGRATION.md before a version with this store and one
//! without share a semaphore.
//!
//! # Permissions
//!
//! Advisory locks need no privilege beyond `CONNECT` on the database (the functions
//! `pg_advisory_lock` and friends, `pg_locks`, `pg_settings`, `pg_stat_activity` and
//! `pg_cancel_backend` of the role's own sessions are open to every role by default). With
//! fencing, the role needs the fencing table's three privileges, and `USAGE` on its schema:
//!
//! ```sql
//! CREATE ROLE dlock_app LOGIN PASSWORD '…';
//! GRANT CONNECT ON DATABASE app TO dlock_app;
//! -- with fencing=true, run in the database `app` once:
//! CREATE TABLE dlock_fencing (id bigint PRIMARY KEY, token bigint NOT NULL);
//! GRANT USAGE ON SCHEMA public TO dlock_app;
//! GRANT SELECT, INSERT, UPDATE ON dlock_fencing TO dlock_app;
//! ```
//!
//! A table the role sees is used as it is: the backend creates it only when it is missing, and
//! then needs `CREATE` on the schema. A role that may neither see nor create it gets a
//! [`LockError::Config`] with the statements above when the backend opens.
//! `tests/least_privilege.rs` runs the conformance suite as a role with `CONNECT` only and as
//! one with the fencing grants, in a database whose `PUBLIC` may do nothing.
//!
//! # TLS
//!
//! The driver speaks TLS with rustls and aws-lc-rs. Verify the server: `sslmode=verify-full` with
//! `sslrootcert=/path/ca.pem` (the CA that signed the server's certificate, trusted besides
//! the system's roots); `verify-ca` skips the host name, and `require` or the default `prefer`
//! check nothing. A refused certificate is a [`LockError::Config`] saying which check failed
//! (unknown issuer, a host name the certificate does not carry, expired). With `verify-full`
//! (or `require`, `verify-ca`) a server without TLS is refused, never used in clear; a server
//! that accepts this client only over TLS (`hostssl` in `pg_hba.conf`) refuses one without it,
//! and the error says so. Client certificates: `sslcert` and `sslkey`.
//!
//! # URL
//!
//! `postgres://user:password@host:port/database` (or `postgresql://`). The options below are
//! read by the backend; the driver's own options (`sslmode`, `sslrootcert`, `sslcert`,
//! `sslkey`, `application_name`, `options`, `statement-cache-capacity`, `host`, `port`,
//! `dbname`, `user`, `password`) go to it as usual, and any other option is refused (so a typo
//! does not pass unnoticed). Connections are named `application_name=dlock` unless the URL
//! names them.
//!
//! | option | default | meaning |
//! |---|---|---|
//! | `fencing` | `false` | issue fencing tokens (see above) |
//! | `fencing_counters` | one per key | with `fencing=true`: keep at most this many counter rows, 1 to 65536 (see above) |
//! | `keepalive` | `5s` | liveness check cadence of connections that hold locks |
//! | `connections` | `4` | lock connections (1 to 64) |
//! | `wait_connections` | `4` | connections for native waits (0 to 64) |
//! | `connect_timeout` | `10s` | how long opening a connection may take |
//! | `statement_timeout` | `10s` | the most one short statement (a try, a release) may take before its connection is dropped and its locks reported lost (10 ms to 365 days) |
//!
//! # Transaction-bound locks and PgBouncer
//!
//! [`try_acquire_in_transaction`] and [`acquire_in_transaction`] take `pg_try_advisory_xact_lock`
//! / `pg_advisory_xact_lock` inside the caller's open transaction (`&mut *tx` of a
//! `sqlx::Transaction`); the lock ends with the transaction's commit or rollback and uses no
//! connection of its own. Rules behind PgBouncer:
//!
//! - **session pooling**: everything works.
//! - **transaction pooling**: only the transaction-bound functions work (a session lock would
//!   stay with a server connection that PgBouncer hands to other clients). Point the
//!   [`LockProvider`](crate::LockProvider) at the server directly or at a session-mode pool.
//! - **statement pooling**: nothing works (no transactions); use a direct connection.
//!
//! The waiting form sets `lock_timeout` only for its own statement, inside a savepoint, and
//! restores the transaction's setting afterwards, so a timed-out wait leaves the transaction
//! usable (it answers [`LockError::Timeout`] and the caller may carry on or roll back).

mod session;
mod statements;
mod url;

use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgConnection};

use crate::backend::BoxFuture;
use crate::key::validate_key;
use crate::session::{Dial, Driver, Opened, SessionBackend, SessionBuilder, SessionOptions};
use crate::sqlx_engine::{SqlxEngine, db_code, driver_error};
use crate::{LockError, lock_id};
use session::{
    Counted, PgConnector, create_fencing_table, is_wait_ended, join_counters, refuse_if_switched,
};
use statements::*;

/// The PostgreSQL engine: the type parameter of [`PostgresBackend`] and [`PostgresBuilder`].
#[derive(Debug, Clone, Copy)]
pub enum Postgres {}

/// The PostgreSQL backend. Made by [`LockProvider::connect`](crate::LockProvider::connect)
/// with a `postgres://` URL, by [`PostgresBackend::new`] from an existing pool, or by
/// [`PostgresBackend::builder`]. See the [module docs](self) for how it uses connections.
pub type PostgresBackend = SessionBackend<Postgres>;

/// Builds a [`PostgresBackend`] with options.
pub type PostgresBuilder = SessionBuilder<Postgres>;

impl Driver for Postgres {
    const BACKEND: &'static str = "PostgresBackend";
    const BUILDER: &'static str = "PostgresBuilder";

    type Target = PgConnectOptions;
    type Connector = PgConnector;

    fn parse_url(url: &str) -> Result<(PgConnectOptions, SessionOptions), LockError> {
        url::parse_url(url)
    }

    fn open(
        options: PgConnectOptions,
        session: &SessionOptions,
    ) -> BoxFuture<'static, Opened<Self>> {
        let mut connector = PgConnector {
            dial: Dial::new(options, session),
            counted: None,
        };
        let counters = session.fencing_counters;
        Box::pin(async move {
            let mut first = connector.open_session().await?;
            if connector.dial.fencing {
                create_fencing_table(&mut first.conn).await?;
                match counters {
                    Some(n) => {
                        let base = join_counters(&mut first.conn, n).await?;
                        connector.counted = Some(Counted { n, base });
                        first.counted = connector.counted;
                    }
                    None => refuse_if_switched(&mut first.conn).await?,
                }
            }
            Ok((connector, first))
        })
    }

    fn fmt_target(options: &PgConnectOptions, f: &mut std::fmt::DebugStruct<'_, '_>) {
        // The connect options carry the password: show only where they point.
        f.field("host", &options.get_host())
            .field("port", &options.get_port());
    }
}

impl SqlxEngine for Postgres {
    type Database = sqlx::Postgres;
}

// ---------------------------------------------------------------------------------------------
// Transaction-bound locks.

pub use crate::TransactionLock;

/// Locks `key` until the transaction open on `conn` commits or rolls back; one try
/// (`pg_try_advisory_xact_lock`). Contention is [`LockError::AlreadyHeld`].
///
/// `conn` must be inside a transaction (pass `&mut *tx` for a `sqlx::Transaction`): outside
/// one, the lock would end with this very statement. Works behind PgBouncer in transaction
/// mode. Locks are re-entrant within one transaction, as PostgreSQL's are.
///
/// # Cancel safety
///
/// If the future is dropped before it completes, the lock may or may not have been taken;
/// either way it ends with the transaction, so roll the transaction back.
pub async fn try_acquire_in_transaction(
    conn: &mut PgConnection,
    key: &str,
) -> Result<TransactionLock, LockError> {
    crate::transaction::observe(NAME, key, Duration::ZERO, try_in_transaction(conn, key)).await
}

async fn try_in_transaction(
    conn: &mut PgConnection,
    key: &str,
) -> Result<TransactionLock, LockError> {
    validate_key(key)?;
    let id = lock_id(key);
    let got: bool = sqlx::query_scalar(TRY_XACT_SQL)
        .bind(id)
        .fetch_one(&mut *conn)
        .await
        .map_err(|e| driver_error::<Postgres>("taking a transaction lock", e))?;
    if got {
        Ok(TransactionLock::new(NAME, key, None))
    } else {
        Err(LockError::AlreadyHeld {
            key: Arc::from(key),
        })
    }
}

/// Locks `key` until the transaction open on `conn` commits or rolls back, waiting on the
/// server up to `timeout` (`pg_advisory_xact_lock` under a `lock_timeout` set for this
/// statement only). Errors with [`LockError::Timeout`] when it runs out; the transaction stays
/// usable (the wait runs in a savepoint). `Duration::ZERO` is one try.
///
/// `conn` must be inside a transaction (`&mut *tx`); outside one this answers
/// [`LockError::Config`]. Works behind PgBouncer in transaction mode.
///
/// # Cancel safety
///
/// If the future is dropped before it completes, the connection may be left inside the
/// savepoint with the wait's `lock_timeout`: roll the transaction back (which also ends the
/// lock, if it was granted).
pub async fn acquire_in_transaction(
    conn: &mut PgConnection,
    key: &str,
    timeout: Duration,
) -> Result<TransactionLock, LockError> {
    crate::transaction::observe(NAME, key, timeout, wait_in_transaction(conn, key, timeout)).await
}

async fn wait_in_transaction(
    conn: &mut PgConnection,
    key: &str,
    timeout: Duration,
) -> Result<TransactionLock, LockError> {
    validate_key(key)?;
    if timeout.is_zero() {
        return try_in_transaction(conn, key).await;
    }
    let id = lock_id(key);
    let err = |e| driver_error::<Postgres>("taking a transaction lock", e);
    let previous: (String, String) = sqlx::query_as(TIMEOUTS_SQL)
        .fetch_one(&mut *conn)
        .await
        .map_err(err)?;
    match sqlx::query(SAVEPOINT_SQL).execute(&mut *conn).await {
        Ok(_) => {}
        Err(e) if db_code::<Postgres>(&e).as_deref() == Some("25P01") => {
            return Err(LockError::config(
                "acquire_in_transaction needs an open transaction: pass `&mut *tx` of a transaction begun with `begin()`",
            ));
        }
        Err(e) => return Err(err(e)),
    }
    let waited = async {
        sqlx::query(SET_WAIT_TIMEOUTS_SQL)
            .bind(lock_timeout_setting(timeout))
            .execute(&mut *conn)
            .await?;
        sqlx::query(WAIT_XACT_SQL)
            .bind(id)
            .execute(&mut *conn)
            .await
    }
    .await;
    match waited {
        Ok(_) => {
            sqlx::query(RESTORE_TIMEOUTS_SQL)
                .bind(&previous.0)
                .bind(&previous.1)
                .execute(&mut *conn)
                .await
                .map_err(err)?;
            sqlx::query(RELEASE_SAVEPOINT_SQL)
                .execute(&mut *conn)
                .await
                .map_err(err)?;
            Ok(TransactionLock::new(NAME, key, None))
        }
        Err(e) => {
            // Undo the savepoint (and with it the wait's lock_timeout).
            sqlx::query(ROLLBACK_SAVEPOINT_SQL)
                .execute(&mut *conn)
                .await
                .map_err(err)?;
            sqlx::query(RELEASE_SAVEPOINT_SQL)
                .execute(&mut *conn)
                .await
                .map_err(err)?;
            if !is_wait_ended(&e) {
                return Err(err(e));
            }
            // The lock may have been granted just as the timeout fired: look before answering.
            let held: bool = sqlx::query_scalar(HELD_SQL)
                .bind(id)
                .fetch_one(&mut *conn)
                .await
                .map_err(err)?;
            if held {
                Ok(TransactionLock::new(NAME, key, None))
            } else {
                Err(LockError::Timeout {
                    key: Arc::from(key),
                    timeout,
                })
            }
        }
    }
}
