//! The `mysql://` and `mariadb://` URL.

use sqlx::mysql::MySqlConnectOptions;

use crate::LockError;
use crate::options::UrlForm;
use crate::session::SessionOptions;
use crate::sqlx_engine::{self, SqlxUrl};

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

/// Reads a `mysql://` or `mariadb://` URL (the same protocol to the driver); its options are
/// checked by the caller.
pub(super) fn parse_url(url: &str) -> Result<(MySqlConnectOptions, SessionOptions), LockError> {
    let (options, _, session) = sqlx_engine::parse_url::<MySql>(url)?;
    Ok((options, session))
}

#[cfg(test)]
mod tests {
    use crate::mysql::{MySql, MySqlBackend};

    #[test]
    fn urls() {
        crate::session::check_session_url::<MySql>("mariadb://u:hunter2@127.0.0.1:5/db");
        crate::options::assert_keys::<
            crate::session::EngineKey<crate::sqlx_engine::DriverOption<MySql>>,
            _,
        >(MySqlBackend::builder_from_url("mysql://h/db?bogus=1"));
        let b =
            MySqlBackend::builder_from_url("mariadb://u:secret@127.0.0.1:5/db?ssl-mode=disabled")
                .unwrap();
        assert_eq!(b.target.get_port(), 5);
        assert_eq!(b.target.get_database(), Some("db"));
        for bad in [
            "mysql://u:secret@h:notaport/db",
            "mysql:h/db",
            "postgres://h/db",
        ] {
            let err = MySqlBackend::builder_from_url(bad).unwrap_err();
            assert_eq!(err.code(), "DistributedLock.Configuration", "{bad}: {err}");
            assert!(!err.to_string().contains("secret"));
        }
    }
}
