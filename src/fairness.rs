//! Fairness runs across processes (`dlock-worker fairness`), as the tests and the report start
//! them and read their one-line summary back.

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
        let number = |name: &str| crate::summary_number(summary, name);
        Ok(Fairness {
            counts: crate::summary_list(summary, "counts")?,
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
    run_with(worker, url, key, [processes, tasks], seconds, &[])
}

/// [`run`] with permits of the semaphore `key` of `permits` instead of the lock `key`.
pub fn run_semaphore(
    worker: &str,
    url: &str,
    key: &str,
    [processes, tasks]: [usize; 2],
    seconds: u64,
    permits: u32,
) -> Result<(Fairness, String), String> {
    let permits = permits.to_string();
    run_with(
        worker,
        url,
        key,
        [processes, tasks],
        seconds,
        &["--permits", &permits],
    )
}

fn run_with(
    worker: &str,
    url: &str,
    key: &str,
    [processes, tasks]: [usize; 2],
    seconds: u64,
    extra: &[&str],
) -> Result<(Fairness, String), String> {
    let summary = crate::run_worker(
        worker,
        ["fairness", url, key],
        [processes as u64, tasks as u64, seconds],
        extra,
        || {},
    )?;
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
