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
//! Opt-in (`fencing=true`, or [`MssqlBuilder::fencing`]); without it
//! [`fencing_token`](crate::LockGuard::fencing_token) is `None`. The backend keeps one counter
//! row per resource name in the table
//! `dlock_fencing (resource nvarchar(255) PRIMARY KEY, token bigint)` (created if missing, in
//! the user's default schema), and increments it in the same batch as the `sp_getapplock`
//! that takes the lock, only when the lock is granted, so an acquisition costs one round trip
//! either way, tries and waits alike (a wait's token is taken after the grant, on the session
//! that holds the lock). Should the increment fail, the batch gives the lock back before it
//! reports the error: no lock is kept without its token. Each increment commits on its own,
//! so tokens increase strictly for each key across holders, processes and server restarts.
//! Every process that locks a key must use the same table: application locks are the
//! database's, while the table is found in the user's default schema, so users of other
//! default schemas share the lock but count its tokens apart, and those tokens are not
//! ordered with each other. Transaction-bound locks issue no
//! token.
//!
//! # Read locks
//!
//! [`try_acquire_read`](crate::LockProvider::try_acquire_read) and
//! [`acquire_read`](crate::LockProvider::acquire_read) take the key's application lock with
//! `sp_getapplock @LockMode = 'Shared'` (given back with `sp_releaseapplock`, as the exclusive
//! lock): readers share the key and exclude its exclusive lock, and the other way round. The
//! readers of one backend that land on one lock connection share its one shared lock, which is
//! given back when the last of them leaves; a read try goes to a lock connection that does not
//! hold the key yet while there is one, so the server answers it. With fencing, a read lock
//! takes its token from the key's counter in the same batch, so a writer's token exceeds every
//! token issued before it.
//!
//! **Writers are not starved:** SQL Server grants lock requests of a resource in the order
//! they arrive, so a reader that asks while a writer waits queues behind the writer (a try
//! answers [`LockError::AlreadyHeld`]), and the writer gets the key once the readers before it
//! have left. In one backend, a waiting writer also holds back later readers of the same
//! backend. This ordering is the server's; it has not been checked against a live server
//! here (see `docs/backends.md` in the repository). Transaction-bound locks have no read form.
//!
//! # Semaphores
//!
//! The backend keeps semaphores itself ([`LockBackend::semaphores`](crate::backend::LockBackend::semaphores)):
//! a permit is a session application lock of a lock connection, like a lock, and a try is
//! **one batch**.
//!
//! - **Slots.** The semaphore `key` of `n` permits is the application locks `<base>:0` to
//!   `<base>:<n - 1>`, held exclusively, where `<base>` is `dlock-sem:` and the 64 hex digits of
//!   SHA-256 of the key.
//! - **The count record.** SQL Server lists application locks only to a login with
//!   `VIEW SERVER STATE`, so each holder holds `<base>:count:<j>` in shared mode for each bit
//!   `j` set in `n`, and a try reads the record bit by bit with `APPLOCK_TEST` (and
//!   `APPLOCK_MODE` for this session's own). Another count is refused with
//!   [`LockError::Config`] naming both, taking nothing.
//! - **One try.** In a transaction that holds the semaphore's gate (`<base>:gate`,
//!   `@LockOwner = 'Transaction'`, so tries of one semaphore run one at a time), the batch
//!   reads the record; unless it names another count, or (for a single try) a session holds
//!   the semaphore's queue lock
//!   ([`PermitRequest::queue_key`](crate::backend::PermitRequest::queue_key)), it walks the
//!   slots from a random one on with `sp_getapplock @LockTimeout = 0`, skipping those this
//!   session holds (`sp_getapplock` would grant them again, and a lock connection is shared by
//!   every acquisition of the backend), and takes the first free one with its shares of the
//!   record.
//! - **Bound.** The server cannot count the held slots, so a try that finds the semaphore
//!   full has asked for every slot: `max_count` is at most **1,024** (the 11 bits of the
//!   record), and a larger one is a [`LockError::Config`] naming the bound.
//! - **Release, loss, fencing.** A release gives back the slot, then the record's shares. A
//!   permit ends with its connection and is reported lost with it. With `fencing=true`, the
//!   semaphore's counter (`dlock_fencing` row `<base>`) is incremented in the batch, under the
//!   gate.
//!
//! The batches are pinned by the unit tests and run by `tests/mssql.rs` against the server of
//! `DLOCK_MSSQL_URL`. A batch that fails after it may have taken a slot drops its connection.
//!
//! # URL
//!
//! `mssql://user:password@host:port/database` (or `sqlserver://`; port 1433 by default). User
//! and password are percent-decoded. Named instances need their port: the SQL Browser service
//! is not queried. Options:
//!
//! | option | default | meaning |
//! |---|---|---|
//! | `fencing` | `false` | issue fencing tokens (see above) |
//! | `encrypt` | `true` | `true` (TLS for the whole connection), `false` (TLS for the login only), `not_supported` (no TLS) |
//! | `trust_server_certificate` | `false` | accept the server's certificate without checking it |
//! | `application_name` | none | shown by the server as the session's program name |
//! | `keepalive` | `5s` | liveness check cadence of connections that hold locks |
//! | `connections` | `4` | lock connections (1 to 64) |
//! | `wait_connections` | `4` | connections for native waits (0 to 64) |
//! | `connect_timeout` | `10s` | how long opening a connection may take |
//! | `statement_timeout` | `10s` | the most one short statement (a try, a release) may take before its connection is dropped and its locks reported lost (10 ms to 365 days) |
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
//! database is all. With fencing, the user needs `SELECT`, `INSERT` and `UPDATE` on the
//! fencing table; the backend creates the table only when it is missing, and then needs
//! `CREATE TABLE` and `ALTER` on the schema. A user that may neither see nor create it gets a
//! [`LockError::Config`] with the statements to run when the backend opens:
//!
//! ```sql
//! CREATE TABLE dbo.dlock_fencing (resource nvarchar(255) NOT NULL PRIMARY KEY, token bigint NOT NULL);
//! GRANT SELECT, INSERT, UPDATE ON dbo.dlock_fencing TO dlock_app;
//! ```
//!
//! (From the SQL Server documentation; not verified here, see `docs/production.md`.)
//!
//! # Transaction-bound locks
//!
//! [`try_acquire_in_transaction`] and [`acquire_in_transaction`] take an application lock with
//! `@LockOwner = 'Transaction'` on the caller's own `tiberius` connection, inside the
//! transaction the caller has begun (`BEGIN TRANSACTION`); SQL Server releases it at commit or
//! rollback, and no connection of the backend is involved. Without an open transaction the
//! server answers -999 ([`LockError::Backend`]).

mod session;
mod statements;
mod url;

use std::time::Duration;

use futures_util::io::{AsyncRead, AsyncWrite};
use tiberius::Config;

use crate::LockError;
use crate::backend::BoxFuture;
use crate::session::{
    Dial, Driver, Opened, SessionBackend, SessionBuilder, SessionOptions, contention,
};
use session::{MssqlConnector, create_fencing_table};
pub use statements::resource_name;
use statements::{Grant, NAME, Owner, getapplock_call, getapplock_result, lock_timeout_ms};

/// The `tiberius` driver this module is built against, for [`MssqlBackend::builder`]'s
/// `Config` and the transaction-bound functions' `Client`.
pub use tiberius;

pub use crate::TransactionLock;

/// The SQL Server engine: the type parameter of [`MssqlBackend`] and [`MssqlBuilder`].
#[derive(Debug, Clone, Copy)]
pub enum Mssql {}

/// The SQL Server backend. Made by [`LockProvider::connect`](crate::LockProvider::connect)
/// with an `mssql://` URL, by [`MssqlBackend::new`] from a [`tiberius::Config`], or by
/// [`MssqlBackend::builder`]. See the [module docs](self) for how it uses connections.
pub type MssqlBackend = SessionBackend<Mssql>;

/// Builds an [`MssqlBackend`] with options.
pub type MssqlBuilder = SessionBuilder<Mssql>;

impl Driver for Mssql {
    const BACKEND: &'static str = "MssqlBackend";
    const BUILDER: &'static str = "MssqlBuilder";

    type Target = Config;
    type Connector = MssqlConnector;

    fn parse_url(url: &str) -> Result<(Config, SessionOptions), LockError> {
        Ok(url::parse_url(url)?.into_parts())
    }

    fn open(config: Config, options: &SessionOptions) -> BoxFuture<'static, Opened<Self>> {
        let connector = MssqlConnector {
            dial: Dial::new(config, options),
            gate_wait: options.statement_timeout,
        };
        let refused = crate::session::refuse_fencing_counters(NAME, options);
        Box::pin(async move {
            refused?;
            let mut first = crate::session::Connector::open(&connector).await?;
            if connector.dial.fencing {
                create_fencing_table(&mut first.client).await?;
            }
            Ok((connector, first))
        })
    }

    fn fmt_target(config: &Config, f: &mut std::fmt::DebugStruct<'_, '_>) {
        // The config carries the password: show only where it points.
        f.field("addr", &config.get_addr());
    }
}

impl SessionBuilder<Mssql> {
    /// The driver configuration the backend connects with (server, credentials, TLS).
    pub fn config(&self) -> &Config {
        &self.target
    }
}

impl SessionBackend<Mssql> {
    /// A builder that connects with `config` (server, credentials, TLS settings).
    pub fn builder(config: Config) -> MssqlBuilder {
        SessionBuilder::new(config)
    }

    /// A builder from an ADO.NET connection string such as
    /// `Server=tcp:db,1433;Database=app;User Id=app;Password=secret;TrustServerCertificate=true`.
    ///
    /// `TrustServerCertificate=true` and `TrustServerCertificateCA=<path>` exclude each other
    /// (the driver would panic on both): together they are a [`LockError::Config`]. Without an
    /// `Encrypt` entry, TLS protects the login only (`Encrypt=false`); write `Encrypt=true`
    /// to encrypt the whole connection.
    pub fn builder_from_ado(connection_string: &str) -> Result<MssqlBuilder, LockError> {
        let both_trusts = || {
            LockError::config(
                "the ADO.NET connection string sets both TrustServerCertificate=true (no check) \
                 and TrustServerCertificateCA (check against that CA); keep the one you mean",
            )
        };
        let keys = url::ado_pairs(connection_string);
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
        let mut config = parsed.map_err(|_| {
            // The driver's message may quote parts of the string: say what to check instead.
            LockError::config(
                "the ADO.NET connection string could not be parsed; check its Server \
                 (tcp:host,port), Database, User Id, Password, Encrypt and \
                 TrustServerCertificate entries",
            )
        })?;
        // The driver now requires encryption throughout when `Encrypt` is absent; strings
        // written for the earlier default keep it (TLS for the login only).
        if !keys.iter().any(|(key, _)| key == "encrypt") {
            config.encryption(tiberius::EncryptionLevel::Off);
        }
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
}

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
) -> Result<TransactionLock, LockError>
where
    S: AsyncRead + AsyncWrite + Unpin + Send,
{
    let locking = lock_in_transaction(client, key, Duration::ZERO);
    crate::transaction::observe(NAME, key, Duration::ZERO, locking).await
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
) -> Result<TransactionLock, LockError>
where
    S: AsyncRead + AsyncWrite + Unpin + Send,
{
    let locking = lock_in_transaction(client, key, timeout);
    crate::transaction::observe(NAME, key, timeout, locking).await
}

async fn lock_in_transaction<S>(
    client: &mut tiberius::Client<S>,
    key: &str,
    timeout: Duration,
) -> Result<TransactionLock, LockError>
where
    S: AsyncRead + AsyncWrite + Unpin + Send,
{
    crate::key::validate_key(key)?;
    let call = getapplock_call(
        &resource_name(key),
        Owner::Transaction,
        lock_timeout_ms(timeout),
    );
    let code = session::run_scalar(client, &call)
        .await
        .map_err(|err| session::failure("taking a transaction-bound lock", err).error)?;
    match getapplock_result(code, key)? {
        Grant::Granted => Ok(TransactionLock::new(NAME, key, None)),
        Grant::TimedOut => Err(contention(key, timeout)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
