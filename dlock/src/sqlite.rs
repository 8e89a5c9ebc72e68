//! SQLite: locks in a shared database file, for processes on one machine.
//!
//! The embedded default: no server to run, and every process that opens the same file shares
//! its locks. Locks are rows of the table `__distributed_locks` (created on open):
//!
//! | column | meaning |
//! |---|---|
//! | `name` (BLOB, primary key) | the key's UTF-8 bytes, compared byte for byte (NUL and any length work) |
//! | `owner` (BLOB) | a 128-bit token of the holding acquisition, `NULL` when free |
//! | `expires_at` (INTEGER) | end of the holder's lease, Unix milliseconds |
//! | `fencing` (INTEGER) | incremented by every acquisition: the fencing token |
//!
//! Acquisition is one atomic statement that takes a free or expired row. A held lock is a
//! **lease**: the provider renews it in the background every third of the lease, so the lock
//! of a process that dies (even by SIGKILL) frees itself when its lease runs out. When a
//! renewal finds the row taken over, or renewals keep failing until the lease may have run out,
//! the guard's [`lost_token`](crate::LockGuard::lost_token) fires.
//!
//! Fencing tokens are free here (the acquisition writes the row anyway): they increase strictly
//! for each key, and survive closing and reopening the file. Rows stay in the table after
//! release, to keep the counter.
//!
//! # URL
//!
//! `sqlite://relative/path.db` or `sqlite:///absolute/path.db`, with options:
//!
//! | option | default | meaning |
//! |---|---|---|
//! | `lease` | `30s` | lease of each lock; renewed every `lease / 3` |
//! | `busy_timeout` | `5s` | how long one statement waits for another writer of the file |
//!
//! The file is opened in WAL mode with `synchronous=NORMAL`: acquisitions survive a crash of the
//! process; a power loss may roll back the last ones (and their fencing tokens).
//!
//! # Limits
//!
//! SQLite has one writer at a time per file. Every acquisition, renewal and release is one
//! short write; they serialize, which is plenty for locks but bounds throughput at some tens of
//! thousands of operations per second. Leases compare wall-clock times of the processes, which
//! all run on the one machine that has the file (network file systems are not supported: their
//! file locking is not reliable enough for SQLite).
//!
//! # Transaction-bound locks
//!
//! [`try_acquire_in_transaction`] and [`acquire_in_transaction`] lock a key inside the caller's
//! own `rusqlite` transaction. The lock is held until that transaction commits or rolls back:
//! the acquisition writes to the database, and SQLite lets no other connection write until the
//! transaction ends. That also means such a transaction keeps every other writer of the file
//! waiting (including acquisitions of other keys): keep it short.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rusqlite::{Connection, ErrorCode, OpenFlags, Transaction, params};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::backend::{Acquired, BoxFuture, HeldLock, LockBackend, LockRequest};
use crate::key::validate_key;
use crate::options::{parse_duration, query_pairs, unknown_option};
use crate::time::later;
use crate::{Backoff, LockError};

const NAME: &str = "sqlite";

const SCHEMA: &str = "CREATE TABLE IF NOT EXISTS __distributed_locks (\
    name BLOB NOT NULL PRIMARY KEY, \
    owner BLOB, \
    expires_at INTEGER NOT NULL DEFAULT 0, \
    fencing INTEGER NOT NULL DEFAULT 0\
) WITHOUT ROWID";

/// The statement of an acquisition: takes a free or expired row. Parameters: `?1` name (the
/// key's bytes), `?2` owner token, `?3` new expiry and `?4` now (Unix ms). Returns the new
/// fencing token, or no row when the lock is held.
pub const ACQUIRE_SQL: &str = "INSERT INTO __distributed_locks (name, owner, expires_at, fencing) \
    VALUES (?1, ?2, ?3, 1) \
    ON CONFLICT (name) DO UPDATE SET owner = excluded.owner, expires_at = excluded.expires_at, \
    fencing = __distributed_locks.fencing + 1 \
    WHERE __distributed_locks.owner IS NULL OR __distributed_locks.expires_at <= ?4 \
    RETURNING fencing";

/// The statement of a release: frees row `?1` if owner `?2` still holds it.
pub const RELEASE_SQL: &str = "UPDATE __distributed_locks SET owner = NULL, expires_at = 0 \
    WHERE name = ?1 AND owner = ?2";

/// Extends the lease to `?3` if `?2` still owns the row.
const RENEW_SQL: &str =
    "UPDATE __distributed_locks SET expires_at = ?3 WHERE name = ?1 AND owner = ?2";

/// Bumps the fencing counter of a free row inside the caller's transaction: `?1` name, `?2` now.
const TRANSACTION_SQL: &str = "INSERT INTO __distributed_locks (name, owner, expires_at, fencing) \
    VALUES (?1, NULL, 0, 1) \
    ON CONFLICT (name) DO UPDATE SET fencing = __distributed_locks.fencing + 1 \
    WHERE __distributed_locks.owner IS NULL OR __distributed_locks.expires_at <= ?2 \
    RETURNING fencing";

/// Commits between two checkpoints of the write-ahead log.
const CHECKPOINT_EVERY: u64 = 1000;

const DEFAULT_LEASE: Duration = Duration::from_secs(30);
const DEFAULT_BUSY_TIMEOUT: Duration = Duration::from_secs(5);
const MIN_LEASE: Duration = Duration::from_millis(100);

/// The SQLite backend. Usually made through [`LockProvider::connect`](crate::LockProvider::connect)
/// with a `sqlite://` URL; [`SqliteBackend::builder`] sets the options from code.
#[derive(Clone)]
pub struct SqliteBackend {
    shared: Arc<Shared>,
}

struct Shared {
    path: PathBuf,
    /// Runs the short statements of acquisition and release on the calling task (no busy wait:
    /// a busy database is retried with async pauses, so no worker thread is ever parked).
    inline: Mutex<Connection>,
    /// Runs renewals and checkpoints on the blocking pool, with the busy timeout.
    background: Arc<Mutex<Connection>>,
    lease: Duration,
    busy_timeout: Duration,
    next_renewal: AtomicU64,
    commits: AtomicU64,
    renewals: Mutex<HashMap<u64, Renewal>>,
    wake: Arc<Notify>,
    /// The renewal task; started on first use, and again if its runtime has gone away.
    renewer: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

#[derive(Debug)]
struct Renewal {
    name: Arc<[u8]>,
    owner: [u8; 16],
    lost: CancellationToken,
    lease: Duration,
    next_due: Instant,
    deadline: Instant,
}

/// Builds a [`SqliteBackend`] with options.
#[derive(Debug, Clone)]
#[must_use]
pub struct SqliteBuilder {
    path: PathBuf,
    lease: Duration,
    busy_timeout: Duration,
}

impl SqliteBuilder {
    /// The lease of each lock (default 30 s, at least 100 ms). Renewed every third of it.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// How long one statement waits for another writer of the file (default 5 s).
    pub fn busy_timeout(mut self, busy_timeout: Duration) -> Self {
        self.busy_timeout = busy_timeout;
        self
    }

    /// Opens (creating if needed) the lock file and its table.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: the file is opened on the blocking pool, and closed again if the future is
    /// dropped before it completes.
    pub async fn open(self) -> Result<SqliteBackend, LockError> {
        check_lease(self.lease)?;
        tokio::task::spawn_blocking(move || self.open_blocking())
            .await
            .map_err(|err| {
                LockError::backend(
                    NAME,
                    "opening the lock file failed",
                    None,
                    Some(Box::new(err)),
                )
            })?
    }

    fn open_blocking(self) -> Result<SqliteBackend, LockError> {
        let inline = open_connection(&self.path, self.busy_timeout)?;
        // Checkpoints run in the background instead of inside someone's acquisition.
        inline
            .pragma_update(None, "wal_autocheckpoint", 0)
            .map_err(|e| sqlite_error(&self.path, "configuring the lock file", e))?;
        inline
            .busy_timeout(Duration::ZERO)
            .map_err(|e| sqlite_error(&self.path, "configuring the lock file", e))?;
        let background = open_connection(&self.path, self.busy_timeout)?;
        Ok(SqliteBackend {
            shared: Arc::new(Shared {
                path: self.path,
                inline: Mutex::new(inline),
                background: Arc::new(Mutex::new(background)),
                lease: self.lease,
                busy_timeout: self.busy_timeout,
                next_renewal: AtomicU64::new(1),
                commits: AtomicU64::new(0),
                renewals: Mutex::new(HashMap::new()),
                wake: Arc::new(Notify::new()),
                renewer: Mutex::new(None),
            }),
        })
    }
}

impl SqliteBackend {
    /// A builder for the lock file at `path`.
    pub fn builder(path: impl Into<PathBuf>) -> SqliteBuilder {
        SqliteBuilder {
            path: path.into(),
            lease: DEFAULT_LEASE,
            busy_timeout: DEFAULT_BUSY_TIMEOUT,
        }
    }

    /// Opens the lock file at `path` with the default options.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe, as [`SqliteBuilder::open`].
    pub async fn open(path: impl Into<PathBuf>) -> Result<SqliteBackend, LockError> {
        SqliteBackend::builder(path).open().await
    }

    /// Parses a `sqlite://` URL with the options of the [module docs](self) into a builder,
    /// without opening the file.
    pub fn builder_from_url(url: &str) -> Result<SqliteBuilder, LockError> {
        parse_url(url)
    }

    /// Opens the lock file named by a `sqlite://` URL (see the [module docs](self)).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe, as [`SqliteBuilder::open`].
    pub async fn connect(url: &str) -> Result<SqliteBackend, LockError> {
        parse_url(url)?.open().await
    }

    /// The lock file's path.
    pub fn path(&self) -> &Path {
        &self.shared.path
    }

    /// The default lease.
    pub fn lease(&self) -> Duration {
        self.shared.lease
    }
}

impl std::fmt::Debug for SqliteBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteBackend")
            .field("path", &self.shared.path)
            .field("lease", &self.shared.lease)
            .field("busy_timeout", &self.shared.busy_timeout)
            .finish()
    }
}

impl LockBackend for SqliteBackend {
    fn name(&self) -> &'static str {
        NAME
    }

    fn try_acquire<'a>(
        &'a self,
        request: LockRequest<'a>,
    ) -> BoxFuture<'a, Result<Option<Acquired>, LockError>> {
        Box::pin(async move {
            let lease = request.lease.unwrap_or(self.shared.lease);
            check_lease(lease)?;
            self.shared.start_renewer()?;
            let owner = self.shared.new_owner()?;
            let name = request.key.as_bytes();
            let started = Instant::now();
            let fencing = self
                .shared
                .with_busy_retry("acquiring a lock", |conn| {
                    let now = now_ms();
                    returning_one(
                        &mut conn.prepare_cached(ACQUIRE_SQL)?,
                        params![name, &owner[..], now.saturating_add(millis(lease)), now],
                    )
                })
                .await;
            let fencing = match fencing {
                Ok(Some(fencing)) => fencing,
                Ok(None) => return Ok(None),
                // Another writer kept the file for the whole busy timeout: contention.
                Err(Busy::Timeout) => return Ok(None),
                Err(Busy::Failed(err)) => return Err(err),
            };
            let name: Arc<[u8]> = Arc::from(name);
            let lost = CancellationToken::new();
            let id = self.shared.register(Renewal {
                name: Arc::clone(&name),
                owner,
                lost: lost.clone(),
                lease,
                next_due: later(started, lease / 3),
                deadline: later(started, safe_window(lease)),
            });
            Ok(Some(Acquired::new(
                u64::try_from(fencing).ok(),
                lost,
                Box::new(SqliteHeld {
                    shared: Arc::clone(&self.shared),
                    id,
                    name,
                    owner,
                }),
            )))
        })
    }
}

struct SqliteHeld {
    shared: Arc<Shared>,
    id: u64,
    name: Arc<[u8]>,
    owner: [u8; 16],
}

impl std::fmt::Debug for SqliteHeld {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteHeld")
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

impl HeldLock for SqliteHeld {
    fn release(self: Box<Self>) -> BoxFuture<'static, Result<(), LockError>> {
        Box::pin(async move {
            self.shared.unregister(self.id);
            let outcome = self
                .shared
                .with_busy_retry("releasing a lock", |conn| {
                    conn.prepare_cached(RELEASE_SQL)?
                        .execute(params![&self.name[..], &self.owner[..]])
                })
                .await;
            match outcome {
                // Zero rows: the lease had run out and someone else took it, which the
                // renewal reports as a loss; not an error of the release.
                Ok(_) => Ok(()),
                Err(Busy::Timeout) => Err(LockError::unavailable(
                    NAME,
                    format!(
                        "releasing a lock: the lock file `{}` stayed busy for the whole busy timeout; the lock frees itself when its lease runs out",
                        self.shared.path.display()
                    ),
                    None,
                )),
                Err(Busy::Failed(err)) => Err(err),
            }
        })
    }
}

impl Drop for SqliteHeld {
    fn drop(&mut self) {
        // Stops the renewal if the handle is dropped without a release; the lease ends it.
        self.shared.unregister(self.id);
    }
}

enum Busy {
    /// The file stayed locked by another writer for the whole busy timeout.
    Timeout,
    Failed(LockError),
}

impl Shared {
    fn inline(&self) -> MutexGuard<'_, Connection> {
        self.inline.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn renewals(&self) -> MutexGuard<'_, HashMap<u64, Renewal>> {
        self.renewals.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A fresh owner token: 128 bits from the operating system's secure generator, so no
    /// other acquisition, in this process or any other, can ever present the same one.
    fn new_owner(&self) -> Result<[u8; 16], LockError> {
        let mut owner = [0u8; 16];
        getrandom::fill(&mut owner).map_err(|err| {
            LockError::backend(
                NAME,
                format!("the operating system's random generator failed: {err}"),
                None,
                None,
            )
        })?;
        Ok(owner)
    }

    /// Runs one short write on the inline connection. When another connection holds the
    /// file's write lock, pauses asynchronously and tries again, up to the busy timeout.
    async fn with_busy_retry<T>(
        &self,
        what: &str,
        mut op: impl FnMut(&Connection) -> rusqlite::Result<T>,
    ) -> Result<T, Busy> {
        let started = Instant::now();
        let mut pause = Duration::from_micros(200);
        loop {
            let outcome = op(&self.inline());
            match outcome {
                Ok(value) => {
                    self.count_commit();
                    return Ok(value);
                }
                Err(err) if is_busy(&err) => {
                    if started.elapsed() >= self.busy_timeout {
                        return Err(Busy::Timeout);
                    }
                    let jitter = Backoff::new(pause, pause, 0.5).map_or(pause, |b| b.delay(0));
                    tokio::time::sleep(jitter).await;
                    pause = (pause * 2).min(Duration::from_millis(20));
                }
                Err(err) => return Err(Busy::Failed(sqlite_error(&self.path, what, err))),
            }
        }
    }

    fn count_commit(&self) {
        let commits = self.commits.fetch_add(1, Ordering::Relaxed) + 1;
        if commits % CHECKPOINT_EVERY == 0
            && let Ok(runtime) = tokio::runtime::Handle::try_current()
        {
            let background = Arc::clone(&self.background);
            // Best effort; a checkpoint that finds readers in the way just does less.
            drop(runtime.spawn_blocking(move || {
                let conn = background.lock().unwrap_or_else(PoisonError::into_inner);
                let _ = conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(()));
            }));
        }
    }

    fn register(&self, renewal: Renewal) -> u64 {
        let id = self.next_renewal.fetch_add(1, Ordering::Relaxed);
        self.renewals().insert(id, renewal);
        self.wake.notify_one();
        id
    }

    fn unregister(&self, id: u64) {
        self.renewals().remove(&id);
    }

    fn start_renewer(self: &Arc<Self>) -> Result<(), LockError> {
        let runtime = tokio::runtime::Handle::try_current().map_err(|_| {
            LockError::config(
                "the SQLite backend renews leases on Tokio: use it within a Tokio runtime",
            )
        })?;
        let mut renewer = self.renewer.lock().unwrap_or_else(PoisonError::into_inner);
        if renewer
            .as_ref()
            .is_none_or(tokio::task::JoinHandle::is_finished)
        {
            let weak = Arc::downgrade(self);
            let wake = Arc::clone(&self.wake);
            *renewer = Some(runtime.spawn(renew_loop(weak, wake)));
        }
        Ok(())
    }

    /// Fires the lost token of every lock whose lease may have run out unrenewed.
    fn expire_overdue(&self, now: Instant) {
        self.renewals().retain(|_, renewal| {
            if now >= renewal.deadline {
                tracing::warn!(
                    backend = NAME,
                    "lease renewals kept failing until the lease may have run out; the lock is presumed lost"
                );
                renewal.lost.cancel();
                false
            } else {
                true
            }
        });
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        // Lets the renewal task see that the backend is gone.
        self.wake.notify_one();
    }
}

/// The part of a lease during which the holder can trust it: renewals that have not succeeded
/// by then make the lock count as lost, before another process could take it over.
fn safe_window(lease: Duration) -> Duration {
    lease - lease / 5
}

async fn renew_loop(weak: Weak<Shared>, wake: Arc<Notify>) {
    loop {
        let (next_due, earliest_deadline) = {
            let Some(shared) = weak.upgrade() else { return };
            let renewals = shared.renewals();
            (
                renewals.values().map(|r| r.next_due).min(),
                renewals.values().map(|r| r.deadline).min(),
            )
        };
        let wake_at = match (next_due, earliest_deadline) {
            (Some(due), Some(deadline)) => Some(due.min(deadline)),
            _ => None,
        };
        match wake_at {
            Some(at) => tokio::select! {
                () = tokio::time::sleep_until(at.into()) => {}
                () = wake.notified() => continue,
            },
            None => {
                wake.notified().await;
                continue;
            }
        }
        let Some(shared) = weak.upgrade() else { return };
        renew_due(&shared).await;
    }
}

/// A renewal to run: lock id, name, owner, lease.
type DueRenewal = (u64, Arc<[u8]>, [u8; 16], Duration);

async fn renew_due(shared: &Arc<Shared>) {
    let started = Instant::now();
    shared.expire_overdue(started);
    let due: Vec<DueRenewal> = shared
        .renewals()
        .iter()
        .filter(|(_, r)| r.next_due <= started)
        .map(|(id, r)| (*id, Arc::clone(&r.name), r.owner, r.lease))
        .collect();
    if due.is_empty() {
        return;
    }
    let background = Arc::clone(&shared.background);
    let batch = due.clone();
    let work = tokio::task::spawn_blocking(move || {
        let mut conn = background.lock().unwrap_or_else(PoisonError::into_inner);
        let tx = conn.transaction()?;
        let now = now_ms();
        let mut still_held = Vec::with_capacity(batch.len());
        {
            let mut stmt = tx.prepare_cached(RENEW_SQL)?;
            for (_, name, owner, lease) in &batch {
                let changed = stmt.execute(params![
                    &name[..],
                    &owner[..],
                    now.saturating_add(millis(*lease))
                ])?;
                still_held.push(changed == 1);
            }
        }
        tx.commit()?;
        Ok::<_, rusqlite::Error>(still_held)
    });
    tokio::pin!(work);
    // While the renewal waits for the file, leases keep running out: watch them.
    let outcome = loop {
        let earliest_deadline = shared.renewals().values().map(|r| r.deadline).min();
        let deadline_passes = async {
            match earliest_deadline {
                Some(deadline) => tokio::time::sleep_until(deadline.into()).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            outcome = &mut work => break outcome,
            () = deadline_passes => shared.expire_overdue(Instant::now()),
        }
    };
    let mut renewals = shared.renewals();
    match outcome {
        Ok(Ok(still_held)) => {
            for ((id, ..), held) in due.iter().zip(still_held) {
                let Some(renewal) = renewals.get_mut(id) else {
                    continue;
                };
                if held {
                    renewal.next_due = later(started, renewal.lease / 3);
                    renewal.deadline = later(started, safe_window(renewal.lease));
                } else {
                    tracing::warn!(
                        backend = NAME,
                        "lease renewal found the lock taken over by another owner; the lock is lost"
                    );
                    renewal.lost.cancel();
                    renewals.remove(id);
                }
            }
        }
        Ok(Err(err)) => {
            tracing::warn!(backend = NAME, error = %err, "lease renewal failed; retrying");
            retry_soon(&mut renewals, &due, started);
        }
        Err(err) => {
            tracing::warn!(backend = NAME, error = %err, "lease renewal task failed; retrying");
            retry_soon(&mut renewals, &due, started);
        }
    }
}

fn retry_soon(renewals: &mut HashMap<u64, Renewal>, due: &[DueRenewal], now: Instant) {
    for (id, ..) in due {
        if let Some(renewal) = renewals.get_mut(id) {
            renewal.next_due = later(now, renewal.lease / 10);
        }
    }
}

/// A lock held for the rest of a SQLite transaction; see the [module docs](self).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransactionLock {
    fencing_token: u64,
}

impl TransactionLock {
    /// The fencing token of this acquisition (the key's counter, shared with session locks).
    pub fn fencing_token(&self) -> u64 {
        self.fencing_token
    }
}

/// Locks `key` until `transaction` commits or rolls back; one try.
///
/// Creates the lock table in the transaction's database if it is missing. Errors with
/// [`LockError::AlreadyHeld`] when a session lock holds the key, or when another connection is
/// writing the database for longer than the connection's busy timeout. Blocking (it is
/// `rusqlite`): call it where blocking is allowed.
pub fn try_acquire_in_transaction(
    transaction: &Transaction<'_>,
    key: &str,
) -> Result<TransactionLock, LockError> {
    validate_key(key)?;
    match transaction_attempt(transaction, key)? {
        Some(lock) => Ok(lock),
        None => Err(LockError::AlreadyHeld {
            key: Arc::from(key),
        }),
    }
}

/// Locks `key` until `transaction` commits or rolls back, trying again with backoff for up to
/// `timeout` (errors with [`LockError::Timeout`] then). Blocking: it sleeps between tries.
pub fn acquire_in_transaction(
    transaction: &Transaction<'_>,
    key: &str,
    timeout: Duration,
) -> Result<TransactionLock, LockError> {
    validate_key(key)?;
    if timeout.is_zero() {
        return try_acquire_in_transaction(transaction, key);
    }
    let deadline = crate::time::deadline(Instant::now(), timeout);
    let backoff = Backoff::default();
    let mut attempt = 0;
    loop {
        if let Some(lock) = transaction_attempt(transaction, key)? {
            return Ok(lock);
        }
        let mut pause = backoff.delay(attempt);
        attempt += 1;
        if let Some(deadline) = deadline {
            let now = Instant::now();
            if now >= deadline {
                return Err(LockError::Timeout {
                    key: Arc::from(key),
                    timeout,
                });
            }
            pause = pause.min(deadline - now);
        }
        std::thread::sleep(pause);
    }
}

fn transaction_attempt(
    transaction: &Transaction<'_>,
    key: &str,
) -> Result<Option<TransactionLock>, LockError> {
    let path = PathBuf::from(transaction.path().unwrap_or("<transaction>"));
    let attempt = transaction.execute_batch(SCHEMA).and_then(|()| {
        returning_one(
            &mut transaction.prepare_cached(TRANSACTION_SQL)?,
            params![key.as_bytes(), now_ms()],
        )
    });
    match attempt {
        Ok(fencing) => Ok(fencing.map(|f| TransactionLock {
            fencing_token: u64::try_from(f).unwrap_or(0),
        })),
        Err(err) if is_busy(&err) => Ok(None),
        Err(err) => Err(sqlite_error(&path, "acquiring a transaction lock", err)),
    }
}

/// Runs a `... RETURNING` statement to completion and gives its one value, if it returned a
/// row. `query_row` would stop after the first row: the statement's implicit commit then
/// happens when it is reset, where an error (a full disk, an I/O error) is dropped, and the
/// caller would take a lock whose row was never written. Stepping until the statement is done
/// makes such an error this call's error.
fn returning_one(
    statement: &mut rusqlite::CachedStatement<'_>,
    params: impl rusqlite::Params,
) -> rusqlite::Result<Option<i64>> {
    let mut rows = statement.query(params)?;
    let value = match rows.next()? {
        Some(row) => Some(row.get::<_, i64>(0)?),
        None => None,
    };
    while rows.next()?.is_some() {}
    Ok(value)
}

fn open_connection(path: &Path, busy_timeout: Duration) -> Result<Connection, LockError> {
    let flags = OpenFlags::SQLITE_OPEN_READ_WRITE
        | OpenFlags::SQLITE_OPEN_CREATE
        | OpenFlags::SQLITE_OPEN_NO_MUTEX;
    let conn = Connection::open_with_flags(path, flags)
        .map_err(|e| sqlite_error(path, "opening the lock file", e))?;
    conn.busy_timeout(busy_timeout)
        .map_err(|e| sqlite_error(path, "configuring the lock file", e))?;
    if conn
        .is_readonly(rusqlite::MAIN_DB)
        .map_err(|e| sqlite_error(path, "opening the lock file", e))?
    {
        return Err(LockError::config(format!(
            "the lock file `{}` is read-only; locks need a file this process can write",
            path.display()
        )));
    }
    conn.query_row("PRAGMA journal_mode = WAL", [], |_| Ok(()))
        .map_err(|e| sqlite_error(path, "opening the lock file", e))?;
    conn.pragma_update(None, "synchronous", "NORMAL")
        .map_err(|e| sqlite_error(path, "configuring the lock file", e))?;
    conn.execute_batch(SCHEMA)
        .map_err(|e| sqlite_error(path, "creating the lock table", e))?;
    Ok(conn)
}

fn parse_url(url: &str) -> Result<SqliteBuilder, LockError> {
    let rest = url
        .strip_prefix("sqlite:")
        .or_else(|| url.strip_prefix("SQLITE:"))
        .ok_or_else(|| LockError::config("a SQLite lock store URL starts with `sqlite://`"))?;
    let rest = rest.strip_prefix("//").unwrap_or(rest);
    let (path, query) = rest.split_once('?').unwrap_or((rest, ""));
    if path.is_empty() {
        return Err(LockError::config(
            "the sqlite:// URL names no file; write `sqlite://locks.db` (relative) or `sqlite:///var/lib/app/locks.db` (absolute)",
        ));
    }
    if path == ":memory:" || path.contains("mode=memory") {
        return Err(LockError::config(
            "an in-memory SQLite database cannot share locks between processes; name a file, such as `sqlite://locks.db`",
        ));
    }
    let mut builder = SqliteBackend::builder(path);
    for (name, value) in query_pairs(query) {
        match name.as_str() {
            "lease" => builder = builder.lease(parse_duration("lease", &value)?),
            "busy_timeout" => {
                builder = builder.busy_timeout(parse_duration("busy_timeout", &value)?)
            }
            other => return Err(unknown_option("sqlite", other, &["lease", "busy_timeout"])),
        }
    }
    check_lease(builder.lease)?;
    Ok(builder)
}

fn check_lease(lease: Duration) -> Result<(), LockError> {
    if lease < MIN_LEASE {
        return Err(LockError::config(format!(
            "a SQLite lease must be at least {MIN_LEASE:?} (it is renewed every third of it), got {lease:?}"
        )));
    }
    Ok(())
}

fn is_busy(err: &rusqlite::Error) -> bool {
    matches!(
        err.sqlite_error_code(),
        Some(ErrorCode::DatabaseBusy | ErrorCode::DatabaseLocked)
    )
}

fn sqlite_error(path: &Path, what: &str, err: rusqlite::Error) -> LockError {
    let shown = path.display();
    let db_code = err
        .sqlite_error()
        .map(|e| format!("SQLITE_{}", e.extended_code));
    match err.sqlite_error_code() {
        Some(ErrorCode::NotADatabase) => LockError::config(format!(
            "{what}: `{shown}` is not a SQLite database (it was left untouched); point dlock at a new or existing SQLite file"
        )),
        Some(ErrorCode::CannotOpen) => LockError::config(format!(
            "{what}: cannot open `{shown}`; it must be a file (not a directory) in an existing directory this process can write"
        )),
        Some(ErrorCode::ReadOnly | ErrorCode::PermissionDenied) => LockError::config(format!(
            "{what}: the lock file `{shown}` cannot be written; locks need a file this process can write"
        )),
        Some(ErrorCode::DiskFull) => LockError::unavailable(
            NAME,
            format!("{what}: the disk holding `{shown}` is full"),
            Some(Box::new(err) as _),
        ),
        Some(ErrorCode::SystemIoFailure) => LockError::unavailable(
            NAME,
            format!("{what}: I/O error on `{shown}`"),
            Some(Box::new(err) as _),
        ),
        _ => LockError::backend(
            NAME,
            format!("{what}: {err}"),
            db_code,
            Some(Box::new(err) as _),
        ),
    }
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn url_forms() {
        assert_eq!(
            parse_url("sqlite://locks.db").unwrap().path,
            PathBuf::from("locks.db")
        );
        assert_eq!(
            parse_url("sqlite:///var/lib/x.db?lease=5s").unwrap().path,
            PathBuf::from("/var/lib/x.db")
        );
        assert_eq!(
            parse_url("sqlite://a.db?lease=5s&busy_timeout=250ms")
                .unwrap()
                .lease,
            Duration::from_secs(5)
        );
        for bad in [
            "sqlite://",
            "sqlite::memory:",
            "sqlite://a.db?lease=1ms",
            "sqlite://a.db?lease=forever",
            "sqlite://a.db?color=red",
        ] {
            let err = parse_url(bad).unwrap_err();
            assert_eq!(err.code(), "DistributedLock.Configuration", "{bad}: {err}");
        }
    }

    #[test]
    fn owners_are_unique() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let backend = rt
            .block_on(SqliteBackend::open(dir.path().join("l.db")))
            .unwrap();
        let a = backend.shared.new_owner().unwrap();
        let b = backend.shared.new_owner().unwrap();
        assert_ne!(a, b);
        assert_ne!(a[..8], b[..8], "no shared prefix: every bit is random");
    }
}
