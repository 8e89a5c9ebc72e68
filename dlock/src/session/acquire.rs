//! How an acquisition runs: a try on a lane, then a native wait or polling.

use std::fmt::Debug;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{Semaphore, oneshot};
use tokio_util::sync::CancellationToken;

use super::claims::{Claim, Claims, Until};
use super::lane::{Lane, LaneHeld};
use super::options::LaneSettings;
use super::traits::{Connector, Mode, PermitAnswer, PermitCount};
use super::wait::{WaitHeld, WaitPool, WaitTask};
use crate::backend::Acquired;
use crate::backoff::Pauses;
use crate::{Backoff, LockError};

/// The shared machinery of one backend instance.
pub(crate) struct Lanes<C: Connector> {
    connector: Arc<C>,
    settings: LaneSettings,
    /// The lanes: one lock session each.
    lanes: Vec<Lane<C>>,
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

    /// Starts the lanes with `first` as the first lane's session (the other lanes open theirs
    /// when first needed). Must run inside a Tokio runtime.
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
            lanes.push(Lane::start(&connector, &settings, first.take()));
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

    /// The next lane.
    fn lane(&self) -> Result<Lane<C>, LockError> {
        let n = self.next_lane.fetch_add(1, Ordering::Relaxed);
        self.lane_at(n % self.lanes.len().max(1))
    }

    /// The lane to try `resource` in `mode` on, and its index: of the lanes that are idle,
    /// the one holding the fewest locks (the first of those), else the next lane in turn.
    /// Uncontended acquire-and-release cycles so keep to one connection, whose socket and
    /// server thread stay warm (handing each try to the next connection in turn cost a cold
    /// server thread per cycle: a MariaDB cycle took 4× the raw statements' time), while the
    /// locks held at once still spread over the sessions, so that one session's end loses as
    /// few of them as it can. A shared try goes only to a lane that holds no shared lock of
    /// the resource yet, if there is one: there the try reaches the server, which answers it
    /// behind a writer that waits there (a lane that holds the resource already grants
    /// another share itself).
    fn lane_for(&self, resource: &C::Resource, mode: Mode) -> Result<(usize, Lane<C>), LockError> {
        let busy = if mode.is_shared() {
            self.claims.lanes_of(resource)
        } else {
            Vec::new()
        };
        self.pick_lane(&busy)
    }

    /// As [`lane_for`](Self::lane_for), among the lanes not in `busy` while there is one.
    fn pick_lane(&self, busy: &[usize]) -> Result<(usize, Lane<C>), LockError> {
        let count = self.lanes.len().max(1);
        let usable = |i: &usize| !busy.contains(i);
        let idle = (0..count)
            .filter(usable)
            .filter_map(|i| Some((self.lanes.get(i)?.idle_holding()?, i)))
            .min()
            .map(|(_, i)| i);
        let index = match idle {
            Some(index) => index,
            None => {
                let n = self.next_lane.fetch_add(1, Ordering::Relaxed) % count;
                (0..count)
                    .map(|k| (n + k) % count)
                    .find(usable)
                    .unwrap_or(n)
            }
        };
        Ok((index, self.lane_at(index)?))
    }

    /// Lane `index`.
    fn lane_at(&self, index: usize) -> Result<Lane<C>, LockError> {
        // Never empty (the settings are checked), but answer an error rather than panic.
        self.lanes.get(index).cloned().ok_or_else(lane_gone::<C>)
    }

    /// A health check on a lane's session.
    pub(crate) async fn ping(&self) -> Result<(), LockError> {
        self.lane()?.ping().await
    }

    /// One try on a lane.
    pub(crate) async fn try_acquire(
        &self,
        key: &str,
        mode: Mode,
    ) -> Result<Option<Acquired>, LockError> {
        let resource = self.connector.resource(key);
        self.try_resource(resource, mode).await
    }

    async fn try_resource(
        &self,
        resource: C::Resource,
        mode: Mode,
    ) -> Result<Option<Acquired>, LockError> {
        let Some(claim) = self.claims.claim(&resource, mode, Until::Try).await else {
            return Ok(None);
        };
        self.try_claimed(resource, mode, claim).await
    }

    /// One try on a lane for a resource this acquisition has claimed.
    async fn try_claimed(
        &self,
        resource: C::Resource,
        mode: Mode,
        claim: Claim<C::Resource>,
    ) -> Result<Option<Acquired>, LockError> {
        let (index, lane) = self.lane_for(&resource, mode)?;
        claim.on_lane(index);
        let handle = self.next_handle.fetch_add(1, Ordering::Relaxed);
        let lost = CancellationToken::new();
        // Marks the claim as being cleaned up if this future is dropped before the answer
        // (the try then ends on a task of its own, and gives back what it got).
        let abandoned = claim.abandon_guard();
        let answer = lane
            .try_lock(resource, mode, claim, handle, lost.clone())
            .await;
        abandoned.disarm();
        // Made in the poll that got the grant: no await lies between the two.
        Ok(answer?
            .map(|grant| Acquired::new(grant.token, lost, Box::new(LaneHeld::new(lane, handle)))))
    }

    /// The semaphore `key` of `max_count` permits, as the engine names it; a count above the
    /// engine's bound is a configuration error that names it.
    fn semaphore(&self, key: &str, max_count: u32, queue: &str) -> Result<C::Semaphore, LockError> {
        if max_count == 0 || max_count > C::MAX_PERMITS {
            return Err(LockError::config(format!(
                "a semaphore on {} takes a max_count of 1 to {} (asked: {max_count}): a try \
                 that finds the semaphore full asks the server for each of its slots in one \
                 statement, and the backend bounds that walk",
                C::NAME,
                C::MAX_PERMITS
            )));
        }
        let queue = self.connector.resource(queue);
        Ok(self.connector.semaphore(key, max_count, queue))
    }

    /// One try for a permit of the semaphore `key` (`waiting`: a try of a waiting
    /// acquisition, which is not answered full for the semaphore's queue lock), on a lane, in
    /// one statement. The permit is pinned to the lane, as a lock.
    pub(crate) async fn try_permit(
        &self,
        key: &str,
        max_count: u32,
        queue: &str,
        waiting: bool,
    ) -> Result<PermitAnswer<Acquired>, LockError> {
        let semaphore = self.semaphore(key, max_count, queue)?;
        let (_, lane) = self.pick_lane(&[])?;
        let handle = self.next_handle.fetch_add(1, Ordering::Relaxed);
        let lost = CancellationToken::new();
        let answer = lane
            .try_permit(semaphore, waiting, handle, lost.clone())
            .await?;
        // Made in the poll that got the grant: no await lies between the two.
        Ok(match answer {
            PermitAnswer::Granted { token, .. } => PermitAnswer::Granted {
                permit: Acquired::new(token, lost, Box::new(LaneHeld::new(lane, handle))),
                token,
            },
            PermitAnswer::Full => PermitAnswer::Full,
            PermitAnswer::Conflict { recorded } => PermitAnswer::Conflict { recorded },
        })
    }

    /// How many permits of the semaphore `key` are live, and under which count.
    pub(crate) async fn count_permits(
        &self,
        key: &str,
        max_count: u32,
        queue: &str,
    ) -> Result<PermitCount, LockError> {
        let semaphore = self.semaphore(key, max_count, queue)?;
        let (_, lane) = self.pick_lane(&[])?;
        lane.count_permits(semaphore).await
    }

    async fn poll_lanes(
        &self,
        resource: C::Resource,
        mode: Mode,
        deadline: Option<Instant>,
    ) -> Result<Option<Acquired>, LockError> {
        let mut pauses = Pauses::new(Backoff::default(), deadline);
        loop {
            // Another acquisition of this backend holding the resource is waited for here,
            // without asking the server.
            let Some(claim) = self
                .claims
                .claim(&resource, mode, Until::Deadline(deadline))
                .await
            else {
                return Ok(None);
            };
            if let Some(acquired) = self.try_claimed(resource.clone(), mode, claim).await? {
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
        mode: Mode,
        timeout: Duration,
    ) -> Result<Option<Acquired>, LockError> {
        let deadline = crate::time::deadline(Instant::now(), timeout);
        let resource = self.connector.resource(key);
        // A free key is taken on a lane, like a try.
        if let Some(acquired) = self.try_resource(resource.clone(), mode).await? {
            return Ok(Some(acquired));
        }
        let remaining = deadline.map_or(Duration::MAX, |d| {
            d.saturating_duration_since(Instant::now())
        });
        if remaining.is_zero() {
            return Ok(None);
        }
        // Another acquisition of this backend (through this provider or another provider on a
        // clone of the backend) may hold the resource in a conflicting mode: wait for it to
        // let go here, since the server would let a shared session in, and could not queue
        // this wait behind it. (Readers share their claims, and each waits on its own wait
        // session, where the server queues it.)
        let Some(claim) = self
            .claims
            .claim(&resource, mode, Until::Deadline(deadline))
            .await
        else {
            return Ok(None);
        };
        let Ok(permit) = Arc::clone(&self.waits.permits).try_acquire_owned() else {
            // Every wait session is busy: poll the lanes instead.
            drop(claim);
            return self.poll_lanes(resource, mode, deadline).await;
        };
        let lost = CancellationToken::new();
        let (reply, answer) = oneshot::channel();
        let abandoned = claim.abandon_guard();
        let task = WaitTask {
            connector: Arc::clone(&self.connector),
            resource,
            mode,
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

#[cfg(test)]
impl<C: Connector> Lanes<C> {
    /// An exclusive try (tests).
    pub(super) async fn try_acquire_x(&self, key: &str) -> Result<Option<Acquired>, LockError> {
        self.try_acquire(key, Mode::Exclusive).await
    }

    /// A shared try (tests).
    pub(super) async fn try_acquire_s(&self, key: &str) -> Result<Option<Acquired>, LockError> {
        self.try_acquire(key, Mode::Shared).await
    }

    /// An exclusive wait (tests).
    pub(super) async fn acquire_wait_x(
        &self,
        key: &str,
        timeout: Duration,
    ) -> Result<Option<Acquired>, LockError> {
        self.acquire_wait(key, Mode::Exclusive, timeout).await
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
        let held = lanes.try_acquire_x("a").await.unwrap().expect("free");
        server
            .hang
            .lock()
            .unwrap()
            .insert(lanes.connector().resource("b"));
        let started = Instant::now();
        let err = tokio::time::timeout(Duration::from_secs(3), lanes.try_acquire_x("b"))
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
            .try_acquire_x("a")
            .await
            .unwrap()
            .expect("a new session");
        again.handle.release().await.unwrap();
        held.handle.release().await.unwrap();
    }

    /// A try whose caller leaves while the server grants it (the statement runs on the
    /// caller's task) still ends: the lock is given back, the key is free again for the next
    /// try, and the lane's session, which keeps other locks, lives on.
    #[tokio::test]
    async fn a_try_dropped_while_granted_gives_the_lock_back() {
        let server = Arc::new(Server::default());
        let lanes = model_lanes(&server, 1, 1).await;
        let other = lanes.try_acquire_x("other").await.unwrap().expect("free");
        let k = lanes.connector().resource("k");
        server.slow.lock().unwrap().insert(k);
        for _ in 0..3 {
            // Dropped after the server granted it, before the answer arrived.
            let cut = tokio::time::timeout(Duration::from_millis(10), lanes.try_acquire_x("k"));
            assert!(cut.await.is_err(), "the try answered before it was dropped");
            assert_eq!(
                ModelSession::holders(&server, k),
                1,
                "granted on the server"
            );
            // The next try waits for the abandoned one to settle, then gets the key.
            let again = lanes.try_acquire_x("k").await.unwrap().expect("given back");
            assert_eq!(ModelSession::holders(&server, k), 1);
            again.handle.release().await.unwrap();
            assert_eq!(ModelSession::holders(&server, k), 0, "nothing stranded");
        }
        assert!(!other.lost.is_cancelled(), "the session was kept");
        other.handle.release().await.unwrap();
        assert!(server.locks.lock().unwrap().is_empty());
    }

    /// Uncontended tries keep to one lane session (round robin would hand each to a colder
    /// connection), locks held at once spread over the sessions, and a try that finds a lane
    /// busy takes an idle one instead of queueing behind a statement that hangs there.
    #[tokio::test]
    async fn tries_keep_to_an_idle_lane() {
        let server = Arc::new(Server::default());
        let lanes = Arc::new(model_lanes(&server, 3, 0).await);
        let owners = |key: &str| -> Vec<u64> {
            let resource = lanes.connector().resource(key);
            server
                .locks
                .lock()
                .unwrap()
                .get(&resource)
                .map(|held| held.owners.keys().copied().collect())
                .unwrap_or_default()
        };
        let mut sessions = std::collections::HashSet::new();
        for key in ["a", "b", "c", "d", "a"] {
            let held = lanes.try_acquire_x(key).await.unwrap().expect("free");
            sessions.extend(owners(key));
            held.handle.release().await.unwrap();
        }
        assert_eq!(
            sessions.len(),
            1,
            "uncontended tries moved between sessions"
        );
        let first = sessions.into_iter().next();
        // A lock statement that never answers keeps the first lane busy.
        server
            .hang
            .lock()
            .unwrap()
            .insert(lanes.connector().resource("x"));
        let hung = tokio::spawn({
            let lanes = Arc::clone(&lanes);
            async move { lanes.try_acquire_x("x").await }
        });
        let started = Instant::now();
        while lanes.lanes[0].idle_holding().is_some() {
            assert!(
                started.elapsed() < Duration::from_secs(5),
                "the try never started"
            );
            tokio::task::yield_now().await;
        }
        let other = tokio::time::timeout(Duration::from_secs(2), lanes.try_acquire_x("y"))
            .await
            .expect("queued behind the hung statement")
            .unwrap()
            .expect("free");
        assert_ne!(owners("y").first().copied(), first, "took the busy lane");
        other.handle.release().await.unwrap();
        hung.abort();
    }

    /// Acquisitions of one backend (two providers on clones of it share its lanes) never both
    /// get a resource, although the one lane's session would let them re-enter.
    #[tokio::test]
    async fn one_backend_never_grants_a_resource_twice_on_a_shared_session() {
        let server = Arc::new(Server::default());
        let lanes = model_lanes(&server, 1, 1).await;
        let first = lanes.try_acquire_x("k").await.unwrap().expect("free");
        assert!(
            lanes.try_acquire_x("k").await.unwrap().is_none(),
            "a second try on the same session was granted"
        );
        let started = Instant::now();
        assert!(
            lanes
                .acquire_wait_x("k", Duration::from_millis(60))
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
            async move { lanes.acquire_wait_x("k", Duration::from_secs(10)).await }
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
            // The previous round's wait task gives its wait session back just after the
            // release it answered: until then a new wait would poll the lanes instead, and hold
            // its claim only for each poll's try, which the loop below could miss for as long
            // as the blocker is held.
            let idle = Instant::now();
            while lanes.waits.permits.available_permits() == 0 {
                assert!(
                    idle.elapsed() < Duration::from_secs(10),
                    "round {round}: the wait session was never given back"
                );
                tokio::task::yield_now().await;
            }
            let blocker = ModelSession {
                server: Arc::clone(&server),
                id: u64::MAX,
            };
            assert!(blocker.take(lanes.connector().resource("k")));
            let waiting = tokio::spawn({
                let lanes = Arc::clone(&lanes);
                async move { lanes.acquire_wait_x("k", Duration::from_secs(10)).await }
            });
            let started = Instant::now();
            while !lanes.claims.is_claimed(&lanes.connector().resource("k")) {
                assert!(
                    !waiting.is_finished() && started.elapsed() < Duration::from_secs(10),
                    "round {round}: the wait ended, or never claimed the key"
                );
                tokio::task::yield_now().await;
            }
            drop(blocker);
            let held = waiting
                .await
                .unwrap()
                .unwrap()
                .expect("granted to the wait");
            held.handle.release().await.unwrap();
            let again = lanes.try_acquire_x("k").await.unwrap();
            let again =
                again.unwrap_or_else(|| panic!("round {round}: still claimed after the release"));
            again.handle.release().await.unwrap();
        }
    }

    /// A lane session dies with the runtime it was opened on (whose reactor drives its
    /// socket): the lock's lost token fires, and the backend keeps working from another
    /// runtime.
    #[test]
    fn a_lane_stopped_with_its_runtime_reports_its_locks_lost() {
        let server = Arc::new(Server::default());
        let first = tokio::runtime::Runtime::new().unwrap();
        let lanes = first.block_on(model_lanes(&server, 1, 1));
        let second = tokio::runtime::Runtime::new().unwrap();
        let held = second
            .block_on(lanes.try_acquire_x("k"))
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
            let again = lanes.try_acquire_x("k").await.unwrap().expect("a new lane");
            assert!(!again.lost.is_cancelled());
            again.handle.release().await.unwrap();
            // The lost lock's release reports nothing of its own.
            held.handle.release().await.unwrap();
        });
    }

    /// A lane used steadily from a runtime other than its session's moves its session there
    /// once idle (a fresh session, opened on the caller's runtime): its socket's answers no
    /// longer cross threads, and its locks no longer end with the runtime it was opened on.
    #[test]
    fn a_lane_used_steadily_from_another_runtime_moves_its_session_there() {
        let server = Arc::new(Server::default());
        let first = tokio::runtime::Runtime::new().unwrap();
        let lanes = first.block_on(model_lanes(&server, 1, 0));
        let before = server.sessions_opened();
        let second = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        second.block_on(async {
            for _ in 0..crate::session::lane::REHOME_AFTER {
                let held = lanes.try_acquire_x("k").await.unwrap().expect("free");
                held.handle.release().await.unwrap();
            }
        });
        assert_eq!(
            server.sessions_opened(),
            before + 1,
            "one session opened on the caller's runtime"
        );
        let held = second
            .block_on(lanes.try_acquire_x("k"))
            .unwrap()
            .expect("free");
        drop(first);
        assert!(
            !held.lost.is_cancelled(),
            "the lane's session lives on the runtime that uses it"
        );
        second.block_on(held.handle.release()).unwrap();
        assert!(server.locks.lock().unwrap().is_empty());
    }

    /// A lane shared by runtimes taking turns keeps its session (each move would cost a
    /// connection), and so does a lane holding a lock, however long it is used from elsewhere.
    #[test]
    fn a_lane_used_by_runtimes_in_turn_or_holding_a_lock_keeps_its_session() {
        let server = Arc::new(Server::default());
        let first = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let lanes = first.block_on(model_lanes(&server, 1, 0));
        let before = server.sessions_opened();
        let second = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let cycle = |rt: &tokio::runtime::Runtime, key: &'static str| {
            let held = rt
                .block_on(lanes.try_acquire_x(key))
                .unwrap()
                .expect("free");
            rt.block_on(held.handle.release()).unwrap();
        };
        for _ in 0..2 * crate::session::lane::REHOME_AFTER {
            cycle(&second, "k");
            cycle(&first, "k");
        }
        assert_eq!(server.sessions_opened(), before, "no session opened");
        // A lock held on the lane: its session stays, whatever runs from elsewhere.
        let pinned = first
            .block_on(lanes.try_acquire_x("held"))
            .unwrap()
            .expect("free");
        for _ in 0..2 * crate::session::lane::REHOME_AFTER {
            cycle(&second, "k");
        }
        assert_eq!(server.sessions_opened(), before, "no session opened");
        assert!(!pinned.lost.is_cancelled());
        first.block_on(pinned.handle.release()).unwrap();
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
            async move { lanes.acquire_wait_x("k", Duration::from_secs(10)).await }
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

    /// Readers and writers on one lane session (connections=1, as a model server would let
    /// the session re-enter in any mode): readers share, hold the server's shared lock once,
    /// and a writer is kept out, tried or waiting, until the last reader has let go.
    #[tokio::test]
    async fn readers_and_a_writer_on_one_lane_session_exclude_each_other() {
        let server = Arc::new(Server::default());
        let lanes = Arc::new(model_lanes(&server, 1, 1).await);
        let id = lanes.connector().resource("k");
        let mut readers = Vec::new();
        for _ in 0..5 {
            readers.push(
                lanes
                    .try_acquire_s("k")
                    .await
                    .unwrap()
                    .expect("readers share"),
            );
        }
        assert_eq!(
            ModelSession::holders(&server, id),
            1,
            "one session holds it"
        );
        assert_eq!(
            server.locks.lock().unwrap()[&id]
                .owners
                .values()
                .sum::<u32>(),
            1
        );
        assert!(server.locks.lock().unwrap()[&id].shared);
        assert!(
            lanes.try_acquire_x("k").await.unwrap().is_none(),
            "a writer re-entered the readers' session"
        );
        let writer = tokio::spawn({
            let lanes = Arc::clone(&lanes);
            async move { lanes.acquire_wait_x("k", Duration::from_secs(10)).await }
        });
        crate::testing::spin_until("the writer waits", || lanes.claims.writer_waits(&id)).await;
        assert!(
            lanes.try_acquire_s("k").await.unwrap().is_none(),
            "a reader went ahead of the waiting writer"
        );
        let last = readers.pop().unwrap();
        for reader in readers {
            reader.handle.release().await.unwrap();
            assert!(!writer.is_finished(), "the writer got in beside a reader");
            assert!(
                server.locks.lock().unwrap().contains_key(&id),
                "the shared lock went while readers held it"
            );
        }
        last.handle.release().await.unwrap();
        let w = writer
            .await
            .unwrap()
            .unwrap()
            .expect("the writer follows the readers");
        assert!(!server.locks.lock().unwrap()[&id].shared);
        assert!(
            lanes.try_acquire_s("k").await.unwrap().is_none(),
            "a reader beside a writer"
        );
        w.handle.release().await.unwrap();
        assert!(server.locks.lock().unwrap().is_empty(), "nothing left held");
        assert!(lanes.claims.is_empty(), "no claim left");
    }

    /// A shared try goes to a lane that does not hold the resource yet, while there is one,
    /// so that the server sees it; and the lanes' shared locks end with their last reader.
    #[tokio::test]
    async fn shared_tries_spread_over_the_lanes() {
        let server = Arc::new(Server::default());
        let lanes = model_lanes(&server, 3, 0).await;
        let id = lanes.connector().resource("k");
        let mut readers = Vec::new();
        for n in 1..=3 {
            readers.push(lanes.try_acquire_s("k").await.unwrap().expect("share"));
            assert_eq!(
                ModelSession::holders(&server, id),
                n,
                "on a lane of its own"
            );
        }
        readers.push(lanes.try_acquire_s("k").await.unwrap().expect("share"));
        assert_eq!(
            ModelSession::holders(&server, id),
            3,
            "every lane holds it: joined"
        );
        for reader in readers {
            reader.handle.release().await.unwrap();
        }
        assert!(server.locks.lock().unwrap().is_empty(), "nothing left held");
    }

    /// Readers that wait natively each wait on a wait session, and get the key together once
    /// another session's writer lets go; a writer on another session is kept out meanwhile.
    #[tokio::test]
    async fn waiting_readers_share_once_a_writer_elsewhere_leaves() {
        let server = Arc::new(Server::default());
        let lanes = Arc::new(model_lanes(&server, 1, 4).await);
        let id = lanes.connector().resource("k");
        let blocker = ModelSession {
            server: Arc::clone(&server),
            id: u64::MAX,
        };
        assert!(blocker.take(id));
        let mut waiting = Vec::new();
        for _ in 0..3 {
            let lanes = Arc::clone(&lanes);
            waiting.push(tokio::spawn(async move {
                lanes
                    .acquire_wait("k", Mode::Shared, Duration::from_secs(10))
                    .await
            }));
        }
        tokio::time::sleep(Duration::from_millis(30)).await;
        assert!(
            waiting.iter().all(|w| !w.is_finished()),
            "a reader beside a writer"
        );
        drop(blocker);
        let mut readers = Vec::new();
        for w in waiting {
            readers.push(w.await.unwrap().unwrap().expect("granted"));
        }
        assert!(ModelSession::holders(&server, id) >= 1);
        let other = ModelSession {
            server: Arc::clone(&server),
            id: u64::MAX - 1,
        };
        assert!(!other.take(id), "a writer elsewhere beside the readers");
        for reader in readers {
            reader.handle.release().await.unwrap();
        }
        assert!(server.locks.lock().unwrap().is_empty(), "nothing left held");
        assert!(other.take(id));
    }

    // Permits.

    /// A permit try on a lane (a single try).
    async fn permit(
        lanes: &Lanes<crate::session::model::Model>,
        key: &str,
        n: u32,
    ) -> PermitAnswer<Acquired> {
        lanes
            .try_permit(key, n, &queue_of(key), false)
            .await
            .expect("the model answers")
    }

    fn queue_of(key: &str) -> String {
        crate::backend::PermitRequest::new(key, 1).queue_key()
    }

    fn granted(answer: PermitAnswer<Acquired>) -> Acquired {
        match answer {
            PermitAnswer::Granted { permit, .. } => permit,
            other => panic!("expected a permit, got {:?}", other.forget()),
        }
    }

    /// Many permits of one semaphore on one lane session (connections=1), taken and given
    /// back in a random order by the acquisitions of one backend (every provider on a clone
    /// of it shares the lane): the session is never granted a slot it holds already, so
    /// `max_count` holders are reached and never passed.
    #[tokio::test]
    async fn permits_on_one_lane_session_never_take_a_held_slot_again() {
        let server = Arc::new(Server::default());
        let lanes = model_lanes(&server, 1, 1).await;
        for n in [1u32, 2, 3, 7] {
            let key = format!("s{n}");
            let mut held = Vec::new();
            for round in 0..200 {
                if held.len() < n as usize && fastrand::bool() {
                    held.push(granted(permit(&lanes, &key, n).await));
                } else if held.len() == n as usize && fastrand::bool() {
                    assert_eq!(
                        permit(&lanes, &key, n).await.forget(),
                        PermitAnswer::Full,
                        "round {round}: a permit past the count"
                    );
                } else if !held.is_empty() {
                    let at = fastrand::usize(..held.len());
                    held.swap_remove(at).handle.release().await.unwrap();
                }
                let slots = ModelSession::slots(&server, &key);
                assert_eq!(
                    slots.len(),
                    held.len(),
                    "round {round}: slots and permits differ"
                );
                assert!(slots.keys().all(|slot| *slot < n));
            }
            while held.len() < n as usize {
                held.push(granted(permit(&lanes, &key, n).await));
            }
            assert_eq!(
                ModelSession::slots(&server, &key).len(),
                n as usize,
                "max_count reached"
            );
            for p in held {
                p.handle.release().await.unwrap();
            }
        }
        assert!(
            server.permits.lock().unwrap().is_empty(),
            "nothing left held"
        );
    }

    /// A try is one statement, whatever the count (`u32::MAX` included) and whether it finds
    /// a permit, the semaphore full, another count or the waiting mark; the release is one
    /// more.
    #[tokio::test]
    async fn a_permit_try_is_one_statement_whatever_the_count() {
        let server = Arc::new(Server::default());
        let lanes = model_lanes(&server, 2, 0).await;
        let statements = || server.statements.load(std::sync::atomic::Ordering::SeqCst);
        for n in [1, 1_000_000, u32::MAX] {
            let key = format!("big{n}");
            let before = statements();
            let first = granted(permit(&lanes, &key, n).await);
            assert_eq!(statements() - before, 1, "a granted try of {n}");
            if n == 1 {
                let before = statements();
                assert_eq!(permit(&lanes, &key, n).await.forget(), PermitAnswer::Full);
                assert_eq!(statements() - before, 1, "a full try");
            }
            let before = statements();
            assert_eq!(
                permit(&lanes, &key, 2).await.forget(),
                PermitAnswer::Conflict { recorded: n },
                "another count is refused while a permit is live"
            );
            assert_eq!(statements() - before, 1, "a refused try");
            let before = statements();
            first.handle.release().await.unwrap();
            assert_eq!(statements() - before, 1, "a release");
        }
    }

    /// The count record: the first holders' count refuses another until every permit taken
    /// with it is given back (or its session ended); then the other count is taken.
    #[tokio::test]
    async fn another_count_is_refused_until_every_permit_is_given_back() {
        let server = Arc::new(Server::default());
        let lanes = model_lanes(&server, 2, 0).await;
        let two = [
            granted(permit(&lanes, "k", 2).await),
            granted(permit(&lanes, "k", 2).await),
        ];
        assert_eq!(
            permit(&lanes, "k", 5).await.forget(),
            PermitAnswer::Conflict { recorded: 2 }
        );
        let [a, b] = two;
        a.handle.release().await.unwrap();
        assert_eq!(
            permit(&lanes, "k", 5).await.forget(),
            PermitAnswer::Conflict { recorded: 2 },
            "one permit of 2 is still live"
        );
        assert_eq!(
            ModelSession::slots(&server, "k").len(),
            1,
            "the refused try took nothing"
        );
        b.handle.release().await.unwrap();
        let five = granted(permit(&lanes, "k", 5).await);
        assert_eq!(
            permit(&lanes, "k", 2).await.forget(),
            PermitAnswer::Conflict { recorded: 5 }
        );
        five.handle.release().await.unwrap();
    }

    /// The waiting mark: while any session holds the semaphore's queue lock (a waiter at the
    /// head of the queue), a single try is answered full with a permit free, and a waiting
    /// try is served.
    #[tokio::test]
    async fn single_tries_are_full_while_a_waiter_holds_the_queue() {
        let server = Arc::new(Server::default());
        let lanes = model_lanes(&server, 1, 0).await;
        let queue = lanes.connector().resource(&queue_of("q"));
        let waiter = ModelSession {
            server: Arc::clone(&server),
            id: u64::MAX,
        };
        assert!(waiter.take(queue));
        assert_eq!(permit(&lanes, "q", 3).await.forget(), PermitAnswer::Full);
        assert!(
            ModelSession::slots(&server, "q").is_empty(),
            "nothing taken"
        );
        let served = lanes
            .try_permit("q", 3, &queue_of("q"), true)
            .await
            .unwrap();
        let served = granted(served);
        drop(waiter);
        let single = granted(permit(&lanes, "q", 3).await);
        // The queue lock held by the lane's own session marks the semaphore too.
        let own = lanes
            .try_acquire_x(&queue_of("q"))
            .await
            .unwrap()
            .expect("free");
        assert_eq!(permit(&lanes, "q", 3).await.forget(), PermitAnswer::Full);
        own.handle.release().await.unwrap();
        for p in [served, single] {
            p.handle.release().await.unwrap();
        }
    }

    /// A permit is lost with its lane's session: its lost token fires, and its slot is free
    /// on the server for others.
    #[tokio::test]
    async fn a_permit_is_lost_with_its_session() {
        let server = Arc::new(Server::default());
        let mut lane_settings = settings(1, 0);
        lane_settings.statement_timeout = Duration::from_millis(100);
        let lanes = model_lanes_with(&server, lane_settings).await;
        let held = granted(permit(&lanes, "s", 1).await);
        server
            .hang
            .lock()
            .unwrap()
            .insert(lanes.connector().resource("b"));
        lanes.try_acquire_x("b").await.unwrap_err();
        assert!(held.lost.is_cancelled(), "the permit was reported lost");
        assert!(
            ModelSession::slots(&server, "s").is_empty(),
            "its slot is free"
        );
        server.hang.lock().unwrap().clear();
        let again = granted(permit(&lanes, "s", 1).await);
        held.handle.release().await.unwrap();
        assert_eq!(
            ModelSession::slots(&server, "s").len(),
            1,
            "the lost permit's release freed nothing of another's"
        );
        again.handle.release().await.unwrap();
    }

    /// A permit try dropped while the server grants it gives the permit back; the lane's
    /// session, which keeps another permit, lives on.
    #[tokio::test]
    async fn a_permit_try_dropped_while_granted_gives_the_permit_back() {
        let server = Arc::new(Server::default());
        let lanes = model_lanes(&server, 1, 0).await;
        let kept = granted(permit(&lanes, "s", 2).await);
        server
            .slow_permits
            .store(true, std::sync::atomic::Ordering::SeqCst);
        for _ in 0..3 {
            let cut = tokio::time::timeout(Duration::from_millis(10), permit(&lanes, "s", 2));
            assert!(cut.await.is_err(), "the try answered before it was dropped");
            let started = Instant::now();
            while ModelSession::slots(&server, "s").len() != 1 {
                assert!(
                    started.elapsed() < Duration::from_secs(5),
                    "never given back"
                );
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
        assert!(!kept.lost.is_cancelled(), "the session was kept");
        kept.handle.release().await.unwrap();
        assert!(server.permits.lock().unwrap().is_empty());
    }

    /// A count of 0 is refused with a configuration error, and a count above the engine's
    /// bound too, naming the bound.
    #[tokio::test]
    async fn counts_out_of_the_engines_bound_are_refused() {
        let server = Arc::new(Server::default());
        let lanes = model_lanes(&server, 1, 0).await;
        let err = lanes
            .try_permit("s", 0, &queue_of("s"), false)
            .await
            .unwrap_err();
        assert_eq!(err.code(), "DistributedLock.Configuration", "{err}");
        assert!(err.to_string().contains("1 to 4294967295"), "{err}");
        assert_eq!(
            server.statements.load(std::sync::atomic::Ordering::SeqCst),
            0
        );
    }
}
