//! The trait every lock store implements.
//!
//! Applications do not call these methods themselves: they go through a
//! [`LockProvider`](crate::LockProvider), which adds what every backend shares (key validation,
//! the in-process table, timeouts, backoff, cancellation, release on drop). Implement
//! [`LockBackend`] to put locks on a store this crate does not cover, then wrap it with
//! [`LockProvider::from_backend`](crate::LockProvider::from_backend).

use std::fmt::Debug;
use std::future::Future;
use std::pin::Pin;
use std::time::{Duration, SystemTime};

use tokio_util::sync::CancellationToken;

use crate::LockError;
pub use crate::lease::LeaseDeadline;

/// A boxed, `Send` future, as the backend trait returns them (the trait must stay object safe).
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// What a backend is asked to lock.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct LockRequest<'a> {
    /// The key, already validated (non-empty).
    pub key: &'a str,
    /// The lease asked for this acquisition, if the caller set one; lease-based backends use
    /// their configured default otherwise, and session-based backends ignore it.
    pub lease: Option<Duration>,
    /// Whether a lease-based backend renews the lock while it is held (the default). When
    /// not, the lock expires with its lease, and its lost token fires at its local deadline.
    /// Session-based backends ignore it.
    pub renew: bool,
    /// A read lock: shared with other read locks of the key, excluding its exclusive locks
    /// (and excluded by them). Asked only of a backend whose
    /// [`shared_locks`](LockBackend::shared_locks) answers `Ok`; such a backend may see
    /// several shared requests of one key from one provider at the same time, and must let
    /// them share.
    pub shared: bool,
    /// Set on each try of a wait that the provider polls (a backend without native waits,
    /// asked to wait): the longest pause the provider may take before its next try (the
    /// backoff's longest pause with its jitter, or while the backend's
    /// [wake-ups](LockBackend::watch_releases) are live its fallback poll, cut to what is left
    /// of the timeout). `None`
    /// for a single try. A lease backend with read locks uses it on an exclusive request to
    /// hold new readers back while the writer waits, for a few such pauses after its last try
    /// (see the backend's docs).
    pub poll_pause: Option<Duration>,
}

impl<'a> LockRequest<'a> {
    /// A request for `key` with the backend's default lease, renewed while held.
    pub fn new(key: &'a str) -> Self {
        LockRequest {
            key,
            lease: None,
            renew: true,
            shared: false,
            poll_pause: None,
        }
    }

    /// The same request with the given lease.
    pub fn with_lease(mut self, lease: Option<Duration>) -> Self {
        self.lease = lease;
        self
    }

    /// The same request, renewed while held (`true`) or left to expire with its lease.
    pub fn with_renewal(mut self, renew: bool) -> Self {
        self.renew = renew;
        self
    }

    /// The same request, for a read (shared) lock when `shared` is true.
    pub fn with_shared(mut self, shared: bool) -> Self {
        self.shared = shared;
        self
    }

    /// The same request, as a try of a polled wait whose next pause is at most `pause`
    /// (see [`poll_pause`](LockRequest::poll_pause)).
    pub fn with_poll_pause(mut self, pause: Option<Duration>) -> Self {
        self.poll_pause = pause;
        self
    }
}

/// A lock a backend has taken.
#[derive(Debug)]
#[non_exhaustive]
pub struct Acquired {
    /// The fencing token of this acquisition, if the backend issues them.
    pub fencing_token: Option<u64>,
    /// Cancelled by the backend when it learns (or must presume) that the lock is no longer
    /// held: a dead connection, a failed or refused lease renewal.
    pub lost: CancellationToken,
    /// Gives the lock back.
    pub handle: Box<dyn HeldLock>,
    /// For a leased lock: the local deadline past which, without a confirmed renewal, the
    /// lock is presumed lost. The guard checks it in [`is_lost`](crate::LockGuard::is_lost)
    /// and [`release`](crate::LockGuard::release), so a holder that was paused past it (a
    /// stopped process, a suspended VM, a long pause of its thread) hears of the loss at once,
    /// before the backend's renewal task has run again. `None` for session locks.
    pub lease_deadline: Option<LeaseDeadline>,
}

impl Acquired {
    /// A taken lock.
    pub fn new(
        fencing_token: Option<u64>,
        lost: CancellationToken,
        handle: Box<dyn HeldLock>,
    ) -> Self {
        Acquired {
            fencing_token,
            lost,
            handle,
            lease_deadline: None,
        }
    }

    /// The same lock, presumed lost once `deadline` passes without a renewal moving it on
    /// (see [`lease_deadline`](Acquired::lease_deadline)).
    pub fn with_lease_deadline(mut self, deadline: LeaseDeadline) -> Self {
        self.lease_deadline = Some(deadline);
        self
    }
}

/// What a release found in the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ReleaseOutcome {
    /// The lock was held by this owner, and is now free.
    Released,
    /// There was no lock to give back: it was released already, its lease ran out, or its
    /// session ended.
    AlreadyReleased,
    /// Another owner holds the lock now; it was left alone.
    NotOwned,
}

/// A lock held in the store by any process, as
/// [`LockProvider::store_locks`](crate::LockProvider::store_locks) shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct StoreLock {
    /// The lock's key: read from the store where it keeps keys (SQLite, Redis); where it keeps
    /// only a number (PostgreSQL's advisory lock id), the key when the caller knows it (a key
    /// held through this provider), else `None`.
    pub key: Option<String>,
    /// What the store calls it: the row's name, the Redis key, the advisory lock id.
    pub resource: String,
    /// How many readers share it; 0 for an exclusive lock.
    pub readers: u32,
    /// Its latest fencing token, where the store keeps one beside the lock.
    pub fencing_token: Option<u64>,
    /// How long its lease still runs, by the store's reckoning, for a leased lock.
    pub remaining_lease: Option<Duration>,
    /// Whether this provider holds it (filled in by the provider).
    pub held_here: bool,
    /// The holder's owner label, where the store keeps one (see [`StoreLock::owner`]).
    owner: Option<String>,
    /// When the holder took it, where the store records that (see [`StoreLock::since`]).
    since: Option<SystemTime>,
}

impl StoreLock {
    /// A lock the store calls `resource`, exclusive, with nothing else known of it.
    pub fn new(resource: impl Into<String>) -> Self {
        StoreLock {
            key: None,
            resource: resource.into(),
            readers: 0,
            fencing_token: None,
            remaining_lease: None,
            held_here: false,
            owner: None,
            since: None,
        }
    }

    /// Who holds it: the [owner label](crate::ProviderBuilder::owner_label) of the provider
    /// that took it (by default its host name and process id), where the store keeps labels
    /// (SQLite, Redis, etcd's lock key value, PostgreSQL's `application_name`, the
    /// `program_name` a MySQL client sent); for a lock held by several readers, their labels,
    /// comma-separated. `None` where the store cannot say (other stores, dlock's own MySQL
    /// sessions, whose driver sends no `program_name`, or a lock taken by an earlier version
    /// of dlock or another client).
    pub fn owner(&self) -> Option<&str> {
        self.owner.as_deref()
    }

    /// When its holder took it, on the wall clock of the machine that took it, where the
    /// store records that: SQLite (each lock row keeps the time beside its owner; a lock taken
    /// by an earlier version of dlock, and a lock held by readers, show none). `None`
    /// elsewhere: Redis, Redlock and etcd keep no time with a lock, and PostgreSQL's
    /// `pg_locks` says when a session began or last ran a statement, not when it took an
    /// advisory lock (dlock's sessions hold many locks over their lives).
    pub fn since(&self) -> Option<SystemTime> {
        self.since
    }

    /// The same lock, taken at `since` (see [`StoreLock::since`]).
    pub fn with_since(mut self, since: Option<SystemTime>) -> Self {
        self.since = since;
        self
    }

    /// The same lock, with its owner label.
    pub fn with_owner(mut self, owner: Option<String>) -> Self {
        self.owner = owner.filter(|owner| !owner.is_empty());
        self
    }

    /// The same lock, with its key.
    pub fn with_key(mut self, key: Option<String>) -> Self {
        self.key = key;
        self
    }

    /// The same lock, shared by `readers` readers (0: exclusive).
    pub fn with_readers(mut self, readers: u32) -> Self {
        self.readers = readers;
        self
    }

    /// The same lock, with its latest fencing token.
    pub fn with_fencing_token(mut self, token: Option<u64>) -> Self {
        self.fencing_token = token;
        self
    }

    /// The same lock, with the time its lease still runs.
    pub fn with_remaining_lease(mut self, remaining: Option<Duration>) -> Self {
        self.remaining_lease = remaining;
        self
    }
}

/// Handle-level control of a leased lock (SQLite, Redis): see
/// [`HeldLock::lease_control`].
pub trait LeaseControl: Send + Sync {
    /// Sets the lease to `lease` from now if this owner still holds the lock, and makes it the
    /// lease later renewals ask for. `Ok(false)` when the lock is gone or held by another
    /// owner: nothing was changed, and the backend has cancelled the lost token. On success
    /// the local deadline moves to four fifths of `lease` after the command was sent.
    fn extend(&self, lease: Duration) -> BoxFuture<'_, Result<bool, LockError>>;

    /// Asks the store, in one round trip, whether this owner still holds the lock. A `false`
    /// answer also cancels the lost token.
    fn verify_still_held(&self) -> BoxFuture<'_, Result<bool, LockError>>;

    /// Stops renewing the lock without releasing it: the lock then expires with its lease,
    /// and its lost token fires at the local deadline. Idempotent.
    fn stop_renewal(&self);

    /// Starts renewing the lock again (or for the first time, for a lock taken with renewal
    /// off), the first renewal at once, on the backend's schedule from then on. `Ok(true)`
    /// when renewals run (also when they already did); `Ok(false)` when the lock's local
    /// deadline has passed or it is known lost: nothing was started (a renewal must never
    /// revive a lease another owner may have taken over since), and the caller reports the
    /// loss. The default answers [`LockError::Unsupported`], for lease controls written before
    /// this method.
    fn start_renewal(&self) -> Result<bool, LockError> {
        Err(LockError::unsupported(
            "this backend",
            "starting lease renewals",
            "its lease control cannot start renewals once they are off; take the lock with renewal on, or extend it",
        ))
    }
}

/// The backend's handle on one held lock.
///
/// Dropping the handle without calling [`release`](HeldLock::release) must not leave the lock
/// held. The provider calls `release` whenever it can, on a task of the guard's runtime; it
/// cannot when the guard is dropped by that runtime's shutdown (a guard held in a task of a
/// runtime that is being dropped), which refuses new tasks. Then the handle is dropped
/// unreleased, and the backend ends the lock from its `Drop`: it stops any renewal it runs for
/// the lock and gives the lock back where that needs no waiting (dlock's session engines run
/// the unlock on the runtime of the lock's connection, etcd revokes the lease on its own
/// runtime), or lets the lease run out.
pub trait HeldLock: Send + Sync + Debug + 'static {
    /// Gives the lock back. A backend that finds the lock already gone (lease expired and taken
    /// over, connection closed) cancels the lock's lost token and may answer
    /// [`LockError::Lost`]; either way the provider reports the release as `Lost`.
    fn release(self: Box<Self>) -> BoxFuture<'static, Result<(), LockError>>;

    /// Gives the lock back and says what the store found. The default runs
    /// [`release`](HeldLock::release) and answers [`ReleaseOutcome::Released`] on success;
    /// a backend that can tell the outcomes apart overrides it (and cancels the lost token on
    /// any outcome but `Released`, as `release` does).
    fn release_outcome(self: Box<Self>) -> BoxFuture<'static, Result<ReleaseOutcome, LockError>> {
        let release = self.release();
        Box::pin(async move { release.await.map(|()| ReleaseOutcome::Released) })
    }

    /// The lease control of a leased lock; `None` (the default) for a lock that lives with a
    /// session or connection, which has no lease to extend.
    fn lease_control(&self) -> Option<&dyn LeaseControl> {
        None
    }
}

/// Ending one lock in the store whoever holds it, for a backend whose store can do that
/// without ending other locks (see [`LockBackend::force_releases`] and
/// [`LockProvider::force_release`](crate::LockProvider::force_release)).
pub trait ForceRelease: Send + Sync {
    /// Ends the lock of `key` (validated) in the store, whoever holds it, exclusive or held by
    /// readers: `Ok(true)` when a lock was held and is now ended, `Ok(false)` when none was.
    /// Its holders learn of it at their next renewal (their lost tokens fire then), or sooner
    /// where the store tells them. It must leave the key's fencing counter as it was (delete
    /// the lock, never its counter), so that the next holder's token is still greater than
    /// every token issued before.
    fn force_release<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<bool, LockError>>;
}

/// What one try of a polled wait found (see [`LockBackend::try_acquire_in_wait`]).
#[derive(Debug)]
#[non_exhaustive]
pub enum WaitTry {
    /// The lock was taken.
    Acquired(Acquired),
    /// The lock is held elsewhere.
    Held {
        /// How long until the lock may be free with nothing to wake the waiter (the holder's
        /// lease running out: a holder that died never releases), or until the backend needs
        /// the next try for its own bookkeeping, when the backend knows. A wait woken by
        /// releases ([`LockBackend::watch_releases`]) tries again no later than that. `None`:
        /// unknown.
        retry_within: Option<Duration>,
    },
}

/// One waiter's watch on the releases of one key, from [`LockBackend::watch_releases`]: it
/// lets a polled wait sleep until the lock is given back instead of polling often. Wake-ups
/// may be missed (a dropped connection, a release by a client that does not announce it), so
/// the provider still tries again after a long pause, and polls with its backoff while the
/// watch is not live. Dropping the watch ends it.
pub trait ReleaseWatch: Send + Debug {
    /// Whether wake-ups are being delivered now (the backend's subscription is in place).
    /// While not, the provider polls with its backoff, as without a watch.
    fn is_live(&self) -> bool;

    /// Forgets the wake-ups seen so far. The provider calls it just before each try, so that
    /// a release during the try still ends the next [`woken`](ReleaseWatch::woken).
    fn mark_seen(&mut self);

    /// Resolves at the first wake-up (or change of [`is_live`](ReleaseWatch::is_live)) since
    /// the last [`mark_seen`](ReleaseWatch::mark_seen), at once if one came already. Cancel
    /// safe: dropping the future loses no wake-up.
    fn woken(&mut self) -> BoxFuture<'_, ()>;
}

/// The most permits a semaphore may have on a backend without a [`PermitStore`]: 1,024.
///
/// Such a backend keeps a semaphore of `max_count` permits as `max_count` ordinary locks
/// ("slots", in a namespace of their own), and a try of a full semaphore asks for each slot in
/// turn: 1,024 round trips, about 0.1 s on a store a tenth of a millisecond away and a second
/// at a millisecond. Larger counts are refused with [`LockError::Config`] naming this limit;
/// a backend that implements [`PermitStore`] has no such limit.
pub const MAX_SLOT_PERMITS: u32 = 1024;

/// What a [`PermitStore`] is asked for: one permit of the semaphore `key`, which admits up to
/// `max_count` holders at once.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct PermitRequest<'a> {
    /// The semaphore's key, already validated (non-empty). Semaphores are a namespace of their
    /// own: the semaphore `"x"` is unrelated to the lock (and read lock) `"x"`, so the store
    /// keeps permits where no lock is kept.
    pub key: &'a str,
    /// How many holders the semaphore admits at once: 1 to [`u32::MAX`] (the provider refuses
    /// 0 before asking). Every value must be served or refused with a typed error; see
    /// [`PermitStore`] for the count record.
    pub max_count: u32,
    /// The lease asked for this permit, as [`LockRequest::lease`].
    pub lease: Option<Duration>,
    /// Whether a leased permit is renewed while held, as [`LockRequest::renew`].
    pub renew: bool,
    /// `None` for a single try ([`try_acquire_semaphore`](crate::LockProvider::try_acquire_semaphore),
    /// or [`acquire_semaphore`](crate::LockProvider::acquire_semaphore) with a zero timeout).
    ///
    /// `Some(mark)` on each try of a waiting acquisition that the provider polls: the waiter
    /// at the head of the semaphore's queue (see [`PermitStore`], Fairness), which tries again
    /// within `mark` if this try finds the semaphore full. `mark` is how long the store keeps
    /// the *waiting mark* that such a try leaves: the provider passes twice its longest pause
    /// before the next try, at least 100 ms and at most a few seconds (a waiter that gives up
    /// leaves its mark to lapse).
    pub waiting: Option<Duration>,
}

impl<'a> PermitRequest<'a> {
    /// A single try for one of the `max_count` permits of `key`, with the backend's default
    /// lease, renewed while held.
    pub fn new(key: &'a str, max_count: u32) -> Self {
        PermitRequest {
            key,
            max_count,
            lease: None,
            renew: true,
            waiting: None,
        }
    }

    /// The same request with the given lease.
    pub fn with_lease(mut self, lease: Option<Duration>) -> Self {
        self.lease = lease;
        self
    }

    /// The same request, renewed while held (`true`) or left to expire with its lease.
    pub fn with_renewal(mut self, renew: bool) -> Self {
        self.renew = renew;
        self
    }

    /// The same request as a try of a waiting acquisition whose waiting mark lasts `mark`
    /// (`None`: a single try); see [`waiting`](PermitRequest::waiting).
    pub fn with_waiting(mut self, mark: Option<Duration>) -> Self {
        self.waiting = mark;
        self
    }

    /// The key of the semaphore's queue lock (see [`PermitStore`], Waiting and fairness): the
    /// ordinary exclusive lock of the backend that a waiter of a store without a native wait
    /// holds while it waits at the head of the queue, under a reserved name that no lock key
    /// can take. The provider takes its queue lock under this key, so a store whose locks have
    /// no expiry (a session engine's) can keep the waiting mark as "this lock is held",
    /// tested in the try's own step: the mark is then live exactly while a waiter holds the
    /// queue, and ends with the waiter's release, timeout or death.
    ///
    /// ```
    /// use dlock::backend::PermitRequest;
    /// let queue = PermitRequest::new("exports", 2).queue_key();
    /// assert!(queue.starts_with("dlock\0"));
    /// assert_ne!(queue, PermitRequest::new("exports2", 2).queue_key());
    /// // The count is not part of it: every waiter of the semaphore queues on one lock.
    /// assert_eq!(queue, PermitRequest::new("exports", 5).queue_key());
    /// ```
    pub fn queue_key(&self) -> String {
        format!(
            "{}semaphore-queue\0{}",
            crate::key::RESERVED_PREFIX,
            self.key
        )
    }

    /// The [`LockError::Config`] that refuses this request because the store's count record
    /// for the semaphore says `recorded` (see [`PermitStore`], The count record). Every store
    /// answers with this error, so that callers read one message.
    pub fn count_conflict(&self, recorded: u32) -> LockError {
        LockError::config(format!(
            "the semaphore `{}` is in use with max_count {recorded}, and this acquisition asked \
             for max_count {}: every holder and waiter of a semaphore must use the same count \
             (a new count is taken once nobody holds or waits for the semaphore)",
            self.key.escape_debug(),
            self.max_count
        ))
    }
}

/// What one try for a permit found (see [`PermitStore::try_acquire_permit`]).
#[derive(Debug)]
#[non_exhaustive]
pub enum PermitTry {
    /// A permit was granted. The handle releases this permit only.
    Acquired(Acquired),
    /// `max_count` permits are held (or, for a single try, a waiter is ahead: see
    /// [`PermitStore`], Fairness).
    Full {
        /// As [`WaitTry::Held::retry_within`]: how long until a permit may be free with
        /// nothing to wake the waiter (the earliest lease end of a live permit: a holder that
        /// died never releases), when the store knows. `None`: unknown.
        retry_within: Option<Duration>,
    },
}

/// Semaphores kept natively by a store: a count of permits per semaphore, taken and given
/// back in O(1) round trips, with the semaphore's `max_count` recorded beside it. A backend
/// offers one through [`LockBackend::semaphores`].
///
/// Without one, the provider keeps each semaphore as `max_count` ordinary locks of the
/// backend ("slots"), which costs up to `max_count` round trips per try, cannot record the
/// count, and is limited to [`MAX_SLOT_PERMITS`] permits.
///
/// # What a try must guarantee
///
/// [`try_acquire_permit`](PermitStore::try_acquire_permit) is one atomic step of the store:
/// one statement, transaction or script where the store allows it (the round trips of a try
/// must not grow with `max_count`, and neither may the client's memory or CPU; the server's
/// work may grow with the number of live permits and waiters). Within that step it
///
/// 1. checks the count record (below), answering [`PermitRequest::count_conflict`] on a
///    disagreement, with nothing taken or changed;
/// 2. counts the *live* permits of the semaphore: granted, not released, and (for leased
///    permits) whose lease has not run out, or (for session permits) whose session is alive;
/// 3. grants a permit when fewer than `max_count` are live and, for a single try, no waiting
///    mark is live (Fairness, below), and otherwise answers [`PermitTry::Full`].
///
/// No interleaving of tries, releases, lease ends and renewals from any number of clients
/// may ever leave more than `max_count` live permits under one count record. Every
/// `max_count` from 1 to [`u32::MAX`] is either served or refused with a typed error (never a
/// panic, and nothing allocated per permit that is not held). A store whose server cannot
/// count the live permits, so that a try of a full semaphore asks for every slot, bounds the
/// count it serves: its [`max_permits`](PermitStore::max_permits) says how far, and a larger
/// count is refused with [`LockError::Config`] naming the bound, before anything is asked.
///
/// # The count record
///
/// The store keeps, with the semaphore, the `max_count` its holders use:
///
/// - a try whose `max_count` differs from the record while any live permit is held, or while
///   a waiting mark is live, is refused with [`PermitRequest::count_conflict`] (naming both
///   counts), taking nothing and changing nothing;
/// - when no permit is live and no waiting mark is live, a try with another count replaces
///   the record (and is then served or refused under it);
/// - a permit whose lease ran out, or whose session ended, no longer holds the record.
///
/// [`holders`](PermitStore::holders) applies the same rule to the count it is asked about.
///
/// A store that cannot keep the record at all says so: its
/// [`keeps_count_record`](PermitStore::keeps_count_record) answers `false`, its tries are
/// never refused for their count, and callers that disagree on it share the permits of the
/// largest count in use (as on the slot scheme). MySQL and MariaDB are such a store: their
/// user locks have no shared mode and cannot be listed without privileges the backend does
/// not ask for, so no sound record can be kept there.
///
/// # Waiting and fairness
///
/// A waiting acquisition ([`acquire_semaphore`](crate::LockProvider::acquire_semaphore) with
/// a timeout above zero) on a store without a native wait first takes the semaphore's queue
/// lock (an ordinary exclusive lock of the backend, under the reserved name
/// [`PermitRequest::queue_key`]), so that waiters are served in the order of the backend's lock waits; only the waiter holding it tries for
/// a permit, with `waiting` set, pausing briefly between tries (up to the `retry_within` of
/// its last try, and until a wake-up of the [`watch_permits`](PermitStore::watch_permits)
/// watch where the store offers one). So a holder that gives its permit back and asks again
/// queues behind the waiters that were there first.
///
/// A try with [`waiting`](PermitRequest::waiting) `Some(mark)` that finds the semaphore full
/// leaves (or moves on) the semaphore's *waiting mark*, live until `mark` after the try: it
/// keeps the count record, and while it is live a **single try is answered
/// [`Full`](PermitTry::Full) even when a permit is free**, so that a try does not take the
/// permit the waiter at the head of the queue is about to take. A waiting try is never
/// refused for a mark, and a waiting try that is granted clears the mark. (Between one
/// waiter's grant and the next waiter's first try, a single try may take a free permit.)
///
/// A store whose locks do not expire on their own (a session engine) may keep the mark as
/// the queue lock itself, tested in the try's own step: live from the moment a waiter holds
/// the queue until it lets go (granted, timed out, or its session ended), which covers every
/// pause between its tries. Such a mark cannot carry the waiter's count: while no permit is
/// live, a single try with another count is then answered [`Full`](PermitTry::Full) rather
/// than [`PermitRequest::count_conflict`] (the waiter's grant records its count).
///
/// A store with a native wait ([`supports_native_permit_wait`](PermitStore::supports_native_permit_wait))
/// queues waiters itself, first come first served, and its single tries must not take a
/// permit while a waiter is queued.
///
/// # The granted permit
///
/// [`PermitTry::Acquired`] holds an ordinary [`Acquired`]: its handle is a [`HeldLock`] (its
/// release gives back this permit only, and is checked against the permit's owner, so it
/// never frees another holder's permit; dropped unreleased, it stops renewing and the
/// permit ends with its lease or session, as any [`HeldLock`]), with the lost token,
/// [`lease_deadline`](Acquired::lease_deadline) and
/// [`lease_control`](HeldLock::lease_control) of a lock of the store. Its fencing token, if
/// the store issues them, is strictly greater than the token of every permit of the same
/// semaphore granted before it (by any process), so tokens increase per semaphore; `None`
/// when the store issues none.
///
/// A leased permit has the lease of [`PermitRequest::lease`] (the backend's default when
/// `None`), and is renewed on the store's schedule for its locks unless
/// [`renew`](PermitRequest::renew) is false. A renewal, an extension or a verification never
/// revives a permit whose lease has run out (another holder may have been admitted in its
/// place): it finds the permit lost, and fires its lost token. A permit whose holder dies
/// (killed, its machine gone) stops counting when its lease runs out or its session ends. A
/// store that answers so late that too little of the lease is left gives the permit back and
/// answers [`LockError::Lost`], as [`LockBackend::try_acquire`] does; the provider's wait then
/// tries again.
///
/// # Cancel safety
///
/// The provider drops these futures when a timeout runs out, a cancellation token fires or
/// the caller drops its own future. A future dropped before it completes must leave no
/// permit held (if the store may have granted one, the store gives it back in the
/// background) and no waiter queued (a native wait's place in the queue goes with it, at the
/// latest when its lease runs out).
pub trait PermitStore: Send + Sync {
    /// One try for a permit (see the [trait docs](PermitStore) for what it must guarantee).
    fn try_acquire_permit<'a>(
        &'a self,
        request: PermitRequest<'a>,
    ) -> BoxFuture<'a, Result<PermitTry, LockError>>;

    /// The largest `max_count` this store serves: [`u32::MAX`], the default. A store that
    /// bounds it (see the [trait docs](PermitStore), What a try must guarantee) refuses a
    /// larger count with [`LockError::Config`] naming the bound.
    fn max_permits(&self) -> u32 {
        u32::MAX
    }

    /// Whether this store keeps the count record (see the [trait docs](PermitStore), The
    /// count record): `true`, the default. A store that cannot answers `false`, and is then
    /// never asked to refuse a try for its count.
    fn keeps_count_record(&self) -> bool {
        true
    }

    /// Whether [`acquire_permit_wait`](PermitStore::acquire_permit_wait) waits natively, first
    /// come first served, on the server. When it does, the provider calls it instead of
    /// taking the semaphore's queue lock and polling.
    fn supports_native_permit_wait(&self) -> bool {
        false
    }

    /// Waits on the server for a permit for up to `timeout` (which may be [`Duration::MAX`],
    /// for no limit), in the order the waits began, across processes: `Ok(None)` when it ran
    /// out. `request.waiting` is `None`. Called only when
    /// [`supports_native_permit_wait`](PermitStore::supports_native_permit_wait) is true.
    fn acquire_permit_wait<'a>(
        &'a self,
        request: PermitRequest<'a>,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<Option<Acquired>, LockError>> {
        let _ = (request, timeout);
        Box::pin(async move {
            Err(LockError::unsupported(
                "permit store",
                "native semaphore waits",
                "this store has no blocking wait for permits; the provider polls it instead",
            ))
        })
    }

    /// Starts watching the semaphore's releases for the waiter at the head of its queue, after
    /// one of its tries found it full: as [`LockBackend::watch_releases`] for a lock. `None`
    /// (the default) when the store cannot wake waiters: the provider polls with short pauses.
    fn watch_permits<'a>(
        &'a self,
        request: PermitRequest<'a>,
    ) -> BoxFuture<'a, Option<Box<dyn ReleaseWatch>>> {
        let _ = request;
        Box::pin(async { None })
    }

    /// How many live permits of the semaphore `key` are held right now, by any process
    /// (waiters not counted), read in one round trip without changing anything. The count
    /// record rule applies: while the record names another count than `max_count` (and a
    /// permit or a waiting mark holds it), the answer is [`PermitRequest::count_conflict`].
    /// The default answers [`LockError::Unsupported`].
    fn holders<'a>(
        &'a self,
        key: &'a str,
        max_count: u32,
    ) -> BoxFuture<'a, Result<u32, LockError>> {
        let _ = (key, max_count);
        Box::pin(async move {
            Err(LockError::unsupported(
                "permit store",
                "semaphore occupancy",
                "this store cannot count the permits of a semaphore",
            ))
        })
    }
}

/// A lock store.
///
/// # Cancel safety
///
/// The provider drops the futures these methods return when a timeout runs out, a
/// cancellation token fires or the caller drops its own future. Implementations must make that
/// safe: a future dropped before it completes must not leave a lock held (if the store may have
/// granted it already, the backend gives it back in the background).
pub trait LockBackend: Send + Sync + Debug + 'static {
    /// A short name for messages, metrics and spans: `"sqlite"`, `"postgres"`, `"redis"`, ...
    fn name(&self) -> &'static str;

    /// Whether [`acquire_wait`](LockBackend::acquire_wait) waits natively on the server. When it
    /// does not, the provider polls [`try_acquire`](LockBackend::try_acquire) with backoff.
    fn supports_native_wait(&self) -> bool {
        false
    }

    /// One attempt: `Ok(Some(_))` when the lock was taken, `Ok(None)` when it is held elsewhere.
    ///
    /// A lease backend whose store granted the lock, but answered so late that too little of
    /// the lease is left to count on (another client may even hold it already), gives the
    /// lock back and returns `Err(LockError::Lost { .. })`. The provider reports that from a
    /// single try and tries again, after a backoff pause, in a polled wait.
    fn try_acquire<'a>(
        &'a self,
        request: LockRequest<'a>,
    ) -> BoxFuture<'a, Result<Option<Acquired>, LockError>>;

    /// One try of a wait the provider polls: as [`try_acquire`](LockBackend::try_acquire),
    /// and on contention, when the backend knows it, how soon the lock may be free with no
    /// release to wake the waiter ([`WaitTry::Held`]). The default calls `try_acquire` and
    /// says nothing more.
    fn try_acquire_in_wait<'a>(
        &'a self,
        request: LockRequest<'a>,
    ) -> BoxFuture<'a, Result<WaitTry, LockError>> {
        let attempt = self.try_acquire(request);
        Box::pin(async move {
            Ok(match attempt.await? {
                Some(acquired) => WaitTry::Acquired(acquired),
                None => WaitTry::Held { retry_within: None },
            })
        })
    }

    /// Starts watching the releases of `key` for a waiter, after a try of a polled wait met
    /// contention: `Some` when the backend can wake waiters (the provider then tries once
    /// more at once, in case the lock was given back before the watch was in place, and
    /// sleeps until a wake-up or a long pause, see [`Backoff::fallback_poll`](crate::Backoff::fallback_poll)).
    /// `None` (the default) when it cannot, or cannot now: the provider polls with its
    /// backoff. A backend that fails to set up its watch answers `None` rather than an error:
    /// waits still work by polling.
    fn watch_releases<'a>(
        &'a self,
        request: LockRequest<'a>,
    ) -> BoxFuture<'a, Option<Box<dyn ReleaseWatch>>> {
        let _ = request;
        Box::pin(async { None })
    }

    /// Waits on the server for up to `timeout` (which may be [`Duration::MAX`], for no limit):
    /// `Ok(None)` when it ran out. Called only when
    /// [`supports_native_wait`](LockBackend::supports_native_wait) is true.
    fn acquire_wait<'a>(
        &'a self,
        request: LockRequest<'a>,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<Option<Acquired>, LockError>> {
        let _ = (request, timeout);
        let name = self.name();
        Box::pin(async move {
            Err(LockError::unsupported(
                name,
                "native waits",
                "this backend has no blocking wait; the provider polls it instead",
            ))
        })
    }

    /// Whether this backend grants read (shared) locks, [`LockRequest::shared`]: `Ok(())` when
    /// it does, or the [`LockError::Unsupported`] that the provider answers read-lock requests
    /// with, saying why. The default answers `Unsupported`: a backend that ignored
    /// [`LockRequest::shared`] would hand readers exclusive locks, so it must opt in.
    fn shared_locks(&self) -> Result<(), LockError> {
        Err(LockError::unsupported(
            self.name(),
            "read locks",
            "this backend has no shared lock mode",
        ))
    }

    /// The store's native semaphores, if it keeps them: `Some` when this backend implements
    /// [`PermitStore`] (see there for what that promises). `None` (the default): the provider
    /// keeps each semaphore as `max_count` ordinary locks of this backend, which costs up to
    /// `max_count` round trips per try, cannot record the semaphore's count (callers that
    /// disagree on it are not refused) and takes at most [`MAX_SLOT_PERMITS`] permits.
    fn semaphores(&self) -> Option<&dyn PermitStore> {
        None
    }

    /// The locks held in the store right now, by any process, where the store can list them
    /// (for an admin page). `known` are keys the caller knows (those it holds): a store that
    /// keeps only a number per lock names those by their key. The default answers
    /// [`LockError::Unsupported`].
    fn store_locks<'a>(
        &'a self,
        known: &'a [&'a str],
    ) -> BoxFuture<'a, Result<Vec<StoreLock>, LockError>> {
        let _ = known;
        let name = self.name();
        Box::pin(async move {
            Err(LockError::unsupported(
                name,
                "store inspection",
                "this backend cannot list the locks in its store",
            ))
        })
    }

    /// Whether each of the exclusive locks `keys` is held right now, by any process, read
    /// without taking or changing anything: one answer per key, in order. The provider counts a
    /// semaphore's holders on the slot scheme with it
    /// ([`LockProvider::semaphore_holders`](crate::LockProvider::semaphore_holders)), so
    /// `keys` may be the reserved names of slot locks (up to [`MAX_SLOT_PERMITS`] of them),
    /// and its round trips should not grow with their number. A lock whose lease has run out
    /// is not held. The default reads [`store_locks`](LockBackend::store_locks) once (a key is
    /// held when a listed lock carries it) and so answers its
    /// [`LockError::Unsupported`] where the backend cannot list its store.
    fn held_keys<'a>(&'a self, keys: &'a [String]) -> BoxFuture<'a, Result<Vec<bool>, LockError>> {
        Box::pin(async move {
            let known: Vec<&str> = keys.iter().map(String::as_str).collect();
            let listed = self.store_locks(&known).await?;
            Ok(keys
                .iter()
                .map(|key| {
                    listed
                        .iter()
                        .any(|lock| lock.key.as_deref() == Some(key.as_str()))
                })
                .collect())
        })
    }

    /// Whether this backend can end one lock whoever holds it: its [`ForceRelease`] when it
    /// can, or the [`LockError::Unsupported`] that
    /// [`LockProvider::force_release`](crate::LockProvider::force_release) answers, saying why
    /// and what to do instead. The default answers `Unsupported`: a backend opts in.
    fn force_releases(&self) -> Result<&dyn ForceRelease, LockError> {
        Err(LockError::unsupported(
            self.name(),
            "force release",
            "this backend cannot end a lock another owner holds; stop the process that holds it, or let its lease run out",
        ))
    }

    /// Keeps `label`, the [owner label](crate::ProviderBuilder::owner_label) of the provider
    /// being built on this backend, to store with the locks it takes where the store can keep
    /// one, and to return from [`StoreLock::owner`]. Called once by
    /// [`ProviderBuilder::build`](crate::ProviderBuilder::build), before any acquisition; a
    /// backend shared by several providers keeps the last label set. It must not add a round
    /// trip to acquisitions (write it once, apart, or in what an acquisition writes anyway).
    /// The default ignores it: such a store's locks have no owner.
    fn set_owner_label(&self, label: &str) {
        let _ = label;
    }

    /// Checks that the store answers, with one cheap round trip (a `SELECT 1`, a `PING`, a
    /// read of the lock table). The default answers [`LockError::Unsupported`]: a backend
    /// that wraps another one forwards it (the conformance suite asks every backend for it).
    fn ping(&self) -> BoxFuture<'_, Result<(), LockError>> {
        let name = self.name();
        Box::pin(async move {
            Err(LockError::unsupported(
                name,
                "ping",
                "this backend cannot check its store",
            ))
        })
    }
}
