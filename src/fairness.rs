//! Fairness runs across processes (`dlock-worker fairness`), as the tests and the report start
//! them and read their one-line summary back.

use std::process::Command;

/// What a fairness run measured.
#[derive(Debug, Clone, PartialEq)]
pub struct Fairness {
    /// Sections each process entered.
    pub counts: Vec<usize>,
    /// The largest distance of a process's count from an equal share, as a fraction of it.
    pub spread: f64,
    /// Median and 99th percentile of every wait, in milliseconds.
    pub p50_ms: f64,
    pub p99_ms: f64,
}

impl Fairness {
    /// Reads the worker's summary line (`ok processes=P counts=N,N,.. spread=X p50_ms=..
    /// p99_ms=.. ...`).
    pub fn parse(summary: &str) -> Result<Fairness, String> {
        let field = |name: &str| -> Result<&str, String> {
            summary
                .split_whitespace()
                .find_map(|part| part.strip_prefix(name)?.strip_prefix('='))
                .ok_or_else(|| format!("no {name} in {summary:?}"))
        };
        let number = |name: &str| -> Result<f64, String> {
            field(name)?.parse().map_err(|e| format!("{name}: {e}"))
        };
        Ok(Fairness {
            counts: field("counts")?
                .split(',')
                .map(|n| n.parse().map_err(|e| format!("counts: {e}")))
                .collect::<Result<_, _>>()?,
            spread: number("spread")?,
            p50_ms: number("p50_ms")?,
            p99_ms: number("p99_ms")?,
        })
    }
}

/// Runs `processes` worker processes (the `dlock-worker` binary at `worker`) of `tasks` tasks
/// each that all take `key` on `url` again and again for `seconds` (holding it 1 ms each
/// time), and returns how evenly they were served with the worker's summary line.
pub fn run(
    worker: &str,
    url: &str,
    key: &str,
    processes: usize,
    tasks: usize,
    seconds: u64,
) -> Result<(Fairness, String), String> {
    let out = Command::new(worker)
        .args(["fairness", url, key])
        .args(["--processes", &processes.to_string()])
        .args(["--tasks", &tasks.to_string()])
        .args(["--seconds", &seconds.to_string()])
        .output()
        .map_err(|e| format!("running dlock-worker: {e}"))?;
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).trim().to_owned());
    }
    let summary = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    Ok((Fairness::parse(&summary)?, summary))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_summary_line() {
        let line = "ok processes=2 counts=10,12 spread=0.091 p50_ms=1.50 p99_ms=3.25 max_ms=4.00 p99_over_p50=2.17";
        assert_eq!(
            Fairness::parse(line),
            Ok(Fairness {
                counts: vec![10, 12],
                spread: 0.091,
                p50_ms: 1.5,
                p99_ms: 3.25,
            })
        );
        for bad in [
            "",
            "ok counts=1,x spread=0 p50_ms=1 p99_ms=1",
            "ok counts=1 spread=0 p50_ms=1",
        ] {
            assert!(Fairness::parse(bad).is_err(), "{bad}");
        }
    }
}
