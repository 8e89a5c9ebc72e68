//! Follows the held locks of one [`RedlockBackend`](super::RedlockBackend) from one task: moves
//! each lock's deadline with its node locks' renewals, and fires its lost token once fewer
//! than a quorum of them are held.
//!
//! A task per lock, as before, cost a spawn on every acquisition and a wake-up on every
//! release, and either could cross threads: about 5 % of an uncontended Redlock acquire +
//! release on three loopback nodes. Here following a lock is a map insert, and ending it a map
//! removal. The driver looks at every lock each tick (the shortest of the locks' ticks, a
//! twentieth of the lease between 10 ms and 1 s, as the task per lock did); only a lock whose
//! tick is shorter than the one the driver sleeps wakes it. With no lock to follow for
//! [`IDLE`], the driver ends; the next lock starts another on its own runtime.
//!
//! If the driver stops for any other reason (its runtime shut down, a panic), the
//! [`DriverStop`] its future owns declares every lock it followed lost: nothing would tell
//! their holders any more.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::LockError;
use crate::backend::LeaseDeadline;

/// How long the driver runs on with no lock to follow.
const IDLE: Duration = Duration::from_secs(10);

/// One Redlock lock, as the driver follows it.
pub(super) struct Followed {
    /// Each node lock's lost token and local deadline (none: it lasts the lease).
    pub(super) nodes: Vec<(CancellationToken, Option<LeaseDeadline>)>,
    pub(super) quorum: usize,
    pub(super) lease: Duration,
    /// Fired once fewer than `quorum` node locks are held.
    pub(super) lost: CancellationToken,
    /// The `quorum`-th latest node deadline, less the drift.
    pub(super) deadline: LeaseDeadline,
}

/// Until when a lock can be counted on, as its node locks (`nodes`: each one's lost token and
/// local deadline) say at `now`: the `quorum`-th latest deadline of those still held, a node
/// lock without one counting as lasting `lease`, less the drift. `None` once fewer than
/// `quorum` are held.
pub(super) fn held_until(
    nodes: &[(CancellationToken, Option<LeaseDeadline>)],
    quorum: usize,
    lease: Duration,
    now: Instant,
) -> Option<Instant> {
    let alive: Vec<Instant> = nodes
        .iter()
        .filter(|(lost, _)| !lost.is_cancelled())
        .map(|(_, d)| d.as_ref().map_or(now + lease, LeaseDeadline::at))
        .filter(|at| *at > now)
        .collect();
    let at = super::redlock::nth_latest(alive, quorum)?;
    Some(at.checked_sub(super::redlock::drift(lease)).unwrap_or(now))
}

impl Followed {
    /// Moves the deadline to what the node locks say now; `false` when the lock is lost (or
    /// was declared lost elsewhere) and needs following no more.
    fn look(&self, now: Instant) -> bool {
        if self.lost.is_cancelled() {
            return false;
        }
        match held_until(&self.nodes, self.quorum, self.lease, now) {
            Some(at) => {
                self.deadline.set(at);
                true
            }
            None => false,
        }
    }
}

/// How often a lock of `lease` is looked at.
fn tick(lease: Duration) -> Duration {
    (lease / 20).clamp(Duration::from_millis(10), Duration::from_secs(1))
}

/// The locks one backend follows.
#[derive(Default)]
pub(super) struct Quorums {
    state: Mutex<State>,
    /// Wakes the driver when a lock needs a shorter tick than the one it sleeps.
    wake: Notify,
}

#[derive(Default)]
struct State {
    locks: HashMap<u64, Followed>,
    next_id: u64,
    /// The number of the running driver, if one runs; cleared when it stops.
    driver: Option<u64>,
    next_driver: u64,
    /// How long the running driver sleeps between two looks.
    sleeps: Option<Duration>,
}

impl Quorums {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Follows `lock` until [`Quorums::forget`]; returns its id. Starts a driver on the
    /// current runtime when none runs.
    pub(super) fn follow(self: &Arc<Self>, lock: Followed) -> Result<u64, LockError> {
        let every = tick(lock.lease);
        // A lock goes in only while a driver runs (under the lock its stop takes too), so none
        // is ever left unfollowed. Two rounds: a driver spawned on a runtime that is shutting
        // down stops at once.
        let mut lock = Some(lock);
        for _ in 0..2 {
            let mut state = self.state();
            if state.driver.is_some() {
                let id = state.next_id;
                state.next_id = state.next_id.wrapping_add(1);
                if let Some(lock) = lock.take() {
                    state.locks.insert(id, lock);
                }
                if state.sleeps.is_none_or(|sleeps| every < sleeps) {
                    state.sleeps = Some(every);
                    drop(state);
                    self.wake.notify_one();
                }
                return Ok(id);
            }
            let runtime = tokio::runtime::Handle::try_current().map_err(|_| {
                LockError::config("dlock runs on Tokio: acquire locks from within a Tokio runtime")
            })?;
            let number = state.next_driver;
            state.next_driver = state.next_driver.wrapping_add(1);
            state.driver = Some(number);
            state.sleeps = None;
            drop(state);
            let stop = DriverStop {
                quorums: Arc::clone(self),
                number,
            };
            // Spawned outside the lock: on a runtime that is shutting down, the future (and
            // its stop) is dropped at once, inside `spawn`.
            drop(runtime.spawn(drive(Arc::clone(self), stop)));
        }
        Err(LockError::unavailable(
            super::redlock::NAME,
            "the Tokio runtime is shutting down: the lock's node locks could not be followed",
            None,
        ))
    }

    /// Stops following lock `id` (released, or its guard dropped). No wake-up needed.
    pub(super) fn forget(&self, id: u64) {
        let lock = self.state().locks.remove(&id);
        drop(lock);
    }

    /// Looks at every lock once: fires the lost tokens of those lost and stops following
    /// them. Answers how long to sleep until the next look, or `None` when the driver ends
    /// (nothing followed for [`IDLE`]).
    fn look(
        &self,
        now: Instant,
        number: u64,
        idle_since: &mut Option<Instant>,
    ) -> Option<Duration> {
        let mut lost = Vec::new();
        let mut state = self.state();
        state.locks.retain(|_, lock| {
            let held = lock.look(now);
            if !held {
                lost.push(lock.lost.clone());
            }
            held
        });
        let sleeps = if state.locks.is_empty() {
            let since = *idle_since.get_or_insert(now);
            if now.saturating_duration_since(since) >= IDLE && state.driver == Some(number) {
                state.driver = None;
                state.sleeps = None;
                drop(state);
                lost.iter().for_each(CancellationToken::cancel);
                return None;
            }
            IDLE
        } else {
            *idle_since = None;
            state
                .locks
                .values()
                .map(|lock| tick(lock.lease))
                .min()
                .unwrap_or(IDLE)
        };
        state.sleeps = Some(sleeps);
        drop(state);
        lost.iter().for_each(CancellationToken::cancel);
        Some(sleeps)
    }

    #[cfg(test)]
    fn followed(&self) -> usize {
        self.state().locks.len()
    }
}

/// Owned by the driver's future: when the driver stops without ending by itself (its runtime
/// shut down, a panic), every lock it followed is declared lost, and the next lock starts a new
/// driver.
struct DriverStop {
    quorums: Arc<Quorums>,
    number: u64,
}

impl Drop for DriverStop {
    fn drop(&mut self) {
        let orphans: Vec<Followed> = {
            let mut state = self.quorums.state();
            if state.driver != Some(self.number) {
                return;
            }
            state.driver = None;
            state.sleeps = None;
            state.locks.drain().map(|(_, lock)| lock).collect()
        };
        if !orphans.is_empty() {
            tracing::warn!(
                locks = orphans.len(),
                "the redlock quorum task stopped (its Tokio runtime shut down?): its locks are presumed lost"
            );
        }
        for lock in orphans {
            lock.lost.cancel();
        }
    }
}

async fn drive(quorums: Arc<Quorums>, stop: DriverStop) {
    let mut idle_since = None;
    while let Some(sleeps) = quorums.look(Instant::now(), stop.number, &mut idle_since) {
        let _ = tokio::time::timeout(sleeps, quorums.wake.notified()).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn followed(nodes: Vec<(CancellationToken, Option<LeaseDeadline>)>) -> Followed {
        Followed {
            nodes,
            quorum: 2,
            lease: Duration::from_millis(200),
            lost: CancellationToken::new(),
            deadline: LeaseDeadline::new(Instant::now()),
        }
    }

    /// A lock is told lost once two of its three node locks are, and no sooner; a released
    /// lock is followed no more.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_lock_is_lost_with_its_quorum_of_node_locks() {
        let quorums = Arc::new(Quorums::default());
        let nodes: Vec<CancellationToken> = (0..3).map(|_| CancellationToken::new()).collect();
        let lock = followed(nodes.iter().map(|t| (t.clone(), None)).collect());
        let lost = lock.lost.clone();
        quorums.follow(lock).unwrap();
        let other = quorums
            .follow(followed(vec![(CancellationToken::new(), None); 3]))
            .unwrap();
        nodes[0].cancel();
        // Several ticks (10 ms each): one node lock lost leaves a quorum.
        tokio::time::sleep(Duration::from_millis(60)).await;
        assert!(!lost.is_cancelled());
        nodes[1].cancel();
        tokio::time::timeout(Duration::from_secs(5), lost.cancelled())
            .await
            .expect("the lock is told lost");
        assert_eq!(quorums.followed(), 1);
        quorums.forget(other);
        assert_eq!(quorums.followed(), 0);
    }

    /// The deadline follows the node deadlines: the second latest of three, less the drift.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_deadline_moves_with_the_node_deadlines() {
        let quorums = Arc::new(Quorums::default());
        let now = Instant::now();
        let secs = |s| now + Duration::from_secs(s);
        let nodes = [secs(100), secs(300), secs(200)].map(LeaseDeadline::new);
        let lock = followed(
            nodes
                .iter()
                .map(|d| (CancellationToken::new(), Some(d.clone())))
                .collect(),
        );
        let deadline = lock.deadline.clone();
        quorums.follow(lock).unwrap();
        let drift = super::super::redlock::drift(Duration::from_millis(200));
        let expected = secs(200) - drift;
        tokio::time::timeout(Duration::from_secs(5), async {
            while deadline.at() != expected {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .expect("the deadline moved to the quorum's");
        nodes[2].set(secs(400));
        let expected = secs(300) - drift;
        tokio::time::timeout(Duration::from_secs(5), async {
            while deadline.at() != expected {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .expect("the deadline moved with a renewal");
    }

    /// A driver whose runtime shuts down declares its locks lost, and the next lock starts a
    /// driver on its own runtime.
    #[test]
    fn locks_are_lost_when_the_drivers_runtime_stops() {
        let quorums = Arc::new(Quorums::default());
        let first = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let lock = followed(vec![(CancellationToken::new(), None); 3]);
        let lost = lock.lost.clone();
        first.block_on(async { quorums.follow(lock).unwrap() });
        assert!(!lost.is_cancelled());
        first.shutdown_timeout(Duration::from_secs(5));
        assert!(lost.is_cancelled(), "the holder was not told");
        let second = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        second.block_on(async {
            let nodes: Vec<CancellationToken> = (0..3).map(|_| CancellationToken::new()).collect();
            let lock = followed(nodes.iter().map(|t| (t.clone(), None)).collect());
            let lost = lock.lost.clone();
            quorums.follow(lock).unwrap();
            nodes[0].cancel();
            nodes[2].cancel();
            tokio::time::timeout(Duration::from_secs(5), lost.cancelled())
                .await
                .expect("a new driver follows the lock");
        });
    }
}
