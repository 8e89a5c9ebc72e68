//! Cost curve C4 and figure C5, across processes (`dlock-worker throughput`): C4 1 to 64
//! worker processes, each with one provider on the same store, taking keys of their own;
//! C5 4 processes all taking one hot key, dlock against the raw driver doing the same.

use std::time::Duration;

use dlock_suite::throughput::{self, Load};
use tokio::runtime::Runtime;

use crate::curves::{Panel, Series, backend, chart, count, grow, growth, listing, wanted};
use crate::measure::{median, sized};
use crate::output::{Report, Row, Target};
use crate::servers::{Backend, Connections, Servers, Store};

/// C4's title.
pub const C4: &str = "C4. Cost curve: providers (processes) on one store";
/// C5's title.
pub const C5: &str = "C5. Hot key across processes against the raw driver";

/// C4 and C5, as far as `--only` asks (`curves-providers`, `curves-hot`).
pub fn run(rt: &Runtime, servers: &Servers, report: &mut Report) {
    if wanted("curves-providers") {
        providers_all(rt, servers, report);
    }
    if wanted("curves-hot") {
        hot_all(servers, report);
    }
}

/// Runs `load` on `url` through the `dlock-worker` binary, calling `during` once it started.
fn throughput(
    url: &str,
    prefix: &str,
    load: Load,
    during: impl FnOnce(),
) -> Result<throughput::Throughput, String> {
    throughput::run(
        env!("CARGO_BIN_EXE_dlock-worker"),
        url,
        prefix,
        load,
        during,
    )
    .map(|(measured, _)| measured)
}

/// One size of C4.
struct Point {
    n: f64,
    /// Acquisitions of every process, per second.
    rate: f64,
    /// The server's client connections during the run, less before (none for SQLite).
    connections: Option<f64>,
}

/// C4 at `processes` processes of `load.tasks` tasks each; the connections are counted half
/// way through the run.
fn providers(rt: &Runtime, b: &Backend, processes: usize, load: Load) -> Result<Point, String> {
    let counter = match b.store.as_ref().map_err(Clone::clone)? {
        Store::Sqlite(_) => None,
        _ => Some(rt.block_on(Connections::new(b))?),
    };
    let before = match &counter {
        Some(c) => Some(rt.block_on(c.count(b))?),
        None => None,
    };
    let mut during = None;
    let measured = throughput(
        &b.dlock_url(""),
        &format!("bench:providers:{processes}"),
        Load { processes, ..load },
        || {
            if let Some(c) = &counter {
                std::thread::sleep(Duration::from_millis(load.seconds * 500));
                during = Some(rt.block_on(c.count(b)));
            }
        },
    )?;
    let connections = match (before, during) {
        (Some(before), Some(now)) => Some(now?.saturating_sub(before) as f64),
        (Some(_), None) => return Err("the run never started".to_owned()),
        _ => None,
    };
    Ok(Point {
        n: processes as f64,
        rate: measured.per_s,
        connections,
    })
}

/// "1 process", "64 processes".
fn processes(n: f64) -> String {
    format!("{} process{}", count(n), if n == 1.0 { "" } else { "es" })
}

/// C4: per store, 1 to 64 worker processes with a provider each take keys of their own.
fn providers_all(rt: &Runtime, servers: &Servers, report: &mut Report) {
    let sizes: &[usize] = sized(&[1, 2, 4, 8, 16, 32, 64], &[1, 2]);
    let load = Load {
        processes: 1,
        tasks: sized(4, 2),
        seconds: sized(3, 1),
        hot: false,
        raw: false,
    };
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    let mut rates = Vec::new();
    let mut conns = Vec::new();
    for label in ["SQLite", "PostgreSQL", "MariaDB", "Redis 7"] {
        let Some(b) = backend(servers, label) else {
            continue;
        };
        let rate_name = format!(
            "{label}: acquisitions/s in total, {} tasks per process on keys of their own",
            load.tasks
        );
        let conn_name = format!("{label}: server connections more during the run");
        let names = if label == "SQLite" {
            vec![rate_name.as_str()]
        } else {
            vec![rate_name.as_str(), conn_name.as_str()]
        };
        if let Err(e) = &b.store {
            for name in names {
                report.add(b.not_measured(C4, name, e, "—"));
            }
            continue;
        }
        eprintln!(" {label}");
        let (points, stop_text) = grow(sizes, "processes", |n| providers(rt, b, n, load));
        let Some(last) = points.last() else {
            for name in names {
                report.add(b.not_measured(C4, name, &stop_text, "—"));
            }
            continue;
        };
        let r: Vec<(f64, f64)> = points.iter().map(|p| (p.n, p.rate)).collect();
        let best = r.iter().copied().fold(
            (0.0, f64::NEG_INFINITY),
            |a, p| if p.1 > a.1 { p } else { a },
        );
        let bound = match label {
            "SQLite" => format!(
                "one database file: every acquisition and release is a write transaction, \
                 and writers take the file's lock in turn, so more processes add waiting for \
                 it, not capacity (and the {cpus} CPUs run every worker process)"
            ),
            "Redis 7" => format!(
                "bounded by the machine's {cpus} CPUs, which the server (its commands on one \
                 thread) and every worker process share"
            ),
            _ => format!(
                "bounded by the machine's {cpus} CPUs, which the server's backends and every \
                 worker process share"
            ),
        };
        report.add(Row::described(
            C4,
            &rate_name,
            format!(
                "{}; grows {}, at most {:.0}/s (at {}): {bound}{stop_text}",
                listing(&r, |v| format!("{v:.0}")),
                growth(&r),
                best.1,
                processes(best.0)
            ),
            last.rate,
            "/s",
            Target::None,
        ));
        rates.push(Series {
            label: label.to_owned(),
            points: r,
        });
        let c: Vec<(f64, f64)> = points
            .iter()
            .filter_map(|p| Some((p.n, p.connections?)))
            .collect();
        let Some(&(n, total)) = c.last() else {
            continue;
        };
        let why = match label {
            "Redis 7" => {
                "a provider's commands share its multiplexed connections, whatever its tasks"
            }
            _ => {
                "a provider holds its session locks on its lock connections, opened as its \
                 tasks need them (`connections`, 4 by default)"
            }
        };
        report.add(Row::described(
            C4,
            &conn_name,
            format!(
                "{}; grows {}: {:.1} per provider at {}: {why}{stop_text}",
                listing(&c, |v| format!("{v:.0}")),
                growth(&c),
                total / n,
                processes(n)
            ),
            total,
            "",
            Target::None,
        ));
        conns.push(Series {
            label: label.to_owned(),
            points: c,
        });
    }
    chart(
        report,
        "curves-providers.svg",
        &format!(
            "C4: providers on one store, a process each, {} tasks on keys of their own (x: processes)",
            load.tasks
        ),
        &[
            Panel {
                title: "acquisitions/s in total".to_owned(),
                unit: "/s".to_owned(),
                series: rates,
                target: None,
            },
            Panel {
                title: "server connections more during the run".to_owned(),
                unit: "count".to_owned(),
                series: conns,
                target: None,
            },
        ],
    );
    report.note(format!(
        "C4: per store and size, that many worker processes (`dlock-worker throughput`), each \
         with one provider, run {} tasks that take a key of their own (`acquire`, then \
         `release` at once) again and again for {} s from a common start; the figure is the \
         acquisitions completed within the run, per second. The server's client connections \
         are counted half way through (as in section 4: PostgreSQL's client backends in \
         `pg_stat_activity`, MariaDB's `SHOW PROCESSLIST`, Redis's `connected_clients`), less \
         before the processes started. The worker processes, the server and this run share \
         the machine's CPUs.",
        load.tasks, load.seconds
    ));
}

/// C5: per store, processes whose tasks all take one key, dlock and the raw driver in turn.
fn hot_all(servers: &Servers, report: &mut Report) {
    let load = Load {
        processes: sized(4, 2),
        tasks: sized(4, 2),
        seconds: sized(3, 1),
        hot: true,
        raw: false,
    };
    let rounds = sized(3, 1);
    for label in ["PostgreSQL", "MariaDB", "Redis 7"] {
        let Some(b) = backend(servers, label) else {
            continue;
        };
        let name = format!(
            "{label}: {} processes × {} tasks on one key, dlock / raw acquisitions/s",
            load.processes, load.tasks
        );
        if let Err(e) = &b.store {
            report.add(b.not_measured(C5, &name, e, "—"));
            continue;
        }
        eprintln!(" {label}");
        // On Redis, the raw commands are dlock's with `fencing=false`, as in section 1; dlock
        // runs a second time without its fair-waiting hold-off (`fair_waits=false`).
        let mut sides = vec![("raw", b.driver_url(), true)];
        if label == "Redis 7" {
            sides.push(("dlock", b.dlock_url("fencing=false"), false));
            sides.push((
                "dlock fair_waits=false",
                b.dlock_url("fencing=false&fair_waits=false"),
                false,
            ));
        } else {
            sides.push(("dlock", b.dlock_url(""), false));
        }
        let mut rates: Vec<Vec<f64>> = vec![Vec::new(); sides.len()];
        let mut failed = None;
        'rounds: for round in 0..rounds {
            for (i, (side, url, raw)) in sides.iter().enumerate() {
                let load = Load { raw: *raw, ..load };
                let key = format!("bench:hot:{}:{round}", side.replace(' ', "-"));
                match throughput(url, &key, load, || {}) {
                    Ok(measured) => {
                        eprintln!("  {side}: {:.0}/s", measured.per_s);
                        rates[i].push(measured.per_s);
                    }
                    Err(e) => {
                        eprintln!("  {side}: {e}");
                        failed = Some(format!("{side}: {e}"));
                        break 'rounds;
                    }
                }
            }
        }
        if let Some(e) = failed {
            report.add(b.not_measured(C5, &name, &e, "—"));
            continue;
        }
        let raw = &rates[0];
        for ((side, ..), dlock) in sides.iter().zip(&rates).skip(1) {
            let ratios: Vec<f64> = dlock.iter().zip(raw).map(|(d, r)| d / r).collect();
            let r = median(&ratios);
            let name = if *side == "dlock" {
                name.clone()
            } else {
                name.replace("dlock / raw", &format!("{side} / raw"))
            };
            report.add(Row::rate_ratio(
                C5,
                &name,
                format!(
                    "{r:.2}× ({side} {:.0}/s / raw {:.0}/s; medians of {rounds} interleaved \
                     rounds)",
                    median(dlock),
                    median(raw)
                ),
                r,
                Target::None,
            ));
        }
    }
    report.note(format!(
        "C5: per store, {} worker processes (`dlock-worker throughput --hot`) of {} tasks each \
         all take one key and give it back at once, again and again for {} s from a common \
         start: through one provider per process (Redis: `fencing=false`, and a second time \
         with `fair_waits=false` as well, without the hold-off that lets other processes' \
         waiters go first), or on the raw \
         driver with a connection per task: PostgreSQL `pg_advisory_lock` (waiting natively) + \
         `pg_advisory_unlock`, MariaDB `GET_LOCK(?, 60)` + `RELEASE_LOCK(?)`, Redis `SET NX \
         PX` polled every {} ms while the key is held + the Lua compare-and-delete. Raw and \
         dlock runs alternate (raw, dlock, ...) for {} rounds; the ratio is the median of the \
         rounds' dlock / raw acquisitions per second (above 1.00× dlock serves more), beside \
         each side's median.",
        load.processes,
        load.tasks,
        load.seconds,
        dlock_suite::raw::REDIS_POLL.as_millis(),
        rounds
    ));
}
