//! TLS with verification on, against throwaway servers that present certificates of a
//! throwaway CA (`dlock_testkit::tls`): PostgreSQL (`ssl=on`), MariaDB and MySQL 9 (`ssl-cert` /
//! `ssl-key`) and Redis 7 and 8 (`tls-port`; the Valkey builds here have no TLS).
//!
//! Per engine, one server goes through these states, restarted in place between them:
//!
//! 1. **no TLS at all**: a client that asks for verification is refused, and never connects
//!    in clear;
//! 2. **TLS only, good certificate**: a verifying client (`sslmode=verify-full` + `sslrootcert`,
//!    `ssl-mode=VERIFY_IDENTITY` + `ssl-ca`, `rediss://` + `ca`) takes and releases locks; a
//!    client without TLS is refused; a client that trusts another CA is refused (unknown
//!    issuer), and so is one that reaches the server by a name the certificate does not carry
//!    (`localhost`, where the certificate is for `127.0.0.1`);
//! 3. **TLS only, expired certificate**: the verifying client is refused (expired).
//!
//! Each refusal must be a [`LockError::Config`] (certificate checks, TLS missing at the server)
//! or [`LockError::Unavailable`] (a handshake that cannot happen) whose message says which
//! check failed.
#![cfg(any(feature = "postgres", feature = "mysql", feature = "redis"))]

use std::time::Duration;

use dlock::{LockError, LockProvider};
use dlock_testkit::tls::{Pki, ServerCert};

/// Takes and releases a lock through `locks`, and checks that a second provider sees it held.
async fn lock_cycle(locks: &LockProvider, other: &LockProvider) {
    let key = dlock_testkit::unique_key("tls");
    let guard = locks
        .acquire(&key, Duration::from_secs(5))
        .await
        .expect("a lock over TLS");
    match other.try_acquire(&key).await {
        Err(LockError::AlreadyHeld { .. }) => {}
        other => panic!("a held lock was not held for another provider: {other:?}"),
    }
    guard.release().await.expect("release over TLS");
    other
        .try_acquire(&key)
        .await
        .expect("free after release")
        .release()
        .await
        .expect("release");
}

/// `outcome` is an error with `code` whose message contains every one of `words`; returns the
/// message.
fn refused<T: std::fmt::Debug>(
    outcome: Result<T, LockError>,
    code: &str,
    words: &[&str],
    what: &str,
) -> String {
    let err = match outcome {
        Ok(value) => panic!("{what}: connected ({value:?}) where it must be refused"),
        Err(err) => err,
    };
    let text = err.to_string();
    assert_eq!(err.code(), code, "{what}: {text}");
    for word in words {
        assert!(
            text.contains(word),
            "{what}: the message does not say `{word}`: {text}"
        );
    }
    eprintln!("{what}: {text}");
    text
}

const CONFIG: &str = "DistributedLock.Configuration";
const UNAVAILABLE: &str = "DistributedLock.Unavailable";

#[cfg(feature = "postgres")]
mod postgres {
    use super::*;
    use dlock_testkit::postgres::PgServer;
    use sqlx::{Connection, PgConnection};

    fn url(server: &PgServer, host: &str, options: &str) -> String {
        format!(
            "postgres://postgres@{host}:{}/postgres?{options}",
            server.port()
        )
    }

    fn verify_full(server: &PgServer, host: &str, ca: &std::path::Path) -> String {
        url(
            server,
            host,
            &format!(
                "sslmode=verify-full&sslrootcert={}&connect_timeout=5s",
                ca.display()
            ),
        )
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn verified_tls_and_every_refusal() {
        let pki = Pki::shared();
        let mut server = PgServer::start();

        // No TLS at the server: a verifying client is refused and sends nothing in clear.
        refused(
            LockProvider::connect(&verify_full(&server, "127.0.0.1", &pki.ca)).await,
            CONFIG,
            &["TLS", "does not offer TLS", "nothing was sent in clear"],
            "PostgreSQL without TLS, sslmode=verify-full",
        );

        // TLS only, with a good certificate.
        server.stop();
        server.set_tls(Some(&pki.server(ServerCert::Good)), true);
        server.resume();
        let good = verify_full(&server, "127.0.0.1", &pki.ca);
        let locks = LockProvider::connect(&good).await.expect("verify-full");
        let other = LockProvider::connect(&format!("{good}&fencing=true"))
            .await
            .expect("verify-full, with fencing");
        lock_cycle(&locks, &other).await;
        // Every session of the server runs over TLS (the admin one too).
        let mut admin = PgConnection::connect(&good).await.expect("admin over TLS");
        let (tls, clear): (i64, i64) = sqlx::query_as(
            "SELECT count(*) FILTER (WHERE s.ssl), count(*) FILTER (WHERE NOT s.ssl) \
             FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid) \
             WHERE a.backend_type = 'client backend'",
        )
        .fetch_one(&mut admin)
        .await
        .expect("pg_stat_ssl");
        assert!(tls >= 3, "{tls} sessions over TLS");
        assert_eq!(clear, 0, "sessions in clear");
        drop((locks, other));

        refused(
            LockProvider::connect(&url(&server, "127.0.0.1", "sslmode=disable")).await,
            CONFIG,
            &["only over TLS", "no encryption"],
            "PostgreSQL TLS-only, client sslmode=disable",
        );
        refused(
            LockProvider::connect(&verify_full(&server, "127.0.0.1", &pki.other_ca)).await,
            CONFIG,
            &[
                "TLS",
                "not signed by a CA this client trusts",
                "sslrootcert",
            ],
            "PostgreSQL, another CA",
        );
        refused(
            LockProvider::connect(&verify_full(&server, "localhost", &pki.ca)).await,
            CONFIG,
            &[
                "TLS",
                "not valid for the host name `localhost`",
                "127.0.0.1",
            ],
            "PostgreSQL, reached as localhost",
        );

        // An expired certificate.
        server.stop();
        server.set_tls(Some(&pki.server(ServerCert::Expired)), true);
        server.resume();
        refused(
            LockProvider::connect(&good).await,
            CONFIG,
            &["TLS", "expired", "2021-01-01"],
            "PostgreSQL, expired certificate",
        );
    }
}

#[cfg(feature = "mysql")]
mod mysql {
    use super::*;
    use dlock_testkit::mysql::{DbServer, Flavor, Tls};

    fn url(server: &DbServer, host: &str, options: &str) -> String {
        format!(
            "{}://root@{host}:{}/dlock_test?{options}",
            server.flavor.label(),
            server.port()
        )
    }

    fn verify_identity(server: &DbServer, host: &str, ca: &std::path::Path) -> String {
        url(
            server,
            host,
            &format!(
                "ssl-mode=VERIFY_IDENTITY&ssl-ca={}&connect_timeout=5s",
                ca.display()
            ),
        )
    }

    async fn verified_tls_and_every_refusal(flavor: Flavor) {
        let pki = Pki::shared();
        let Some(mut server) = DbServer::start(flavor) else {
            return;
        };
        let label = flavor.label();

        server.stop();
        server.set_tls(Tls::Off);
        server.resume();
        refused(
            LockProvider::connect(&verify_identity(&server, "127.0.0.1", &pki.ca)).await,
            CONFIG,
            &["TLS", "does not offer TLS", "nothing was sent in clear"],
            &format!("{label} without TLS, ssl-mode=VERIFY_IDENTITY"),
        );

        server.stop();
        server.set_tls(Tls::On {
            files: pki.server(ServerCert::Good),
            only: true,
        });
        server.resume();
        let good = verify_identity(&server, "127.0.0.1", &pki.ca);
        let locks = LockProvider::connect(&good).await.expect("VERIFY_IDENTITY");
        let other = LockProvider::connect(&format!("{good}&fencing=true"))
            .await
            .expect("VERIFY_IDENTITY, with fencing");
        lock_cycle(&locks, &other).await;
        drop((locks, other));

        // MySQL says why; MariaDB answers "access denied", and the message says that a
        // server requiring TLS answers so too.
        let why = match flavor {
            Flavor::MySql => "only over TLS",
            Flavor::MariaDb => "requires TLS refuses clients without it",
        };
        refused(
            LockProvider::connect(&url(&server, "127.0.0.1", "ssl-mode=DISABLED")).await,
            CONFIG,
            &[why],
            &format!("{label} TLS-only, client ssl-mode=DISABLED"),
        );
        refused(
            LockProvider::connect(&verify_identity(&server, "127.0.0.1", &pki.other_ca)).await,
            CONFIG,
            &["TLS", "not signed by a CA this client trusts", "ssl-ca"],
            &format!("{label}, another CA"),
        );
        refused(
            LockProvider::connect(&verify_identity(&server, "localhost", &pki.ca)).await,
            CONFIG,
            &[
                "TLS",
                "not valid for the host name `localhost`",
                "127.0.0.1",
            ],
            &format!("{label}, reached as localhost"),
        );

        server.stop();
        server.set_tls(Tls::On {
            files: pki.server(ServerCert::Expired),
            only: true,
        });
        server.resume();
        refused(
            LockProvider::connect(&good).await,
            CONFIG,
            &["TLS", "expired", "2021-01-01"],
            &format!("{label}, expired certificate"),
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn mariadb_verified_tls_and_every_refusal() {
        verified_tls_and_every_refusal(Flavor::MariaDb).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn mysql_verified_tls_and_every_refusal() {
        verified_tls_and_every_refusal(Flavor::MySql).await;
    }
}

#[cfg(feature = "redis")]
mod redis_tls {
    use super::*;
    use dlock::redis::RedisBackend;
    use dlock_testkit::redis::{Flavor, RedisServer};

    async fn verified_tls_and_every_refusal(flavor: Flavor) {
        let pki = Pki::shared();
        let Some(mut server) = RedisServer::start(flavor) else {
            return;
        };
        let ca = format!("ca={}", pki.ca.display());

        // A TLS client against the plain port: the server waits for the rest of what it takes
        // for a command, the client for the server's hello; nothing is sent in clear.
        let plain_port = server.port();
        let commands = server.command_calls().values().sum::<u64>();
        refused(
            LockProvider::connect(&format!("rediss://127.0.0.1:{plain_port}/?{ca}&timeout=2s"))
                .await,
            UNAVAILABLE,
            &["TLS", "no TLS handshake completed"],
            &format!("{flavor:?} without TLS, rediss://"),
        );
        // The server ran no command of the client (INFO itself is counted once more).
        assert_eq!(
            server.command_calls().values().sum::<u64>(),
            commands + 1,
            "commands ran on the server"
        );
        // A connection manager brings its own TLS settings: a CA for it is a mistake.
        let manager = redis::aio::ConnectionManager::new(server.client())
            .await
            .expect("a manager");
        let err = RedisBackend::builder_on_manager(manager)
            .ca_certificates(std::fs::read(&pki.ca).expect("read the CA"))
            .connect()
            .await
            .expect_err("a CA with an existing manager");
        assert_eq!(err.code(), CONFIG, "{err}");
        assert!(err.to_string().contains("ConnectionManager"), "{err}");

        server.set_tls(Some(&pki.server(ServerCert::Good)), true);
        server.restart();
        let good = server.tls_url(&ca);
        let locks = LockProvider::connect(&good)
            .await
            .expect("rediss:// with ca");
        // The builder takes the CA too.
        let client = redis::Client::open(server.tls_url("")).expect("a rediss:// client");
        let pem = std::fs::read(&pki.ca).expect("read the CA");
        let built = RedisBackend::builder(client)
            .ca_certificates(pem.clone())
            .connect()
            .await
            .expect("the builder with ca_certificates");
        lock_cycle(&locks, &LockProvider::from_backend(built)).await;

        refused(
            LockProvider::connect(&format!(
                "redis://127.0.0.1:{}/?timeout=2s",
                server.tls_port()
            ))
            .await,
            UNAVAILABLE,
            &[],
            &format!("{flavor:?} TLS-only, a redis:// client"),
        );
        refused(
            LockProvider::connect(&server.tls_url("timeout=2s")).await,
            CONFIG,
            &["TLS", "not signed by a CA this client trusts", "`ca`"],
            &format!("{flavor:?}, system roots only"),
        );
        refused(
            LockProvider::connect(
                &server.tls_url(&format!("ca={}&timeout=2s", pki.other_ca.display())),
            )
            .await,
            CONFIG,
            &["TLS", "not signed by a CA this client trusts"],
            &format!("{flavor:?}, another CA"),
        );
        let client = redis::Client::open(server.tls_url_by("localhost", "")).expect("client");
        refused(
            RedisBackend::builder(client)
                .ca_certificates(pem)
                .timeout(Duration::from_secs(2))
                .connect()
                .await,
            CONFIG,
            &[
                "TLS",
                "not valid for the host name `localhost`",
                "127.0.0.1",
            ],
            &format!("{flavor:?}, reached as localhost"),
        );

        server.set_tls(Some(&pki.server(ServerCert::Expired)), true);
        server.restart();
        refused(
            LockProvider::connect(&good).await,
            CONFIG,
            &["TLS", "expired", "2021-01-01"],
            &format!("{flavor:?}, expired certificate"),
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redis7_verified_tls_and_every_refusal() {
        verified_tls_and_every_refusal(Flavor::Redis7).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redis8_verified_tls_and_every_refusal() {
        verified_tls_and_every_refusal(Flavor::Redis8).await;
    }

    /// The CA option's mistakes are configuration errors, before anything is sent.
    #[tokio::test]
    async fn ca_mistakes_are_config_errors() {
        let pki = Pki::shared();
        let ca = pki.ca.display();
        for (url, words) in [
            (format!("redis://127.0.0.1:1/?ca={ca}"), "rediss://"),
            (
                "rediss://127.0.0.1:1/?ca=/nonexistent/ca.pem".to_owned(),
                "cannot be read",
            ),
        ] {
            let err = RedisBackend::builder_from_url(&url).unwrap_err();
            assert_eq!(err.code(), CONFIG, "{url}: {err}");
            assert!(err.to_string().contains(words), "{url}: {err}");
        }
        let client = redis::Client::open("rediss://127.0.0.1:1/").unwrap();
        let err = RedisBackend::builder(client)
            .ca_certificates(b"not a certificate".to_vec())
            .connect()
            .await
            .unwrap_err();
        assert_eq!(err.code(), CONFIG, "{err}");
        assert!(err.to_string().contains("no certificate"), "{err}");
        let client = redis::Client::open("redis://127.0.0.1:1/").unwrap();
        let pem = std::fs::read(&pki.ca).unwrap();
        let err = RedisBackend::builder(client)
            .ca_certificates(pem)
            .connect()
            .await
            .unwrap_err();
        assert_eq!(err.code(), CONFIG, "{err}");
        assert!(err.to_string().contains("rediss://"), "{err}");
    }
}
