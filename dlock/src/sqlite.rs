//! SQLite: locks in a shared database file, for processes on one machine.
//!
//! The embedded default: no server to run, and every process that opens the same file shares
//! its locks. Locks are rows of the table `__distributed_locks` (created on open):
//!
//! | column | meaning |
//! |---|---|
//! | `name` (BLOB, primary key) | the key's UTF-8 bytes, compared byte for byte (NUL and any length work) |
//! | `owner` (BLOB) | a 128-bit token of the holding acquisition, `NULL` when free |
//! | `lease_end` (INTEGER) | end of the holder's lease, in milliseconds on the [lease clock](#the-lease-clock) |
//! | `boot` (BLOB) | the boot of the machine that `lease_end` belongs to (Linux's boot id; empty elsewhere) |
//! | `fencing` (INTEGER) | the last fencing token issued for the key |
//!
//! An acquisition takes a free or expired row with one atomic statement. Polls of a key that
//! is held elsewhere are answered by a read, without the file's write lock, once the key has
//! been found held in the last second or whenever another connection is writing, so processes
//! polling a busy key neither hold up the holders' writes nor wait for them. A held lock is a
//! **lease**: the provider renews it every third of the lease, on a thread of the backend's
//! own (no Tokio runtime of the application has to outlive the lock), so the lock of a process
//! that dies (even by SIGKILL) frees itself when its lease runs out. When a renewal or the
//! release finds the row taken over or gone, or renewals keep failing until four fifths of the
//! lease have passed, the guard's [`lost_token`](crate::LockGuard::lost_token) fires and the
//! release answers [`LockError::Lost`]; the loss is also logged (`tracing`, warn). If the
//! renewal thread ever ended while locks were held, their lost tokens would fire and the next
//! acquisition would start a new thread.
//!
//! # The lease clock
//!
//! Processes compare lease ends that other processes wrote with their own clock, so the clock
//! must be one for the whole machine and must not step.
//!
//! - **Linux** (and Android): `CLOCK_MONOTONIC`, shared by every process and never stepped by
//!   time synchronisation or an administrator's `date`; a step of the system clock changes
//!   nothing. Rows carry the kernel's boot id, so the locks of an earlier boot count as free
//!   after a reboot, and the offset of a process's time namespace is taken off, so containers
//!   in time namespaces agree with the host. `/proc` must be readable (opening errors with
//!   [`LockError::Config`] otherwise).
//! - **Other platforms**: the wall clock (Unix milliseconds). A step forward by more than a
//!   holder's remaining lease lets another process take the lock while the holder still
//!   believes it holds it (until its next renewal, at most a third of the lease later, reports
//!   the loss); a step backward keeps the lock of a dead holder for its lease plus the step.
//!   Keep the clock slewed, not stepped, on machines that share a lock file there.
//!
//! # Fencing tokens
//!
//! Fencing tokens are free here (the acquisition writes the row anyway). They increase
//! strictly for each key, and a token once handed out is never handed out again: not after
//! closing and reopening the file, not after a process crash, and not after a
//! [transaction-bound lock](#transaction-bound-locks) whose transaction rolled back. Such a
//! lock cannot keep its token in the caller's transaction (a rollback would undo it), so it
//! records the token, before returning it, in a second SQLite file next to the lock file:
//! `<lock file>-fencing`, with a write lock of its own, created by the first transaction-bound
//! lock on the file. Session acquisitions issue tokens above that record once the file exists
//! (they look for it at most every 50 ms; a process's first transaction-bound lock on a file
//! waits 50 ms, once, so that no look older than that is trusted). Keep the `-fencing` file
//! with the lock file (as SQLite's own `-wal` file); deleting it lets the token of a
//! rolled-back transaction lock be issued again. Rows stay in the table after release, to keep
//! the counter. A power loss (not a process crash) may roll back the last acquisitions and
//! their tokens (`synchronous=NORMAL`).
//!
//! # URL
//!
//! `sqlite://relative/path.db` or `sqlite:///absolute/path.db`, with options:
//!
//! | option | default | meaning |
//! |---|---|---|
//! | `lease` | `30s` | lease of each lock, 100 ms to 365 days; renewed every `lease / 3` |
//! | `busy_timeout` | `5s` | how long one statement waits for another writer of the file, up to 365 days |
//!
//! Values outside those bounds are refused with [`LockError::Config`] naming the bound, from
//! the URL, the [builder](SqliteBuilder) and a lease asked for one acquisition alike.
//!
//! # The write-ahead log
//!
//! The file is opened in WAL mode with `synchronous=NORMAL`, and created with 1 KiB pages
//! (every commit appends whole pages to the log; lock rows are short). Under sustained load
//! from several processes SQLite's own (passive) checkpoints never catch up with the writers,
//! and the log grew without end (by gigabytes). So every 1,000 commits a backend checkpoints
//! on the blocking pool, so that no thread of the application waits for its `fsync`s; the
//! backend's own writes wait for it (asynchronously), as they would for SQLite's automatic
//! checkpoint, so that with no other writer it catches up and the log starts over. While the
//! `-wal` file is under 8 MiB the checkpoint is passive: it holds no other process back. Past
//! that (other processes kept passive ones from catching up), it is a `RESTART`: it holds
//! every writer back while it writes out the rest of the log and lets the log start over; it
//! tries every 0.2 ms, up to 250 times, to get the write lock and then to find no reader in
//! the way. `journal_size_limit` trims the file to 8 MiB when the log starts over. A
//! transaction kept open on the file (a long transaction-bound lock, an application's long
//! read) holds checkpoints back, and the log grows while it lasts.
//!
//! # Limits
//!
//! SQLite has one writer at a time per file. Every acquisition of a free key, renewal and
//! release is one short write; they serialize, which is plenty for locks but bounds throughput
//! at some tens of thousands of writes per second. Renewals and releases try again for the
//! write lock every 0.5 ms and 1 ms at most, so a stream of acquisitions does not starve them;
//! still, a machine so overloaded that a process is not scheduled for about half a lease loses
//! that process's leases (they are reported lost), so keep leases well above such stalls.
//! All processes must run on the one machine that has the file (network file systems are not
//! supported: their file locking is not reliable enough for SQLite, and the lease clock is
//! per machine).
//!
//! # Upgrading a lock file
//!
//! Lock files written by an earlier version of this crate (whose table has the wall-clock
//! column `expires_at`) are converted in place by the first process of this version that opens
//! them: fencing counters are kept, so tokens keep increasing, and locks held at that moment
//! keep the rest of their lease. From then on, every statement of an earlier version fails on
//! that file (`no such column: expires_at`): its acquisitions error, and the locks it holds are
//! reported lost before their lease ends. A fleet that shares a file must therefore upgrade
//! all its processes together (or stop the old ones first) and must not start an earlier
//! version against a converted file; nothing is ever locked twice meanwhile, but the old
//! processes cannot take locks.
//!
//! # Transaction-bound locks
//!
//! [`try_acquire_in_transaction`] and [`acquire_in_transaction`] lock a key inside the caller's
//! own `rusqlite` transaction. The lock is held until that transaction commits or rolls back:
//! the acquisition writes to the database, and SQLite lets no other connection write until the
//! transaction ends. That also means such a transaction keeps every other writer of the file
//! waiting (including acquisitions of other keys, renewals and releases): keep it short. The
//! database must be a file (its `-fencing` file holds the tokens). A transaction sees the
//! file as it was when it first read it, and while it holds the write lock nobody else can
//! release; so [`acquire_in_transaction`] mostly waits for leases to run out. To wait for a
//! session lock, retry [`try_acquire_in_transaction`] in fresh transactions instead.

mod clock;
mod renewer;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use rusqlite::{Connection, ErrorCode, OpenFlags, Transaction, TransactionBehavior, params};
use tokio_util::sync::CancellationToken;

use self::clock::LeaseClock;
use self::renewer::{Renewal, Renewer};
use crate::backend::{Acquired, BoxFuture, HeldLock, LockBackend, LockRequest};
use crate::backoff::Pauses;
use crate::key::validate_key;
use crate::options::{UrlForm, parse_duration, read_query, url_keys};
use crate::time::{MAX_SETTING, check_setting};
use crate::{Backoff, LockError};

const NAME: &str = "sqlite";

const SCHEMA: &str = "CREATE TABLE IF NOT EXISTS __distributed_locks (\
    name BLOB NOT NULL PRIMARY KEY, \
    owner BLOB, \
    lease_end INTEGER NOT NULL DEFAULT 0, \
    fencing INTEGER NOT NULL DEFAULT 0, \
    boot BLOB\
) WITHOUT ROWID";

/// Counts the column of the earlier, wall-clock table (1 when the table must be converted).
const LEGACY_SQL: &str =
    "SELECT count(*) FROM pragma_table_info('__distributed_locks') WHERE name = 'expires_at'";

/// Converts the earlier table: the lease column gets its new name (so statements of earlier
/// versions fail instead of misreading it) and the boot column is added.
const MIGRATE_SQL: &str = "ALTER TABLE __distributed_locks RENAME COLUMN expires_at TO lease_end; \
    ALTER TABLE __distributed_locks ADD COLUMN boot BLOB";

/// Moves held rows' lease ends from the wall clock to the lease clock, keeping what was left of
/// each lease (at most `?4` ms): `?1` wall-clock now, `?2` lease-clock now, `?3` boot.
const MIGRATE_ROWS_SQL: &str = "UPDATE __distributed_locks SET boot = ?3, lease_end = \
    CASE WHEN owner IS NULL THEN 0 ELSE ?2 + max(0, min(lease_end - ?1, ?4)) END";

/// The table of the `-fencing` file: the highest token issued to a transaction-bound lock.
const FENCING_SCHEMA: &str = "CREATE TABLE IF NOT EXISTS __distributed_lock_fencing (\
    name BLOB NOT NULL PRIMARY KEY, \
    fencing INTEGER NOT NULL\
) WITHOUT ROWID";

/// Makes the `-fencing` file (`?1`) readable by the acquisition statement.
const ATTACH_FENCING_SQL: &str = "ATTACH DATABASE ?1 AS dlock_fencing";

/// Issues a token in the `-fencing` file, above both its record and `?2` (the lock table's
/// counter): `?1` name. Returns the token.
const ISSUE_SQL: &str = "INSERT INTO __distributed_lock_fencing (name, fencing) VALUES (?1, ?2 + 1) \
    ON CONFLICT (name) DO UPDATE SET fencing = max(__distributed_lock_fencing.fencing, ?2) + 1 \
    RETURNING fencing";

/// Whether row `?1` is held by a live lease: `?2` now on the lease clock, `?3` boot.
const PEEK_SQL: &str = "SELECT 1 FROM main.__distributed_locks \
    WHERE name = ?1 AND owner IS NOT NULL AND boot = ?3 AND lease_end > ?2";

/// The statement of an acquisition: takes a free or expired row (expired: its lease ended,
/// or it was written during another boot). Parameters: `?1` name (the key's bytes), `?2`
/// owner token, `?3` new lease end and `?4` now (lease clock), `?5` boot. Returns the new
/// fencing token, or no row when the lock is held. For a file whose `-fencing` file does not
/// exist (no transaction-bound lock ever issued a token on it).
const ACQUIRE_SQL: &str = "INSERT INTO main.__distributed_locks (name, owner, lease_end, fencing, boot) \
    VALUES (?1, ?2, ?3, 1, ?5) \
    ON CONFLICT (name) DO UPDATE SET owner = excluded.owner, lease_end = excluded.lease_end, \
    boot = excluded.boot, fencing = __distributed_locks.fencing + 1 \
    WHERE __distributed_locks.owner IS NULL OR __distributed_locks.boot IS NOT excluded.boot \
    OR __distributed_locks.lease_end <= ?4 \
    RETURNING fencing";

/// [`ACQUIRE_SQL`] with the `-fencing` file attached: the token is above both the row's
/// counter and the `-fencing` file's record.
const ACQUIRE_FENCED_SQL: &str = "INSERT INTO main.__distributed_locks (name, owner, lease_end, fencing, boot) \
    VALUES (?1, ?2, ?3, 1 + coalesce((SELECT fencing FROM dlock_fencing.__distributed_lock_fencing \
    WHERE name = ?1), 0), ?5) \
    ON CONFLICT (name) DO UPDATE SET owner = excluded.owner, lease_end = excluded.lease_end, \
    boot = excluded.boot, fencing = max(__distributed_locks.fencing + 1, excluded.fencing) \
    WHERE __distributed_locks.owner IS NULL OR __distributed_locks.boot IS NOT excluded.boot \
    OR __distributed_locks.lease_end <= ?4 \
    RETURNING fencing";

/// Raises the token of row `?1`, just taken by owner `?2` with [`ACQUIRE_SQL`], above the
/// `-fencing` file's record (found to exist only after the row was taken). Returns the token.
const RAISE_TOKEN_SQL: &str = "UPDATE main.__distributed_locks SET fencing = max(fencing, 1 + \
    coalesce((SELECT fencing FROM dlock_fencing.__distributed_lock_fencing WHERE name = ?1), 0)) \
    WHERE name = ?1 AND owner = ?2 \
    RETURNING fencing";

/// The statement of a release: frees row `?1` if owner `?2` still holds it.
const RELEASE_SQL: &str = "UPDATE main.__distributed_locks SET owner = NULL, lease_end = 0 \
    WHERE name = ?1 AND owner = ?2";

/// Extends the lease to `?3` if `?2` still owns the row.
const RENEW_SQL: &str =
    "UPDATE main.__distributed_locks SET lease_end = ?3 WHERE name = ?1 AND owner = ?2";

/// A transaction-bound lock takes a free row inside the caller's transaction (which gives it
/// the file's write lock until the transaction ends): `?1` name, `?2` now, `?3` boot. Returns
/// the row's counter.
const TRANSACTION_CLAIM_SQL: &str = "INSERT INTO main.__distributed_locks \
    (name, owner, lease_end, fencing, boot) VALUES (?1, NULL, 0, 0, NULL) \
    ON CONFLICT (name) DO UPDATE SET fencing = __distributed_locks.fencing \
    WHERE __distributed_locks.owner IS NULL OR __distributed_locks.boot IS NOT ?3 \
    OR __distributed_locks.lease_end <= ?2 \
    RETURNING fencing";

/// Stores token `?2` in row `?1` inside the caller's transaction (when it commits, the lock
/// table alone knows the token too).
const TRANSACTION_RECORD_SQL: &str =
    "UPDATE main.__distributed_locks SET fencing = ?2 WHERE name = ?1";

/// Writes the write-ahead log into the database without holding writers back.
const CHECKPOINT_PASSIVE_SQL: &str = "PRAGMA wal_checkpoint(PASSIVE)";

/// Writes the rest of the log into the database and lets the log start over, waiting for
/// readers (for at most the checkpoint connection's busy timeout) and holding writers back
/// meanwhile.
const CHECKPOINT_RESTART_SQL: &str = "PRAGMA wal_checkpoint(RESTART)";

/// Commits of a backend between two checkpoints (about as many pages of log).
const CHECKPOINT_EVERY: u64 = 1000;
/// The size of the `-wal` file past which a checkpoint makes the log start over (`RESTART`)
/// instead of writing it out passively, and the size the file is trimmed to when the log
/// starts over (`journal_size_limit`).
const WAL_LIMIT_BYTES: u64 = 8 << 20;
/// How many times, [`CHECKPOINT_RETRY`] apart, a `RESTART` checkpoint tries again to get the
/// file's write lock, and then to find no reader in the way (holding the write lock). SQLite's
/// own busy handler sleeps whole milliseconds: other writers win the lock meanwhile, and
/// writers wait longer than the readers need.
const CHECKPOINT_TRIES: i32 = 250;
const CHECKPOINT_RETRY: Duration = Duration::from_micros(200);

/// The busy handler of the checkpoint connection: see [`CHECKPOINT_TRIES`].
fn checkpoint_busy(tries: i32) -> bool {
    if tries >= CHECKPOINT_TRIES {
        return false;
    }
    std::thread::sleep(CHECKPOINT_RETRY);
    true
}

/// The suffix of the file that records the tokens of transaction-bound locks.
const FENCING_SUFFIX: &str = "-fencing";

/// How long a backend trusts that the `-fencing` file does not exist after looking; a process
/// waits as long after it first opens the file before it hands out a token recorded there,
/// so that no backend can still trust an earlier look (see [`Fencing`]).
const FENCING_LOOK: Duration = Duration::from_millis(50);

const DEFAULT_LEASE: Duration = Duration::from_secs(30);
const DEFAULT_BUSY_TIMEOUT: Duration = Duration::from_secs(5);
const MIN_LEASE: Duration = Duration::from_millis(100);

/// How long a key found held makes the backend read before it writes, and how many such keys
/// it remembers.
const HELD_MEMORY: Duration = Duration::from_secs(1);
const HELD_MEMORY_KEYS: usize = 1024;

/// Pauses between tries of a write while another connection holds the file's write lock:
/// (first, longest). Releases retry sooner than acquisitions, so that a stream of
/// acquisitions does not starve them.
const ACQUIRE_PAUSES: (Duration, Duration) = (Duration::from_micros(200), Duration::from_millis(5));
const RELEASE_PAUSES: (Duration, Duration) = (Duration::from_micros(100), Duration::from_millis(1));

/// The SQLite backend. Usually made through [`LockProvider::connect`](crate::LockProvider::connect)
/// with a `sqlite://` URL; [`SqliteBackend::builder`] sets the options from code.
#[derive(Clone)]
pub struct SqliteBackend {
    shared: Arc<Shared>,
}

struct Shared {
    path: PathBuf,
    /// Runs the short statements of acquisition and release on the calling task (no busy wait:
    /// a busy database is retried with async pauses, so no worker thread is ever parked). Has
    /// the `-fencing` file attached.
    inline: Mutex<Connection>,
    /// Runs checkpoints, on the blocking pool.
    checkpointer: Arc<Mutex<Connection>>,
    /// Set while a checkpoint is under way.
    checkpointing: Arc<AtomicBool>,
    /// Writes of the inline connection pass it shared; a checkpoint takes it whole, so that
    /// this backend's writes wait (asynchronously) while it runs and, with no other writer
    /// of the file, it catches up and the log starts over, as with SQLite's own checkpoints.
    gate: Arc<tokio::sync::RwLock<()>>,
    /// The `-wal` file, whose size decides the kind of checkpoint.
    wal: PathBuf,
    lease: Duration,
    busy_timeout: Duration,
    clock: &'static LeaseClock,
    commits: AtomicU64,
    renewer: Renewer,
    /// Keys this backend found held lately: their next poll reads before it writes.
    held_recently: Mutex<HashMap<Box<[u8]>, Instant>>,
    /// Random bytes for owner tokens, not handed out yet.
    owners: Mutex<Owners>,
    /// The `-fencing` file, once it exists.
    fencing: Fencing,
}

/// The `-fencing` file of a backend's lock file, attached to the inline connection once it
/// exists. Until then (a file on which no transaction-bound lock ever issued a token, the
/// common case), acquisitions do not read it: after taking a row with [`ACQUIRE_SQL`], they
/// look whether the file exists (at most every [`FENCING_LOOK`]; a look that finds it absent
/// is trusted that long), and if it does, attach it and raise the token above its record.
///
/// Why a look may be trusted for [`FENCING_LOOK`]: a transaction-bound lock hands out a token
/// only [`FENCING_LOOK`] after its process first opened the file (so after the file came to
/// be), and only while its transaction holds the file's write lock; the acquisition that
/// trusts a look took its row later, once that transaction had ended, so less than
/// [`FENCING_LOOK`] after the look. Had the token come first, the file would have existed for
/// more than [`FENCING_LOOK`] before the acquisition, so before the look, which would have
/// found it.
struct Fencing {
    path: PathBuf,
    /// Set once the file is attached to the inline connection (under its lock).
    attached: AtomicBool,
    /// When the last look that found the file absent began.
    absent_since: Mutex<Option<Instant>>,
}

impl Fencing {
    fn attached(&self) -> bool {
        self.attached.load(Ordering::Acquire)
    }

    /// Attaches the file (creating its table if its creator has not yet) to `inline`.
    fn attach(&self, inline: &Connection, busy_timeout: Duration) -> Result<(), LockError> {
        if self.attached() {
            return Ok(());
        }
        drop(open_fencing(&self.path, busy_timeout)?);
        let name = self.path.to_str().ok_or_else(|| {
            LockError::config(format!(
                "the fencing file's path `{}` is not valid UTF-8",
                self.path.display()
            ))
        })?;
        inline
            .execute(ATTACH_FENCING_SQL, [name])
            .map_err(|e| sqlite_error(&self.path, "opening the fencing file", e))?;
        self.attached.store(true, Ordering::Release);
        Ok(())
    }

    /// Whether the file may exist, looking if the last look is too old to be trusted.
    fn may_exist(&self) -> bool {
        if self.attached() {
            return true;
        }
        let mut absent_since = self
            .absent_since
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if absent_since.is_some_and(|since| since.elapsed() < FENCING_LOOK) {
            return false;
        }
        // The instant the look begins: the file did not exist before it, if it is absent.
        let look = Instant::now();
        match std::fs::symlink_metadata(&self.path) {
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => {
                *absent_since = Some(look);
                false
            }
            _ => true,
        }
    }
}

/// How many owner tokens one call to the operating system's generator fetches.
const OWNERS_PER_FETCH: usize = 32;

struct Owners {
    bytes: [u8; 16 * OWNERS_PER_FETCH],
    /// How many tokens of `bytes` have been handed out.
    used: usize,
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
    /// The lease of each lock (default 30 s; 100 ms to 365 days, checked by
    /// [`open`](SqliteBuilder::open)). Renewed every third of it.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// How long one statement waits for another writer of the file (default 5 s; at most 365
    /// days, checked by [`open`](SqliteBuilder::open)).
    pub fn busy_timeout(mut self, busy_timeout: Duration) -> Self {
        self.busy_timeout = busy_timeout;
        self
    }

    /// Opens (creating if needed) the lock file and its table, and the `-fencing` file next to
    /// it; converts the table of an earlier version (see the [module docs](self)).
    ///
    /// Errors with [`LockError::Config`] when the lease or busy timeout is out of bounds, or
    /// the file cannot be used.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: the file is opened on the blocking pool, and closed again if the future is
    /// dropped before it completes.
    pub async fn open(self) -> Result<SqliteBackend, LockError> {
        self.check()?;
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

    fn check(&self) -> Result<(), LockError> {
        check_lease(self.lease)?;
        check_setting(
            "the SQLite busy_timeout",
            self.busy_timeout,
            Duration::ZERO,
            MAX_SETTING,
        )?;
        Ok(())
    }

    fn open_blocking(self) -> Result<SqliteBackend, LockError> {
        let clock = LeaseClock::get()?;
        let inline = open_connection(&self.path, self.busy_timeout, clock)?;
        let db_file = PathBuf::from(inline.path().unwrap_or_default());
        let db_file = if db_file.as_os_str().is_empty() {
            self.path.clone()
        } else {
            db_file
        };
        // The calling task never waits inside SQLite; see `with_busy_retry`.
        inline
            .busy_timeout(Duration::ZERO)
            .map_err(|e| sqlite_error(&self.path, "configuring the lock file", e))?;
        let background = open_connection(&self.path, self.busy_timeout, clock)?;
        background
            .busy_timeout(Duration::ZERO)
            .map_err(|e| sqlite_error(&self.path, "configuring the lock file", e))?;
        let mut checkpointer = open_connection(&self.path, self.busy_timeout, clock)?;
        checkpointer
            .busy_handler(Some(checkpoint_busy))
            .map_err(|e| sqlite_error(&self.path, "configuring the lock file", e))?;
        let mut wal = db_file.clone().into_os_string();
        wal.push("-wal");
        let fencing = Fencing {
            path: fencing_path(&db_file),
            attached: AtomicBool::new(false),
            absent_since: Mutex::new(None),
        };
        if fencing.path.exists() {
            fencing.attach(&inline, self.busy_timeout)?;
        }
        Ok(SqliteBackend {
            shared: Arc::new(Shared {
                inline: Mutex::new(inline),
                checkpointer: Arc::new(Mutex::new(checkpointer)),
                checkpointing: Arc::new(AtomicBool::new(false)),
                gate: Arc::new(tokio::sync::RwLock::new(())),
                wal: PathBuf::from(wal),
                lease: self.lease,
                busy_timeout: self.busy_timeout,
                clock,
                commits: AtomicU64::new(0),
                renewer: Renewer::new(background, clock, self.path.clone()),
                held_recently: Mutex::new(HashMap::new()),
                fencing,
                owners: Mutex::new(Owners {
                    bytes: [0; 16 * OWNERS_PER_FETCH],
                    used: OWNERS_PER_FETCH,
                }),
                path: self.path,
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
    /// without opening the file. Options out of bounds are a [`LockError::Config`].
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
            // Everything that can fail for want of resources fails before the row is written.
            self.shared.renewer.ensure_running()?;
            let owner = self.shared.new_owner()?;
            let name = request.key.as_bytes();
            let (started, fencing, fenced) = match self.shared.take_row(name, &owner, lease).await {
                Ok(Take::Taken {
                    started,
                    fencing,
                    fenced,
                }) => (started, fencing, fenced),
                Ok(Take::Held) => return Ok(None),
                // Another writer kept the file for the whole busy timeout: contention.
                Err(Busy::Timeout) => return Ok(None),
                Err(Busy::Failed(err)) => return Err(err),
            };
            self.shared.count_commit();
            // The row is ours from here on: a failure must give it back.
            let fencing = match fencing {
                Ok(token) if !fenced && self.shared.fencing.may_exist() => {
                    self.shared.raise_token(name, &owner, token).await
                }
                Ok(token) => Ok(token),
                Err(err) => Err(sqlite_error(&self.shared.path, "acquiring a lock", err)),
            };
            let token = match fencing.map(u64::try_from) {
                Ok(Ok(token)) => token,
                Ok(Err(_)) => {
                    self.shared.give_back(name, &owner).await;
                    return Err(LockError::backend(
                        NAME,
                        format!(
                            "acquiring a lock: the fencing counter of the lock file `{}` is not a positive integer; the lock was given back",
                            self.shared.path.display()
                        ),
                        None,
                        None,
                    ));
                }
                Err(err) => {
                    self.shared.give_back(name, &owner).await;
                    return Err(err);
                }
            };
            let name: Arc<[u8]> = Arc::from(name);
            let lost = CancellationToken::new();
            let renewal = Renewal::new(Arc::clone(&name), owner, lease, lost.clone(), started);
            let deadline = renewal.deadline();
            let registered = self.shared.renewer.register(renewal);
            let id = match registered {
                Ok(id) => id,
                Err(err) => {
                    self.shared.give_back(&name, &owner).await;
                    return Err(err);
                }
            };
            Ok(Some(
                Acquired::new(
                    Some(token),
                    lost.clone(),
                    Box::new(SqliteHeld {
                        shared: Arc::clone(&self.shared),
                        id,
                        key: Arc::from(request.key),
                        owner,
                        lost,
                    }),
                )
                .with_lease_deadline(deadline),
            ))
        })
    }
}

struct SqliteHeld {
    shared: Arc<Shared>,
    id: u64,
    key: Arc<str>,
    owner: [u8; 16],
    lost: CancellationToken,
}

impl std::fmt::Debug for SqliteHeld {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteHeld")
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

impl HeldLock for SqliteHeld {
    /// Frees the row if this lock still owns it. When the row was taken over or removed (the
    /// lease had run out unrenewed), fires the lost token and answers [`LockError::Lost`].
    fn release(self: Box<Self>) -> BoxFuture<'static, Result<(), LockError>> {
        Box::pin(async move {
            // Renewed until the row is free: a release that waits for the file must not let
            // the lease run out meanwhile.
            self.shared.renewer.releasing(self.id);
            let outcome = self
                .shared
                .with_busy_retry("releasing a lock", RELEASE_PAUSES, |conn| {
                    conn.prepare_cached(RELEASE_SQL)?
                        .execute(params![self.key.as_bytes(), &self.owner[..]])
                })
                .await;
            self.shared.renewer.unregister(self.id);
            match outcome {
                Ok(1) => {
                    self.shared.count_commit();
                    Ok(())
                }
                Ok(_) => {
                    tracing::warn!(
                        backend = NAME,
                        key = &*self.key,
                        "the release found the lock taken over or removed; it was lost"
                    );
                    self.lost.cancel();
                    Err(LockError::Lost {
                        key: Arc::clone(&self.key),
                        reason: "the release found the lock taken over or removed (its lease had run out)".to_owned(),
                    })
                }
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
        self.shared.renewer.unregister(self.id);
    }
}

enum Busy {
    /// The file stayed locked by another writer for the whole busy timeout.
    Timeout,
    Failed(LockError),
}

/// What an acquisition's statement found.
enum Take {
    /// The row is ours.
    Taken {
        /// When the statement began (before the clock was read).
        started: Instant,
        /// The fencing token (read apart: when it cannot be read, the row must still be
        /// given back).
        fencing: rusqlite::Result<i64>,
        /// Whether the token is above the `-fencing` file's record ([`ACQUIRE_FENCED_SQL`]).
        fenced: bool,
    },
    /// Someone else holds the lock.
    Held,
}

impl Shared {
    fn inline(&self) -> MutexGuard<'_, Connection> {
        self.inline.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A fresh owner token: 128 bits from the operating system's secure generator, so no
    /// other acquisition, in this process or any other, can ever present the same one. The
    /// bits are fetched [`OWNERS_PER_FETCH`] tokens at a time (one system call), and each
    /// token is handed out once.
    fn new_owner(&self) -> Result<[u8; 16], LockError> {
        let mut owners = self.owners.lock().unwrap_or_else(PoisonError::into_inner);
        if owners.used == OWNERS_PER_FETCH {
            getrandom::fill(&mut owners.bytes).map_err(|err| {
                LockError::backend(
                    NAME,
                    format!("the operating system's random generator failed: {err}"),
                    None,
                    None,
                )
            })?;
            owners.used = 0;
        }
        let at = owners.used * 16;
        let mut owner = [0u8; 16];
        owner.copy_from_slice(&owners.bytes[at..at + 16]);
        // Not used again: overwritten before the next fetch is handed out.
        owners.bytes[at..at + 16].fill(0);
        owners.used += 1;
        Ok(owner)
    }

    /// Takes the key's row if it is free or expired. A held key is answered by a read,
    /// without the file's write lock, whenever there is reason to expect it held: the key was
    /// found held in the last second, or the write lock is taken (then the poll does not wait
    /// for it). Otherwise (the common case of a free key) the write comes first, with no read.
    async fn take_row(&self, name: &[u8], owner: &[u8; 16], lease: Duration) -> Result<Take, Busy> {
        let clock = self.clock;
        let held = |conn: &Connection| -> Result<bool, Busy> {
            let peek = conn.prepare_cached(PEEK_SQL).and_then(|mut peek| {
                let mut rows = peek.query(params![name, clock.now_ms(), clock.boot()])?;
                Ok(rows.next()?.is_some())
            });
            match peek {
                Ok(held) => Ok(held),
                // Not known: the write will tell.
                Err(err) if is_busy(&err) => Ok(false),
                Err(err) => Err(Busy::Failed(sqlite_error(
                    &self.path,
                    "checking a lock",
                    err,
                ))),
            }
        };
        if self.seen_held(name) && held(&self.inline())? {
            self.note_held(name);
            return Ok(Take::Held);
        }
        let waiting_since = Instant::now();
        let (mut pause, longest) = ACQUIRE_PAUSES;
        loop {
            let pass = self.gate.read().await;
            let attempt = {
                let conn = self.inline();
                // Taken before the clock is read: the holder's own deadlines start no later
                // than the lease it writes.
                let started = Instant::now();
                let now = clock.now_ms();
                // Read under the connection's lock, which attaching takes too.
                let fenced = self.fencing.attached();
                let statement = if fenced {
                    conn.prepare_cached(ACQUIRE_FENCED_SQL)
                } else {
                    conn.prepare_cached(ACQUIRE_SQL)
                };
                let written = statement.and_then(|mut acquire| {
                    returning_one(
                        &mut acquire,
                        params![
                            name,
                            &owner[..],
                            now.saturating_add(millis(lease)),
                            now,
                            clock.boot()
                        ],
                    )
                });
                match written {
                    Ok(Some(fencing)) => Some(Take::Taken {
                        started,
                        fencing,
                        fenced,
                    }),
                    Ok(None) => Some(Take::Held),
                    Err(err) if is_busy(&err) => {
                        if held(&conn)? {
                            Some(Take::Held)
                        } else {
                            None
                        }
                    }
                    Err(err) => {
                        return Err(Busy::Failed(sqlite_error(
                            &self.path,
                            "acquiring a lock",
                            err,
                        )));
                    }
                }
            };
            drop(pass);
            match attempt {
                Some(Take::Held) => {
                    self.note_held(name);
                    return Ok(Take::Held);
                }
                Some(taken) => {
                    self.forget_held(name);
                    return Ok(taken);
                }
                None => {}
            }
            if waiting_since.elapsed() >= self.busy_timeout {
                return Err(Busy::Timeout);
            }
            let jitter = Backoff::new(pause, pause, 0.5).map_or(pause, |b| b.delay(0));
            tokio::time::sleep(jitter).await;
            pause = (pause * 2).min(longest);
        }
    }

    fn held_recently(&self) -> MutexGuard<'_, HashMap<Box<[u8]>, Instant>> {
        self.held_recently
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether this backend found `name` held in the last [`HELD_MEMORY`].
    fn seen_held(&self, name: &[u8]) -> bool {
        let held = self.held_recently();
        !held.is_empty() && held.get(name).is_some_and(|at| at.elapsed() < HELD_MEMORY)
    }

    fn note_held(&self, name: &[u8]) {
        let mut held = self.held_recently();
        if held.len() >= HELD_MEMORY_KEYS && !held.contains_key(name) {
            held.retain(|_, at| at.elapsed() < HELD_MEMORY);
            if held.len() >= HELD_MEMORY_KEYS {
                held.clear();
            }
        }
        match held.get_mut(name) {
            Some(at) => *at = Instant::now(),
            None => {
                held.insert(Box::from(name), Instant::now());
            }
        }
    }

    fn forget_held(&self, name: &[u8]) {
        let mut held = self.held_recently();
        if !held.is_empty() {
            held.remove(name);
        }
    }

    /// Runs one short write on the inline connection. When another connection holds the
    /// file's write lock, pauses asynchronously (`pauses`: first and longest pause) and tries
    /// again, up to the busy timeout.
    async fn with_busy_retry<T>(
        &self,
        what: &str,
        pauses: (Duration, Duration),
        mut op: impl FnMut(&Connection) -> rusqlite::Result<T>,
    ) -> Result<T, Busy> {
        let started = Instant::now();
        let (mut pause, longest) = pauses;
        loop {
            let pass = self.gate.read().await;
            let outcome = op(&self.inline());
            drop(pass);
            match outcome {
                Ok(value) => return Ok(value),
                Err(err) if is_busy(&err) => {
                    if started.elapsed() >= self.busy_timeout {
                        return Err(Busy::Timeout);
                    }
                    let jitter = Backoff::new(pause, pause, 0.5).map_or(pause, |b| b.delay(0));
                    tokio::time::sleep(jitter).await;
                    pause = (pause * 2).min(longest);
                }
                Err(err) => return Err(Busy::Failed(sqlite_error(&self.path, what, err))),
            }
        }
    }

    /// Raises the token of a row just taken with [`ACQUIRE_SQL`] above the `-fencing` file's
    /// record, attaching the file first.
    async fn raise_token(
        &self,
        name: &[u8],
        owner: &[u8; 16],
        token: i64,
    ) -> Result<i64, LockError> {
        self.fencing.attach(&self.inline(), self.busy_timeout)?;
        let raised = self
            .with_busy_retry("acquiring a lock", RELEASE_PAUSES, |conn| {
                returning_one(
                    &mut conn.prepare_cached(RAISE_TOKEN_SQL)?,
                    params![name, &owner[..]],
                )
            })
            .await;
        match raised {
            Ok(Some(Ok(raised))) => {
                self.count_commit();
                if raised != token {
                    tracing::debug!(
                        backend = NAME,
                        token,
                        raised,
                        "fencing token raised above a transaction-bound lock's"
                    );
                }
                Ok(raised)
            }
            Ok(Some(Err(err))) => Err(sqlite_error(&self.path, "acquiring a lock", err)),
            Ok(None) => Err(LockError::backend(
                NAME,
                "acquiring a lock: the row taken was gone before its fencing token was final",
                None,
                None,
            )),
            Err(Busy::Timeout) => Err(LockError::unavailable(
                NAME,
                format!(
                    "acquiring a lock: the lock file `{}` stayed busy for the whole busy timeout",
                    self.path.display()
                ),
                None,
            )),
            Err(Busy::Failed(err)) => Err(err),
        }
    }

    /// Frees a row this backend has just written but cannot hand out; best effort (if it
    /// fails, the row's lease ends it).
    async fn give_back(&self, name: &[u8], owner: &[u8; 16]) {
        let outcome = self
            .with_busy_retry("giving a lock back", RELEASE_PAUSES, |conn| {
                conn.prepare_cached(RELEASE_SQL)?
                    .execute(params![name, &owner[..]])
            })
            .await;
        if outcome.is_err() {
            tracing::warn!(
                backend = NAME,
                "a lock taken but not handed out could not be given back; it frees itself when its lease ends"
            );
        }
    }

    /// Counts a commit of the inline connection. Every [`CHECKPOINT_EVERY`] commits, starts a
    /// checkpoint on the blocking pool, so that no thread of the application waits for its
    /// `fsync`s; this backend's writes wait for it asynchronously (see `gate`). A passive
    /// one: it writes the log into the database without holding other processes back, and
    /// with no other writer the log starts over at the next commit. When the `-wal` file has
    /// grown past [`WAL_LIMIT_BYTES`] (other processes kept passive ones from catching up), a
    /// `RESTART` one: it holds every writer back while it writes the rest of the log, and
    /// lets the log start over.
    fn count_commit(&self) {
        let commits = self.commits.fetch_add(1, Ordering::Relaxed) + 1;
        if !commits.is_multiple_of(CHECKPOINT_EVERY) {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if self.checkpointing.swap(true, Ordering::AcqRel) {
            return;
        }
        // Cleared when the work is done or dropped unrun.
        let running = Checkpointing(Arc::clone(&self.checkpointing));
        let checkpointer = Arc::clone(&self.checkpointer);
        let gate = Arc::clone(&self.gate);
        let wal = self.wal.clone();
        drop(runtime.spawn_blocking(move || {
            let _running = running;
            // Waits for the statements under way (one at most), then holds the next ones.
            let _writes_wait = gate.blocking_write();
            let conn = checkpointer.lock().unwrap_or_else(PoisonError::into_inner);
            // Past the limit, passive checkpoints did not catch up with the other writers of
            // the file (the file only grows when the log does not fit in it).
            let size = std::fs::metadata(&wal).map_or(0, |m| m.len());
            let done = if size > WAL_LIMIT_BYTES {
                conn.query_row(CHECKPOINT_RESTART_SQL, [], |_| Ok(()))
            } else {
                conn.query_row(CHECKPOINT_PASSIVE_SQL, [], |_| Ok(()))
            };
            // Best effort: a checkpoint that finds others in the way is tried again later.
            if let Err(err) = done {
                tracing::debug!(backend = NAME, error = %err, "checkpoint of the write-ahead log failed");
            }
        }));
    }
}

/// Clears the checkpoint flag when dropped.
struct Checkpointing(Arc<AtomicBool>);

impl Drop for Checkpointing {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

pub use crate::TransactionLock;

/// Locks `key` until `transaction` commits or rolls back; one try.
///
/// Creates the lock table in the transaction's database if it is missing (and converts an
/// earlier version's table), and the `-fencing` file next to the database. Errors with
/// [`LockError::AlreadyHeld`] when a session lock holds the key, or when another connection is
/// writing the database for longer than the connection's busy timeout; with
/// [`LockError::Config`] when the database is not a file (in memory or temporary). Blocking
/// (it is `rusqlite`): call it where blocking is allowed.
pub fn try_acquire_in_transaction(
    transaction: &Transaction<'_>,
    key: &str,
) -> Result<TransactionLock, LockError> {
    crate::transaction::observe_blocking(NAME, key, Duration::ZERO, || {
        try_in_transaction(transaction, key)
    })
}

fn try_in_transaction(
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
/// `timeout` (errors with [`LockError::Timeout`] then). Blocking: it sleeps between tries. See
/// the [module docs](self#transaction-bound-locks) for what it can wait for.
pub fn acquire_in_transaction(
    transaction: &Transaction<'_>,
    key: &str,
    timeout: Duration,
) -> Result<TransactionLock, LockError> {
    crate::transaction::observe_blocking(NAME, key, timeout, || {
        wait_in_transaction(transaction, key, timeout)
    })
}

fn wait_in_transaction(
    transaction: &Transaction<'_>,
    key: &str,
    timeout: Duration,
) -> Result<TransactionLock, LockError> {
    validate_key(key)?;
    if timeout.is_zero() {
        return try_in_transaction(transaction, key);
    }
    let deadline = crate::time::deadline(Instant::now(), timeout);
    let mut pauses = Pauses::new(Backoff::default(), deadline);
    loop {
        if let Some(lock) = transaction_attempt(transaction, key)? {
            return Ok(lock);
        }
        let Some(pause) = pauses.next_pause() else {
            return Err(LockError::Timeout {
                key: Arc::from(key),
                timeout,
            });
        };
        std::thread::sleep(pause);
    }
}

fn transaction_attempt(
    transaction: &Transaction<'_>,
    key: &str,
) -> Result<Option<TransactionLock>, LockError> {
    let db_file = match transaction.path() {
        Some(path) if !path.is_empty() => PathBuf::from(path),
        _ => {
            return Err(LockError::config(
                "a transaction-bound lock needs a database file (not an in-memory or temporary database): its fencing tokens are recorded in a file next to it",
            ));
        }
    };
    let clock = LeaseClock::get()?;
    // Before the claim, which takes the file's write lock for the rest of the transaction.
    let fencing = fencing_connection(&db_file)?;
    let name = key.as_bytes();
    let claimed = ensure_schema(transaction, clock)
        .and_then(|()| {
            // A held lock is answered by a read, without taking the file's write lock.
            let mut peek = transaction.prepare_cached(PEEK_SQL)?;
            let held = peek
                .query(params![name, clock.now_ms(), clock.boot()])?
                .next()?
                .is_some();
            Ok(held)
        })
        .and_then(|held| {
            if held {
                return Ok(None);
            }
            returning_one(
                &mut transaction.prepare_cached(TRANSACTION_CLAIM_SQL)?,
                params![name, clock.now_ms(), clock.boot()],
            )
        });
    let counter = match claimed {
        Ok(Some(counter)) => counter,
        Ok(None) => return Ok(None),
        Err(err) if is_busy(&err) => return Ok(None),
        Err(err) => return Err(sqlite_error(&db_file, "acquiring a transaction lock", err)),
    };
    let counter = counter.map_err(|e| sqlite_error(&db_file, "acquiring a transaction lock", e))?;
    // The token must outlive a rollback of the caller's transaction: it is recorded in the
    // `-fencing` file, committed, before it is handed out.
    let token = issue_token(&fencing, &db_file, name, counter)?;
    transaction
        .prepare_cached(TRANSACTION_RECORD_SQL)
        .and_then(|mut record| record.execute(params![name, token]))
        .map_err(|e| sqlite_error(&db_file, "acquiring a transaction lock", e))?;
    let fencing_token = u64::try_from(token).map_err(|_| {
        LockError::backend(
            NAME,
            "acquiring a transaction lock: the fencing counter is not a positive integer",
            None,
            None,
        )
    })?;
    Ok(Some(TransactionLock::new(NAME, key, Some(fencing_token))))
}

/// The connection to the `-fencing` file of `db_file`, created (with the file) the first time
/// this process asks. Connections are kept for the life of the process, one per lock
/// database. The first time, it waits [`FENCING_LOOK`] after opening the file, so that no
/// backend still trusts a look that found no file when a token recorded in it is handed out
/// (see [`Fencing`]).
fn fencing_connection(db_file: &Path) -> Result<Arc<Mutex<Connection>>, LockError> {
    static FENCING: LazyLock<Mutex<HashMap<PathBuf, Arc<Mutex<Connection>>>>> =
        LazyLock::new(|| Mutex::new(HashMap::new()));
    let path = fencing_path(db_file);
    let mut files = FENCING.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(conn) = files.get(&path) {
        return Ok(Arc::clone(conn));
    }
    let conn = Arc::new(Mutex::new(open_fencing(&path, DEFAULT_BUSY_TIMEOUT)?));
    std::thread::sleep(FENCING_LOOK);
    files.insert(path, Arc::clone(&conn));
    Ok(conn)
}

/// Issues a token for `name` in the `-fencing` file, above `at_least`, and commits it.
fn issue_token(
    fencing: &Mutex<Connection>,
    db_file: &Path,
    name: &[u8],
    at_least: i64,
) -> Result<i64, LockError> {
    let path = fencing_path(db_file);
    let conn = fencing.lock().unwrap_or_else(PoisonError::into_inner);
    let issued = conn
        .prepare_cached(ISSUE_SQL)
        .and_then(|mut issue| returning_one(&mut issue, params![name, at_least]));
    match issued {
        Ok(Some(Ok(token))) => Ok(token),
        Ok(Some(Err(err))) | Err(err) => Err(sqlite_error(&path, "issuing a fencing token", err)),
        Ok(None) => Err(LockError::backend(
            NAME,
            "issuing a fencing token: the fencing file returned no token",
            None,
            None,
        )),
    }
}

/// `<db_file>-fencing`.
fn fencing_path(db_file: &Path) -> PathBuf {
    let mut path = db_file.as_os_str().to_owned();
    path.push(FENCING_SUFFIX);
    PathBuf::from(path)
}

/// Opens (creating if needed) a `-fencing` file and its table.
fn open_fencing(path: &Path, busy_timeout: Duration) -> Result<Connection, LockError> {
    let conn = open_file(path, busy_timeout)?;
    retry_busy(busy_timeout, || conn.execute_batch(FENCING_SCHEMA))
        .map_err(|e| sqlite_error(path, "creating the fencing table", e))?;
    Ok(conn)
}

/// Runs a `... RETURNING` statement to completion and gives its one value, if it returned a
/// row. `query_row` would stop after the first row: the statement's implicit commit then
/// happens when it is reset, where an error (a full disk, an I/O error) is dropped, and the
/// caller would take a lock whose row was never written. Stepping until the statement is done
/// makes such an error this call's error. The value is read apart (inner result): when it
/// cannot be read, the statement has still run, and a written row must be given back.
fn returning_one(
    statement: &mut rusqlite::CachedStatement<'_>,
    params: impl rusqlite::Params,
) -> rusqlite::Result<Option<rusqlite::Result<i64>>> {
    let mut rows = statement.query(params)?;
    let value = rows.next()?.map(|row| row.get::<_, i64>(0));
    while rows.next()?.is_some() {}
    Ok(value)
}

/// Opens a SQLite file for dlock: read-write, WAL, `synchronous=NORMAL`, no automatic
/// checkpoints (see [`Shared::count_commit`]).
fn open_file(path: &Path, busy_timeout: Duration) -> Result<Connection, LockError> {
    let flags = OpenFlags::SQLITE_OPEN_READ_WRITE
        | OpenFlags::SQLITE_OPEN_CREATE
        | OpenFlags::SQLITE_OPEN_NO_MUTEX;
    let conn = Connection::open_with_flags(path, flags)
        .map_err(|e| sqlite_error(path, "opening the lock file", e))?;
    // SQLite takes the busy timeout in `int` milliseconds (about 24 days); longer is the same.
    conn.busy_timeout(busy_timeout.min(Duration::from_millis(i32::MAX as u64)))
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
    // Small pages for a file created now (no effect on an existing one): every commit appends
    // whole pages to the write-ahead log, and lock rows are short.
    conn.execute_batch("PRAGMA page_size = 1024")
        .map_err(|e| sqlite_error(path, "configuring the lock file", e))?;
    retry_busy(busy_timeout, || {
        conn.query_row("PRAGMA journal_mode = WAL", [], |_| Ok(()))
    })
    .map_err(|e| sqlite_error(path, "opening the lock file", e))?;
    conn.pragma_update(None, "synchronous", "NORMAL")
        .map_err(|e| sqlite_error(path, "configuring the lock file", e))?;
    conn.pragma_update(None, "wal_autocheckpoint", 0)
        .map_err(|e| sqlite_error(path, "configuring the lock file", e))?;
    conn.query_row("PRAGMA journal_size_limit = 8388608", [], |_| Ok(()))
        .map_err(|e| sqlite_error(path, "configuring the lock file", e))?;
    Ok(conn)
}

fn open_connection(
    path: &Path,
    busy_timeout: Duration,
    clock: &LeaseClock,
) -> Result<Connection, LockError> {
    let conn = open_file(path, busy_timeout)?;
    retry_busy(busy_timeout, || ensure_schema(&conn, clock))
        .map_err(|e| sqlite_error(path, "creating the lock table", e))?;
    Ok(conn)
}

/// Runs `op` again while it fails with `SQLITE_BUSY`, for up to `busy_timeout`. SQLite does
/// not wait by itself in every case: a connection that would have to upgrade its lock while
/// another waits for the same (several processes creating or converting a file at once) gets
/// `SQLITE_BUSY` at once, to avoid a deadlock. Blocking: for opening the file only.
fn retry_busy<T>(
    busy_timeout: Duration,
    mut op: impl FnMut() -> rusqlite::Result<T>,
) -> rusqlite::Result<T> {
    let started = Instant::now();
    let mut pause = Duration::from_millis(1);
    loop {
        match op() {
            Err(err) if is_busy(&err) && started.elapsed() < busy_timeout => {
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(50));
            }
            outcome => return outcome,
        }
    }
}

/// Creates the lock table, or converts an earlier version's (see the module docs). On a
/// connection outside a transaction, the conversion runs in a transaction of its own; inside
/// the caller's transaction, it is part of it.
fn ensure_schema(conn: &Connection, clock: &LeaseClock) -> rusqlite::Result<()> {
    conn.execute_batch(SCHEMA)?;
    let legacy = |conn: &Connection| -> rusqlite::Result<bool> {
        conn.prepare_cached(LEGACY_SQL)?
            .query_row([], |row| row.get::<_, i64>(0))
            .map(|n| n > 0)
    };
    if !legacy(conn)? {
        return Ok(());
    }
    let own = conn.is_autocommit();
    let tx = if own {
        Some(Transaction::new_unchecked(
            conn,
            TransactionBehavior::Immediate,
        )?)
    } else {
        None
    };
    if legacy(conn)? {
        conn.execute_batch(MIGRATE_SQL)?;
        let wall_now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, millis);
        conn.prepare_cached(MIGRATE_ROWS_SQL)?.execute(params![
            wall_now,
            clock.now_ms(),
            clock.boot(),
            millis(MAX_SETTING)
        ])?;
        tracing::info!(
            backend = NAME,
            "converted a lock table of an earlier version to the lease clock"
        );
    }
    if let Some(tx) = tx {
        tx.commit()?;
    }
    Ok(())
}

const FORM: UrlForm = UrlForm {
    backend: "SQLite",
    schemes: &["sqlite"],
    example: "sqlite://locks.db (relative) or sqlite:///var/lib/app/locks.db (absolute)",
};

url_keys! {
    /// The SQLite URL options.
    enum SqliteOption for FORM {
        Lease = "lease",
        BusyTimeout = "busy_timeout",
    }
}

fn parse_url(url: &str) -> Result<SqliteBuilder, LockError> {
    // The scheme is case-insensitive, as in every URL (`LockProvider::connect` picks the
    // backend that way too).
    let (rest, query) = FORM.split(url)?;
    let path = rest.strip_prefix("//").unwrap_or(rest);
    if path.is_empty() {
        return Err(FORM.error("names no file"));
    }
    if path == ":memory:" || path.contains("mode=memory") {
        return Err(LockError::config(
            "an in-memory SQLite database cannot share locks between processes; name a file, such as `sqlite://locks.db`",
        ));
    }
    let mut builder = SqliteBackend::builder(path);
    read_query(query, |key: SqliteOption, value| {
        let value = parse_duration(key.as_ref(), &value)?;
        match key {
            SqliteOption::Lease => builder.lease = value,
            SqliteOption::BusyTimeout => builder.busy_timeout = value,
        }
        Ok(())
    })?;
    builder.check()?;
    Ok(builder)
}

fn check_lease(lease: Duration) -> Result<(), LockError> {
    check_setting(
        "the SQLite lease (renewed every third of it)",
        lease,
        MIN_LEASE,
        MAX_SETTING,
    )
    .map(drop)
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

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn url_forms() {
        crate::options::assert_keys::<SqliteOption, _>(parse_url("sqlite://a.db?bogus=1"));
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
        // The scheme in any case, as `LockProvider::connect` accepts it.
        for scheme in ["SQLite", "SQLITE", "sQlItE"] {
            assert_eq!(
                parse_url(&format!("{scheme}://locks.db")).unwrap().path,
                PathBuf::from("locks.db")
            );
        }
        for bad in [
            "sqlite://",
            "sqlit://a.db",
            "é://a.db",
            "sqlite::memory:",
            "sqlite://a.db?lease=1ms",
            "sqlite://a.db?lease=forever",
            "sqlite://a.db?color=red",
            "sqlite://a.db?lease=8761h",
            "sqlite://a.db?busy_timeout=8761h",
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

    async fn open(dir: &tempfile::TempDir, lease: Duration) -> SqliteBackend {
        SqliteBackend::builder(dir.path().join("l.db"))
            .lease(lease)
            .busy_timeout(Duration::from_millis(200))
            .open()
            .await
            .unwrap()
    }

    async fn take(backend: &SqliteBackend, key: &str) -> Option<Acquired> {
        backend.try_acquire(LockRequest::new(key)).await.unwrap()
    }

    /// The row of `key` as another connection sees it: (owner is set, fencing).
    fn row(dir: &tempfile::TempDir, key: &str) -> Option<(bool, i64)> {
        let conn = Connection::open(dir.path().join("l.db")).unwrap();
        conn.query_row(
            "SELECT owner IS NOT NULL, fencing FROM __distributed_locks WHERE name = ?1",
            [key.as_bytes()],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .ok()
    }

    #[tokio::test]
    async fn two_backends_on_one_file_exclude_each_other_and_tokens_increase() {
        let dir = tempfile::tempdir().unwrap();
        let a = open(&dir, Duration::from_secs(30)).await;
        let b = open(&dir, Duration::from_secs(30)).await;
        assert_eq!(a.name(), "sqlite");
        assert_eq!(a.path(), dir.path().join("l.db"));
        assert_eq!(a.lease(), Duration::from_secs(30));
        let first = take(&a, "k").await.unwrap();
        assert_eq!(first.fencing_token, Some(1));
        assert_eq!(row(&dir, "k"), Some((true, 1)));
        assert!(take(&b, "k").await.is_none());
        // Found held: the next poll reads first, and finds it held still.
        assert!(b.shared.seen_held(b"k"));
        assert!(take(&b, "k").await.is_none());
        assert!(!first.lost.is_cancelled());
        first.handle.release().await.unwrap();
        assert_eq!(row(&dir, "k"), Some((false, 1)));
        // The read says held no more; the write takes it.
        let second = take(&b, "k").await.unwrap();
        assert_eq!(second.fencing_token, Some(2));
        assert!(!b.shared.seen_held(b"k"));
        // Other keys are independent.
        let other = take(&a, "other").await.unwrap();
        assert_eq!(other.fencing_token, Some(1));
        second.handle.release().await.unwrap();
        other.handle.release().await.unwrap();
        // Three acquisitions and three releases were commits.
        assert_eq!(
            a.shared.commits.load(Ordering::Relaxed) + b.shared.commits.load(Ordering::Relaxed),
            6
        );
    }

    #[tokio::test]
    async fn a_release_after_a_takeover_is_a_loss() {
        let dir = tempfile::tempdir().unwrap();
        let a = open(&dir, Duration::from_secs(30)).await;
        let held = take(&a, "k").await.unwrap();
        let conn = Connection::open(dir.path().join("l.db")).unwrap();
        conn.execute(
            "UPDATE __distributed_locks SET owner = zeroblob(16) WHERE name = ?1",
            [b"k".as_slice()],
        )
        .unwrap();
        let lost = held.lost.clone();
        let err = held.handle.release().await.unwrap_err();
        assert!(
            matches!(&err, LockError::Lost { key, .. } if &**key == "k"),
            "{err:?}"
        );
        assert!(lost.is_cancelled());
        // The other owner's row is left alone.
        assert_eq!(row(&dir, "k"), Some((true, 1)));
    }

    #[tokio::test]
    async fn an_unrenewed_lease_runs_out_and_another_backend_takes_the_key() {
        let dir = tempfile::tempdir().unwrap();
        let a = open(&dir, Duration::from_secs(30)).await;
        let b = open(&dir, Duration::from_secs(30)).await;
        let lease = Duration::from_millis(150);
        let held = a
            .try_acquire(LockRequest::new("k").with_lease(Some(lease)))
            .await
            .unwrap()
            .unwrap();
        // Dropping the handle stops its renewal; the lease ends the lock.
        drop(held.handle);
        let started = Instant::now();
        let taken = loop {
            if let Some(taken) = take(&b, "k").await {
                break taken;
            }
            assert!(started.elapsed() < Duration::from_secs(10), "never expired");
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        assert!(started.elapsed() >= Duration::from_millis(100));
        assert_eq!(taken.fencing_token, Some(2));
        // A lease below the minimum is refused before anything is written.
        let err = b
            .try_acquire(LockRequest::new("j").with_lease(Some(Duration::from_millis(99))))
            .await
            .unwrap_err();
        assert!(matches!(err, LockError::Config { .. }), "{err:?}");
        assert_eq!(row(&dir, "j"), None);
    }

    #[tokio::test]
    async fn a_renewed_lease_outlives_itself() {
        let dir = tempfile::tempdir().unwrap();
        let a = open(&dir, Duration::from_millis(150)).await;
        let b = open(&dir, Duration::from_millis(150)).await;
        let held = take(&a, "k").await.unwrap();
        tokio::time::sleep(Duration::from_millis(450)).await;
        assert!(take(&b, "k").await.is_none());
        assert!(!held.lost.is_cancelled());
        held.handle.release().await.unwrap();
    }

    #[tokio::test]
    async fn a_busy_file_is_contention_for_an_acquisition_and_unavailable_for_a_release() {
        let dir = tempfile::tempdir().unwrap();
        let a = open(&dir, Duration::from_secs(30)).await;
        let held = take(&a, "k").await.unwrap();
        let mut conn = Connection::open(dir.path().join("l.db")).unwrap();
        let tx = conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .unwrap();
        let started = Instant::now();
        assert!(take(&a, "free").await.is_none());
        assert!(started.elapsed() >= Duration::from_millis(200));
        assert!(started.elapsed() < Duration::from_secs(5));
        let err = held.handle.release().await.unwrap_err();
        assert!(matches!(err, LockError::Unavailable { .. }), "{err:?}");
        drop(tx);
        assert_eq!(row(&dir, "free"), None);
    }

    #[test]
    fn held_keys_are_remembered_for_a_while_and_in_bounded_number() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let backend = rt.block_on(open(&dir, Duration::from_secs(30)));
        let shared = &backend.shared;
        assert!(!shared.seen_held(b"a"));
        shared.note_held(b"a");
        assert!(shared.seen_held(b"a"));
        assert!(!shared.seen_held(b"b"));
        shared.forget_held(b"a");
        assert!(!shared.seen_held(b"a"));
        // An old memory counts for nothing.
        shared
            .held_recently()
            .insert(Box::from(&b"old"[..]), Instant::now() - HELD_MEMORY);
        assert!(!shared.seen_held(b"old"));
        shared.note_held(b"old");
        assert!(shared.seen_held(b"old"));
        // Full: stale entries go first, then everything.
        shared.held_recently().clear();
        for i in 0..HELD_MEMORY_KEYS - 1 {
            shared.note_held(format!("k{i}").as_bytes());
        }
        shared
            .held_recently()
            .insert(Box::from(&b"stale"[..]), Instant::now() - HELD_MEMORY);
        assert_eq!(shared.held_recently().len(), HELD_MEMORY_KEYS);
        shared.note_held(b"k0");
        assert_eq!(shared.held_recently().len(), HELD_MEMORY_KEYS);
        shared.note_held(b"new");
        assert_eq!(shared.held_recently().len(), HELD_MEMORY_KEYS);
        assert!(!shared.held_recently().contains_key(&b"stale"[..]));
        shared.note_held(b"newer");
        assert_eq!(shared.held_recently().len(), 1);
        assert!(shared.seen_held(b"newer"));
    }

    #[test]
    fn owner_tokens_are_handed_out_once_across_fetches() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let backend = rt.block_on(open(&dir, Duration::from_secs(30)));
        let owners: std::collections::HashSet<[u8; 16]> = (0..3 * OWNERS_PER_FETCH)
            .map(|_| backend.shared.new_owner().unwrap())
            .collect();
        assert_eq!(owners.len(), 3 * OWNERS_PER_FETCH);
        assert!(!owners.contains(&[0u8; 16]));
    }

    #[test]
    fn transaction_locks_take_tokens_that_a_rollback_does_not_give_back() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("l.db");
        let backend = rt.block_on(open(&dir, Duration::from_secs(30)));
        let mut conn = Connection::open(&path).unwrap();
        let tx = conn.transaction().unwrap();
        let first = try_acquire_in_transaction(&tx, "k").unwrap();
        assert_eq!(first.fencing_token(), Some(1));
        tx.rollback().unwrap();
        let tx = conn.transaction().unwrap();
        let second = acquire_in_transaction(&tx, "k", Duration::from_secs(1)).unwrap();
        assert_eq!(second.fencing_token(), Some(2));
        tx.commit().unwrap();
        // A session acquisition issues tokens above the record.
        let taken = rt.block_on(take(&backend, "k")).unwrap();
        assert_eq!(taken.fencing_token, Some(3));
        let tx = conn.transaction().unwrap();
        let err = try_acquire_in_transaction(&tx, "k").unwrap_err();
        assert!(matches!(err, LockError::AlreadyHeld { .. }), "{err:?}");
        let started = Instant::now();
        let err = acquire_in_transaction(&tx, "k", Duration::from_millis(60)).unwrap_err();
        assert!(matches!(err, LockError::Timeout { .. }), "{err:?}");
        assert!(started.elapsed() >= Duration::from_millis(60));
        let err = acquire_in_transaction(&tx, "k", Duration::ZERO).unwrap_err();
        assert!(matches!(err, LockError::AlreadyHeld { .. }), "{err:?}");
        assert!(matches!(
            try_acquire_in_transaction(&tx, ""),
            Err(LockError::InvalidKey { .. })
        ));
        drop(tx);
        rt.block_on(taken.handle.release()).unwrap();
        // A backend opened after the record exists raises its tokens above it at once.
        let late = rt.block_on(open(&dir, Duration::from_secs(30)));
        assert!(late.shared.fencing.attached());
        let next = rt.block_on(take(&late, "k")).unwrap();
        assert_eq!(next.fencing_token, Some(4));
        drop(next);
        let mut memory = Connection::open_in_memory().unwrap();
        let tx = memory.transaction().unwrap();
        assert!(matches!(
            try_acquire_in_transaction(&tx, "k"),
            Err(LockError::Config { .. })
        ));
    }

    #[tokio::test]
    async fn settings_out_of_bounds_are_refused_at_open() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("l.db");
        let low = SqliteBackend::builder(&path)
            .lease(Duration::from_millis(99))
            .open()
            .await
            .unwrap_err();
        assert!(low.to_string().contains("at least 100ms"), "{low}");
        let high = SqliteBackend::builder(&path)
            .busy_timeout(MAX_SETTING + Duration::from_secs(1))
            .open()
            .await
            .unwrap_err();
        assert!(high.to_string().contains("busy_timeout"), "{high}");
        let ok = SqliteBackend::builder(&path)
            .lease(MIN_LEASE)
            .open()
            .await
            .unwrap();
        assert_eq!(ok.lease(), MIN_LEASE);
        let defaults = SqliteBackend::open(&path).await.unwrap();
        assert_eq!(defaults.lease(), DEFAULT_LEASE);
        assert_eq!(defaults.shared.busy_timeout, DEFAULT_BUSY_TIMEOUT);
        let url = format!("SQLITE://{}?busy_timeout=250ms", path.display());
        let from_url = SqliteBackend::connect(&url).await.unwrap();
        assert_eq!(from_url.shared.busy_timeout, Duration::from_millis(250));
        let not_a_db = dir.path().join("text");
        std::fs::write(&not_a_db, vec![b'x'; 4096]).unwrap();
        let err = SqliteBackend::open(&not_a_db).await.unwrap_err();
        assert!(
            err.to_string().contains("is not a SQLite database"),
            "{err}"
        );
        let err = SqliteBackend::open(dir.path()).await.unwrap_err();
        assert!(matches!(err, LockError::Config { .. }), "{err}");
    }

    #[test]
    fn checkpoints_run_every_thousand_commits() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let backend = rt.block_on(open(&dir, Duration::from_secs(30)));
        let shared = &backend.shared;
        rt.block_on(async {
            for _ in 0..CHECKPOINT_EVERY - 1 {
                shared.count_commit();
            }
            assert!(!shared.checkpointing.load(Ordering::Acquire));
            // A write under way holds the checkpoint back (it waits for the gate).
            let writing = shared.gate.read().await;
            shared.count_commit();
            assert!(shared.checkpointing.load(Ordering::Acquire));
            drop(writing);
            // The flag is cleared once the checkpoint is done.
            let started = Instant::now();
            while shared.checkpointing.load(Ordering::Acquire) {
                assert!(started.elapsed() < Duration::from_secs(10));
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        });
        // Outside a runtime, nothing is started.
        for _ in 0..CHECKPOINT_EVERY {
            shared.count_commit();
        }
        assert!(!shared.checkpointing.load(Ordering::Acquire));
        assert!(checkpoint_busy(0) && !checkpoint_busy(CHECKPOINT_TRIES));
    }

    /// A backend that looked for the `-fencing` file before it existed looks again once that
    /// look is too old, and raises its token above a rolled-back transaction lock's.
    #[test]
    fn a_session_lock_takes_a_token_above_a_rolled_back_transaction_lock() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let backend = rt.block_on(open(&dir, Duration::from_secs(30)));
        // A look that finds no file.
        let first = rt.block_on(take(&backend, "j")).unwrap();
        rt.block_on(first.handle.release()).unwrap();
        assert!(!backend.shared.fencing.attached());
        let mut conn = Connection::open(dir.path().join("l.db")).unwrap();
        let tx = conn.transaction().unwrap();
        assert_eq!(
            try_acquire_in_transaction(&tx, "k")
                .unwrap()
                .fencing_token(),
            Some(1)
        );
        tx.commit().unwrap();
        let tx = conn.transaction().unwrap();
        assert_eq!(
            try_acquire_in_transaction(&tx, "k")
                .unwrap()
                .fencing_token(),
            Some(2)
        );
        tx.rollback().unwrap();
        // The row says 1; the record says 2 was handed out.
        assert_eq!(row(&dir, "k"), Some((false, 1)));
        let taken = rt.block_on(take(&backend, "k")).unwrap();
        assert_eq!(taken.fencing_token, Some(3));
        assert!(backend.shared.fencing.attached());
        rt.block_on(taken.handle.release()).unwrap();
    }

    fn failure(code: std::os::raw::c_int) -> rusqlite::Error {
        rusqlite::Error::SqliteFailure(rusqlite::ffi::Error::new(code), None)
    }

    /// Failures are told apart by what the caller can do about them: fix the file (`Config`),
    /// try again later (`Unavailable`), or read the database's code (`Backend`).
    #[test]
    fn errors_say_what_the_caller_can_do() {
        use rusqlite::ffi;
        let path = Path::new("/srv/l.db");
        for code in [ffi::SQLITE_READONLY, ffi::SQLITE_PERM] {
            let err = sqlite_error(path, "releasing a lock", failure(code));
            assert!(matches!(err, LockError::Config { .. }), "{err:?}");
            assert!(err.to_string().contains("cannot be written"), "{err}");
        }
        let err = sqlite_error(path, "releasing a lock", failure(ffi::SQLITE_FULL));
        assert!(matches!(err, LockError::Unavailable { .. }), "{err:?}");
        assert!(err.to_string().contains("is full"), "{err}");
        let err = sqlite_error(path, "releasing a lock", failure(ffi::SQLITE_IOERR));
        assert!(matches!(err, LockError::Unavailable { .. }), "{err:?}");
        assert!(
            err.to_string().contains("I/O error on `/srv/l.db`"),
            "{err}"
        );
        let err = sqlite_error(path, "releasing a lock", failure(ffi::SQLITE_CONSTRAINT));
        assert!(matches!(err, LockError::Backend { .. }), "{err:?}");
        assert_eq!(err.db_code(), Some("SQLITE_19"));

        assert!(is_busy(&failure(ffi::SQLITE_BUSY)));
        assert!(is_busy(&failure(ffi::SQLITE_LOCKED)));
        assert!(!is_busy(&failure(ffi::SQLITE_CONSTRAINT)));
        assert!(!is_busy(&rusqlite::Error::QueryReturnedNoRows));
    }

    /// A lock file of the earlier version (wall-clock `expires_at`, no boot column) is
    /// converted when opened: held locks keep what was left of their lease, free ones stay
    /// free, and counters go on from where they were.
    #[tokio::test]
    async fn a_lock_file_of_the_earlier_version_is_converted() {
        let dir = tempfile::tempdir().unwrap();
        let conn = Connection::open(dir.path().join("l.db")).unwrap();
        conn.execute_batch(
            "CREATE TABLE __distributed_locks (name BLOB NOT NULL PRIMARY KEY, owner BLOB, \
             expires_at INTEGER NOT NULL DEFAULT 0, fencing INTEGER NOT NULL DEFAULT 0) \
             WITHOUT ROWID",
        )
        .unwrap();
        let wall_now = millis(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap(),
        );
        conn.execute(
            "INSERT INTO __distributed_locks VALUES (?1, zeroblob(16), ?2, 7), (?3, NULL, 0, 3)",
            params![&b"held"[..], wall_now + 60_000, &b"free"[..]],
        )
        .unwrap();
        drop(conn);

        let backend = open(&dir, Duration::from_secs(30)).await;
        assert!(take(&backend, "held").await.is_none());
        let free = take(&backend, "free").await.unwrap();
        assert_eq!(free.fencing_token, Some(4));
        free.handle.release().await.unwrap();
        let conn = Connection::open(dir.path().join("l.db")).unwrap();
        let legacy: i64 = conn.query_row(LEGACY_SQL, [], |r| r.get(0)).unwrap();
        assert_eq!(legacy, 0);
        // What was left of the held lease is kept (not the whole remaining clock).
        let lease_end: i64 = conn
            .query_row(
                "SELECT lease_end FROM __distributed_locks WHERE name = ?1",
                [&b"held"[..]],
                |r| r.get(0),
            )
            .unwrap();
        let left = lease_end - LeaseClock::get().unwrap().now_ms();
        assert!((50_000..=60_000).contains(&left), "{left}");
    }

    /// A counter that cannot be a fencing token is an error, and the row just taken is given
    /// back instead of staying locked for its lease.
    #[tokio::test]
    async fn a_counter_that_is_not_a_positive_integer_gives_the_row_back() {
        let dir = tempfile::tempdir().unwrap();
        let backend = open(&dir, Duration::from_secs(30)).await;
        let conn = Connection::open(dir.path().join("l.db")).unwrap();
        conn.execute(
            "INSERT INTO __distributed_locks (name, owner, lease_end, fencing) \
             VALUES (?1, NULL, 0, -10)",
            [&b"k"[..]],
        )
        .unwrap();
        let err = backend
            .try_acquire(LockRequest::new("k"))
            .await
            .unwrap_err();
        assert!(err.to_string().contains("not a positive integer"), "{err}");
        assert_eq!(row(&dir, "k"), Some((false, -9)));
    }

    /// Statements the file refuses (here by a trigger, as a constraint would) are failures,
    /// not contention: they are neither retried for the busy timeout nor answered as "held".
    #[test]
    fn refused_statements_are_errors_not_contention() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("l.db");
        let backend = rt
            .block_on(
                SqliteBackend::builder(&path)
                    .busy_timeout(Duration::from_secs(20))
                    .open(),
            )
            .unwrap();
        let held = rt.block_on(take(&backend, "k")).unwrap();
        let mut conn = Connection::open(&path).unwrap();
        conn.execute_batch(
            "CREATE TRIGGER no_insert BEFORE INSERT ON __distributed_locks \
             BEGIN SELECT RAISE(ABORT, 'refused'); END; \
             CREATE TRIGGER no_release BEFORE UPDATE ON __distributed_locks \
             WHEN new.owner IS NULL BEGIN SELECT RAISE(ABORT, 'refused'); END;",
        )
        .unwrap();
        let started = Instant::now();
        let err = rt
            .block_on(backend.try_acquire(LockRequest::new("new")))
            .unwrap_err();
        assert!(matches!(err, LockError::Backend { .. }), "{err:?}");
        let err = rt.block_on(held.handle.release()).unwrap_err();
        assert!(matches!(err, LockError::Backend { .. }), "{err:?}");
        let tx = conn.transaction().unwrap();
        let err = try_acquire_in_transaction(&tx, "t").unwrap_err();
        assert!(matches!(err, LockError::Backend { .. }), "{err:?}");
        drop(tx);
        assert!(started.elapsed() < Duration::from_secs(10));
    }

    /// A release that finds the file busy waits for it, within the busy timeout.
    #[tokio::test]
    async fn a_release_waits_for_a_busy_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("l.db");
        let backend = SqliteBackend::builder(&path)
            .busy_timeout(Duration::from_secs(20))
            .open()
            .await
            .unwrap();
        let held = take(&backend, "k").await.unwrap();
        let (locked, is_locked) = std::sync::mpsc::channel();
        let (free, unlock) = std::sync::mpsc::channel::<()>();
        let writer = std::thread::spawn(move || {
            let mut conn = Connection::open(&path).unwrap();
            let tx = conn
                .transaction_with_behavior(TransactionBehavior::Immediate)
                .unwrap();
            locked.send(()).unwrap();
            // Held until the release has found the file busy at least once.
            unlock.recv().unwrap();
            drop(tx);
        });
        is_locked.recv().unwrap();
        let release = tokio::spawn(held.handle.release());
        // The release is retrying (it cannot get through while the write lock is held).
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!release.is_finished());
        free.send(()).unwrap();
        release.await.unwrap().unwrap();
        writer.join().unwrap();
        assert_eq!(row(&dir, "k"), Some((false, 1)));
    }

    /// A transaction lock on a file another connection is writing is held, as far as one try
    /// can tell.
    #[test]
    fn a_transaction_lock_on_a_busy_file_is_already_held() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("l.db");
        drop(rt.block_on(open(&dir, Duration::from_secs(30))));
        let mut writer = Connection::open(&path).unwrap();
        let writing = writer
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .unwrap();
        let mut conn = Connection::open(&path).unwrap();
        conn.busy_timeout(Duration::from_millis(20)).unwrap();
        let tx = conn.transaction().unwrap();
        let err = try_acquire_in_transaction(&tx, "k").unwrap_err();
        assert!(matches!(err, LockError::AlreadyHeld { .. }), "{err:?}");
        drop(tx);
        drop(writing);
    }

    /// Failures other than a busy file are not retried while the file is opened.
    #[tokio::test]
    async fn a_file_that_is_not_a_database_is_refused_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("text");
        std::fs::write(&path, vec![b'x'; 4096]).unwrap();
        let started = Instant::now();
        let err = SqliteBackend::builder(&path)
            .busy_timeout(Duration::from_secs(60))
            .open()
            .await
            .unwrap_err();
        assert!(matches!(err, LockError::Config { .. }), "{err:?}");
        assert!(started.elapsed() < Duration::from_secs(30));
    }

    /// A file another connection keeps locked (exclusive locking mode) cannot be opened: the
    /// open gives up once the busy timeout has passed instead of waiting for the file.
    #[tokio::test]
    async fn opening_a_file_locked_for_good_gives_up_after_the_busy_timeout() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("l.db");
        let conn = Connection::open(&path).unwrap();
        conn.query_row("PRAGMA journal_mode = WAL", [], |_| Ok(()))
            .unwrap();
        conn.execute_batch(
            "PRAGMA locking_mode = EXCLUSIVE; BEGIN IMMEDIATE; CREATE TABLE other (x); COMMIT;",
        )
        .unwrap();
        let started = Instant::now();
        let err = SqliteBackend::builder(&path)
            .busy_timeout(Duration::from_millis(200))
            .open()
            .await
            .unwrap_err();
        assert!(matches!(err, LockError::Backend { .. }), "{err:?}");
        assert_eq!(err.db_code(), Some("SQLITE_5"), "{err:?}");
        assert!(started.elapsed() >= Duration::from_millis(200));
        drop(conn);
        // Once the file is let go, it opens.
        SqliteBackend::open(&path).await.unwrap();
    }
}
