//! The options layer: how the lock store URLs of every backend are taken apart, how their
//! options are named, and how option values are read, written once.
//!
//! - Each backend names its options with a typed key (an enum implementing [`ConfigKey`] and
//!   `FromStr`); an unknown name is refused by one error that lists the valid ones.
//! - [`read_query`] walks a URL's query, turning each name into the backend's key, and the
//!   backend reads the value with the parser of its kind: [`parse_duration`], [`parse_bool`] or
//!   [`parse_count`]. A bad value's message names the option and says what it should be.
//! - [`UrlForm`] is the URL skeleton a backend fills in with its name, schemes and example.
//!
//! The rules, the same for every backend: durations as [`parse_duration`] reads them; booleans
//! `true`, `false`, `1`, `0`, `yes`, `no`, `on`, `off` in any case; counts are whole numbers,
//! surrounding spaces allowed.
// The helpers that serve only some backends are compiled with them; a build without any
// backend leaves the rest unused.
#![cfg_attr(
    not(any(
        feature = "sqlite",
        feature = "postgres",
        feature = "mysql",
        feature = "mssql",
        feature = "oracle",
        feature = "redis",
        feature = "etcd"
    )),
    allow(dead_code, unused_imports, unused_macros)
)]

use std::fmt::Display;
use std::str::FromStr;
use std::time::Duration;

use crate::LockError;

/// Parses a duration option: a number with a unit from `ns` to `h`, such as `30s`, `500ms`,
/// `2m`, `1h` or `1.5s`; several of them, summed (`1h 30m`, `1m30s`); or a bare number, which
/// is seconds (`10`, `0.5`). Units are humantime's (`ms`/`msec`, `s`/`sec`, `m`/`min`,
/// `h`/`hr`, …); days and longer are refused. `option` names the option in the error message.
/// The `#[distributed_lock]` attribute reads `timeout = "10s"` with the same grammar.
///
/// ```
/// use std::time::Duration;
/// assert_eq!(dlock::parse_duration("lease", "1.5s")?, Duration::from_millis(1500));
/// assert_eq!(dlock::parse_duration("lease", "250ms")?, Duration::from_millis(250));
/// assert_eq!(dlock::parse_duration("lease", "2m")?, Duration::from_secs(120));
/// assert_eq!(dlock::parse_duration("lease", "1h 30m")?, Duration::from_secs(5400));
/// assert_eq!(dlock::parse_duration("lease", "10")?, Duration::from_secs(10));
/// assert!(dlock::parse_duration("lease", "soon").is_err());
/// # Ok::<(), dlock::LockError>(())
/// ```
pub fn parse_duration(option: &str, value: &str) -> Result<Duration, LockError> {
    dlock_template::parse_duration(value).map_err(|_| bad_duration(option, value))
}

fn bad_duration(option: &str, value: &str) -> LockError {
    bad_value(
        option,
        value,
        "a duration; write it like `30s`, `500ms`, `2m`, `1h` or `1h 30m`",
    )
}

#[cfg(any(
    feature = "postgres",
    feature = "mysql",
    feature = "mssql",
    feature = "oracle",
    feature = "redis"
))]
/// Parses a boolean option: `true`, `1`, `yes`, `on` or `false`, `0`, `no`, `off`, in any case.
pub(crate) fn parse_bool(option: &str, value: &str) -> Result<bool, LockError> {
    match value.trim().to_ascii_lowercase().as_str() {
        "true" | "1" | "yes" | "on" => Ok(true),
        "false" | "0" | "no" | "off" => Ok(false),
        _ => Err(bad_value(option, value, "true or false")),
    }
}

#[cfg(any(
    feature = "postgres",
    feature = "mysql",
    feature = "mssql",
    feature = "oracle",
    feature = "redis"
))]
/// Parses a count option: a whole number, surrounding spaces allowed.
pub(crate) fn parse_count(option: &str, value: &str) -> Result<usize, LockError> {
    value
        .trim()
        .parse()
        .map_err(|_| bad_value(option, value, "a whole number"))
}

#[cfg(any(
    feature = "postgres",
    feature = "mysql",
    feature = "mssql",
    feature = "oracle"
))]
/// Checks that the count option `option` is within `bounds`.
pub(crate) fn check_count(
    option: &str,
    value: usize,
    bounds: std::ops::RangeInclusive<usize>,
) -> Result<(), LockError> {
    if bounds.contains(&value) {
        return Ok(());
    }
    Err(LockError::config(format!(
        "{option} is {value}, but it must be between {} and {}",
        bounds.start(),
        bounds.end()
    )))
}

/// The error for an option value that cannot be read: `expected` says what it should be.
pub(crate) fn bad_value(option: &str, value: &str, expected: &str) -> LockError {
    LockError::config(format!(
        "option `{option}` has the value `{}`, which is not {expected}",
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

/// The URL options of one backend, as a typed key: `FromStr` accepts the names the backend
/// documents (an unknown one is [`unknown_key`]'s error) and `as_ref` gives a key's name.
pub(crate) trait ConfigKey: FromStr<Err = LockError> + AsRef<str> + Sized {
    /// The backend, as its messages name it.
    const BACKEND: &'static str;

    /// The key named `name`, if the backend has one.
    fn find(name: &str) -> Option<Self>;

    /// The names of the backend's options, as the error for an unknown one lists them.
    fn names() -> Vec<&'static str>;
}

/// The key `name` of `K`'s backend, or the error for an option it does not know (what each
/// key's `FromStr` answers).
pub(crate) fn parse_key<K: ConfigKey>(name: &str) -> Result<K, LockError> {
    K::find(name).ok_or_else(|| unknown_key::<K>(name))
}

/// The error for an option `K`'s backend does not know, listing the ones it does.
pub(crate) fn unknown_key<K: ConfigKey>(name: &str) -> LockError {
    LockError::config(format!(
        "unknown {} URL option `{}`; valid options are: {}",
        K::BACKEND,
        shown(name),
        K::names().join(", ")
    ))
}

/// Declares an enum of URL option keys, each with its name: `ALL` (every key, in the order
/// written), `name()` and `as_ref()`. With `for FORM` (a [`UrlForm`]), the enum is that
/// backend's [`ConfigKey`], with `FromStr`.
macro_rules! url_keys {
    (
        $(#[$meta:meta])* $vis:vis enum $key:ident $(for $form:ident)?
        { $($variant:ident = $name:literal),* $(,)? }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        $vis enum $key {
            $($variant),*
        }

        impl $key {
            /// Every key, in the order the docs list them.
            const ALL: &'static [$key] = &[$($key::$variant),*];

            /// The key's URL name.
            fn name(self) -> &'static str {
                match self {
                    $($key::$variant => $name),*
                }
            }
        }

        impl AsRef<str> for $key {
            fn as_ref(&self) -> &str {
                self.name()
            }
        }

        $(
        impl $crate::options::ConfigKey for $key {
            const BACKEND: &'static str = $form.backend;

            fn find(name: &str) -> Option<Self> {
                Self::ALL.iter().copied().find(|key| key.name() == name)
            }

            fn names() -> Vec<&'static str> {
                Self::ALL.iter().map(|key| key.name()).collect()
            }
        }

        impl std::str::FromStr for $key {
            type Err = $crate::LockError;

            fn from_str(name: &str) -> Result<Self, $crate::LockError> {
                $crate::options::parse_key(name)
            }
        }
        )?
    };
}
pub(crate) use url_keys;

/// Reads the options of a URL's `query`: each name becomes a `K` (an unknown one ends the
/// reading with its error), and `apply` reads the value.
pub(crate) fn read_query<K: ConfigKey>(
    query: &str,
    mut apply: impl FnMut(K, String) -> Result<(), LockError>,
) -> Result<(), LockError> {
    for (name, value) in url::form_urlencoded::parse(query.as_bytes()) {
        apply(name.parse()?, value.into_owned())?;
    }
    Ok(())
}

#[cfg(any(
    feature = "mssql",
    feature = "oracle",
    feature = "etcd",
    feature = "redis"
))]
/// Percent-decodes `text` (`+` stays `+`, a `%` not followed by two hex digits stays as it
/// is); `None` when the result is not UTF-8.
pub(crate) fn percent_decode(text: &str) -> Option<String> {
    percent_encoding::percent_decode_str(text)
        .decode_utf8()
        .ok()
        .map(|decoded| decoded.into_owned())
}

/// The URL skeleton a backend fills in: its name, its schemes and how its URLs look, for the
/// checks every backend makes and their messages.
pub(crate) struct UrlForm {
    /// The backend, as messages name it (`SQL Server`).
    pub(crate) backend: &'static str,
    /// The schemes it takes, in lower case.
    pub(crate) schemes: &'static [&'static str],
    /// A URL of its kind, for messages (`mssql://user:password@host:1433/database`).
    pub(crate) example: &'static str,
}

#[cfg(any(feature = "mssql", feature = "oracle"))]
/// The parts of a URL like `scheme://user:password@host:port/name`, percent-decoded.
pub(crate) struct ServerUrl {
    pub(crate) host: String,
    pub(crate) port: Option<u16>,
    pub(crate) user: String,
    pub(crate) password: String,
    /// The path without its `/` (a database or service name; empty when there is none).
    pub(crate) name: String,
    /// The query, without `?`.
    pub(crate) query: String,
}

impl UrlForm {
    /// A configuration error about the URL: `the {backend} URL {what}; write it like {example}`.
    pub(crate) fn error(&self, what: impl Display) -> LockError {
        LockError::config(format!(
            "the {} URL {what}; write it like {}",
            self.backend, self.example
        ))
    }

    fn wrong_scheme(&self) -> LockError {
        let schemes: Vec<String> = self.schemes.iter().map(|s| format!("{s}://")).collect();
        LockError::config(format!(
            "a {} URL starts with {}; write it like {}",
            self.backend,
            schemes.join(" or "),
            self.example
        ))
    }

    #[cfg(any(
        feature = "sqlite",
        feature = "postgres",
        feature = "mysql",
        feature = "etcd"
    ))]
    /// Splits `url` after its scheme (one of the form's, in any case) and at its query: what
    /// follows `scheme:` up to the query, and the query without `?` (empty when there is none).
    pub(crate) fn split<'a>(&self, url: &'a str) -> Result<(&'a str, &'a str), LockError> {
        let (scheme, rest) = url.split_once(':').ok_or_else(|| self.wrong_scheme())?;
        if !self.schemes.contains(&scheme.to_ascii_lowercase().as_str()) {
            return Err(self.wrong_scheme());
        }
        Ok(rest.split_once('?').unwrap_or((rest, "")))
    }

    #[cfg(any(feature = "mssql", feature = "oracle", feature = "redis"))]
    /// Parses `url` as a URL of one of the form's schemes. The parser's message is kept: it
    /// says what is wrong without repeating the URL.
    pub(crate) fn parse(&self, url: &str) -> Result<url::Url, LockError> {
        let parsed =
            url::Url::parse(url).map_err(|err| self.error(format!("is not valid ({err})")))?;
        if !self.schemes.contains(&parsed.scheme()) {
            return Err(self.wrong_scheme());
        }
        Ok(parsed)
    }

    #[cfg(any(feature = "mssql", feature = "oracle"))]
    /// Takes apart a URL like `scheme://user:password@host:port/name`: a host is required, and
    /// the path is at most one name (`name` says what it names, for messages).
    pub(crate) fn server(&self, url: &str, name: &str) -> Result<ServerUrl, LockError> {
        let parsed = self.parse(url)?;
        let decode = |text: &str, what: &str| {
            percent_decode(text).ok_or_else(|| {
                self.error(format_args!(
                    "has a {what} that is not percent-encoded UTF-8"
                ))
            })
        };
        let host = match parsed.host_str() {
            Some(host) if !host.is_empty() => host.to_owned(),
            _ => return Err(self.error("has no host")),
        };
        let path = decode(parsed.path().trim_start_matches('/'), name)?;
        if path.contains('/') {
            return Err(self.error(format_args!("has a path that is more than the {name}")));
        }
        Ok(ServerUrl {
            host,
            port: parsed.port(),
            user: decode(parsed.username(), "user name")?,
            password: decode(parsed.password().unwrap_or(""), "password")?,
            name: path,
            query: parsed.query().unwrap_or("").to_owned(),
        })
    }
}

#[cfg(test)]
pub(crate) fn assert_keys<K: ConfigKey, T>(refusal: Result<T, LockError>) {
    let names = K::names();
    assert!(!names.is_empty());
    for name in &names {
        let key = K::from_str(name).map(|key| key.as_ref().to_owned());
        assert_eq!(key.ok().as_deref(), Some(*name));
    }
    let Err(err) = refusal else {
        panic!("the option `bogus` was accepted");
    };
    let text = err.to_string();
    assert_eq!(err.code(), "DistributedLock.Configuration");
    assert!(
        text.contains(&format!("unknown {} URL option `bogus`", K::BACKEND)),
        "{text}"
    );
    assert!(
        text.ends_with(&format!("valid options are: {}", names.join(", "))),
        "{text}"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        let ok = [
            ("0", Duration::ZERO),
            ("10", Duration::from_secs(10)),
            ("0.5", Duration::from_millis(500)),
            (" 30s ", Duration::from_secs(30)),
            ("500ms", Duration::from_millis(500)),
            ("1.5s", Duration::from_millis(1500)),
            ("2m", Duration::from_secs(120)),
            ("2min", Duration::from_secs(120)),
            ("1h", Duration::from_secs(3600)),
            ("1h 30m", Duration::from_secs(5400)),
            ("1m30s", Duration::from_secs(90)),
            ("250us", Duration::from_micros(250)),
            ("250µs", Duration::from_micros(250)),
            ("8760h", Duration::from_secs(8760 * 3600)),
            (
                "10000000000000000s",
                Duration::from_secs(10_000_000_000_000_000),
            ),
        ];
        for (text, want) in ok {
            assert_eq!(parse_duration("x", text).unwrap(), want, "{text}");
        }
        for bad in [
            "",
            "s",
            "-1s",
            "1d",
            "2w",
            "2M",
            "1y",
            "1e400",
            "NaN",
            "1..2s",
            "1.2.3",
            "soon",
            "5s x",
            "99999999999999999999999s",
        ] {
            let err = parse_duration("lease", bad).unwrap_err();
            assert!(err.to_string().contains("option `lease`"), "{bad}: {err}");
            assert!(err.to_string().contains("not a duration"), "{bad}: {err}");
        }
    }

    #[cfg(feature = "redis")]
    #[test]
    fn booleans_have_one_rule() {
        for yes in [
            "true", "TRUE", "True", "1", "yes", "YES", "on", "On", " true ",
        ] {
            assert!(parse_bool("fencing", yes).unwrap(), "{yes}");
        }
        for no in ["false", "FALSE", "0", "no", "No", "off", "OFF"] {
            assert!(!parse_bool("fencing", no).unwrap(), "{no}");
        }
        for bad in ["", "maybe", "2", "t", "y"] {
            let err = parse_bool("fencing", bad).unwrap_err().to_string();
            assert!(err.contains("option `fencing`"), "{err}");
            assert!(err.contains("not true or false"), "{err}");
        }
    }

    #[cfg(feature = "mssql")]
    #[test]
    fn counts() {
        assert_eq!(parse_count("connections", " 7 ").unwrap(), 7);
        assert_eq!(parse_count("connections", "0").unwrap(), 0);
        for bad in ["", "-1", "1.5", "many", "18446744073709551616"] {
            let err = parse_count("connections", bad).unwrap_err().to_string();
            assert!(err.contains("option `connections`"), "{err}");
            assert!(err.contains("not a whole number"), "{err}");
        }
        check_count("connections", 1, 1..=64).unwrap();
        check_count("connections", 64, 1..=64).unwrap();
        let err = check_count("connections", 65, 1..=64)
            .unwrap_err()
            .to_string();
        assert!(
            err.ends_with("connections is 65, but it must be between 1 and 64"),
            "{err}"
        );
    }

    #[cfg(feature = "mssql")]
    #[test]
    fn percent_decoding() {
        assert_eq!(percent_decode("p%40ss+w%2Fd").as_deref(), Some("p@ss+w/d"));
        assert_eq!(percent_decode("100%").as_deref(), Some("100%"));
        assert_eq!(percent_decode("%zz%4").as_deref(), Some("%zz%4"));
        assert_eq!(percent_decode("%C3%BC").as_deref(), Some("ü"));
        assert_eq!(percent_decode("%FF"), None);
    }

    #[cfg(all(feature = "mssql", feature = "sqlite"))]
    const FORM: UrlForm = UrlForm {
        backend: "Test",
        schemes: &["test", "tests"],
        example: "test://user:password@host/name",
    };

    #[cfg(all(feature = "mssql", feature = "sqlite"))]
    #[test]
    fn url_skeleton() {
        assert_eq!(FORM.split("TEST://a/b?x=1").unwrap(), ("//a/b", "x=1"));
        assert!(FORM.split("nope://a").is_err());
        assert!(FORM.split("no scheme").is_err());
        let server = FORM
            .server("tests://u%40x:p%3A@h:7/db?x=1", "database name")
            .unwrap();
        assert_eq!(
            (server.user.as_str(), server.password.as_str()),
            ("u@x", "p:")
        );
        assert_eq!((server.host.as_str(), server.port), ("h", Some(7)));
        assert_eq!((server.name.as_str(), server.query.as_str()), ("db", "x=1"));
        for bad in [
            "test://u:secret@/db",
            "test://u:secret@h/a/b",
            "test://u:secret%FF@h/db",
            "other://u:secret@h/db",
            "test://u:secret@h:99999/db",
        ] {
            let err = FORM
                .server(bad, "database name")
                .err()
                .expect(bad)
                .to_string();
            assert!(!err.contains("secret"), "{bad}: {err}");
            assert!(err.contains("Test URL"), "{bad}: {err}");
        }
    }
}
