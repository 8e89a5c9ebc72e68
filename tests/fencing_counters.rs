//! Bounded fencing counters (`fencing_counters=N`) on real servers: tokens strictly increase
//! per key across keys that share counters and across processes, the store holds at most
//! `N` counters however many keys were locked, switching the mode never hands out a lower
//! token (a backend switched away refuses with `LockError::Config`), and bad values are
//! configuration errors.
#![cfg(all(feature = "redis", feature = "postgres", feature = "sqlite"))]

mod support;

use std::collections::HashMap;
use std::time::Duration;

use dlock::{LockError, LockProvider};
use dlock_testkit::unique_key;
use support::{Fencing, run_exclusion};

/// Takes and releases each of `keys` `rounds` times, alternating between `providers`, and
/// checks that each key's tokens strictly increase; returns each key's last token.
async fn tokens_increase(
    providers: &[&LockProvider],
    keys: &[String],
    rounds: usize,
    last: &mut HashMap<String, u64>,
) {
    let mut turn = 0;
    for _ in 0..rounds {
        for key in keys {
            let provider = providers[turn % providers.len()];
            turn += 1;
            let guard = provider.try_acquire(key).await.unwrap();
            let token = guard.fencing_token().expect("a fencing token");
            if let Some(before) = last.insert(key.clone(), token) {
                assert!(token > before, "{key}: token {token} after {before}");
            }
            guard.release().await.unwrap();
        }
    }
}

/// The keys `name:0` .. `name:count`.
fn keys(name: &str, count: usize) -> Vec<String> {
    let base = unique_key(name);
    (0..count).map(|i| format!("{base}:{i}")).collect()
}

fn is_config(err: &LockError) -> bool {
    matches!(err, LockError::Config { .. })
}

/// An acquisition's error, expected to be a configuration error.
async fn refused(provider: &LockProvider, key: &str) -> LockError {
    match provider.try_acquire(key).await {
        Ok(_) => panic!("{key}: a backend that is not the store's mode issued a token"),
        Err(err) => {
            assert!(is_config(&err), "{err:?}");
            err
        }
    }
}

/// What a backend adds to the switching test, at each stage.
enum Stage {
    /// The per-key rounds are done; the store is still in per-key mode.
    PerKey,
    /// The store was switched to 16 shared counters, and a per-key backend tried it.
    Switched,
}

/// Per-key counters, then 16 shared ones, then 2, then 16 again, on the store `url(options)`
/// names: no token is ever lower than one handed out before, and a backend switched away
/// refuses with a configuration error that names the new mode (tries and read locks, and
/// with `wait` waits of that length), holding nothing after. With `refuses_at_open`, a new
/// per-key backend refuses the switched store when it opens (the SQL stores read the mode
/// then; Redis at the first fenced acquisition). `also` adds the backend's own checks.
async fn switching_never_hands_out_a_lower_token(
    url: impl Fn(&str) -> String,
    refuses_at_open: bool,
    wait: Option<Duration>,
    also: impl Fn(Stage, &[String], &mut HashMap<String, u64>),
) {
    let keys = keys("switch", 30);
    let mut last = HashMap::new();
    // Per-key counters first, pushed well up.
    let per_key = LockProvider::connect(&url("")).await.unwrap();
    tokens_increase(&[&per_key], &keys, 20, &mut last).await;
    also(Stage::PerKey, &keys, &mut last);
    // Then 16 shared counters: every token above the per-key ones.
    let sixteen = LockProvider::connect(&url("fencing_counters=16"))
        .await
        .unwrap();
    tokens_increase(&[&sixteen], &keys, 3, &mut last).await;
    if refuses_at_open {
        let err = LockProvider::connect(&url("")).await.unwrap_err();
        assert!(is_config(&err), "{err:?}");
        assert!(err.to_string().contains("fencing_counters=16"), "{err}");
    }
    also(Stage::Switched, &keys, &mut last);
    // Then 2 counters: a switch, above every token so far; the 16-counter backend, switched
    // away, refuses rather than issue lower tokens.
    let two = LockProvider::connect(&url("fencing_counters=2"))
        .await
        .unwrap();
    tokens_increase(&[&two], &keys, 3, &mut last).await;
    let err = refused(&sixteen, &keys[1]).await;
    assert!(err.to_string().contains("fencing_counters=2"), "{err}");
    if let Some(wait) = wait {
        let err = sixteen.acquire(&keys[2], wait).await.unwrap_err();
        assert!(is_config(&err), "{err:?}");
    }
    assert!(is_config(
        &sixteen.try_acquire_read(&keys[3]).await.unwrap_err()
    ));
    // Nothing was left held by the refusals.
    tokens_increase(&[&two], &keys, 1, &mut last).await;
    // Back to 16, in a new backend: a new epoch, above everything.
    let sixteen_again = LockProvider::connect(&url("fencing_counters=16"))
        .await
        .unwrap();
    tokens_increase(&[&sixteen_again], &keys, 2, &mut last).await;
    refused(&two, &keys[4]).await;
}

mod on_redis {
    use super::*;
    use dlock_testkit::redis::{Flavor, RedisServer};

    fn start() -> Option<RedisServer> {
        RedisServer::start(Flavor::Redis7)
    }

    async fn db_size(server: &RedisServer) -> u64 {
        let mut conn = server
            .client()
            .get_multiplexed_async_connection()
            .await
            .unwrap();
        let keys: Vec<Vec<u8>> = ::redis::cmd("KEYS")
            .arg("*")
            .query_async(&mut conn)
            .await
            .unwrap();
        // Each provider's owner label (one key per provider, written on a task of its own at
        // its first acquisition) is not a lock's: left out, so that the count is exact.
        let label = b"\xffowner:";
        keys.iter()
            .filter(|k| !k.windows(label.len()).any(|w| w == label))
            .count() as u64
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn tokens_increase_per_key_on_shared_counters() {
        let Some(server) = start() else { return };
        let url = server.url("fencing_counters=4");
        let a = LockProvider::connect(&url).await.unwrap();
        let b = LockProvider::connect(&url).await.unwrap();
        let keys = keys("shared", 40);
        let mut last = HashMap::new();
        tokens_increase(&[&a, &b], &keys, 5, &mut last).await;
        // Read locks take their tokens from the same counters.
        for key in &keys {
            let read = b.try_acquire_read(key).await.unwrap();
            let token = read.fencing_token().unwrap();
            assert!(token > last[key], "{key}");
            last.insert(key.clone(), token);
            read.release().await.unwrap();
        }
        tokens_increase(&[&b, &a], &keys, 2, &mut last).await;
        // Two processes on 12 keys over 4 counters: exclusion and increasing tokens.
        run_exclusion(&url, &unique_key("procs"), 2, 2, 12, 400, Fencing::Every);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_store_stays_bounded() {
        let Some(server) = start() else { return };
        let provider = LockProvider::connect(&server.url("fencing_counters=16"))
            .await
            .unwrap();
        let keys = keys("bounded", 5_000);
        for key in &keys {
            let guard = provider.try_acquire(key).await.unwrap();
            guard.release().await.unwrap();
        }
        // At most 16 counters and the record of their mode; no key per lock (owner labels
        // left out, see `db_size`).
        let size = db_size(&server).await;
        assert!(size <= 17, "{size} keys after 5,000 distinct locks");
        // Per-key counters, for comparison: one key per lock ever taken.
        let per_key = LockProvider::connect(&server.url("prefix=pk:"))
            .await
            .unwrap();
        for key in keys.iter().take(100) {
            per_key
                .try_acquire(key)
                .await
                .unwrap()
                .release()
                .await
                .unwrap();
        }
        assert_eq!(db_size(&server).await, size + 100);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn switching_never_hands_out_a_lower_token() {
        let Some(server) = start() else { return };
        let url = |options: &str| server.url(options);
        super::switching_never_hands_out_a_lower_token(url, false, None, |_, _, _| ()).await;
    }

    /// Per-key counters on a store that had shared ones: each backend refuses its first
    /// fenced acquisition (a try, a read lock, a wait) with a configuration error naming the
    /// store's mode, as the SQL stores refuse such a store when they open, and holds nothing
    /// after; the shared counters go on from where they were. `per_key` and `shared` name the
    /// same prefix (and layout) on the deployment.
    async fn going_back_is_refused(per_key: &str, shared: &str) {
        let key = unique_key("back");
        let mut last = HashMap::new();
        let before = LockProvider::connect(per_key).await.unwrap();
        tokens_increase(&[&before], std::slice::from_ref(&key), 3, &mut last).await;
        let counted = LockProvider::connect(shared).await.unwrap();
        tokens_increase(&[&counted], std::slice::from_ref(&key), 2, &mut last).await;
        let back = LockProvider::connect(per_key).await.unwrap();
        let err = refused(&back, &key).await;
        assert!(err.to_string().contains("fencing_counters=4"), "{err}");
        let err = back.try_acquire_read(&key).await.unwrap_err();
        assert!(is_config(&err), "{err:?}");
        let err = back
            .acquire(&unique_key("back-wait"), Duration::from_millis(300))
            .await
            .unwrap_err();
        assert!(is_config(&err), "{err:?}");
        assert_eq!(back.local_key_count(), 0);
        tokens_increase(&[&counted], std::slice::from_ref(&key), 2, &mut last).await;
    }

    /// Going back from `fencing_counters` to per-key counters on one server, in both key
    /// layouts: refused (a key's token once went from 562949953421322 to 1 here).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn going_back_to_per_key_counters_is_refused() {
        let Some(server) = start() else { return };
        for layout in ["tagged", "plain"] {
            let options = format!("prefix=back-{layout}:&key_layout={layout}");
            going_back_is_refused(
                &server.url(&options),
                &server.url(&format!("{options}&fencing_counters=4")),
            )
            .await;
        }
    }

    /// With `key_layout=plain`, a name written as a hash tag (`{order:42}`) is the very Redis
    /// key of the tagged layout's lock `order:42`: the two layouts exclude each other on it,
    /// but each counts its tokens in a counter of its own (`p:{order:42}:fence`, and the
    /// plain one with its 0xFF), so their tokens are not ordered with each other. The module
    /// docs say so (never take one lock through both layouts); this pins it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_hash_tagged_plain_name_is_the_tagged_lock_with_a_counter_of_its_own() {
        let Some(server) = start() else { return };
        let tagged = LockProvider::connect(&server.url("prefix=twin:"))
            .await
            .unwrap();
        let plain = LockProvider::connect(&server.url("prefix=twin:&key_layout=plain"))
            .await
            .unwrap();
        let name = unique_key("order");
        let mut last = 0;
        for _ in 0..3 {
            let guard = tagged.try_acquire(&name).await.unwrap();
            last = guard.fencing_token().unwrap();
            assert!(matches!(
                plain.try_acquire(&format!("{{{name}}}")).await,
                Err(LockError::AlreadyHeld { .. })
            ));
            guard.release().await.unwrap();
        }
        let twin = plain.try_acquire(&format!("{{{name}}}")).await.unwrap();
        assert!(
            twin.fencing_token().unwrap() < last,
            "{:?} after {last}",
            twin.fencing_token()
        );
        twin.release().await.unwrap();
    }

    /// The same behind Sentinel.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn going_back_to_per_key_counters_is_refused_behind_sentinel() {
        use dlock_testkit::redis::SentinelDeployment;
        let Some(deployment) =
            tokio::task::block_in_place(|| SentinelDeployment::start(Duration::from_secs(20)))
        else {
            return;
        };
        tokio::task::block_in_place(|| deployment.wait_ready());
        going_back_is_refused(
            &deployment.url("prefix=back:"),
            &deployment.url("prefix=back:&fencing_counters=4"),
        )
        .await;
    }

    /// A Cluster cannot have shared counters, but its data can come from a server that had
    /// them (a migration copies the record of their mode): a per-key Cluster backend refuses
    /// such a prefix.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_cluster_refuses_a_prefix_that_had_shared_counters() {
        use dlock_testkit::redis::RedisCluster;
        let Some(cluster) = tokio::task::block_in_place(RedisCluster::shared) else {
            return;
        };
        let prefix = format!("{}:", unique_key("migrated"));
        let locks = LockProvider::connect(&cluster.url(&format!("prefix={prefix}")))
            .await
            .unwrap();
        let key = unique_key("k");
        let guard = locks.try_acquire(&key).await.unwrap();
        assert!(guard.fencing_token().is_some());
        guard.release().await.unwrap();
        let record = format!("{prefix}{{%fence}}");
        let owner = tokio::task::block_in_place(|| {
            let owner = cluster.owner_of(cluster.slot_of(record.as_bytes()));
            cluster
                .command(owner, &[b"SET", record.as_bytes(), b"4:1"])
                .expect("write the record");
            owner
        });
        let fresh = LockProvider::connect(&cluster.url(&format!("prefix={prefix}")))
            .await
            .unwrap();
        let err = refused(&fresh, &key).await;
        assert!(err.to_string().contains("fencing_counters=4"), "{err}");
        tokio::task::block_in_place(|| {
            cluster
                .command(owner, &[b"DEL", record.as_bytes()])
                .expect("clean up");
        });
    }

    /// Redlock nodes cannot have shared counters either; a node whose prefix was switched by
    /// a single-server backend refuses, and the Redlock backend says so rather than count on
    /// the other nodes.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redlock_refuses_a_node_that_had_shared_counters() {
        let Some(servers) = (0..3)
            .map(|_| RedisServer::start(Flavor::Redis7))
            .collect::<Option<Vec<_>>>()
        else {
            return;
        };
        let hosts: Vec<String> = servers
            .iter()
            .map(|s| format!("127.0.0.1:{}", s.port()))
            .collect();
        let url = format!("redlock://{}/?prefix=rl:", hosts.join(","));
        let key = unique_key("rl");
        let mut last = HashMap::new();
        let before = LockProvider::connect(&url).await.unwrap();
        tokens_increase(&[&before], std::slice::from_ref(&key), 3, &mut last).await;
        let node = LockProvider::connect(&servers[0].url("prefix=rl:&fencing_counters=4"))
            .await
            .unwrap();
        tokens_increase(&[&node], std::slice::from_ref(&key), 1, &mut last).await;
        let fresh = LockProvider::connect(&url).await.unwrap();
        let err = refused(&fresh, &key).await;
        assert!(err.to_string().contains("fencing_counters=4"), "{err}");
        assert_eq!(fresh.local_key_count(), 0);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn bad_values_are_config_errors() {
        for bad in ["0", "-1", "65537", "4294967296", "many", "", "1.5"] {
            let url = format!("redis://127.0.0.1:1/?fencing_counters={bad}");
            let err = dlock::redis::RedisBackend::builder_from_url(&url).unwrap_err();
            assert!(is_config(&err), "{bad}: {err:?}");
        }
        let Some(server) = start() else { return };
        let err = LockProvider::connect(&server.url("fencing_counters=8&fencing=false"))
            .await
            .unwrap_err();
        assert!(is_config(&err), "{err:?}");
        let err = dlock::redis::RedisBackend::builder(server.client())
            .fencing_counters(0)
            .connect()
            .await
            .unwrap_err();
        assert!(is_config(&err), "{err:?}");
    }
}

mod on_postgres {
    use super::*;
    use dlock_testkit::postgres::PgServer;
    use sqlx::{Connection, PgConnection};

    async fn rows(server: &PgServer) -> i64 {
        let mut conn = PgConnection::connect(&server.url("")).await.unwrap();
        sqlx::query_scalar("SELECT count(*) FROM dlock_fencing")
            .fetch_one(&mut conn)
            .await
            .unwrap()
    }

    fn url(server: &PgServer, options: &str) -> String {
        server.url(&format!("fencing=true&{options}"))
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn tokens_increase_per_key_on_shared_counters() {
        let server = PgServer::start();
        let url = url(&server, "fencing_counters=4");
        let a = LockProvider::connect(&url).await.unwrap();
        let b = LockProvider::connect(&url).await.unwrap();
        let keys = keys("shared", 40);
        let mut last = HashMap::new();
        tokens_increase(&[&a, &b], &keys, 5, &mut last).await;
        for key in &keys {
            // Read locks, and waits (the statement that waits increments too).
            let read = b.try_acquire_read(key).await.unwrap();
            let token = read.fencing_token().unwrap();
            assert!(token > last[key], "{key}");
            read.release().await.unwrap();
            let waited = a.acquire(key, Duration::from_secs(5)).await.unwrap();
            let next = waited.fencing_token().unwrap();
            assert!(next > token, "{key}");
            last.insert(key.clone(), next);
            waited.release().await.unwrap();
        }
        tokens_increase(&[&b, &a], &keys, 2, &mut last).await;
        run_exclusion(&url, &unique_key("procs"), 2, 2, 12, 300, Fencing::Every);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_store_stays_bounded() {
        let server = PgServer::start();
        let provider = LockProvider::connect(&url(&server, "fencing_counters=16"))
            .await
            .unwrap();
        for key in &keys("bounded", 5_000) {
            provider
                .try_acquire(key)
                .await
                .unwrap()
                .release()
                .await
                .unwrap();
        }
        // At most 16 counter rows and the row of their mode.
        let count = rows(&server).await;
        assert!(count <= 17, "{count} rows after 5,000 distinct locks");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn switching_never_hands_out_a_lower_token() {
        let server = PgServer::start();
        let on_server = |options: &str| url(&server, options);
        let wait = Some(Duration::from_secs(5));
        super::switching_never_hands_out_a_lower_token(on_server, true, wait, |_, _, _| ()).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn bad_values_are_config_errors() {
        for bad in ["0", "-1", "65537", "4294967296", "many", "", "1.5"] {
            let url = format!("postgres://u@127.0.0.1:1/db?fencing=true&fencing_counters={bad}");
            let err = LockProvider::connect(&url).await.unwrap_err();
            assert!(is_config(&err), "{bad}: {err:?}");
        }
        let err = LockProvider::connect("postgres://u@127.0.0.1:1/db?fencing_counters=8")
            .await
            .unwrap_err();
        assert!(is_config(&err), "fencing off: {err:?}");
        // Not on MySQL, SQL Server or Oracle in this version: refused before connecting.
        #[cfg(feature = "mysql")]
        {
            let url = "mysql://u@127.0.0.1:1/db?fencing=true&fencing_counters=8";
            let err = LockProvider::connect(url).await.unwrap_err();
            assert!(is_config(&err), "mysql: {err:?}");
            assert!(err.to_string().contains("not available"), "{err}");
        }
        #[cfg(feature = "mssql")]
        {
            let url = "mssql://u:p@127.0.0.1:1/db?fencing=true&fencing_counters=8";
            let err = LockProvider::connect(url).await.unwrap_err();
            assert!(is_config(&err), "mssql: {err:?}");
            assert!(err.to_string().contains("not available"), "{err}");
        }
        #[cfg(feature = "oracle")]
        {
            let url = "oracle://u:p@127.0.0.1:1/db?fencing=true&fencing_counters=8";
            let err = LockProvider::connect(url).await.unwrap_err();
            assert!(is_config(&err), "oracle: {err:?}");
            assert!(err.to_string().contains("not available"), "{err}");
        }
    }
}

mod on_sqlite {
    use super::*;
    use std::path::Path;

    fn count(file: &Path, table: &str) -> i64 {
        let conn = rusqlite::Connection::open(file).unwrap();
        conn.query_row(&format!("SELECT count(*) FROM {table}"), [], |row| {
            row.get(0)
        })
        .unwrap()
    }

    fn url(file: &Path, options: &str) -> String {
        format!("sqlite://{}?{options}", file.display())
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn tokens_increase_per_key_on_shared_counters() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("locks.db");
        let url = url(&file, "fencing_counters=4");
        let a = LockProvider::connect(&url).await.unwrap();
        let b = LockProvider::connect(&url).await.unwrap();
        let keys = keys("shared", 40);
        let mut last = HashMap::new();
        tokens_increase(&[&a, &b], &keys, 5, &mut last).await;
        for key in &keys {
            let read = b.try_acquire_read(key).await.unwrap();
            let second = a.try_acquire_read(key).await.unwrap();
            let token = read.fencing_token().unwrap();
            assert!(token > last[key], "{key}");
            assert!(second.fencing_token().unwrap() > token, "{key}");
            last.insert(key.clone(), second.fencing_token().unwrap());
            read.release().await.unwrap();
            second.release().await.unwrap();
        }
        tokens_increase(&[&b, &a], &keys, 2, &mut last).await;
        // Every row released: none left.
        assert_eq!(count(&file, "__distributed_locks"), 0);
        run_exclusion(&url, &unique_key("procs"), 2, 2, 12, 400, Fencing::Every);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_store_stays_bounded() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("locks.db");
        let provider = LockProvider::connect(&url(&file, "fencing_counters=16"))
            .await
            .unwrap();
        for key in &keys("bounded", 5_000) {
            provider
                .try_acquire(key)
                .await
                .unwrap()
                .release()
                .await
                .unwrap();
        }
        let held = provider.try_acquire("still-held").await.unwrap();
        // At most 16 counters and the mode row; only the lock held now has a row.
        let counters = count(&file, "__distributed_lock_counters");
        assert!(
            counters <= 17,
            "{counters} counter rows after 5,000 distinct locks"
        );
        assert_eq!(count(&file, "__distributed_locks"), 1);
        assert_eq!(count(&file, "__distributed_lock_readers"), 0);
        held.release().await.unwrap();
        assert_eq!(count(&file, "__distributed_locks"), 0);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn switching_never_hands_out_a_lower_token() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("locks.db");
        // Transaction-bound locks: one before the switch records its token in the `-fencing`
        // file, and the shared counters' tokens are above it too; after the switch they
        // refuse the file.
        let in_transaction = |stage, keys: &[String], last: &mut HashMap<String, u64>| {
            let mut conn = rusqlite::Connection::open(&file).unwrap();
            let tx = conn.transaction().unwrap();
            let lock = dlock::sqlite::try_acquire_in_transaction(&tx, &keys[0]);
            match stage {
                Stage::PerKey => {
                    let token = lock.unwrap().fencing_token().unwrap();
                    assert!(token > last[&keys[0]]);
                    last.insert(keys[0].clone(), token);
                    tx.rollback().unwrap();
                }
                Stage::Switched => {
                    let err = lock.unwrap_err();
                    assert!(is_config(&err), "{err:?}");
                }
            }
        };
        let on_file = |options: &str| url(&file, options);
        let wait = Some(Duration::from_secs(1));
        super::switching_never_hands_out_a_lower_token(on_file, true, wait, in_transaction).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn bad_values_are_config_errors() {
        for bad in ["0", "-1", "65537", "4294967296", "many", "", "1.5"] {
            let url = format!("sqlite://locks.db?fencing_counters={bad}");
            let err = dlock::sqlite::SqliteBackend::builder_from_url(&url).unwrap_err();
            assert!(is_config(&err), "{bad}: {err:?}");
        }
        let dir = tempfile::tempdir().unwrap();
        let err = dlock::sqlite::SqliteBackend::builder(dir.path().join("l.db"))
            .fencing_counters(70_000)
            .open()
            .await
            .unwrap_err();
        assert!(is_config(&err), "{err:?}");
    }
}
