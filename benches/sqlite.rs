//! SQLite: an uncontended acquire + release through dlock, beside raw rusqlite running the same
//! two statements on one connection with the same settings, in the same run.

use std::hint::black_box;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use criterion::{Criterion, criterion_group, criterion_main};
use dlock::sqlite::{ACQUIRE_SQL, RELEASE_SQL};
use rusqlite::{Connection, OptionalExtension, params};

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

fn acquire_release(c: &mut Criterion) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bench.db");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let locks = rt
        .block_on(dlock::LockProvider::connect(&format!(
            "sqlite://{}",
            path.display()
        )))
        .unwrap();

    let raw = Connection::open(&path).unwrap();
    raw.query_row("PRAGMA journal_mode = WAL", [], |_| Ok(()))
        .unwrap();
    raw.pragma_update(None, "synchronous", "NORMAL").unwrap();
    raw.busy_timeout(Duration::from_secs(5)).unwrap();
    let lease = 30_000i64;

    let mut group = c.benchmark_group("sqlite/acquire_release");
    group.bench_function("raw_rusqlite", |b| {
        let mut n = 0u64;
        b.iter(|| {
            n += 1;
            let owner = n.to_le_bytes();
            let now = now_ms();
            let token: Option<i64> = raw
                .prepare_cached(ACQUIRE_SQL)
                .unwrap()
                .query_row(params![b"bench:raw", &owner[..], now + lease, now], |r| {
                    r.get(0)
                })
                .optional()
                .unwrap();
            assert!(token.is_some());
            raw.prepare_cached(RELEASE_SQL)
                .unwrap()
                .execute(params![b"bench:raw", &owner[..]])
                .unwrap();
        })
    });
    group.bench_function("dlock", |b| {
        b.to_async(&rt).iter(|| async {
            let guard = locks.try_acquire(black_box("bench:dlock")).await.unwrap();
            guard.release().await.unwrap();
        })
    });
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(5));
    targets = acquire_release
}
criterion_main!(benches);
