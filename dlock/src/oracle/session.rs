//! What the session engine runs on an Oracle session: the blocking calls on Tokio's blocking
//! thread pool, and what the driver's errors mean.

use std::sync::Arc;
use std::time::Duration;

use super::statements::*;
use crate::LockError;
use crate::backend::BoxFuture;
use crate::session::{Connector, Failure, Grant as LaneGrant, Session};

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

pub(super) fn run_call(
    conn: &oracle::Connection,
    call: &Call,
) -> Result<Option<i64>, oracle::Error> {
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
    pub(super) target: OracleTarget,
    pub(super) connect_timeout: Duration,
}

impl Connector for OracleConnector {
    type Resource = OracleResource;
    type Session = OracleSession;

    const NAME: &'static str = NAME;
    const MAX_WAIT: Duration = MAX_WAIT;

    fn wait_resolution(&self) -> Duration {
        Duration::from_secs(1)
    }

    fn resource(&self, key: &str) -> OracleResource {
        OracleResource {
            id: dbms_lock_id(key),
        }
    }

    fn open(&self) -> BoxFuture<'_, Result<OracleSession, LockError>> {
        let OracleTarget {
            user,
            password,
            connect_string,
        } = self.target.clone();
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
pub struct OracleResource {
    id: i32,
}

/// One session. The connection is shared with the blocking call in flight, so an abandoned
/// wait can be interrupted from another thread and the session closes when both let go.
#[derive(Debug)]
pub struct OracleSession {
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
