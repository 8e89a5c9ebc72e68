//! Lease renewal of SQLite locks, on a thread of the backend's own.
//!
//! Renewal is blocking work (rusqlite) that must go on for as long as any lock of the backend
//! is held, whichever Tokio runtime the lock was taken on and whether or not that runtime
//! still exists. So it runs on one OS thread per backend, started by the first acquisition and
//! ending when the backend is dropped; no user runtime owns it.
//!
//! Each held lock has an entry with its place in the lease schedule (see [`crate::lease`]:
//! renewed every third of its lease, trusted for four fifths of it after the last renewal
//! began; all due locks are renewed in one transaction). An entry
//! holds its lock's lost token through a [`DropGuard`]: removing it in any way other than
//! [`Renewer::unregister`] (a renewal that found the row taken, a deadline that passed, the
//! thread ending for any reason, even a panic) fires the token.

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use rusqlite::{Connection, TransactionBehavior, params};
use tokio_util::sync::{CancellationToken, DropGuard};

use super::clock::LeaseClock;
use super::{NAME, RENEW_SQL, is_busy, millis, renew_permit, renew_reader, sqlite_error};
use crate::LockError;
use crate::lease::{LeaseDeadline, Term};
use crate::time::later;

/// How long the thread keeps looking in by itself, every [`IDLE_TICK`], after the last lock
/// was released; acquisitions in that time need not wake it. After that it sleeps until woken.
const IDLE_LINGER: Duration = Duration::from_secs(2);
const IDLE_TICK: Duration = Duration::from_millis(20);

/// Pauses between tries while another connection has the file's write lock: short, so that
/// renewals are not starved by a stream of other writers.
const BUSY_PAUSE_FIRST: Duration = Duration::from_micros(50);
const BUSY_PAUSE_MAX: Duration = Duration::from_micros(500);

/// One held lock, as the renewer sees it.
pub(super) struct Renewal {
    pub(super) name: Arc<[u8]>,
    pub(super) owner: [u8; 16],
    /// Fires the lock's lost token when dropped; disarmed by a normal release.
    lost: DropGuard,
    /// Its place in the lease schedule; the deadline is shared with the guard (see
    /// [`Renewal::deadline`]).
    term: Term,
    /// Being released: still renewed, but a renewal that finds the row free or taken leaves
    /// the verdict to the release.
    releasing: bool,
    /// What is held: a lock's row, a reader's share, a permit.
    kind: Kind,
}

/// What one held lock of the backend is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    /// A lock's row of `__distributed_locks`.
    Lock,
    /// A reader's share, in the readers' table (see `read.rs`).
    Read,
    /// A permit of a semaphore, in the permits' table (see `permits.rs`).
    Permit,
}

impl Renewal {
    /// A lock whose lease was written at `written` (taken before the lease clock was read).
    pub(super) fn new(
        name: Arc<[u8]>,
        owner: [u8; 16],
        lease: Duration,
        lost: CancellationToken,
        written: Instant,
    ) -> Renewal {
        Renewal {
            name,
            owner,
            lost: lost.drop_guard(),
            term: Term::new(lease, written, None),
            releasing: false,
            kind: Kind::Lock,
        }
    }

    /// The same lock, renewed every `cadence` (at most half its lease) instead of every third
    /// of its lease; `written` as for [`Renewal::new`].
    pub(super) fn every(mut self, cadence: Option<Duration>, written: Instant) -> Renewal {
        self.term = Term::new(self.term.lease(), written, cadence);
        self
    }

    /// The same lock, as a reader's share of its key or a permit of a semaphore.
    pub(super) fn of_kind(mut self, kind: Kind) -> Renewal {
        self.kind = kind;
        self
    }

    /// The same lock, never renewed: it expires with its lease.
    pub(super) fn unrenewed(mut self) -> Renewal {
        self.term.stop();
        self
    }

    /// The lock's local deadline, moved on by each renewal: the guard checks it itself, so a
    /// holder paused past it hears of the loss before the renewal thread runs again.
    pub(super) fn deadline(&self) -> LeaseDeadline {
        self.term.deadline()
    }
}

/// The renewals of one backend and the thread that runs them.
pub(super) struct Renewer {
    state: Arc<State>,
    /// The thread last started; joined when the backend is dropped, so that the file is
    /// closed when the last handle on the backend is gone.
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

struct State {
    registry: Mutex<Registry>,
    wake: Condvar,
    /// The connection renewals write on; only the renewal thread uses it.
    connection: Mutex<Connection>,
    clock: &'static LeaseClock,
    path: std::path::PathBuf,
}

#[derive(Default)]
struct Registry {
    /// Boxed: the map's spare room (up to half of it after it grows) costs a pointer per
    /// bucket, not a whole entry.
    renewals: HashMap<u64, Box<Renewal>>,
    next_id: u64,
    /// Whether a renewal thread is running (cleared by the thread as it ends).
    running: bool,
    /// Set when the backend is dropped: the thread ends.
    stop: bool,
    /// Set when something changed that the thread should look at.
    woken: bool,
    /// When the thread will next look at the registry by itself (`None`: only when woken).
    /// A new lock due after that needs no wake-up.
    planned: Option<Instant>,
    /// When the registry last held a lock.
    last_held: Option<Instant>,
}

impl Renewer {
    pub(super) fn new(
        connection: Connection,
        clock: &'static LeaseClock,
        path: std::path::PathBuf,
    ) -> Renewer {
        Renewer {
            state: Arc::new(State {
                registry: Mutex::new(Registry::default()),
                wake: Condvar::new(),
                connection: Mutex::new(connection),
                clock,
                path,
            }),
            thread: Mutex::new(None),
        }
    }

    /// Starts the renewal thread if none is running.
    pub(super) fn ensure_running(&self) -> Result<(), LockError> {
        let mut registry = self.state.registry();
        self.start_locked(&mut registry)
    }

    fn start_locked(&self, registry: &mut Registry) -> Result<(), LockError> {
        if registry.running {
            return Ok(());
        }
        let state = Arc::clone(&self.state);
        let (ready, started) = std::sync::mpsc::sync_channel(1);
        let thread = std::thread::Builder::new()
            .name("dlock-sqlite-renewal".to_owned())
            .spawn(move || {
                // The thread is set up (the runtime's own allocations are done): the caller
                // goes on, with nothing of the start left running beside it.
                let _ = ready.send(());
                run(&state);
            })
            .map_err(|err| {
                LockError::backend(
                    NAME,
                    format!("starting the lease renewal thread failed: {err}"),
                    None,
                    Some(Box::new(err)),
                )
            })?;
        // Never blocks long: the thread's first step is to answer (the registry is not
        // needed for that).
        let _ = started.recv();
        registry.running = true;
        // The thread replaced (if any) has ended.
        *self.thread.lock().unwrap_or_else(PoisonError::into_inner) = Some(thread);
        Ok(())
    }

    /// Adds a held lock; its renewals start at once. Errors only when no renewal thread runs
    /// and none can be started: then the caller must give the lock back.
    pub(super) fn register(&self, renewal: Renewal) -> Result<u64, LockError> {
        let mut registry = self.state.registry();
        self.start_locked(&mut registry)?;
        registry.next_id += 1;
        let id = registry.next_id;
        let looks_in_time = registry
            .planned
            .is_some_and(|planned| planned <= renewal.term.wake_at());
        registry.renewals.insert(id, Box::new(renewal));
        if !looks_in_time {
            registry.woken = true;
            drop(registry);
            self.state.wake.notify_one();
        }
        Ok(id)
    }

    /// Marks lock `id` as being released: it is renewed until [`Renewer::unregister`], but a
    /// renewal that finds its row free or taken does not fire its lost token (the release
    /// tells which it was).
    pub(super) fn releasing(&self, id: u64) {
        if let Some(renewal) = self.state.registry().renewals.get_mut(&id) {
            renewal.releasing = true;
        }
    }

    /// Stops renewing lock `id` without firing its lost token (a release, or a handle dropped
    /// whose lease will end by itself).
    pub(super) fn unregister(&self, id: u64) {
        let removed = self.state.registry().renewals.remove(&id);
        if let Some(renewal) = removed {
            renewal.lost.disarm();
        }
    }

    /// Lock `id`'s lease was set to `lease` by a statement begun at `sent`: later renewals
    /// ask for it, and the thread looks at the new schedule.
    pub(super) fn extended(&self, id: u64, lease: Duration, sent: Instant) {
        let mut registry = self.state.registry();
        if let Some(renewal) = registry.renewals.get_mut(&id) {
            renewal.term.extended(lease, sent);
            registry.woken = true;
            drop(registry);
            self.state.wake.notify_one();
        }
    }

    /// Stops renewing lock `id`; it stays registered until its deadline, when its lost token
    /// fires, or until it is released.
    pub(super) fn stop(&self, id: u64) {
        if let Some(renewal) = self.state.registry().renewals.get_mut(&id) {
            renewal.term.stop();
        }
    }

    /// Starts renewing lock `id` again, the first renewal at once: whether it is still
    /// counted on (registered, its deadline not passed).
    pub(super) fn resume(&self, id: u64) -> bool {
        let mut registry = self.state.registry();
        let resumed = registry
            .renewals
            .get_mut(&id)
            .is_some_and(|renewal| renewal.term.resume(Instant::now()));
        if resumed {
            registry.woken = true;
            drop(registry);
            self.state.wake.notify_one();
        }
        resumed
    }

    /// Lock `id` was found lost: its renewals end, and its lost token fires.
    pub(super) fn lose(&self, id: u64) {
        let removed = self.state.registry().renewals.remove(&id);
        drop(removed);
    }

    /// How many locks are being renewed.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.state.registry().renewals.len()
    }
}

impl Drop for Renewer {
    fn drop(&mut self) {
        self.state.registry().stop = true;
        self.state.wake.notify_one();
        // The thread never holds the backend, so this never runs on it; it ends within one
        // statement (it never waits inside SQLite).
        let thread = self
            .thread
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(thread) = thread
            && thread.thread().id() != std::thread::current().id()
        {
            let _ = thread.join();
        }
    }
}

impl State {
    fn registry(&self) -> MutexGuard<'_, Registry> {
        self.registry.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Registry {
    /// Drops (so fires the lost token of) every lock whose renewals kept failing until its
    /// lease may have run out.
    fn expire_overdue(&mut self, now: Instant) {
        self.renewals.retain(|_, renewal| {
            let keep = !renewal.term.is_overdue(now);
            if !keep {
                tracing::warn!(
                    backend = NAME,
                    "lease renewals kept failing until the lease may have run out; the lock is presumed lost"
                );
            }
            keep
        });
    }
}

/// Whatever ends the thread (the backend dropped, a panic), every lock it was renewing is
/// told it is lost, and the next acquisition starts a new thread.
struct Exit<'a>(&'a State);

impl Drop for Exit<'_> {
    fn drop(&mut self) {
        let mut registry = self.0.registry();
        registry.running = false;
        if !registry.renewals.is_empty() {
            tracing::warn!(
                backend = NAME,
                locks = registry.renewals.len(),
                "the lease renewal thread ended; every lock it renewed is presumed lost"
            );
        }
        registry.renewals.clear();
    }
}

/// A renewal to run: lock id, name, owner, lease, what is held.
type Due = (u64, Arc<[u8]>, [u8; 16], Duration, Kind);

fn run(state: &State) {
    let _exit = Exit(state);
    let mut registry = state.registry();
    loop {
        if registry.stop {
            return;
        }
        let now = Instant::now();
        // Awake: whatever is registered now is seen before the thread sleeps again.
        registry.planned = Some(now);
        registry.expire_overdue(now);
        if !registry.renewals.is_empty() {
            registry.last_held = Some(now);
        }
        let due: Vec<Due> = registry
            .renewals
            .iter()
            .filter(|(_, r)| r.term.is_due(now))
            .map(|(id, r)| (*id, Arc::clone(&r.name), r.owner, r.term.lease(), r.kind))
            .collect();
        if !due.is_empty() {
            drop(registry);
            renew(state, &due);
            registry = state.registry();
            continue;
        }
        let lingering = registry
            .last_held
            .is_some_and(|at| now.saturating_duration_since(at) < IDLE_LINGER);
        let wake_at = registry
            .renewals
            .values()
            .map(|r| r.term.wake_at())
            .min()
            .or_else(|| lingering.then(|| later(now, IDLE_TICK)));
        registry.planned = wake_at;
        registry.woken = false;
        registry = match wake_at {
            Some(at) => {
                state
                    .wake
                    .wait_timeout_while(registry, at.saturating_duration_since(now), |r| {
                        !r.woken && !r.stop
                    })
                    .unwrap_or_else(PoisonError::into_inner)
                    .0
            }
            None => state
                .wake
                .wait_while(registry, |r| !r.woken && !r.stop)
                .unwrap_or_else(PoisonError::into_inner),
        };
    }
}

/// Renews `due` in one transaction, trying again while other connections write the file,
/// and watching every lock's deadline meanwhile.
fn renew(state: &State, due: &[Due]) {
    let mut connection = state
        .connection
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    let mut pause = BUSY_PAUSE_FIRST;
    loop {
        let started = Instant::now();
        match renew_once(&mut connection, state.clock, due) {
            Ok(still_held) => {
                let mut registry = state.registry();
                for ((id, ..), held) in due.iter().zip(still_held) {
                    if held {
                        if let Some(renewal) = registry.renewals.get_mut(id) {
                            renewal.term.renewed(started);
                        }
                    } else if registry.renewals.get(id).is_some_and(|r| !r.releasing) {
                        registry.renewals.remove(id);
                        tracing::warn!(
                            backend = NAME,
                            "lease renewal found the lock taken over or removed; the lock is lost"
                        );
                    }
                }
                return;
            }
            Err(err) if is_busy(&err) => {
                let mut registry = state.registry();
                registry.expire_overdue(Instant::now());
                let waiting = due
                    .iter()
                    .any(|(id, ..)| registry.renewals.contains_key(id));
                if registry.stop || !waiting {
                    return;
                }
                drop(registry);
                std::thread::sleep(pause);
                pause = (pause * 2).min(BUSY_PAUSE_MAX);
            }
            Err(err) => {
                let err = sqlite_error(&state.path, "renewing a lease", err);
                tracing::warn!(backend = NAME, error = %err, "lease renewal failed; retrying");
                let mut registry = state.registry();
                for (id, ..) in due {
                    if let Some(renewal) = registry.renewals.get_mut(id) {
                        renewal.term.failed(started);
                    }
                }
                return;
            }
        }
    }
}

fn renew_once(
    connection: &mut Connection,
    clock: &LeaseClock,
    due: &[Due],
) -> rusqlite::Result<Vec<bool>> {
    let tx = connection.transaction_with_behavior(TransactionBehavior::Immediate)?;
    let now = clock.now_ms();
    let mut still_held = Vec::with_capacity(due.len());
    {
        let mut statement = tx.prepare_cached(RENEW_SQL)?;
        for (_, name, owner, lease, kind) in due {
            match kind {
                Kind::Read => {
                    still_held.push(renew_reader(&tx, clock, name, owner, *lease)?);
                    continue;
                }
                Kind::Permit => {
                    still_held.push(renew_permit(&tx, clock, name, owner, *lease)?);
                    continue;
                }
                Kind::Lock => {}
            }
            let changed = statement.execute(params![
                &name[..],
                &owner[..],
                now.saturating_add(millis(*lease))
            ])?;
            still_held.push(changed == 1);
        }
    }
    tx.commit()?;
    Ok(still_held)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn renewer(dir: &tempfile::TempDir) -> Renewer {
        let clock = LeaseClock::get().unwrap();
        let path = dir.path().join("r.db");
        let connection = super::super::open_connection(&path, Duration::ZERO, clock).unwrap();
        Renewer::new(connection, clock, path)
    }

    fn wait_for(token: &CancellationToken, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        while !token.is_cancelled() {
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        true
    }

    /// The thread ending (here: its backend dropped while locks are registered) fires the
    /// lost token of every lock it renewed.
    #[test]
    fn the_end_of_the_thread_fires_every_lost_token() {
        let dir = tempfile::tempdir().unwrap();
        let renewer = renewer(&dir);
        let tokens: Vec<CancellationToken> = (0..3).map(|_| CancellationToken::new()).collect();
        for (i, token) in tokens.iter().enumerate() {
            renewer
                .register(Renewal::new(
                    Arc::from(format!("k{i}").as_bytes()),
                    [i as u8; 16],
                    Duration::from_secs(30),
                    token.clone(),
                    Instant::now(),
                ))
                .unwrap();
        }
        assert_eq!(renewer.len(), 3);
        assert!(tokens.iter().all(|t| !t.is_cancelled()));
        drop(renewer);
        assert!(tokens.iter().all(CancellationToken::is_cancelled));
    }

    /// When the thread has ended (here: stopped by hand, as a panic would end it), the locks
    /// it renewed are told, and the next lock registered starts a new thread that renews it.
    #[test]
    fn a_new_thread_renews_after_the_old_one_ended() {
        let dir = tempfile::tempdir().unwrap();
        let renewer = renewer(&dir);
        let clock = LeaseClock::get().unwrap();
        let before = CancellationToken::new();
        renewer
            .register(Renewal::new(
                Arc::from(&b"before"[..]),
                [1; 16],
                Duration::from_secs(30),
                before.clone(),
                Instant::now(),
            ))
            .unwrap();
        // End the thread without dropping the renewer.
        renewer.state.registry().stop = true;
        renewer.state.wake.notify_one();
        let thread = renewer.thread.lock().unwrap().take().unwrap();
        thread.join().unwrap();
        assert!(
            before.is_cancelled(),
            "the end of the thread fired the token"
        );
        renewer.state.registry().stop = false;

        // A held row, and its lock registered: a new thread renews it.
        let conn = Connection::open(dir.path().join("r.db")).unwrap();
        let lease_end = |conn: &Connection| -> i64 {
            conn.query_row(
                "SELECT lease_end FROM __distributed_locks WHERE name = X'6166746572'",
                [],
                |r| r.get(0),
            )
            .unwrap()
        };
        conn.execute(
            "INSERT INTO __distributed_locks (name, owner, lease_end, fencing, boot) \
             VALUES (X'6166746572', ?1, ?2, 1, ?3)",
            params![&[2u8; 16][..], clock.now_ms() + 300, clock.boot()],
        )
        .unwrap();
        let first = lease_end(&conn);
        let after = CancellationToken::new();
        renewer
            .register(Renewal::new(
                Arc::from(&b"after"[..]),
                [2; 16],
                Duration::from_millis(300),
                after.clone(),
                Instant::now(),
            ))
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        while lease_end(&conn) <= first {
            assert!(Instant::now() < deadline, "no renewal after the restart");
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(!after.is_cancelled());
    }

    /// A release (unregister) does not fire the token; a deadline that passes does.
    #[test]
    fn unregister_is_quiet_and_deadlines_fire() {
        let dir = tempfile::tempdir().unwrap();
        let renewer = renewer(&dir);
        let released = CancellationToken::new();
        let id = renewer
            .register(Renewal::new(
                Arc::from(&b"released"[..]),
                [1; 16],
                Duration::from_secs(30),
                released.clone(),
                Instant::now(),
            ))
            .unwrap();
        renewer.unregister(id);
        // Written long ago: its deadline has passed, and the row does not exist either.
        let overdue = CancellationToken::new();
        let long_ago = Instant::now()
            .checked_sub(Duration::from_secs(10))
            .unwrap_or_else(Instant::now);
        renewer
            .register(Renewal::new(
                Arc::from(&b"overdue"[..]),
                [2; 16],
                Duration::from_secs(1),
                overdue.clone(),
                long_ago,
            ))
            .unwrap();
        assert!(wait_for(&overdue, Duration::from_secs(5)));
        assert_eq!(renewer.len(), 0);
        drop(renewer);
        assert!(!released.is_cancelled(), "a release is not a loss");
    }

    #[test]
    fn renewals_are_due_every_third_and_trusted_for_four_fifths_of_the_lease() {
        let written = Instant::now();
        let renewal = Renewal::new(
            Arc::from(&b"k"[..]),
            [1; 16],
            Duration::from_secs(3),
            CancellationToken::new(),
            written,
        );
        assert_eq!(renewal.term.next(), written + Duration::from_secs(1));
        assert_eq!(
            renewal.deadline().at(),
            written + Duration::from_millis(2400)
        );
        assert!(!renewal.releasing);
        renewal.lost.disarm();
    }

    fn insert_row(conn: &Connection, name: &[u8], owner: [u8; 16]) {
        let clock = LeaseClock::get().unwrap();
        conn.execute(
            "INSERT INTO __distributed_locks (name, owner, lease_end, fencing, boot) \
             VALUES (?1, ?2, ?3, 1, ?4)",
            params![name, &owner[..], clock.now_ms() + 30_000, clock.boot()],
        )
        .unwrap();
    }

    fn lease_end(conn: &Connection, name: &[u8]) -> i64 {
        conn.query_row(
            "SELECT lease_end FROM __distributed_locks WHERE name = ?1",
            [name],
            |r| r.get(0),
        )
        .unwrap()
    }

    /// A renewal that finds the row held by another owner fires the lost token, unless the
    /// lock is being released (the release tells then).
    #[test]
    fn a_renewal_that_finds_the_row_taken_fires_the_token_unless_releasing() {
        let dir = tempfile::tempdir().unwrap();
        let renewer = renewer(&dir);
        let conn = Connection::open(dir.path().join("r.db")).unwrap();
        insert_row(&conn, b"taken", [7; 16]);
        insert_row(&conn, b"releasing", [7; 16]);
        insert_row(&conn, b"mine", [3; 16]);
        let lease = Duration::from_secs(30);
        // Due now (written a third of the lease ago), trusted for a while yet.
        let written = Instant::now() - Duration::from_secs(11);
        let register = |name: &[u8], owner: [u8; 16], written: Instant| {
            let token = CancellationToken::new();
            let id = renewer
                .register(Renewal::new(
                    Arc::from(name),
                    owner,
                    lease,
                    token.clone(),
                    written,
                ))
                .unwrap();
            (id, token)
        };
        let (_, taken) = register(b"taken", [1; 16], written);
        assert!(wait_for(&taken, Duration::from_secs(5)));

        // Not due yet: marked as releasing first, then made due with a lock of its own.
        let (releasing_id, releasing) = register(b"releasing", [1; 16], Instant::now());
        renewer.releasing(releasing_id);
        let first = lease_end(&conn, b"mine");
        std::thread::sleep(Duration::from_millis(5));
        {
            let mut registry = renewer.state.registry();
            registry
                .renewals
                .get_mut(&releasing_id)
                .unwrap()
                .term
                .set_next(written);
            registry.woken = true;
        }
        let (mine_id, mine) = register(b"mine", [3; 16], written);
        let deadline = Instant::now() + Duration::from_secs(5);
        while lease_end(&conn, b"mine") <= first {
            assert!(Instant::now() < deadline, "no renewal");
            std::thread::sleep(Duration::from_millis(2));
        }
        assert!(!releasing.is_cancelled());
        assert!(!mine.is_cancelled());
        assert_eq!(renewer.len(), 2);
        // The renewed lock is due again a third of the lease after the renewal began.
        let next = renewer.state.registry().renewals[&mine_id].term.next();
        assert!(next > Instant::now() + Duration::from_secs(9), "{next:?}");
        renewer.unregister(releasing_id);
        renewer.unregister(mine_id);
        assert_eq!(renewer.len(), 0);
    }

    /// While another connection keeps the file's write lock, renewals keep trying until the
    /// lock's deadline, and then it is lost.
    #[test]
    fn renewals_kept_from_the_file_past_the_deadline_lose_the_lock() {
        let dir = tempfile::tempdir().unwrap();
        let renewer = renewer(&dir);
        let mut conn = Connection::open(dir.path().join("r.db")).unwrap();
        insert_row(&conn, b"k", [1; 16]);
        let tx = conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .unwrap();
        let lost = CancellationToken::new();
        // Due at once, trusted for 300 ms more.
        let written = Instant::now() - Duration::from_millis(500);
        renewer
            .register(Renewal::new(
                Arc::from(&b"k"[..]),
                [1; 16],
                Duration::from_secs(1),
                lost.clone(),
                written,
            ))
            .unwrap();
        assert!(wait_for(&lost, Duration::from_secs(5)));
        assert!(written.elapsed() >= Duration::from_millis(800));
        assert_eq!(renewer.len(), 0);
        drop(tx);
    }

    /// `ensure_running` starts the thread (an acquisition calls it before it writes its row),
    /// and starts no second one while it runs.
    #[test]
    fn ensure_running_starts_the_thread_once() {
        let dir = tempfile::tempdir().unwrap();
        let renewer = renewer(&dir);
        assert!(!renewer.state.registry().running);
        renewer.ensure_running().unwrap();
        assert!(renewer.state.registry().running);
        let first = renewer
            .thread
            .lock()
            .unwrap()
            .as_ref()
            .unwrap()
            .thread()
            .id();
        renewer.ensure_running().unwrap();
        let again = renewer
            .thread
            .lock()
            .unwrap()
            .as_ref()
            .unwrap()
            .thread()
            .id();
        assert_eq!(first, again);
    }

    /// Waits until `condition` holds of the registry; panics with `what` after `limit`.
    fn until(
        renewer: &Renewer,
        what: &str,
        limit: Duration,
        condition: impl Fn(&Registry) -> bool,
    ) {
        let end = Instant::now() + limit;
        while !condition(&renewer.state.registry()) {
            assert!(Instant::now() < end, "timed out waiting until {what}");
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// After the last lock is released the thread keeps looking in by itself every tick for
    /// `IDLE_LINGER`, then sleeps until woken.
    #[test]
    fn the_thread_lingers_after_the_last_release_then_sleeps() {
        let dir = tempfile::tempdir().unwrap();
        let renewer = renewer(&dir);
        let conn = Connection::open(dir.path().join("r.db")).unwrap();
        insert_row(&conn, b"k", [1; 16]);
        // Renewed every 100 ms: the thread looks in often while it is held.
        let id = renewer
            .register(Renewal::new(
                Arc::from(&b"k"[..]),
                [1; 16],
                Duration::from_millis(300),
                CancellationToken::new(),
                Instant::now(),
            ))
            .unwrap();
        until(
            &renewer,
            "the thread holds the lock",
            Duration::from_secs(5),
            |r| r.last_held.is_some(),
        );
        renewer.unregister(id);
        let released = Instant::now();
        // Lingering: it plans to look again a tick from each look.
        until(&renewer, "the thread ticks", Duration::from_secs(5), |r| {
            r.last_held.is_some_and(|held| held < released)
                && r.planned
                    .is_some_and(|at| at > released && at <= later(Instant::now(), IDLE_TICK))
                && r.renewals.is_empty()
        });
        let ticking = Instant::now();
        assert!(
            ticking < later(released, Duration::from_millis(1500)),
            "ticks at once"
        );
        until(&renewer, "the thread sleeps", Duration::from_secs(5), |r| {
            r.planned.is_none()
        });
        let slept = Instant::now();
        assert!(
            slept >= later(released, IDLE_LINGER - Duration::from_millis(150)),
            "lingers for IDLE_LINGER: slept {:?} after the release",
            slept - released
        );
        // Asleep, it is woken by a new lock, and renews it.
        let lost = CancellationToken::new();
        let written = Instant::now();
        renewer
            .register(Renewal::new(
                Arc::from(&b"k"[..]),
                [1; 16],
                Duration::from_millis(300),
                lost.clone(),
                written,
            ))
            .unwrap();
        until(
            &renewer,
            "the new lock is seen",
            Duration::from_secs(5),
            |r| r.planned.is_some(),
        );
    }

    /// Dropping the backend ends the thread promptly even while another connection keeps the
    /// file's write lock and a renewal waits for it; the locks are then lost.
    #[test]
    fn a_renewer_dropped_while_the_file_is_busy_ends_its_thread() {
        let dir = tempfile::tempdir().unwrap();
        let renewer = renewer(&dir);
        let mut conn = Connection::open(dir.path().join("r.db")).unwrap();
        insert_row(&conn, b"k", [1; 16]);
        let tx = conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .unwrap();
        let lost = CancellationToken::new();
        // Due at once, trusted for 13 s more.
        let written = Instant::now() - Duration::from_secs(11);
        renewer
            .register(Renewal::new(
                Arc::from(&b"k"[..]),
                [1; 16],
                Duration::from_secs(30),
                lost.clone(),
                written,
            ))
            .unwrap();
        // The renewal holds the connection while it waits for the file.
        let end = Instant::now() + Duration::from_secs(5);
        while renewer.state.connection.try_lock().is_ok() {
            assert!(Instant::now() < end, "no renewal started");
            std::thread::sleep(Duration::from_millis(1));
        }
        let (done, dropped) = std::sync::mpsc::channel();
        let dropping = std::thread::spawn(move || {
            drop(renewer);
            let _ = done.send(());
        });
        let ended = dropped.recv_timeout(Duration::from_secs(3));
        drop(tx);
        dropping.join().unwrap();
        assert!(ended.is_ok(), "the drop waited for the file");
        assert!(lost.is_cancelled());
    }

    /// While another connection holds the file's write lock for a moment, the renewal waits
    /// and succeeds once it is free, well before the lock's deadline.
    #[test]
    fn a_renewal_waits_out_a_busy_file() {
        let dir = tempfile::tempdir().unwrap();
        let renewer = renewer(&dir);
        let mut conn = Connection::open(dir.path().join("r.db")).unwrap();
        insert_row(&conn, b"k", [1; 16]);
        let first = lease_end(&conn, b"k");
        let tx = conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .unwrap();
        let lost = CancellationToken::new();
        let written = Instant::now() - Duration::from_secs(11);
        let id = renewer
            .register(Renewal::new(
                Arc::from(&b"k"[..]),
                [1; 16],
                Duration::from_secs(30),
                lost.clone(),
                written,
            ))
            .unwrap();
        let end = Instant::now() + Duration::from_secs(5);
        while renewer.state.connection.try_lock().is_ok() {
            assert!(Instant::now() < end, "no renewal started");
            std::thread::sleep(Duration::from_millis(1));
        }
        std::thread::sleep(Duration::from_millis(50));
        drop(tx);
        let end = Instant::now() + Duration::from_secs(5);
        while lease_end(&conn, b"k") <= first {
            assert!(Instant::now() < end, "no renewal after the file was freed");
            std::thread::sleep(Duration::from_millis(2));
        }
        assert!(!lost.is_cancelled());
        renewer.unregister(id);
    }
}
