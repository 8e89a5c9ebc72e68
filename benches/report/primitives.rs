//! Section 8: the primitives beyond the mutex.
//!
//! - A semaphore slot (5 permits, uncontended) taken and given back, against the raw driver
//!   taking and freeing one slot's lock with the same statements (on a connection of its own,
//!   as in section 1);
//! - a read lock taken and given back: against `pg_try_advisory_lock_shared` +
//!   `pg_advisory_unlock_shared` on PostgreSQL, and beside dlock's own exclusive lock on the
//!   lease stores (their read lock is a script or statement of dlock's own, with no raw
//!   equivalent to compare with);
//! - a reader-heavy load: 16 tasks over 2 providers on one key, nine reads to one write, in
//!   acquisitions per second, against the same load with exclusive locks only.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use dlock::LockProvider;
use dlock_suite::raw;
use tokio::runtime::Runtime;

use crate::measure::{Batch, Contender, interleave, median, sized};
use crate::output::{Report, Row, Target};
use crate::servers::{Backend, Servers, Store, batch, on_worker, rounds};

/// Section 8's title.
pub const S8: &str = "8. Semaphores and read locks against the raw driver; a reader-heavy load";

/// The semaphore's size in the comparison.
const PERMITS: u32 = 5;

/// The internal name of slot `slot` of semaphore `key`, as dlock names it.
fn slot_name(slot: u32, key: &str) -> String {
    format!("dlock\0semaphore\0{slot}\0{key}")
}

/// Section 8 on every backend.
pub fn run(rt: &Runtime, servers: &Servers, report: &mut Report) {
    for b in &servers.backends {
        let store = match &b.store {
            Ok(store) => store,
            Err(e) => {
                for (name, target) in names(b) {
                    report.add(b.not_measured(S8, &name, e, target));
                }
                continue;
            }
        };
        eprintln!(" {}", b.label);
        // The single-cycle comparisons on one CPU, as section 1 (see `pin`); the reader-heavy
        // load is a throughput across tasks and keeps both CPUs.
        let pinned = (!crate::measure::quick())
            .then(crate::pin::OneCpu::pin)
            .flatten();
        semaphore(rt, b, store, report);
        read_lock(rt, b, store, report);
        drop(pinned);
        reader_heavy(rt, b, report);
    }
}

/// The rows of a backend, for a backend that could not be measured.
fn names(b: &Backend) -> Vec<(String, &'static str)> {
    vec![
        (
            format!("{}: semaphore slot, dlock / raw", b.label),
            "≤ 1.10×",
        ),
        (format!("{}: read lock", b.label), "—"),
        (
            format!(
                "{}: reader-heavy load, read locks / exclusive only",
                b.label
            ),
            "≥ 1.00×",
        ),
    ]
}

fn semaphore(rt: &Runtime, b: &Backend, store: &Store, report: &mut Report) {
    let name = format!("{}: semaphore slot, dlock / raw", b.label);
    // Redis: the comparison uses the same commands (`fencing=false`), as in section 1.
    let options = if matches!(store, Store::Redis(_)) {
        "fencing=false"
    } else {
        ""
    };
    let locks = match rt.block_on(LockProvider::connect(&b.dlock_url(options))) {
        Ok(locks) => locks,
        Err(e) => return report.add(b.not_measured(S8, &name, &e.to_string(), "≤ 1.10×")),
    };
    let mut dlock: Box<Batch<'_>> = Box::new(|n| {
        let locks = locks.clone();
        on_worker(rt, async move {
            let t = Instant::now();
            for _ in 0..n {
                let slot = locks
                    .try_acquire_semaphore("bench:sem", PERMITS)
                    .await
                    .map_err(|e| e.to_string())?;
                slot.release().await.map_err(|e| e.to_string())?;
            }
            Ok(t.elapsed())
        })
    });
    // The raw side frees and takes one slot's lock, a slot picked at random as dlock does.
    let slots: Vec<String> = (0..PERMITS)
        .map(|s| slot_name(s, "bench:raw-sem"))
        .collect();
    let mut raw_side: Box<Batch<'_>> = match store {
        Store::Sqlite(dir) => {
            let conn = std::cell::RefCell::new(raw::Sqlite::open(&dir.path().join("raw-sem.db")));
            Box::new(move |n| {
                let t = Instant::now();
                let mut c = conn.borrow_mut();
                for _ in 0..n {
                    c.acquire_release(slots[fastrand::usize(..slots.len())].as_bytes());
                }
                Ok(t.elapsed())
            })
        }
        Store::Postgres(_) => {
            let conn = match pg_connection(rt, b) {
                Ok(conn) => conn,
                Err(e) => return report.add(b.not_measured(S8, &name, &e, "≤ 1.10×")),
            };
            let ids: Vec<i64> = slots.iter().map(|s| dlock::lock_id(s)).collect();
            Box::new(move |n| {
                let (conn, ids) = (Arc::clone(&conn), ids.clone());
                on_worker(rt, async move {
                    let mut conn = conn.lock().await;
                    let t = Instant::now();
                    for _ in 0..n {
                        raw::postgres_on(&mut conn, ids[fastrand::usize(..ids.len())]).await;
                    }
                    Ok(t.elapsed())
                })
            })
        }
        Store::My(_) => {
            let conn = match rt.block_on(<sqlx::MySqlConnection as sqlx::Connection>::connect(
                &b.driver_url(),
            )) {
                Ok(conn) => Arc::new(tokio::sync::Mutex::new(conn)),
                Err(e) => return report.add(b.not_measured(S8, &name, &e.to_string(), "≤ 1.10×")),
            };
            let names: Vec<String> = slots
                .iter()
                .map(|s| dlock::mysql::server_lock_name(s))
                .collect();
            Box::new(move |n| {
                let (conn, names) = (Arc::clone(&conn), names.clone());
                on_worker(rt, async move {
                    let mut conn = conn.lock().await;
                    let t = Instant::now();
                    for _ in 0..n {
                        raw::mysql_on(&mut conn, &names[fastrand::usize(..names.len())]).await;
                    }
                    Ok(t.elapsed())
                })
            })
        }
        Store::Redis(server) => {
            let manager = match rt.block_on(redis::aio::ConnectionManager::new(server.client())) {
                Ok(manager) => manager,
                Err(e) => return report.add(b.not_measured(S8, &name, &e.to_string(), "≤ 1.10×")),
            };
            let script = redis::Script::new(raw::REDIS_RELEASE_LUA);
            Box::new(move |n| {
                let (mut conn, script, slots) = (manager.clone(), script.clone(), slots.clone());
                on_worker(rt, async move {
                    let t = Instant::now();
                    for _ in 0..n {
                        raw::redis(&mut conn, &script, &slots[fastrand::usize(..slots.len())])
                            .await;
                    }
                    Ok(t.elapsed())
                })
            })
        }
    };
    let mut contenders = [
        Contender::new("raw", &mut *raw_side),
        Contender::new("dlock", &mut *dlock),
    ];
    let results = interleave(&mut contenders, rounds(), batch());
    report.add(match (&results[0], &results[1]) {
        (Ok(raw), Ok(d)) => Row::ratio(S8, &name, ("dlock", d), ("raw", raw), Target::AtMost(1.10)),
        (Err(e), _) | (_, Err(e)) => b.not_measured(S8, &name, e, "≤ 1.10×"),
    });
}

fn read_lock(rt: &Runtime, b: &Backend, store: &Store, report: &mut Report) {
    let locks = match rt.block_on(LockProvider::connect(&b.dlock_url(""))) {
        Ok(locks) => locks,
        Err(e) => {
            let name = format!("{}: read lock", b.label);
            return report.add(b.not_measured(S8, &name, &e.to_string(), "—"));
        }
    };
    let cycle = |read: bool| -> Box<Batch<'_>> {
        let locks = locks.clone();
        Box::new(move |n| {
            let locks = locks.clone();
            on_worker(rt, async move {
                let t = Instant::now();
                for _ in 0..n {
                    let guard = if read {
                        locks.try_acquire_read("bench:read").await
                    } else {
                        locks.try_acquire("bench:write").await
                    }
                    .map_err(|e| e.to_string())?;
                    guard.release().await.map_err(|e| e.to_string())?;
                }
                Ok(t.elapsed())
            })
        })
    };
    // A backend without read locks says so once.
    if let Err(e) =
        rt.block_on(async { locks.try_acquire_read("bench:probe").await?.release().await })
    {
        let name = format!("{}: read lock", b.label);
        return report.add(Row::info(
            S8,
            &name,
            format!("no read locks here ({})", e.code()),
        ));
    }
    let mut read = cycle(true);
    if let Store::Postgres(_) = store {
        let name = format!("{}: read lock, dlock / raw", b.label);
        let conn = match pg_connection(rt, b) {
            Ok(conn) => conn,
            Err(e) => return report.add(b.not_measured(S8, &name, &e, "≤ 1.10×")),
        };
        let id = dlock::lock_id("bench:raw-read");
        let mut raw_side: Box<Batch<'_>> = Box::new(move |n| {
            let conn = Arc::clone(&conn);
            on_worker(rt, async move {
                let mut conn = conn.lock().await;
                let t = Instant::now();
                for _ in 0..n {
                    raw_postgres_shared(&mut conn, id).await?;
                }
                Ok(t.elapsed())
            })
        });
        let mut contenders = [
            Contender::new("raw", &mut *raw_side),
            Contender::new("dlock", &mut *read),
        ];
        let results = interleave(&mut contenders, rounds(), batch());
        report.add(match (&results[0], &results[1]) {
            (Ok(raw), Ok(d)) => {
                Row::ratio(S8, &name, ("dlock", d), ("raw", raw), Target::AtMost(1.10))
            }
            (Err(e), _) | (_, Err(e)) => b.not_measured(S8, &name, e, "≤ 1.10×"),
        });
    } else {
        let name = format!("{}: read lock / exclusive lock, dlock", b.label);
        let mut write = cycle(false);
        let mut contenders = [
            Contender::new("exclusive", &mut *write),
            Contender::new("read", &mut *read),
        ];
        let results = interleave(&mut contenders, rounds(), batch());
        report.add(match (&results[0], &results[1]) {
            (Ok(w), Ok(r)) => Row::ratio(S8, &name, ("read", r), ("exclusive", w), Target::None),
            (Err(e), _) | (_, Err(e)) => b.not_measured(S8, &name, e, "—"),
        });
    }
}

/// A connection of its own for the raw PostgreSQL side: the statements and nothing else, as
/// dlock runs them on its lock connections and as in section 1.
fn pg_connection(
    rt: &Runtime,
    b: &Backend,
) -> Result<Arc<tokio::sync::Mutex<sqlx::PgConnection>>, String> {
    rt.block_on(<sqlx::PgConnection as sqlx::Connection>::connect(
        &b.driver_url(),
    ))
    .map(|conn| Arc::new(tokio::sync::Mutex::new(conn)))
    .map_err(|e| e.to_string())
}

/// `pg_try_advisory_lock_shared($1)` + `pg_advisory_unlock_shared($1)` on `conn`.
async fn raw_postgres_shared(conn: &mut sqlx::PgConnection, id: i64) -> Result<(), String> {
    let got: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock_shared($1)")
        .bind(id)
        .fetch_one(&mut *conn)
        .await
        .map_err(|e| e.to_string())?;
    let freed: bool = sqlx::query_scalar("SELECT pg_advisory_unlock_shared($1)")
        .bind(id)
        .fetch_one(&mut *conn)
        .await
        .map_err(|e| e.to_string())?;
    if got && freed {
        Ok(())
    } else {
        Err("the shared advisory lock was not free".to_owned())
    }
}

/// 16 tasks over 2 providers on one key for `length`, nine reads to one write (or exclusive
/// locks only): acquisitions per second.
async fn load(url: &str, reads: bool, length: Duration) -> Result<f64, String> {
    let mut providers = Vec::new();
    for _ in 0..2 {
        providers.push(
            LockProvider::connect(url)
                .await
                .map_err(|e| e.to_string())?,
        );
    }
    let done = Arc::new(AtomicU64::new(0));
    let until = Instant::now() + length;
    let mut tasks = tokio::task::JoinSet::new();
    for t in 0..16u64 {
        let (locks, done) = (providers[(t % 2) as usize].clone(), Arc::clone(&done));
        tasks.spawn(async move {
            let mut n = 0u64;
            while Instant::now() < until {
                n += 1;
                let guard = if reads && !n.is_multiple_of(10) {
                    locks
                        .acquire_read("bench:load", Duration::from_secs(30))
                        .await
                } else {
                    locks.acquire("bench:load", Duration::from_secs(30)).await
                }
                .map_err(|e| e.to_string())?;
                // A short piece of work under the lock.
                tokio::time::sleep(Duration::from_micros(200)).await;
                guard.release().await.map_err(|e| e.to_string())?;
                done.fetch_add(1, Ordering::Relaxed);
            }
            Ok::<(), String>(())
        });
    }
    let started = Instant::now();
    while let Some(joined) = tasks.join_next().await {
        joined.map_err(|e| e.to_string())??;
    }
    Ok(done.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64())
}

fn reader_heavy(rt: &Runtime, b: &Backend, report: &mut Report) {
    let name = format!(
        "{}: reader-heavy load, read locks / exclusive only",
        b.label
    );
    let url = b.dlock_url("");
    let length = sized(Duration::from_millis(700), Duration::from_millis(100));
    let (mut with_reads, mut exclusive) = (Vec::new(), Vec::new());
    for _ in 0..sized(3, 1) {
        for reads in [true, false] {
            let url = url.clone();
            let rate = rt
                .block_on(rt.spawn(async move { load(&url, reads, length).await }))
                .map_err(|e| e.to_string())
                .and_then(|r| r);
            match rate {
                Ok(rate) if reads => with_reads.push(rate),
                Ok(rate) => exclusive.push(rate),
                Err(e) if reads && e.contains("read locks") => {
                    return report.add(Row::info(S8, &name, "no read locks here".to_owned()));
                }
                Err(e) => return report.add(b.not_measured(S8, &name, &e, "≥ 1.00×")),
            }
        }
    }
    let (r, w) = (median(&with_reads), median(&exclusive));
    report.add(Row::rate_ratio(
        S8,
        &name,
        format!(
            "{:.2}× ({r:.0}/s with read locks, {w:.0}/s exclusive only)",
            r / w
        ),
        r / w,
        Target::AtLeast(1.0),
    ));
}
