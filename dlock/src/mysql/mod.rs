#![doc = include_str!("docs.md")]

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
