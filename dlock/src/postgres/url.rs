//! The `postgres://` URL.

use sqlx::postgres::PgConnectOptions;

use crate::LockError;
use crate::options::UrlForm;
use crate::session::SessionOptions;
use crate::sqlx_engine::{self, SqlxUrl};

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

/// Reads a `postgres://` or `postgresql://` URL (the same to the driver); its options are
/// checked by the caller. Connections are named `dlock` unless the URL names them.
pub(super) fn parse_url(url: &str) -> Result<(PgConnectOptions, SessionOptions), LockError> {
    let (options, passthrough, session) = sqlx_engine::parse_url::<Postgres>(url)?;
    if passthrough
        .iter()
        .any(|(name, _)| name == "application_name")
    {
        return Ok((options, session));
    }
    Ok((options.application_name("dlock"), session))
}

#[cfg(test)]
mod tests {
    use super::super::{Postgres, PostgresBackend};

    #[test]
    fn urls() {
        crate::session::check_session_url::<Postgres>("postgres://u:hunter2@127.0.0.1:5/db");
        crate::options::assert_keys::<
            crate::session::EngineKey<crate::sqlx_engine::DriverOption<Postgres>>,
            _,
        >(PostgresBackend::builder_from_url("postgres://h/db?bogus=1"));
        let b = PostgresBackend::builder_from_url(
            "postgresql://u:secret@127.0.0.1:5/db?sslmode=disable&statement_timeout=1500ms",
        )
        .unwrap();
        assert_eq!(b.target.get_port(), 5);
        assert_eq!(b.target.get_application_name(), Some("dlock"));
        // The driver never sees the session options (it would take them for server settings).
        assert!(!format!("{:?}", b.target).contains("1500"));
        let b = PostgresBackend::builder_from_url("postgres://h/db?application_name=billing");
        assert_eq!(b.unwrap().target.get_application_name(), Some("billing"));
        for bad in ["postgres://h:notaport/db", "postgres:h/db", "mysql://h/db"] {
            let err = PostgresBackend::builder_from_url(bad).unwrap_err();
            assert_eq!(err.code(), "DistributedLock.Configuration", "{bad}: {err}");
        }
    }
}
