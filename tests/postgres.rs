//! The PostgreSQL backend against real throwaway servers: the conformance suite (with and
//! without fencing), lost detection, server restarts, other processes, many held locks on few
//! connections, transaction-bound locks and bad inputs.
#![cfg(feature = "postgres")]

mod support;

use std::time::{Duration, Instant};

use dlock::postgres::{PostgresBackend, acquire_in_transaction, try_acquire_in_transaction};
use dlock::{LockError, LockGuard, LockProvider, lock_id};
use dlock_testkit::postgres::PgServer;
use dlock_testkit::unique_key;
use sqlx::{Connection, PgConnection};
use support::Holder;

const KEEPALIVE: Duration = Duration::from_millis(200);

async fn admin(server: &PgServer) -> PgConnection {
    PgConnection::connect(&server.url(""))
        .await
        .expect("admin connection")
}

/// The server pids holding the advisory lock of `key`.
async fn holders(conn: &mut PgConnection, key: &str) -> Vec<i32> {
    sqlx::query_scalar(
        "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 1 \
         AND ((classid::bigint << 32) | objid::bigint) = $1",
    )
    .bind(lock_id(key))
    .fetch_all(conn)
    .await
    .expect("query pg_locks")
}

/// How many sessions wait on the server for the advisory lock of `key`.
async fn waiting_for(conn: &mut PgConnection, key: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted \
         AND objsubid = 1 AND ((classid::bigint << 32) | objid::bigint) = $1",
    )
    .bind(lock_id(key))
    .fetch_one(conn)
    .await
    .expect("query pg_locks")
}

async fn terminate_holder(server: &PgServer, key: &str) {
    let mut conn = admin(server).await;
    let pids = holders(&mut conn, key).await;
    assert_eq!(pids.len(), 1, "exactly one session holds {key:?}");
    let done: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(pids[0])
        .fetch_one(&mut conn)
        .await
        .expect("terminate");
    assert!(done);
}

struct PgHarness {
    server: &'static PgServer,
    options: &'static str,
    fencing: bool,
}

impl dlock_testkit::Harness for PgHarness {
    async fn provider(&self) -> LockProvider {
        LockProvider::connect(&self.server.url(self.options))
            .await
            .expect("connect")
    }

    async fn break_lock(&self, guard: &LockGuard) {
        terminate_holder(self.server, guard.key()).await;
    }

    fn lost_within(&self) -> Duration {
        KEEPALIVE + Duration::from_secs(1)
    }

    fn fencing(&self) -> bool {
        self.fencing
    }

    fn store_inspection(&self) -> dlock_testkit::StoreInspection {
        dlock_testkit::StoreInspection::Listed
    }

    /// Read locks in the engine's shared mode (pg_advisory_lock_shared).
    fn read_locks(&self) -> bool {
        true
    }

    async fn shared_providers(&self, count: usize) -> Vec<LockProvider> {
        let url = self.server.url(&format!("{}&connections=1", self.options));
        let backend = PostgresBackend::connect(&url).await.expect("connect");
        (0..count)
            .map(|_| LockProvider::from_backend(backend.clone()))
            .collect()
    }
}

mod fenced {
    use super::*;

    async fn harness() -> PgHarness {
        PgHarness {
            server: PgServer::shared(),
            options: "keepalive=200ms&fencing=true",
            fencing: true,
        }
    }

    dlock_testkit::conformance_suite!(harness());
}

mod plain {
    use super::*;

    async fn harness() -> PgHarness {
        PgHarness {
            server: PgServer::shared(),
            options: "keepalive=200ms",
            fencing: false,
        }
    }

    dlock_testkit::conformance_suite!(harness());
}

/// 50 trials: the session behind a held lock is terminated, and the guard's lost token fires
/// within keepalive + 1 s, for locks on lock connections and on wait connections alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terminated_sessions_are_detected() {
    let server = PgServer::shared();
    let url = server.url("keepalive=100ms&connections=2&wait_connections=2");
    let a = LockProvider::connect(&url).await.unwrap();
    let b = LockProvider::connect(&url).await.unwrap();
    let limit = Duration::from_millis(100) + Duration::from_secs(1);
    let mut slowest = Duration::ZERO;
    for trial in 0..50 {
        let key = unique_key("terminate");
        let guard = if trial % 2 == 0 {
            a.try_acquire(&key).await.expect("free key")
        } else {
            // Contended, so it is granted to a native wait on a wait connection.
            let other = b.try_acquire(&key).await.unwrap();
            let waiter = {
                let (a, key) = (a.clone(), key.clone());
                tokio::spawn(async move { a.acquire(&key, Duration::from_secs(10)).await })
            };
            let mut conn = admin(server).await;
            // Wait until the waiter is queued on the server, then hand over.
            let deadline = Instant::now() + Duration::from_secs(5);
            loop {
                let waiting: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted \
                     AND ((classid::bigint << 32) | objid::bigint) = $1",
                )
                .bind(lock_id(&key))
                .fetch_one(&mut conn)
                .await
                .unwrap();
                if waiting == 1 {
                    break;
                }
                assert!(Instant::now() < deadline, "the waiter never queued");
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            other.release().await.unwrap();
            waiter.await.unwrap().expect("waiter gets the lock")
        };
        terminate_holder(server, &key).await;
        let started = Instant::now();
        tokio::time::timeout(limit, guard.lost_token().cancelled())
            .await
            .unwrap_or_else(|_| panic!("trial {trial}: lost token did not fire within {limit:?}"));
        slowest = slowest.max(started.elapsed());
        assert!(matches!(guard.release().await, Err(LockError::Lost { .. })));
    }
    println!("slowest lost detection: {slowest:?}");
    // Both providers still work.
    let g = a.try_acquire(&unique_key("after")).await.unwrap();
    g.release().await.unwrap();
}

/// A server stop is reported as lost locks and as unavailability (not a hang); once the
/// server is back, the provider works again with fresh connections.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn provider_recovers_from_a_server_restart() {
    let mut server = PgServer::start();
    let url = server.url("keepalive=200ms&connect_timeout=2s");
    let locks = LockProvider::connect(&url).await.unwrap();
    let key = unique_key("restart");
    let guard = locks.try_acquire(&key).await.unwrap();
    let other = locks.try_acquire(&unique_key("restart-2")).await.unwrap();
    server.stop();
    for g in [&guard, &other] {
        tokio::time::timeout(
            KEEPALIVE + Duration::from_secs(1),
            g.lost_token().cancelled(),
        )
        .await
        .expect("lost token fires when the server stops");
    }
    let started = Instant::now();
    match locks
        .acquire(&unique_key("down"), Duration::from_secs(1))
        .await
    {
        Err(err @ LockError::Unavailable { .. }) => {
            assert!(!err.to_string().contains("postgres://"), "{err}")
        }
        other => panic!("expected Unavailable while the server is down, got {other:?}"),
    }
    assert!(started.elapsed() < Duration::from_secs(5));
    assert!(matches!(guard.release().await, Err(LockError::Lost { .. })));
    drop(other);
    server.resume();
    let g = locks
        .acquire(&key, Duration::from_secs(5))
        .await
        .expect("the provider recovers");
    let g2 = locks.try_acquire(&unique_key("after")).await.unwrap();
    g.release().await.unwrap();
    g2.release().await.unwrap();
}

#[test]
fn multi_process_exclusion() {
    let server = PgServer::shared();
    support::run_multi_process(
        &server.url("fencing=true"),
        &unique_key("mp"),
        4,
        40,
        support::Fencing::Every,
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_holder_frees_the_lock_at_once() {
    let server = PgServer::shared();
    let url = server.url("");
    let key = unique_key("sigkill");
    let holder = Holder::start(&url, &key);
    let locks = LockProvider::connect(&url).await.unwrap();
    assert!(matches!(
        locks.try_acquire(&key).await,
        Err(LockError::AlreadyHeld { .. })
    ));
    holder.kill();
    // The server ends the session when the socket closes: no lease to run out.
    let g = locks
        .acquire(&key, Duration::from_secs(3))
        .await
        .expect("the killed holder's lock is free");
    g.release().await.unwrap();
}

/// 10,000 locks held at once, with waits in flight, on at most 8 server connections.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_locks_on_eight_connections() {
    let server = PgServer::shared();
    let app = format!("tenk{}", std::process::id());
    let locks = LockProvider::connect(&server.url(&format!("application_name={app}")))
        .await
        .unwrap();
    let other = LockProvider::connect(&server.url("")).await.unwrap();
    let prefix = unique_key("tenk");
    let mut guards = Vec::with_capacity(10_000);
    for chunk in 0..20 {
        let batch = futures::future::try_join_all(
            (0..500).map(|i| locks.try_acquire_owned_key(format!("{prefix}:{chunk}:{i}"))),
        )
        .await
        .expect("10,000 free keys");
        guards.extend(batch);
    }
    assert_eq!(locks.local_key_count(), 10_000);
    // Waits in flight too: keys held by another provider, waited for by this one.
    let contended: Vec<String> = (0..6).map(|i| format!("{prefix}:contended:{i}")).collect();
    let mut held_elsewhere = Vec::new();
    for key in &contended {
        held_elsewhere.push(other.try_acquire(key).await.unwrap());
    }
    let waiters: Vec<_> = contended
        .iter()
        .map(|key| {
            let (locks, key) = (locks.clone(), key.clone());
            tokio::spawn(async move { locks.acquire(&key, Duration::from_secs(20)).await })
        })
        .collect();
    let mut conn = admin(server).await;
    // Every wait connection (4, the default) waits on the server; the other two waits poll.
    dlock_testkit::wait_until(
        "the waits reach the server",
        Duration::from_secs(10),
        async || {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid) \
                 WHERE l.locktype = 'advisory' AND NOT l.granted AND a.application_name = $1",
            )
            .bind(&app)
            .fetch_one(&mut conn)
            .await
            .unwrap();
            waiting == 4
        },
    )
    .await;
    let connections = count_connections(&mut conn, &app).await;
    assert!(
        (1..=8).contains(&connections),
        "{connections} connections for 10,000 locks"
    );
    let advisory: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid) \
         WHERE l.locktype = 'advisory' AND l.granted AND a.application_name = $1",
    )
    .bind(&app)
    .fetch_one(&mut conn)
    .await
    .unwrap();
    assert_eq!(advisory, 10_000);
    // Every contended key is still held elsewhere: hand them over, and all waiters get theirs.
    for g in held_elsewhere {
        g.release().await.unwrap();
    }
    for w in waiters {
        guards.push(w.await.unwrap().expect("waiter"));
    }
    let connections = count_connections(&mut conn, &app).await;
    assert!(connections <= 8, "{connections} connections");
    futures::future::try_join_all(guards.into_iter().map(LockGuard::release))
        .await
        .unwrap();
    assert_eq!(locks.local_key_count(), 0);
}

async fn count_connections(conn: &mut PgConnection, app: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM pg_stat_activity WHERE application_name = $1")
        .bind(app)
        .fetch_one(conn)
        .await
        .unwrap()
}

trait OwnedKey {
    fn try_acquire_owned_key(
        &self,
        key: String,
    ) -> impl std::future::Future<Output = Result<LockGuard, LockError>> + Send;
}

impl OwnedKey for LockProvider {
    fn try_acquire_owned_key(
        &self,
        key: String,
    ) -> impl std::future::Future<Output = Result<LockGuard, LockError>> + Send {
        let locks = self.clone();
        async move { locks.try_acquire(&key).await }
    }
}

/// Transaction locks end with commit and with rollback; a timed-out wait leaves the
/// transaction usable and its `lock_timeout` as it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transaction_locks_end_with_their_transaction() {
    let server = PgServer::shared();
    let locks = LockProvider::connect(&server.url("")).await.unwrap();
    let mut conn = admin(server).await;
    let key = unique_key("tx");
    for finish in ["commit", "rollback"] {
        let mut tx = conn.begin().await.unwrap();
        let lock = try_acquire_in_transaction(&mut tx, &key).await.unwrap();
        assert_eq!(lock.lock_id(), lock_id(&key));
        assert!(matches!(
            locks.try_acquire(&key).await,
            Err(LockError::AlreadyHeld { .. })
        ));
        match finish {
            "commit" => tx.commit().await.unwrap(),
            _ => tx.rollback().await.unwrap(),
        }
        let g = locks
            .try_acquire(&key)
            .await
            .unwrap_or_else(|e| panic!("free after {finish}: {e}"));
        g.release().await.unwrap();
    }

    // A session lock held elsewhere: the transaction's wait times out, and the transaction
    // carries on with its own lock_timeout.
    let g = locks.try_acquire(&key).await.unwrap();
    let mut tx = conn.begin().await.unwrap();
    sqlx::query("SET LOCAL lock_timeout = '7s'")
        .execute(&mut *tx)
        .await
        .unwrap();
    // Shorter than the waits below: it must not cut them short.
    sqlx::query("SET LOCAL statement_timeout = '100ms'")
        .execute(&mut *tx)
        .await
        .unwrap();
    assert!(matches!(
        try_acquire_in_transaction(&mut tx, &key).await,
        Err(LockError::AlreadyHeld { .. })
    ));
    let started = Instant::now();
    match acquire_in_transaction(&mut tx, &key, Duration::from_millis(300)).await {
        Err(LockError::Timeout { .. }) => {}
        other => panic!("expected Timeout, got {other:?}"),
    }
    assert!(started.elapsed() >= Duration::from_millis(300));
    let setting: (String, String) = sqlx::query_as(
        "SELECT current_setting('lock_timeout'), current_setting('statement_timeout')",
    )
    .fetch_one(&mut *tx)
    .await
    .expect("the transaction is still usable");
    assert_eq!(setting, ("7s".to_owned(), "100ms".to_owned()));
    // Granted once the holder lets go, while waiting: released as soon as the transaction's
    // wait is queued on the server.
    let mut watcher = admin(server).await;
    let (granted, released) = tokio::join!(
        acquire_in_transaction(&mut tx, &key, Duration::from_secs(10)),
        async {
            dlock_testkit::wait_until(
                "the transaction waits on the server",
                Duration::from_secs(5),
                async || waiting_for(&mut watcher, &key).await == 1,
            )
            .await;
            g.release().await
        },
    );
    released.unwrap();
    granted.expect("granted after the release");
    let setting: (String, String) = sqlx::query_as(
        "SELECT current_setting('lock_timeout'), current_setting('statement_timeout')",
    )
    .fetch_one(&mut *tx)
    .await
    .unwrap();
    assert_eq!(setting, ("7s".to_owned(), "100ms".to_owned()));
    assert!(matches!(
        locks.try_acquire(&key).await,
        Err(LockError::AlreadyHeld { .. })
    ));
    tx.rollback().await.unwrap();
    locks
        .try_acquire(&key)
        .await
        .unwrap()
        .release()
        .await
        .unwrap();

    // Outside a transaction the waiting form says so; bad keys are typed errors.
    assert!(matches!(
        acquire_in_transaction(&mut conn, &key, Duration::from_secs(1)).await,
        Err(LockError::Config { .. })
    ));
    assert!(matches!(
        try_acquire_in_transaction(&mut conn, "").await,
        Err(LockError::InvalidKey { .. })
    ));
}

/// A pool-wide `statement_timeout` does not cut the provider's waits short.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn statement_timeout_does_not_cut_waits() {
    let server = PgServer::shared();
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect_with(
            server
                .url("")
                .parse::<sqlx::postgres::PgConnectOptions>()
                .unwrap()
                .options([("statement_timeout", "100")]),
        )
        .await
        .unwrap();
    let locks = LockProvider::from_backend(PostgresBackend::new(pool.clone()).await.unwrap());
    let other = LockProvider::connect(&server.url("")).await.unwrap();
    let key = unique_key("stmt-timeout");
    let g = other.try_acquire(&key).await.unwrap();
    // Held for 600 ms, six times the pool's statement_timeout: the length of the wait is
    // what is tested.
    let started = Instant::now();
    let release = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(600)).await;
        g.release().await
    });
    let got = locks
        .acquire(&key, Duration::from_secs(10))
        .await
        .expect("the wait outlasts the pool's statement_timeout");
    assert!(
        started.elapsed() >= Duration::from_millis(500),
        "granted after {:?}, before the holder let go",
        started.elapsed()
    );
    release.await.unwrap().unwrap();
    got.release().await.unwrap();
    assert_eq!(
        pool.size(),
        1,
        "the backend takes no connections from the pool"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_credentials_and_unreachable_servers_are_clear_errors() {
    let server = PgServer::shared();
    let mut conn = admin(server).await;
    sqlx::query(
        "DO $$ BEGIN IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'locker') THEN \
         CREATE ROLE locker LOGIN PASSWORD 'right-password'; END IF; END $$",
    )
    .execute(&mut conn)
    .await
    .unwrap();
    let port = server.port();
    let ok = LockProvider::connect(&format!(
        "postgres://locker:right-password@127.0.0.1:{port}/postgres"
    ))
    .await
    .expect("the right password works");
    ok.try_acquire(&unique_key("pw"))
        .await
        .unwrap()
        .release()
        .await
        .unwrap();

    let err = LockProvider::connect(&format!(
        "postgres://locker:wrong-secret@127.0.0.1:{port}/postgres"
    ))
    .await
    .unwrap_err();
    assert_eq!(err.code(), "DistributedLock.Configuration", "{err}");
    let message = err.to_string();
    assert!(message.contains("password"), "{message}");
    assert!(
        !message.contains("wrong-secret"),
        "the password leaked: {message}"
    );

    // Nothing listens on this port.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let closed_port = closed.local_addr().unwrap().port();
    drop(closed);
    let started = Instant::now();
    let err = LockProvider::connect(&format!(
        "postgres://u:secret@127.0.0.1:{closed_port}/db?connect_timeout=2s"
    ))
    .await
    .unwrap_err();
    assert_eq!(err.code(), "DistributedLock.Unavailable", "{err}");
    assert!(!err.to_string().contains("secret"), "{err}");
    assert!(started.elapsed() < Duration::from_secs(3));

    // Something accepts the connection but never answers: the connect timeout holds.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let silent_port = silent.local_addr().unwrap().port();
    let started = Instant::now();
    let err = LockProvider::connect(&format!(
        "postgres://u@127.0.0.1:{silent_port}/db?connect_timeout=500ms"
    ))
    .await
    .unwrap_err();
    assert_eq!(err.code(), "DistributedLock.Unavailable", "{err}");
    let elapsed = started.elapsed();
    assert!(
        elapsed >= Duration::from_millis(500) && elapsed < Duration::from_secs(2),
        "{elapsed:?}"
    );
    drop(silent);

    for bad in [
        "postgres://h/db?fencing=maybe",
        "postgres://h/db?connections=0",
        "postgres://h/db?nonsense_option_x=1",
        "postgres://h/db?keepalive=soon",
    ] {
        let err = LockProvider::connect(bad).await.unwrap_err();
        assert_eq!(err.code(), "DistributedLock.Configuration", "{bad}: {err}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fencing_tokens_survive_a_new_provider_and_builder_options() {
    let server = PgServer::shared();
    let key = unique_key("fence");
    let first = {
        let locks = LockProvider::connect(&server.url("fencing=true"))
            .await
            .unwrap();
        let g = locks.try_acquire(&key).await.unwrap();
        let t = g.fencing_token().expect("token");
        g.release().await.unwrap();
        t
    };
    let opts: sqlx::postgres::PgConnectOptions = server.url("").parse().unwrap();
    let backend = PostgresBackend::builder(opts)
        .fencing(true)
        .keepalive(Duration::from_secs(1))
        .connections(1)
        .wait_connections(0)
        .open()
        .await
        .unwrap();
    assert!(backend.fencing());
    let locks = LockProvider::from_backend(backend);
    let g = locks.acquire(&key, Duration::from_secs(1)).await.unwrap();
    assert!(g.fencing_token().unwrap() > first);
    // The key is held by this provider; with no wait connections, a wait from another
    // provider polls and times out.
    let other = LockProvider::connect(&server.url("wait_connections=0"))
        .await
        .unwrap();
    assert!(matches!(
        other.acquire(&key, Duration::from_millis(200)).await,
        Err(LockError::Timeout { .. })
    ));
    g.release().await.unwrap();
}

/// Abandoned native waits leave nothing on the server: no queued waiter, no granted lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abandoned_waits_leave_the_server_clean() {
    let server = PgServer::shared();
    let a = LockProvider::connect(&server.url("")).await.unwrap();
    let b = LockProvider::connect(&server.url("")).await.unwrap();
    let key = unique_key("abandoned-wait");
    let held = b.try_acquire(&key).await.unwrap();
    let mut conn = admin(server).await;
    for _ in 0..5 {
        // The wait reaches the server, then its future is dropped.
        let wait = a.acquire(&key, Duration::from_secs(60));
        assert!(
            tokio::time::timeout(Duration::from_millis(200), wait)
                .await
                .is_err()
        );
    }
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted \
             AND objsubid = 1 AND ((classid::bigint << 32) | objid::bigint) = $1",
        )
        .bind(lock_id(&key))
        .fetch_one(&mut conn)
        .await
        .unwrap();
        if waiting == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{waiting} abandoned waits still queued"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    held.release().await.unwrap();
    // Nobody was left to take it over.
    assert!(holders(&mut conn, &key).await.is_empty());
    b.try_acquire(&key).await.unwrap().release().await.unwrap();
}

/// A wait cancelled at the moment its key is released may be granted on the server just before
/// the cancel lands; its session then holds the lock until the server sees the connection go.
/// The same backend must not answer `AlreadyHeld` for that moment: its next acquisition of the
/// key waits until the abandoned session neither waits nor holds. 100 races of cancel against
/// release; each time the provider that waited takes the key at once afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_cancelled_as_its_key_is_released_never_leaves_it_held() {
    let server = PgServer::shared();
    let a = LockProvider::connect(&server.url("")).await.unwrap();
    let b = LockProvider::connect(&server.url("")).await.unwrap();
    let mut conn = admin(server).await;
    let cancelled = dlock_testkit::conformance::cancel_race(&a, &b, 100, async |key: &str| {
        waiting_for(&mut conn, key).await == 1
    })
    .await;
    eprintln!("{cancelled} of 100 waits ended cancelled");
}

/// The fenced statements (`pg_try_advisory_lock` + `INSERT ... RETURNING token` in one
/// statement) read their row with `fetch_one`. This pins what that relies on: an error raised
/// when the implicit transaction commits, after the row was sent, still reaches the caller (a
/// deferred constraint fails at commit), so no token is handed out that the server rolled back.
/// (SQLite's driver did drop such errors; see its full-disk test.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_at_commit_after_a_returned_row_reach_the_caller() {
    let server = PgServer::shared();
    let mut conn = admin(server).await;
    let suffix = std::process::id();
    let (parent, child) = (format!("fence_p_{suffix}"), format!("fence_c_{suffix}"));
    for statement in [
        format!("CREATE TABLE {parent} (id int PRIMARY KEY)"),
        format!(
            "CREATE TABLE {child} (id int PRIMARY KEY, \
             p int REFERENCES {parent}(id) DEFERRABLE INITIALLY DEFERRED)"
        ),
    ] {
        sqlx::query(sqlx::AssertSqlSafe(statement))
            .execute(&mut conn)
            .await
            .unwrap();
    }
    let outcome: Result<i32, _> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {child} VALUES (1, 42) RETURNING id"
    )))
    .fetch_one(&mut conn)
    .await;
    let err = outcome.expect_err("the commit fails after the row was returned");
    assert!(err.to_string().contains("foreign key"), "{err}");
    let rows: i64 =
        sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SELECT count(*) FROM {child}")))
            .fetch_one(&mut conn)
            .await
            .unwrap();
    assert_eq!(rows, 0);
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE {child}, {parent}")))
        .execute(&mut conn)
        .await
        .unwrap();
}

/// A lock statement that outlives `statement_timeout` drops its connection and reports every
/// lock that connection held as lost, at the setting (300 ms here, against the 10 s default):
/// another session holds the fencing counter row of a second key in an open transaction, so
/// the fenced try of that key (which takes its advisory lock, then increments the row) blocks
/// on the server. Once the server sees the connection gone, the lost lock is free again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_statement_outliving_statement_timeout_drops_its_connection() {
    let server = PgServer::shared();
    // One lock connection, no wait connections, and a keepalive too slow to notice anything
    // first: only the statement bound can end this.
    let url = server
        .url("fencing=true&connections=1&wait_connections=0&keepalive=1h&statement_timeout=300ms");
    let locks = LockProvider::connect(&url).await.expect("connect");
    let (held_key, blocked_key) = (unique_key("st-held"), unique_key("st-blocked"));
    let held = locks.try_acquire(&held_key).await.expect("free");
    let mut blocker = admin(server).await;
    sqlx::query("BEGIN")
        .execute(&mut blocker)
        .await
        .expect("begin");
    sqlx::query(
        "INSERT INTO dlock_fencing (id, token) VALUES ($1, 1) \
         ON CONFLICT (id) DO UPDATE SET token = dlock_fencing.token + 1",
    )
    .bind(lock_id(&blocked_key))
    .execute(&mut blocker)
    .await
    .expect("hold the counter row");
    let started = Instant::now();
    let err = tokio::time::timeout(Duration::from_secs(5), locks.try_acquire(&blocked_key))
        .await
        .expect("the statement outlived statement_timeout=300ms: the setting was not applied")
        .expect_err("the counter row is held");
    let took = started.elapsed();
    eprintln!("answered after {took:?}: {err}");
    assert!(took >= Duration::from_millis(300), "{took:?}");
    assert_eq!(err.code(), "DistributedLock.Unavailable", "{err}");
    assert!(err.to_string().contains("statement_timeout"), "{err}");
    assert!(
        held.is_lost(),
        "the connection's other lock is reported lost"
    );
    let release = held.release().await;
    assert!(
        matches!(release, Err(LockError::Lost { .. })),
        "{release:?}"
    );
    // The server ends the abandoned session (it checks its client every second while a
    // statement runs), and with it the lost lock; nothing is left held after the rollback.
    let mut check = admin(server).await;
    dlock_testkit::wait_until(
        "the lost lock is freed on the server",
        Duration::from_secs(10),
        async || holders(&mut check, &held_key).await.is_empty(),
    )
    .await;
    sqlx::query("ROLLBACK")
        .execute(&mut blocker)
        .await
        .expect("rollback");
    // The backend opens a fresh connection and goes on.
    let again = locks.try_acquire(&blocked_key).await.expect("free again");
    assert!(again.fencing_token().is_some());
    again.release().await.expect("release");
    let again = locks.try_acquire(&held_key).await.expect("free again");
    again.release().await.expect("release");
}

/// The advisory locks of `key` on the server, as (pid, mode, granted).
async fn advisory_locks(conn: &mut PgConnection, key: &str) -> Vec<(i32, String, bool)> {
    sqlx::query_as(
        "SELECT pid, mode, granted FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 1 \
         AND ((classid::bigint << 32) | objid::bigint) = $1",
    )
    .bind(lock_id(key))
    .fetch_all(conn)
    .await
    .expect("query pg_locks")
}

fn assert_held(got: Result<LockGuard, LockError>) {
    match got {
        Err(LockError::AlreadyHeld { .. }) => {}
        other => panic!("expected AlreadyHeld, got {other:?}"),
    }
}

/// One backend with one lock connection, so every try runs on the same server session, which
/// PostgreSQL would let take an advisory lock it holds shared in exclusive mode too (and the
/// reverse). Readers and writers of providers on clones of it must still exclude each other,
/// both ways, tried and waited; the readers hold one shared lock on the server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_and_a_writer_on_one_lane_session_exclude_each_other() {
    let server = PgServer::shared();
    let backend = PostgresBackend::connect(&server.url("connections=1&wait_connections=2"))
        .await
        .unwrap();
    let (reader, writer) = (
        LockProvider::from_backend(backend.clone()),
        LockProvider::from_backend(backend.clone()),
    );
    let mut conn = admin(server).await;
    for round in 0..20 {
        let key = unique_key("one-lane-rw");
        let r = reader.try_acquire_read(&key).await.unwrap();
        let locks = advisory_locks(&mut conn, &key).await;
        assert_eq!(locks.len(), 1, "{locks:?}");
        assert_eq!(locks[0].1, "ShareLock", "{locks:?}");
        assert_held(writer.try_acquire(&key).await);
        match writer.acquire(&key, Duration::from_millis(100)).await {
            Err(LockError::Timeout { .. }) => {}
            other => panic!("round {round}: a writer waited beside a reader and got {other:?}"),
        }
        assert_eq!(
            advisory_locks(&mut conn, &key).await,
            locks,
            "no exclusive lock taken"
        );
        r.release().await.unwrap();
        assert!(advisory_locks(&mut conn, &key).await.is_empty());
        // And the other way round.
        let w = writer.try_acquire(&key).await.unwrap();
        assert_held(reader.try_acquire_read(&key).await);
        match reader.acquire_read(&key, Duration::from_millis(100)).await {
            Err(LockError::Timeout { .. }) => {}
            other => panic!("round {round}: a reader waited beside a writer and got {other:?}"),
        }
        let locks = advisory_locks(&mut conn, &key).await;
        assert_eq!(locks.len(), 1, "{locks:?}");
        assert_eq!(locks[0].1, "ExclusiveLock", "{locks:?}");
        w.release().await.unwrap();
        assert!(advisory_locks(&mut conn, &key).await.is_empty());
    }
}

/// Many readers of one key through one backend with one lock connection all hold it at once
/// (from one provider and from providers on clones); the server sees one shared lock, which
/// stays until the last of them leaves, and no writer gets in before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_readers_on_one_lock_connection_hold_together() {
    let server = PgServer::shared();
    let backend = PostgresBackend::connect(&server.url("connections=1&wait_connections=0"))
        .await
        .unwrap();
    let providers: Vec<LockProvider> = (0..4)
        .map(|_| LockProvider::from_backend(backend.clone()))
        .collect();
    let writer = LockProvider::connect(&server.url("")).await.unwrap();
    let mut conn = admin(server).await;
    let key = unique_key("many-readers");
    let mut readers = Vec::new();
    for n in 0..40 {
        readers.push(providers[n % 4].try_acquire_read(&key).await.unwrap());
    }
    let locks = advisory_locks(&mut conn, &key).await;
    assert_eq!(locks.len(), 1, "one session, one shared lock: {locks:?}");
    assert_eq!(locks[0].1, "ShareLock");
    let last = readers.pop().unwrap();
    for (n, r) in readers.into_iter().enumerate() {
        r.release().await.unwrap();
        if n % 10 == 0 {
            assert_held(writer.try_acquire(&key).await);
            assert_held(providers[0].try_acquire(&key).await);
        }
    }
    assert_eq!(
        advisory_locks(&mut conn, &key).await,
        locks,
        "held for the last reader"
    );
    assert_held(writer.try_acquire(&key).await);
    last.release().await.unwrap();
    assert!(advisory_locks(&mut conn, &key).await.is_empty());
    writer
        .try_acquire(&key)
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
}

/// PostgreSQL queues a new request behind a waiter it conflicts with: while a writer waits
/// for a key readers hold, a reader's `pg_try_advisory_lock_shared` answers false (a raw
/// statement shows it, and so does `try_acquire_read`), and a reader's wait queues behind
/// the writer, which gets the key as soon as the readers before it have left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_writer_holds_back_later_readers() {
    let server = PgServer::shared();
    let (first, late, w) = (
        LockProvider::connect(&server.url("")).await.unwrap(),
        LockProvider::connect(&server.url("")).await.unwrap(),
        LockProvider::connect(&server.url("")).await.unwrap(),
    );
    let mut conn = admin(server).await;
    let mut raw = admin(server).await;
    let key = unique_key("writer-first");
    let r = first.try_acquire_read(&key).await.unwrap();
    // Without a waiting writer, a new reader shares at once.
    let shared: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock_shared($1)")
        .bind(lock_id(&key))
        .fetch_one(&mut raw)
        .await
        .unwrap();
    assert!(shared);
    let _: bool = sqlx::query_scalar("SELECT pg_advisory_unlock_shared($1)")
        .bind(lock_id(&key))
        .fetch_one(&mut raw)
        .await
        .unwrap();
    let writer = {
        let (w, key) = (w.clone(), key.clone());
        tokio::spawn(async move { w.acquire(&key, Duration::from_secs(30)).await })
    };
    dlock_testkit::wait_until(
        "the writer is queued on the server",
        Duration::from_secs(5),
        async || waiting_for(&mut conn, &key).await == 1,
    )
    .await;
    let shared: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock_shared($1)")
        .bind(lock_id(&key))
        .fetch_one(&mut raw)
        .await
        .unwrap();
    assert!(!shared, "the server let a reader pass a queued writer");
    assert_held(late.try_acquire_read(&key).await);
    let reader = {
        let (late, key) = (late.clone(), key.clone());
        tokio::spawn(async move { late.acquire_read(&key, Duration::from_secs(30)).await })
    };
    dlock_testkit::wait_until(
        "the late reader is queued behind the writer",
        Duration::from_secs(5),
        async || waiting_for(&mut conn, &key).await == 2,
    )
    .await;
    r.release().await.unwrap();
    let g = tokio::time::timeout(Duration::from_secs(10), writer)
        .await
        .expect("the writer gets the key once the first reader left")
        .unwrap()
        .unwrap();
    assert!(
        !reader.is_finished(),
        "the late reader got in beside the writer"
    );
    let locks = advisory_locks(&mut conn, &key).await;
    assert!(
        locks
            .iter()
            .any(|(_, mode, granted)| *granted && mode == "ExclusiveLock"),
        "{locks:?}"
    );
    g.release().await.unwrap();
    let r = tokio::time::timeout(Duration::from_secs(10), reader)
        .await
        .expect("the late reader follows the writer")
        .unwrap()
        .unwrap();
    r.release().await.unwrap();
    assert!(advisory_locks(&mut conn, &key).await.is_empty());
}

/// Shared waits dropped midway (at random points while the key is held exclusively, and at
/// its release) leave no shared lock and no waiter on the server: afterwards pg_locks shows
/// nothing for the key and a writer elsewhere takes it with one try.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_shared_waits_leave_no_shared_lock() {
    let server = PgServer::shared();
    let readers = LockProvider::connect(&server.url("wait_connections=4"))
        .await
        .unwrap();
    let writer = LockProvider::connect(&server.url("")).await.unwrap();
    let mut conn = admin(server).await;
    for round in 0..20u64 {
        let key = unique_key("dropped-shared-wait");
        let held = writer.try_acquire(&key).await.unwrap();
        let mut waits = Vec::new();
        for n in 0..3u64 {
            let (readers, key) = (readers.clone(), key.clone());
            let budget = Duration::from_millis(20 + (round * 7 + n * 13) % 60);
            waits.push(tokio::spawn(async move {
                tokio::time::timeout(budget, readers.acquire_read(&key, Duration::from_secs(30)))
                    .await
            }));
        }
        // Release while some waits are still queued and others have been dropped.
        tokio::time::sleep(Duration::from_millis(20 + round * 3 % 50)).await;
        held.release().await.unwrap();
        for wait in waits {
            if let Ok(Ok(guard)) = wait.await.unwrap() {
                guard.release().await.unwrap();
            }
        }
        dlock_testkit::wait_until(
            "no advisory lock of the key is left on the server",
            Duration::from_secs(5),
            async || advisory_locks(&mut conn, &key).await.is_empty(),
        )
        .await;
        writer
            .try_acquire(&key)
            .await
            .unwrap_or_else(|e| panic!("round {round}: {e}"))
            .release()
            .await
            .unwrap();
    }
    assert!(
        dlock_testkit::eventually(Duration::from_secs(5), || readers.local_key_count() == 0).await
    );
}

/// Semaphores as the engine keeps them (its permit store, asked directly): slot locks of the
/// two-key form under a gate, one statement per try, the count record in `pg_locks`.
mod permits {
    use std::time::{Duration, Instant};

    use dlock::LockError;
    use dlock::backend::{LockBackend, LockRequest, PermitRequest};
    use dlock::postgres::PostgresBackend;
    use dlock_testkit::postgres::PgServer;
    use dlock_testkit::{unique_key, wait_until};
    use sqlx::PgConnection;

    use super::admin;
    use crate::support::permits::{
        PermitHolder, contend, hold_in_child, refused, release, store, try_permit, try_waiting,
    };
    use crate::support::wire::{Protocol, Proxy};

    async fn backend(options: &str) -> PostgresBackend {
        PostgresBackend::connect(&PgServer::shared().url(options))
            .await
            .expect("connect")
    }

    /// The semaphore's permits the server shows (as `store_locks` reads them): how many.
    async fn shown(backend: &PostgresBackend, key: &str) -> usize {
        let locks = backend.store_locks(&[key]).await.expect("store_locks");
        locks
            .iter()
            .filter(|lock| lock.key.as_deref() == Some(key))
            .map(|lock| lock.readers as usize)
            .sum()
    }

    /// The two-key advisory locks (`objsubid` 2) that sessions named `app` hold now: (pid,
    /// objid, mode).
    async fn two_key_locks(conn: &mut PgConnection, app: &str) -> Vec<(i32, i64, String)> {
        sqlx::query_as(
            "SELECT l.pid, l.objid::bigint, l.mode FROM pg_locks l JOIN pg_stat_activity a \
             USING (pid) WHERE l.locktype = 'advisory' AND l.objsubid = 2 AND l.granted \
             AND a.application_name = $1 ORDER BY 2",
        )
        .bind(app)
        .fetch_all(conn)
        .await
        .expect("pg_locks")
    }

    /// Tasks of three backends (two lock connections each) take permits of a semaphore of 3
    /// for two seconds: never more than 3 holders, by the tasks' count and by the server's,
    /// and 3 at some moment.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn never_more_than_max_count_holders_across_backends() {
        let key = unique_key("sem-contend");
        let mut backends = Vec::new();
        for _ in 0..3 {
            backends.push(backend("connections=2&wait_connections=0").await);
        }
        let watcher = backend("").await;
        let taken = contend(&backends, 4, &key, 3, Duration::from_secs(2), || {
            shown(&watcher, &key)
        })
        .await;
        assert!(taken > 30, "only {taken} permits in 2 s");
        assert_eq!(
            shown(&watcher, &key).await,
            0,
            "every permit was given back"
        );
    }

    /// One lane session (connections=1) shared by every acquisition of a backend, and by
    /// several providers on clones of it: the statement skips the slots the session holds
    /// (the server would grant a session its own advisory lock again), so the session holds
    /// `max_count` distinct slots, and the next try is full. Other backends count too.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn one_lane_session_never_takes_a_slot_it_holds() {
        let key = unique_key("sem-lane");
        let app = format!("semlane{}", std::process::id());
        let one = backend(&format!("connections=1&application_name={app}")).await;
        let clones = [one.clone(), one.clone()];
        let mut conn = admin(PgServer::shared()).await;
        let mut held = Vec::new();
        for i in 0..5 {
            let permit = try_permit(&clones[i % 2], &key, 5)
                .await
                .unwrap_or_else(|| panic!("permit {i} of 5 on one session"));
            held.push(permit);
        }
        assert!(try_permit(&one, &key, 5).await.is_none(), "a sixth permit");
        let locks = two_key_locks(&mut conn, &app).await;
        let slots: Vec<_> = locks.iter().filter(|l| l.2 == "ExclusiveLock").collect();
        assert_eq!(slots.len(), 5, "{locks:?}");
        // The count record: the session holds (class, 5) shared, once for all five.
        let records: Vec<_> = locks.iter().filter(|l| l.2 == "ShareLock").collect();
        assert_eq!(records.len(), 1, "{locks:?}");
        assert_eq!(records[0].1, 5, "{locks:?}");
        assert!(
            slots.iter().all(|l| l.0 == slots[0].0),
            "one session: {slots:?}"
        );
        let mut objids: Vec<i64> = slots.iter().map(|l| l.1).collect();
        objids.dedup();
        assert_eq!(objids, vec![0, 1, 2, 3, 4], "five distinct slots");
        // Another backend, one session too: the semaphore is full for it as well; a permit
        // given back on the first is taken by it.
        let other = backend("connections=1").await;
        assert!(try_permit(&other, &key, 5).await.is_none());
        release(held.pop().unwrap()).await;
        let theirs = try_permit(&other, &key, 5).await.expect("a free slot");
        assert!(try_permit(&one, &key, 5).await.is_none());
        release(theirs).await;
        for permit in held {
            release(permit).await;
        }
        assert_eq!(shown(&one, &key).await, 0);
    }

    /// A try is one round trip (one `Sync` on the wire), whatever the count, and whether it
    /// takes a permit, finds the semaphore full, or is refused for another count; a release
    /// is one more. (The first try of each statement also prepares it, once per session.)
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_try_is_one_round_trip_whatever_the_count() {
        let server = PgServer::shared();
        let target = format!("127.0.0.1:{}", server.port()).parse().unwrap();
        let proxy = Proxy::start(target, Protocol::Postgres).await;
        let url = format!(
            "postgres://postgres@{}/postgres?sslmode=disable&connections=1&wait_connections=0\
             &keepalive=1h",
            proxy.addr
        );
        let through = PostgresBackend::connect(&url).await.expect("connect");
        let key = unique_key("sem-trips");
        // Prepares the statements on the session.
        let warm = try_permit(&through, &key, 1).await.expect("free");
        release(warm).await;
        for n in [1, 1_000_000, u32::MAX] {
            let before = proxy.requests();
            let permit = try_permit(&through, &key, n).await.expect("free");
            assert_eq!(proxy.requests() - before, 1, "a granted try of {n}");
            let before = proxy.requests();
            let message = refused(&through, &key, if n == 1 { 2 } else { 1 }).await;
            assert_eq!(proxy.requests() - before, 1, "a refused try ({message})");
            if n == 1 {
                let before = proxy.requests();
                assert!(try_permit(&through, &key, 1).await.is_none());
                assert_eq!(proxy.requests() - before, 1, "a full try");
            }
            let before = proxy.requests();
            release(permit).await;
            assert_eq!(proxy.requests() - before, 1, "a release");
        }
    }

    /// `u32::MAX` and 1,000,000 are served like 3 (the server counts the live slots in
    /// `pg_locks` and walks at most one more than are held); 0 is a configuration error.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn huge_counts_are_served() {
        let (a, b) = (backend("").await, backend("").await);
        assert_eq!(store(&a).max_permits(), u32::MAX);
        for n in [u32::MAX, 1_000_000] {
            let key = unique_key("sem-huge");
            let started = Instant::now();
            let mut held = Vec::new();
            for backend in [&a, &b, &a] {
                held.push(try_permit(backend, &key, n).await.expect("a permit"));
            }
            assert!(
                started.elapsed() < Duration::from_secs(5),
                "three tries of {n} took {:?}",
                started.elapsed()
            );
            assert_eq!(shown(&a, &key).await, 3);
            assert_eq!(store(&b).holders(&key, n).await.unwrap(), 3);
            for permit in held {
                release(permit).await;
            }
        }
        let err = store(&a)
            .try_acquire_permit(PermitRequest::new("sem-zero", 0))
            .await
            .unwrap_err();
        assert_eq!(err.code(), "DistributedLock.Configuration", "{err}");
    }

    /// The count record: while permits of 2 are held, a try of 5 from another backend is
    /// refused with a message naming both counts (nothing taken), as is `holders`; once
    /// every permit of 2 is given back, 5 is taken and then refuses 2.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn another_count_is_refused_while_permits_are_held() {
        let key = unique_key("sem-count");
        let (a, b) = (backend("").await, backend("").await);
        assert!(store(&a).keeps_count_record());
        let first = try_permit(&a, &key, 2).await.expect("free");
        let second = try_permit(&b, &key, 2).await.expect("free");
        let message = refused(&b, &key, 5).await;
        assert!(
            message.contains("max_count 2") && message.contains("max_count 5"),
            "{message}"
        );
        assert!(store(&a).holders(&key, 5).await.is_err());
        assert_eq!(store(&a).holders(&key, 2).await.unwrap(), 2);
        release(first).await;
        refused(&a, &key, 5).await;
        assert_eq!(shown(&a, &key).await, 1, "the refused tries took nothing");
        release(second).await;
        let mut five = Vec::new();
        for backend in [&a, &b, &a, &b, &a] {
            five.push(try_permit(backend, &key, 5).await.expect("the new count"));
        }
        assert!(try_permit(&b, &key, 5).await.is_none());
        let message = refused(&a, &key, 2).await;
        assert!(message.contains("max_count 5"), "{message}");
        for permit in five {
            release(permit).await;
        }
    }

    /// Tries of 2 and of 5 from several backends at once on fresh semaphores, 30 times: the
    /// tries that get in all used one count, and no more of them than that count (the gate
    /// serializes the count check and the grant).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn two_counts_never_get_in_together() {
        let mut backends = Vec::new();
        for _ in 0..4 {
            backends.push(backend("connections=2").await);
        }
        for round in 0..30 {
            let key = unique_key("sem-race");
            let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(12));
            let mut tries = Vec::new();
            for i in 0..12 {
                let (backend, key, barrier) =
                    (backends[i % 4].clone(), key.clone(), barrier.clone());
                let n = if i % 2 == 0 { 2 } else { 5 };
                tries.push(tokio::spawn(async move {
                    barrier.wait().await;
                    let tried = store(&backend)
                        .try_acquire_permit(PermitRequest::new(&key, n))
                        .await;
                    (n, tried)
                }));
            }
            let mut counts = Vec::new();
            let mut permits = Vec::new();
            for tried in tries {
                match tried.await.unwrap() {
                    (n, Ok(dlock::backend::PermitTry::Acquired(permit))) => {
                        counts.push(n);
                        permits.push(permit);
                    }
                    (_, Ok(_)) => {}
                    (_, Err(LockError::Config { .. })) => {}
                    (n, Err(err)) => panic!("round {round}: a try of {n} failed: {err}"),
                }
            }
            counts.sort_unstable();
            counts.dedup();
            assert_eq!(
                counts.len(),
                1,
                "round {round}: counts {counts:?} got in together"
            );
            assert!(
                permits.len() <= counts[0] as usize,
                "round {round}: {} holders",
                permits.len()
            );
            for permit in permits {
                release(permit).await;
            }
        }
    }

    /// The waiting mark is the semaphore's queue lock: while any session holds it (the
    /// waiter at the head of the queue), a single try is answered full although a permit is
    /// free, and a waiting try is served; once it is given back, single tries are served.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn single_tries_wait_behind_the_head_waiter() {
        let key = unique_key("sem-mark");
        let (tries, waiter) = (backend("").await, backend("").await);
        let queue = PermitRequest::new(&key, 3).queue_key();
        let head = waiter
            .try_acquire(LockRequest::new(&queue))
            .await
            .unwrap()
            .expect("the queue lock is free");
        assert!(
            try_permit(&tries, &key, 3).await.is_none(),
            "a single try went ahead"
        );
        assert_eq!(shown(&tries, &key).await, 0, "nothing was taken");
        let served = try_waiting(&waiter, &key, 3)
            .await
            .expect("the head waiter is served");
        head.handle.release().await.unwrap();
        let single = try_permit(&tries, &key, 3)
            .await
            .expect("no waiter is left");
        release(served).await;
        release(single).await;
    }

    /// Tries cut off at every moment (their futures dropped after 0 to 3 ms) leave nothing
    /// held: each permit a cut-off try got is given back, and the next try is served.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn tries_cut_off_leave_nothing_held() {
        let key = unique_key("sem-cut");
        let (a, watcher) = (backend("connections=1").await, backend("").await);
        for round in 0..60 {
            let cut = Duration::from_micros(fastrand::u64(0..3000));
            if let Ok(Some(permit)) = tokio::time::timeout(cut, try_permit(&a, &key, 1)).await {
                release(permit).await;
            }
            wait_until(
                &format!("round {round}: the cut-off try's permit is given back"),
                Duration::from_secs(5),
                async || shown(&watcher, &key).await == 0,
            )
            .await;
        }
        let last = try_permit(&a, &key, 1).await.expect("free");
        release(last).await;
    }

    /// A permit is lost with its session: terminating the lane's server process fires the
    /// permit's lost token within keepalive + 1 s, and frees its slot for others.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_permit_is_lost_with_its_session() {
        let key = unique_key("sem-lost");
        let app = format!("semlost{}", std::process::id());
        let a = backend(&format!(
            "keepalive=200ms&connections=1&application_name={app}"
        ))
        .await;
        let b = backend("").await;
        let permit = try_permit(&a, &key, 1).await.expect("free");
        assert!(try_permit(&b, &key, 1).await.is_none());
        let mut conn = admin(PgServer::shared()).await;
        let pids: Vec<i32> = sqlx::query_scalar(
            "SELECT l.pid FROM pg_locks l JOIN pg_stat_activity a USING (pid) \
             WHERE l.locktype = 'advisory' AND l.objsubid = 2 AND l.granted \
             AND l.mode = 'ExclusiveLock' AND a.application_name = $1",
        )
        .bind(&app)
        .fetch_all(&mut conn)
        .await
        .unwrap();
        assert_eq!(pids.len(), 1, "the lane's session holds the slot");
        let pid = pids[0];
        let _: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
            .bind(pid)
            .fetch_one(&mut conn)
            .await
            .unwrap();
        tokio::time::timeout(Duration::from_millis(1200), permit.lost.cancelled())
            .await
            .expect("the lost token fired within keepalive + 1 s");
        let again = try_permit(&b, &key, 1).await.expect("the slot is free");
        permit.handle.release().await.unwrap();
        assert_eq!(
            shown(&b, &key).await,
            1,
            "the lost permit's release freed nothing"
        );
        release(again).await;
    }

    /// A holder process killed with SIGKILL frees its permit as soon as the server sees its
    /// connection closed: no lease to run out.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_killed_holder_process_frees_its_permit() {
        let key = unique_key("sem-kill");
        let url = PgServer::shared().url("");
        let holder = PermitHolder::start("permits::permit_holder_child", &url, &key, 1);
        let here = backend("").await;
        assert!(
            try_permit(&here, &key, 1).await.is_none(),
            "the child holds it"
        );
        holder.kill();
        let started = Instant::now();
        let permit = loop {
            if let Some(permit) = try_permit(&here, &key, 1).await {
                break permit;
            }
            assert!(started.elapsed() < Duration::from_secs(5), "never freed");
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        release(permit).await;
    }

    /// The child process of [`a_killed_holder_process_frees_its_permit`].
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[ignore = "the holder process of a_killed_holder_process_frees_its_permit, which runs it"]
    async fn permit_holder_child() {
        hold_in_child(async |url: String| PostgresBackend::connect(&url).await.expect("connect"))
            .await;
    }

    /// With fencing, tokens increase strictly per semaphore across holders and backends, in
    /// the order of the grants, and concurrent holders never share one.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn fencing_tokens_increase_per_semaphore() {
        let key = unique_key("sem-fence");
        let (a, b) = (backend("fencing=true").await, backend("fencing=true").await);
        let mut last = 0;
        let mut held = Vec::new();
        for i in 0..12 {
            let backend = if i % 2 == 0 { &a } else { &b };
            let permit = try_permit(backend, &key, 3).await.expect("a permit");
            let token = permit.fencing_token.expect("fencing=true issues tokens");
            assert!(token > last, "token {token} after {last}");
            last = token;
            held.push(permit);
            if held.len() == 3 {
                release(held.remove(fastrand::usize(..3))).await;
            }
        }
        for permit in held {
            release(permit).await;
        }
        let plain = backend("").await;
        let permit = try_permit(&plain, &unique_key("sem-plain"), 2)
            .await
            .unwrap();
        assert_eq!(permit.fencing_token, None);
        release(permit).await;
    }
}
