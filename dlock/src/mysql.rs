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
//! Sessions re-enter their own user locks on the server; the provider's in-process table, and
//! a table of names in the backend shared by every provider made from it, make sure one
//! backend never asks the server for a name it already holds.
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
//! A wait that would close a cycle of sessions waiting for each other's user locks is refused
//! by the server (MySQL error 3058, MariaDB error 1213): the acquisition fails at once with a
//! [`LockError::Backend`] that says so (its [`db_code`](LockError::db_code) is the error
//! number), never a hang. Such cycles need another client that holds several locks while it
//! waits; this backend's own waits hold nothing while they wait.
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

use std::collections::HashMap;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};
use sqlx::mysql::{MySqlConnectOptions, MySqlConnection, MySqlDatabaseError, MySqlPool};
use sqlx::{Connection, Row};
use tokio::sync::{Notify, Semaphore, mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use crate::backend::{Acquired, BoxFuture, HeldLock, LockBackend, LockRequest};
use crate::key::validate_key;
use crate::options::{parse_duration, query_pairs, unknown_option};
use crate::{Backoff, LockError};

const NAME: &str = "mysql";

const DEFAULT_KEEPALIVE: Duration = Duration::from_secs(5);
const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
const DEFAULT_CONNECTIONS: usize = 4;
const DEFAULT_WAIT_CONNECTIONS: usize = 4;
const MAX_CONNECTIONS: usize = 64;
/// A liveness check that takes longer than this counts as a dead connection.
const PING_TIMEOUT: Duration = Duration::from_secs(1);
/// Bound on one short statement (try, release, fencing, kill) on a lock connection.
const STATEMENT_TIMEOUT: Duration = Duration::from_secs(10);
/// Extra time a native wait gets beyond its timeout before the client gives up on it.
const WAIT_GRACE: Duration = Duration::from_secs(2);
/// The longest single native wait; longer waits repeat it.
const MAX_NATIVE_WAIT: Duration = Duration::from_secs(3600);
/// How long a killed wait's session may take to let go of its lock before the name is
/// handed out again anyway (the server will still refuse it while that session holds it).
const SETTLE_LIMIT: Duration = Duration::from_secs(5);

/// Most readable characters kept in front of the hash of a hashed lock name.
const READABLE_PREFIX: usize = 31;
/// The longest lock name the server accepts.
const MAX_NAME: usize = 64;

const OPTIONS: &[&str] = &[
    "fencing",
    "keepalive",
    "connections",
    "wait_connections",
    "connect_timeout",
];

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
    shared: Arc<Shared>,
}

struct Shared {
    options: MySqlConnectOptions,
    fencing: bool,
    keepalive: Duration,
    connect_timeout: Duration,
    server: ServerInfo,
    lanes: Vec<mpsc::UnboundedSender<LaneCommand>>,
    next_lane: AtomicUsize,
    waits: Arc<WaitPool>,
    names: Arc<Names>,
    next_handle: AtomicU64,
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
    fencing: bool,
    keepalive: Duration,
    connect_timeout: Duration,
    connections: usize,
    wait_connections: usize,
}

impl std::fmt::Debug for MySqlBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The connect options carry the password: show only where they point.
        f.debug_struct("MySqlBuilder")
            .field("host", &self.options.get_host())
            .field("port", &self.options.get_port())
            .field("fencing", &self.fencing)
            .field("keepalive", &self.keepalive)
            .field("connect_timeout", &self.connect_timeout)
            .field("connections", &self.connections)
            .field("wait_connections", &self.wait_connections)
            .finish()
    }
}

impl MySqlBuilder {
    /// Issue fencing tokens from the `dlock_fencing` counter table (default off).
    pub fn fencing(mut self, fencing: bool) -> Self {
        self.fencing = fencing;
        self
    }

    /// How often connections that hold locks are checked (default 5 s, at least 10 ms).
    pub fn keepalive(mut self, keepalive: Duration) -> Self {
        self.keepalive = keepalive;
        self
    }

    /// How long opening a connection may take (default 10 s).
    pub fn connect_timeout(mut self, connect_timeout: Duration) -> Self {
        self.connect_timeout = connect_timeout;
        self
    }

    /// The number of lock connections (default 4, 1 to 64).
    pub fn connections(mut self, connections: usize) -> Self {
        self.connections = connections;
        self
    }

    /// The most connections used for native waits at once (default 4, 0 to 64; 0 makes waits
    /// poll instead).
    pub fn wait_connections(mut self, wait_connections: usize) -> Self {
        self.wait_connections = wait_connections;
        self
    }

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
        let (mut first, _, server) = open_first(&self.options, self.connect_timeout).await?;
        if self.fencing {
            create_fencing_table(&mut first).await?;
        }
        let names = Arc::new(Names::default());
        let mut lanes = Vec::with_capacity(self.connections);
        let mut first = Some(first);
        for _ in 0..self.connections {
            let (tx, rx) = mpsc::unbounded_channel();
            let lane = Lane {
                options: self.options.clone(),
                server: server.clone(),
                connect_timeout: self.connect_timeout,
                keepalive: self.keepalive,
                fencing: self.fencing,
                conn: first.take(),
                held: HashMap::new(),
            };
            tokio::spawn(lane.run(rx));
            lanes.push(tx);
        }
        Ok(MySqlBackend {
            shared: Arc::new(Shared {
                options: self.options,
                fencing: self.fencing,
                keepalive: self.keepalive,
                connect_timeout: self.connect_timeout,
                server,
                lanes,
                next_lane: AtomicUsize::new(0),
                waits: Arc::new(WaitPool {
                    permits: Arc::new(Semaphore::new(self.wait_connections)),
                    idle: Mutex::new(Vec::new()),
                }),
                names,
                next_handle: AtomicU64::new(0),
            }),
        })
    }

    fn check(&self) -> Result<(), LockError> {
        if self.keepalive < Duration::from_millis(10) {
            return Err(LockError::config(format!(
                "keepalive {:?} is too short; use at least 10ms",
                self.keepalive
            )));
        }
        if self.connect_timeout.is_zero() {
            return Err(LockError::config("connect_timeout must be more than zero"));
        }
        if !(1..=MAX_CONNECTIONS).contains(&self.connections) {
            return Err(LockError::config(format!(
                "connections must be between 1 and {MAX_CONNECTIONS}, not {}",
                self.connections
            )));
        }
        if self.wait_connections > MAX_CONNECTIONS {
            return Err(LockError::config(format!(
                "wait_connections must be between 0 and {MAX_CONNECTIONS}, not {}",
                self.wait_connections
            )));
        }
        Ok(())
    }
}

impl MySqlBackend {
    /// A builder that connects with `options`.
    pub fn builder(options: MySqlConnectOptions) -> MySqlBuilder {
        MySqlBuilder {
            options,
            fencing: false,
            keepalive: DEFAULT_KEEPALIVE,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            connections: DEFAULT_CONNECTIONS,
            wait_connections: DEFAULT_WAIT_CONNECTIONS,
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

    /// Whether this backend issues fencing tokens.
    pub fn fencing(&self) -> bool {
        self.shared.fencing
    }

    /// The liveness check cadence.
    pub fn keepalive(&self) -> Duration {
        self.shared.keepalive
    }

    /// The server's version string, as `VERSION()` answered when the backend opened.
    pub fn server_version(&self) -> &str {
        &self.shared.server.version
    }

    /// Whether the server is MariaDB (rather than MySQL).
    pub fn is_mariadb(&self) -> bool {
        self.shared.server.mariadb
    }

    fn lane(&self) -> &mpsc::UnboundedSender<LaneCommand> {
        let lanes = &self.shared.lanes;
        let n = self.shared.next_lane.fetch_add(1, Ordering::Relaxed);
        // `lanes` is never empty (checked when built).
        &lanes[n % lanes.len().max(1)]
    }

    /// One `GET_LOCK(name, 0)` on a lock connection.
    async fn try_on_lane(&self, name: Arc<str>) -> Result<Option<Acquired>, LockError> {
        let Some(claim) = self.shared.names.claim(&name).await else {
            return Ok(None);
        };
        let lane = self.lane().clone();
        let handle = self.shared.next_handle.fetch_add(1, Ordering::Relaxed);
        let lost = CancellationToken::new();
        let (reply, answer) = oneshot::channel();
        let guard = claim.abandon_guard();
        lane.send(LaneCommand::Try {
            claim,
            handle,
            lost: lost.clone(),
            reply,
        })
        .map_err(|_| lane_gone())?;
        // Armed from here on: if this future is dropped before the answer is turned into a
        // guard (even after the lane has sent a grant), dropping `held` queues a release
        // behind the try, which frees whatever the try got.
        let held = LaneHeld::new(lane, handle);
        let answer = answer.await;
        guard.disarm();
        match answer.map_err(|_| lane_gone())?? {
            None => {
                held.disarm();
                Ok(None)
            }
            Some(token) => Ok(Some(Acquired::new(token, lost, Box::new(held)))),
        }
    }

    async fn poll_lanes(
        &self,
        name: Arc<str>,
        deadline: Option<Instant>,
    ) -> Result<Option<Acquired>, LockError> {
        let backoff = Backoff::default();
        let mut attempt = 0u32;
        loop {
            if let Some(acquired) = self.try_on_lane(Arc::clone(&name)).await? {
                return Ok(Some(acquired));
            }
            let mut pause = backoff.delay(attempt);
            attempt = attempt.saturating_add(1);
            if let Some(deadline) = deadline {
                let now = Instant::now();
                if now >= deadline {
                    return Ok(None);
                }
                pause = pause.min(deadline - now);
            }
            tokio::time::sleep(pause).await;
        }
    }

    async fn wait(&self, key: &str, timeout: Duration) -> Result<Option<Acquired>, LockError> {
        let deadline = Instant::now().checked_add(timeout);
        let name: Arc<str> = Arc::from(server_lock_name(key));
        // A free key is taken on a lock connection, like a try.
        if let Some(acquired) = self.try_on_lane(Arc::clone(&name)).await? {
            return Ok(Some(acquired));
        }
        let remaining = deadline.map_or(Duration::MAX, |d| {
            d.saturating_duration_since(Instant::now())
        });
        if remaining.is_zero() {
            return Ok(None);
        }
        let Ok(permit) = Arc::clone(&self.shared.waits.permits).try_acquire_owned() else {
            // Every wait connection is busy: poll the lock connections instead.
            return self.poll_lanes(name, deadline).await;
        };
        let Some(claim) = self.shared.names.claim(&name).await else {
            // Another provider on this backend holds it: poll until it lets go.
            drop(permit);
            return self.poll_lanes(name, deadline).await;
        };
        let lost = CancellationToken::new();
        let (reply, answer) = oneshot::channel();
        let guard = claim.abandon_guard();
        let task = WaitTask {
            claim,
            deadline,
            fencing: self.shared.fencing,
            keepalive: self.shared.keepalive,
            options: self.shared.options.clone(),
            server: self.shared.server.clone(),
            connect_timeout: self.shared.connect_timeout,
            pool: Arc::clone(&self.shared.waits),
            killer: self.lane().clone(),
            lost: lost.clone(),
            _permit: permit,
        };
        tokio::spawn(task.run(reply));
        // If this future is dropped, the task sees the closed reply, ends the server's wait
        // and gives back whatever it got.
        let answer = match remaining.checked_add(WAIT_GRACE) {
            Some(limit) => match tokio::time::timeout(limit, answer).await {
                Ok(answer) => answer,
                // The server did not answer in time: give up (the task cleans up; the armed
                // guard marks the name as being freed).
                Err(_) => return Ok(None),
            },
            None => answer.await,
        };
        guard.disarm();
        match answer.map_err(|_| lane_gone())?? {
            None => Ok(None),
            Some((token, release)) => Ok(Some(Acquired::new(
                token,
                lost,
                Box::new(WaitHeld {
                    release: Some(release),
                }),
            ))),
        }
    }
}

impl std::fmt::Debug for MySqlBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MySqlBackend")
            .field("host", &self.shared.options.get_host())
            .field("port", &self.shared.options.get_port())
            .field("server", &self.shared.server.version)
            .field("fencing", &self.shared.fencing)
            .field("keepalive", &self.shared.keepalive)
            .field("connections", &self.shared.lanes.len())
            .finish()
    }
}

impl LockBackend for MySqlBackend {
    fn name(&self) -> &'static str {
        NAME
    }

    fn supports_native_wait(&self) -> bool {
        true
    }

    fn try_acquire<'a>(
        &'a self,
        request: LockRequest<'a>,
    ) -> BoxFuture<'a, Result<Option<Acquired>, LockError>> {
        Box::pin(self.try_on_lane(Arc::from(server_lock_name(request.key))))
    }

    fn acquire_wait<'a>(
        &'a self,
        request: LockRequest<'a>,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<Option<Acquired>, LockError>> {
        Box::pin(self.wait(request.key, timeout))
    }
}

// ---------------------------------------------------------------------------------------------
// The names this backend holds or is cleaning up.

/// Server lock names that some connection of this backend holds, is acquiring, or is still
/// freeing after an abandoned wait. The server lets a session take its own lock again, so the
/// backend must never ask for a name it has; and a name whose killed wait is still being torn
/// down is waited for rather than reported as held.
#[derive(Default)]
struct Names {
    map: Mutex<HashMap<Arc<str>, NameState>>,
    next_claim: AtomicU64,
}

/// The state of a claimed name, with the id of the claim.
enum NameState {
    Taken(u64),
    Settling(Arc<Notify>),
}

impl Names {
    /// Marks claim `id` of `name` as being freed (if it is still that claim): acquisitions by
    /// this backend wait for it instead of answering that the name is held.
    fn settle(&self, name: &Arc<str>, id: u64) {
        let mut map = self.map.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(state) = map.get_mut(name) {
            if matches!(state, NameState::Taken(taken) if *taken == id) {
                *state = NameState::Settling(Arc::new(Notify::new()));
            }
        }
    }
}

impl Names {
    /// Claims `name`: `None` when this backend already holds it.
    async fn claim(self: &Arc<Self>, name: &Arc<str>) -> Option<Claim> {
        let started = Instant::now();
        loop {
            let notify = {
                let mut map = self.map.lock().unwrap_or_else(PoisonError::into_inner);
                match map.get(name) {
                    None => {
                        let id = self.next_claim.fetch_add(1, Ordering::Relaxed);
                        map.insert(Arc::clone(name), NameState::Taken(id));
                        return Some(Claim {
                            names: Arc::clone(self),
                            name: Arc::clone(name),
                            id,
                        });
                    }
                    Some(NameState::Taken(_)) => return None,
                    Some(NameState::Settling(notify)) => Arc::clone(notify),
                }
            };
            let left = SETTLE_LIMIT.saturating_sub(started.elapsed());
            if left.is_zero() {
                return None;
            }
            let notified = notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            // Re-check: the claim may have gone between the look and `enable`.
            let still = matches!(
                self.map
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .get(name),
                Some(NameState::Settling(_))
            );
            if still {
                let _ = tokio::time::timeout(left, notified).await;
            }
        }
    }
}

/// A claimed name; dropping it frees the name (and wakes acquisitions waiting for it).
struct Claim {
    names: Arc<Names>,
    name: Arc<str>,
    id: u64,
}

impl Claim {
    /// Marks the name as being freed on the server: acquisitions by this backend wait until
    /// the claim is dropped instead of answering that it is held.
    fn settling(&self) {
        self.names.settle(&self.name, self.id);
    }

    /// A guard that marks this claim as being freed if it is dropped armed: an acquisition
    /// future dropped before its answer arrived leaves the name to a background clean-up.
    fn abandon_guard(&self) -> AbandonGuard {
        AbandonGuard {
            names: Arc::clone(&self.names),
            name: Arc::clone(&self.name),
            id: self.id,
            armed: true,
        }
    }
}

struct AbandonGuard {
    names: Arc<Names>,
    name: Arc<str>,
    id: u64,
    armed: bool,
}

impl AbandonGuard {
    fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for AbandonGuard {
    fn drop(&mut self) {
        if self.armed {
            self.names.settle(&self.name, self.id);
        }
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        let removed = self
            .names
            .map
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&self.name);
        if let Some(NameState::Settling(notify)) = removed {
            notify.notify_waiters();
        }
    }
}

impl std::fmt::Debug for Claim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Claim").field(&self.name).finish()
    }
}

// ---------------------------------------------------------------------------------------------
// Lock connections ("lanes").

type TryReply = oneshot::Sender<Result<Option<Option<u64>>, LockError>>;

enum LaneCommand {
    /// `GET_LOCK(name, 0)`; on success the lock is pinned to this lane under `handle`.
    Try {
        claim: Claim,
        handle: u64,
        lost: CancellationToken,
        reply: TryReply,
    },
    /// Gives back the lock `handle` (if this lane still holds it), then acknowledges.
    Release {
        handle: u64,
        done: oneshot::Sender<()>,
    },
    /// `KILL` of an abandoned wait's connection, then waits until that session no longer
    /// holds `name`, then acknowledges.
    Kill {
        id: u64,
        name: Arc<str>,
        done: oneshot::Sender<()>,
    },
}

/// One lock connection, owned by its task: every statement on it runs in order, and the task
/// also runs the liveness checks.
struct Lane {
    options: MySqlConnectOptions,
    server: ServerInfo,
    connect_timeout: Duration,
    keepalive: Duration,
    fencing: bool,
    conn: Option<MySqlConnection>,
    /// The locks this connection holds: handle -> (claim of the name, lost token).
    held: HashMap<u64, (Claim, CancellationToken)>,
}

impl Lane {
    async fn run(mut self, mut commands: mpsc::UnboundedReceiver<LaneCommand>) {
        let mut ticker = tokio::time::interval(self.keepalive);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                command = commands.recv() => match command {
                    Some(command) => self.handle(command).await,
                    // The backend and every lock of this lane are gone.
                    None => break,
                },
                _ = ticker.tick(), if self.conn.is_some() => self.check().await,
            }
        }
    }

    async fn handle(&mut self, command: LaneCommand) {
        match command {
            LaneCommand::Try {
                claim,
                handle,
                lost,
                reply,
            } => {
                if reply.is_closed() {
                    return;
                }
                match self.try_lock(&claim.name).await {
                    Ok(Some(token)) => {
                        self.held.insert(handle, (claim, lost));
                        if reply.send(Ok(Some(token))).is_err() {
                            // The acquisition was abandoned while the server granted it.
                            self.release(handle).await;
                        }
                    }
                    other => {
                        drop(claim);
                        let _ = reply.send(other.map(|_| None));
                    }
                }
            }
            LaneCommand::Release { handle, done } => {
                self.release(handle).await;
                let _ = done.send(());
            }
            LaneCommand::Kill { id, name, done } => {
                self.kill(id, &name).await;
                let _ = done.send(());
            }
        }
    }

    /// The open connection, opening a fresh one if there is none.
    async fn connection(&mut self) -> Result<&mut MySqlConnection, LockError> {
        if self.conn.is_none() {
            let (conn, _) =
                open_connection(&self.options, &self.server, self.connect_timeout).await?;
            self.conn = Some(conn);
        }
        self.conn.as_mut().ok_or_else(lane_gone)
    }

    /// One try; `Ok(Some(token))` when taken. A connection found dead before anything was
    /// sent over it (idle, holding nothing) is replaced once.
    async fn try_lock(&mut self, name: &str) -> Result<Option<Option<u64>>, LockError> {
        let reused = self.conn.is_some();
        match self.try_once(name).await {
            Err(_) if reused && self.conn.is_none() && self.held.is_empty() => {
                self.try_once(name).await
            }
            other => other,
        }
    }

    async fn try_once(&mut self, name: &str) -> Result<Option<Option<u64>>, LockError> {
        let fencing = self.fencing;
        let conn = self.connection().await?;
        let statement = async {
            let got: Option<i64> = sqlx::query_scalar(TRY_SQL)
                .bind(name)
                .fetch_one(&mut *conn)
                .await?;
            if got != Some(1) {
                return Ok::<_, sqlx::Error>(Err(got));
            }
            if !fencing {
                return Ok(Ok(None));
            }
            match fence(conn, name).await {
                Ok(token) => Ok(Ok(Some(token))),
                Err(err) => {
                    // Do not keep a lock whose token could not be issued.
                    sqlx::query(RELEASE_SQL)
                        .bind(name)
                        .execute(&mut *conn)
                        .await?;
                    Err(err)
                }
            }
        };
        match tokio::time::timeout(STATEMENT_TIMEOUT, statement).await {
            Ok(Ok(Ok(token))) => Ok(Some(token)),
            Ok(Ok(Err(Some(_)))) => Ok(None),
            Ok(Ok(Err(None))) => Err(LockError::backend(
                NAME,
                "GET_LOCK answered NULL (an error on the server, such as the session being killed)",
                None,
                None,
            )),
            Ok(Err(err)) if !is_connection_error(&err) => Err(mysql_error("taking a lock", err)),
            Ok(Err(err)) => {
                self.die("the lock connection failed");
                Err(mysql_error("taking a lock", err))
            }
            Err(_) => {
                self.die("the lock connection stopped answering");
                Err(LockError::unavailable(
                    NAME,
                    format!(
                        "the server did not answer a lock statement within {STATEMENT_TIMEOUT:?}"
                    ),
                    None,
                ))
            }
        }
    }

    async fn release(&mut self, handle: u64) {
        // A lock that is not in `held` went with a dead connection: nothing to give back.
        let Some((claim, _lost)) = self.held.remove(&handle) else {
            return;
        };
        let Some(conn) = self.conn.as_mut() else {
            return;
        };
        let release = sqlx::query(RELEASE_SQL)
            .bind(&*claim.name)
            .execute(&mut *conn);
        match tokio::time::timeout(STATEMENT_TIMEOUT, release).await {
            Ok(Ok(_)) => {}
            // The connection's state is unknown: dropping it is the one sure way to free the
            // lock on the server, and it takes this lane's other locks with it.
            _ => self.die("releasing a lock failed"),
        }
        drop(claim);
    }

    /// Ends session `id` (an abandoned wait) and waits until it no longer holds `name`.
    async fn kill(&mut self, id: u64, name: &str) {
        let Ok(conn) = self.connection().await else {
            return;
        };
        let work = async {
            let kill = kill_sql(id);
            match sqlx::query(&kill).execute(&mut *conn).await {
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
                    .fetch_one(&mut *conn)
                    .await?;
                if holder != Some(id) {
                    return Ok(());
                }
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_millis(20));
            }
        };
        match tokio::time::timeout(SETTLE_LIMIT, work).await {
            Ok(Ok(())) => {}
            Ok(Err(err)) if !is_connection_error(&err) => {
                tracing::warn!(backend = NAME, error = %err, "ending an abandoned wait failed");
            }
            Ok(Err(_)) => self.die("the lock connection failed"),
            Err(_) => {
                tracing::warn!(
                    backend = NAME,
                    "an abandoned wait's session still holds its lock after {SETTLE_LIMIT:?}"
                );
            }
        }
    }

    async fn check(&mut self) {
        let Some(conn) = self.conn.as_mut() else {
            return;
        };
        match tokio::time::timeout(PING_TIMEOUT, conn.ping()).await {
            Ok(Ok(())) => {}
            _ => self.die("the lock connection failed its liveness check"),
        }
    }

    /// Drops the connection and reports every lock it held as lost.
    fn die(&mut self, why: &str) {
        if !self.held.is_empty() {
            tracing::warn!(
                backend = NAME,
                locks = self.held.len(),
                "{why}; its locks are lost"
            );
        }
        for (_, (_claim, lost)) in self.held.drain() {
            lost.cancel();
        }
        self.conn = None;
    }
}

/// A lock pinned to a lane (or a try in flight that may become one). Dropped without
/// [`HeldLock::release`], it queues a release for its handle without waiting for it; the lane
/// runs commands in order, so that release comes after the try it answers.
#[derive(Debug)]
struct LaneHeld {
    lane: mpsc::UnboundedSender<LaneCommand>,
    handle: u64,
    armed: bool,
}

impl LaneHeld {
    fn new(lane: mpsc::UnboundedSender<LaneCommand>, handle: u64) -> Self {
        LaneHeld {
            lane,
            handle,
            armed: true,
        }
    }

    /// For a try that was not granted: nothing to give back.
    fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for LaneHeld {
    fn drop(&mut self) {
        if self.armed {
            let (done, _) = oneshot::channel();
            let _ = self.lane.send(LaneCommand::Release {
                handle: self.handle,
                done,
            });
        }
    }
}

impl HeldLock for LaneHeld {
    fn release(mut self: Box<Self>) -> BoxFuture<'static, Result<(), LockError>> {
        self.armed = false;
        Box::pin(async move {
            let (done, acknowledged) = oneshot::channel();
            if self
                .lane
                .send(LaneCommand::Release {
                    handle: self.handle,
                    done,
                })
                .is_ok()
            {
                // The lane task ends only with its connection, which frees the lock anyway.
                let _ = acknowledged.await;
            }
            Ok(())
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Native waits.

struct WaitPool {
    /// One permit per wait connection in use (waiting, or holding what its wait got).
    permits: Arc<Semaphore>,
    /// Wait connections that hold nothing, ready for the next wait.
    idle: Mutex<Vec<WaitConnection>>,
}

impl WaitPool {
    fn take(&self) -> Option<WaitConnection> {
        self.idle
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop()
    }

    fn put(&self, conn: WaitConnection) {
        self.idle
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(conn);
    }
}

struct WaitConnection {
    conn: MySqlConnection,
    id: u64,
}

type WaitReply = oneshot::Sender<Result<Option<(Option<u64>, ReleaseSender)>, LockError>>;
type ReleaseSender = oneshot::Sender<oneshot::Sender<()>>;

/// One native wait on a wait connection; once granted, the task keeps the lock (and checks
/// the connection) until it is released.
struct WaitTask {
    claim: Claim,
    deadline: Option<Instant>,
    fencing: bool,
    keepalive: Duration,
    options: MySqlConnectOptions,
    server: ServerInfo,
    connect_timeout: Duration,
    pool: Arc<WaitPool>,
    killer: mpsc::UnboundedSender<LaneCommand>,
    lost: CancellationToken,
    // Held until the connection is back in the pool (or closed).
    _permit: tokio::sync::OwnedSemaphorePermit,
}

enum WaitOutcome {
    Granted,
    NotGranted,
    Abandoned,
}

impl WaitTask {
    async fn run(self, mut reply: WaitReply) {
        let mut wc = match self.reuse().await {
            Some(wc) => wc,
            None => match self.open().await {
                Ok(wc) => wc,
                Err(err) => {
                    let _ = reply.send(Err(err));
                    return;
                }
            },
        };
        match self.wait(&mut wc, &mut reply).await {
            Ok(WaitOutcome::Abandoned) => {
                // The server may grant the lock at any moment: end the session, and keep the
                // name claimed until it is gone.
                self.claim.settling();
                let (done, killed) = oneshot::channel();
                let kill = LaneCommand::Kill {
                    id: wc.id,
                    name: Arc::clone(&self.claim.name),
                    done,
                };
                if self.killer.send(kill).is_ok() {
                    let _ = killed.await;
                }
                // Closing the connection is what ends it if the kill could not be sent.
                drop(wc);
            }
            Ok(WaitOutcome::NotGranted) => {
                let _ = reply.send(Ok(None));
                self.pool.put(wc);
            }
            Ok(WaitOutcome::Granted) => {
                let token = if self.fencing {
                    match fence(&mut wc.conn, &self.claim.name).await {
                        Ok(token) => Some(token),
                        Err(err) => {
                            let _ = reply.send(Err(mysql_error("issuing a fencing token", err)));
                            self.give_back(wc).await;
                            return;
                        }
                    }
                } else {
                    None
                };
                let (release_tx, release_rx) = oneshot::channel();
                if reply.send(Ok(Some((token, release_tx)))).is_err() {
                    // Abandoned after the server granted it: give it back.
                    self.claim.settling();
                    self.give_back(wc).await;
                    return;
                }
                self.hold(wc, release_rx).await;
            }
            Err(err) => {
                // The connection's state is unknown: close it, which ends anything it held.
                let _ = reply.send(Err(err));
            }
        }
    }

    /// An idle wait connection that still answers, if there is one.
    async fn reuse(&self) -> Option<WaitConnection> {
        while let Some(mut wc) = self.pool.take() {
            if let Ok(Ok(())) = tokio::time::timeout(PING_TIMEOUT, wc.conn.ping()).await {
                return Some(wc);
            }
        }
        None
    }

    async fn open(&self) -> Result<WaitConnection, LockError> {
        let (conn, id) = open_connection(&self.options, &self.server, self.connect_timeout).await?;
        Ok(WaitConnection { conn, id })
    }

    /// Waits natively, in whole seconds where the server counts them so, then tries out
    /// what is left of the timeout.
    async fn wait(
        &self,
        wc: &mut WaitConnection,
        reply: &mut WaitReply,
    ) -> Result<WaitOutcome, LockError> {
        let name = &*self.claim.name;
        let fractional = self.server.fractional_waits();
        let mut pause = Duration::from_millis(2);
        loop {
            let remaining = self.deadline.map_or(Duration::MAX, |d| {
                d.saturating_duration_since(Instant::now())
            });
            let chunk = remaining.min(MAX_NATIVE_WAIT);
            let native = if fractional {
                !chunk.is_zero()
            } else {
                chunk.as_secs() > 0
            };
            let conn = &mut wc.conn;
            let statement = async {
                if native {
                    let query = sqlx::query_scalar::<_, Option<i64>>(WAIT_SQL).bind(name);
                    let query = if fractional {
                        query.bind(chunk.as_secs_f64())
                    } else {
                        query.bind(chunk.as_secs())
                    };
                    query.fetch_one(&mut *conn).await
                } else {
                    // Less than a second left on a whole-second server: a short pause, then a
                    // try (the last one at the deadline).
                    if !chunk.is_zero() {
                        tokio::time::sleep(pause.min(chunk)).await;
                    }
                    sqlx::query_scalar::<_, Option<i64>>(TRY_SQL)
                        .bind(name)
                        .fetch_one(&mut *conn)
                        .await
                }
            };
            let result = tokio::select! {
                result = statement => result,
                () = reply.closed() => return Ok(WaitOutcome::Abandoned),
            };
            match result {
                Ok(Some(1)) => return Ok(WaitOutcome::Granted),
                Ok(Some(_)) => {
                    if remaining.is_zero() {
                        return Ok(WaitOutcome::NotGranted);
                    }
                    pause = (pause * 2).min(Duration::from_millis(50));
                }
                Ok(None) => {
                    return Err(LockError::backend(
                        NAME,
                        "GET_LOCK answered NULL (an error on the server, such as the session being killed)",
                        None,
                        None,
                    ));
                }
                Err(err) if is_deadlock(&err) => {
                    return Err(deadlock_error(name, err));
                }
                Err(err) => return Err(mysql_error("waiting for a lock", err)),
            }
        }
    }

    /// Releases and returns the connection to the pool; closes it if that fails.
    async fn give_back(&self, mut wc: WaitConnection) {
        let release = sqlx::query(RELEASE_SQL)
            .bind(&*self.claim.name)
            .execute(&mut wc.conn);
        if let Ok(Ok(_)) = tokio::time::timeout(STATEMENT_TIMEOUT, release).await {
            self.pool.put(wc);
        }
    }

    async fn hold(
        self,
        mut wc: WaitConnection,
        mut release: oneshot::Receiver<oneshot::Sender<()>>,
    ) {
        let mut ticker = tokio::time::interval(self.keepalive);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        ticker.tick().await;
        loop {
            tokio::select! {
                done = &mut release => {
                    self.give_back(wc).await;
                    if let Ok(done) = done {
                        let _ = done.send(());
                    }
                    return;
                }
                _ = ticker.tick() => {
                    match tokio::time::timeout(PING_TIMEOUT, wc.conn.ping()).await {
                        Ok(Ok(())) => {}
                        _ => {
                            tracing::warn!(backend = NAME, "a wait connection failed its liveness check; its lock is lost");
                            self.lost.cancel();
                            return;
                        }
                    }
                }
            }
        }
    }
}

/// A lock held by a wait connection's task.
#[derive(Debug)]
struct WaitHeld {
    release: Option<ReleaseSender>,
}

impl HeldLock for WaitHeld {
    fn release(mut self: Box<Self>) -> BoxFuture<'static, Result<(), LockError>> {
        let release = self.release.take();
        Box::pin(async move {
            if let Some(release) = release {
                let (done, acknowledged) = oneshot::channel();
                if release.send(done).is_ok() {
                    let _ = acknowledged.await;
                }
            }
            Ok(())
        })
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

async fn create_fencing_table(conn: &mut MySqlConnection) -> Result<(), LockError> {
    match sqlx::query(FENCING_TABLE_SQL).execute(&mut *conn).await {
        Ok(_) => Ok(()),
        Err(e) if error_number(&e) == Some(1046) => Err(LockError::config(
            "fencing=true needs a database for its counter table dlock_fencing: name one in the URL, like mysql://user@host:3306/app",
        )),
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

fn lane_gone() -> LockError {
    LockError::unavailable(NAME, "the lock connection task has stopped", None)
}

/// Maps a driver error; messages name what was being done, never the URL.
fn mysql_error(what: &str, err: sqlx::Error) -> LockError {
    let number = error_number(&err);
    match &err {
        sqlx::Error::Database(db) => {
            let message = db.message().to_owned();
            match number {
                Some(1045 | 1698 | 1251) => LockError::config(format!(
                    "{what}: the server refused the credentials ({message}); check the user name and password in the URL"
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
    let mut fencing = false;
    let mut keepalive = DEFAULT_KEEPALIVE;
    let mut connect_timeout = DEFAULT_CONNECT_TIMEOUT;
    let mut connections = DEFAULT_CONNECTIONS;
    let mut wait_connections = DEFAULT_WAIT_CONNECTIONS;
    for (name, value) in query_pairs(query) {
        match name.as_str() {
            "fencing" => {
                fencing = match value.as_str() {
                    "true" | "1" | "yes" | "on" => true,
                    "false" | "0" | "no" | "off" => false,
                    _ => {
                        return Err(LockError::config(format!(
                            "option `fencing` has the value `{}`; write `true` or `false`",
                            crate::options::shown(&value)
                        )));
                    }
                }
            }
            "keepalive" => keepalive = parse_duration("keepalive", &value)?,
            "connect_timeout" => connect_timeout = parse_duration("connect_timeout", &value)?,
            "connections" => connections = parse_count("connections", &value)?,
            "wait_connections" => wait_connections = parse_count("wait_connections", &value)?,
            other if DRIVER_OPTIONS.contains(&other) => passthrough.push((name, value)),
            other => {
                let valid: Vec<&str> = OPTIONS.iter().chain(DRIVER_OPTIONS).copied().collect();
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
            OPTIONS.join(", ")
        ))
    })?;
    let builder = MySqlBuilder {
        options,
        fencing,
        keepalive,
        connect_timeout,
        connections,
        wait_connections,
    };
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

fn parse_count(option: &str, value: &str) -> Result<usize, LockError> {
    value.trim().parse().map_err(|_| {
        LockError::config(format!(
            "option `{option}` has the value `{}`, which is not a whole number",
            crate::options::shown(value)
        ))
    })
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
        assert!(b.fencing);
        assert_eq!(b.keepalive, Duration::from_millis(250));
        assert_eq!((b.connections, b.wait_connections), (2, 0));
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
