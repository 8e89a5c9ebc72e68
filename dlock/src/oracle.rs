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
//! Not issued: [`fencing_token`](crate::LockGuard::fencing_token) is `None`.
//!
//! # URL
//!
//! `oracle://user:password@host:port/service_name` (port 1521 by default; user and password
//! percent-decoded), connected as the Easy Connect string `//host:port/service_name` over TCP.
//! For TLS (TCPS) with a wallet, use [`OracleBackend::builder`] with an Easy Connect Plus string
//! (Oracle Client 19c and later) such as
//! `tcps://db.internal:2484/app?wallet_location=/etc/oracle/wallet&ssl_server_dn_match=on`, or
//! a `tnsnames.ora` alias whose `sqlnet.ora` names the wallet. The account needs
//! `CREATE SESSION` and `EXECUTE` on `SYS.DBMS_LOCK`, nothing else. (From Oracle's
//! documentation; not verified here, see the README.) Options:
//!
//! | option | default | meaning |
//! |---|---|---|
//! | `keepalive` | `5s` | liveness check cadence of sessions that hold locks |
//! | `connections` | `4` | lock sessions (1 to 64) |
//! | `wait_connections` | `4` | sessions for native waits (0 to 64) |
//! | `connect_timeout` | `10s` | how long opening a session may take |
//!
//! # Transaction-bound locks
//!
//! [`try_acquire_in_transaction`] and [`acquire_in_transaction`] call `DBMS_LOCK.REQUEST` with
//! `release_on_commit => TRUE` on the caller's own [`oracle::Connection`]: the lock ends with
//! the caller's next commit or rollback. They are blocking, like the `oracle` crate: call them
//! where you use that connection (inside `spawn_blocking` in async code).

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::LockError;
use crate::backend::BoxFuture;
use crate::options::{query_pairs, unknown_option};
use crate::session::{
    Connector, Failure, Grant as LaneGrant, LaneSettings, Lanes, Session, check_connect_timeout,
    lane_backend,
};

/// The `oracle` driver this module is built against, for the transaction-bound functions'
/// `Connection`.
pub use ::oracle as driver;

const NAME: &str = "oracle";

const DEFAULT_KEEPALIVE: Duration = Duration::from_secs(5);
const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
const DEFAULT_CONNECTIONS: usize = 4;
const DEFAULT_WAIT_CONNECTIONS: usize = 4;
const DEFAULT_PORT: u16 = 1521;

const URL_OPTIONS: &[&str] = &[
    "keepalive",
    "connections",
    "wait_connections",
    "connect_timeout",
];

/// `DBMS_LOCK.MAXWAIT`: a `timeout` of this many seconds waits without limit.
const MAXWAIT_SECS: i64 = 32767;

/// The highest id of the range `DBMS_LOCK` leaves to applications.
const MAX_USER_ID: i64 = 1_073_741_823;

/// `DBMS_LOCK.REQUEST` in exclusive mode, held by the session.
const REQUEST_SESSION_SQL: &str = "BEGIN :1 := DBMS_LOCK.REQUEST(id => :2, \
lockmode => DBMS_LOCK.X_MODE, timeout => :3, release_on_commit => FALSE); END;";

/// `DBMS_LOCK.REQUEST` in exclusive mode, released at commit or rollback.
const REQUEST_TRANSACTION_SQL: &str = "BEGIN :1 := DBMS_LOCK.REQUEST(id => :2, \
lockmode => DBMS_LOCK.X_MODE, timeout => :3, release_on_commit => TRUE); END;";

/// `DBMS_LOCK.RELEASE`.
const RELEASE_SQL: &str = "BEGIN :1 := DBMS_LOCK.RELEASE(id => :2); END;";

/// The liveness check (Oracle needs a `FROM`).
const KEEPALIVE_SQL: &str = "SELECT 1 FROM DUAL";

/// The `DBMS_LOCK` user-lock id of `key`: the low 30 bits of [`lock_id`](crate::lock_id),
/// in `0..=1073741823`. See the [module docs](self) for why, and for the collision odds.
///
/// ```
/// assert_eq!(dlock::oracle::dbms_lock_id("account:42"), 7645020056959376184_i64 as i32 & 0x3FFF_FFFF);
/// assert!((0..=1_073_741_823).contains(&dlock::oracle::dbms_lock_id("anything")));
/// ```
pub fn dbms_lock_id(key: &str) -> i32 {
    let id = crate::lock_id(key) & MAX_USER_ID;
    i32::try_from(id).unwrap_or(0)
}

// ---------------------------------------------------------------------------------------------
// Statements, as plain data.

/// A bound parameter, with the Oracle type it is bound as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Param {
    /// An OUT bind for the function's result, `NUMBER(10)`.
    OutNumber,
    /// An IN bind, `NUMBER` from a Rust `i64`.
    Number(i64),
}

/// One PL/SQL block and its parameters (`:1`, `:2`, ... in order).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Call {
    sql: &'static str,
    params: Vec<Param>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scope {
    Session,
    Transaction,
}

/// The `timeout` argument, in whole seconds (rounded up), for a wait of `wait`;
/// `Duration::MAX` and anything from `MAXWAIT` seconds up is `MAXWAIT` (no limit).
fn timeout_secs(wait: Duration) -> i64 {
    let secs = wait
        .as_secs()
        .saturating_add(u64::from(wait.subsec_nanos() > 0));
    i64::try_from(secs)
        .unwrap_or(MAXWAIT_SECS)
        .min(MAXWAIT_SECS)
}

fn request_call(id: i32, scope: Scope, timeout_secs: i64) -> Call {
    Call {
        sql: match scope {
            Scope::Session => REQUEST_SESSION_SQL,
            Scope::Transaction => REQUEST_TRANSACTION_SQL,
        },
        params: vec![
            Param::OutNumber,
            Param::Number(i64::from(id)),
            Param::Number(timeout_secs),
        ],
    }
}

fn release_call(id: i32) -> Call {
    Call {
        sql: RELEASE_SQL,
        params: vec![Param::OutNumber, Param::Number(i64::from(id))],
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Grant {
    /// 0.
    Granted,
    /// 1 (timeout) or 4 (this session already owns the id, for a key that shares it).
    NotGranted,
}

fn dbms_error(function: &str, code: i64, meaning: &str) -> LockError {
    LockError::backend(
        NAME,
        format!("DBMS_LOCK.{function} returned {code}: {meaning}"),
        Some(format!("DBMS_LOCK {code}")),
        None,
    )
}

fn request_result(code: Option<i64>) -> Result<Grant, LockError> {
    match code {
        Some(0) => Ok(Grant::Granted),
        Some(1 | 4) => Ok(Grant::NotGranted),
        Some(2) => Err(dbms_error(
            "REQUEST",
            2,
            "deadlock; the request was chosen to break it, retry the acquisition",
        )),
        Some(3) => Err(dbms_error("REQUEST", 3, "parameter error")),
        Some(5) => Err(dbms_error("REQUEST", 5, "illegal lock handle")),
        Some(other) => Err(dbms_error("REQUEST", other, "an unexpected return code")),
        None => Err(LockError::backend(
            NAME,
            "DBMS_LOCK.REQUEST returned no result",
            None,
            None,
        )),
    }
}

fn release_result(code: Option<i64>) -> Result<(), LockError> {
    match code {
        // 4: not owned any more; nothing to give back.
        Some(0 | 4) => Ok(()),
        Some(3) => Err(dbms_error("RELEASE", 3, "parameter error")),
        Some(5) => Err(dbms_error("RELEASE", 5, "illegal lock handle")),
        Some(other) => Err(dbms_error("RELEASE", other, "an unexpected return code")),
        None => Err(LockError::backend(
            NAME,
            "DBMS_LOCK.RELEASE returned no result",
            None,
            None,
        )),
    }
}

// ---------------------------------------------------------------------------------------------
// Driver errors.

/// Which kind of failure an Oracle error is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ErrorClass {
    /// DPI-1047: the client library could not be loaded.
    NoClient,
    /// No EXECUTE privilege on DBMS_LOCK.
    NoGrant,
    /// The server cannot be reached or the session is gone.
    Connection,
    /// Wrong user name or password.
    Login,
    /// Any other statement error; the session lives on.
    Statement,
}

/// Classifies an error by its text, which carries the `ORA-`, `PLS-` and `DPI-` codes.
fn classify(text: &str) -> ErrorClass {
    const CONNECTION: &[&str] = &[
        "ORA-03113",
        "ORA-03114",
        "ORA-03135",
        "ORA-01012",
        "ORA-00028",
        "ORA-02396",
        "ORA-12170",
        "ORA-12514",
        "ORA-12516",
        "ORA-12519",
        "ORA-12520",
        "ORA-12521",
        "ORA-12528",
        "ORA-12537",
        "ORA-12541",
        "ORA-12543",
        "ORA-12545",
        "ORA-12547",
        "ORA-12571",
        "ORA-01033",
        "ORA-01034",
        "ORA-01089",
        "ORA-01092",
        "DPI-1010",
        "DPI-1080",
        "DPI-1067",
    ];
    if text.contains("DPI-1047") {
        ErrorClass::NoClient
    } else if text.contains("PLS-00201") && text.to_ascii_uppercase().contains("DBMS_LOCK")
        || text.contains("ORA-01031")
    {
        ErrorClass::NoGrant
    } else if text.contains("ORA-01017") || text.contains("ORA-28000") || text.contains("ORA-28001")
    {
        ErrorClass::Login
    } else if CONNECTION.iter().any(|code| text.contains(code)) {
        ErrorClass::Connection
    } else {
        ErrorClass::Statement
    }
}

/// The first `ORA-nnnnn` (or `PLS-`/`DPI-`) code in an error text.
fn oracle_code(text: &str) -> Option<String> {
    ["ORA-", "PLS-", "DPI-"].iter().find_map(|prefix| {
        let start = text.find(prefix)?;
        let code: String = text
            .get(start..)?
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
            .collect();
        (code.len() > prefix.len()).then_some(code)
    })
}

/// Maps an error's text while doing `what` to a failure.
fn map_error_text(what: &str, text: &str) -> Failure {
    match classify(text) {
        ErrorClass::NoClient => Failure::connection(LockError::config(format!(
            "{what}: the Oracle client library could not be loaded (DPI-1047). Install Oracle \
             Instant Client (the Basic or Basic Light package) and make it findable: on Linux add \
             its directory to LD_LIBRARY_PATH or register it with ldconfig; on macOS put it in \
             ~/lib or /usr/local/lib; on Windows add it to PATH. Driver message: {text}"
        ))),
        ErrorClass::NoGrant => Failure::statement(LockError::backend(
            NAME,
            format!(
                "{what}: the user may not call DBMS_LOCK; have a DBA run \
                 `GRANT EXECUTE ON SYS.DBMS_LOCK TO <user>`. Server message: {text}"
            ),
            oracle_code(text),
            None,
        )),
        ErrorClass::Login => Failure::connection(LockError::backend(
            NAME,
            format!("{what}: login refused; check the user name and password ({text})"),
            oracle_code(text),
            None,
        )),
        ErrorClass::Connection => Failure::connection(LockError::unavailable(
            NAME,
            format!("{what}: the Oracle server cannot be reached or the session ended: {text}"),
            None,
        )),
        ErrorClass::Statement => Failure::statement(LockError::backend(
            NAME,
            format!("{what}: {text}"),
            oracle_code(text),
            None,
        )),
    }
}

fn map_error(what: &str, err: &oracle::Error) -> Failure {
    map_error_text(what, &err.to_string())
}

fn join_failure(what: &str) -> Failure {
    Failure::connection(LockError::unavailable(
        NAME,
        format!("{what}: the blocking Oracle call did not finish (runtime shutting down?)"),
        None,
    ))
}

// ---------------------------------------------------------------------------------------------
// Running calls (blocking).

fn run_call(conn: &oracle::Connection, call: &Call) -> Result<Option<i64>, oracle::Error> {
    let out_type = oracle::sql_type::OracleType::Number(10, 0);
    let values: Vec<&dyn oracle::sql_type::ToSql> = call
        .params
        .iter()
        .map(|param| match param {
            Param::OutNumber => &out_type as &dyn oracle::sql_type::ToSql,
            Param::Number(number) => number as &dyn oracle::sql_type::ToSql,
        })
        .collect();
    let mut statement = conn.statement(call.sql).build()?;
    statement.execute(&values)?;
    statement.bind_value::<usize, Option<i64>>(1)
}

fn ping(conn: &oracle::Connection) -> Result<(), oracle::Error> {
    conn.query_row_as::<i64>(KEEPALIVE_SQL, &[]).map(drop)
}

// ---------------------------------------------------------------------------------------------
// Sessions.

struct OracleConnector {
    user: String,
    password: String,
    connect_string: String,
    connect_timeout: Duration,
}

impl Connector for OracleConnector {
    type Resource = OracleResource;
    type Session = OracleSession;

    const NAME: &'static str = NAME;
    const MAX_WAIT: Duration = Duration::from_secs(MAXWAIT_SECS as u64 - 1);

    fn wait_resolution(&self) -> Duration {
        Duration::from_secs(1)
    }

    fn resource(&self, key: &str) -> OracleResource {
        OracleResource {
            id: dbms_lock_id(key),
        }
    }

    fn open(&self) -> BoxFuture<'_, Result<OracleSession, LockError>> {
        let (user, password, connect_string) = (
            self.user.clone(),
            self.password.clone(),
            self.connect_string.clone(),
        );
        let timeout = self.connect_timeout;
        Box::pin(async move {
            let opening = tokio::task::spawn_blocking(move || {
                oracle::Connector::new(user, password, connect_string).connect()
            });
            match tokio::time::timeout(timeout, opening).await {
                Ok(Ok(Ok(conn))) => Ok(OracleSession {
                    conn: Arc::new(conn),
                }),
                Ok(Ok(Err(err))) => Err(map_error("connecting to Oracle", &err).error),
                Ok(Err(_)) => Err(join_failure("connecting to Oracle").error),
                Err(_) => Err(LockError::unavailable(
                    NAME,
                    format!(
                        "connecting to Oracle did not complete within connect_timeout {timeout:?}"
                    ),
                    None,
                )),
            }
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct OracleResource {
    id: i32,
}

/// One session. The connection is shared with the blocking call in flight, so an abandoned
/// wait can be interrupted from another thread and the session closes when both let go.
struct OracleSession {
    conn: Arc<oracle::Connection>,
}

impl OracleSession {
    async fn blocking<T, F>(&self, what: &'static str, f: F) -> Result<T, Failure>
    where
        T: Send + 'static,
        F: FnOnce(&oracle::Connection) -> Result<T, oracle::Error> + Send + 'static,
    {
        let conn = Arc::clone(&self.conn);
        match tokio::task::spawn_blocking(move || f(&conn)).await {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(err)) => Err(map_error(what, &err)),
            Err(_) => Err(join_failure(what)),
        }
    }
}

impl Session for OracleSession {
    type Resource = OracleResource;
    type Interrupt = std::convert::Infallible;

    fn lock<'a>(
        &'a mut self,
        resource: &'a OracleResource,
        wait: Duration,
    ) -> BoxFuture<'a, Result<Option<LaneGrant>, Failure>> {
        let call = request_call(resource.id, Scope::Session, timeout_secs(wait));
        Box::pin(async move {
            let code = self
                .blocking("taking a lock", move |conn| run_call(conn, &call))
                .await?;
            if code == Some(4) && !wait.is_zero() {
                // Wait sessions hold nothing while they wait, so this cannot happen; answering
                // it as contention would make the wait spin on the server.
                return Err(Failure::statement(dbms_error(
                    "REQUEST",
                    4,
                    "the waiting session already owns this lock id",
                )));
            }
            match request_result(code) {
                Ok(Grant::Granted) => Ok(Some(LaneGrant::PLAIN)),
                Ok(Grant::NotGranted) => Ok(None),
                Err(error) => Err(Failure::statement(error)),
            }
        })
    }

    fn unlock<'a>(
        &'a mut self,
        resource: &'a OracleResource,
    ) -> BoxFuture<'a, Result<(), Failure>> {
        let call = release_call(resource.id);
        Box::pin(async move {
            let code = self
                .blocking("releasing a lock", move |conn| run_call(conn, &call))
                .await?;
            release_result(code).map_err(Failure::statement)
        })
    }

    fn ping(&mut self) -> BoxFuture<'_, Result<(), Failure>> {
        Box::pin(self.blocking("checking a session", ping))
    }

    fn interrupt(&self, _resource: &OracleResource) -> Option<std::convert::Infallible> {
        let conn = Arc::clone(&self.conn);
        drop(tokio::task::spawn_blocking(move || {
            let _ = conn.break_execution();
        }));
        None
    }
}

// ---------------------------------------------------------------------------------------------
// Backend.

/// The Oracle backend. Made by [`LockProvider::connect`](crate::LockProvider::connect) with an
/// `oracle://` URL, or by [`OracleBackend::builder`]. See the [module docs](self).
#[derive(Clone)]
pub struct OracleBackend {
    lanes: Arc<Lanes<OracleConnector>>,
    connect_string: String,
}

/// Builds an [`OracleBackend`] with options.
#[derive(Clone)]
#[must_use]
pub struct OracleBuilder {
    user: String,
    password: String,
    connect_string: String,
    connect_timeout: Duration,
    settings: LaneSettings,
}

impl std::fmt::Debug for OracleBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OracleBuilder")
            .field("user", &self.user)
            .field("connect_string", &self.connect_string)
            .field("connect_timeout", &self.connect_timeout)
            .field("keepalive", &self.settings.keepalive)
            .field("connections", &self.settings.connections)
            .field("wait_connections", &self.settings.wait_connections)
            .finish_non_exhaustive()
    }
}

impl OracleBuilder {
    /// How often sessions that hold locks are checked (default 5 s, at least 10 ms).
    pub fn keepalive(mut self, keepalive: Duration) -> Self {
        self.settings.keepalive = keepalive;
        self
    }

    /// How long opening a session may take (default 10 s). The driver cannot be interrupted
    /// while it connects: an attempt that outlives the timeout finishes on its blocking thread
    /// and the session is closed at once.
    pub fn connect_timeout(mut self, connect_timeout: Duration) -> Self {
        self.connect_timeout = connect_timeout;
        self
    }

    /// The number of lock sessions (default 4, 1 to 64).
    pub fn connections(mut self, connections: usize) -> Self {
        self.settings.connections = connections;
        self
    }

    /// The most sessions used for native waits at once (default 4, 0 to 64; 0 makes waits
    /// poll instead).
    pub fn wait_connections(mut self, wait_connections: usize) -> Self {
        self.settings.wait_connections = wait_connections;
        self
    }

    /// Opens the first lock session (so a missing client library, a wrong address or password
    /// is reported here) and starts the backend. Must run inside a Tokio runtime.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a session still opening on a blocking thread is closed as soon as it opens.
    pub async fn open(self) -> Result<OracleBackend, LockError> {
        self.check()?;
        let connect_string = self.connect_string.clone();
        let connector = OracleConnector {
            user: self.user,
            password: self.password,
            connect_string: self.connect_string,
            connect_timeout: self.connect_timeout,
        };
        let lanes = Lanes::open(connector, self.settings).await?;
        Ok(OracleBackend {
            lanes: Arc::new(lanes),
            connect_string,
        })
    }

    fn check(&self) -> Result<(), LockError> {
        check_connect_timeout(self.connect_timeout)?;
        self.settings.check()
    }
}

impl OracleBackend {
    /// A builder for `user` / `password` at `connect_string` (an Easy Connect string such as
    /// `//db.internal:1521/FREEPDB1`, or a TNS alias).
    pub fn builder(
        user: impl Into<String>,
        password: impl Into<String>,
        connect_string: impl Into<String>,
    ) -> OracleBuilder {
        OracleBuilder {
            user: user.into(),
            password: password.into(),
            connect_string: connect_string.into(),
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            settings: LaneSettings {
                connections: DEFAULT_CONNECTIONS,
                wait_connections: DEFAULT_WAIT_CONNECTIONS,
                keepalive: DEFAULT_KEEPALIVE,
            },
        }
    }

    /// Parses an `oracle://` URL with the options of the [module docs](self) into a builder,
    /// without connecting.
    pub fn builder_from_url(url: &str) -> Result<OracleBuilder, LockError> {
        parse_url(url)
    }

    /// Connects with an `oracle://` URL.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe, as [`OracleBuilder::open`].
    pub async fn connect(url: &str) -> Result<OracleBackend, LockError> {
        parse_url(url)?.open().await
    }

    /// The liveness check cadence.
    pub fn keepalive(&self) -> Duration {
        self.lanes.settings().keepalive
    }
}

impl std::fmt::Debug for OracleBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OracleBackend")
            .field("connect_string", &self.connect_string)
            .field("lanes", &self.lanes)
            .finish()
    }
}

lane_backend!(OracleBackend, NAME);

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
pub fn try_acquire_in_transaction(conn: &oracle::Connection, key: &str) -> Result<(), LockError> {
    acquire_in_transaction(conn, key, Duration::ZERO)
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
) -> Result<(), LockError> {
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
            Grant::Granted => return Ok(()),
            // 4: this session already owns the id (the same key, or one sharing its id).
            Grant::NotGranted if last || code == Some(4) => return Err(contention(key, timeout)),
            Grant::NotGranted => {}
        }
    }
}

fn contention(key: &str, timeout: Duration) -> LockError {
    if timeout.is_zero() {
        LockError::AlreadyHeld { key: key.into() }
    } else {
        LockError::Timeout {
            key: key.into(),
            timeout,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// URL.

fn parse_url(url: &str) -> Result<OracleBuilder, LockError> {
    let parsed = url::Url::parse(url).map_err(|err| {
        LockError::config(format!(
            "the Oracle URL is malformed ({err}); expected oracle://user:password@host:port/service_name"
        ))
    })?;
    if parsed.scheme() != "oracle" {
        return Err(LockError::config("an Oracle URL starts with oracle://"));
    }
    let host = match parsed.host_str() {
        Some(host) if !host.is_empty() => host.to_owned(),
        _ => {
            return Err(LockError::config(
                "the Oracle URL has no host; expected oracle://user:password@host:port/service_name",
            ));
        }
    };
    let bad = |what: &str| {
        LockError::config(format!(
            "the {what} in the Oracle URL is not valid percent-encoded UTF-8"
        ))
    };
    let user = percent_decode(parsed.username()).ok_or_else(|| bad("user name"))?;
    let password =
        percent_decode(parsed.password().unwrap_or("")).ok_or_else(|| bad("password"))?;
    if user.is_empty() {
        return Err(LockError::config(
            "the Oracle URL has no user name; expected oracle://user:password@host:port/service_name",
        ));
    }
    let service =
        percent_decode(parsed.path().trim_start_matches('/')).ok_or_else(|| bad("service name"))?;
    if service.contains('/') {
        return Err(LockError::config(
            "the Oracle URL's path must be just the service name",
        ));
    }
    let port = parsed.port().unwrap_or(DEFAULT_PORT);
    let connect_string = if service.is_empty() {
        format!("//{host}:{port}")
    } else {
        format!("//{host}:{port}/{service}")
    };
    let mut builder = OracleBackend::builder(user, password, connect_string);
    for (name, value) in query_pairs(parsed.query().unwrap_or("")) {
        builder = match name.as_str() {
            "keepalive" => builder.keepalive(crate::parse_duration("keepalive", &value)?),
            "connect_timeout" => {
                builder.connect_timeout(crate::parse_duration("connect_timeout", &value)?)
            }
            "connections" => builder.connections(parse_count("connections", &value)?),
            "wait_connections" => {
                builder.wait_connections(parse_count("wait_connections", &value)?)
            }
            other => return Err(unknown_option("Oracle", other, URL_OPTIONS)),
        };
    }
    builder.check()?;
    Ok(builder)
}

fn parse_count(option: &str, value: &str) -> Result<usize, LockError> {
    value.parse().map_err(|_| {
        LockError::config(format!(
            "option `{option}` has the value `{}`, which is not a count",
            crate::options::shown(value)
        ))
    })
}

/// Percent-decodes `text` (`+` stays `+`); `None` when the result is not UTF-8.
fn percent_decode(text: &str) -> Option<String> {
    crate::options::percent_decode(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_statements_and_parameters() {
        let call = request_call(123, Scope::Session, 0);
        assert_eq!(
            call.sql,
            "BEGIN :1 := DBMS_LOCK.REQUEST(id => :2, lockmode => DBMS_LOCK.X_MODE, \
             timeout => :3, release_on_commit => FALSE); END;"
        );
        assert_eq!(
            call.params,
            vec![Param::OutNumber, Param::Number(123), Param::Number(0)]
        );
        let call = request_call(7, Scope::Transaction, 5);
        assert_eq!(
            call.sql,
            "BEGIN :1 := DBMS_LOCK.REQUEST(id => :2, lockmode => DBMS_LOCK.X_MODE, \
             timeout => :3, release_on_commit => TRUE); END;"
        );
        assert_eq!(
            call.params,
            vec![Param::OutNumber, Param::Number(7), Param::Number(5)]
        );
    }

    #[test]
    fn release_and_keepalive_statements() {
        let call = release_call(42);
        assert_eq!(call.sql, "BEGIN :1 := DBMS_LOCK.RELEASE(id => :2); END;");
        assert_eq!(call.params, vec![Param::OutNumber, Param::Number(42)]);
        assert_eq!(KEEPALIVE_SQL, "SELECT 1 FROM DUAL");
    }

    #[test]
    fn timeouts_in_seconds() {
        assert_eq!(timeout_secs(Duration::ZERO), 0);
        assert_eq!(timeout_secs(Duration::from_millis(1)), 1);
        assert_eq!(timeout_secs(Duration::from_millis(1000)), 1);
        assert_eq!(timeout_secs(Duration::from_millis(1001)), 2);
        assert_eq!(timeout_secs(Duration::from_secs(32766)), 32766);
        assert_eq!(timeout_secs(Duration::from_secs(40000)), MAXWAIT_SECS);
        assert_eq!(timeout_secs(Duration::MAX), MAXWAIT_SECS);
        assert_eq!(
            timeout_secs(<OracleConnector as Connector>::MAX_WAIT),
            MAXWAIT_SECS - 1
        );
    }

    #[test]
    fn ids_are_pinned_and_in_the_user_range() {
        // Low 30 bits of lock_id, whose own vectors are pinned in the key module.
        assert_eq!(
            i64::from(dbms_lock_id("account:42")),
            7645020056959376184_i64 & 0x3FFF_FFFF
        );
        assert_eq!(
            i64::from(dbms_lock_id("jobs:recurring-monthly-billing")),
            -4568809572337086091_i64 & 0x3FFF_FFFF
        );
        for key in ["a", "A", "\0", "ключ", &"x".repeat(5000)] {
            assert!((0..=1_073_741_823).contains(&dbms_lock_id(key)), "{key:?}");
        }
        assert_ne!(dbms_lock_id("a"), dbms_lock_id("A"));
    }

    #[test]
    fn every_request_code() {
        assert_eq!(request_result(Some(0)).unwrap(), Grant::Granted);
        assert_eq!(request_result(Some(1)).unwrap(), Grant::NotGranted);
        assert_eq!(request_result(Some(4)).unwrap(), Grant::NotGranted);
        for (code, words) in [
            (2, "deadlock"),
            (3, "parameter error"),
            (5, "illegal lock handle"),
            (9, "unexpected"),
        ] {
            let err = request_result(Some(code)).unwrap_err();
            assert_eq!(err.code(), "DistributedLock.BackendError");
            assert_eq!(err.db_code(), Some(format!("DBMS_LOCK {code}").as_str()));
            let text = err.to_string();
            assert!(text.contains(&format!("returned {code}")), "{text}");
            assert!(text.contains(words), "{text}");
        }
        assert!(request_result(None).is_err());
    }

    #[test]
    fn every_release_code() {
        assert!(release_result(Some(0)).is_ok());
        assert!(release_result(Some(4)).is_ok());
        for code in [3, 5, 8] {
            let err = release_result(Some(code)).unwrap_err();
            assert_eq!(err.db_code(), Some(format!("DBMS_LOCK {code}").as_str()));
        }
        assert!(release_result(None).is_err());
    }

    #[test]
    fn server_errors() {
        let no_client = map_error_text(
            "connecting to Oracle",
            "DPI Error: DPI-1047: Cannot locate a 64-bit Oracle Client library: \"libclntsh.so: \
             cannot open shared object file: No such file or directory\"",
        );
        assert!(!no_client.connection_ok);
        assert_eq!(no_client.error.code(), "DistributedLock.Configuration");
        let text = no_client.error.to_string();
        assert!(text.contains("Oracle Instant Client"), "{text}");
        assert!(text.contains("LD_LIBRARY_PATH"), "{text}");

        let no_grant = map_error_text(
            "taking a lock",
            "OCI Error: ORA-06550: line 1, column 14:\nPLS-00201: identifier 'DBMS_LOCK' must be \
             declared\nORA-06550: line 1, column 7:\nPL/SQL: Statement ignored",
        );
        assert!(no_grant.connection_ok);
        assert!(
            no_grant
                .error
                .to_string()
                .contains("GRANT EXECUTE ON SYS.DBMS_LOCK TO <user>")
        );
        assert_eq!(no_grant.error.db_code(), Some("ORA-06550"));

        let login = map_error_text(
            "connecting to Oracle",
            "OCI Error: ORA-01017: invalid username/password; logon denied",
        );
        assert!(
            login
                .error
                .to_string()
                .contains("check the user name and password")
        );
        assert_eq!(login.error.db_code(), Some("ORA-01017"));

        for gone in [
            "OCI Error: ORA-12541: TNS:no listener",
            "OCI Error: ORA-03113: end-of-file on communication channel",
            "DPI Error: DPI-1080: connection was closed by ORA-3113",
            "OCI Error: ORA-00028: your session has been killed",
        ] {
            let failure = map_error_text("taking a lock", gone);
            assert!(!failure.connection_ok, "{gone}");
            assert_eq!(
                failure.error.code(),
                "DistributedLock.Unavailable",
                "{gone}"
            );
        }

        let other = map_error_text(
            "taking a lock",
            "OCI Error: ORA-00942: table or view does not exist",
        );
        assert!(other.connection_ok);
        assert_eq!(other.error.db_code(), Some("ORA-00942"));
    }

    #[test]
    fn urls() {
        let b = parse_url(
            "oracle://app%40x:p%40ss+w@db.internal:1522/FREEPDB1?keepalive=1s&connections=2\
             &wait_connections=0&connect_timeout=3s",
        )
        .unwrap();
        assert_eq!(b.user, "app@x");
        assert_eq!(b.password, "p@ss+w");
        assert_eq!(b.connect_string, "//db.internal:1522/FREEPDB1");
        assert_eq!(b.settings.keepalive, Duration::from_secs(1));
        assert_eq!(b.settings.connections, 2);
        assert_eq!(b.settings.wait_connections, 0);
        assert_eq!(b.connect_timeout, Duration::from_secs(3));
        let b = parse_url("oracle://u:p@[::1]/svc").unwrap();
        assert_eq!(b.connect_string, "//[::1]:1521/svc");
        assert_eq!(b.settings.connections, 4);
        let b = parse_url("oracle://u:p@h").unwrap();
        assert_eq!(b.connect_string, "//h:1521");
        assert!(!format!("{b:?}").contains("\"p\""));
    }

    #[test]
    fn url_errors_never_show_the_password() {
        for case in [
            "oracle://app:hunter2@db/x?bogus=1",
            "oracle://app:hunter2@db/x?keepalive=soon",
            "oracle://app:hunter2@db/x?connections=0",
            "oracle://app:hunter2@db/x?wait_connections=99",
            "oracle://app:hunter2@db/x?connect_timeout=0",
            "oracle://app:hunter2@db/x?connect_timeout=10000000000000000s",
            "oracle://app:hunter2@db/x?keepalive=10000000000000000s",
            "oracle://:hunter2@db/x",
            "oracle://app:hunter2@/x",
            "oracle://app:hunter2@db/x/y",
            "oracle://app:hunter2%FF@db/x",
            "mssql://app:hunter2@db/x",
        ] {
            let err = parse_url(case).unwrap_err();
            assert_eq!(err.code(), "DistributedLock.Configuration", "{case}");
            assert!(!err.to_string().contains("hunter2"), "{case}: {err}");
        }
    }

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
