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
