//! SQLite: an uncontended acquire + release through dlock, beside raw rusqlite running the same
//! two statements on one connection with the same settings, in the same run.

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};

#[path = "shared/raw.rs"]
mod raw;

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

    let mut raw = raw::Sqlite::open(&path);

    let mut group = c.benchmark_group("sqlite/acquire_release");
    group.bench_function("raw_rusqlite", |b| {
        b.iter(|| raw.acquire_release(b"bench:raw"))
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
