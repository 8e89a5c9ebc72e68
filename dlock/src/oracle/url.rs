//! The `oracle://` URL.

use crate::LockError;
use crate::options::{query_pairs, unknown_option};
use crate::session::SessionOptions;

use super::session::OracleTarget;

const DEFAULT_PORT: u16 = 1521;

/// Reads an `oracle://` URL; its options are checked by the caller.
pub(super) fn parse_url(url: &str) -> Result<(OracleTarget, SessionOptions), LockError> {
    let parsed = url::Url::parse(url).map_err(|err| {
        LockError::config(format!(
            "the Oracle URL is malformed ({err}); expected oracle://user:password@host:port/service_name"
        ))
    })?;
    if parsed.scheme() != "oracle" {
        return Err(LockError::config("an Oracle URL starts with oracle://"));
    }
    let host = match parsed.host_str() {
        Some(host) if !host.is_empty() => host.to_owned(),
        _ => {
            return Err(LockError::config(
                "the Oracle URL has no host; expected oracle://user:password@host:port/service_name",
            ));
        }
    };
    let bad = |what: &str| {
        LockError::config(format!(
            "the {what} in the Oracle URL is not valid percent-encoded UTF-8"
        ))
    };
    let user = crate::options::percent_decode(parsed.username()).ok_or_else(|| bad("user name"))?;
    let password = crate::options::percent_decode(parsed.password().unwrap_or(""))
        .ok_or_else(|| bad("password"))?;
    if user.is_empty() {
        return Err(LockError::config(
            "the Oracle URL has no user name; expected oracle://user:password@host:port/service_name",
        ));
    }
    let service = crate::options::percent_decode(parsed.path().trim_start_matches('/'))
        .ok_or_else(|| bad("service name"))?;
    if service.contains('/') {
        return Err(LockError::config(
            "the Oracle URL's path must be just the service name",
        ));
    }
    let port = parsed.port().unwrap_or(DEFAULT_PORT);
    let connect_string = if service.is_empty() {
        format!("//{host}:{port}")
    } else {
        format!("//{host}:{port}/{service}")
    };
    let mut options = SessionOptions::default();
    for (name, value) in query_pairs(parsed.query().unwrap_or("")) {
        if !options.parse(false, &name, &value)? {
            return Err(unknown_option(
                "Oracle",
                &name,
                SessionOptions::names(false),
            ));
        }
    }
    let target = OracleTarget {
        user,
        password,
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
    fn url_errors_never_show_the_password() {
        for case in [
            "oracle://app:hunter2@db/x?bogus=1",
            "oracle://app:hunter2@db/x?keepalive=soon",
            "oracle://app:hunter2@db/x?connections=0",
            "oracle://app:hunter2@db/x?wait_connections=99",
            "oracle://app:hunter2@db/x?connect_timeout=0",
            "oracle://app:hunter2@db/x?connect_timeout=10000000000000000s",
            "oracle://app:hunter2@db/x?keepalive=10000000000000000s",
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
