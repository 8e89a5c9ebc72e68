//! How an acquisition runs: a try on a lane, then a native wait or polling.

use std::fmt::Debug;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use tokio::sync::{Semaphore, mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use super::claims::{Claim, Claims, Until};
use super::lane::{Lane, LaneCommand, LaneHeld};
use super::options::LaneSettings;
use super::traits::Connector;
use super::wait::{WaitHeld, WaitPool, WaitTask};
use crate::backend::Acquired;
use crate::backoff::Pauses;
use crate::{Backoff, LockError};

/// The shared machinery of one backend instance.
pub(crate) struct Lanes<C: Connector> {
    connector: Arc<C>,
    settings: LaneSettings,
    /// The lanes' command channels; a lane whose task has stopped (its runtime was dropped) is
    /// started again when next picked.
    lanes: Vec<Mutex<mpsc::UnboundedSender<LaneCommand<C>>>>,
    next_lane: AtomicUsize,
    next_handle: AtomicU64,
    waits: Arc<WaitPool<C::Session>>,
    claims: Arc<Claims<C::Resource>>,
}

impl<C: Connector> Lanes<C> {
    /// Answers a configuration error outside a Tokio runtime.
    pub(super) fn check_runtime() -> Result<(), LockError> {
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(LockError::config(format!(
                "the {} backend must be opened inside a Tokio runtime",
                C::NAME
            )));
        }
        Ok(())
    }

    /// Starts the lane tasks with `first` as the first lane's session (the other lanes open
    /// theirs when first needed). Must run inside a Tokio runtime.
    pub(super) fn start(
        connector: C,
        settings: LaneSettings,
        first: C::Session,
    ) -> Result<Self, LockError> {
        settings.check()?;
        Self::check_runtime()?;
        let connector = Arc::new(connector);
        let mut first = Some(first);
        let mut lanes = Vec::with_capacity(settings.connections);
        for _ in 0..settings.connections {
            lanes.push(Mutex::new(Lane::spawn(&connector, &settings, first.take())));
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
            claims: Arc::new(Claims::default()),
        })
    }

    /// The backend's connector.
    pub(super) fn connector(&self) -> &C {
        &self.connector
    }

    /// The next lane's command channel. A lane whose task has stopped (the runtime it ran on
    /// was dropped; its locks were reported lost then) is started again on this runtime.
    fn lane(&self) -> Result<mpsc::UnboundedSender<LaneCommand<C>>, LockError> {
        let n = self.next_lane.fetch_add(1, Ordering::Relaxed);
        // Never empty (the settings are checked), but answer an error rather than panic.
        let lane = self
            .lanes
            .get(n % self.lanes.len().max(1))
            .ok_or_else(lane_gone::<C>)?;
        let mut sender = lane.lock().unwrap_or_else(PoisonError::into_inner);
        if sender.is_closed() {
            Self::check_runtime()?;
            *sender = Lane::spawn(&self.connector, &self.settings, None);
        }
        Ok(sender.clone())
    }

    /// A health check on a lane's session.
    pub(crate) async fn ping(&self) -> Result<(), LockError> {
        let lane = self.lane()?;
        let (reply, answer) = oneshot::channel();
        lane.send(LaneCommand::Ping { reply })
            .map_err(|_| lane_gone::<C>())?;
        answer.await.map_err(|_| lane_gone::<C>())?
    }

    /// One try on a lane.
    pub(crate) async fn try_acquire(&self, key: &str) -> Result<Option<Acquired>, LockError> {
        let resource = self.connector.resource(key);
        self.try_resource(resource).await
    }

    async fn try_resource(&self, resource: C::Resource) -> Result<Option<Acquired>, LockError> {
        let Some(claim) = self.claims.claim(&resource, Until::Try).await else {
            return Ok(None);
        };
        self.try_claimed(resource, claim).await
    }

    /// One try on a lane for a resource this acquisition has claimed.
    async fn try_claimed(
        &self,
        resource: C::Resource,
        claim: Claim<C::Resource>,
    ) -> Result<Option<Acquired>, LockError> {
        let lane = self.lane()?;
        let handle = self.next_handle.fetch_add(1, Ordering::Relaxed);
        let lost = CancellationToken::new();
        let (reply, answer) = oneshot::channel();
        // Marks the claim as being cleaned up if this future is dropped before the answer.
        let abandoned = claim.abandon_guard();
        lane.send(LaneCommand::Try {
            resource,
            claim,
            handle,
            lost: lost.clone(),
            reply,
        })
        .map_err(|_| lane_gone::<C>())?;
        // Armed from here on: if this future is dropped before the answer is turned into a
        // guard (even after the lane has sent a grant), dropping `held` queues an unlock
        // behind the try, which frees whatever the try got.
        let held = LaneHeld::new(lane, handle);
        let answer = answer.await;
        abandoned.disarm();
        match answer.map_err(|_| lane_gone::<C>())?? {
            Some(grant) => Ok(Some(Acquired::new(grant.token, lost, Box::new(held)))),
            None => {
                held.disarm();
                Ok(None)
            }
        }
    }

    async fn poll_lanes(
        &self,
        resource: C::Resource,
        deadline: Option<Instant>,
    ) -> Result<Option<Acquired>, LockError> {
        let mut pauses = Pauses::new(Backoff::default(), deadline);
        loop {
            // Another acquisition of this backend holding the resource is waited for here,
            // without asking the server.
            let Some(claim) = self
                .claims
                .claim(&resource, Until::Deadline(deadline))
                .await
            else {
                return Ok(None);
            };
            if let Some(acquired) = self.try_claimed(resource.clone(), claim).await? {
                return Ok(Some(acquired));
            }
            let Some(pause) = pauses.next_pause() else {
                return Ok(None);
            };
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
        let deadline = crate::time::deadline(Instant::now(), timeout);
        let resource = self.connector.resource(key);
        // A free key is taken on a lane, like a try.
        if let Some(acquired) = self.try_resource(resource.clone()).await? {
            return Ok(Some(acquired));
        }
        let remaining = deadline.map_or(Duration::MAX, |d| {
            d.saturating_duration_since(Instant::now())
        });
        if remaining.is_zero() {
            return Ok(None);
        }
        // Another acquisition of this backend (through this provider or another provider on a
        // clone of the backend) may hold the resource: wait for it to let go here, since the
        // server would let a shared session in, and could not queue this wait behind it.
        let Some(claim) = self
            .claims
            .claim(&resource, Until::Deadline(deadline))
            .await
        else {
            return Ok(None);
        };
        let Ok(permit) = Arc::clone(&self.waits.permits).try_acquire_owned() else {
            // Every wait session is busy: poll the lanes instead.
            drop(claim);
            return self.poll_lanes(resource, deadline).await;
        };
        let lost = CancellationToken::new();
        let (reply, answer) = oneshot::channel();
        let abandoned = claim.abandon_guard();
        let task = WaitTask {
            connector: Arc::clone(&self.connector),
            resource,
            claim,
            deadline,
            keepalive: self.settings.keepalive,
            statement_timeout: self.settings.statement_timeout,
            pool: Arc::clone(&self.waits),
            interrupter: self.lane()?,
            lost: lost.clone(),
            tie: Mutex::new(None),
            _permit: permit,
        };
        tokio::spawn(task.run(reply));
        // If this future is dropped, the task sees the closed reply, interrupts the wait and
        // drops its session, which also ends a lock granted in the meantime.
        let answer = match remaining.checked_add(C::WAIT_GRACE) {
            Some(limit) => match tokio::time::timeout(limit, answer).await {
                Ok(answer) => answer,
                // The server did not answer in time: give up (the task cleans up; the armed
                // guard marks the claim as being cleaned up).
                Err(_) => return Ok(None),
            },
            None => answer.await,
        };
        abandoned.disarm();
        match answer.map_err(|_| lane_gone::<C>())?? {
            None => Ok(None),
            Some((grant, release)) => Ok(Some(Acquired::new(
                grant.token,
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
            .field("statement_timeout", &self.settings.statement_timeout)
            .finish()
    }
}

pub(super) fn lane_gone<C: Connector>() -> LockError {
    LockError::unavailable(
        C::NAME,
        "the backend's connection task has stopped (is the Tokio runtime shutting down?)",
        None,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::session::model::{ModelSession, Server, model_lanes, model_lanes_with, settings};

    /// A lane statement that outlives `statement_timeout` is given up: the try answers
    /// `Unavailable` at the bound (not at the old fixed 10 s), the lane's session is dropped,
    /// and the locks it held are reported lost and freed on the server.
    #[tokio::test]
    async fn a_statement_outliving_statement_timeout_drops_the_session() {
        let server = Arc::new(Server::default());
        let mut lane_settings = settings(1, 0);
        lane_settings.statement_timeout = Duration::from_millis(100);
        let lanes = model_lanes_with(&server, lane_settings).await;
        let held = lanes.try_acquire("a").await.unwrap().expect("free");
        server
            .hang
            .lock()
            .unwrap()
            .insert(lanes.connector().resource("b"));
        let started = Instant::now();
        let err = tokio::time::timeout(Duration::from_secs(3), lanes.try_acquire("b"))
            .await
            .expect("the statement was not bounded by statement_timeout")
            .unwrap_err();
        assert!(started.elapsed() >= Duration::from_millis(100));
        assert_eq!(err.code(), "DistributedLock.Unavailable", "{err}");
        assert!(err.to_string().contains("statement_timeout"), "{err}");
        assert!(
            held.lost.is_cancelled(),
            "the lane's locks are reported lost"
        );
        assert!(
            server.locks.lock().unwrap().is_empty(),
            "the session, and its lock, were dropped"
        );
        server.hang.lock().unwrap().clear();
        let again = lanes
            .try_acquire("a")
            .await
            .unwrap()
            .expect("a new session");
        again.handle.release().await.unwrap();
        held.handle.release().await.unwrap();
    }

    /// Acquisitions of one backend (two providers on clones of it share its lanes) never both
    /// get a resource, although the one lane's session would let them re-enter.
    #[tokio::test]
    async fn one_backend_never_grants_a_resource_twice_on_a_shared_session() {
        let server = Arc::new(Server::default());
        let lanes = model_lanes(&server, 1, 1).await;
        let first = lanes.try_acquire("k").await.unwrap().expect("free");
        assert!(
            lanes.try_acquire("k").await.unwrap().is_none(),
            "a second try on the same session was granted"
        );
        let started = Instant::now();
        assert!(
            lanes
                .acquire_wait("k", Duration::from_millis(60))
                .await
                .unwrap()
                .is_none(),
            "a wait was granted a held resource"
        );
        assert!(started.elapsed() >= Duration::from_millis(60));
        // A waiter gets it once the holder lets go.
        let lanes = Arc::new(lanes);
        let waiter = tokio::spawn({
            let lanes = Arc::clone(&lanes);
            async move { lanes.acquire_wait("k", Duration::from_secs(10)).await }
        });
        tokio::time::sleep(Duration::from_millis(30)).await;
        assert!(!waiter.is_finished());
        first.handle.release().await.unwrap();
        let second = waiter
            .await
            .unwrap()
            .unwrap()
            .expect("granted after release");
        assert_eq!(server.locks.lock().unwrap().len(), 1);
        second.handle.release().await.unwrap();
        assert!(server.locks.lock().unwrap().is_empty(), "nothing left held");
    }

    /// Once the release of a lock granted through a wait has returned, the next try of the
    /// same backend gets the resource: the wait's claim ended before the release was
    /// acknowledged (it used to end a moment after, and the try answered "held").
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_try_right_after_a_waited_lock_is_released_gets_it() {
        let server = Arc::new(Server::default());
        let lanes = Arc::new(model_lanes(&server, 1, 1).await);
        for round in 0..200 {
            let blocker = ModelSession {
                server: Arc::clone(&server),
                id: u64::MAX,
            };
            assert!(blocker.take(lanes.connector().resource("k")));
            let waiting = tokio::spawn({
                let lanes = Arc::clone(&lanes);
                async move { lanes.acquire_wait("k", Duration::from_secs(10)).await }
            });
            while !lanes.claims.is_claimed(&lanes.connector().resource("k")) {
                tokio::task::yield_now().await;
            }
            drop(blocker);
            let held = waiting
                .await
                .unwrap()
                .unwrap()
                .expect("granted to the wait");
            held.handle.release().await.unwrap();
            let again = lanes.try_acquire("k").await.unwrap();
            let again =
                again.unwrap_or_else(|| panic!("round {round}: still claimed after the release"));
            again.handle.release().await.unwrap();
        }
    }

    /// The lane task that keeps a lock dies with the runtime it ran on: the lock's lost token
    /// fires, and the backend keeps working from another runtime.
    #[test]
    fn a_lane_stopped_with_its_runtime_reports_its_locks_lost() {
        let server = Arc::new(Server::default());
        let first = tokio::runtime::Runtime::new().unwrap();
        let lanes = first.block_on(model_lanes(&server, 1, 1));
        let second = tokio::runtime::Runtime::new().unwrap();
        let held = second
            .block_on(lanes.try_acquire("k"))
            .unwrap()
            .expect("free");
        assert!(!held.lost.is_cancelled());
        drop(first);
        assert!(held.lost.is_cancelled(), "the lane's runtime is gone");
        assert!(
            server.locks.lock().unwrap().is_empty(),
            "the session, and its lock, ended with the lane"
        );
        second.block_on(async {
            let again = lanes.try_acquire("k").await.unwrap().expect("a new lane");
            assert!(!again.lost.is_cancelled());
            again.handle.release().await.unwrap();
            // The lost lock's release reports nothing of its own.
            held.handle.release().await.unwrap();
        });
    }

    /// The same for a lock granted through a native wait, kept by its wait task.
    #[test]
    fn a_wait_task_stopped_with_its_runtime_reports_its_lock_lost() {
        let server = Arc::new(Server::default());
        let second = tokio::runtime::Runtime::new().unwrap();
        let lanes = Arc::new(second.block_on(model_lanes(&server, 1, 1)));
        let first = tokio::runtime::Runtime::new().unwrap();
        // A holder on another session of the server, so the acquisition must wait.
        let blocker = ModelSession {
            server: Arc::clone(&server),
            id: u64::MAX,
        };
        assert!(blocker.take(lanes.connector().resource("k")));
        let waiting = first.spawn({
            let lanes = Arc::clone(&lanes);
            async move { lanes.acquire_wait("k", Duration::from_secs(10)).await }
        });
        std::thread::sleep(Duration::from_millis(30));
        drop(blocker);
        let held = first
            .block_on(waiting)
            .unwrap()
            .unwrap()
            .expect("granted to the wait");
        assert!(!held.lost.is_cancelled());
        drop(first);
        assert!(held.lost.is_cancelled(), "the wait task's runtime is gone");
        assert!(server.locks.lock().unwrap().is_empty());
    }
}
