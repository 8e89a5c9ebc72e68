//! The balances: a SQLite file, used from blocking threads.

use std::path::Path;
use std::sync::{Arc, Mutex};

use rusqlite::{Connection, OptionalExtension, params};

/// Account balances and their journal, in one SQLite file.
///
/// Reads and writes are separate calls on purpose: a debit reads the balance, does its work,
/// then writes the new balance. Without a lock around the three steps, two debits of one
/// account running at once both read the same balance and one of them is lost; the journal
/// keeps every entry, so [`Ledger::reconcile`] finds the difference.
#[derive(Clone)]
pub struct Ledger {
    conn: Arc<Mutex<Connection>>,
}

impl std::fmt::Debug for Ledger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ledger").finish_non_exhaustive()
    }
}

/// A failure of the balance database.
#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    /// SQLite failed.
    #[error("ledger database error: {0}")]
    Sqlite(#[from] rusqlite::Error),
    /// The blocking task ended abnormally.
    #[error("ledger task failed: {0}")]
    Task(#[from] tokio::task::JoinError),
    /// The connection mutex was poisoned by a panic.
    #[error("ledger connection poisoned")]
    Poisoned,
}

/// One account whose balance disagrees with the sum of its journal.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Mismatch {
    /// The account.
    pub id: String,
    /// The stored balance.
    pub balance: i64,
    /// The sum of the account's journal entries.
    pub journal: i64,
}

impl Ledger {
    /// Opens (and creates) the ledger file.
    pub fn open(path: &Path) -> Result<Ledger, LedgerError> {
        let conn = Connection::open(path)?;
        conn.busy_timeout(std::time::Duration::from_secs(10))?;
        conn.execute_batch(
            "PRAGMA journal_mode = WAL;
             CREATE TABLE IF NOT EXISTS accounts (id TEXT PRIMARY KEY, balance INTEGER NOT NULL);
             CREATE TABLE IF NOT EXISTS journal (
                 seq INTEGER PRIMARY KEY AUTOINCREMENT,
                 account_id TEXT NOT NULL,
                 amount INTEGER NOT NULL
             );",
        )?;
        Ok(Ledger {
            conn: Arc::new(Mutex::new(conn)),
        })
    }

    async fn with_conn<T, F>(&self, f: F) -> Result<T, LedgerError>
    where
        T: Send + 'static,
        F: FnOnce(&mut Connection) -> Result<T, rusqlite::Error> + Send + 'static,
    {
        let conn = Arc::clone(&self.conn);
        tokio::task::spawn_blocking(move || {
            let mut conn = conn.lock().map_err(|_| LedgerError::Poisoned)?;
            Ok(f(&mut conn)?)
        })
        .await?
    }

    /// The balance of `id`, `None` for an unknown account.
    pub async fn balance(&self, id: &str) -> Result<Option<i64>, LedgerError> {
        let id = id.to_owned();
        self.with_conn(move |conn| {
            conn.query_row(
                "SELECT balance FROM accounts WHERE id = ?1",
                params![id],
                |row| row.get(0),
            )
            .optional()
        })
        .await
    }

    /// Stores `balance` as the balance of `id` (creating the account) and journals `amount`.
    pub async fn write(&self, id: &str, balance: i64, amount: i64) -> Result<(), LedgerError> {
        let id = id.to_owned();
        self.with_conn(move |conn| {
            let tx = conn.transaction()?;
            tx.execute(
                "INSERT INTO accounts (id, balance) VALUES (?1, ?2)
                 ON CONFLICT (id) DO UPDATE SET balance = excluded.balance",
                params![id, balance],
            )?;
            tx.execute(
                "INSERT INTO journal (account_id, amount) VALUES (?1, ?2)",
                params![id, amount],
            )?;
            tx.commit()
        })
        .await
    }

    /// Accounts whose balance is not the sum of their journal (lost updates), and how many
    /// accounts were checked.
    pub async fn reconcile(&self) -> Result<(usize, Vec<Mismatch>), LedgerError> {
        self.with_conn(|conn| {
            let count: i64 = conn.query_row("SELECT COUNT(*) FROM accounts", [], |r| r.get(0))?;
            let mut stmt = conn.prepare(
                "SELECT a.id, a.balance, COALESCE(SUM(j.amount), 0)
                 FROM accounts a LEFT JOIN journal j ON j.account_id = a.id
                 GROUP BY a.id, a.balance
                 HAVING a.balance <> COALESCE(SUM(j.amount), 0)",
            )?;
            let mismatches = stmt
                .query_map([], |row| {
                    Ok(Mismatch {
                        id: row.get(0)?,
                        balance: row.get(1)?,
                        journal: row.get(2)?,
                    })
                })?
                .collect::<Result<Vec<_>, _>>()?;
            Ok((usize::try_from(count).unwrap_or(0), mismatches))
        })
        .await
    }
}
