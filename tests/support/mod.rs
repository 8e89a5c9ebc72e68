//! What only this repository's tests do: run its `dlock-worker` binary (lock holders in other
//! processes, the multi-process exclusion checker), and capture what a test binary logs.
//! Everything else the tests share (the conformance suite, throwaway servers, keys, waits) is
//! in `dlock-testkit`.
//!
//! Each test binary that runs workers includes this module and uses part of it.
#![allow(dead_code)]

pub mod permits;
pub mod wire;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use dlock_testkit::Captured;

/// Everything any thread of this test binary logs at `level` and above (with span events
/// where `spans`), captured by a subscriber set once, globally: what renewal tasks and
/// blocking threads log is caught as well as the test thread's events. The first call of the
/// binary sets the level.
pub fn logs(level: tracing::Level, spans: bool) -> Captured {
    static LOGS: OnceLock<Captured> = OnceLock::new();
    LOGS.get_or_init(|| {
        let logs = Captured::default();
        let writer = logs.clone();
        let events = if spans {
            tracing_subscriber::fmt::format::FmtSpan::FULL
        } else {
            tracing_subscriber::fmt::format::FmtSpan::NONE
        };
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(level)
            .with_span_events(events)
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .finish();
        tracing::subscriber::set_global_default(subscriber).expect("the only subscriber");
        logs
    })
    .clone()
}

/// The path of the worker binary built with the tests.
pub fn worker_bin() -> &'static str {
    env!("CARGO_BIN_EXE_dlock-worker")
}

/// Whether the backend under test (as the URL configures it) issues fencing tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fencing {
    /// It does: every critical section must carry a token, and they must strictly increase.
    Every,
    /// It does not: no section may carry one.
    None,
}

/// Runs `processes` workers that each take `key` `iterations` times, then checks the log:
/// no two critical sections overlap, every worker finished, and fencing tokens (every section
/// carries one where `fencing` says the backend issues them) strictly increase in the order
/// the sections ran.
pub fn run_multi_process(
    url: &str,
    key: &str,
    processes: usize,
    iterations: usize,
    fencing: Fencing,
) {
    run_exclusion(url, key, processes, 1, 1, processes * iterations, fencing);
}

/// The exclusion checker (`dlock-worker exclusion`): `processes` worker processes of `tasks`
/// tasks each take `acquisitions` locks in all on `keys` hot keys under `prefix`; fails the
/// test on any overlap, failed worker, non-increasing fencing token, or a section without a
/// token (with [`Fencing::Every`]) or with one (with [`Fencing::None`]). Returns the checker's
/// summary line (`ok sections=... fenced=... per_second=...`).
pub fn run_exclusion(
    url: &str,
    prefix: &str,
    processes: usize,
    tasks: usize,
    keys: usize,
    acquisitions: usize,
    fencing: Fencing,
) -> String {
    run_mix(
        url,
        prefix,
        processes,
        tasks,
        keys,
        acquisitions,
        fencing,
        "exclusive",
    )
}

/// [`run_exclusion`] with sections that take what `mix` says (`exclusive`, `rw`,
/// `semaphore:N` or `many`; see the worker's docs for each one's invariants). No fault is
/// made meanwhile, so a release that finds its lock ran out fails the test too.
#[allow(clippy::too_many_arguments)]
pub fn run_mix(
    url: &str,
    prefix: &str,
    processes: usize,
    tasks: usize,
    keys: usize,
    acquisitions: usize,
    fencing: Fencing,
    mix: &str,
) -> String {
    let summary = checker(
        url,
        prefix,
        processes,
        tasks,
        keys,
        acquisitions,
        fencing,
        mix,
    );
    assert!(
        summary.split_whitespace().any(|part| part == "lost=0"),
        "a release found its lock run out on {url} (no fault was made): {summary}"
    );
    summary
}

/// [`run_exclusion`] through faults made meanwhile (a partition, a killed member): a
/// release may then find that its lock ran out after its section ended (the checker counts
/// those), while overlaps and token order are checked as always.
pub fn run_exclusion_through_faults(
    url: &str,
    prefix: &str,
    processes: usize,
    tasks: usize,
    keys: usize,
    acquisitions: usize,
    fencing: Fencing,
) -> String {
    checker(
        url,
        prefix,
        processes,
        tasks,
        keys,
        acquisitions,
        fencing,
        "exclusive",
    )
}

/// Runs the checker; fails the test on a failed run. Its summary line.
#[allow(clippy::too_many_arguments)]
fn checker(
    url: &str,
    prefix: &str,
    processes: usize,
    tasks: usize,
    keys: usize,
    acquisitions: usize,
    fencing: Fencing,
    mix: &str,
) -> String {
    let fencing = match fencing {
        Fencing::Every => "every",
        Fencing::None => "none",
    };
    let out = Command::new(worker_bin())
        .args(["exclusion", url, prefix])
        .args(["--processes", &processes.to_string()])
        .args(["--tasks", &tasks.to_string()])
        .args(["--keys", &keys.to_string()])
        .args(["--acquisitions", &acquisitions.to_string()])
        .args(["--fencing", fencing])
        .args(["--mix", mix])
        .stderr(Stdio::piped())
        .output()
        .expect("run the exclusion checker");
    assert!(
        out.status.success(),
        "exclusion check failed on {url}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let summary = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    eprintln!("{url}: {summary}");
    summary
}

/// A child process that holds `key` until killed.
pub struct Holder {
    child: Child,
    pub fencing_token: Option<u64>,
    /// Its later stdout lines (`lost UNIX_MS`), read by a thread.
    lines: std::sync::mpsc::Receiver<String>,
}

impl Holder {
    /// Starts a holder and waits until it reports that it holds the lock.
    pub fn start(url: &str, key: &str) -> Holder {
        Holder::start_as("hold", url, key)
    }

    /// Starts a holder of a read lock on `key`, as [`Holder::start`].
    pub fn start_read(url: &str, key: &str) -> Holder {
        Holder::start_as("hold-read", url, key)
    }

    /// Starts a holder of a permit of the semaphore `key` of `permits`, as [`Holder::start`].
    pub fn start_permit(url: &str, key: &str, permits: u32) -> Holder {
        Holder::start_with(&["hold-permit", url, key, &permits.to_string()])
    }

    fn start_as(mode: &str, url: &str, key: &str) -> Holder {
        Holder::start_with(&[mode, url, key])
    }

    fn start_with(args: &[&str]) -> Holder {
        let mut child = Command::new(worker_bin())
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn holder");
        let stdout = child.stdout.take().expect("holder stdout");
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let line = lines
            .recv_timeout(Duration::from_secs(30))
            .expect("the holder reports within 30 s");
        let token = line
            .trim()
            .strip_prefix("held ")
            .unwrap_or_else(|| panic!("holder said `{line}` instead of `held ...`"));
        Holder {
            fencing_token: token.parse().ok(),
            child,
            lines,
        }
    }

    /// SIGKILL, and wait for the process to be gone.
    pub fn kill(mut self) {
        self.child.kill().expect("kill holder");
        self.child.wait().expect("reap holder");
    }

    /// Sends `signal` (`"STOP"`, `"CONT"`, ...) to the holder.
    pub fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(self.child.id().to_string())
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -{signal} failed");
    }

    /// Waits up to `limit` for the holder to report its lock lost; the wall clock (Unix ms)
    /// at which its lost token fired.
    pub fn lost_within(&self, limit: Duration) -> Option<u128> {
        let line = self.lines.recv_timeout(limit).ok()?;
        line.strip_prefix("lost ")?.parse().ok()
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub use dlock_suite::fairness::Fairness;

/// Runs `processes` worker processes of `tasks` tasks each that all take `key` again and
/// again for `seconds` (holding it 1 ms each time), and returns how evenly they were served.
pub fn run_fairness(
    url: &str,
    key: &str,
    processes: usize,
    tasks: usize,
    seconds: u64,
) -> Fairness {
    match dlock_suite::fairness::run(worker_bin(), url, key, processes, tasks, seconds) {
        Ok((run, summary)) => {
            eprintln!("{url}: {summary}");
            run
        }
        Err(err) => panic!("fairness run failed on {url}: {err}"),
    }
}
