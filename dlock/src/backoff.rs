//! Exponential backoff with randomized jitter, for backends that cannot wait natively.

use std::time::Duration;

use crate::LockError;
use crate::time::{MAX_SETTING, check_limit, check_setting};

/// How a waiting acquisition polls a backend that has no blocking wait of its own.
///
/// The n-th pause is `initial * 2^n`, capped at `max`, then scaled by a random factor in
/// `[1 - jitter, 1 + jitter]` so that waiters on many replicas spread out instead of polling
/// in step. A pause never runs past the acquisition's deadline: the last try happens at the
/// deadline, so a timeout answers after at least the timeout and at most one pause more.
///
/// A backend that wakes its waiters when a lock is given back (Redis and Valkey, see
/// [`LockBackend::watch_releases`](crate::backend::LockBackend::watch_releases)) is polled
/// far less: after a try that met contention, the waiter sleeps until a wake-up, the end of
/// the holder's lease when the backend said it, or at most [`fallback_poll`](Backoff::fallback_poll)
/// (default 15 s), whichever comes first; it polls with the pauses above only while the
/// backend's wake-ups are not being delivered.
///
/// ```
/// use std::time::Duration;
/// let backoff = dlock::Backoff::new(Duration::from_millis(10), Duration::from_millis(500), 0.25)?;
/// assert_eq!(backoff.initial(), Duration::from_millis(10));
/// # Ok::<(), dlock::LockError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Backoff {
    initial: Duration,
    max: Duration,
    jitter: f64,
    fallback: Duration,
}

/// The default [`Backoff::fallback_poll`].
const DEFAULT_FALLBACK_POLL: Duration = Duration::from_secs(15);

impl Default for Backoff {
    /// 10 ms first pause, doubling up to 500 ms, ±25 % jitter; 15 s fallback poll.
    fn default() -> Self {
        Backoff {
            initial: Duration::from_millis(10),
            max: Duration::from_millis(500),
            jitter: 0.25,
            fallback: DEFAULT_FALLBACK_POLL,
        }
    }
}

impl Backoff {
    /// Pauses from `initial`, doubling up to `max`, without jitter (checked by the caller).
    #[cfg(any(feature = "postgres", feature = "mysql"))]
    pub(crate) const fn unjittered(initial: Duration, max: Duration) -> Backoff {
        Backoff {
            initial,
            max,
            jitter: 0.0,
            fallback: DEFAULT_FALLBACK_POLL,
        }
    }

    /// A backoff policy; `jitter` is a ratio in `0.0..=1.0`.
    ///
    /// Errors with [`LockError::Config`] when `initial` is zero, either interval is longer than
    /// 365 days, `max < initial`, or `jitter` is outside `0.0..=1.0`.
    pub fn new(initial: Duration, max: Duration, jitter: f64) -> Result<Self, LockError> {
        let nanosecond = Duration::from_nanos(1);
        check_setting(
            "backoff: the initial interval",
            initial,
            nanosecond,
            MAX_SETTING,
        )?;
        check_setting("backoff: the max interval", max, nanosecond, MAX_SETTING)?;
        if max < initial {
            return Err(LockError::config(format!(
                "backoff: the max interval ({max:?}) must not be less than the initial interval ({initial:?})"
            )));
        }
        if !(0.0..=1.0).contains(&jitter) {
            return Err(LockError::config(format!(
                "backoff: the jitter ratio must be between 0.0 and 1.0, got {jitter}"
            )));
        }
        Ok(Backoff {
            initial,
            max,
            jitter,
            fallback: DEFAULT_FALLBACK_POLL,
        })
    }

    /// The same policy with another fallback poll: the longest pause between two tries of a
    /// wait whose backend wakes it on releases (see the [type docs](Backoff)), the bound on how
    /// late a waiter notices a release that sent no wake-up (a client that does not announce
    /// its releases, a Redis user refused `PUBLISH`). Shorter costs more server commands per
    /// waiter; the end of the holder's lease is noticed on time either way.
    ///
    /// Errors with [`LockError::Config`] when `fallback` is zero or longer than 365 days.
    ///
    /// ```
    /// use std::time::Duration;
    /// let backoff = dlock::Backoff::default().with_fallback_poll(Duration::from_secs(5))?;
    /// assert_eq!(backoff.fallback_poll(), Duration::from_secs(5));
    /// # Ok::<(), dlock::LockError>(())
    /// ```
    pub fn with_fallback_poll(mut self, fallback: Duration) -> Result<Self, LockError> {
        check_limit("backoff: the fallback poll", fallback)?;
        self.fallback = fallback;
        Ok(self)
    }

    /// The longest pause of a wait woken by releases (default 15 s; see
    /// [`with_fallback_poll`](Backoff::with_fallback_poll)).
    pub fn fallback_poll(&self) -> Duration {
        self.fallback
    }

    /// A fallback pause with jitter: between `1 - jitter` times the fallback poll and the
    /// fallback poll itself (never longer), so that waiters spread out.
    pub(crate) fn fallback_delay(&self) -> Duration {
        if self.jitter == 0.0 {
            return self.fallback;
        }
        let factor = 1.0 - self.jitter * fastrand::f64();
        self.fallback.mul_f64(factor.max(0.0))
    }

    /// The first pause, before jitter.
    pub fn initial(&self) -> Duration {
        self.initial
    }

    /// The longest pause, before jitter.
    pub fn max(&self) -> Duration {
        self.max
    }

    /// The jitter ratio.
    pub fn jitter(&self) -> f64 {
        self.jitter
    }

    /// The pause before try number `attempt + 1` (0-based), with jitter applied.
    pub fn delay(&self, attempt: u32) -> Duration {
        let base = self
            .initial
            .checked_mul(1u32.checked_shl(attempt.min(30)).unwrap_or(u32::MAX))
            .unwrap_or(self.max)
            .min(self.max);
        if self.jitter == 0.0 {
            return base;
        }
        let factor = 1.0 + self.jitter * (fastrand::f64() * 2.0 - 1.0);
        base.mul_f64(factor.max(0.0))
    }
}

/// The pauses of one bounded poll: the backoff's delays, each cut to what is left before the
/// deadline (`None`: no deadline). Every loop that polls until a deadline (the provider's wait
/// on a backend without native waits, the session engines' waits when every wait connection
/// is busy, SQLite's transaction-bound waits) takes its pauses from here, so the last try
/// happens at the deadline and a timeout is answered after at least the timeout.
#[derive(Debug)]
pub(crate) struct Pauses {
    backoff: Backoff,
    attempt: u32,
    deadline: Option<std::time::Instant>,
}

impl Pauses {
    pub(crate) fn new(backoff: Backoff, deadline: Option<std::time::Instant>) -> Pauses {
        Pauses {
            backoff,
            attempt: 0,
            deadline,
        }
    }

    /// The pause before the next try, or `None` when the deadline has passed (the try just
    /// made was the last).
    pub(crate) fn next_pause(&mut self) -> Option<Duration> {
        let pause = self.backoff.delay(self.attempt);
        self.attempt = self.attempt.saturating_add(1);
        self.cut(pause)
    }

    /// `pause` cut to what is left before the deadline, or `None` when the deadline has
    /// passed.
    pub(crate) fn cut(&self, pause: Duration) -> Option<Duration> {
        match self.deadline {
            None => Some(pause),
            Some(deadline) => {
                let left = deadline.checked_duration_since(std::time::Instant::now())?;
                (!left.is_zero()).then(|| pause.min(left))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_and_caps() {
        let b = Backoff::new(Duration::from_millis(10), Duration::from_millis(100), 0.0).unwrap();
        assert_eq!(b.delay(0), Duration::from_millis(10));
        assert_eq!(b.delay(1), Duration::from_millis(20));
        assert_eq!(b.delay(3), Duration::from_millis(80));
        assert_eq!(b.delay(4), Duration::from_millis(100));
        assert_eq!(b.delay(u32::MAX), Duration::from_millis(100));
    }

    #[test]
    fn jitter_stays_in_range_and_varies() {
        let b = Backoff::new(Duration::from_millis(100), Duration::from_millis(100), 0.5).unwrap();
        let delays: Vec<_> = (0..200).map(|_| b.delay(0)).collect();
        assert!(
            delays
                .iter()
                .all(|d| *d >= Duration::from_millis(50) && *d <= Duration::from_millis(150))
        );
        assert!(delays.iter().any(|d| *d != delays[0]));
    }

    #[test]
    fn rejects_bad_settings() {
        assert!(Backoff::new(Duration::ZERO, Duration::from_secs(1), 0.1).is_err());
        assert!(Backoff::new(Duration::from_secs(2), Duration::from_secs(1), 0.1).is_err());
        assert!(Backoff::new(Duration::from_secs(1), Duration::from_secs(1), 1.5).is_err());
        assert!(Backoff::new(Duration::from_secs(1), Duration::from_secs(1), f64::NAN).is_err());
    }

    #[test]
    fn settings_read_back() {
        let b = Backoff::new(Duration::from_millis(3), Duration::from_millis(40), 0.3).unwrap();
        assert_eq!(b.initial(), Duration::from_millis(3));
        assert_eq!(b.max(), Duration::from_millis(40));
        assert_eq!(b.jitter(), 0.3);
        let d = Backoff::default();
        assert_eq!(
            (d.initial(), d.max(), d.jitter()),
            (Duration::from_millis(10), Duration::from_millis(500), 0.25)
        );
        // The bounds of the ranges are accepted.
        let edges = Backoff::new(Duration::from_nanos(1), Duration::from_nanos(1), 1.0).unwrap();
        assert_eq!(edges.max(), Duration::from_nanos(1));
        assert!(Backoff::new(Duration::from_secs(1), Duration::from_secs(1), 0.0).is_ok());
        assert!(Backoff::new(Duration::from_secs(1), Duration::from_secs(1), -0.01).is_err());
        assert!(Backoff::new(Duration::from_secs(1), Duration::MAX, 0.1).is_err());
    }

    #[test]
    fn full_jitter_spans_zero_to_double() {
        let b = Backoff::new(Duration::from_millis(100), Duration::from_millis(100), 1.0).unwrap();
        let delays: Vec<_> = (0..2000).map(|_| b.delay(0)).collect();
        assert!(delays.iter().all(|d| *d <= Duration::from_millis(200)));
        assert!(delays.iter().any(|d| *d < Duration::from_millis(20)));
        assert!(delays.iter().any(|d| *d > Duration::from_millis(180)));
    }

    /// Pauses follow the backoff, never run past the deadline, and end once it has passed.
    #[test]
    fn pauses_stop_at_the_deadline() {
        let ms = Duration::from_millis;
        let backoff = Backoff::new(ms(10), ms(40), 0.0).unwrap();
        let mut unbounded = Pauses::new(backoff, None);
        let seen: Vec<_> = (0..4).map(|_| unbounded.next_pause()).collect();
        assert_eq!(seen, [10, 20, 40, 40].map(|n| Some(ms(n))));
        let far = std::time::Instant::now() + Duration::from_secs(60);
        let mut bounded = Pauses::new(backoff, Some(far));
        assert_eq!(bounded.next_pause(), Some(ms(10)));
        assert_eq!(bounded.next_pause(), Some(ms(20)));
        let near = std::time::Instant::now() + ms(15);
        let mut cut = Pauses::new(Backoff::new(ms(30), ms(40), 0.0).unwrap(), Some(near));
        let pause = cut.next_pause().expect("time is left");
        assert!(pause <= ms(15), "cut to the deadline: {pause:?}");
        std::thread::sleep(ms(20));
        assert_eq!(cut.next_pause(), None, "the deadline has passed");
        let now = std::time::Instant::now();
        assert_eq!(Pauses::new(backoff, Some(now)).next_pause(), None);
    }
}
