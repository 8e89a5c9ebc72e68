#![doc = include_str!("docs.md")]

mod clock;
mod counted;
mod file;
mod force;
mod owners;
mod permits;
mod queue;
mod read;
mod renewer;
mod statements;
mod transaction;
mod url;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use rusqlite::{Connection, ErrorCode, OpenFlags, Transaction, TransactionBehavior, params};
use tokio_util::sync::CancellationToken;

use self::clock::LeaseClock;
use self::file::*;
use self::permits::renew_permit;
use self::read::renew_reader;
use self::renewer::{Kind, Renewal, Renewer};
use self::statements::*;
pub use self::transaction::{acquire_in_transaction, try_acquire_in_transaction};
use self::url::*;
use crate::backend::{
    Acquired, BoxFuture, HeldLock, LeaseControl, LockBackend, LockRequest, PermitStore,
    ReleaseOutcome, StoreLock, WaitTry,
};
use crate::backoff::Pauses;
use crate::key::validate_key;
use crate::lease::DEFAULT_LEASE;
use crate::options::{UrlForm, parse_duration, read_query, url_keys};
use crate::time::{MAX_SETTING, check_setting};
use crate::{Backoff, LockError};

const NAME: &str = "sqlite";

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

const DEFAULT_BUSY_TIMEOUT: Duration = Duration::from_secs(5);

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
    /// The renewal cadence set by the application, if any.
    renew_every: Option<Duration>,
    clock: &'static LeaseClock,
    commits: AtomicU64,
    renewer: Renewer,
    /// Keys this backend found held lately: their next poll reads before it writes.
    held_recently: Mutex<HashMap<Box<[u8]>, Instant>>,
    /// Random bytes for owner tokens, not handed out yet.
    owners: Mutex<Owners>,
    /// The backend's id (the first 8 bytes of its owner tokens) and owner label.
    owner_label: owners::OwnerLabel,
    /// The `-fencing` file, once it exists.
    fencing: Fencing,
    /// The shared counters the backend joined (`fencing_counters`), if any.
    counted: Option<counted::Counted>,
    /// Keys this backend left a waiting writer's intent on (see `read.rs`).
    intents: Mutex<std::collections::HashSet<Box<[u8]>>>,
    /// This backend's name in the waiters' queues (random), and its places there, by key
    /// (see `queue.rs`).
    waiter: [u8; 16],
    places: Mutex<HashMap<Box<[u8]>, queue::Place>>,
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
    renew_every: Option<Duration>,
    fencing_counters: Option<u32>,
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

    /// How often held locks are renewed (default: every third of each lock's lease; 10 ms to
    /// 365 days, checked by [`open`](SqliteBuilder::open)). A cadence longer than half of a
    /// lock's lease is cut to that half, so that failed renewals can still be retried before
    /// the lock's local deadline. Shorter cadences cost more writes and find a lost lock
    /// sooner.
    pub fn renew_every(mut self, cadence: Duration) -> Self {
        self.renew_every = Some(cadence);
        self
    }

    /// Keep at most `counters` fencing counters (1 to 65,536) instead of one row per key ever
    /// locked: a key's tokens come from counter number
    /// [`fencing_counter`](crate::fencing_counter)`(key, counters)` and still increase
    /// strictly per key, and a released lock's row is deleted, so the file holds the keys held
    /// now and at most `counters` counters (see [Bounded fencing
    /// counters](self#bounded-fencing-counters)). Checked by [`open`](SqliteBuilder::open).
    /// The URL option is `fencing_counters=N`.
    pub fn fencing_counters(mut self, counters: u32) -> Self {
        self.fencing_counters = Some(counters);
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
        if let Some(cadence) = self.renew_every {
            crate::lease::check_cadence("the SQLite renew_every", cadence)?;
        }
        if let Some(n) = self.fencing_counters {
            crate::counters::check(n)?;
        }
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
        let mut waiter = [0; 16];
        random_fill(&mut waiter)?;
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
        let counted = match self.fencing_counters {
            Some(n) => Some(counted::join_file(
                &inline,
                &self.path,
                n,
                self.busy_timeout,
            )?),
            None => {
                counted::refuse_if_switched(&inline, &self.path, self.busy_timeout)?;
                None
            }
        };
        Ok(SqliteBackend {
            shared: Arc::new(Shared {
                inline: Mutex::new(inline),
                checkpointer: Arc::new(Mutex::new(checkpointer)),
                checkpointing: Arc::new(AtomicBool::new(false)),
                gate: Arc::new(tokio::sync::RwLock::new(())),
                wal: PathBuf::from(wal),
                lease: self.lease,
                busy_timeout: self.busy_timeout,
                renew_every: self.renew_every,
                clock,
                commits: AtomicU64::new(0),
                renewer: Renewer::new(background, clock, self.path.clone()),
                held_recently: Mutex::new(HashMap::new()),
                intents: Mutex::new(std::collections::HashSet::new()),
                waiter,
                places: Mutex::new(HashMap::new()),
                fencing,
                counted,
                owners: Mutex::new(Owners {
                    bytes: [0; 16 * OWNERS_PER_FETCH],
                    used: OWNERS_PER_FETCH,
                }),
                owner_label: owners::OwnerLabel::new()?,
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
            renew_every: None,
            fencing_counters: None,
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

    /// Read locks are shares of the key held under leases of their own (see
    /// [Read locks](self#read-locks)).
    fn shared_locks(&self) -> Result<(), LockError> {
        Ok(())
    }

    /// Semaphores are a counted table of permits with leases (see
    /// [Semaphores](self#semaphores)).
    fn semaphores(&self) -> Option<&dyn PermitStore> {
        Some(self)
    }

    fn ping(&self) -> BoxFuture<'_, Result<(), LockError>> {
        Box::pin(async move {
            let read =
                self.shared
                    .with_busy_retry("checking the lock file", RELEASE_PAUSES, |conn| {
                        conn.prepare_cached(PING_SQL)?
                            .query_row([], |row| row.get::<_, i64>(0))
                    });
            read.await
                .map(drop)
                .map_err(|busy| self.shared.busy_error("checking the lock file", busy))
        })
    }

    /// The held rows of the lock table, with their readers.
    fn force_releases(&self) -> Result<&dyn crate::backend::ForceRelease, LockError> {
        Ok(self)
    }

    fn set_owner_label(&self, label: &str) {
        self.shared.owner_label.set(label);
    }

    fn store_locks<'a>(
        &'a self,
        _known: &'a [&'a str],
    ) -> BoxFuture<'a, Result<Vec<StoreLock>, LockError>> {
        Box::pin(async move {
            let clock = self.shared.clock;
            let read = self
                .shared
                .with_busy_retry("listing the locks", RELEASE_PAUSES, |conn| {
                    let (now, boot) = (clock.now_ms(), clock.boot());
                    let mut readers = HashMap::new();
                    let mut query = conn.prepare_cached(owners::STORE_READERS_SQL)?;
                    let mut rows = query.query(params![now, boot])?;
                    while let Some(row) = rows.next()? {
                        readers.insert(
                            row.get::<_, Vec<u8>>(0)?,
                            (row.get::<_, i64>(1)?, row.get::<_, Option<String>>(2)?),
                        );
                    }
                    let mut locks = Vec::new();
                    let mut query = conn.prepare_cached(owners::STORE_LOCKS_SQL)?;
                    let mut rows = query.query(params![now, boot])?;
                    while let Some(row) = rows.next()? {
                        let name: Vec<u8> = row.get(0)?;
                        let by_readers: bool = row.get(1)?;
                        let lease_end: i64 = row.get(2)?;
                        let fencing: i64 = row.get(3)?;
                        let label: Option<String> = row.get(4)?;
                        let taken_at: Option<i64> = row.get(5)?;
                        let key = String::from_utf8_lossy(&name).into_owned();
                        let (count, owner) = if by_readers {
                            readers.remove(&name).unwrap_or((0, None))
                        } else {
                            (0, label)
                        };
                        let left = u64::try_from(lease_end.saturating_sub(now)).unwrap_or(0);
                        locks.push(
                            StoreLock::new(key.clone())
                                .with_key(Some(key))
                                .with_readers(u32::try_from(count).unwrap_or(u32::MAX))
                                .with_fencing_token(u64::try_from(fencing).ok().filter(|t| *t > 0))
                                .with_remaining_lease(Some(Duration::from_millis(left)))
                                .with_owner(owner)
                                .with_since(taken_at.and_then(|at| {
                                    let at = u64::try_from(at).ok()?;
                                    std::time::UNIX_EPOCH.checked_add(Duration::from_millis(at))
                                })),
                        );
                    }
                    Ok(locks)
                })
                .await;
            read.map_err(|busy| self.shared.busy_error("listing the locks", busy))
        })
    }

    /// An exclusive wait queues across processes (see the [module docs](self#fair-waiting)):
    /// it takes the key only when no waiter of another backend began waiting before it.
    fn try_acquire_in_wait<'a>(
        &'a self,
        request: LockRequest<'a>,
    ) -> BoxFuture<'a, Result<WaitTry, LockError>> {
        Box::pin(async move {
            let name = request.key.as_bytes();
            let ahead = if request.shared {
                0
            } else {
                self.shared.queue_ahead(name).await
            };
            if ahead > 0 {
                let retry_within = self.shared.queue_wait(name, ahead).await;
                return Ok(WaitTry::Held {
                    retry_within: Some(retry_within),
                });
            }
            match self.try_acquire(request).await? {
                Some(acquired) => {
                    if !request.shared {
                        self.shared.queue_leave(name).await;
                    }
                    Ok(WaitTry::Acquired(acquired))
                }
                None if request.shared => Ok(WaitTry::Held { retry_within: None }),
                None => Ok(WaitTry::Held {
                    retry_within: Some(self.shared.queue_wait(name, 0).await),
                }),
            }
        })
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
            let take = if request.shared {
                self.shared.take_read(name, &owner, lease).await
            } else {
                self.shared.take_row(name, &owner, lease).await
            };
            let (started, fencing, fenced) = match take {
                Ok(Take::Taken {
                    started,
                    fencing,
                    fenced,
                }) => (started, fencing, fenced),
                Ok(Take::Held) => {
                    if let (false, Some(pause)) = (request.shared, request.poll_pause) {
                        self.shared.writer_waits(name, pause).await;
                    }
                    return Ok(None);
                }
                // Another writer kept the file for the whole busy timeout: contention.
                Err(Busy::Timeout) => return Ok(None),
                Err(Busy::Failed(err)) => return Err(err),
            };
            self.shared.count_commit();
            if !request.shared {
                self.shared.writer_got(name).await;
            }
            self.shared.write_owner_label(started).await;
            // The row (or the reader's share) is ours from here on: a failure must give it
            // back. A reader's token is final (see `read_once`).
            let fencing = match fencing {
                Ok(token) if !request.shared && !fenced && self.shared.fencing.may_exist() => {
                    self.shared.raise_token(name, &owner, token).await
                }
                Ok(token) => Ok(token),
                Err(err) => Err(sqlite_error(&self.shared.path, "acquiring a lock", err)),
            };
            let token = match fencing.map(u64::try_from) {
                Ok(Ok(token)) => token,
                Ok(Err(_)) => {
                    self.shared.give_back(name, &owner, request.shared).await;
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
                    self.shared.give_back(name, &owner, request.shared).await;
                    return Err(err);
                }
            };
            let name: Arc<[u8]> = Arc::from(name);
            let lost = CancellationToken::new();
            let mut renewal = Renewal::new(Arc::clone(&name), owner, lease, lost.clone(), started)
                .every(self.shared.renew_every, started);
            if !request.renew {
                renewal = renewal.unrenewed();
            }
            if request.shared {
                renewal = renewal.of_kind(Kind::Read);
            }
            let deadline = renewal.deadline();
            let registered = self.shared.renewer.register(renewal);
            let id = match registered {
                Ok(id) => id,
                Err(err) => {
                    self.shared.give_back(&name, &owner, request.shared).await;
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
                        name,
                        owner,
                        lost,
                        kind: if request.shared {
                            Kind::Read
                        } else {
                            Kind::Lock
                        },
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
    /// The key's bytes, shared with the lock's renewal entry.
    name: Arc<[u8]>,
    owner: [u8; 16],
    lost: CancellationToken,
    /// A lock's row, a reader's share (see `read.rs`) or a permit (see `permits.rs`).
    kind: Kind,
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
        let name = Arc::clone(&self.name);
        let outcome = self.release_outcome();
        Box::pin(async move {
            match outcome.await? {
                ReleaseOutcome::Released => Ok(()),
                _ => Err(LockError::Lost {
                    key: Arc::from(String::from_utf8_lossy(&name)),
                    reason:
                        "the release found the lock taken over or removed (its lease had run out)"
                            .to_owned(),
                }),
            }
        })
    }

    /// Frees the row if this lock still owns it; otherwise tells whether another owner holds
    /// it under a live lease ([`ReleaseOutcome::NotOwned`]) or nobody does
    /// ([`ReleaseOutcome::AlreadyReleased`]), and fires the lost token.
    fn release_outcome(self: Box<Self>) -> BoxFuture<'static, Result<ReleaseOutcome, LockError>> {
        Box::pin(async move {
            // Renewed until the row is free: a release that waits for the file must not let
            // the lease run out meanwhile.
            self.shared.renewer.releasing(self.id);
            if self.kind == Kind::Permit {
                let outcome = self
                    .shared
                    .release_permit(&self.name[..], &self.owner)
                    .await;
                self.shared.renewer.unregister(self.id);
                return match outcome {
                    Ok(outcome) => {
                        self.shared.count_commit();
                        if outcome != ReleaseOutcome::Released {
                            tracing::warn!(
                                backend = NAME,
                                semaphore = %String::from_utf8_lossy(&self.name),
                                "the release found the permit's lease run out; it was lost"
                            );
                            self.lost.cancel();
                        }
                        Ok(outcome)
                    }
                    Err(busy) => Err(self.shared.busy_error(
                        "releasing a permit (it frees itself when its lease runs out)",
                        busy,
                    )),
                };
            }
            if self.kind == Kind::Read {
                let outcome = self.shared.release_read(&self.name[..], &self.owner).await;
                self.shared.renewer.unregister(self.id);
                return match outcome {
                    Ok(outcome) => {
                        self.shared.count_commit();
                        if outcome != ReleaseOutcome::Released {
                            tracing::warn!(
                                backend = NAME,
                                key = %String::from_utf8_lossy(&self.name),
                                "the release found the read lock's lease run out; it was lost"
                            );
                            self.lost.cancel();
                        }
                        Ok(outcome)
                    }
                    Err(busy) => Err(self.shared.busy_error(
                        "releasing a read lock (it frees itself when its lease runs out)",
                        busy,
                    )),
                };
            }
            let outcome = self
                .shared
                .with_busy_retry("releasing a lock", RELEASE_PAUSES, |conn| {
                    conn.prepare_cached(self.shared.release_sql())?
                        .execute(params![&self.name[..], &self.owner[..]])
                })
                .await;
            self.shared.renewer.unregister(self.id);
            match outcome {
                Ok(1) => {
                    self.shared.count_commit();
                    Ok(ReleaseOutcome::Released)
                }
                Ok(_) => {
                    tracing::warn!(
                        backend = NAME,
                        key = %String::from_utf8_lossy(&self.name),
                        "the release found the lock taken over or removed; it was lost"
                    );
                    self.lost.cancel();
                    let clock = self.shared.clock;
                    let taken = self
                        .shared
                        .with_busy_retry("releasing a lock", RELEASE_PAUSES, |conn| {
                            let mut peek = conn.prepare_cached(PEEK_SQL)?;
                            peek.exists(params![&self.name[..], clock.now_ms(), clock.boot()])
                        })
                        .await;
                    Ok(match taken {
                        Ok(true) => ReleaseOutcome::NotOwned,
                        // The lock is lost either way; a file too busy to tell is not an error.
                        Ok(false) | Err(_) => ReleaseOutcome::AlreadyReleased,
                    })
                }
                Err(Busy::Timeout) => Err(self.shared.busy_error(
                    "releasing a lock (it frees itself when its lease runs out)",
                    Busy::Timeout,
                )),
                Err(Busy::Failed(err)) => Err(err),
            }
        })
    }

    fn lease_control(&self) -> Option<&dyn LeaseControl> {
        Some(self)
    }
}

impl LeaseControl for SqliteHeld {
    fn extend(&self, lease: Duration) -> BoxFuture<'_, Result<bool, LockError>> {
        Box::pin(async move {
            check_lease(lease)?;
            let sent = Instant::now();
            let clock = self.shared.clock;
            let changed = if self.kind == Kind::Read {
                self.shared
                    .extend_read(&self.name[..], &self.owner, lease)
                    .await
                    .map(usize::from)
            } else if self.kind == Kind::Permit {
                self.shared
                    .extend_permit(&self.name[..], &self.owner, lease)
                    .await
                    .map(usize::from)
            } else {
                self.shared
                    .with_busy_retry("extending a lease", RELEASE_PAUSES, |conn| {
                        let lease_end = clock.now_ms().saturating_add(millis(lease));
                        conn.prepare_cached(RENEW_SQL)?.execute(params![
                            &self.name[..],
                            &self.owner[..],
                            lease_end
                        ])
                    })
                    .await
            }
            .map_err(|busy| self.shared.busy_error("extending a lease", busy))?;
            if changed == 1 {
                self.shared.count_commit();
                self.shared.renewer.extended(self.id, lease, sent);
                Ok(true)
            } else {
                self.shared.renewer.lose(self.id);
                Ok(false)
            }
        })
    }

    fn verify_still_held(&self) -> BoxFuture<'_, Result<bool, LockError>> {
        Box::pin(async move {
            let clock = self.shared.clock;
            if self.kind != Kind::Lock {
                let verified = if self.kind == Kind::Read {
                    self.shared.verify_read(&self.name[..], &self.owner).await
                } else {
                    self.shared.verify_permit(&self.name[..], &self.owner).await
                };
                let held =
                    verified.map_err(|busy| self.shared.busy_error("verifying a lock", busy))?;
                if !held {
                    self.shared.renewer.lose(self.id);
                }
                return Ok(held);
            }
            let held = self
                .shared
                .with_busy_retry("verifying a lock", RELEASE_PAUSES, |conn| {
                    let mut verify = conn.prepare_cached(VERIFY_SQL)?;
                    let params = params![
                        &self.name[..],
                        &self.owner[..],
                        clock.now_ms(),
                        clock.boot()
                    ];
                    verify.query_row(params, |row| row.get::<_, i64>(0))
                })
                .await
                .map_err(|busy| self.shared.busy_error("verifying a lock", busy))?;
            if held == 0 {
                self.shared.renewer.lose(self.id);
            }
            Ok(held > 0)
        })
    }

    fn stop_renewal(&self) {
        self.shared.renewer.stop(self.id);
    }

    fn start_renewal(&self) -> Result<bool, LockError> {
        Ok(self.shared.renewer.resume(self.id))
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
    /// The release statement: frees the row, or under shared counters deletes it (the row
    /// keeps no counter then).
    fn release_sql(&self) -> &'static str {
        if self.counted.is_some() {
            counted::RELEASE_DELETE_SQL
        } else {
            RELEASE_SQL
        }
    }

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
            random_fill(&mut owners.bytes)?;
            owners.used = 0;
        }
        let at = owners.used * 16;
        let mut owner = [0u8; 16];
        owner.copy_from_slice(&owners.bytes[at..at + 16]);
        // Not used again: overwritten before the next fetch is handed out.
        owners.bytes[at..at + 16].fill(0);
        owners.used += 1;
        // The backend's id first, for its owner label (see `owners.rs`); 64 random bits stay.
        owner[..8].copy_from_slice(&self.owner_label.id);
        Ok(owner)
    }

    /// What a look at the file without its write lock found: a busy file is "not known"
    /// (`false`), for the write to tell.
    fn peeked(&self, peek: rusqlite::Result<bool>) -> Result<bool, Busy> {
        match peek {
            Ok(seen) => Ok(seen),
            Err(err) if is_busy(&err) => Ok(false),
            Err(err) => Err(Busy::Failed(sqlite_error(
                &self.path,
                "checking a lock",
                err,
            ))),
        }
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
            self.peeked(peek)
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
                if let Some(counted) = self.counted {
                    let end = now.saturating_add(millis(lease));
                    match counted.acquire(&conn, name, owner, end, now, clock.boot()) {
                        Ok(counted::CountedTake::Taken(token)) => Some(Take::Taken {
                            started,
                            fencing: Ok(token),
                            fenced: true,
                        }),
                        Ok(counted::CountedTake::Held) => Some(Take::Held),
                        Ok(counted::CountedTake::Refused) => {
                            return Err(Busy::Failed(counted.refusal(&conn)));
                        }
                        Err(err) => {
                            self.after_failed_try(err, "acquiring a lock", || held(&conn))?
                        }
                    }
                } else {
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
                                clock.boot(),
                                file::wall_now_ms()
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
                        Err(err) => {
                            self.after_failed_try(err, "acquiring a lock", || held(&conn))?
                        }
                    }
                }
            };
            drop(pass);
            if let Some(take) = attempt {
                return Ok(self.noted(name, take));
            }
            self.pause_between_tries(waiting_since, &mut pause, longest)
                .await?;
        }
    }

    /// Between two tries of one acquisition: [`Busy::Timeout`] once the busy timeout has
    /// passed since `since`; otherwise a jittered `pause`, doubled for the next time up to
    /// `longest`.
    async fn pause_between_tries(
        &self,
        since: Instant,
        pause: &mut Duration,
        longest: Duration,
    ) -> Result<(), Busy> {
        if since.elapsed() >= self.busy_timeout {
            return Err(Busy::Timeout);
        }
        let jitter = Backoff::new(*pause, *pause, 0.5).map_or(*pause, |b| b.delay(0));
        tokio::time::sleep(jitter).await;
        *pause = (*pause * 2).min(longest);
        Ok(())
    }

    /// A try's statement failed with `err`: a busy file makes the try end as held when
    /// `held` reads the key held, or be tried again (`None`); any other error ends the
    /// acquisition, as the error of `what`.
    fn after_failed_try(
        &self,
        err: rusqlite::Error,
        what: &str,
        held: impl FnOnce() -> Result<bool, Busy>,
    ) -> Result<Option<Take>, Busy> {
        if is_busy(&err) {
            Ok(held()?.then_some(Take::Held))
        } else {
            Err(Busy::Failed(sqlite_error(&self.path, what, err)))
        }
    }

    /// The end of a try for `name`: a key found held is remembered for a while (the next
    /// try reads before it writes), any other end forgets it.
    fn noted(&self, name: &[u8], take: Take) -> Take {
        if matches!(take, Take::Held) {
            self.note_held(name);
        } else {
            self.forget_held(name);
        }
        take
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

    /// The error for a statement on the lock file that could not run: the file stayed busy
    /// for the whole busy timeout, or the statement failed.
    fn busy_error(&self, what: &str, busy: Busy) -> LockError {
        match busy {
            Busy::Failed(err) => err,
            Busy::Timeout => LockError::unavailable(
                NAME,
                format!(
                    "{what}: the lock file `{}` stayed busy for the whole busy timeout ({:?})",
                    self.path.display(),
                    self.busy_timeout
                ),
                None,
            ),
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
    async fn give_back(&self, name: &[u8], owner: &[u8; 16], read: bool) {
        if read {
            if self.release_read(name, owner).await.is_err() {
                tracing::warn!(
                    backend = NAME,
                    "a read lock taken but not handed out could not be given back; it frees itself when its lease ends"
                );
            }
            return;
        }
        let outcome = self
            .with_busy_retry("giving a lock back", RELEASE_PAUSES, |conn| {
                conn.prepare_cached(self.release_sql())?
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

/// Fills `bytes` from the operating system's secure generator.
fn random_fill(bytes: &mut [u8]) -> Result<(), LockError> {
    getrandom::fill(bytes).map_err(|err| {
        LockError::backend(
            NAME,
            format!("the operating system's random generator failed: {err}"),
            None,
            None,
        )
    })
}

#[cfg(test)]
mod tests;
