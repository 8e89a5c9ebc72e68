//! Time arithmetic that cannot overflow, and the bounds of durations from user input.
//!
//! Durations reach the crate from URLs, builders and acquisition options, and any of them may
//! be as large as [`Duration::MAX`]. `Instant + Duration` panics on overflow, so nothing in the
//! crate adds a user's duration to an instant with `+`: it uses [`deadline`] (no limit when the
//! sum cannot be represented) or [`later`] (saturates at a far-future instant). Settings that
//! are stored and used again and again (leases, keepalives, connect and command timeouts,
//! backoff intervals) are checked once, when they are set, with [`check_setting`], which
//! refuses values outside their bounds with a [`LockError::Config`] naming the bound.

use std::time::{Duration, Instant};

use crate::LockError;

/// The longest setting the crate accepts for a lease, keepalive, timeout or backoff interval:
/// 365 days. Longer values are refused when they are set; an acquisition's own timeout may be
/// anything up to [`Duration::MAX`] (which waits without limit).
pub(crate) const MAX_SETTING: Duration = Duration::from_secs(365 * 24 * 60 * 60);

/// How far [`later`] saturates: about 30 years, as Tokio's own far-future instant.
const FAR_FUTURE: Duration = Duration::from_secs(86_400 * 365 * 30);

/// `now + after`, or `None` when that instant cannot be represented (then there is no limit).
#[inline]
pub(crate) fn deadline(now: Instant, after: Duration) -> Option<Instant> {
    now.checked_add(after)
}

/// `now + after`, saturating at a far-future instant: for when something must be planned at
/// some instant (a renewal, a liveness check), however long `after` is.
#[inline]
pub(crate) fn later(now: Instant, after: Duration) -> Instant {
    now.checked_add(after)
        .or_else(|| now.checked_add(FAR_FUTURE))
        .unwrap_or(now)
}

/// [`later`] for Tokio instants.
#[cfg_attr(
    not(any(
        feature = "mssql",
        feature = "oracle",
        feature = "postgres",
        feature = "mysql"
    )),
    allow(dead_code)
)]
#[inline]
pub(crate) fn later_tokio(now: tokio::time::Instant, after: Duration) -> tokio::time::Instant {
    later(now.into_std(), after).into()
}

/// Checks a limit named `what` (a timeout, a poll): above zero and at most [`MAX_SETTING`].
pub(crate) fn check_limit(what: &str, limit: Duration) -> Result<Duration, LockError> {
    check_setting(what, limit, Duration::from_nanos(1), MAX_SETTING)
}

/// Checks a duration setting named `what`: at least `min` and at most `max`. The error names
/// the setting, the value and the bound it broke.
pub(crate) fn check_setting(
    what: &str,
    value: Duration,
    min: Duration,
    max: Duration,
) -> Result<Duration, LockError> {
    if value < min {
        let bound = if min == Duration::from_nanos(1) {
            "more than zero".to_owned()
        } else {
            format!("at least {min:?}")
        };
        return Err(LockError::config(format!(
            "{what} is {value:?}, but it must be {bound}"
        )));
    }
    if value > max {
        return Err(LockError::config(format!(
            "{what} is {}, but it must be at most {}",
            shown_duration(value),
            shown_duration(max)
        )));
    }
    Ok(value)
}

/// A duration for a message: whole days when it is that long (a `Duration::MAX` printed with
/// `{:?}` is a 20-digit number of seconds).
fn shown_duration(value: Duration) -> String {
    const DAY: u64 = 86_400;
    if value.as_secs() >= DAY {
        let days = value.as_secs() / DAY;
        if value.as_secs().is_multiple_of(DAY) && value.subsec_nanos() == 0 {
            format!("{days} days")
        } else {
            format!("more than {days} days")
        }
    } else {
        format!("{value:?}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deadlines_and_saturation() {
        let now = Instant::now();
        assert_eq!(deadline(now, Duration::MAX), None);
        assert_eq!(
            deadline(now, Duration::from_secs(1)),
            Some(now + Duration::from_secs(1))
        );
        let far = later(now, Duration::MAX);
        assert!(far > now + Duration::from_secs(86_400 * 365));
        assert_eq!(
            later(now, Duration::from_millis(5)),
            now + Duration::from_millis(5)
        );
        let tokio_now = tokio::time::Instant::now();
        assert!(later_tokio(tokio_now, Duration::MAX) > tokio_now);
    }

    #[test]
    fn settings_name_their_bounds() {
        let ok = check_setting(
            "lease",
            Duration::from_secs(1),
            Duration::from_millis(100),
            MAX_SETTING,
        );
        assert_eq!(ok.unwrap(), Duration::from_secs(1));
        let low = check_setting(
            "lease",
            Duration::from_millis(1),
            Duration::from_millis(100),
            MAX_SETTING,
        )
        .unwrap_err()
        .to_string();
        assert!(
            low.contains("lease") && low.contains("at least 100ms"),
            "{low}"
        );
        let high = check_setting("keepalive", Duration::MAX, Duration::ZERO, MAX_SETTING)
            .unwrap_err()
            .to_string();
        assert!(
            high.contains("keepalive") && high.contains("at most 365 days"),
            "{high}"
        );
        let zero = check_setting(
            "timeout",
            Duration::ZERO,
            Duration::from_nanos(1),
            MAX_SETTING,
        )
        .unwrap_err()
        .to_string();
        assert!(zero.contains("more than zero"), "{zero}");
        // The bounds themselves are accepted.
        assert!(check_setting("x", MAX_SETTING, Duration::ZERO, MAX_SETTING).is_ok());
    }

    #[test]
    fn long_durations_are_shown_in_days() {
        assert_eq!(shown_duration(Duration::from_secs(86_400 * 3)), "3 days");
        assert_eq!(
            shown_duration(Duration::from_secs(86_400 * 3 + 1)),
            "more than 3 days"
        );
        assert_eq!(shown_duration(Duration::new(86_400, 1)), "more than 1 days");
        assert_eq!(shown_duration(Duration::from_secs(86_400)), "1 days");
        assert_eq!(shown_duration(Duration::from_secs(86_399)), "86399s");
        // A value just over the bound is refused, the bound itself is not.
        let over = MAX_SETTING + Duration::from_nanos(1);
        assert!(check_setting("x", over, Duration::ZERO, MAX_SETTING).is_err());
        let min = Duration::from_millis(100);
        assert!(check_setting("x", min, min, MAX_SETTING).is_ok());
        let under = check_setting("x", min - Duration::from_nanos(1), min, MAX_SETTING);
        assert!(under.is_err());
        // Saturation: an instant that cannot be 30 years later stays where it is.
        let now = Instant::now();
        let far = later(now, Duration::MAX);
        assert_eq!(far - now, Duration::from_secs(946_080_000), "30 years");
        let tokio_now = tokio::time::Instant::now();
        assert_eq!(
            later_tokio(tokio_now, Duration::from_millis(5)),
            tokio_now + Duration::from_millis(5)
        );
    }
}
