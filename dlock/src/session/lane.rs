//! Lanes: the multiplexed lock connections. Each lane is one session behind an async mutex;
//! an acquisition runs its statement on its own task, holding the mutex, so the uncontended
//! path hands nothing to another task.
//!
//! What is cut off must not strand a lock: every operation is a [`Finish`], which, dropped
//! after it started, runs the rest of its work on a task of its own (a try granted after its
//! caller left gives the lock back). A statement dropped half-way (its runtime shut down)
//! leaves the session's state unknown, so the session is dropped ([`Busy`]). A keeper task,
//! on the runtime the session was opened on, checks the session every keepalive and reports
//! its locks lost if that runtime stops. An idle lane used steadily from another runtime moves
//! its session there ([`REHOME_AFTER`]), so that its answers wake no other thread.

use std::collections::HashMap;
use std::fmt::Debug;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, PoisonError, Weak};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::runtime::Handle;
use tokio::sync::{Mutex, OwnedMutexGuard};
use tokio_util::sync::CancellationToken;

use super::acquire::lane_gone;
use super::claims::{Claim, SETTLE_LIMIT};
use super::options::LaneSettings;
use super::traits::{Connector, Grant, InterruptOf, Mode, PermitAnswer, Session};
use crate::backend::{BoxFuture, HeldLock};
use crate::{LockError, detach};

// Lanes.

/// How many tries in a row from a runtime other than its session's move an idle lane's
/// session to that runtime (see [`LaneState::come_home`]). Opening a connection costs
/// milliseconds, a statement whose answer crosses threads some tens of microseconds more than
/// one that does not: a lane used steadily from another runtime moves after this many, and
/// one shared by runtimes taking turns, or used once from elsewhere, stays.
pub(super) const REHOME_AFTER: u32 = 64;

/// A handle to one lane; clones share it.
pub(super) struct Lane<C: Connector> {
    core: Arc<Core<C>>,
}

impl<C: Connector> Clone for Lane<C> {
    fn clone(&self) -> Self {
        Lane {
            core: Arc::clone(&self.core),
        }
    }
}

struct Core<C: Connector> {
    state: Arc<Mutex<LaneState<C>>>,
    /// The runtime the lane's latest session was opened on: work that outlives its caller
    /// runs there when the caller's thread is in no runtime.
    runtime: std::sync::Mutex<Option<Handle>>,
}

/// A lock or a permit a lane holds.
pub(super) struct LaneLock<C: Connector> {
    kept: Kept<C>,
    lost: CancellationToken,
}

/// What a lane holds for one handle.
enum Kept<C: Connector> {
    /// A lock of `resource` in `mode`.
    Lock {
        resource: C::Resource,
        mode: Mode,
        /// Dropped after the lock is given back (or its session is gone).
        _claim: Claim<C::Resource>,
    },
    /// A permit of a semaphore. It needs no claim: the session's try skips the slots the
    /// session holds already, so no two handles of a lane ever hold one slot.
    Permit(PermitOf<C>),
}

type PermitOf<C> = <<C as Connector>::Session as Session>::Permit;

/// What a lane's statement asks the server: one try for a lock, or for a permit.
enum Ask<'a, C: Connector> {
    Lock(&'a C::Resource, Mode),
    Permit(&'a C::Semaphore, bool),
}

impl<C: Connector> Clone for Ask<'_, C> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<C: Connector> Copy for Ask<'_, C> {}

/// What the server answered an [`Ask`].
enum Answer<C: Connector> {
    Lock(Option<Grant>),
    Permit(PermitAnswer<PermitOf<C>>),
}

pub(super) struct LaneState<C: Connector> {
    connector: Arc<C>,
    /// The lane itself, for the keeper of each session it opens.
    core: Weak<Core<C>>,
    keepalive: Duration,
    /// The most a lock or unlock statement may take before the session is presumed dead
    /// (`statement_timeout`; pings have [`Connector::PING_TIMEOUT`]).
    statement_timeout: Duration,
    session: Option<C::Session>,
    /// The runtime whose reactor drives the session's socket (the one it was opened on).
    home: Option<tokio::runtime::Id>,
    /// How many tries in a row ran from a runtime other than `home` (see [`REHOME_AFTER`]).
    away: u32,
    /// Counts the sessions opened: a keeper looks after the one it was started for.
    generation: u64,
    held: HashMap<u64, LaneLock<C>>,
    /// The resources the session holds shared: how many read locks share each, and the
    /// fencing token the server issued with the shared lock.
    shares: HashMap<C::Resource, Share>,
}

/// A shared lock of a lane's session, and the read locks that share it.
#[derive(Debug, Clone, Copy)]
struct Share {
    count: usize,
    grant: Grant,
}

impl<C: Connector> Lane<C> {
    /// A lane with `session` (or opening one when first needed). Runs inside a Tokio runtime,
    /// where a given session's keeper starts.
    pub(super) fn start(
        connector: &Arc<C>,
        settings: &LaneSettings,
        session: Option<C::Session>,
    ) -> Self {
        let core = Arc::new_cyclic(|weak| Core {
            state: Arc::new(Mutex::new(LaneState {
                connector: Arc::clone(connector),
                core: Weak::clone(weak),
                keepalive: settings.keepalive,
                statement_timeout: settings.statement_timeout,
                session: None,
                home: None,
                away: 0,
                generation: 0,
                held: HashMap::new(),
                shares: HashMap::new(),
            })),
            runtime: std::sync::Mutex::new(Handle::try_current().ok()),
        });
        if let Some(session) = session
            && let Ok(mut state) = core.state.try_lock()
        {
            state.adopt(session);
        }
        Lane { core }
    }

    /// How many locks the lane holds, if no work runs on it at this moment (a hint: work may
    /// start the next moment).
    pub(super) fn idle_holding(&self) -> Option<usize> {
        self.core
            .state
            .try_lock()
            .ok()
            .map(|state| state.held.len())
    }

    /// Runs `work` on the lane's state, as a [`Finish`]. `eager`: dropped before its first
    /// poll, the work still runs (an unlock, an interrupt).
    fn run<T, F>(&self, eager: bool, work: F) -> Finish<T>
    where
        T: Send + 'static,
        F: for<'a> FnOnce(&'a mut LaneState<C>, Arc<AtomicBool>) -> BoxFuture<'a, T>
            + Send
            + 'static,
    {
        let state = Arc::clone(&self.core.state);
        let abandoned = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&abandoned);
        let work = Box::pin(async move {
            let mut busy = Busy::lock(state).await;
            let out = work(&mut busy.state, flag).await;
            busy.done();
            out
        });
        Finish {
            work: Some(work),
            started: eager,
            abandoned,
            runtime: self
                .core
                .runtime
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clone(),
        }
    }

    /// One try; on success the lock is pinned to this lane under `handle`. A shared try of a
    /// resource this lane holds shared already is granted without asking the server (the
    /// session holds the resource once, however many read locks share it). Dropped after it
    /// started, the try still ends, and a lock it got is given back.
    pub(super) fn try_lock(
        &self,
        resource: C::Resource,
        mode: Mode,
        claim: Claim<C::Resource>,
        handle: u64,
        lost: CancellationToken,
    ) -> Finish<Result<Option<Grant>, LockError>> {
        self.run(false, move |state, abandoned| {
            Box::pin(state.try_for(resource, mode, claim, handle, lost, abandoned))
        })
    }

    /// One try for a permit of `semaphore` (a single try, or one of a waiting acquisition:
    /// `waiting`); a permit it gets is pinned to this lane under `handle`. Dropped after it
    /// started, the try still ends, and a permit it got is given back.
    pub(super) fn try_permit(
        &self,
        semaphore: C::Semaphore,
        waiting: bool,
        handle: u64,
        lost: CancellationToken,
    ) -> Finish<Result<PermitAnswer<()>, LockError>> {
        self.run(false, move |state, abandoned| {
            Box::pin(state.try_permit_for(semaphore, waiting, handle, lost, abandoned))
        })
    }

    /// How many permits of `semaphore` are live, by any session.
    pub(super) fn count_permits(
        &self,
        semaphore: C::Semaphore,
    ) -> Finish<Result<super::traits::PermitCount, LockError>> {
        self.run(false, move |state, _| {
            Box::pin(async move {
                let bound = state.statement_timeout;
                let session = state.session().await?;
                match tokio::time::timeout(bound, session.count_permits(&semaphore)).await {
                    Ok(Ok(count)) => Ok(count),
                    Ok(Err(failure)) => {
                        if !failure.connection_ok {
                            state.die("the lock connection failed");
                        }
                        Err(failure.error)
                    }
                    Err(_) => {
                        state.die("the lock connection stopped answering");
                        Err(timed_out::<C>(bound))
                    }
                }
            })
        })
    }

    /// Gives back the lock `handle` (if this lane still holds it); runs even if dropped.
    pub(super) fn unlock(&self, handle: u64) -> Finish<()> {
        self.run(true, move |state, _| Box::pin(state.unlock(handle)))
    }

    /// Runs an abandoned wait's interrupt request; runs even if dropped.
    pub(super) fn interrupt(&self, request: InterruptOf<C>) -> Finish<()> {
        self.run(true, move |state, _| Box::pin(state.interrupt(request)))
    }

    /// A health check: the lane's session answers a ping. A session that died (a server
    /// restart, a killed session) is replaced once: the ping answers for the store, and the
    /// locks of the dead session have just been reported lost.
    pub(super) fn ping(&self) -> Finish<Result<(), LockError>> {
        self.run(false, |state, _| {
            Box::pin(async move {
                let reused = state.session.is_some();
                let outcome = state.ping().await;
                if outcome.is_err() && reused {
                    return state.ping().await;
                }
                outcome
            })
        })
    }
}

/// A lane's state, locked for one piece of work. Dropped before the work is done (its task
/// stopped mid-statement), the session's state is unknown: the session is dropped, and its
/// locks reported lost.
struct Busy<C: Connector> {
    state: OwnedMutexGuard<LaneState<C>>,
    done: bool,
}

impl<C: Connector> Busy<C> {
    async fn lock(state: Arc<Mutex<LaneState<C>>>) -> Self {
        Busy {
            state: state.lock_owned().await,
            done: false,
        }
    }

    /// The work ended: the session's state is known again.
    fn done(mut self) {
        self.done = true;
    }
}

impl<C: Connector> Drop for Busy<C> {
    fn drop(&mut self) {
        if !self.done {
            self.state
                .die("a lock statement was cut off (its task stopped)");
        }
    }
}

/// Work on a lane that finishes even when its caller stops waiting: dropped after it started
/// (or, `eager`, at any time), the rest runs on a task of the current runtime (or, if that one
/// is shutting down or there is none, the lane's).
pub(super) struct Finish<T: Send + 'static> {
    work: Option<BoxFuture<'static, T>>,
    started: bool,
    /// Set when the caller left: the work gives back what it gets from then on.
    abandoned: Arc<AtomicBool>,
    runtime: Option<Handle>,
}

impl<T: Send + 'static> Future for Finish<T> {
    type Output = T;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        let this = &mut *self;
        let Some(work) = this.work.as_mut() else {
            // Polled after it finished: nothing more comes.
            return Poll::Pending;
        };
        this.started = true;
        match work.as_mut().poll(cx) {
            Poll::Ready(out) => {
                this.work = None;
                Poll::Ready(out)
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<T: Send + 'static> Drop for Finish<T> {
    fn drop(&mut self) {
        let Some(work) = self.work.take() else {
            return;
        };
        if !self.started {
            return;
        }
        self.abandoned.store(true, Ordering::SeqCst);
        let rest = async move {
            drop(work.await);
        };
        // The current runtime, else the lane's: a finish dropped by its runtime's shutdown
        // (a guard held on a runtime that is being dropped) is refused there, and runs on the
        // runtime of the lane's session. Refused by both, the work is dropped, and with it its
        // session if the work was mid-statement ([`Busy`]); a lane whose runtime has stopped
        // has dropped its session already ([`Keeper`]).
        let current = Handle::try_current().ok();
        drop(detach::spawn_first(
            current.into_iter().chain(self.runtime.take()),
            rest,
        ));
    }
}

/// Checks the session of one generation every keepalive, on the runtime that session was
/// opened on; dropped with that runtime, it drops the session and reports its locks lost.
struct Keeper<C: Connector> {
    core: Weak<Core<C>>,
    generation: u64,
}

impl<C: Connector> Keeper<C> {
    async fn run(self, keepalive: Duration) {
        loop {
            tokio::time::sleep(keepalive).await;
            let Some(core) = self.core.upgrade() else {
                return;
            };
            let state = Arc::clone(&core.state);
            drop(core);
            let mut busy = Busy::lock(state).await;
            if busy.state.generation != self.generation {
                // A newer session has a keeper of its own.
                busy.done();
                return;
            }
            busy.state.check().await;
            busy.done();
        }
    }
}

impl<C: Connector> Drop for Keeper<C> {
    fn drop(&mut self) {
        let Some(core) = self.core.upgrade() else {
            return;
        };
        // A keeper stops early only with its runtime, whose reactor drives the session's
        // socket. (Work in flight on that runtime holds the state; it stops too, and drops
        // the session itself.)
        if let Ok(mut state) = core.state.try_lock()
            && state.generation == self.generation
            && state.session.is_some()
        {
            state.die("the lock connection's runtime stopped (was its Tokio runtime dropped?)");
        }
    }
}

impl<C: Connector> LaneState<C> {
    /// Takes `session` as the lane's, with a keeper on the current runtime.
    fn adopt(&mut self, session: C::Session) {
        self.session = Some(session);
        self.home = Handle::try_current().ok().map(|runtime| runtime.id());
        self.away = 0;
        self.generation += 1;
        let keeper = Keeper {
            core: Weak::clone(&self.core),
            generation: self.generation,
        };
        if let Ok(runtime) = Handle::try_current() {
            if let Some(core) = self.core.upgrade() {
                *core.runtime.lock().unwrap_or_else(PoisonError::into_inner) =
                    Some(runtime.clone());
            }
            drop(runtime.spawn(keeper.run(self.keepalive)));
        }
    }

    async fn try_for(
        &mut self,
        resource: C::Resource,
        mode: Mode,
        claim: Claim<C::Resource>,
        handle: u64,
        lost: CancellationToken,
        abandoned: Arc<AtomicBool>,
    ) -> Result<Option<Grant>, LockError> {
        if abandoned.load(Ordering::SeqCst) {
            // Its caller left before the try reached the server.
            return Ok(None);
        }
        let joined = match self.shares.get_mut(&resource) {
            Some(share) if mode.is_shared() && self.session.is_some() => {
                share.count += 1;
                Some(share.grant)
            }
            _ => None,
        };
        let outcome = match joined {
            Some(grant) => Ok(Some(grant)),
            None => {
                let tried = self.try_lock(&resource, mode).await;
                if let (Ok(Some(grant)), Mode::Shared) = (&tried, mode) {
                    self.shares.insert(
                        resource.clone(),
                        Share {
                            count: 1,
                            grant: *grant,
                        },
                    );
                }
                tried
            }
        };
        match outcome {
            Ok(Some(grant)) => {
                self.held.insert(
                    handle,
                    LaneLock {
                        kept: Kept::Lock {
                            resource,
                            mode,
                            _claim: claim,
                        },
                        lost,
                    },
                );
                if abandoned.load(Ordering::SeqCst) {
                    // Its caller left while the server granted it: give it back.
                    self.unlock(handle).await;
                    return Ok(None);
                }
                Ok(Some(grant))
            }
            other => {
                // Free the claim before answering, so a retry can claim it again.
                drop(claim);
                other
            }
        }
    }

    async fn try_permit_for(
        &mut self,
        semaphore: C::Semaphore,
        waiting: bool,
        handle: u64,
        lost: CancellationToken,
        abandoned: Arc<AtomicBool>,
    ) -> Result<PermitAnswer<()>, LockError> {
        if abandoned.load(Ordering::SeqCst) {
            // Its caller left before the try reached the server.
            return Ok(PermitAnswer::Full);
        }
        let answer = match self.ask(Ask::Permit(&semaphore, waiting)).await? {
            Answer::Permit(answer) => answer,
            Answer::Lock(_) => return Err(lane_gone::<C>()),
        };
        let forgotten = answer.forget();
        if let PermitAnswer::Granted { permit, .. } = answer {
            self.held.insert(
                handle,
                LaneLock {
                    kept: Kept::Permit(permit),
                    lost,
                },
            );
            if abandoned.load(Ordering::SeqCst) {
                // Its caller left while the server granted it: give it back.
                self.unlock(handle).await;
                return Ok(PermitAnswer::Full);
            }
        }
        Ok(forgotten)
    }

    /// Pings the lane's session (opening one if there is none). A session that fails is
    /// dropped, and the locks it held are reported lost.
    async fn ping(&mut self) -> Result<(), LockError> {
        let session = self.session().await?;
        match tokio::time::timeout(C::PING_TIMEOUT, session.ping()).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(failure)) => {
                self.die("the lock connection failed a health check");
                Err(failure.error)
            }
            Err(_) => {
                self.die("the lock connection did not answer a health check");
                Err(LockError::unavailable(
                    C::NAME,
                    format!(
                        "the server did not answer a ping within {:?}",
                        C::PING_TIMEOUT
                    ),
                    None,
                ))
            }
        }
    }

    /// Moves an idle session to the caller's runtime once the lane has served
    /// [`REHOME_AFTER`] tries in a row from it. A session's socket is driven by the reactor of
    /// the runtime it was opened on: used from another runtime, every answer is read there
    /// and handed across threads (a wake-up of the caller's thread per statement, which on a
    /// machine whose CPUs idle costs more than the round trip itself). A session that holds
    /// nothing can be replaced freely: a fresh one is opened here (a keeper with it), and the
    /// old one is dropped only once the new one is there, so a failure to open leaves the lane
    /// as it was.
    async fn come_home(&mut self) {
        if self.session.is_none() {
            return;
        }
        let Ok(here) = Handle::try_current() else {
            return;
        };
        if self.home == Some(here.id()) {
            self.away = 0;
            return;
        }
        self.away = self.away.saturating_add(1);
        if self.away < REHOME_AFTER || !self.held.is_empty() || !self.shares.is_empty() {
            return;
        }
        match self.connector.open().await {
            Ok(session) => self.adopt(session),
            // Tried again after as many tries more.
            Err(_) => self.away = 0,
        }
    }

    /// The lane's session, opening a fresh one if there is none.
    async fn session(&mut self) -> Result<&mut C::Session, LockError> {
        if self.session.is_none() {
            let session = self.connector.open().await?;
            self.adopt(session);
        }
        self.session.as_mut().ok_or_else(lane_gone::<C>)
    }

    /// One try. A session found dead is replaced once (its locks have just been reported
    /// lost), except after a statement that outlived `statement_timeout` on a session that held
    /// locks: the server may still run that session, holding what it was granted, and a retry
    /// would answer that the key is held (by the abandoned session) instead of the failure.
    async fn try_lock(
        &mut self,
        resource: &C::Resource,
        mode: Mode,
    ) -> Result<Option<Grant>, LockError> {
        match self.ask(Ask::Lock(resource, mode)).await? {
            Answer::Lock(grant) => Ok(grant),
            Answer::Permit(_) => Err(lane_gone::<C>()),
        }
    }

    /// One try for a lock or a permit.
    async fn ask(&mut self, ask: Ask<'_, C>) -> Result<Answer<C>, LockError> {
        let reused = self.session.is_some();
        // Known only before the try: a failure drains `held`.
        let idle = self.held.is_empty();
        match self.try_once(ask).await {
            Err(failed) if reused && self.session.is_none() && (idle || !failed.timed_out) => {
                self.try_once(ask).await.map_err(|failed| failed.error)
            }
            other => other.map_err(|failed| failed.error),
        }
    }

    async fn try_once(&mut self, ask: Ask<'_, C>) -> Result<Answer<C>, TryFailed> {
        let bound = self.statement_timeout;
        self.come_home().await;
        let session = self.session().await?;
        let statement = async move {
            match ask {
                Ask::Lock(resource, mode) => session
                    .lock(resource, mode, Duration::ZERO)
                    .await
                    .map(Answer::Lock),
                Ask::Permit(semaphore, waiting) => session
                    .try_permit(semaphore, waiting)
                    .await
                    .map(Answer::Permit),
            }
        };
        let outcome = tokio::time::timeout(bound, statement).await;
        match outcome {
            Ok(Ok(answer)) => Ok(answer),
            Ok(Err(failure)) => {
                if !failure.connection_ok {
                    self.die("the lock connection failed");
                }
                Err(TryFailed {
                    error: failure.error,
                    timed_out: false,
                })
            }
            Err(_) => {
                self.die("the lock connection stopped answering");
                Err(TryFailed {
                    error: timed_out::<C>(bound),
                    timed_out: true,
                })
            }
        }
    }

    async fn unlock(&mut self, handle: u64) {
        // A lock that is not in `held` went with a dead session: nothing to give back.
        let Some(lock) = self.held.remove(&handle) else {
            return;
        };
        if let Kept::Lock { resource, mode, .. } = &lock.kept
            && mode.is_shared()
            && let Some(share) = self.shares.get_mut(resource)
        {
            share.count = share.count.saturating_sub(1);
            if share.count > 0 {
                // Other read locks still share the session's shared lock.
                return;
            }
            self.shares.remove(resource);
        }
        let Some(session) = self.session.as_mut() else {
            return;
        };
        let unlock = match &lock.kept {
            Kept::Lock { resource, mode, .. } => session.unlock(resource, *mode),
            Kept::Permit(permit) => session.release_permit(permit),
        };
        match tokio::time::timeout(self.statement_timeout, unlock).await {
            Ok(Ok(())) => {}
            Ok(Err(failure)) if failure.connection_ok => {
                tracing::warn!(backend = C::NAME, error = %failure.error, "releasing a lock failed; closing its connection");
                self.die("releasing a lock failed");
            }
            // The session's state is unknown: dropping it is the one sure way to free the
            // lock on the server, and it takes this lane's other locks with it.
            _ => self.die("releasing a lock failed"),
        }
    }

    /// Runs an abandoned wait's interrupt request from this lane's session: its statements,
    /// and watching the server until the wait has settled (which the engine bounds by
    /// [`SETTLE_LIMIT`]).
    async fn interrupt(&mut self, request: InterruptOf<C>) {
        let bound = self.statement_timeout.saturating_add(SETTLE_LIMIT);
        let Ok(session) = self.session().await else {
            return;
        };
        match tokio::time::timeout(bound, session.run_interrupt(request)).await {
            Ok(Ok(())) => {}
            Ok(Err(failure)) if failure.connection_ok => {
                tracing::warn!(backend = C::NAME, error = %failure.error, "stopping an abandoned wait failed");
            }
            _ => self.die("the lock connection failed"),
        }
    }

    async fn check(&mut self) {
        let Some(session) = self.session.as_mut() else {
            return;
        };
        match tokio::time::timeout(C::PING_TIMEOUT, session.ping()).await {
            Ok(Ok(())) => {}
            _ => self.die("the lock connection failed its liveness check"),
        }
    }

    /// Drops the session and reports every lock it held as lost.
    fn die(&mut self, why: &str) {
        if !self.held.is_empty() {
            tracing::warn!(
                backend = C::NAME,
                locks = self.held.len(),
                "{why}; its locks are lost"
            );
        }
        for (_, lock) in self.held.drain() {
            lock.lost.cancel();
        }
        self.shares.clear();
        self.session = None;
    }
}

/// The error of a statement that outlived `bound` (`statement_timeout`), whose connection
/// was dropped.
fn timed_out<C: Connector>(bound: Duration) -> LockError {
    LockError::unavailable(
        C::NAME,
        format!(
            "the server did not answer a lock statement within {bound:?} \
             (statement_timeout); the connection was dropped"
        ),
        None,
    )
}

/// A failed try, and whether it failed by outliving `statement_timeout`.
struct TryFailed {
    error: LockError,
    timed_out: bool,
}

impl From<LockError> for TryFailed {
    /// A failure before any statement was sent (opening the session).
    fn from(error: LockError) -> Self {
        TryFailed {
            error,
            timed_out: false,
        }
    }
}

/// A lock pinned to a lane. Dropped without [`HeldLock::release`], it gives the lock back on a
/// task of its own.
pub(super) struct LaneHeld<C: Connector> {
    lane: Lane<C>,
    handle: u64,
    armed: bool,
}

impl<C: Connector> LaneHeld<C> {
    pub(super) fn new(lane: Lane<C>, handle: u64) -> Self {
        LaneHeld {
            lane,
            handle,
            armed: true,
        }
    }
}

impl<C: Connector> Drop for LaneHeld<C> {
    fn drop(&mut self) {
        if self.armed {
            // An unlock runs even when dropped unpolled.
            drop(self.lane.unlock(self.handle));
        }
    }
}

impl<C: Connector> Debug for LaneHeld<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LaneHeld")
            .field("backend", &C::NAME)
            .field("handle", &self.handle)
            .finish()
    }
}

impl<C: Connector> HeldLock for LaneHeld<C> {
    /// Cancel safe: the unlock runs to its end even if this future is dropped.
    fn release(mut self: Box<Self>) -> BoxFuture<'static, Result<(), LockError>> {
        self.armed = false;
        let unlock = self.lane.unlock(self.handle);
        Box::pin(async move {
            unlock.await;
            Ok(())
        })
    }
}
