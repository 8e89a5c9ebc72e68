//! Section 9: fairness across processes. Worker processes (`dlock-worker fairness`) of 8 tasks
//! each take one key again and again, holding it 1 ms, for 5 s from a common start; per
//! store and number of processes, how far the process that got the most or the fewest
//! acquisitions is from an equal share, and the 99th percentile wait against the median.
//! The same again with permits of a semaphore of 3 on the key instead of the lock. On the
//! stores of the other sections, and on an etcd cluster of 3 members started here.

use crate::measure::{backend, sized};
use crate::output::{Report, Row, Target};
use crate::servers::Servers;

pub const S9: &str = "9. Fairness: processes contending for one key (a lock, a semaphore of 3)";

/// The semaphore's permits.
const PERMITS: u32 = 3;

/// What one run printed.
struct Run {
    counts: String,
    spread: f64,
    p50_ms: f64,
    p99_ms: f64,
}

/// Section 9 on every store that runs.
pub fn run(servers: &Servers, report: &mut Report) {
    for b in &servers.backends {
        if !backend(b.label) {
            continue;
        }
        let url = b
            .store
            .as_ref()
            .map(|_| b.dlock_url(""))
            .map_err(|e| e.clone());
        measure(report, b.label, url, b.missing());
    }
    if backend("etcd") {
        let (cluster, excused) = start_etcd();
        let url = cluster.as_ref().map(|c| c.url("")).map_err(|e| e.clone());
        measure(report, "etcd (3 members)", url, excused);
    }
}

/// The rows of one store: at each size, the lock, then the semaphore.
fn measure(report: &mut Report, label: &str, url: Result<String, String>, excused: bool) {
    let sizes: &[usize] = sized(&[2, 4], &[2]);
    let (tasks, seconds) = sized((8, 5), (2, 1));
    for &processes in sizes {
        for permits in [None, Some(PERMITS)] {
            let what = match permits {
                None => String::new(),
                Some(n) => format!(", semaphore of {n}"),
            };
            let spread_name = format!(
                "{label}, {processes} processes × {tasks} tasks{what}: largest distance from an equal share"
            );
            let wait_name =
                format!("{label}, {processes} processes × {tasks} tasks{what}: wait p99 / median");
            let url = match &url {
                Ok(url) => url,
                Err(e) => {
                    for (name, target) in [(&spread_name, "≤ 25 %"), (&wait_name, "≤ 5×")] {
                        report.add(Row::not_measured(S9, name, e, target).excused_if(excused));
                    }
                    continue;
                }
            };
            eprintln!(" {label} with {processes} processes{what}");
            let key = match permits {
                None => format!("bench:fair:{processes}"),
                Some(_) => format!("bench:fair-semaphore:{processes}"),
            };
            match fair(url, &key, [processes, tasks], seconds, permits) {
                Ok(run) => {
                    report.add(Row::described(
                        S9,
                        &spread_name,
                        format!(
                            "{:.1} % (acquisitions per process: {})",
                            run.spread * 100.0,
                            run.counts
                        ),
                        run.spread * 100.0,
                        "%",
                        Target::AtMost(25.0),
                    ));
                    report.add(Row::described(
                        S9,
                        &wait_name,
                        format!(
                            "{:.2}× (median {:.1} ms, p99 {:.1} ms)",
                            run.p99_ms / run.p50_ms.max(1e-3),
                            run.p50_ms,
                            run.p99_ms
                        ),
                        run.p99_ms / run.p50_ms.max(1e-3),
                        "×",
                        Target::AtMost(5.0),
                    ));
                }
                Err(e) => {
                    report.add(Row::not_measured(S9, &spread_name, &e, "≤ 25 %"));
                    report.add(Row::not_measured(S9, &wait_name, &e, "≤ 5×"));
                }
            }
        }
    }
}

/// Starts 3 etcd members, and whether a failure is excused (no binary, or no feature).
#[cfg(feature = "etcd")]
fn start_etcd() -> (Result<dlock_testkit::etcd::EtcdCluster, String>, bool) {
    if dlock_testkit::etcd::binary().is_none() {
        return (Err("server binary not installed".to_owned()), true);
    }
    let started = crate::deployments::caught(|| dlock_testkit::etcd::EtcdCluster::start(3));
    let excused = started
        .as_ref()
        .is_err_and(|e| e == "server binary not installed");
    (started, excused)
}

/// Without the `etcd` feature there is no etcd cluster (no failure).
#[cfg(not(feature = "etcd"))]
fn start_etcd() -> (Result<NoEtcd, String>, bool) {
    (
        Err("built without the `etcd` feature (run with --all-features)".to_owned()),
        true,
    )
}

/// What `start_etcd` never gives without the `etcd` feature.
#[cfg(not(feature = "etcd"))]
enum NoEtcd {}

#[cfg(not(feature = "etcd"))]
impl NoEtcd {
    fn url(&self, _: &str) -> String {
        match *self {}
    }
}

fn fair(
    url: &str,
    key: &str,
    [processes, tasks]: [usize; 2],
    seconds: u64,
    permits: Option<u32>,
) -> Result<Run, String> {
    let worker = env!("CARGO_BIN_EXE_dlock-worker");
    let (run, _) = match permits {
        None => dlock_suite::fairness::run(worker, url, key, processes, tasks, seconds)?,
        Some(permits) => dlock_suite::fairness::run_semaphore(
            worker,
            url,
            key,
            [processes, tasks],
            seconds,
            permits,
        )?,
    };
    Ok(Run {
        counts: run
            .counts
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(", "),
        spread: run.spread,
        p50_ms: run.p50_ms,
        p99_ms: run.p99_ms,
    })
}
