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
//! [`PgPool`] the application already has, so it never takes connections out of that pool):
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
//! short statements (a try, an unlock) is in flight, that statement is given up after 10 s,
//! and the connection's locks are reported lost then.
//!
//! [`LockGuard::release`]: crate::LockGuard::release
//!
//! # Fencing tokens
//!
//! Opt-in (`fencing=true`, or [`PostgresBuilder::fencing`]): the backend keeps one counter row
//! per lock id in the table `dlock_fencing (id bigint primary key, token bigint)` (created if
//! missing) and increments it in the same statement that takes the lock, so an acquisition
//! costs one round trip either way. Tokens increase strictly for each key across holders,
//! processes and server restarts (the row is an ordinary committed row).
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
//! The driver speaks TLS with rustls and ring. Verify the server: `sslmode=verify-full` with
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
//! | `keepalive` | `5s` | liveness check cadence of connections that hold locks |
//! | `connections` | `4` | lock connections (1 to 64) |
//! | `wait_connections` | `4` | connections for native waits (0 to 64) |
//! | `connect_timeout` | `10s` | how long opening a connection may take |
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

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgConnection, PgPool};
use sqlx::{Connection, Row};

use crate::backend::BoxFuture;
use crate::key::validate_key;
use crate::options::{query_pairs, unknown_option};
use crate::session::{
    Connector, Failure, Grant, LaneOptions, Lanes, SETTLE_LIMIT, Session, lane_backend,
};
use crate::{LockError, lock_id};

const NAME: &str = "postgres";

/// Query options the driver reads (it would ignore any other silently, so a typo would go
/// unnoticed: they are refused instead).
const DRIVER_OPTIONS: &[&str] = &[
    "sslmode",
    "ssl-mode",
    "sslrootcert",
    "ssl-root-cert",
    "ssl-ca",
    "sslcert",
    "ssl-cert",
    "sslkey",
    "ssl-key",
    "statement-cache-capacity",
    "host",
    "hostaddr",
    "port",
    "dbname",
    "user",
    "password",
    "application_name",
    "options",
];

/// Session settings of lock and wait connections: no server-side timeouts that could cut a
/// wait short or drop an idle session that holds locks. Settings the server does not know
/// (older versions) are skipped.
const SESSION_SQL: &str = "SELECT count(set_config(name, '0', false)) FROM pg_settings \
    WHERE name IN ('statement_timeout', 'idle_session_timeout', 'idle_in_transaction_session_timeout')";

/// `$1` lock id. Returns whether the lock was taken.
const TRY_SQL: &str = "SELECT pg_try_advisory_lock($1)";

/// `$1` lock id. Takes the lock and, only if it was taken, increments its fencing counter in
/// the same statement.
const TRY_FENCED_SQL: &str = "WITH l AS (SELECT pg_try_advisory_lock($1) AS got), \
    f AS (INSERT INTO dlock_fencing (id, token) SELECT $1, 1 FROM l WHERE l.got \
          ON CONFLICT (id) DO UPDATE SET token = dlock_fencing.token + 1 RETURNING token) \
    SELECT l.got, (SELECT token FROM f) FROM l";

/// `$1` lock id. Waits (under the session's `lock_timeout`).
const WAIT_SQL: &str = "SELECT pg_advisory_lock($1)";

/// `$1` lock id. Waits, then increments the fencing counter in the same statement.
const WAIT_FENCED_SQL: &str = "WITH l AS (SELECT pg_advisory_lock($1)) \
    INSERT INTO dlock_fencing (id, token) SELECT $1, 1 FROM l \
    ON CONFLICT (id) DO UPDATE SET token = dlock_fencing.token + 1 RETURNING token";

/// `$1` lock id. Increments the fencing counter of a lock this session already holds.
const FENCE_SQL: &str = "INSERT INTO dlock_fencing (id, token) VALUES ($1, 1) \
    ON CONFLICT (id) DO UPDATE SET token = dlock_fencing.token + 1 RETURNING token";

const UNLOCK_SQL: &str = "SELECT pg_advisory_unlock($1)";

/// `$1` lock id. Whether this session holds the lock (session or transaction level).
const HELD_SQL: &str = "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' \
    AND pid = pg_backend_pid() AND granted AND objsubid = 1 \
    AND ((classid::bigint << 32) | objid::bigint) = $1)";

const FENCING_TABLE_SQL: &str =
    "CREATE TABLE IF NOT EXISTS dlock_fencing (id bigint PRIMARY KEY, token bigint NOT NULL)";

/// Whether this role sees the fencing table (on its search path), and may `SELECT`, `INSERT`
/// and `UPDATE` it. Asked before [`FENCING_TABLE_SQL`], which needs `CREATE` on the schema even
/// when the table exists: a role with just the table's grants could not open the backend.
const FENCING_TABLE_CHECK_SQL: &str = "SELECT to_regclass('dlock_fencing') IS NOT NULL, \
    COALESCE(has_table_privilege(to_regclass('dlock_fencing'), 'SELECT') \
    AND has_table_privilege(to_regclass('dlock_fencing'), 'INSERT') \
    AND has_table_privilege(to_regclass('dlock_fencing'), 'UPDATE'), false)";

/// What an administrator runs for a role that may not create the fencing table.
const FENCING_GRANTS: &str = "CREATE TABLE dlock_fencing (id bigint PRIMARY KEY, token bigint NOT NULL); \
    GRANT USAGE ON SCHEMA <schema> TO <role>; GRANT SELECT, INSERT, UPDATE ON dlock_fencing TO <role>";

/// `$1` pid, `$2` backend start time (text) of a wait connection: cancels its statement.
const CANCEL_SQL: &str = "SELECT pg_cancel_backend(pid) FROM pg_stat_activity \
    WHERE pid = $1 AND backend_start::text = $2";

/// `$1` pid, `$2` backend start time (text) of a wait connection: whether that session (if it
/// still exists) neither waits for nor holds any advisory lock.
const SETTLED_SQL: &str = "SELECT NOT EXISTS (SELECT 1 FROM pg_locks l \
    JOIN pg_stat_activity a ON a.pid = l.pid \
    WHERE l.pid = $1 AND a.backend_start::text = $2 AND l.locktype = 'advisory')";

/// Process id and start time of this session, which identify it for [`CANCEL_SQL`]. Also
/// has the server look for a vanished client once a second while a statement runs
/// (`client_connection_check_interval`, PostgreSQL 14 and later; skipped where unknown), so a
/// wait whose cancel arrived before the wait began still ends soon after its connection is
/// dropped, instead of at its `lock_timeout`.
const IDENTITY_SQL: &str = "SELECT pid, backend_start::text, \
    (SELECT count(set_config(name, '1000', false)) FROM pg_settings \
     WHERE name = 'client_connection_check_interval') \
    FROM pg_stat_activity WHERE pid = pg_backend_pid()";

const SET_LOCK_TIMEOUT_SQL: &str = "SELECT set_config('lock_timeout', $1, false)";

/// The PostgreSQL backend. Made by [`LockProvider::connect`](crate::LockProvider::connect)
/// with a `postgres://` URL, by [`PostgresBackend::new`] from an existing pool, or by
/// [`PostgresBackend::builder`]. See the [module docs](self) for how it uses connections.
#[derive(Clone)]
pub struct PostgresBackend {
    lanes: Arc<Lanes<PgConnector>>,
}

/// Builds a [`PostgresBackend`] with options.
#[derive(Clone)]
#[must_use]
pub struct PostgresBuilder {
    options: PgConnectOptions,
    lane: LaneOptions,
}

impl std::fmt::Debug for PostgresBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The connect options carry the password: show only where they point.
        f.debug_struct("PostgresBuilder")
            .field("host", &self.options.get_host())
            .field("port", &self.options.get_port())
            .field("options", &self.lane)
            .finish()
    }
}

impl PostgresBuilder {
    crate::session::lane_builder_options!();

    /// Opens the first lock connection (so a wrong address or password is reported here) and
    /// starts the backend; the other connections open when they are first needed. Creates the
    /// fencing table when fencing is on. Must run inside a Tokio runtime.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: dropping the future closes the connection it was opening.
    pub async fn open(self) -> Result<PostgresBackend, LockError> {
        self.check()?;
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(LockError::config(
                "the PostgreSQL backend must be opened inside a Tokio runtime",
            ));
        }
        let connector = PgConnector {
            options: self.options,
            fencing: self.lane.fencing,
            connect_timeout: self.lane.connect_timeout,
        };
        let mut first = connector.open_session().await?;
        if self.lane.fencing {
            create_fencing_table(&mut first.conn).await?;
        }
        Ok(PostgresBackend {
            lanes: Arc::new(Lanes::start(connector, self.lane.settings, first)?),
        })
    }

    fn check(&self) -> Result<(), LockError> {
        self.lane.check()
    }
}

impl PostgresBackend {
    /// A builder that connects with `options`.
    pub fn builder(options: PgConnectOptions) -> PostgresBuilder {
        PostgresBuilder {
            options,
            lane: LaneOptions::default(),
        }
    }

    /// A builder that connects like `pool` does (same server, user, password, TLS and
    /// options). The backend opens its own connections and never takes any from the pool.
    pub fn builder_from_pool(pool: &PgPool) -> PostgresBuilder {
        PostgresBackend::builder((*pool.connect_options()).clone())
    }

    /// A backend with the default settings that connects like `pool` does.
    ///
    /// ```no_run
    /// # async fn demo(pool: sqlx::PgPool) -> Result<(), dlock::LockError> {
    /// let backend = dlock::postgres::PostgresBackend::new(pool.clone()).await?;
    /// let locks = dlock::LockProvider::from_backend(backend);
    /// # Ok(()) }
    /// ```
    ///
    /// # Cancel safety
    ///
    /// Cancel safe, as [`PostgresBuilder::open`].
    pub async fn new(pool: PgPool) -> Result<PostgresBackend, LockError> {
        PostgresBackend::builder_from_pool(&pool).open().await
    }

    /// Parses a `postgres://` URL with the options of the [module docs](self) into a builder,
    /// without connecting.
    pub fn builder_from_url(url: &str) -> Result<PostgresBuilder, LockError> {
        parse_url(url)
    }

    /// Connects with a `postgres://` URL.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe, as [`PostgresBuilder::open`].
    pub async fn connect(url: &str) -> Result<PostgresBackend, LockError> {
        parse_url(url)?.open().await
    }

    crate::session::lane_backend_options!();
}

impl std::fmt::Debug for PostgresBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let connector = self.lanes.connector();
        f.debug_struct("PostgresBackend")
            .field("host", &connector.options.get_host())
            .field("port", &connector.options.get_port())
            .field("fencing", &connector.fencing)
            .field("lanes", &self.lanes)
            .finish()
    }
}

lane_backend!(PostgresBackend, NAME);

// ---------------------------------------------------------------------------------------------
// Sessions: what the shared connection machinery runs on a PostgreSQL connection.

/// Opens lock and wait connections.
struct PgConnector {
    options: PgConnectOptions,
    fencing: bool,
    connect_timeout: Duration,
}

impl PgConnector {
    async fn open_session(&self) -> Result<PgSession, LockError> {
        let mut conn = open_connection(&self.options, self.connect_timeout).await?;
        let (pid, started, _): (i32, String, i64) = sqlx::query_as(IDENTITY_SQL)
            .fetch_one(&mut conn)
            .await
            .map_err(|e| pg_error("opening a connection", e))?;
        Ok(PgSession {
            conn,
            fencing: self.fencing,
            identity: PgCancel { pid, started },
        })
    }
}

impl Connector for PgConnector {
    /// The advisory lock id.
    type Resource = i64;
    type Session = PgSession;

    const NAME: &'static str = NAME;
    /// The longest `lock_timeout` the server takes.
    const MAX_WAIT: Duration = Duration::from_millis(i32::MAX as u64);
    const PING_TIMEOUT: Duration = Duration::from_secs(1);
    const WAIT_GRACE: Duration = Duration::from_secs(1);

    fn wait_resolution(&self) -> Duration {
        Duration::from_millis(1)
    }

    fn resource(&self, key: &str) -> i64 {
        lock_id(key)
    }

    fn open(&self) -> BoxFuture<'_, Result<PgSession, LockError>> {
        Box::pin(self.open_session())
    }
}

/// One connection, with the identity that [`CANCEL_SQL`] aims at.
struct PgSession {
    conn: PgConnection,
    fencing: bool,
    identity: PgCancel,
}

/// `pg_cancel_backend` for an abandoned wait on another connection, identified by its process
/// id and start time (so a reused process id is never hit).
struct PgCancel {
    pid: i32,
    started: String,
}

impl PgSession {
    /// One try; the fencing token is issued in the same statement.
    async fn try_lock(&mut self, id: i64) -> Result<Option<Grant>, sqlx::Error> {
        if self.fencing {
            let row = sqlx::query(TRY_FENCED_SQL)
                .bind(id)
                .fetch_one(&mut self.conn)
                .await?;
            let got: bool = row.try_get(0)?;
            let token: Option<i64> = row.try_get(1)?;
            Ok(got.then(|| Grant {
                token: token.and_then(|t| u64::try_from(t).ok()),
            }))
        } else {
            let got: bool = sqlx::query_scalar(TRY_SQL)
                .bind(id)
                .fetch_one(&mut self.conn)
                .await?;
            Ok(got.then_some(Grant::PLAIN))
        }
    }

    /// A native wait under `lock_timeout`. If the timeout (or a cancel) fires at the moment
    /// the lock is granted, `pg_locks` decides.
    async fn wait_lock(&mut self, id: i64, wait: Duration) -> Result<Option<Grant>, sqlx::Error> {
        sqlx::query(SET_LOCK_TIMEOUT_SQL)
            .bind(lock_timeout_setting(wait))
            .execute(&mut self.conn)
            .await?;
        let waited = if self.fencing {
            sqlx::query_scalar::<_, i64>(WAIT_FENCED_SQL)
                .bind(id)
                .fetch_one(&mut self.conn)
                .await
                .map(|token| u64::try_from(token).ok())
        } else {
            sqlx::query(WAIT_SQL)
                .bind(id)
                .execute(&mut self.conn)
                .await
                .map(|_| None)
        };
        match waited {
            Ok(token) => Ok(Some(Grant { token })),
            Err(err) if is_wait_ended(&err) => {
                let held: bool = sqlx::query_scalar(HELD_SQL)
                    .bind(id)
                    .fetch_one(&mut self.conn)
                    .await?;
                if !held {
                    return Ok(None);
                }
                let token = if self.fencing {
                    let token: i64 = sqlx::query_scalar(FENCE_SQL)
                        .bind(id)
                        .fetch_one(&mut self.conn)
                        .await?;
                    u64::try_from(token).ok()
                } else {
                    None
                };
                Ok(Some(Grant { token }))
            }
            Err(err) => Err(err),
        }
    }
}

impl PgSession {
    /// Cancels another session's abandoned wait, then watches the server until that session
    /// neither waits for nor holds an advisory lock. The cancel only asks, and a wait granted
    /// just before it holds its lock until the server sees the dropped connection; the
    /// acquisition's claim is kept until then, so a later acquisition of the key through the
    /// same backend never finds it held by a session that is going away.
    async fn cancel_and_settle(&mut self, cancel: &PgCancel) -> Result<(), sqlx::Error> {
        sqlx::query(CANCEL_SQL)
            .bind(cancel.pid)
            .bind(&cancel.started)
            .execute(&mut self.conn)
            .await?;
        let mut pause = Duration::from_millis(1);
        loop {
            let settled: bool = sqlx::query_scalar(SETTLED_SQL)
                .bind(cancel.pid)
                .bind(&cancel.started)
                .fetch_one(&mut self.conn)
                .await?;
            if settled {
                return Ok(());
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_millis(20));
        }
    }
}

impl Session for PgSession {
    type Resource = i64;
    type Interrupt = PgCancel;

    fn lock<'a>(
        &'a mut self,
        id: &'a i64,
        wait: Duration,
    ) -> BoxFuture<'a, Result<Option<Grant>, Failure>> {
        Box::pin(async move {
            let (what, outcome) = if wait.is_zero() {
                ("taking a lock", self.try_lock(*id).await)
            } else {
                ("waiting for a lock", self.wait_lock(*id, wait).await)
            };
            match outcome {
                Ok(grant) => Ok(grant),
                Err(err) if !is_connection_error(&err) => {
                    // The statement failed (say, the fencing table is missing) after the lock
                    // may have been taken: give it back. The unlock cannot end another
                    // acquisition's hold on this session: the backend's claims admit one
                    // acquisition per lock id at a time, however many providers share it.
                    let error = pg_error(what, err);
                    match sqlx::query(UNLOCK_SQL)
                        .bind(*id)
                        .execute(&mut self.conn)
                        .await
                    {
                        Ok(_) => Err(Failure::statement(error)),
                        Err(_) => Err(Failure::connection(error)),
                    }
                }
                Err(err) => Err(Failure::connection(pg_error(what, err))),
            }
        })
    }

    fn unlock<'a>(&'a mut self, id: &'a i64) -> BoxFuture<'a, Result<(), Failure>> {
        Box::pin(async move {
            sqlx::query_scalar::<_, bool>(UNLOCK_SQL)
                .bind(*id)
                .fetch_one(&mut self.conn)
                .await
                .map(drop)
                .map_err(|err| Failure::connection(pg_error("releasing a lock", err)))
        })
    }

    fn ping(&mut self) -> BoxFuture<'_, Result<(), Failure>> {
        Box::pin(async move {
            self.conn
                .ping()
                .await
                .map_err(|err| Failure::connection(pg_error("checking a connection", err)))
        })
    }

    fn interrupt(&self, _id: &i64) -> Option<PgCancel> {
        Some(PgCancel {
            pid: self.identity.pid,
            started: self.identity.started.clone(),
        })
    }

    fn run_interrupt(&mut self, cancel: PgCancel) -> BoxFuture<'_, Result<(), Failure>> {
        Box::pin(async move {
            let what = "cancelling an abandoned wait";
            let settled = tokio::time::timeout(SETTLE_LIMIT, self.cancel_and_settle(&cancel));
            match settled.await {
                Ok(Ok(())) => Ok(()),
                Ok(Err(err)) if !is_connection_error(&err) => {
                    Err(Failure::statement(pg_error(what, err)))
                }
                Ok(Err(err)) => Err(Failure::connection(pg_error(what, err))),
                Err(_) => {
                    tracing::warn!(
                        backend = NAME,
                        "an abandoned wait's session still waits for or holds its lock after {SETTLE_LIMIT:?}"
                    );
                    Ok(())
                }
            }
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Transaction-bound locks.

/// A lock held until the end of the caller's transaction; see the [module docs](self).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TransactionLock {
    id: i64,
}

impl TransactionLock {
    /// The advisory lock id that is held ([`lock_id`] of the key).
    pub fn lock_id(&self) -> i64 {
        self.id
    }
}

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
    validate_key(key)?;
    let id = lock_id(key);
    let got: bool = sqlx::query_scalar("SELECT pg_try_advisory_xact_lock($1)")
        .bind(id)
        .fetch_one(&mut *conn)
        .await
        .map_err(|e| pg_error("taking a transaction lock", e))?;
    if got {
        Ok(TransactionLock { id })
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
    validate_key(key)?;
    if timeout.is_zero() {
        return try_acquire_in_transaction(conn, key).await;
    }
    let id = lock_id(key);
    let err = |e| pg_error("taking a transaction lock", e);
    let previous: (String, String) = sqlx::query_as(
        "SELECT current_setting('lock_timeout'), current_setting('statement_timeout')",
    )
    .fetch_one(&mut *conn)
    .await
    .map_err(err)?;
    match sqlx::query("SAVEPOINT dlock_wait")
        .execute(&mut *conn)
        .await
    {
        Ok(_) => {}
        Err(e) if db_code(&e).as_deref() == Some("25P01") => {
            return Err(LockError::config(
                "acquire_in_transaction needs an open transaction: pass `&mut *tx` of a transaction begun with `begin()`",
            ));
        }
        Err(e) => return Err(err(e)),
    }
    let waited = async {
        // The caller's statement_timeout must not cut the wait short: lock_timeout bounds it.
        sqlx::query(
            "SELECT set_config('lock_timeout', $1, true), set_config('statement_timeout', '0', true)",
        )
        .bind(lock_timeout_setting(timeout))
        .execute(&mut *conn)
        .await?;
        sqlx::query("SELECT pg_advisory_xact_lock($1)")
            .bind(id)
            .execute(&mut *conn)
            .await
    }
    .await;
    match waited {
        Ok(_) => {
            sqlx::query(
                "SELECT set_config('lock_timeout', $1, true), set_config('statement_timeout', $2, true)",
            )
            .bind(&previous.0)
            .bind(&previous.1)
            .execute(&mut *conn)
                .await
                .map_err(err)?;
            sqlx::query("RELEASE SAVEPOINT dlock_wait")
                .execute(&mut *conn)
                .await
                .map_err(err)?;
            Ok(TransactionLock { id })
        }
        Err(e) => {
            // Undo the savepoint (and with it the wait's lock_timeout).
            sqlx::query("ROLLBACK TO SAVEPOINT dlock_wait")
                .execute(&mut *conn)
                .await
                .map_err(err)?;
            sqlx::query("RELEASE SAVEPOINT dlock_wait")
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
                Ok(TransactionLock { id })
            } else {
                Err(LockError::Timeout {
                    key: Arc::from(key),
                    timeout,
                })
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Helpers.

/// `lock_timeout` for a wait of `timeout`: whole milliseconds, rounded up; `0` (no limit) for
/// waits too long for the setting.
fn lock_timeout_setting(timeout: Duration) -> String {
    let ms = timeout.as_nanos().div_ceil(1_000_000).max(1);
    if ms > i32::MAX as u128 {
        "0".to_owned()
    } else {
        format!("{ms}ms")
    }
}

async fn open_connection(
    options: &PgConnectOptions,
    timeout: Duration,
) -> Result<PgConnection, LockError> {
    let connect = async {
        let mut conn = PgConnection::connect_with(options).await?;
        sqlx::query(SESSION_SQL).execute(&mut conn).await?;
        Ok::<_, sqlx::Error>(conn)
    };
    match tokio::time::timeout(timeout, connect).await {
        Ok(result) => result.map_err(|e| pg_error("connecting", e)),
        Err(_) => Err(LockError::unavailable(
            NAME,
            format!("connecting to the server took longer than {timeout:?} (connect_timeout)"),
            None,
        )),
    }
}

/// Makes sure the fencing table is there and usable: a table this role sees needs only its
/// three privileges (never `CREATE` on the schema); a missing one is created.
async fn create_fencing_table(conn: &mut PgConnection) -> Result<(), LockError> {
    let (exists, usable): (bool, bool) = sqlx::query_as(FENCING_TABLE_CHECK_SQL)
        .fetch_one(&mut *conn)
        .await
        .map_err(|e| pg_error("looking for the fencing table dlock_fencing", e))?;
    if exists {
        return if usable {
            Ok(())
        } else {
            Err(LockError::config(format!(
                "fencing=true: this role lacks a privilege the table dlock_fencing needs \
                 (all three of select, insert and update); an administrator grants them: \
                 {FENCING_GRANTS}"
            )))
        };
    }
    match sqlx::query(FENCING_TABLE_SQL).execute(&mut *conn).await {
        Ok(_) => Ok(()),
        // Another process created it at the same moment.
        Err(e) if matches!(db_code(&e).as_deref(), Some("23505" | "42P07")) => Ok(()),
        // No `CREATE` on the schema (nor `USAGE`, if the table is there but out of sight), or
        // no schema on the search path this role may use at all.
        Err(e) if matches!(db_code(&e).as_deref(), Some("42501" | "3F000")) => {
            Err(LockError::config(format!(
                "fencing=true needs the table dlock_fencing, which this role does not see and \
             may not create ({}); an administrator creates it and grants it: {FENCING_GRANTS}",
                match &e {
                    sqlx::Error::Database(db) => db.message().to_owned(),
                    other => other.to_string(),
                }
            )))
        }
        Err(e) => Err(pg_error("creating the fencing table dlock_fencing", e)),
    }
}

fn db_code(err: &sqlx::Error) -> Option<String> {
    match err {
        sqlx::Error::Database(db) => db.code().map(|c| c.into_owned()),
        _ => None,
    }
}

/// Whether a wait ended without error of its own: `lock_timeout` (55P03) or a cancel (57014).
fn is_wait_ended(err: &sqlx::Error) -> bool {
    matches!(db_code(err).as_deref(), Some("55P03" | "57014"))
}

/// Whether `err` means the connection can no longer be trusted.
fn is_connection_error(err: &sqlx::Error) -> bool {
    match err {
        sqlx::Error::Database(db) => db.code().is_some_and(|code| {
            code.starts_with("08") || code.starts_with("57P") || code == "53300"
        }),
        _ => true,
    }
}

/// Maps a driver error; messages name what was being done, never the URL.
fn pg_error(what: &str, err: sqlx::Error) -> LockError {
    if crate::tls::is_tls_refused_by_server(&err) {
        return LockError::config(format!(
            "{what}: TLS: the server does not offer TLS, and the URL's `sslmode` requires it; \
             nothing was sent in clear (turn `ssl` on at the server)"
        ));
    }
    if let Some(failure) = crate::tls::describe(&err, "sslrootcert") {
        return failure.into_error(NAME, what, Box::new(err));
    }
    let code = db_code(&err);
    match &err {
        sqlx::Error::Database(db) => {
            let message = db.message().to_owned();
            match code.as_deref() {
                // pg_hba.conf has no line for this client without TLS.
                Some("28000") if message.ends_with("no encryption") => LockError::config(format!(
                    "{what}: the server accepts this client only over TLS ({message}); connect with sslmode=verify-full and sslrootcert"
                )),
                Some("28P01" | "28000") => LockError::config(format!(
                    "{what}: the server refused the credentials ({message}); check the user name and password in the URL"
                )),
                Some("3D000") => LockError::config(format!(
                    "{what}: {message}; check the database name in the URL"
                )),
                Some(c) if c.starts_with("08") || c.starts_with("57P") || c == "53300" => {
                    LockError::unavailable(NAME, format!("{what}: {message}"), Some(Box::new(err)))
                }
                _ => LockError::backend(
                    NAME,
                    format!("{what}: {message}"),
                    code,
                    Some(Box::new(err)),
                ),
            }
        }
        sqlx::Error::Configuration(_) => {
            LockError::config(format!("{what}: invalid connection settings: {err}"))
        }
        sqlx::Error::Io(io) => LockError::unavailable(
            NAME,
            format!("{what}: cannot reach the server: {io}"),
            Some(Box::new(err)),
        ),
        sqlx::Error::Tls(_)
        | sqlx::Error::Protocol(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => LockError::unavailable(
            NAME,
            format!("{what}: the connection failed: {err}"),
            Some(Box::new(err)),
        ),
        _ => LockError::backend(NAME, format!("{what}: {err}"), code, Some(Box::new(err))),
    }
}

fn parse_url(url: &str) -> Result<PostgresBuilder, LockError> {
    let (base, query) = url.split_once('?').unwrap_or((url, ""));
    let mut passthrough = Vec::new();
    let mut lane = LaneOptions::default();
    let mut named = false;
    for (name, value) in query_pairs(query) {
        if lane.parse(&name, &value)? {
            continue;
        }
        match name.as_str() {
            other if DRIVER_OPTIONS.contains(&other) || other.starts_with("options[") => {
                if other == "application_name" {
                    named = true;
                }
                passthrough.push((name, value));
            }
            other => {
                let valid: Vec<&str> = LaneOptions::NAMES
                    .iter()
                    .chain(DRIVER_OPTIONS)
                    .copied()
                    .collect();
                return Err(unknown_option(NAME, other, &valid));
            }
        }
    }
    let mut driver_url = base.to_owned();
    if !passthrough.is_empty() {
        let encoded: String = url::form_urlencoded::Serializer::new(String::new())
            .extend_pairs(passthrough.iter())
            .finish();
        driver_url.push('?');
        driver_url.push_str(&encoded);
    }
    let mut options = PgConnectOptions::from_str(&driver_url).map_err(|e| {
        // The driver's message is about the URL's shape; it does not repeat the URL.
        LockError::config(format!(
            "the postgres:// URL is not valid ({e}); write it like postgres://user:password@host:5432/database (options: {})",
            LaneOptions::NAMES.join(", ")
        ))
    })?;
    if !named {
        options = options.application_name("dlock");
    }
    let builder = PostgresBuilder { options, lane };
    builder.check()?;
    Ok(builder)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lock_timeouts() {
        assert_eq!(lock_timeout_setting(Duration::from_millis(400)), "400ms");
        assert_eq!(lock_timeout_setting(Duration::from_micros(1)), "1ms");
        assert_eq!(lock_timeout_setting(Duration::from_micros(1500)), "2ms");
        assert_eq!(lock_timeout_setting(Duration::MAX), "0");
    }

    #[test]
    fn urls() {
        let b = parse_url("postgres://u:secret@127.0.0.1:5/db?fencing=true&keepalive=250ms&connections=2&wait_connections=0&sslmode=disable").unwrap();
        assert!(b.lane.fencing);
        assert_eq!(b.lane.settings.keepalive, Duration::from_millis(250));
        assert_eq!(
            (
                b.lane.settings.connections,
                b.lane.settings.wait_connections
            ),
            (2, 0)
        );
        assert_eq!(b.options.get_port(), 5);
        assert_eq!(b.options.get_application_name(), Some("dlock"));
        assert!(!format!("{b:?}").contains("secret"));
        for bad in [
            "postgres://h/db?fencing=maybe",
            "postgres://h/db?keepalive=soon",
            "postgres://h/db?connections=0",
            "postgres://h/db?connections=100",
            "postgres://h/db?keepalive=1ms",
            "postgres://h/db?fencng=true",
            "postgres://h:notaport/db",
        ] {
            let err = parse_url(bad).unwrap_err();
            assert_eq!(err.code(), "DistributedLock.Configuration", "{bad}: {err}");
        }
    }
}
