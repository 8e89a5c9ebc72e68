//! Cost curve C3: 1 to 1,000 waiters on one key across 10 providers; the server's queries
//! per second while they wait, and the handover latency when they take the key in turn.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dlock::LockProvider;
use tokio::runtime::Runtime;

use crate::curves::{Panel, Series, chart, count, grow, growth, listing};
use crate::measure::{median, quantile, sized};
use crate::output::{Report, Row, Target, time};
use crate::servers::{Backend, Servers, Store};

pub const C3: &str = "C3. Cost curve: waiters on one key";

/// One size of C3.
struct Point {
    n: f64,
    /// Server statements or commands per second while the waiters wait.
    rate: f64,
    /// Release → next holder, in nanoseconds.
    handovers: Vec<f64>,
}

/// C3 on PostgreSQL and Redis.
pub fn run(rt: &Runtime, servers: &Servers, report: &mut Report) {
    let sizes: &[usize] = sized(&[1, 10, 100, 1_000], &[1, 4]);
    let mut rates = Vec::new();
    let mut medians = Vec::new();
    let mut p99s = Vec::new();
    for label in ["PostgreSQL", "Redis 7"] {
        let Some(b) = servers.backends.iter().find(|b| b.label == label) else {
            continue;
        };
        let rate_name = format!("{label}: server queries/s while the waiters wait");
        let hand_name = format!("{label}: handover, release → next holder, median / p99");
        if let Err(e) = &b.store {
            report.add(b.not_measured(C3, &rate_name, e, "—"));
            report.add(b.not_measured(C3, &hand_name, e, "—"));
            continue;
        }
        eprintln!(" {label}");
        let (points, stop_text) = grow(sizes, "waiters", |n| rt.block_on(waiters(b, n)));
        let Some(last) = points.last() else {
            report.add(b.not_measured(C3, &rate_name, &stop_text, "—"));
            report.add(b.not_measured(C3, &hand_name, &stop_text, "—"));
            continue;
        };
        let r: Vec<(f64, f64)> = points.iter().map(|p| (p.n, p.rate)).collect();
        // A provider's waiters on one key queue in its in-process table: one of them asks
        // the server.
        let bound = match label {
            "PostgreSQL" => {
                "bounded by the providers, not the waiters: a provider's waiters on one key \
                 queue in its in-process table, and the one that asks the server waits there \
                 natively (`pg_advisory_lock`), sending nothing while it waits"
            }
            _ => {
                "bounded by the providers, not the waiters: a provider's waiters on one key \
                 queue in its in-process table, and the one that asks the server polls it with \
                 backoff and jitter (no wake-ups)"
            }
        };
        report.add(Row::described(
            C3,
            &rate_name,
            format!(
                "{}; grows {}: {bound}{stop_text}",
                listing(&r, |v| format!("{v:.0}")),
                growth(&r)
            ),
            last.rate,
            "/s",
            Target::None,
        ));
        let m: Vec<(f64, f64)> = points
            .iter()
            .map(|p| (p.n, median(&p.handovers) / 1e6))
            .collect();
        let q: Vec<(f64, f64)> = points
            .iter()
            .map(|p| (p.n, quantile(&p.handovers, 0.99) / 1e6))
            .collect();
        report.add(Row::described(
            C3,
            &hand_name,
            format!(
                "{}; the median grows {}: the more waiters, the likelier the next holder is \
                 queued in the releasing provider and takes the key as soon as it is free; \
                 the p99 is a waiter of another provider{}{stop_text}",
                points
                    .iter()
                    .map(|p| format!(
                        "{}: {} / {}",
                        count(p.n),
                        time(median(&p.handovers)),
                        time(quantile(&p.handovers, 0.99))
                    ))
                    .collect::<Vec<_>>()
                    .join(", "),
                growth(&m),
                if label == "Redis 7" {
                    ", which learns of the free key at its next poll"
                } else {
                    ""
                }
            ),
            median(&last.handovers),
            "ns",
            Target::None,
        ));
        rates.push(Series {
            label: label.to_owned(),
            points: r,
        });
        medians.push(Series {
            label: label.to_owned(),
            points: m,
        });
        p99s.push(Series {
            label: label.to_owned(),
            points: q,
        });
    }
    chart(
        report,
        "curves-waiters.svg",
        "C3: waiters on one key across 10 providers (x: waiters)",
        &[
            Panel {
                title: "server queries/s while they wait".to_owned(),
                unit: "/s".to_owned(),
                series: rates,
                target: None,
            },
            Panel {
                title: "handover, release → next holder, median".to_owned(),
                unit: "ms".to_owned(),
                series: medians,
                target: None,
            },
            Panel {
                title: "handover, release → next holder, p99".to_owned(),
                unit: "ms".to_owned(),
                series: p99s,
                target: None,
            },
        ],
    );
    report.note(format!(
        "C3: per size, an 11th provider holds a key while that many waiters (`acquire`, spread \
         over up to 10 providers) wait for it; the server's statements or commands are counted \
         over {} s after {} s to settle, as in section 3 (PostgreSQL `xact_commit + \
         xact_rollback`, Redis `INFO commandstats` without `INFO`), less the counting. Then \
         the holder releases and every waiter takes the key once and releases it at once; a \
         handover is the time from one holder starting its release to the next holder having \
         the lock.",
        window().as_secs_f64(),
        settle().as_secs_f64()
    ));
}

fn settle() -> Duration {
    sized(Duration::from_secs(1), Duration::from_millis(200))
}

fn window() -> Duration {
    sized(Duration::from_secs(3), Duration::from_millis(300))
}

/// The server's statement or command count, and how much each count adds to it.
async fn queries(b: &Backend, pg: Option<&sqlx::PgPool>) -> Result<(u64, u64), String> {
    match b.store.as_ref().map_err(Clone::clone)? {
        Store::Postgres(_) => sqlx::query_scalar::<_, i64>(
            "SELECT (xact_commit + xact_rollback)::bigint FROM pg_stat_database \
             WHERE datname = current_database()",
        )
        .fetch_one(pg.ok_or("no pool")?)
        .await
        .map(|n| (n as u64, 1))
        .map_err(|e| e.to_string()),
        Store::Redis(server) => Ok((
            server
                .command_calls()
                .into_iter()
                .filter(|(name, _)| name != "info")
                .map(|(_, calls)| calls)
                .sum(),
            0,
        )),
        _ => Err("not measured here".to_owned()),
    }
}

async fn waiters(b: &Backend, n: usize) -> Result<Point, String> {
    let pg = match b.store {
        Ok(Store::Postgres(_)) => Some(
            sqlx::postgres::PgPoolOptions::new()
                .max_connections(1)
                .connect(&b.driver_url())
                .await
                .map_err(|e| e.to_string())?,
        ),
        _ => None,
    };
    let url = b.dlock_url("");
    let key = format!("curves:waiters:{n}");
    let holder = LockProvider::connect(&url)
        .await
        .map_err(|e| e.to_string())?;
    let guard = holder.try_acquire(&key).await.map_err(|e| e.to_string())?;
    let held_since = Instant::now();
    let mut providers = Vec::new();
    for _ in 0..n.min(10) {
        providers.push(
            LockProvider::connect(&url)
                .await
                .map_err(|e| e.to_string())?,
        );
    }
    // (acquired, release started) per critical section.
    let log = Arc::new(Mutex::new(Vec::with_capacity(n + 1)));
    let tasks: Vec<_> = (0..n)
        .map(|i| {
            let (p, log, key) = (
                providers[i % providers.len()].clone(),
                log.clone(),
                key.clone(),
            );
            tokio::spawn(async move {
                let g = p
                    .acquire(&key, Duration::from_secs(600))
                    .await
                    .map_err(|e| e.to_string())?;
                let acquired = Instant::now();
                log.lock()
                    .map_err(|e| e.to_string())?
                    .push((acquired, Instant::now()));
                g.release().await.map_err(|e| e.to_string())
            })
        })
        .collect();
    tokio::time::sleep(settle()).await;
    let (before, per_count) = queries(b, pg.as_ref()).await?;
    let started = Instant::now();
    tokio::time::sleep(window()).await;
    let (after, _) = queries(b, pg.as_ref()).await?;
    let rate = after.saturating_sub(before).saturating_sub(per_count) as f64
        / started.elapsed().as_secs_f64();
    let ended = tasks.iter().filter(|t| t.is_finished()).count();
    if ended > 0 {
        for t in &tasks {
            t.abort();
        }
        return Err(format!("{ended} of {n} waiters stopped waiting early"));
    }
    log.lock()
        .map_err(|e| e.to_string())?
        .push((held_since, Instant::now()));
    guard.release().await.map_err(|e| e.to_string())?;
    for t in tasks {
        t.await.map_err(|e| e.to_string())??;
    }
    let mut log = log.lock().map_err(|e| e.to_string())?.clone();
    log.sort_by_key(|(acquired, _)| *acquired);
    let handovers = log
        .windows(2)
        .map(|pair| (pair[1].0 - pair[0].1).as_nanos() as f64)
        .collect();
    Ok(Point {
        n: n as f64,
        rate,
        handovers,
    })
}
