//! MySQL and MariaDB: `GET_LOCK` user locks on a few multiplexed connections, with native
//! waits.
//!
//! A key is locked as the server's named user lock ([`server_lock_name`] of the key), taken
//! with `GET_LOCK(name, timeout)` and given back with `RELEASE_LOCK(name)`. These locks belong
//! to the session that took them: the server frees them when that session ends (a closed
//! connection, `KILL`, a crash of the client process, a server restart), so a dead holder
//! never keeps a lock. Both engines let one session hold many user locks (MySQL 5.7 and later,
//! MariaDB 10.0.2 and later), which this backend needs.
//!
//! # Lock names
//!
//! The server limits user lock names to 64 characters, and MySQL compares them without regard
//! to case (MariaDB compares them exactly). Keys are any non-empty strings, so they are mapped
//! to names by one fixed, documented rule that never depends on case:
//!
//! | key | server lock name |
//! |---|---|
//! | 1 to 64 characters, each one of `a-z`, `0-9`, `_ - . : / @` | the key itself: `jobs:billing` locks `jobs:billing` |
//! | anything else (upper case, spaces, other characters, NUL, more than 64 characters) | up to 31 readable characters, then `#`, then 32 lowercase hex digits of SHA-256 of the key's UTF-8 bytes |
//!
//! The readable part of a hashed name is the key's first characters with `A-Z` lowered and
//! every character outside the set above dropped, at most 31 of them: `"Jobs"` locks
//! `jobs#…` (the hash of `"Jobs"`), and `"jobs"` locks `jobs`, two different locks. A `#` never
//! appears in a name kept as it is, and hashed names differ whenever their 128-bit hashes do,
//! so two keys share a server lock only if SHA-256 collides in its first 128 bits. The names
//! are pure ASCII and at most 64 bytes long, and other programs can compute them to take the
//! same locks. [`server_lock_name`] is public for that.
//!
//! # Connections
//!
//! The backend opens its own connections (from the URL, or with the connect options of a
//! [`MySqlPool`] the application already has; it never takes connections from that pool):
//!
//! | connections | how many | what they do |
//! |---|---|---|
//! | lock connections | `connections` (default 4) | hold the locks taken without waiting: `GET_LOCK(name, 0)` for tries and for every `acquire` of a free key |
//! | wait connections | at most `wait_connections` (default 4) | run the server's blocking wait, `GET_LOCK(name, seconds)`; a granted wait keeps its lock on that connection until release |
//!
//! One provider never has more than `connections + wait_connections` (8 by default) server
//! connections, however many locks it holds. A lock connection runs one short statement at a
//! time and never waits on the server, so a wait never delays the locks that share a
//! connection. When every wait connection is busy, further waits poll `GET_LOCK(name, 0)` on
//! the lock connections with backoff and jitter. `wait_connections=0` makes every wait poll.
//!
//! Sessions re-enter their own user locks on the server; the backend claims each name in
//! process before it asks the server (one claim table for every provider made from clones of
//! the backend), so one backend never asks the server for a name it already holds.
//!
//! Lock and wait connections set `wait_timeout` to its maximum and turn off the statement time
//! limit (`max_execution_time` on MySQL, `max_statement_time` on MariaDB) for their session, so
//! neither an idle timeout nor a server-wide statement limit ends a held lock or a wait.
//!
//! # Waits
//!
//! `acquire` first tries on a lock connection; only a key held elsewhere starts a wait on a
//! wait connection. MariaDB takes fractional seconds in `GET_LOCK`, so the wait is exactly
//! what is left of the timeout. MySQL counts the wait in whole seconds: the backend waits the
//! whole seconds natively, then tries with `GET_LOCK(name, 0)` with short pauses until the
//! deadline and once at it, so a timeout is neither cut short nor overslept by a second.
//! Waits without limit ([`Duration::MAX`]) are native waits of an hour each, repeated.
//!
//! The server refuses a wait that would close a cycle of sessions waiting for each other's
//! user locks (MySQL error 3058, MariaDB error 1213). This backend's waits never close one:
//! a wait runs on a session that holds nothing while it waits. When dlock holders and another
//! client that holds several user locks wait for each other in a lock-order inversion, the
//! server refuses the other client's wait, and dlock's wait ends with its own timeout
//! ([`LockError::Timeout`]) while its held locks stay held. (Should a server ever refuse one of
//! this backend's waits that way, it is answered with a [`LockError::Backend`] whose
//! [`db_code`](LockError::db_code) is the error number, never a hang.)
//!
//! Dropping an acquisition is safe at every point. A try whose answer nobody reads is undone
//! on its lock connection (`RELEASE_LOCK`). A wait that is abandoned (timeout, cancel token,
//! dropped future) is ended with `KILL` of its connection (aimed by `CONNECTION_ID()`), which
//! also frees the lock if the server granted it in the meantime; the backend then watches
//! `IS_USED_LOCK(name)` until that session is gone, and its own later acquisitions of the
//! name wait for that.
//!
//! # Lost locks
//!
//! Every connection that holds locks is pinged every `keepalive` (default 5 s); a ping must
//! answer within one second. When a connection dies (`KILL`, server restart, a cut network),
//! the [`lost_token`](crate::LockGuard::lost_token) of every guard on it is cancelled within
//! `keepalive` + 1 s, and later acquisitions open fresh connections.
//!
//! # Fencing tokens
//!
//! Opt-in (`fencing=true`, or [`MySqlBuilder::fencing`]). The backend keeps one counter row per
//! lock name in the table `dlock_fencing` of the URL's database (created if missing), and
//! after a lock is taken, increments it with one statement,
//! `INSERT … VALUES (name, LAST_INSERT_ID(1)) ON DUPLICATE KEY UPDATE token = LAST_INSERT_ID(token + 1)`,
//! whose answer carries the new value. Tokens increase strictly for each key across holders,
//! processes and server restarts. Fencing needs a database in the URL.
//!
//! # Permissions
//!
//! `GET_LOCK`, `RELEASE_LOCK`, `IS_USED_LOCK` and `CONNECTION_ID()` need no privilege, and
//! `KILL` of a session of one's own user needs none either (the backend kills only its own
//! wait connections, never another user's session). Without fencing a user with no privilege
//! at all (`USAGE`) suffices; leave the database out of the URL then (a database in the URL
//! needs some privilege on it). With fencing, the user needs the counter table's three
//! privileges:
//!
//! ```sql
//! CREATE USER 'dlock_app'@'%' IDENTIFIED BY '…' REQUIRE SSL;
//! -- with fencing=true, once:
//! CREATE TABLE app.dlock_fencing (name VARCHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL PRIMARY KEY, token BIGINT UNSIGNED NOT NULL) ENGINE=InnoDB;
//! GRANT SELECT, INSERT, UPDATE ON app.dlock_fencing TO 'dlock_app'@'%';
//! ```
//!
//! A table the user sees is used as it is: the backend creates it only when it is missing, and
//! then needs `CREATE` on the database. A user that may neither see nor create it gets a
//! [`LockError::Config`] with the statements above when the backend opens.
//! `tests/least_privilege.rs` runs the conformance suite, its `KILL`s of abandoned waits
//! included, as such users on MariaDB and MySQL 9.
//!
//! # TLS
//!
//! The driver speaks TLS with rustls and ring. Verify the server: `ssl-mode=VERIFY_IDENTITY`
//! with `ssl-ca=/path/ca.pem` (trusted besides the system's roots); `VERIFY_CA` skips the host
//! name, `REQUIRED` and the default `PREFERRED` check nothing. A refused certificate is a
//! [`LockError::Config`] saying which check failed (unknown issuer, a host name the certificate
//! does not carry, expired). With `VERIFY_IDENTITY` (or `REQUIRED`, `VERIFY_CA`) a server
//! without TLS is refused, never used in clear. A server with `require_secure_transport=ON`
//! refuses a client without TLS: MySQL says so; MariaDB answers "access denied", and the
//! error's message mentions that cause. Client certificates: `ssl-cert` and `ssl-key`.
//!
//! # URL
//!
//! `mysql://user:password@host:3306/database` or `mariadb://…` (the same backend). Options:
//!
//! | option | default | meaning |
//! |---|---|---|
//! | `fencing` | `false` | issue fencing tokens (see above) |
//! | `keepalive` | `5s` | liveness check cadence of connections that hold locks |
//! | `connections` | `4` | lock connections (1 to 64) |
//! | `wait_connections` | `4` | connections for native waits (0 to 64) |
//! | `connect_timeout` | `10s` | how long opening a connection may take |
//!
//! The driver's own options pass through: `ssl-mode`, `ssl-ca`, `ssl-cert`, `ssl-key`,
//! `charset`, `collation`, `socket`, `timezone`, `statement-cache-capacity`.
//!
//! ```no_run
//! use std::time::Duration;
//!
//! # async fn demo() -> Result<(), dlock::LockError> {
//! let locks = dlock::LockProvider::connect(
//!     "mysql://app:secret@db.internal:3306/app?fencing=true&keepalive=2s",
//! )
//! .await?;
//! let guard = locks.acquire("invoices:42", Duration::from_secs(10)).await?;
//! let token = guard.fencing_token(); // Some(n) with fencing=true
//! # let _ = token;
//! guard.release().await?;
//! # Ok(()) }
//! ```
//!
//! # Transaction-bound locks
//!
//! Neither MySQL nor MariaDB has user locks that end with a transaction: `GET_LOCK` locks
//! belong to the session and survive commit and rollback. [`try_acquire_in_transaction`] and
//! [`acquire_in_transaction`] exist so that code written for other engines gets a clear
//! [`LockError::Unsupported`] instead of a lock that silently outlives its transaction.

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use sha2::{Digest, Sha256};
use sqlx::mysql::{MySqlConnectOptions, MySqlConnection, MySqlDatabaseError, MySqlPool};
use sqlx::{Connection, Row};

use crate::LockError;
use crate::backend::BoxFuture;
use crate::key::validate_key;
use crate::options::{query_pairs, unknown_option};
use crate::session::{
    Connector, Failure, Grant, LaneOptions, Lanes, SETTLE_LIMIT, Session, lane_backend,
};

const NAME: &str = "mysql";

/// Most readable characters kept in front of the hash of a hashed lock name.
const READABLE_PREFIX: usize = 31;
/// The longest lock name the server accepts.
const MAX_NAME: usize = 64;

/// Options of the driver that pass through the URL unchanged.
const DRIVER_OPTIONS: &[&str] = &[
    "sslmode",
    "ssl-mode",
    "sslca",
    "ssl-ca",
    "sslcert",
    "ssl-cert",
    "sslkey",
    "ssl-key",
    "charset",
    "collation",
    "socket",
    "timezone",
    "time-zone",
    "statement-cache-capacity",
];

/// `?` name. 1 when taken, 0 when held elsewhere.
const TRY_SQL: &str = "SELECT GET_LOCK(?, 0)";
/// `?` name, `?` seconds (whole or fractional).
const WAIT_SQL: &str = "SELECT GET_LOCK(?, ?)";
/// `?` name. 1 when released, 0 when another session holds it, NULL when nobody does.
const RELEASE_SQL: &str = "SELECT RELEASE_LOCK(?)";
/// `?` name. The connection id of the session holding the lock, or NULL.
const HOLDER_SQL: &str = "SELECT CAST(IS_USED_LOCK(?) AS UNSIGNED)";
/// `?` name. Increments the fencing counter of a lock this session holds; the statement's
/// last insert id is the new token.
const FENCE_SQL: &str = "INSERT INTO dlock_fencing (name, token) VALUES (?, LAST_INSERT_ID(1)) \
    ON DUPLICATE KEY UPDATE token = LAST_INSERT_ID(token + 1)";
const FENCING_TABLE_SQL: &str = "CREATE TABLE IF NOT EXISTS dlock_fencing (\
    name VARCHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL PRIMARY KEY, \
    token BIGINT UNSIGNED NOT NULL) ENGINE=InnoDB";
/// Whether the fencing table is in the URL's database and visible to this user (it is when the
/// user holds any privilege on it). Asked before [`FENCING_TABLE_SQL`], which needs `CREATE`
/// even when the table exists: a user with just the table's grants could not open the backend.
const FENCING_TABLE_CHECK_SQL: &str = "SELECT COUNT(*) FROM information_schema.TABLES \
    WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'dlock_fencing'";
/// What an administrator runs for a user that may not create the fencing table.
const FENCING_GRANTS: &str = "CREATE TABLE <database>.dlock_fencing (name VARCHAR(64) CHARACTER SET ascii \
    COLLATE ascii_bin NOT NULL PRIMARY KEY, token BIGINT UNSIGNED NOT NULL) ENGINE=InnoDB; \
    GRANT SELECT, INSERT, UPDATE ON <database>.dlock_fencing TO <user>";
/// Ends a session (and with it its wait and its locks). MySQL takes no parameter in `KILL`
/// ("dynamic parameters can only be used in DML statements"), so this is the one statement
/// built by formatting: its only input is a `u64` connection id the server itself reported,
/// never text from a caller.
fn kill_sql(id: u64) -> String {
    format!("KILL CONNECTION {id}")
}
const IDENTITY_SQL: &str = "SELECT CAST(CONNECTION_ID() AS UNSIGNED), VERSION()";
const MYSQL_SESSION_SQL: &str = "SET SESSION wait_timeout = 31536000, max_execution_time = 0";
const MARIADB_SESSION_SQL: &str = "SET SESSION wait_timeout = 31536000, max_statement_time = 0";

/// MySQL's error for a `GET_LOCK` wait that would deadlock.
const ER_USER_LOCK_DEADLOCK: u16 = 3058;
/// MariaDB's (and InnoDB's) deadlock error.
const ER_LOCK_DEADLOCK: u16 = 1213;

/// The server's user lock name for `key`; see the [module docs](self#lock-names) for the rule.
///
/// ```
/// use dlock::mysql::server_lock_name;
/// assert_eq!(server_lock_name("jobs:billing"), "jobs:billing");
/// assert_eq!(
///     server_lock_name("Jobs"),
///     "jobs#2f17a0f8d518e491c5a0c490b2c19918"
/// );
/// assert!(server_lock_name(&"x".repeat(1000)).len() <= 64);
/// ```
pub fn server_lock_name(key: &str) -> String {
    let verbatim = (1..=MAX_NAME).contains(&key.len()) && key.bytes().all(is_name_byte);
    if verbatim {
        return key.to_owned();
    }
    let digest = Sha256::digest(key.as_bytes());
    let mut name = String::with_capacity(MAX_NAME);
    for c in key.chars() {
        if name.len() == READABLE_PREFIX {
            break;
        }
        let c = c.to_ascii_lowercase();
        if c.is_ascii() && is_name_byte(c as u8) {
            name.push(c);
        }
    }
    name.push('#');
    for byte in &digest[..16] {
        name.push(hex_digit(byte >> 4));
        name.push(hex_digit(byte & 0x0f));
    }
    name
}

fn is_name_byte(b: u8) -> bool {
    matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'_' | b'-' | b'.' | b':' | b'/' | b'@')
}

fn hex_digit(nibble: u8) -> char {
    char::from(b"0123456789abcdef"[usize::from(nibble & 0x0f)])
}

// ---------------------------------------------------------------------------------------------
// The backend.

/// The MySQL / MariaDB backend. Made by [`LockProvider::connect`](crate::LockProvider::connect)
/// with a `mysql://` or `mariadb://` URL, by [`MySqlBackend::new`] from an existing pool, or by
/// [`MySqlBackend::builder`]. See the [module docs](self).
#[derive(Clone)]
pub struct MySqlBackend {
    lanes: Arc<Lanes<MySqlConnector>>,
}

/// What the first connection learned about the server.
#[derive(Debug, Clone)]
struct ServerInfo {
    version: String,
    mariadb: bool,
}

impl ServerInfo {
    fn new(version: String) -> Self {
        let mariadb = version.to_ascii_lowercase().contains("mariadb");
        ServerInfo { version, mariadb }
    }

    /// Whether `GET_LOCK` honours fractional seconds. MariaDB does; MySQL rounds to whole
    /// seconds, so the backend waits whole seconds there and tries out the rest.
    fn fractional_waits(&self) -> bool {
        self.mariadb
    }

    fn session_sql(&self) -> &'static str {
        if self.mariadb {
            MARIADB_SESSION_SQL
        } else {
            MYSQL_SESSION_SQL
        }
    }
}

/// Builds a [`MySqlBackend`] with options.
#[derive(Clone)]
#[must_use]
pub struct MySqlBuilder {
    options: MySqlConnectOptions,
    lane: LaneOptions,
}

impl std::fmt::Debug for MySqlBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The connect options carry the password: show only where they point.
        f.debug_struct("MySqlBuilder")
            .field("host", &self.options.get_host())
            .field("port", &self.options.get_port())
            .field("options", &self.lane)
            .finish()
    }
}

impl MySqlBuilder {
    crate::session::lane_builder_options!();

    /// Opens the first lock connection (so a wrong address or password is reported here) and
    /// starts the backend; the other connections open when they are first needed. Creates the
    /// fencing table when fencing is on. Must run inside a Tokio runtime.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: dropping the future closes the connection it was opening.
    pub async fn open(self) -> Result<MySqlBackend, LockError> {
        self.check()?;
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(LockError::config(
                "the MySQL backend must be opened inside a Tokio runtime",
            ));
        }
        let (mut conn, id, server) = open_first(&self.options, self.lane.connect_timeout).await?;
        if self.lane.fencing {
            create_fencing_table(&mut conn).await?;
        }
        let connector = MySqlConnector {
            options: self.options,
            server,
            fencing: self.lane.fencing,
            connect_timeout: self.lane.connect_timeout,
        };
        let first = connector.session(conn, id);
        Ok(MySqlBackend {
            lanes: Arc::new(Lanes::start(connector, self.lane.settings, first)?),
        })
    }

    fn check(&self) -> Result<(), LockError> {
        self.lane.check()
    }
}

impl MySqlBackend {
    /// A builder that connects with `options`.
    pub fn builder(options: MySqlConnectOptions) -> MySqlBuilder {
        MySqlBuilder {
            options,
            lane: LaneOptions::default(),
        }
    }

    /// A builder that connects like `pool` does (same server, user, password, TLS, database).
    /// The backend opens its own connections and never takes any from the pool.
    pub fn builder_from_pool(pool: &MySqlPool) -> MySqlBuilder {
        MySqlBackend::builder((*pool.connect_options()).clone())
    }

    /// A backend with the default settings that connects like `pool` does.
    ///
    /// ```no_run
    /// # async fn demo(pool: sqlx::MySqlPool) -> Result<(), dlock::LockError> {
    /// let backend = dlock::mysql::MySqlBackend::new(pool.clone()).await?;
    /// let locks = dlock::LockProvider::from_backend(backend);
    /// # Ok(()) }
    /// ```
    ///
    /// # Cancel safety
    ///
    /// Cancel safe, as [`MySqlBuilder::open`].
    pub async fn new(pool: MySqlPool) -> Result<MySqlBackend, LockError> {
        MySqlBackend::builder_from_pool(&pool).open().await
    }

    /// Parses a `mysql://` or `mariadb://` URL with the options of the [module docs](self)
    /// into a builder, without connecting.
    pub fn builder_from_url(url: &str) -> Result<MySqlBuilder, LockError> {
        parse_url(url)
    }

    /// Connects with a `mysql://` or `mariadb://` URL.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe, as [`MySqlBuilder::open`].
    pub async fn connect(url: &str) -> Result<MySqlBackend, LockError> {
        parse_url(url)?.open().await
    }

    crate::session::lane_backend_options!();

    /// The server's version string, as `VERSION()` answered when the backend opened.
    pub fn server_version(&self) -> &str {
        &self.lanes.connector().server.version
    }

    /// Whether the server is MariaDB (rather than MySQL).
    pub fn is_mariadb(&self) -> bool {
        self.lanes.connector().server.mariadb
    }
}

impl std::fmt::Debug for MySqlBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let connector = self.lanes.connector();
        f.debug_struct("MySqlBackend")
            .field("host", &connector.options.get_host())
            .field("port", &connector.options.get_port())
            .field("server", &connector.server.version)
            .field("fencing", &connector.fencing)
            .field("lanes", &self.lanes)
            .finish()
    }
}

lane_backend!(MySqlBackend, NAME);

// ---------------------------------------------------------------------------------------------
// Sessions: what the shared connection machinery runs on a MySQL connection.

/// Opens lock and wait connections.
struct MySqlConnector {
    options: MySqlConnectOptions,
    server: ServerInfo,
    fencing: bool,
    connect_timeout: Duration,
}

impl MySqlConnector {
    fn session(&self, conn: MySqlConnection, id: u64) -> MySqlSession {
        MySqlSession {
            conn,
            id,
            fencing: self.fencing,
            fractional: self.server.fractional_waits(),
        }
    }
}

impl Connector for MySqlConnector {
    /// The server lock name.
    type Resource = Arc<str>;
    type Session = MySqlSession;

    const NAME: &'static str = NAME;
    /// Waits without limit are native waits of an hour each, repeated.
    const MAX_WAIT: Duration = Duration::from_secs(3600);
    const PING_TIMEOUT: Duration = Duration::from_secs(1);
    /// MariaDB takes fractional seconds in `GET_LOCK`; MySQL counts whole seconds.
    fn wait_resolution(&self) -> Duration {
        if self.server.fractional_waits() {
            Duration::from_micros(1)
        } else {
            Duration::from_secs(1)
        }
    }

    fn resource(&self, key: &str) -> Arc<str> {
        Arc::from(server_lock_name(key))
    }

    fn open(&self) -> BoxFuture<'_, Result<MySqlSession, LockError>> {
        Box::pin(async move {
            let (conn, id) =
                open_connection(&self.options, &self.server, self.connect_timeout).await?;
            Ok(self.session(conn, id))
        })
    }
}

/// One connection, with the id that `KILL` aims at.
struct MySqlSession {
    conn: MySqlConnection,
    id: u64,
    fencing: bool,
    fractional: bool,
}

/// `KILL` of an abandoned wait's connection; the killing lane then waits until that session
/// no longer holds `name`.
struct MySqlKill {
    id: u64,
    name: Arc<str>,
}

impl MySqlSession {
    /// `GET_LOCK`: 1 when taken, 0 when held elsewhere, NULL on a server-side error.
    async fn get_lock(&mut self, name: &str, wait: Duration) -> Result<Option<i64>, sqlx::Error> {
        if wait.is_zero() {
            sqlx::query_scalar(TRY_SQL)
                .bind(name)
                .fetch_one(&mut self.conn)
                .await
        } else {
            let query = sqlx::query_scalar(WAIT_SQL).bind(name);
            let query = if self.fractional {
                query.bind(wait.as_secs_f64())
            } else {
                query.bind(wait.as_secs())
            };
            query.fetch_one(&mut self.conn).await
        }
    }

    /// Issues the fencing token of a lock just taken; gives the lock back if that fails.
    async fn fence_or_release(&mut self, name: &str) -> Result<u64, Failure> {
        match fence(&mut self.conn, name).await {
            Ok(token) => Ok(token),
            Err(err) => {
                let error = failure("issuing a fencing token", err);
                // Do not keep a lock whose token could not be issued.
                match sqlx::query(RELEASE_SQL)
                    .bind(name)
                    .execute(&mut self.conn)
                    .await
                {
                    Ok(_) => Err(error),
                    Err(_) => Err(Failure::connection(error.error)),
                }
            }
        }
    }

    /// Ends session `id` (an abandoned wait) and waits until it no longer holds `name`.
    async fn kill(&mut self, id: u64, name: &str) -> Result<(), sqlx::Error> {
        let kill = kill_sql(id);
        match sqlx::query(&kill).execute(&mut self.conn).await {
            Ok(_) => {}
            // Unknown thread id: the session is gone already.
            Err(err) if error_number(&err) == Some(1094) => return Ok(()),
            Err(err) => return Err(err),
        }
        // KILL only flags the session: it frees its locks a moment later.
        let mut pause = Duration::from_millis(1);
        loop {
            let holder: Option<u64> = sqlx::query_scalar(HOLDER_SQL)
                .bind(name)
                .fetch_one(&mut self.conn)
                .await?;
            if holder != Some(id) {
                return Ok(());
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_millis(20));
        }
    }
}

impl Session for MySqlSession {
    type Resource = Arc<str>;
    type Interrupt = MySqlKill;

    fn lock<'a>(
        &'a mut self,
        name: &'a Arc<str>,
        wait: Duration,
    ) -> BoxFuture<'a, Result<Option<Grant>, Failure>> {
        Box::pin(async move {
            let what = if wait.is_zero() {
                "taking a lock"
            } else {
                "waiting for a lock"
            };
            match self.get_lock(name, wait).await {
                Ok(Some(1)) if self.fencing => Ok(Some(Grant {
                    token: Some(self.fence_or_release(name).await?),
                })),
                Ok(Some(1)) => Ok(Some(Grant::PLAIN)),
                Ok(Some(_)) => Ok(None),
                Ok(None) => Err(Failure::statement(LockError::backend(
                    NAME,
                    "GET_LOCK answered NULL (an error on the server, such as the session being killed)",
                    None,
                    None,
                ))),
                Err(err) if is_deadlock(&err) => Err(Failure::statement(deadlock_error(name, err))),
                Err(err) => Err(failure(what, err)),
            }
        })
    }

    fn unlock<'a>(&'a mut self, name: &'a Arc<str>) -> BoxFuture<'a, Result<(), Failure>> {
        Box::pin(async move {
            sqlx::query(RELEASE_SQL)
                .bind(&**name)
                .execute(&mut self.conn)
                .await
                .map(drop)
                .map_err(|err| failure("releasing a lock", err))
        })
    }

    fn ping(&mut self) -> BoxFuture<'_, Result<(), Failure>> {
        Box::pin(async move {
            self.conn
                .ping()
                .await
                .map_err(|err| Failure::connection(mysql_error("checking a connection", err)))
        })
    }

    fn interrupt(&self, name: &Arc<str>) -> Option<MySqlKill> {
        Some(MySqlKill {
            id: self.id,
            name: Arc::clone(name),
        })
    }

    fn run_interrupt(&mut self, kill: MySqlKill) -> BoxFuture<'_, Result<(), Failure>> {
        Box::pin(async move {
            match tokio::time::timeout(SETTLE_LIMIT, self.kill(kill.id, &kill.name)).await {
                Ok(Ok(())) => Ok(()),
                Ok(Err(err)) => Err(failure("ending an abandoned wait", err)),
                Err(_) => {
                    tracing::warn!(
                        backend = NAME,
                        "an abandoned wait's session still holds its lock after {SETTLE_LIMIT:?}"
                    );
                    Ok(())
                }
            }
        })
    }
}

/// A failed statement: the connection stays usable unless the error says otherwise.
fn failure(what: &str, err: sqlx::Error) -> Failure {
    if is_connection_error(&err) {
        Failure::connection(mysql_error(what, err))
    } else {
        Failure::statement(mysql_error(what, err))
    }
}

// ---------------------------------------------------------------------------------------------
// Transaction-bound locks.

/// A lock bound to a transaction. MySQL and MariaDB have none, so no value of this type can
/// exist; see [`try_acquire_in_transaction`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransactionLock {}

const NO_TRANSACTION_LOCKS: &str = "MySQL and MariaDB have no transaction-bound user locks: GET_LOCK locks belong to the session and outlive commit and rollback; take the lock with LockProvider::acquire and release it after the transaction ends";

/// Always answers [`LockError::Unsupported`]: MySQL and MariaDB have no user locks that end
/// with a transaction (see the [module docs](self#transaction-bound-locks)).
///
/// # Cancel safety
///
/// Cancel safe: it does nothing with the connection.
pub async fn try_acquire_in_transaction(
    conn: &mut MySqlConnection,
    key: &str,
) -> Result<TransactionLock, LockError> {
    let _ = conn;
    validate_key(key)?;
    Err(LockError::unsupported(
        NAME,
        "transaction-bound locks",
        NO_TRANSACTION_LOCKS,
    ))
}

/// Always answers [`LockError::Unsupported`], as [`try_acquire_in_transaction`].
///
/// # Cancel safety
///
/// Cancel safe: it does nothing with the connection.
pub async fn acquire_in_transaction(
    conn: &mut MySqlConnection,
    key: &str,
    timeout: Duration,
) -> Result<TransactionLock, LockError> {
    let _ = timeout;
    try_acquire_in_transaction(conn, key).await
}

// ---------------------------------------------------------------------------------------------
// Helpers.

/// Increments the fencing counter of `name`; the new value.
async fn fence(conn: &mut MySqlConnection, name: &str) -> Result<u64, sqlx::Error> {
    let done = sqlx::query(FENCE_SQL)
        .bind(name)
        .execute(&mut *conn)
        .await?;
    Ok(done.last_insert_id())
}

/// Opens the first connection and learns what server it is.
async fn open_first(
    options: &MySqlConnectOptions,
    timeout: Duration,
) -> Result<(MySqlConnection, u64, ServerInfo), LockError> {
    let connect = async {
        let mut conn = MySqlConnection::connect_with(options).await?;
        let row = sqlx::query(IDENTITY_SQL).fetch_one(&mut conn).await?;
        let id: u64 = row.try_get(0)?;
        let version: String = row.try_get(1)?;
        let server = ServerInfo::new(version);
        sqlx::query(server.session_sql()).execute(&mut conn).await?;
        Ok::<_, sqlx::Error>((conn, id, server))
    };
    match tokio::time::timeout(timeout, connect).await {
        Ok(result) => result.map_err(|e| mysql_error("connecting", e)),
        Err(_) => Err(connect_timed_out(timeout)),
    }
}

async fn open_connection(
    options: &MySqlConnectOptions,
    server: &ServerInfo,
    timeout: Duration,
) -> Result<(MySqlConnection, u64), LockError> {
    let connect = async {
        let mut conn = MySqlConnection::connect_with(options).await?;
        let id: u64 = sqlx::query_scalar("SELECT CAST(CONNECTION_ID() AS UNSIGNED)")
            .fetch_one(&mut conn)
            .await?;
        sqlx::query(server.session_sql()).execute(&mut conn).await?;
        Ok::<_, sqlx::Error>((conn, id))
    };
    match tokio::time::timeout(timeout, connect).await {
        Ok(result) => result.map_err(|e| mysql_error("connecting", e)),
        Err(_) => Err(connect_timed_out(timeout)),
    }
}

fn connect_timed_out(timeout: Duration) -> LockError {
    LockError::unavailable(
        NAME,
        format!("connecting to the server took longer than {timeout:?} (connect_timeout)"),
        None,
    )
}

/// Makes sure the fencing table is there: a table this user sees needs only its own
/// privileges (never `CREATE`); a missing one is created.
async fn create_fencing_table(conn: &mut MySqlConnection) -> Result<(), LockError> {
    let seen: i64 = sqlx::query_scalar(FENCING_TABLE_CHECK_SQL)
        .fetch_one(&mut *conn)
        .await
        .map_err(|e| mysql_error("looking for the fencing table dlock_fencing", e))?;
    if seen > 0 {
        return Ok(());
    }
    match sqlx::query(FENCING_TABLE_SQL).execute(&mut *conn).await {
        Ok(_) => Ok(()),
        Err(e) if error_number(&e) == Some(1046) => Err(LockError::config(
            "fencing=true needs a database for its counter table dlock_fencing: name one in the URL, like mysql://user@host:3306/app",
        )),
        // CREATE command denied (the table may be there, out of sight of a user with no
        // privilege on it).
        Err(e) if error_number(&e) == Some(1142) => Err(LockError::config(format!(
            "fencing=true needs the table dlock_fencing, which this user does not see and may \
             not create; an administrator creates it and grants it: {FENCING_GRANTS}"
        ))),
        Err(e) => Err(mysql_error("creating the fencing table dlock_fencing", e)),
    }
}

/// The server's error number, for errors the server answered.
fn error_number(err: &sqlx::Error) -> Option<u16> {
    match err {
        sqlx::Error::Database(db) => db
            .try_downcast_ref::<MySqlDatabaseError>()
            .map(MySqlDatabaseError::number),
        _ => None,
    }
}

fn is_deadlock(err: &sqlx::Error) -> bool {
    matches!(
        error_number(err),
        Some(ER_USER_LOCK_DEADLOCK | ER_LOCK_DEADLOCK)
    )
}

fn deadlock_error(name: &str, err: sqlx::Error) -> LockError {
    let number = error_number(&err);
    LockError::backend(
        NAME,
        format!(
            "waiting for user lock `{name}` would deadlock: the session holding it is itself waiting for a lock that another waiter holds; the server refused the wait. Take locks in one fixed order, or use try_acquire"
        ),
        number.map(|n| n.to_string()),
        Some(Box::new(err)),
    )
}

/// Server errors after which the connection cannot be trusted: shutdown, killed session,
/// disconnected for inactivity, too many connections.
const CONNECTION_ERRORS: &[u16] = &[1040, 1053, 1152, 1159, 1161, 1927, 3169, 4031];

/// Whether `err` means the connection can no longer be trusted.
fn is_connection_error(err: &sqlx::Error) -> bool {
    match err {
        sqlx::Error::Database(_) => {
            error_number(err).is_some_and(|n| CONNECTION_ERRORS.contains(&n))
        }
        _ => true,
    }
}

/// Maps a driver error; messages name what was being done, never the URL.
fn mysql_error(what: &str, err: sqlx::Error) -> LockError {
    if crate::tls::is_tls_refused_by_server(&err) {
        return LockError::config(format!(
            "{what}: TLS: the server does not offer TLS, and the URL's `ssl-mode` requires it; \
             nothing was sent in clear (give the server `ssl-cert` and `ssl-key`)"
        ));
    }
    if let Some(failure) = crate::tls::describe(&err, "ssl-ca") {
        return failure.into_error(NAME, what, Box::new(err));
    }
    let number = error_number(&err);
    match &err {
        sqlx::Error::Database(db) => {
            let message = db.message().to_owned();
            match number {
                Some(1045 | 1698 | 1251) => LockError::config(format!(
                    "{what}: the server refused the credentials ({message}); check the user name and password in the URL \
                     (a server or account that requires TLS refuses clients without it the same way: \
                     MariaDB's `require_secure_transport`, an account `REQUIRE SSL`; use ssl-mode=VERIFY_IDENTITY)"
                )),
                // MySQL's `require_secure_transport`.
                Some(3159) => LockError::config(format!(
                    "{what}: the server accepts clients only over TLS ({message}); connect with ssl-mode=VERIFY_IDENTITY and ssl-ca"
                )),
                Some(1049) => LockError::config(format!(
                    "{what}: {message}; check the database name in the URL"
                )),
                Some(n) if CONNECTION_ERRORS.contains(&n) => {
                    LockError::unavailable(NAME, format!("{what}: {message}"), Some(Box::new(err)))
                }
                _ => LockError::backend(
                    NAME,
                    format!("{what}: {message}"),
                    number.map(|n| n.to_string()),
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
        _ => LockError::backend(
            NAME,
            format!("{what}: {err}"),
            number.map(|n| n.to_string()),
            Some(Box::new(err)),
        ),
    }
}

fn parse_url(url: &str) -> Result<MySqlBuilder, LockError> {
    let (base, query) = url.split_once('?').unwrap_or((url, ""));
    let Some((scheme, rest)) = base.split_once("://") else {
        return Err(LockError::config(
            "the MySQL URL must look like mysql://user:password@host:3306/database",
        ));
    };
    if !matches!(scheme.to_ascii_lowercase().as_str(), "mysql" | "mariadb") {
        return Err(LockError::config(
            "the MySQL backend takes mysql:// or mariadb:// URLs",
        ));
    }
    let mut passthrough = Vec::new();
    let mut lane = LaneOptions::default();
    for (name, value) in query_pairs(query) {
        if lane.parse(&name, &value)? {
            continue;
        }
        match name.as_str() {
            other if DRIVER_OPTIONS.contains(&other) => passthrough.push((name, value)),
            other => {
                let valid: Vec<&str> = LaneOptions::NAMES
                    .iter()
                    .chain(DRIVER_OPTIONS)
                    .copied()
                    .collect();
                return Err(unknown_option("mysql", other, &valid));
            }
        }
    }
    // The driver reads `mysql://`; `mariadb://` is the same protocol.
    let mut driver_url = format!("mysql://{rest}");
    if !passthrough.is_empty() {
        let encoded: String = url::form_urlencoded::Serializer::new(String::new())
            .extend_pairs(passthrough.iter())
            .finish();
        driver_url.push('?');
        driver_url.push_str(&encoded);
    }
    let options = MySqlConnectOptions::from_str(&driver_url).map_err(|e| {
        LockError::config(format!(
            "the MySQL URL is not valid ({}); write it like mysql://user:password@host:3306/database (options: {})",
            describe_url_error(&e),
            LaneOptions::NAMES.join(", ")
        ))
    })?;
    let builder = MySqlBuilder { options, lane };
    builder.check()?;
    Ok(builder)
}

/// The driver's URL error, without anything that could repeat the URL.
fn describe_url_error(err: &sqlx::Error) -> String {
    match err {
        sqlx::Error::Configuration(inner) => inner.to_string(),
        _ => "malformed URL".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_kept_verbatim() {
        for key in ["jobs", "jobs:billing", "a/b@c.d-e_f", &"x".repeat(64)] {
            assert_eq!(server_lock_name(key), key);
        }
    }

    #[test]
    fn names_hashed() {
        // Pinned: changing these changes which server locks deployed clients take.
        assert_eq!(
            server_lock_name("Jobs"),
            "jobs#2f17a0f8d518e491c5a0c490b2c19918"
        );
        let long = "x".repeat(65);
        let name = server_lock_name(&long);
        assert_eq!(name.len(), 31 + 1 + 32);
        assert!(name.starts_with(&"x".repeat(31)));
        assert_eq!(
            server_lock_name("ключ"),
            format!("#{}", &hex(&Sha256::digest("ключ".as_bytes()))[..32])
        );
        assert_eq!(
            server_lock_name("a b"),
            format!("ab#{}", &hex(&Sha256::digest(b"a b"))[..32])
        );
        for key in ["", " ", "\0", "JOBS", "jobs ", "a#b", &"é".repeat(200)] {
            let name = server_lock_name(key);
            assert!(name.len() <= MAX_NAME, "{key:?}");
            assert!(name.is_ascii());
            assert_eq!(name, name.to_ascii_lowercase());
            assert_eq!(name.matches('#').count(), 1, "{key:?} -> {name}");
        }
    }

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    #[test]
    fn distinct_keys_get_distinct_names() {
        let mut keys: Vec<String> = vec![
            "Jobs".into(),
            "jobs".into(),
            "JOBS".into(),
            "jObs".into(),
            "a\0b".into(),
            "a\0c".into(),
            "x".into(),
            "x\0".into(),
            "k ".into(),
            "k".into(),
            "é".into(),
            "e\u{301}".into(),
            "E".into(),
            "e".into(),
        ];
        let long = "p".repeat(10_000);
        for i in 0..200 {
            keys.push(format!("{long}{i}"));
            keys.push(format!("{}{i}", "q".repeat(60)));
            keys.push(format!("Key{i}"));
            keys.push(format!("key{i}"));
        }
        // Keys that look like hashed names stay themselves (no `#` in a verbatim name).
        let hashed = server_lock_name("Jobs");
        keys.push(hashed.clone());
        let mut seen = std::collections::HashMap::new();
        for key in &keys {
            // The server may fold case: compare lowered names.
            let name = server_lock_name(key).to_ascii_lowercase();
            if let Some(other) = seen.insert(name.clone(), key.clone()) {
                assert_eq!(&other, key, "{other:?} and {key:?} share {name}");
            }
        }
        assert_ne!(server_lock_name(&hashed), hashed);
    }

    #[test]
    fn urls() {
        let b = MySqlBackend::builder_from_url(
            "mariadb://u:secret@127.0.0.1:5/db?fencing=true&keepalive=250ms&connections=2&wait_connections=0&ssl-mode=disabled",
        )
        .unwrap();
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
        assert_eq!(b.options.get_database(), Some("db"));
        assert!(!format!("{b:?}").contains("secret"));
        for bad in [
            "mysql://h/db?fencing=maybe",
            "mysql://h/db?keepalive=soon",
            "mysql://h/db?connections=0",
            "mysql://h/db?connections=100",
            "mysql://h/db?keepalive=1ms",
            "mysql://h/db?nonsense=1",
            "mysql://h:notaport/db",
            "postgres://h/db",
        ] {
            let err = parse_url(bad).unwrap_err();
            assert_eq!(err.code(), "DistributedLock.Configuration", "{bad}: {err}");
            assert!(!err.to_string().contains("secret"));
        }
    }
}
