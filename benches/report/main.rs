//! The benchmark report: `cargo bench --bench report`.
//!
//! Spawns throwaway servers (as the tests do: PostgreSQL, MariaDB, MySQL 9, Redis 7, Valkey
//! 9.1; a server whose binary is missing is reported as not measured) and measures, in one run
//! on this machine:
//!
//! 1. uncontended acquire + release per backend beside its raw-driver baseline;
//! 2. handover latency with 16 waiters on one key across 4 providers;
//! 3. server queries per second while 100 waiters wait for one held key;
//! 4. locks held at once per connection;
//! 5. contended in-process `try_acquire` and `lock_id`;
//! 6. the axum layer's requests/s against the same route locking by hand;
//! 7. other lock crates on the same servers (`sqlx::postgres::PgAdvisoryLock` here, the rest
//!    through the `benches/peers` workspace, run with `cargo run`);
//! 8. semaphore slots and read locks against the raw driver, and a reader-heavy load;
//! 9. fairness: 2 and 4 processes of 8 tasks contending for one key, a lock and a semaphore of 3
//!    (`fairness.rs`);
//! 10. multi-node deployments: Redis Cluster, Sentinel, Redlock, etcd (`deployments.rs`);
//!
//! and cost curves (`curves.rs`, `waiters.rs`, `scale.rs`): C1 client memory, server
//! connections and keep-alive CPU against 1 to 100,000 locks held; C2 what the store keeps
//! against 1 to 1,000,000 distinct keys ever locked; C3 server queries and handover against 1
//! to 1,000 waiters on one key; C4 acquisitions/s and server connections against 1 to 64
//! processes, each with a provider on the same store, taking keys of their own; C5 the
//! acquisitions/s of 4 processes all taking one hot key, dlock against the raw driver in
//! interleaved rounds (C4 and C5 run worker processes, `dlock-worker throughput`). `-- --only
//! curves` (or `--only curves-held`, `curves-keys`, `curves-waiters`, `curves-providers`,
//! `curves-hot`) runs those alone (see `measure::section_named`).
//!
//! Figures that are compared are measured in interleaved rounds (A, B, A, B, ...) and
//! summarised by their medians, so that the machine's noise hits both sides alike. Prints a
//! table and writes `benches/RESULTS.md` and `benches/results.svg`.
//!
//! Quick mode (`cargo bench --bench report -- --quick`, or `DLOCK_REPORT_QUICK=1`; CI runs it
//! as `cargo test --workspace --all-features --bench report -- --quick`, on the tests' build)
//! runs every section with tiny sizes and fails when a figure is missing, unless its server's
//! binary is not installed. It writes its table under the target directory, never over the
//! report. It builds the peers in the dev profile, the cheapest. `DLOCK_REPORT_PEERS=0` leaves
//! the peers out of any run.
//!
//! A partial run (`-- --only 1,8`, `-- --backend mysql,mariadb`, or both; or
//! `DLOCK_REPORT_ONLY` and `DLOCK_REPORT_BACKENDS`) measures only those sections (by number)
//! and backends (by a part of their label, any case), and writes its table under the target
//! directory, never over the report. Section 1 without 7 leaves the peers out.

use std::cell::RefCell;
use std::time::{Duration, Instant};

use dlock::LockProvider;

mod axum_layer;
mod curves;
mod deployments;
mod fairness;
mod measure;
mod output;
mod peers;
mod pin;
mod primitives;
mod scale;
mod servers;
mod waiters;

use measure::{Contender, interleave, median, partial, quick, section, section_named, sized};
use output::{Report, Row, Target};
use peers::Peers;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

fn main() {
    let started = Instant::now();
    let rt = runtime();
    let mut report = Report::new();
    if quick() {
        eprintln!("report: quick mode: tiny sizes, checks only that every figure is produced");
    }
    // The peers build (first run) while the servers start.
    let without_peers =
        std::env::var("DLOCK_REPORT_PEERS").is_ok_and(|v| v == "0") || !(section(7) || section(10));
    let peers = RefCell::new(match (without_peers, quick()) {
        (true, _) => {
            let why = if section(7) || section(10) {
                PEERS_SKIPPED
            } else {
                "peers (sections 7 and 10, other lock crates) left out: a partial run without them"
            };
            eprintln!("report: {why}");
            Peers::skip(why)
        }
        (false, false) => Peers::spawn("release"),
        // The cheapest build: the dev profile.
        (false, true) => Peers::spawn("dev"),
    });

    eprintln!("report: starting servers");
    let servers = servers::Servers::start(&rt, &mut report);

    if section(1) || section(7) {
        eprintln!("report: 1+7 uncontended acquire + release, raw baselines and peers");
        // On one CPU (see `pin`), with the peers' process started first so that it is pinned
        // too. Quick mode measures nothing worth pinning for.
        let pinned = (!quick()).then(|| {
            peers.borrow_mut().start();
            pin::OneCpu::pin()
        });
        servers::uncontended_all(&rt, &servers, &peers, &mut report);
        drop(pinned);
    }
    if section(2) {
        eprintln!("report: 2 handover");
        servers::handover_all(&rt, &servers, &mut report);
    }
    if section(3) {
        eprintln!("report: 3 thundering herd");
        servers::herd_all(&rt, &servers, &mut report);
    }
    if section(4) {
        eprintln!("report: 4 locks per connection");
        servers::locks_per_connection_all(&rt, &servers, &mut report);
    }
    if section(5) {
        eprintln!("report: 5 in-process");
        in_process(&rt, &mut report);
    }
    if section(6) {
        eprintln!("report: 6 axum layer");
        axum_layer::run(&rt, &mut report);
    }
    if section(8) {
        eprintln!("report: 8 semaphores and read locks");
        primitives::run(&rt, &servers, &mut report);
    }
    if section(9) {
        eprintln!("report: 9 fairness across processes");
        fairness::run(&servers, &mut report);
    }
    if section(10) {
        eprintln!("report: 10 multi-node deployments");
        deployments::run(&rt, &peers, &mut report);
    }
    // Any one curve chosen (`--only curves-keys` does not start `curves`).
    if ["curves-held", "curves-keys", "curves-waiters"]
        .iter()
        .any(|name| section_named(name))
    {
        eprintln!("report: C1-C3 cost curves");
        curves_and_waiters(&rt, &servers, &mut report);
    }
    if ["curves-providers", "curves-hot"]
        .iter()
        .any(|name| section_named(name))
    {
        eprintln!("report: C4-C5 cost curves across processes");
        scale::run(&rt, &servers, &mut report);
    }

    drop(peers);
    for note in [
        "Figures vary with the machine's load: quote them only from a run on a quiet machine.",
        "1, 7: per backend, the raw baseline, dlock and the peers run in 20 interleaved rounds of \
         ~40 ms batches on one key each; a ratio is the median of the rounds' ratios, the \
         times beside it are medians per operation. The report's process, its servers and the \
         peers run on one CPU for these sections (DLOCK_REPORT_PIN=0 turns that off): on a \
         virtual machine a wake-up across CPUs costs 20 to 100 µs at random, more than a \
         whole cycle, and unpinned batches of one raw baseline varied sevenfold. Raw SQL baselines run both \
         statements on a connection of their own, as dlock does on its lock connections; the \
         same statements on a connection taken from a sqlx pool each time are shown beside \
         them (sqlx pings every connection that goes back to its pool: a third round trip, \
         off the caller's path but not off the machine's two cores); on \
         Redis and Valkey the raw commands are `SET NX PX` + Lua compare-and-delete, compared \
         with dlock `fencing=false` (the same commands); dlock's default (fencing tokens) is \
         compared with a raw client doing the same work, one script of `SET NX PX` and \
         `INCR` of a counter key then the Lua compare-and-delete, in the same rounds, and \
         the server commands per cycle of both are counted (`INFO commandstats` around 50 \
         cycles, commands run by scripts included). Peers are compared with the same dlock column; all but \
         `sqlx::postgres::PgAdvisoryLock` run in the `benches/peers` workspace, driven over a \
         pipe by this run.",
        "2: 16 tasks over 4 providers each take the key 4 times, in 3 rounds; a handover is the \
         time from one holder starting its release to the next holder having the lock. Redis \
         and Valkey waiters are woken by the release (its announcement on the key's channel), \
         so their p99 is held to 2 ms; the other lease store, SQLite, polls with backoff.",
        "3: 100 waiters (10 providers × 10) wait while an 11th provider holds the key; counted \
         over 3 s (Redis and Valkey: 20 s, past their 15 s fallback poll, so that the count \
         includes their polls) after 0.5 s to settle, less the counting statements. Redis and \
         Valkey waiters sleep until a release wakes them, the holder's lease runs out or the \
         fallback poll: 5 /s is their target. PostgreSQL: \
         `xact_commit + xact_rollback` of `pg_stat_database` (backends publish it up to ~1 s \
         late); MySQL / MariaDB: `SHOW GLOBAL STATUS LIKE 'Questions'`; Redis / Valkey: \
         `INFO commandstats` without `INFO` itself. The MySQL and Redis counters are first \
         checked to see 20 test statements of another connection.",
        "4: one provider takes the keys 32 at a time and holds them all; the figure is the \
         server's client connections (pg_stat_activity, SHOW PROCESSLIST, connected_clients) \
         then less before.",
        "6: 16 client tasks (reqwest) against an in-process axum server on loopback, 6 \
         interleaved rounds of 0.7 s per route, a new key per request.",
        "9: worker processes (`dlock-worker fairness`) of 8 tasks each take one key again \
         and again, holding it 1 ms, for 5 s from a common start; the spread is the largest \
         distance of a process's acquisitions from an equal share, the waits are every \
         acquisition's of every process (a wait still going at the end counts up to the end). \
         Without queueing across processes, SQLite gave one process every acquisition and \
         Redis one process 2.8× another's. The semaphore rows take permits of a semaphore of 3 \
         on the key the same way (its waiters queue on the semaphore's queue lock, or on \
         etcd's own order); before they queued, 3 processes × 8 tasks holding permits 5-25 ms \
         for 2 s left 21 of 24 tasks without a permit on SQLite.",
        "8: as 1 (on one CPU), on one key each: a semaphore of 5 permits (dlock's permit \
         store where the backend has one, SQLite's one transaction; elsewhere its slot locks, \
         tried in turn from a random one; the raw side takes and frees one random slot's lock \
         with the driver's statements on a connection of its own, on Redis with \
         `fencing=false` on both sides); \
         a read lock against `pg_try_advisory_lock_shared` + `pg_advisory_unlock_shared`, or, where a read lock \
         is dlock's own script or statement, beside dlock's exclusive lock. The reader-heavy \
         load: 16 tasks over 2 providers on one key, each holding the lock 0.2 ms, nine reads \
         to one write, against exclusive locks only; medians of 3 runs of 0.7 s each.",
        deployments::NOTE,
    ] {
        report.note(note.to_owned());
    }
    report.note(format!(
        "The run took {:.0} s.",
        started.elapsed().as_secs_f64()
    ));
    if partial() {
        report.note(
            "A partial run (--only / --backend): only the sections and backends it chose."
                .to_owned(),
        );
    }
    let problems = if quick() && !partial() {
        report.problems(&[
            servers::S1,
            servers::S2,
            servers::S3,
            servers::S4,
            IN_PROCESS,
            axum_layer::SECTION,
            servers::S7,
            primitives::S8,
            fairness::S9,
            deployments::S10,
            curves::C1,
            curves::C2,
            waiters::C3,
            scale::C4,
            scale::C5,
        ])
    } else {
        Vec::new()
    };
    report.finish();
    if quick() {
        if !problems.is_empty() {
            eprintln!(
                "report --quick: FAILED: {} figure(s) not produced (a server that is not \
                 installed is no failure):",
                problems.len()
            );
            for p in &problems {
                eprintln!("  {p}");
            }
            std::process::exit(1);
        }
        eprintln!(
            "report --quick: every figure was produced ({:.0} s)",
            started.elapsed().as_secs_f64()
        );
    }
}

/// The cost curves C1 and C2, then C3, as far as `--only` asks.
fn curves_and_waiters(
    rt: &tokio::runtime::Runtime,
    servers: &servers::Servers,
    report: &mut Report,
) {
    curves::run(rt, servers, report);
    if curves::wanted("curves-waiters") {
        waiters::run(rt, servers, report);
    }
}

/// Section 5's title.
const IN_PROCESS: &str = "5. In-process";

/// Why a quick run has no peers.
const PEERS_SKIPPED: &str = "peers (section 7, other lock crates) left out: DLOCK_REPORT_PEERS=0";

/// Section 5: a contended `try_acquire` answered from the in-process table, and `lock_id`.
fn in_process(rt: &tokio::runtime::Runtime, report: &mut Report) {
    use futures::FutureExt;
    use std::hint::black_box;

    let dir = tempfile::tempdir().expect("temp dir");
    let url = format!("sqlite://{}/inproc.db", dir.path().display());
    let locks = rt.block_on(LockProvider::connect(&url)).expect("provider");
    let guard = rt
        .block_on(locks.try_acquire("bench:contended"))
        .expect("holder");
    let _enter = rt.enter();
    let mut contended = |n: u64| {
        let t = Instant::now();
        for _ in 0..n {
            let outcome = locks
                .try_acquire(black_box("bench:contended"))
                .now_or_never()
                .expect("answered at once");
            black_box(outcome.is_err());
        }
        Ok(t.elapsed())
    };
    let result = interleave(
        &mut [Contender::new("contended", &mut contended)],
        sized(9, 2),
        sized(Duration::from_millis(40), Duration::from_millis(5)),
    );
    let ns = result[0].as_ref().map(|v| median(v)).unwrap_or(f64::NAN);
    report.add(Row::figure(
        IN_PROCESS,
        "contended try_acquire (answered from the in-process table)",
        ns,
        "ns",
        Target::AtMost(1000.0),
    ));
    drop(guard);

    for len in [8usize, 32, 64, 256] {
        let key = "k".repeat(len);
        let mut hash = |n: u64| {
            let t = Instant::now();
            for _ in 0..n {
                black_box(dlock::lock_id(black_box(&key)));
            }
            Ok(t.elapsed())
        };
        let result = interleave(
            &mut [Contender::new("lock_id", &mut hash)],
            sized(9, 2),
            sized(Duration::from_millis(20), Duration::from_millis(5)),
        );
        let ns = result[0].as_ref().map(|v| median(v)).unwrap_or(f64::NAN);
        report.add(Row::figure(
            IN_PROCESS,
            &format!("lock_id, {len}-byte key"),
            ns,
            "ns",
            Target::AtMost(100.0),
        ));
    }
}
