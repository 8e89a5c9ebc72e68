//! What a failed TLS connection says: which check of the server's certificate failed, or that
//! the server offers no TLS at all, in words that tell the operator what to fix.
//!
//! The drivers (sqlx for PostgreSQL and MySQL, redis-rs) all verify certificates with rustls,
//! and report a refused certificate as a `rustls::Error` somewhere in their error's chain,
//! usually inside an `std::io::Error` (whose `source` skips the error it wraps), and redis-rs
//! behind an `Arc<dyn Error>` (whose `source` does the same): the chain is walked by hand here.

use std::error::Error as StdError;
use std::sync::Arc;

use rustls::CertificateError;

/// The `rustls::Error` in `err`'s chain, if any.
fn find_rustls<'a>(err: &'a (dyn StdError + 'static)) -> Option<&'a rustls::Error> {
    let mut next = Some(err);
    while let Some(err) = next {
        if let Some(found) = err.downcast_ref::<rustls::Error>() {
            return Some(found);
        }
        if let Some(io) = err.downcast_ref::<std::io::Error>()
            && let Some(inner) = io.get_ref()
            && let Some(found) = find_rustls(inner)
        {
            return Some(found);
        }
        if let Some(shared) = err.downcast_ref::<Arc<dyn StdError + Send + Sync>>()
            && let Some(found) = find_rustls(&**shared)
        {
            return Some(found);
        }
        next = err.source();
    }
    None
}

/// A TLS failure found in a driver's error.
#[derive(Debug)]
pub(crate) struct Failure {
    /// What failed and what to do, starting with `TLS: `.
    pub(crate) message: String,
    /// The server's certificate was refused: something to fix in the configuration (the CA,
    /// the host name, the certificate), not a passing fault.
    pub(crate) certificate: bool,
}

impl Failure {
    /// The [`LockError`](crate::LockError) for a failure while `what`: a refused certificate is
    /// a [`Config`](crate::LockError::Config) error, any other TLS failure leaves the store
    /// [`Unavailable`](crate::LockError::Unavailable).
    pub(crate) fn into_error(
        self,
        backend: &'static str,
        what: &str,
        source: crate::error::BoxError,
    ) -> crate::LockError {
        let message = format!("{what}: {}", self.message);
        if self.certificate {
            crate::LockError::config(message)
        } else {
            crate::LockError::unavailable(backend, message, Some(source))
        }
    }
}

/// If `err` is a TLS failure, a sentence that says which check failed and what to do about it.
/// `ca_option` names the option that sets the trusted CA (`sslrootcert`, `ssl-ca`, `ca`).
pub(crate) fn describe(err: &(dyn StdError + 'static), ca_option: &str) -> Option<Failure> {
    let tls = find_rustls(err)?;
    let certificate = matches!(tls, rustls::Error::InvalidCertificate(_));
    let what = match tls {
        rustls::Error::InvalidCertificate(cert) => match cert {
            CertificateError::UnknownIssuer => format!(
                "the server's certificate is not signed by a CA this client trusts (unknown \
                 issuer); give the CA that signed it with `{ca_option}`"
            ),
            CertificateError::NotValidForName => {
                "the server's certificate is not valid for the host name the URL names; \
                 connect by a name the certificate carries"
                    .to_owned()
            }
            CertificateError::NotValidForNameContext {
                expected,
                presented,
            } => format!(
                "the server's certificate is not valid for the host name `{}` the URL names \
                 (it is for {}); connect by a name the certificate carries",
                expected.to_str(),
                if presented.is_empty() {
                    "no name".to_owned()
                } else {
                    presented.join(", ")
                }
            ),
            CertificateError::Expired => "the server's certificate has expired".to_owned(),
            CertificateError::ExpiredContext { time, not_after } => format!(
                "the server's certificate has expired (valid until {}, now {})",
                utc(not_after.as_secs()),
                utc(time.as_secs())
            ),
            CertificateError::NotValidYet => "the server's certificate is not valid yet".to_owned(),
            CertificateError::NotValidYetContext { time, not_before } => format!(
                "the server's certificate is not valid yet (valid from {}, now {})",
                utc(not_before.as_secs()),
                utc(time.as_secs())
            ),
            CertificateError::Revoked => "the server's certificate has been revoked".to_owned(),
            CertificateError::InvalidPurpose | CertificateError::InvalidPurposeContext { .. } => {
                "the server's certificate is not for TLS servers (extended key usage)".to_owned()
            }
            other => format!("the server's certificate was refused ({other:?})"),
        },
        other => format!("the TLS handshake failed ({other})"),
    };
    Some(Failure {
        message: format!("TLS: {what}"),
        certificate,
    })
}

/// [`describe`] for a driver that passes on a TLS failure only as text, as the Redis cluster
/// client does ("... invalid peer certificate: UnknownIssuer"): the refused certificate of
/// rustls's message, if `text` carries one.
#[cfg(feature = "redis")]
pub(crate) fn describe_text(text: &str, ca_option: &str) -> Option<Failure> {
    const REFUSED: &str = "invalid peer certificate: ";
    let (_, rest) = text.split_once(REFUSED)?;
    let name: String = rest
        .chars()
        .take_while(char::is_ascii_alphanumeric)
        .collect();
    let error = match name.as_str() {
        "UnknownIssuer" => CertificateError::UnknownIssuer,
        "NotValidForName" | "NotValidForNameContext" => CertificateError::NotValidForName,
        "Expired" | "ExpiredContext" => CertificateError::Expired,
        "NotValidYet" | "NotValidYetContext" => CertificateError::NotValidYet,
        "Revoked" => CertificateError::Revoked,
        "InvalidPurpose" | "InvalidPurposeContext" => CertificateError::InvalidPurpose,
        _ => CertificateError::Other(rustls::OtherError(std::sync::Arc::new(
            std::io::Error::other(rest.trim_end_matches(')').to_owned()),
        ))),
    };
    describe(&rustls::Error::InvalidCertificate(error), ca_option)
}

/// The error sqlx gives when the URL requires TLS (`sslmode=require` and up, `ssl-mode=REQUIRED`
/// and up) and the server offers none: nothing was sent in clear.
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) fn is_tls_refused_by_server(err: &sqlx::Error) -> bool {
    matches!(err, sqlx::Error::Tls(inner) if inner.to_string() == "server does not support TLS")
}

/// `YYYY-MM-DD HH:MM:SS UTC` of a Unix time (seconds).
fn utc(secs: u64) -> String {
    let days = secs / 86_400;
    let rest = secs % 86_400;
    // Civil date from days since 1970-01-01 (H. Hinnant's algorithm), for any u64 input.
    let z = i128::from(days) + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i128::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02} UTC",
        rest / 3600,
        rest % 3600 / 60,
        rest % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(feature = "redis")]
    #[test]
    fn refusals_passed_on_as_text() {
        let text = "Failed to create initial connections - Io: invalid peer certificate: \
                    UnknownIssuer";
        let failure = describe_text(text, "ca").expect("a refused certificate");
        assert!(failure.certificate);
        assert!(
            failure.message.contains("unknown issuer"),
            "{}",
            failure.message
        );
        assert!(failure.message.contains("`ca`"), "{}", failure.message);
        let expired = describe_text(
            "Io: invalid peer certificate: ExpiredContext { time: 1, not_after: 0 }",
            "ca",
        )
        .expect("a refused certificate");
        assert!(expired.message.contains("expired"), "{}", expired.message);
        let other = describe_text("Io: invalid peer certificate: BadSignature)", "ca")
            .expect("a refused certificate");
        assert!(other.certificate);
        assert!(other.message.contains("BadSignature"), "{}", other.message);
        assert!(describe_text("Io: connection refused", "ca").is_none());
    }

    #[test]
    fn dates() {
        assert_eq!(utc(0), "1970-01-01 00:00:00 UTC");
        assert_eq!(utc(1_609_459_200), "2021-01-01 00:00:00 UTC");
        assert_eq!(utc(951_829_323), "2000-02-29 13:02:03 UTC");
        assert!(utc(u64::MAX).ends_with("UTC"));
    }

    #[test]
    fn found_inside_io_errors() {
        let tls = rustls::Error::InvalidCertificate(CertificateError::UnknownIssuer);
        let io = std::io::Error::new(std::io::ErrorKind::InvalidData, tls);
        let failure = describe(&io, "sslrootcert").expect("a TLS failure");
        let text = failure.message;
        assert!(failure.certificate);
        assert!(
            text.contains("unknown issuer") && text.contains("sslrootcert"),
            "{text}"
        );
        let alert = rustls::Error::AlertReceived(rustls::AlertDescription::HandshakeFailure);
        assert!(!describe(&alert, "ca").expect("a TLS failure").certificate);
        // As redis-rs keeps it: an I/O error behind an `Arc<dyn Error>`.
        let tls = rustls::Error::InvalidCertificate(CertificateError::Expired);
        let shared: Arc<dyn StdError + Send + Sync> = Arc::new(std::io::Error::other(tls));
        let failure = describe(&shared, "ca").expect("a TLS failure");
        assert!(failure.message.contains("expired"), "{}", failure.message);
        let plain = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        assert!(describe(&plain, "ca").is_none());
    }
}
