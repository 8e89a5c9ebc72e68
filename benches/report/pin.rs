//! Sections 1 and 7, and section 8's single-cycle comparisons, on one CPU.
//!
//! An uncontended cycle is two round trips to a server on loopback, about 20 µs. On a virtual
//! machine a wake-up that crosses to another CPU costs from 20 to over 100 µs, at random from
//! one batch to the next: unpinned, a raw PostgreSQL cycle measured anywhere from 20 to 148 µs
//! per batch in one process, and a ratio measured against it says more about the scheduler
//! than about the library. With the client, the runtime's threads and the servers on one CPU
//! every wake-up stays on that CPU, and both sides of a ratio are measured alike (a raw cycle
//! then varies by about 5 %). The pin covers this process and every process under it (the
//! servers, the peers' process), each with all its threads, and is undone when dropped.
//! `DLOCK_REPORT_PIN=0` leaves the scheduler alone.

use std::process::Command;

/// The CPU affinity of a process tree, pinned to CPU 0 until this is dropped.
pub struct OneCpu {
    /// Each process pinned, with the CPU list it had.
    saved: Vec<(u32, String)>,
}

impl OneCpu {
    /// Pins this process and its descendants to CPU 0; `None` when turned off, on a machine
    /// of one CPU, or when `taskset` is not there (then nothing is changed).
    pub fn pin() -> Option<OneCpu> {
        if std::env::var("DLOCK_REPORT_PIN").is_ok_and(|v| v == "0") {
            return None;
        }
        if std::thread::available_parallelism().map_or(1, usize::from) < 2 {
            return None;
        }
        let mut saved = Vec::new();
        for pid in tree(std::process::id()) {
            let Some(cpus) = cpu_list(pid) else {
                continue;
            };
            if set_cpu_list(pid, "0") {
                saved.push((pid, cpus));
            }
        }
        if saved.is_empty() {
            eprintln!("report: could not pin to one CPU (is `taskset` installed?)");
            return None;
        }
        eprintln!(
            "report: {} processes pinned to CPU 0 (DLOCK_REPORT_PIN=0 leaves them be)",
            saved.len()
        );
        Some(OneCpu { saved })
    }
}

impl Drop for OneCpu {
    fn drop(&mut self) {
        for (pid, cpus) in &self.saved {
            set_cpu_list(*pid, cpus);
        }
    }
}

/// `root` and every process under it, parents before children.
fn tree(root: u32) -> Vec<u32> {
    let parents: Vec<(u32, u32)> = std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let pid: u32 = entry.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(entry.path().join("stat")).ok()?;
            // `pid (comm) state ppid ...`; the name may hold spaces and parentheses.
            let after = &stat[stat.rfind(')')? + 1..];
            let ppid: u32 = after.split_whitespace().nth(1)?.parse().ok()?;
            Some((pid, ppid))
        })
        .collect();
    let mut found = vec![root];
    let mut next = 0;
    while next < found.len() {
        let parent = found[next];
        found.extend(
            parents
                .iter()
                .filter(|(_, ppid)| *ppid == parent)
                .map(|(pid, _)| *pid),
        );
        next += 1;
    }
    found
}

/// The CPU list of `pid` (`taskset -c -p`), such as `0,1` or `0-3`.
fn cpu_list(pid: u32) -> Option<String> {
    let out = Command::new("taskset")
        .args(["-c", "-p", &pid.to_string()])
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    // `pid 123's current affinity list: 0,1`
    let text = String::from_utf8(out.stdout).ok()?;
    Some(text.rsplit(':').next()?.trim().to_owned())
}

/// Sets the CPU list of every thread of `pid`.
fn set_cpu_list(pid: u32, cpus: &str) -> bool {
    Command::new("taskset")
        .args(["-a", "-c", "-p", cpus, &pid.to_string()])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|status| status.success())
}
