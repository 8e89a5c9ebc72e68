//! Proves that the hot paths do not allocate: a contended `try_acquire` answered from the
//! in-process table, and `lock_id` for keys up to 256 bytes.
//!
//! The counting allocator is global, so this file holds a single test that runs on one thread.
#![cfg(feature = "sqlite")]

use std::alloc::System;

use futures::FutureExt;
use stats_alloc::{INSTRUMENTED_SYSTEM, Region, StatsAlloc};

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

#[test]
fn hot_paths_do_not_allocate() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}/alloc.db", dir.path().display());
    rt.block_on(async {
        let locks = dlock::LockProvider::connect(&url).await.unwrap();
        let guard = locks.try_acquire("jobs:billing").await.unwrap();

        // Warm up once, then count.
        assert!(locks.try_acquire("jobs:billing").now_or_never().is_some());
        let region = Region::new(GLOBAL);
        for _ in 0..1000 {
            let outcome = locks
                .try_acquire("jobs:billing")
                .now_or_never()
                .expect("answered without waiting");
            assert!(matches!(outcome, Err(dlock::LockError::AlreadyHeld { .. })));
        }
        let stats = region.change();
        assert_eq!(
            stats.allocations + stats.reallocations,
            0,
            "contended try_acquire allocated: {stats:?}"
        );
        guard.release().await.unwrap();
    });

    for len in [1usize, 16, 64, 255, 256] {
        let key = "k".repeat(len);
        let region = Region::new(GLOBAL);
        let id = dlock::lock_id(&key);
        let stats = region.change();
        assert_eq!(stats.allocations, 0, "lock_id of {len} bytes allocated");
        assert_ne!(id, 0);
    }
}
