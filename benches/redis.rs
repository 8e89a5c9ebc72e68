//! Redis acquire+release against the raw driver, on throwaway servers started here.
//!
//! - `acquire_release/<server>/raw`: `SET key token NX PX` plus a Lua compare-and-delete
//!   through `EVALSHA`, on the same kind of client (`redis` connection manager);
//! - `.../dlock`: the same through `LockProvider::try_acquire` and `LockGuard::release`
//!   (`fencing=false`: the same commands on servers without native ones, plus the guard, the
//!   in-process table and the renewal task), and `.../dlock_fenced` with fencing tokens;
//! - `release/valkey91/{native,lua}`: `SET NX PX` followed by `DELIFEQ` or by the Lua delete;
//! - `acquire_release/cluster/{raw,dlock_fenced,dlock_fenced_wait1}` on a Redis 7 Cluster of 3
//!   masters with a replica each: the raw commands through the driver's cluster connection,
//!   dlock through `redis+cluster://`, and dlock with `wait_replicas=1` (each acquisition
//!   counted once the master's replica has it: the cost of the option).
//!
//! Servers whose binary is missing are left out (see `dlock_testkit::redis`).

use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use dlock::LockProvider;
use dlock_suite::raw;
use dlock_suite::raw::REDIS_RELEASE_LUA as RELEASE_LUA;
use dlock_testkit::redis::{Flavor, RedisCluster, RedisServer};
use redis::aio::ConnectionManager;

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let mut group = c.benchmark_group("acquire_release");
    group
        .measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_secs(1));
    for (name, flavor) in [
        ("redis7", Flavor::Redis7),
        ("valkey81", Flavor::Valkey81),
        ("valkey91", Flavor::Valkey91),
        ("redis8", Flavor::Redis8),
    ] {
        let Some(server) = start(flavor) else {
            continue;
        };
        let manager: ConnectionManager = rt
            .block_on(ConnectionManager::new(server.client()))
            .expect("connect");
        let script = redis::Script::new(RELEASE_LUA);
        group.bench_function(format!("{name}/raw"), |b| {
            b.to_async(&rt).iter(|| {
                let mut conn = manager.clone();
                let script = &script;
                async move { raw::redis(&mut conn, script, "bench:raw").await }
            });
        });
        for (label, options) in [("dlock", "fencing=false"), ("dlock_fenced", "")] {
            let locks = rt
                .block_on(LockProvider::connect(&server.url(options)))
                .expect("connect");
            group.bench_function(format!("{name}/{label}"), |b| {
                b.to_async(&rt).iter(|| {
                    let locks = &locks;
                    async move {
                        let guard = locks.try_acquire("bench:dlock").await.expect("free");
                        guard.release().await.expect("release");
                    }
                });
            });
        }
    }
    group.finish();

    let Some(server) = start(Flavor::Valkey91) else {
        return;
    };
    let manager: ConnectionManager = rt
        .block_on(ConnectionManager::new(server.client()))
        .expect("connect");
    let script = redis::Script::new(RELEASE_LUA);
    let mut group = c.benchmark_group("release/valkey91");
    group
        .measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_secs(1));
    for native in [true, false] {
        group.bench_function(if native { "native" } else { "lua" }, |b| {
            b.to_async(&rt).iter(|| {
                let mut conn = manager.clone();
                let script = &script;
                async move {
                    let _: Option<String> = redis::cmd("SET")
                        .arg("bench:release")
                        .arg("token-0123456789")
                        .arg("NX")
                        .arg("PX")
                        .arg(30_000)
                        .query_async(&mut conn)
                        .await
                        .expect("set");
                    let deleted: i64 = if native {
                        redis::cmd("DELIFEQ")
                            .arg("bench:release")
                            .arg("token-0123456789")
                            .query_async(&mut conn)
                            .await
                            .expect("delifeq")
                    } else {
                        script
                            .key("bench:release")
                            .arg("token-0123456789")
                            .invoke_async(&mut conn)
                            .await
                            .expect("lua")
                    };
                    assert_eq!(deleted, 1);
                }
            });
        });
    }
    group.finish();
}

fn bench_cluster(c: &mut Criterion) {
    if Flavor::Redis7.binary().is_none() {
        eprintln!("Redis7: no server binary, the cluster is not measured");
        return;
    }
    let Some(cluster) = RedisCluster::start() else {
        return;
    };
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let nodes: Vec<String> = cluster
        .ports()
        .iter()
        .map(|p| format!("redis://127.0.0.1:{p}/"))
        .collect();
    let client = redis::cluster::ClusterClient::new(nodes).expect("cluster client");
    let conn = rt.block_on(client.get_async_connection()).expect("connect");
    let script = redis::Script::new(RELEASE_LUA);
    let mut group = c.benchmark_group("acquire_release");
    group
        .measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_secs(1));
    group.bench_function("cluster/raw", |b| {
        b.to_async(&rt).iter(|| {
            let mut conn = conn.clone();
            let script = &script;
            async move { raw::redis(&mut conn, script, "bench:raw").await }
        });
    });
    for (label, options) in [
        ("dlock_fenced", ""),
        ("dlock_fenced_wait1", "wait_replicas=1"),
    ] {
        let locks = rt
            .block_on(LockProvider::connect(&cluster.url(options)))
            .expect("connect");
        group.bench_function(format!("cluster/{label}"), |b| {
            b.to_async(&rt).iter(|| {
                let locks = &locks;
                async move {
                    let guard = locks.try_acquire("bench:dlock").await.expect("free");
                    guard.release().await.expect("release");
                }
            });
        });
    }
    group.finish();
}

fn start(flavor: Flavor) -> Option<RedisServer> {
    // Benches never fail for a missing server: they measure what is installed.
    if flavor.binary().is_none() {
        eprintln!("{flavor:?}: no server binary, not measured");
        return None;
    }
    RedisServer::start(flavor)
}

criterion_group!(benches, bench, bench_cluster);
criterion_main!(benches);
