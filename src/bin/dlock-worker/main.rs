//! Child processes for the multi-process tests, and the exclusion checker.
//!
//! `dlock-worker exclusion URL PREFIX [--processes N] [--tasks M] [--keys K]
//! [--acquisitions A] [--fencing every|none] [--soak]` runs N worker processes of M tasks each
//! that together take A locks on K hot keys (`PREFIX:0` .. `PREFIX:K-1`; with one key, `PREFIX`
//! itself), then checks the sections log they wrote. It prints one `ok ...` summary line and
//! exits 0, or names the first violation and exits 1. `--soak` means 8 processes × 16 tasks ×
//! 8 keys and 1,000,000 acquisitions, for runs outside CI.
//!
//! `dlock-worker storm URL PREFIX KEYS TASKS ACQUISITIONS LOG` is one such worker process:
//! each critical section appends `enter KEY HOLDER TOKEN` and then `exit KEY HOLDER` to LOG,
//! opened in append mode, so every line lands whole and in the order the writes happened.
//! The checker reads that interleaving: per key, an `enter` while another holder is inside is
//! an overlap, and fencing tokens (where issued) must strictly increase. `--fencing every`
//! says the backend issues tokens: a section without one is a violation (otherwise tokens that
//! went missing would leave "strictly increasing" true of nothing). `--fencing none` says it
//! issues none: a section with one is a violation. Without the option, a log must be
//! consistent: every section fenced, or none.
//!
//! `dlock-worker verify LOG SECTIONS [--fencing every|none]` checks a log on its own (the
//! checker's own tests).
//!
//! `dlock-worker hold URL KEY` takes the lock, prints `held TOKEN` on stdout and sleeps until
//! it is killed; if the lock's lost token fires meanwhile, it prints `lost UNIX_MS` (the wall
//! clock when it fired).
//!
//! `dlock-worker take URL KEY TIMEOUT_MS` waits up to the timeout for the lock, then prints
//! `held TOKEN` (and releases it) or `timeout`, and exits 0; any other outcome exits 1.
//!
//! `dlock-worker tx-hold FILE KEY` (SQLite) opens the database file, begins a transaction,
//! takes `KEY` with a transaction-bound lock, prints `held TOKEN` and sleeps until it is
//! killed, with the transaction still open.
//!
//! `dlock-worker schedule --url URL ...` is one worker process of the schedule test
//! (`tests/schedule/`), driven over stdin and stdout; see the `schedule` module.

use std::collections::HashMap;
use std::io::Write;
use std::path::Path;
use std::process::{Command, ExitCode, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

mod schedule;

/// How long one acquisition may wait before the worker gives up (and fails the run).
const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(120);
/// How long a critical section lasts, yielding all the while, so that a second holder (if
/// exclusion were broken) has every chance to write its `enter` in between.
const SECTION: Duration = Duration::from_micros(100);

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let outcome = match args.as_slice() {
        ["exclusion", url, prefix, rest @ ..] => exclusion(url, prefix, rest),
        ["storm", url, prefix, keys, tasks, acquisitions, log] => {
            runtime().and_then(|rt| rt.block_on(storm(url, prefix, keys, tasks, acquisitions, log)))
        }
        ["hold", url, key] => runtime().and_then(|rt| rt.block_on(hold(url, key, false))),
        ["hold-read", url, key] => runtime().and_then(|rt| rt.block_on(hold(url, key, true))),
        ["take", url, key, timeout_ms] => timeout_ms
            .parse()
            .map_err(|e| format!("timeout: {e}"))
            .and_then(|ms| runtime().and_then(|rt| rt.block_on(take(url, key, ms)))),
        #[cfg(feature = "sqlite")]
        ["tx-hold", file, key] => tx_hold(file, key),
        ["schedule", rest @ ..] => schedule::run(rest),
        ["verify", log, expected, rest @ ..] => expected
            .parse()
            .map_err(|e| format!("expected: {e}"))
            .and_then(|expected| Ok((expected, Fencing::parse_option(rest)?)))
            .and_then(|(expected, fencing)| check(Path::new(log), expected, fencing))
            .map(|summary| println!("ok sections={} fenced={}", summary.sections, summary.fenced)),
        _ => Err(
            "usage: dlock-worker exclusion URL PREFIX [--processes N] [--tasks M] \
                  [--keys K] [--acquisitions A] [--fencing every|none] [--soak] \
                  | storm URL PREFIX KEYS TASKS ACQUISITIONS LOG \
                  | verify LOG SECTIONS [--fencing every|none] | hold URL KEY | hold-read URL KEY \
                  | take URL KEY TIMEOUT_MS | tx-hold FILE KEY \
                  | schedule --url URL [--runtimes N] [--provider GROUP:RUNTIME]... [--sqlite-file PATH]"
                .to_owned(),
        ),
    };
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("dlock-worker: {message}");
            ExitCode::FAILURE
        }
    }
}

fn runtime() -> Result<tokio::runtime::Runtime, String> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| format!("runtime: {e}"))
}

/// What the checker requires of the sections' fencing tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fencing {
    /// The backend issues tokens: every section carries one (`--fencing every`).
    Every,
    /// The backend issues none: no section carries one (`--fencing none`).
    None,
    /// Not said: every section carries one, or none does.
    Consistent,
}

impl Fencing {
    fn parse(value: &str) -> Result<Fencing, String> {
        match value {
            "every" => Ok(Fencing::Every),
            "none" => Ok(Fencing::None),
            other => Err(format!("--fencing takes `every` or `none`, not `{other}`")),
        }
    }

    /// `[]` or `["--fencing", VALUE]`, as `verify` takes it.
    fn parse_option(rest: &[&str]) -> Result<Fencing, String> {
        match rest {
            [] => Ok(Fencing::Consistent),
            ["--fencing", value] => Fencing::parse(value),
            other => Err(format!("unexpected arguments {other:?}")),
        }
    }
}

/// The settings of one exclusion run.
struct Run {
    processes: usize,
    tasks: usize,
    keys: usize,
    acquisitions: usize,
    fencing: Fencing,
}

impl Run {
    fn parse(rest: &[&str]) -> Result<Run, String> {
        let mut run = Run {
            processes: 4,
            tasks: 8,
            keys: 4,
            acquisitions: 20_000,
            fencing: Fencing::Consistent,
        };
        let mut rest = rest.iter();
        while let Some(flag) = rest.next() {
            if *flag == "--soak" {
                run = Run {
                    processes: 8,
                    tasks: 16,
                    keys: 8,
                    acquisitions: 1_000_000,
                    fencing: run.fencing,
                };
                continue;
            }
            let value = rest.next().ok_or_else(|| format!("{flag} needs a value"))?;
            if *flag == "--fencing" {
                run.fencing = Fencing::parse(value)?;
                continue;
            }
            let value = value.parse::<usize>().map_err(|e| format!("{flag}: {e}"))?;
            if value == 0 {
                return Err(format!("{flag} must be at least 1"));
            }
            match *flag {
                "--processes" => run.processes = value,
                "--tasks" => run.tasks = value,
                "--keys" => run.keys = value,
                "--acquisitions" => run.acquisitions = value,
                _ => return Err(format!("unknown option {flag}")),
            }
        }
        Ok(run)
    }
}

/// Spawns the workers, waits for them and checks their log.
fn exclusion(url: &str, prefix: &str, rest: &[&str]) -> Result<(), String> {
    let run = Run::parse(rest)?;
    let dir = std::env::temp_dir().join(format!("dlock-exclusion-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let log = dir.join("sections.log");
    let _ = std::fs::remove_file(&log);
    let me = std::env::current_exe().map_err(|e| format!("own path: {e}"))?;
    let started = Instant::now();
    let children = (0..run.processes)
        .map(|i| {
            let share = run.acquisitions / run.processes
                + usize::from(i < run.acquisitions % run.processes);
            Command::new(&me)
                .arg("storm")
                .args([url, prefix])
                .args([run.keys, run.tasks, share].map(|n| n.to_string()))
                .arg(&log)
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .map_err(|e| format!("spawning a worker: {e}"))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mut failures = Vec::new();
    for child in children {
        let out = child
            .wait_with_output()
            .map_err(|e| format!("waiting for a worker: {e}"))?;
        if !out.status.success() {
            failures.push(String::from_utf8_lossy(&out.stderr).trim().to_owned());
        }
    }
    let elapsed = started.elapsed();
    let verdict = check(&log, run.acquisitions, run.fencing);
    let _ = std::fs::remove_dir_all(&dir);
    if !failures.is_empty() {
        return Err(format!("workers failed: {}", failures.join("; ")));
    }
    let summary = verdict?;
    println!(
        "ok sections={} keys={} processes={} tasks={} fenced={} seconds={:.2} per_second={:.0}",
        summary.sections,
        run.keys,
        run.processes,
        run.tasks,
        summary.fenced,
        elapsed.as_secs_f64(),
        summary.sections as f64 / elapsed.as_secs_f64().max(1e-9),
    );
    Ok(())
}

/// What a clean log held.
struct Summary {
    sections: usize,
    /// Sections that carried a fencing token.
    fenced: usize,
}

/// Per key: who is inside, and the last fencing token seen.
#[derive(Default)]
struct KeyState {
    inside: Option<String>,
    last_token: Option<u64>,
}

/// Reads a sections log and reports the first overlap, non-increasing, missing or unexpected
/// fencing token, unmatched exit or missing section.
fn check(log: &Path, expected: usize, fencing: Fencing) -> Result<Summary, String> {
    let text = std::fs::read_to_string(log).map_err(|e| format!("{}: {e}", log.display()))?;
    let mut keys: HashMap<&str, KeyState> = HashMap::new();
    let mut summary = Summary {
        sections: 0,
        fenced: 0,
    };
    for (n, line) in text.lines().enumerate() {
        let n = n + 1;
        match line.split(' ').collect::<Vec<_>>().as_slice() {
            ["enter", key, holder, token] => {
                let state = keys.entry(key).or_default();
                if let Some(other) = &state.inside {
                    return Err(format!(
                        "line {n}: {holder} entered {key} while {other} was inside"
                    ));
                }
                state.inside = Some((*holder).to_owned());
                let token = match *token {
                    "-" => None,
                    text => Some(
                        text.parse::<u64>()
                            .map_err(|_| format!("line {n}: malformed `{line}`"))?,
                    ),
                };
                match (token, fencing) {
                    (None, Fencing::Every) => {
                        return Err(format!(
                            "line {n}: {holder} entered {key} without a fencing token, but the \
                             backend issues them"
                        ));
                    }
                    (Some(token), Fencing::None) => {
                        return Err(format!(
                            "line {n}: {holder} entered {key} with fencing token {token}, but \
                             the backend issues none"
                        ));
                    }
                    _ => {}
                }
                if let Some(token) = token {
                    if let Some(last) = state.last_token.filter(|last| token <= *last) {
                        return Err(format!(
                            "line {n}: fencing token {token} on {key} after {last}"
                        ));
                    }
                    state.last_token = Some(token);
                    summary.fenced += 1;
                }
            }
            ["exit", key, holder] => {
                let state = keys.entry(key).or_default();
                if state.inside.as_deref() != Some(*holder) {
                    return Err(format!("line {n}: {holder} left {key} without entering"));
                }
                state.inside = None;
                summary.sections += 1;
            }
            _ => return Err(format!("line {n}: malformed `{line}`")),
        }
    }
    if let Some((key, state)) = keys.iter().find(|(_, s)| s.inside.is_some()) {
        return Err(format!(
            "the log ends with {} inside {key}",
            state.inside.as_deref().unwrap_or("?")
        ));
    }
    if summary.sections != expected {
        return Err(format!(
            "{} sections in the log, {expected} expected",
            summary.sections
        ));
    }
    if summary.fenced != 0 && summary.fenced != summary.sections {
        return Err(format!(
            "{} of {} sections carried a fencing token: a backend issues one with every \
             acquisition or with none",
            summary.fenced, summary.sections
        ));
    }
    Ok(summary)
}

/// One worker process: `tasks` tasks share one provider and take `acquisitions` locks in all.
async fn storm(
    url: &str,
    prefix: &str,
    keys: &str,
    tasks: &str,
    acquisitions: &str,
    log: &str,
) -> Result<(), String> {
    let parse = |what: &str, value: &str| {
        value
            .parse::<usize>()
            .map_err(|e| format!("{what}: {e}"))
            .and_then(|n| {
                if n == 0 {
                    Err(format!("{what} must be at least 1"))
                } else {
                    Ok(n)
                }
            })
    };
    let (keys, tasks, acquisitions) = (
        parse("keys", keys)?,
        parse("tasks", tasks)?,
        parse("acquisitions", acquisitions)?,
    );
    let names: Arc<Vec<String>> = Arc::new(if keys == 1 {
        vec![prefix.to_owned()]
    } else {
        (0..keys).map(|k| format!("{prefix}:{k}")).collect()
    });
    let locks = dlock::LockProvider::connect(url)
        .await
        .map_err(|e| e.to_string())?;
    let file = Arc::new(
        std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .open(log)
            .map_err(|e| format!("{log}: {e}"))?,
    );
    let pid = std::process::id();
    let mut set = tokio::task::JoinSet::new();
    for task in 0..tasks {
        let share = acquisitions / tasks + usize::from(task < acquisitions % tasks);
        let (locks, names, file) = (locks.clone(), Arc::clone(&names), Arc::clone(&file));
        set.spawn(async move {
            let holder = format!("{pid}.{task}");
            for _ in 0..share {
                let key = &names[fastrand::usize(..names.len())];
                let guard = locks
                    .acquire(key, ACQUIRE_TIMEOUT)
                    .await
                    .map_err(|e| format!("{holder} acquiring {key}: {e}"))?;
                let token = guard
                    .fencing_token()
                    .map_or_else(|| "-".to_owned(), |t| t.to_string());
                (&*file)
                    .write_all(format!("enter {key} {holder} {token}\n").as_bytes())
                    .map_err(|e| e.to_string())?;
                let until = Instant::now() + SECTION;
                while Instant::now() < until {
                    tokio::task::yield_now().await;
                }
                (&*file)
                    .write_all(format!("exit {key} {holder}\n").as_bytes())
                    .map_err(|e| e.to_string())?;
                guard
                    .release()
                    .await
                    .map_err(|e| format!("{holder} releasing {key}: {e}"))?;
            }
            Ok::<(), String>(())
        });
    }
    while let Some(done) = set.join_next().await {
        done.map_err(|e| format!("a task failed: {e}"))??;
    }
    Ok(())
}

/// Holds `key` (a read lock when `read`) until killed, saying `held TOKEN`, then `lost UNIX_MS`
/// if the lock is lost.
async fn hold(url: &str, key: &str, read: bool) -> Result<(), String> {
    let locks = dlock::LockProvider::connect(url)
        .await
        .map_err(|e| e.to_string())?;
    let guard = if read {
        locks.acquire_read(key, ACQUIRE_TIMEOUT).await
    } else {
        locks.acquire(key, ACQUIRE_TIMEOUT).await
    }
    .map_err(|e| e.to_string())?;
    println!(
        "held {}",
        guard
            .fencing_token()
            .map_or_else(|| "-".to_owned(), |t| t.to_string())
    );
    std::io::stdout().flush().map_err(|e| e.to_string())?;
    guard.lost_token().cancelled().await;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
    println!("lost {now}");
    std::io::stdout().flush().map_err(|e| e.to_string())?;
    std::future::pending::<()>().await;
    drop(guard);
    Ok(())
}

async fn take(url: &str, key: &str, timeout_ms: u64) -> Result<(), String> {
    let locks = dlock::LockProvider::connect(url)
        .await
        .map_err(|e| e.to_string())?;
    match locks.acquire(key, Duration::from_millis(timeout_ms)).await {
        Ok(guard) => {
            println!(
                "held {}",
                guard
                    .fencing_token()
                    .map_or_else(|| "-".to_owned(), |t| t.to_string())
            );
            guard.release().await.map_err(|e| e.to_string())
        }
        Err(dlock::LockError::Timeout { .. }) => {
            println!("timeout");
            Ok(())
        }
        Err(err) => Err(err.to_string()),
    }
}

#[cfg(feature = "sqlite")]
fn tx_hold(file: &str, key: &str) -> Result<(), String> {
    let mut conn = rusqlite::Connection::open(file).map_err(|e| e.to_string())?;
    let tx = conn
        .transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)
        .map_err(|e| e.to_string())?;
    let lock = dlock::sqlite::try_acquire_in_transaction(&tx, key).map_err(|e| e.to_string())?;
    // SQLite issues a token for every transaction lock.
    let token = lock
        .fencing_token()
        .ok_or("a SQLite transaction lock without a token")?;
    println!("held {token}");
    std::io::stdout().flush().map_err(|e| e.to_string())?;
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}
