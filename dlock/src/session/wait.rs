//! Native waits: a bounded set of sessions that run the server's blocking waits.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use tokio::sync::{Semaphore, oneshot};
use tokio_util::sync::CancellationToken;

use super::claims::Claim;
use super::lane::Lane;
use super::traits::{Connector, Failure, Grant, Mode, Session};
use crate::LockError;
use crate::backend::{BoxFuture, HeldLock};

/// The first and the longest pause between the tries that end a wait when less than the
/// server's wait resolution is left.
const TAIL_PAUSE: Duration = Duration::from_millis(2);
const TAIL_PAUSE_MAX: Duration = Duration::from_millis(50);

// Native waits.

pub(super) struct WaitPool<S> {
    /// One permit per wait session in use (waiting, or holding what its wait got).
    pub(super) permits: Arc<Semaphore>,
    /// Wait sessions that hold nothing, ready for the next wait, with the runtime each was
    /// opened on.
    pub(super) idle: Mutex<Vec<(S, RuntimeTie)>>,
}

impl<S> WaitPool<S> {
    /// An idle session whose runtime still runs; those whose runtime is gone are dropped.
    /// Of those, the latest one opened on the current runtime if there is one (its socket's
    /// answers then wake no other thread), else the latest one.
    pub(super) fn take(&self) -> Option<(S, RuntimeTie)> {
        let here = tokio::runtime::Handle::try_current()
            .ok()
            .map(|runtime| runtime.id());
        let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        idle.retain(|(_, tie)| tie.alive());
        let at = idle
            .iter()
            .rposition(|(_, tie)| here.is_some() && tie.runtime == here)
            .or_else(|| idle.len().checked_sub(1))?;
        Some(idle.remove(at))
    }

    pub(super) fn put(&self, session: S, tie: RuntimeTie) {
        self.idle
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push((session, tie));
    }
}

/// Whether the Tokio runtime a session was opened on still runs. The session's socket is
/// driven by that runtime: once it has shut down, the socket's next wait for readiness fails
/// ("A Tokio 1.x context was found, but it is being shutdown"), although a ping may still
/// pass on readiness seen before, so an idle session is not reused after that. A task on the
/// runtime holds the tie's other end: it is dropped, and the tie cut, when the runtime shuts
/// down, and it ends when the tie is dropped.
pub(super) struct RuntimeTie {
    /// The runtime, if there was one.
    runtime: Option<tokio::runtime::Id>,
    runtime_gone: CancellationToken,
    _dropped: tokio_util::sync::DropGuard,
}

impl RuntimeTie {
    /// A tie to the current runtime (cut at once outside one).
    pub(super) fn current() -> RuntimeTie {
        let runtime_gone = CancellationToken::new();
        let dropped = CancellationToken::new();
        let current = tokio::runtime::Handle::try_current();
        let id = current.as_ref().ok().map(|runtime| runtime.id());
        match current {
            Ok(runtime) => {
                let cut = runtime_gone.clone().drop_guard();
                let ended = dropped.clone();
                drop(runtime.spawn(async move {
                    let _cut = cut;
                    ended.cancelled().await;
                }));
            }
            Err(_) => runtime_gone.cancel(),
        }
        RuntimeTie {
            runtime: id,
            runtime_gone,
            _dropped: dropped.drop_guard(),
        }
    }

    pub(super) fn alive(&self) -> bool {
        !self.runtime_gone.is_cancelled()
    }
}

pub(super) type ReleaseSender = oneshot::Sender<oneshot::Sender<()>>;
type WaitReply = oneshot::Sender<Result<Option<(Grant, ReleaseSender)>, LockError>>;

/// One native wait on a wait session; once granted, the task keeps the lock (and checks the
/// session) until it is released.
pub(super) struct WaitTask<C: Connector> {
    pub(super) connector: Arc<C>,
    pub(super) resource: C::Resource,
    pub(super) mode: Mode,
    /// Held until the task ends, after the lock is given back or the session dropped.
    pub(super) claim: Claim<C::Resource>,
    pub(super) deadline: Option<Instant>,
    pub(super) keepalive: Duration,
    /// The most giving the lock back may take before the session is dropped instead.
    pub(super) statement_timeout: Duration,
    pub(super) pool: Arc<WaitPool<C::Session>>,
    /// The lane that runs this wait's interrupt request if it is abandoned.
    pub(super) interrupter: Lane<C>,
    pub(super) lost: CancellationToken,
    /// The runtime the task's session was opened on (set when the task has its session).
    pub(super) tie: Mutex<Option<RuntimeTie>>,
    // Held until the session is back in the pool (or dropped).
    pub(super) _permit: tokio::sync::OwnedSemaphorePermit,
}

enum Step {
    Granted(Grant),
    NotGranted,
    Abandoned,
    Failed(Failure),
}

impl<C: Connector> WaitTask<C> {
    pub(super) async fn run(self, mut reply: WaitReply) {
        let (mut session, tie) = match self.reuse().await {
            Some(reused) => reused,
            None => match self.connector.open().await {
                Ok(session) => (session, RuntimeTie::current()),
                Err(err) => {
                    let _ = reply.send(Err(err));
                    return;
                }
            },
        };
        *self.tie.lock().unwrap_or_else(PoisonError::into_inner) = Some(tie);
        let resolution = self.connector.wait_resolution();
        let mut pause = TAIL_PAUSE;
        let grant = loop {
            let left = self.deadline.map_or(Duration::MAX, |deadline| {
                deadline.saturating_duration_since(Instant::now())
            });
            let last = self.deadline.is_some() && left.is_zero();
            let whole = round_down(left.min(C::MAX_WAIT), resolution);
            if whole.is_zero() && !last {
                // Less than the server's resolution is left: short pauses and tries up to
                // the deadline, the last one at it.
                tokio::select! {
                    () = tokio::time::sleep(pause.min(left)) => {}
                    () = reply.closed() => {
                        // Nothing is in flight or held on the session: keep it.
                        self.put(session);
                        return;
                    }
                }
                pause = (pause * 2).min(TAIL_PAUSE_MAX);
            }
            let step = {
                let statement = session.lock(&self.resource, self.mode, whole);
                tokio::select! {
                    result = statement => match result {
                        Ok(Some(grant)) => Step::Granted(grant),
                        Ok(None) => Step::NotGranted,
                        Err(failure) => Step::Failed(failure),
                    },
                    () = reply.closed() => Step::Abandoned,
                }
            };
            match step {
                Step::Granted(grant) => break grant,
                Step::NotGranted if last => {
                    let _ = reply.send(Ok(None));
                    self.put(session);
                    return;
                }
                Step::NotGranted => continue,
                Step::Abandoned => {
                    self.abandon(session).await;
                    return;
                }
                Step::Failed(failure) => {
                    let _ = reply.send(Err(failure.error));
                    if failure.connection_ok {
                        // Make sure nothing stays held, then keep the session.
                        self.give_back(session).await;
                    }
                    return;
                }
            }
        };
        let (release_tx, release_rx) = oneshot::channel();
        if reply.send(Ok(Some((grant, release_tx)))).is_err() {
            // Abandoned after the server granted it: give it back.
            self.settling();
            self.give_back(session).await;
            return;
        }
        self.hold(session, release_rx).await;
    }

    fn settling(&self) {
        self.claim.settling();
    }

    /// Stops the server's wait (interrupting it, from a lane where the session asks for
    /// that) and drops the session, which ends anything it was granted in the meantime. The
    /// task (and with it the claim) ends once the lane has run the interrupt.
    async fn abandon(&self, session: C::Session) {
        self.settling();
        let finished = session
            .interrupt(&self.resource)
            .map(|request| self.interrupter.interrupt(request));
        drop(session);
        if let Some(finished) = finished {
            finished.await;
        }
    }

    /// An idle wait session that still answers, if there is one, with its runtime tie.
    async fn reuse(&self) -> Option<(C::Session, RuntimeTie)> {
        while let Some((mut session, tie)) = self.pool.take() {
            if let Ok(Ok(())) = tokio::time::timeout(C::PING_TIMEOUT, session.ping()).await {
                return Some((session, tie));
            }
        }
        None
    }

    /// Returns the session (which holds nothing) to the pool.
    fn put(&self, session: C::Session) {
        let tie = self
            .tie
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(tie) = tie {
            self.pool.put(session, tie);
        }
    }

    /// Gives the lock back and returns the session to the pool; drops the session (which
    /// frees the lock on the server) if that fails.
    async fn give_back(&self, mut session: C::Session) {
        if let Ok(Ok(())) = tokio::time::timeout(
            self.statement_timeout,
            session.unlock(&self.resource, self.mode),
        )
        .await
        {
            self.put(session);
        }
    }

    async fn hold(
        self,
        mut session: C::Session,
        mut release: oneshot::Receiver<oneshot::Sender<()>>,
    ) {
        // The first check one period from now. (`interval`'s immediate first tick still goes
        // through the timer wheel: awaiting it here cost up to a millisecond before a release
        // could be seen, on every lock granted through a wait.)
        let mut ticker = tokio::time::interval_at(
            crate::time::later_tokio(tokio::time::Instant::now(), self.keepalive),
            self.keepalive,
        );
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // If this task stops before the lock is released (its runtime is dropped), the
        // session and the lock end with it: the holder is told.
        let lost = self.lost.clone().drop_guard();
        loop {
            tokio::select! {
                asked = &mut release => {
                    lost.disarm();
                    self.give_back(session).await;
                    // The backend's claim ends before the release is acknowledged: an
                    // acquisition that follows the release must not find the key still
                    // claimed and answer that it is held.
                    drop(self.claim);
                    if let Ok(done) = asked {
                        let _ = done.send(());
                    }
                    return;
                }
                _ = ticker.tick() => {
                    match tokio::time::timeout(C::PING_TIMEOUT, session.ping()).await {
                        Ok(Ok(())) => {}
                        _ => {
                            tracing::warn!(
                                backend = C::NAME,
                                "a wait connection failed its liveness check; its lock is lost"
                            );
                            drop(lost);
                            return;
                        }
                    }
                }
            }
        }
    }
}

/// `wait` rounded down to a whole number of `unit`s.
pub(super) fn round_down(wait: Duration, unit: Duration) -> Duration {
    let units = wait.as_nanos().checked_div(unit.as_nanos()).unwrap_or(0);
    unit.saturating_mul(u32::try_from(units).unwrap_or(u32::MAX))
}

/// A lock taken by a native wait, held by its wait task.
#[derive(Debug)]
pub(super) struct WaitHeld {
    pub(super) release: Option<ReleaseSender>,
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
    /// An idle wait session opened on a runtime that has since shut down is dropped, not
    /// reused: its socket fails its next wait for readiness, though a ping may pass.
    #[test]
    fn an_idle_session_of_a_runtime_that_is_gone_is_not_reused() {
        let runtime = || {
            tokio::runtime::Builder::new_current_thread()
                .build()
                .unwrap()
        };
        let pool: WaitPool<&str> = WaitPool {
            permits: Arc::new(Semaphore::new(2)),
            idle: Mutex::new(Vec::new()),
        };
        let (first, second) = (runtime(), runtime());
        pool.put("second", second.block_on(async { RuntimeTie::current() }));
        pool.put("first", first.block_on(async { RuntimeTie::current() }));
        drop(first);
        let (session, tie) = pool.take().expect("the live runtime's session");
        assert_eq!(session, "second");
        assert!(tie.alive());
        assert!(
            pool.take().is_none(),
            "the dropped runtime's session is not reused"
        );
        assert!(
            !RuntimeTie::current().alive(),
            "outside a runtime there is nothing to tie to"
        );
    }

    /// Of the idle wait sessions, one opened on the caller's runtime is taken first,
    /// whatever the order they came back in; outside a runtime, the latest.
    #[test]
    fn an_idle_wait_session_of_the_callers_runtime_is_taken_first() {
        let runtime = || {
            tokio::runtime::Builder::new_current_thread()
                .build()
                .unwrap()
        };
        let pool: WaitPool<&str> = WaitPool {
            permits: Arc::new(Semaphore::new(3)),
            idle: Mutex::new(Vec::new()),
        };
        let (first, second) = (runtime(), runtime());
        pool.put("first", first.block_on(async { RuntimeTie::current() }));
        pool.put("second", second.block_on(async { RuntimeTie::current() }));
        pool.put(
            "second again",
            second.block_on(async { RuntimeTie::current() }),
        );
        let (session, _) = first.block_on(async { pool.take() }).unwrap();
        assert_eq!(session, "first");
        let (session, _) = pool.take().unwrap();
        assert_eq!(session, "second again");
    }

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
