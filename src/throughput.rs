//! Throughput runs across processes (`dlock-worker throughput`), as the report starts them and
//! reads their one-line summary back.

/// What a throughput run is asked to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Load {
    /// Worker processes.
    pub processes: usize,
    /// Tasks per process, each taking its lock again and again.
    pub tasks: usize,
    /// How long the tasks take locks, from a common start.
    pub seconds: u64,
    /// Every task of every process takes one key (otherwise each task a key of its own).
    pub hot: bool,
    /// The raw driver's statements or commands instead of dlock (a connection per task).
    pub raw: bool,
}

/// What a throughput run measured.
#[derive(Debug, Clone, PartialEq)]
pub struct Throughput {
    /// Acquisitions (taken and given back) each process completed within the run.
    pub counts: Vec<u64>,
    /// Acquisitions of every process, per second.
    pub per_s: f64,
}

impl Throughput {
    /// Reads the worker's summary line (`ok processes=P tasks=T seconds=S keys=.. side=..
    /// counts=N,N,.. total=N per_s=X`).
    pub fn parse(summary: &str) -> Result<Throughput, String> {
        if !summary.starts_with("ok ") {
            return Err(format!("not a summary: {summary:?}"));
        }
        Ok(Throughput {
            counts: crate::summary_list(summary, "counts")?,
            per_s: crate::summary_number(summary, "per_s")?,
        })
    }
}

/// Runs `load` through the `dlock-worker` binary at `worker` against `url` (a dlock URL, or
/// with `load.raw` a driver's: `postgres://`, `mysql://`, `redis://`), its keys named after
/// `prefix`; calls `during` once every worker has started (while they take locks), and
/// returns what the run measured with the worker's summary line.
pub fn run(
    worker: &str,
    url: &str,
    prefix: &str,
    load: Load,
    during: impl FnOnce(),
) -> Result<(Throughput, String), String> {
    let flags = [(load.hot, "--hot"), (load.raw, "--raw")];
    let extra: Vec<&str> = flags.iter().filter(|f| f.0).map(|f| f.1).collect();
    let summary = crate::run_worker(
        worker,
        ["throughput", url, prefix],
        [load.processes as u64, load.tasks as u64, load.seconds],
        &extra,
        during,
    )?;
    Ok((Throughput::parse(&summary)?, summary))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_summary_line() {
        let line = "ok processes=2 tasks=4 seconds=3 keys=hot side=raw counts=300,330 total=630 per_s=210.0";
        assert_eq!(
            Throughput::parse(line),
            Ok(Throughput {
                counts: vec![300, 330],
                per_s: 210.0,
            })
        );
        for bad in [
            "",
            "started",
            "ok counts=1,x per_s=1",
            "ok counts=1,2",
            "ok counts=-1 per_s=1",
            "ok counts=1 per_s=fast",
        ] {
            assert!(Throughput::parse(bad).is_err(), "{bad}");
        }
    }
}
