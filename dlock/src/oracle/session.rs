//! What the session engine runs on an Oracle session: the blocking calls on Tokio's blocking
//! thread pool, and what the driver's errors mean.

use std::sync::Arc;
use std::time::Duration;

use super::Oracle;
use super::statements::*;
use crate::LockError;
use crate::backend::BoxFuture;
use crate::session::{
    Connector, Dial, Failure, Grant as LaneGrant, Mode, PermitAnswer, PermitCount, Session,
};

/// Which kind of failure an Oracle error is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ErrorClass {
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
pub(super) fn classify(text: &str) -> ErrorClass {
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
pub(super) fn oracle_code(text: &str) -> Option<String> {
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
pub(super) fn map_error_text(what: &str, text: &str) -> Failure {
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
                "{what}: the user may not call DBMS_LOCK (or, with fencing=true, write the table \
                 dlock_fencing); have a DBA run `GRANT EXECUTE ON SYS.DBMS_LOCK TO <user>` \
                 (and `GRANT SELECT, INSERT, UPDATE ON dlock_fencing TO <user>`). Server \
                 message: {text}"
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

pub(super) fn map_error(what: &str, err: &oracle::Error) -> Failure {
    map_error_text(what, &err.to_string())
}

pub(super) fn join_failure(what: &str) -> Failure {
    Failure::connection(LockError::unavailable(
        NAME,
        format!("{what}: the blocking Oracle call did not finish (runtime shutting down?)"),
        None,
    ))
}

/// Runs `call` and reads its first OUT bind.
pub(super) fn run_call(
    conn: &oracle::Connection,
    call: &Call,
) -> Result<Option<i64>, oracle::Error> {
    Ok(run_outs(conn, call)?.into_iter().next().flatten())
}

/// Runs `call` (binding by position) and reads its OUT binds, in order.
pub(super) fn run_outs(
    conn: &oracle::Connection,
    call: &Call,
) -> Result<Vec<Option<i64>>, oracle::Error> {
    use oracle::sql_type::{OracleType, ToSql};
    let number = OracleType::Number(10, 0);
    let token = OracleType::Number(19, 0);
    let values: Vec<&dyn ToSql> = call
        .params
        .iter()
        .map(|param| match param {
            Param::OutNumber => &number as &dyn ToSql,
            Param::OutToken => &token as &dyn ToSql,
            Param::Number(value) => value as &dyn ToSql,
        })
        .collect();
    let mut statement = conn.statement(call.sql).build()?;
    statement.execute(&values)?;
    call.params
        .iter()
        .enumerate()
        .filter(|(_, param)| matches!(param, Param::OutNumber | Param::OutToken))
        .map(|(at, _)| statement.bind_value::<usize, Option<i64>>(at + 1))
        .collect()
}

/// Makes sure the fencing table is there and usable (blocking): a table this user sees needs
/// only its three privileges (never `CREATE TABLE`); a missing one is created.
pub(super) fn create_fencing_table(conn: &oracle::Connection) -> Result<(), LockError> {
    match conn.query_row_as::<i64>(FENCING_TABLE_CHECK_SQL, &[]) {
        Ok(_) => {
            for check in [FENCING_UPDATE_CHECK_SQL, FENCING_INSERT_CHECK_SQL] {
                if let Err(err) = conn.execute(check, &[]) {
                    let _ = conn.rollback();
                    let text = err.to_string();
                    return Err(if text.contains(NO_PRIVILEGE_ERROR) {
                        fencing_privilege_error(&text)
                    } else {
                        map_error("checking the fencing table dlock_fencing", &err).error
                    });
                }
            }
            conn.rollback()
                .map_err(|err| map_error("checking the fencing table dlock_fencing", &err).error)
        }
        Err(err) if err.to_string().contains(NO_TABLE_ERROR) => {
            match conn.execute(FENCING_TABLE_SQL, &[]) {
                Ok(_) => Ok(()),
                // Another process created it at the same moment.
                Err(err) if err.to_string().contains(NAME_USED_ERROR) => Ok(()),
                Err(err) if err.to_string().contains(NO_PRIVILEGE_ERROR) => {
                    Err(fencing_create_error(&err.to_string()))
                }
                Err(err) => Err(map_error("creating the fencing table dlock_fencing", &err).error),
            }
        }
        Err(err) => Err(map_error("looking for the fencing table dlock_fencing", &err).error),
    }
}

pub(super) fn ping(conn: &oracle::Connection) -> Result<(), oracle::Error> {
    conn.query_row_as::<i64>(KEEPALIVE_SQL, &[]).map(drop)
}

/// Where and as whom the backend connects.
#[derive(Clone)]
pub struct OracleTarget {
    pub(super) user: String,
    pub(super) password: String,
    pub(super) connect_string: String,
}

impl std::fmt::Debug for OracleTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OracleTarget")
            .field("user", &self.user)
            .field("connect_string", &self.connect_string)
            .finish_non_exhaustive()
    }
}

/// Opens sessions.
#[derive(Debug)]
pub struct OracleConnector {
    pub(super) dial: Dial<Oracle>,
    /// How long a permit try waits for its semaphore's gate (the backend's
    /// `statement_timeout`, which bounds the whole try anyway).
    pub(super) gate_wait: Duration,
}

/// A semaphore: the base of its lock ids, its count and its queue lock's id.
#[derive(Debug, Clone, Copy)]
pub struct OracleSemaphore {
    base: i32,
    count: u32,
    queue: i32,
}

/// A permit: the slot `lock_of(slot)` of the semaphore `base`, and its count (the record's
/// shares).
#[derive(Debug, Clone, Copy)]
pub struct OraclePermit {
    base: i32,
    slot: u32,
    count: u32,
}

impl Connector for OracleConnector {
    type Resource = OracleResource;
    type Semaphore = OracleSemaphore;
    type Session = OracleSession;

    const NAME: &'static str = NAME;
    const MAX_WAIT: Duration = MAX_WAIT;
    const MAX_PERMITS: u32 = MAX_PERMITS;

    fn semaphore(&self, key: &str, max_count: u32, queue: OracleResource) -> OracleSemaphore {
        OracleSemaphore {
            base: semaphore_base(key),
            count: max_count,
            queue: queue.id,
        }
    }

    fn wait_resolution(&self) -> Duration {
        Duration::from_secs(1)
    }

    fn resource(&self, key: &str) -> OracleResource {
        OracleResource {
            id: dbms_lock_id(key),
        }
    }

    /// `DBMS_LOCK.REQUEST` with `lockmode => DBMS_LOCK.S_MODE`.
    fn shared_locks(&self) -> Result<(), LockError> {
        Ok(())
    }

    fn open(&self) -> BoxFuture<'_, Result<OracleSession, LockError>> {
        let OracleTarget {
            user,
            password,
            connect_string,
        } = self.dial.target.clone();
        let timeout = self.dial.connect_timeout;
        let fencing = self.dial.fencing;
        let gate_wait = self.gate_wait;
        Box::pin(async move {
            let opening = tokio::task::spawn_blocking(move || {
                oracle::Connector::new(user, password, connect_string).connect()
            });
            match tokio::time::timeout(timeout, opening).await {
                Ok(Ok(Ok(conn))) => Ok(OracleSession {
                    conn: Arc::new(conn),
                    fencing,
                    gate_wait,
                    permits: std::collections::HashMap::new(),
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
pub struct OracleResource {
    id: i32,
}

/// One session. The connection is shared with the blocking call in flight, so an abandoned
/// wait can be interrupted from another thread and the session closes when both let go.
#[derive(Debug)]
pub struct OracleSession {
    conn: Arc<oracle::Connection>,
    fencing: bool,
    gate_wait: Duration,
    /// How many permits of each semaphore (by base) this session holds: `DBMS_LOCK` counts
    /// no re-entries, so the record's shares are given back with the last of them.
    permits: std::collections::HashMap<i32, u32>,
}

impl OracleSession {
    /// Sets up the fencing table on this session (at open).
    pub(super) async fn create_fencing_table(&self) -> Result<(), LockError> {
        let conn = Arc::clone(&self.conn);
        match tokio::task::spawn_blocking(move || create_fencing_table(&conn)).await {
            Ok(outcome) => outcome,
            Err(_) => Err(join_failure("setting up the fencing table").error),
        }
    }

    /// A fenced request: the lock and, with a grant, its token in the same block. On a
    /// failure after the lock may have been granted, the lock is given back first (the block
    /// does it itself for errors it catches; this covers the rest).
    async fn lock_fenced(
        &mut self,
        resource: &OracleResource,
        mode: Mode,
        wait: Duration,
    ) -> Result<Option<LaneGrant>, Failure> {
        let call = request_fenced_call(resource.id, mode, timeout_secs(wait));
        let outs = match self
            .blocking("taking a lock", move |conn| run_outs(conn, &call))
            .await
        {
            Ok(outs) => outs,
            Err(failure) => return Err(self.give_back(resource, failure).await),
        };
        let code = outs.first().copied().flatten();
        let token = outs.get(1).copied().flatten();
        if code == Some(4) && !wait.is_zero() {
            return Err(Failure::statement(already_own()));
        }
        match fenced_result(code, token) {
            Ok(token) => Ok(token.map(|token| LaneGrant { token: Some(token) })),
            // Granted, but without a token: not kept.
            Err(error) if code == Some(0) => {
                Err(self.give_back(resource, Failure::statement(error)).await)
            }
            Err(error) => Err(Failure::statement(error)),
        }
    }

    /// Gives back `resource` after `failure`, if the session is still usable; a session on
    /// which that fails is given up (closing it ends its locks on the server).
    async fn give_back(&mut self, resource: &OracleResource, failure: Failure) -> Failure {
        if !failure.connection_ok {
            return failure;
        }
        let call = release_call(resource.id);
        match self
            .blocking("releasing a lock", move |conn| run_call(conn, &call))
            .await
        {
            Ok(code) if release_result(code).is_ok() => failure,
            _ => Failure::connection(failure.error),
        }
    }

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

/// The error for a permit try or count whose gate stayed held past `statement_timeout`.
fn gate_error(code: Option<i64>) -> LockError {
    LockError::unavailable(
        NAME,
        format!(
            "a permit try waited for its semaphore's gate (a DBMS_LOCK id that tries of one \
             semaphore hold for one block each) until statement_timeout, and \
             DBMS_LOCK.REQUEST answered {code:?}"
        ),
        None,
    )
}

impl Session for OracleSession {
    type Resource = OracleResource;
    type Semaphore = OracleSemaphore;
    type Permit = OraclePermit;
    type Interrupt = std::convert::Infallible;

    fn try_permit<'a>(
        &'a mut self,
        semaphore: &'a OracleSemaphore,
        waiting: bool,
    ) -> BoxFuture<'a, Result<PermitAnswer<OraclePermit>, Failure>> {
        let first = fastrand::u32(0..semaphore.count.max(1));
        let call = permit_call(
            semaphore.base,
            semaphore.count,
            first,
            semaphore.queue,
            waiting,
            self.gate_wait,
            self.fencing,
        );
        Box::pin(async move {
            // The block may have taken a slot before it failed, and session locks outlive
            // it: only the session's end frees it for sure.
            let outs = self
                .blocking("taking a permit", move |conn| run_outs(conn, &call))
                .await
                .map_err(|failure| Failure::connection(failure.error))?;
            let out = |at: usize| outs.get(at).copied().flatten();
            let (gate, slot, recorded, token) = (out(0), out(1), out(2), out(3));
            if !matches!(gate, Some(0 | 4)) {
                return Err(Failure::statement(gate_error(gate)));
            }
            let recorded = recorded.and_then(|r| u32::try_from(r).ok()).unwrap_or(0);
            if recorded != 0 && recorded != semaphore.count {
                return Ok(PermitAnswer::Conflict { recorded });
            }
            let Some(slot) = slot.and_then(|slot| u32::try_from(slot).ok()) else {
                return Ok(PermitAnswer::Full);
            };
            let permit = OraclePermit {
                base: semaphore.base,
                slot,
                count: semaphore.count,
            };
            *self.permits.entry(semaphore.base).or_insert(0) += 1;
            let token = match (self.fencing, token.and_then(|t| u64::try_from(t).ok())) {
                (false, _) => None,
                (true, Some(token)) if token > 0 => Some(token),
                (true, other) => {
                    let error = LockError::backend(
                        NAME,
                        format!(
                            "the permit was taken, but the fencing counter in dlock_fencing \
                             answered {other:?} instead of a positive token; the permit was \
                             given back"
                        ),
                        None,
                        None,
                    );
                    return Err(match self.release_permit(&permit).await {
                        Ok(()) => Failure::statement(error),
                        Err(_) => Failure::connection(error),
                    });
                }
            };
            Ok(PermitAnswer::Granted { permit, token })
        })
    }

    fn release_permit<'a>(
        &'a mut self,
        permit: &'a OraclePermit,
    ) -> BoxFuture<'a, Result<(), Failure>> {
        let held = self.permits.entry(permit.base).or_insert(1);
        *held = held.saturating_sub(1);
        let last = *held == 0;
        if last {
            self.permits.remove(&permit.base);
        }
        let call = permit_release_call(permit.base, permit.slot, permit.count, last);
        Box::pin(async move {
            self.blocking("releasing a permit", move |conn| run_outs(conn, &call))
                .await
                .map(drop)
        })
    }

    fn count_permits<'a>(
        &'a mut self,
        semaphore: &'a OracleSemaphore,
    ) -> BoxFuture<'a, Result<PermitCount, Failure>> {
        let call = permit_count_call(semaphore.base, semaphore.count, self.gate_wait);
        Box::pin(async move {
            let outs = self
                .blocking("counting the permits", move |conn| run_outs(conn, &call))
                .await?;
            let out = |at: usize| outs.get(at).copied().flatten();
            let Some(holders) = out(0).and_then(|n| u32::try_from(n).ok()) else {
                return Err(Failure::statement(gate_error(out(0))));
            };
            let recorded = out(1)
                .and_then(|r| u32::try_from(r).ok())
                .filter(|r| *r > 0);
            Ok(PermitCount { holders, recorded })
        })
    }

    fn lock<'a>(
        &'a mut self,
        resource: &'a OracleResource,
        mode: Mode,
        wait: Duration,
    ) -> BoxFuture<'a, Result<Option<LaneGrant>, Failure>> {
        let call = session_request_call(resource.id, mode, timeout_secs(wait));
        Box::pin(async move {
            if self.fencing {
                return self.lock_fenced(resource, mode, wait).await;
            }
            let code = self
                .blocking("taking a lock", move |conn| run_call(conn, &call))
                .await?;
            if code == Some(4) && !wait.is_zero() {
                return Err(Failure::statement(already_own()));
            }
            match request_result(code) {
                Ok(Grant::Granted) => Ok(Some(LaneGrant::PLAIN)),
                Ok(Grant::NotGranted) => Ok(None),
                Err(error) => Err(Failure::statement(error)),
            }
        })
    }

    /// `DBMS_LOCK.RELEASE` gives back a lock of either mode.
    fn unlock<'a>(
        &'a mut self,
        resource: &'a OracleResource,
        _mode: Mode,
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

impl Drop for OracleSession {
    /// A session dropped with a blocking call still in flight (a lane statement that outlived
    /// `statement_timeout`) would stay open, with its locks, until that call returned, since
    /// the call shares the connection: the call is broken off (`OCIBreak`), so the session
    /// closes and the server frees its locks. The break runs on a thread of its own: the
    /// session may be dropped outside a runtime, or by a runtime's shutdown, whose blocking
    /// pool refuses new work.
    fn drop(&mut self) {
        if Arc::strong_count(&self.conn) > 1 {
            let conn = Arc::clone(&self.conn);
            let spawned = std::thread::Builder::new()
                .name("dlock-oracle-break".into())
                .spawn(move || {
                    let _ = conn.break_execution();
                });
            if let Err(err) = spawned {
                tracing::warn!(error = %err, "an Oracle call in flight could not be broken off; its session closes when the call returns");
            }
        }
    }
}

/// The error for a wait answered 4 ("already own"). Wait sessions hold nothing while they
/// wait, so this cannot happen; answering it as contention would make the wait spin on the
/// server.
fn already_own() -> LockError {
    dbms_error(
        "REQUEST",
        4,
        "the waiting session already owns this lock id",
    )
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
