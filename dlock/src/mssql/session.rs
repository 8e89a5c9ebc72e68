//! What the session engine runs on a SQL Server connection: opening `tiberius` connections
//! over Tokio TCP, running the calls of [`statements`](super::statements), and mapping driver
//! errors.

use std::sync::Arc;
use std::time::Duration;

use futures_util::io::{AsyncRead, AsyncWrite};
use tiberius::error::Error as TdsError;
use tiberius::{Client, Config, ToSql};
use tokio::net::TcpStream;
use tokio_util::compat::{Compat, TokioAsyncWriteCompatExt};

use super::Mssql;
use super::statements::{
    ALREADY_EXISTS_ERROR, CREATE_DENIED_ERRORS, Call, Grant as AppLock, MAX_PERMITS, MAX_WAIT,
    NAME, NOT_HELD_ERROR, Param, fenced_result, fencing_create_error, fencing_privilege_error,
    fencing_table_call, fencing_table_check_call, getapplock_fenced_call, getapplock_result,
    getapplock_session_call, keepalive_call, lock_timeout_ms, permit_call, permit_count_call,
    permit_release_call, releaseapplock_call, releaseapplock_result, resource_name, semaphore_base,
    server_error,
};
use crate::LockError;
use crate::backend::BoxFuture;
use crate::session::{Connector, Dial, Failure, Grant, Mode, PermitAnswer, PermitCount, Session};

/// A connection opened by the backend.
pub(crate) type MssqlClient = Client<Compat<TcpStream>>;

/// Opens a connection, following at most one server redirect, within `connect_timeout`.
pub(crate) async fn open_client(
    config: &Config,
    connect_timeout: Duration,
) -> Result<MssqlClient, LockError> {
    match tokio::time::timeout(connect_timeout, connect(config)).await {
        Ok(result) => result,
        Err(_) => Err(LockError::unavailable(
            NAME,
            format!(
                "connecting to SQL Server at {} did not complete within connect_timeout {connect_timeout:?}",
                config.get_addr()
            ),
            None,
        )),
    }
}

async fn connect(config: &Config) -> Result<MssqlClient, LockError> {
    let mut config = config.clone();
    // The backend bounds connecting (`connect_timeout`) and each wait (`@LockTimeout`) itself;
    // the driver's own limits on the handshake and on each round trip would cut a long wait
    // short and leave the connection in an unknown state.
    config.handshake_timeout(None);
    config.command_timeout(None);
    for _ in 0..2 {
        let addr = config.get_addr();
        let tcp = TcpStream::connect(&addr).await.map_err(|err| {
            LockError::unavailable(
                NAME,
                format!("could not connect to SQL Server at {addr}: {err}"),
                Some(Box::new(err)),
            )
        })?;
        let _ = tcp.set_nodelay(true);
        match Client::connect(config.clone(), tcp.compat_write()).await {
            Ok(client) => return Ok(client),
            Err(TdsError::Routing { host, port }) => {
                // Azure SQL's gateway redirects once to the node that serves the database.
                config.host(host);
                config.port(port);
            }
            Err(err) => return Err(connect_error(&addr, err)),
        }
    }
    Err(LockError::unavailable(
        NAME,
        "the server redirected the connection more than once",
        None,
    ))
}

/// The error for a failed connection handshake or login.
pub(crate) fn connect_error(addr: &str, err: TdsError) -> LockError {
    match err {
        TdsError::Server(token) => server_error(
            &format!("logging in to SQL Server at {addr}"),
            token.code(),
            token.message(),
        ),
        TdsError::Tls(message) => tls_error(addr, &message),
        // rustls reports a broken handshake as an I/O error of the TLS stream.
        TdsError::Io { message, .. } if looks_like_tls(&message) => tls_error(addr, &message),
        other => LockError::unavailable(
            NAME,
            format!(
                "{addr} did not complete the SQL Server (TDS) handshake: {other}; check that \
                 this is a SQL Server port"
            ),
            Some(Box::new(other)),
        ),
    }
}

fn tls_error(addr: &str, message: &str) -> LockError {
    if let Some(check) = refused_certificate(message) {
        // A configuration to fix, not a passing fault: the same answer as the other engines'.
        return LockError::config(format!(
            "connecting to SQL Server at {addr}: TLS: the server's certificate was refused \
             ({check}); trust the CA that signed it (`TrustServerCertificateCA` in an ADO.NET \
             string, `trust_cert_ca` on a `tiberius::Config`), connect by a name the \
             certificate carries, or, on a trusted network only, set trust_server_certificate=true"
        ));
    }
    LockError::unavailable(
        NAME,
        format!(
            "the TLS handshake with {addr} failed: {message}; check that this is a SQL Server \
             port, and the `encrypt` and `trust_server_certificate` options (the server's \
             certificate must be trusted unless trust_server_certificate=true)"
        ),
        None,
    )
}

/// The check a refused server certificate failed, as the driver words it (`UnknownIssuer`,
/// `certificate expired: …`), when `message` says the certificate was refused: tiberius's own
/// sentence under a validating trust setting, or rustls's words passed on as I/O.
fn refused_certificate(message: &str) -> Option<&str> {
    const REFUSED: [&str; 2] = [
        "the server's certificate was rejected during the TLS handshake: ",
        "invalid peer certificate: ",
    ];
    let rest = REFUSED
        .iter()
        .find_map(|words| message.split_once(words).map(|(_, rest)| rest))?;
    // tiberius follows the check with its advice, which names its own API.
    let end = [". To connect", ". The SQL Server"]
        .iter()
        .filter_map(|advice| rest.find(advice))
        .min()
        .unwrap_or(rest.len());
    Some(rest[..end].trim_end_matches('.'))
}

/// Whether an I/O error's text comes from the TLS layer.
pub(crate) fn looks_like_tls(message: &str) -> bool {
    let message = message.to_ascii_lowercase();
    [
        "corrupt message",
        "invalidcontenttype",
        "certificate",
        "handshake",
        "tls",
        "alert",
        "peer misbehaved",
    ]
    .iter()
    .any(|needle| message.contains(needle))
}

/// The driver value a parameter is sent as: `nvarchar` text, `int` numbers.
fn bind(param: &Param) -> &dyn ToSql {
    match param {
        Param::NVarChar(text) => text,
        Param::Int(number) => number,
    }
}

/// Runs `call` and reads the first row of its first result set.
async fn run_row<S>(client: &mut Client<S>, call: &Call) -> Result<Option<tiberius::Row>, TdsError>
where
    S: AsyncRead + AsyncWrite + Unpin + Send,
{
    let params: Vec<&dyn ToSql> = call.params.iter().map(bind).collect();
    client.query(call.sql, &params).await?.into_row().await
}

/// Runs `call` and reads the `int` in the first column of its first row.
pub(crate) async fn run_scalar<S>(
    client: &mut Client<S>,
    call: &Call,
) -> Result<Option<i32>, TdsError>
where
    S: AsyncRead + AsyncWrite + Unpin + Send,
{
    match run_row(client, call).await? {
        Some(row) => row.try_get::<i32, _>(0),
        None => Ok(None),
    }
}

/// Runs a fenced `sp_getapplock` call: its return code (`int`) and token (`bigint`, `NULL`
/// when not granted).
async fn run_fenced(
    client: &mut MssqlClient,
    call: &Call,
) -> Result<(Option<i32>, Option<i64>), TdsError> {
    match run_row(client, call).await? {
        Some(row) => Ok((row.try_get::<i32, _>(0)?, row.try_get::<i64, _>(1)?)),
        None => Ok((None, None)),
    }
}

/// Makes sure the fencing table is there and usable: a table this user sees needs only its
/// three privileges (never `CREATE TABLE`); a missing one is created.
pub(super) async fn create_fencing_table(client: &mut MssqlClient) -> Result<(), LockError> {
    let looking = "looking for the fencing table dlock_fencing";
    let row = run_row(client, &fencing_table_check_call())
        .await
        .map_err(|err| failure(looking, err).error)?;
    let flag = |column: usize| {
        row.as_ref()
            .and_then(|row| row.try_get::<i32, _>(column).ok().flatten())
            .unwrap_or(0)
            == 1
    };
    let (exists, usable) = (flag(0), flag(1));
    if exists {
        return if usable {
            Ok(())
        } else {
            Err(fencing_privilege_error())
        };
    }
    let create = fencing_table_call();
    let params: Vec<&dyn ToSql> = create.params.iter().map(bind).collect();
    match client.execute(create.sql, &params).await {
        Ok(_) => Ok(()),
        // Another process created it at the same moment.
        Err(TdsError::Server(token)) if token.code() == ALREADY_EXISTS_ERROR => Ok(()),
        Err(TdsError::Server(token)) if CREATE_DENIED_ERRORS.contains(&token.code()) => {
            Err(fencing_create_error(token.message()))
        }
        Err(err) => Err(failure("creating the fencing table dlock_fencing", err).error),
    }
}

/// Whether a driver error leaves the connection usable: a server error below severity 20
/// does (the statement failed, the session lives on); anything else does not.
pub(crate) fn failure(what: &str, err: TdsError) -> Failure {
    match err {
        TdsError::Server(token) => {
            server_failure(what, token.code(), token.class(), token.message())
        }
        other => Failure::connection(LockError::unavailable(
            NAME,
            format!("{what}: the connection to SQL Server failed: {other}"),
            Some(Box::new(other)),
        )),
    }
}

/// A server error of severity `class`: from 20 up the server closes the connection.
fn server_failure(what: &str, code: u32, class: u8, message: &str) -> Failure {
    let error = server_error(what, code, message);
    if class >= 20 {
        Failure::connection(error)
    } else {
        Failure::statement(error)
    }
}

/// The resource of one key: the key (for error messages) and its application-lock name.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Resource {
    key: Arc<str>,
    name: Arc<str>,
}

/// A semaphore: the base name of its application locks, its count and its queue lock.
#[derive(Debug, Clone)]
pub struct Semaphore {
    base: Arc<str>,
    count: u32,
    queue: Arc<str>,
}

/// A permit: the slot `<base>:<slot>` and the record's shares of its count.
#[derive(Debug)]
pub struct Permit {
    base: Arc<str>,
    slot: u32,
    count: u32,
}

/// Opens backend connections.
#[derive(Debug)]
pub struct MssqlConnector {
    pub(super) dial: Dial<Mssql>,
    /// How long a permit try waits for its semaphore's gate (the backend's
    /// `statement_timeout`, which bounds the whole try anyway).
    pub(super) gate_wait: Duration,
}

impl Connector for MssqlConnector {
    type Resource = Resource;
    type Semaphore = Semaphore;
    type Session = MssqlSession;

    const NAME: &'static str = NAME;
    const MAX_WAIT: Duration = MAX_WAIT;
    const MAX_PERMITS: u32 = MAX_PERMITS;

    fn semaphore(&self, key: &str, max_count: u32, queue: Resource) -> Semaphore {
        Semaphore {
            base: Arc::from(semaphore_base(key)),
            count: max_count,
            queue: queue.name,
        }
    }

    fn wait_resolution(&self) -> Duration {
        Duration::from_millis(1)
    }

    fn resource(&self, key: &str) -> Resource {
        Resource {
            key: Arc::from(key),
            name: Arc::from(resource_name(key)),
        }
    }

    /// `sp_getapplock @LockMode = 'Shared'`.
    fn shared_locks(&self) -> Result<(), LockError> {
        Ok(())
    }

    fn open(&self) -> BoxFuture<'_, Result<MssqlSession, LockError>> {
        Box::pin(async move {
            let client = open_client(&self.dial.target, self.dial.connect_timeout).await?;
            Ok(MssqlSession {
                client,
                fencing: self.dial.fencing,
                gate_wait: self.gate_wait,
            })
        })
    }
}

/// One backend connection: its session owns the application locks it takes.
#[derive(Debug)]
pub struct MssqlSession {
    pub(super) client: MssqlClient,
    fencing: bool,
    gate_wait: Duration,
}

impl MssqlSession {
    /// A fenced lock call: the lock and, with a grant, its token in the same batch. On a
    /// failure after the lock may have been granted, the lock is given back first (the batch
    /// does it itself for errors it catches; this covers the rest).
    async fn lock_fenced(
        &mut self,
        resource: &Resource,
        mode: Mode,
        wait: Duration,
    ) -> Result<Option<Grant>, Failure> {
        let call = getapplock_fenced_call(&resource.name, mode, lock_timeout_ms(wait));
        let (code, token) = match run_fenced(&mut self.client, &call).await {
            Ok(answer) => answer,
            Err(err) => {
                let failure = failure("taking a lock", err);
                return Err(self.give_back(resource, failure).await);
            }
        };
        match fenced_result(code, token, &resource.key) {
            Ok(token) => Ok(token.map(|token| Grant { token: Some(token) })),
            // Granted, but without a token: not kept.
            Err(error) if matches!(code, Some(0 | 1)) => {
                Err(self.give_back(resource, Failure::statement(error)).await)
            }
            Err(error) => Err(Failure::statement(error)),
        }
    }

    /// Gives back `resource` after `failure`, if the session is still usable; a session on
    /// which that fails is given up (dropping it ends its locks on the server).
    async fn give_back(&mut self, resource: &Resource, failure: Failure) -> Failure {
        if !failure.connection_ok {
            return failure;
        }
        match run_scalar(&mut self.client, &releaseapplock_call(&resource.name)).await {
            Ok(_) => failure,
            Err(TdsError::Server(token)) if token.code() == NOT_HELD_ERROR => failure,
            Err(_) => Failure::connection(failure.error),
        }
    }
}

/// Runs `call` and reads its first row's `int`s (the columns `ints`) and, if asked, the
/// `bigint` after them.
async fn run_ints(
    client: &mut MssqlClient,
    call: &Call,
    ints: usize,
    token: bool,
) -> Result<(Vec<Option<i32>>, Option<i64>), TdsError> {
    let Some(row) = run_row(client, call).await? else {
        return Ok((vec![None; ints], None));
    };
    let mut values = Vec::with_capacity(ints);
    for column in 0..ints {
        values.push(row.try_get::<i32, _>(column)?);
    }
    let token = if token {
        row.try_get::<i64, _>(ints)?
    } else {
        None
    };
    Ok((values, token))
}

/// The error for a permit try whose gate stayed held past `statement_timeout`.
fn gate_error(code: Option<i32>) -> LockError {
    LockError::unavailable(
        NAME,
        format!(
            "a permit try waited for its semaphore's gate (an application lock that tries of \
             one semaphore hold for one batch each) until statement_timeout, and \
             sp_getapplock answered {code:?}"
        ),
        None,
    )
}

impl Session for MssqlSession {
    type Resource = Resource;
    type Semaphore = Semaphore;
    type Permit = Permit;
    type Interrupt = std::convert::Infallible;

    fn try_permit<'a>(
        &'a mut self,
        semaphore: &'a Semaphore,
        waiting: bool,
    ) -> BoxFuture<'a, Result<PermitAnswer<Permit>, Failure>> {
        Box::pin(async move {
            let first = fastrand::u32(0..semaphore.count.max(1));
            let call = permit_call(
                &semaphore.base,
                semaphore.count,
                first,
                &semaphore.queue,
                waiting,
                self.gate_wait,
                self.fencing,
            );
            // The batch may have taken a slot before it failed, and session locks outlive
            // it: only the session's end frees it for sure.
            let (ints, token) = run_ints(&mut self.client, &call, 3, true)
                .await
                .map_err(|err| Failure::connection(failure("taking a permit", err).error))?;
            let (gate, slot, recorded) = (ints[0], ints[1], ints[2]);
            if gate.is_none_or(|code| code < 0) {
                return Err(Failure::statement(gate_error(gate)));
            }
            let recorded = recorded.and_then(|r| u32::try_from(r).ok()).unwrap_or(0);
            if recorded != 0 && recorded != semaphore.count {
                return Ok(PermitAnswer::Conflict { recorded });
            }
            let Some(slot) = slot.and_then(|slot| u32::try_from(slot).ok()) else {
                return Ok(PermitAnswer::Full);
            };
            let permit = Permit {
                base: Arc::clone(&semaphore.base),
                slot,
                count: semaphore.count,
            };
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

    fn release_permit<'a>(&'a mut self, permit: &'a Permit) -> BoxFuture<'a, Result<(), Failure>> {
        Box::pin(async move {
            let call = permit_release_call(&permit.base, permit.slot, permit.count);
            run_scalar(&mut self.client, &call)
                .await
                .map(drop)
                .map_err(|err| failure("releasing a permit", err))
        })
    }

    fn count_permits<'a>(
        &'a mut self,
        semaphore: &'a Semaphore,
    ) -> BoxFuture<'a, Result<PermitCount, Failure>> {
        Box::pin(async move {
            let call = permit_count_call(&semaphore.base, semaphore.count);
            let (ints, _) = run_ints(&mut self.client, &call, 2, false)
                .await
                .map_err(|err| failure("counting the permits", err))?;
            let holders = ints[0].and_then(|n| u32::try_from(n).ok()).unwrap_or(0);
            let recorded = ints[1]
                .and_then(|r| u32::try_from(r).ok())
                .filter(|r| *r > 0);
            Ok(PermitCount { holders, recorded })
        })
    }

    fn lock<'a>(
        &'a mut self,
        resource: &'a Resource,
        mode: Mode,
        wait: Duration,
    ) -> BoxFuture<'a, Result<Option<Grant>, Failure>> {
        Box::pin(async move {
            if self.fencing {
                return self.lock_fenced(resource, mode, wait).await;
            }
            let call = getapplock_session_call(&resource.name, mode, lock_timeout_ms(wait));
            let code = run_scalar(&mut self.client, &call)
                .await
                .map_err(|err| failure("taking a lock", err))?;
            match getapplock_result(code, &resource.key) {
                Ok(AppLock::Granted) => Ok(Some(Grant::PLAIN)),
                Ok(AppLock::TimedOut) => Ok(None),
                Err(error) => Err(Failure::statement(error)),
            }
        })
    }

    /// `sp_releaseapplock` gives back a lock of either mode.
    fn unlock<'a>(
        &'a mut self,
        resource: &'a Resource,
        _mode: Mode,
    ) -> BoxFuture<'a, Result<(), Failure>> {
        Box::pin(async move {
            let call = releaseapplock_call(&resource.name);
            match run_scalar(&mut self.client, &call).await {
                Ok(code) => releaseapplock_result(code).map_err(Failure::statement),
                // Not held any more: nothing to give back.
                Err(TdsError::Server(token)) if token.code() == NOT_HELD_ERROR => Ok(()),
                Err(err) => Err(failure("releasing a lock", err)),
            }
        })
    }

    fn ping(&mut self) -> BoxFuture<'_, Result<(), Failure>> {
        Box::pin(async move {
            run_scalar(&mut self.client, &keepalive_call())
                .await
                .map(drop)
                .map_err(|err| failure("checking a connection", err))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameters_are_sent_as_nvarchar_and_int() {
        use std::borrow::Cow;
        use tiberius::ColumnData;

        let call = getapplock_session_call("dlock:ab", Mode::Shared, 250);
        let sent: Vec<ColumnData<'_>> = call.params.iter().map(|p| bind(p).to_sql()).collect();
        assert_eq!(
            sent,
            vec![
                ColumnData::String(Some(Cow::Borrowed("dlock:ab"))),
                ColumnData::I32(Some(250)),
            ]
        );
        let call = getapplock_fenced_call("dlock:ef", Mode::Shared, 0);
        let sent: Vec<ColumnData<'_>> = call.params.iter().map(|p| bind(p).to_sql()).collect();
        assert_eq!(
            sent,
            vec![
                ColumnData::String(Some(Cow::Borrowed("dlock:ef"))),
                ColumnData::I32(Some(0)),
            ]
        );
        let call = releaseapplock_call("dlock:cd");
        let sent: Vec<ColumnData<'_>> = call.params.iter().map(|p| bind(p).to_sql()).collect();
        assert_eq!(
            sent,
            vec![ColumnData::String(Some(Cow::Borrowed("dlock:cd")))]
        );
    }

    #[test]
    fn failures_keep_or_drop_the_connection() {
        let kept = server_failure("taking a lock", 229, 14, "permission denied");
        assert!(kept.connection_ok);
        assert_eq!(kept.error.db_code(), Some("229"));
        let dropped = server_failure("taking a lock", 596, 21, "session is in the kill state");
        assert!(!dropped.connection_ok);
        let io = failure(
            "taking a lock",
            TdsError::Io {
                kind: std::io::ErrorKind::ConnectionReset,
                message: "reset".into(),
            },
        );
        assert!(!io.connection_ok);
        assert_eq!(io.error.code(), "DistributedLock.Unavailable");
    }

    #[test]
    fn connect_errors() {
        let io = |message: &str| TdsError::Io {
            kind: std::io::ErrorKind::InvalidData,
            message: message.to_owned(),
        };
        let tls = connect_error(
            "h:1",
            io("received corrupt message of type InvalidContentType"),
        );
        assert!(
            tls.to_string().contains("TLS handshake with h:1 failed"),
            "{tls}"
        );
        let tls = connect_error("h:1", io("invalid peer certificate: UnknownIssuer"));
        assert!(
            tls.to_string().contains("trust_server_certificate"),
            "{tls}"
        );
        assert_eq!(tls.code(), "DistributedLock.Configuration");
        // tiberius 0.13's words for a certificate its verifier refused, with its advice.
        for (check, hint) in [
            ("UnknownIssuer", ""),
            (
                "certificate expired: verification time 1800000000 (UNIX), but certificate is \
                 not valid after 1700000000 (100000000 seconds ago)",
                "",
            ),
            (
                "Other(OtherError(UnsupportedCertVersion))",
                " The SQL Server presented a certificate rustls considers too old.",
            ),
        ] {
            let text = format!(
                "the server's certificate was rejected during the TLS handshake: {check}.{hint} \
                 To connect anyway you can: (1) trust a specific CA certificate with \
                 `Config::trust_cert_ca(path)`"
            );
            let err = connect_error("h:1", TdsError::Tls(text));
            assert_eq!(err.code(), "DistributedLock.Configuration", "{err}");
            let shown = err.to_string();
            assert!(shown.contains(&format!("refused ({check});")), "{shown}");
            assert!(!shown.contains("To connect anyway"), "{shown}");
        }
        let tls = connect_error("h:1", TdsError::Tls("bad".into()));
        assert_eq!(tls.code(), "DistributedLock.Unavailable");
        let tds = connect_error(
            "h:1",
            TdsError::Protocol("header: invalid packet type: 72".into()),
        );
        assert!(
            tds.to_string()
                .contains("did not complete the SQL Server (TDS) handshake"),
            "{tds}"
        );
        assert_eq!(tds.code(), "DistributedLock.Unavailable");
        let reset = connect_error("h:1", io("Connection reset by peer (os error 104)"));
        assert!(reset.to_string().contains("TDS"), "{reset}");
    }
}
