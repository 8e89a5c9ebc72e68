//! Test support shared by the integration tests: unique keys, child processes, and (per
//! backend) throwaway servers.
#![allow(dead_code, unreachable_pub)]

#[cfg(any(feature = "postgres", feature = "mysql", feature = "redis"))]
mod placement;
#[cfg(feature = "redis")]
pub mod redis;

#[cfg(any(feature = "postgres", feature = "mysql", feature = "redis"))]
pub use placement::Placement;

use std::io::{BufRead, BufReader};
use std::path::Path;
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

/// Runs `processes` workers that each take `key` `iterations` times, then checks the log:
/// no two critical sections overlap, every worker finished, and fencing tokens (where the
/// backend issues them) strictly increase in the order the sections ran.
pub fn run_multi_process(url: &str, key: &str, processes: usize, iterations: usize) {
    let dir = tempfile::tempdir().expect("temp dir");
    let log = dir.path().join("sections.log");
    let children: Vec<Child> = (0..processes)
        .map(|_| {
            Command::new(worker_bin())
                .args(["cycle", url, key, &iterations.to_string()])
                .arg(&log)
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .expect("spawn worker")
        })
        .collect();
    for child in children {
        let out = child.wait_with_output().expect("wait for worker");
        assert!(
            out.status.success(),
            "worker failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    check_sections(&log, processes * iterations);
}

/// Reads a sections log and fails on any overlap or non-increasing fencing token.
pub fn check_sections(log: &Path, expected_sections: usize) {
    let text = std::fs::read_to_string(log).expect("read sections log");
    let mut inside: Option<String> = None;
    let mut last_token: Option<u64> = None;
    let mut sections = 0;
    for (n, line) in text.lines().enumerate() {
        let parts: Vec<&str> = line.split(' ').collect();
        match parts.as_slice() {
            ["enter", pid, token] => {
                assert!(
                    inside.is_none(),
                    "line {}: process {pid} entered while {} was inside",
                    n + 1,
                    inside.as_deref().unwrap_or("?")
                );
                inside = Some((*pid).to_owned());
                if let Ok(token) = token.parse::<u64>() {
                    if let Some(last) = last_token {
                        assert!(
                            token > last,
                            "line {}: fencing token {token} after {last}",
                            n + 1
                        );
                    }
                    last_token = Some(token);
                }
            }
            ["exit", pid] => {
                assert_eq!(
                    inside.as_deref(),
                    Some(*pid),
                    "line {}: exit without enter",
                    n + 1
                );
                inside = None;
                sections += 1;
            }
            _ => panic!("line {}: malformed `{line}`", n + 1),
        }
    }
    assert!(inside.is_none(), "the log ends inside a critical section");
    assert_eq!(
        sections, expected_sections,
        "every worker section is in the log"
    );
}

/// A child process that holds `key` until killed.
pub struct Holder {
    child: Child,
    pub fencing_token: Option<u64>,
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
        let mut line = String::new();
        BufReader::new(stdout)
            .read_line(&mut line)
            .expect("read holder output");
        let token = line
            .trim()
            .strip_prefix("held ")
            .unwrap_or_else(|| panic!("holder said `{line}` instead of `held ...`"));
        Holder {
            child,
            fencing_token: token.parse().ok(),
        }
    }

    /// SIGKILL, and wait for the process to be gone.
    pub fn kill(mut self) {
        self.child.kill().expect("kill holder");
        self.child.wait().expect("reap holder");
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
