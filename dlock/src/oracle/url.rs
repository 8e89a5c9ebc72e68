//! The `oracle://` URL.

use crate::LockError;
use crate::options::{UrlForm, url_keys};
use crate::session::{SessionOptions, read_engine_query};

use super::session::OracleTarget;

const DEFAULT_PORT: u16 = 1521;

const FORM: UrlForm = UrlForm {
    backend: "Oracle",
    schemes: &["oracle"],
    example: "oracle://user:password@host:1521/service_name",
};

url_keys! {
    /// Oracle's own URL options: none, beside the session options.
    pub(super) enum OracleOption for FORM {}
}

/// Reads an `oracle://` URL; its options are checked by the caller.
pub(super) fn parse_url(url: &str) -> Result<(OracleTarget, SessionOptions), LockError> {
    let server = FORM.server(url, "service name")?;
    if server.user.is_empty() {
        return Err(FORM.error("has no user name"));
    }
    let port = server.port.unwrap_or(DEFAULT_PORT);
    let connect_string = if server.name.is_empty() {
        format!("//{}:{port}", server.host)
    } else {
        format!("//{}:{port}/{}", server.host, server.name)
    };
    let options = read_engine_query::<OracleOption>(&server.query, |key, _| match key {})?;
    let target = OracleTarget {
        user: server.user,
        password: server.password,
        connect_string,
    };
    Ok((target, options))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use crate::oracle::OracleBackend;

    #[test]
    fn urls() {
        crate::options::assert_keys::<crate::session::EngineKey<super::OracleOption>, _>(
            OracleBackend::builder_from_url("oracle://u:p@h/svc?bogus=1"),
        );
        let b = OracleBackend::builder_from_url(
            "oracle://app%40x:p%40ss+w@db.internal:1522/FREEPDB1?keepalive=1s&connections=2\
             &wait_connections=0&connect_timeout=3s",
        )
        .unwrap();
        assert_eq!(b.target.user, "app@x");
        assert_eq!(b.target.password, "p@ss+w");
        assert_eq!(b.target.connect_string, "//db.internal:1522/FREEPDB1");
        assert_eq!(b.options.keepalive, Duration::from_secs(1));
        assert_eq!(b.options.connections, 2);
        assert_eq!(b.options.wait_connections, 0);
        assert_eq!(b.options.connect_timeout, Duration::from_secs(3));
        let b = OracleBackend::builder_from_url("oracle://u:p@[::1]/svc").unwrap();
        assert_eq!(b.target.connect_string, "//[::1]:1521/svc");
        assert_eq!(b.options.connections, 4);
        let b = OracleBackend::builder_from_url("oracle://u:p@h").unwrap();
        assert_eq!(b.target.connect_string, "//h:1521");
        assert!(!format!("{b:?}").contains("\"p\""));
    }

    #[test]
    fn session_options() {
        crate::session::check_session_url::<crate::oracle::Oracle>("oracle://app:hunter2@db/x");
        let b = OracleBackend::builder("u", "p", "//h/svc").fencing(true);
        assert!(b.options.fencing);
    }

    #[test]
    fn url_errors_never_show_the_password() {
        for case in [
            "oracle://app:hunter2@db/x?bogus=1",
            "oracle://:hunter2@db/x",
            "oracle://app:hunter2@/x",
            "oracle://app:hunter2@db/x/y",
            "oracle://app:hunter2%FF@db/x",
            "mssql://app:hunter2@db/x",
        ] {
            let err = OracleBackend::builder_from_url(case).unwrap_err();
            assert_eq!(err.code(), "DistributedLock.Configuration", "{case}");
            assert!(!err.to_string().contains("hunter2"), "{case}: {err}");
        }
    }
}
