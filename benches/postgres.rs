//! PostgreSQL: uncontended acquire + release against raw sqlx doing the same two statements on
//! a pool, and handover latency with 16 waiters on one key across 4 providers. Spawns a
//! throwaway server (as the tests do).

use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use dlock::{LockProvider, lock_id};

use dlock_suite::raw;
use dlock_testkit::postgres as pgserver;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

fn uncontended(c: &mut Criterion, server: &pgserver::PgServer) {
    let rt = runtime();
    let url = server.url("");
    let pool = rt.block_on(async {
        sqlx::postgres::PgPoolOptions::new()
            .max_connections(4)
            .connect(&url)
            .await
            .expect("pool")
    });
    let single = rt.block_on(async {
        sqlx::postgres::PgPoolOptions::new()
            .max_connections(1)
            .connect(&url)
            .await
            .expect("pool")
    });
    let locks = rt.block_on(LockProvider::connect(&url)).expect("provider");
    let key = "bench:uncontended";
    let id = lock_id(key);

    let mut group = c.benchmark_group("postgres_uncontended");
    // The two statements straight on a pool. With one connection in it, the unlock is sure
    // to run on the session that took the lock.
    group.bench_function("raw_sqlx_pool_of_one", |b| {
        b.to_async(&rt).iter(|| async {
            let got: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
                .bind(id)
                .fetch_one(&single)
                .await
                .expect("lock");
            assert!(got);
            let released: bool = sqlx::query_scalar("SELECT pg_advisory_unlock($1)")
                .bind(id)
                .fetch_one(&single)
                .await
                .expect("unlock");
            assert!(released);
        })
    });
    // A larger pool: take one connection for both statements.
    group.bench_function("raw_sqlx_same_connection", |b| {
        b.to_async(&rt).iter(|| raw::postgres(&pool, id))
    });
    group.bench_function("dlock_try_acquire_release", |b| {
        b.to_async(&rt).iter(|| async {
            let guard = locks.try_acquire(key).await.expect("lock");
            guard.release().await.expect("release");
        })
    });
    group.finish();
}

fn handover(c: &mut Criterion, server: &pgserver::PgServer) {
    let rt = runtime();
    let url = server.url("");
    let providers: Vec<LockProvider> = rt.block_on(async {
        let mut v = Vec::new();
        for _ in 0..4 {
            v.push(LockProvider::connect(&url).await.expect("provider"));
        }
        v
    });
    let key = "bench:handover";
    let mut group = c.benchmark_group("postgres_handover");
    group.sample_size(10);
    // Per handover: from a holder's release to the next waiter holding the lock.
    group.bench_function("16_waiters_4_providers", |b| {
        b.to_async(&rt).iter_custom(|iters| {
            let providers = providers.clone();
            async move {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let first = providers[0].try_acquire(key).await.expect("first holder");
                    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
                    let waiters: Vec<_> = (0..16)
                        .map(|i| {
                            let (p, tx) = (providers[i % 4].clone(), tx.clone());
                            tokio::spawn(async move {
                                let g = p.acquire(key, Duration::from_secs(30)).await.expect("w");
                                let _ = tx.send(Instant::now());
                                g.release().await.expect("release");
                            })
                        })
                        .collect();
                    // Let every waiter queue (locally or on the server).
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    let started = Instant::now();
                    first.release().await.expect("release");
                    let mut last = started;
                    for _ in 0..16 {
                        last = rx.recv().await.expect("a waiter got the lock");
                    }
                    for w in waiters {
                        w.await.expect("waiter");
                    }
                    total += (last - started) / 16;
                }
                total
            }
        })
    });
    group.finish();
}

fn benches(c: &mut Criterion) {
    let server = pgserver::PgServer::start();
    uncontended(c, &server);
    handover(c, &server);
}

criterion_group! {
    name = postgres;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3))
        .sample_size(30);
    targets = benches
}
criterion_main!(postgres);
