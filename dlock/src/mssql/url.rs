//! The `mssql://` URL and ADO.NET connection strings.

use tiberius::{AuthMethod, Config, EncryptionLevel};

use crate::LockError;
use crate::options::{UrlForm, bad_value, parse_bool, url_keys};
use crate::session::{SessionOptions, read_engine_query};

const DEFAULT_PORT: u16 = 1433;

const FORM: UrlForm = UrlForm {
    backend: "SQL Server",
    schemes: &["mssql", "sqlserver"],
    example: "mssql://user:password@host:1433/database",
};

url_keys! {
    /// SQL Server's own URL options, beside the session options.
    pub(super) enum MssqlOption for FORM {
        Encrypt = "encrypt",
        TrustServerCertificate = "trust_server_certificate",
        ApplicationName = "application_name",
    }
}

/// The `key=value` pairs of an ADO.NET connection string, keys trimmed and in lower case,
/// values unquoted (`'...'` or `"..."`, a doubled quote standing for one; `;` inside quotes
/// belongs to the value).
pub(super) fn ado_pairs(text: &str) -> Vec<(String, String)> {
    let mut pairs = Vec::new();
    let mut chars = text.chars().peekable();
    loop {
        let key: String = chars.by_ref().take_while(|c| *c != '=').collect();
        if key.trim().is_empty() && chars.peek().is_none() {
            return pairs;
        }
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        let mut value = String::new();
        match chars.peek().copied() {
            Some(quote @ ('\'' | '"')) => {
                chars.next();
                while let Some(c) = chars.next() {
                    if c == quote {
                        if chars.next_if_eq(&quote).is_some() {
                            value.push(quote);
                        } else {
                            break;
                        }
                    } else {
                        value.push(c);
                    }
                }
                // Up to the separator.
                for c in chars.by_ref() {
                    if c == ';' {
                        break;
                    }
                }
            }
            _ => {
                for c in chars.by_ref() {
                    if c == ';' {
                        break;
                    }
                    value.push(c);
                }
            }
        }
        // A part without `=` (a stray `;`) has eaten its way to the end; keep what was found.
        let key = key.trim().to_ascii_lowercase();
        if !key.is_empty() {
            pairs.push((
                key.rsplit(';').next().unwrap_or_default().trim().to_owned(),
                value,
            ));
        }
        if chars.peek().is_none() {
            return pairs;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// URL.

/// An `mssql://` URL taken apart (plain data, so tests can pin it).
#[derive(Clone, PartialEq, Eq)]
pub(super) struct ParsedUrl {
    host: String,
    port: u16,
    database: Option<String>,
    user: String,
    password: String,
    encryption: Encryption,
    trust_server_certificate: bool,
    application_name: Option<String>,
    options: SessionOptions,
}

impl std::fmt::Debug for ParsedUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ParsedUrl")
            .field("host", &self.host)
            .field("port", &self.port)
            .field("database", &self.database)
            .field("user", &self.user)
            .field("password", &"<redacted>")
            .field("encryption", &self.encryption)
            .finish_non_exhaustive()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Encryption {
    Required,
    LoginOnly,
    None,
}

pub(super) fn parse_url(url: &str) -> Result<ParsedUrl, LockError> {
    let server = FORM.server(url, "database name")?;
    if server.user.is_empty() {
        return Err(FORM.error(
            "has no user name (or use MssqlBackend::builder with a tiberius::Config for other \
             authentication)",
        ));
    }
    let mut encryption = Encryption::Required;
    let mut trust_server_certificate = false;
    let mut application_name = None;
    let options = read_engine_query(&server.query, |key, value| {
        match key {
            MssqlOption::Encrypt => encryption = parse_encryption(&value)?,
            MssqlOption::TrustServerCertificate => {
                trust_server_certificate = parse_bool(key.as_ref(), &value)?
            }
            MssqlOption::ApplicationName => application_name = Some(value),
        }
        Ok(())
    })?;
    Ok(ParsedUrl {
        host: server.host,
        port: server.port.unwrap_or(DEFAULT_PORT),
        database: (!server.name.is_empty()).then_some(server.name),
        user: server.user,
        password: server.password,
        encryption,
        trust_server_certificate,
        application_name,
        options,
    })
}

/// `encrypt`: a boolean, or one of the driver's levels by name.
fn parse_encryption(value: &str) -> Result<Encryption, LockError> {
    match value.trim().to_ascii_lowercase().as_str() {
        "required" | "mandatory" => Ok(Encryption::Required),
        "optional" => Ok(Encryption::LoginOnly),
        "not_supported" | "none" => Ok(Encryption::None),
        _ => match parse_bool("encrypt", value) {
            Ok(true) => Ok(Encryption::Required),
            Ok(false) => Ok(Encryption::LoginOnly),
            Err(_) => Err(bad_value("encrypt", value, "true, false or not_supported")),
        },
    }
}

impl ParsedUrl {
    /// The driver configuration and the session options the URL names.
    pub(super) fn into_parts(self) -> (Config, SessionOptions) {
        let mut config = Config::new();
        config.host(&self.host);
        config.port(self.port);
        if let Some(database) = &self.database {
            config.database(database);
        }
        config.authentication(AuthMethod::sql_server(&self.user, &self.password));
        config.encryption(match self.encryption {
            Encryption::Required => EncryptionLevel::Required,
            Encryption::LoginOnly => EncryptionLevel::Off,
            Encryption::None => EncryptionLevel::NotSupported,
        });
        if self.trust_server_certificate {
            config.trust_cert();
        }
        if let Some(name) = &self.application_name {
            config.application_name(name);
        }
        (config, self.options)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::mssql::MssqlBackend;

    #[test]
    fn url_defaults() {
        crate::options::assert_keys::<crate::session::EngineKey<MssqlOption>, _>(parse_url(
            "mssql://app:secret@db.internal/app?bogus=1",
        ));
        let url = parse_url("mssql://app:secret@db.internal/app").unwrap();
        assert_eq!(url.host, "db.internal");
        assert_eq!(url.port, 1433);
        assert_eq!(url.database.as_deref(), Some("app"));
        assert_eq!(url.user, "app");
        assert_eq!(url.password, "secret");
        assert_eq!(url.encryption, Encryption::Required);
        assert!(!url.trust_server_certificate);
        assert_eq!(url.options, crate::session::SessionOptions::default());
    }

    #[test]
    fn session_options() {
        crate::session::check_session_url::<crate::mssql::Mssql>("mssql://app:hunter2@db/app");
    }

    #[test]
    fn url_options_and_decoding() {
        let url = parse_url(
            "sqlserver://do%6D%5Cuser:p%40ss%3Aw%2Fo+rd@127.0.0.1:14330/my%20db?encrypt=false\
             &trust_server_certificate=true&application_name=billing&keepalive=250ms\
             &connections=2&wait_connections=0&connect_timeout=3s",
        )
        .unwrap();
        assert_eq!(url.user, "dom\\user");
        assert_eq!(url.password, "p@ss:w/o+rd");
        assert_eq!(url.host, "127.0.0.1");
        assert_eq!(url.port, 14330);
        assert_eq!(url.database.as_deref(), Some("my db"));
        assert_eq!(url.encryption, Encryption::LoginOnly);
        assert!(url.trust_server_certificate);
        assert_eq!(url.application_name.as_deref(), Some("billing"));
        assert_eq!(url.options.keepalive, Duration::from_millis(250));
        assert_eq!(url.options.connections, 2);
        assert_eq!(url.options.wait_connections, 0);
        assert_eq!(url.options.connect_timeout, Duration::from_secs(3));
        let (config, _) = url.into_parts();
        assert_eq!(config.get_addr(), "127.0.0.1:14330");
        assert_eq!(
            parse_url("mssql://a:b@h/?encrypt=not_supported")
                .unwrap()
                .encryption,
            Encryption::None
        );
        assert_eq!(parse_url("mssql://a:b@h").unwrap().database, None);
    }

    #[test]
    fn url_errors_never_show_the_password() {
        let cases = [
            "mssql://app:hunter2@db/app?bogus=1",
            "mssql://app:hunter2@db/app?encrypt=maybe",
            "mssql://app:hunter2@db:99999/app",
            "mssql://:hunter2@db/app",
            "mssql://app:hunter2@/app",
            "mssql://app:hunter2@db/a/b",
            "mssql://app:hunter2%FF@db/app",
            "postgres://app:hunter2@db/app",
        ];
        for case in cases {
            let err = MssqlBackend::builder_from_url(case).unwrap_err();
            assert_eq!(err.code(), "DistributedLock.Configuration", "{case}");
            let text = err.to_string();
            assert!(!text.contains("hunter2"), "{case}: {text}");
        }
        let err = MssqlBackend::builder_from_url("mssql://app:hunter2@db/app?bogus=1").unwrap_err();
        assert!(err.to_string().contains("connect_timeout"), "{err}");
    }

    #[test]
    fn ado_connection_strings() {
        let builder = MssqlBackend::builder_from_ado(
            "Server=tcp:db.internal,14331;Database=app;User Id=app;Password=hunter2;\
             TrustServerCertificate=true",
        )
        .unwrap();
        assert_eq!(builder.config().get_addr(), "db.internal:14331");
        let shown = format!("{builder:?}");
        assert!(!shown.contains("hunter2"), "{shown}");
        let err =
            MssqlBackend::builder_from_ado("Server=tcp:db,notaport;Password=hunter2").unwrap_err();
        assert_eq!(err.code(), "DistributedLock.Configuration");
        assert!(!err.to_string().contains("hunter2"));
    }

    /// Without `Encrypt`, an ADO.NET string encrypts the login only, as it always did here;
    /// `Encrypt` given is the driver's reading of it.
    #[test]
    fn ado_encryption_defaults_to_the_login_only() {
        for (ado, expected) in [
            ("Server=tcp:db,1433", "encryption: Off"),
            ("Server=tcp:db,1433;Encrypt=false", "encryption: Off"),
            ("Server=tcp:db,1433;ENCRYPT=true", "encryption: Required"),
            (
                "Server=tcp:db,1433;Encrypt=DANGER_PLAINTEXT",
                "encryption: NotSupported",
            ),
        ] {
            let builder = MssqlBackend::builder_from_ado(ado).unwrap();
            let shown = format!("{:?}", builder.config());
            assert!(shown.contains(expected), "{ado}: {shown}");
        }
    }
}
