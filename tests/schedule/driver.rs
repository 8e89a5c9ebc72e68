//! The driver: runs a schedule against real worker processes and a real store, applies the
//! faults itself, and hands the history to the checker.
//!
//! Workers are `dlock-worker schedule` processes (see `src/bin/dlock-worker/schedule.rs`), one
//! per slot of the schedule plus a probe (the last slot: one plain provider, no faketime, never
//! killed, frozen or stepped) that takes each key at the checkpoints. A killed worker is
//! replaced by a new process in its slot (the next *generation*).

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, channel};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use super::model::{Bounds, Fault, History, MS, Op, OpKind, SEC, Violation};
use super::plan::{Action, Backend, KNOWN_HOLES, Schedule, WorkerSpec, gated, generate, opened};
use dlock_testkit::postgres::PgServer;
use dlock_testkit::redis::{Flavor, RedisServer};
use dlock_testkit::unique_key;

/// Nanoseconds of `CLOCK_MONOTONIC` through the vDSO: the clock the workers report in.
pub fn now() -> u64 {
    let ts = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    u64::try_from(ts.tv_sec).unwrap_or(0) * SEC + u64::try_from(ts.tv_nsec).unwrap_or(0)
}

/// How long past a key's "may hold until" the probe waits for it: its own backoff (up to
/// 500 ms, plus jitter) and a round trip.
const PROBE_SLACK: u64 = 1_000 * MS;

/// The libfaketime library, if installed.
pub fn libfaketime() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("DLOCK_LIBFAKETIME") {
        return Some(PathBuf::from(path));
    }
    let dirs = std::fs::read_dir("/usr/lib").ok()?;
    let mut candidates: Vec<PathBuf> = dirs
        .filter_map(|e| e.ok().map(|e| e.path().join("faketime/libfaketime.so.1")))
        .collect();
    candidates.push(PathBuf::from("/usr/lib/faketime/libfaketime.so.1"));
    candidates.into_iter().find(|p| p.is_file())
}

/// Removes the shared memory libfaketime made for the (ended) process `pid`: it is left behind
/// when the process is killed (and, with this version, often when it exits), and a later
/// process with the same pid would fail on it (`shm_open failed: File exists`).
fn forget_faketime(pid: u32) {
    let _ = std::fs::remove_file(format!("/dev/shm/faketime_shm_{pid}"));
    let _ = std::fs::remove_file(format!("/dev/shm/sem.faketime_sem_{pid}"));
}

/// The store of one backend, and the faults it can suffer.
pub enum Store {
    Sqlite {
        dir: tempfile::TempDir,
        file: PathBuf,
    },
    Postgres {
        server: PgServer,
        admin: tokio::runtime::Runtime,
    },
    Redis {
        server: RedisServer,
    },
}

impl Store {
    /// A store for `backend`; for Redis, the server flavour picked by the seed among those
    /// installed.
    pub fn start(backend: Backend, seed: u64) -> Store {
        match backend {
            Backend::Sqlite => {
                let dir = tempfile::tempdir().expect("temp dir");
                let file = dir.path().join("locks.db");
                Store::Sqlite { dir, file }
            }
            Backend::Postgres => Store::Postgres {
                server: PgServer::start(),
                admin: tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("runtime"),
            },
            Backend::Redis => {
                let flavors = [
                    Flavor::Redis7,
                    Flavor::Valkey91,
                    Flavor::Redis8,
                    Flavor::Valkey81,
                ];
                let installed: Vec<Flavor> = flavors
                    .into_iter()
                    .filter(|f| f.binary().is_some())
                    .collect();
                let flavor = if installed.is_empty() {
                    Flavor::Redis7
                } else {
                    installed[(seed % installed.len() as u64) as usize]
                };
                Store::Redis {
                    server: RedisServer::start(flavor)
                        .unwrap_or_else(|| panic!("no {flavor:?} server: run .ci/run")),
                }
            }
        }
    }

    /// A fresh SQLite file for the next schedule (the servers stay; keys are unique).
    pub fn reset(&mut self) {
        if let Store::Sqlite { dir, file } = self {
            *file = dir
                .path()
                .join(format!("{}.db", unique_key("locks").replace(':', "-")));
        }
    }

    pub fn describe(&self) -> String {
        match self {
            Store::Sqlite { .. } => "SQLite file".to_owned(),
            Store::Postgres { .. } => "PostgreSQL".to_owned(),
            Store::Redis { server } => format!("{:?}", server.flavor),
        }
    }

    /// The URL a worker connects with; `name` labels its PostgreSQL connections.
    fn url(&self, sched: &Schedule, spec: Option<&WorkerSpec>, name: &str) -> String {
        match self {
            Store::Sqlite { file, .. } => {
                format!("sqlite://{}?lease={}ms", file.display(), sched.lease_ms)
            }
            Store::Postgres { server, .. } => {
                let connections = spec.map_or(4, |s| s.connections);
                server.url(&format!(
                    "keepalive={}ms&connect_timeout=1s&fencing={}&connections={connections}\
                     &application_name={name}",
                    sched.keepalive_ms, sched.fencing
                ))
            }
            Store::Redis { server } => server.url(&format!(
                "lease={}ms&fencing={}&timeout=1s",
                sched.lease_ms, sched.fencing
            )),
        }
    }

    fn sqlite_file(&self) -> Option<&Path> {
        match self {
            Store::Sqlite { file, .. } => Some(file),
            _ => None,
        }
    }

    /// The server drops the connections of the worker whose connections are named `name`
    /// (PostgreSQL), or every client's (Redis, which has no names for them).
    fn conn_kill(&self, name: &str) -> String {
        match self {
            Store::Sqlite { .. } => "no connections to kill".to_owned(),
            Store::Postgres { server, admin } => {
                let url = server.url("");
                admin.block_on(async {
                    use sqlx::Connection;
                    let Ok(mut conn) = sqlx::PgConnection::connect(&url).await else {
                        return "no admin connection (server down?)".to_owned();
                    };
                    let killed: Result<i64, _> = sqlx::query_scalar(
                        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
                         WHERE application_name = $1",
                    )
                    .bind(name)
                    .fetch_one(&mut conn)
                    .await;
                    let _ = conn.close().await;
                    format!("{killed:?} sessions terminated")
                })
            }
            Store::Redis { server } => format!(
                "{:?}",
                server.raw(&["CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes"])
            ),
        }
    }

    fn stop(&mut self) {
        match self {
            Store::Sqlite { .. } => {}
            Store::Postgres { server, .. } => server.stop(),
            Store::Redis { server } => server.stop(),
        }
    }

    fn resume(&mut self) {
        match self {
            Store::Sqlite { .. } => {}
            Store::Postgres { server, .. } => server.resume(),
            Store::Redis { server } => server.restart(),
        }
    }
}

/// A line from a worker (`None`: its stdout closed).
struct Msg {
    slot: usize,
    generation: u32,
    line: Option<String>,
}

/// One worker process.
struct Proc {
    generation: u32,
    child: Child,
    stdin: Option<ChildStdin>,
    pid: u32,
    faked: bool,
    ready: bool,
    /// SIGSTOPped until then.
    frozen_until: Option<u64>,
    frozen_at: u64,
}

/// One run of one schedule.
struct Run<'a> {
    sched: &'a Schedule,
    store: Arc<Mutex<Store>>,
    history: History,
    procs: Vec<Proc>,
    tx: Sender<Msg>,
    rx: Receiver<Msg>,
    next_op: u64,
    keys: Vec<String>,
    name: String,
    dir: tempfile::TempDir,
    libfaketime: Option<PathBuf>,
    server: Option<JoinHandle<(u64, u64, u64)>>,
    /// When each step was carried out.
    step_times: Vec<u64>,
    step: usize,
    /// Set when the run must stop early (a hang, a stranded key, a dead worker).
    stop: bool,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Run<'_> {
    fn probe(&self) -> usize {
        self.sched.workers.len()
    }

    fn worker_name(&self, slot: usize) -> String {
        format!("{}-w{slot}", self.name)
    }

    fn clock_file(&self, slot: usize) -> PathBuf {
        self.dir.path().join(format!("clock-{slot}"))
    }

    fn spawn(&mut self, slot: usize, generation: u32) -> Proc {
        let spec = self.sched.workers.get(slot);
        let store = lock(&self.store);
        let url = store.url(self.sched, spec, &self.worker_name(slot));
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_dlock-worker"));
        cmd.args(["schedule", "--url", &url]);
        if let Some(file) = store.sqlite_file() {
            cmd.arg("--sqlite-file").arg(file);
        }
        drop(store);
        let mut faked = false;
        if let Some(spec) = spec {
            cmd.args(["--runtimes", &spec.runtimes.to_string()]);
            for (group, rt) in &spec.providers {
                cmd.args(["--provider", &format!("{group}:{rt}")]);
            }
            if spec.faketime
                && let Some(lib) = &self.libfaketime
            {
                let file = self.clock_file(slot);
                if !file.exists() {
                    std::fs::write(&file, "+0\n").expect("clock file");
                }
                cmd.env("LD_PRELOAD", lib)
                    .env("FAKETIME_TIMESTAMP_FILE", &file)
                    .env("FAKETIME_NO_CACHE", "1")
                    .env("FAKETIME_DONT_FAKE_MONOTONIC", "1");
                faked = true;
            }
        }
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn a schedule worker");
        let stdout = child.stdout.take().expect("stdout");
        let tx = self.tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                let msg = Msg {
                    slot,
                    generation,
                    line: Some(line),
                };
                if tx.send(msg).is_err() {
                    return;
                }
            }
            let _ = tx.send(Msg {
                slot,
                generation,
                line: None,
            });
        });
        Proc {
            generation,
            pid: child.id(),
            stdin: child.stdin.take(),
            child,
            faked,
            ready: false,
            frozen_until: None,
            frozen_at: 0,
        }
    }

    /// Handles one message; returns the (slot, generation) whose stdout closed, if any.
    fn handle(&mut self, msg: Msg) -> Option<(usize, u32)> {
        let Some(line) = msg.line else {
            return Some((msg.slot, msg.generation));
        };
        if line.starts_with("ready ")
            && let Some(p) = self.procs.get_mut(msg.slot)
            && p.generation == msg.generation
        {
            p.ready = true;
        }
        if live_trace() {
            eprintln!(
                "{:>9} w{}/{}: {line}",
                self.history.rel(now()),
                msg.slot,
                msg.generation
            );
        }
        if let Err(e) = self.history.apply(msg.slot, msg.generation, &line) {
            let at = now();
            self.history.online.push(Violation {
                rule: "protocol",
                at,
                key: None,
                message: e,
            });
            self.stop = true;
        }
        if line.starts_with("fail") {
            self.stop = true;
        }
        None
    }

    /// Handles messages and due unfreezes until `until`.
    fn tick_until(&mut self, until: u64) {
        loop {
            self.unfreeze_due(false);
            let t = now();
            if t >= until {
                break;
            }
            let wait = Duration::from_nanos((until - t).min(5 * MS));
            match self.rx.recv_timeout(wait) {
                Ok(msg) => {
                    if let Some((slot, generation)) = self.handle(msg)
                        && self
                            .procs
                            .get(slot)
                            .is_some_and(|p| p.generation == generation)
                    {
                        self.died(slot);
                    }
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => break,
            }
        }
    }

    /// A worker's stdout closed without the driver killing it.
    fn died(&mut self, slot: usize) {
        let p = &mut self.procs[slot];
        let status = p.child.try_wait().ok().flatten();
        let t = now();
        self.history.online.push(Violation {
            rule: "worker failed",
            at: t,
            key: None,
            message: format!(
                "w{slot}/{} (pid {}) exited unasked: {status:?}",
                p.generation, p.pid
            ),
        });
        self.stop = true;
    }

    fn unfreeze_due(&mut self, all: bool) {
        let t = now();
        for slot in 0..self.procs.len() {
            let p = &mut self.procs[slot];
            if let Some(until) = p.frozen_until
                && (all || t >= until)
            {
                let _ = Command::new("kill")
                    .args(["-CONT", &p.pid.to_string()])
                    .status();
                p.frozen_until = None;
                let t1 = now();
                self.history.faults.push(Fault::Freeze {
                    worker: slot,
                    generation: p.generation,
                    t0: p.frozen_at,
                    t1,
                });
                self.history
                    .note(t1, None, format!("driver: w{slot} resumed (SIGCONT)"));
            }
        }
    }

    fn send(&mut self, slot: usize, line: &str) {
        if let Some(stdin) = self.procs[slot].stdin.as_mut() {
            // A dead worker's pipe fails; its death is reported by its reader.
            let _ = writeln!(stdin, "{line}").and_then(|()| stdin.flush());
        }
    }

    fn issue(&mut self, slot: usize, kind: OpKind, key: Option<usize>, words: &str) -> u64 {
        self.next_op += 1;
        let id = self.next_op;
        let issued = now();
        let via = match words.split(' ').collect::<Vec<_>>().as_slice() {
            ["acq", _, prov, rt, ..] => format!("p{prov} rt{rt}"),
            _ => String::new(),
        };
        self.history.issue(Op {
            id,
            step: self.step,
            worker: slot,
            generation: self.procs[slot].generation,
            via,
            key,
            kind,
            issued,
            started: None,
            done: None,
            outcome: None,
            void: false,
        });
        let line = words.replace("{op}", &id.to_string());
        self.send(slot, &line);
        id
    }

    /// Waits until the worker in `slot` reports `ready`.
    fn wait_ready(&mut self, slot: usize) {
        let deadline = now() + 60 * SEC;
        while !self.procs[slot].ready && !self.stop {
            if now() > deadline {
                self.history.online.push(Violation {
                    rule: "worker failed",
                    at: now(),
                    key: None,
                    message: format!("w{slot} did not start within 60 s"),
                });
                self.stop = true;
                return;
            }
            self.tick_until(now() + 5 * MS);
        }
    }

    /// Waits for the operations `ops` to finish; one that outlives its deadline is a hang.
    fn wait_ops(&mut self, ops: &[u64]) {
        loop {
            let pending: Vec<u64> = ops
                .iter()
                .copied()
                .filter(|id| {
                    self.history
                        .ops
                        .get(id)
                        .is_some_and(|o| o.done.is_none() && !o.void)
                })
                .collect();
            if pending.is_empty() || self.stop {
                return;
            }
            let t = now();
            for id in &pending {
                let op = &self.history.ops[id];
                // A frozen worker cannot answer; its deadline runs from the thaw.
                let frozen = self.procs[op.worker].frozen_until.is_some();
                if !frozen && t > op.deadline(&self.history.bounds) {
                    let message = format!(
                        "operation {id} (step {}: {}) on w{}/{} did not finish within its timeout + {} s",
                        op.step,
                        self.sched
                            .steps
                            .get(op.step)
                            .map_or_else(|| "checkpoint".to_owned(), |s| s.action.to_string()),
                        op.worker,
                        op.generation,
                        self.history.bounds.hang / SEC
                    );
                    self.history.online.push(Violation {
                        rule: "hang",
                        at: t,
                        key: op.key,
                        message,
                    });
                    self.stop = true;
                    return;
                }
            }
            self.tick_until(now() + 5 * MS);
        }
    }

    fn pending_ops(&self) -> Vec<u64> {
        self.history
            .ops
            .values()
            .filter(|o| o.done.is_none() && !o.void)
            .map(|o| o.id)
            .collect()
    }

    fn join_server(&mut self) {
        if let Some(thread) = self.server.take() {
            while !thread.is_finished() {
                self.tick_until(now() + 5 * MS);
            }
            let (t0, t1, up) = thread.join().expect("server thread");
            if let Some(Fault::Server { up: u, .. }) =
                self.history.faults.iter_mut().rev().find(
                    |f| matches!(f, Fault::Server { t0: x, t1: y, .. } if *x == t0 && *y == t1),
                )
            {
                *u = Some(up);
            }
            self.history
                .note(up, None, "driver: server up again".to_owned());
        }
    }

    /// Waits for everything, releases every guard and has the probe take each key.
    fn checkpoint(&mut self) {
        // Frozen workers are thawed when due; wait for that, and for the server.
        while self.procs.iter().any(|p| p.frozen_until.is_some()) {
            self.tick_until(now() + 5 * MS);
        }
        self.join_server();
        let pending = self.pending_ops();
        self.wait_ops(&pending);
        if self.stop {
            return;
        }
        let held: Vec<(usize, u64)> = self
            .history
            .sections
            .values()
            .filter(|s| s.end.is_none() && !s.tx && self.procs[s.worker].generation == s.generation)
            .map(|s| (s.worker, s.gid))
            .collect();
        let mut releases = Vec::new();
        for (slot, gid) in held {
            let key = self.history.sections[&gid].key;
            releases.push(self.issue(
                slot,
                OpKind::Release,
                Some(key),
                &format!("rel {{op}} g:{gid}"),
            ));
        }
        self.wait_ops(&releases);
        if self.stop {
            return;
        }
        let probe = self.probe();
        let mut probes = Vec::new();
        for key in 0..self.keys.len() {
            let (free_by, what) = self.history.free_by(key);
            let t = now();
            // Every guard has ended by now; a bound past a minute would be a driver error, and
            // the probe would then report the key stranded after a minute.
            let timeout = free_by.saturating_sub(t).min(60 * SEC) + PROBE_SLACK;
            let id = self.issue(
                probe,
                OpKind::Acquire(super::plan::Mode::Wait(timeout / MS)),
                Some(key),
                &format!("acq {{op}} 0 0 {} wait {}", self.keys[key], timeout / MS),
            );
            self.history.note(
                t,
                Some(key),
                format!(
                    "driver: probe {id} for k{key}, free by {} ({what}), timeout {} ms",
                    self.history.rel(free_by.min(t + 3600 * SEC)),
                    timeout / MS
                ),
            );
            probes.push((key, id, free_by, what, t + timeout));
        }
        // A probe that meets a store error (not a timeout) tries again until its deadline.
        loop {
            let ids: Vec<u64> = probes.iter().map(|p| p.1).collect();
            self.wait_ops(&ids);
            if self.stop {
                return;
            }
            let mut again = false;
            for probe_entry in &mut probes {
                let (key, id, _, _, deadline) = probe_entry;
                let deadline = *deadline;
                let op = &self.history.ops[id];
                let failed = !self.history.sections.contains_key(id)
                    && op.outcome.as_deref() != Some("Timeout");
                let t = now();
                if failed && t + 50 * MS < deadline {
                    let timeout = (deadline - t) / MS;
                    let key = *key;
                    *id = self.issue(
                        probe,
                        OpKind::Acquire(super::plan::Mode::Wait(timeout)),
                        Some(key),
                        &format!("acq {{op}} 0 0 {} wait {timeout}", self.keys[key]),
                    );
                    again = true;
                }
            }
            if !again {
                break;
            }
            self.tick_until(now() + 20 * MS);
        }
        let mut releases = Vec::new();
        for (key, id, free_by, what, _) in probes {
            let op = &self.history.ops[&id];
            if self.history.sections.contains_key(&id) {
                releases.push(self.issue(
                    probe,
                    OpKind::Release,
                    Some(key),
                    &format!("rel {{op}} g:{id}"),
                ));
                continue;
            }
            let outcome = op.outcome.clone().unwrap_or_default();
            let done = op.done.unwrap_or(0);
            let message = format!(
                "key k{key} could not be taken at the checkpoint: the probe answered {outcome} at {}; \
                 every earlier holder was gone by {} (the latest: {what})",
                self.history.rel(done),
                self.history.rel(free_by)
            );
            self.history.online.push(Violation {
                rule: if outcome == "Timeout" {
                    "stranded key"
                } else {
                    "probe failed"
                },
                at: free_by.max(self.history.origin),
                key: Some(key),
                message,
            });
            self.stop = true;
        }
        self.wait_ops(&releases);
    }

    fn kill(&mut self, slot: usize) {
        let t0 = now();
        let generation = self.procs[slot].generation;
        if self.procs[slot].frozen_until.is_some() {
            self.history.faults.push(Fault::Freeze {
                worker: slot,
                generation,
                t0: self.procs[slot].frozen_at,
                t1: t0,
            });
        }
        {
            let p = &mut self.procs[slot];
            let _ = p.child.kill();
            let _ = p.child.wait();
            p.stdin = None;
        }
        let t1 = now();
        // Everything the old process printed comes before its end of stream.
        let deadline = now() + 10 * SEC;
        loop {
            match self.rx.recv_timeout(Duration::from_millis(50)) {
                Ok(msg) => {
                    if let Some((s, g)) = self.handle(msg)
                        && s == slot
                        && g == generation
                    {
                        break;
                    }
                }
                Err(_) if now() > deadline => break,
                Err(_) => {}
            }
        }
        let pid = self.procs[slot].pid;
        if self.procs[slot].faked {
            forget_faketime(pid);
        }
        self.history.killed(slot, generation, t0, t1);
        self.history.note(
            t1,
            None,
            format!("driver: w{slot}/{generation} (pid {pid}) killed"),
        );
        let fresh = self.spawn(slot, generation + 1);
        self.procs[slot] = fresh;
        self.wait_ready(slot);
    }

    fn act(&mut self, action: &Action) {
        match *action {
            Action::Acquire {
                w,
                prov,
                rt,
                key,
                mode,
            } => {
                let words = format!("acq {{op}} {prov} {rt} {} {}", self.keys[key], mode.words());
                self.issue(w, OpKind::Acquire(mode), Some(key), &words);
            }
            Action::Release { w, pick } => {
                self.issue(w, OpKind::Release, None, &format!("rel {{op}} {pick}"));
            }
            Action::Drop { w, pick } => {
                self.issue(w, OpKind::Release, None, &format!("drop {{op}} {pick}"));
            }
            Action::ReleaseAbandon { w, pick, after } => {
                self.issue(
                    w,
                    OpKind::Release,
                    None,
                    &format!("relx {{op}} {pick} {after}"),
                );
            }
            Action::Tx {
                w,
                key,
                commit,
                hold,
            } => {
                let end = if commit { "commit" } else { "rollback" };
                let words = format!("tx {{op}} {} {end} {hold}", self.keys[key]);
                self.issue(w, OpKind::Tx, Some(key), &words);
            }
            Action::KillWorker { w } => self.kill(w),
            Action::ConnKill { w } => {
                let t0 = now();
                let what = lock(&self.store).conn_kill(&self.worker_name(w));
                let t1 = now();
                self.history.faults.push(Fault::ConnKill {
                    worker: w,
                    generation: self.procs[w].generation,
                    t0,
                    t1,
                });
                self.history
                    .note(t1, None, format!("driver: w{w} connections killed: {what}"));
            }
            Action::ServerKill => {
                if self.server.is_some() {
                    return;
                }
                let store = Arc::clone(&self.store);
                let b = self.history.bounds;
                // Down for longer than a holder needs to hear of the loss, so that one that
                // hears in time never overlaps the next holder.
                let down = Duration::from_nanos(b.detect + 500 * MS);
                let t0 = now();
                lock(&store).stop();
                let t1 = now();
                self.history.faults.push(Fault::Server { t0, t1, up: None });
                self.history.note(
                    t1,
                    None,
                    format!("driver: server stopped, down for {} ms", down.as_millis()),
                );
                self.server = Some(std::thread::spawn(move || {
                    std::thread::sleep(down);
                    lock(&store).resume();
                    (t0, t1, now())
                }));
            }
            Action::ClockStep { w, offset } => {
                if !self.procs[w].faked {
                    return;
                }
                let file = self.clock_file(w);
                let tmp = file.with_extension("tmp");
                std::fs::write(&tmp, format!("{offset:+}\n")).expect("clock file");
                std::fs::rename(&tmp, &file).expect("clock file");
                let t = now();
                self.history.faults.push(Fault::Clock {
                    worker: w,
                    offset,
                    t,
                });
                self.history
                    .note(t, None, format!("driver: w{w} wall clock {offset:+} s"));
            }
            Action::RuntimeDrop { w, rt } => {
                self.issue(w, OpKind::Other, None, &format!("rt {{op}} {rt}"));
            }
            Action::Freeze { w, ms } => {
                let t = now();
                let p = &mut self.procs[w];
                if p.frozen_until.is_none() {
                    let _ = Command::new("kill")
                        .args(["-STOP", &p.pid.to_string()])
                        .status();
                    p.frozen_at = t;
                }
                p.frozen_until = Some(p.frozen_until.unwrap_or(0).max(t + ms * MS));
                self.history.note(
                    t,
                    None,
                    format!("driver: w{w} frozen (SIGSTOP) for {ms} ms"),
                );
            }
            Action::Checkpoint => self.checkpoint(),
        }
    }

    fn finish(&mut self) {
        self.unfreeze_due(true);
        for slot in 0..self.procs.len() {
            self.send(slot, "quit");
            self.procs[slot].stdin = None;
        }
        let deadline = now() + 10 * SEC;
        for p in &mut self.procs {
            loop {
                match p.child.try_wait() {
                    Ok(Some(_)) | Err(_) => break,
                    Ok(None) if now() > deadline => {
                        let _ = p.child.kill();
                        let _ = p.child.wait();
                        break;
                    }
                    Ok(None) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
            if p.faked {
                forget_faketime(p.pid);
            }
        }
        if let Some(thread) = self.server.take() {
            let _ = thread.join();
        }
    }
}

/// What one run found.
pub struct Outcome {
    pub violations: Vec<Violation>,
    pub notices: Vec<String>,
    pub report: String,
    pub sections: usize,
    pub seconds: f64,
}

/// Runs one schedule on `store`.
pub fn run_schedule(
    sched: &Schedule,
    store: &Arc<Mutex<Store>>,
    libfaketime: Option<PathBuf>,
) -> Outcome {
    lock(store).reset();
    let (tx, rx) = channel();
    let bounds = Bounds::new(
        sched.backend,
        sched.lease_ms,
        sched.keepalive_ms,
        sched.fencing,
    );
    let name = unique_key("sched").replace(':', "-");
    let keys = (0..sched.keys).map(|k| format!("{name}:{k}")).collect();
    let origin = now();
    let mut run = Run {
        sched,
        store: Arc::clone(store),
        history: History::new(bounds, origin),
        procs: Vec::new(),
        tx,
        rx,
        next_op: 0,
        keys,
        name,
        dir: tempfile::tempdir().expect("temp dir"),
        libfaketime,
        server: None,
        step_times: Vec::new(),
        step: 0,
        stop: false,
    };
    run.history.groups = sched
        .workers
        .iter()
        .map(|w| w.providers.iter().map(|p| p.0).collect())
        .chain([vec![0]])
        .collect();
    for slot in 0..=sched.workers.len() {
        let p = run.spawn(slot, 0);
        run.procs.push(p);
        if !sched.concurrent_open {
            run.wait_ready(slot);
        }
    }
    for slot in 0..=sched.workers.len() {
        run.wait_ready(slot);
    }
    let started = now();
    run.history.origin = started;
    let mut at = started;
    for (i, step) in sched.steps.iter().enumerate() {
        if run.stop {
            break;
        }
        at = at.max(now()) + step.delay_ms * MS;
        run.tick_until(at);
        run.step = i;
        run.step_times.push(now());
        if live_trace() {
            eprintln!("{:>9} #{i} {}", run.history.rel(now()), step.action);
        }
        run.act(&step.action);
    }
    run.finish();
    // Whatever was still on its way.
    while let Ok(msg) = run.rx.try_recv() {
        run.handle(msg);
    }
    run.history.collect_notices();
    let violations = run.history.check();
    if std::env::var("DLOCK_SCHEDULE_TRACE").is_ok_and(|v| v == "1") {
        eprintln!("{}", trace(&run));
    }
    let report = if violations.is_empty() {
        String::new()
    } else {
        report(&run, &violations)
    };
    Outcome {
        sections: run.history.sections.len(),
        seconds: (now() - started) as f64 / 1e9,
        notices: run.history.notices.clone(),
        violations,
        report,
    }
}

/// `DLOCK_SCHEDULE_TRACE=live`: every step and event as it happens.
fn live_trace() -> bool {
    std::env::var("DLOCK_SCHEDULE_TRACE").is_ok_and(|v| v == "live")
}

/// The whole run: the schedule, each step, and every event.
fn trace(run: &Run<'_>) -> String {
    let h = &run.history;
    let mut out = format!("schedule: {}\n", run.sched);
    for (i, step) in run.sched.steps.iter().enumerate() {
        let t = run
            .step_times
            .get(i)
            .map_or_else(|| "-".to_owned(), |t| h.rel(*t));
        out.push_str(&format!("  #{i:<3} {t:>9}  {}\n", step.action));
    }
    for (t, k, text) in &h.log {
        let k = k.map_or_else(|| "--".to_owned(), |k| format!("k{k}"));
        out.push_str(&format!("  {:>9} {k} {text}\n", h.rel(*t)));
    }
    out
}

/// The seed, the schedule up to the first violation, and the events of the keys involved.
fn report(run: &Run<'_>, violations: &[Violation]) -> String {
    let h = &run.history;
    let first = &violations[0];
    let mut out = String::new();
    out.push_str(&format!(
        "schedule: {}\nstore: {}\n\nviolations ({}):\n",
        run.sched,
        lock(&run.store).describe(),
        violations.len()
    ));
    for v in violations.iter().take(12) {
        out.push_str(&format!("  at {}: {v}\n", h.rel(v.at)));
    }
    let last_step = run
        .step_times
        .iter()
        .rposition(|t| *t <= first.at)
        .unwrap_or(0)
        .max(
            h.sections
                .values()
                .filter(|s| s.first.is_some_and(|f| f <= first.at))
                .map(|s| s.step)
                .max()
                .unwrap_or(0),
        );
    out.push_str(&format!(
        "\nschedule prefix (steps 0..={last_step} of {}; time the step was carried out):\n",
        run.sched.steps.len()
    ));
    for (i, step) in run.sched.steps.iter().enumerate().take(last_step + 1) {
        let t = run
            .step_times
            .get(i)
            .map_or_else(|| "-".to_owned(), |t| h.rel(*t));
        out.push_str(&format!("  #{i:<3} {t:>9}  {}\n", step.action));
    }
    let mut keys: Vec<usize> = violations.iter().filter_map(|v| v.key).collect();
    keys.sort_unstable();
    keys.dedup();
    let window = first.at + 2 * SEC;
    let lines: Vec<&(u64, Option<usize>, String)> = h
        .log
        .iter()
        .filter(|(t, k, _)| *t <= window && (k.is_none() || k.is_some_and(|k| keys.contains(&k))))
        .collect();
    let shown = lines.len().saturating_sub(80);
    out.push_str(&format!(
        "\nevents of keys {keys:?} and faults up to 2 s after the first violation (times since the start, ns in the raw lines){}:\n",
        if shown > 0 {
            format!(", the last 80 of {}", lines.len())
        } else {
            String::new()
        }
    ));
    for (t, _, text) in &lines[shown..] {
        out.push_str(&format!("  {:>9}  {text}\n", h.rel(*t)));
    }
    out
}

/// splitmix64: the seed of schedule `i` of a run with base `base`.
pub fn seed_of(base: u64, i: u64) -> u64 {
    let mut z = base.wrapping_add(i.wrapping_mul(0x9e37_79b9_7f4a_7c15));
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn env_u64(name: &str) -> Option<u64> {
    let v = std::env::var(name).ok()?;
    let v = v.trim();
    let parsed = match v.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => v.parse(),
    };
    Some(parsed.unwrap_or_else(|_| panic!("{name}={v} is not a number")))
}

/// Runs the schedules of one backend as the environment says, and panics with a report on
/// the first failure (or, with `DLOCK_SCHEDULE_KEEP_GOING=1`, after all of them).
///
/// | variable | meaning |
/// |---|---|
/// | `DLOCK_SCHEDULES` | schedules per backend (default `ci_count`) |
/// | `DLOCK_SCHEDULE_SEED=backend:seed` | replays that one schedule (other backends are skipped) |
/// | `DLOCK_SCHEDULE_BASE` | base of the seeds (default: random, printed) |
/// | `DLOCK_SCHEDULE_HOLES=open` | also generates the features of [`KNOWN_HOLES`](super::plan::KNOWN_HOLES); `=RuntimeDrop,ClockStep` only those |
/// | `DLOCK_SCHEDULE_REPEAT` | runs each seed that many times |
/// | `DLOCK_SCHEDULE_KEEP_GOING=1` | runs every schedule, then reports all failures |
/// | `DLOCK_SCHEDULE_VERBOSE=1` | prints every schedule's summary |
pub fn run_backend(backend: Backend, ci_count: u64) {
    let holes = std::env::var("DLOCK_SCHEDULE_HOLES").unwrap_or_default();
    let opened = opened(&holes);
    let holes_env = if holes.is_empty() {
        String::new()
    } else {
        format!(" DLOCK_SCHEDULE_HOLES={holes}")
    };
    let keep_going = std::env::var("DLOCK_SCHEDULE_KEEP_GOING").is_ok_and(|v| v == "1");
    let verbose = std::env::var("DLOCK_SCHEDULE_VERBOSE").is_ok_and(|v| v == "1");
    let repeat = env_u64("DLOCK_SCHEDULE_REPEAT").unwrap_or(1).max(1);
    let seeds: Vec<u64> = match std::env::var("DLOCK_SCHEDULE_SEED") {
        Ok(spec) => {
            let (b, seed) = spec
                .split_once(':')
                .unwrap_or_else(|| panic!("DLOCK_SCHEDULE_SEED=backend:seed, got {spec}"));
            if Backend::parse(b) != Some(backend) {
                eprintln!(
                    "schedule test on {}: skipped (replaying {spec})",
                    backend.name()
                );
                return;
            }
            // The same seed with the same gates makes the same schedule.
            let seed = match seed.strip_prefix("0x") {
                Some(hex) => u64::from_str_radix(hex, 16),
                None => seed.parse(),
            }
            .unwrap_or_else(|_| panic!("bad seed in DLOCK_SCHEDULE_SEED={spec}"));
            vec![seed]
        }
        Err(_) => {
            let count = env_u64("DLOCK_SCHEDULES").unwrap_or(ci_count);
            let base = env_u64("DLOCK_SCHEDULE_BASE").unwrap_or_else(|| fastrand::u64(..));
            eprintln!(
                "schedule test on {}: {count} schedules, DLOCK_SCHEDULE_BASE={base}{holes_env}",
                backend.name(),
            );
            (0..count).map(|i| seed_of(base, i)).collect()
        }
    };
    let lib = libfaketime();
    if lib.is_none() {
        // Clock steps are one of the schedule's fault classes: a run without them is not run.
        dlock_testkit::not_run(
            "no libfaketime here",
            "install the Debian package `faketime`; `bash .ci/run` does",
        );
    }
    let gates = gated(backend, &opened);
    for hole in KNOWN_HOLES
        .iter()
        .filter(|h| h.backend == backend && gates.contains(&h.feature))
    {
        eprintln!(
            "schedule test on {}: {:?} left out, known hole ({}): {}",
            backend.name(),
            hole.feature,
            if hole.class == "new" {
                "found by this test".to_owned()
            } else {
                format!("issue 14 class {}", hole.class)
            },
            hole.what
        );
    }
    let store = Arc::new(Mutex::new(Store::start(backend, seeds[0])));
    let mut first = true;
    let mut failures = Vec::new();
    let mut notices: Vec<String> = Vec::new();
    let mut total = 0.0;
    let mut sections = 0;
    for &seed in &seeds {
        for attempt in 0..repeat {
            let sched = generate(backend, seed, &gates, lib.is_some());
            if backend == Backend::Redis && !first {
                // A fresh server of the seed's flavour for each schedule.
                let fresh = Store::start(backend, seed);
                *lock(&store) = fresh;
            }
            first = false;
            let outcome = run_schedule(&sched, &store, lib.clone());
            total += outcome.seconds;
            sections += outcome.sections;
            for n in &outcome.notices {
                notices.push(format!("{}:{seed}: {n}", backend.name()));
            }
            let replay = format!(
                "DLOCK_SCHEDULE_SEED={}:{seed}{holes_env} cargo test --features postgres,redis --test schedule {}",
                backend.name(),
                backend.name()
            );
            if verbose || !outcome.violations.is_empty() {
                eprintln!(
                    "schedule {}:{seed} (attempt {}): {} sections in {:.1} s, {} violations{}",
                    backend.name(),
                    attempt + 1,
                    outcome.sections,
                    outcome.seconds,
                    outcome.violations.len(),
                    outcome
                        .violations
                        .first()
                        .map_or_else(String::new, |v| format!(", first: {}", v.rule))
                );
            }
            if !outcome.violations.is_empty() {
                let text = format!(
                    "schedule test failed on {}, seed {seed}\nreplay: {replay}\n\n{}",
                    backend.name(),
                    outcome.report
                );
                if !keep_going {
                    panic!("{text}");
                }
                eprintln!("{text}");
                let rules: Vec<&str> = outcome.violations.iter().map(|v| v.rule).collect();
                failures.push(format!("{}:{seed} {rules:?}", backend.name()));
            }
        }
    }
    eprintln!(
        "schedule test on {}: {} schedules, {sections} sections, {total:.1} s, {} failed, {} notices",
        backend.name(),
        seeds.len() as u64 * repeat,
        failures.len(),
        notices.len()
    );
    for n in notices.iter().take(20) {
        eprintln!("  notice: {n}");
    }
    assert!(
        failures.is_empty(),
        "failing schedules:\n{}",
        failures.join("\n")
    );
}
