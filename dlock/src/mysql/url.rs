//! The `mysql://` and `mariadb://` URL.

use std::str::FromStr;

use sqlx::mysql::MySqlConnectOptions;

use crate::LockError;
use crate::session::SessionOptions;
use crate::sqlx_engine::{driver_url, split_query};

use super::MySql;

/// Options of the driver that pass through the URL unchanged.
const DRIVER_OPTIONS: &[&str] = &[
    "sslmode",
    "ssl-mode",
    "sslca",
    "ssl-ca",
    "sslcert",
    "ssl-cert",
    "sslkey",
    "ssl-key",
    "charset",
    "collation",
    "socket",
    "timezone",
    "time-zone",
    "statement-cache-capacity",
];

/// Reads a `mysql://` or `mariadb://` URL; its options are checked by the caller.
pub(super) fn parse_url(url: &str) -> Result<(MySqlConnectOptions, SessionOptions), LockError> {
    let (base, query) = url.split_once('?').unwrap_or((url, ""));
    let Some((scheme, rest)) = base.split_once("://") else {
        return Err(LockError::config(
            "the MySQL URL must look like mysql://user:password@host:3306/database",
        ));
    };
    if !matches!(scheme.to_ascii_lowercase().as_str(), "mysql" | "mariadb") {
        return Err(LockError::config(
            "the MySQL backend takes mysql:// or mariadb:// URLs",
        ));
    }
    let (session, passthrough) =
        split_query::<MySql>(query, DRIVER_OPTIONS, |name| DRIVER_OPTIONS.contains(&name))?;
    // The driver reads `mysql://`; `mariadb://` is the same protocol.
    let driver_url = driver_url(format!("mysql://{rest}"), &passthrough);
    let options = MySqlConnectOptions::from_str(&driver_url).map_err(|e| {
        LockError::config(format!(
            "the MySQL URL is not valid ({}); write it like mysql://user:password@host:3306/database (options: {})",
            describe_url_error(&e),
            SessionOptions::names(true).join(", ")
        ))
    })?;
    Ok((options, session))
}

/// The driver's URL error, without anything that could repeat the URL.
fn describe_url_error(err: &sqlx::Error) -> String {
    match err {
        sqlx::Error::Configuration(inner) => inner.to_string(),
        _ => "malformed URL".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use crate::mysql::MySqlBackend;

    #[test]
    fn urls() {
        let b = MySqlBackend::builder_from_url(
            "mariadb://u:secret@127.0.0.1:5/db?fencing=true&keepalive=250ms&connections=2&wait_connections=0&ssl-mode=disabled",
        )
        .unwrap();
        assert!(b.options.fencing);
        assert_eq!(b.options.keepalive, Duration::from_millis(250));
        assert_eq!((b.options.connections, b.options.wait_connections), (2, 0));
        assert_eq!(b.target.get_port(), 5);
        assert_eq!(b.target.get_database(), Some("db"));
        assert!(!format!("{b:?}").contains("secret"));
        for bad in [
            "mysql://h/db?fencing=maybe",
            "mysql://h/db?keepalive=soon",
            "mysql://h/db?connections=0",
            "mysql://h/db?connections=100",
            "mysql://h/db?keepalive=1ms",
            "mysql://h/db?nonsense=1",
            "mysql://h:notaport/db",
            "postgres://h/db",
        ] {
            let err = MySqlBackend::builder_from_url(bad).unwrap_err();
            assert_eq!(err.code(), "DistributedLock.Configuration", "{bad}: {err}");
            assert!(!err.to_string().contains("secret"));
        }
    }
}
