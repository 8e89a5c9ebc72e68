//! Leader election: one process at a time does the leader's work, for as long as it holds a
//! key.

use std::future::Future;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::{Backoff, LockError, LockGuard, LockProvider, LostSignal};

/// Runs a leader's work on at most one process at a time: the one holding the lock `key`.
///
/// [`run`](Leader::run) contends for the key (waiting on the store, or polling it), runs the
/// work once it has the key, and contends again after losing it. The work gets a [`LeaderTerm`]
/// whose token fires when leadership ends (the lock was lost, or shutdown began); it should
/// stop and return then. Shutdown steps down gracefully: the work is told, it returns, and the
/// lock is released for the next leader at once.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), dlock::LockError> {
/// # let dir = tempfile::tempdir().unwrap();
/// # let url = format!("sqlite://{}/locks.db", dir.path().display());
/// use dlock::{CancellationToken, Leader};
/// let locks = dlock::LockProvider::connect(&url).await?;
/// let shutdown = CancellationToken::new();
/// # shutdown.cancel();
/// Leader::new(&locks, "leader:scheduler")
///     .run(&shutdown, |term| async move {
///         // Only this process runs here until `term.ended()` fires.
///         let fencing_token = term.fencing_token();
///         # let _ = fencing_token;
///         term.ended().await;
///     })
///     .await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Leader {
    provider: LockProvider,
    key: String,
    backoff: Backoff,
}

/// One term of leadership, handed to the leader's work. Cheap to clone: hand it to every task
/// of the work.
///
/// [`has_ended`](LeaderTerm::has_ended) and [`ended`](LeaderTerm::ended) **read the clock**:
/// on a leased lock (SQLite, Redis, Redlock, etcd) the term has ended once the lease's local
/// deadline has passed, even if no task has noticed yet. A leader paused past its lease (a
/// stopped process, a suspended machine), which another process may lead by now, finds
/// `has_ended()` true at its first step after the pause. The [`token`](LeaderTerm::token) is
/// cancelled by a task, and may lag after such a pause, except as seen from the work's own
/// future: [`Leader::run`] checks the clock before each poll of it and cancels the token first.
/// On the session engines (PostgreSQL, MySQL/MariaDB, SQL Server, Oracle) a paused leader keeps
/// leading: the server keeps its session, and so its lock.
#[derive(Debug, Clone)]
pub struct LeaderTerm {
    /// The term's token and the lease's local deadline.
    signal: LostSignal,
    fencing_token: Option<u64>,
    number: u64,
}

impl LeaderTerm {
    /// Fires when this term ends: the lock was lost, or shutdown began. Cancelled by a task
    /// (see the type's docs): [`has_ended`](LeaderTerm::has_ended) reads the clock as well.
    pub fn token(&self) -> &CancellationToken {
        self.signal.token()
    }

    /// Waits until this term ends: the lock is lost (its lost token fires, or its lease's
    /// local deadline passes), or shutdown begins.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe.
    pub async fn ended(&self) {
        self.signal.lost().await;
    }

    /// Whether this term has ended: its token was cancelled, or the lease's local deadline
    /// has passed (then the token is cancelled here).
    pub fn has_ended(&self) -> bool {
        self.signal.is_lost()
    }

    /// The fencing token of this term's lock, where the backend issues them: pass it to the
    /// stores the leader writes, so that a deposed leader's late writes are refused.
    pub fn fencing_token(&self) -> Option<u64> {
        self.fencing_token
    }

    /// Which term of this [`Leader`] this is: 1 for the first it won, then 2, ...
    pub fn number(&self) -> u64 {
        self.number
    }
}

impl Leader {
    /// A leader election on `key` through `provider`.
    pub fn new(provider: &LockProvider, key: impl Into<String>) -> Leader {
        Leader {
            provider: provider.clone(),
            key: key.into(),
            // After a loss: first pause 100 ms, doubling to 5 s, ±25 %.
            backoff: Backoff::new(Duration::from_millis(100), Duration::from_secs(5), 0.25)
                .unwrap_or_default(),
        }
    }

    /// The pauses before contending again after a lost term or a store that could not be
    /// reached (default: 100 ms doubling to 5 s, ±25 % jitter). Winning a term starts the
    /// pauses over.
    pub fn backoff(mut self, backoff: Backoff) -> Leader {
        self.backoff = backoff;
        self
    }

    /// Contends for leadership until `shutdown` is cancelled, running `lead` for each term
    /// won.
    ///
    /// - While another process leads, this one waits for the key.
    /// - When a term ends by a **loss**, `lead`'s token fires; once `lead` returns, `run`
    ///   pauses (the backoff) and contends again.
    /// - When **`shutdown`** is cancelled, a waiting `run` stops waiting, a leading one
    ///   cancels the term's token, waits for `lead` to return, releases the lock (so the next
    ///   leader takes over at once), and returns `Ok(())`.
    /// - When `lead` returns by itself while the term goes on, the work is done: the lock is
    ///   released and `run` returns `Ok(())`.
    ///
    /// A store that cannot be reached ([`LockError::Unavailable`], a backend error) is tried
    /// again after the backoff; errors that trying again cannot mend (a bad key, a
    /// configuration error, [`LockError::Unsupported`]) are returned.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe as far as the lock goes: dropping the future drops `lead`'s future and
    /// releases the lock in the background. Prefer `shutdown`, which lets the work finish.
    pub async fn run<F, Fut>(
        &self,
        shutdown: &CancellationToken,
        mut lead: F,
    ) -> Result<(), LockError>
    where
        F: FnMut(LeaderTerm) -> Fut,
        Fut: Future<Output = ()>,
    {
        let mut failures = 0u32;
        let mut terms = 0u64;
        loop {
            if shutdown.is_cancelled() {
                return Ok(());
            }
            let acquired = self
                .provider
                .lock(&self.key)
                .cancel_on(shutdown)
                .acquire()
                .await;
            let guard = match acquired {
                Ok(guard) => guard,
                Err(LockError::Canceled { .. }) => return Ok(()),
                Err(
                    err @ (LockError::Unavailable { .. }
                    | LockError::Backend { .. }
                    | LockError::Lost { .. }
                    | LockError::Timeout { .. }),
                ) => {
                    tracing::warn!(key = %self.key, error = %err, "contending for leadership failed; trying again");
                    if !self.pause(shutdown, &mut failures).await {
                        return Ok(());
                    }
                    continue;
                }
                Err(err) => return Err(err),
            };
            failures = 0;
            terms += 1;
            let token = shutdown.child_token();
            let term = LeaderTerm {
                signal: LostSignal::new(token.clone(), guard.lost_signal().deadline()),
                fencing_token: guard.fencing_token(),
                number: terms,
            };
            let work = lead(term);
            tokio::pin!(work);
            let ended_by_itself = lead_until_ended(&guard, shutdown, work.as_mut()).await;
            token.cancel();
            if !ended_by_itself {
                work.await;
            }
            let lost = guard.is_lost();
            if let Err(err) = guard.release().await {
                tracing::debug!(key = %self.key, error = %err, "the leader's lock ended with an error");
            }
            if shutdown.is_cancelled() || (ended_by_itself && !lost) {
                return Ok(());
            }
            tracing::warn!(key = %self.key, "leadership was lost; contending again");
            if !self.pause(shutdown, &mut failures).await {
                return Ok(());
            }
        }
    }

    /// Pauses before contending again; `false` when shutdown came first.
    async fn pause(&self, shutdown: &CancellationToken, failures: &mut u32) -> bool {
        let pause = self.backoff.delay(*failures);
        *failures = failures.saturating_add(1);
        tokio::select! {
            () = tokio::time::sleep(pause) => true,
            () = shutdown.cancelled() => false,
        }
    }
}

/// Polls the leader's `work` until it returns (`true`), or the term ends (`false`): the lock
/// is lost or shutdown begins. The loss is checked before each poll of the work with
/// [`LockGuard::is_lost`], which reads the clock: after a pause past the lease, the term ends
/// before the work's next step, whatever task would have noticed the loss.
async fn lead_until_ended(
    guard: &LockGuard,
    shutdown: &CancellationToken,
    mut work: std::pin::Pin<&mut impl Future<Output = ()>>,
) -> bool {
    let mut lost = std::pin::pin!(guard.lost_token().cancelled());
    let mut stopping = std::pin::pin!(shutdown.cancelled());
    std::future::poll_fn(|cx| {
        if guard.is_lost()
            || lost.as_mut().poll(cx).is_ready()
            || stopping.as_mut().poll(cx).is_ready()
        {
            return std::task::Poll::Ready(false);
        }
        work.as_mut().poll(cx).map(|()| true)
    })
    .await
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};
    use std::time::Instant;

    use super::*;
    use crate::backend::BoxFuture;
    use crate::testing::{Answer, MemoryBackend};

    /// A backoff with no jitter: each pause is `pause`.
    fn fixed(pause: Duration) -> Backoff {
        Backoff::new(pause, pause, 0.0).unwrap()
    }

    /// Runs `leader` until `shutdown` or the work ends it, bounded so that a leader that never
    /// stops fails the test instead of hanging it.
    async fn bounded(
        leader: &Leader,
        shutdown: &CancellationToken,
        lead: impl FnMut(LeaderTerm) -> BoxFuture<'static, ()>,
    ) -> Result<(), LockError> {
        tokio::time::timeout(Duration::from_secs(10), leader.run(shutdown, lead))
            .await
            .expect("the leader stopped")
    }

    /// A term lost when its lease runs out ends for the work (its token fires, `has_ended`
    /// answers true) before the work's next step; the lock is given back, the leader contends
    /// again after its pause and wins a second term with the next number and fencing token.
    /// A term whose work returns by itself ends the run, and its lock is given back.
    #[tokio::test]
    async fn a_lost_term_is_followed_by_the_next_and_a_finished_one_ends_the_run() {
        let backend = MemoryBackend::default();
        let lease = Duration::from_millis(150);
        let deadline = Instant::now() + lease;
        {
            let mut store = backend.store();
            store.next_token = 41;
            store.lease_deadline = Some(deadline);
        }
        let locks = LockProvider::from_backend(backend.clone());
        let shutdown = CancellationToken::new();
        // (term, fencing token, ended at its start, ended at its end, steps past the deadline)
        let seen = Arc::new(Mutex::new(Vec::new()));
        let leader = Leader::new(&locks, "leader").backoff(fixed(Duration::from_millis(100)));
        let started = Instant::now();
        let lost_at = Arc::new(Mutex::new(None));
        let result = bounded(&leader, &shutdown, |term| {
            let (seen, backend, shutdown, lost_at) = (
                Arc::clone(&seen),
                backend.clone(),
                shutdown.clone(),
                Arc::clone(&lost_at),
            );
            Box::pin(async move {
                let at_start = term.has_ended() || term.token().is_cancelled();
                let mut late_steps = 0;
                if term.number() == 1 {
                    // Steps that never look at the term: the leader must stop polling them
                    // once the lease has run out, cancelling the token first.
                    while !term.token().is_cancelled() {
                        if Instant::now() > deadline + Duration::from_millis(5) {
                            late_steps += 1;
                        }
                        tokio::time::sleep(Duration::from_millis(2)).await;
                    }
                    *lost_at.lock().unwrap() = Some(Instant::now());
                    term.ended().await;
                    backend.store().lease_deadline = None;
                } else if term.number() > 2 {
                    shutdown.cancel();
                }
                let at_end = term.has_ended();
                seen.lock().unwrap().push((
                    term.number(),
                    term.fencing_token(),
                    at_start,
                    at_end,
                    late_steps,
                ));
            })
        })
        .await;
        result.unwrap();
        assert_eq!(
            *seen.lock().unwrap(),
            vec![
                (1, Some(42), false, true, 0),
                (2, Some(43), false, false, 0)
            ]
        );
        let lost_at = lost_at.lock().unwrap().expect("the first term ended");
        assert!(
            lost_at >= deadline,
            "the term ended before its lease ran out"
        );
        assert!(
            started.elapsed() >= lease + Duration::from_millis(100),
            "the leader paused before contending again"
        );
        assert!(!backend.is_held("leader"), "the lock was given back");
        assert_eq!(backend.store().releases, 2);
    }

    /// Work that returns by itself after its term was lost (its lease ran out while it ran)
    /// is not done: the leader contends again and runs it in a new term.
    #[tokio::test]
    async fn work_that_returns_after_losing_its_term_runs_again() {
        let backend = MemoryBackend::default();
        let lease = Duration::from_millis(50);
        backend.store().lease_deadline = Some(Instant::now() + lease);
        let locks = LockProvider::from_backend(backend.clone());
        let shutdown = CancellationToken::new();
        let terms = Arc::new(Mutex::new(Vec::new()));
        let leader = Leader::new(&locks, "leader").backoff(fixed(Duration::from_millis(1)));
        bounded(&leader, &shutdown, |term| {
            let (terms, backend, shutdown) =
                (Arc::clone(&terms), backend.clone(), shutdown.clone());
            Box::pin(async move {
                terms.lock().unwrap().push(term.number());
                if term.number() == 1 {
                    // A step that blocks past the lease (a pause of the process).
                    std::thread::sleep(2 * lease);
                    backend.store().lease_deadline = None;
                } else if term.number() > 2 {
                    shutdown.cancel();
                }
            })
        })
        .await
        .unwrap();
        assert_eq!(*terms.lock().unwrap(), vec![1, 2]);
        assert!(!backend.is_held("leader"));
    }

    /// A loss the backend reports (the lock's lost token fires, no lease involved) ends the
    /// term at once, while the work waits for that end.
    #[tokio::test]
    async fn a_loss_the_backend_reports_ends_the_term() {
        let backend = MemoryBackend::default();
        let locks = LockProvider::from_backend(backend.clone());
        let shutdown = CancellationToken::new();
        let terms = Arc::new(Mutex::new(Vec::new()));
        let leader = Leader::new(&locks, "leader").backoff(fixed(Duration::from_millis(1)));
        bounded(&leader, &shutdown, |term| {
            let (terms, backend, shutdown) =
                (Arc::clone(&terms), backend.clone(), shutdown.clone());
            Box::pin(async move {
                if term.number() == 1 {
                    let lost = backend.store().lost_tokens.last().cloned().unwrap();
                    tokio::spawn(async move {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        lost.cancel();
                    });
                    term.ended().await;
                } else {
                    shutdown.cancel();
                }
                terms
                    .lock()
                    .unwrap()
                    .push((term.number(), term.has_ended()));
            })
        })
        .await
        .unwrap();
        assert_eq!(*terms.lock().unwrap(), vec![(1, true), (2, true)]);
    }

    /// Shutdown ends the term: the work is told, it returns, and the lock is given back. A
    /// shutdown before the run takes nothing.
    #[tokio::test]
    async fn shutdown_ends_the_term_and_gives_the_lock_back() {
        let backend = MemoryBackend::default();
        let locks = LockProvider::from_backend(backend.clone());
        let shutdown = CancellationToken::new();
        let ended = Arc::new(Mutex::new(Vec::new()));
        let leader = Leader::new(&locks, "leader");
        bounded(&leader, &shutdown, |term| {
            let (ended, shutdown, backend) =
                (Arc::clone(&ended), shutdown.clone(), backend.clone());
            Box::pin(async move {
                assert!(
                    backend.is_held("leader"),
                    "the work runs while the lock is held"
                );
                // Shutdown comes while the work waits for the end of its term.
                tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    shutdown.cancel();
                });
                term.ended().await;
                ended
                    .lock()
                    .unwrap()
                    .push((term.number(), term.has_ended()));
            })
        })
        .await
        .unwrap();
        assert_eq!(*ended.lock().unwrap(), vec![(1, true)]);
        assert!(!backend.is_held("leader"));
        assert_eq!(backend.store().tries, 1);

        let tries = backend.store().tries;
        bounded(&leader, &shutdown, |_| {
            unreachable!("no term after shutdown")
        })
        .await
        .unwrap();
        assert_eq!(backend.store().tries, tries, "nothing was tried");
    }

    /// A store that fails is tried again after the pause; a shutdown during that pause ends
    /// the run at once; an error that trying again cannot mend is returned.
    #[tokio::test]
    async fn store_failures_are_tried_again_after_the_pause() {
        let backend = MemoryBackend::default();
        {
            let mut store = backend.store();
            store.answers.push_back(Answer::Fail);
            store.answers.push_back(Answer::Fail);
        }
        let locks = LockProvider::from_backend(backend.clone());
        let shutdown = CancellationToken::new();
        let pause = Duration::from_millis(60);
        let leader = Leader::new(&locks, "leader").backoff(fixed(pause));
        let started = Instant::now();
        let terms = Arc::new(Mutex::new(Vec::new()));
        bounded(&leader, &shutdown, |term| {
            let terms = Arc::clone(&terms);
            Box::pin(async move { terms.lock().unwrap().push(term.number()) })
        })
        .await
        .unwrap();
        assert_eq!(*terms.lock().unwrap(), vec![1]);
        assert_eq!(backend.store().tries, 3);
        assert!(started.elapsed() >= 2 * pause, "{:?}", started.elapsed());

        // A shutdown during a long pause ends the run without waiting it out.
        backend.store().answers.push_back(Answer::Fail);
        let leader = Leader::new(&locks, "leader").backoff(fixed(Duration::from_secs(3600)));
        let stop = shutdown.clone();
        let cancel = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(50)).await;
            stop.cancel();
        });
        bounded(&leader, &shutdown, |_| unreachable!("the store failed"))
            .await
            .unwrap();
        cancel.await.unwrap();

        let err = bounded(&Leader::new(&locks, ""), &CancellationToken::new(), |_| {
            unreachable!("an empty key is never taken")
        })
        .await
        .unwrap_err();
        assert!(matches!(err, LockError::InvalidKey { .. }), "{err:?}");
    }
}
