//! SQL Server: application locks (`sp_getapplock`) on a few multiplexed connections, native
//! waits, and transaction-bound locks.
//!
//! A key is locked as the exclusive application lock named by [`resource_name`]: `"dlock:"`
//! followed by the lowercase hex SHA-256 of the key (70 characters). SQL Server limits resource
//! names to 255 characters and compares them under the database's collation, usually
//! case-insensitively, so keys are never used as names directly: the digest fits every key and
//! reads the same under every collation, and distinct keys (differing only in case, longer than
//! 255 characters, with NUL bytes or any Unicode) never share a resource.
//!
//! # Connections
//!
//! The backend opens its own connections (from a URL, an ADO.NET connection string, or a
//! [`tiberius::Config`] the application already has):
//!
//! | connections | how many | what they do |
//! |---|---|---|
//! | lock connections | `connections` (default 4) | `sp_getapplock` with `@LockTimeout = 0` for every try (and the first step of every wait); hold the locks so taken |
//! | wait connections | at most `wait_connections` (default 4) | run the server's blocking wait (`@LockTimeout` = what is left of the timeout); a granted wait keeps its lock on that connection until release |
//!
//! So one provider never has more than `connections + wait_connections` server connections,
//! however many locks it holds. When every wait connection is busy, further waits poll the lock
//! connections with backoff and jitter. `wait_connections=0` makes every wait poll. Every
//! acquisition claims its resource in the backend before it asks the server (one claim table
//! for every provider made from clones of the backend), so the re-entrancy of session
//! application locks never lets two tasks or two providers of one process in at once.
//!
//! ```no_run
//! use std::time::Duration;
//!
//! # async fn demo() -> Result<(), dlock::LockError> {
//! let locks = dlock::LockProvider::connect(
//!     "mssql://app:secret@db.internal:1433/app?keepalive=2s",
//! )
//! .await?;
//! let guard = locks.acquire("invoices:42", Duration::from_secs(10)).await?;
//! guard.release().await?;
//! # Ok(()) }
//! ```
//!
//! # Return codes and errors
//!
//! | `sp_getapplock` returns | meaning | answer |
//! |---|---|---|
//! | 0, 1 | granted (at once / after waiting) | the lock |
//! | -1 | timed out | [`LockError::AlreadyHeld`] for a try, [`LockError::Timeout`] for a wait |
//! | -2 | the request was canceled | [`LockError::Canceled`] |
//! | -3 | chosen as deadlock victim | [`LockError::Backend`] with `db_code` `"-3"` |
//! | -999 | parameter validation or other call error | [`LockError::Backend`] with `db_code` `"-999"` |
//!
//! Server errors become [`LockError::Backend`] with the error number as `db_code` (1205
//! deadlock victim, 18456 login failed, 229 permission denied name what to do); a connection
//! that cannot be opened or fails is [`LockError::Unavailable`]. Messages never contain the
//! URL or the password.
//!
//! # Waits and cancellation
//!
//! A wait is one `sp_getapplock` with `@LockTimeout` set to what is left of the timeout (at most
//! 30 s per statement; longer waits repeat it), so SQL Server queues the waiters of a resource
//! and grants the lock as soon as it is free. A wait that is abandoned (its timeout, a
//! cancellation token, a dropped future) closes its connection: the server ends the session,
//! and with it anything the wait was granted in the meantime. Dropping a try is safe too: a lock
//! granted to a try nobody reads is released on its connection.
//!
//! # Lost locks
//!
//! Every connection that holds locks runs `SELECT 1` every `keepalive` (default 5 s), which must
//! answer within 2 s. When a connection dies (server restart, `KILL`, a cut network), the
//! [`lost_token`](crate::LockGuard::lost_token) of every guard on it is cancelled, the
//! connection is dropped (SQL Server frees a session's application locks when it ends) and
//! later acquisitions open fresh connections.
//!
//! # Fencing tokens
//!
//! Not issued: [`fencing_token`](crate::LockGuard::fencing_token) is `None`.
//!
//! # URL
//!
//! `mssql://user:password@host:port/database` (or `sqlserver://`; port 1433 by default). User
//! and password are percent-decoded. Named instances need their port: the SQL Browser service
//! is not queried. Options:
//!
//! | option | default | meaning |
//! |---|---|---|
//! | `encrypt` | `true` | `true` (TLS for the whole connection), `false` (TLS for the login only), `not_supported` (no TLS) |
//! | `trust_server_certificate` | `false` | accept the server's certificate without checking it |
//! | `application_name` | none | shown by the server as the session's program name |
//! | `keepalive` | `5s` | liveness check cadence of connections that hold locks |
//! | `connections` | `4` | lock connections (1 to 64) |
//! | `wait_connections` | `4` | connections for native waits (0 to 64) |
//! | `connect_timeout` | `10s` | how long opening a connection may take |
//!
//! An ADO.NET connection string works too, through [`MssqlBackend::builder_from_ado`]:
//! `Server=tcp:db.internal,1433;Database=app;User Id=app;Password=secret;TrustServerCertificate=true`.
//! TLS is done by rustls (no OpenSSL). The server's certificate is verified against the
//! system's roots unless `trust_server_certificate=true`; for a private CA, put
//! `TrustServerCertificateCA=/path/ca.pem` in an ADO.NET string, or call
//! `tiberius::Config::trust_cert_ca` and use [`MssqlBackend::builder`] (the driver then trusts
//! that CA besides the system's roots). Both `TrustServerCertificate=true` and
//! `TrustServerCertificateCA` in one string is a [`LockError::Config`].
//!
//! # Permissions
//!
//! `sp_getapplock` and `sp_releaseapplock` need membership in the database's `public` role,
//! which every database user has: `CREATE USER dlock_app FOR LOGIN dlock_app` in the URL's
//! database is all. (From the SQL Server documentation; not verified here, see the README.)
//!
//! # Transaction-bound locks
//!
//! [`try_acquire_in_transaction`] and [`acquire_in_transaction`] take an application lock with
//! `@LockOwner = 'Transaction'` on the caller's own `tiberius` connection, inside the
//! transaction the caller has begun (`BEGIN TRANSACTION`); SQL Server releases it at commit or
//! rollback, and no connection of the backend is involved. Without an open transaction the
//! server answers -999 ([`LockError::Backend`]).

mod conn;
mod statements;

use std::time::Duration;

use futures_util::io::{AsyncRead, AsyncWrite};
use tiberius::{AuthMethod, Config, EncryptionLevel};

use crate::LockError;
use crate::options::{query_pairs, unknown_option};
use crate::session::{LaneSettings, Lanes, check_connect_timeout, lane_backend};
use conn::MssqlConnector;
pub use statements::resource_name;
use statements::{Grant, NAME, Owner, getapplock_call, getapplock_result, lock_timeout_ms};
/// The `key=value` pairs of an ADO.NET connection string, keys trimmed and in lower case,
/// values unquoted (`'...'` or `"..."`, a doubled quote standing for one; `;` inside quotes
/// belongs to the value).
fn ado_pairs(text: &str) -> Vec<(String, String)> {
    let mut pairs = Vec::new();
    let mut chars = text.chars().peekable();
    loop {
        let key: String = chars.by_ref().take_while(|c| *c != '=').collect();
        if key.trim().is_empty() && chars.peek().is_none() {
            return pairs;
        }
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        let mut value = String::new();
        match chars.peek().copied() {
            Some(quote @ ('\'' | '"')) => {
                chars.next();
                while let Some(c) = chars.next() {
                    if c == quote {
                        if chars.next_if_eq(&quote).is_some() {
                            value.push(quote);
                        } else {
                            break;
                        }
                    } else {
                        value.push(c);
                    }
                }
                // Up to the separator.
                for c in chars.by_ref() {
                    if c == ';' {
                        break;
                    }
                }
            }
            _ => {
                for c in chars.by_ref() {
                    if c == ';' {
                        break;
                    }
                    value.push(c);
                }
            }
        }
        // A part without `=` (a stray `;`) has eaten its way to the end; keep what was found.
        let key = key.trim().to_ascii_lowercase();
        if !key.is_empty() {
            pairs.push((
                key.rsplit(';').next().unwrap_or_default().trim().to_owned(),
                value,
            ));
        }
        if chars.peek().is_none() {
            return pairs;
        }
    }
}

/// The `tiberius` driver this module is built against, for [`MssqlBackend::builder`]'s
/// `Config` and the transaction-bound functions' `Client`.
pub use tiberius;

const DEFAULT_KEEPALIVE: Duration = Duration::from_secs(5);
const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
const DEFAULT_CONNECTIONS: usize = 4;
const DEFAULT_WAIT_CONNECTIONS: usize = 4;
const DEFAULT_PORT: u16 = 1433;

const URL_OPTIONS: &[&str] = &[
    "encrypt",
    "trust_server_certificate",
    "application_name",
    "keepalive",
    "connections",
    "wait_connections",
    "connect_timeout",
];

/// The SQL Server backend. Made by [`LockProvider::connect`](crate::LockProvider::connect)
/// with an `mssql://` URL, by [`MssqlBackend::new`] from a [`tiberius::Config`], or by
/// [`MssqlBackend::builder`]. See the [module docs](self) for how it uses connections.
#[derive(Clone)]
pub struct MssqlBackend {
    lanes: std::sync::Arc<Lanes<MssqlConnector>>,
    addr: String,
}

/// Builds an [`MssqlBackend`] with options.
#[derive(Clone)]
#[must_use]
pub struct MssqlBuilder {
    config: Config,
    connect_timeout: Duration,
    settings: LaneSettings,
}

impl std::fmt::Debug for MssqlBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The config carries the password: show only where it points.
        f.debug_struct("MssqlBuilder")
            .field("addr", &self.config.get_addr())
            .field("connect_timeout", &self.connect_timeout)
            .field("keepalive", &self.settings.keepalive)
            .field("connections", &self.settings.connections)
            .field("wait_connections", &self.settings.wait_connections)
            .finish()
    }
}

impl MssqlBuilder {
    /// The driver configuration the backend connects with (server, credentials, TLS).
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// How often connections that hold locks are checked (default 5 s, at least 10 ms).
    pub fn keepalive(mut self, keepalive: Duration) -> Self {
        self.settings.keepalive = keepalive;
        self
    }

    /// How long opening a connection may take (default 10 s).
    pub fn connect_timeout(mut self, connect_timeout: Duration) -> Self {
        self.connect_timeout = connect_timeout;
        self
    }

    /// The number of lock connections (default 4, 1 to 64).
    pub fn connections(mut self, connections: usize) -> Self {
        self.settings.connections = connections;
        self
    }

    /// The most connections used for native waits at once (default 4, 0 to 64; 0 makes waits
    /// poll instead).
    pub fn wait_connections(mut self, wait_connections: usize) -> Self {
        self.settings.wait_connections = wait_connections;
        self
    }

    /// Opens the first lock connection (so a wrong address or password is reported here) and
    /// starts the backend; the other connections open when first needed. Must run inside a
    /// Tokio runtime.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: dropping the future closes the connection it was opening.
    pub async fn open(self) -> Result<MssqlBackend, LockError> {
        check_connect_timeout(self.connect_timeout)?;
        self.settings.check()?;
        let addr = self.config.get_addr();
        let connector = MssqlConnector {
            config: self.config,
            connect_timeout: self.connect_timeout,
        };
        let lanes = Lanes::open(connector, self.settings).await?;
        Ok(MssqlBackend {
            lanes: std::sync::Arc::new(lanes),
            addr,
        })
    }
}

impl MssqlBackend {
    /// A builder that connects with `config` (server, credentials, TLS settings).
    pub fn builder(config: Config) -> MssqlBuilder {
        MssqlBuilder {
            config,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            settings: LaneSettings {
                connections: DEFAULT_CONNECTIONS,
                wait_connections: DEFAULT_WAIT_CONNECTIONS,
                keepalive: DEFAULT_KEEPALIVE,
            },
        }
    }

    /// Parses an `mssql://` (or `sqlserver://`) URL with the options of the
    /// [module docs](self) into a builder, without connecting.
    pub fn builder_from_url(url: &str) -> Result<MssqlBuilder, LockError> {
        parse_url(url)?.into_builder()
    }

    /// A builder from an ADO.NET connection string such as
    /// `Server=tcp:db,1433;Database=app;User Id=app;Password=secret;TrustServerCertificate=true`.
    ///
    /// `TrustServerCertificate=true` and `TrustServerCertificateCA=<path>` exclude each other
    /// (the driver would panic on both): together they are a [`LockError::Config`].
    pub fn builder_from_ado(connection_string: &str) -> Result<MssqlBuilder, LockError> {
        let both_trusts = || {
            LockError::config(
                "the ADO.NET connection string sets both TrustServerCertificate=true (no check) \
                 and TrustServerCertificateCA (check against that CA); keep the one you mean",
            )
        };
        let keys = ado_pairs(connection_string);
        let trusts_all = keys.iter().any(|(key, value)| {
            key == "trustservercertificate"
                && matches!(value.trim().to_ascii_lowercase().as_str(), "true" | "yes")
        });
        if trusts_all
            && keys
                .iter()
                .any(|(key, _)| key == "trustservercertificateca")
        {
            return Err(both_trusts());
        }
        // The driver panics on the pair; should its reading of the string find one where the
        // check above did not (quoting), the panic is kept from the caller.
        let parsed = std::panic::catch_unwind(|| Config::from_ado_string(connection_string))
            .map_err(|_| both_trusts())?;
        let config = parsed.map_err(|_| {
            // The driver's message may quote parts of the string: say what to check instead.
            LockError::config(
                "the ADO.NET connection string could not be parsed; check its Server \
                 (tcp:host,port), Database, User Id, Password, Encrypt and \
                 TrustServerCertificate entries",
            )
        })?;
        Ok(MssqlBackend::builder(config))
    }

    /// A backend with the default settings that connects with `config`.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), dlock::LockError> {
    /// let mut config = tiberius::Config::new();
    /// config.host("db.internal");
    /// config.authentication(tiberius::AuthMethod::sql_server("app", "secret"));
    /// let backend = dlock::mssql::MssqlBackend::new(config).await?;
    /// let locks = dlock::LockProvider::from_backend(backend);
    /// # Ok(()) }
    /// ```
    ///
    /// # Cancel safety
    ///
    /// Cancel safe, as [`MssqlBuilder::open`].
    pub async fn new(config: Config) -> Result<MssqlBackend, LockError> {
        MssqlBackend::builder(config).open().await
    }

    /// Connects with an `mssql://` URL.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe, as [`MssqlBuilder::open`].
    pub async fn connect(url: &str) -> Result<MssqlBackend, LockError> {
        MssqlBackend::builder_from_url(url)?.open().await
    }

    /// The liveness check cadence.
    pub fn keepalive(&self) -> Duration {
        self.lanes.settings().keepalive
    }
}

impl std::fmt::Debug for MssqlBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MssqlBackend")
            .field("addr", &self.addr)
            .field("lanes", &self.lanes)
            .finish()
    }
}

lane_backend!(MssqlBackend, NAME);

// ---------------------------------------------------------------------------------------------
// Transaction-bound locks.

/// One attempt to lock `key` in the caller's open transaction on `client`
/// (`@LockOwner = 'Transaction'`, `@LockTimeout = 0`). SQL Server releases the lock when the
/// transaction commits or rolls back.
///
/// Returns [`LockError::AlreadyHeld`] when the key is held elsewhere. Locking the same key
/// twice in one transaction succeeds both times (SQL Server counts it), unlike the provider's
/// locks.
///
/// ```no_run
/// # async fn demo(client: &mut tiberius::Client<tokio_util::compat::Compat<tokio::net::TcpStream>>)
/// # -> Result<(), Box<dyn std::error::Error>> {
/// client.simple_query("BEGIN TRANSACTION").await?.into_results().await?;
/// dlock::mssql::try_acquire_in_transaction(client, "invoices:42").await?;
/// // ... work inside the transaction ...
/// client.simple_query("COMMIT").await?.into_results().await?; // releases the lock
/// # Ok(()) }
/// ```
///
/// # Cancel safety
///
/// Not cancel safe: dropping the future mid-statement leaves `client` in the middle of a
/// response; roll back and discard the connection then. The lock itself can never outlive the
/// transaction.
pub async fn try_acquire_in_transaction<S>(
    client: &mut tiberius::Client<S>,
    key: &str,
) -> Result<(), LockError>
where
    S: AsyncRead + AsyncWrite + Unpin + Send,
{
    lock_in_transaction(client, key, Duration::ZERO).await
}

/// Locks `key` in the caller's open transaction on `client`, waiting on the server up to
/// `timeout` (`Duration::MAX`: no limit; otherwise at most `i32::MAX` milliseconds, about
/// 24.8 days). Returns [`LockError::Timeout`] when it stays held elsewhere
/// ([`LockError::AlreadyHeld`] for a zero timeout).
///
/// # Cancel safety
///
/// Not cancel safe, as [`try_acquire_in_transaction`].
pub async fn acquire_in_transaction<S>(
    client: &mut tiberius::Client<S>,
    key: &str,
    timeout: Duration,
) -> Result<(), LockError>
where
    S: AsyncRead + AsyncWrite + Unpin + Send,
{
    lock_in_transaction(client, key, timeout).await
}

async fn lock_in_transaction<S>(
    client: &mut tiberius::Client<S>,
    key: &str,
    timeout: Duration,
) -> Result<(), LockError>
where
    S: AsyncRead + AsyncWrite + Unpin + Send,
{
    crate::key::validate_key(key)?;
    let call = getapplock_call(
        &resource_name(key),
        Owner::Transaction,
        lock_timeout_ms(timeout),
    );
    let code = conn::run_scalar(client, &call)
        .await
        .map_err(|err| conn::failure("taking a transaction-bound lock", err).error)?;
    match getapplock_result(code, key)? {
        Grant::Granted => Ok(()),
        Grant::TimedOut => Err(contention(key, timeout)),
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

/// An `mssql://` URL taken apart (plain data, so tests can pin it).
#[derive(Clone, PartialEq, Eq)]
struct ParsedUrl {
    host: String,
    port: u16,
    database: Option<String>,
    user: String,
    password: String,
    encryption: Encryption,
    trust_server_certificate: bool,
    application_name: Option<String>,
    keepalive: Duration,
    connections: usize,
    wait_connections: usize,
    connect_timeout: Duration,
}

impl std::fmt::Debug for ParsedUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ParsedUrl")
            .field("host", &self.host)
            .field("port", &self.port)
            .field("database", &self.database)
            .field("user", &self.user)
            .field("password", &"<redacted>")
            .field("encryption", &self.encryption)
            .finish_non_exhaustive()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Encryption {
    Required,
    LoginOnly,
    None,
}

fn parse_url(url: &str) -> Result<ParsedUrl, LockError> {
    let parsed = url::Url::parse(url).map_err(|err| {
        LockError::config(format!(
            "the SQL Server URL is malformed ({err}); expected mssql://user:password@host:port/database"
        ))
    })?;
    if !matches!(parsed.scheme(), "mssql" | "sqlserver") {
        return Err(LockError::config(
            "a SQL Server URL starts with mssql:// or sqlserver://",
        ));
    }
    let host = match parsed.host_str() {
        Some(host) if !host.is_empty() => host.to_owned(),
        _ => {
            return Err(LockError::config(
                "the SQL Server URL has no host; expected mssql://user:password@host:port/database",
            ));
        }
    };
    let user = decode(parsed.username(), "user name")?;
    let password = decode(parsed.password().unwrap_or(""), "password")?;
    if user.is_empty() {
        return Err(LockError::config(
            "the SQL Server URL has no user name; expected mssql://user:password@host:port/database \
             (or use MssqlBackend::builder with a tiberius::Config for other authentication)",
        ));
    }
    let database = decode(parsed.path().trim_start_matches('/'), "database name")?;
    if database.contains('/') {
        return Err(LockError::config(
            "the SQL Server URL's path must be just the database name",
        ));
    }
    let mut out = ParsedUrl {
        host,
        port: parsed.port().unwrap_or(DEFAULT_PORT),
        database: (!database.is_empty()).then_some(database),
        user,
        password,
        encryption: Encryption::Required,
        trust_server_certificate: false,
        application_name: None,
        keepalive: DEFAULT_KEEPALIVE,
        connections: DEFAULT_CONNECTIONS,
        wait_connections: DEFAULT_WAIT_CONNECTIONS,
        connect_timeout: DEFAULT_CONNECT_TIMEOUT,
    };
    for (name, value) in query_pairs(parsed.query().unwrap_or("")) {
        match name.as_str() {
            "encrypt" => {
                out.encryption = match value.to_ascii_lowercase().as_str() {
                    "true" | "yes" | "on" | "required" | "mandatory" => Encryption::Required,
                    "false" | "no" | "off" | "optional" => Encryption::LoginOnly,
                    "not_supported" | "none" => Encryption::None,
                    _ => {
                        return Err(LockError::config(format!(
                            "option `encrypt` has the value `{}`; use true, false or not_supported",
                            crate::options::shown(&value)
                        )));
                    }
                }
            }
            "trust_server_certificate" => {
                out.trust_server_certificate = parse_bool("trust_server_certificate", &value)?
            }
            "application_name" => out.application_name = Some(value),
            "keepalive" => out.keepalive = crate::parse_duration("keepalive", &value)?,
            "connect_timeout" => {
                out.connect_timeout = crate::parse_duration("connect_timeout", &value)?
            }
            "connections" => out.connections = parse_count("connections", &value)?,
            "wait_connections" => out.wait_connections = parse_count("wait_connections", &value)?,
            other => return Err(unknown_option("SQL Server", other, URL_OPTIONS)),
        }
    }
    Ok(out)
}

impl ParsedUrl {
    fn into_builder(self) -> Result<MssqlBuilder, LockError> {
        let mut config = Config::new();
        config.host(&self.host);
        config.port(self.port);
        if let Some(database) = &self.database {
            config.database(database);
        }
        config.authentication(AuthMethod::sql_server(&self.user, &self.password));
        config.encryption(match self.encryption {
            Encryption::Required => EncryptionLevel::Required,
            Encryption::LoginOnly => EncryptionLevel::Off,
            Encryption::None => EncryptionLevel::NotSupported,
        });
        if self.trust_server_certificate {
            config.trust_cert();
        }
        if let Some(name) = &self.application_name {
            config.application_name(name);
        }
        let builder = MssqlBackend::builder(config)
            .keepalive(self.keepalive)
            .connect_timeout(self.connect_timeout)
            .connections(self.connections)
            .wait_connections(self.wait_connections);
        builder.settings.check()?;
        check_connect_timeout(builder.connect_timeout)?;
        Ok(builder)
    }
}

fn decode(text: &str, what: &str) -> Result<String, LockError> {
    crate::options::percent_decode(text).ok_or_else(|| {
        LockError::config(format!(
            "the {what} in the SQL Server URL is not valid percent-encoded UTF-8"
        ))
    })
}

fn parse_bool(option: &str, value: &str) -> Result<bool, LockError> {
    match value.to_ascii_lowercase().as_str() {
        "true" | "yes" | "on" | "1" => Ok(true),
        "false" | "no" | "off" | "0" => Ok(false),
        _ => Err(LockError::config(format!(
            "option `{option}` has the value `{}`; use true or false",
            crate::options::shown(value)
        ))),
    }
}

fn parse_count(option: &str, value: &str) -> Result<usize, LockError> {
    value.parse().map_err(|_| {
        LockError::config(format!(
            "option `{option}` has the value `{}`, which is not a count",
            crate::options::shown(value)
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn url_defaults() {
        let url = parse_url("mssql://app:secret@db.internal/app").unwrap();
        assert_eq!(url.host, "db.internal");
        assert_eq!(url.port, 1433);
        assert_eq!(url.database.as_deref(), Some("app"));
        assert_eq!(url.user, "app");
        assert_eq!(url.password, "secret");
        assert_eq!(url.encryption, Encryption::Required);
        assert!(!url.trust_server_certificate);
        assert_eq!(url.keepalive, Duration::from_secs(5));
        assert_eq!(url.connections, 4);
        assert_eq!(url.wait_connections, 4);
        assert_eq!(url.connect_timeout, Duration::from_secs(10));
    }

    #[test]
    fn url_options_and_decoding() {
        let url = parse_url(
            "sqlserver://do%6D%5Cuser:p%40ss%3Aw%2Fo+rd@127.0.0.1:14330/my%20db?encrypt=false\
             &trust_server_certificate=true&application_name=billing&keepalive=250ms\
             &connections=2&wait_connections=0&connect_timeout=3s",
        )
        .unwrap();
        assert_eq!(url.user, "dom\\user");
        assert_eq!(url.password, "p@ss:w/o+rd");
        assert_eq!(url.host, "127.0.0.1");
        assert_eq!(url.port, 14330);
        assert_eq!(url.database.as_deref(), Some("my db"));
        assert_eq!(url.encryption, Encryption::LoginOnly);
        assert!(url.trust_server_certificate);
        assert_eq!(url.application_name.as_deref(), Some("billing"));
        assert_eq!(url.keepalive, Duration::from_millis(250));
        assert_eq!(url.connections, 2);
        assert_eq!(url.wait_connections, 0);
        assert_eq!(url.connect_timeout, Duration::from_secs(3));
        let builder = url.into_builder().unwrap();
        assert_eq!(builder.config.get_addr(), "127.0.0.1:14330");
        assert_eq!(
            parse_url("mssql://a:b@h/?encrypt=not_supported")
                .unwrap()
                .encryption,
            Encryption::None
        );
        assert_eq!(parse_url("mssql://a:b@h").unwrap().database, None);
    }

    #[test]
    fn url_errors_never_show_the_password() {
        let cases = [
            "mssql://app:hunter2@db/app?bogus=1",
            "mssql://app:hunter2@db/app?encrypt=maybe",
            "mssql://app:hunter2@db/app?keepalive=soon",
            "mssql://app:hunter2@db/app?connections=0",
            "mssql://app:hunter2@db/app?connections=many",
            "mssql://app:hunter2@db/app?wait_connections=65",
            "mssql://app:hunter2@db/app?connect_timeout=0",
            "mssql://app:hunter2@db/app?connect_timeout=10000000000000000s",
            "mssql://app:hunter2@db/app?keepalive=10000000000000000s",
            "mssql://app:hunter2@db:99999/app",
            "mssql://:hunter2@db/app",
            "mssql://app:hunter2@/app",
            "mssql://app:hunter2@db/a/b",
            "mssql://app:hunter2%FF@db/app",
            "postgres://app:hunter2@db/app",
        ];
        for case in cases {
            let err = MssqlBackend::builder_from_url(case).unwrap_err();
            assert_eq!(err.code(), "DistributedLock.Configuration", "{case}");
            let text = err.to_string();
            assert!(!text.contains("hunter2"), "{case}: {text}");
        }
        let err = MssqlBackend::builder_from_url("mssql://app:hunter2@db/app?bogus=1").unwrap_err();
        assert!(err.to_string().contains("connect_timeout"), "{err}");
    }

    #[test]
    fn ado_connection_strings() {
        let builder = MssqlBackend::builder_from_ado(
            "Server=tcp:db.internal,14331;Database=app;User Id=app;Password=hunter2;\
             TrustServerCertificate=true",
        )
        .unwrap();
        assert_eq!(builder.config.get_addr(), "db.internal:14331");
        let shown = format!("{builder:?}");
        assert!(!shown.contains("hunter2"), "{shown}");
        let err =
            MssqlBackend::builder_from_ado("Server=tcp:db,notaport;Password=hunter2").unwrap_err();
        assert_eq!(err.code(), "DistributedLock.Configuration");
        assert!(!err.to_string().contains("hunter2"));
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
