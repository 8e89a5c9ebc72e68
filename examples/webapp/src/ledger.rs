//! The balances: a SQLite file, used from blocking threads.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rusqlite::{Connection, ErrorCode, OptionalExtension, params};

/// Account balances and their journal, in one SQLite file.
///
/// Reads and writes are separate calls on purpose: a debit reads the balance, does its work,
/// then writes the new balance. Without a lock around the three steps, two debits of one
/// account running at once both read the same balance and one of them is lost; the journal
/// keeps every entry, so [`Ledger::reconcile`] finds the difference.
///
/// **Fencing.** A lock can be lost while its holder still works (a paused process whose lease
/// ran out, a network cut), and another holder can then take it and write. So writes carry
/// the lock's fencing token ([`Ledger::write`]): the ledger keeps the highest token it has
/// seen per account and refuses a write with a lower one ([`LedgerError::StaleToken`]), so a
/// stale holder's write can never land after a newer holder's.
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
    /// A write under a lock older than one that already wrote to the account: its holder has
    /// lost the lock since, and another holder has written. Nothing was written.
    #[error(
        "stale lock: a write with fencing token {token} came after one with token {seen}; it \
         was refused"
    )]
    StaleToken {
        /// The token of the refused write.
        token: u64,
        /// The highest token the account has seen.
        seen: u64,
    },
}

/// How long opening the ledger waits for other processes that are opening or creating it at
/// the same moment (replicas started together).
pub const OPEN_WAIT: Duration = Duration::from_secs(10);

/// Whether `err` is SQLite's "another connection has the file locked" (`SQLITE_BUSY`,
/// `SQLITE_LOCKED`).
fn is_busy(err: &rusqlite::Error) -> bool {
    matches!(
        err.sqlite_error_code(),
        Some(ErrorCode::DatabaseBusy | ErrorCode::DatabaseLocked)
    )
}

/// One attempt at opening (and creating) the ledger file.
fn try_open(path: &Path) -> Result<Connection, rusqlite::Error> {
    let conn = Connection::open(path)?;
    conn.busy_timeout(OPEN_WAIT)?;
    // Switching to WAL takes the file exclusively, and SQLite does not wait for that (no
    // busy handler) when another connection is opening it: asked only when not yet in WAL,
    // and retried by `Ledger::open`.
    let mode: String = conn.query_row("PRAGMA journal_mode", [], |row| row.get(0))?;
    if !mode.eq_ignore_ascii_case("wal") {
        conn.query_row("PRAGMA journal_mode = WAL", [], |row| {
            row.get::<_, String>(0)
        })?;
    }
    conn.execute_batch(
        "CREATE TABLE IF NOT EXISTS accounts (id TEXT PRIMARY KEY, balance INTEGER NOT NULL);
         CREATE TABLE IF NOT EXISTS journal (
             seq INTEGER PRIMARY KEY AUTOINCREMENT,
             account_id TEXT NOT NULL,
             amount INTEGER NOT NULL
         );
         CREATE TABLE IF NOT EXISTS fencing (
             account_id TEXT PRIMARY KEY,
             token INTEGER NOT NULL
         );",
    )?;
    Ok(conn)
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
    /// Opens (and creates) the ledger file, waiting up to [`OPEN_WAIT`] for other processes
    /// that open or create it at the same moment. Blocking: call it from a blocking thread.
    pub fn open(path: &Path) -> Result<Ledger, LedgerError> {
        let deadline = Instant::now() + OPEN_WAIT;
        let mut pause = Duration::from_millis(2);
        let conn = loop {
            match try_open(path) {
                Ok(conn) => break conn,
                Err(err) if is_busy(&err) && Instant::now() < deadline => {
                    // Another replica holds the file while it sets it up; its set-up is short.
                    std::thread::sleep(
                        pause.min(deadline.saturating_duration_since(Instant::now())),
                    );
                    pause = (pause * 2).min(Duration::from_millis(100));
                }
                Err(err) => return Err(err.into()),
            }
        };
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

    /// Stores `balance` as the balance of `id` (creating the account) and journals `amount`,
    /// under the lock with fencing token `token`.
    ///
    /// The write is refused with [`LedgerError::StaleToken`] when the account has already seen
    /// a higher token: a later holder of the account's lock has written since this writer's
    /// lock was taken, so this writer's lock is lost and its balance is stale. An equal token
    /// is the same holder writing again. `None` (a lock store without fencing tokens, or no
    /// lock) writes without the check.
    pub async fn write(
        &self,
        id: &str,
        balance: i64,
        amount: i64,
        token: Option<u64>,
    ) -> Result<(), LedgerError> {
        let id = id.to_owned();
        let conn = Arc::clone(&self.conn);
        tokio::task::spawn_blocking(move || {
            let mut conn = conn.lock().map_err(|_| LedgerError::Poisoned)?;
            let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
            if let Some(token) = token {
                let seen: Option<i64> = tx
                    .query_row(
                        "SELECT token FROM fencing WHERE account_id = ?1",
                        params![id],
                        |row| row.get(0),
                    )
                    .optional()?;
                // Tokens are below 2^63 in practice; a larger one is stored as the largest.
                let stored = i64::try_from(token).unwrap_or(i64::MAX);
                if let Some(seen) = seen.filter(|seen| *seen > stored) {
                    return Err(LedgerError::StaleToken {
                        token,
                        seen: u64::try_from(seen).unwrap_or(0),
                    });
                }
                tx.execute(
                    "INSERT INTO fencing (account_id, token) VALUES (?1, ?2)
                     ON CONFLICT (account_id) DO UPDATE SET token = excluded.token",
                    params![id, stored],
                )?;
            }
            tx.execute(
                "INSERT INTO accounts (id, balance) VALUES (?1, ?2)
                 ON CONFLICT (id) DO UPDATE SET balance = excluded.balance",
                params![id, balance],
            )?;
            tx.execute(
                "INSERT INTO journal (account_id, amount) VALUES (?1, ?2)",
                params![id, amount],
            )?;
            tx.commit()?;
            Ok(())
        })
        .await?
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
