//! Scheduled jobs: run a job on one replica at a time, with ShedLock's `lockAtMostFor` and
//! `lockAtLeastFor`.

use std::future::Future;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use crate::{LockError, LockProvider};

impl LockProvider {
    /// Runs `f` if no other replica runs (or recently ran) the job `key`, and answers `None`
    /// without running it otherwise: the way to make a job that every replica schedules (a
    /// `tokio::time::interval`, a cron crate) run on one of them. Nothing waits: a replica
    /// that finds the lock held skips this run.
    ///
    /// - **`at_most_for`** bounds how long the lock outlives a holder that dies or hangs. On
    ///   lease backends (SQLite, Redis) the lock is taken with that lease and **not renewed**:
    ///   a run that takes longer may overlap the next replica's. `f`'s token fires when the
    ///   lock can no longer be counted on (at four fifths of `at_most_for`, see
    ///   [`LockGuard::remaining_lease`](crate::LockGuard::remaining_lease)); choose it well
    ///   above the job's longest run. The clock is checked before each poll of `f`'s future,
    ///   so a process paused past that point finds the token cancelled at the job's next step
    ///   (tasks the job spawns with the token are not polled here: see
    ///   [`LostSignal`](crate::LostSignal)). Session backends (PostgreSQL, MySQL, SQL Server,
    ///   Oracle) hold the lock until the run ends or the holder's session does.
    /// - **`at_least_for`** keeps the lock held after a quick run until that long after it
    ///   started, so replicas whose clocks or schedules differ a little do not run the job
    ///   again for the same tick. The rest of the hold runs in the background: this returns as
    ///   soon as `f` does. On lease backends the lease is set to a little more than what is
    ///   left of `at_least_for` (a quarter more, and 50 ms), so it also holds if this process
    ///   exits; a session lock ends with its session.
    ///
    /// Returns `Ok(Some(output))` when `f` ran, `Ok(None)` when the job was skipped, and
    /// [`LockError::Lost`] when the lock was lost while `f` ran (another replica may have run
    /// the job meanwhile). `at_least_for` longer than `at_most_for` is a
    /// [`LockError::Config`].
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), dlock::LockError> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let url = format!("sqlite://{}/locks.db", dir.path().display());
    /// use std::time::Duration;
    /// let locks = dlock::LockProvider::connect(&url).await?;
    /// let ran = locks
    ///     .run_exclusive(
    ///         "jobs:nightly-report",
    ///         Duration::from_secs(600), // a replica that dies frees it after ten minutes
    ///         Duration::from_secs(30),  // nobody runs it again within 30 s of this start
    ///         |_lost| async { "report sent" },
    ///     )
    ///     .await?;
    /// assert_eq!(ran, Some("report sent"));
    /// // Another replica ticking a moment later skips the job.
    /// let again = locks
    ///     .run_exclusive("jobs:nightly-report", Duration::from_secs(600), Duration::from_secs(30), |_| async {})
    ///     .await?;
    /// assert_eq!(again, None);
    /// # Ok(()) }
    /// ```
    ///
    /// # Cancel safety
    ///
    /// Cancel safe as far as the lock goes: a dropped future drops `f` mid-way and releases
    /// the lock in the background (without the `at_least_for` hold).
    pub async fn run_exclusive<F, Fut, T>(
        &self,
        key: &str,
        at_most_for: Duration,
        at_least_for: Duration,
        f: F,
    ) -> Result<Option<T>, LockError>
    where
        F: FnOnce(CancellationToken) -> Fut,
        Fut: Future<Output = T>,
    {
        if at_least_for > at_most_for {
            return Err(LockError::config(format!(
                "run_exclusive: at_least_for ({at_least_for:?}) is longer than at_most_for ({at_most_for:?})"
            )));
        }
        let started = Instant::now();
        let taken = self
            .lock(key)
            .lease(at_most_for)
            .renewal(false)
            .try_acquire()
            .await;
        let guard = match taken {
            Ok(guard) => guard,
            Err(LockError::AlreadyHeld { .. }) => return Ok(None),
            Err(err) => return Err(err),
        };
        // The lease's clock is checked before each poll of the job: after a pause past the
        // lease, the token is cancelled before the job's next step.
        let output = guard.checked(f(guard.lost_token().clone())).await;
        if guard.is_lost() {
            return guard.release().await.map(|()| Some(output));
        }
        let rest = at_least_for.saturating_sub(started.elapsed());
        if rest.is_zero() {
            guard.release().await?;
            return Ok(Some(output));
        }
        if guard.remaining_lease().is_some() {
            // The store keeps the lock for the rest of `at_least_for` even if this process
            // ends now; the hold below releases it on time. The lease is a quarter longer than
            // the rest, and 50 ms more: the local deadline (four fifths of it) then comes after
            // the hold's release, and store clocks that count in cached milliseconds cannot end
            // it early. Never past `at_most_for`. A lease shorter than the backend's shortest
            // keeps the lease the lock has.
            let lease = (rest + rest / 4 + Duration::from_millis(50))
                .min(at_most_for.saturating_sub(started.elapsed()))
                .max(rest);
            match guard.extend(lease).await {
                Ok(()) | Err(LockError::Config { .. }) => {}
                Err(err) => {
                    tracing::warn!(key, error = %err, "the job ran, but its lock could not be kept for at_least_for");
                    return Ok(Some(output));
                }
            }
        }
        let hold = async move {
            tokio::time::sleep(rest).await;
            if let Err(err) = guard.release().await {
                tracing::debug!(error = %err, "the at_least_for hold of a job's lock ended with an error");
            }
        };
        drop(tokio::spawn(hold));
        Ok(Some(output))
    }
}
