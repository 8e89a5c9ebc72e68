//! The SQL Server backend.
//!
//! No SQL Server can run on the machines this suite is developed and checked on, so:
//! - the conformance suite and the transaction-bound tests run against the server named by
//!   `DLOCK_MSSQL_URL` (for example `mssql://sa:Secret-123@127.0.0.1:1433/master?trust_server_certificate=true`;
//!   the user needs `VIEW SERVER STATE` and `ALTER ANY CONNECTION` for the lost-lock case, which
//!   kills the holding session); built without the variable, they are compiled as ignored
//!   and `cargo test` lists them as `ignored, DLOCK_MSSQL_URL is not set ...` (see `build.rs`),
//!   never as passed;
//! - the client-side failures below (refused connection, a port that does not speak TDS, a
//!   broken TLS handshake, a silent server) run everywhere, against real sockets;
//! - the statements, parameters and return-code mapping are pinned by the unit tests of
//!   `dlock::mssql`.
#![cfg(feature = "mssql")]

mod support;

use std::time::Duration;

use dlock::mssql::tiberius::{Client, Config};
use dlock::mssql::{MssqlBackend, acquire_in_transaction, try_acquire_in_transaction};
use dlock::{LockError, LockGuard, LockProvider};
use dlock_testkit::unique_key;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::compat::{Compat, TokioAsyncWriteCompatExt};

const ENV: &str = "DLOCK_MSSQL_URL";
const KEEPALIVE: Duration = Duration::from_millis(250);

/// The server under test. The live tests are built as ignored unless `DLOCK_MSSQL_URL` was
/// set at build time (see `build.rs`), so this runs only when the variable was set then, or
/// when ignored tests are asked for (`--ignored`): then a missing variable fails the test.
fn live_url() -> String {
    match std::env::var(ENV) {
        Ok(url) if !url.is_empty() => url,
        _ => panic!(
            "{ENV} is not set: the live SQL Server tests need a server (they are ignored when \
             the tests are built without {ENV})"
        ),
    }
}

struct MssqlHarness {
    url: String,
    /// The program name of this harness's lock connections, so `break_lock` can find them.
    application: String,
    fencing: bool,
}

impl MssqlHarness {
    async fn from_env(fencing: bool) -> Self {
        MssqlHarness {
            url: live_url(),
            application: unique_key("dlock-conformance").replace(':', "-"),
            fencing,
        }
    }

    fn url(&self) -> String {
        let sep = if self.url.contains('?') { '&' } else { '?' };
        format!(
            "{}{sep}keepalive={}ms&application_name={}&fencing={}",
            self.url,
            KEEPALIVE.as_millis(),
            self.application,
            self.fencing
        )
    }

    async fn client(&self) -> Client<Compat<TcpStream>> {
        raw_client(&self.url).await
    }
}

async fn raw_client(url: &str) -> Client<Compat<TcpStream>> {
    let builder = MssqlBackend::builder_from_url(url).expect("DLOCK_MSSQL_URL is an mssql:// URL");
    let config: Config = builder.config().clone();
    let tcp = TcpStream::connect(config.get_addr())
        .await
        .expect("connect");
    Client::connect(config, tcp.compat_write())
        .await
        .expect("log in")
}

impl dlock_testkit::Harness for MssqlHarness {
    async fn provider(&self) -> LockProvider {
        LockProvider::connect(&self.url())
            .await
            .expect("connect to SQL Server")
    }

    async fn break_lock(&self, guard: &LockGuard) {
        // Kill the lock connections of this harness's providers (found by their program name),
        // after checking that one of them holds the guard's application lock.
        let mut client = self.client().await;
        let rows = client
            .query(
                "SELECT s.session_id, \
                 (SELECT COUNT(*) FROM sys.dm_tran_locks l \
                  WHERE l.request_session_id = s.session_id AND l.resource_type = 'APPLICATION') \
                 FROM sys.dm_exec_sessions s WHERE s.program_name = @P1",
                &[&self.application],
            )
            .await
            .expect("query sessions")
            .into_first_result()
            .await
            .expect("rows");
        let app_locks: i32 = rows
            .iter()
            .map(|row| row.get::<i32, _>(1).unwrap_or(0))
            .sum();
        assert!(
            app_locks > 0,
            "no connection of this harness holds an application lock"
        );
        let _ = guard;
        for row in rows {
            let session: i16 = row.get(0).expect("session id");
            // KILL takes no parameters; the id is an integer read from the server.
            client
                .simple_query(format!("KILL {session}"))
                .await
                .expect("kill")
                .into_results()
                .await
                .expect("kill done");
        }
    }

    fn lost_within(&self) -> Duration {
        KEEPALIVE + Duration::from_secs(3)
    }

    fn fencing(&self) -> bool {
        self.fencing
    }

    /// SQL Server has no store inspection in dlock.
    fn store_inspection(&self) -> dlock_testkit::StoreInspection {
        dlock_testkit::StoreInspection::Unsupported
    }

    /// Read locks in the engine's shared mode (sp_getapplock @LockMode = 'Shared').
    fn read_locks(&self) -> bool {
        true
    }

    async fn shared_providers(&self, count: usize) -> Vec<LockProvider> {
        let url = format!("{}&connections=1", self.url());
        let backend = dlock::mssql::MssqlBackend::connect(&url)
            .await
            .expect("connect to SQL Server");
        (0..count)
            .map(|_| LockProvider::from_backend(backend.clone()))
            .collect()
    }
}

mod live {
    use super::*;

    dlock_testkit::conformance_suite!(
        attributes [#[cfg_attr(
            not(dlock_mssql_live),
            ignore = "DLOCK_MSSQL_URL is not set: no SQL Server to test against"
        )]]
        MssqlHarness::from_env(false)
    );
}

/// The conformance suite with fencing on: every acquisition carries a token from the
/// `dlock_fencing` counter, taken in the batch of its `sp_getapplock`.
mod live_fenced {
    use super::*;

    dlock_testkit::conformance_suite!(
        attributes [#[cfg_attr(
            not(dlock_mssql_live),
            ignore = "DLOCK_MSSQL_URL is not set: no SQL Server to test against"
        )]]
        MssqlHarness::from_env(true)
    );
}

/// Fencing tokens strictly increase for one key across new providers (new sessions), tries
/// and native waits, and a wait's token is issued on the session it was granted to; the
/// builder's `fencing` and `statement_timeout` are taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(dlock_mssql_live),
    ignore = "DLOCK_MSSQL_URL is not set: no SQL Server to test against"
)]
async fn live_fencing_tokens_increase_across_providers_and_waits() {
    let url = live_url();
    let sep = if url.contains('?') { '&' } else { '?' };
    let key = unique_key("mssql-fence");
    let mut last = 0;
    for _ in 0..3 {
        let locks = LockProvider::connect(&format!("{url}{sep}fencing=true"))
            .await
            .expect("connect");
        let guard = locks.try_acquire(&key).await.expect("free");
        let token = guard.fencing_token().expect("a token");
        assert!(token > last, "token {token} after {last}");
        last = token;
        guard.release().await.expect("release");
    }
    let backend = MssqlBackend::builder_from_url(&url)
        .expect("url")
        .fencing(true)
        .statement_timeout(Duration::from_secs(3))
        .open()
        .await
        .expect("open");
    assert!(backend.fencing());
    assert_eq!(backend.statement_timeout(), Duration::from_secs(3));
    let locks = LockProvider::from_backend(backend);
    let holder = locks.try_acquire(&key).await.expect("free");
    let held = holder.fencing_token().expect("a token");
    assert!(held > last);
    let waiter = tokio::spawn({
        let locks = LockProvider::connect(&format!("{url}{sep}fencing=true"))
            .await
            .expect("connect");
        let key = key.clone();
        async move {
            let guard = locks.acquire(&key, Duration::from_secs(20)).await?;
            let token = guard.fencing_token();
            guard.release().await?;
            Ok::<_, LockError>(token)
        }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    holder.release().await.expect("release");
    let waited = waiter
        .await
        .expect("task")
        .expect("granted after the release");
    assert!(waited.expect("a token") > held);
}

#[tokio::test]
#[cfg_attr(
    not(dlock_mssql_live),
    ignore = "DLOCK_MSSQL_URL is not set: no SQL Server to test against"
)]
async fn live_transaction_bound_locks() {
    let url = live_url();
    let mut a = raw_client(&url).await;
    let mut b = raw_client(&url).await;
    let key = unique_key("mssql-tx");
    // Without a transaction the server refuses: return code -999, or an error token of its
    // own (depending on the version), either way a backend error.
    let err = try_acquire_in_transaction(&mut a, &key).await.unwrap_err();
    eprintln!("without a transaction: {err}");
    assert_eq!(err.code(), "DistributedLock.BackendError", "{err}");

    a.simple_query("BEGIN TRANSACTION")
        .await
        .unwrap()
        .into_results()
        .await
        .unwrap();
    try_acquire_in_transaction(&mut a, &key)
        .await
        .expect("free");
    b.simple_query("BEGIN TRANSACTION")
        .await
        .unwrap()
        .into_results()
        .await
        .unwrap();
    assert!(matches!(
        try_acquire_in_transaction(&mut b, &key).await,
        Err(LockError::AlreadyHeld { .. })
    ));
    assert!(matches!(
        acquire_in_transaction(&mut b, &key, Duration::from_millis(300)).await,
        Err(LockError::Timeout { .. })
    ));
    // A session lock through a provider contends with it too.
    let locks = LockProvider::connect(&url).await.expect("provider");
    assert!(matches!(
        locks.try_acquire(&key).await,
        Err(LockError::AlreadyHeld { .. })
    ));
    a.simple_query("COMMIT")
        .await
        .unwrap()
        .into_results()
        .await
        .unwrap();
    acquire_in_transaction(&mut b, &key, Duration::from_secs(10))
        .await
        .expect("free after commit");
    b.simple_query("ROLLBACK")
        .await
        .unwrap()
        .into_results()
        .await
        .unwrap();
    let guard = locks.try_acquire(&key).await.expect("free after rollback");
    guard.release().await.expect("release");
}

#[tokio::test]
#[cfg_attr(
    not(dlock_mssql_live),
    ignore = "DLOCK_MSSQL_URL is not set: no SQL Server to test against"
)]
async fn live_multi_process_exclusion() {
    let url = live_url();
    support::run_multi_process(&url, &unique_key("mssql-mp"), 3, 10, support::Fencing::None);
    let sep = if url.contains('?') { '&' } else { '?' };
    support::run_multi_process(
        &format!("{url}{sep}fencing=true"),
        &unique_key("mssql-mp-fenced"),
        3,
        10,
        support::Fencing::Every,
    );
}

/// Semaphores as the engine keeps them (its permit store, asked directly): one batch per try
/// over the slot locks, the count record held bit by bit, the queue lock as the waiting mark.
mod live_permits {
    use std::time::Duration;

    use dlock::mssql::MssqlBackend;

    use super::live_url;
    use crate::support::permits::{checks, contend, store};

    async fn backend(options: &'static str) -> MssqlBackend {
        let url = live_url();
        let sep = if url.contains('?') { '&' } else { '?' };
        MssqlBackend::connect(&format!("{url}{sep}{options}"))
            .await
            .expect("connect")
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[cfg_attr(
        not(dlock_mssql_live),
        ignore = "DLOCK_MSSQL_URL is not set: no SQL Server to test against"
    )]
    async fn never_more_than_max_count_holders_across_backends() {
        let key = dlock_testkit::unique_key("sem-contend");
        let mut backends = Vec::new();
        for _ in 0..3 {
            backends.push(backend("connections=2&wait_connections=0").await);
        }
        let watcher = backend("").await;
        let taken = contend(&backends, 3, &key, 3, Duration::from_secs(3), || async {
            store(&watcher).holders(&key, 3).await.expect("holders") as usize
        })
        .await;
        assert!(taken > 10, "only {taken} permits in 3 s");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[cfg_attr(
        not(dlock_mssql_live),
        ignore = "DLOCK_MSSQL_URL is not set: no SQL Server to test against"
    )]
    async fn one_session_never_takes_a_slot_it_holds() {
        checks::one_session_never_takes_a_slot_it_holds(backend).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[cfg_attr(
        not(dlock_mssql_live),
        ignore = "DLOCK_MSSQL_URL is not set: no SQL Server to test against"
    )]
    async fn another_count_is_refused_while_permits_are_held() {
        checks::another_count_is_refused_while_permits_are_held(backend).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[cfg_attr(
        not(dlock_mssql_live),
        ignore = "DLOCK_MSSQL_URL is not set: no SQL Server to test against"
    )]
    async fn counts_past_the_bound_are_refused() {
        checks::counts_past_the_bound_are_refused(&backend("").await, 1024).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[cfg_attr(
        not(dlock_mssql_live),
        ignore = "DLOCK_MSSQL_URL is not set: no SQL Server to test against"
    )]
    async fn single_tries_wait_behind_the_head_waiter() {
        checks::single_tries_wait_behind_the_head_waiter(&backend("").await, &backend("").await)
            .await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[cfg_attr(
        not(dlock_mssql_live),
        ignore = "DLOCK_MSSQL_URL is not set: no SQL Server to test against"
    )]
    async fn tries_cut_off_leave_nothing_held() {
        checks::tries_cut_off_leave_nothing_held(
            &backend("connections=1").await,
            &backend("").await,
        )
        .await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[cfg_attr(
        not(dlock_mssql_live),
        ignore = "DLOCK_MSSQL_URL is not set: no SQL Server to test against"
    )]
    async fn fencing_tokens_increase_per_semaphore() {
        checks::fencing_tokens_increase_per_semaphore(
            &backend("fencing=true").await,
            &backend("fencing=true").await,
        )
        .await;
    }
}

// ---------------------------------------------------------------------------------------------
// Client-side failures, against real sockets on this machine.

const PASSWORD: &str = "pw-never-shown-9431";

fn url_for(port: u16, options: &str) -> String {
    format!("mssql://app:{PASSWORD}@127.0.0.1:{port}/app?{options}")
}

fn assert_unavailable(err: &LockError, words: &str) {
    let text = err.to_string();
    eprintln!("{text}");
    assert_eq!(err.code(), "DistributedLock.Unavailable", "{text}");
    assert!(text.contains(words), "expected `{words}` in: {text}");
    assert!(!text.contains(PASSWORD), "{text}");
    assert!(!format!("{err:?}").contains(PASSWORD));
}

async fn bounded<T>(f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(60), f)
        .await
        .expect("the connection attempt hung")
}

#[tokio::test]
async fn refused_connection_is_unavailable() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    drop(listener);
    let err = bounded(LockProvider::connect(&url_for(port, "connect_timeout=30s")))
        .await
        .unwrap_err();
    assert_unavailable(&err, "could not connect to SQL Server at 127.0.0.1");
}

#[tokio::test]
async fn a_port_that_does_not_speak_tds_fails_the_handshake() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let server = tokio::spawn(async move {
        let (mut socket, _) = listener.accept().await.unwrap();
        let mut buf = [0u8; 512];
        let _ = socket.read(&mut buf).await;
        let _ = socket
            .write_all(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
            .await;
        let _ = socket.shutdown().await;
    });
    // A generous connect timeout: the failure must come from the handshake, not the clock.
    let err = bounded(LockProvider::connect(&url_for(port, "connect_timeout=30s")))
        .await
        .unwrap_err();
    assert_unavailable(&err, "did not complete the SQL Server (TDS) handshake");
    assert!(!err.to_string().contains("connect_timeout"), "{err}");
    server.await.unwrap();
}

/// A PRELOGIN response that asks for encryption, as a TDS 7.x server sends it.
fn prelogin_response() -> Vec<u8> {
    // Options: VERSION at offset 11 (6 bytes), ENCRYPTION at offset 17 (1 byte), terminator.
    let payload: Vec<u8> = vec![
        0x00, 0x00, 11, 0x00, 6, // VERSION
        0x01, 0x00, 17, 0x00, 1,    // ENCRYPTION
        0xff, // terminator
        16, 0, 0x07, 0xd0, 0, 0,    // version 16.0.2000.0
        0x01, // ENCRYPT_ON
    ];
    let length = u16::try_from(8 + payload.len()).unwrap();
    let mut packet = vec![0x04, 0x01];
    packet.extend_from_slice(&length.to_be_bytes());
    packet.extend_from_slice(&[0, 0, 1, 0]);
    packet.extend_from_slice(&payload);
    packet
}

#[tokio::test]
async fn a_broken_tls_handshake_is_reported() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let server = tokio::spawn(async move {
        let (mut socket, _) = listener.accept().await.unwrap();
        let mut buf = [0u8; 4096];
        // The client's PRELOGIN.
        let _ = socket.read(&mut buf).await;
        socket.write_all(&prelogin_response()).await.unwrap();
        // The client's TLS ClientHello (wrapped in a PRELOGIN packet): answer with a TDS packet
        // that carries no TLS record at all.
        let _ = socket.read(&mut buf).await;
        let _ = socket
            .write_all(&[0x12, 0x01, 0x00, 0x0c, 0, 0, 1, 0, b'n', b'o', b'p', b'e'])
            .await;
        let _ = socket.shutdown().await;
    });
    let err = bounded(LockProvider::connect(&url_for(port, "connect_timeout=30s")))
        .await
        .unwrap_err();
    assert_unavailable(&err, "TLS handshake with 127.0.0.1");
    assert!(!err.to_string().contains("connect_timeout"), "{err}");
    server.await.unwrap();
}

#[tokio::test]
async fn a_silent_server_ends_at_the_connect_timeout() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let server = tokio::spawn(async move {
        let (socket, _) = listener.accept().await.unwrap();
        // Accept and say nothing until the client gives up.
        let mut socket = socket;
        let mut buf = [0u8; 512];
        while matches!(socket.read(&mut buf).await, Ok(n) if n > 0) {}
    });
    let err = bounded(LockProvider::connect(&url_for(
        port,
        "connect_timeout=300ms",
    )))
    .await
    .unwrap_err();
    assert_unavailable(&err, "did not complete within connect_timeout 300ms");
    server.await.unwrap();
}

#[tokio::test]
async fn url_and_ado_errors_are_configuration_errors() {
    for url in [
        format!("mssql://app:{PASSWORD}@127.0.0.1/app?nonsense=1"),
        format!("sqlserver://app:{PASSWORD}@127.0.0.1/app?encrypt=perhaps"),
        format!("mssql://app:{PASSWORD}@/app"),
    ] {
        let err = LockProvider::connect(&url).await.unwrap_err();
        assert_eq!(err.code(), "DistributedLock.Configuration", "{err}");
        assert!(!err.to_string().contains(PASSWORD), "{err}");
    }
    let builder = MssqlBackend::builder_from_ado(&format!(
        "Server=tcp:127.0.0.1,1;User Id=app;Password={PASSWORD};TrustServerCertificate=true"
    ))
    .expect("ADO string");
    let err = builder
        .connect_timeout(Duration::from_secs(30))
        .open()
        .await
        .unwrap_err();
    assert_unavailable(&err, "127.0.0.1:1");
}

/// `TrustServerCertificate=true` with `TrustServerCertificateCA` (no check, and a check against
/// a CA) is a configuration error, in any spelling and order the driver reads, never a panic
/// (tiberius panics on the pair).
#[test]
fn ado_strings_that_trust_everything_and_a_ca_are_configuration_errors() {
    let panics_before = dlock_testkit::foreign_panics().len();
    for ado in [
        "Server=tcp:127.0.0.1,1;TrustServerCertificate=true;TrustServerCertificateCA=/ca.pem",
        "Server=tcp:127.0.0.1,1;trustservercertificateca=/ca.pem; TRUSTSERVERCERTIFICATE = yes",
        "Server=tcp:127.0.0.1,1;TrustServerCertificate='true';TrustServerCertificateCA='/a;b.pem'",
    ] {
        match MssqlBackend::builder_from_ado(ado) {
            Err(err) => {
                assert_eq!(err.code(), "DistributedLock.Configuration", "{ado}: {err}");
                assert!(
                    err.to_string().contains("TrustServerCertificateCA"),
                    "{err}"
                );
            }
            Ok(_) => panic!("{ado}: accepted"),
        }
    }
    // Either one alone is fine.
    for ado in [
        "Server=tcp:127.0.0.1,1;TrustServerCertificate=true",
        "Server=tcp:127.0.0.1,1;TrustServerCertificateCA=/ca.pem",
        "Server=tcp:127.0.0.1,1;TrustServerCertificate=false;TrustServerCertificateCA=/ca.pem",
    ] {
        drop(MssqlBackend::builder_from_ado(ado).expect(ado));
    }
    assert_eq!(
        dlock_testkit::foreign_panics().len(),
        panics_before,
        "{:?}",
        dlock_testkit::foreign_panics()
    );
}
