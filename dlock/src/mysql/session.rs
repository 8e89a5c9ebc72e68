//! What the session engine runs on a MySQL or MariaDB connection.

use std::sync::Arc;
use std::time::Duration;

use sqlx::error::DatabaseError;
use sqlx::mysql::{MySqlConnectOptions, MySqlConnection, MySqlDatabaseError};
use sqlx::{Connection, Row};

use super::MySql;
use super::statements::*;
use crate::backend::BoxFuture;
use crate::session::{Connector, Dial, Failure, Grant, Mode, PermitAnswer, PermitCount, Session};
use crate::sqlx_engine::{
    SqlxErrors, connect_within, driver_error, failure, ping, settle, settle_pauses,
};
use crate::{LockError, StoreLock};

/// What the first connection learned about the server.
#[derive(Debug, Clone)]
pub(super) struct ServerInfo {
    pub(super) version: String,
    pub(super) mariadb: bool,
    /// Whether the server has recursive CTEs (MySQL 8.0.3 and later, MariaDB 10.2.2 and
    /// later), which a permit's walk is.
    pub(super) walks: bool,
}

impl ServerInfo {
    pub(super) fn new(version: String) -> Self {
        let mariadb = version.to_ascii_lowercase().contains("mariadb");
        let walks = if mariadb {
            version_numbers(&version) >= (10, 2, 2)
        } else {
            version_numbers(&version) >= (8, 0, 3)
        };
        ServerInfo {
            version,
            mariadb,
            walks,
        }
    }

    /// Whether `GET_LOCK` honours fractional seconds. MariaDB does; MySQL rounds to whole
    /// seconds, so the backend waits whole seconds there and tries out the rest.
    fn fractional_waits(&self) -> bool {
        self.mariadb
    }

    fn session_sql(&self) -> &'static str {
        match (self.mariadb, self.walks) {
            (true, true) => MARIADB_WALK_SESSION_SQL,
            (true, false) => MARIADB_SESSION_SQL,
            (false, true) => MYSQL_WALK_SESSION_SQL,
            (false, false) => MYSQL_SESSION_SQL,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Sessions: what the shared connection machinery runs on a MySQL connection.

/// Opens lock and wait connections.
#[derive(Debug)]
pub struct MySqlConnector {
    pub(super) dial: Dial<MySql>,
    pub(super) server: ServerInfo,
}

impl MySqlConnector {
    pub(super) fn session(&self, conn: MySqlConnection, id: u64) -> MySqlSession {
        MySqlSession {
            conn,
            id,
            fencing: self.dial.fencing,
            fractional: self.server.fractional_waits(),
        }
    }
}

/// A semaphore: its slots' name prefix (without its last `#`, the name of its fencing counter),
/// its count and its queue lock's name.
#[derive(Debug, Clone)]
pub struct MySqlSemaphore {
    prefix: Arc<str>,
    count: u32,
    queue: Arc<str>,
}

impl Connector for MySqlConnector {
    /// The server lock name.
    type Resource = Arc<str>;
    type Semaphore = MySqlSemaphore;
    type Session = MySqlSession;
    const MAX_PERMITS: u32 = MAX_PERMITS;

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

    fn semaphore(&self, key: &str, max_count: u32, queue: Arc<str>) -> MySqlSemaphore {
        MySqlSemaphore {
            prefix: Arc::from(semaphore_prefix(key)),
            count: max_count,
            queue,
        }
    }

    /// Servers without recursive CTEs (MySQL 5.7, MariaDB 10.1) keep semaphores as slot
    /// locks of the provider.
    fn keeps_permits(&self) -> bool {
        self.server.walks
    }

    /// User locks have no shared mode, and cannot be listed without privileges the backend
    /// does not ask for (`performance_schema`): no sound record of a semaphore's count can be
    /// kept (see the module docs, Semaphores).
    fn keeps_count_record(&self) -> bool {
        false
    }

    fn shared_locks(&self) -> Result<(), LockError> {
        Err(no_shared_locks())
    }

    fn open(&self) -> BoxFuture<'_, Result<MySqlSession, LockError>> {
        Box::pin(async move {
            let (conn, id, _) =
                open_connection(&self.dial.target, self.dial.connect_timeout).await?;
            Ok(self.session(conn, id))
        })
    }

    /// `performance_schema.metadata_locks` (user locks), on a connection of its own, with
    /// the holder's `program_name` connect attribute. Needs `SELECT` on `performance_schema`
    /// and its metadata lock instrument on (MySQL's default; MariaDB's `performance_schema`
    /// is off by default): otherwise `Unsupported`, saying which is missing.
    fn store_locks<'a>(
        &'a self,
        known: &'a [&'a str],
    ) -> BoxFuture<'a, Result<Vec<StoreLock>, LockError>> {
        Box::pin(async move {
            let (mut conn, _, _) =
                open_connection(&self.dial.target, self.dial.connect_timeout).await?;
            let listed = list_user_locks(&mut conn).await;
            let _ = conn.close().await;
            let rows = listed?;
            let names: std::collections::HashMap<String, &str> = known
                .iter()
                .map(|key| (server_lock_name(key), *key))
                .collect();
            Ok(rows
                .into_iter()
                .map(|(name, program)| {
                    // A name without `#` is its key (see the module docs); a hashed one is
                    // named when it is one of `known`'s.
                    let key = if name.contains('#') {
                        names.get(&name).map(|key| (*key).to_owned())
                    } else {
                        Some(name.clone())
                    };
                    StoreLock::new(name).with_key(key).with_owner(program)
                })
                .collect())
        })
    }
}

/// The user locks granted now, and their holders' `program_name`s (see
/// [`Connector::store_locks`]).
async fn list_user_locks(
    conn: &mut MySqlConnection,
) -> Result<Vec<(String, Option<String>)>, LockError> {
    let what = "listing the locks";
    let denied = |e: &sqlx::Error| matches!(error_number(e), Some(1142 | 1044 | 1143));
    let unsupported = |why: String| LockError::unsupported(NAME, "store inspection", why);
    let (on, instrumented): (i64, i64) = match sqlx::query_as(STORE_LOCKS_CHECK_SQL)
        .fetch_one(&mut *conn)
        .await
    {
        Ok(row) => row,
        Err(e) if denied(&e) => {
            return Err(unsupported(
                "listing user locks reads performance_schema, which this user may not read; \
                 grant it with GRANT SELECT ON performance_schema.* TO the user"
                    .to_owned(),
            ));
        }
        Err(e) => return Err(driver_error::<MySql>(what, e)),
    };
    if on != 1 {
        return Err(unsupported(
            "listing user locks reads performance_schema, which is off on this server; start \
             it with performance_schema=ON"
                .to_owned(),
        ));
    }
    if instrumented == 0 {
        return Err(unsupported(
            "listing user locks needs the metadata lock instrument, which is off on this \
             server; turn it on with UPDATE performance_schema.setup_instruments SET \
             ENABLED = 'YES' WHERE NAME = 'wait/lock/metadata/sql/mdl' (or \
             performance-schema-instrument='wait/lock/metadata/sql/mdl=ON' in the server's \
             configuration)"
                .to_owned(),
        ));
    }
    sqlx::query_as(STORE_LOCKS_SQL)
        .fetch_all(&mut *conn)
        .await
        .map_err(|e| {
            if denied(&e) {
                unsupported(format!(
                    "listing user locks reads performance_schema.metadata_locks, threads and \
                     session_connect_attrs, which this user may not read ({e}); grant them with \
                     GRANT SELECT ON performance_schema.* TO the user"
                ))
            } else {
                driver_error::<MySql>(what, e)
            }
        })
}

/// One connection, with the id that `KILL` aims at.
#[derive(Debug)]
pub struct MySqlSession {
    conn: MySqlConnection,
    id: u64,
    fencing: bool,
    fractional: bool,
}

/// `KILL` of an abandoned wait's connection; the killing lane then waits until that session
/// has ended.
#[derive(Debug)]
pub struct MySqlKill {
    id: u64,
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
                let error = failure::<MySql>("issuing a fencing token", err);
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
}

impl MySqlSession {
    /// Gives back the slot `name` (a permit not kept: its fencing token could not be issued).
    async fn release_slot(&mut self, name: &str) -> Result<(), sqlx::Error> {
        sqlx::query(RELEASE_SQL)
            .bind(name)
            .fetch_optional(&mut self.conn)
            .await
            .map(drop)
    }
}

impl Session for MySqlSession {
    type Resource = Arc<str>;
    type Semaphore = MySqlSemaphore;
    /// The slot's lock name.
    type Permit = Arc<str>;
    type Interrupt = MySqlKill;

    fn try_permit<'a>(
        &'a mut self,
        semaphore: &'a MySqlSemaphore,
        waiting: bool,
    ) -> BoxFuture<'a, Result<PermitAnswer<Arc<str>>, Failure>> {
        Box::pin(async move {
            let start = fastrand::u32(0..semaphore.count.max(1));
            let slot: Option<u64> = sqlx::query_scalar(PERMIT_SQL)
                .bind(&*semaphore.prefix)
                .bind(start)
                .bind(semaphore.count)
                .bind(&*semaphore.queue)
                .bind(waiting)
                .fetch_one(&mut self.conn)
                .await
                // The walk may have taken a slot before the statement failed; only the
                // session's end frees it for sure.
                .map_err(|err| {
                    Failure::connection(driver_error::<MySql>("taking a permit", err))
                })?;
            let Some(slot) = slot else {
                return Ok(PermitAnswer::Full);
            };
            let name: Arc<str> = Arc::from(format!("{}{slot}", semaphore.prefix));
            let token = if self.fencing {
                // The semaphore's counter: its prefix without the last `#`.
                let counter = semaphore.prefix.trim_end_matches('#');
                match fence(&mut self.conn, counter).await {
                    Ok(token) => Some(token),
                    Err(err) => {
                        let error = failure::<MySql>("issuing a fencing token", err);
                        // Do not keep a permit whose token could not be issued.
                        return Err(match self.release_slot(&name).await {
                            Ok(()) => error,
                            Err(_) => Failure::connection(error.error),
                        });
                    }
                }
            } else {
                None
            };
            Ok(PermitAnswer::Granted {
                permit: name,
                token,
            })
        })
    }

    fn release_permit<'a>(
        &'a mut self,
        permit: &'a Arc<str>,
    ) -> BoxFuture<'a, Result<(), Failure>> {
        Box::pin(async move {
            self.release_slot(permit)
                .await
                .map_err(|err| failure::<MySql>("releasing a permit", err))
        })
    }

    /// Counts the held slots (one `IS_USED_LOCK` per slot, in one statement). The server
    /// keeps no count record: `recorded` is always `None`.
    fn count_permits<'a>(
        &'a mut self,
        semaphore: &'a MySqlSemaphore,
    ) -> BoxFuture<'a, Result<PermitCount, Failure>> {
        Box::pin(async move {
            let held: i64 = sqlx::query_scalar(PERMIT_COUNT_SQL)
                .bind(&*semaphore.prefix)
                .bind(semaphore.count)
                .fetch_one(&mut self.conn)
                .await
                .map_err(|err| failure::<MySql>("counting the permits", err))?;
            Ok(PermitCount {
                holders: u32::try_from(held).unwrap_or(u32::MAX),
                recorded: None,
            })
        })
    }

    fn lock<'a>(
        &'a mut self,
        name: &'a Arc<str>,
        mode: Mode,
        wait: Duration,
    ) -> BoxFuture<'a, Result<Option<Grant>, Failure>> {
        Box::pin(async move {
            if mode.is_shared() {
                // Never asked: `shared_locks` answers `Unsupported` first.
                return Err(Failure::statement(no_shared_locks()));
            }
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
                Err(err) => Err(failure::<MySql>(what, err)),
            }
        })
    }

    fn unlock<'a>(
        &'a mut self,
        name: &'a Arc<str>,
        _mode: Mode,
    ) -> BoxFuture<'a, Result<(), Failure>> {
        Box::pin(async move {
            // The answer's one row is read and dropped undecoded. `execute` would send the
            // same statement but read the answer through sqlx's row stream: about 3,000 more
            // instructions per release, a sixth of what the layer added to an uncontended
            // cycle on MariaDB.
            sqlx::query(RELEASE_SQL)
                .bind(&**name)
                .fetch_optional(&mut self.conn)
                .await
                .map(drop)
                .map_err(|err| failure::<MySql>("releasing a lock", err))
        })
    }

    fn ping(&mut self) -> BoxFuture<'_, Result<(), Failure>> {
        Box::pin(ping::<MySql>(&mut self.conn))
    }

    fn interrupt(&self, _name: &Arc<str>) -> Option<MySqlKill> {
        Some(MySqlKill { id: self.id })
    }

    /// Ends session `target.id` (an abandoned wait), and waits until the server has let it
    /// go. `KILL` only flags the session: until its thread has woken and left, its wait stays
    /// queued, and a release in that moment still grants it the lock, held until the thread
    /// ends. Looking for the lock's holder would miss that (the session did not hold it yet
    /// when looked at); a `KILL` answering "unknown thread" says the session is gone, with
    /// whatever it held or waited for. Asking again is harmless: the session is being killed
    /// anyway, and no other privilege than `KILL`'s own (a user's own sessions) is needed.
    fn run_interrupt(&mut self, target: MySqlKill) -> BoxFuture<'_, Result<(), Failure>> {
        Box::pin(settle::<MySql>("ending an abandoned wait", async move {
            let mut pauses = settle_pauses();
            loop {
                let kill = kill_sql(target.id);
                match sqlx::query(sqlx::AssertSqlSafe(kill))
                    .execute(&mut self.conn)
                    .await
                {
                    // Still there (now flagged, if it was not already): look again.
                    Ok(_) => {}
                    // No such session: it has ended.
                    Err(err) if error_number(&err) == Some(ER_NO_SUCH_THREAD) => return Ok(()),
                    Err(err) => return Err(err),
                }
                tokio::time::sleep(pauses.next_pause().unwrap_or_default()).await;
            }
        }))
    }
}

/// Increments the fencing counter of `name`; the new value.
async fn fence(conn: &mut MySqlConnection, name: &str) -> Result<u64, sqlx::Error> {
    let done = sqlx::query(FENCE_SQL)
        .bind(name)
        .execute(&mut *conn)
        .await?;
    Ok(done.last_insert_id())
}

/// Opens a connection, learns what server it is and sets its session up, within `timeout`.
pub(super) async fn open_connection(
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
    let address = match options.get_socket() {
        Some(socket) => socket.display().to_string(),
        None => format!("{}:{}", options.get_host(), options.get_port()),
    };
    connect_within::<MySql, _>(&address, timeout, connect).await
}

/// Makes sure the fencing table is there: a table this user sees needs only its own
/// privileges (never `CREATE`); a missing one is created.
pub(super) async fn create_fencing_table(conn: &mut MySqlConnection) -> Result<(), LockError> {
    let seen: i64 = sqlx::query_scalar(FENCING_TABLE_CHECK_SQL)
        .fetch_one(&mut *conn)
        .await
        .map_err(|e| driver_error::<MySql>("looking for the fencing table dlock_fencing", e))?;
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
        Err(e) => Err(driver_error::<MySql>(
            "creating the fencing table dlock_fencing",
            e,
        )),
    }
}

/// The server's error number, for errors the server answered.
fn error_number(err: &sqlx::Error) -> Option<u16> {
    match err {
        sqlx::Error::Database(db) => number(db.as_ref()),
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

impl SqlxErrors for MySql {
    const NAME: &'static str = NAME;
    const TLS_MODE_OPTION: &'static str = "ssl-mode";
    const TLS_CA_OPTION: &'static str = "ssl-ca";
    const SERVER_TLS_HINT: &'static str = "give the server `ssl-cert` and `ssl-key`";

    fn code(db: &dyn DatabaseError) -> Option<String> {
        number(db).map(|n| n.to_string())
    }

    fn ends_connection(db: &dyn DatabaseError) -> bool {
        number(db).is_some_and(|n| CONNECTION_ERRORS.contains(&n))
    }

    fn config_error(what: &str, db: &dyn DatabaseError) -> Option<LockError> {
        let message = db.message();
        let text = match number(db)? {
            1045 | 1698 | 1251 => format!(
                "{what}: the server refused the credentials ({message}); check the user name and password in the URL \
                 (a server or account that requires TLS refuses clients without it the same way: \
                 MariaDB's `require_secure_transport`, an account `REQUIRE SSL`; use ssl-mode=VERIFY_IDENTITY)"
            ),
            // MySQL's `require_secure_transport`.
            3159 => format!(
                "{what}: the server accepts clients only over TLS ({message}); connect with ssl-mode=VERIFY_IDENTITY and ssl-ca"
            ),
            1049 => format!("{what}: {message}; check the database name in the URL"),
            _ => return None,
        };
        Some(LockError::config(text))
    }
}

/// The server's error number.
fn number(db: &dyn DatabaseError) -> Option<u16> {
    db.try_downcast_ref::<MySqlDatabaseError>()
        .map(MySqlDatabaseError::number)
}

/// Why MySQL and MariaDB have no read locks: the server's user locks have one mode.
pub(super) fn no_shared_locks() -> LockError {
    LockError::unsupported(
        NAME,
        "read locks",
        "GET_LOCK has no shared mode (a user lock is held by one session at a time), and a \
         sound reader-writer lock on top of it would need extra tables or sessions per key; \
         use the exclusive lock, or PostgreSQL, SQL Server or Oracle for read locks",
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The answer to a read lock says why there is none, and what to use instead.
    #[test]
    fn read_locks_are_unsupported_with_the_reason() {
        match no_shared_locks() {
            LockError::Unsupported {
                backend,
                operation,
                message,
            } => {
                assert_eq!(backend, NAME);
                assert_eq!(operation, "read locks");
                assert!(message.contains("GET_LOCK has no shared mode"), "{message}");
                assert!(message.contains("PostgreSQL"), "{message}");
            }
            other => panic!("{other:?}"),
        }
    }

    /// Permits need recursive CTEs (MySQL 8.0.3, MariaDB 10.2.2); older servers keep the
    /// provider's slot scheme, and their sessions are not asked for the recursion limit.
    #[test]
    fn permits_need_a_server_with_recursive_ctes() {
        for (version, walks) in [
            ("9.7.4-2", true),
            ("8.0.3", true),
            ("8.0.2-dmr", false),
            ("5.7.44-log", false),
            ("10.11.19-MariaDB-0+deb12u1", true),
            ("10.2.2-MariaDB", true),
            ("10.2.1-MariaDB", false),
            ("10.1.48-MariaDB", false),
        ] {
            let server = ServerInfo::new(version.to_owned());
            assert_eq!(server.walks, walks, "{version}");
            assert_eq!(
                server.session_sql().contains("recursi"),
                walks,
                "{version}: {}",
                server.session_sql()
            );
            assert_eq!(
                server.session_sql().contains("max_statement_time"),
                server.mariadb
            );
        }
    }
}
