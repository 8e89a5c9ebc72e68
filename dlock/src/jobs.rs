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

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use crate::testing::MemoryBackend;
    use crate::{LockError, LockProvider};

    const MS: Duration = Duration::from_millis(1);

    /// Waits until `key` is free in `backend`, at most `within`.
    async fn freed(backend: &MemoryBackend, key: &str, within: Duration) -> Instant {
        tokio::time::timeout(within, async {
            while backend.is_held(key) {
                tokio::time::sleep(MS).await;
            }
            Instant::now()
        })
        .await
        .expect("the key was given back")
    }

    /// `at_least_for` longer than `at_most_for` is refused before anything is tried; equal
    /// bounds are a valid job. A key held elsewhere skips the job.
    #[tokio::test]
    async fn bounds_are_checked_and_a_held_key_skips_the_job() {
        let backend = MemoryBackend::default();
        let locks = LockProvider::from_backend(backend.clone());
        let err = locks
            .run_exclusive("job", 100 * MS, 101 * MS, |_| async { unreachable!() })
            .await
            .unwrap_err();
        assert!(matches!(err, LockError::Config { .. }), "{err:?}");
        assert!(err.to_string().contains("at_least_for"), "{err}");
        assert_eq!(backend.store().tries, 0);

        let ran = locks
            .run_exclusive("job", 100 * MS, 100 * MS, |_| async { 7 })
            .await
            .unwrap();
        assert_eq!(ran, Some(7));
        freed(&backend, "job", Duration::from_secs(5)).await;

        backend.hold_elsewhere("job");
        let skipped = locks
            .run_exclusive("job", 100 * MS, Duration::ZERO, |_| async {
                unreachable!("the key is held elsewhere")
            })
            .await
            .unwrap();
        assert_eq!(skipped, None);
    }

    /// The job runs while the lock is held, with a live token. With no `at_least_for` the lock
    /// is given back before `run_exclusive` returns; with one, it is kept until `at_least_for`
    /// after the start, and on a leased lock the lease is first extended to cover the rest
    /// (a quarter more, and 50 ms), never past `at_most_for`.
    #[tokio::test]
    async fn the_lock_is_kept_for_at_least_for_and_given_back_after() {
        let backend = MemoryBackend::default();
        let locks = LockProvider::from_backend(backend.clone());
        let probe = backend.clone();
        let ran = locks
            .run_exclusive(
                "job",
                Duration::from_secs(10),
                Duration::ZERO,
                |token| async move {
                    assert!(probe.is_held("job") && !token.is_cancelled());
                    "done"
                },
            )
            .await
            .unwrap();
        assert_eq!(ran, Some("done"));
        assert!(!backend.is_held("job"), "given back before the answer");
        assert_eq!(backend.store().releases, 1);

        // A lock without a lease: held on for the rest of at_least_for, then given back.
        let started = Instant::now();
        let at_least = 200 * MS;
        locks
            .run_exclusive("job", Duration::from_secs(10), at_least, |_| async {})
            .await
            .unwrap();
        assert!(backend.is_held("job"), "kept for at_least_for");
        let freed_at = freed(&backend, "job", Duration::from_secs(5)).await;
        assert!(freed_at - started >= at_least, "{:?}", freed_at - started);
        assert!(backend.store().extends.is_empty(), "no lease to extend");

        // A leased lock: its lease is extended to cover the rest.
        {
            let mut store = backend.store();
            store.lease_control = true;
            store.lease_deadline = Some(Instant::now() + Duration::from_secs(60));
        }
        let at_least = 400 * MS;
        locks
            .run_exclusive("job", Duration::from_secs(10), at_least, |_| async {})
            .await
            .unwrap();
        let lease = backend
            .store()
            .extends
            .pop()
            .expect("the lease was extended");
        // The rest is at most 400 ms, and well over 320 ms on any machine that runs the test.
        assert!(
            (450 * MS..=550 * MS).contains(&lease),
            "the lease covers the rest with a quarter more and 50 ms: {lease:?}"
        );
        freed(&backend, "job", Duration::from_secs(5)).await;

        // Never past at_most_for, never short of the rest.
        locks
            .run_exclusive("job", 450 * MS, 420 * MS, |_| async {})
            .await
            .unwrap();
        let lease = backend
            .store()
            .extends
            .pop()
            .expect("the lease was extended");
        assert!(
            (300 * MS..=450 * MS).contains(&lease),
            "at most what is left of at_most_for: {lease:?}"
        );
        freed(&backend, "job", Duration::from_secs(5)).await;
    }

    /// A job whose lease runs out while it runs sees its token fire; the answer is `Lost`
    /// (another replica may have run the job meanwhile), and the lock is given back at once:
    /// no hold for `at_least_for` on a lock that is lost.
    #[tokio::test]
    async fn a_job_that_outlives_its_lease_is_told_and_not_held_on() {
        let backend = MemoryBackend::default();
        backend.store().lease_deadline = Some(Instant::now() + 50 * MS);
        let locks = LockProvider::from_backend(backend.clone());
        let told = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let seen = std::sync::Arc::clone(&told);
        let err = locks
            .run_exclusive(
                "job",
                Duration::from_secs(10),
                Duration::from_secs(10),
                |token| async move {
                    let started = Instant::now();
                    while !token.is_cancelled() && started.elapsed() < Duration::from_secs(5) {
                        tokio::time::sleep(MS).await;
                    }
                    seen.store(token.is_cancelled(), std::sync::atomic::Ordering::SeqCst);
                },
            )
            .await
            .unwrap_err();
        assert!(
            matches!(&err, LockError::Lost { key, .. } if &**key == "job"),
            "{err:?}"
        );
        assert!(
            told.load(std::sync::atomic::Ordering::SeqCst),
            "the token fired"
        );
        assert!(!backend.is_held("job"), "given back at once");
        assert_eq!(backend.store().releases, 1);
        assert!(backend.store().extends.is_empty());
    }
}
