//! SQLite under sustained contention: the exclusion soak at CI size, in a test binary of its
//! own so that no other test's processes compete with it for the machine.
#![cfg(feature = "sqlite")]

mod support;

use std::time::{Duration, Instant};

/// The exclusion soak at CI size on one file, 8 processes × 16 tasks on 4 keys with a 200 ms
/// lease: no overlap, no lost lock (a loss fails its worker), and the write-ahead log stays
/// under 64 MiB all along.
#[test]
fn sustained_contention_keeps_the_log_bounded_and_short_leases_alive() {
    const WAL_BOUND: u64 = 64 << 20;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("soak.db");
    let url = format!("sqlite://{}?lease=200ms", path.display());
    let wal = dir.path().join("soak.db-wal");
    let started = Instant::now();
    let run = std::thread::spawn({
        let url = url.clone();
        move || support::run_exclusion(&url, "soak", 8, 16, 4, 20_000, support::Fencing::Every)
    });
    let mut peak = 0;
    while !run.is_finished() {
        peak = peak.max(std::fs::metadata(&wal).map_or(0, |m| m.len()));
        std::thread::sleep(Duration::from_millis(10));
    }
    let summary = run.join().expect("no violation, no loss");
    eprintln!(
        "soak: {summary}; write-ahead log peak {:.1} MiB in {:.1} s",
        peak as f64 / (1 << 20) as f64,
        started.elapsed().as_secs_f64()
    );
    assert!(peak > 0, "the log was watched");
    assert!(
        peak <= WAL_BOUND,
        "the write-ahead log reached {peak} bytes"
    );
}
