//! Store-independent hot paths: `lock_id` by key length, and a contended `try_acquire`
//! answered from the in-process table.

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use futures::FutureExt;

fn lock_id(c: &mut Criterion) {
    let mut group = c.benchmark_group("lock_id");
    for len in [8usize, 32, 64, 256, 1024] {
        let key = "k".repeat(len);
        group.throughput(Throughput::Bytes(len as u64));
        group.bench_with_input(BenchmarkId::from_parameter(len), &key, |b, key| {
            b.iter(|| dlock::lock_id(black_box(key)))
        });
    }
    group.finish();
}

#[cfg(feature = "sqlite")]
fn contended_try_acquire(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}/bench.db", dir.path().display());
    let locks = rt.block_on(dlock::LockProvider::connect(&url)).unwrap();
    let guard = rt.block_on(locks.try_acquire("jobs:billing")).unwrap();
    let _enter = rt.enter();
    c.bench_function("try_acquire/contended_in_process", |b| {
        b.iter(|| {
            let outcome = locks
                .try_acquire(black_box("jobs:billing"))
                .now_or_never()
                .expect("answered at once");
            black_box(outcome.is_err())
        })
    });
    drop(guard);
}

#[cfg(not(feature = "sqlite"))]
fn contended_try_acquire(_: &mut Criterion) {}

criterion_group!(benches, lock_id, contended_try_acquire);
criterion_main!(benches);
