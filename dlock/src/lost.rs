//! The check of a held lock that reads the clock: [`LostSignal`].

use std::fmt;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use crate::backend::LeaseDeadline;

/// Whether a held lock is still held, for the work done under it: the lock's lost token and,
/// for a leased lock (SQLite, Redis, Redlock, etcd), the local deadline of its lease. Cheap to
/// clone (two reference counts), so that every task of the work can have one. Get it from
/// [`LockGuard::lost_signal`](crate::LockGuard::lost_signal).
///
/// **It reads the clock.** [`is_lost`](LostSignal::is_lost) is `true` once the lost token has
/// fired *or* the lease's local deadline has passed, and [`lost`](LostSignal::lost) completes
/// at whichever comes first. A bare [`CancellationToken`] cannot do that: the lost token is
/// cancelled by a task (the renewal, or a timer at the deadline), and after a pause of the
/// process (a stopped process, a suspended machine, a thread that did not run) the work may
/// take its next step before that task has run again. So a holder paused past its lease, which
/// another process may hold by now, finds `is_lost()` true at its first step after the pause,
/// while `token().is_cancelled()` may still say `false` for a moment (even where dlock checks
/// the clock before each poll of the work, when the pause fell inside a poll). Once this
/// signal has found the deadline passed, it cancels the lost token itself.
///
/// Session locks (PostgreSQL, MySQL/MariaDB, SQL Server, Oracle) have no lease: their signal
/// is their lost token. A paused process keeps such a lock, because the server keeps its
/// session, and learns of a loss (the session ended) when its keepalive runs again.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), dlock::LockError> {
/// # let dir = tempfile::tempdir().unwrap();
/// # let url = format!("sqlite://{}/locks.db", dir.path().display());
/// let locks = dlock::LockProvider::connect(&url).await?;
/// let guard = locks.try_acquire("imports:daily").await?;
/// let signal = guard.lost_signal();
/// let worker = tokio::spawn(async move {
///     for batch in 0..3 {
///         // Checked before each step: false once the lease can no longer be counted on.
///         if signal.is_lost() {
///             return Err(batch);
///         }
///         // ... import the batch, with the guard's fencing token ...
///     }
///     Ok(3)
/// });
/// assert_eq!(worker.await.unwrap(), Ok(3));
/// guard.release().await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct LostSignal {
    token: CancellationToken,
    deadline: Option<LeaseDeadline>,
}

impl LostSignal {
    /// The signal of `token`, with the local deadline of a leased lock.
    pub(crate) fn new(token: CancellationToken, deadline: Option<LeaseDeadline>) -> LostSignal {
        LostSignal { token, deadline }
    }

    /// Whether the lock is lost: its lost token has fired, or its lease's local deadline has
    /// passed (then the lost token is cancelled here). Reads the clock; no I/O.
    pub fn is_lost(&self) -> bool {
        if self.token.is_cancelled() {
            return true;
        }
        if self
            .deadline
            .as_ref()
            .is_some_and(LeaseDeadline::has_passed)
        {
            self.token.cancel();
            return true;
        }
        false
    }

    /// Completes when the lock is lost: its lost token fires, or its lease's local deadline
    /// passes (which renewals move on), whichever comes first.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only waits.
    pub async fn lost(&self) {
        let Some(deadline) = &self.deadline else {
            return self.token.cancelled().await;
        };
        while !self.is_lost() {
            tokio::select! {
                () = self.token.cancelled() => return,
                () = tokio::time::sleep_until(deadline.at().into()) => {}
            }
        }
    }

    /// The lock's lost token. It fires when the loss is seen by a task of the backend or by
    /// a check that reads the clock ([`is_lost`](LostSignal::is_lost),
    /// [`LockGuard::is_lost`](crate::LockGuard::is_lost)): after a pause of the process, it
    /// may lag behind [`is_lost`](LostSignal::is_lost).
    pub fn token(&self) -> &CancellationToken {
        &self.token
    }

    /// The lease's local deadline, shared with the lock (renewals move it).
    pub(crate) fn deadline(&self) -> Option<LeaseDeadline> {
        self.deadline.clone()
    }

    /// How long the lock may still be counted on without another confirmed renewal (zero
    /// once lost); `None` for session locks. See
    /// [`LockGuard::remaining_lease`](crate::LockGuard::remaining_lease).
    pub fn remaining_lease(&self) -> Option<Duration> {
        let deadline = self.deadline.as_ref()?;
        if self.is_lost() {
            return Some(Duration::ZERO);
        }
        Some(deadline.at().saturating_duration_since(Instant::now()))
    }
}

impl fmt::Debug for LostSignal {
    /// Reads the clock, but never cancels the token (a `Debug` has no effects).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let passed = self
            .deadline
            .as_ref()
            .is_some_and(LeaseDeadline::has_passed);
        f.debug_struct("LostSignal")
            .field("lost", &(self.token.is_cancelled() || passed))
            .field(
                "remaining_lease",
                &self
                    .deadline
                    .as_ref()
                    .map(|d| d.at().saturating_duration_since(Instant::now())),
            )
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_passed_deadline_is_a_loss_before_the_token_fires() {
        let token = CancellationToken::new();
        let deadline = LeaseDeadline::new(Instant::now() + Duration::from_millis(30));
        let signal = LostSignal::new(token.clone(), Some(deadline.clone()));
        assert!(!signal.is_lost());
        assert!(signal.remaining_lease().unwrap() > Duration::ZERO);
        // A renewal moves the deadline on; `lost` follows it.
        deadline.set(Instant::now() + Duration::from_millis(60));
        let started = Instant::now();
        signal.lost().await;
        assert!(started.elapsed() >= Duration::from_millis(50));
        assert!(signal.is_lost());
        assert!(token.is_cancelled(), "the signal cancels the token");
        assert_eq!(signal.remaining_lease(), Some(Duration::ZERO));
        // Debug must not panic, and says so.
        assert!(format!("{signal:?}").contains("lost: true"));
    }

    /// A lease whose local deadline passes while no task cancels the lost token (as after a
    /// pause of the process, before the renewal task runs again): the work that dlock drives
    /// finds its token cancelled at its next step, and every check that reads the clock says
    /// "lost".
    #[tokio::test]
    async fn the_work_dlock_drives_finds_its_token_cancelled_after_the_deadline() {
        use crate::LockError;
        use crate::testing::MemoryBackend;
        let backend = MemoryBackend::default();
        let locks = crate::LockProvider::from_backend(backend.clone());
        let lease_ends = || {
            backend.store().lease_deadline = Some(Instant::now() + Duration::from_millis(30));
        };
        let past_it = || tokio::time::sleep(Duration::from_millis(60));

        lease_ends();
        let (tx, rx) = std::sync::mpsc::channel();
        let outcome = locks
            .with_lock("a", Duration::ZERO, |token| async move {
                past_it().await;
                tx.send(token.is_cancelled()).unwrap();
            })
            .await;
        assert!(
            matches!(outcome, Err(LockError::Lost { .. })),
            "{outcome:?}"
        );
        assert!(rx.recv().unwrap(), "with_lock's token");
        lease_ends();
        let (tx, rx) = std::sync::mpsc::channel();
        let outcome = locks
            .run_exclusive(
                "b",
                Duration::from_secs(5),
                Duration::ZERO,
                |token| async move {
                    past_it().await;
                    tx.send(token.is_cancelled()).unwrap();
                },
            )
            .await;
        assert!(
            matches!(outcome, Err(LockError::Lost { .. })),
            "{outcome:?}"
        );
        assert!(rx.recv().unwrap(), "run_exclusive's token");

        lease_ends();
        let guard = locks.try_acquire("c").await.unwrap();
        let signal = guard.lost_signal();
        past_it().await;
        assert!(
            !guard.lost_token().is_cancelled(),
            "no task cancels it here"
        );
        assert!(signal.is_lost());
        assert!(guard.is_lost());
        drop(guard);

        lease_ends();
        let shutdown = CancellationToken::new();
        let (tx, rx) = std::sync::mpsc::channel();
        crate::Leader::new(&locks, "d")
            .run(&shutdown, |term| {
                let (tx, shutdown) = (tx.clone(), shutdown.clone());
                async move {
                    past_it().await;
                    tx.send((term.token().is_cancelled(), term.has_ended()))
                        .unwrap();
                    shutdown.cancel();
                }
            })
            .await
            .unwrap();
        assert_eq!(
            rx.recv().unwrap(),
            (true, true),
            "the term's token, has_ended"
        );
    }

    #[tokio::test]
    async fn a_session_lock_is_its_token() {
        let token = CancellationToken::new();
        let signal = LostSignal::new(token.clone(), None);
        assert!(!signal.is_lost());
        assert_eq!(signal.remaining_lease(), None);
        let waiting = tokio::spawn({
            let signal = signal.clone();
            async move { signal.lost().await }
        });
        token.cancel();
        waiting.await.unwrap();
        assert!(signal.is_lost());
    }
}
