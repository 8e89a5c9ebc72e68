//! Uncontended PostgreSQL `try_acquire` + `release` against the raw driver, per Tokio runtime
//! flavour: `cargo bench --features postgres --bench runtimes`.
//!
//! The report (`benches/report`) measures on a multi-thread runtime with the process and its
//! servers on one CPU. A wake-up that crosses threads costs little there, and from 20 to over
//! 100 µs on a virtual machine whose CPUs are free to idle: a path that needs one per cycle
//! looks cheap in the report and costs several times the raw driver unpinned. This bench runs
//! where its process runs: unpinned as it starts, pinned with `taskset -c 0 <bench binary>
//! --bench` (the throwaway server, started by this process, inherits the CPU list).
//!
//! Rows (each a throwaway PostgreSQL, one key for dlock and one for the raw connection):
//! - `current-thread`: a current-thread runtime runs both the provider (connected on it) and a
//!   raw `PgConnection` running `pg_try_advisory_lock` + `pg_advisory_unlock`;
//! - `multi-thread`: the same on a runtime of 2 workers, the cycles run on a worker;
//! - `current-thread, provider of another runtime`: the provider is connected on a runtime of
//!   its own (a multi-thread runtime of one worker, kept running), and used from the
//!   current-thread runtime, as when a provider made at startup serves other runtimes.
//!
//! Each row runs `ROUNDS` interleaved rounds (raw, dlock, raw, dlock, ...) of `CYCLES` cycles;
//! the ratio is the median of the rounds' ratios, the times the medians per cycle.
//! `DLOCK_RUNTIMES_ROUNDS` and `DLOCK_RUNTIMES_CYCLES` change the sizes; `DLOCK_RUNTIMES_ROWS`
//! (`current`, `multi`, `other`, comma-separated) chooses the rows; `DLOCK_RUNTIMES_ONLY=raw`
//! or `dlock` runs one side alone (its rounds still run, the other side's batches are empty),
//! for counting one side's system calls (`strace -f -c`) or scheduler events (`perf stat`).
//!
//! In the `other` row before the lanes moved their sessions to the runtime that uses them,
//! every answer was read by the provider's runtime's worker (an `epoll_wait` there) and handed
//! to the caller's thread (a `write` to its runtime's eventfd): two wake-ups across threads per
//! cycle that the raw connection never needs. `strace -f -e trace=write,epoll_wait,sendto` on
//! `DLOCK_RUNTIMES_ONLY=dlock DLOCK_RUNTIMES_ROWS=other` shows whether any are left.

use std::sync::Arc;
use std::time::{Duration, Instant};

use dlock::LockProvider;
use dlock_suite::raw;
use dlock_testkit::postgres::PgServer;
use sqlx::Connection;
use tokio::runtime::{Builder, Runtime};

fn size(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn median(mut samples: Vec<f64>) -> f64 {
    samples.sort_by(f64::total_cmp);
    samples[samples.len() / 2]
}

fn current_thread() -> Runtime {
    Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

fn multi_thread(workers: usize) -> Runtime {
    Builder::new_multi_thread()
        .worker_threads(workers)
        .enable_all()
        .build()
        .expect("runtime")
}

/// Where a row's provider is connected and where its cycles run.
enum Row {
    Current,
    Multi,
    Other,
}

impl Row {
    fn label(&self) -> &'static str {
        match self {
            Row::Current => "current-thread",
            Row::Multi => "multi-thread (2 workers)",
            Row::Other => "current-thread, provider of another runtime",
        }
    }
}

/// One row: (raw µs, dlock µs, ratio), medians.
fn measure(server: &PgServer, row: &Row, rounds: usize, cycles: usize) -> (f64, f64, f64) {
    let url = server.url("");
    let rt = match row {
        Row::Multi => multi_thread(2),
        Row::Current | Row::Other => current_thread(),
    };
    // The provider's own runtime, for `Other`: kept running until the row ends.
    let home = matches!(row, Row::Other).then(|| multi_thread(1));
    let locks = match &home {
        Some(home) => home.block_on(LockProvider::connect(&url)),
        None => rt.block_on(LockProvider::connect(&url)),
    }
    .expect("provider");
    let locks = Arc::new(locks);
    let run = async move {
        let mut conn = sqlx::PgConnection::connect(&url)
            .await
            .expect("raw connection");
        let id = dlock::lock_id("bench:runtimes-raw");
        // Warm both up.
        for _ in 0..50 {
            raw::postgres_on(&mut conn, id).await;
            let guard = locks.try_acquire("bench:runtimes").await.expect("lock");
            guard.release().await.expect("release");
        }
        let (mut raw_t, mut dlock_t, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
        let only = std::env::var("DLOCK_RUNTIMES_ONLY").unwrap_or_default();
        for _ in 0..rounds {
            let t = Instant::now();
            for _ in 0..cycles {
                if only == "dlock" {
                    break;
                }
                raw::postgres_on(&mut conn, id).await;
            }
            let r = t.elapsed();
            let t = Instant::now();
            for _ in 0..cycles {
                if only == "raw" {
                    break;
                }
                let guard = locks.try_acquire("bench:runtimes").await.expect("lock");
                guard.release().await.expect("release");
            }
            let d = t.elapsed();
            let per = |d: Duration| d.as_secs_f64() * 1e6 / cycles as f64;
            raw_t.push(per(r));
            dlock_t.push(per(d));
            ratios.push(d.as_secs_f64() / r.as_secs_f64());
        }
        let _ = conn.close().await;
        (median(raw_t), median(dlock_t), median(ratios))
    };
    let out = match row {
        // On a worker, where a service's code runs.
        Row::Multi => rt
            .block_on(async { tokio::spawn(run).await })
            .expect("the row's task"),
        Row::Current | Row::Other => rt.block_on(run),
    };
    drop(rt);
    drop(home);
    out
}

fn main() {
    // `cargo bench` passes `--bench`; nothing else is read from the arguments.
    let rounds = size("DLOCK_RUNTIMES_ROUNDS", 21).max(1);
    let cycles = size("DLOCK_RUNTIMES_CYCLES", 300).max(1);
    let chosen =
        std::env::var("DLOCK_RUNTIMES_ROWS").unwrap_or_else(|_| "current,multi,other".into());
    let cpus = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Cpus_allowed_list"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_owned())
        })
        .unwrap_or_default();
    let server = PgServer::start();
    println!(
        "PostgreSQL, uncontended try_acquire + release, {rounds} rounds × {cycles} cycles, CPUs {cpus}"
    );
    println!("| runtime | raw µs | dlock µs | dlock / raw |");
    println!("|---|---|---|---|");
    for row in [Row::Current, Row::Multi, Row::Other] {
        let name = match row {
            Row::Current => "current",
            Row::Multi => "multi",
            Row::Other => "other",
        };
        if !chosen.split(',').any(|c| c.trim() == name) {
            continue;
        }
        let (raw, dlock, ratio) = measure(&server, &row, rounds, cycles);
        println!("| {} | {raw:.1} | {dlock:.1} | {ratio:.2}× |", row.label());
    }
}
