//! Child processes for the multi-process tests, and the exclusion checker.
//!
//! `dlock-worker exclusion URL PREFIX [--processes N] [--tasks M] [--keys K]
//! [--acquisitions A] [--fencing every|none] [--mix MIX] [--soak]` runs N worker processes of M tasks each
//! that together take A locks on K hot keys (`PREFIX:0` .. `PREFIX:K-1`; with one key, `PREFIX`
//! itself), then checks the sections log they wrote. It prints one `ok ...` summary line and
//! exits 0, or names the first violation and exits 1. `--soak` means 8 processes × 16 tasks ×
//! 8 keys and 1,000,000 acquisitions, for runs outside CI.
//!
//! `dlock-worker storm URL PREFIX KEYS TASKS ACQUISITIONS LOG [MIX]` is one such worker process:
//! each critical section appends `enter KEY HOLDER TOKEN` and then `exit KEY HOLDER` to LOG,
//! opened in append mode, so every line lands whole and in the order the writes happened.
//! The checker reads that interleaving: per key, an `enter` while another holder is inside is
//! an overlap, and fencing tokens (where issued) must strictly increase. A release that answers
//! that the lock had run out comes after the exit line; it appends `lost KEY HOLDER`, which the
//! checker counts (`lost=N` in its summary) and which fails no check of its own: the tests
//! refuse it outside runs through faults (a partition may let a lease run out while a release
//! is stuck).
//!
//! MIX (`--mix`) picks what the sections take, each with its own invariant:
//! - `exclusive` (the default): one lock per section, as above;
//! - `rw`: three sections in four are read locks (`read KEY HOLDER TOKEN` .. `unread KEY
//!   HOLDER`), the rest exclusive: no writer overlaps any other holder, readers do share (a run
//!   in which readers never overlapped fails, as it proves nothing), a writer's token exceeds
//!   every token seen before on its key, and a reader's exceeds the last writer's;
//! - `semaphore:N`: each section holds one of the N slots of a semaphore (`slot KEY SLOT
//!   HOLDER TOKEN` .. `unslot KEY SLOT HOLDER`): at most N holders per key, one per slot, and
//!   tokens strictly increasing per slot;
//! - `many`: each section holds two distinct keys at once through `acquire_many` (`enter-set
//!   HOLDER KEY TOKEN KEY TOKEN` .. `exit-set HOLDER KEY KEY`): no key of a set overlaps any
//!   other holder of it, and tokens increase per key. (Needs at least 2 keys.)
//!
//! `--fencing every` says the backend issues tokens: a section without one is a violation (otherwise tokens that
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
//! `dlock-worker hold-permit URL KEY MAX_COUNT` (a Redis URL) takes one of the `MAX_COUNT`
//! permits of the semaphore `KEY` straight from the backend's permit store, waiting for one,
//! and then behaves as `hold`.
//!
//! `dlock-worker take URL KEY TIMEOUT_MS` waits up to the timeout for the lock, then prints
//! `held TOKEN` (and releases it) or `timeout`, and exits 0; any other outcome exits 1.
//!
//! `dlock-worker tx-hold FILE KEY` (SQLite) opens the database file, begins a transaction,
//! takes `KEY` with a transaction-bound lock, prints `held TOKEN` and sleeps until it is
//! killed, with the transaction still open.
//!
//! `dlock-worker fairness URL KEY ...` measures how evenly processes contending for one key are
//! served; see the `fairness` module.
//!
//! `dlock-worker throughput URL PREFIX ...` measures the acquisitions per second of processes
//! taking distinct keys or one hot key, through dlock or the raw driver; see the `throughput`
//! module.
//!
//! `dlock-worker schedule --url URL ...` is one worker process of the schedule test
//! (`tests/schedule/`), driven over stdin and stdout; see the `schedule` module.

use std::collections::HashMap;
use std::io::Write;
use std::path::Path;
use std::process::{Command, ExitCode, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

mod fairness;
mod group;
mod schedule;
mod throughput;

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
        ["storm", url, prefix, keys, tasks, acquisitions, log, mix @ ..] => {
            let mix = match mix {
                [] => Ok(Mix::Exclusive),
                [mix] => Mix::parse(mix),
                _ => Err("storm takes one MIX at most".to_owned()),
            };
            mix.and_then(|mix| {
                runtime().and_then(|rt| {
                    rt.block_on(storm(url, prefix, keys, tasks, acquisitions, log, mix))
                })
            })
        }
        ["fairness", url, key, rest @ ..] => fairness::run(url, key, rest),
        ["fair", url, key, tasks, seconds, hold_us] => runtime().and_then(|rt| {
            rt.block_on(fairness::worker(url, key, tasks, seconds, hold_us))
        }),
        ["throughput", url, prefix, rest @ ..] => throughput::run(url, prefix, rest),
        ["tput", url, prefix, index, tasks, seconds, mode] => runtime().and_then(|rt| {
            rt.block_on(throughput::worker(
                url, prefix, index, tasks, seconds, mode,
            ))
        }),
        ["hold", url, key] => runtime().and_then(|rt| rt.block_on(hold(url, key, false))),
        ["hold-read", url, key] => runtime().and_then(|rt| rt.block_on(hold(url, key, true))),
        #[cfg(feature = "redis")]
        ["hold-permit", url, key, max_count] => max_count
            .parse()
            .map_err(|e| format!("max_count: {e}"))
            .and_then(|max| runtime().and_then(|rt| rt.block_on(hold_permit(url, key, max)))),
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
                  [--keys K] [--acquisitions A] [--fencing every|none] \
                  [--mix exclusive|rw|semaphore:N|many] [--soak] \
                  | storm URL PREFIX KEYS TASKS ACQUISITIONS LOG [MIX] \
                  | fairness URL KEY [--processes P] [--tasks T] [--seconds S] [--hold-us H] \
                  | throughput URL PREFIX [--processes P] [--tasks T] [--seconds S] [--hot] [--raw] \
                  | verify LOG SECTIONS [--fencing every|none] | hold URL KEY | hold-read URL KEY \
                  | hold-permit URL KEY MAX_COUNT | take URL KEY TIMEOUT_MS | tx-hold FILE KEY \
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

/// What the sections of a run take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mix {
    /// One exclusive lock each.
    Exclusive,
    /// Read locks mostly, exclusive locks otherwise.
    ReadWrite,
    /// A slot of a semaphore of this many.
    Semaphore(u32),
    /// Two keys at once, all or none.
    Many,
}

impl Mix {
    fn parse(value: &str) -> Result<Mix, String> {
        match value {
            "exclusive" => Ok(Mix::Exclusive),
            "rw" => Ok(Mix::ReadWrite),
            "many" => Ok(Mix::Many),
            other => match other.strip_prefix("semaphore:").map(str::parse::<u32>) {
                Some(Ok(n)) if n > 0 => Ok(Mix::Semaphore(n)),
                _ => Err(format!(
                    "--mix takes exclusive, rw, semaphore:N (N at least 1) or many, not `{other}`"
                )),
            },
        }
    }

    fn arg(self) -> String {
        match self {
            Mix::Exclusive => "exclusive".to_owned(),
            Mix::ReadWrite => "rw".to_owned(),
            Mix::Semaphore(n) => format!("semaphore:{n}"),
            Mix::Many => "many".to_owned(),
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
    mix: Mix,
}

impl Run {
    fn parse(rest: &[&str]) -> Result<Run, String> {
        let mut run = Run {
            processes: 4,
            tasks: 8,
            keys: 4,
            acquisitions: 20_000,
            fencing: Fencing::Consistent,
            mix: Mix::Exclusive,
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
                    mix: run.mix,
                };
                continue;
            }
            let value = rest.next().ok_or_else(|| format!("{flag} needs a value"))?;
            if *flag == "--fencing" {
                run.fencing = Fencing::parse(value)?;
                continue;
            }
            if *flag == "--mix" {
                run.mix = Mix::parse(value)?;
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
        if run.mix == Mix::Many && run.keys < 2 {
            return Err("--mix many needs --keys 2 or more".to_owned());
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
                .arg(run.mix.arg())
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
    if run.mix == Mix::ReadWrite && summary.most_shared < 2 {
        return Err(format!(
            "readers never shared a key in {} sections: the run shows nothing of read locks",
            summary.sections
        ));
    }
    println!(
        "ok sections={} keys={} processes={} tasks={} fenced={} shared={} lost={} mix={} seconds={:.2} per_second={:.0}",
        summary.sections,
        run.keys,
        run.processes,
        run.tasks,
        summary.fenced,
        summary.most_shared,
        summary.lost,
        run.mix.arg(),
        elapsed.as_secs_f64(),
        summary.sections as f64 / elapsed.as_secs_f64().max(1e-9),
    );
    Ok(())
}

/// What a clean log held.
struct Summary {
    sections: usize,
    /// Releases that answered that the lock had run out (after the section ended).
    lost: usize,
    /// Sections that carried a fencing token.
    fenced: usize,
    /// The most holders one key had at once (readers, or a semaphore's slot holders).
    most_shared: usize,
}

/// Per key (or semaphore slot): who is inside, and the tokens seen.
#[derive(Default)]
struct KeyState {
    /// The exclusive holder.
    inside: Option<String>,
    /// Readers, or a semaphore's slot holders.
    sharing: std::collections::HashSet<String>,
    /// A semaphore's size, once a slot of it was seen.
    permits: Option<u32>,
    /// The last exclusive holder's token.
    last_token: Option<u64>,
    /// The highest token seen on the key, readers' included.
    highest: Option<u64>,
}

/// Reads a sections log and reports the first overlap, non-increasing, missing or unexpected
/// fencing token, unmatched exit or missing section (the line kinds are in the module docs).
fn check(log: &Path, expected: usize, fencing: Fencing) -> Result<Summary, String> {
    let text = std::fs::read_to_string(log).map_err(|e| format!("{}: {e}", log.display()))?;
    let mut keys: HashMap<String, KeyState> = HashMap::new();
    let mut summary = Summary {
        sections: 0,
        lost: 0,
        fenced: 0,
        most_shared: 0,
    };
    for (n, line) in text.lines().enumerate() {
        let n = n + 1;
        let words: Vec<&str> = line.split(' ').collect();
        let malformed = || format!("line {n}: malformed `{line}`");
        let token = |text: &str| match text {
            "-" => Ok(None),
            text => text.parse::<u64>().map(Some).map_err(|_| malformed()),
        };
        // Every kind of entry carries one token per key it takes; check their presence once.
        let fenced = |holder: &str, key: &str, token: Option<u64>| match (token, fencing) {
            (None, Fencing::Every) => Err(format!(
                "line {n}: {holder} entered {key} without a fencing token, but the backend \
                 issues them"
            )),
            (Some(token), Fencing::None) => Err(format!(
                "line {n}: {holder} entered {key} with fencing token {token}, but the backend \
                 issues none"
            )),
            _ => Ok(()),
        };
        match words.as_slice() {
            ["lost", _key, _holder] => summary.lost += 1,
            ["enter", key, holder, t] => {
                let t = token(t)?;
                fenced(holder, key, t)?;
                enter(&mut keys, n, key, holder, t)?;
                summary.fenced += usize::from(t.is_some());
            }
            ["exit", key, holder] => {
                exit(&mut keys, n, key, holder)?;
                summary.sections += 1;
            }
            ["enter-set", holder, rest @ ..] if !rest.is_empty() && rest.len() % 2 == 0 => {
                let mut all = true;
                for pair in rest.chunks(2) {
                    let t = token(pair[1])?;
                    fenced(holder, pair[0], t)?;
                    enter(&mut keys, n, pair[0], holder, t)?;
                    all &= t.is_some();
                }
                summary.fenced += usize::from(all);
            }
            ["exit-set", holder, rest @ ..] if !rest.is_empty() => {
                for key in rest {
                    exit(&mut keys, n, key, holder)?;
                }
                summary.sections += 1;
            }
            ["read", key, holder, t] => {
                let t = token(t)?;
                fenced(holder, key, t)?;
                let state = keys.entry((*key).to_owned()).or_default();
                if let Some(writer) = &state.inside {
                    return Err(format!(
                        "line {n}: reader {holder} entered {key} while writer {writer} was inside"
                    ));
                }
                if let (Some(t), Some(last)) = (t, state.last_token)
                    && t <= last
                {
                    return Err(format!(
                        "line {n}: reader's fencing token {t} on {key} after writer's {last}"
                    ));
                }
                if let Some(t) = t {
                    state.highest = Some(state.highest.map_or(t, |h| h.max(t)));
                }
                if !state.sharing.insert((*holder).to_owned()) {
                    return Err(format!("line {n}: {holder} read {key} twice at once"));
                }
                summary.most_shared = summary.most_shared.max(state.sharing.len());
                summary.fenced += usize::from(t.is_some());
            }
            ["unread", key, holder] => {
                let state = keys.entry((*key).to_owned()).or_default();
                if !state.sharing.remove(*holder) {
                    return Err(format!(
                        "line {n}: {holder} stopped reading {key} without reading it"
                    ));
                }
                summary.sections += 1;
            }
            ["slot", key, slot, holder, t, permits] => {
                let t = token(t)?;
                fenced(holder, key, t)?;
                let permits = permits.parse::<u32>().map_err(|_| malformed())?;
                let state = keys.entry(format!("semaphore {key}")).or_default();
                if state.permits.is_some_and(|p| p != permits) {
                    return Err(format!("line {n}: semaphore {key} used with two sizes"));
                }
                state.permits = Some(permits);
                state.sharing.insert((*holder).to_owned());
                if state.sharing.len() > permits as usize {
                    return Err(format!(
                        "line {n}: {holder} made {} holders of semaphore {key}, of at most {permits}",
                        state.sharing.len()
                    ));
                }
                summary.most_shared = summary.most_shared.max(state.sharing.len());
                // Each slot is a lock of its own: exclusive, with increasing tokens.
                enter(&mut keys, n, &format!("slot {slot}"), holder, t)?;
                summary.fenced += usize::from(t.is_some());
            }
            ["unslot", key, slot, holder] => {
                let state = keys.entry(format!("semaphore {key}")).or_default();
                if !state.sharing.remove(*holder) {
                    return Err(format!(
                        "line {n}: {holder} left semaphore {key} without entering"
                    ));
                }
                exit(&mut keys, n, &format!("slot {slot}"), holder)?;
                summary.sections += 1;
            }
            _ => return Err(malformed()),
        }
    }
    for (key, state) in &keys {
        if let Some(holder) = state.inside.as_deref().or(state
            .sharing
            .iter()
            .next()
            .map(String::as_str))
        {
            return Err(format!("the log ends with {holder} inside {key}"));
        }
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

/// An exclusive holder enters `key`: nobody may be inside, readers included, and its token
/// must exceed every token seen on the key.
fn enter(
    keys: &mut HashMap<String, KeyState>,
    n: usize,
    key: &str,
    holder: &str,
    token: Option<u64>,
) -> Result<(), String> {
    let state = keys.entry(key.to_owned()).or_default();
    if let Some(other) = &state.inside {
        return Err(format!(
            "line {n}: {holder} entered {key} while {other} was inside"
        ));
    }
    if let Some(reader) = state.sharing.iter().next() {
        return Err(format!(
            "line {n}: writer {holder} entered {key} while reader {reader} was inside"
        ));
    }
    state.inside = Some(holder.to_owned());
    if let Some(token) = token {
        if let Some(last) = state.highest.filter(|last| token <= *last) {
            return Err(format!(
                "line {n}: fencing token {token} on {key} after {last}"
            ));
        }
        state.last_token = Some(token);
        state.highest = Some(token);
    }
    Ok(())
}

fn exit(
    keys: &mut HashMap<String, KeyState>,
    n: usize,
    key: &str,
    holder: &str,
) -> Result<(), String> {
    let state = keys.entry(key.to_owned()).or_default();
    if state.inside.as_deref() != Some(holder) {
        return Err(format!("line {n}: {holder} left {key} without entering"));
    }
    state.inside = None;
    Ok(())
}

/// One worker process: `tasks` tasks share one provider and take `acquisitions` locks in all.
async fn storm(
    url: &str,
    prefix: &str,
    keys: &str,
    tasks: &str,
    acquisitions: &str,
    log: &str,
    mix: Mix,
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
            let write = |line: String| {
                (&*file)
                    .write_all(line.as_bytes())
                    .map_err(|e| e.to_string())
            };
            let token_of = |guard: &dlock::LockGuard| {
                guard
                    .fencing_token()
                    .map_or_else(|| "-".to_owned(), |t| t.to_string())
            };
            for _ in 0..share {
                let key = &names[fastrand::usize(..names.len())];
                let failed = |e: dlock::LockError| format!("{holder} acquiring {key}: {e}");
                let released = |e: dlock::LockError| format!("{holder} releasing {key}: {e}");
                match mix {
                    Mix::Exclusive => {
                        let guard = locks.acquire(key, ACQUIRE_TIMEOUT).await.map_err(failed)?;
                        write(format!("enter {key} {holder} {}\n", token_of(&guard)))?;
                        section().await;
                        write(format!("exit {key} {holder}\n"))?;
                        release(guard, &holder, &write).await.map_err(released)?;
                    }
                    Mix::ReadWrite if fastrand::u8(..4) != 0 => {
                        let guard = locks
                            .acquire_read(key, ACQUIRE_TIMEOUT)
                            .await
                            .map_err(failed)?;
                        write(format!("read {key} {holder} {}\n", token_of(&guard)))?;
                        section().await;
                        write(format!("unread {key} {holder}\n"))?;
                        release(guard, &holder, &write).await.map_err(released)?;
                    }
                    Mix::ReadWrite => {
                        let guard = locks.acquire(key, ACQUIRE_TIMEOUT).await.map_err(failed)?;
                        write(format!("enter {key} {holder} {}\n", token_of(&guard)))?;
                        section().await;
                        write(format!("exit {key} {holder}\n"))?;
                        release(guard, &holder, &write).await.map_err(released)?;
                    }
                    Mix::Semaphore(permits) => {
                        let guard = locks
                            .acquire_semaphore(key, permits, ACQUIRE_TIMEOUT)
                            .await
                            .map_err(failed)?;
                        // The slot's internal name holds NUL bytes; log a printable form.
                        let slot = guard
                            .key()
                            .replace(|c: char| c.is_control() || c == ' ', "_");
                        write(format!(
                            "slot {key} {slot} {holder} {} {permits}\n",
                            token_of(&guard)
                        ))?;
                        section().await;
                        write(format!("unslot {key} {slot} {holder}\n"))?;
                        release(guard, &holder, &write).await.map_err(released)?;
                    }
                    Mix::Many => {
                        let other = loop {
                            let other = &names[fastrand::usize(..names.len())];
                            if other != key {
                                break other;
                            }
                        };
                        let guards = locks
                            .acquire_many(&[key.as_str(), other.as_str()], ACQUIRE_TIMEOUT)
                            .await
                            .map_err(failed)?;
                        let taken: Vec<String> = guards
                            .iter()
                            .map(|g| format!("{} {}", g.key(), token_of(g)))
                            .collect();
                        write(format!("enter-set {holder} {}\n", taken.join(" ")))?;
                        section().await;
                        write(format!("exit-set {holder} {key} {other}\n"))?;
                        for guard in guards {
                            release(guard, &holder, &write).await.map_err(released)?;
                        }
                    }
                }
            }
            Ok::<(), String>(())
        });
    }
    while let Some(done) = set.join_next().await {
        done.map_err(|e| format!("a task failed: {e}"))??;
    }
    Ok(())
}

/// Gives `guard` back. A release that answers [`dlock::LockError::Lost`] comes after the
/// section's exit line: the lock ran out (a partition, a stuck store) once the section was
/// over, which breaks no exclusion, so it is logged as `lost KEY HOLDER` for the checker to
/// count rather than failing the run (the tests refuse any outside fault runs).
async fn release(
    guard: dlock::LockGuard,
    holder: &str,
    write: &impl Fn(String) -> Result<(), String>,
) -> Result<(), dlock::LockError> {
    // Printable: a semaphore slot's internal name holds NUL bytes.
    let key = guard
        .key()
        .replace(|c: char| c.is_control() || c == ' ', "_");
    match guard.release().await {
        Err(dlock::LockError::Lost { .. }) => {
            let _ = write(format!("lost {key} {holder}\n"));
            Ok(())
        }
        other => other,
    }
}

/// A critical section: yields all along, so that a second holder (if exclusion were broken)
/// has every chance to write its entry in between.
async fn section() {
    let until = Instant::now() + SECTION;
    while Instant::now() < until {
        tokio::task::yield_now().await;
    }
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

/// `hold-permit`: a permit of the backend's own store (renewed by the backend, as a guard's
/// lock is), held until the process is killed.
#[cfg(feature = "redis")]
async fn hold_permit(url: &str, key: &str, max_count: u32) -> Result<(), String> {
    use dlock::backend::{LockBackend, PermitRequest, PermitTry};
    let backend = dlock::redis::RedisBackend::connect(url)
        .await
        .map_err(|e| e.to_string())?;
    let store = backend
        .semaphores()
        .ok_or("this backend keeps no semaphores of its own")?;
    let deadline = Instant::now() + ACQUIRE_TIMEOUT;
    let acquired = loop {
        let request = PermitRequest::new(key, max_count).with_waiting(Some(Duration::from_secs(1)));
        match store.try_acquire_permit(request).await {
            Ok(PermitTry::Acquired(acquired)) => break acquired,
            Ok(_) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Ok(_) => return Err(format!("no permit of `{key}` within {ACQUIRE_TIMEOUT:?}")),
            Err(err) => return Err(err.to_string()),
        }
    };
    println!(
        "held {}",
        acquired
            .fencing_token
            .map_or_else(|| "-".to_owned(), |t| t.to_string())
    );
    std::io::stdout().flush().map_err(|e| e.to_string())?;
    acquired.lost.cancelled().await;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
    println!("lost {now}");
    std::io::stdout().flush().map_err(|e| e.to_string())?;
    std::future::pending::<()>().await;
    drop(acquired);
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
