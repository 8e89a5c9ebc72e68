#![doc = include_str!("docs.md")]

mod session;
mod statements;
mod url;

use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgConnection};

use crate::backend::BoxFuture;
use crate::key::validate_key;
use crate::session::{Dial, Driver, Opened, SessionBackend, SessionBuilder, SessionOptions};
use crate::sqlx_engine::{SqlxEngine, db_code, driver_error};
use crate::{LockError, lock_id};
use session::{
    Counted, PgConnector, create_fencing_table, is_wait_ended, join_counters, refuse_if_switched,
};
use statements::*;

/// The PostgreSQL engine: the type parameter of [`PostgresBackend`] and [`PostgresBuilder`].
#[derive(Debug, Clone, Copy)]
pub enum Postgres {}

/// The PostgreSQL backend. Made by [`LockProvider::connect`](crate::LockProvider::connect)
/// with a `postgres://` URL, by [`PostgresBackend::new`] from an existing pool, or by
/// [`PostgresBackend::builder`]. See the [module docs](self) for how it uses connections.
pub type PostgresBackend = SessionBackend<Postgres>;

/// Builds a [`PostgresBackend`] with options.
pub type PostgresBuilder = SessionBuilder<Postgres>;

impl Driver for Postgres {
    const BACKEND: &'static str = "PostgresBackend";
    const BUILDER: &'static str = "PostgresBuilder";

    type Target = PgConnectOptions;
    type Connector = PgConnector;

    fn parse_url(url: &str) -> Result<(PgConnectOptions, SessionOptions), LockError> {
        url::parse_url(url)
    }

    fn open(
        options: PgConnectOptions,
        session: &SessionOptions,
    ) -> BoxFuture<'static, Opened<Self>> {
        let mut connector = PgConnector {
            dial: Dial::new(options, session),
            counted: None,
        };
        let counters = session.fencing_counters;
        Box::pin(async move {
            let mut first = connector.open_session().await?;
            if connector.dial.fencing {
                create_fencing_table(&mut first.conn).await?;
                match counters {
                    Some(n) => {
                        let base = join_counters(&mut first.conn, n).await?;
                        connector.counted = Some(Counted { n, base });
                        first.counted = connector.counted;
                    }
                    None => refuse_if_switched(&mut first.conn).await?,
                }
            }
            Ok((connector, first))
        })
    }

    fn fmt_target(options: &PgConnectOptions, f: &mut std::fmt::DebugStruct<'_, '_>) {
        // The connect options carry the password: show only where they point.
        f.field("host", &options.get_host())
            .field("port", &options.get_port());
    }
}

impl SqlxEngine for Postgres {
    type Database = sqlx::Postgres;
}

// ---------------------------------------------------------------------------------------------
// Transaction-bound locks.

pub use crate::TransactionLock;

/// Locks `key` until the transaction open on `conn` commits or rolls back; one try
/// (`pg_try_advisory_xact_lock`). Contention is [`LockError::AlreadyHeld`].
///
/// `conn` must be inside a transaction (pass `&mut *tx` for a `sqlx::Transaction`): outside
/// one, the lock would end with this very statement. Works behind PgBouncer in transaction
/// mode. Locks are re-entrant within one transaction, as PostgreSQL's are.
///
/// # Cancel safety
///
/// If the future is dropped before it completes, the lock may or may not have been taken;
/// either way it ends with the transaction, so roll the transaction back.
pub async fn try_acquire_in_transaction(
    conn: &mut PgConnection,
    key: &str,
) -> Result<TransactionLock, LockError> {
    crate::transaction::observe(NAME, key, Duration::ZERO, try_in_transaction(conn, key)).await
}

async fn try_in_transaction(
    conn: &mut PgConnection,
    key: &str,
) -> Result<TransactionLock, LockError> {
    validate_key(key)?;
    let id = lock_id(key);
    let got: bool = sqlx::query_scalar(TRY_XACT_SQL)
        .bind(id)
        .fetch_one(&mut *conn)
        .await
        .map_err(|e| driver_error::<Postgres>("taking a transaction lock", e))?;
    if got {
        Ok(TransactionLock::new(NAME, key, None))
    } else {
        Err(LockError::AlreadyHeld {
            key: Arc::from(key),
        })
    }
}

/// Locks `key` until the transaction open on `conn` commits or rolls back, waiting on the
/// server up to `timeout` (`pg_advisory_xact_lock` under a `lock_timeout` set for this
/// statement only). Errors with [`LockError::Timeout`] when it runs out; the transaction stays
/// usable (the wait runs in a savepoint). `Duration::ZERO` is one try.
///
/// `conn` must be inside a transaction (`&mut *tx`); outside one this answers
/// [`LockError::Config`]. Works behind PgBouncer in transaction mode.
///
/// # Cancel safety
///
/// If the future is dropped before it completes, the connection may be left inside the
/// savepoint with the wait's `lock_timeout`: roll the transaction back (which also ends the
/// lock, if it was granted).
pub async fn acquire_in_transaction(
    conn: &mut PgConnection,
    key: &str,
    timeout: Duration,
) -> Result<TransactionLock, LockError> {
    crate::transaction::observe(NAME, key, timeout, wait_in_transaction(conn, key, timeout)).await
}

async fn wait_in_transaction(
    conn: &mut PgConnection,
    key: &str,
    timeout: Duration,
) -> Result<TransactionLock, LockError> {
    validate_key(key)?;
    if timeout.is_zero() {
        return try_in_transaction(conn, key).await;
    }
    let id = lock_id(key);
    let err = |e| driver_error::<Postgres>("taking a transaction lock", e);
    let previous: (String, String) = sqlx::query_as(TIMEOUTS_SQL)
        .fetch_one(&mut *conn)
        .await
        .map_err(err)?;
    match sqlx::query(SAVEPOINT_SQL).execute(&mut *conn).await {
        Ok(_) => {}
        Err(e) if db_code::<Postgres>(&e).as_deref() == Some("25P01") => {
            return Err(LockError::config(
                "acquire_in_transaction needs an open transaction: pass `&mut *tx` of a transaction begun with `begin()`",
            ));
        }
        Err(e) => return Err(err(e)),
    }
    let waited = async {
        sqlx::query(SET_WAIT_TIMEOUTS_SQL)
            .bind(lock_timeout_setting(timeout))
            .execute(&mut *conn)
            .await?;
        sqlx::query(WAIT_XACT_SQL)
            .bind(id)
            .execute(&mut *conn)
            .await
    }
    .await;
    match waited {
        Ok(_) => {
            sqlx::query(RESTORE_TIMEOUTS_SQL)
                .bind(&previous.0)
                .bind(&previous.1)
                .execute(&mut *conn)
                .await
                .map_err(err)?;
            sqlx::query(RELEASE_SAVEPOINT_SQL)
                .execute(&mut *conn)
                .await
                .map_err(err)?;
            Ok(TransactionLock::new(NAME, key, None))
        }
        Err(e) => {
            // Undo the savepoint (and with it the wait's lock_timeout).
            sqlx::query(ROLLBACK_SAVEPOINT_SQL)
                .execute(&mut *conn)
                .await
                .map_err(err)?;
            sqlx::query(RELEASE_SAVEPOINT_SQL)
                .execute(&mut *conn)
                .await
                .map_err(err)?;
            if !is_wait_ended(&e) {
                return Err(err(e));
            }
            // The lock may have been granted just as the timeout fired: look before answering.
            let held: bool = sqlx::query_scalar(HELD_SQL)
                .bind(id)
                .fetch_one(&mut *conn)
                .await
                .map_err(err)?;
            if held {
                Ok(TransactionLock::new(NAME, key, None))
            } else {
                Err(LockError::Timeout {
                    key: Arc::from(key),
                    timeout,
                })
            }
        }
    }
}
