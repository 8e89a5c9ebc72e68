//! The lease engine: the one schedule by which the lease backends (SQLite, Redis) keep their
//! locks, and the local deadline a holder counts on.
//!
//! A lock taken with a command sent (or a lease clock read) at `t` is renewed every third of
//! its lease ([`renew_every`]). Each confirmed renewal, measured from before it was sent, moves
//! the lock's local deadline to four fifths of the lease later ([`safe_window`]); if no renewal
//! has been confirmed by then, the lock is presumed lost, a fifth of the lease or more before the
//! store could let anyone else take it. A renewal that fails without an answer is tried again
//! after a twentieth of the lease ([`retry_after`]); one that finds the lock gone or taken means
//! the lock is lost at once. How the renewals are sent is the backend's: SQLite renews every due
//! lock in one transaction on a thread, Redis sends the due renewals (and those due within a tenth
//! of their period) in pipelines of up to 512 from one task per pipeline, etcd one keep-alive
//! per lock's lease from a task of its own.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::time::later;

/// A lease backend's default lease.
#[cfg(any(feature = "sqlite", feature = "redis", feature = "etcd"))]
pub(crate) const DEFAULT_LEASE: Duration = Duration::from_secs(30);

/// The shortest lease a lease backend takes: 100 ms.
#[cfg(any(feature = "sqlite", feature = "redis", feature = "etcd"))]
pub(crate) const MIN_LEASE: Duration = Duration::from_millis(100);

/// Checks the lease setting named `what`: [`MIN_LEASE`] to 365 days.
#[cfg(any(feature = "sqlite", feature = "redis", feature = "etcd"))]
pub(crate) fn check_lease(what: &str, lease: Duration) -> Result<Duration, crate::LockError> {
    crate::time::check_setting(what, lease, MIN_LEASE, crate::time::MAX_SETTING)
}

/// The longest an acquisition's answer may take, from before its request was sent, for the
/// lock to be handed out: half the safe window, 40 % of the lease. What is left of the window
/// is at least as long again, time for the first renewal to make a round trip as slow. (One
/// renewal is in flight at a time, so round trips longer than this could not keep the lock
/// anyway.)
#[cfg(any(feature = "redis", feature = "etcd"))]
pub(crate) fn answer_window(lease: Duration) -> Duration {
    safe_window(lease) / 2
}

/// Whether a lock of `key` whose request was sent `took` ago came in time to be handed out
/// ([`answer_window`]): `Err(Lost)` when it did not, which the caller answers after giving the
/// lock back. `what` is "lock" or "read lock", `store` the backend's name.
#[cfg(any(feature = "redis", feature = "etcd"))]
pub(crate) fn check_answer_time(
    key: &str,
    lease: Duration,
    took: Duration,
    what: &str,
    store: &str,
) -> Result<(), crate::LockError> {
    let window = answer_window(lease);
    if took <= window {
        return Ok(());
    }
    tracing::warn!(
        took_ms = took.as_millis() as u64,
        lease_ms = lease.as_millis() as u64,
        "a {store} {what} was taken, but the answer came too late to count on its lease; giving it back"
    );
    Err(crate::LockError::Lost {
        key: Arc::from(key),
        reason: format!(
            "the {store} answer took {took:?}, more than {window:?} (40% of the {lease:?} \
             lease), so the lease could run out before its first renewal; the {what} was given \
             back (use a longer lease for a store this slow)"
        ),
    })
}

/// How often a lock is renewed: every third of its lease.
#[cfg(any(feature = "sqlite", feature = "redis", feature = "etcd"))]
pub(crate) fn renew_every(lease: Duration) -> Duration {
    lease / 3
}

/// The renewal cadence of a lock of `lease`: `cadence` when the backend sets one, but never
/// more than half the lease (so that retries still fit before the local deadline at four
/// fifths), otherwise [`renew_every`].
#[cfg(any(feature = "sqlite", feature = "redis", feature = "etcd"))]
pub(crate) fn every(lease: Duration, cadence: Option<Duration>) -> Duration {
    match cadence {
        Some(cadence) => cadence.min(lease / 2),
        None => renew_every(lease),
    }
}

/// Checks a configured renewal cadence: 10 ms to 365 days (it is also cut to half of each
/// lock's lease, see [`every`]).
#[cfg(any(feature = "sqlite", feature = "redis", feature = "etcd"))]
pub(crate) fn check_cadence(what: &str, cadence: Duration) -> Result<(), crate::LockError> {
    crate::time::check_setting(
        what,
        cadence,
        Duration::from_millis(10),
        crate::time::MAX_SETTING,
    )
    .map(drop)
}

/// The part of a lease the holder counts on, from the moment the last confirmed renewal (or the
/// acquisition) was sent: four fifths.
#[cfg(any(feature = "sqlite", feature = "redis", feature = "etcd"))]
pub(crate) fn safe_window(lease: Duration) -> Duration {
    lease - lease / 5
}

/// The pause before a renewal that failed without an answer is tried again: a twentieth of the
/// lease, at least 10 ms.
#[cfg(any(feature = "sqlite", feature = "redis", feature = "etcd"))]
pub(crate) fn retry_after(lease: Duration) -> Duration {
    (lease / 20).max(Duration::from_millis(10))
}

/// How early a due renewal may be sent along with others: up to a tenth of its renewal
/// period (see [`every`]) before it is due. The renewals of many locks due close together then
/// go out together, in one wake-up and one batch, at the cost of renewing some of them a little
/// more often than their cadence.
#[cfg(feature = "redis")]
pub(crate) fn renew_early(every: Duration) -> Duration {
    every / 10
}

/// The shortest and longest a waiting writer's intent holds new readers back after the
/// writer's last try (see [`writer_intent`]).
#[cfg(any(feature = "sqlite", feature = "redis"))]
pub(crate) const INTENT_BOUNDS: (Duration, Duration) =
    (Duration::from_millis(100), Duration::from_secs(5));

/// How long a waiting writer's intent, left by a try of its polled wait, holds back readers
/// that come after it: twice the longest pause before the writer's next try (so the intent
/// outlives the pause, and lapses soon after a writer that gave up), within
/// [`INTENT_BOUNDS`].
#[cfg(any(feature = "sqlite", feature = "redis"))]
pub(crate) fn writer_intent(pause: Duration) -> Duration {
    pause
        .saturating_mul(2)
        .clamp(INTENT_BOUNDS.0, INTENT_BOUNDS.1)
}

/// One held lock's place in the schedule: when its next renewal is due, its local deadline,
/// and whether a renewal is in flight.
#[cfg(any(feature = "sqlite", feature = "redis", feature = "etcd"))]
#[derive(Debug)]
pub(crate) struct Term {
    /// The lease renewals ask for, in nanoseconds (a lease is at most a year): a word, not a
    /// `Duration`'s two, as a term is kept for every held lock.
    lease: u64,
    next: Mark,
    deadline: LeaseDeadline,
    in_flight: bool,
    /// Renewals were turned off (at acquisition, or later by the holder): the lock expires
    /// with its lease, and is presumed lost at its deadline.
    stopped: bool,
    /// The backend's configured cadence in nanoseconds, if any (see [`every`]); 0 for none (a
    /// cadence is at least 10 ms).
    cadence: u64,
}

/// A duration as a term keeps it: nanoseconds, saturating.
#[cfg(any(feature = "sqlite", feature = "redis", feature = "etcd"))]
fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

#[cfg(any(feature = "sqlite", feature = "redis", feature = "etcd"))]
impl Term {
    /// The term of a lock taken for `lease` with a command sent at `sent`, renewed every
    /// `cadence` when the backend sets one (see [`every`]).
    pub(crate) fn new(lease: Duration, sent: Instant, cadence: Option<Duration>) -> Term {
        Term {
            lease: nanos(lease),
            next: Mark::of(later(sent, every(lease, cadence))),
            deadline: LeaseDeadline::new(later(sent, safe_window(lease))),
            in_flight: false,
            stopped: false,
            cadence: cadence.map_or(0, |cadence| nanos(cadence).max(1)),
        }
    }

    /// Renewals stop: the deadline stays where the last confirmed renewal put it.
    pub(crate) fn stop(&mut self) {
        self.stopped = true;
    }

    /// Renewals start again at `now` (the holder asked for them), the first one at once:
    /// what is left of the lease may be short. `false` (and nothing changes) when the local
    /// deadline has passed: the lock is presumed lost, and a renewal must not revive it.
    pub(crate) fn resume(&mut self, now: Instant) -> bool {
        if self.is_overdue(now) {
            return false;
        }
        if self.stopped {
            self.stopped = false;
            self.in_flight = false;
            self.next = Mark::of(now);
        }
        true
    }

    /// The holder set the lease to `lease` with a command sent at `sent` and confirmed:
    /// later renewals ask for `lease`.
    pub(crate) fn extended(&mut self, lease: Duration, sent: Instant) {
        self.lease = nanos(lease);
        self.renewed(sent);
    }

    /// The lease renewals ask for.
    pub(crate) fn lease(&self) -> Duration {
        Duration::from_nanos(self.lease)
    }

    /// The backend's configured cadence, if any.
    pub(crate) fn cadence(&self) -> Option<Duration> {
        (self.cadence != 0).then(|| Duration::from_nanos(self.cadence))
    }

    /// The time from one renewal to the next (see [`every`]).
    fn every(&self) -> Duration {
        every(self.lease(), self.cadence())
    }

    /// The local deadline, shared with the guard.
    pub(crate) fn deadline(&self) -> LeaseDeadline {
        self.deadline.clone()
    }

    /// Whether a renewal should start at `now`.
    #[cfg(any(feature = "sqlite", feature = "etcd", test))]
    pub(crate) fn is_due(&self, now: Instant) -> bool {
        !self.in_flight && !self.stopped && self.next <= Mark::of(now)
    }

    /// Whether a renewal may start at `now` along with others due then: it is due within
    /// [`renew_early`] of `now`.
    #[cfg(feature = "redis")]
    pub(crate) fn may_renew(&self, now: Instant) -> bool {
        let early = renew_early(self.every());
        !self.in_flight && !self.stopped && self.next <= Mark::of(later(now, early))
    }

    /// Whether the local deadline has passed at `now`: the lock is presumed lost.
    pub(crate) fn is_overdue(&self, now: Instant) -> bool {
        self.deadline.at() <= now
    }

    /// A renewal has started (Redis, etcd; SQLite renews every due lock at once, on its
    /// thread).
    #[cfg(any(feature = "redis", feature = "etcd"))]
    pub(crate) fn start(&mut self) {
        self.in_flight = true;
    }

    /// The renewal sent at `sent` was confirmed.
    pub(crate) fn renewed(&mut self, sent: Instant) {
        self.in_flight = false;
        self.deadline.set(later(sent, safe_window(self.lease())));
        self.next = Mark::of(later(sent, self.every()));
    }

    /// The renewal failed without an answer at `now`: tried again soon, up to the deadline.
    pub(crate) fn failed(&mut self, now: Instant) {
        self.in_flight = false;
        self.next = Mark::of(later(now, retry_after(self.lease())));
    }

    /// When the driver must look at this lock next: its next renewal, or its deadline.
    pub(crate) fn wake_at(&self) -> Instant {
        if self.in_flight || self.stopped {
            self.deadline.at()
        } else {
            self.next.at().min(self.deadline.at())
        }
    }

    /// Makes the next renewal due at `at` (tests).
    #[cfg(all(test, feature = "sqlite"))]
    pub(crate) fn set_next(&mut self, at: Instant) {
        self.next = Mark::of(at);
    }

    /// When the next renewal is due (tests).
    #[cfg(test)]
    pub(crate) fn next(&self) -> Instant {
        self.next.at()
    }
}

/// The local deadline of a leased lock, shared between the backend that renews the lock and
/// the guard that holds it: the instant until which the holder may count on the lease (the
/// last confirmed renewal, measured from before it was sent, plus the part of the lease the
/// backend trusts). Renewals move it on with [`set`](LeaseDeadline::set).
///
/// Measured on the monotonic clock of this process ([`Instant`]), which keeps running while the
/// process is stopped, so a deadline passes during a pause as the store's lease does.
#[derive(Clone)]
pub struct LeaseDeadline(
    /// A [`Mark`]'s nanoseconds: one word per held lock.
    Arc<AtomicU64>,
);

/// An instant in one word, for what is kept per held lock (deadlines, the times of terms and
/// of renewal queues): nanoseconds after the process's origin, the first instant kept this
/// way (saturating, about 584 years). An instant before the origin is kept as the origin,
/// which has passed too.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct Mark(u64);

impl Mark {
    fn origin() -> Instant {
        static ORIGIN: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
        *ORIGIN.get_or_init(Instant::now)
    }

    pub(crate) fn of(at: Instant) -> Mark {
        let after = at.saturating_duration_since(Mark::origin()).as_nanos();
        Mark(u64::try_from(after).unwrap_or(u64::MAX))
    }

    pub(crate) fn at(self) -> Instant {
        later(Mark::origin(), Duration::from_nanos(self.0))
    }
}

impl LeaseDeadline {
    /// A deadline at `at` (one already passed counts as passed).
    pub fn new(at: Instant) -> Self {
        let deadline = LeaseDeadline(Arc::new(AtomicU64::new(0)));
        deadline.set(at);
        deadline
    }

    /// Moves the deadline to `at` (a renewal confirmed), earlier or later.
    pub fn set(&self, at: Instant) {
        self.0.store(Mark::of(at).0, Ordering::Release);
    }

    /// The deadline.
    pub fn at(&self) -> Instant {
        Mark(self.0.load(Ordering::Acquire)).at()
    }

    /// Whether the deadline has passed.
    pub fn has_passed(&self) -> bool {
        Instant::now() >= self.at()
    }
}

impl std::fmt::Debug for LeaseDeadline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaseDeadline")
            .field(
                "remaining",
                &self.at().saturating_duration_since(Instant::now()),
            )
            .finish()
    }
}

#[cfg(all(test, any(feature = "sqlite", feature = "redis", feature = "etcd")))]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn writer_intents_outlive_two_pauses_within_bounds() {
        assert_eq!(writer_intent(625 * MS), 1250 * MS);
        assert_eq!(writer_intent(Duration::ZERO), INTENT_BOUNDS.0);
        assert_eq!(writer_intent(Duration::MAX), INTENT_BOUNDS.1);
    }

    /// The late-answer rule at its boundary: an answer that took 40 % of the lease is kept,
    /// one a nanosecond later is not (a window of 80 %, or 30 %, fails here).
    #[cfg(any(feature = "redis", feature = "etcd"))]
    #[test]
    fn answers_later_than_two_fifths_of_the_lease_are_refused() {
        for lease in [100 * MS, 1000 * MS, 3000 * MS, Duration::from_secs(3600)] {
            let window = answer_window(lease);
            assert_eq!(window, lease * 2 / 5, "40 % of {lease:?}");
            assert!(check_answer_time("k", lease, lease * 39 / 100, "lock", "s").is_ok());
            assert!(check_answer_time("k", lease, window, "lock", "s").is_ok());
            let late = check_answer_time("k", lease, window + Duration::from_nanos(1), "lock", "s");
            assert!(
                matches!(&late, Err(crate::LockError::Lost { key, .. }) if &**key == "k"),
                "{late:?}"
            );
            assert!(check_answer_time("k", lease, lease * 41 / 100, "lock", "s").is_err());
        }
    }

    #[test]
    fn the_schedule() {
        let lease = 3000 * MS;
        assert_eq!(renew_every(lease), 1000 * MS);
        assert_eq!(safe_window(lease), 2400 * MS);
        assert_eq!(retry_after(lease), 150 * MS);
        assert_eq!(retry_after(100 * MS), 10 * MS, "at least 10 ms");
        assert_eq!(safe_window(100 * MS), 80 * MS);
    }

    /// Stopped renewals start again due at once; a term past its deadline stays stopped.
    #[test]
    fn a_stopped_term_resumes_until_its_deadline() {
        let sent = Instant::now();
        let mut term = Term::new(3000 * MS, sent, None);
        term.stop();
        assert!(!term.is_due(sent + 1500 * MS), "stopped");
        assert_eq!(
            term.wake_at(),
            sent + 2400 * MS,
            "stopped: only the deadline"
        );
        assert!(term.resume(sent + 1500 * MS));
        assert!(term.is_due(sent + 1500 * MS), "the first renewal at once");
        assert_eq!(term.wake_at(), sent + 1500 * MS);
        assert!(term.resume(sent + 1600 * MS), "idempotent");
        assert_eq!(
            term.next(),
            sent + 1500 * MS,
            "a running schedule is left alone"
        );
        let mut late = Term::new(3000 * MS, sent, None);
        late.stop();
        assert!(!late.resume(sent + 2400 * MS));
        assert!(
            !late.is_due(sent + 2400 * MS),
            "a lease past its deadline is never revived"
        );
    }

    #[test]
    #[cfg(any(feature = "redis", feature = "etcd"))]
    fn a_term_moves_with_its_renewals() {
        let sent = Instant::now();
        let mut term = Term::new(3000 * MS, sent, None);
        assert_eq!(term.lease(), 3000 * MS);
        assert_eq!(term.next(), sent + 1000 * MS);
        assert_eq!(term.deadline().at(), sent + 2400 * MS);
        assert_eq!(term.wake_at(), sent + 1000 * MS);
        assert!(!term.is_due(sent + 999 * MS));
        assert!(term.is_due(sent + 1000 * MS));
        assert!(!term.is_overdue(sent + 2399 * MS));
        assert!(term.is_overdue(sent + 2400 * MS));
        term.start();
        assert!(
            !term.is_due(sent + 2000 * MS),
            "one renewal in flight at a time"
        );
        assert_eq!(
            term.wake_at(),
            sent + 2400 * MS,
            "in flight: only the deadline"
        );
        let renewal = sent + 1000 * MS;
        term.renewed(renewal);
        assert_eq!(term.deadline().at(), renewal + 2400 * MS);
        assert_eq!(term.next(), renewal + 1000 * MS);
        term.start();
        let failed = renewal + 1100 * MS;
        term.failed(failed);
        assert_eq!(term.next(), failed + 150 * MS);
        assert!(term.is_due(failed + 150 * MS));
        assert_eq!(
            term.deadline().at(),
            renewal + 2400 * MS,
            "a failure moves nothing"
        );
    }

    #[test]
    fn a_stopped_term_waits_only_for_its_deadline_and_an_extension_sets_a_new_lease() {
        let sent = Instant::now();
        let mut term = Term::new(3000 * MS, sent, None);
        term.stop();
        assert!(!term.is_due(sent + 1000 * MS), "no renewal once stopped");
        assert_eq!(term.wake_at(), sent + 2400 * MS, "only the deadline");
        assert!(term.is_overdue(sent + 2400 * MS));
        let mut term = Term::new(3000 * MS, sent, None);
        let at = sent + 500 * MS;
        term.extended(30_000 * MS, at);
        assert_eq!(term.lease(), 30_000 * MS, "renewals ask for the new lease");
        assert_eq!(term.deadline().at(), at + 24_000 * MS);
        assert_eq!(term.next(), at + 10_000 * MS);
    }

    #[test]
    fn a_configured_cadence_is_kept_up_to_half_the_lease() {
        let sent = Instant::now();
        let term = Term::new(3000 * MS, sent, Some(200 * MS));
        assert_eq!(term.next(), sent + 200 * MS);
        assert_eq!(
            every(3000 * MS, Some(5000 * MS)),
            1500 * MS,
            "at most half the lease"
        );
        assert_eq!(every(3000 * MS, None), 1000 * MS);
    }

    #[test]
    fn deadlines_are_shared_and_saturate() {
        let now = Instant::now();
        let deadline = LeaseDeadline::new(now + 10 * MS);
        let held = deadline.clone();
        assert!(!held.has_passed());
        deadline.set(now);
        assert!(held.has_passed(), "a clone sees the move");
        let past = now.checked_sub(Duration::from_secs(1)).unwrap_or(now);
        assert!(LeaseDeadline::new(past).has_passed());
        let far = LeaseDeadline::new(later(now, Duration::MAX));
        assert!(!far.has_passed());
        assert!(format!("{far:?}").contains("remaining"));
    }
}
