//! The guard of a held lock.

use std::fmt;
use std::sync::Arc;
use std::task::Poll;
use std::time::Instant;

use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::LockError;
use crate::backend::{BoxFuture, HeldLock, LeaseDeadline};
use crate::metrics::Metrics;
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
    state: Option<Held>,
    key: Arc<str>,
    fencing_token: Option<u64>,
    lost: CancellationToken,
    /// For a leased lock, the local deadline past which it is presumed lost.
    lease_deadline: Option<LeaseDeadline>,
    backend: &'static str,
    acquired_at: Instant,
    runtime: tokio::runtime::Handle,
    metrics: Arc<Metrics>,
}

struct Held {
    handle: Box<dyn HeldLock>,
    // Dropped after the store has the lock back, so local waiters queue behind the release.
    slot: Slot,
}

impl LockGuard {
    pub(crate) fn new(
        slot: Slot,
        acquired: crate::backend::Acquired,
        backend: &'static str,
        metrics: Arc<Metrics>,
        runtime: tokio::runtime::Handle,
    ) -> Self {
        LockGuard {
            key: Arc::clone(slot.key()),
            fencing_token: acquired.fencing_token,
            lost: acquired.lost,
            lease_deadline: acquired.lease_deadline,
            backend,
            acquired_at: Instant::now(),
            runtime,
            metrics,
            state: Some(Held {
                handle: acquired.handle,
                slot,
            }),
        }
    }

    /// The key this guard holds.
    pub fn key(&self) -> &str {
        &self.key
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
    /// The token is not cancelled by an ordinary release or drop of the guard.
    pub fn lost_token(&self) -> &CancellationToken {
        &self.lost
    }

    /// Whether the lock is known to be lost.
    ///
    /// For a leased lock (SQLite, Redis) this also compares the clock with the lease: a
    /// holder that was paused past the point where its lease could no longer be counted on
    /// (a stopped process, a suspended VM, a long pause of its thread) finds the lock lost
    /// here at once, even before the renewal task has run again, and the
    /// [`lost_token`](LockGuard::lost_token) fires with it.
    pub fn is_lost(&self) -> bool {
        if self.lost.is_cancelled() {
            return true;
        }
        if self
            .lease_deadline
            .as_ref()
            .is_some_and(LeaseDeadline::has_passed)
        {
            tracing::warn!(
                key = &*self.key,
                backend = self.backend,
                "the lock's lease ran out with no renewal confirmed (was the process paused?); it is presumed lost"
            );
            self.lost.cancel();
            return true;
        }
        false
    }

    /// The name of the backend that holds the lock.
    pub fn backend(&self) -> &'static str {
        self.backend
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
    pub async fn release(mut self) -> Result<(), LockError> {
        // Before the release: its own round trip must not count against the lease.
        let _ = self.is_lost();
        let Some(Held { handle, slot }) = self.state.take() else {
            return Ok(());
        };
        let span = tracing::debug_span!("dlock.release", key = &*self.key, backend = self.backend);
        let mut releasing = Releasing {
            future: Some(handle.release()),
            slot: Some(slot),
            end: Some(self.hold_end()),
            runtime: self.runtime.clone(),
        };
        let outcome = std::future::poll_fn(|cx| match releasing.future.as_mut() {
            Some(future) => future.as_mut().poll(cx),
            None => Poll::Ready(Ok(())),
        })
        .instrument(span)
        .await;
        releasing.future = None;
        drop(releasing);
        if self.lost.is_cancelled() {
            return Err(LockError::Lost {
                key: Arc::clone(&self.key),
                reason: "ownership was lost before the release".to_owned(),
            });
        }
        outcome
    }
}

/// A release in flight. If its owner stops polling it (the `release` future was dropped), the
/// rest of the release runs in the background, and the local slot is freed after it.
struct Releasing {
    future: Option<BoxFuture<'static, Result<(), LockError>>>,
    slot: Option<Slot>,
    end: Option<HoldEnd>,
    runtime: tokio::runtime::Handle,
}

impl Drop for Releasing {
    fn drop(&mut self) {
        let (slot, end) = (self.slot.take(), self.end.take());
        if let Some(future) = self.future.take() {
            drop(self.runtime.spawn(async move {
                let _ = future.await;
                drop(slot);
                drop(end);
            }));
        }
    }
}

/// The end of a hold, recorded when this is dropped: after the release has run, so that a
/// loss the release itself finds (a row or key taken over) is counted too. Dropped unrun with
/// a background release whose runtime is gone, it records then.
struct HoldEnd {
    metrics: Arc<Metrics>,
    key: Arc<str>,
    backend: &'static str,
    held: std::time::Duration,
    lost: CancellationToken,
}

impl Drop for HoldEnd {
    fn drop(&mut self) {
        let lost = self.lost.is_cancelled();
        if lost {
            tracing::warn!(
                key = &*self.key,
                backend = self.backend,
                "the lock was lost while held"
            );
        }
        self.metrics
            .released(self.backend, &self.key, self.held, lost);
    }
}

impl LockGuard {
    /// The hold ends now (its duration is measured here); it is recorded once the release is
    /// done (once: the guard's state is gone).
    fn hold_end(&self) -> HoldEnd {
        HoldEnd {
            metrics: Arc::clone(&self.metrics),
            key: Arc::clone(&self.key),
            backend: self.backend,
            held: self.acquired_at.elapsed(),
            lost: self.lost.clone(),
        }
    }
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        if let Some(Held { handle, slot }) = self.state.take() {
            let end = self.hold_end();
            let key = Arc::clone(&self.key);
            let backend = self.backend;
            let task = async move {
                if let Err(err) = handle.release().await {
                    tracing::warn!(%key, backend, error = %err, "background release of a dropped lock guard failed");
                }
                drop(slot);
                drop(end);
            };
            // If the runtime is gone, the task is dropped unrun: the backend's handle stops its
            // renewal and the lock goes with its lease or its connection.
            drop(self.runtime.spawn(task));
        }
    }
}

impl fmt::Debug for LockGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockGuard")
            .field("key", &self.key)
            .field("backend", &self.backend)
            .field("fencing_token", &self.fencing_token)
            .field(
                "lost",
                &(self.lost.is_cancelled()
                    || self
                        .lease_deadline
                        .as_ref()
                        .is_some_and(LeaseDeadline::has_passed)),
            )
            .field("released", &self.state.is_none())
            .finish()
    }
}
