//! MySQL and MariaDB: an uncontended acquire + release through dlock, beside raw sqlx running
//! `GET_LOCK(?, 0)` + `RELEASE_LOCK(?)` on a pool, in the same run. Spawns throwaway servers
//! (as the tests do): MariaDB from the Debian package, MySQL from the chroot that
//! `.ci/mysql-chroot.sh` installs; an engine that is missing is skipped.

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use dlock::LockProvider;
use dlock::mysql::server_lock_name;

use dlock_suite::raw;
use dlock_testkit::mysql::{DbServer, Flavor};

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

fn uncontended(c: &mut Criterion, server: &DbServer) {
    let rt = runtime();
    let url = server.url("");
    let driver_url = url.replacen("mariadb://", "mysql://", 1);
    let pool = |size| {
        rt.block_on(
            sqlx::mysql::MySqlPoolOptions::new()
                .max_connections(size)
                .connect(&driver_url),
        )
        .expect("pool")
    };
    let single = pool(1);
    let four = pool(4);
    let locks = rt.block_on(LockProvider::connect(&url)).expect("provider");
    let key = "bench:uncontended";
    let name = server_lock_name(key);

    let mut group = c.benchmark_group(format!("{}_uncontended", server.flavor.label()));
    // The two statements straight on a pool. With one connection in it, the release is sure
    // to run on the session that took the lock.
    group.bench_function("raw_sqlx_pool_of_one", |b| {
        b.to_async(&rt).iter(|| async {
            let got: Option<i64> = sqlx::query_scalar("SELECT GET_LOCK(?, 0)")
                .bind(&name)
                .fetch_one(&single)
                .await
                .expect("lock");
            assert_eq!(got, Some(1));
            let released: Option<i64> = sqlx::query_scalar("SELECT RELEASE_LOCK(?)")
                .bind(&name)
                .fetch_one(&single)
                .await
                .expect("release");
            assert_eq!(released, Some(1));
        })
    });
    // A larger pool: take one connection for both statements.
    group.bench_function("raw_sqlx_same_connection", |b| {
        b.to_async(&rt).iter(|| raw::mysql(&four, &name))
    });
    group.bench_function("dlock_try_acquire_release", |b| {
        b.to_async(&rt).iter(|| async {
            let guard = locks.try_acquire(black_box(key)).await.expect("lock");
            guard.release().await.expect("release");
        })
    });
    group.finish();
}

fn benches(c: &mut Criterion) {
    for flavor in [Flavor::MariaDb, Flavor::MySql] {
        if let Some(server) = DbServer::start(flavor) {
            uncontended(c, &server);
        }
    }
}

criterion_group! {
    name = mysql;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3))
        .sample_size(30);
    targets = benches
}
criterion_main!(mysql);
