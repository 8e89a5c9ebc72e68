//! Parsing of lock store URL options shared by the backends.

use std::time::Duration;

use crate::LockError;

/// Parses a duration option such as `30s`, `500ms`, `2m`, `1h` or `1.5s`; a bare number is
/// seconds. `option` names the option in the error message.
///
/// ```
/// use std::time::Duration;
/// assert_eq!(dlock::parse_duration("lease", "1.5s")?, Duration::from_millis(1500));
/// assert_eq!(dlock::parse_duration("lease", "250ms")?, Duration::from_millis(250));
/// assert_eq!(dlock::parse_duration("lease", "2m")?, Duration::from_secs(120));
/// assert_eq!(dlock::parse_duration("lease", "10")?, Duration::from_secs(10));
/// assert!(dlock::parse_duration("lease", "soon").is_err());
/// # Ok::<(), dlock::LockError>(())
/// ```
pub fn parse_duration(option: &str, value: &str) -> Result<Duration, LockError> {
    let value = value.trim();
    let split = value
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(value.len());
    let (number, unit) = value.split_at(split);
    let scale = match unit {
        "" | "s" => 1.0,
        "ms" => 0.001,
        "us" | "µs" => 0.000_001,
        "m" | "min" => 60.0,
        "h" => 3600.0,
        _ => f64::NAN,
    };
    let parsed = number.parse::<f64>().ok().map(|n| n * scale);
    match parsed {
        Some(secs) if secs.is_finite() && secs >= 0.0 => {
            Duration::try_from_secs_f64(secs).map_err(|_| bad_duration(option, value))
        }
        _ => Err(bad_duration(option, value)),
    }
}

fn bad_duration(option: &str, value: &str) -> LockError {
    LockError::config(format!(
        "option `{option}` has the value `{}`, which is not a duration; write it like `30s`, `500ms`, `2m` or `1h`",
        shown(value)
    ))
}

/// A piece of a URL as an error message may show it: escaped, and only when it is short and
/// has none of `@`, `:` or `/`. A mangled URL can put its credentials where an option name,
/// an option value or a scheme is expected (`postgr?es://user:password@host`), and error
/// messages end up in logs.
pub(crate) fn shown(text: &str) -> String {
    if text.chars().count() <= 40 && !text.contains(['@', ':', '/']) {
        text.escape_debug().to_string()
    } else {
        "(not shown: it may contain credentials)".to_owned()
    }
}

/// Splits the query string of a lock store URL into decoded `(name, value)` pairs.
// Used by the backends; unused in a build without any.
#[allow(dead_code)]
pub(crate) fn query_pairs(query: &str) -> Vec<(String, String)> {
    url::form_urlencoded::parse(query.as_bytes())
        .map(|(k, v)| (k.into_owned(), v.into_owned()))
        .collect()
}

/// The error for an option a backend does not know.
// Used by the backends; unused in a build without any.
#[allow(dead_code)]
pub(crate) fn unknown_option(backend: &str, option: &str, valid: &[&str]) -> LockError {
    LockError::config(format!(
        "unknown {backend} URL option `{}`; valid options are: {}",
        shown(option),
        valid.join(", ")
    ))
}

/// Percent-decodes `text` (`+` stays `+`); `None` when the result is not UTF-8.
#[cfg(any(feature = "mssql", feature = "oracle"))]
pub(crate) fn percent_decode(text: &str) -> Option<String> {
    fn hex(byte: u8) -> Option<u8> {
        match byte {
            b'0'..=b'9' => Some(byte - b'0'),
            b'a'..=b'f' => Some(byte - b'a' + 10),
            b'A'..=b'F' => Some(byte - b'A' + 10),
            _ => None,
        }
    }
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while let Some(&byte) = bytes.get(i) {
        let pair = (
            bytes.get(i + 1).copied().and_then(hex),
            bytes.get(i + 2).copied().and_then(hex),
        );
        match (byte, pair) {
            (b'%', (Some(high), Some(low))) => {
                out.push(high << 4 | low);
                i += 3;
            }
            _ => {
                out.push(byte);
                i += 1;
            }
        }
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("x", "0").unwrap(), Duration::ZERO);
        assert_eq!(
            parse_duration("x", "1h").unwrap(),
            Duration::from_secs(3600)
        );
        for bad in ["", "s", "-1s", "1d", "1e400", "NaN", "1..2s"] {
            assert!(parse_duration("x", bad).is_err(), "{bad}");
        }
    }
}
