//! dlock run as accounts that hold exactly the grants `docs/production.md` lists and
//! nothing more, over verified TLS where the server has it: the conformance suite as those
//! accounts on PostgreSQL, MariaDB, MySQL 9 and every Redis / Valkey flavour; what each
//! missing Redis command does (a clear `NOPERM` naming it, and no other code path); tenants of
//! one Redis that cannot touch each other's locks. The statements and ACL rules the tests run
//! are the production page's, word for word (`readme_gives_the_tested_grants`).
#![cfg(any(feature = "postgres", feature = "mysql", feature = "redis"))]

mod support;

use std::time::Duration;

use dlock::{LockError, LockGuard, LockProvider};
use dlock_testkit::tls::{Pki, ServerCert};

const KEEPALIVE: Duration = Duration::from_millis(200);

/// Runs `future` to its end on a runtime of its own, on a thread of its own: for the one-time
/// set-up of a server shared by tests that each run on their own runtime.
fn block_on_own_runtime<T: Send + 'static, F: std::future::Future<Output = T>>(
    make: impl FnOnce() -> F + Send + 'static,
) -> T {
    std::thread::spawn(move || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime")
            .block_on(make())
    })
    .join()
    .expect("the set-up thread")
}

/// `docs/production.md`, where the grants are documented (the README links to it).
fn readme() -> String {
    std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/production.md"))
        .expect("docs/production.md")
}

#[cfg(feature = "postgres")]
mod postgres {
    use super::*;
    use dlock_testkit::postgres::PgServer;
    use sqlx::{Connection, PgConnection};

    /// Run by an administrator once, as the production page says: a database whose `PUBLIC` may do
    /// nothing, and two roles (after `CREATE DATABASE locks`, the application's database).
    pub(crate) const ADMIN_SQL: &[&str] = &[
        "REVOKE ALL ON DATABASE locks FROM PUBLIC",
        "CREATE ROLE dlock_app LOGIN",
        "GRANT CONNECT ON DATABASE locks TO dlock_app",
        "CREATE ROLE dlock_fenced LOGIN",
        "GRANT CONNECT ON DATABASE locks TO dlock_fenced",
    ];

    /// Run in the database `locks`: the fencing table and its three privileges.
    pub(crate) const FENCING_SQL: &[&str] = &[
        "REVOKE ALL ON SCHEMA public FROM PUBLIC",
        "CREATE TABLE dlock_fencing (id bigint PRIMARY KEY, token bigint NOT NULL)",
        "GRANT USAGE ON SCHEMA public TO dlock_fenced",
        "GRANT SELECT, INSERT, UPDATE ON dlock_fencing TO dlock_fenced",
    ];

    pub(crate) struct Prod {
        server: PgServer,
        ca: std::path::PathBuf,
    }

    impl Prod {
        fn url(&self, user: &str, database: &str, options: &str) -> String {
            format!(
                "postgres://{user}@127.0.0.1:{}/{database}?sslmode=verify-full&sslrootcert={}{options}",
                self.server.port(),
                self.ca.display()
            )
        }

        async fn admin(&self, database: &str) -> PgConnection {
            PgConnection::connect(&self.url("postgres", database, ""))
                .await
                .expect("admin over TLS")
        }
    }

    /// A TLS-only server (good certificate) with the production page's roles.
    pub(crate) fn prod() -> &'static Prod {
        static PROD: std::sync::OnceLock<Prod> = std::sync::OnceLock::new();
        static STARTING: std::sync::Mutex<()> = std::sync::Mutex::new(());
        let _once = STARTING.lock().unwrap_or_else(|e| e.into_inner());
        PROD.get_or_init(|| {
            let pki = Pki::shared();
            let prod = Prod {
                server: PgServer::start_tls(&pki.server(ServerCert::Good), true),
                ca: pki.ca.clone(),
            };
            let (port, ca) = (prod.server.port(), prod.ca.clone());
            block_on_own_runtime(move || async move {
                let url = |db: &str| {
                    format!(
                        "postgres://postgres@127.0.0.1:{port}/{db}?sslmode=verify-full&sslrootcert={}",
                        ca.display()
                    )
                };
                let mut admin = PgConnection::connect(&url("postgres")).await.unwrap();
                for statement in std::iter::once(&"CREATE DATABASE locks").chain(ADMIN_SQL) {
                    sqlx::raw_sql(*statement).execute(&mut admin).await.unwrap();
                }
                let mut admin = PgConnection::connect(&url("locks")).await.unwrap();
                for statement in FENCING_SQL {
                    sqlx::raw_sql(*statement).execute(&mut admin).await.unwrap();
                }
            });
            prod
        })
    }

    /// Nothing beyond the production page's grants: no role attribute, no role membership, no `TEMP`
    /// or `CREATE` anywhere, no schema for the role without fencing, and only `SELECT`,
    /// `INSERT`, `UPDATE` on the table for the other.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_roles_have_nothing_more() {
        let prod = prod();
        let mut admin = prod.admin("locks").await;
        for role in ["dlock_app", "dlock_fenced"] {
            let (attributes, memberships): (bool, i64) = sqlx::query_as(
                "SELECT rolsuper OR rolcreaterole OR rolcreatedb \
                 OR rolreplication OR rolbypassrls, \
                 (SELECT count(*) FROM pg_auth_members m WHERE m.member = r.oid) \
                 FROM pg_roles r WHERE rolname = $1",
            )
            .bind(role)
            .fetch_one(&mut admin)
            .await
            .unwrap();
            assert!(!attributes && memberships == 0, "{role}");
            let (connect, temp, create_db, create_schema): (bool, bool, bool, bool) =
                sqlx::query_as(
                    "SELECT has_database_privilege($1, 'locks', 'CONNECT'), \
                     has_database_privilege($1, 'locks', 'TEMP'), \
                     has_database_privilege($1, 'locks', 'CREATE'), \
                     has_schema_privilege($1, 'public', 'CREATE')",
                )
                .bind(role)
                .fetch_one(&mut admin)
                .await
                .unwrap();
            assert!(connect && !temp && !create_db && !create_schema, "{role}");
        }
        let usage: bool =
            sqlx::query_scalar("SELECT has_schema_privilege('dlock_app', 'public', 'USAGE')")
                .fetch_one(&mut admin)
                .await
                .unwrap();
        assert!(!usage, "dlock_app sees no schema");
        let table: Vec<String> = sqlx::query_scalar(
            "SELECT privilege_type::text FROM information_schema.role_table_grants \
             WHERE grantee = 'dlock_fenced' AND table_name = 'dlock_fencing' ORDER BY 1",
        )
        .fetch_all(&mut admin)
        .await
        .unwrap();
        assert_eq!(table, ["INSERT", "SELECT", "UPDATE"]);
    }

    /// A role with `CONNECT` only that asks for fencing tokens gets an error that names the
    /// table and the grants (the server refuses to show it the table, or to create one).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn fencing_without_its_grants_is_a_clear_error() {
        let prod = prod();
        let err = LockProvider::connect(&prod.url("dlock_app", "locks", "&fencing=true"))
            .await
            .expect_err("fencing without the table's grants");
        let text = err.to_string();
        assert_eq!(err.code(), "DistributedLock.Configuration", "{text}");
        assert!(
            text.contains("dlock_fencing") && text.contains("GRANT SELECT, INSERT, UPDATE"),
            "{text}"
        );
    }

    struct Harness {
        prod: &'static Prod,
        role: &'static str,
        fencing: bool,
    }

    impl Harness {
        fn url(&self, extra: &str) -> String {
            let fencing = if self.fencing { "&fencing=true" } else { "" };
            self.prod.url(
                self.role,
                "locks",
                &format!("&keepalive={}ms{fencing}{extra}", KEEPALIVE.as_millis()),
            )
        }
    }

    impl dlock_testkit::Harness for Harness {
        async fn provider(&self) -> LockProvider {
            LockProvider::connect(&self.url("")).await.expect("connect")
        }

        async fn break_lock(&self, guard: &LockGuard) {
            let mut admin = self.prod.admin("locks").await;
            let pids: Vec<i32> = sqlx::query_scalar(
                "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted \
                 AND objsubid = 1 AND ((classid::bigint << 32) | objid::bigint) = $1",
            )
            .bind(dlock::lock_id(guard.key()))
            .fetch_all(&mut admin)
            .await
            .unwrap();
            assert_eq!(pids.len(), 1, "one session holds the lock");
            let done: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
                .bind(pids[0])
                .fetch_one(&mut admin)
                .await
                .unwrap();
            assert!(done);
        }

        fn lost_within(&self) -> Duration {
            KEEPALIVE + Duration::from_secs(1)
        }

        fn fencing(&self) -> bool {
            self.fencing
        }

        /// PostgreSQL reads `pg_locks`, which needs no grant.
        fn store_inspection(&self) -> dlock_testkit::StoreInspection {
            dlock_testkit::StoreInspection::Listed
        }

        /// Read locks in the engine's shared mode (pg_advisory_lock_shared, with no privilege beyond CONNECT).
        fn read_locks(&self) -> bool {
            true
        }

        async fn shared_providers(&self, count: usize) -> Vec<LockProvider> {
            let backend = dlock::postgres::PostgresBackend::connect(&self.url("&connections=1"))
                .await
                .expect("connect");
            (0..count)
                .map(|_| LockProvider::from_backend(backend.clone()))
                .collect()
        }
    }

    /// `CONNECT` on the database, nothing else.
    mod connect_only {
        use super::*;

        async fn harness() -> Harness {
            Harness {
                prod: prod(),
                role: "dlock_app",
                fencing: false,
            }
        }

        dlock_testkit::conformance_suite!(harness());
    }

    /// `CONNECT`, `USAGE` on the schema, `SELECT, INSERT, UPDATE` on the fencing table.
    mod fenced {
        use super::*;

        async fn harness() -> Harness {
            Harness {
                prod: prod(),
                role: "dlock_fenced",
                fencing: true,
            }
        }

        dlock_testkit::conformance_suite!(harness());
    }
}

#[cfg(feature = "mysql")]
mod mysql {
    use super::*;
    use dlock::mysql::server_lock_name;
    use dlock_testkit::mysql::{DbServer, Flavor, Tls};
    use sqlx::mysql::MySqlConnection;
    use sqlx::{Connection, Executor};

    /// Run by an administrator once, as the production page says (`dlock_test` is the application's
    /// database here).
    pub(crate) const ADMIN_SQL: &[&str] = &[
        "CREATE TABLE dlock_test.dlock_fencing (\
         name VARCHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL PRIMARY KEY, \
         token BIGINT UNSIGNED NOT NULL) ENGINE=InnoDB",
        "CREATE USER 'dlock_app'@'127.0.0.1' IDENTIFIED BY 'app-secret' REQUIRE SSL",
        "CREATE USER 'dlock_fenced'@'127.0.0.1' IDENTIFIED BY 'fenced-secret' REQUIRE SSL",
        "GRANT SELECT, INSERT, UPDATE ON dlock_test.dlock_fencing TO 'dlock_fenced'@'127.0.0.1'",
    ];

    pub(crate) struct Prod {
        server: DbServer,
        ca: std::path::PathBuf,
    }

    impl Prod {
        fn url(&self, user: &str, database: &str, options: &str) -> String {
            format!(
                "mysql://{user}@127.0.0.1:{}/{database}?ssl-mode=VERIFY_IDENTITY&ssl-ca={}{options}",
                self.server.port(),
                self.ca.display()
            )
        }

        async fn admin(&self) -> MySqlConnection {
            MySqlConnection::connect(&self.url("root", "dlock_test", ""))
                .await
                .expect("admin over TLS")
        }
    }

    /// A TLS-only server (`require_secure_transport`, good certificate) with the production page's
    /// users; `None` when the server is missing outside CI.
    fn prod(flavor: Flavor) -> Option<&'static Prod> {
        static MARIADB: std::sync::OnceLock<Option<Prod>> = std::sync::OnceLock::new();
        static MYSQL: std::sync::OnceLock<Option<Prod>> = std::sync::OnceLock::new();
        static STARTING: std::sync::Mutex<()> = std::sync::Mutex::new(());
        let _once = STARTING.lock().unwrap_or_else(|e| e.into_inner());
        let cell = match flavor {
            Flavor::MariaDb => &MARIADB,
            Flavor::MySql => &MYSQL,
        };
        cell.get_or_init(|| {
            let pki = Pki::shared();
            let mut server = DbServer::start(flavor)?;
            server.stop();
            server.set_tls(Tls::On {
                files: pki.server(ServerCert::Good),
                only: true,
            });
            server.resume();
            let prod = Prod {
                server,
                ca: pki.ca.clone(),
            };
            let admin_url = prod.url("root", "dlock_test", "");
            block_on_own_runtime(move || async move {
                let mut admin = MySqlConnection::connect(&admin_url).await.unwrap();
                for statement in ADMIN_SQL {
                    admin.execute(*statement).await.unwrap();
                }
            });
            Some(prod)
        })
        .as_ref()
    }

    async fn the_users_have_nothing_more(flavor: Flavor) {
        let Some(prod) = prod(flavor) else { return };
        let mut admin = prod.admin().await;
        for (user, expected) in [
            (
                "dlock_app",
                vec!["GRANT USAGE ON *.* TO `dlock_app`@`127.0.0.1`"],
            ),
            (
                "dlock_fenced",
                vec![
                    "GRANT USAGE ON *.* TO `dlock_fenced`@`127.0.0.1`",
                    "GRANT SELECT, INSERT, UPDATE ON `dlock_test`.`dlock_fencing` TO `dlock_fenced`@`127.0.0.1`",
                ],
            ),
        ] {
            let show = format!("SHOW GRANTS FOR '{user}'@'127.0.0.1'");
            let grants: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(show))
                .fetch_all(&mut admin)
                .await
                .unwrap();
            // MariaDB shows the password hash and REQUIRE SSL on the USAGE line.
            let grants: Vec<String> = grants
                .into_iter()
                .map(|g| {
                    g.split(" IDENTIFIED BY")
                        .next()
                        .unwrap_or_default()
                        .split(" REQUIRE SSL")
                        .next()
                        .unwrap_or_default()
                        .to_owned()
                })
                .collect();
            assert_eq!(grants, expected, "{flavor:?} {user}");
        }
    }

    /// A user who may not create the fencing table, nor sees it, and asks for fencing tokens
    /// gets an error that names the table and the grants.
    async fn fencing_without_its_grants(flavor: Flavor) {
        let Some(prod) = prod(flavor) else { return };
        let mut admin = prod.admin().await;
        let user = format!("dlock_other_{}", std::process::id());
        for statement in [
            "CREATE TABLE IF NOT EXISTS dlock_test.other (id INT PRIMARY KEY)".to_owned(),
            format!("CREATE USER IF NOT EXISTS '{user}'@'127.0.0.1' REQUIRE SSL"),
            format!("GRANT SELECT ON dlock_test.other TO '{user}'@'127.0.0.1'"),
        ] {
            admin.execute(sqlx::AssertSqlSafe(statement)).await.unwrap();
        }
        let err = LockProvider::connect(&prod.url(&user, "dlock_test", "&fencing=true"))
            .await
            .expect_err("fencing without the table's grants");
        let text = err.to_string();
        assert_eq!(err.code(), "DistributedLock.Configuration", "{text}");
        assert!(
            text.contains("dlock_fencing") && text.contains("GRANT SELECT, INSERT, UPDATE"),
            "{text}"
        );
        let drop_user = format!("DROP USER '{user}'@'127.0.0.1'");
        admin.execute(sqlx::AssertSqlSafe(drop_user)).await.unwrap();
    }

    /// The connection that holds `key`'s user lock is killed by the administrator.
    async fn kill_holder(prod: &Prod, key: &str) {
        let mut admin = prod.admin().await;
        let id: Option<u64> = sqlx::query_scalar("SELECT CAST(IS_USED_LOCK(?) AS UNSIGNED)")
            .bind(server_lock_name(key))
            .fetch_one(&mut admin)
            .await
            .unwrap();
        let kill = format!("KILL CONNECTION {}", id.expect("someone holds the lock"));
        admin.execute(sqlx::AssertSqlSafe(kill)).await.unwrap();
    }

    struct Harness {
        prod: &'static Prod,
        user: &'static str,
        fencing: bool,
    }

    impl Harness {
        fn url(&self, extra: &str) -> String {
            // Without fencing the user has no privilege on any database, so it names none.
            let (user, database, fencing) = if self.fencing {
                (
                    format!("{}:fenced-secret", self.user),
                    "dlock_test",
                    "&fencing=true",
                )
            } else {
                (format!("{}:app-secret", self.user), "", "")
            };
            self.prod.url(
                &user,
                database,
                &format!("&keepalive={}ms{fencing}{extra}", KEEPALIVE.as_millis()),
            )
        }
    }

    impl dlock_testkit::Harness for Harness {
        async fn provider(&self) -> LockProvider {
            LockProvider::connect(&self.url("")).await.expect("connect")
        }

        async fn break_lock(&self, guard: &LockGuard) {
            kill_holder(self.prod, guard.key()).await;
        }

        fn lost_within(&self) -> Duration {
            KEEPALIVE + Duration::from_secs(1)
        }

        fn retake_within(&self) -> Duration {
            Duration::from_secs(5)
        }

        fn fencing(&self) -> bool {
            self.fencing
        }

        /// MySQL/MariaDB list user locks from `performance_schema`, which the test servers run
        /// without.
        fn store_inspection(&self) -> dlock_testkit::StoreInspection {
            dlock_testkit::StoreInspection::Unsupported
        }

        async fn shared_providers(&self, count: usize) -> Vec<LockProvider> {
            let backend = dlock::mysql::MySqlBackend::connect(&self.url("&connections=1"))
                .await
                .expect("connect");
            (0..count)
                .map(|_| LockProvider::from_backend(backend.clone()))
                .collect()
        }
    }

    macro_rules! engine {
        ($module:ident, $flavor:expr) => {
            mod $module {
                use super::*;

                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn the_users_have_nothing_more() {
                    super::the_users_have_nothing_more($flavor).await;
                }

                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn fencing_without_its_grants_is_a_clear_error() {
                    super::fencing_without_its_grants($flavor).await;
                }

                /// No privilege at all (`USAGE`), no database in the URL.
                mod no_privileges {
                    use super::*;

                    async fn harness() -> Option<Harness> {
                        Some(Harness {
                            prod: prod($flavor)?,
                            user: "dlock_app",
                            fencing: false,
                        })
                    }

                    dlock_testkit::conformance_suite!(optional harness());
                }

                /// `SELECT, INSERT, UPDATE` on the fencing table.
                mod fenced {
                    use super::*;

                    async fn harness() -> Option<Harness> {
                        Some(Harness {
                            prod: prod($flavor)?,
                            user: "dlock_fenced",
                            fencing: true,
                        })
                    }

                    dlock_testkit::conformance_suite!(optional harness());
                }
            }
        };
    }

    engine!(mariadb, Flavor::MariaDb);
    engine!(mysql9, Flavor::MySql);
}

#[cfg(feature = "redis")]
mod redis_acl {
    use super::*;
    use dlock::redis::{OwnerToken, RedisBackend, ReleaseOutcome};
    use dlock_testkit::redis::{Deployment, Flavor, LeaseHarness, RedisServer};
    use std::collections::HashMap;

    const LEASE: Duration = Duration::from_secs(1);

    /// What the raw-token reads (`owner_token`, `verify_still_held`, `remaining_lease`) add:
    /// `GET` and `PTTL` in a `MULTI` / `EXEC`.
    pub(crate) const RAW_READS: [&str; 4] = ["get", "pttl", "multi", "exec"];

    /// What read locks add, on every flavour (their scripts' commands; `incr` with fencing):
    /// what the production page grants for them.
    pub(crate) const READ_LOCKS: [&str; 14] = [
        "evalsha",
        "eval",
        "get",
        "set",
        "exists",
        "time",
        "zadd",
        "zscore",
        "zrem",
        "zremrangebyscore",
        "zrange",
        "pexpire",
        "del",
        "incr",
    ];

    /// What semaphores add, on every flavour (their scripts' commands; `incr` with fencing,
    /// `publish` asked with `pcall` to wake the head waiter): what the production page grants for them.
    pub(crate) const SEMAPHORES: [&str; 17] = [
        "evalsha",
        "eval",
        "get",
        "set",
        "time",
        "zadd",
        "zscore",
        "zrem",
        "zremrangebyscore",
        "zrange",
        "zcard",
        "zcount",
        "pttl",
        "pexpireat",
        "del",
        "incr",
        "publish",
    ];

    /// The commands dlock's provider runs on `flavor`: what the production page grants, in its order.
    pub(crate) fn commands(flavor: Flavor, fencing: bool) -> Vec<&'static str> {
        let mut commands = vec!["set"];
        let lua = ["evalsha", "eval"];
        if fencing {
            commands.extend(lua);
            commands.push("incr");
        }
        let path: &[&str] = match flavor {
            // Lua renewal (GET, PEXPIRE) and release (GET, DEL).
            Flavor::Redis7 => &["evalsha", "eval", "get", "pexpire", "del"],
            // SET IFEQ renewal, Lua release.
            Flavor::Valkey81 => &["evalsha", "eval", "get", "del"],
            // SET IFEQ renewal, DELIFEQ release (EXISTS tells a lock gone from another's).
            Flavor::Valkey91 => &["delifeq", "exists"],
            Flavor::Redis8 => &["delex", "exists"],
        };
        for command in path {
            if !commands.contains(command) {
                commands.push(command);
            }
        }
        commands
    }

    /// The production page's rule: the commands, as `+cmd` words.
    pub(crate) fn grant_words(flavor: Flavor, fencing: bool) -> String {
        commands(flavor, fencing)
            .iter()
            .map(|c| format!("+{c}"))
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// A server of `flavor` with TLS where it has it (Redis 7 and 8), the plain port for the
    /// tests' own commands; `None` when missing outside CI.
    fn server(flavor: Flavor) -> Option<RedisServer> {
        match flavor {
            Flavor::Redis7 | Flavor::Redis8 => {
                RedisServer::start_tls(flavor, &Pki::shared().server(ServerCert::Good), false)
            }
            Flavor::Valkey81 | Flavor::Valkey91 => RedisServer::start(flavor),
        }
    }

    fn tls(flavor: Flavor) -> bool {
        matches!(flavor, Flavor::Redis7 | Flavor::Redis8)
    }

    /// `ACL SETUSER name reset on >password ~{prefix}{* +commands...`.
    async fn set_user(server: &RedisServer, name: &str, prefix: &str, commands: &[&str]) {
        let mut admin = server
            .client()
            .get_multiplexed_async_connection()
            .await
            .unwrap();
        let mut cmd = redis::cmd("ACL");
        cmd.arg("SETUSER")
            .arg(name)
            .arg("reset")
            .arg("on")
            .arg(format!(">{name}-secret"))
            .arg(format!("~{prefix}{{*"));
        for command in commands {
            cmd.arg(format!("+{command}"));
        }
        let () = cmd.query_async(&mut admin).await.unwrap();
    }

    /// The URL of user `name`, TLS verified where the server has TLS.
    fn user_url(server: &RedisServer, name: &str, prefix: &str, options: &str) -> String {
        let options = format!("prefix={prefix}&{options}");
        if tls(server.flavor) {
            server
                .tls_url(&format!("ca={}&{options}", Pki::shared().ca.display()))
                .replacen("rediss://", &format!("rediss://{name}:{name}-secret@"), 1)
        } else {
            server
                .url(&options)
                .replacen("redis://", &format!("redis://{name}:{name}-secret@"), 1)
        }
    }

    async fn admin(server: &RedisServer) -> redis::aio::MultiplexedConnection {
        server
            .client()
            .get_multiplexed_async_connection()
            .await
            .unwrap()
    }

    /// The suite's ACL user on one server (keys `app:{*`): providers connect as that user, and
    /// another owner takes a lock over through the admin connection.
    struct AclUser {
        server: RedisServer,
    }

    impl Deployment for AclUser {
        type Backend = RedisBackend;

        fn url_with(&self, options: &str) -> String {
            user_url(&self.server, "dlock_app", "app:", options)
        }

        async fn take_over(&self, backend: &RedisBackend, key: &str) {
            let mut conn = admin(&self.server).await;
            dlock_testkit::redis::take_over(&mut conn, backend.storage_key(key), "someone-else")
                .await;
        }

        /// Without `PUBLISH` and `SUBSCRIBE` (not among the least commands) there are no
        /// wake-ups, so no fair waits across processes: waits poll, and the provider that gave
        /// a key back hands it to its own next waiter.
        fn unfair_waits(&self) -> Option<&'static str> {
            Some(
                "the least commands grant no PUBLISH or SUBSCRIBE: without wake-ups, Redis \
                 waits are not fair across processes",
            )
        }

        /// Inspection walks the keyspace with `SCAN`, an admin's command the least commands
        /// leave out.
        fn store_inspection(&self) -> dlock_testkit::StoreInspection {
            dlock_testkit::StoreInspection::Denied("NOPERM")
        }
    }

    /// The conformance harness on `flavor`'s server, as a user granted exactly the production
    /// page's commands, with those of the suite's `ping`, the guard's `verify_still_held`, read locks
    /// and semaphores.
    async fn acl_harness(flavor: Flavor) -> Option<LeaseHarness<AclUser>> {
        let server = server(flavor)?;
        let mut granted = commands(flavor, true);
        granted.extend(["ping", "get"]);
        for command in READ_LOCKS.into_iter().chain(SEMAPHORES) {
            if !granted.contains(&command) {
                granted.push(command);
            }
        }
        set_user(&server, "dlock_app", "app:", &granted).await;
        Some(LeaseHarness::start(AclUser { server }).await)
    }

    /// Calls, rejected and failed calls of every command so far (`INFO commandstats`).
    fn command_counts(server: &RedisServer) -> HashMap<String, u64> {
        server
            .info("commandstats")
            .into_iter()
            .filter_map(|(k, v)| {
                let name = k.strip_prefix("cmdstat_")?.to_owned();
                let total = v
                    .split(',')
                    .filter_map(|f| {
                        let (field, n) = f.split_once('=')?;
                        matches!(field, "calls" | "rejected_calls" | "failed_calls")
                            .then(|| n.parse::<u64>().ok())?
                    })
                    .sum();
                Some((name, total))
            })
            .collect()
    }

    /// The commands that ran (or were refused) between two readings, `INFO` left out.
    fn ran_between(before: &HashMap<String, u64>, after: &HashMap<String, u64>) -> Vec<String> {
        let mut ran: Vec<String> = after
            .iter()
            .filter(|(name, n)| {
                name.as_str() != "info" && before.get(*name).copied().unwrap_or(0) < **n
            })
            .map(|(name, _)| name.clone())
            .collect();
        ran.sort();
        ran
    }

    /// Where a missing command shows.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Step {
        Acquire,
        Renew,
        Release,
        /// Releasing a lock another owner holds (the raw-token API): a native conditional
        /// delete answers 0, and `EXISTS` tells "taken over" from "gone".
        ReleaseOfAnother,
    }

    /// The commands a step may run on `flavor` (with fencing): its own path, the native deletes
    /// tried before it, and the `CLIENT ID` that goes ahead of a new connection's first command
    /// (for connection fencing; these users may not run it), nothing of another path. A failed
    /// acquisition also gives back what it may have taken (a script that stopped at `INCR` has
    /// run its `SET`), by the release path.
    fn path(flavor: Flavor, step: Step) -> Vec<&'static str> {
        let mut path = path_of(flavor, step);
        path.push("client|id");
        path
    }

    fn path_of(flavor: Flavor, step: Step) -> Vec<&'static str> {
        match (step, flavor) {
            (Step::Acquire, _) => {
                // A backend's first fenced acquisition reads the record of the prefix's
                // fencing counters: `GET`, or `EXISTS` where `GET` is refused.
                let mut path = vec!["get", "exists", "evalsha", "eval", "set", "incr"];
                path.extend(path_of(flavor, Step::Release));
                path
            }
            (Step::Renew, Flavor::Redis7) => vec!["set", "evalsha", "eval", "get", "pexpire"],
            (Step::Renew, _) => vec!["set"],
            // A release also announces itself (`PUBLISH`, see `tests/redis_wake.rs`): refused
            // here, where it is not granted, without failing the release.
            (_, Flavor::Redis7 | Flavor::Valkey81) => {
                vec![
                    "delex", "delifeq", "evalsha", "eval", "get", "del", "publish",
                ]
            }
            (_, Flavor::Valkey91) => vec!["delex", "delifeq", "exists", "publish"],
            (_, Flavor::Redis8) => vec!["delex", "exists", "publish"],
        }
    }

    fn expected_step(flavor: Flavor, missing: &str) -> Step {
        match (flavor, missing) {
            (_, "set" | "evalsha" | "eval" | "incr") => Step::Acquire,
            // Without the one of `GET` and `EXISTS` its list grants, the first fenced
            // acquisition cannot read the record of the prefix's counters.
            (Flavor::Redis7 | Flavor::Valkey81, "get") => Step::Acquire,
            (Flavor::Valkey91 | Flavor::Redis8, "exists") => Step::Acquire,
            (Flavor::Redis7, "pexpire") => Step::Renew,
            (_, "get" | "del" | "delex" | "delifeq") => Step::Release,
            (_, "exists") => Step::ReleaseOfAnother,
            other => panic!("no expectation for {other:?}"),
        }
    }

    /// With one command of the flavour's list taken away, the first step that needs it fails
    /// with `NOPERM` naming it (a renewal: the guard is told it lost the lock, and the log says
    /// why), every step before it works, and in the failing step nothing else is tried: no
    /// other command runs after the refused one, and a refused release leaves the lock in place.
    async fn missing_commands(flavor: Flavor) {
        let Some(server) = server(flavor) else { return };
        let logs = super::support::logs(tracing::Level::WARN, false);
        let mut conn = admin(&server).await;
        let all = commands(flavor, true);
        for (n, missing) in all.iter().enumerate() {
            let user = format!("lacks_{missing}_{n}");
            let granted: Vec<&str> = all.iter().copied().filter(|c| c != missing).collect();
            set_user(&server, &user, "np:", &granted).await;
            // Every case starts without the scripts, so EVALSHA's NOSCRIPT leads to EVAL.
            let () = redis::cmd("SCRIPT")
                .arg("FLUSH")
                .query_async(&mut conn)
                .await
                .unwrap();
            let url = user_url(&server, &user, "np:", "lease=600ms");
            let locks = LockProvider::connect(&url)
                .await
                .expect("connecting needs no command");
            let raw = RedisBackend::connect(&url).await.expect("connect");
            let key = dlock_testkit::unique_key("np");
            let storage = raw.storage_key(&key);
            let pttl = |conn: &mut redis::aio::MultiplexedConnection| {
                let storage = storage.clone();
                let mut conn = conn.clone();
                async move {
                    redis::cmd("PTTL")
                        .arg(storage)
                        .query_async::<i64>(&mut conn)
                        .await
                        .unwrap()
                }
            };
            let logged_before = logs.len();
            // The step that failed, its message and its `db_code`.
            let failed: (Step, String, Option<String>) = 'steps: {
                let before = command_counts(&server);
                let guard = match locks.try_acquire(&key).await {
                    Ok(guard) => guard,
                    Err(err) => {
                        let ran = ran_between(&before, &command_counts(&server));
                        let path = path(flavor, Step::Acquire);
                        assert!(
                            ran.iter().all(|c| path.contains(&c.as_str())),
                            "{flavor:?} without {missing}: {ran:?} ran"
                        );
                        // Nothing stays taken: the acquisition gave back what it wrote.
                        dlock_testkit::wait_until(
                            "no lock left",
                            Duration::from_secs(3),
                            async || pttl(&mut conn).await == -2,
                        )
                        .await;
                        break 'steps (
                            Step::Acquire,
                            err.to_string(),
                            err.db_code().map(str::to_owned),
                        );
                    }
                };
                // A renewal: the lease's time to live goes back up, or the guard is told.
                let mut lowest = i64::MAX;
                dlock_testkit::wait_until(
                    "a renewal or a loss",
                    Duration::from_secs(3),
                    async || {
                        let left = pttl(&mut conn).await;
                        let renewed = left > lowest.saturating_add(50);
                        lowest = lowest.min(left);
                        guard.is_lost() || renewed
                    },
                )
                .await;
                if guard.is_lost() {
                    // Only this case's renewals fail for want of this command.
                    let text = logs.text_from(logged_before);
                    let line = text
                        .lines()
                        .find(|l| l.contains("renewing a lock") && l.contains(&format!("`{missing}`")))
                        .unwrap_or_else(|| panic!("{flavor:?} without {missing}: no log of the failed renewal:\n{text}"))
                        .to_owned();
                    let release = guard.release().await;
                    assert!(
                        matches!(release, Err(LockError::Lost { .. })),
                        "{release:?}"
                    );
                    let code = line.contains("NOPERM").then(|| "NOPERM".to_owned());
                    break 'steps (Step::Renew, line, code);
                }
                let before = command_counts(&server);
                if let Err(err) = guard.release().await {
                    let ran = ran_between(&before, &command_counts(&server));
                    let path = path(flavor, Step::Release);
                    assert!(
                        ran.iter().all(|c| path.contains(&c.as_str())),
                        "{flavor:?} without {missing}: {ran:?} ran"
                    );
                    assert!(
                        pttl(&mut conn).await > 0,
                        "{flavor:?} without {missing}: a refused release deleted the lock"
                    );
                    break 'steps (
                        Step::Release,
                        err.to_string(),
                        err.db_code().map(str::to_owned),
                    );
                }
                // Another owner's lock: left alone, and reported so.
                let () = redis::cmd("SET")
                    .arg(&storage)
                    .arg("another-owner")
                    .arg("PX")
                    .arg(60_000)
                    .query_async(&mut conn)
                    .await
                    .unwrap();
                let ours = OwnerToken::random().unwrap();
                let before = command_counts(&server);
                match raw.release(&key, &ours).await {
                    Ok(outcome) => assert_eq!(outcome, ReleaseOutcome::NotOwned),
                    Err(err) => {
                        let ran = ran_between(&before, &command_counts(&server));
                        let path = path(flavor, Step::ReleaseOfAnother);
                        assert!(
                            ran.iter().all(|c| path.contains(&c.as_str())),
                            "{flavor:?} without {missing}: {ran:?} ran"
                        );
                        break 'steps (
                            Step::ReleaseOfAnother,
                            err.to_string(),
                            err.db_code().map(str::to_owned),
                        );
                    }
                }
                panic!("{flavor:?} without {missing}: every step worked");
            };
            let (step, text, code) = failed;
            eprintln!("{flavor:?} without {missing}: {step:?}: {text}");
            assert_eq!(
                step,
                expected_step(flavor, missing),
                "{flavor:?} without {missing}: {text}"
            );
            assert_eq!(
                code.as_deref(),
                Some("NOPERM"),
                "{flavor:?} without {missing}: {text}"
            );
            assert!(
                text.contains(&format!("`{missing}`")),
                "{flavor:?} without {missing}: the error does not name it: {text}"
            );
            assert!(!text.contains(&format!("{user}-secret")), "{text}");
            let _: i64 = redis::cmd("DEL")
                .arg(&storage)
                .query_async(&mut conn)
                .await
                .unwrap();
        }
    }

    /// Connection fencing needs `+client|id +client|kill`. A user without `CLIENT ID` has it
    /// off from its first command; one with `CLIENT ID` but not `CLIENT KILL` has it off at the
    /// first kill. Either way an uncertain release does what it did without fencing: it answers
    /// the timeout, and the delete held back in the server runs once the server goes on (what
    /// fencing prevents, see `tests/redis.rs`).
    async fn fencing_without_permission(flavor: Flavor) {
        let Some(server) = server(flavor) else { return };
        let mut conn = admin(&server).await;
        for (user, extra) in [("no_client", &[][..]), ("no_kill", &["client|id"][..])] {
            let mut granted = commands(flavor, true);
            granted.extend(extra);
            set_user(&server, user, "nf:", &granted).await;
            let url = user_url(&server, user, "nf:", "lease=30s&timeout=300ms");
            let backend = RedisBackend::connect(&url).await.expect("connect");
            let locks = LockProvider::from_backend(backend.clone());
            let key = dlock_testkit::unique_key("nf");
            // A cycle first: the paths (and, if it may, the CLIENT ID) are known.
            locks
                .try_acquire(&key)
                .await
                .unwrap()
                .release()
                .await
                .unwrap();
            let guard = locks.try_acquire(&key).await.unwrap();
            assert_eq!(
                backend.connection_fencing().enabled,
                !extra.is_empty(),
                "{flavor:?} {user}"
            );
            let storage = backend.storage_key(&key);
            let () = redis::cmd("CLIENT")
                .arg("PAUSE")
                .arg(20_000)
                .arg("WRITE")
                .query_async(&mut conn)
                .await
                .unwrap();
            let outcome = guard.release().await;
            assert!(
                matches!(outcome, Err(LockError::Unavailable { .. })),
                "{flavor:?} {user}: {outcome:?}"
            );
            let fencing = backend.connection_fencing();
            assert_eq!(
                (fencing.enabled, fencing.killed, fencing.not_fenced),
                (false, 0, 1),
                "{flavor:?} {user}"
            );
            let () = redis::cmd("CLIENT")
                .arg("UNPAUSE")
                .query_async(&mut conn)
                .await
                .unwrap();
            dlock_testkit::wait_until(
                "the held-back delete runs",
                Duration::from_secs(5),
                async || {
                    redis::cmd("EXISTS")
                        .arg(&storage)
                        .query_async::<i64>(&mut conn)
                        .await
                        .unwrap()
                        == 0
                },
            )
            .await;
            // The backend works on, unfenced.
            let again = locks.try_acquire(&key).await.unwrap();
            again.release().await.unwrap();
        }
    }

    /// Two tenants of one server, each an ACL user limited to its own prefix: one cannot
    /// release, extend or read the other's lock through dlock (their namespaces are apart), nor
    /// through a backend pointed at the other's prefix, nor with raw commands; the lock and its
    /// token stay as they were. The production page's key pattern ends in `{*`: a prefix that begins
    /// another (`t:` and `t:x:`) would otherwise reach into it.
    async fn tenants(flavor: Flavor) {
        let Some(server) = server(flavor) else { return };
        // The provider's commands and those of the raw-token reads.
        let mut all = commands(flavor, true);
        all.extend(RAW_READS);
        set_user(&server, "tenant_a", "t:", &all).await;
        set_user(&server, "tenant_b", "t:x:", &all).await;
        let a = RedisBackend::connect(&user_url(&server, "tenant_a", "t:", ""))
            .await
            .unwrap();
        let b = RedisBackend::connect(&user_url(&server, "tenant_b", "t:x:", ""))
            .await
            .unwrap();
        let a_locks = LockProvider::from_backend(a.clone());
        let key = dlock_testkit::unique_key("tenant");
        let guard = a_locks.try_acquire(&key).await.expect("tenant a locks");
        let token = a
            .owner_token(&key)
            .await
            .unwrap()
            .expect("a reads its own token");
        let storage = a.storage_key(&key);
        let mut conn = admin(&server).await;
        let value = |conn: &mut redis::aio::MultiplexedConnection| {
            let (storage, mut conn) = (storage.clone(), conn.clone());
            async move {
                redis::cmd("GET")
                    .arg(storage)
                    .query_async::<Option<Vec<u8>>>(&mut conn)
                    .await
                    .unwrap()
            }
        };
        assert_eq!(value(&mut conn).await.as_deref(), Some(token.as_bytes()));

        // Through B's own namespace: another lock of the same name, never A's.
        assert_eq!(b.owner_token(&key).await.unwrap(), None);
        assert_eq!(
            b.release(&key, &token).await.unwrap(),
            ReleaseOutcome::AlreadyReleased
        );
        assert!(!b.reset_expiry(&key, &token, LEASE).await.unwrap());

        // B pointed at A's prefix: refused by the server, whatever it asks.
        let b_as_a = RedisBackend::connect(&user_url(&server, "tenant_b", "t:", ""))
            .await
            .unwrap();
        for (what, outcome) in [
            ("read", b_as_a.owner_token(&key).await.map(drop)),
            ("release", b_as_a.release(&key, &token).await.map(drop)),
            (
                "extend",
                b_as_a.reset_expiry(&key, &token, LEASE).await.map(drop),
            ),
            (
                "take",
                LockProvider::from_backend(b_as_a.clone())
                    .try_acquire(&key)
                    .await
                    .map(drop),
            ),
        ] {
            let err = outcome.expect_err(what);
            assert_eq!(err.db_code(), Some("NOPERM"), "{what}: {err}");
            assert!(
                !err.to_string().contains(&token.to_string()),
                "{what}: {err}"
            );
        }
        // Raw commands of B on A's key (over the plain port).
        let b_url = server
            .url("")
            .replacen("redis://", "redis://tenant_b:tenant_b-secret@", 1);
        let mut b_conn = redis::Client::open(b_url)
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap();
        for cmd in ["GET", "DEL", "PTTL"] {
            let err = redis::cmd(cmd)
                .arg(&storage)
                .query_async::<redis::Value>(&mut b_conn)
                .await
                .unwrap_err();
            assert_eq!(err.code(), Some("NOPERM"), "{cmd}: {err}");
        }
        // A's lock is untouched, and still A's.
        assert_eq!(value(&mut conn).await.as_deref(), Some(token.as_bytes()));
        assert!(!guard.is_lost());
        guard.release().await.expect("a releases");

        // Why `{*`: the rule `~t:*` would let tenant t: read t:x:'s keys.
        let b_key = b.storage_key("k");
        let () = redis::cmd("ACL")
            .arg(&[
                "SETUSER",
                "loose",
                "reset",
                "on",
                ">loose-secret",
                "~t:*",
                "+get",
            ])
            .query_async(&mut conn)
            .await
            .unwrap();
        let () = redis::cmd("ACL")
            .arg(&[
                "SETUSER",
                "tight",
                "reset",
                "on",
                ">tight-secret",
                "~t:{*",
                "+get",
            ])
            .query_async(&mut conn)
            .await
            .unwrap();
        for (user, reaches) in [("loose", true), ("tight", false)] {
            let url =
                server
                    .url("")
                    .replacen("redis://", &format!("redis://{user}:{user}-secret@"), 1);
            let mut c = redis::Client::open(url)
                .unwrap()
                .get_multiplexed_async_connection()
                .await
                .unwrap();
            let got = redis::cmd("GET")
                .arg(&b_key)
                .query_async::<redis::Value>(&mut c)
                .await;
            assert_eq!(got.is_ok(), reaches, "{user}: {got:?}");
        }
    }

    macro_rules! flavor {
        ($module:ident, $flavor:expr) => {
            mod $module {
                use super::*;

                /// Exactly the production page's commands for this flavour, on keys `app:{*`.
                mod conformance_as_acl_user {
                    use super::*;
                    dlock_testkit::conformance_suite!(optional async { acl_harness($flavor).await });
                }

                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn each_missing_command_is_named_and_nothing_else_is_tried() {
                    missing_commands($flavor).await;
                }

                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn tenants_cannot_touch_each_others_locks() {
                    tenants($flavor).await;
                }

                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn fencing_falls_back_without_client_permissions() {
                    fencing_without_permission($flavor).await;
                }
            }
        };
    }

    flavor!(redis7, Flavor::Redis7);
    flavor!(valkey81, Flavor::Valkey81);
    flavor!(valkey91, Flavor::Valkey91);
    flavor!(redis8, Flavor::Redis8);
}

/// `docs/production.md` gives, word for word, the statements and ACL rules these
/// tests grant.
#[test]
fn readme_gives_the_tested_grants() {
    let readme = readme();
    let mut missing = Vec::new();
    #[cfg(feature = "postgres")]
    for statement in postgres::ADMIN_SQL.iter().chain(postgres::FENCING_SQL) {
        // The production page's database is the application's, `app`; its roles have passwords.
        let documented = statement
            .replace(" locks", " app")
            .replace(" LOGIN", " LOGIN PASSWORD '…'");
        if !readme.contains(&format!("{documented};")) {
            missing.push(documented);
        }
    }
    #[cfg(feature = "mysql")]
    for statement in mysql::ADMIN_SQL {
        let documented = statement
            .replace("dlock_test.", "app.")
            .replace("'app-secret'", "'…'")
            .replace("'fenced-secret'", "'…'")
            .replace("'127.0.0.1'", "'%'");
        if !readme.contains(&format!("{documented};")) {
            missing.push(documented);
        }
    }
    #[cfg(feature = "redis")]
    for flavor in [
        dlock_testkit::redis::Flavor::Redis7,
        dlock_testkit::redis::Flavor::Valkey81,
        dlock_testkit::redis::Flavor::Valkey91,
        dlock_testkit::redis::Flavor::Redis8,
    ] {
        for fencing in [true, false] {
            let words = redis_acl::grant_words(flavor, fencing);
            if !readme.contains(&format!("`{words}`")) {
                missing.push(format!("{flavor:?} fencing={fencing}: `{words}`"));
            }
        }
    }
    #[cfg(feature = "redis")]
    {
        let words = redis_acl::READ_LOCKS
            .iter()
            .map(|c| format!("+{c}"))
            .collect::<Vec<_>>()
            .join(" ");
        if !readme.contains(&format!("`{words}`")) {
            missing.push(format!("read locks: `{words}`"));
        }
        let words = redis_acl::SEMAPHORES
            .iter()
            .map(|c| format!("+{c}"))
            .collect::<Vec<_>>()
            .join(" ");
        if !readme.contains(&format!("`{words}`")) {
            missing.push(format!("semaphores: `{words}`"));
        }
    }
    assert!(
        missing.is_empty(),
        "not in docs/production.md:\n{}",
        missing.join("\n")
    );
}
