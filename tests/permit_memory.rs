//! A permit try's client memory does not grow with the semaphore's count: the bytes a try and
//! its release allocate are the same for a count of 3 as for `u32::MAX` (PostgreSQL) or the
//! bound of 1,024 (MariaDB), and small. (The slot scheme allocated a list of every slot: 16
//! GiB for `u32::MAX`, which aborted the process.)
//!
//! The counting allocator is global, so this file holds a single test that runs on one thread.
#![cfg(any(feature = "postgres", feature = "mysql"))]

mod support;

use std::alloc::System;

use dlock::backend::LockBackend;
use stats_alloc::{INSTRUMENTED_SYSTEM, Region, StatsAlloc};
use support::permits::{release, try_permit};

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

/// The bytes `rounds` tries (each taking a permit of `key` of `n`) and releases allocate.
async fn bytes_per_try(backend: &impl LockBackend, key: &str, n: u32, rounds: usize) -> usize {
    let region = Region::new(GLOBAL);
    for _ in 0..rounds {
        let permit = try_permit(backend, key, n).await.expect("a permit");
        release(permit).await;
    }
    region.change().bytes_allocated / rounds
}

/// Compares a try of `small` permits with a try of `large`, after warming up each.
async fn compare(backend: &impl LockBackend, what: &str, small: u32, large: u32) {
    let key = dlock_testkit::unique_key("sem-memory");
    let (key_small, key_large) = (format!("{key}-s"), format!("{key}-l"));
    // Warm up: the connection's buffers and statement cache reach their size.
    for _ in 0..3 {
        bytes_per_try(backend, &key_small, small, 10).await;
        bytes_per_try(backend, &key_large, large, 10).await;
    }
    let few = bytes_per_try(backend, &key_small, small, 20).await;
    let many = bytes_per_try(backend, &key_large, large, 20).await;
    eprintln!("{what}: {few} bytes per try of {small}, {many} of {large}");
    assert!(
        many <= few + 256,
        "{what}: a try of {large} allocated {many} bytes, one of {small} {few}"
    );
    assert!(many < 256 * 1024, "{what}: {many} bytes per try");
}

#[test]
fn a_tries_memory_does_not_grow_with_the_count() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        #[cfg(feature = "postgres")]
        {
            let server = dlock_testkit::postgres::PgServer::shared();
            let backend = dlock::postgres::PostgresBackend::connect(&server.url("connections=1"))
                .await
                .expect("connect");
            compare(&backend, "postgres", 3, u32::MAX).await;
        }
        #[cfg(feature = "mysql")]
        {
            use dlock_testkit::mysql::{DbServer, Flavor};
            // A missing server skips this half (fails under CI), as in tests/mysql.rs.
            if let Some(server) = DbServer::shared(Flavor::MariaDb) {
                let backend = dlock::mysql::MySqlBackend::connect(&server.url("connections=1"))
                    .await
                    .expect("connect");
                compare(&backend, "mariadb", 3, 1024).await;
            }
        }
    });
}
