//! Connection machinery shared by the session-lock backends (SQL Server, Oracle): a few
//! multiplexed lock connections ("lanes"), a bounded set of connections for native waits, and
//! liveness checks that cancel the lost token of every lock on a connection that dies.
//!
//! A backend plugs in with a [`Connector`] (opens sessions, maps keys to resources) and a
//! [`Session`] (one server connection: lock, unlock, ping). Nothing here knows SQL.
//!
//! - **Lanes** (`connections` of them) each own one session in one task. They run the tries
//!   (a lock statement with a zero wait) and keep the locks so taken; statements run one at a
//!   time per lane, never wait on the server, and are bounded by [`STATEMENT_TIMEOUT`].
//! - **Waits** run on their own sessions (at most `wait_connections` at once), because a
//!   server-side wait blocks its connection. A granted wait keeps its lock on that session
//!   until release; the session then goes back to an idle list for the next wait. When every
//!   wait session is busy, waits poll the lanes with backoff instead.
//! - A wait that is abandoned (timeout, cancel, dropped future) interrupts the server's
//!   statement where the driver can ([`Session::interrupt`]) and always drops its session,
//!   which ends whatever the session may have been granted.
//! - Sessions holding locks are pinged every `keepalive`; a failed ping, a failed statement
//!   or a statement that outlives its bound drops the session and cancels the lost token of
//!   every lock it held (the server frees a session's locks when the session ends).

use std::collections::HashMap;
use std::fmt::Debug;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use tokio::sync::{Semaphore, mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use crate::backend::{Acquired, BoxFuture, HeldLock};
use crate::{Backoff, LockError};

/// The most a lock, unlock or ping statement on a lane may take before its connection is
/// presumed dead.
pub(crate) const STATEMENT_TIMEOUT: Duration = Duration::from_secs(10);
/// The most a liveness check may take.
const PING_TIMEOUT: Duration = Duration::from_secs(2);
/// How long past the caller's timeout a wait may take to answer before it is given up.
const WAIT_GRACE: Duration = Duration::from_secs(2);

/// A failed statement: the error, and whether the session is still usable afterwards (a
/// server-side error such as a permission problem leaves it usable; an I/O error does not).
#[derive(Debug)]
pub(crate) struct Failure {
    pub(crate) error: LockError,
    pub(crate) connection_ok: bool,
}

impl Failure {
    /// A failure after which the session can still be used.
    pub(crate) fn statement(error: LockError) -> Self {
        Failure {
            error,
            connection_ok: true,
        }
    }

    /// A failure that leaves the session unusable.
    pub(crate) fn connection(error: LockError) -> Self {
        Failure {
            error,
            connection_ok: false,
        }
    }
}

/// Opens sessions and names resources for one backend.
pub(crate) trait Connector: Send + Sync + 'static {
    /// What the server locks for a key (a resource name, an integer id).
    type Resource: Clone + Send + Sync + Debug + 'static;
    /// One server connection.
    type Session: Session<Resource = Self::Resource>;

    /// The backend's name, as in `LockBackend::name`.
    const NAME: &'static str;
    /// The longest wait one lock statement is given; longer waits are split into several
    /// statements of at most this length.
    const MAX_WAIT: Duration;
    /// The granularity of the server's wait timeout (1 ms for SQL Server, 1 s for Oracle). A
    /// wait asks the server for whole units only; what is left below one unit is waited out
    /// here, followed by one last try at the deadline, so timeouts are kept exactly.
    const WAIT_RESOLUTION: Duration;

    /// The resource that `key` locks.
    fn resource(&self, key: &str) -> Self::Resource;

    /// Opens a session (bounded by the backend's connect timeout).
    fn open(&self) -> BoxFuture<'_, Result<Self::Session, LockError>>;
}

/// One server connection whose session owns the locks it takes.
pub(crate) trait Session: Send + 'static {
    /// What the server locks.
    type Resource;

    /// Asks for `resource`, waiting up to `wait` on the server (`Duration::ZERO` is one try):
    /// `Ok(true)` when granted, `Ok(false)` when it stayed held elsewhere.
    fn lock<'a>(
        &'a mut self,
        resource: &'a Self::Resource,
        wait: Duration,
    ) -> BoxFuture<'a, Result<bool, Failure>>;

    /// Gives `resource` back. A resource the session no longer holds is not an error.
    fn unlock<'a>(&'a mut self, resource: &'a Self::Resource)
    -> BoxFuture<'a, Result<(), Failure>>;

    /// A liveness check.
    fn ping(&mut self) -> BoxFuture<'_, Result<(), Failure>>;

    /// Asks the server to stop the statement in flight on this session, for a wait nobody
    /// waits for any more. Best effort; the session is dropped afterwards either way.
    fn interrupt(&self) {}
}

/// How many connections, and how often they are checked.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LaneSettings {
    pub(crate) connections: usize,
    pub(crate) wait_connections: usize,
    pub(crate) keepalive: Duration,
}

/// The most lock or wait connections a backend may be configured with.
pub(crate) const MAX_CONNECTIONS: usize = 64;

impl LaneSettings {
    /// Checks the settings, naming the option that is wrong.
    pub(crate) fn check(&self) -> Result<(), LockError> {
        if self.keepalive < Duration::from_millis(10) {
            return Err(LockError::config(format!(
                "keepalive {:?} is too short; use at least 10ms",
                self.keepalive
            )));
        }
        if !(1..=MAX_CONNECTIONS).contains(&self.connections) {
            return Err(LockError::config(format!(
                "connections must be between 1 and {MAX_CONNECTIONS}, not {}",
                self.connections
            )));
        }
        if self.wait_connections > MAX_CONNECTIONS {
            return Err(LockError::config(format!(
                "wait_connections must be between 0 and {MAX_CONNECTIONS}, not {}",
                self.wait_connections
            )));
        }
        Ok(())
    }
}

/// The shared machinery of one backend instance.
pub(crate) struct Lanes<C: Connector> {
    connector: Arc<C>,
    settings: LaneSettings,
    lanes: Vec<mpsc::UnboundedSender<LaneCommand<C::Resource>>>,
    next_lane: AtomicUsize,
    next_handle: AtomicU64,
    waits: Arc<WaitPool<C::Session>>,
}

impl<C: Connector> Lanes<C> {
    /// Opens the first lane's session (so a wrong address or password is reported at once)
    /// and starts the lane tasks. Must run inside a Tokio runtime.
    pub(crate) async fn open(connector: C, settings: LaneSettings) -> Result<Self, LockError> {
        settings.check()?;
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(LockError::config(format!(
                "the {} backend must be opened inside a Tokio runtime",
                C::NAME
            )));
        }
        let first = connector.open().await?;
        let connector = Arc::new(connector);
        let mut first = Some(first);
        let mut lanes = Vec::with_capacity(settings.connections);
        for _ in 0..settings.connections {
            let (tx, rx) = mpsc::unbounded_channel();
            let lane = Lane {
                connector: Arc::clone(&connector),
                keepalive: settings.keepalive,
                session: first.take(),
                held: HashMap::new(),
            };
            tokio::spawn(lane.run(rx));
            lanes.push(tx);
        }
        Ok(Lanes {
            connector,
            settings,
            lanes,
            next_lane: AtomicUsize::new(0),
            next_handle: AtomicU64::new(0),
            waits: Arc::new(WaitPool {
                permits: Arc::new(Semaphore::new(settings.wait_connections)),
                idle: Mutex::new(Vec::new()),
            }),
        })
    }

    /// The settings this instance runs with.
    pub(crate) fn settings(&self) -> LaneSettings {
        self.settings
    }

    fn lane(&self) -> Option<&mpsc::UnboundedSender<LaneCommand<C::Resource>>> {
        let n = self.next_lane.fetch_add(1, Ordering::Relaxed);
        let count = self.lanes.len();
        if count == 0 {
            return None;
        }
        self.lanes.get(n % count)
    }

    /// One try on a lane.
    pub(crate) async fn try_acquire(&self, key: &str) -> Result<Option<Acquired>, LockError> {
        let resource = self.connector.resource(key);
        self.try_resource(resource).await
    }

    async fn try_resource(&self, resource: C::Resource) -> Result<Option<Acquired>, LockError> {
        let lane = self.lane().ok_or_else(lane_gone::<C>)?.clone();
        let handle = self.next_handle.fetch_add(1, Ordering::Relaxed);
        let lost = CancellationToken::new();
        let (reply, answer) = oneshot::channel();
        lane.send(LaneCommand::Try {
            resource,
            handle,
            lost: lost.clone(),
            reply,
        })
        .map_err(|_| lane_gone::<C>())?;
        // Armed from here on: if this future is dropped before the answer is turned into a
        // guard (even after the lane has sent a grant), dropping `held` queues an unlock
        // behind the try, which frees whatever the try got.
        let held = LaneHeld::new(lane, handle);
        if answer.await.map_err(|_| lane_gone::<C>())?? {
            Ok(Some(Acquired::new(None, lost, Box::new(held))))
        } else {
            held.disarm();
            Ok(None)
        }
    }

    async fn poll_lanes(
        &self,
        resource: C::Resource,
        deadline: Option<Instant>,
    ) -> Result<Option<Acquired>, LockError> {
        let backoff = Backoff::default();
        let mut attempt = 0u32;
        loop {
            if let Some(acquired) = self.try_resource(resource.clone()).await? {
                return Ok(Some(acquired));
            }
            let mut pause = backoff.delay(attempt);
            attempt = attempt.saturating_add(1);
            if let Some(deadline) = deadline {
                let now = Instant::now();
                if now >= deadline {
                    return Ok(None);
                }
                pause = pause.min(deadline - now);
            }
            tokio::time::sleep(pause).await;
        }
    }

    /// Waits up to `timeout` (`Duration::MAX`: no limit): a try on a lane first, then a
    /// native wait on a wait session (or polling when none is free).
    pub(crate) async fn acquire_wait(
        &self,
        key: &str,
        timeout: Duration,
    ) -> Result<Option<Acquired>, LockError> {
        let deadline = Instant::now().checked_add(timeout);
        let resource = self.connector.resource(key);
        if let Some(acquired) = self.try_resource(resource.clone()).await? {
            return Ok(Some(acquired));
        }
        let remaining = deadline.map_or(Duration::MAX, |d| {
            d.saturating_duration_since(Instant::now())
        });
        if remaining.is_zero() {
            return Ok(None);
        }
        let Ok(permit) = Arc::clone(&self.waits.permits).try_acquire_owned() else {
            return self.poll_lanes(resource, deadline).await;
        };
        let lost = CancellationToken::new();
        let (reply, answer) = oneshot::channel();
        let task = WaitTask {
            connector: Arc::clone(&self.connector),
            resource,
            deadline,
            keepalive: self.settings.keepalive,
            pool: Arc::clone(&self.waits),
            lost: lost.clone(),
            _permit: permit,
        };
        tokio::spawn(task.run(reply));
        // If this future is dropped, the task sees the closed reply, interrupts the wait and
        // drops its session, which also ends a lock granted in the meantime.
        let answer = match remaining.checked_add(WAIT_GRACE) {
            Some(limit) => match tokio::time::timeout(limit, answer).await {
                Ok(answer) => answer,
                Err(_) => return Ok(None),
            },
            None => answer.await,
        };
        match answer.map_err(|_| lane_gone::<C>())?? {
            None => Ok(None),
            Some(release) => Ok(Some(Acquired::new(
                None,
                lost,
                Box::new(WaitHeld {
                    release: Some(release),
                }),
            ))),
        }
    }
}

impl<C: Connector> Debug for Lanes<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lanes")
            .field("backend", &C::NAME)
            .field("connections", &self.lanes.len())
            .field("wait_connections", &self.settings.wait_connections)
            .field("keepalive", &self.settings.keepalive)
            .finish()
    }
}

fn lane_gone<C: Connector>() -> LockError {
    LockError::unavailable(
        C::NAME,
        "the backend's connection task has stopped (is the Tokio runtime shutting down?)",
        None,
    )
}

// ---------------------------------------------------------------------------------------------
// Lanes.

enum LaneCommand<R> {
    Try {
        resource: R,
        handle: u64,
        lost: CancellationToken,
        reply: oneshot::Sender<Result<bool, LockError>>,
    },
    Unlock {
        handle: u64,
        done: oneshot::Sender<()>,
    },
}

struct Lane<C: Connector> {
    connector: Arc<C>,
    keepalive: Duration,
    session: Option<C::Session>,
    held: HashMap<u64, (C::Resource, CancellationToken)>,
}

impl<C: Connector> Lane<C> {
    async fn run(mut self, mut commands: mpsc::UnboundedReceiver<LaneCommand<C::Resource>>) {
        let mut ticker = tokio::time::interval(self.keepalive);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                command = commands.recv() => match command {
                    Some(command) => self.handle(command).await,
                    None => break,
                },
                _ = ticker.tick(), if self.session.is_some() => self.check().await,
            }
        }
    }

    async fn handle(&mut self, command: LaneCommand<C::Resource>) {
        match command {
            LaneCommand::Try {
                resource,
                handle,
                lost,
                reply,
            } => {
                if reply.is_closed() {
                    return;
                }
                match self.try_lock(&resource).await {
                    Ok(true) => {
                        self.held.insert(handle, (resource, lost));
                        if reply.send(Ok(true)).is_err() {
                            // Abandoned while the server granted it: give it back.
                            self.unlock(handle).await;
                        }
                    }
                    other => {
                        let _ = reply.send(other);
                    }
                }
            }
            LaneCommand::Unlock { handle, done } => {
                self.unlock(handle).await;
                let _ = done.send(());
            }
        }
    }

    /// One try. An idle session found dead (nothing held on it) is replaced once.
    async fn try_lock(&mut self, resource: &C::Resource) -> Result<bool, LockError> {
        let reused = self.session.is_some();
        match self.try_once(resource).await {
            Err(_) if reused && self.session.is_none() && self.held.is_empty() => {
                self.try_once(resource).await
            }
            other => other,
        }
    }

    async fn try_once(&mut self, resource: &C::Resource) -> Result<bool, LockError> {
        if self.session.is_none() {
            self.session = Some(self.connector.open().await?);
        }
        let Some(session) = self.session.as_mut() else {
            return Err(lane_gone::<C>());
        };
        let outcome =
            tokio::time::timeout(STATEMENT_TIMEOUT, session.lock(resource, Duration::ZERO)).await;
        match outcome {
            Ok(Ok(granted)) => Ok(granted),
            Ok(Err(failure)) => {
                if !failure.connection_ok {
                    self.die("the lock connection failed");
                }
                Err(failure.error)
            }
            Err(_) => {
                self.die("the lock connection stopped answering");
                Err(LockError::unavailable(
                    C::NAME,
                    format!(
                        "the server did not answer a lock statement within {STATEMENT_TIMEOUT:?}"
                    ),
                    None,
                ))
            }
        }
    }

    async fn unlock(&mut self, handle: u64) {
        // A lock that is not in `held` went with a dead session: nothing to give back.
        let Some((resource, _lost)) = self.held.remove(&handle) else {
            return;
        };
        let Some(session) = self.session.as_mut() else {
            return;
        };
        match tokio::time::timeout(STATEMENT_TIMEOUT, session.unlock(&resource)).await {
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

    async fn check(&mut self) {
        let Some(session) = self.session.as_mut() else {
            return;
        };
        match tokio::time::timeout(PING_TIMEOUT, session.ping()).await {
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
        for (_, (_, lost)) in self.held.drain() {
            lost.cancel();
        }
        self.session = None;
    }
}

/// A lock pinned to a lane.
/// A lock pinned to a lane (or a try in flight that may become one). Dropped without
/// [`HeldLock::release`], it queues an unlock for its handle without waiting for it; the lane
/// runs commands in order, so that unlock comes after the try it answers.
struct LaneHeld<R> {
    lane: mpsc::UnboundedSender<LaneCommand<R>>,
    handle: u64,
    armed: bool,
}

impl<R> LaneHeld<R> {
    fn new(lane: mpsc::UnboundedSender<LaneCommand<R>>, handle: u64) -> Self {
        LaneHeld {
            lane,
            handle,
            armed: true,
        }
    }

    /// For a try that was not granted: nothing to give back.
    fn disarm(mut self) {
        self.armed = false;
    }
}

impl<R> Drop for LaneHeld<R> {
    fn drop(&mut self) {
        if self.armed {
            let (done, _) = oneshot::channel();
            let _ = self.lane.send(LaneCommand::Unlock {
                handle: self.handle,
                done,
            });
        }
    }
}

impl<R> Debug for LaneHeld<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LaneHeld")
            .field("handle", &self.handle)
            .finish()
    }
}

impl<R: Send + Sync + 'static> HeldLock for LaneHeld<R> {
    fn release(mut self: Box<Self>) -> BoxFuture<'static, Result<(), LockError>> {
        self.armed = false;
        Box::pin(async move {
            let (done, acknowledged) = oneshot::channel();
            if self
                .lane
                .send(LaneCommand::Unlock {
                    handle: self.handle,
                    done,
                })
                .is_ok()
            {
                // The lane task ends only with its session, which frees the lock anyway.
                let _ = acknowledged.await;
            }
            Ok(())
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Native waits.

struct WaitPool<S> {
    /// One permit per wait session in use (waiting, or holding what its wait got).
    permits: Arc<Semaphore>,
    /// Wait sessions that hold nothing, ready for the next wait.
    idle: Mutex<Vec<S>>,
}

impl<S> WaitPool<S> {
    fn take(&self) -> Option<S> {
        self.idle
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop()
    }

    fn put(&self, session: S) {
        self.idle
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(session);
    }
}

type ReleaseSender = oneshot::Sender<oneshot::Sender<()>>;
type WaitReply = oneshot::Sender<Result<Option<ReleaseSender>, LockError>>;

struct WaitTask<C: Connector> {
    connector: Arc<C>,
    resource: C::Resource,
    deadline: Option<Instant>,
    keepalive: Duration,
    pool: Arc<WaitPool<C::Session>>,
    lost: CancellationToken,
    // Held until the session is back in the pool (or dropped).
    _permit: tokio::sync::OwnedSemaphorePermit,
}

enum Step {
    Granted,
    NotGranted,
    Abandoned,
    Failed(Failure),
}

impl<C: Connector> WaitTask<C> {
    async fn run(self, mut reply: WaitReply) {
        let mut session = match self.reuse().await {
            Some(session) => session,
            None => match self.connector.open().await {
                Ok(session) => session,
                Err(err) => {
                    let _ = reply.send(Err(err));
                    return;
                }
            },
        };
        loop {
            let chunk = match self.deadline {
                Some(deadline) => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        let _ = reply.send(Ok(None));
                        self.pool.put(session);
                        return;
                    }
                    left.min(C::MAX_WAIT)
                }
                None => C::MAX_WAIT,
            };
            let whole = round_down(chunk, C::WAIT_RESOLUTION);
            let last = whole.is_zero();
            if last {
                // Less than the server's resolution is left: wait it out, then try once more.
                tokio::select! {
                    () = tokio::time::sleep(chunk) => {}
                    () = reply.closed() => return,
                }
            }
            let step = {
                let statement = session.lock(&self.resource, whole);
                tokio::select! {
                    result = statement => match result {
                        Ok(true) => Step::Granted,
                        Ok(false) => Step::NotGranted,
                        Err(failure) => Step::Failed(failure),
                    },
                    () = reply.closed() => Step::Abandoned,
                }
            };
            match step {
                Step::Granted => break,
                Step::NotGranted if last => {
                    let _ = reply.send(Ok(None));
                    self.pool.put(session);
                    return;
                }
                Step::NotGranted => continue,
                Step::Abandoned => {
                    // Stop the server's wait where the driver can; dropping the session ends
                    // anything it was granted in the meantime.
                    session.interrupt();
                    return;
                }
                Step::Failed(failure) => {
                    let _ = reply.send(Err(failure.error));
                    if failure.connection_ok {
                        // Make sure nothing stays held, then keep the session.
                        if let Ok(Ok(())) =
                            tokio::time::timeout(STATEMENT_TIMEOUT, session.unlock(&self.resource))
                                .await
                        {
                            self.pool.put(session);
                        }
                    }
                    return;
                }
            }
        }
        let (release_tx, release_rx) = oneshot::channel();
        if reply.send(Ok(Some(release_tx))).is_err() {
            self.give_back(session).await;
            return;
        }
        self.hold(session, release_rx).await;
    }

    /// An idle wait session that still answers, if there is one.
    async fn reuse(&self) -> Option<C::Session> {
        while let Some(mut session) = self.pool.take() {
            if let Ok(Ok(())) = tokio::time::timeout(PING_TIMEOUT, session.ping()).await {
                return Some(session);
            }
        }
        None
    }

    async fn give_back(&self, mut session: C::Session) {
        if let Ok(Ok(())) =
            tokio::time::timeout(STATEMENT_TIMEOUT, session.unlock(&self.resource)).await
        {
            self.pool.put(session);
        }
        // Otherwise the session is dropped, which frees the lock on the server.
    }

    async fn hold(
        &self,
        mut session: C::Session,
        mut release: oneshot::Receiver<oneshot::Sender<()>>,
    ) {
        let mut ticker = tokio::time::interval(self.keepalive);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        ticker.tick().await;
        loop {
            tokio::select! {
                asked = &mut release => {
                    self.give_back(session).await;
                    if let Ok(done) = asked {
                        let _ = done.send(());
                    }
                    return;
                }
                _ = ticker.tick() => {
                    match tokio::time::timeout(PING_TIMEOUT, session.ping()).await {
                        Ok(Ok(())) => {}
                        _ => {
                            tracing::warn!(
                                backend = C::NAME,
                                "a wait connection failed its liveness check; its lock is lost"
                            );
                            self.lost.cancel();
                            return;
                        }
                    }
                }
            }
        }
    }
}

/// `wait` rounded down to a whole number of `unit`s.
pub(crate) fn round_down(wait: Duration, unit: Duration) -> Duration {
    let units = wait.as_nanos().checked_div(unit.as_nanos()).unwrap_or(0);
    unit.saturating_mul(u32::try_from(units).unwrap_or(u32::MAX))
}

/// A lock taken by a native wait, held by its wait task.
#[derive(Debug)]
struct WaitHeld {
    release: Option<ReleaseSender>,
}

impl HeldLock for WaitHeld {
    fn release(mut self: Box<Self>) -> BoxFuture<'static, Result<(), LockError>> {
        let release = self.release.take();
        Box::pin(async move {
            if let Some(release) = release {
                let (done, acknowledged) = oneshot::channel();
                if release.send(done).is_ok() {
                    let _ = acknowledged.await;
                }
            }
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounding_waits_down_to_the_server_resolution() {
        let second = Duration::from_secs(1);
        let milli = Duration::from_millis(1);
        assert_eq!(
            round_down(Duration::from_millis(400), second),
            Duration::ZERO
        );
        assert_eq!(round_down(Duration::from_millis(2999), second), 2 * second);
        assert_eq!(
            round_down(Duration::from_secs(32766), second),
            32766 * second
        );
        assert_eq!(round_down(Duration::from_micros(1500), milli), milli);
        assert_eq!(
            round_down(Duration::from_secs(30), milli),
            Duration::from_secs(30)
        );
        assert_eq!(
            round_down(Duration::from_micros(999), milli),
            Duration::ZERO
        );
        assert_eq!(
            round_down(Duration::from_secs(5), Duration::ZERO),
            Duration::ZERO
        );
    }
}
