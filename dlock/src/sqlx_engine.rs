//! What the engines built on sqlx (PostgreSQL, MySQL) share: mapping driver errors to
//! [`LockError`]s, telling errors that end a connection from those that end a statement, and
//! connecting within `connect_timeout`.

use std::future::Future;
use std::marker::PhantomData;
use std::str::FromStr;
use std::time::Duration;

use sqlx::error::DatabaseError;

use crate::LockError;
use crate::backoff::{Backoff, Pauses};
use crate::options::{ConfigKey, UrlForm, parse_key};
use crate::session::{
    Driver, Failure, SETTLE_LIMIT, SessionBackend, SessionBuilder, SessionKey, SessionOptions,
    read_engine_query,
};

/// How an engine's server errors read, for [`driver_error`].
pub(crate) trait SqlxErrors {
    /// The backend's name.
    const NAME: &'static str;
    /// The URL option that requires TLS (`sslmode`, `ssl-mode`).
    const TLS_MODE_OPTION: &'static str;
    /// The URL option that names the CA file (`sslrootcert`, `ssl-ca`).
    const TLS_CA_OPTION: &'static str;
    /// What turns TLS on at the server.
    const SERVER_TLS_HINT: &'static str;

    /// The server's code of an error it answered (a SQLSTATE, an error number).
    fn code(db: &dyn DatabaseError) -> Option<String>;

    /// Whether a server error means the connection can no longer be trusted.
    fn ends_connection(db: &dyn DatabaseError) -> bool;

    /// A configuration error for server errors that a setting causes (credentials, database
    /// name, TLS required): `None` for the others.
    fn config_error(what: &str, db: &dyn DatabaseError) -> Option<LockError>;
}

/// The server's code of `err`, for errors the server answered.
pub(crate) fn db_code<E: SqlxErrors>(err: &sqlx::Error) -> Option<String> {
    match err {
        sqlx::Error::Database(db) => E::code(db.as_ref()),
        _ => None,
    }
}

/// Whether `err` means the connection can no longer be trusted: any error that the server did
/// not answer, and the server's own errors that say so.
pub(crate) fn is_connection_error<E: SqlxErrors>(err: &sqlx::Error) -> bool {
    match err {
        sqlx::Error::Database(db) => E::ends_connection(db.as_ref()),
        _ => true,
    }
}

/// A failed statement: the connection stays usable unless the error says otherwise.
pub(crate) fn failure<E: SqlxErrors>(what: &str, err: sqlx::Error) -> Failure {
    if is_connection_error::<E>(&err) {
        Failure::connection(driver_error::<E>(what, err))
    } else {
        Failure::statement(driver_error::<E>(what, err))
    }
}

/// Maps a driver error while doing `what`; messages name what was being done, never the URL.
pub(crate) fn driver_error<E: SqlxErrors>(what: &str, err: sqlx::Error) -> LockError {
    if crate::tls::is_tls_refused_by_server(&err) {
        return LockError::config(format!(
            "{what}: TLS: the server does not offer TLS, and the URL's `{}` requires it; \
             nothing was sent in clear ({})",
            E::TLS_MODE_OPTION,
            E::SERVER_TLS_HINT
        ));
    }
    if let Some(failure) = crate::tls::describe(&err, E::TLS_CA_OPTION) {
        return failure.into_error(E::NAME, what, Box::new(err));
    }
    let code = db_code::<E>(&err);
    match &err {
        sqlx::Error::Database(db) => {
            if let Some(config) = E::config_error(what, db.as_ref()) {
                return config;
            }
            let message = format!("{what}: {}", db.message());
            if E::ends_connection(db.as_ref()) {
                LockError::unavailable(E::NAME, message, Some(Box::new(err)))
            } else {
                LockError::backend(E::NAME, message, code, Some(Box::new(err)))
            }
        }
        sqlx::Error::Configuration(_) => {
            LockError::config(format!("{what}: invalid connection settings: {err}"))
        }
        sqlx::Error::Io(io) if io.kind() == std::io::ErrorKind::ConnectionRefused => {
            LockError::unavailable(
                E::NAME,
                format!(
                    "{what}: the connection was refused ({io}); is the server running, and \
                     listening there?"
                ),
                Some(Box::new(err)),
            )
        }
        sqlx::Error::Io(io) => LockError::unavailable(
            E::NAME,
            format!("{what}: cannot reach the server: {io}"),
            Some(Box::new(err)),
        ),
        sqlx::Error::Tls(_)
        | sqlx::Error::Protocol(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => LockError::unavailable(
            E::NAME,
            format!("{what}: the connection failed: {err}"),
            Some(Box::new(err)),
        ),
        _ => LockError::backend(E::NAME, format!("{what}: {err}"), code, Some(Box::new(err))),
    }
}

/// Runs `connect` (opening a connection to `address` and setting up its session) within
/// `timeout`; errors name the address (never the URL, which may hold a password).
pub(crate) async fn connect_within<E: SqlxErrors, T>(
    address: &str,
    timeout: Duration,
    connect: impl Future<Output = Result<T, sqlx::Error>>,
) -> Result<T, LockError> {
    match tokio::time::timeout(timeout, connect).await {
        Ok(result) => result.map_err(|e| driver_error::<E>(&format!("connecting to {address}"), e)),
        Err(_) => Err(LockError::unavailable(
            E::NAME,
            format!("connecting to {address} took longer than {timeout:?} (connect_timeout)"),
            None,
        )),
    }
}

/// A session's liveness check: the driver's ping, any failure ending the session.
pub(crate) async fn ping<E: SqlxErrors>(conn: &mut impl sqlx::Connection) -> Result<(), Failure> {
    conn.ping()
        .await
        .map_err(|err| Failure::connection(driver_error::<E>("checking a connection", err)))
}

/// Runs `settle`, the end of an abandoned wait from another session (a cancel or a kill,
/// then looking at the server, with [`settle_pauses`], until the wait's session neither waits
/// nor holds its lock), for at most [`SETTLE_LIMIT`]; after that, a warning is logged and the
/// session is left to end on its own.
pub(crate) async fn settle<E: SqlxErrors>(
    what: &str,
    settle: impl Future<Output = Result<(), sqlx::Error>>,
) -> Result<(), Failure> {
    match tokio::time::timeout(SETTLE_LIMIT, settle).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(err)) => Err(failure::<E>(what, err)),
        Err(_) => {
            tracing::warn!(
                backend = E::NAME,
                "an abandoned wait's session still waits for or holds its lock after {SETTLE_LIMIT:?}"
            );
            Ok(())
        }
    }
}

/// The pauses between two looks at a settling session: 1 ms, doubling to 20 ms.
pub(crate) fn settle_pauses() -> Pauses {
    let backoff = Backoff::unjittered(Duration::from_millis(1), Duration::from_millis(20));
    Pauses::new(backoff, None)
}

/// The URL of an engine built on sqlx: its form, and the driver's own options, which pass
/// through to the driver. The driver would ignore any other option silently, so that a typo
/// would go unnoticed: they are refused instead.
pub(crate) trait SqlxUrl {
    /// The engine's URL skeleton.
    const FORM: UrlForm;
    /// The driver's options, as the engine documents them.
    const DRIVER_OPTIONS: &'static [&'static str];

    /// Whether the driver reads the option `name`.
    fn is_driver_option(name: &str) -> bool {
        Self::DRIVER_OPTIONS.contains(&name)
    }
}

/// An option of a sqlx engine's driver, passed to it as it is.
pub(crate) struct DriverOption<E> {
    name: String,
    engine: PhantomData<E>,
}

impl<E: SqlxUrl> ConfigKey for DriverOption<E> {
    const BACKEND: &'static str = E::FORM.backend;

    fn find(name: &str) -> Option<Self> {
        E::is_driver_option(name).then(|| DriverOption {
            name: name.to_owned(),
            engine: PhantomData,
        })
    }

    fn names() -> Vec<&'static str> {
        E::DRIVER_OPTIONS.to_vec()
    }
}

impl<E: SqlxUrl> FromStr for DriverOption<E> {
    type Err = LockError;

    fn from_str(name: &str) -> Result<Self, LockError> {
        parse_key(name)
    }
}

impl<E> AsRef<str> for DriverOption<E> {
    fn as_ref(&self) -> &str {
        &self.name
    }
}

/// Reads the query of a sqlx engine's URL: the session options, and the driver's own options,
/// which go to the driver as they are.
fn split_query<E: SqlxUrl>(
    query: &str,
) -> Result<(SessionOptions, Vec<(String, String)>), LockError> {
    let mut passthrough = Vec::new();
    let session = read_engine_query::<DriverOption<E>>(query, |key, value| {
        passthrough.push((key.name, value));
        Ok(())
    })?;
    Ok((session, passthrough))
}

/// An engine built on sqlx (PostgreSQL, MySQL): its target is its driver's connect options,
/// which a pool of the application's can lend.
pub trait SqlxEngine:
    Driver<Target = <<Self::Database as sqlx::Database>::Connection as sqlx::Connection>::Options>
{
    /// The driver's database.
    type Database: sqlx::Database;
}

/// Reads the URL of a sqlx engine: the driver's connect options (the URL under the engine's
/// first scheme, with the driver's own options), those options, and the session options,
/// which are checked by the caller.
pub(crate) fn parse_url<E: SqlxEngine + SqlxUrl>(url: &str) -> Result<ParsedUrl<E>, LockError> {
    let form = E::FORM;
    let (rest, query) = form.split(url)?;
    if !rest.starts_with("//") {
        return Err(form.error("has no `//` after its scheme"));
    }
    let (session, passthrough) = split_query::<E>(query)?;
    let base = format!("{}:{rest}", form.schemes[0]);
    let target = E::Target::from_str(&driver_url(base, &passthrough)).map_err(|err| {
        // Only the driver's words on a setting: its other errors could repeat the URL.
        let why = match err {
            sqlx::Error::Configuration(inner) => inner.to_string(),
            _ => "malformed URL".to_owned(),
        };
        let names: Vec<_> = SessionKey::names().collect();
        form.error(format!(
            "is not valid ({why}) (options: {})",
            names.join(", ")
        ))
    })?;
    Ok((target, passthrough, session))
}

/// A sqlx engine's URL, read: see [`parse_url`].
pub(crate) type ParsedUrl<E> = (<E as Driver>::Target, Vec<(String, String)>, SessionOptions);

impl<E: SqlxEngine> SessionBackend<E> {
    /// A builder that connects with `options`.
    pub fn builder(options: E::Target) -> SessionBuilder<E> {
        SessionBuilder::new(options)
    }

    /// A builder that connects like `pool` does (same server, user, password, TLS, database
    /// and options). The backend opens its own connections and never takes any from the pool.
    pub fn builder_from_pool(pool: &sqlx::Pool<E::Database>) -> SessionBuilder<E> {
        SessionBuilder::new((*pool.connect_options()).clone())
    }

    /// A backend with the default settings that connects like `pool` does.
    ///
    /// ```no_run
    /// # #[cfg(feature = "postgres")]
    /// # async fn demo(pool: sqlx::PgPool) -> Result<(), dlock::LockError> {
    /// let backend = dlock::postgres::PostgresBackend::new(pool.clone()).await?;
    /// let locks = dlock::LockProvider::from_backend(backend);
    /// # Ok(()) }
    /// ```
    ///
    /// # Cancel safety
    ///
    /// Cancel safe, as [`SessionBuilder::open`].
    pub async fn new(pool: sqlx::Pool<E::Database>) -> Result<SessionBackend<E>, LockError> {
        Self::builder_from_pool(&pool).open().await
    }
}

/// Appends the driver's own URL options to `base`, for the driver to read.
fn driver_url(mut base: String, passthrough: &[(String, String)]) -> String {
    if !passthrough.is_empty() {
        let encoded: String = url::form_urlencoded::Serializer::new(String::new())
            .extend_pairs(passthrough.iter())
            .finish();
        base.push('?');
        base.push_str(&encoded);
    }
    base
}
