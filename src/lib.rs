//! The test suite's own library (not published): what its benches share. The tests' shared code
//! is in `dlock-testkit`.

pub mod fairness;
pub mod raw;
pub mod throughput;

/// Runs the `dlock-worker` binary at `worker` as `worker SUBCOMMAND URL KEY --processes P
/// --tasks T --seconds S` and the `extra` arguments; calls `during` when it prints `started`
/// (never, if it does not), and returns its summary line (`ok ...`).
fn run_worker(
    worker: &str,
    [subcommand, url, key]: [&str; 3],
    [processes, tasks, seconds]: [u64; 3],
    extra: &[&str],
    during: impl FnOnce(),
) -> Result<String, String> {
    use std::io::BufRead;
    let mut child = std::process::Command::new(worker)
        .args([subcommand, url, key])
        .args(["--processes", &processes.to_string()])
        .args(["--tasks", &tasks.to_string()])
        .args(["--seconds", &seconds.to_string()])
        .args(extra)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| format!("running dlock-worker: {e}"))?;
    let out = std::io::BufReader::new(child.stdout.take().ok_or("dlock-worker without stdout")?);
    let (mut during, mut summary) = (Some(during), None);
    for line in out.lines() {
        let line = line.map_err(|e| format!("reading dlock-worker: {e}"))?;
        if line == "started" {
            if let Some(during) = during.take() {
                during();
            }
        } else if line.starts_with("ok ") {
            summary = Some(line);
        }
    }
    let out = child
        .wait_with_output()
        .map_err(|e| format!("waiting for dlock-worker: {e}"))?;
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).trim().to_owned());
    }
    summary.ok_or_else(|| "dlock-worker printed no summary".to_owned())
}

/// The value of `name=value` in a worker's summary line (`ok name=value ...`).
fn summary_field<'a>(summary: &'a str, name: &str) -> Result<&'a str, String> {
    summary
        .split_whitespace()
        .find_map(|part| part.strip_prefix(name)?.strip_prefix('='))
        .ok_or_else(|| format!("no {name} in {summary:?}"))
}

/// The list `name=value,value,..` in a worker's summary line.
fn summary_list<T>(summary: &str, name: &str) -> Result<Vec<T>, String>
where
    T: std::str::FromStr,
    T::Err: std::fmt::Display,
{
    summary_field(summary, name)?
        .split(',')
        .map(|n| n.parse().map_err(|e| format!("{name}: {e}")))
        .collect()
}

/// The number `name=value` in a worker's summary line.
fn summary_number<T>(summary: &str, name: &str) -> Result<T, String>
where
    T: std::str::FromStr,
    T::Err: std::fmt::Display,
{
    summary_field(summary, name)?
        .parse()
        .map_err(|e| format!("{name}: {e}"))
}
