//! Owner labels: who holds a lock, as store inspection (`LockProvider::store_locks`, `dlock ls`)
//! shows it, on SQLite, Redis, PostgreSQL and etcd; and what keeping them costs an acquisition.

use std::time::Duration;

use dlock::LockProvider;
use dlock_testkit::unique_key;

/// The owner `store_locks` shows for `key`.
async fn owner_of(locks: &LockProvider, key: &str) -> Option<String> {
    locks
        .store_locks()
        .await
        .expect("store inspection")
        .into_iter()
        .find(|lock| lock.key.as_deref() == Some(key))
        .and_then(|lock| lock.owner().map(str::to_owned))
}

/// The default label is `host:pid`.
#[cfg_attr(not(any(feature = "sqlite", feature = "etcd")), allow(dead_code))]
fn assert_default_label(label: &str) {
    let (host, pid) = label.rsplit_once(':').expect("host:pid");
    assert!(!host.is_empty(), "{label}");
    assert_eq!(pid, std::process::id().to_string(), "{label}");
}

#[cfg(feature = "sqlite")]
mod sqlite {
    use super::*;

    async fn provider(path: &std::path::Path, label: Option<&str>) -> LockProvider {
        let backend = dlock::sqlite::SqliteBackend::open(path).await.unwrap();
        let builder = LockProvider::builder(backend);
        match label {
            Some(label) => builder.owner_label(label).build(),
            None => builder.build(),
        }
    }

    /// Each lock shows the label of the provider that holds it (a read lock, its readers'),
    /// whichever provider lists it; released locks are gone, and so are the labels of
    /// backends that hold nothing once another backend records its own.
    #[tokio::test]
    async fn locks_show_their_owners() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("locks.db");
        let a = provider(&path, Some("worker-a")).await;
        let b = provider(&path, None).await;
        assert_eq!(a.owner_label(), "worker-a");
        assert_default_label(b.owner_label());

        let exclusive = a.try_acquire("jobs:a").await.unwrap();
        let by_b = b.try_acquire("jobs:b").await.unwrap();
        let read_a = a.try_acquire_read("prices").await.unwrap();
        let read_b = b.try_acquire_read("prices").await.unwrap();
        for lister in [&a, &b] {
            assert_eq!(
                owner_of(lister, "jobs:a").await.as_deref(),
                Some("worker-a")
            );
            assert_eq!(
                owner_of(lister, "jobs:b").await.as_deref(),
                Some(b.owner_label())
            );
            let readers = owner_of(lister, "prices").await.unwrap();
            let mut labels: Vec<&str> = readers.split(',').collect();
            labels.sort_unstable();
            let mut expected = vec!["worker-a", b.owner_label()];
            expected.sort_unstable();
            assert_eq!(labels, expected);
        }
        for guard in [exclusive, by_b, read_a, read_b] {
            guard.release().await.unwrap();
        }
        assert!(a.store_locks().await.unwrap().is_empty());

        // A record not written for a day is deleted when another backend records its label,
        // unless its backend still holds a lock; the labels of live backends stay.
        let conn = rusqlite::Connection::open(&path).unwrap();
        let labels = || {
            let mut rows: Vec<String> = conn
                .prepare("SELECT label FROM __distributed_lock_owners")
                .unwrap()
                .query_map([], |row| row.get(0))
                .unwrap()
                .map(Result::unwrap)
                .collect();
            rows.sort();
            rows
        };
        let held = a.try_acquire("jobs:held").await.unwrap();
        conn.execute(
            "INSERT INTO __distributed_lock_owners (id, label, written) VALUES (x'0102030405060708', 'gone', 0)",
            [],
        )
        .unwrap();
        conn.execute(
            "UPDATE __distributed_lock_owners SET written = 0 WHERE label = 'worker-a'",
            [],
        )
        .unwrap();
        let c = provider(&path, Some("worker-c")).await;
        c.try_acquire("jobs:c")
            .await
            .unwrap()
            .release()
            .await
            .unwrap();
        let mut expected = vec![
            b.owner_label().to_owned(),
            "worker-a".into(),
            "worker-c".into(),
        ];
        expected.sort();
        assert_eq!(
            labels(),
            expected,
            "the stale record of a backend that holds nothing went"
        );
        assert_eq!(owner_of(&c, "jobs:held").await.as_deref(), Some("worker-a"));
        held.release().await.unwrap();
    }

    /// The listing says when each exclusive lock was taken (between the calls around its
    /// acquisition, on this machine's wall clock), a renewal does not move it, a new holder's
    /// time is its own, and a row whose time is not its holder's (taken over by a version that
    /// does not record it, or held by readers) shows none. A file made by an earlier version
    /// gets the columns when opened.
    #[tokio::test]
    async fn locks_show_when_they_were_taken() {
        use std::time::SystemTime;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("locks.db");
        // A lock table as earlier versions made it, without the acquisition-time columns.
        let conn = rusqlite::Connection::open(&path).unwrap();
        conn.execute_batch(
            "CREATE TABLE __distributed_locks (name BLOB NOT NULL PRIMARY KEY, owner BLOB, \
             lease_end INTEGER NOT NULL DEFAULT 0, fencing INTEGER NOT NULL DEFAULT 0, \
             boot BLOB) WITHOUT ROWID",
        )
        .unwrap();
        let a = provider(&path, Some("a")).await;
        let b = provider(&path, Some("b")).await;
        let since_of = async |key: &str| {
            b.store_locks()
                .await
                .expect("store inspection")
                .into_iter()
                .find(|lock| lock.key.as_deref() == Some(key))
                .unwrap_or_else(|| panic!("{key} is listed"))
                .since()
        };
        let before = SystemTime::now();
        let guard = a.try_acquire("jobs:a").await.unwrap();
        let after = SystemTime::now();
        let since = since_of("jobs:a").await.expect("the time it was taken");
        // Recorded in whole milliseconds.
        assert!(
            since + Duration::from_millis(1) >= before && since <= after,
            "{since:?} not within {before:?}..{after:?}"
        );
        guard.extend(Duration::from_secs(60)).await.unwrap();
        assert_eq!(since_of("jobs:a").await, Some(since), "a renewal keeps it");
        guard.release().await.unwrap();
        let later = b.try_acquire("jobs:a").await.unwrap();
        let again = since_of("jobs:a").await.expect("the new holder's time");
        assert!(again >= since, "{again:?} before {since:?}");
        // Another owner token, as an earlier version writes when it takes the row over.
        let changed = conn
            .execute(
                "UPDATE __distributed_locks SET owner = zeroblob(16) WHERE name = ?1",
                [b"jobs:a".as_slice()],
            )
            .unwrap();
        assert_eq!(changed, 1);
        assert_eq!(since_of("jobs:a").await, None);
        drop(later);
        let reader = a.try_acquire_read("prices").await.unwrap();
        assert_eq!(since_of("prices").await, None, "readers show no time");
        reader.release().await.unwrap();
    }
}

#[cfg(feature = "redis")]
mod redis {
    use super::*;
    use dlock_testkit::redis::{Flavor, RedisServer};

    /// Each lock shows its holder's label (read locks, their readers'). The label is written
    /// once: the first acquisition and release send one `SET` more than the next, and fifty
    /// more send no more commands each than the second did.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn locks_show_their_owners_at_no_cost_per_acquisition() {
        let Some(server) = RedisServer::start(Flavor::Redis7) else {
            return;
        };
        let provider = |label: &'static str| {
            let url = server.url("");
            async move {
                let backend = dlock::redis::RedisBackend::connect(&url).await.unwrap();
                LockProvider::builder(backend).owner_label(label).build()
            }
        };
        let (a, b) = (provider("worker-a").await, provider("worker-b").await);
        let key = unique_key("owned");
        let before = server.commands_sent();
        let guard = a.try_acquire(&key).await.unwrap();
        dlock_testkit::wait_until(
            "the label is recorded",
            Duration::from_secs(5),
            async || owner_of(&b, &key).await.as_deref() == Some("worker-a"),
        )
        .await;
        guard.release().await.unwrap();
        let first = server.commands_sent();
        let first_sets = first.calls("set") - before.calls("set");

        let cycle = async || {
            a.try_acquire(&key).await.unwrap().release().await.unwrap();
        };
        let start = server.commands_sent();
        cycle().await;
        let second = server.commands_sent();
        let (one, sets) = (
            second.total() - start.total(),
            second.calls("set") - start.calls("set"),
        );
        assert_eq!(
            first_sets,
            sets + 1,
            "the first cycle wrote the label, once"
        );
        for _ in 0..50 {
            cycle().await;
        }
        let after = server.commands_sent();
        assert_eq!(
            after.calls("set") - second.calls("set"),
            50 * sets,
            "no other label write"
        );
        assert_eq!(
            after.total() - second.total(),
            50 * one,
            "{one} commands a cycle"
        );

        let prices = unique_key("prices");
        let read_a = a.try_acquire_read(&prices).await.unwrap();
        let read_b = b.try_acquire_read(&prices).await.unwrap();
        dlock_testkit::wait_until(
            "both labels are recorded",
            Duration::from_secs(5),
            async || {
                owner_of(&a, &prices).await.is_some_and(|owners| {
                    let mut labels: Vec<&str> = owners.split(',').collect();
                    labels.sort_unstable();
                    labels == ["worker-a", "worker-b"]
                })
            },
        )
        .await;
        read_a.release().await.unwrap();
        read_b.release().await.unwrap();
    }
}

#[cfg(feature = "postgres")]
mod postgres {
    use super::*;

    /// PostgreSQL's owner is the holding session's `application_name`: `dlock` unless the
    /// URL names it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn locks_show_the_sessions_application_name() {
        let server = dlock_testkit::postgres::PgServer::shared();
        let named = LockProvider::connect(&server.url("application_name=billing-7"))
            .await
            .unwrap();
        let plain = LockProvider::connect(&server.url("")).await.unwrap();
        let (k1, k2) = (unique_key("pg-owned"), unique_key("pg-owned"));
        let g1 = named.try_acquire(&k1).await.unwrap();
        let g2 = plain.try_acquire(&k2).await.unwrap();
        assert_eq!(owner_of(&named, &k1).await.as_deref(), Some("billing-7"));
        assert_eq!(owner_of(&plain, &k2).await.as_deref(), Some("dlock"));
        g1.release().await.unwrap();
        g2.release().await.unwrap();
    }
}

#[cfg(feature = "etcd")]
mod etcd {
    use super::*;

    /// etcd's owner is the value of the holder's key: the provider's label, written in the
    /// put the acquisition makes anyway. The listing shows each lock's holder (not its
    /// waiters), its token and lease, and a long key (stored shortened) by its key when the
    /// listing provider holds it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn locks_show_their_owners() {
        let Some(cluster) = dlock_testkit::etcd::EtcdCluster::single() else {
            return;
        };
        let url = cluster.url("lease=5s");
        let backend = dlock::etcd::EtcdBackend::connect(&url).await.unwrap();
        let a = LockProvider::builder(backend)
            .owner_label("worker-a")
            .build();
        let b = LockProvider::connect(&url).await.unwrap();
        let key = unique_key("etcd-owned/with%slash");
        let guard = a.try_acquire(&key).await.unwrap();
        let waiter = {
            let (b, key) = (b.clone(), key.clone());
            tokio::spawn(async move { b.acquire(&key, Duration::from_secs(30)).await })
        };
        dlock_testkit::wait_until("the waiter queued", Duration::from_secs(5), async || {
            b.local_key_count() == 1
        })
        .await;
        for lister in [&a, &b] {
            let listed: Vec<_> = lister
                .store_locks()
                .await
                .unwrap()
                .into_iter()
                .filter(|lock| lock.key.as_deref() == Some(key.as_str()))
                .collect();
            assert_eq!(listed.len(), 1, "the holder, not its waiter: {listed:?}");
            assert_eq!(listed[0].owner(), Some("worker-a"));
            assert_eq!(listed[0].fencing_token, guard.fencing_token());
            let left = listed[0].remaining_lease.expect("its lease");
            assert!(left > Duration::ZERO && left <= Duration::from_secs(5));
            assert_eq!(listed[0].since(), None, "etcd keeps no time");
        }
        guard.release().await.unwrap();
        let next = waiter.await.unwrap().unwrap();
        assert_default_label(&owner_of(&a, &key).await.expect("b's label"));
        next.release().await.unwrap();

        let long = format!("{}-{}", unique_key("etcd-long"), "x".repeat(300));
        let held = b.try_acquire(&long).await.unwrap();
        assert_default_label(&owner_of(&b, &long).await.expect("named by its holder"));
        let elsewhere = a.store_locks().await.unwrap();
        assert!(
            elsewhere
                .iter()
                .any(|lock| lock.key.is_none() && lock.fencing_token == held.fencing_token()),
            "listed by its etcd key where the key is not known: {elsewhere:?}"
        );
        held.release().await.unwrap();
    }
}
