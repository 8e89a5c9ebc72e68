//! The `mysql://` and `mariadb://` URL.

use std::str::FromStr;

use sqlx::mysql::MySqlConnectOptions;

use crate::LockError;
use crate::options::UrlForm;
use crate::session::{SessionKey, SessionOptions};
use crate::sqlx_engine::{SqlxUrl, driver_url, split_query};

use super::MySql;

impl SqlxUrl for MySql {
    const FORM: UrlForm = UrlForm {
        backend: "MySQL",
        schemes: &["mysql", "mariadb"],
        example: "mysql://user:password@host:3306/database",
    };
    const DRIVER_OPTIONS: &'static [&'static str] = &[
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
}

/// Reads a `mysql://` or `mariadb://` URL; its options are checked by the caller.
pub(super) fn parse_url(url: &str) -> Result<(MySqlConnectOptions, SessionOptions), LockError> {
    let form = MySql::FORM;
    let (rest, query) = form.split(url)?;
    let Some(rest) = rest.strip_prefix("//") else {
        return Err(form.error("has no `//` after its scheme"));
    };
    let (session, passthrough) = split_query::<MySql>(query)?;
    // The driver reads `mysql://`; `mariadb://` is the same protocol.
    let driver_url = driver_url(format!("mysql://{rest}"), &passthrough);
    let options = MySqlConnectOptions::from_str(&driver_url).map_err(|e| {
        form.error(format!(
            "is not valid ({}) (options: {})",
            describe_url_error(&e),
            SessionKey::names_of(true).collect::<Vec<_>>().join(", ")
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
        crate::options::assert_keys::<
            crate::session::EngineKey<crate::sqlx_engine::DriverOption<crate::mysql::MySql>>,
            _,
        >(MySqlBackend::builder_from_url("mysql://h/db?bogus=1"));
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
            "mysql://h/db?statement_timeout=later",
            "mysql://h/db?statement_timeout=0",
            "mariadb://h/db?statement_timeout=10000000000000000s",
        ] {
            let err = MySqlBackend::builder_from_url(bad).unwrap_err();
            assert_eq!(err.code(), "DistributedLock.Configuration", "{bad}: {err}");
            assert!(!err.to_string().contains("secret"));
        }
    }

    #[test]
    fn statement_timeout_from_the_url_and_the_builder() {
        let b = MySqlBackend::builder_from_url("mysql://h/db").unwrap();
        assert_eq!(b.options.statement_timeout, Duration::from_secs(10));
        let b = MySqlBackend::builder_from_url("mariadb://h/db?statement_timeout=2s").unwrap();
        assert_eq!(b.options.statement_timeout, Duration::from_secs(2));
        let b = b.statement_timeout(Duration::from_millis(250));
        assert_eq!(b.options.statement_timeout, Duration::from_millis(250));
        let err = MySqlBackend::builder_from_url("mysql://h/db?statement_timeout=1h%2030m")
            .map(|b| b.options.statement_timeout);
        assert_eq!(err.unwrap(), Duration::from_secs(5400));
    }
}
