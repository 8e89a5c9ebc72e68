//! SQLite: an uncontended acquire + release through dlock, beside a hand-written lease lock on
//! raw rusqlite (two statements, one connection, the same settings), in the same run. dlock
//! does more per acquisition: it reads the row first (so that polls of held keys need no write
//! lock) and takes the fencing token above the `-fencing` file's record.

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};

use dlock_suite::raw;

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

    let mut raw = raw::Sqlite::open(&dir.path().join("raw.db"));

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
    interleaved(&rt, &locks, &mut raw);
}

/// The same two measurements in alternating batches, so that both see the same load (this
/// machine is shared): prints the median time of each and the median of the per-round ratios.
/// Skipped when the bench is run with a filter that does not name it (`interleaved`).
fn interleaved(rt: &tokio::runtime::Runtime, locks: &dlock::LockProvider, raw: &mut raw::Sqlite) {
    const NAME: &str = "sqlite/acquire_release/interleaved";
    if std::env::args()
        .skip(1)
        .any(|arg| !arg.starts_with('-') && !NAME.contains(arg.as_str()))
    {
        return;
    }
    const ROUNDS: usize = 40;
    const BATCH: u32 = 2_000;
    let (mut raws, mut dlocks, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        let started = std::time::Instant::now();
        for _ in 0..BATCH {
            raw.acquire_release(b"bench:raw");
        }
        let r = started.elapsed() / BATCH;
        let started = std::time::Instant::now();
        rt.block_on(async {
            for _ in 0..BATCH {
                let guard = locks.try_acquire(black_box("bench:dlock")).await.unwrap();
                guard.release().await.unwrap();
            }
        });
        let d = started.elapsed() / BATCH;
        ratios.push(d.as_secs_f64() / r.as_secs_f64());
        raws.push(r);
        dlocks.push(d);
    }
    raws.sort();
    dlocks.sort();
    ratios.sort_by(f64::total_cmp);
    println!(
        "sqlite/acquire_release interleaved ({ROUNDS} rounds of {BATCH}): raw_rusqlite {:.1} µs, dlock {:.1} µs, dlock/raw {:.2} (median of rounds; quartiles {:.2}..{:.2})",
        raws[ROUNDS / 2].as_secs_f64() * 1e6,
        dlocks[ROUNDS / 2].as_secs_f64() * 1e6,
        ratios[ROUNDS / 2],
        ratios[ROUNDS / 4],
        ratios[3 * ROUNDS / 4],
    );
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(5));
    targets = acquire_release
}
criterion_main!(benches);
