//! A store that refuses the connection: every network backend's `connect` answers with an error
//! that names the address it tried and says that the connection was refused, and nothing
//! unrelated to that cause. The port is a loopback port that was just free (a listener bound
//! and closed), so the kernel answers each connection attempt with a reset at once.
//!
//! Oracle is not here: its driver loads the Oracle client library before it connects, and the
//! machines the suite runs on have none (`tests/oracle.rs` checks that message instead).
#![cfg(any(
    feature = "postgres",
    feature = "mysql",
    feature = "redis",
    feature = "etcd",
    feature = "mssql"
))]

use std::time::{Duration, Instant};

use dlock::{LockError, LockProvider};

/// A loopback port nothing listens on: bound, then closed. (Another process could take it in
/// between; the assertions would then fail loudly, not pass wrongly.)
fn closed_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a loopback port");
    listener.local_addr().expect("its address").port()
}

/// Connects to `url` and returns the error, within a bound: a refused connection is answered
/// at once, not after a timeout.
async fn refused(url: &str) -> LockError {
    let started = Instant::now();
    let outcome = tokio::time::timeout(Duration::from_secs(30), LockProvider::connect(url))
        .await
        .unwrap_or_else(|_| panic!("{url}: no answer within 30 s"));
    let err = match outcome {
        Ok(_) => panic!("{url}: connected to a closed port"),
        Err(err) => err,
    };
    eprintln!("{url} ({:?}): {err}", started.elapsed());
    err
}

/// The message of `err` names every one of `addresses` and says "refused", and carries neither
/// the URL's password nor a remark about another cause.
fn assert_says_refused(url: &str, err: &LockError, addresses: &[String]) {
    let message = err.to_string();
    assert!(
        matches!(err, LockError::Unavailable { .. }),
        "{url}: not Unavailable: {err:?}"
    );
    assert!(
        message.contains("refused"),
        "{url}: the message does not say the connection was refused: {message}"
    );
    for address in addresses {
        assert!(
            message.contains(address.as_str()),
            "{url}: the message does not name {address}: {message}"
        );
    }
    assert!(
        !message.contains("secret"),
        "{url}: the message repeats the password: {message}"
    );
    for unrelated in ["Tokio runtime", "runtime that ran it", "shuts down"] {
        assert!(
            !message.contains(unrelated),
            "{url}: the message mentions an unrelated cause ({unrelated:?}): {message}"
        );
    }
}

#[cfg(feature = "postgres")]
#[tokio::test]
async fn postgres_names_the_address_and_says_refused() {
    let port = closed_port();
    for url in [
        format!("postgres://app:secret@127.0.0.1:{port}/app"),
        format!("postgres://app:secret@127.0.0.1:{port}/app?connect_timeout=5s&sslmode=disable"),
    ] {
        let err = refused(&url).await;
        assert_says_refused(&url, &err, &[format!("127.0.0.1:{port}")]);
    }
}

#[cfg(feature = "mysql")]
#[tokio::test]
async fn mysql_and_mariadb_name_the_address_and_say_refused() {
    let port = closed_port();
    for url in [
        format!("mysql://app:secret@127.0.0.1:{port}/app"),
        format!("mariadb://app:secret@127.0.0.1:{port}"),
    ] {
        let err = refused(&url).await;
        assert_says_refused(&url, &err, &[format!("127.0.0.1:{port}")]);
    }
}

#[cfg(feature = "redis")]
#[tokio::test]
async fn redis_names_the_address_and_says_refused() {
    let port = closed_port();
    for url in [
        format!("redis://127.0.0.1:{port}"),
        format!("redis://:secret@127.0.0.1:{port}/0?timeout=2s"),
    ] {
        let err = refused(&url).await;
        assert_says_refused(&url, &err, &[format!("127.0.0.1:{port}")]);
    }
}

#[cfg(feature = "redis")]
#[tokio::test]
async fn redis_deployments_name_every_address_and_say_refused() {
    let (a, b, c) = (closed_port(), closed_port(), closed_port());
    let nodes =
        |ports: &[u16]| -> Vec<String> { ports.iter().map(|p| format!("127.0.0.1:{p}")).collect() };
    for (url, addresses) in [
        (
            format!("redis+sentinel://127.0.0.1:{a},127.0.0.1:{b}/mymaster"),
            nodes(&[a, b]),
        ),
        (
            format!("redis+cluster://127.0.0.1:{a},127.0.0.1:{b}?timeout=2s"),
            nodes(&[a, b]),
        ),
        (
            format!("redlock://127.0.0.1:{a},127.0.0.1:{b},127.0.0.1:{c}"),
            nodes(&[a, b, c]),
        ),
    ] {
        let err = refused(&url).await;
        assert_says_refused(&url, &err, &addresses);
    }
}

#[cfg(feature = "etcd")]
#[tokio::test]
async fn etcd_names_the_address_and_says_refused() {
    let (a, b) = (closed_port(), closed_port());
    for (url, addresses) in [
        (
            format!("etcd://127.0.0.1:{a}"),
            vec![format!("127.0.0.1:{a}")],
        ),
        (
            format!("etcd://127.0.0.1:{a},127.0.0.1:{b}"),
            vec![format!("127.0.0.1:{a}"), format!("127.0.0.1:{b}")],
        ),
    ] {
        let err = refused(&url).await;
        assert_says_refused(&url, &err, &addresses);
    }
}

#[cfg(feature = "mssql")]
#[tokio::test]
async fn mssql_names_the_address_and_says_refused() {
    let port = closed_port();
    for url in [
        format!("mssql://app:secret@127.0.0.1:{port}/app"),
        format!("sqlserver://app:secret@127.0.0.1:{port}/app?encrypt=false"),
    ] {
        let err = refused(&url).await;
        assert_says_refused(&url, &err, &[format!("127.0.0.1:{port}")]);
    }
}
