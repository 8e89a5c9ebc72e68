//! The guard of a held lock.

use std::fmt;
use std::sync::Arc;
use std::task::Poll;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use crate::LockError;
use crate::backend::{BoxFuture, HeldLock, LeaseControl, LeaseDeadline, ReleaseOutcome};
use crate::metrics::{Hold, Metrics};
use crate::table::Slot;

/// A held lock. Dropping it releases the lock.
///
/// The guard is the proof of ownership: the lock is held from the moment the guard is returned
/// until [`release`](LockGuard::release) completes or the guard is dropped, unless it is lost
/// before that (see [`lost_token`](LockGuard::lost_token)).
///
/// **Release on drop is deferred**: dropping the guard starts the release on the Tokio runtime
/// the lock was acquired on and returns at once; other processes see the lock free a moment
/// later (a round trip to the store). Other tasks of this process that wait for the same key
/// through the same provider are served in order once the store has the lock back. Call
/// [`release`](LockGuard::release) to wait for the release and see its outcome.
#[must_use = "the lock is released as soon as the guard is dropped"]
pub struct LockGuard {
    /// The handle and the table slot; taken only by the release or the drop that consume the
    /// guard.
    state: Option<Held>,
    /// The key: the lock's, or the semaphore's for a permit.
    key: Arc<str>,
    fencing_token: Option<u64>,
    lost: CancellationToken,
    /// For a leased lock, the local deadline past which it is presumed lost.
    lease_deadline: Option<LeaseDeadline>,
    acquired_at: Instant,
    runtime: tokio::runtime::Handle,
    metrics: Arc<Metrics>,
    /// The lock's record with the metrics: the watch on the lost token, which counts the loss
    /// when it is detected, and what inspection shows.
    hold: Hold,
}

struct Held {
    handle: Box<dyn HeldLock>,
    // Dropped after the store has the lock back, so local waiters queue behind the release.
    // `None` for a permit of a store's native semaphore, which takes no key of the table.
    slot: Option<Slot>,
}

impl LockGuard {
    /// The guard of a lock or read lock whose table slot is `slot` (and whose key is the
    /// slot's).
    pub(crate) fn new(
        slot: Slot,
        acquired: crate::backend::Acquired,
        metrics: Arc<Metrics>,
        runtime: tokio::runtime::Handle,
    ) -> Self {
        let key = Arc::clone(slot.key());
        let shared = slot.is_shared();
        LockGuard::holding(Some(slot), key, shared, None, acquired, metrics, runtime)
    }

    /// The guard of a permit of the semaphore `key` of `max_count` permits: the permit of a
    /// store's native semaphore (no `slot`), or a slot lock of the slot scheme (its `slot`
    /// in the table).
    pub(crate) fn permit(
        slot: Option<Slot>,
        key: Arc<str>,
        max_count: u32,
        acquired: crate::backend::Acquired,
        metrics: Arc<Metrics>,
        runtime: tokio::runtime::Handle,
    ) -> Self {
        LockGuard::holding(
            slot,
            key,
            false,
            Some(max_count),
            acquired,
            metrics,
            runtime,
        )
    }

    fn holding(
        slot: Option<Slot>,
        key: Arc<str>,
        shared: bool,
        semaphore: Option<u32>,
        acquired: crate::backend::Acquired,
        metrics: Arc<Metrics>,
        runtime: tokio::runtime::Handle,
    ) -> Self {
        let shown = crate::metrics::Shown {
            key: Arc::clone(&key),
            since: std::time::SystemTime::now(),
            fencing_token: acquired.fencing_token,
            lease_deadline: acquired.lease_deadline.clone(),
            lost: acquired.lost.clone(),
            shared,
            semaphore,
        };
        metrics.hold_started(metrics.backend(), &key);
        let hold = metrics.watch(&runtime, shown);
        LockGuard {
            hold,
            fencing_token: acquired.fencing_token,
            lost: acquired.lost,
            lease_deadline: acquired.lease_deadline,
            acquired_at: Instant::now(),
            runtime,
            metrics,
            key,
            state: Some(Held {
                handle: acquired.handle,
                slot,
            }),
        }
    }

    /// The key this guard holds: the lock's key, or for a permit of a semaphore
    /// ([`acquire_semaphore`](crate::LockProvider::acquire_semaphore)) the semaphore's key.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The table, key and mode of the held lock, for [`run_holding`](crate::run_holding):
    /// `None` once released, and for a permit of a store's native semaphore (which takes no
    /// key of the table: holding a permit never makes another acquisition reentrant).
    pub(crate) fn held_entry(&self) -> Option<(usize, Arc<str>, bool)> {
        let slot = self.state.as_ref()?.slot.as_ref()?;
        Some((slot.table_id(), Arc::clone(slot.key()), slot.is_shared()))
    }

    /// The key, shared (for errors and the end of the hold).
    fn shared_key(&self) -> Arc<str> {
        Arc::clone(&self.key)
    }

    /// The fencing token of this acquisition: strictly greater than the token of every earlier
    /// holder of the same key. Pass it to the resource the lock protects so it can refuse
    /// writes from a holder that has since lost the lock. `None` when the backend issues no
    /// tokens (or they are not enabled for it).
    pub fn fencing_token(&self) -> Option<u64> {
        self.fencing_token
    }

    /// A token that is cancelled when ownership is lost: the lock's connection died, its lease
    /// could not be renewed in time, or someone else took it over. Long-running work under the
    /// lock should stop when it fires (`token.cancelled().await` in a `select!`).
    ///
    /// The token is cancelled by a task (the renewal, or a timer at the lease's local
    /// deadline), or by a check that reads the clock ([`is_lost`](LockGuard::is_lost),
    /// [`LostSignal`](crate::LostSignal)). **After a pause of the process** past the lease, the
    /// work may take its next step before that task has run again, and see the token not yet
    /// cancelled: check [`is_lost`](LockGuard::is_lost) or a
    /// [`lost_signal`](LockGuard::lost_signal) before each step that must not run without the
    /// lock. (Where dlock drives the work's future itself, in
    /// [`with_lock`](crate::LockProvider::with_lock),
    /// [`run_exclusive`](crate::LockProvider::run_exclusive), [`Leader`](crate::Leader), the
    /// axum layer and `#[distributed_lock]`, it checks the clock before each poll of the work,
    /// and cancels the token first; a pause that falls inside a poll, after that check, is
    /// seen by the token at the next poll.)
    ///
    /// The token is not cancelled by an ordinary release or drop of the guard.
    pub fn lost_token(&self) -> &CancellationToken {
        &self.lost
    }

    /// The lost token and the lease's local deadline, as one cheap value to hand to the tasks
    /// of the work done under the lock: its [`is_lost`](crate::LostSignal::is_lost) reads the
    /// clock, as [`is_lost`](LockGuard::is_lost) does. See [`LostSignal`](crate::LostSignal).
    pub fn lost_signal(&self) -> crate::LostSignal {
        crate::LostSignal::new(self.lost.clone(), self.lease_deadline.clone())
    }

    /// Whether the lock is known to be lost.
    ///
    /// For a leased lock (SQLite, Redis, Redlock, etcd) this also compares the clock with the
    /// lease: a holder that was paused past the point where its lease could no longer be
    /// counted on (a stopped process, a suspended VM, a long pause of its thread) finds the
    /// lock lost here at once, even before the renewal task has run again, and the
    /// [`lost_token`](LockGuard::lost_token) fires with it. A session lock (PostgreSQL,
    /// MySQL/MariaDB, SQL Server, Oracle) has no lease: a paused process keeps it while the
    /// server keeps its session, and learns of a loss when its keepalive runs again.
    pub fn is_lost(&self) -> bool {
        if self.lost.is_cancelled() {
            return true;
        }
        if self.lease_ran_out() {
            tracing::warn!(
                key = self.key(),
                backend = self.backend(),
                "the lock's lease ran out with no renewal confirmed (was the process paused?); it is presumed lost"
            );
            self.mark_lost();
            return true;
        }
        false
    }

    /// Runs `work` to its end, checking the lease's clock ([`is_lost`](LockGuard::is_lost))
    /// before each poll of it: after a pause past the lease, the lost token is cancelled
    /// before the work's next step, whatever task would have cancelled it.
    pub(crate) async fn checked<F: std::future::Future>(&self, work: F) -> F::Output {
        let mut work = std::pin::pin!(work);
        std::future::poll_fn(|cx| {
            let _ = self.is_lost();
            work.as_mut().poll(cx)
        })
        .await
    }

    /// Fires the lost token for a loss this guard found, and counts it now (the metrics'
    /// watch would count it a moment later).
    fn mark_lost(&self) {
        self.lost.cancel();
        self.metrics.lost(self.hold, self.backend(), self.key());
    }

    /// Whether the lease's local deadline has passed (never for session locks). Read by
    /// [`is_lost`](LockGuard::is_lost), which acts on it, and by `Debug`, which must not.
    fn lease_ran_out(&self) -> bool {
        self.lease_deadline
            .as_ref()
            .is_some_and(LeaseDeadline::has_passed)
    }

    /// The name of the backend that holds the lock.
    pub fn backend(&self) -> &'static str {
        self.metrics.backend()
    }

    /// When the lock was acquired.
    pub fn acquired_at(&self) -> Instant {
        self.acquired_at
    }

    /// Releases the lock and waits until the store has it back.
    ///
    /// Returns [`LockError::Lost`] when the lock was lost while it was held (so the work done
    /// under it may have overlapped with another holder's); the loss is then reported here
    /// once, not also as the failure of the release on a dead connection. A leased lock whose
    /// lease could no longer be counted on when the release began (see
    /// [`is_lost`](LockGuard::is_lost)) counts as lost, whatever the store then answers.
    ///
    /// # Cancel safety
    ///
    /// Dropping the returned future before it completes still releases the lock, in the
    /// background, as dropping the guard does.
    pub async fn release(self) -> Result<(), LockError> {
        let key = self.shared_key();
        let lost = self.lost.clone();
        let outcome = self.give_back().await;
        if lost.is_cancelled() {
            // The backend's own account of the loss, when it gave one, says more.
            return Err(match outcome {
                Err(err @ LockError::Lost { .. }) => err,
                _ => LockError::Lost {
                    key,
                    reason: "ownership was lost before the release".to_owned(),
                },
            });
        }
        match outcome? {
            ReleaseOutcome::Released => Ok(()),
            ReleaseOutcome::AlreadyReleased | ReleaseOutcome::NotOwned => Err(LockError::Lost {
                key,
                reason: "the store no longer held the lock for this owner".to_owned(),
            }),
        }
    }

    /// Releases the lock, like [`release`](LockGuard::release), and says what the store
    /// found: [`Released`](ReleaseOutcome::Released), or, for a lock that was lost,
    /// [`AlreadyReleased`](ReleaseOutcome::AlreadyReleased) (nothing under the key: its lease
    /// ran out, its session ended) or [`NotOwned`](ReleaseOutcome::NotOwned) (another owner
    /// holds it now, and was left alone). Session-lock backends, whose locks end with their
    /// session, answer `Released` or an error.
    ///
    /// The outcome is the store's: a leased lock presumed lost because its local deadline
    /// passed is still `Released` if the store had it. Use [`release`](LockGuard::release) to
    /// have every loss reported as [`LockError::Lost`].
    ///
    /// # Cancel safety
    ///
    /// As [`release`](LockGuard::release): a dropped future still releases the lock, in the
    /// background.
    pub async fn release_outcome(self) -> Result<ReleaseOutcome, LockError> {
        self.give_back().await
    }

    /// Gives the lock back, waits for the store, then frees the local slot.
    async fn give_back(mut self) -> Result<ReleaseOutcome, LockError> {
        // Before the release: its own round trip must not count against the lease.
        let _ = self.is_lost();
        let Some(Held { handle, slot }) = self.state.take() else {
            return Ok(ReleaseOutcome::AlreadyReleased);
        };
        let key = Arc::clone(&self.key);
        let span = tracing::debug_span!("dlock.release", key = &*key, backend = self.backend());
        let mut releasing = Releasing {
            future: Some(handle.release_outcome()),
            slot,
            end: Some(self.hold_end(key)),
            runtime: self.runtime.clone(),
        };
        let outcome = crate::metrics::in_span(
            span,
            std::future::poll_fn(|cx| match releasing.future.as_mut() {
                Some(future) => future.as_mut().poll(cx),
                None => Poll::Ready(Ok(ReleaseOutcome::AlreadyReleased)),
            }),
        )
        .await;
        if !matches!(outcome, Ok(ReleaseOutcome::Released) | Err(_)) {
            self.lost.cancel();
        }
        releasing.future = None;
        drop(releasing);
        outcome
    }

    /// The lease control of this lock, or the error for a backend without leases.
    fn lease_control(&self, operation: &'static str) -> Result<&dyn LeaseControl, LockError> {
        self.state
            .as_ref()
            .and_then(|held| held.handle.lease_control())
            .ok_or_else(|| {
                LockError::unsupported(
                    self.backend(),
                    operation,
                    "this backend's locks live with a server session, not a lease",
                )
            })
    }

    /// The error for a lock found lost by a lease operation.
    fn lost_error(&self, reason: &str) -> LockError {
        LockError::Lost {
            key: self.shared_key(),
            reason: reason.to_owned(),
        }
    }

    /// Sets the lease of a leased lock (SQLite, Redis) to `lease` from now, if this guard
    /// still holds it, and makes `lease` the lease its renewals ask for from then on. The
    /// command is owner-checked (Redis: `SET … IFEQ … PX` where the server has it, else a
    /// script): it never extends a lock another owner holds.
    ///
    /// Errors with [`LockError::Lost`] when the lock was lost (the lost token then fires),
    /// [`LockError::Config`] when `lease` is out of the backend's bounds, and
    /// [`LockError::Unsupported`] on backends whose locks are session locks (PostgreSQL,
    /// MySQL, SQL Server, Oracle).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), dlock::LockError> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let url = format!("sqlite://{}/locks.db", dir.path().display());
    /// use std::time::Duration;
    /// let locks = dlock::LockProvider::connect(&url).await?;
    /// // A lock that expires by itself after 10 s unless the job shows it is still alive.
    /// let guard = locks
    ///     .lock("jobs:import")
    ///     .lease(Duration::from_secs(10))
    ///     .renewal(false)
    ///     .try_acquire()
    ///     .await?;
    /// // ... a batch done: ten more seconds, if this guard still holds the lock.
    /// guard.extend(Duration::from_secs(10)).await?;
    /// assert!(guard.remaining_lease().unwrap() > Duration::from_secs(5));
    /// assert!(guard.verify_still_held().await?);
    /// guard.release().await?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe: a dropped future may or may not have extended the lease. The lock
    /// stays held either way, and renewals go on.
    pub async fn extend(&self, lease: Duration) -> Result<(), LockError> {
        let control = self.lease_control("extend")?;
        if self.is_lost() {
            return Err(self.lost_error("the lock was lost before it could be extended"));
        }
        if control.extend(lease).await? {
            Ok(())
        } else {
            self.mark_lost();
            Err(self.lost_error(
                "the store no longer held the lock for this owner when it was extended",
            ))
        }
    }

    /// Asks the store, in one round trip, whether this guard still holds its leased lock.
    /// `Ok(false)` (and the lost token fires) when the lock is gone or held by another owner,
    /// or when it is already known to be lost (then without a round trip).
    ///
    /// Errors with [`LockError::Unsupported`] on backends whose locks are session locks.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a read.
    pub async fn verify_still_held(&self) -> Result<bool, LockError> {
        let control = self.lease_control("verify_still_held")?;
        if self.is_lost() {
            return Ok(false);
        }
        let held = control.verify_still_held().await?;
        if !held {
            self.mark_lost();
        }
        Ok(held)
    }

    /// How long this holder may still count on its leased lock without another confirmed
    /// renewal: the time to the lease's local deadline, four fifths of the lease after the
    /// last confirmed renewal (or the acquisition) was sent. Read locally, with no round trip;
    /// zero once the lock is lost. `None` for session locks, which have no lease.
    pub fn remaining_lease(&self) -> Option<Duration> {
        let deadline = self.lease_deadline.as_ref()?;
        if self.lost.is_cancelled() {
            return Some(Duration::ZERO);
        }
        Some(deadline.at().saturating_duration_since(Instant::now()))
    }

    /// Stops renewing a leased lock without releasing it. The lock then expires with its
    /// lease (see [`remaining_lease`](LockGuard::remaining_lease)), and the lost token fires
    /// at its local deadline; dropping or releasing the guard still gives it back at once.
    ///
    /// Errors with [`LockError::Unsupported`] on backends whose locks are session locks.
    pub fn stop_renewal(&self) -> Result<(), LockError> {
        self.lease_control("stop_renewal")?.stop_renewal();
        Ok(())
    }

    /// Starts renewing a leased lock whose renewals are off: one taken with
    /// [`renewal(false)`](crate::LockBuilder::renewal) (or a provider's
    /// [`renewal(false)`](crate::ProviderBuilder::renewal)), or stopped with
    /// [`stop_renewal`](LockGuard::stop_renewal). The first renewal is sent at once, then
    /// they follow the backend's schedule (every third of the lease), and a failed renewal
    /// fires the lost token as for any renewed lock. Idempotent: on a lock that is renewed
    /// already, it does nothing.
    ///
    /// A job that knows it is short takes its lock without renewals (nothing runs for it
    /// in the background); once it finds it will run longer, it starts them:
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), dlock::LockError> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let url = format!("sqlite://{}/locks.db", dir.path().display());
    /// use std::time::Duration;
    /// let locks = dlock::LockProvider::connect(&url).await?;
    /// let guard = locks
    ///     .lock("jobs:import")
    ///     .lease(Duration::from_secs(10))
    ///     .renewal(false)
    ///     .try_acquire()
    ///     .await?;
    /// // ... more work than expected: keep the lock for as long as it takes.
    /// guard.start_renewal()?;
    /// guard.release().await?;
    /// # Ok(()) }
    /// ```
    ///
    /// Errors with [`LockError::Lost`] when the lock is lost already, or its lease's local
    /// deadline has passed (the store may have let another owner in: renewals never revive
    /// such a lease; the lost token fires), and with [`LockError::Unsupported`] on backends
    /// whose locks are session locks (PostgreSQL, MySQL, SQL Server, Oracle: they are held as
    /// long as their session, with nothing to renew).
    pub fn start_renewal(&self) -> Result<(), LockError> {
        let control = self.lease_control("start_renewal")?;
        if self.is_lost() {
            return Err(self.lost_error("the lock was lost before its renewals could start"));
        }
        if control.start_renewal()? {
            Ok(())
        } else {
            self.mark_lost();
            Err(self.lost_error(
                "the lock's lease could no longer be counted on when its renewals were to start",
            ))
        }
    }
}

/// A release in flight. If its owner stops polling it (the `release` future was dropped), the
/// rest of the release runs in the background, and the local slot is freed after it.
struct Releasing {
    future: Option<BoxFuture<'static, Result<ReleaseOutcome, LockError>>>,
    slot: Option<Slot>,
    end: Option<HoldEnd>,
    runtime: tokio::runtime::Handle,
}

impl Drop for Releasing {
    fn drop(&mut self) {
        let (slot, end) = (self.slot.take(), self.end.take());
        if let Some(future) = self.future.take() {
            let rest = async move {
                let _ = future.await;
                drop(slot);
                drop(end);
            };
            // Refused everywhere (its runtimes are shutting down), the release's future is
            // dropped: the backend's handle ends the lock from its `Drop`.
            drop(crate::detach::spawn_first(runtimes(&self.runtime), rest));
        }
    }
}

/// The guard's runtime, then the current one if that is another.
fn runtimes(guard: &tokio::runtime::Handle) -> impl Iterator<Item = tokio::runtime::Handle> {
    let current = tokio::runtime::Handle::try_current()
        .ok()
        .filter(|current| current.id() != guard.id());
    std::iter::once(guard.clone()).chain(current)
}

/// The end of a hold, recorded when this is dropped: after the release has run, so that a
/// loss the release itself finds (a row or key taken over) is counted too (the loss is counted
/// once: at detection, or here). Dropped unrun with a background release whose runtime is
/// gone, it records then.
struct HoldEnd {
    metrics: Arc<Metrics>,
    hold: Hold,
    key: Arc<str>,
    backend: &'static str,
    held: std::time::Duration,
    lost: CancellationToken,
}

impl Drop for HoldEnd {
    fn drop(&mut self) {
        self.metrics.held(self.backend, &self.key, self.held);
        if self.lost.is_cancelled() {
            self.metrics.lost(self.hold, self.backend, &self.key);
        }
        self.metrics.end(self.hold);
    }
}

impl LockGuard {
    /// The hold ends now (its duration is measured here); it is recorded once the release is
    /// done (once: the guard's state is gone).
    fn hold_end(&self, key: Arc<str>) -> HoldEnd {
        HoldEnd {
            metrics: Arc::clone(&self.metrics),
            hold: self.hold,
            key,
            backend: self.backend(),
            held: self.acquired_at.elapsed(),
            lost: self.lost.clone(),
        }
    }
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        if let Some(Held { handle, slot }) = self.state.take() {
            let key = Arc::clone(&self.key);
            let end = self.hold_end(Arc::clone(&key));
            let backend = self.backend();
            let task = async move {
                if let Err(err) = handle.release().await {
                    tracing::warn!(%key, backend, error = %err, "background release of a dropped lock guard failed");
                }
                drop(slot);
                drop(end);
            };
            // On the guard's runtime, else the current one. Refused by both (they are shutting
            // down: the guard went with its runtime), the task is dropped unrun, and the
            // backend's handle ends the lock from its `Drop` (see `HeldLock`).
            drop(crate::detach::spawn_first(runtimes(&self.runtime), task));
        }
    }
}

impl fmt::Debug for LockGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockGuard")
            .field("key", &self.key())
            .field("backend", &self.backend())
            .field("fencing_token", &self.fencing_token)
            .field("lost", &(self.lost.is_cancelled() || self.lease_ran_out()))
            .field("released", &self.state.is_none())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::sync::Notify;

    use crate::testing::{MemoryBackend, Recorder};
    use crate::{LockError, LockProvider};

    /// Waits for a notification, failing (not hanging) when it never comes.
    async fn within(notified: impl std::future::Future<Output = ()>) {
        tokio::time::timeout(Duration::from_secs(10), notified)
            .await
            .expect("the release never ran");
    }

    fn provider(backend: &MemoryBackend, recorder: &Recorder) -> LockProvider {
        LockProvider::builder(backend.clone())
            .meter(recorder.meter())
            .build()
    }

    /// (lock_type, count) of the hold-duration points and the lost counter.
    fn holds_and_losses(recorder: &Recorder) -> (u64, u64) {
        let sum = |name| {
            recorder
                .points(name)
                .iter()
                .inspect(|(attrs, _)| {
                    assert_eq!(attrs, &[("lock_type".to_owned(), "memory".to_owned())]);
                })
                .map(|(_, n)| n)
                .sum()
        };
        (
            sum("distributed_lock.hold_duration"),
            sum("distributed_lock.lost"),
        )
    }

    #[tokio::test]
    async fn a_guard_tells_what_it_holds_and_releases_it() {
        let backend = MemoryBackend::default();
        let recorder = Recorder::new();
        let locks = provider(&backend, &recorder);
        let before = std::time::Instant::now();
        let guard = locks.try_acquire("a").await.unwrap();
        assert!(guard.acquired_at() >= before && guard.acquired_at() <= std::time::Instant::now());
        assert_eq!(guard.key(), "a");
        assert_eq!(guard.backend(), "memory");
        assert_eq!(guard.fencing_token(), Some(1));
        assert!(!guard.is_lost());
        assert!(!guard.lost_token().is_cancelled());
        let shown = format!("{guard:?}");
        assert!(
            shown.contains("\"a\"") && shown.contains("released: false"),
            "{shown}"
        );
        guard.release().await.unwrap();
        assert!(!backend.is_held("a"));
        assert_eq!(backend.store().releases, 1);
        assert_eq!(locks.local_key_count(), 0);
        assert_eq!(holds_and_losses(&recorder), (1, 0));
    }

    #[tokio::test]
    async fn a_lost_guard_reports_the_loss_on_release() {
        let backend = MemoryBackend::default();
        let recorder = Recorder::new();
        let locks = provider(&backend, &recorder);
        let guard = locks.try_acquire("a").await.unwrap();
        guard.lost_token().cancel();
        assert!(guard.is_lost());
        let err = guard.release().await.unwrap_err();
        assert!(
            matches!(&err, LockError::Lost { key, .. } if &**key == "a"),
            "{err:?}"
        );
        // The release still ran: the key is free in the store and locally.
        assert!(!backend.is_held("a"));
        assert_eq!(locks.local_key_count(), 0);
        assert_eq!(holds_and_losses(&recorder), (1, 1));
    }

    fn lock_type() -> Vec<(String, String)> {
        vec![("lock_type".to_owned(), "memory".to_owned())]
    }

    /// A loss is counted when the lost token fires (here cancelled as a backend would on a
    /// dead connection), while the guard is still held, and not again at its release.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_loss_is_counted_when_it_is_detected_and_once() {
        let backend = MemoryBackend::default();
        let recorder = Recorder::new();
        let locks = provider(&backend, &recorder);
        let guard = locks.try_acquire("a").await.unwrap();
        let other = locks.try_acquire("b").await.unwrap();
        guard.lost_token().cancel();
        recorder
            .until("distributed_lock.lost", &[(lock_type(), 1)])
            .await;
        assert!(recorder.points("distributed_lock.hold_duration").is_empty());
        assert!(matches!(guard.release().await, Err(LockError::Lost { .. })));
        other.release().await.unwrap();
        assert_eq!(holds_and_losses(&recorder), (2, 1));
    }

    /// `is_lost` finding a lease's local deadline passed counts the loss at once.
    #[tokio::test]
    async fn a_lease_found_past_its_deadline_is_counted_at_once() {
        let backend = MemoryBackend::default();
        let recorder = Recorder::new();
        let locks = provider(&backend, &recorder);
        backend.store().lease_deadline = Some(std::time::Instant::now());
        let guard = locks.try_acquire("a").await.unwrap();
        assert!(recorder.points("distributed_lock.lost").is_empty());
        assert!(guard.is_lost());
        assert!(guard.lost_token().is_cancelled());
        assert_eq!(holds_and_losses(&recorder), (0, 1));
        assert!(guard.is_lost());
        let released = backend.released.clone();
        let notified = released.notified();
        drop(guard);
        within(notified).await;
        crate::testing::spin_until("the provider keeps no key", || locks.local_key_count() == 0)
            .await;
        assert_eq!(holds_and_losses(&recorder), (1, 1));
    }

    /// With `metric_resource_id`, every instrument carries the key; without it (the other
    /// tests), none does.
    #[tokio::test]
    async fn the_resource_id_is_an_attribute_when_asked_for() {
        let backend = MemoryBackend::default();
        let recorder = Recorder::new();
        let locks = LockProvider::builder(backend.clone())
            .meter(recorder.meter())
            .metric_resource_id(true)
            .build();
        let guard = locks.try_acquire("jobs:a").await.unwrap();
        let _ = locks.try_acquire("jobs:a").await.unwrap_err();
        guard.lost_token().cancel();
        let _ = guard.release().await;
        let attributes = |status: Option<&str>| {
            let mut v = vec![
                ("lock_type".to_owned(), "memory".to_owned()),
                ("resource_id".to_owned(), "jobs:a".to_owned()),
            ];
            if let Some(status) = status {
                v.push(("status".to_owned(), status.to_owned()));
            }
            v
        };
        let acquisitions = vec![
            (attributes(Some("acquired")), 1),
            (attributes(Some("already_held")), 1),
        ];
        assert_eq!(
            recorder.points("distributed_lock.acquisitions"),
            acquisitions
        );
        assert_eq!(
            recorder.points("distributed_lock.wait_duration"),
            acquisitions
        );
        assert_eq!(
            recorder.points("distributed_lock.hold_duration"),
            vec![(attributes(None), 1)]
        );
        let mut lost = attributes(None);
        lost.insert(
            0,
            ("lock_id".to_owned(), crate::lock_id("jobs:a").to_string()),
        );
        assert_eq!(recorder.points("distributed_lock.lost"), vec![(lost, 1)]);
        assert_eq!(
            recorder.points("distributed_lock.held"),
            vec![(attributes(None), 0)]
        );
    }

    /// `distributed_lock.held` counts the guards from acquisition until their release has
    /// finished (a dropped guard's in the background); `distributed_lock.waiting` the
    /// acquisitions with a timeout until their answer, or until their future is dropped.
    #[tokio::test]
    async fn the_gauges_count_holds_and_waits() {
        let backend = MemoryBackend::default();
        let recorder = Recorder::new();
        let locks = provider(&backend, &recorder);
        let gauge = |n| vec![(lock_type(), n)];
        let a = locks.try_acquire("a").await.unwrap();
        let b = locks.try_acquire("b").await.unwrap();
        assert_eq!(recorder.points("distributed_lock.held"), gauge(2));
        // A single try that meets contention never waits.
        assert!(locks.try_acquire("a").await.is_err());
        assert!(recorder.points("distributed_lock.waiting").is_empty());

        let waiter = {
            let locks = locks.clone();
            tokio::spawn(async move { locks.acquire("a", Duration::from_secs(30)).await })
        };
        recorder.until("distributed_lock.waiting", &gauge(1)).await;
        let gave_up = {
            let locks = locks.clone();
            tokio::spawn(async move { locks.acquire("b", Duration::from_secs(30)).await })
        };
        recorder.until("distributed_lock.waiting", &gauge(2)).await;
        gave_up.abort();
        assert!(gave_up.await.unwrap_err().is_cancelled());
        recorder.until("distributed_lock.waiting", &gauge(1)).await;

        a.release().await.unwrap();
        let a = waiter.await.unwrap().unwrap();
        assert_eq!(recorder.points("distributed_lock.waiting"), gauge(0));
        assert_eq!(recorder.points("distributed_lock.held"), gauge(2));
        // Timed out: counted while it waited, and not held.
        let err = locks
            .acquire("a", Duration::from_millis(20))
            .await
            .unwrap_err();
        assert!(matches!(err, LockError::Timeout { .. }), "{err:?}");
        assert_eq!(recorder.points("distributed_lock.waiting"), gauge(0));

        let released = backend.released.clone();
        let notified = released.notified();
        drop(a);
        within(notified).await;
        b.release().await.unwrap();
        recorder.until("distributed_lock.held", &gauge(0)).await;
    }

    #[tokio::test]
    async fn a_failed_release_is_answered() {
        let backend = MemoryBackend::default();
        let recorder = Recorder::new();
        let locks = provider(&backend, &recorder);
        let guard = locks.try_acquire("a").await.unwrap();
        backend.store().fail_release = true;
        let err = guard.release().await.unwrap_err();
        assert!(matches!(err, LockError::Backend { .. }), "{err:?}");
        assert_eq!(locks.local_key_count(), 0);
    }

    #[tokio::test]
    async fn a_dropped_guard_releases_in_the_background_before_freeing_its_slot() {
        let backend = MemoryBackend::default();
        let recorder = Recorder::new();
        let locks = provider(&backend, &recorder);
        let gate = std::sync::Arc::new(Notify::new());
        backend.store().release_gate = Some(gate.clone());
        let guard = locks.try_acquire("a").await.unwrap();
        let released = backend.released.clone();
        let notified = released.notified();
        drop(guard);
        // The release waits at the gate: the key stays taken, locally too, so no local waiter
        // can go to the store before it has the lock back.
        tokio::task::yield_now().await;
        assert!(backend.is_held("a"));
        assert_eq!(locks.local_key_count(), 1);
        assert!(matches!(
            locks.try_acquire("a").await,
            Err(LockError::AlreadyHeld { .. })
        ));
        let waiter = {
            let locks = locks.clone();
            tokio::spawn(async move { locks.acquire("a", Duration::from_secs(30)).await })
        };
        gate.notify_one();
        within(notified).await;
        let next = waiter.await.unwrap().unwrap();
        assert_eq!(next.fencing_token(), Some(2));
        assert_eq!(backend.store().releases, 1);
        assert_eq!(holds_and_losses(&recorder), (1, 0));
        backend.store().release_gate = None;
        drop(next);
    }

    #[tokio::test]
    async fn a_dropped_lost_guard_counts_the_loss() {
        let backend = MemoryBackend::default();
        let recorder = Recorder::new();
        let locks = provider(&backend, &recorder);
        let guard = locks.try_acquire("a").await.unwrap();
        guard.lost_token().cancel();
        let released = backend.released.clone();
        let notified = released.notified();
        drop(guard);
        within(notified).await;
        // The slot goes, and the hold is recorded, right after the release in the same task.
        crate::testing::spin_until("the provider keeps no key", || locks.local_key_count() == 0)
            .await;
        assert_eq!(holds_and_losses(&recorder), (1, 1));
    }

    #[tokio::test]
    async fn a_dropped_release_goes_on_in_the_background() {
        let backend = MemoryBackend::default();
        let recorder = Recorder::new();
        let locks = provider(&backend, &recorder);
        let gate = std::sync::Arc::new(Notify::new());
        backend.store().release_gate = Some(gate.clone());
        let guard = locks.try_acquire("a").await.unwrap();
        // Give up on the release while it waits at the gate.
        let gave_up = tokio::time::timeout(Duration::from_millis(10), guard.release()).await;
        assert!(gave_up.is_err());
        assert!(backend.is_held("a"));
        assert_eq!(locks.local_key_count(), 1);
        let released = backend.released.clone();
        let notified = released.notified();
        gate.notify_one();
        within(notified).await;
        crate::testing::spin_until("the provider keeps no key", || locks.local_key_count() == 0)
            .await;
        assert!(!backend.is_held("a"));
        assert_eq!(holds_and_losses(&recorder), (1, 0));
    }
}
