//! Test support shared by the integration tests: unique keys, child processes, and (per
//! backend) throwaway servers.
#![allow(dead_code, unreachable_pub)]

#[cfg(any(feature = "postgres", feature = "mysql", feature = "redis"))]
mod placement;
#[cfg(feature = "redis")]
pub mod redis;
#[cfg(any(feature = "postgres", feature = "mysql", feature = "redis"))]
pub mod tls;

#[cfg(any(feature = "postgres", feature = "mysql", feature = "redis"))]
pub use placement::Placement;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// A key no other test (or earlier run against the same server) uses.
pub fn unique_key(name: &str) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    format!(
        "{name}:{}:{}:{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed),
        fastrand_u64()
    )
}

fn fastrand_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(0);
    h.finish()
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
        let mut child = Command::new(worker_bin())
            .args(["hold", url, key])
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

/// Every panic raised so far in this test binary outside the test suite's own files (in dlock,
/// or in a dependency dlock called), as `file:line: message`. The first call installs a panic
/// hook that records them before it runs the hook that was there. A panic in a task dlock
/// spawns (a background release, a connection task) never reaches a test's `JoinHandle`; this
/// is how a test sees it. Tests run in parallel threads of one binary, so a count taken around
/// a test also sees panics of the library in other tests of the same binary: each one is a
/// defect all the same.
pub fn foreign_panics() -> Vec<String> {
    use std::sync::{Mutex, OnceLock};
    static PANICS: OnceLock<Mutex<Vec<String>>> = OnceLock::new();
    let panics = PANICS.get_or_init(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let (file, line) = info.location().map_or(("?", 0), |l| (l.file(), l.line()));
            if !file.starts_with("tests/") {
                let message = info
                    .payload()
                    .downcast_ref::<&str>()
                    .map(|s| (*s).to_owned())
                    .or_else(|| info.payload().downcast_ref::<String>().cloned())
                    .unwrap_or_default();
                if let Some(panics) = PANICS.get() {
                    panics
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .push(format!("{file}:{line}: {message}"));
                }
            }
            previous(info);
        }));
        Mutex::new(Vec::new())
    });
    panics
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone()
}

/// Polls `condition` (an async closure, so it may ask a server) every few milliseconds until
/// it holds, and fails the test, naming `what`, if it does not hold within `limit`: for
/// waiting on something that can be observed (a wait has reached the server, a renewal has
/// happened) instead of sleeping and hoping it has.
pub async fn wait_until(what: &str, limit: Duration, mut condition: impl AsyncFnMut() -> bool) {
    let started = std::time::Instant::now();
    loop {
        if condition().await {
            return;
        }
        assert!(
            started.elapsed() < limit,
            "timed out after {limit:?} waiting until {what}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A multi-thread Tokio runtime of `workers` threads, for tests that make and drop runtimes of
/// their own.
pub fn runtime(workers: usize) -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .enable_all()
        .build()
        .expect("a Tokio runtime")
}

/// Waits for `condition` to hold, checking every few milliseconds, for at most `limit`.
pub async fn eventually(limit: Duration, mut condition: impl FnMut() -> bool) -> bool {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        if condition() {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[cfg(feature = "mysql")]
pub mod mysql;
#[cfg(feature = "postgres")]
pub mod postgres;
