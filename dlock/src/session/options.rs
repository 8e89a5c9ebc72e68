//! The options every session engine takes, from its URL or its builder: their defaults, their
//! URL names, how they are read and how they are checked, written once for all engines.

use std::time::Duration;

use crate::LockError;
use crate::options::{parse_duration, shown};
use crate::time::{MAX_SETTING, check_setting};

/// How many connections, and how often they are checked.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LaneSettings {
    pub(crate) connections: usize,
    pub(crate) wait_connections: usize,
    pub(crate) keepalive: Duration,
}

/// The most lock or wait connections a backend may be configured with.
pub(crate) const MAX_CONNECTIONS: usize = 64;

impl LaneSettings {
    /// Checks the settings, naming the option that is wrong.
    pub(crate) fn check(&self) -> Result<(), LockError> {
        check_setting(
            "keepalive",
            self.keepalive,
            Duration::from_millis(10),
            MAX_SETTING,
        )?;
        if !(1..=MAX_CONNECTIONS).contains(&self.connections) {
            return Err(LockError::config(format!(
                "connections must be between 1 and {MAX_CONNECTIONS}, not {}",
                self.connections
            )));
        }
        if self.wait_connections > MAX_CONNECTIONS {
            return Err(LockError::config(format!(
                "wait_connections must be between 0 and {MAX_CONNECTIONS}, not {}",
                self.wait_connections
            )));
        }
        Ok(())
    }
}

/// The options every session engine takes, from its URL or its builder (`fencing` only where
/// the engine issues fencing tokens).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionOptions {
    pub(crate) fencing: bool,
    pub(crate) connect_timeout: Duration,
    pub(crate) connections: usize,
    pub(crate) wait_connections: usize,
    pub(crate) keepalive: Duration,
}

impl Default for SessionOptions {
    fn default() -> Self {
        SessionOptions {
            fencing: false,
            connect_timeout: Duration::from_secs(10),
            connections: 4,
            wait_connections: 4,
            keepalive: Duration::from_secs(5),
        }
    }
}

impl SessionOptions {
    /// The URL options [`SessionOptions::parse`] reads, `fencing` first.
    const NAMES: &[&str] = &[
        "fencing",
        "keepalive",
        "connections",
        "wait_connections",
        "connect_timeout",
    ];

    /// The URL option names of an engine that does (`fencing`) or does not issue fencing tokens.
    pub(crate) fn names(fencing: bool) -> &'static [&'static str] {
        if fencing {
            Self::NAMES
        } else {
            &Self::NAMES[1..]
        }
    }

    /// Reads the URL option `name` if it is one of [`SessionOptions::names`]`(fencing)`:
    /// `Ok(false)` when it is not.
    pub(crate) fn parse(
        &mut self,
        fencing: bool,
        name: &str,
        value: &str,
    ) -> Result<bool, LockError> {
        match name {
            "fencing" if fencing => {
                self.fencing = match value {
                    "true" | "1" | "yes" | "on" => true,
                    "false" | "0" | "no" | "off" => false,
                    _ => {
                        return Err(LockError::config(format!(
                            "option `fencing` has the value `{}`; write `true` or `false`",
                            shown(value)
                        )));
                    }
                }
            }
            "keepalive" => self.keepalive = parse_duration(name, value)?,
            "connect_timeout" => self.connect_timeout = parse_duration(name, value)?,
            "connections" => self.connections = parse_count(name, value)?,
            "wait_connections" => self.wait_connections = parse_count(name, value)?,
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// The lane machinery's part of the options.
    pub(crate) fn settings(&self) -> LaneSettings {
        LaneSettings {
            connections: self.connections,
            wait_connections: self.wait_connections,
            keepalive: self.keepalive,
        }
    }

    /// Checks the options, naming the one that is wrong.
    pub(crate) fn check(&self) -> Result<(), LockError> {
        check_setting(
            "connect_timeout",
            self.connect_timeout,
            Duration::from_nanos(1),
            MAX_SETTING,
        )?;
        self.settings().check()
    }
}

/// Reads a count option (`connections`, `wait_connections`).
fn parse_count(option: &str, value: &str) -> Result<usize, LockError> {
    value.trim().parse().map_err(|_| {
        LockError::config(format!(
            "option `{option}` has the value `{}`, which is not a whole number",
            shown(value)
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fencing_is_an_option_only_where_tokens_are_issued() {
        let mut options = SessionOptions::default();
        assert!(options.parse(true, "fencing", "on").unwrap());
        assert!(options.fencing);
        let mut options = SessionOptions::default();
        assert!(!options.parse(false, "fencing", "true").unwrap());
        assert!(!options.fencing);
        assert!(!SessionOptions::names(false).contains(&"fencing"));
        assert_eq!(SessionOptions::names(true).len(), 5);
    }

    #[test]
    fn counts_and_durations() {
        let mut options = SessionOptions::default();
        assert!(options.parse(false, "connections", " 7 ").unwrap());
        assert!(options.parse(false, "wait_connections", "0").unwrap());
        assert!(options.parse(false, "keepalive", "250ms").unwrap());
        assert!(options.parse(false, "connect_timeout", "3s").unwrap());
        assert!(!options.parse(false, "bogus", "1").unwrap());
        assert_eq!((options.connections, options.wait_connections), (7, 0));
        assert_eq!(options.keepalive, Duration::from_millis(250));
        assert_eq!(options.connect_timeout, Duration::from_secs(3));
        options.check().unwrap();
        let err = options.parse(false, "connections", "many").unwrap_err();
        assert!(err.to_string().contains("not a whole number"), "{err}");
        options.connect_timeout = Duration::ZERO;
        assert!(options.check().is_err());
    }
}
