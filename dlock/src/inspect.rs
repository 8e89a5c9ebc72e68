//! Inspection: the locks a provider holds.

use std::time::{Duration, Instant, SystemTime};

use crate::{LockError, LockProvider, StoreLock};

/// One lock a provider holds, as [`LockProvider::held_locks`] shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct LockInfo {
    /// The key: the lock's, or for a permit of a semaphore the semaphore's (see
    /// [`semaphore`](LockInfo::semaphore)).
    pub key: String,
    /// When the lock was acquired, on the wall clock.
    pub since: SystemTime,
    /// Its fencing token, where the backend issues them.
    pub fencing_token: Option<u64>,
    /// For a leased lock (SQLite, Redis), how long it can still be counted on without another
    /// confirmed renewal (see [`LockGuard::remaining_lease`](crate::LockGuard::remaining_lease));
    /// `None` for session locks.
    pub remaining_lease: Option<Duration>,
    /// Whether the lock is known to be lost (its guard has not been released yet).
    pub lost: bool,
    /// Whether it is a read lock, shared with other readers of the key.
    pub shared: bool,
    /// For a permit of a semaphore, the semaphore's `max_count`; `None` for a lock.
    pub semaphore: Option<u32>,
}

impl LockProvider {
    /// The locks this provider (and every provider made from it with
    /// [`with_shutdown`](LockProvider::with_shutdown)) holds right now, sorted by key (a key read
    /// by several tasks shows once for each, oldest first): from
    /// the moment an acquisition hands out its guard until the guard's release has finished.
    /// Read from memory, with no round trip; for an admin page or a debug endpoint.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), dlock::LockError> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let url = format!("sqlite://{}/locks.db", dir.path().display());
    /// let locks = dlock::LockProvider::connect(&url).await?;
    /// let guard = locks.try_acquire("jobs:billing").await?;
    /// let held = locks.held_locks();
    /// assert_eq!(held.len(), 1);
    /// assert_eq!(held[0].key, "jobs:billing");
    /// assert_eq!(held[0].fencing_token, guard.fencing_token());
    /// guard.release().await?;
    /// assert!(locks.held_locks().is_empty());
    /// # Ok(()) }
    /// ```
    pub fn held_locks(&self) -> Vec<LockInfo> {
        let now = Instant::now();
        let mut held: Vec<LockInfo> = self
            .metrics()
            .shown()
            .into_iter()
            .map(|shown| {
                let lost = shown.lost.is_cancelled()
                    || shown
                        .lease_deadline
                        .as_ref()
                        .is_some_and(|deadline| deadline.at() <= now);
                LockInfo {
                    key: shown.key.to_string(),
                    since: shown.since,
                    fencing_token: shown.fencing_token,
                    remaining_lease: shown.lease_deadline.map(|deadline| {
                        if lost {
                            Duration::ZERO
                        } else {
                            deadline.at().saturating_duration_since(now)
                        }
                    }),
                    lost,
                    shared: shown.shared,
                    semaphore: shown.semaphore,
                }
            })
            .collect();
        held.sort_by(|a, b| (&a.key, a.since).cmp(&(&b.key, b.since)));
        held
    }

    /// The locks held in the store right now **by any process**, where the backend can list
    /// them: SQLite (its tables), Redis (a `SCAN` of the prefix; it walks the whole keyspace,
    /// so keep it to admin use), PostgreSQL (`pg_locks`: advisory locks carry only a number,
    /// so a lock is named by its key when this provider holds it, and is otherwise listed by
    /// its id), etcd (one range read of the prefix, then one lease read per lock: each
    /// queue's holder, not its waiters), MySQL/MariaDB (`performance_schema.metadata_locks`,
    /// where the account may read it and the server has it on; a hashed lock name is named
    /// by its key when this provider holds it). Other backends (Redlock, SQL Server, Oracle,
    /// MySQL/MariaDB without `performance_schema`) answer [`LockError::Unsupported`] saying
    /// why. Sorted by resource; each says whether this provider is the one holding it.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), dlock::LockError> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let url = format!("sqlite://{}/locks.db", dir.path().display());
    /// let here = dlock::LockProvider::connect(&url).await?;
    /// let elsewhere = dlock::LockProvider::connect(&url).await?;
    /// let guard = elsewhere.try_acquire("jobs:billing").await?;
    /// let locks = here.store_locks().await?;
    /// assert_eq!(locks.len(), 1);
    /// assert_eq!(locks[0].key.as_deref(), Some("jobs:billing"));
    /// assert!(!locks[0].held_here);
    /// guard.release().await?;
    /// assert!(here.store_locks().await?.is_empty());
    /// # Ok(()) }
    /// ```
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only reads.
    pub async fn store_locks(&self) -> Result<Vec<StoreLock>, LockError> {
        let shown = self.metrics().shown();
        let known: Vec<&str> = shown.iter().map(|shown| &*shown.key).collect();
        let mut locks = self.backend().store_locks(&known).await?;
        for lock in &mut locks {
            lock.held_here = lock.key.as_deref().is_some_and(|key| known.contains(&key));
        }
        locks.sort_by(|a, b| a.resource.cmp(&b.resource));
        Ok(locks)
    }
}
