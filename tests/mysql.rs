//! The MySQL / MariaDB backend against real throwaway servers, both engines: the conformance
//! suite (with and without fencing), lost detection by `KILL`, server restarts, other
//! processes, SIGKILLed holders, lock name mapping, many locks on few connections, sub-second
//! waits, deadlock errors and bad inputs.
#![cfg(feature = "mysql")]

mod support;

use std::time::{Duration, Instant};

use dlock::mysql::{
    MySqlBackend, acquire_in_transaction, server_lock_name, try_acquire_in_transaction,
};
use dlock::{LockError, LockGuard, LockProvider};
use dlock_testkit::mysql::{DbServer, Flavor};
use dlock_testkit::unique_key;
use sqlx::mysql::{MySqlConnection, MySqlDatabaseError};
use sqlx::{Connection, Executor};
use support::Holder;

const KEEPALIVE: Duration = Duration::from_millis(200);

async fn admin(server: &DbServer) -> MySqlConnection {
    MySqlConnection::connect(&server.url("").replacen("mariadb://", "mysql://", 1))
        .await
        .expect("admin connection")
}

/// The connection id holding the user lock of `key`, if any.
async fn holder(conn: &mut MySqlConnection, key: &str) -> Option<u64> {
    sqlx::query_scalar("SELECT CAST(IS_USED_LOCK(?) AS UNSIGNED)")
        .bind(server_lock_name(key))
        .fetch_one(conn)
        .await
        .expect("IS_USED_LOCK")
}

async fn kill_holder(server: &DbServer, key: &str) {
    let mut conn = admin(server).await;
    let id = holder(&mut conn, key)
        .await
        .expect("someone holds the lock");
    let kill = format!("KILL CONNECTION {id}");
    sqlx::query(sqlx::AssertSqlSafe(kill))
        .execute(&mut conn)
        .await
        .expect("KILL");
}

/// A user of its own on `server` (all privileges, no password), so that a test can pick its
/// sessions out of the process list of a server other tests share; and a URL for it with
/// `options`.
async fn own_user(server: &DbServer, name: &str, options: &str) -> (String, String) {
    let mut conn = admin(server).await;
    let user = format!("dlock_{name}{}", std::process::id());
    for statement in [
        format!("CREATE USER IF NOT EXISTS '{user}'@'127.0.0.1'"),
        format!("GRANT ALL PRIVILEGES ON *.* TO '{user}'@'127.0.0.1'"),
    ] {
        conn.execute(sqlx::AssertSqlSafe(statement)).await.unwrap();
    }
    let sep = if options.is_empty() { "" } else { "?" };
    let url = format!(
        "mysql://{user}@127.0.0.1:{}/dlock_test{sep}{options}",
        server.port()
    );
    (user, url)
}

/// How many sessions of `user` are blocked in `GET_LOCK` on the server right now.
async fn get_lock_waits(conn: &mut MySqlConnection, user: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT COUNT(*) FROM information_schema.PROCESSLIST \
         WHERE STATE = 'User lock' AND USER = ?",
    )
    .bind(user)
    .fetch_one(conn)
    .await
    .expect("read the process list")
}

/// Whether session `id` is blocked in `GET_LOCK` on the server right now.
async fn waits_in_get_lock(conn: &mut MySqlConnection, id: u64) -> bool {
    let waiting: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM information_schema.PROCESSLIST \
         WHERE STATE = 'User lock' AND ID = ?",
    )
    .bind(id)
    .fetch_one(conn)
    .await
    .expect("read the process list");
    waiting == 1
}

/// The server's id of the session behind `conn`.
async fn connection_id(conn: &mut MySqlConnection) -> u64 {
    sqlx::query_scalar("SELECT CONNECTION_ID()")
        .fetch_one(conn)
        .await
        .expect("CONNECTION_ID()")
}

fn number(err: &sqlx::Error) -> Option<u16> {
    match err {
        sqlx::Error::Database(db) => db
            .try_downcast_ref::<MySqlDatabaseError>()
            .map(|e| e.number()),
        _ => None,
    }
}

struct MyHarness {
    server: &'static DbServer,
    options: &'static str,
    fencing: bool,
}

impl dlock_testkit::Harness for MyHarness {
    async fn provider(&self) -> LockProvider {
        LockProvider::connect(&self.server.url(self.options))
            .await
            .expect("connect")
    }

    async fn break_lock(&self, guard: &LockGuard) {
        kill_holder(self.server, guard.key()).await;
    }

    fn lost_within(&self) -> Duration {
        KEEPALIVE + Duration::from_secs(1)
    }

    fn retake_within(&self) -> Duration {
        // KILL only flags the session; under load the server can take a moment to end it.
        Duration::from_secs(5)
    }

    fn fencing(&self) -> bool {
        self.fencing
    }

    /// MySQL/MariaDB list user locks from `performance_schema`, which the shared test servers
    /// run without (see `store_inspection` below, on servers that have it).
    fn store_inspection(&self) -> dlock_testkit::StoreInspection {
        dlock_testkit::StoreInspection::Unsupported
    }

    async fn shared_providers(&self, count: usize) -> Vec<LockProvider> {
        let url = self.server.url(&format!("{}&connections=1", self.options));
        let backend = dlock::mysql::MySqlBackend::connect(&url)
            .await
            .expect("connect");
        (0..count)
            .map(|_| LockProvider::from_backend(backend.clone()))
            .collect()
    }
}

/// Generates the tests of one engine. A missing server skips them (fails under CI).
macro_rules! engine_tests {
    ($module:ident, $flavor:expr) => {
        mod $module {
            use super::*;

            fn server() -> Option<&'static DbServer> {
                DbServer::shared($flavor)
            }

            mod fenced {
                use super::*;

                async fn harness() -> Option<MyHarness> {
                    Some(MyHarness {
                        server: server()?,
                        options: "keepalive=200ms&fencing=true",
                        fencing: true,
                    })
                }

                dlock_testkit::conformance_suite!(optional harness());
            }

            mod plain {
                use super::*;

                async fn harness() -> Option<MyHarness> {
                    Some(MyHarness {
                        server: server()?,
                        options: "keepalive=200ms",
                        fencing: false,
                    })
                }

                dlock_testkit::conformance_suite!(optional harness());
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn killed_connections_are_detected() {
                let Some(server) = server() else { return };
                killed_connections(server).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn provider_recovers_from_a_server_restart() {
                let Some(server) = DbServer::start($flavor) else {
                    return;
                };
                server_restart(server).await;
            }

            #[test]
            fn multi_process_exclusion() {
                let Some(server) = server() else { return };
                support::run_multi_process(
                    &server.url("fencing=true"),
                    &unique_key("mp"),
                    4,
                    30,
                    support::Fencing::Every,
                );
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn store_inspection_lists_user_locks_or_says_what_it_needs() {
                let Some(server) = server() else { return };
                store_inspection(server, false).await;
                let Some(inspectable) = DbServer::start_with_performance_schema($flavor) else {
                    return;
                };
                store_inspection(&inspectable, true).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn killed_holder_frees_the_lock_at_once() {
                let Some(server) = server() else { return };
                killed_holder(server).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn fencing_counts_per_database_while_locks_are_the_servers() {
                let Some(server) = server() else { return };
                fencing_tables_are_per_database(server).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn distinct_keys_never_share_a_server_lock() {
                let Some(server) = server() else { return };
                name_mapping(server).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn thousand_locks_on_eight_connections() {
                let Some(server) = server() else { return };
                thousand_locks(server).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn sub_second_timeouts_are_honoured() {
                let Some(server) = server() else { return };
                sub_second(server).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn get_lock_deadlocks_are_errors_not_hangs() {
                let Some(server) = server() else { return };
                deadlock(server).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn errors_and_unsupported_operations_are_clear() {
                let Some(server) = server() else { return };
                errors(server).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn two_statements_per_acquire_and_release() {
                // A server of its own: the counters are global.
                let Some(server) = DbServer::start($flavor) else {
                    return;
                };
                statements_per_cycle(&server).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_wait_cancelled_as_its_key_is_released_never_leaves_it_held() {
                let Some(server) = server() else { return };
                cancel_race(server).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn backend_from_an_existing_pool() {
                let Some(server) = server() else { return };
                from_pool(server).await;
            }

            /// Semaphores as the engine keeps them (its permit store, asked directly).
            mod permits {
                use super::*;

                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn never_more_than_max_count_holders_across_backends() {
                    let Some(server) = server() else { return };
                    permit_cases::contention(server).await;
                }

                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn a_walk_takes_one_slot_and_never_one_the_session_holds() {
                    let Some(server) = server() else { return };
                    permit_cases::one_slot_per_walk(server).await;
                }

                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn a_try_is_one_statement_whatever_the_count() {
                    // A server of its own: the counters are global.
                    let Some(server) = DbServer::start($flavor) else {
                        return;
                    };
                    permit_cases::statements_per_try(&server).await;
                }

                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn counts_past_the_bound_are_refused_before_any_statement() {
                    let Some(server) = server() else { return };
                    permit_cases::bounds(server).await;
                }

                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn the_count_is_not_recorded() {
                    let Some(server) = server() else { return };
                    permit_cases::no_count_record(server).await;
                }

                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn single_tries_wait_behind_the_head_waiter() {
                    let Some(server) = server() else { return };
                    permit_cases::waiting_mark(server).await;
                }

                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn tries_cut_off_leave_nothing_held() {
                    let Some(server) = server() else { return };
                    permit_cases::cut_off(server).await;
                }

                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn a_permit_is_lost_with_its_session() {
                    let Some(server) = server() else { return };
                    permit_cases::lost(server).await;
                }

                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn a_killed_holder_process_frees_its_permit() {
                    let Some(server) = server() else { return };
                    permit_cases::killed_holder(
                        server,
                        concat!(stringify!($module), "::permits::permit_holder_child"),
                    )
                    .await;
                }

                /// The child process of `a_killed_holder_process_frees_its_permit`.
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                #[ignore = "the holder process of a_killed_holder_process_frees_its_permit, which runs it"]
                async fn permit_holder_child() {
                    support::permits::hold_in_child(async |url: String| {
                        MySqlBackend::connect(&url).await.expect("connect")
                    })
                    .await;
                }

                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn fencing_tokens_increase_per_semaphore() {
                    let Some(server) = server() else { return };
                    permit_cases::fencing(server).await;
                }
            }
        }
    };
}

engine_tests!(mariadb, Flavor::MariaDb);
engine_tests!(oracle_mysql, Flavor::MySql);

/// Races a wait's cancellation against its key's release, 100 times, once the wait is
/// blocked in `GET_LOCK` on the server: the server may grant the key to the wait's session
/// while the `KILL` that ends it takes effect, and the engine must not count the wait as over
/// until that session has gone, or the waiting provider's next try finds the key held.
async fn cancel_race(server: &DbServer) {
    let (user, url) = own_user(server, "cancelrace", "").await;
    let a = LockProvider::connect(&url).await.unwrap();
    let b = LockProvider::connect(&url).await.unwrap();
    let mut conn = admin(server).await;
    let cancelled = dlock_testkit::conformance::cancel_race(&a, &b, 100, async |_key: &str| {
        get_lock_waits(&mut conn, &user).await == 1
    })
    .await;
    eprintln!("{cancelled} of 100 waits ended cancelled");
}

/// The server's statement counters: `Questions` and every `Com_*`.
async fn statement_counters(conn: &mut MySqlConnection) -> std::collections::HashMap<String, u64> {
    let rows: Vec<(String, String)> = sqlx::query_as(
        "SHOW GLOBAL STATUS WHERE Variable_name = 'Questions' OR Variable_name LIKE 'Com\\_%'",
    )
    .fetch_all(conn)
    .await
    .expect("SHOW GLOBAL STATUS");
    rows.into_iter()
        .filter_map(|(name, value)| Some((name, value.parse().ok()?)))
        .collect()
}

/// What an uncontended acquire + release costs the server: after warming up (every lane has
/// opened its session and prepared its statements), each cycle runs `GET_LOCK` and
/// `RELEASE_LOCK` and nothing else (no `SET`, no `DO`, no fencing statement with fencing off,
/// no new prepare), as a raw driver does with the same two statements. Counted by the server's
/// `Questions` and `Com_*` counters on a server of the test's own (which do not count
/// `COM_PING`).
async fn statements_per_cycle(server: &DbServer) {
    const CYCLES: u64 = 20;
    let mut admin = admin(server).await;
    let locks = LockProvider::connect(&server.url("")).await.unwrap();
    let key = unique_key("cycle");
    // More cycles than lanes: every lane has its session and its prepared statements.
    for _ in 0..40 {
        locks
            .try_acquire(&key)
            .await
            .unwrap()
            .release()
            .await
            .unwrap();
    }
    let before = statement_counters(&mut admin).await;
    for _ in 0..CYCLES {
        locks
            .try_acquire(&key)
            .await
            .unwrap()
            .release()
            .await
            .unwrap();
    }
    let after = statement_counters(&mut admin).await;
    let delta =
        |name: &str| after.get(name).copied().unwrap_or(0) - before.get(name).copied().unwrap_or(0);
    let mut changed: Vec<(String, u64)> = after
        .keys()
        .map(|name| (name.clone(), delta(name)))
        .filter(|(_, n)| *n > 0)
        .collect();
    changed.sort();
    eprintln!("{CYCLES} cycles: {changed:?}");
    // The second count of the admin connection (a prepared statement too) counts itself.
    assert_eq!(delta("Questions"), 2 * CYCLES + 1, "{changed:?}");
    assert_eq!(delta("Com_show_status"), 1, "{changed:?}");
    assert_eq!(delta("Com_stmt_execute"), 2 * CYCLES + 1, "{changed:?}");
    assert_eq!(delta("Com_select"), 2 * CYCLES, "{changed:?}");
    assert_eq!(
        delta("Com_stmt_prepare"),
        0,
        "statements stay prepared: {changed:?}"
    );
    let others: Vec<_> = changed
        .iter()
        .filter(|(name, _)| {
            !matches!(
                name.as_str(),
                "Questions" | "Com_show_status" | "Com_stmt_execute" | "Com_select"
            )
        })
        .collect();
    assert!(others.is_empty(), "no other statement: {others:?}");

    // The raw driver's two statements on a pooled connection count the same.
    let pool = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(1)
        .test_before_acquire(false)
        .connect(&server.url("").replacen("mariadb://", "mysql://", 1))
        .await
        .unwrap();
    let name = server_lock_name(&key);
    let raw = async || {
        let mut conn = pool.acquire().await.unwrap();
        let got: Option<i64> = sqlx::query_scalar("SELECT GET_LOCK(?, 0)")
            .bind(&name)
            .fetch_one(&mut *conn)
            .await
            .unwrap();
        assert_eq!(got, Some(1));
        let released: Option<i64> = sqlx::query_scalar("SELECT RELEASE_LOCK(?)")
            .bind(&name)
            .fetch_one(&mut *conn)
            .await
            .unwrap();
        assert_eq!(released, Some(1));
    };
    raw().await;
    let before = statement_counters(&mut admin).await;
    for _ in 0..CYCLES {
        raw().await;
    }
    let after = statement_counters(&mut admin).await;
    let raw_delta =
        |name: &str| after.get(name).copied().unwrap_or(0) - before.get(name).copied().unwrap_or(0);
    assert_eq!(
        raw_delta("Questions"),
        delta("Questions"),
        "dlock runs what the raw driver runs"
    );
    assert_eq!(raw_delta("Com_stmt_execute"), delta("Com_stmt_execute"));
}

/// 20 trials: the session behind a held lock is killed, and the guard's lost token fires
/// within keepalive + 1 s, for locks on lock connections and on wait connections alike.
async fn killed_connections(server: &DbServer) {
    let (user, url) = own_user(
        server,
        "kc",
        "keepalive=100ms&connections=2&wait_connections=2",
    )
    .await;
    let a = LockProvider::connect(&url).await.unwrap();
    let b = LockProvider::connect(&url).await.unwrap();
    let limit = Duration::from_millis(100) + Duration::from_secs(1);
    let mut conn = admin(server).await;
    let mut slowest = Duration::ZERO;
    for trial in 0..20 {
        let key = unique_key("kill");
        let guard = if trial % 2 == 0 {
            a.try_acquire(&key).await.expect("free key")
        } else {
            // Contended, so it is granted to a native wait on a wait connection.
            let other = b.try_acquire(&key).await.unwrap();
            let first = holder(&mut conn, &key).await;
            let waiter = {
                let (a, key) = (a.clone(), key.clone());
                tokio::spawn(async move { a.acquire(&key, Duration::from_secs(10)).await })
            };
            // Wait until the waiter is blocked in GET_LOCK on the server (this test's own
            // user: `b` holds and `a` waits, so the one waiting session is `a`'s), then hand
            // over.
            dlock_testkit::wait_until(
                "the waiter waits on the server",
                Duration::from_secs(5),
                async || get_lock_waits(&mut conn, &user).await == 1,
            )
            .await;
            other.release().await.unwrap();
            let g = waiter.await.unwrap().expect("waiter gets the lock");
            assert_ne!(holder(&mut conn, &key).await, first);
            g
        };
        kill_holder(server, &key).await;
        let started = Instant::now();
        tokio::time::timeout(limit, guard.lost_token().cancelled())
            .await
            .unwrap_or_else(|_| panic!("trial {trial}: lost token did not fire within {limit:?}"));
        slowest = slowest.max(started.elapsed());
        assert!(matches!(guard.release().await, Err(LockError::Lost { .. })));
        // The key is free again once the server has ended the killed session (it does so
        // asynchronously after KILL; under load that can take a moment).
        b.acquire(&key, Duration::from_secs(5))
            .await
            .expect("free after the kill")
            .release()
            .await
            .unwrap();
    }
    println!("slowest lost detection: {slowest:?}");
    let g = a.try_acquire(&unique_key("after")).await.unwrap();
    g.release().await.unwrap();
}

/// A server crash is reported as lost locks and unavailability (not a hang); once the server
/// is back, the provider works again with fresh connections.
async fn server_restart(mut server: DbServer) {
    let url = server.url("keepalive=200ms&connect_timeout=2s");
    let locks = LockProvider::connect(&url).await.unwrap();
    let other = LockProvider::connect(&url).await.unwrap();
    let key = unique_key("restart");
    let guard = locks.try_acquire(&key).await.unwrap();
    // One lock on a wait connection too.
    let waited_key = unique_key("restart-wait");
    let blocker = other.try_acquire(&waited_key).await.unwrap();
    let waiter = {
        let (locks, k) = (locks.clone(), waited_key.clone());
        tokio::spawn(async move { locks.acquire(&k, Duration::from_secs(10)).await })
    };
    // Hand over once the waiter waits on the server (this server is the test's own), so that
    // the lock is granted to a wait connection.
    let mut conn = admin(&server).await;
    dlock_testkit::wait_until(
        "the waiter waits on the server",
        Duration::from_secs(5),
        async || get_lock_waits(&mut conn, "root").await == 1,
    )
    .await;
    drop(conn);
    blocker.release().await.unwrap();
    let waited = waiter.await.unwrap().expect("waiter");
    server.stop();
    for g in [&guard, &waited] {
        tokio::time::timeout(
            KEEPALIVE + Duration::from_secs(1),
            g.lost_token().cancelled(),
        )
        .await
        .expect("lost token fires when the server dies");
    }
    let started = Instant::now();
    match locks
        .acquire(&unique_key("down"), Duration::from_secs(1))
        .await
    {
        Err(err @ LockError::Unavailable { .. }) => {
            assert!(!err.to_string().contains("mysql://"), "{err}")
        }
        other => panic!("expected Unavailable while the server is down, got {other:?}"),
    }
    assert!(started.elapsed() < Duration::from_secs(5));
    assert!(matches!(guard.release().await, Err(LockError::Lost { .. })));
    assert!(matches!(
        waited.release().await,
        Err(LockError::Lost { .. })
    ));
    server.resume();
    let g = locks
        .acquire(&key, Duration::from_secs(5))
        .await
        .expect("the provider recovers");
    let g2 = locks.try_acquire(&waited_key).await.unwrap();
    g.release().await.unwrap();
    g2.release().await.unwrap();
}

/// Store inspection reads `performance_schema.metadata_locks`: where it is on and its
/// metadata lock instrument enabled (MySQL's defaults), user locks held by any session are
/// listed (by key where the name is the key, or the lister holds it; a hashed name elsewhere
/// by its server name) and released ones are not; where it is off (MariaDB's default), or
/// for a user who may not read it, the answer is `Unsupported` saying what is missing.
async fn store_inspection(server: &DbServer, inspectable: bool) {
    let mut conn = admin(server).await;
    let (on, instrumented): (i64, i64) = sqlx::query_as(
        "SELECT CAST(@@performance_schema AS SIGNED), (SELECT COUNT(*) FROM \
         performance_schema.setup_instruments WHERE NAME = 'wait/lock/metadata/sql/mdl' \
         AND ENABLED = 'YES')",
    )
    .fetch_one(&mut conn)
    .await
    .expect("performance_schema state");
    assert_eq!(
        on == 1 && instrumented == 1,
        inspectable,
        "performance_schema {on}, metadata lock instrument {instrumented}"
    );
    let a = LockProvider::connect(&server.url("")).await.unwrap();
    let b = LockProvider::connect(&server.url("")).await.unwrap();
    let plain = format!("inspected-{}", std::process::id());
    let hashed = unique_key("Inspected Key");
    if on == 1 && instrumented == 1 {
        let held = a.try_acquire(&plain).await.unwrap();
        let long = a.try_acquire(&hashed).await.unwrap();
        let listed = b.store_locks().await.expect("store inspection");
        assert!(
            listed
                .iter()
                .any(|lock| lock.key.as_deref() == Some(plain.as_str())),
            "{plain} is listed: {listed:?}"
        );
        let name = server_lock_name(&hashed);
        let seen = listed
            .iter()
            .find(|lock| lock.resource == name)
            .unwrap_or_else(|| panic!("{name} is listed: {listed:?}"));
        assert_eq!(seen.key, None, "a hashed name is not a key elsewhere");
        let mine = a.store_locks().await.expect("store inspection");
        assert!(
            mine.iter().any(|lock| lock.resource == name
                && lock.key.as_deref() == Some(hashed.as_str())
                && lock.held_here),
            "the holder names its hashed lock by key: {mine:?}"
        );
        held.release().await.unwrap();
        long.release().await.unwrap();
        let after = b.store_locks().await.expect("store inspection");
        assert!(
            after
                .iter()
                .all(|lock| lock.resource != plain && lock.resource != name),
            "released locks are listed: {after:?}"
        );
    } else {
        match b.store_locks().await {
            Err(LockError::Unsupported {
                operation, message, ..
            }) => {
                assert_eq!(operation, "store inspection");
                assert!(message.contains("performance_schema"), "{message}");
            }
            other => panic!("store inspection without performance_schema: {other:?}"),
        }
    }
    // A user with no privilege on performance_schema is told which grant is missing.
    let user = format!("dlock_noinspect{}", std::process::id());
    for statement in [
        format!("CREATE USER IF NOT EXISTS '{user}'@'127.0.0.1'"),
        format!("GRANT SELECT ON dlock_test.* TO '{user}'@'127.0.0.1'"),
    ] {
        conn.execute(sqlx::AssertSqlSafe(statement)).await.unwrap();
    }
    let url = format!("mysql://{user}@127.0.0.1:{}/dlock_test", server.port());
    let limited = LockProvider::connect(&url).await.unwrap();
    match limited.store_locks().await {
        Err(LockError::Unsupported { message, .. }) => {
            assert!(
                message.contains("GRANT SELECT ON performance_schema.*")
                    || message.contains("performance_schema=ON"),
                "{message}"
            );
        }
        other => panic!("store inspection without the grant: {other:?}"),
    }
}

async fn killed_holder(server: &DbServer) {
    let url = server.url("");
    let key = unique_key("sigkill");
    let holder_process = Holder::start(&url, &key);
    let locks = LockProvider::connect(&url).await.unwrap();
    assert!(matches!(
        locks.try_acquire(&key).await,
        Err(LockError::AlreadyHeld { .. })
    ));
    holder_process.kill();
    // The server ends the session when the socket closes: no lease to run out.
    let g = locks
        .acquire(&key, Duration::from_secs(3))
        .await
        .expect("the killed holder's lock is free");
    g.release().await.unwrap();
}

/// Keys that a case-folding, length-limited server could confuse are all held at once, each
/// on its own server lock.
/// `GET_LOCK` names are the server's, not a database's: two providers whose URLs name other
/// databases take the same lock `k`, but each counts its fencing tokens in its own database's
/// `dlock_fencing`, so their tokens are not ordered with each other. The module docs say so
/// (every process that locks a key must name the same database); this pins it.
async fn fencing_tables_are_per_database(server: &DbServer) {
    let mut root = MySqlConnection::connect(&server.url_without_database())
        .await
        .unwrap();
    root.execute("CREATE DATABASE IF NOT EXISTS dlock_other")
        .await
        .unwrap();
    let url = server.url("fencing=true");
    let a = LockProvider::connect(&url).await.unwrap();
    let b = LockProvider::connect(&url.replace("/dlock_test", "/dlock_other"))
        .await
        .unwrap();
    let key = unique_key("per-db");
    let mut last = 0;
    for _ in 0..3 {
        let guard = a.try_acquire(&key).await.unwrap();
        last = guard.fencing_token().unwrap();
        // One lock for both databases.
        assert!(matches!(
            b.try_acquire(&key).await,
            Err(LockError::AlreadyHeld { .. })
        ));
        guard.release().await.unwrap();
    }
    let other = b.try_acquire(&key).await.unwrap();
    assert!(
        other.fencing_token().unwrap() < last,
        "{:?} after {last}: the other database's counter",
        other.fencing_token()
    );
    other.release().await.unwrap();
}

async fn name_mapping(server: &DbServer) {
    let a = LockProvider::connect(&server.url("")).await.unwrap();
    let b = LockProvider::connect(&server.url("")).await.unwrap();
    let salt = unique_key("names").replace(':', "-");
    let long = "l".repeat(64);
    let suffixes: Vec<String> = vec![
        // case
        "jobs".into(),
        "Jobs".into(),
        "JOBS".into(),
        "jObS".into(),
        // length: beyond 64 characters, sharing the first 64
        long.clone(),
        format!("{long}1"),
        format!("{long}2"),
        "l".repeat(5000),
        "L".repeat(5000),
        // unicode: composed and decomposed, case pairs, lookalikes
        "é".into(),
        "e\u{301}".into(),
        "É".into(),
        "ß".into(),
        "ss".into(),
        "SS".into(),
        "ı".into(),
        "i".into(),
        "İ".into(),
        "鍵".into(),
        "ключ".into(),
        "КЛЮЧ".into(),
        // awkward bytes
        "a b".into(),
        "ab".into(),
        "a\0b".into(),
        "a#b".into(),
        "".into(),
    ];
    let keys: Vec<String> = suffixes.iter().map(|s| format!("{salt}{s}")).collect();
    let mut guards = Vec::new();
    for key in &keys {
        guards.push(
            a.try_acquire(key)
                .await
                .unwrap_or_else(|e| panic!("{key:?} collides with an earlier key: {e}")),
        );
    }
    let mut conn = admin(server).await;
    let mut names = std::collections::HashSet::new();
    for key in &keys {
        let name = server_lock_name(key);
        assert!(name.len() <= 64, "{name}");
        // Each name is held on the server, and no two keys share one even case-folded.
        assert!(
            holder(&mut conn, key).await.is_some(),
            "{key:?} is not held"
        );
        assert!(names.insert(name.to_lowercase()), "{key:?} shares {name}");
        assert!(matches!(
            b.try_acquire(key).await,
            Err(LockError::AlreadyHeld { .. })
        ));
    }
    for g in guards {
        g.release().await.unwrap();
    }
    for key in &keys {
        assert_eq!(holder(&mut conn, key).await, None, "{key:?} still held");
    }
}

/// 1,000 locks held at once, with waits in flight, on at most 8 server connections.
async fn thousand_locks(server: &DbServer) {
    let mut conn = admin(server).await;
    let (user, url) = own_user(server, "k", "keepalive=1s").await;
    let locks = LockProvider::connect(&url).await.unwrap();
    let other = LockProvider::connect(&server.url("")).await.unwrap();
    let prefix = unique_key("thousand");
    let mut guards = Vec::with_capacity(1006);
    for chunk in 0..4 {
        let batch = futures::future::try_join_all((0..250).map(|i| {
            let (locks, key) = (locks.clone(), format!("{prefix}:{chunk}:{i}"));
            async move { locks.try_acquire(&key).await }
        }))
        .await
        .expect("1,000 free keys");
        guards.extend(batch);
    }
    assert_eq!(locks.local_key_count(), 1000);
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
    // Every wait connection (4, the default) waits on the server; the other two waits poll.
    dlock_testkit::wait_until(
        "the waits reach the server",
        Duration::from_secs(10),
        async || get_lock_waits(&mut conn, &user).await == 4,
    )
    .await;
    let count = || async {
        let mut c = admin(server).await;
        sqlx::query_scalar::<_, i64>(
            "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE USER = ?",
        )
        .bind(&user)
        .fetch_one(&mut c)
        .await
        .unwrap()
    };
    let connections = count().await;
    assert!(
        (1..=8).contains(&connections),
        "{connections} connections for 1,000 locks"
    );
    for g in held_elsewhere {
        g.release().await.unwrap();
    }
    for w in waiters {
        guards.push(w.await.unwrap().expect("waiter"));
    }
    let connections = count().await;
    assert!(connections <= 8, "{connections} connections");
    // Every lock is held on the server by one of those connections.
    let mut holders = std::collections::HashSet::new();
    for g in &guards {
        holders.insert(holder(&mut conn, g.key()).await.expect("held"));
    }
    assert!(holders.len() <= 8, "{} holding sessions", holders.len());
    futures::future::try_join_all(guards.into_iter().map(LockGuard::release))
        .await
        .unwrap();
    assert_eq!(locks.local_key_count(), 0);
}

/// Timeouts below and between whole seconds are neither cut short nor overslept by a second,
/// and a wait still gets a lock freed in its last fraction of a second.
async fn sub_second(server: &DbServer) {
    let a = LockProvider::connect(&server.url("")).await.unwrap();
    let b = LockProvider::connect(&server.url("")).await.unwrap();
    let key = unique_key("subsecond");
    let guard = a.try_acquire(&key).await.unwrap();
    for ms in [150u64, 700, 1300] {
        let timeout = Duration::from_millis(ms);
        let started = Instant::now();
        assert!(matches!(
            b.acquire(&key, timeout).await,
            Err(LockError::Timeout { .. })
        ));
        let elapsed = started.elapsed();
        assert!(
            elapsed >= timeout,
            "{timeout:?}: answered after {elapsed:?}"
        );
        assert!(
            elapsed < timeout + Duration::from_millis(600),
            "{timeout:?}: answered after {elapsed:?}"
        );
    }
    // Freed 1.3 s into a 1.6 s wait: past the whole second a whole-second server waits.
    let release = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(1300)).await;
        guard.release().await
    });
    let started = Instant::now();
    let got = b
        .acquire(&key, Duration::from_millis(1600))
        .await
        .expect("granted in the last fraction of a second");
    assert!(started.elapsed() >= Duration::from_millis(1250));
    release.await.unwrap().unwrap();
    got.release().await.unwrap();
}

/// A lock-order inversion that goes through dlock ends in errors at the acquisition's timeout,
/// never in a hang, and the locks held meanwhile stay held and exclusive.
///
/// dlock's waits run on sessions that hold nothing while they wait, so the server never sees
/// a cycle through them (nothing for it to refuse): the timeout alone ends the deadlock.
/// - Two providers each hold one key and wait for the other's: both waits answer `Timeout`,
///   after the timeout and not much later, and each key is still held by its provider.
/// - A provider holds X and waits for Y while another program's session holds Y and waits
///   for X in `GET_LOCK`: the provider's wait answers `Timeout`, the other session keeps
///   waiting (X is still held), and gets X as soon as the provider lets go.
/// - Plain sessions that close a cycle themselves are refused by the server with the error
///   numbers the backend maps to its deadlock error (3058 on MySQL, 1213 on MariaDB), at once.
async fn deadlock(server: &DbServer) {
    const WAIT: Duration = Duration::from_millis(1500);
    // MySQL waits whole seconds on the server, then tries until the deadline.
    const LATE: Duration = Duration::from_secs(1);
    let answered_in_time = |what: &str, outcome: &Result<LockGuard, LockError>, took: Duration| {
        assert!(
            matches!(outcome, Err(LockError::Timeout { .. })),
            "{what}: expected Timeout, got {outcome:?}"
        );
        assert!(
            took >= WAIT,
            "{what}: answered after {took:?}, before the timeout"
        );
        assert!(
            took < WAIT + LATE,
            "{what}: the deadlock held the wait for {took:?} ({WAIT:?} timeout)"
        );
    };
    let (x, y) = (unique_key("dl-x"), unique_key("dl-y"));
    let a = LockProvider::connect(&server.url("")).await.unwrap();
    let b = LockProvider::connect(&server.url("")).await.unwrap();

    // Two providers, each holding what the other waits for.
    let held_x = a.try_acquire(&x).await.expect("x is free");
    let held_y = b.try_acquire(&y).await.expect("y is free");
    let started = Instant::now();
    let (a_wants_y, b_wants_x) = tokio::join!(
        async { (a.acquire(&y, WAIT).await, started.elapsed()) },
        async { (b.acquire(&x, WAIT).await, started.elapsed()) },
    );
    answered_in_time("a waiting for y", &a_wants_y.0, a_wants_y.1);
    answered_in_time("b waiting for x", &b_wants_x.0, b_wants_x.1);
    assert!(matches!(
        b.try_acquire(&x).await,
        Err(LockError::AlreadyHeld { .. })
    ));
    assert!(matches!(
        a.try_acquire(&y).await,
        Err(LockError::AlreadyHeld { .. })
    ));
    held_y.release().await.unwrap();

    // A provider and another program's session.
    let mut other = admin(server).await;
    let other_id = connection_id(&mut other).await;
    let take = |name: String, secs: u64| {
        sqlx::query_scalar::<_, Option<i64>>("SELECT GET_LOCK(?, ?)")
            .bind(name)
            .bind(secs)
    };
    assert_eq!(
        take(server_lock_name(&y), 0)
            .fetch_one(&mut other)
            .await
            .unwrap(),
        Some(1)
    );
    let other_wants_x = tokio::spawn({
        let name = server_lock_name(&x);
        async move {
            let got = take(name, 30).fetch_one(&mut other).await;
            (got.map_err(|e| number(&e)), Instant::now())
        }
    });
    let mut conn = admin(server).await;
    dlock_testkit::wait_until(
        "the other session waits for x on the server",
        Duration::from_secs(5),
        async || waits_in_get_lock(&mut conn, other_id).await,
    )
    .await;
    let started = Instant::now();
    let a_wants_y = a.acquire(&y, WAIT).await;
    answered_in_time(
        "a waiting for y, held by the other session",
        &a_wants_y,
        started.elapsed(),
    );
    assert!(
        waits_in_get_lock(&mut conn, other_id).await && !other_wants_x.is_finished(),
        "x was given to the other session while a held it"
    );
    let released = Instant::now();
    held_x.release().await.unwrap();
    let (got, at) = tokio::time::timeout(Duration::from_secs(5), other_wants_x)
        .await
        .expect("the other session gets x once a lets go")
        .unwrap();
    assert_eq!(got, Ok(Some(1)), "the other session's GET_LOCK of x");
    assert!(at >= released);

    // Plain sessions closing a cycle: refused by the server, with the numbers the backend maps.
    let mut s1 = admin(server).await;
    let mut s2 = admin(server).await;
    let s1_id = connection_id(&mut s1).await;
    let (p, q) = (unique_key("dl-p"), unique_key("dl-q"));
    let (np, nq) = (server_lock_name(&p), server_lock_name(&q));
    assert_eq!(
        take(np.clone(), 0).fetch_one(&mut s1).await.unwrap(),
        Some(1)
    );
    assert_eq!(
        take(nq.clone(), 0).fetch_one(&mut s2).await.unwrap(),
        Some(1)
    );
    let first = tokio::spawn(async move {
        let r = take(nq, 20).fetch_one(&mut s1).await;
        (r.map_err(|e| number(&e)), s1)
    });
    dlock_testkit::wait_until(
        "the first session waits on the server",
        Duration::from_secs(5),
        async || waits_in_get_lock(&mut conn, s1_id).await,
    )
    .await;
    let started = Instant::now();
    let second = take(np, 20).fetch_one(&mut s2).await;
    // Whichever wait the server refused, it refused with a deadlock error number.
    let refused = match second {
        Err(err) => number(&err),
        Ok(_) => {
            let (r, _s1) = first.await.unwrap();
            r.expect_err("one of the two waits is refused")
        }
    };
    assert!(
        matches!(refused, Some(3058 | 1213)),
        "deadlock error number {refused:?}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "the deadlock hung"
    );
    drop(s2);
}

async fn errors(server: &DbServer) {
    // Transaction-bound locks: a clear Unsupported.
    let mut conn = admin(server).await;
    let err = try_acquire_in_transaction(&mut conn, "k")
        .await
        .unwrap_err();
    assert_eq!(err.code(), "DistributedLock.Unsupported", "{err}");
    assert!(err.to_string().contains("transaction"), "{err}");
    assert!(matches!(
        acquire_in_transaction(&mut conn, "k", Duration::from_secs(1)).await,
        Err(LockError::Unsupported { .. })
    ));

    // Fencing needs a database.
    let err = LockProvider::connect(&format!("{}?fencing=true", server.url_without_database()))
        .await
        .unwrap_err();
    assert_eq!(err.code(), "DistributedLock.Configuration", "{err}");

    // Wrong password: a configuration error that does not repeat the password.
    conn.execute("CREATE USER IF NOT EXISTS 'locker'@'127.0.0.1' IDENTIFIED BY 'right-password'")
        .await
        .unwrap();
    conn.execute("GRANT ALL PRIVILEGES ON dlock_test.* TO 'locker'@'127.0.0.1'")
        .await
        .unwrap();
    let port = server.port();
    let ok = LockProvider::connect(&format!(
        "mysql://locker:right-password@127.0.0.1:{port}/dlock_test"
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
        "mariadb://locker:wrong-secret@127.0.0.1:{port}/dlock_test"
    ))
    .await
    .unwrap_err();
    assert_eq!(err.code(), "DistributedLock.Configuration", "{err}");
    assert!(!err.to_string().contains("wrong-secret"), "{err}");

    // Nothing listens: Unavailable, quickly.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let closed_port = closed.local_addr().unwrap().port();
    drop(closed);
    let err = LockProvider::connect(&format!(
        "mysql://u:secret@127.0.0.1:{closed_port}/db?connect_timeout=2s"
    ))
    .await
    .unwrap_err();
    assert_eq!(err.code(), "DistributedLock.Unavailable", "{err}");
    assert!(!err.to_string().contains("secret"), "{err}");

    // Something accepts but never answers: the connect timeout holds.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let silent_port = silent.local_addr().unwrap().port();
    let started = Instant::now();
    let err = LockProvider::connect(&format!(
        "mysql://u@127.0.0.1:{silent_port}/db?connect_timeout=500ms"
    ))
    .await
    .unwrap_err();
    assert_eq!(err.code(), "DistributedLock.Unavailable", "{err}");
    assert!(started.elapsed() < Duration::from_secs(2));
    drop(silent);

    for bad in [
        "mysql://h/db?fencing=maybe",
        "mysql://h/db?connections=0",
        "mariadb://h/db?nonsense_option_x=1",
    ] {
        let err = LockProvider::connect(bad).await.unwrap_err();
        assert_eq!(err.code(), "DistributedLock.Configuration", "{bad}: {err}");
    }
}

async fn from_pool(server: &DbServer) {
    let pool = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(2)
        .connect(&server.url("").replacen("mariadb://", "mysql://", 1))
        .await
        .unwrap();
    let backend = MySqlBackend::builder_from_pool(&pool)
        .fencing(true)
        .keepalive(Duration::from_secs(1))
        .connections(1)
        .wait_connections(0)
        .open()
        .await
        .unwrap();
    assert!(backend.fencing());
    assert_eq!(
        backend.is_mariadb(),
        server.flavor == Flavor::MariaDb,
        "{}",
        backend.server_version()
    );
    let locks = LockProvider::from_backend(backend);
    let key = unique_key("pool");
    let g = locks.acquire(&key, Duration::from_secs(1)).await.unwrap();
    let first = g.fencing_token().expect("token");
    // With no wait connections, another provider's wait polls and times out.
    let other = LockProvider::connect(&server.url("wait_connections=0"))
        .await
        .unwrap();
    assert!(matches!(
        other.acquire(&key, Duration::from_millis(200)).await,
        Err(LockError::Timeout { .. })
    ));
    g.release().await.unwrap();
    let g = locks.try_acquire(&key).await.unwrap();
    assert!(g.fencing_token().unwrap() > first);
    g.release().await.unwrap();
    assert_eq!(
        pool.size(),
        1,
        "the backend takes no connections from the pool"
    );
}

/// The engine's semaphores (its permit store, asked directly), on either server.
mod permit_cases {
    use std::time::{Duration, Instant};

    use dlock::backend::{LockBackend, LockRequest, PermitRequest};
    use dlock::mysql::{MySqlBackend, semaphore_slot_name};
    use dlock_testkit::mysql::DbServer;
    use dlock_testkit::{unique_key, wait_until};
    use sqlx::mysql::MySqlConnection;

    use super::{admin, statement_counters};
    use crate::support::permits::{PermitHolder, contend, release, store, try_permit, try_waiting};

    async fn backend(server: &DbServer, options: &str) -> MySqlBackend {
        MySqlBackend::connect(&server.url(options))
            .await
            .expect("connect")
    }

    /// The holders of the semaphore `key` of `n`, as the server shows them (one
    /// `IS_USED_LOCK` per slot): (slot, connection id).
    async fn slots(conn: &mut MySqlConnection, key: &str, n: u32) -> Vec<(u32, u64)> {
        let mut held = Vec::new();
        for slot in 0..n {
            let holder: Option<u64> =
                sqlx::query_scalar("SELECT CAST(IS_USED_LOCK(?) AS UNSIGNED)")
                    .bind(semaphore_slot_name(key, slot))
                    .fetch_one(&mut *conn)
                    .await
                    .expect("IS_USED_LOCK");
            if let Some(holder) = holder {
                held.push((slot, holder));
            }
        }
        held
    }

    /// Tasks of three backends take permits of a semaphore of 3 for two seconds: never more
    /// than 3 holders, by the tasks' count and the server's, and 3 at some moment.
    pub(super) async fn contention(server: &DbServer) {
        let key = unique_key("sem-contend");
        let mut backends = Vec::new();
        for _ in 0..3 {
            backends.push(backend(server, "connections=2&wait_connections=0").await);
        }
        let watcher = backend(server, "").await;
        let taken = contend(&backends, 4, &key, 3, Duration::from_secs(2), || async {
            store(&watcher).holders(&key, 3).await.expect("holders") as usize
        })
        .await;
        assert!(taken > 30, "only {taken} permits in 2 s");
        assert_eq!(store(&watcher).holders(&key, 3).await.unwrap(), 0);
    }

    /// The recursive walk takes at most one slot (the server evaluates the next step only
    /// from a row whose slot was not taken), and never a slot its session holds already
    /// (`GET_LOCK` would grant it again): one lane session (connections=1) of two
    /// "providers" (clones of one backend) holds `n` distinct slots, one per try, whatever
    /// the other slots' state, and the next try is full.
    pub(super) async fn one_slot_per_walk(server: &DbServer) {
        let mut conn = admin(server).await;
        for n in [1u32, 7, 50] {
            let key = unique_key("sem-walk");
            let one = backend(server, "connections=1").await;
            let clones = [one.clone(), one.clone()];
            let mut held = Vec::new();
            for i in 0..n as usize {
                held.push(
                    try_permit(&clones[i % 2], &key, n)
                        .await
                        .unwrap_or_else(|| panic!("permit {i} of {n}")),
                );
                let seen = slots(&mut conn, &key, n).await;
                assert_eq!(seen.len(), i + 1, "{n}: try {i} took {seen:?}");
                assert!(
                    seen.iter().all(|(_, id)| *id == seen[0].1),
                    "one session: {seen:?}"
                );
            }
            assert!(
                try_permit(&one, &key, n).await.is_none(),
                "a permit past {n}"
            );
            assert_eq!(slots(&mut conn, &key, n).await.len(), n as usize);
            for permit in held {
                release(permit).await;
            }
            assert!(slots(&mut conn, &key, n).await.is_empty(), "all given back");
        }
    }

    /// A try is one statement on the server, whatever the count (1,024, the bound, and 1),
    /// whether it takes a permit or finds the semaphore full; a release is one more. Counted
    /// by the server's `Questions` on a server of the test's own.
    pub(super) async fn statements_per_try(server: &DbServer) {
        let mut admin = admin(server).await;
        let through = backend(server, "connections=1&wait_connections=0&keepalive=1h").await;
        let key = unique_key("sem-trips");
        // Prepares the statements on the session.
        let warm = try_permit(&through, &key, 1).await.expect("free");
        release(warm).await;
        let questions = async |admin: &mut MySqlConnection| {
            statement_counters(admin)
                .await
                .get("Questions")
                .copied()
                .unwrap_or(0)
        };
        for n in [1024, 1] {
            // The admin connection's count is a question of its own.
            let before = questions(&mut admin).await;
            let permit = try_permit(&through, &key, n).await.expect("free");
            assert_eq!(
                questions(&mut admin).await - before,
                2,
                "a granted try of {n}"
            );
            if n == 1 {
                let before = questions(&mut admin).await;
                assert!(try_permit(&through, &key, 1).await.is_none());
                assert_eq!(questions(&mut admin).await - before, 2, "a full try");
            }
            let before = questions(&mut admin).await;
            release(permit).await;
            assert_eq!(questions(&mut admin).await - before, 2, "a release");
        }
        // A full semaphore of 1,024 is walked whole, in one statement.
        let full = backend(server, "connections=1").await;
        let key = unique_key("sem-full");
        let mut held = Vec::new();
        for _ in 0..1024 {
            held.push(try_permit(&full, &key, 1024).await.expect("free"));
        }
        let before = questions(&mut admin).await;
        let started = Instant::now();
        assert!(try_permit(&through, &key, 1024).await.is_none());
        eprintln!("a full try of 1,024 took {:?}", started.elapsed());
        assert_eq!(
            questions(&mut admin).await - before,
            2,
            "a full try of 1,024"
        );
        for permit in held {
            release(permit).await;
        }
    }

    /// The walk of a full semaphore is bounded: 1,024 is served, more is a configuration
    /// error naming the bound, asked of nobody (`u32::MAX` included).
    pub(super) async fn bounds(server: &DbServer) {
        let a = backend(server, "").await;
        let key = unique_key("sem-bound");
        assert_eq!(store(&a).max_permits(), 1024);
        let permit = try_permit(&a, &key, 1024).await.expect("1,024 is served");
        release(permit).await;
        for n in [1025, 1_000_000, u32::MAX, 0] {
            let err = store(&a)
                .try_acquire_permit(PermitRequest::new(&key, n))
                .await
                .unwrap_err();
            assert_eq!(err.code(), "DistributedLock.Configuration", "{n}: {err}");
            if n != 0 {
                assert!(err.to_string().contains("1 to 1024"), "{err}");
            }
        }
    }

    /// MySQL and MariaDB keep no count record (user locks have no shared mode and cannot be
    /// listed without privileges the backend does not ask for): a try with another count is
    /// not refused, and the semaphore admits as many holders as the largest count in use,
    /// never more. Pins the documented limit.
    pub(super) async fn no_count_record(server: &DbServer) {
        let key = unique_key("sem-norecord");
        let (a, b) = (backend(server, "").await, backend(server, "").await);
        assert!(
            !store(&a).keeps_count_record(),
            "the store says it keeps none"
        );
        let mut held = vec![
            try_permit(&a, &key, 2).await.expect("free"),
            try_permit(&a, &key, 2).await.expect("free"),
        ];
        assert!(try_permit(&a, &key, 2).await.is_none());
        for _ in 0..3 {
            held.push(
                try_permit(&b, &key, 5)
                    .await
                    .expect("another count is not refused"),
            );
        }
        assert!(
            try_permit(&b, &key, 5).await.is_none(),
            "never past the largest count"
        );
        assert!(try_permit(&a, &key, 2).await.is_none());
        assert_eq!(store(&a).holders(&key, 5).await.unwrap(), 5);
        for permit in held {
            release(permit).await;
        }
    }

    /// The waiting mark is the semaphore's queue lock: while any session holds it, a single
    /// try is answered full with a permit free, and a waiting try is served.
    pub(super) async fn waiting_mark(server: &DbServer) {
        let key = unique_key("sem-mark");
        let (tries, waiter) = (backend(server, "").await, backend(server, "").await);
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

    /// Tries cut off at every moment leave nothing held.
    pub(super) async fn cut_off(server: &DbServer) {
        let key = unique_key("sem-cut");
        let (a, watcher) = (
            backend(server, "connections=1").await,
            backend(server, "").await,
        );
        for round in 0..60 {
            let cut = Duration::from_micros(fastrand::u64(0..3000));
            if let Ok(Some(permit)) = tokio::time::timeout(cut, try_permit(&a, &key, 1)).await {
                release(permit).await;
            }
            wait_until(
                &format!("round {round}: the cut-off try's permit is given back"),
                Duration::from_secs(5),
                async || store(&watcher).holders(&key, 1).await.unwrap() == 0,
            )
            .await;
        }
        let last = try_permit(&a, &key, 1).await.expect("free");
        release(last).await;
    }

    /// A permit is lost with its session: `KILL` of the lane's connection fires the
    /// permit's lost token within keepalive + 1 s, and frees its slot.
    pub(super) async fn lost(server: &DbServer) {
        let key = unique_key("sem-lost");
        let a = backend(server, "keepalive=200ms&connections=1").await;
        let b = backend(server, "").await;
        let permit = try_permit(&a, &key, 1).await.expect("free");
        let mut conn = admin(server).await;
        let (_, id) = slots(&mut conn, &key, 1).await[0];
        sqlx::query(sqlx::AssertSqlSafe(format!("KILL CONNECTION {id}")))
            .execute(&mut conn)
            .await
            .expect("KILL");
        tokio::time::timeout(Duration::from_millis(1200), permit.lost.cancelled())
            .await
            .expect("the lost token fired within keepalive + 1 s");
        wait_until(
            "the killed session's slot is free",
            Duration::from_secs(5),
            async || slots(&mut conn, &key, 1).await.is_empty(),
        )
        .await;
        let again = try_permit(&b, &key, 1).await.expect("the slot is free");
        permit.handle.release().await.unwrap();
        assert_eq!(
            store(&b).holders(&key, 1).await.unwrap(),
            1,
            "the lost release freed nothing"
        );
        release(again).await;
    }

    /// A holder process killed with SIGKILL frees its permit once the server sees its
    /// connection closed.
    pub(super) async fn killed_holder(server: &DbServer, child: &str) {
        let key = unique_key("sem-kill");
        let holder = PermitHolder::start(child, &server.url(""), &key, 1);
        let here = backend(server, "").await;
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

    /// With fencing, tokens increase strictly per semaphore across holders and backends.
    pub(super) async fn fencing(server: &DbServer) {
        let key = unique_key("sem-fence");
        let (a, b) = (
            backend(server, "fencing=true").await,
            backend(server, "fencing=true").await,
        );
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
    }
}
