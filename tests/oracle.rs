//! The Oracle backend.
//!
//! No Oracle server (nor Oracle client library) can run on the machines this suite is developed
//! and checked on, so:
//! - the conformance suite and the transaction-bound tests run against the server named by
//!   `DLOCK_ORACLE_URL` (for example `oracle://app:secret@127.0.0.1:1521/FREEPDB1`; the user
//!   needs `EXECUTE ON SYS.DBMS_LOCK`, and `SELECT` on `V$LOCK` / `V$SESSION` plus
//!   `ALTER SYSTEM` for the lost-lock case, which kills the holding session); built without
//!   the variable, they are compiled as ignored and `cargo test` lists them as
//!   `ignored, DLOCK_ORACLE_URL is not set ...` (see `build.rs`), never as passed;
//! - the client-side failure "no Oracle client library" runs everywhere (with a client library
//!   installed, the same test checks the refused connection instead);
//! - the statements, parameters and return-code mapping are pinned by the unit tests of
//!   `dlock::oracle`.
#![cfg(feature = "oracle")]

mod support;

use std::time::Duration;

use dlock::oracle::driver::Connection;
use dlock::oracle::{OracleBackend, acquire_in_transaction, try_acquire_in_transaction};
use dlock::{LockError, LockGuard, LockProvider};
use dlock_testkit::unique_key;

const ENV: &str = "DLOCK_ORACLE_URL";
const KEEPALIVE: Duration = Duration::from_millis(250);

/// The server under test. The live tests are built as ignored unless `DLOCK_ORACLE_URL` was
/// set at build time (see `build.rs`), so this runs only when the variable was set then, or
/// when ignored tests are asked for (`--ignored`): then a missing variable fails the test.
fn live_url() -> String {
    match std::env::var(ENV) {
        Ok(url) if !url.is_empty() => url,
        _ => panic!(
            "{ENV} is not set: the live Oracle tests need a server (they are ignored when the \
             tests are built without {ENV})"
        ),
    }
}

/// A plain blocking connection to the server under test, for setting up and breaking locks.
fn raw_connection(url: &str) -> Connection {
    let parsed = url::Url::parse(url).expect("DLOCK_ORACLE_URL is a URL");
    let host = parsed.host_str().expect("host");
    let port = parsed.port().unwrap_or(1521);
    let service = parsed.path().trim_start_matches('/');
    Connection::connect(
        parsed.username(),
        parsed.password().unwrap_or(""),
        format!("//{host}:{port}/{service}"),
    )
    .expect("connect to Oracle")
}

struct OracleHarness {
    url: String,
    fencing: bool,
}

impl OracleHarness {
    async fn from_env(fencing: bool) -> Self {
        OracleHarness {
            url: live_url(),
            fencing,
        }
    }

    fn url(&self) -> String {
        let sep = if self.url.contains('?') { '&' } else { '?' };
        format!(
            "{}{sep}keepalive={}ms&fencing={}",
            self.url,
            KEEPALIVE.as_millis(),
            self.fencing
        )
    }
}

/// `url` with `options` appended.
fn with_options(url: &str, options: &str) -> String {
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}{options}")
}

impl dlock_testkit::Harness for OracleHarness {
    async fn provider(&self) -> LockProvider {
        LockProvider::connect(&self.url())
            .await
            .expect("connect to Oracle")
    }

    async fn break_lock(&self, guard: &LockGuard) {
        let url = self.url.clone();
        let id = i64::from(dlock::oracle::dbms_lock_id(guard.key()));
        tokio::task::spawn_blocking(move || {
            let conn = raw_connection(&url);
            let rows = conn
                .query_as::<(i64, i64)>(
                    "SELECT s.sid, s.serial# FROM v$lock l JOIN v$session s ON s.sid = l.sid \
                     WHERE l.type = 'UL' AND l.id1 = :1",
                    &[&id],
                )
                .expect("query locks");
            let mut killed = 0;
            for row in rows {
                let (sid, serial) = row.expect("row");
                // ALTER SYSTEM takes no binds; both numbers come from the server.
                conn.execute(
                    &format!("ALTER SYSTEM KILL SESSION '{sid},{serial}' IMMEDIATE"),
                    &[],
                )
                .expect("kill session");
                killed += 1;
            }
            assert!(killed > 0, "no session holds lock id {id}");
        })
        .await
        .expect("break lock");
    }

    fn lost_within(&self) -> Duration {
        KEEPALIVE + Duration::from_secs(3)
    }

    fn fencing(&self) -> bool {
        self.fencing
    }

    /// Oracle has no store inspection in dlock.
    fn store_inspection(&self) -> dlock_testkit::StoreInspection {
        dlock_testkit::StoreInspection::Unsupported
    }

    /// Read locks in the engine's shared mode (DBMS_LOCK S_MODE).
    fn read_locks(&self) -> bool {
        true
    }

    async fn shared_providers(&self, count: usize) -> Vec<LockProvider> {
        let sep = if self.url().contains('?') { '&' } else { '?' };
        let url = format!("{}{sep}connections=1", self.url());
        let backend = dlock::oracle::OracleBackend::connect(&url)
            .await
            .expect("connect to Oracle");
        (0..count)
            .map(|_| LockProvider::from_backend(backend.clone()))
            .collect()
    }
}

mod live {
    use super::*;

    dlock_testkit::conformance_suite!(
        attributes [#[cfg_attr(
            not(dlock_oracle_live),
            ignore = "DLOCK_ORACLE_URL is not set: no Oracle server to test against"
        )]]
        OracleHarness::from_env(false)
    );
}

/// The conformance suite with fencing on: every acquisition carries a token from the
/// `dlock_fencing` counter, taken in the PL/SQL block of its `DBMS_LOCK.REQUEST`.
mod live_fenced {
    use super::*;

    dlock_testkit::conformance_suite!(
        attributes [#[cfg_attr(
            not(dlock_oracle_live),
            ignore = "DLOCK_ORACLE_URL is not set: no Oracle server to test against"
        )]]
        OracleHarness::from_env(true)
    );
}

/// Fencing tokens strictly increase for one key across new providers (new sessions), tries
/// and native waits; the builder's `fencing` and `statement_timeout` are taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(dlock_oracle_live),
    ignore = "DLOCK_ORACLE_URL is not set: no Oracle server to test against"
)]
async fn live_fencing_tokens_increase_across_providers_and_waits() {
    let url = live_url();
    let fenced = with_options(&url, "fencing=true");
    let key = unique_key("oracle-fence");
    let mut last = 0;
    for _ in 0..3 {
        let locks = LockProvider::connect(&fenced).await.expect("connect");
        let guard = locks.try_acquire(&key).await.expect("free");
        let token = guard.fencing_token().expect("a token");
        assert!(token > last, "token {token} after {last}");
        last = token;
        guard.release().await.expect("release");
    }
    let backend = OracleBackend::builder_from_url(&url)
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
    let other = LockProvider::connect(&fenced).await.expect("connect");
    let waiter = tokio::spawn({
        let key = key.clone();
        async move {
            let guard = other.acquire(&key, Duration::from_secs(20)).await?;
            let token = guard.fencing_token();
            guard.release().await?;
            Ok::<_, LockError>(token)
        }
    });
    tokio::time::sleep(Duration::from_millis(1500)).await;
    holder.release().await.expect("release");
    let waited = waiter
        .await
        .expect("task")
        .expect("granted after the release");
    assert!(waited.expect("a token") > held);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(dlock_oracle_live),
    ignore = "DLOCK_ORACLE_URL is not set: no Oracle server to test against"
)]
async fn live_transaction_bound_locks() {
    let url = live_url();
    let key = unique_key("oracle-tx");
    let locks = LockProvider::connect(&url).await.expect("provider");
    let (k, u) = (key.clone(), url.clone());
    let a = tokio::task::spawn_blocking(move || {
        let a = raw_connection(&u);
        try_acquire_in_transaction(&a, &k).expect("free");
        a
    })
    .await
    .unwrap();
    assert!(matches!(
        locks.try_acquire(&key).await,
        Err(LockError::AlreadyHeld { .. })
    ));
    let (k, u) = (key.clone(), url.clone());
    let b = tokio::task::spawn_blocking(move || {
        let b = raw_connection(&u);
        assert!(matches!(
            try_acquire_in_transaction(&b, &k),
            Err(LockError::AlreadyHeld { .. })
        ));
        assert!(matches!(
            acquire_in_transaction(&b, &k, Duration::from_millis(500)),
            Err(LockError::Timeout { .. })
        ));
        b
    })
    .await
    .unwrap();
    let k = key.clone();
    tokio::task::spawn_blocking(move || {
        a.commit().expect("commit releases");
        acquire_in_transaction(&b, &k, Duration::from_secs(10)).expect("free after commit");
        b.rollback().expect("rollback releases");
    })
    .await
    .unwrap();
    let guard = locks.try_acquire(&key).await.expect("free after rollback");
    guard.release().await.expect("release");
}

#[tokio::test]
#[cfg_attr(
    not(dlock_oracle_live),
    ignore = "DLOCK_ORACLE_URL is not set: no Oracle server to test against"
)]
async fn live_multi_process_exclusion() {
    let url = live_url();
    support::run_multi_process(
        &url,
        &unique_key("oracle-mp"),
        3,
        10,
        support::Fencing::None,
    );
    support::run_multi_process(
        &with_options(&url, "fencing=true"),
        &unique_key("oracle-mp-fenced"),
        3,
        10,
        support::Fencing::Every,
    );
}

/// Semaphores as the engine keeps them (its permit store, asked directly): one batch per try
/// over the slot locks, the count record held bit by bit, the queue lock as the waiting mark.
mod live_permits {
    use std::time::Duration;

    use dlock::oracle::OracleBackend;

    use super::live_url;
    use crate::support::permits::{checks, contend, store};

    async fn backend(options: &'static str) -> OracleBackend {
        let url = live_url();
        let sep = if url.contains('?') { '&' } else { '?' };
        OracleBackend::connect(&format!("{url}{sep}{options}"))
            .await
            .expect("connect")
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[cfg_attr(
        not(dlock_oracle_live),
        ignore = "DLOCK_ORACLE_URL is not set: no Oracle server to test against"
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
        not(dlock_oracle_live),
        ignore = "DLOCK_ORACLE_URL is not set: no Oracle server to test against"
    )]
    async fn one_session_never_takes_a_slot_it_holds() {
        checks::one_session_never_takes_a_slot_it_holds(backend).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[cfg_attr(
        not(dlock_oracle_live),
        ignore = "DLOCK_ORACLE_URL is not set: no Oracle server to test against"
    )]
    async fn another_count_is_refused_while_permits_are_held() {
        checks::another_count_is_refused_while_permits_are_held(backend).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[cfg_attr(
        not(dlock_oracle_live),
        ignore = "DLOCK_ORACLE_URL is not set: no Oracle server to test against"
    )]
    async fn counts_past_the_bound_are_refused() {
        checks::counts_past_the_bound_are_refused(&backend("").await, 1024).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[cfg_attr(
        not(dlock_oracle_live),
        ignore = "DLOCK_ORACLE_URL is not set: no Oracle server to test against"
    )]
    async fn single_tries_wait_behind_the_head_waiter() {
        checks::single_tries_wait_behind_the_head_waiter(&backend("").await, &backend("").await)
            .await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[cfg_attr(
        not(dlock_oracle_live),
        ignore = "DLOCK_ORACLE_URL is not set: no Oracle server to test against"
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
        not(dlock_oracle_live),
        ignore = "DLOCK_ORACLE_URL is not set: no Oracle server to test against"
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
// Client-side failures, on this machine.

const PASSWORD: &str = "pw-never-shown-5520";

/// Without the Oracle client library (as on this machine and in CI) opening a session fails
/// with DPI-1047, which must come back as a configuration error that says what to install and
/// how it is found. Where a client library is installed, the closed port answers instead.
#[tokio::test]
async fn missing_client_library_or_refused_connection() {
    let url = format!("oracle://app:{PASSWORD}@127.0.0.1:1/FREEPDB1?connect_timeout=30s");
    let err = tokio::time::timeout(Duration::from_secs(60), LockProvider::connect(&url))
        .await
        .expect("connect hung")
        .unwrap_err();
    let text = err.to_string();
    eprintln!("{text}");
    assert!(!text.contains(PASSWORD), "{text}");
    assert!(!format!("{err:?}").contains(PASSWORD));
    if text.contains("DPI-1047") {
        assert_eq!(err.code(), "DistributedLock.Configuration", "{text}");
        assert!(text.contains("Oracle Instant Client"), "{text}");
        assert!(text.contains("LD_LIBRARY_PATH"), "{text}");
    } else {
        eprintln!("an Oracle client library is installed: checking the refused connection");
        assert_eq!(err.code(), "DistributedLock.Unavailable", "{text}");
        assert!(text.contains("ORA-12541") || text.contains("TNS"), "{text}");
    }
}

#[tokio::test]
async fn url_errors_are_configuration_errors() {
    for url in [
        format!("oracle://app:{PASSWORD}@127.0.0.1/x?nonsense=1"),
        format!("oracle://app:{PASSWORD}@127.0.0.1/x?connections=0"),
        format!("oracle://:{PASSWORD}@127.0.0.1/x"),
    ] {
        let err = LockProvider::connect(&url).await.unwrap_err();
        assert_eq!(err.code(), "DistributedLock.Configuration", "{err}");
        assert!(!err.to_string().contains(PASSWORD), "{err}");
    }
    let builder =
        OracleBackend::builder_from_url(&format!("oracle://app:{PASSWORD}@db.internal:1522/svc"))
            .expect("valid URL");
    assert!(!format!("{builder:?}").contains(PASSWORD));
}
