//! Cost curves C1 and C2: how the cost of held locks and of distinct keys grows, and what
//! bounds it. (C3, waiters on one key, is in `waiters.rs`.) Also the counting allocator of
//! the report's binary, the process's CPU time, and the curves' charts.

use std::alloc::System;
use std::fmt::Write as _;
use std::time::{Duration, Instant};

use dlock::{LockGuard, LockProvider};
use futures::StreamExt;
use stats_alloc::{INSTRUMENTED_SYSTEM, StatsAlloc};
use tokio::runtime::Runtime;

use crate::measure::{quick, sized};
use crate::output::{Report, Row, Target};
use crate::servers::{Backend, Servers, Store};

pub const C1: &str = "C1. Cost curve: locks held by one provider";
pub const C2: &str = "C2. Cost curve: distinct keys ever locked";

/// The system allocator, counting the bytes the process allocates and frees (`stats_alloc`:
/// a few atomic adds per allocation, in every section; dlock allocates more per operation than
/// a raw driver, so this weighs a little more on dlock's side of a ratio).
#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

/// The bytes the process has allocated and not freed.
pub fn live_bytes() -> f64 {
    let s = GLOBAL.stats();
    s.bytes_allocated as f64 - s.bytes_deallocated as f64 + s.bytes_reallocated as f64
}

/// The CPU time the process has used (user + system, every thread, exited ones included),
/// from `/proc/self/stat`, in clock ticks of 10 ms.
pub fn cpu_time() -> Option<Duration> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // The fields after the command's name in brackets: state is field 3, utime 14, stime 15.
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    Some(Duration::from_millis(ticks * 10))
}

/// The process's open file descriptors.
fn open_files() -> Result<f64, String> {
    std::fs::read_dir("/proc/self/fd")
        .map(|d| d.count() as f64)
        .map_err(|e| e.to_string())
}

/// One line of a chart: a backend's figure at each size.
pub struct Series {
    pub label: String,
    pub points: Vec<(f64, f64)>,
}

/// One chart: its series against the size, on a logarithmic x axis.
pub struct Panel {
    pub title: String,
    pub unit: String,
    pub series: Vec<Series>,
    pub target: Option<f64>,
}

/// How a total grows with the size: the slope `k` of a least-squares line through its points
/// on log-log axes (sizes of 10 or more when there are two such points, and only positive
/// figures, so that a figure below its counter's resolution does not count), named
/// "constant" (|k| < 0.15), "linear" (0.85 ≤ k ≤ 1.15) or "~n^k".
pub fn growth(points: &[(f64, f64)]) -> String {
    if points.iter().all(|(_, y)| y.abs() < 1e-9) {
        return "none (zero)".to_owned();
    }
    let positive = |from: f64| -> Vec<(f64, f64)> {
        points
            .iter()
            .filter(|(n, y)| *n >= from && *y > 0.0 && y.is_finite())
            .map(|(n, y)| (n.ln(), y.ln()))
            .collect()
    };
    let mut pts = positive(10.0);
    if pts.len() < 2 {
        pts = positive(0.0);
    }
    if pts.len() < 2 {
        return "unclear (too few figures above zero)".to_owned();
    }
    let m = pts.len() as f64;
    let (mx, my) = (
        pts.iter().map(|p| p.0).sum::<f64>() / m,
        pts.iter().map(|p| p.1).sum::<f64>() / m,
    );
    let sxx: f64 = pts.iter().map(|p| (p.0 - mx).powi(2)).sum();
    let sxy: f64 = pts.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    if sxx <= 0.0 {
        return "unclear (one size only)".to_owned();
    }
    let k = sxy / sxx;
    if k.abs() < 0.15 {
        "constant".to_owned()
    } else if (0.85..=1.15).contains(&k) {
        "linear".to_owned()
    } else {
        format!("~n^{k:.2}")
    }
}

/// Measures a curve's sizes in turn (`measure(n)`, logged as `n what`) and stops at the first
/// that fails: the points reached, and "; not reached at N: why" (empty when all were).
pub fn grow<P>(
    sizes: &[usize],
    what: &str,
    mut measure: impl FnMut(usize) -> Result<P, String>,
) -> (Vec<P>, String) {
    let mut points = Vec::new();
    for &n in sizes {
        let t = Instant::now();
        match measure(n) {
            Ok(p) => points.push(p),
            Err(e) => {
                eprintln!("  {n} {what}: {e}");
                return (points, format!("; not reached at {}: {e}", count(n as f64)));
            }
        }
        eprintln!("  {n} {what}: {:.1} s", t.elapsed().as_secs_f64());
    }
    (points, String::new())
}

/// "1: 1.2 KiB, 10: ..." for a row.
pub fn listing(points: &[(f64, f64)], show: impl Fn(f64) -> String) -> String {
    points
        .iter()
        .map(|(n, y)| format!("{}: {}", count(*n), show(*y)))
        .collect::<Vec<_>>()
        .join(", ")
}

/// 100000 → "100k".
pub fn count(n: f64) -> String {
    if n >= 1e6 && (n / 1e6).fract() == 0.0 {
        format!("{:.0}M", n / 1e6)
    } else if n >= 1e3 && (n / 1e3).fract() == 0.0 {
        format!("{:.0}k", n / 1e3)
    } else {
        format!("{n:.0}")
    }
}

/// Bytes in a readable unit.
pub fn bytes(b: f64) -> String {
    if !b.is_finite() {
        "—".to_owned()
    } else if b.abs() < 1024.0 {
        format!("{b:.0} B")
    } else if b.abs() < 1024.0 * 1024.0 {
        format!("{:.1} KiB", b / 1024.0)
    } else {
        format!("{:.1} MiB", b / 1024.0 / 1024.0)
    }
}

/// Writes a chart of panels, one under the other, as `name` in the report's directory, and
/// adds a note that shows it.
pub fn chart(report: &mut Report, name: &str, title: &str, panels: &[Panel]) {
    let (left, w, h, gap, top) = (70.0, 560.0, 200.0, 70.0, 40.0);
    let legend_w = 160.0;
    let height = top + panels.len() as f64 * (h + gap);
    let width = left + w + legend_w + 20.0;
    let colours = [
        "#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b",
    ];
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(
        s,
        r##"<rect width="100%" height="100%" fill="#ffffff"/><text x="10" y="22" font-size="15" font-weight="bold">{}</text>"##,
        escape(title)
    );
    for (i, panel) in panels.iter().enumerate() {
        let y0 = top + i as f64 * (h + gap) + 20.0;
        let pts: Vec<(f64, f64)> = panel
            .series
            .iter()
            .flat_map(|s| s.points.iter().copied())
            .filter(|(x, y)| x.is_finite() && y.is_finite())
            .collect();
        let _ = writeln!(
            s,
            r#"<text x="{left}" y="{}" font-weight="bold">{}</text>"#,
            y0 - 6.0,
            escape(&format!("{} ({})", panel.title, panel.unit))
        );
        let _ = writeln!(
            s,
            r##"<rect x="{left}" y="{y0}" width="{w}" height="{h}" fill="none" stroke="#888"/>"##
        );
        if pts.is_empty() {
            continue;
        }
        let xmax = pts.iter().map(|p| p.0).fold(1.0f64, f64::max).max(10.0);
        let (lx0, lx1) = (0.0, xmax.log10().ceil());
        let ys = pts.iter().map(|p| p.1).chain(panel.target);
        let (ymin, ymax) = ys.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), y| {
            (a.min(y), b.max(y))
        });
        let log_y = ymin > 0.0 && ymax / ymin > 30.0;
        let (ly0, ly1) = if log_y {
            (ymin.log10().floor(), ymax.log10().ceil())
        } else {
            (ymin.min(0.0), if ymax > 0.0 { ymax * 1.1 } else { 1.0 })
        };
        let px = |x: f64| left + (x.max(1.0).log10() - lx0) / (lx1 - lx0).max(1e-9) * w;
        let py = |y: f64| {
            let v = if log_y { y.max(1e-12).log10() } else { y };
            y0 + h - (v - ly0) / (ly1 - ly0).max(1e-12) * h
        };
        let mut d = lx0;
        while d <= lx1 {
            let x = left + (d - lx0) / (lx1 - lx0).max(1e-9) * w;
            let _ = writeln!(
                s,
                r##"<line x1="{x:.1}" x2="{x:.1}" y1="{y0}" y2="{}" stroke="#ddd"/><text x="{x:.1}" y="{}" text-anchor="middle" fill="#555">{}</text>"##,
                y0 + h,
                y0 + h + 14.0,
                count(10f64.powf(d))
            );
            d += 1.0;
        }
        let ticks: Vec<f64> = if log_y {
            let mut v = Vec::new();
            let mut e = ly0;
            while e <= ly1 {
                v.push(10f64.powf(e));
                e += 1.0;
            }
            v
        } else {
            (0..=4)
                .map(|k| ly0 + (ly1 - ly0) * k as f64 / 4.0)
                .collect()
        };
        for t in ticks {
            let y = py(t);
            let _ = writeln!(
                s,
                r##"<line x1="{left}" x2="{}" y1="{y:.1}" y2="{y:.1}" stroke="#eee"/><text x="{}" y="{:.1}" text-anchor="end" fill="#555">{}</text>"##,
                left + w,
                left - 4.0,
                y + 4.0,
                short_number(t)
            );
        }
        if let Some(t) = panel.target {
            let y = py(t);
            let _ = writeln!(
                s,
                r##"<line x1="{left}" x2="{}" y1="{y:.1}" y2="{y:.1}" stroke="#000" stroke-dasharray="6 4"/><text x="{}" y="{:.1}" fill="#000">target</text>"##,
                left + w,
                left + w - 40.0,
                y - 3.0
            );
        }
        for (k, series) in panel.series.iter().enumerate() {
            let colour = colours[k % colours.len()];
            let path: Vec<String> = series
                .points
                .iter()
                .filter(|(x, y)| x.is_finite() && y.is_finite())
                .map(|(x, y)| format!("{:.1},{:.1}", px(*x), py(*y)))
                .collect();
            let _ = writeln!(
                s,
                r#"<polyline points="{}" fill="none" stroke="{colour}" stroke-width="2"/>"#,
                path.join(" ")
            );
            for p in &path {
                let (x, y) = p.split_once(',').unwrap_or(("0", "0"));
                let _ = writeln!(s, r#"<circle cx="{x}" cy="{y}" r="3" fill="{colour}"/>"#);
            }
            let _ = writeln!(
                s,
                r#"<text x="{}" y="{}" fill="{colour}">{}</text>"#,
                left + w + 10.0,
                y0 + 14.0 + 16.0 * k as f64,
                escape(&series.label)
            );
        }
    }
    s.push_str("</svg>\n");
    let path = crate::output::out_dir().join(name);
    if let Err(e) = std::fs::write(&path, s) {
        eprintln!("could not write {}: {e}", path.display());
    }
    report.note(format!("![{title}]({name})"));
}

fn short_number(v: f64) -> String {
    let a = v.abs();
    if a >= 1e6 {
        format!("{:.1}M", v / 1e6)
    } else if a >= 1e3 {
        format!("{:.1}k", v / 1e3)
    } else if a >= 10.0 || v == 0.0 {
        format!("{v:.0}")
    } else if a >= 0.1 {
        format!("{v:.2}")
    } else {
        format!("{v:.0e}")
    }
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// Whether a run does the curve `name` (`curves-held`, ...): every run without `--only`, and
/// one whose `--only` it starts with.
pub fn wanted(name: &str) -> bool {
    crate::measure::section_named(name)
}

/// The curves' notes, and C1 and C2 (C3 is `waiters::run`).
pub fn run(rt: &Runtime, servers: &Servers, report: &mut Report) {
    if wanted("curves-held") {
        held_all(rt, servers, report);
    }
    if wanted("curves-keys") {
        keys_all(rt, servers, report);
    }
}

/// The backend labelled `label`, if this run started it (C1 to C5).
pub(crate) fn backend<'a>(servers: &'a Servers, label: &str) -> Option<&'a Backend> {
    servers.backends.iter().find(|b| b.label == label)
}

/// The lease of C1's held locks, and the window their keep-alive CPU is counted over.
fn held_lease() -> (Duration, Duration) {
    sized(
        (Duration::from_secs(9), Duration::from_secs(9)),
        (Duration::from_secs(1), Duration::from_millis(400)),
    )
}

/// One size of C1.
struct Held {
    n: f64,
    /// Client bytes per held lock.
    memory: f64,
    /// Server connections (SQLite: file descriptors) more than before.
    connections: f64,
    /// CPU over the window as a share of one core, in per cent.
    cpu: f64,
    /// Server commands per lock over the window (Redis).
    commands: Option<f64>,
    /// Locks found lost at the window's end.
    lost: usize,
}

/// C1: per backend, one provider takes 1 to 100,000 keys and holds them.
fn held_all(rt: &Runtime, servers: &Servers, report: &mut Report) {
    let sizes: &[usize] = sized(&[1, 10, 100, 1_000, 10_000, 100_000], &[1, 10, 40]);
    let (lease, window) = held_lease();
    let mut memory = Vec::new();
    let mut conns = Vec::new();
    let mut cpu = Vec::new();
    for label in ["SQLite", "PostgreSQL", "Redis 7"] {
        let Some(b) = backend(servers, label) else {
            continue;
        };
        let names = [
            format!("{label}: client memory per held lock"),
            format!(
                "{label}: {} more while holding",
                if label == "SQLite" {
                    "open files"
                } else {
                    "server connections"
                }
            ),
            format!(
                "{label}: keep-alive CPU while holding, % of one core{}",
                if label == "PostgreSQL" {
                    " (no lease)"
                } else {
                    ", for 30 s leases"
                }
            ),
        ];
        let cpu_target = if label == "Redis 7" {
            Target::AtMost(5.0)
        } else {
            Target::None
        };
        if let Err(e) = &b.store {
            for (name, target) in names.iter().zip(["≤ 1024 B", "—", "—"]) {
                report.add(b.not_measured(C1, name, e, target));
            }
            continue;
        }
        eprintln!(" {label}");
        let (points, stop_text) = grow(sizes, "held", |n| rt.block_on(held(b, n, lease, window)));
        if points.is_empty() {
            let why = stop_text.trim_start_matches("; ");
            for (name, target) in names.iter().zip(["≤ 1024 B", "—", "—"]) {
                report.add(b.not_measured(C1, name, why, target));
            }
            continue;
        }
        let last = points.last().expect("a point");
        let per: Vec<(f64, f64)> = points.iter().map(|p| (p.n, p.memory)).collect();
        let total: Vec<(f64, f64)> = points.iter().map(|p| (p.n, p.memory * p.n)).collect();
        report.add(Row::described(
            C1,
            &names[0],
            format!(
                "{}; total grows {}, bounded only by the locks held{}{stop_text}",
                listing(&per, bytes),
                growth(&total),
                if last.memory > 1024.0 {
                    "; over the target: each held lock keeps its guard, its in-process table \
                     entry, its record with the provider (what inspection shows, and the \
                     waiter on its lost token), its lost token, the backend's handle and, on \
                     SQLite and Redis, a renewal entry and its lease deadline"
                } else {
                    ""
                }
            ),
            last.memory,
            "B",
            Target::AtMost(1024.0),
        ));
        let c: Vec<(f64, f64)> = points.iter().map(|p| (p.n, p.connections)).collect();
        let bound = match label {
            "SQLite" => "one database file and its journal, whatever the count",
            "PostgreSQL" => {
                "session locks on the provider's lock connections; the server's shared lock \
                 table bounds the locks held at once (max_locks_per_transaction × \
                 (max_connections + max_prepared_transactions) slots, 256 × 300 here, and what \
                 spare shared memory it can take beyond them)"
            }
            _ => "the provider's multiplexed connections, whatever the count",
        };
        report.add(Row::described(
            C1,
            &names[1],
            format!(
                "{}; grows {}: {bound}{stop_text}",
                listing(&c, |v| format!("{v:.0}")),
                growth(&c)
            ),
            last.connections,
            "",
            Target::None,
        ));
        // Normalised to 30 s leases: renewals come 30 s / lease times less often.
        let scale = if label == "PostgreSQL" {
            1.0
        } else {
            lease.as_secs_f64() / 30.0
        };
        let u: Vec<(f64, f64)> = points.iter().map(|p| (p.n, p.cpu * scale)).collect();
        let lost: usize = points.iter().map(|p| p.lost).sum();
        let why = match label {
            "Redis 7" => {
                let per_lock = last
                    .commands
                    .map(|c| {
                        format!(
                            "; {:.1} server commands per lock in the window (as the server \
                             counts them: a renewal script and the commands it runs each \
                             count): one renewal per lock every third of its lease, sent in \
                             pipelines of up to 512",
                            c
                        )
                    })
                    .unwrap_or_default();
                format!(
                    "linear in the locks held: every lock is renewed every third of its lease, \
                     those due close together in one pipeline{per_lock}"
                )
            }
            "SQLite" => "all due locks are renewed in one transaction on a thread of its own; \
                 the rows it updates grow with the locks held"
                .to_owned(),
            _ => "no lease: one liveness check per connection (keepalive, 5 s), whatever the \
                 locks held"
                .to_owned(),
        };
        report.add(Row::described(
            C1,
            &names[2],
            format!(
                "{}; grows {}: {why}{}{stop_text}",
                listing(&u, |v| format!("{v:.2} %")),
                growth(&u),
                if lost > 0 {
                    format!(
                        "; {lost} lock(s) lost in the window with leases of {} s: the renewals \
                         did not keep up (so the CPU figure counts fewer renewals than due)",
                        lease.as_secs()
                    )
                } else {
                    String::new()
                }
            ),
            last.cpu * scale,
            "%",
            cpu_target,
        ));
        memory.push(Series {
            label: label.to_owned(),
            points: per,
        });
        conns.push(Series {
            label: label.to_owned(),
            points: c,
        });
        cpu.push(Series {
            label: label.to_owned(),
            points: u,
        });
    }
    chart(
        report,
        "curves-held.svg",
        "C1: locks held by one provider (x: locks held)",
        &[
            Panel {
                title: "client memory per held lock".to_owned(),
                unit: "bytes, counting allocator".to_owned(),
                series: memory,
                target: Some(1024.0),
            },
            Panel {
                title: "server connections (SQLite: open files) more while holding".to_owned(),
                unit: "count".to_owned(),
                series: conns,
                target: None,
            },
            Panel {
                title: "keep-alive CPU, normalised to 30 s leases (PostgreSQL: no lease)"
                    .to_owned(),
                unit: "% of one core".to_owned(),
                series: cpu,
                target: Some(5.0),
            },
        ],
    );
    report.note(format!(
        "C1: per backend and size, a new provider (lease {} s; PostgreSQL has none) takes that \
         many keys (64 at a time) and holds them. Memory: the bytes the process has live (a \
         counting global allocator in the report's binary, so exact, not RSS) while holding, \
         less before (the provider connected, one key taken and released), per lock; the \
         guards' own `Vec` is included (the allocator's atomic adds, a few per \
         allocation, run in every section of the report). Connections: PostgreSQL `pg_stat_activity` of the \
         database and user (the counting one left out), Redis `connected_clients`, SQLite the \
         process's open file descriptors, while holding less before. CPU: the process's user \
         + system time (`/proc/self/stat`, 10 ms ticks) over {} s of holding, as a share of \
         one core, multiplied by lease / 30 s for the lease backends (renewals every third of \
         the lease); PostgreSQL's as measured. The Redis target: 100,000 leases of 30 s \
         renewed with ≤ 5 % of one core. The run's machine is shared with other builds.",
        lease.as_secs(),
        window.as_secs_f64()
    ));
}

/// The connections C1 counts: the server's (PostgreSQL, Redis) or the process's files (SQLite).
async fn connections(b: &Backend, pg: Option<&sqlx::PgPool>) -> Result<f64, String> {
    match b.store.as_ref().map_err(Clone::clone)? {
        Store::Postgres(_) => sqlx::query_scalar::<_, i64>(
            "SELECT count(*)::bigint FROM pg_stat_activity \
             WHERE datname = current_database() AND usename = current_user \
             AND pid <> pg_backend_pid()",
        )
        .fetch_one(pg.ok_or("no pool")?)
        .await
        .map(|n| n as f64)
        .map_err(|e| e.to_string()),
        Store::Redis(server) => crate::servers::redis_clients(server).map(|n| n as f64),
        Store::Sqlite(_) => open_files(),
        Store::My(_) => Err("not measured here".to_owned()),
    }
}

/// Takes `n` keys into one new provider and holds them over `window`.
async fn held(b: &Backend, n: usize, lease: Duration, window: Duration) -> Result<Held, String> {
    let options = match b.store.as_ref().map_err(Clone::clone)? {
        Store::Postgres(_) => String::new(),
        _ => format!("lease={}ms", lease.as_millis()),
    };
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
    let conns_before = connections(b, pg.as_ref()).await?;
    let locks = LockProvider::connect(&b.dlock_url(&options))
        .await
        .map_err(|e| e.to_string())?;
    let warm = locks
        .try_acquire("curves:held:warm")
        .await
        .map_err(|e| e.to_string())?;
    warm.release().await.map_err(|e| e.to_string())?;
    tokio::time::sleep(Duration::from_millis(50)).await;
    let before = live_bytes();
    let mut guards: Vec<LockGuard> = Vec::with_capacity(n);
    let mut taken = futures::stream::iter(0..n)
        .map(|i| {
            let locks = &locks;
            async move { locks.try_acquire(&format!("curves:held:{i}")).await }
        })
        .buffer_unordered(64);
    while let Some(g) = taken.next().await {
        match g {
            Ok(g) => guards.push(g),
            Err(e) => {
                drop(taken);
                release(guards).await;
                return Err(e.to_string());
            }
        }
    }
    drop(taken);
    tokio::time::sleep(Duration::from_millis(20)).await;
    let memory = (live_bytes() - before) / n as f64;
    let conns = connections(b, pg.as_ref()).await? - conns_before;
    let commands_before = match &b.store {
        Ok(Store::Redis(server)) => Some(server.command_calls().values().sum::<u64>()),
        _ => None,
    };
    let cpu_before = cpu_time().ok_or("no /proc/self/stat")?;
    let t = Instant::now();
    tokio::time::sleep(window).await;
    let cpu = (cpu_time().ok_or("no /proc/self/stat")? - cpu_before).as_secs_f64()
        / t.elapsed().as_secs_f64()
        * 100.0;
    let commands = match (&b.store, commands_before) {
        (Ok(Store::Redis(server)), Some(was)) => Some(
            server
                .command_calls()
                .iter()
                .filter(|(name, _)| *name != "info")
                .map(|(_, n)| *n)
                .sum::<u64>()
                .saturating_sub(was) as f64
                / n as f64,
        ),
        _ => None,
    };
    let lost = guards.iter().filter(|g| g.is_lost()).count();
    release(guards).await;
    Ok(Held {
        n: n as f64,
        memory,
        connections: conns,
        cpu,
        commands,
        lost,
    })
}

async fn release(guards: Vec<LockGuard>) {
    futures::stream::iter(guards)
        .for_each_concurrent(64, |g| async move {
            let _ = g.release().await;
        })
        .await;
}

/// What a store keeps after `n` distinct keys were each locked once and released.
struct Kept {
    n: f64,
    /// Entries (SQLite rows, Redis keys, PostgreSQL fencing rows or tables) more than before.
    entries: f64,
    /// Bytes (SQLite pages, Redis `used_memory`, PostgreSQL database size) more than before.
    bytes: f64,
}

/// C2's store: where it counts what is kept, per backend.
enum Kept0 {
    Sqlite(std::path::PathBuf),
    Redis(String),
    /// Counts the `dlock_fencing` table (whether it exists).
    Postgres(sqlx::PgPool),
    /// Counts the rows of `dlock_fencing`.
    PostgresRows(sqlx::PgPool),
}

impl Kept0 {
    async fn measure(&self, server: Option<&Backend>) -> Result<(f64, f64), String> {
        match self {
            Kept0::Sqlite(path) => {
                let conn = rusqlite::Connection::open(path).map_err(|e| e.to_string())?;
                // The lock rows, and the shared counters' rows where the file has them.
                let rows: i64 = conn
                    .query_row(
                        "SELECT (SELECT count(*) FROM __distributed_locks) + \
                         coalesce((SELECT count(*) FROM __distributed_lock_counters), 0)",
                        [],
                        |r| r.get(0),
                    )
                    .map_err(|e| e.to_string())?;
                let size: i64 = conn
                    .query_row(
                        "SELECT page_count * page_size FROM pragma_page_count(), pragma_page_size()",
                        [],
                        |r| r.get(0),
                    )
                    .map_err(|e| e.to_string())?;
                Ok((rows as f64, size as f64))
            }
            Kept0::Redis(url) => {
                let client = redis::Client::open(url.as_str()).map_err(|e| e.to_string())?;
                let mut conn = client
                    .get_multiplexed_async_connection()
                    .await
                    .map_err(|e| e.to_string())?;
                let keys: i64 = redis::cmd("DBSIZE")
                    .query_async(&mut conn)
                    .await
                    .map_err(|e| e.to_string())?;
                let memory = match server.map(|b| &b.store) {
                    Some(Ok(Store::Redis(s))) => s
                        .info("memory")
                        .get("used_memory")
                        .and_then(|v| v.parse::<f64>().ok())
                        .ok_or("no used_memory")?,
                    _ => return Err("no server".to_owned()),
                };
                Ok((keys as f64, memory))
            }
            Kept0::Postgres(pool) | Kept0::PostgresRows(pool) => {
                let size: i64 =
                    sqlx::query_scalar("SELECT pg_database_size(current_database())::bigint")
                        .fetch_one(pool)
                        .await
                        .map_err(|e| e.to_string())?;
                let tables: i64 = sqlx::query_scalar(
                    "SELECT count(*)::bigint FROM pg_tables WHERE tablename = 'dlock_fencing'",
                )
                .fetch_one(pool)
                .await
                .map_err(|e| e.to_string())?;
                if matches!(self, Kept0::Postgres(_)) || tables == 0 {
                    return Ok((tables as f64, size as f64));
                }
                let rows: i64 = sqlx::query_scalar("SELECT count(*)::bigint FROM dlock_fencing")
                    .fetch_one(pool)
                    .await
                    .map_err(|e| e.to_string())?;
                Ok((rows as f64, size as f64))
            }
        }
    }
}

/// The longest C2 spends growing one backend's keys.
fn keys_budget() -> Duration {
    sized(Duration::from_secs(120), Duration::from_secs(5))
}

/// One configuration C2 measures.
struct KeysVariant {
    /// The backend's label in the report.
    backend: &'static str,
    /// The series' label in the chart.
    series: &'static str,
    /// The rows' names: entries, bytes, time per key.
    names: [&'static str; 3],
    /// URL options.
    options: &'static str,
    /// Where it keeps its store apart from the other variants: the SQLite file's name, the
    /// Redis database, the PostgreSQL database (`None`: the server's own).
    apart: &'static str,
    /// What bounds the store.
    bound: &'static str,
}

/// The number of shared counters C2's bounded rows use.
const KEYS_COUNTERS: &str = "fencing_counters=16";

const KEYS_VARIANTS: &[KeysVariant] = &[
    KeysVariant {
        backend: "SQLite",
        series: "SQLite",
        names: [
            "SQLite: rows of __distributed_locks per distinct key",
            "SQLite: file bytes (page_count × page_size) per distinct key",
            "SQLite: acquire + release per distinct key (64 at a time)",
        ],
        options: "",
        apart: "curves-keys.db",
        bound: "unbounded: a released key keeps its row (its fencing counter) for good",
    },
    KeysVariant {
        backend: "SQLite",
        series: "SQLite, fencing_counters=16",
        names: [
            "SQLite, fencing_counters=16: rows (locks + counters) per distinct key",
            "SQLite, fencing_counters=16: file bytes per distinct key",
            "SQLite, fencing_counters=16: acquire + release per distinct key (64 at a time)",
        ],
        options: KEYS_COUNTERS,
        apart: "curves-keys-bounded.db",
        bound: "bounded: at most 16 counter rows and the mode row; released rows are deleted",
    },
    KeysVariant {
        backend: "Redis 7",
        series: "Redis 7",
        names: [
            "Redis 7: keys (DBSIZE) per distinct key",
            "Redis 7: used_memory per distinct key",
            "Redis 7: acquire + release per distinct key (64 at a time)",
        ],
        options: "",
        apart: "9",
        bound: "unbounded: every key keeps its `…:fence` counter key, which never expires",
    },
    KeysVariant {
        backend: "Redis 7",
        series: "Redis 7, fencing_counters=16",
        names: [
            "Redis 7, fencing_counters=16: keys (DBSIZE) per distinct key",
            "Redis 7, fencing_counters=16: used_memory per distinct key",
            "Redis 7, fencing_counters=16: acquire + release per distinct key (64 at a time)",
        ],
        options: KEYS_COUNTERS,
        apart: "10",
        bound: "bounded: at most 16 counter keys and the mode key",
    },
    KeysVariant {
        backend: "PostgreSQL",
        series: "PostgreSQL",
        names: [
            "PostgreSQL: dlock tables (fencing off, the default)",
            "PostgreSQL: database bytes (pg_database_size) per distinct key",
            "PostgreSQL: acquire + release per distinct key (64 at a time)",
        ],
        options: "",
        apart: "",
        bound: "nothing kept per key (advisory locks; no fencing table by default)",
    },
    KeysVariant {
        backend: "PostgreSQL",
        series: "PostgreSQL, fencing=true",
        names: [
            "PostgreSQL, fencing=true: dlock_fencing rows per distinct key",
            "PostgreSQL, fencing=true: database bytes per distinct key",
            "PostgreSQL, fencing=true: acquire + release per distinct key (64 at a time)",
        ],
        options: "fencing=true",
        apart: "curves_keys_fenced",
        bound: "unbounded: one counter row per key for good",
    },
    KeysVariant {
        backend: "PostgreSQL",
        series: "PostgreSQL, fencing_counters=16",
        names: [
            "PostgreSQL, fencing_counters=16: dlock_fencing rows per distinct key",
            "PostgreSQL, fencing_counters=16: database bytes per distinct key",
            "PostgreSQL, fencing_counters=16: acquire + release per distinct key (64 at a time)",
        ],
        options: "fencing=true&fencing_counters=16",
        apart: "curves_keys_bounded",
        bound: "bounded: at most 16 counter rows and the mode row",
    },
];

/// C2: per backend, keys each locked once and released, 1 to 1,000,000 distinct ones; what
/// the store keeps and what each key costs, with per-key fencing counters (the default) and
/// with `fencing_counters=16`.
fn keys_all(rt: &Runtime, servers: &Servers, report: &mut Report) {
    let sizes: &[usize] = sized(
        &[1, 10, 100, 1_000, 10_000, 100_000, 1_000_000],
        &[1, 10, 100],
    );
    let mut entries_chart = Vec::new();
    let mut bytes_chart = Vec::new();
    // The per-key default's time per key, per backend, for the bounded rows' ratio.
    let mut per_key_cost: Vec<(&str, f64)> = Vec::new();
    for v in KEYS_VARIANTS {
        let Some(b) = backend(servers, v.backend) else {
            continue;
        };
        let [entries_name, bytes_name, cost_name] = v.names;
        if let Err(e) = &b.store {
            report.add(b.not_measured(C2, entries_name, e, "—"));
            report.add(b.not_measured(C2, bytes_name, e, "—"));
            report.add(b.not_measured(C2, cost_name, e, "—"));
            continue;
        }
        eprintln!(" {}", v.series);
        match rt.block_on(keys(b, v, sizes)) {
            Ok((points, stopped, cost)) => {
                let stop_text = stopped
                    .map(|n| {
                        format!(
                            "; stopped after {} keys: the run's time budget of {} s",
                            count(n as f64),
                            keys_budget().as_secs()
                        )
                    })
                    .unwrap_or_default();
                let last = points.last().expect("a point");
                let e: Vec<(f64, f64)> = points.iter().map(|p| (p.n, p.entries / p.n)).collect();
                let et: Vec<(f64, f64)> = points.iter().map(|p| (p.n, p.entries)).collect();
                let by: Vec<(f64, f64)> = points.iter().map(|p| (p.n, p.bytes / p.n)).collect();
                let bt: Vec<(f64, f64)> = points.iter().map(|p| (p.n, p.bytes)).collect();
                let bound = v.bound;
                if v.options.is_empty() && v.backend == "PostgreSQL" {
                    report.add(Row::described(
                        C2,
                        entries_name,
                        format!(
                            "{}; {bound}{stop_text}",
                            listing(&et, |v| format!("{v:.0}"))
                        ),
                        last.entries,
                        "",
                        Target::None,
                    ));
                } else {
                    report.add(Row::described(
                        C2,
                        entries_name,
                        format!(
                            "{}; total {}: {bound}{stop_text}",
                            listing(&e, |v| format!("{v:.3}")),
                            listing(&et, |v| format!("{v:.0}"))
                        ),
                        last.entries / last.n,
                        "",
                        Target::None,
                    ));
                }
                report.add(Row::described(
                    C2,
                    bytes_name,
                    format!(
                        "{}; total grows {}{stop_text}",
                        listing(&by, bytes),
                        growth(&bt)
                    ),
                    last.bytes / last.n,
                    "B",
                    Target::None,
                ));
                let micros = cost.as_secs_f64() * 1e6;
                let bounded = v.options.contains("fencing_counters");
                // The bounded rows compare with the backend's per-key fencing row (on
                // PostgreSQL `fencing=true`, which comes after the default without tokens).
                let versus = match per_key_cost.iter().find(|(name, _)| *name == v.backend) {
                    Some((_, base)) if bounded && *base > 0.0 => format!(
                        "; {:.2}× the per-key counters' {base:.1} µs (same sizes, one run)",
                        micros / base
                    ),
                    _ => String::new(),
                };
                if !bounded && (v.options.contains("fencing=true") || v.backend != "PostgreSQL") {
                    per_key_cost.retain(|(name, _)| *name != v.backend);
                    per_key_cost.push((v.backend, micros));
                }
                report.add(Row::described(
                    C2,
                    cost_name,
                    format!("{micros:.1} µs, the mean over every key of the run{versus}"),
                    micros,
                    "µs",
                    Target::None,
                ));
                entries_chart.push(Series {
                    label: v.series.to_owned(),
                    points: e,
                });
                bytes_chart.push(Series {
                    label: v.series.to_owned(),
                    points: by,
                });
            }
            Err(e) => {
                report.add(b.not_measured(C2, entries_name, &e, "—"));
                report.add(b.not_measured(C2, bytes_name, &e, "—"));
                report.add(b.not_measured(C2, cost_name, &e, "—"));
            }
        }
    }
    chart(
        report,
        "curves-keys.svg",
        "C2: distinct keys ever locked, each once and released (x: distinct keys)",
        &[
            Panel {
                title: "entries kept per distinct key (SQLite rows, Redis keys, PostgreSQL fencing rows)"
                    .to_owned(),
                unit: "entries".to_owned(),
                series: entries_chart,
                target: None,
            },
            Panel {
                title: "store bytes per distinct key".to_owned(),
                unit: "bytes".to_owned(),
                series: bytes_chart,
                target: None,
            },
        ],
    );
    report.note(format!(
        "C2: one provider per backend and configuration locks distinct keys, each once \
         (`try_acquire`, 64 at a time) and releases them, growing the count to each size in \
         turn (a configuration stops growing once it has spent {} s); the figures are what the \
         store keeps, less before, per key, and the mean time per key of acquire + release over \
         the whole run. SQLite: rows of `__distributed_locks` (and `__distributed_lock_counters`) \
         and `page_count × page_size` of a file of its own; Redis: `DBSIZE` of a database of \
         its own and `INFO memory` `used_memory`; PostgreSQL: `pg_database_size` and the rows of \
         `dlock_fencing`, the fenced configurations in databases of their own. Per-key fencing \
         counters (the default) live for good (a row per key on SQLite, a `…:fence` key per key \
         on Redis, a `dlock_fencing` row per key on PostgreSQL with `fencing=true`), so the \
         store grows without bound with the keys ever locked; with `{KEYS_COUNTERS}` it holds \
         at most 16 counters (tokens still strictly increasing per key).",
        keys_budget().as_secs()
    ));
}

/// `url` with its database name (the path) replaced by `db`.
fn with_database(url: &str, db: &str) -> String {
    let Some(scheme_end) = url.find("://") else {
        return url.to_owned();
    };
    let after = scheme_end + 3;
    let Some(slash) = url[after..].find('/').map(|i| after + i) else {
        return url.to_owned();
    };
    let end = url[slash..].find('?').map_or(url.len(), |i| slash + i);
    format!("{}/{db}{}", &url[..slash], &url[end..])
}

/// Locks distinct keys once each, growing to every size in `sizes`; what the store keeps at
/// each, the size it stopped before when it ran out of time, and the mean time of one key's
/// acquire + release (64 at a time).
async fn keys(
    b: &Backend,
    v: &KeysVariant,
    sizes: &[usize],
) -> Result<(Vec<Kept>, Option<usize>, Duration), String> {
    let (url, counter) = match b.store.as_ref().map_err(Clone::clone)? {
        Store::Sqlite(dir) => {
            let path = dir.path().join(v.apart);
            let mut url = format!("sqlite://{}", path.display());
            if !v.options.is_empty() {
                url = format!("{url}?{}", v.options);
            }
            (url, Kept0::Sqlite(path))
        }
        Store::Redis(server) => {
            // A database of its own, so that other sections' keys do not count.
            let base = format!("{}{}", server.url(""), v.apart);
            let url = if v.options.is_empty() {
                base.clone()
            } else {
                format!("{base}?{}", v.options)
            };
            (url, Kept0::Redis(base))
        }
        Store::Postgres(_) if v.apart.is_empty() => (
            b.dlock_url(v.options),
            Kept0::Postgres(
                sqlx::postgres::PgPoolOptions::new()
                    .max_connections(1)
                    .connect(&b.driver_url())
                    .await
                    .map_err(|e| e.to_string())?,
            ),
        ),
        Store::Postgres(_) => {
            // A database of its own: its fencing table is this configuration's alone.
            let admin = sqlx::postgres::PgPoolOptions::new()
                .max_connections(1)
                .connect(&b.driver_url())
                .await
                .map_err(|e| e.to_string())?;
            let create = match v.apart {
                "curves_keys_fenced" => "CREATE DATABASE curves_keys_fenced",
                _ => "CREATE DATABASE curves_keys_bounded",
            };
            if let Err(e) = sqlx::query(create).execute(&admin).await
                && !e.to_string().contains("already exists")
            {
                return Err(e.to_string());
            }
            admin.close().await;
            let pool = sqlx::postgres::PgPoolOptions::new()
                .max_connections(1)
                .connect(&with_database(&b.driver_url(), v.apart))
                .await
                .map_err(|e| e.to_string())?;
            (
                with_database(&b.dlock_url(v.options), v.apart),
                Kept0::PostgresRows(pool),
            )
        }
        Store::My(_) => return Err("not measured here".to_owned()),
    };
    let locks = LockProvider::connect(&url)
        .await
        .map_err(|e| e.to_string())?;
    // The schema exists before the first count.
    let warm = locks
        .try_acquire("curves:keys:warm")
        .await
        .map_err(|e| e.to_string())?;
    warm.release().await.map_err(|e| e.to_string())?;
    let (entries0, bytes0) = counter.measure(Some(b)).await?;
    let started = Instant::now();
    let mut spent = Duration::ZERO;
    let mut done = 0usize;
    let mut points = Vec::new();
    for &n in sizes {
        // Stop when this size would take past the budget at the rate so far.
        let elapsed = started.elapsed().as_secs_f64();
        if done > 0 && !quick() {
            let projected = elapsed / done as f64 * n as f64;
            if projected > keys_budget().as_secs_f64() {
                return Ok((points, Some(n), spent / done.max(1) as u32));
            }
        }
        let batch = Instant::now();
        let outcome: Vec<Result<(), String>> = futures::stream::iter(done..n)
            .map(|i| {
                let locks = &locks;
                async move {
                    let g = locks
                        .try_acquire(&format!("curves:key:{i}"))
                        .await
                        .map_err(|e| e.to_string())?;
                    g.release().await.map_err(|e| e.to_string())
                }
            })
            .buffer_unordered(64)
            .collect()
            .await;
        spent += batch.elapsed();
        outcome.into_iter().collect::<Result<Vec<()>, String>>()?;
        done = n;
        let (entries, size) = counter.measure(Some(b)).await?;
        eprintln!(
            "  {n} keys: {:.1} s, {} entries, {} more",
            started.elapsed().as_secs_f64(),
            entries - entries0,
            bytes((size - bytes0).max(0.0))
        );
        points.push(Kept {
            n: n as f64,
            entries: entries - entries0,
            bytes: size - bytes0,
        });
    }
    Ok((points, None, spent / done.max(1) as u32))
}
