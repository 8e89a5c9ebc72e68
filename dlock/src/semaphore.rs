//! Semaphores: up to `max_count` holders per key, in a namespace of their own.
//!
//! A backend that keeps semaphores natively ([`LockBackend::semaphores`]) is asked for permits
//! through its [`PermitStore`]: one try is one atomic step of the store, whatever the count.
//! Any other backend gets the *slot scheme*: a semaphore of `max_count` permits is
//! `max_count` ordinary locks ("slots") under the reserved prefix, and a try asks for them in
//! turn from a random one ([`MAX_SLOT_PERMITS`] at most).
//!
//! Waits are fair. A waiting acquisition first takes the semaphore's *queue lock*, an
//! ordinary lock of the backend under the reserved prefix, with what is left of its timeout:
//! waiters line up there in the order of the backend's lock waits (across processes: native
//! FIFO waits, SQLite's waiters' table, Redis's fair waits; in one process: the table's
//! queue). Only the waiter holding it tries for a permit, pausing briefly between tries; it
//! gives the queue lock back once it has a permit or gives up. A holder that gives its permit
//! back and asks again therefore queues behind the waiters already there. A store with a
//! native FIFO wait for permits (etcd) waits there instead.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::backend::{MAX_SLOT_PERMITS, PermitRequest, PermitStore, PermitTry, ReleaseWatch};
use crate::key::{RESERVED_PREFIX, validate_key};
use crate::provider::{Terms, current_runtime};
use crate::{LockError, LockGuard, LockProvider};

/// The name of slot `slot` of the semaphore `key` (slot scheme): the reserved prefix (which no
/// lock key may start with), then `semaphore`, the slot number and the key, NUL-separated.
/// Distinct keys or slots give distinct names, and no name is a lock key, so a semaphore "x"
/// and a lock "x" are unrelated.
fn slot_name(key: &str, slot: u32) -> String {
    format!("{RESERVED_PREFIX}semaphore\0{slot}\0{key}")
}

/// The name of the queue lock of the semaphore `key`: the reserved prefix, then
/// `semaphore-queue` and the key, NUL-separated (never a slot's name, whose second part is
/// `semaphore`).
fn queue_name(key: &str) -> String {
    format!("{RESERVED_PREFIX}semaphore-queue\0{key}")
}

/// The first and longest pause of the waiter at the head of a semaphore's queue between two
/// tries (with a quarter of jitter either way), on a store that cannot wake it. Only that
/// waiter polls, whatever the number of waiters; a permit given back is taken within about a
/// millisecond while the semaphore turns over fast, and a semaphore held long costs about 30
/// tries a second.
const HEAD_PAUSES: (Duration, Duration) = (Duration::from_millis(1), Duration::from_millis(32));

/// The longest pause of the waiter at the head of the queue on the slot scheme, where a try of
/// a full semaphore costs `max_count` round trips: `max_count` × 0.25 ms, at least
/// [`HEAD_PAUSES`]'s (so 256 ms for 1,024 slots).
fn slot_head_pause(max_count: u32) -> Duration {
    HEAD_PAUSES
        .1
        .max(Duration::from_micros(250).saturating_mul(max_count))
}

/// The longest the waiter at the head of the queue sleeps on a live watch of the store's
/// wake-ups before it tries again. It keeps the waiting mark short: a waiter that gives up
/// holds single tries back for at most twice this.
const WATCHED_PAUSE: Duration = Duration::from_secs(1);

/// The shortest waiting mark a try of the head waiter asks for.
const MARK_MIN: Duration = Duration::from_millis(100);

/// What one try for a permit found.
enum Found {
    Taken(LockGuard),
    Full { retry_within: Option<Duration> },
}

impl LockProvider {
    /// Takes one of the `max_count` permits of the semaphore `key`, without waiting: up to
    /// `max_count` holders at once, in any process. [`LockError::AlreadyHeld`] when they are
    /// all held (or, on a store that keeps semaphores natively, while a waiter is ahead: see
    /// [Fairness](#fairness)).
    ///
    /// A permit is a lock of its own: its guard has the backend's lost token, lease control
    /// and release on drop, and its [`key`](LockGuard::key) is the semaphore's key. Semaphores
    /// are a namespace of their own: the semaphore "x" and the lock "x" are unrelated.
    ///
    /// # How permits are kept
    ///
    /// SQLite and etcd keep semaphores natively ([`PermitStore`]): a try is one transaction
    /// (SQLite) or a lease grant and one transaction (etcd), whatever `max_count`, up to
    /// [`u32::MAX`]; [`fencing_token`](LockGuard::fencing_token)s increase per semaphore,
    /// across all its permits. The other backends (until they keep semaphores natively, and a
    /// [`LockBackend`](crate::backend::LockBackend) of your own) keep `max_count` slot locks
    /// in a reserved namespace; a try asks for them in turn, starting from a random one, so it
    /// costs up to `max_count` round trips, `max_count` is limited to
    /// [`MAX_SLOT_PERMITS`] (1,024; more is a [`LockError::Config`] naming the limit), and
    /// fencing tokens increase per slot.
    ///
    /// # The count
    ///
    /// Every holder and waiter of one semaphore must use the same `max_count`. Where the store
    /// keeps semaphores natively, it records the count with the semaphore and refuses another
    /// one with [`LockError::Config`] naming both, as long as anyone holds a permit or waits
    /// for one; once nobody does, a new count is taken. The slot scheme cannot record it:
    /// there, callers that disagree get the larger count (slot *n* is the same lock whatever
    /// count asks for it). `max_count` 0 is a [`LockError::Config`].
    ///
    /// # Fairness
    ///
    /// Waits ([`acquire_semaphore`](LockProvider::acquire_semaphore)) queue, first come first
    /// served, across processes. Where the store keeps semaphores natively, a single try does
    /// not take a permit while the waiter at the head of the queue is between two of its
    /// tries (it answers [`LockError::AlreadyHeld`]), so tries in a loop cannot starve
    /// waiters; on the slot scheme, a try takes any free slot.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), dlock::LockError> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let url = format!("sqlite://{}/locks.db", dir.path().display());
    /// let locks = dlock::LockProvider::connect(&url).await?;
    /// // At most two exports run at once across the replicas.
    /// let first = locks.try_acquire_semaphore("exports", 2).await?;
    /// let second = locks.try_acquire_semaphore("exports", 2).await?;
    /// assert_eq!(first.key(), "exports");
    /// assert!(matches!(
    ///     locks.try_acquire_semaphore("exports", 2).await,
    ///     Err(dlock::LockError::AlreadyHeld { .. })
    /// ));
    /// // Another count is refused while the semaphore is in use.
    /// assert!(matches!(
    ///     locks.try_acquire_semaphore("exports", 5).await,
    ///     Err(dlock::LockError::Config { .. })
    /// ));
    /// // The lock "exports" is another thing altogether.
    /// locks.try_acquire("exports").await?.release().await?;
    /// first.release().await?;
    /// second.release().await?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Cancel safety
    ///
    /// Cancel safe, as [`try_acquire`](LockProvider::try_acquire): no permit is left held.
    pub async fn try_acquire_semaphore(
        &self,
        key: &str,
        max_count: u32,
    ) -> Result<LockGuard, LockError> {
        self.semaphore(key, max_count, Duration::ZERO).await
    }

    /// Takes one of the `max_count` permits of the semaphore `key`, waiting up to `timeout`
    /// for one: [`LockError::Timeout`] (naming the semaphore's key) when it runs out.
    /// `Duration::ZERO` is a single try, answered [`LockError::AlreadyHeld`] as
    /// [`try_acquire_semaphore`](LockProvider::try_acquire_semaphore); `Duration::MAX` waits
    /// without limit. The provider's shutdown token ends the wait with
    /// [`LockError::Canceled`].
    ///
    /// Waiters are served in turn: the wait first takes the semaphore's queue lock (an
    /// ordinary lock of the backend under a reserved name, so waiters line up as the
    /// backend's lock waits do, across processes and in this one), and only the waiter
    /// holding it tries for a permit: every millisecond at first, up to every 32 ms (on the
    /// slot scheme up to every `max_count` × 0.25 ms), sooner when a holder's lease is about to
    /// run out. It gives the queue lock back once it has a permit or gives up. So a holder
    /// that gives its permit back and asks again waits behind those already waiting. On etcd
    /// the wait is etcd's own: each waiter's key queues by its revision, and the first
    /// `max_count` keys hold the permits. See
    /// [`try_acquire_semaphore`](LockProvider::try_acquire_semaphore) for the count and how
    /// permits are kept.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a dropped future ends the wait, and leaves neither a permit nor the queue
    /// lock held (a permit or queue lock it had just taken is released in the background).
    pub async fn acquire_semaphore(
        &self,
        key: &str,
        max_count: u32,
        timeout: Duration,
    ) -> Result<LockGuard, LockError> {
        self.semaphore(key, max_count, timeout).await
    }

    /// Whether this provider's backend keeps semaphores natively (it implements
    /// [`PermitStore`]; SQLite and etcd do): a try costs one atomic step of the store whatever
    /// `max_count`, up to [`u32::MAX`], and the store records each semaphore's count and
    /// refuses another one while the semaphore is in use. `false`: the slot scheme (see
    /// [`try_acquire_semaphore`](LockProvider::try_acquire_semaphore)).
    pub fn native_semaphores(&self) -> bool {
        self.backend().semaphores().is_some()
    }

    /// The largest `max_count` this provider's backend serves: [`u32::MAX`] where the store
    /// keeps semaphores natively without a bound (SQLite, Redis, etcd, PostgreSQL), the
    /// store's own bound where it has one (MySQL/MariaDB, SQL Server and Oracle walk at most
    /// 1,024 slots in one statement), and [`MAX_SLOT_PERMITS`] on the slot scheme. A larger
    /// count is refused with [`LockError::Config`] naming the bound, before anything is asked.
    pub fn max_semaphore_count(&self) -> u32 {
        self.backend()
            .semaphores()
            .map_or(MAX_SLOT_PERMITS, PermitStore::max_permits)
    }

    /// Whether this provider's backend records each semaphore's count and refuses another one
    /// while the semaphore is in use (see
    /// [`try_acquire_semaphore`](LockProvider::try_acquire_semaphore)). `false` on the slot
    /// scheme and on MySQL/MariaDB, whose user locks can neither be shared nor listed without
    /// privileges the backend does not ask for: there every caller of a semaphore must pass
    /// the same `max_count`, or the semaphore admits up to the largest count passed.
    pub fn records_semaphore_counts(&self) -> bool {
        self.backend()
            .semaphores()
            .is_some_and(PermitStore::keeps_count_record)
    }

    /// How many permits of the semaphore `key` (of `max_count` permits) are held right now,
    /// **by any process**: for a dashboard, an admin page or `dlock ls --semaphore`. Waiters
    /// are not counted, nor are permits whose lease has run out (or whose session ended),
    /// even while their holders have not heard of it yet. Read without taking or changing
    /// anything.
    ///
    /// - **Where the store keeps semaphores natively** ([`native_semaphores`](LockProvider::native_semaphores):
    ///   SQLite, Redis and Valkey in every topology, etcd, PostgreSQL, MySQL/MariaDB, SQL
    ///   Server, Oracle) it is one round trip: a read transaction (SQLite), one script
    ///   (Redis), a counted range read (etcd), one statement (the session engines). A store that records the count answers
    ///   [`LockError::Config`] naming both counts while the semaphore is in use with another
    ///   `max_count`, as an acquisition would be refused; MySQL/MariaDB keep no record
    ///   ([`records_semaphore_counts`](LockProvider::records_semaphore_counts)) and count
    ///   the permits of the first `max_count` slots.
    /// - **On the slot scheme** (Redlock, and a [`LockBackend`](crate::backend::LockBackend)
    ///   of your own) the `max_count` slot locks are read in one go
    ///   ([`LockBackend::held_keys`](crate::backend::LockBackend::held_keys): on Redlock one
    ///   pipeline per node, a slot counting when a quorum of nodes hold it). The count is not
    ///   recorded there, so nothing is refused, and holders that asked with a larger count
    ///   and hold a slot past `max_count` are not counted. A backend of your own that can
    ///   neither list its store nor say whether a key is held answers
    ///   [`LockError::Unsupported`].
    ///
    /// `max_count` 0, or a count above [`max_semaphore_count`](LockProvider::max_semaphore_count),
    /// is a [`LockError::Config`], as for an acquisition.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), dlock::LockError> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let url = format!("sqlite://{}/locks.db", dir.path().display());
    /// let worker = dlock::LockProvider::connect(&url).await?;
    /// let dashboard = dlock::LockProvider::connect(&url).await?;
    /// let permit = worker.try_acquire_semaphore("exports", 2).await?;
    /// assert_eq!(dashboard.semaphore_holders("exports", 2).await?, 1);
    /// permit.release().await?;
    /// assert_eq!(dashboard.semaphore_holders("exports", 2).await?, 0);
    /// # Ok(()) }
    /// ```
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only reads.
    pub async fn semaphore_holders(&self, key: &str, max_count: u32) -> Result<u32, LockError> {
        validate_key(key)?;
        if max_count == 0 {
            return Err(LockError::config(
                "a semaphore needs a max_count of at least 1",
            ));
        }
        let store = self.backend().semaphores();
        check_count(store, key, max_count, self.backend_name())?;
        match store {
            Some(store) => store
                .holders(key, max_count)
                .await
                .map_err(|err| rekey(err, key)),
            None => {
                let slots: Vec<String> = (0..max_count).map(|slot| slot_name(key, slot)).collect();
                let held = self
                    .backend()
                    .held_keys(&slots)
                    .await
                    .map_err(|err| match err {
                        LockError::Unsupported { message, .. } => LockError::unsupported(
                            self.backend_name(),
                            "semaphore occupancy",
                            format!(
                                "this backend keeps semaphores as slot locks and cannot say \
                                 whether a lock is held ({message}); implement \
                                 `LockBackend::held_keys` or `LockBackend::store_locks`"
                            ),
                        ),
                        other => rekey(other, key),
                    })?;
                if held.len() != slots.len() {
                    return Err(LockError::backend(
                        self.backend_name(),
                        format!(
                            "asked whether {} slot locks are held, the backend answered for {}",
                            slots.len(),
                            held.len()
                        ),
                        None,
                        None,
                    ));
                }
                Ok(
                    u32::try_from(held.into_iter().filter(|held| *held).count())
                        .unwrap_or(u32::MAX),
                )
            }
        }
    }

    async fn semaphore(
        &self,
        key: &str,
        max_count: u32,
        timeout: Duration,
    ) -> Result<LockGuard, LockError> {
        self.observed(
            key,
            timeout,
            self.semaphore_untraced(key, max_count, timeout),
        )
        .await
    }

    async fn semaphore_untraced(
        &self,
        key: &str,
        max_count: u32,
        timeout: Duration,
    ) -> Result<LockGuard, LockError> {
        validate_key(key)?;
        if max_count == 0 {
            return Err(LockError::config(
                "a semaphore needs a max_count of at least 1",
            ));
        }
        let store = self.backend().semaphores();
        check_count(store, key, max_count, self.backend_name())?;
        let shutdown = self.shutdown_token();
        if crate::provider::is_cancelled(None, shutdown) {
            return Err(LockError::Canceled {
                key: Arc::from(key),
            });
        }
        let runtime = current_runtime()?;
        let one_try = timeout.is_zero();
        let deadline = if one_try {
            None
        } else {
            crate::time::deadline(Instant::now(), timeout)
        };
        let attempt = async {
            if one_try {
                return match self
                    .try_permit(store, key, max_count, None, &runtime)
                    .await?
                {
                    Found::Taken(guard) => Ok(guard),
                    Found::Full { .. } => Err(LockError::AlreadyHeld {
                        key: Arc::from(key),
                    }),
                };
            }
            match store {
                Some(store) if store.supports_native_permit_wait() => {
                    self.native_wait(store, key, max_count, deadline, timeout, &runtime)
                        .await
                }
                _ => {
                    self.wait_in_queue(store, key, max_count, deadline, timeout, &runtime)
                        .await
                }
            }
        };
        tokio::select! {
            biased;
            () = crate::provider::cancelled(None, shutdown) => Err(LockError::Canceled {
                key: Arc::from(key),
            }),
            taken = attempt => taken,
        }
    }

    /// The permit request for `key` with the provider's lease terms.
    fn permit_request<'a>(&self, key: &'a str, max_count: u32) -> PermitRequest<'a> {
        let (lease, renew) = self.lease_terms();
        PermitRequest::new(key, max_count)
            .with_lease(lease)
            .with_renewal(renew)
    }

    /// One try for a permit: of the store's native semaphore (with the waiting mark
    /// `waiting`, see [`PermitRequest::waiting`]), or of the slot scheme.
    async fn try_permit(
        &self,
        store: Option<&dyn PermitStore>,
        key: &str,
        max_count: u32,
        waiting: Option<Duration>,
        runtime: &tokio::runtime::Handle,
    ) -> Result<Found, LockError> {
        let Some(store) = store else {
            return self.try_slots(key, max_count).await;
        };
        let request = self.permit_request(key, max_count).with_waiting(waiting);
        Ok(match store.try_acquire_permit(request).await? {
            PermitTry::Acquired(acquired) => Found::Taken(LockGuard::permit(
                None,
                Arc::from(key),
                max_count,
                acquired,
                Arc::clone(self.metrics()),
                runtime.clone(),
            )),
            PermitTry::Full { retry_within } => Found::Full { retry_within },
        })
    }

    /// A wait on the store's own FIFO queue of permits.
    async fn native_wait(
        &self,
        store: &dyn PermitStore,
        key: &str,
        max_count: u32,
        deadline: Option<Instant>,
        timeout: Duration,
        runtime: &tokio::runtime::Handle,
    ) -> Result<LockGuard, LockError> {
        let remaining = deadline.map_or(Duration::MAX, |deadline| {
            deadline.saturating_duration_since(Instant::now())
        });
        // A share of the queue's name in the table while it waits, so that the wait counts
        // among the keys the provider is acquiring (local waiters do not queue on it: the
        // store orders them).
        let _waiting = self.table().try_slot(&queue_name(key), true);
        let request = self.permit_request(key, max_count);
        match store.acquire_permit_wait(request, remaining).await? {
            Some(acquired) => Ok(LockGuard::permit(
                None,
                Arc::from(key),
                max_count,
                acquired,
                Arc::clone(self.metrics()),
                runtime.clone(),
            )),
            None => Err(LockError::Timeout {
                key: Arc::from(key),
                timeout,
            }),
        }
    }

    /// A wait through the semaphore's queue lock: takes it with what is left of the timeout,
    /// then tries for a permit until one is taken or the deadline passes (the last try at the
    /// deadline), and gives the queue lock back: in the background once it has a permit (as a
    /// dropped guard), awaited when it ends without one.
    async fn wait_in_queue(
        &self,
        store: Option<&dyn PermitStore>,
        key: &str,
        max_count: u32,
        deadline: Option<Instant>,
        timeout: Duration,
        runtime: &tokio::runtime::Handle,
    ) -> Result<LockGuard, LockError> {
        let queue = self.queue_lock(key, deadline, timeout).await?;
        match self
            .wait_at_head(store, key, max_count, deadline, timeout, runtime)
            .await
        {
            // The next waiter takes the queue lock a moment later; the permit is the caller's
            // now.
            Ok(guard) => {
                drop(queue);
                Ok(guard)
            }
            // A wait that ends without a permit gives the queue lock back before it answers:
            // a single try of the caller's right after it must not find it still held (which
            // a store may read as a waiter ahead).
            Err(err) => {
                if let Err(release) = queue.release().await {
                    tracing::debug!(error = %release, "giving back a semaphore's queue lock failed");
                }
                Err(err)
            }
        }
    }

    /// The tries of the waiter at the head of the semaphore's queue (it holds the queue lock),
    /// until a permit is taken or the deadline passes.
    async fn wait_at_head(
        &self,
        store: Option<&dyn PermitStore>,
        key: &str,
        max_count: u32,
        deadline: Option<Instant>,
        timeout: Duration,
        runtime: &tokio::runtime::Handle,
    ) -> Result<LockGuard, LockError> {
        let longest = match store {
            Some(_) => HEAD_PAUSES.1,
            None => slot_head_pause(max_count),
        };
        let mut pause = HEAD_PAUSES.0;
        let mut watch: Option<Box<dyn ReleaseWatch>> = None;
        let mut asked_for_watch = store.is_none();
        loop {
            let live = watch.as_ref().is_some_and(|watch| watch.is_live());
            // The longest pause before the next try, jitter included.
            let next = if live {
                WATCHED_PAUSE
            } else {
                longest.mul_f64(1.25)
            };
            let mark = next.saturating_mul(2).max(MARK_MIN);
            if let Some(watch) = watch.as_mut() {
                watch.mark_seen();
            }
            let retry_within = match self
                .try_permit(store, key, max_count, Some(mark), runtime)
                .await
            {
                Ok(Found::Taken(guard)) => return Ok(guard),
                Ok(Found::Full { retry_within }) => retry_within,
                // Taken, but answered too late to count on the lease; given back. A wait
                // tries again.
                Err(LockError::Lost { .. }) => None,
                Err(err) => return Err(rekey(err, key)),
            };
            if !asked_for_watch && let Some(store) = store {
                asked_for_watch = true;
                let watching = store.watch_permits(self.permit_request(key, max_count));
                watch = match deadline {
                    Some(deadline) => tokio::time::timeout_at(deadline.into(), watching)
                        .await
                        .unwrap_or(None),
                    None => watching.await,
                };
                if watch.as_ref().is_some_and(|watch| watch.is_live()) {
                    // A permit may have been given back before the watch was in place.
                    continue;
                }
            }
            let left = deadline.map(|deadline| deadline.saturating_duration_since(Instant::now()));
            if left == Some(Duration::ZERO) {
                return Err(LockError::Timeout {
                    key: Arc::from(key),
                    timeout,
                });
            }
            let mut this = if live {
                WATCHED_PAUSE.mul_f64(0.75 + 0.25 * fastrand::f64())
            } else {
                let this = pause.mul_f64(0.75 + 0.5 * fastrand::f64());
                pause = pause.saturating_mul(2).min(longest);
                this
            };
            if let Some(within) = retry_within {
                this = this.min(within);
            }
            if let Some(left) = left {
                this = this.min(left);
            }
            match watch.as_mut().filter(|watch| watch.is_live()) {
                Some(watch) => tokio::select! {
                    () = tokio::time::sleep(this) => {}
                    () = watch.woken() => {}
                },
                None => tokio::time::sleep(this).await,
            }
        }
    }

    /// Takes the queue lock of the semaphore `key` with what is left of the timeout. Its
    /// guard records nothing in the metrics and is not shown by inspection.
    async fn queue_lock(
        &self,
        key: &str,
        deadline: Option<Instant>,
        timeout: Duration,
    ) -> Result<LockGuard, LockError> {
        let left = deadline.map_or(Duration::MAX, |deadline| {
            deadline.saturating_duration_since(Instant::now())
        });
        let timed_out = || LockError::Timeout {
            key: Arc::from(key),
            timeout,
        };
        if left.is_zero() {
            return Err(timed_out());
        }
        let terms = Terms {
            internal: true,
            ..Terms::default()
        };
        match self
            .acquire_raw(&queue_name(key), left, None, terms, None)
            .await
        {
            Ok(taken) => Ok(LockGuard::new(
                taken.slot,
                taken.acquired,
                Arc::clone(self.quiet_metrics()),
                taken.runtime,
            )),
            Err(LockError::Timeout { .. } | LockError::AlreadyHeld { .. }) => Err(timed_out()),
            Err(err) => Err(rekey(err, key)),
        }
    }

    /// One try of every slot of the slot scheme, in turn from a random one: the first slot
    /// taken, or `Full` when all are held.
    async fn try_slots(&self, key: &str, max_count: u32) -> Result<Found, LockError> {
        let terms = Terms {
            internal: true,
            ..Terms::default()
        };
        let start = fastrand::u32(..max_count);
        for i in 0..max_count {
            // Below 2 × MAX_SLOT_PERMITS: no overflow.
            let slot = (start + i) % max_count;
            match self
                .acquire_raw(&slot_name(key, slot), Duration::ZERO, None, terms, None)
                .await
            {
                Ok(taken) => {
                    return Ok(Found::Taken(LockGuard::permit(
                        Some(taken.slot),
                        Arc::from(key),
                        max_count,
                        taken.acquired,
                        Arc::clone(self.metrics()),
                        taken.runtime,
                    )));
                }
                Err(LockError::AlreadyHeld { .. }) => {}
                Err(err) => return Err(rekey(err, key)),
            }
        }
        Ok(Found::Full { retry_within: None })
    }
}

/// Refuses a `max_count` above what the backend serves (the slot scheme's
/// [`MAX_SLOT_PERMITS`], or the store's [`PermitStore::max_permits`]).
fn check_count(
    store: Option<&dyn PermitStore>,
    key: &str,
    max_count: u32,
    backend: &str,
) -> Result<(), LockError> {
    match store {
        None if max_count > MAX_SLOT_PERMITS => Err(LockError::config(format!(
            "the semaphore `{}` asks for {max_count} permits; the {backend} backend keeps \
             semaphores as one lock per permit, at most {MAX_SLOT_PERMITS} (a try of a full \
             semaphore asks for every one of them)",
            key.escape_debug(),
        ))),
        Some(store) if max_count > store.max_permits() => Err(LockError::config(format!(
            "the semaphore `{}` asks for {max_count} permits; the {backend} backend serves at \
             most {} (a try walks the permits in one statement)",
            key.escape_debug(),
            store.max_permits()
        ))),
        _ => Ok(()),
    }
}

/// `err`, naming the semaphore `key` where it named one of the semaphore's internal locks.
fn rekey(err: LockError, key: &str) -> LockError {
    let key = || Arc::from(key);
    match err {
        LockError::AlreadyHeld { .. } => LockError::AlreadyHeld { key: key() },
        LockError::Timeout { timeout, .. } => LockError::Timeout {
            key: key(),
            timeout,
        },
        LockError::Lost { reason, .. } => LockError::Lost { key: key(), reason },
        LockError::Canceled { .. } => LockError::Canceled { key: key() },
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::MemoryBackend;

    fn native() -> MemoryBackend {
        MemoryBackend {
            permits: true,
            ..MemoryBackend::default()
        }
    }

    #[test]
    fn internal_names_are_distinct_and_never_lock_keys() {
        let names = [
            slot_name("x", 0),
            slot_name("x", 1),
            slot_name("x", 10),
            slot_name("x\u{0}1", 0),
            slot_name("1\u{0}x", 0),
            queue_name("x"),
            queue_name("0\u{0}x"),
            queue_name("semaphore\u{0}0\u{0}x"),
        ];
        for (i, a) in names.iter().enumerate() {
            assert!(crate::key::refuse_reserved(a).is_err(), "{a:?} is reserved");
            for b in &names[i + 1..] {
                assert_ne!(a, b);
            }
        }
        assert!(crate::key::refuse_reserved("x").is_ok());
        assert!(crate::key::refuse_reserved("dlock:x").is_ok());
    }

    /// A try of a native semaphore is one try of the store whatever the count; the slot
    /// scheme refuses a count above its limit before asking anything.
    #[tokio::test]
    async fn a_huge_count_costs_one_try_or_is_refused_at_once() {
        let backend = native();
        let locks = LockProvider::from_backend(backend.clone());
        for count in [u32::MAX, 1_000_000] {
            let before = backend.store().permit_tries;
            let guard = locks.try_acquire_semaphore("big", count).await.unwrap();
            assert_eq!(backend.store().permit_tries, before + 1);
            assert_eq!(backend.store().tries, 0, "no lock was asked for");
            guard.release().await.unwrap();
        }

        let slots = MemoryBackend::default();
        let locks = LockProvider::from_backend(slots.clone());
        for count in [u32::MAX, MAX_SLOT_PERMITS + 1] {
            for timeout in [Duration::ZERO, Duration::from_secs(5)] {
                let err = locks
                    .acquire_semaphore("big", count, timeout)
                    .await
                    .unwrap_err();
                assert!(
                    matches!(&err, LockError::Config { message } if message.contains("1024")),
                    "{err:?}"
                );
            }
        }
        assert_eq!(slots.store().tries, 0);
        // A full semaphore of the largest count: one try per slot, each slot once.
        for slot in 0..MAX_SLOT_PERMITS {
            slots.hold_elsewhere(&slot_name("big", slot));
        }
        assert!(matches!(
            locks.try_acquire_semaphore("big", MAX_SLOT_PERMITS).await,
            Err(LockError::AlreadyHeld { .. })
        ));
        assert_eq!(slots.store().tries, MAX_SLOT_PERMITS as usize);
        slots.free(&slot_name("big", 700));
        let guard = locks
            .try_acquire_semaphore("big", MAX_SLOT_PERMITS)
            .await
            .unwrap();
        assert_eq!(guard.key(), "big");
        assert!(slots.is_held(&slot_name("big", 700)));
        guard.release().await.unwrap();
    }

    /// On the slot scheme, the holders are the held slots among the first `max_count`, read
    /// in one call whatever the count (another semaphore's slots and the lock of the same key
    /// not counted), and a count above the slot limit is refused before anything is asked.
    #[tokio::test]
    async fn slot_scheme_holders_are_the_held_slots() {
        let slots = MemoryBackend::default();
        let locks = LockProvider::from_backend(slots.clone());
        assert_eq!(locks.semaphore_holders("s", 3).await.unwrap(), 0);
        let first = locks.try_acquire_semaphore("s", 3).await.unwrap();
        // The permit took a slot drawn at random: another one of the three is held elsewhere.
        let mine = (0..3)
            .find(|slot| slots.is_held(&slot_name("s", *slot)))
            .expect("the permit's slot");
        slots.hold_elsewhere(&slot_name("s", (mine + 1) % 3));
        slots.hold_elsewhere(&slot_name("s", 5));
        slots.hold_elsewhere(&slot_name("t", 0));
        slots.hold_elsewhere("s");
        let before = slots.store().tries;
        assert_eq!(locks.semaphore_holders("s", 3).await.unwrap(), 2);
        assert_eq!(locks.semaphore_holders("s", 6).await.unwrap(), 3);
        assert_eq!(slots.store().tries, before, "counting takes nothing");
        first.release().await.unwrap();
        assert_eq!(locks.semaphore_holders("s", 3).await.unwrap(), 1);
        for count in [0, MAX_SLOT_PERMITS + 1] {
            assert!(matches!(
                locks.semaphore_holders("s", count).await,
                Err(LockError::Config { .. })
            ));
        }
        assert!(matches!(
            locks.semaphore_holders("", 3).await,
            Err(LockError::InvalidKey { .. })
        ));
    }

    /// A permit's guard names the semaphore; inspection shows it as a permit of its
    /// semaphore, and never the queue lock a wait takes.
    #[tokio::test]
    async fn a_permit_is_shown_under_the_semaphores_key() {
        for backend in [native(), MemoryBackend::default()] {
            let locks = LockProvider::from_backend(backend.clone());
            let first = locks.try_acquire_semaphore("s", 2).await.unwrap();
            let second = locks
                .acquire_semaphore("s", 2, Duration::from_secs(5))
                .await
                .unwrap();
            assert_eq!((first.key(), second.key()), ("s", "s"));
            let held = locks.held_locks();
            assert_eq!(held.len(), 2, "{held:?}");
            assert!(
                held.iter()
                    .all(|info| info.key == "s" && info.semaphore == Some(2) && !info.shared),
                "{held:?}"
            );
            let plain = locks.try_acquire("s").await.unwrap();
            let locks_of_s = locks.held_locks();
            assert_eq!(
                locks_of_s
                    .iter()
                    .filter(|info| info.semaphore.is_none())
                    .count(),
                1,
                "{locks_of_s:?}"
            );
            plain.release().await.unwrap();
            first.release().await.unwrap();
            second.release().await.unwrap();
            assert!(locks.held_locks().is_empty());
        }
    }

    /// Defect 1 of issue 43, in one process: a holder that gives its permit back and asks
    /// again queues behind the waiter that was there first (it used to take its permit
    /// straight back, while the waiter slept out its backoff).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_holder_that_asks_again_queues_behind_the_waiter() {
        for backend in [native(), MemoryBackend::default()] {
            let slow =
                crate::Backoff::new(Duration::from_millis(200), Duration::from_millis(200), 0.0)
                    .unwrap();
            let locks = LockProvider::builder(backend.clone()).backoff(slow).build();
            let held = locks.try_acquire_semaphore("s", 1).await.unwrap();
            let waiter = {
                let locks = locks.clone();
                tokio::spawn(async move {
                    locks
                        .acquire_semaphore("s", 1, Duration::from_secs(30))
                        .await
                })
            };
            // The waiter is at the head of the queue.
            crate::testing::spin_until("the waiter heads the queue", || {
                backend.is_held(&queue_name("s"))
            })
            .await;
            held.release().await.unwrap();
            let again = {
                let locks = locks.clone();
                tokio::spawn(async move {
                    locks
                        .acquire_semaphore("s", 1, Duration::from_secs(30))
                        .await
                })
            };
            let first = tokio::time::timeout(Duration::from_secs(10), waiter)
                .await
                .expect("the waiter is served")
                .unwrap()
                .unwrap();
            assert!(!again.is_finished(), "the holder asking again went first");
            drop(first);
            let second = tokio::time::timeout(Duration::from_secs(10), again)
                .await
                .expect("then the holder that asked again")
                .unwrap()
                .unwrap();
            drop(second);
        }
    }

    /// The waiter at the head of the queue marks its tries (`waiting`), long enough to cover
    /// its next pause; a single try does not; and while a mark is live, a single try does not
    /// take a free permit (the memory store keeps marks as every store must).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_single_try_does_not_take_the_permit_a_waiter_waits_for() {
        let backend = native();
        let locks = LockProvider::from_backend(backend.clone());
        let held = locks.try_acquire_semaphore("s", 1).await.unwrap();
        let waiter = {
            let locks = locks.clone();
            tokio::spawn(async move {
                locks
                    .acquire_semaphore("s", 1, Duration::from_millis(300))
                    .await
            })
        };
        assert!(matches!(
            waiter.await.unwrap(),
            Err(LockError::Timeout { .. })
        ));
        let marks = backend.store().permit_waitings.clone();
        assert_eq!(marks[0], None, "the single try");
        assert!(marks.len() > 3, "{marks:?}");
        for mark in &marks[1..] {
            let mark = mark.expect("every try of the wait is marked");
            // Twice the longest pause (with its jitter), at least 100 ms.
            assert!(mark >= HEAD_PAUSES.1.mul_f64(2.5).max(MARK_MIN), "{mark:?}");
            assert!(mark <= WATCHED_PAUSE * 3, "{mark:?}");
        }
        drop(held);
        crate::testing::spin_until("no permit is held", || backend.permits_held("s") == 0).await;

        // A mark that lasts: a single try meets it, a waiting try is served and clears it.
        let request = PermitRequest::new("t", 1);
        let first = locks.try_acquire_semaphore("t", 1).await.unwrap();
        let marked = PermitStore::try_acquire_permit(
            &backend,
            request.with_waiting(Some(Duration::from_secs(3600))),
        )
        .await
        .unwrap();
        assert!(matches!(marked, PermitTry::Full { .. }));
        first.release().await.unwrap();
        assert!(matches!(
            locks.try_acquire_semaphore("t", 1).await,
            Err(LockError::AlreadyHeld { .. })
        ));
        let served = PermitStore::try_acquire_permit(
            &backend,
            request.with_waiting(Some(Duration::from_secs(3600))),
        )
        .await
        .unwrap();
        let PermitTry::Acquired(served) = served else {
            panic!("a waiting try takes the free permit")
        };
        served.handle.release().await.unwrap();
        drop(locks.try_acquire_semaphore("t", 1).await.unwrap());
    }

    /// Another count is refused while the semaphore is held, and taken once all have left.
    #[tokio::test]
    async fn a_disagreeing_count_is_refused_while_held() {
        let backend = native();
        let locks = LockProvider::from_backend(backend.clone());
        let held = locks.try_acquire_semaphore("s", 2).await.unwrap();
        for timeout in [Duration::ZERO, Duration::from_secs(30)] {
            let err = locks.acquire_semaphore("s", 5, timeout).await.unwrap_err();
            assert!(
                matches!(&err, LockError::Config { message }
                    if message.contains("max_count 2") && message.contains("max_count 5")),
                "{err:?}"
            );
        }
        held.release().await.unwrap();
        drop(locks.try_acquire_semaphore("s", 5).await.unwrap());
    }

    /// Every way a semaphore wait runs out of time answers `Timeout` naming the semaphore:
    /// waiting for a permit, and waiting behind another waiter (for the queue lock).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn waits_that_run_out_answer_timeout() {
        for backend in [native(), MemoryBackend::default()] {
            let locks = LockProvider::from_backend(backend.clone());
            let other = LockProvider::from_backend(backend.clone());
            let held = locks.try_acquire_semaphore("s", 1).await.unwrap();
            let timeout = Duration::from_millis(50);
            let started = Instant::now();
            let err = locks.acquire_semaphore("s", 1, timeout).await.unwrap_err();
            assert!(started.elapsed() >= timeout);
            assert!(
                matches!(&err, LockError::Timeout { key, timeout: t } if &**key == "s" && *t == timeout),
                "{err:?}"
            );
            let ahead = {
                let locks = locks.clone();
                tokio::spawn(async move {
                    locks
                        .acquire_semaphore("s", 1, Duration::from_secs(30))
                        .await
                })
            };
            crate::testing::spin_until("the waiter heads the queue", || {
                backend.is_held(&queue_name("s"))
            })
            .await;
            // Behind it in this provider (the table's queue) and in another (the store's).
            for provider in [&locks, &other] {
                let err = provider
                    .acquire_semaphore("s", 1, timeout)
                    .await
                    .unwrap_err();
                assert!(
                    matches!(&err, LockError::Timeout { key, .. } if &**key == "s"),
                    "{err:?}"
                );
            }
            assert!(matches!(
                other.acquire_semaphore("s", 1, Duration::ZERO).await,
                Err(LockError::AlreadyHeld { key }) if &*key == "s"
            ));
            drop(held);
            drop(ahead.await.unwrap().unwrap());
        }
    }

    /// A dropped wait, and one ended by the provider's shutdown during its pause, leave
    /// neither the queue lock nor a permit held.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn ended_waits_leave_nothing_held() {
        for backend in [native(), MemoryBackend::default()] {
            let shutdown = tokio_util::sync::CancellationToken::new();
            let locks = LockProvider::builder(backend.clone())
                .cancel_on(&shutdown)
                .build();
            let other = LockProvider::from_backend(backend.clone());
            let held = other.try_acquire_semaphore("s", 1).await.unwrap();
            let dropped = tokio::time::timeout(
                Duration::from_millis(30),
                locks.acquire_semaphore("s", 1, Duration::from_secs(30)),
            )
            .await;
            assert!(dropped.is_err());
            let wait = {
                let locks = locks.clone();
                tokio::spawn(async move {
                    locks
                        .acquire_semaphore("s", 1, Duration::from_secs(60))
                        .await
                })
            };
            let tried = || {
                let store = backend.store();
                store.permit_tries + store.tries
            };
            let before = tried();
            crate::testing::spin_until("two more tries", || tried() >= before + 2).await;
            shutdown.cancel();
            let answer = tokio::time::timeout(Duration::from_secs(2), wait)
                .await
                .expect("the shutdown ends the wait")
                .unwrap();
            assert!(
                matches!(&answer, Err(LockError::Canceled { key }) if &**key == "s"),
                "{answer:?}"
            );
            drop(held);
            // The queue lock is given back in the background, then its table slot freed.
            let queue = queue_name("s");
            tokio::time::timeout(Duration::from_secs(5), async {
                while backend.is_held(&queue)
                    || backend.permits_held("s") > 0
                    || locks.local_key_count() > 0
                {
                    tokio::task::yield_now().await;
                }
            })
            .await
            .expect("the ended waits leave no queue lock, permit or table slot behind");
            // (A single try may meet the waiting mark the canceled waiter left, for up to
            // its length.)
            let free = other
                .acquire_semaphore("s", 1, Duration::from_secs(5))
                .await
                .unwrap();
            drop(free);
        }
    }
}
