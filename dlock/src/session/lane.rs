//! Lanes: the multiplexed lock connections, each one session in one task.

use std::collections::HashMap;
use std::fmt::Debug;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use super::acquire::lane_gone;
use super::claims::{Claim, SETTLE_LIMIT};
use super::options::LaneSettings;
use super::traits::{Connector, Grant, InterruptOf, Mode, Session};
use crate::LockError;
use crate::backend::{BoxFuture, HeldLock};

// Lanes.

pub(super) enum LaneCommand<C: Connector> {
    /// One try; on success the lock is pinned to this lane under `handle`. A shared try of
    /// a resource this lane holds shared already is granted without asking the server (the
    /// session holds the resource once, however many read locks share it).
    Try {
        resource: C::Resource,
        mode: Mode,
        claim: Claim<C::Resource>,
        handle: u64,
        lost: CancellationToken,
        reply: oneshot::Sender<Result<Option<Grant>, LockError>>,
    },
    /// Gives back the lock `handle` (if this lane still holds it), then acknowledges.
    Unlock {
        handle: u64,
        done: oneshot::Sender<()>,
    },
    /// Runs an abandoned wait's interrupt request, then acknowledges.
    Interrupt {
        request: InterruptOf<C>,
        done: oneshot::Sender<()>,
    },
    /// A health check: the lane's session answers a ping.
    Ping {
        reply: oneshot::Sender<Result<(), LockError>>,
    },
}

/// A lock a lane holds.
pub(super) struct LaneLock<C: Connector> {
    resource: C::Resource,
    mode: Mode,
    lost: CancellationToken,
    /// Dropped after the lock is given back (or its session is gone).
    _claim: Claim<C::Resource>,
}

pub(super) struct Lane<C: Connector> {
    connector: Arc<C>,
    keepalive: Duration,
    /// The most a lock or unlock statement may take before the session is presumed dead
    /// (`statement_timeout`; pings have [`Connector::PING_TIMEOUT`]).
    statement_timeout: Duration,
    session: Option<C::Session>,
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
    /// Starts a lane task on the current runtime (with `session`, or opening one when first
    /// needed) and returns its command channel.
    pub(super) fn spawn(
        connector: &Arc<C>,
        settings: &LaneSettings,
        session: Option<C::Session>,
    ) -> mpsc::UnboundedSender<LaneCommand<C>> {
        let (tx, rx) = mpsc::unbounded_channel();
        let lane = Lane {
            connector: Arc::clone(connector),
            keepalive: settings.keepalive,
            statement_timeout: settings.statement_timeout,
            session,
            held: HashMap::new(),
            shares: HashMap::new(),
        };
        tokio::spawn(lane.run(rx));
        tx
    }

    async fn run(mut self, mut commands: mpsc::UnboundedReceiver<LaneCommand<C>>) {
        let mut ticker = tokio::time::interval_at(
            crate::time::later_tokio(tokio::time::Instant::now(), self.keepalive),
            self.keepalive,
        );
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                command = commands.recv() => match command {
                    Some(command) => self.handle(command).await,
                    // The backend and every lock of this lane are gone.
                    None => break,
                },
                _ = ticker.tick(), if self.session.is_some() => self.check().await,
            }
        }
    }

    async fn handle(&mut self, command: LaneCommand<C>) {
        match command {
            LaneCommand::Try {
                resource,
                mode,
                claim,
                handle,
                lost,
                reply,
            } => {
                if reply.is_closed() {
                    return;
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
                                resource,
                                mode,
                                lost,
                                _claim: claim,
                            },
                        );
                        if reply.send(Ok(Some(grant))).is_err() {
                            // Abandoned while the server granted it: give it back.
                            self.unlock(handle).await;
                        }
                    }
                    other => {
                        // Free the claim before answering, so a retry can claim it again.
                        drop(claim);
                        let _ = reply.send(other);
                    }
                }
            }
            LaneCommand::Unlock { handle, done } => {
                self.unlock(handle).await;
                let _ = done.send(());
            }
            LaneCommand::Interrupt { request, done } => {
                self.interrupt(request).await;
                let _ = done.send(());
            }
            LaneCommand::Ping { reply } => {
                let reused = self.session.is_some();
                let mut outcome = self.ping().await;
                // A session that died (a server restart, a killed session) is replaced once:
                // the ping answers for the store, and the locks of the dead session have just
                // been reported lost.
                if outcome.is_err() && reused {
                    outcome = self.ping().await;
                }
                let _ = reply.send(outcome);
            }
        }
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

    /// The lane's session, opening a fresh one if there is none.
    async fn session(&mut self) -> Result<&mut C::Session, LockError> {
        if self.session.is_none() {
            self.session = Some(self.connector.open().await?);
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
        let reused = self.session.is_some();
        // Known only before the try: a failure drains `held`.
        let idle = self.held.is_empty();
        match self.try_once(resource, mode).await {
            Err(failed) if reused && self.session.is_none() && (idle || !failed.timed_out) => self
                .try_once(resource, mode)
                .await
                .map_err(|failed| failed.error),
            other => other.map_err(|failed| failed.error),
        }
    }

    async fn try_once(
        &mut self,
        resource: &C::Resource,
        mode: Mode,
    ) -> Result<Option<Grant>, TryFailed> {
        let bound = self.statement_timeout;
        let session = self.session().await?;
        let outcome =
            tokio::time::timeout(bound, session.lock(resource, mode, Duration::ZERO)).await;
        match outcome {
            Ok(Ok(granted)) => Ok(granted),
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
                    error: LockError::unavailable(
                        C::NAME,
                        format!(
                            "the server did not answer a lock statement within {bound:?} \
                             (statement_timeout); the connection was dropped"
                        ),
                        None,
                    ),
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
        if lock.mode.is_shared()
            && let Some(share) = self.shares.get_mut(&lock.resource)
        {
            share.count = share.count.saturating_sub(1);
            if share.count > 0 {
                // Other read locks still share the session's shared lock.
                return;
            }
            self.shares.remove(&lock.resource);
        }
        let Some(session) = self.session.as_mut() else {
            return;
        };
        let unlock = session.unlock(&lock.resource, lock.mode);
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

impl<C: Connector> Drop for Lane<C> {
    /// The lane's task has stopped: normally only once the backend and every lock of the lane
    /// are gone, but also when the runtime it ran on is dropped with locks still held. Its
    /// session (and with it every lock it held) ends here, so their holders must hear it.
    fn drop(&mut self) {
        if !self.held.is_empty() {
            self.die("the lock connection's task stopped (was its Tokio runtime dropped?)");
        }
    }
}

/// A lock pinned to a lane (or a try in flight that may become one). Dropped without
/// [`HeldLock::release`], it queues an unlock for its handle without waiting for it; the lane
/// runs commands in order, so that unlock comes after the try it answers.
pub(super) struct LaneHeld<C: Connector> {
    lane: mpsc::UnboundedSender<LaneCommand<C>>,
    handle: u64,
    armed: bool,
}

impl<C: Connector> LaneHeld<C> {
    pub(super) fn new(lane: mpsc::UnboundedSender<LaneCommand<C>>, handle: u64) -> Self {
        LaneHeld {
            lane,
            handle,
            armed: true,
        }
    }

    /// For a try that was not granted: nothing to give back.
    pub(super) fn disarm(mut self) {
        self.armed = false;
    }
}

impl<C: Connector> Drop for LaneHeld<C> {
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

impl<C: Connector> Debug for LaneHeld<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LaneHeld")
            .field("backend", &C::NAME)
            .field("handle", &self.handle)
            .finish()
    }
}

impl<C: Connector> HeldLock for LaneHeld<C> {
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
