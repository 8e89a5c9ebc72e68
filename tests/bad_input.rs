//! Bad input that is not a key: mangled connection URLs for every backend, and servers of the
//! wrong kind (or none that answers) behind a URL. Each gets a typed error within its bound:
//! no panic, no hang, no password in a message. (Awkward keys are a conformance case that every
//! backend runs; bad keys over HTTP are in dlock-axum's tests.)

use std::time::{Duration, Instant};

use dlock::mssql::MssqlBackend;
use dlock::mysql::MySqlBackend;
use dlock::postgres::PostgresBackend;
use dlock::redis::RedisBackend;
use dlock::sqlite::SqliteBackend;
use dlock::{LockError, LockProvider};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The password in every seed URL; no error message may repeat it.
const SECRET: &str = "pa55-SECRET-word";

/// Valid URLs to start mutating from, one or more per backend.
fn seeds() -> Vec<String> {
    vec![
        format!(
            "postgres://app:{SECRET}@db.internal:5432/app?keepalive=5s&fencing=true&connect_timeout=2s&connections=4&wait_connections=4"
        ),
        format!(
            "mysql://app:{SECRET}@db.internal:3306/app?keepalive=5s&fencing=true&connect_timeout=2s"
        ),
        format!(
            "redis://:{SECRET}@cache.internal:6379/0?lease=30s&prefix=locks:&timeout=1s&fencing=false"
        ),
        format!("rediss://user:{SECRET}@cache.internal/?lease=2s"),
        "sqlite:///var/lib/app/locks.db?lease=30s&busy_timeout=250ms".to_owned(),
        format!("mssql://app:{SECRET}@sql.internal:1433/app?keepalive=5s&connect_timeout=2s"),
        format!(
            "mssql://app:{SECRET}@sql.internal:1433/app?fencing=true&statement_timeout=3s&encrypt=true"
        ),
        format!("mariadb://app:{SECRET}@db.internal/app?statement_timeout=250ms&fencing=true"),
    ]
}

/// Every parser, on the same text.
fn parse_everywhere(url: &str) -> Vec<(&'static str, Result<(), LockError>)> {
    vec![
        ("postgres", PostgresBackend::builder_from_url(url).map(drop)),
        ("mysql", MySqlBackend::builder_from_url(url).map(drop)),
        ("redis", RedisBackend::builder_from_url(url).map(drop)),
        ("sqlite", SqliteBackend::builder_from_url(url).map(drop)),
        ("mssql", MssqlBackend::builder_from_url(url).map(drop)),
    ]
}

/// Pieces that tend to break URL and option parsers.
const PIECES: &[&str] = &[
    "%",
    "%zz",
    "%00",
    "%FF",
    "?",
    "&",
    "=",
    "&&",
    "==",
    ":",
    "//",
    "@",
    "@@",
    "[",
    "]",
    "[::1]",
    "#",
    " ",
    "\0",
    "\r\n",
    "ü",
    "鍵",
    "\u{202e}",
    "-1",
    "0",
    "0s",
    "1e9",
    "18446744073709551616",
    "99999999999999999999999s",
    "1ns",
    "5m",
    "NaN",
    "true",
    "maybe",
    "lease=",
    "keepalive=0ms",
    "connections=0",
    "connections=65",
    "prefix={",
    "port=",
    ":65536",
    ":0",
    "fencing=",
    "statement_timeout=",
    "statement_timeout=1ms",
];

/// 4,000 mutated URLs through all five parsers (20,000 parses): each answers a builder or a Configuration
/// error with a message, and no message shows the password.
#[test]
fn mangled_urls_get_typed_errors() {
    let seed = fastrand::u64(..);
    let mut rng = fastrand::Rng::with_seed(seed);
    let seeds = seeds();
    let (mut parsed, mut refused) = (0usize, 0usize);
    for _ in 0..4_000 {
        let mut url = seeds[rng.usize(..seeds.len())].clone();
        for _ in 0..rng.usize(1..4) {
            // Cut at a char boundary, then insert, replace or delete around it.
            let mut at = rng.usize(..=url.len());
            while !url.is_char_boundary(at) {
                at -= 1;
            }
            let piece = PIECES[rng.usize(..PIECES.len())];
            match rng.u8(0..3) {
                0 => url.insert_str(at, piece),
                1 => {
                    let end = url[at..]
                        .char_indices()
                        .nth(piece.chars().count())
                        .map_or(url.len(), |(i, _)| at + i);
                    url.replace_range(at..end, piece);
                }
                _ => {
                    let end = url[at..]
                        .char_indices()
                        .nth(1)
                        .map_or(url.len(), |(i, _)| at + i);
                    url.replace_range(at..end, "");
                }
            }
        }
        for (backend, outcome) in parse_everywhere(&url) {
            match outcome {
                Ok(()) => parsed += 1,
                Err(err) => {
                    refused += 1;
                    assert_eq!(
                        err.code(),
                        "DistributedLock.Configuration",
                        "{backend} on {url:?} (seed {seed}): {err}"
                    );
                    let message = err.to_string();
                    assert!(!message.is_empty());
                    assert!(
                        !message.contains(SECRET),
                        "{backend} showed the password for {url:?} (seed {seed}): {message}"
                    );
                }
            }
        }
    }
    eprintln!("{parsed} parsed, {refused} refused (seed {seed})");
    assert!(
        parsed > 0 && refused > 0,
        "the mutations reach both outcomes"
    );
}

/// What listens on a port that is not the server the URL names.
#[derive(Clone, Copy, Debug)]
enum Impostor {
    /// Accepts and closes at once.
    Closes,
    /// Accepts and answers like a web server, whatever is sent.
    SpeaksHttp,
    /// Accepts and never says anything.
    Silent,
}

/// A listener that plays `impostor` for every connection; returns its port.
async fn impostor(kind: Impostor) -> u16 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        loop {
            let Ok((mut socket, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                match kind {
                    Impostor::Closes => drop(socket),
                    Impostor::SpeaksHttp => {
                        let mut buf = [0u8; 1024];
                        let _ =
                            tokio::time::timeout(Duration::from_millis(200), socket.read(&mut buf))
                                .await;
                        let _ = socket
                            .write_all(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")
                            .await;
                        let _ = socket.shutdown().await;
                    }
                    Impostor::Silent => {
                        let mut buf = [0u8; 1024];
                        while let Ok(n) = socket.read(&mut buf).await {
                            if n == 0 {
                                break;
                            }
                        }
                    }
                }
            });
        }
    });
    port
}

/// Each network backend pointed at a port that closes, speaks HTTP, or stays silent: a
/// typed error (never a lock) within the connect timeout and a margin, without the password.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_servers_are_clear_errors_within_the_timeout() {
    const CONNECT: Duration = Duration::from_secs(1);
    let mut tasks = Vec::new();
    for kind in [Impostor::Closes, Impostor::SpeaksHttp, Impostor::Silent] {
        let port = impostor(kind).await;
        for url in [
            format!("postgres://app:{SECRET}@127.0.0.1:{port}/app?connect_timeout=1s"),
            format!("mysql://app:{SECRET}@127.0.0.1:{port}/app?connect_timeout=1s"),
            format!("redis://:{SECRET}@127.0.0.1:{port}/?timeout=1s"),
            format!("mssql://app:{SECRET}@127.0.0.1:{port}/app?connect_timeout=1s"),
        ] {
            tasks.push(tokio::spawn(async move {
                let started = Instant::now();
                let outcome = match LockProvider::connect(&url).await {
                    // A backend may connect lazily: then the first acquisition must fail.
                    Ok(locks) => locks.try_acquire("k").await.map(drop),
                    Err(err) => Err(err),
                };
                (kind, url, outcome, started.elapsed())
            }));
        }
    }
    for task in tasks {
        let (kind, url, outcome, took) = task.await.unwrap();
        let err = outcome.expect_err(&format!("{url} behind {kind:?} gave a lock"));
        assert!(
            matches!(
                err.code(),
                "DistributedLock.Unavailable"
                    | "DistributedLock.Backend"
                    | "DistributedLock.Configuration"
            ),
            "{url} behind {kind:?}: {err}"
        );
        assert!(!err.to_string().contains(SECRET), "{url}: {err}");
        assert!(
            took < CONNECT + Duration::from_secs(3),
            "{url} behind {kind:?} took {took:?}: {err}"
        );
        eprintln!(
            "{kind:?} {}: {took:?}: {err}",
            url.split(':').next().unwrap_or("")
        );
    }
}

/// Durations near `Duration::MAX` from a URL or a builder are refused when the provider is
/// made, with a configuration error that names the option and its bound; before, a keepalive
/// like this panicked the task that planned the next liveness check. (Lease stores check
/// their leases and timeouts in their own tests.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_store_durations_beyond_their_bound_are_refused() {
    // Nothing listens on port 1: a refusal must come before any connection.
    let huge = "10000000000000000s";
    let urls = [
        format!("postgres://app:{SECRET}@127.0.0.1:1/app?keepalive={huge}"),
        format!("postgres://app:{SECRET}@127.0.0.1:1/app?connect_timeout={huge}"),
        format!("mysql://app:{SECRET}@127.0.0.1:1/app?keepalive={huge}"),
        format!("mariadb://app:{SECRET}@127.0.0.1:1/app?connect_timeout={huge}"),
        format!("mssql://app:{SECRET}@127.0.0.1:1/app?keepalive={huge}"),
        format!("mssql://app:{SECRET}@127.0.0.1:1/app?connect_timeout={huge}"),
        format!("postgres://app:{SECRET}@127.0.0.1:1/app?statement_timeout={huge}"),
        format!("mysql://app:{SECRET}@127.0.0.1:1/app?statement_timeout={huge}"),
        format!("mssql://app:{SECRET}@127.0.0.1:1/app?statement_timeout={huge}"),
    ];
    for url in &urls {
        let err = LockProvider::connect(url).await.expect_err(url);
        let text = err.to_string();
        assert_eq!(err.code(), "DistributedLock.Configuration", "{url}: {text}");
        assert!(text.contains("at most 365 days"), "{url}: {text}");
        assert!(!text.contains(SECRET), "{text}");
    }
    let base = format!("postgres://app:{SECRET}@127.0.0.1:1/app");
    let refused = [
        PostgresBackend::builder_from_url(&base)
            .unwrap()
            .keepalive(Duration::MAX)
            .open()
            .await
            .map(drop),
        PostgresBackend::builder_from_url(&base)
            .unwrap()
            .connect_timeout(Duration::MAX)
            .open()
            .await
            .map(drop),
        MySqlBackend::builder_from_url(&base.replace("postgres", "mysql"))
            .unwrap()
            .keepalive(Duration::MAX)
            .open()
            .await
            .map(drop),
        MssqlBackend::builder_from_url(&base.replace("postgres", "mssql"))
            .unwrap()
            .keepalive(Duration::MAX)
            .open()
            .await
            .map(drop),
        MssqlBackend::builder_from_url(&base.replace("postgres", "mssql"))
            .unwrap()
            .connect_timeout(Duration::MAX)
            .open()
            .await
            .map(drop),
        PostgresBackend::builder_from_url(&base)
            .unwrap()
            .statement_timeout(Duration::MAX)
            .open()
            .await
            .map(drop),
        MySqlBackend::builder_from_url(&base.replace("postgres", "mysql"))
            .unwrap()
            .statement_timeout(Duration::MAX)
            .open()
            .await
            .map(drop),
        MssqlBackend::builder_from_url(&base.replace("postgres", "mssql"))
            .unwrap()
            .statement_timeout(Duration::MAX)
            .open()
            .await
            .map(drop),
    ];
    for (n, outcome) in refused.into_iter().enumerate() {
        let err = outcome.expect_err("refused");
        assert_eq!(
            err.code(),
            "DistributedLock.Configuration",
            "builder {n}: {err}"
        );
        assert!(
            err.to_string().contains("at most 365 days"),
            "builder {n}: {err}"
        );
    }
    // The longest accepted setting is accepted (the connection then fails: nothing listens).
    let err = LockProvider::connect(&format!(
        "postgres://app:{SECRET}@127.0.0.1:1/app?keepalive=8760h&connect_timeout=1s"
    ))
    .await
    .expect_err("nothing listens");
    assert_eq!(err.code(), "DistributedLock.Unavailable", "{err}");
    // A backoff's intervals have the same bound.
    let err = dlock::Backoff::new(Duration::from_millis(1), Duration::MAX, 0.5).unwrap_err();
    assert!(err.to_string().contains("at most 365 days"), "{err}");
}

/// A `statement_timeout` too short to tell a slow answer from a dead connection (below 10 ms),
/// or not a duration, is refused on every session engine, from the URL and from the builder,
/// before any connection, with a configuration error that names the option and its bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn statement_timeouts_out_of_bounds_are_refused() {
    // Nothing listens on port 1: a refusal must come before any connection.
    for scheme in ["postgres", "mysql", "mariadb", "mssql"] {
        for (value, words) in [
            (
                "9ms",
                "statement_timeout is 9ms, but it must be at least 10ms",
            ),
            (
                "0",
                "statement_timeout is 0ns, but it must be at least 10ms",
            ),
            ("soon", "option `statement_timeout` has the value `soon`"),
            ("-1s", "option `statement_timeout`"),
        ] {
            let url = format!("{scheme}://app:{SECRET}@127.0.0.1:1/app?statement_timeout={value}");
            let err = LockProvider::connect(&url).await.expect_err(&url);
            let text = err.to_string();
            assert_eq!(err.code(), "DistributedLock.Configuration", "{url}: {text}");
            assert!(text.contains(words), "{url}: {text}");
            assert!(!text.contains(SECRET), "{text}");
        }
    }
    let base = format!("postgres://app:{SECRET}@127.0.0.1:1/app");
    let short = Duration::from_millis(9);
    let refused = [
        PostgresBackend::builder_from_url(&base)
            .unwrap()
            .statement_timeout(short)
            .open()
            .await
            .map(drop),
        MySqlBackend::builder_from_url(&base.replace("postgres", "mysql"))
            .unwrap()
            .statement_timeout(Duration::ZERO)
            .open()
            .await
            .map(drop),
        MssqlBackend::builder_from_url(&base.replace("postgres", "mssql"))
            .unwrap()
            .statement_timeout(short)
            .open()
            .await
            .map(drop),
    ];
    for (n, outcome) in refused.into_iter().enumerate() {
        let err = outcome.expect_err("refused");
        assert_eq!(
            err.code(),
            "DistributedLock.Configuration",
            "builder {n}: {err}"
        );
        assert!(
            err.to_string().contains("statement_timeout")
                && err.to_string().contains("at least 10ms"),
            "builder {n}: {err}"
        );
    }
    // The bound itself is accepted (the connection then fails: nothing listens).
    let err = LockProvider::connect(&format!(
        "postgres://app:{SECRET}@127.0.0.1:1/app?statement_timeout=10ms&connect_timeout=1s"
    ))
    .await
    .expect_err("nothing listens");
    assert_eq!(err.code(), "DistributedLock.Unavailable", "{err}");
}

/// A lease store's renewal cadence (`renew_every`) out of its bounds is refused before
/// anything is opened, from URLs and builders, and the bound itself is accepted.
#[tokio::test]
async fn renewal_cadences_out_of_bounds_are_refused() {
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("locks.db");
    for base in [
        format!("sqlite://{}?", file.display()),
        format!("redis://:{SECRET}@127.0.0.1:1/0?"),
    ] {
        for (value, words) in [
            ("9ms", "is 9ms, but it must be at least 10ms"),
            ("0", "is 0ns, but it must be at least 10ms"),
            ("366d", "option `renew_every`"),
            ("400 days", "option `renew_every`"),
            ("8761h", "at most"),
            ("soon", "option `renew_every` has the value `soon`"),
        ] {
            let url = format!("{base}renew_every={value}");
            let err = LockProvider::connect(&url).await.expect_err(&url);
            let text = err.to_string();
            assert_eq!(err.code(), "DistributedLock.Configuration", "{url}: {text}");
            assert!(
                text.contains(words) && text.contains("renew_every"),
                "{url}: {text}"
            );
            assert!(!text.contains(SECRET), "{text}");
        }
    }
    assert!(!file.exists(), "nothing was opened");
    let short = Duration::from_millis(9);
    let sqlite = dlock::sqlite::SqliteBackend::builder(&file)
        .renew_every(short)
        .open()
        .await
        .map(drop)
        .expect_err("refused");
    let redis = dlock::redis::RedisBackend::builder_from_url("redis://127.0.0.1:1/0")
        .unwrap()
        .renew_every(short)
        .connect()
        .await
        .map(drop)
        .expect_err("refused");
    for err in [sqlite, redis] {
        assert_eq!(err.code(), "DistributedLock.Configuration", "{err}");
        assert!(err.to_string().contains("at least 10ms"), "{err}");
    }
    let locks = LockProvider::connect(&format!("sqlite://{}?renew_every=10ms", file.display()))
        .await
        .expect("the bound itself is accepted");
    locks
        .try_acquire("k")
        .await
        .expect("free")
        .release()
        .await
        .expect("release");
}
