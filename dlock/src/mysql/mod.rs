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
//! [`MySqlPool`](sqlx::MySqlPool) the application already has; it never takes connections from that pool):
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
//! processes and server restarts. Fencing needs a database in the URL, and every process
//! that locks a key must name the same one: `GET_LOCK` names are the server's, so processes
//! whose URLs name other databases share the lock but count its tokens in their own tables,
//! and those are not ordered with each other.
//!
//! # Read locks
//!
//! None: [`try_acquire_read`](crate::LockProvider::try_acquire_read) and
//! [`acquire_read`](crate::LockProvider::acquire_read) answer
//! [`LockError::Unsupported`]. `GET_LOCK` has one mode (a user
//! lock is held by one session at a time), and a sound reader-writer lock built on it would
//! need extra tables or sessions per key. Use the exclusive lock, or PostgreSQL, SQL Server or
//! Oracle for read locks.
//!
//! # Semaphores
//!
//! The backend keeps semaphores itself ([`LockBackend::semaphores`](crate::backend::LockBackend::semaphores)):
//! a permit is a user lock of a lock connection, like a lock, and a try is **one statement**.
//!
//! - **Slots.** The semaphore `key` of `n` permits is the user locks
//!   [`semaphore_slot_name`]`(key, 0)` to `(key, n - 1)`: `#sem#`, 32 hex digits of SHA-256 of
//!   the key, `#`, the slot (never a lock's name, which has at most one `#`).
//! - **One try.** A recursive CTE walks the slots from a random one on, one `GET_LOCK(name, 0)`
//!   per iteration; the server evaluates each step from a row whose slot was not taken, so a
//!   try takes at most one slot (`tests/mysql.rs` pins it on both servers). A slot this session
//!   holds already is skipped (`IS_USED_LOCK(name) = CONNECTION_ID()`: the server would let a
//!   session take its own user lock again, and a lock connection is shared by every
//!   acquisition of the backend). A single try takes nothing while any session holds the
//!   semaphore's queue lock
//!   ([`PermitRequest::queue_key`](crate::backend::PermitRequest::queue_key)): the waiter at
//!   the head of the queue polls for the permit.
//! - **Bound.** The server cannot count the held slots, so a try that finds the semaphore full
//!   has asked for every slot (in one statement, about 10 µs of the server's time per slot):
//!   `max_count` is at most **1,024** here, and a larger one is a [`LockError::Config`]
//!   naming the bound. The lock connections set `cte_max_recursion_depth` (MySQL) or
//!   `max_recursive_iterations` (MariaDB) to 1,025 for their session, which needs no
//!   privilege. Servers without recursive CTEs (before MySQL 8.0.3, MariaDB 10.2.2) keep the
//!   provider's slot scheme.
//! - **No count record.** User locks have no shared mode and cannot be listed without
//!   privileges this backend does not ask for (`performance_schema`), so the semaphore's
//!   count cannot be recorded soundly
//!   ([`keeps_count_record`](crate::backend::PermitStore::keeps_count_record) is `false`):
//!   a try with another count is not refused, and callers that disagree share the slots of
//!   the largest count in use (never more holders than that). Give every holder of a
//!   semaphore the same `max_count`; PostgreSQL, SQL Server and Oracle refuse another.
//! - **Release, loss, fencing.** A release is `RELEASE_LOCK` of the slot; a permit ends with
//!   its connection and is reported lost with it. With `fencing=true`, the semaphore's
//!   counter (`dlock_fencing` row `#sem#` and the 32 hex digits) is incremented after the
//!   grant (one statement more, as for locks).
//!
//! A statement that fails after it may have taken a slot drops its connection (the server
//! frees the slot with the session).
//!
//! # Store inspection
//!
//! [`store_locks`](crate::LockProvider::store_locks) reads the user locks granted now from
//! `performance_schema.metadata_locks`, on a connection of its own, with the holding
//! session's `program_name` connect attribute as the owner (dlock's own sessions send none:
//! its driver sets no connect attributes). A lock whose name is its key is named by it; a
//! hashed name is named by its key when the listing provider holds it, and otherwise shown
//! by its server name; semaphore slots are listed by their names (`#sem#…`). It needs `SELECT`
//! on `performance_schema`, `performance_schema=ON` (MariaDB's default is off) and the
//! metadata lock instrument `wait/lock/metadata/sql/mdl` on (MySQL's default); without them
//! it answers [`LockError::Unsupported`] saying which is missing. Locking needs none of it.
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
//! The driver speaks TLS with rustls and aws-lc-rs. Verify the server: `ssl-mode=VERIFY_IDENTITY`
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
//! | `statement_timeout` | `10s` | the most one short statement (a try, a release) may take before its connection is dropped and its locks reported lost (10 ms to 365 days) |
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

mod session;
mod statements;
mod url;

use std::time::Duration;

use sqlx::mysql::{MySqlConnectOptions, MySqlConnection};

use crate::LockError;
use crate::backend::BoxFuture;
use crate::key::validate_key;
use crate::session::{Dial, Driver, Opened, SessionBackend, SessionBuilder, SessionOptions};
use crate::sqlx_engine::SqlxEngine;
use session::{MySqlConnector, create_fencing_table, open_connection};
use statements::NAME;
pub use statements::{semaphore_slot_name, server_lock_name};

/// The MySQL / MariaDB engine: the type parameter of [`MySqlBackend`] and [`MySqlBuilder`].
#[derive(Debug, Clone, Copy)]
pub enum MySql {}

/// The MySQL / MariaDB backend. Made by [`LockProvider::connect`](crate::LockProvider::connect)
/// with a `mysql://` or `mariadb://` URL, by [`MySqlBackend::new`] from an existing pool, or by
/// [`MySqlBackend::builder`]. See the [module docs](self).
pub type MySqlBackend = SessionBackend<MySql>;

/// Builds a [`MySqlBackend`] with options.
pub type MySqlBuilder = SessionBuilder<MySql>;

impl Driver for MySql {
    const BACKEND: &'static str = "MySqlBackend";
    const BUILDER: &'static str = "MySqlBuilder";

    type Target = MySqlConnectOptions;
    type Connector = MySqlConnector;

    fn parse_url(url: &str) -> Result<(MySqlConnectOptions, SessionOptions), LockError> {
        url::parse_url(url)
    }

    fn open(
        options: MySqlConnectOptions,
        session: &SessionOptions,
    ) -> BoxFuture<'static, Opened<Self>> {
        let dial = Dial::new(options, session);
        let refused = crate::session::refuse_fencing_counters(NAME, session);
        Box::pin(async move {
            refused?;
            let (mut conn, id, server) =
                open_connection(&dial.target, dial.connect_timeout).await?;
            if dial.fencing {
                create_fencing_table(&mut conn).await?;
            }
            let connector = MySqlConnector { dial, server };
            let first = connector.session(conn, id);
            Ok((connector, first))
        })
    }

    fn fmt_target(options: &MySqlConnectOptions, f: &mut std::fmt::DebugStruct<'_, '_>) {
        // The connect options carry the password: show only where they point.
        f.field("host", &options.get_host())
            .field("port", &options.get_port());
    }
}

impl SqlxEngine for MySql {
    type Database = sqlx::MySql;
}

impl SessionBackend<MySql> {
    /// The server's version string, as `VERSION()` answered when the backend opened.
    pub fn server_version(&self) -> &str {
        &self.connector().server.version
    }

    /// Whether the server is MariaDB (rather than MySQL).
    pub fn is_mariadb(&self) -> bool {
        self.connector().server.mariadb
    }
}

// ---------------------------------------------------------------------------------------------
// Transaction-bound locks.

pub use crate::TransactionLock;

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
