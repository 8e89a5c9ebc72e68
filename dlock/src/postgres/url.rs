//! The `postgres://` URL.

use std::str::FromStr;

use sqlx::postgres::PgConnectOptions;

use crate::LockError;
use crate::options::UrlForm;
use crate::session::{SessionKey, SessionOptions};
use crate::sqlx_engine::{SqlxUrl, driver_url, split_query};

use super::Postgres;

impl SqlxUrl for Postgres {
    const FORM: UrlForm = UrlForm {
        backend: "PostgreSQL",
        schemes: &["postgres", "postgresql"],
        example: "postgres://user:password@host:5432/database",
    };
    const DRIVER_OPTIONS: &'static [&'static str] = &[
        "sslmode",
        "ssl-mode",
        "sslrootcert",
        "ssl-root-cert",
        "ssl-ca",
        "sslcert",
        "ssl-cert",
        "sslkey",
        "ssl-key",
        "statement-cache-capacity",
        "host",
        "hostaddr",
        "port",
        "dbname",
        "user",
        "password",
        "application_name",
        "options",
    ];

    fn is_driver_option(name: &str) -> bool {
        Self::DRIVER_OPTIONS.contains(&name) || name.starts_with("options[")
    }
}

/// Reads a `postgres://` URL; its options are checked by the caller.
pub(super) fn parse_url(url: &str) -> Result<(PgConnectOptions, SessionOptions), LockError> {
    let form = Postgres::FORM;
    let (rest, query) = form.split(url)?;
    let (session, passthrough) = split_query::<Postgres>(query)?;
    let named = passthrough
        .iter()
        .any(|(name, _)| name == "application_name");
    // `postgresql://` is the same as `postgres://` to the driver.
    let base = format!("postgres:{}", rest);
    let mut options = PgConnectOptions::from_str(&driver_url(base, &passthrough)).map_err(|e| {
        // The driver's message is about the URL's shape; it does not repeat the URL.
        form.error(format!(
            "is not valid ({e}) (options: {})",
            SessionKey::names_of(true).collect::<Vec<_>>().join(", ")
        ))
    })?;
    if !named {
        options = options.application_name("dlock");
    }
    Ok((options, session))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::super::PostgresBackend;

    #[test]
    fn urls() {
        crate::options::assert_keys::<
            crate::session::EngineKey<crate::sqlx_engine::DriverOption<super::super::Postgres>>,
            _,
        >(PostgresBackend::builder_from_url("postgres://h/db?bogus=1"));
        let b = PostgresBackend::builder_from_url("postgres://u:secret@127.0.0.1:5/db?fencing=true&keepalive=250ms&connections=2&wait_connections=0&sslmode=disable").unwrap();
        assert!(b.options.fencing);
        assert_eq!(b.options.keepalive, Duration::from_millis(250));
        assert_eq!((b.options.connections, b.options.wait_connections), (2, 0));
        assert_eq!(b.target.get_port(), 5);
        assert_eq!(b.target.get_application_name(), Some("dlock"));
        assert!(!format!("{b:?}").contains("secret"));
        for bad in [
            "postgres://h/db?fencing=maybe",
            "postgres://h/db?keepalive=soon",
            "postgres://h/db?connections=0",
            "postgres://h/db?connections=100",
            "postgres://h/db?keepalive=1ms",
            "postgres://h/db?fencng=true",
            "postgres://h:notaport/db",
            "postgres://h/db?statement_timeout=soon",
            "postgres://h/db?statement_timeout=5ms",
            "postgres://h/db?statement_timeout=10000000000000000s",
        ] {
            let err = PostgresBackend::builder_from_url(bad).unwrap_err();
            assert_eq!(err.code(), "DistributedLock.Configuration", "{bad}: {err}");
        }
    }

    #[test]
    fn statement_timeout_from_the_url_and_the_builder() {
        let b = PostgresBackend::builder_from_url("postgres://h/db").unwrap();
        assert_eq!(b.options.statement_timeout, Duration::from_secs(10));
        let b =
            PostgresBackend::builder_from_url("postgres://h/db?statement_timeout=1500ms").unwrap();
        assert_eq!(b.options.statement_timeout, Duration::from_millis(1500));
        // The driver never sees it (it would be taken for a server setting).
        assert!(!format!("{:?}", b.target).contains("1500"));
        let b = b.statement_timeout(Duration::from_secs(3));
        assert_eq!(b.options.statement_timeout, Duration::from_secs(3));
        let err = PostgresBackend::builder_from_url("postgres://h/db?statement_timeout=9ms")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("statement_timeout is 9ms, but it must be at least 10ms"),
            "{err}"
        );
    }
}
