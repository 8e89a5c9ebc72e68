//! The options every session engine takes, from its URL or its builder.

use std::time::Duration;

use crate::LockError;
use crate::options::parse_duration;
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

/// The options PostgreSQL and MySQL take alike, from their URL or their builder.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LaneOptions {
    pub(crate) fencing: bool,
    pub(crate) connect_timeout: Duration,
    pub(crate) settings: LaneSettings,
}

impl Default for LaneOptions {
    fn default() -> Self {
        LaneOptions {
            fencing: false,
            connect_timeout: Duration::from_secs(10),
            settings: LaneSettings {
                connections: 4,
                wait_connections: 4,
                keepalive: Duration::from_secs(5),
            },
        }
    }
}

#[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
impl LaneOptions {
    /// The URL options [`LaneOptions::parse`] reads.
    pub(crate) const NAMES: &[&str] = &[
        "fencing",
        "keepalive",
        "connections",
        "wait_connections",
        "connect_timeout",
    ];

    /// Reads the URL option `name` if it is one of [`LaneOptions::NAMES`]: `Ok(false)` when
    /// it is not.
    pub(crate) fn parse(&mut self, name: &str, value: &str) -> Result<bool, LockError> {
        match name {
            "fencing" => {
                self.fencing = match value {
                    "true" | "1" | "yes" | "on" => true,
                    "false" | "0" | "no" | "off" => false,
                    _ => {
                        return Err(LockError::config(format!(
                            "option `fencing` has the value `{}`; write `true` or `false`",
                            crate::options::shown(value)
                        )));
                    }
                }
            }
            "keepalive" => self.settings.keepalive = parse_duration(name, value)?,
            "connect_timeout" => self.connect_timeout = parse_duration(name, value)?,
            "connections" => self.settings.connections = parse_count(name, value)?,
            "wait_connections" => self.settings.wait_connections = parse_count(name, value)?,
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// Checks the options, naming the one that is wrong.
    pub(crate) fn check(&self) -> Result<(), LockError> {
        check_connect_timeout(self.connect_timeout)?;
        self.settings.check()
    }
}

#[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
fn parse_count(option: &str, value: &str) -> Result<usize, LockError> {
    value.trim().parse().map_err(|_| {
        LockError::config(format!(
            "option `{option}` has the value `{}`, which is not a whole number",
            crate::options::shown(value)
        ))
    })
}

/// Checks a session engine's `connect_timeout`: more than zero, at most
/// [`MAX_SETTING`](crate::time::MAX_SETTING).
pub(crate) fn check_connect_timeout(connect_timeout: Duration) -> Result<(), LockError> {
    check_setting(
        "connect_timeout",
        connect_timeout,
        Duration::from_nanos(1),
        MAX_SETTING,
    )
    .map(drop)
}
