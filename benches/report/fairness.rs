//! Section 9: fairness across processes. Worker processes (`dlock-worker fairness`) of 8 tasks
//! each take one key again and again, holding it 1 ms, for 5 s from a common start; per
//! store and number of processes, how far the process that got the most or the fewest
//! acquisitions is from an equal share, and the 99th percentile wait against the median.

use crate::measure::{backend, sized};
use crate::output::{Report, Row, Target};
use crate::servers::Servers;

pub const S9: &str = "9. Fairness: processes contending for one key";

/// What one run printed.
struct Run {
    counts: String,
    spread: f64,
    p50_ms: f64,
    p99_ms: f64,
}

/// Section 9 on every store that runs.
pub fn run(servers: &Servers, report: &mut Report) {
    let sizes: &[usize] = sized(&[2, 4], &[2]);
    let (tasks, seconds) = sized((8, 5), (2, 1));
    for b in &servers.backends {
        if !backend(b.label) {
            continue;
        }
        for &processes in sizes {
            let spread_name = format!(
                "{}, {processes} processes × {tasks} tasks: largest distance from an equal share",
                b.label
            );
            let wait_name = format!(
                "{}, {processes} processes × {tasks} tasks: wait p99 / median",
                b.label
            );
            if let Err(e) = &b.store {
                report.add(b.not_measured(S9, &spread_name, e, "≤ 25 %"));
                report.add(b.not_measured(S9, &wait_name, e, "≤ 5×"));
                continue;
            }
            eprintln!(" {} with {processes} processes", b.label);
            let key = format!("bench:fair:{processes}");
            match fair(&b.dlock_url(""), &key, processes, tasks, seconds) {
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

fn fair(url: &str, key: &str, processes: usize, tasks: usize, seconds: u64) -> Result<Run, String> {
    let (run, _) = dlock_suite::fairness::run(
        env!("CARGO_BIN_EXE_dlock-worker"),
        url,
        key,
        processes,
        tasks,
        seconds,
    )?;
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
