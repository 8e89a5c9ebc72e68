//! The options every session engine takes, from its URL or its builder: their defaults, their
//! URL names, how they are read and how they are checked, written once for all engines.

use std::str::FromStr;
use std::time::Duration;

use crate::LockError;
use crate::options::{
    ConfigKey, check_count, parse_bool, parse_count, parse_duration, parse_key, read_query,
    url_keys,
};
use crate::time::{MAX_SETTING, check_limit, check_setting};

/// How many connections, how often they are checked, and how long a short statement may take.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LaneSettings {
    pub(crate) connections: usize,
    pub(crate) wait_connections: usize,
    pub(crate) keepalive: Duration,
    pub(crate) statement_timeout: Duration,
}

/// The most lock or wait connections a backend may be configured with.
pub(crate) const MAX_CONNECTIONS: usize = 64;

/// The default [`statement_timeout`](SessionOptions::statement_timeout).
pub(crate) const DEFAULT_STATEMENT_TIMEOUT: Duration = Duration::from_secs(10);

/// The shortest `statement_timeout`: below this, a healthy server's answer to a try on a
/// loaded machine would be taken for a dead connection.
pub(crate) const MIN_STATEMENT_TIMEOUT: Duration = Duration::from_millis(10);

impl LaneSettings {
    /// Checks the settings, naming the option that is wrong.
    pub(crate) fn check(&self) -> Result<(), LockError> {
        check_setting(
            "keepalive",
            self.keepalive,
            Duration::from_millis(10),
            MAX_SETTING,
        )?;
        check_setting(
            "statement_timeout",
            self.statement_timeout,
            MIN_STATEMENT_TIMEOUT,
            MAX_SETTING,
        )?;
        check_count("connections", self.connections, 1..=MAX_CONNECTIONS)?;
        check_count(
            "wait_connections",
            self.wait_connections,
            0..=MAX_CONNECTIONS,
        )
    }
}

/// The options every session engine takes, from its URL or its builder.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionOptions {
    pub(crate) fencing: bool,
    /// `fencing_counters`: at most this many shared fencing counters, or one per key (`None`).
    pub(crate) fencing_counters: Option<u32>,
    pub(crate) connect_timeout: Duration,
    pub(crate) connections: usize,
    pub(crate) wait_connections: usize,
    pub(crate) keepalive: Duration,
    /// The most one short statement on a lock connection (a try, a release, stopping an
    /// abandoned wait) or a release on a wait connection may take before its connection is
    /// presumed dead: the connection is dropped and the locks it held are reported lost.
    pub(crate) statement_timeout: Duration,
}

impl Default for SessionOptions {
    fn default() -> Self {
        SessionOptions {
            fencing: false,
            fencing_counters: None,
            connect_timeout: Duration::from_secs(10),
            connections: 4,
            wait_connections: 4,
            keepalive: Duration::from_secs(5),
            statement_timeout: DEFAULT_STATEMENT_TIMEOUT,
        }
    }
}

impl SessionOptions {
    /// Reads the value of the URL option `key`.
    pub(crate) fn set(&mut self, key: SessionKey, value: &str) -> Result<(), LockError> {
        let name = key.as_ref();
        match key {
            SessionKey::Fencing => self.fencing = parse_bool(name, value)?,
            SessionKey::FencingCounters => {
                self.fencing_counters = Some(crate::counters::parse(name, value)?);
            }
            SessionKey::Keepalive => self.keepalive = parse_duration(name, value)?,
            SessionKey::ConnectTimeout => self.connect_timeout = parse_duration(name, value)?,
            SessionKey::StatementTimeout => self.statement_timeout = parse_duration(name, value)?,
            SessionKey::Connections => self.connections = parse_count(name, value)?,
            SessionKey::WaitConnections => self.wait_connections = parse_count(name, value)?,
        }
        Ok(())
    }

    /// The lane machinery's part of the options.
    pub(crate) fn settings(&self) -> LaneSettings {
        LaneSettings {
            connections: self.connections,
            wait_connections: self.wait_connections,
            keepalive: self.keepalive,
            statement_timeout: self.statement_timeout,
        }
    }

    /// Checks the options, naming the one that is wrong.
    pub(crate) fn check(&self) -> Result<(), LockError> {
        if let Some(n) = self.fencing_counters {
            crate::counters::check(n)?;
            if !self.fencing {
                return Err(LockError::config(
                    "fencing_counters bounds the fencing counters, but fencing is off: set \
                     fencing=true as well, or drop fencing_counters",
                ));
            }
        }
        check_limit("connect_timeout", self.connect_timeout)?;
        self.settings().check()
    }
}

url_keys! {
    /// A URL option that every session engine reads.
    pub(crate) enum SessionKey {
        Fencing = "fencing",
        FencingCounters = "fencing_counters",
        Keepalive = "keepalive",
        Connections = "connections",
        WaitConnections = "wait_connections",
        ConnectTimeout = "connect_timeout",
        StatementTimeout = "statement_timeout",
    }
}

impl SessionKey {
    /// The key called `name`.
    fn find(name: &str) -> Option<SessionKey> {
        Self::ALL.iter().copied().find(|key| key.name() == name)
    }

    /// The names of the keys.
    pub(crate) fn names() -> impl Iterator<Item = &'static str> {
        Self::ALL.iter().map(|key| key.name())
    }
}

/// A URL option of a session engine: one that every engine reads, or one of the engine's own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum EngineKey<K> {
    Session(SessionKey),
    Own(K),
}

impl<K: ConfigKey> ConfigKey for EngineKey<K> {
    const BACKEND: &'static str = K::BACKEND;

    fn find(name: &str) -> Option<Self> {
        SessionKey::find(name)
            .map(EngineKey::Session)
            .or_else(|| K::find(name).map(EngineKey::Own))
    }

    fn names() -> Vec<&'static str> {
        SessionKey::names().chain(K::names()).collect()
    }
}

impl<K: ConfigKey> FromStr for EngineKey<K> {
    type Err = LockError;

    fn from_str(name: &str) -> Result<Self, LockError> {
        parse_key(name)
    }
}

impl<K: ConfigKey> AsRef<str> for EngineKey<K> {
    fn as_ref(&self) -> &str {
        match self {
            EngineKey::Session(key) => key.name(),
            EngineKey::Own(key) => key.as_ref(),
        }
    }
}

/// Reads a session engine's URL `query`: the session options into the answer, each of the
/// engine's own to `own`.
pub(crate) fn read_engine_query<K: ConfigKey>(
    query: &str,
    mut own: impl FnMut(K, String) -> Result<(), LockError>,
) -> Result<SessionOptions, LockError> {
    let mut options = SessionOptions::default();
    read_query(query, |key, value| match key {
        EngineKey::Session(key) => options.set(key, &value),
        EngineKey::Own(key) => own(key, value),
    })?;
    Ok(options)
}

/// Refuses `fencing_counters` on an engine that does not have it yet, naming the engine.
#[cfg(any(feature = "mysql", feature = "mssql", feature = "oracle"))]
pub(crate) fn refuse_fencing_counters(
    backend: &str,
    options: &SessionOptions,
) -> Result<(), LockError> {
    if options.fencing_counters.is_some() {
        return Err(LockError::config(format!(
            "{backend}: the option fencing_counters is not available on this backend in this \
             version (PostgreSQL, Redis and SQLite have it); its fencing counters are one per key"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An engine with no options of its own.
    #[derive(Debug, PartialEq, Eq)]
    enum NoOwn {}

    impl AsRef<str> for NoOwn {
        fn as_ref(&self) -> &str {
            match *self {}
        }
    }

    impl ConfigKey for NoOwn {
        const BACKEND: &'static str = "test";
        fn find(_: &str) -> Option<Self> {
            None
        }
        fn names() -> Vec<&'static str> {
            Vec::new()
        }
    }

    impl FromStr for NoOwn {
        type Err = LockError;
        fn from_str(name: &str) -> Result<Self, LockError> {
            parse_key(name)
        }
    }

    type Keys = EngineKey<NoOwn>;

    #[test]
    fn fencing_is_an_option() {
        let options = read_engine_query::<NoOwn>("fencing=on", |key, _| match key {}).unwrap();
        assert!(options.fencing);
        assert_eq!(Keys::names().len(), 7);
    }

    #[test]
    fn keys_round_trip_through_their_names() {
        for name in Keys::names() {
            assert_eq!(name.parse::<Keys>().unwrap().as_ref(), name);
        }
        let err = "Keepalive".parse::<Keys>().unwrap_err().to_string();
        assert!(
            err.ends_with("valid options are: fencing, fencing_counters, keepalive, connections, wait_connections, connect_timeout, statement_timeout"),
            "{err}"
        );
    }

    #[test]
    fn counts_and_durations() {
        let mut options = read_engine_query::<NoOwn>(
            "connections=+7+&wait_connections=0&keepalive=250ms&connect_timeout=3s&statement_timeout=1.5s",
            |key, _| match key {},
        )
        .unwrap();
        assert!(read_engine_query::<NoOwn>("bogus=1", |key, _| match key {}).is_err());
        assert_eq!((options.connections, options.wait_connections), (7, 0));
        assert_eq!(options.keepalive, Duration::from_millis(250));
        assert_eq!(options.connect_timeout, Duration::from_secs(3));
        assert_eq!(options.statement_timeout, Duration::from_millis(1500));
        options.check().unwrap();
        let err = options.set(SessionKey::Connections, "many").unwrap_err();
        assert!(err.to_string().contains("not a whole number"), "{err}");
        options.connect_timeout = Duration::ZERO;
        assert!(options.check().is_err());
        options.connect_timeout = Duration::from_secs(1);
        options.wait_connections = MAX_CONNECTIONS + 1;
        let err = options.check().unwrap_err().to_string();
        assert!(
            err.ends_with("wait_connections is 65, but it must be between 0 and 64"),
            "{err}"
        );
    }

    /// `fencing_counters` needs `fencing`; the engines that do not have it yet refuse it,
    /// naming themselves.
    #[test]
    fn fencing_counters_need_fencing_and_an_engine_that_has_them() {
        let mut options =
            read_engine_query::<NoOwn>("fencing_counters=8", |key, _| match key {}).unwrap();
        assert_eq!(options.fencing_counters, Some(8));
        let err = options.check().unwrap_err().to_string();
        assert!(
            err.contains("fencing_counters") && err.contains("fencing is off"),
            "{err}"
        );
        options.set(SessionKey::Fencing, "true").unwrap();
        options.check().unwrap();
        #[cfg(any(feature = "mysql", feature = "mssql", feature = "oracle"))]
        {
            let err = refuse_fencing_counters("MySQL", &options)
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("MySQL") && err.contains("fencing_counters"),
                "{err}"
            );
            options.fencing_counters = None;
            refuse_fencing_counters("MySQL", &options).unwrap();
        }
    }

    #[test]
    fn statement_timeout_default_and_bounds() {
        let defaults = read_engine_query::<NoOwn>("", |key, _| match key {}).unwrap();
        assert_eq!(defaults.statement_timeout, Duration::from_secs(10));
        assert_eq!(
            defaults.settings().statement_timeout,
            Duration::from_secs(10)
        );
        let mut options = defaults;
        for (value, words) in [
            ("9ms", "must be at least 10ms"),
            ("0", "must be at least 10ms"),
            ("10000000000000000s", "at most 365 days"),
        ] {
            options.set(SessionKey::StatementTimeout, value).unwrap();
            let err = options.check().unwrap_err();
            assert_eq!(err.code(), "DistributedLock.Configuration");
            assert!(err.to_string().contains(words), "{value}: {err}");
            assert!(err.to_string().contains("statement_timeout"), "{err}");
        }
        let err = options
            .set(SessionKey::StatementTimeout, "soon")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("statement_timeout") && err.contains("a duration"),
            "{err}"
        );
        options.set(SessionKey::StatementTimeout, "10ms").unwrap();
        options.check().unwrap();
        options.set(SessionKey::StatementTimeout, "8760h").unwrap();
        options.check().unwrap();
    }
}
