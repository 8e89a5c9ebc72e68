//! `dlock-worker schedule`: one worker process of the schedule test (`tests/schedule/`).
//!
//! ```text
//! dlock-worker schedule --url URL [--runtimes N] [--provider GROUP:RUNTIME]... [--sqlite-file PATH]
//! ```
//!
//! The process runs `N` Tokio runtimes (1 or 2, each with one worker thread) and one provider
//! per `--provider` flag, numbered from 0 in order. Providers of one `GROUP` share one backend,
//! opened once and handed to each of them as a clone (`LockProvider::from_backend(b.clone())`);
//! the backend of a group is opened on the `RUNTIME` of the group's first provider (so its
//! connection tasks start there), and each provider is built there too.
//!
//! The driver (the test process) writes one command per line on stdin; the worker answers with
//! one event per line on stdout. Every time in an event is nanoseconds of `CLOCK_MONOTONIC`,
//! read through the vDSO (`rustix`), which libfaketime does not intercept: all processes of
//! the machine share that clock, and a faked wall clock does not move it.
//!
//! | command | effect |
//! |---|---|
//! | `acq OP PROV RT KEY try` | `try_acquire` on provider `PROV`, in a task on runtime `RT` |
//! | `acq OP PROV RT KEY wait MS` | `acquire` with a timeout of `MS` ms |
//! | `acq OP PROV RT KEY cancel MS AFTER` | `acquire` with a timeout and a cancellation token fired after `AFTER` ms |
//! | `acq OP PROV RT KEY abandon MS AFTER` | `acquire` whose future is dropped after `AFTER` ms if it has not finished |
//! | `rel OP PICK` / `drop OP PICK` | releases / drops a held guard: `g:GID` names one, a number picks the `n % count`-th held guard |
//! | `relx OP PICK AFTER` | releases a guard and drops the `release` future after `AFTER` ms if it has not finished |
//! | `rt OP R` | drops runtime `R` (every task on it, and so every guard held there, goes with it), then starts a new one in its place |
//! | `tx OP KEY commit\|rollback MS` | SQLite only: a transaction-bound lock held `MS` ms, then the transaction ends |
//! | `quit` | exits |
//!
//! | event | meaning |
//! |---|---|
//! | `ready PID T` | providers built |
//! | `acq OP ok T0 T1 ALIVE TOKEN` | the acquisition `OP`, begun at `T0`, returned a guard (its id is `OP`) at `T1`; `ALIVE` is a time at which the guard was not lost (`-` when it was lost at once); `TOKEN` its fencing token or `-` |
//! | `acq OP err KIND T0 T1` | it failed with the error code `KIND` (`AlreadyHeld`, `Timeout`, ...) |
//! | `acq OP abandoned T0 T1` | its future was dropped at `T1` |
//! | `alive GID T` | at `T` the guard existed and its lost token had not fired |
//! | `lost GID ALIVE T` | its lost token fired; the watcher saw it at `T`; `ALIVE` is the last time it had been seen not lost |
//! | `rel OP GID OUTCOME ALIVE T0 T1` | `release` of guard `GID` began at `T0` and returned `OUTCOME` (`ok` or an error code) at `T1`; `ALIVE` as above |
//! | `relx OP GID OUTCOME ALIVE T0 T1` | the same with the future dropped (`OUTCOME` `abandoned`) when it took too long |
//! | `drop OP GID ALIVE T0 T1` | the guard was dropped |
//! | `none OP T` | `rel`/`drop`/`relx` found no guard to pick |
//! | `rt OP R T0 T1 GIDS OPS` | runtime `R` was shut down between `T0` and `T1`; the guards (`g:1,2` or `g:-`) and the unfinished operations (`o:3,4` or `o:-`) on it are gone |
//! | `fail MESSAGE` | the worker cannot go on (it exits) |
//!
//! Each guard is watched by its own task, which checks `is_lost()` every [`POLL`] and reports
//! `alive` every [`HEARTBEAT`]. A time reported as alive is always read *before* the check
//! that found the guard not lost, so the guard was not lost at that time (the token never
//! un-fires); the schedule checker relies on that.

use std::collections::BTreeMap;
use std::io::{BufRead, Write};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use dlock::{CancellationToken, LockError, LockGuard, LockProvider};
use tokio::sync::mpsc;

/// How often a guard's watcher checks `is_lost()`.
const POLL: Duration = Duration::from_millis(2);
/// How often a guard's watcher reports `alive`.
const HEARTBEAT: u64 = 25_000_000;

/// Nanoseconds of `CLOCK_MONOTONIC`, read through the vDSO so that libfaketime (which
/// intercepts libc's `clock_gettime`) cannot shift it.
pub fn now() -> u64 {
    let ts = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    u64::try_from(ts.tv_sec).unwrap_or(0) * 1_000_000_000 + u64::try_from(ts.tv_nsec).unwrap_or(0)
}

/// The backend of one provider group.
#[derive(Clone)]
enum Backend {
    #[cfg(feature = "sqlite")]
    Sqlite(dlock::sqlite::SqliteBackend),
    #[cfg(feature = "postgres")]
    Postgres(dlock::postgres::PostgresBackend),
    #[cfg(feature = "redis")]
    Redis(dlock::redis::RedisBackend),
}

impl Backend {
    async fn open(url: &str) -> Result<Backend, String> {
        let scheme = url.split(':').next().unwrap_or_default();
        match scheme {
            #[cfg(feature = "sqlite")]
            "sqlite" => dlock::sqlite::SqliteBackend::connect(url)
                .await
                .map(Backend::Sqlite)
                .map_err(|e| e.to_string()),
            #[cfg(feature = "postgres")]
            "postgres" => dlock::postgres::PostgresBackend::connect(url)
                .await
                .map(Backend::Postgres)
                .map_err(|e| e.to_string()),
            #[cfg(feature = "redis")]
            "redis" => dlock::redis::RedisBackend::connect(url)
                .await
                .map(Backend::Redis)
                .map_err(|e| e.to_string()),
            _ => Err(format!("no backend for `{scheme}` in this build")),
        }
    }

    fn provider(&self) -> LockProvider {
        match self {
            #[cfg(feature = "sqlite")]
            Backend::Sqlite(b) => LockProvider::from_backend(b.clone()),
            #[cfg(feature = "postgres")]
            Backend::Postgres(b) => LockProvider::from_backend(b.clone()),
            #[cfg(feature = "redis")]
            Backend::Redis(b) => LockProvider::from_backend(b.clone()),
        }
    }
}

/// Where the events go: whole lines, flushed at once.
#[derive(Clone)]
struct Out(Arc<Mutex<std::io::Stdout>>);

impl Out {
    fn emit(&self, line: &str) {
        let mut out = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        // A closed pipe means the driver is gone; the worker is killed soon after.
        let _ = writeln!(out, "{line}");
        let _ = out.flush();
    }
}

/// What a guard's task is asked to do.
enum GuardCmd {
    Release { op: u64 },
    Drop { op: u64 },
    ReleaseAbandon { op: u64, after: Duration },
}

/// The worker's bookkeeping, shared by its tasks. Events that change it are emitted while it
/// is locked, so a runtime drop sees exactly the operations and guards that had not reported.
#[derive(Default)]
struct Live {
    /// Held guards not picked yet: their runtime and their task's command channel.
    guards: BTreeMap<u64, (usize, mpsc::UnboundedSender<GuardCmd>)>,
    /// Operations running as tasks, by runtime.
    busy: BTreeMap<u64, usize>,
    /// Guards whose task is still running (picked or not), by runtime.
    tasks: BTreeMap<u64, usize>,
}

#[derive(Clone)]
struct Ctx {
    out: Out,
    live: Arc<Mutex<Live>>,
}

impl Ctx {
    fn live(&self) -> std::sync::MutexGuard<'_, Live> {
        self.live.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

fn runtime() -> Result<tokio::runtime::Runtime, String> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .map_err(|e| format!("runtime: {e}"))
}

fn stamp(t: Option<u64>) -> String {
    t.map_or_else(|| "-".to_owned(), |t| t.to_string())
}

/// The error code of `error` without its `DistributedLock.` prefix.
fn kind(error: &LockError) -> &'static str {
    let code = error.code();
    code.strip_prefix("DistributedLock.").unwrap_or(code)
}

/// Runs the worker until `quit` or the end of stdin.
pub fn run(args: &[&str]) -> Result<(), String> {
    let mut url = None;
    let mut runtimes = 1usize;
    let mut providers: Vec<(usize, usize)> = Vec::new();
    let mut sqlite_file = None;
    let mut rest = args.iter();
    while let Some(flag) = rest.next() {
        let value = rest.next().ok_or_else(|| format!("{flag} needs a value"))?;
        match *flag {
            "--url" => url = Some((*value).to_owned()),
            "--runtimes" => {
                runtimes = value
                    .parse()
                    .ok()
                    .filter(|n| (1..=4).contains(n))
                    .ok_or("--runtimes: 1 to 4")?;
            }
            "--provider" => {
                let (group, rt) = value
                    .split_once(':')
                    .and_then(|(g, r)| Some((g.parse().ok()?, r.parse().ok()?)))
                    .ok_or("--provider GROUP:RUNTIME")?;
                providers.push((group, rt));
            }
            "--sqlite-file" => sqlite_file = Some((*value).to_owned()),
            _ => return Err(format!("unknown option {flag}")),
        }
    }
    let url = url.ok_or("--url is required")?;
    if providers.is_empty() {
        providers.push((0, 0));
    }
    if providers.iter().any(|&(_, rt)| rt >= runtimes) {
        return Err("a provider's runtime is out of range".to_owned());
    }
    let mut slots: Vec<Option<tokio::runtime::Runtime>> = (0..runtimes)
        .map(|_| runtime().map(Some))
        .collect::<Result<_, _>>()?;
    let mut groups: BTreeMap<usize, Backend> = BTreeMap::new();
    let mut built = Vec::new();
    for &(group, rt) in &providers {
        let rt = slots[rt].as_ref().ok_or("runtime")?;
        let backend = match groups.get(&group) {
            Some(backend) => backend.clone(),
            None => {
                // A worker started while the server is down (after a kill) waits for it, as
                // a service would.
                let started = std::time::Instant::now();
                let backend = loop {
                    match rt.block_on(Backend::open(&url)) {
                        Ok(backend) => break backend,
                        Err(e) if started.elapsed() > Duration::from_secs(30) => return Err(e),
                        Err(_) => std::thread::sleep(Duration::from_millis(100)),
                    }
                };
                groups.insert(group, backend.clone());
                backend
            }
        };
        // Built inside the runtime, as an application would.
        built.push(rt.block_on(async { backend.provider() }));
    }
    let providers = built;
    let ctx = Ctx {
        out: Out(Arc::new(Mutex::new(std::io::stdout()))),
        live: Arc::default(),
    };
    ctx.out
        .emit(&format!("ready {} {}", std::process::id(), now()));

    for line in std::io::stdin().lock().lines() {
        let line = line.map_err(|e| format!("stdin: {e}"))?;
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["quit"] => break,
            ["acq", op, prov, rt, key, mode @ ..] => {
                let op: u64 = op.parse().map_err(|_| "op")?;
                let provider = prov
                    .parse::<usize>()
                    .ok()
                    .and_then(|p| providers.get(p))
                    .ok_or("provider")?
                    .clone();
                let rt: usize = rt.parse().map_err(|_| "runtime")?;
                let mode = Mode::parse(mode)?;
                let handle = slots
                    .get(rt)
                    .and_then(Option::as_ref)
                    .ok_or("runtime")?
                    .handle()
                    .clone();
                ctx.live().busy.insert(op, rt);
                let (ctx, key) = (ctx.clone(), (*key).to_owned());
                drop(handle.spawn(acquire(ctx, op, rt, provider, key, mode)));
            }
            [cmd @ ("rel" | "drop" | "relx"), op, pick, more @ ..] => {
                let op: u64 = op.parse().map_err(|_| "op")?;
                let after = match more {
                    [ms] => Duration::from_millis(ms.parse().map_err(|_| "after")?),
                    _ => Duration::ZERO,
                };
                let mut live = ctx.live();
                let gid = match pick.strip_prefix("g:") {
                    Some(gid) => gid.parse().ok().filter(|g| live.guards.contains_key(g)),
                    None => {
                        let n: usize = pick.parse().map_err(|_| "pick")?;
                        let count = live.guards.len();
                        (count > 0).then(|| *live.guards.keys().nth(n % count).unwrap_or(&0))
                    }
                };
                let Some((rt, tx)) = gid.and_then(|gid| live.guards.remove(&gid)) else {
                    ctx.out.emit(&format!("none {op} {}", now()));
                    continue;
                };
                live.busy.insert(op, rt);
                let cmd = match *cmd {
                    "rel" => GuardCmd::Release { op },
                    "drop" => GuardCmd::Drop { op },
                    _ => GuardCmd::ReleaseAbandon { op, after },
                };
                // The guard's task is alive while it is listed; if its runtime died meanwhile,
                // the runtime drop reports the operation.
                let _ = tx.send(cmd);
            }
            ["rt", op, r] => {
                let r: usize = r.parse().ok().filter(|r| *r < slots.len()).ok_or("rt")?;
                let t0 = now();
                if let Some(rt) = slots[r].take() {
                    rt.shutdown_timeout(Duration::from_secs(2));
                }
                let t1 = now();
                let mut live = ctx.live();
                let gone = |map: &mut BTreeMap<u64, usize>| {
                    let ids: Vec<u64> = map
                        .iter()
                        .filter(|(_, rt)| **rt == r)
                        .map(|(id, _)| *id)
                        .collect();
                    for id in &ids {
                        map.remove(id);
                    }
                    ids
                };
                let guards = gone(&mut live.tasks);
                let ops = gone(&mut live.busy);
                live.guards.retain(|_, (rt, _)| *rt != r);
                let list = |ids: &[u64]| {
                    if ids.is_empty() {
                        "-".to_owned()
                    } else {
                        ids.iter().map(u64::to_string).collect::<Vec<_>>().join(",")
                    }
                };
                ctx.out.emit(&format!(
                    "rt {op} {r} {t0} {t1} g:{} o:{}",
                    list(&guards),
                    list(&ops)
                ));
                drop(live);
                slots[r] = Some(runtime()?);
            }
            ["tx", op, key, end @ ("commit" | "rollback"), ms] => {
                let op: u64 = op.parse().map_err(|_| "op")?;
                let hold = Duration::from_millis(ms.parse().map_err(|_| "ms")?);
                let path = sqlite_file.clone().ok_or("tx needs --sqlite-file")?;
                let (ctx, key, commit) = (ctx.clone(), (*key).to_owned(), *end == "commit");
                std::thread::spawn(move || transaction(&ctx, op, &path, &key, commit, hold));
            }
            _ => return Err(format!("unknown command `{line}`")),
        }
    }
    for rt in slots.into_iter().flatten() {
        rt.shutdown_timeout(Duration::from_secs(2));
    }
    Ok(())
}

/// How an acquisition is made.
#[derive(Clone, Copy)]
enum Mode {
    Try,
    Wait(Duration),
    Cancel(Duration, Duration),
    Abandon(Duration, Duration),
}

impl Mode {
    fn parse(words: &[&str]) -> Result<Mode, String> {
        let ms = |w: &str| {
            w.parse::<u64>()
                .map(Duration::from_millis)
                .map_err(|_| format!("bad duration `{w}`"))
        };
        Ok(match words {
            ["try"] => Mode::Try,
            ["wait", t] => Mode::Wait(ms(t)?),
            ["cancel", t, after] => Mode::Cancel(ms(t)?, ms(after)?),
            ["abandon", t, after] => Mode::Abandon(ms(t)?, ms(after)?),
            _ => return Err(format!("bad acquisition mode {words:?}")),
        })
    }
}

async fn acquire(ctx: Ctx, op: u64, rt: usize, provider: LockProvider, key: String, mode: Mode) {
    let t_start = now();
    let result = match mode {
        Mode::Try => provider.try_acquire(&key).await,
        Mode::Wait(timeout) => provider.acquire(&key, timeout).await,
        Mode::Cancel(timeout, after) => {
            let token = CancellationToken::new();
            let firing = token.clone();
            let fire = tokio::spawn(async move {
                tokio::time::sleep(after).await;
                firing.cancel();
            });
            let result = provider
                .lock(&key)
                .timeout(timeout)
                .cancel_on(&token)
                .acquire()
                .await;
            fire.abort();
            result
        }
        Mode::Abandon(timeout, after) => {
            match tokio::time::timeout(after, provider.acquire(&key, timeout)).await {
                Ok(result) => result,
                Err(_) => {
                    // The acquisition future has been dropped.
                    let t = now();
                    let mut live = ctx.live();
                    live.busy.remove(&op);
                    ctx.out.emit(&format!("acq {op} abandoned {t_start} {t}"));
                    return;
                }
            }
        }
    };
    let t_ret = now();
    let guard = match result {
        Ok(guard) => guard,
        Err(error) => {
            let mut live = ctx.live();
            live.busy.remove(&op);
            ctx.out
                .emit(&format!("acq {op} err {} {t_start} {t_ret}", kind(&error)));
            return;
        }
    };
    let t = now();
    let alive = (!guard.is_lost()).then_some(t);
    let (tx, rx) = mpsc::unbounded_channel();
    {
        let mut live = ctx.live();
        live.busy.remove(&op);
        live.guards.insert(op, (rt, tx));
        live.tasks.insert(op, rt);
        ctx.out.emit(&format!(
            "acq {op} ok {t_start} {t_ret} {} {}",
            stamp(alive),
            stamp(guard.fencing_token())
        ));
    }
    watch(ctx, op, guard, alive, rx).await;
}

/// Holds a guard: reports `alive` and `lost`, and carries out the command that ends it.
async fn watch(
    ctx: Ctx,
    gid: u64,
    guard: LockGuard,
    mut alive: Option<u64>,
    mut rx: mpsc::UnboundedReceiver<GuardCmd>,
) {
    let lost = guard.lost_token().clone();
    let mut heard = alive.is_none();
    let mut reported = alive.unwrap_or(0);
    let cmd = loop {
        tokio::select! {
            biased;
            cmd = rx.recv() => break cmd,
            () = lost.cancelled(), if !heard => {
                let t = now();
                heard = true;
                ctx.out.emit(&format!("lost {gid} {} {t}", stamp(alive)));
            }
            () = tokio::time::sleep(POLL), if !heard => {
                let t = now();
                if !guard.is_lost() {
                    alive = Some(t);
                    if t.saturating_sub(reported) >= HEARTBEAT {
                        reported = t;
                        ctx.out.emit(&format!("alive {gid} {t}"));
                    }
                }
            }
        }
    };
    let Some(cmd) = cmd else {
        // The worker is quitting.
        return;
    };
    let t0 = now();
    if !guard.is_lost() {
        alive = Some(t0);
    }
    let (op, line) = match cmd {
        GuardCmd::Release { op } => {
            let outcome = match guard.release().await {
                Ok(()) => "ok",
                Err(error) => kind(&error),
            };
            let t1 = now();
            (
                op,
                format!("rel {op} {gid} {outcome} {} {t0} {t1}", stamp(alive)),
            )
        }
        GuardCmd::Drop { op } => {
            drop(guard);
            let t1 = now();
            (op, format!("drop {op} {gid} {} {t0} {t1}", stamp(alive)))
        }
        GuardCmd::ReleaseAbandon { op, after } => {
            let outcome = match tokio::time::timeout(after, guard.release()).await {
                Ok(Ok(())) => "ok",
                Ok(Err(error)) => kind(&error),
                Err(_) => "abandoned",
            };
            let t1 = now();
            (
                op,
                format!("relx {op} {gid} {outcome} {} {t0} {t1}", stamp(alive)),
            )
        }
    };
    let mut live = ctx.live();
    live.busy.remove(&op);
    live.tasks.remove(&gid);
    ctx.out.emit(&line);
}

/// A transaction-bound SQLite lock, held `hold` and then committed or rolled back. Reported as
/// an acquisition `acq OP ok ...` and a release `rel OP OP commit|rollback ...` (or `acq OP err`).
#[cfg(feature = "sqlite")]
fn transaction(ctx: &Ctx, op: u64, path: &str, key: &str, commit: bool, hold: Duration) {
    let t_start = now();
    let fail = |what: &str, e: &dyn std::fmt::Display| {
        ctx.out.emit(&format!(
            "acq {op} err {what}:{} {t_start} {}",
            e.to_string().replace(' ', "_"),
            now()
        ));
    };
    let mut conn = match rusqlite::Connection::open(path) {
        Ok(conn) => conn,
        Err(e) => return fail("open", &e),
    };
    let _ = conn.busy_timeout(Duration::from_secs(5));
    let tx = match conn.transaction() {
        Ok(tx) => tx,
        Err(e) => return fail("begin", &e),
    };
    let lock = match dlock::sqlite::try_acquire_in_transaction(&tx, key) {
        Ok(lock) => lock,
        Err(error) => {
            ctx.out.emit(&format!(
                "acq {op} err {} {t_start} {}",
                kind(&error),
                now()
            ));
            return;
        }
    };
    let t = now();
    ctx.out.emit(&format!(
        "acq {op} ok {t_start} {t} {t} {}",
        lock.fencing_token()
            .map_or("-".to_owned(), |t| t.to_string())
    ));
    std::thread::sleep(hold);
    let t0 = now();
    let end = if commit { tx.commit() } else { tx.rollback() };
    let t1 = now();
    let outcome = match end {
        Ok(()) if commit => "ok",
        Ok(()) => "rolledback",
        Err(_) => "endfailed",
    };
    ctx.out
        .emit(&format!("rel {op} {op} {outcome} {t0} {t0} {t1}"));
}

#[cfg(not(feature = "sqlite"))]
fn transaction(ctx: &Ctx, op: u64, _path: &str, _key: &str, _commit: bool, _hold: Duration) {
    let t = now();
    ctx.out.emit(&format!("acq {op} err Unsupported {t} {t}"));
}
