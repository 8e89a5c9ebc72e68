//! The duration grammar of dlock's options: URL options (`?lease=30s`) and the
//! `#[distributed_lock]` attribute's `timeout = "10s"` read durations with [`parse_duration`].

use std::fmt;
use std::time::Duration;

/// The units a duration may be written in: humantime's names from nanoseconds to hours.
/// Longer ones are refused: a month and a year are approximations there, `M` (months) is one
/// shift key from `m` (minutes), and no setting may exceed 365 days anyway.
pub const DURATION_UNITS: &[&str] = &[
    "nanos", "nsec", "ns", "usec", "us", "µs", "millis", "msec", "ms", "seconds", "second", "secs",
    "sec", "s", "minutes", "minute", "min", "mins", "m", "hours", "hour", "hr", "hrs", "h",
];

/// Parses a duration: a number with a unit from `ns` to `h`, such as `30s`, `500ms`, `2m`,
/// `1h` or `1.5s`; several of them, summed (`1h 30m`, `1m30s`); or a bare number, which is
/// seconds (`10`, `0.5`). Units are humantime's (`ms`/`msec`, `s`/`sec`, `m`/`min`,
/// `h`/`hr`, …, see [`DURATION_UNITS`]); days and longer are refused. Surrounding spaces are
/// ignored.
///
/// ```
/// use std::time::Duration;
/// use dlock_template::parse_duration;
///
/// assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
/// assert_eq!(parse_duration("1h 30m"), Ok(Duration::from_secs(5400)));
/// assert_eq!(parse_duration("10"), Ok(Duration::from_secs(10)));
/// assert!(parse_duration("2d").is_err());
/// assert!(parse_duration("soon").is_err());
/// ```
pub fn parse_duration(value: &str) -> Result<Duration, DurationError> {
    let value = value.trim();
    let bare = !value.is_empty()
        && value.chars().all(|c| c.is_ascii_digit() || c == '.')
        && value.chars().filter(|&c| c == '.').count() <= 1;
    let units_known = value
        .split(|c: char| !(c.is_ascii_alphabetic() || c == 'µ'))
        .all(|unit| unit.is_empty() || DURATION_UNITS.contains(&unit));
    let parsed = if bare {
        humantime::parse_duration(&format!("{value}s"))
    } else if units_known {
        humantime::parse_duration(value)
    } else {
        return Err(DurationError);
    };
    parsed.map_err(|_| DurationError)
}

/// A text [`parse_duration`] does not read as a duration.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DurationError;

impl fmt::Display for DurationError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("not a duration; write it like `30s`, `500ms`, `2m`, `1h` or `1h 30m`")
    }
}

impl std::error::Error for DurationError {}
