//! The reference model of a lock, and the checker that holds a run's history against it.
//!
//! # What is recorded
//!
//! Every time comes from one clock: `CLOCK_MONOTONIC`, read through the vDSO (`rustix`) in
//! the workers and in the driver. All processes of the machine share it, it never steps, and
//! libfaketime (which intercepts libc's `clock_gettime` and is told not to fake the monotonic
//! clock anyway) cannot shift it. So times from different processes compare directly.
//!
//! A *section* is one guard's life. The checker never uses the moment an acquisition returned
//! as the start of a hold, nor the moment a lost token fired as its end: both are known only
//! approximately. It uses two kinds of exact facts instead:
//!
//! - **alive at `t`**: the worker read the clock (`t`), and *then* found the guard not released
//!   and `is_lost()` false. The lost token never un-fires, so at `t` the holder believed it
//!   held the lock. The first such time (`first`, read right after `acquire` returned) and the
//!   last (`last`: every 2 ms while the guard is held, reported every 25 ms, with the last one
//!   attached to the `lost`, `release` and `drop` events) bound an interval during which the
//!   holder believed, without a gap, that it held the lock.
//! - **may hold until `t`**: an upper bound on when the store may still have held the lock for
//!   a section or for an abandoned acquisition (the smallest that applies; margin = 1.5 s):
//!
//!   | end | lease stores (SQLite, Redis) | session stores (PostgreSQL) |
//!   |---|---|---|
//!   | `release` returned `Ok` (or the transaction ended) | its return | its return |
//!   | `release` future dropped midway, guard dropped | + margin | + margin |
//!   | `release` failed | + lease + margin | + keepalive bound + margin |
//!   | process killed, runtime dropped | + lease + margin | + margin |
//!   | loss heard | + lease + margin | + lease (0) + margin |
//!   | acquisition timed out, cancelled or dropped | + margin | + margin |
//!   | acquisition failed otherwise, or its process or runtime died | + lease + margin | + margin |
//!   | server restarted after the grant | back up + margin | back up + margin |
//!   | its session killed by the server | — | kill + margin |
//!
//! # The rules
//!
//! 1. **At most one holder, and a loss is heard before another holder exists.** Two sections
//!    of one key whose alive intervals overlap are two holders that each believed they held
//!    the key at one same moment: a violation, with no tolerance needed, because both
//!    intervals lie inside the true beliefs. A holder that hears of its loss late shows up the
//!    same way: it is alive, by its own reports, after the other holder's first alive time.
//!    The watcher polls every 2 ms, so a late hearing is seen when it comes at least one poll
//!    after the other holder's first check; one that comes within the same couple of
//!    milliseconds can pass unseen (never the reverse: nothing innocent is reported).
//!
//!    One exception, the documented limit of session stores: when the server ends a session
//!    (`pg_terminate_backend` of a worker's connections, or a shutdown, which ends the
//!    sessions one by one and may grant a waiting session the lock of one it has ended), it
//!    frees that session's locks at once, and the holder can only learn of it at its next
//!    liveness check (keepalive + 1 s). An overlap between such a victim and a section that
//!    began after the fault began is excused while the victim's last alive time is within
//!    that bound of the fault (moved by the time the victim's process was frozen, since a
//!    frozen process checks nothing); the victim must still have heard by then (rule 2).
//! 2. **Losses are heard within the bound** when the driver kills the server or a worker's
//!    connections: every section that was alive before the fault must have no alive time later
//!    than the fault plus keepalive + 1.5 s (PostgreSQL) or the lease (Redis). The server is
//!    kept down at least that long, so that a holder that hears in time never overlaps the
//!    next one.
//! 3. **Fencing tokens.** Every granted acquisition has a token when the backend issues them
//!    (SQLite always, PostgreSQL with `fencing=true`, Redis unless `fencing=false`) and none
//!    otherwise; no token repeats for a key; and ordered by their first alive time, the tokens
//!    of a key's sections strictly increase. Redis tokens restart with an empty server after a
//!    restart (documented), so Redis tokens are compared within one server lifetime.
//! 4. **No key stranded.** At each checkpoint the driver waits for every operation, releases
//!    every guard, and then has a probe process acquire each key, with a timeout that ends a
//!    second after the latest "may hold until" of the key: a probe that times out found the key
//!    stranded.
//!
//! And the operations keep their word: a `release` after a reported loss answers `Lost`, a
//! `Timeout` comes no earlier than the timeout (and no later than 3 s after it), a cancelled
//! wait ends no earlier than its token fired (and within 3 s), and nothing hangs.

use std::collections::BTreeMap;
use std::fmt;

use super::plan::{Backend, Mode};

pub const MS: u64 = 1_000_000;

/// How long after its thaw a frozen worker may take to report an answer that arrived while it
/// was frozen (it reads the answer first thing; the report crosses a pipe to the driver).
const THAW_REPORT: u64 = 50 * MS;
pub const SEC: u64 = 1_000 * MS;

/// The bounds a backend promises, in ns.
#[derive(Debug, Clone, Copy)]
pub struct Bounds {
    pub backend: Backend,
    /// The lease of lease stores (0 for session stores).
    pub lease: u64,
    /// How soon a holder hears of a loss the driver caused: keepalive + ping timeout (1 s) +
    /// 0.5 s on PostgreSQL; the lease on Redis and SQLite.
    pub detect: u64,
    /// What a release in the background, a cancelled or abandoned acquisition's clean-up, or a
    /// server freeing a dead session may take.
    pub margin: u64,
    /// How late past its timeout or cancellation an acquisition may answer.
    pub prompt: u64,
    /// How long past its timeout any operation may take before it counts as hung.
    pub hang: u64,
    /// Whether the store issues fencing tokens.
    pub fencing: bool,
}

impl Bounds {
    pub fn new(backend: Backend, lease_ms: u64, keepalive_ms: u64, fencing: bool) -> Bounds {
        let lease = if backend.leases() { lease_ms * MS } else { 0 };
        Bounds {
            backend,
            lease,
            detect: if backend.leases() {
                lease
            } else {
                keepalive_ms * MS + 1_500 * MS
            },
            margin: 1_500 * MS,
            prompt: 3 * SEC,
            hang: 15 * SEC,
            fencing: fencing || backend == Backend::Sqlite,
        }
    }

    /// What may follow an end the store was not told of: the lease on lease stores.
    fn unreleased(&self) -> u64 {
        self.margin + self.lease
    }
}

/// How a section ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum End {
    /// `release` (or a transaction's end) began at `t0` and returned `outcome` at `t1`.
    Released { outcome: String, t0: u64, t1: u64 },
    /// The guard was dropped at `t1`.
    Dropped { t1: u64 },
    /// The process was killed; it was gone at `t`.
    Killed { t: u64 },
    /// The guard's runtime was shut down by `t`.
    RuntimeDropped { t: u64 },
}

/// One guard's life.
#[derive(Debug, Clone)]
pub struct Section {
    pub gid: u64,
    pub worker: usize,
    pub generation: u32,
    pub key: usize,
    /// The schedule step that started the acquisition.
    pub step: usize,
    /// The provider and runtime it was taken through (`p1 rt0`).
    pub via: String,
    /// A transaction-bound lock.
    pub tx: bool,
    pub token: Option<u64>,
    /// The acquisition began (`start`) and returned (`granted`).
    pub start: u64,
    pub granted: u64,
    /// First and last times the holder was seen alive; `None` when it was lost at once.
    pub first: Option<u64>,
    pub last: Option<u64>,
    /// When the watcher saw the lost token fired.
    pub heard: Option<u64>,
    pub end: Option<End>,
}

impl Section {
    fn label(&self) -> String {
        format!(
            "guard {} (w{}/{} {}{})",
            self.gid,
            self.worker,
            self.generation,
            self.via,
            if self.tx { ", transaction lock" } else { "" }
        )
    }
}

/// An acquisition that ended without a guard but may have left the lock taken for a while.
#[derive(Debug, Clone)]
pub struct Ghost {
    pub key: usize,
    pub op: u64,
    /// When it ended.
    pub at: u64,
    /// Whether the store may keep it until a lease runs out (a process or runtime that died
    /// with it, or a store error), rather than for the clean-up margin.
    pub lease: bool,
}

/// A fault the driver applied, with the times it began and was complete. (Some fields are
/// read only through `Debug`, in reports.)
#[derive(Debug, Clone)]
#[allow(dead_code)]
pub enum Fault {
    Kill {
        worker: usize,
        generation: u32,
        t0: u64,
        t1: u64,
    },
    ConnKill {
        worker: usize,
        generation: u32,
        t0: u64,
        t1: u64,
    },
    /// The server went down at `t0`..`t1` and was back at `up` (`None` while it is down).
    Server {
        t0: u64,
        t1: u64,
        up: Option<u64>,
    },
    Freeze {
        worker: usize,
        generation: u32,
        t0: u64,
        t1: u64,
    },
    Clock {
        worker: usize,
        offset: i64,
        t: u64,
    },
    RuntimeDrop {
        worker: usize,
        generation: u32,
        t0: u64,
        t1: u64,
    },
}

/// The kind of an operation the driver asked of a worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpKind {
    Acquire(Mode),
    Tx,
    Release,
    Other,
}

/// One operation the driver asked of a worker.
#[derive(Debug, Clone)]
pub struct Op {
    pub id: u64,
    pub step: usize,
    pub worker: usize,
    pub generation: u32,
    /// The provider and runtime of an acquisition (`p1 rt0`).
    pub via: String,
    pub key: Option<usize>,
    pub kind: OpKind,
    /// The driver's time when it sent the command.
    pub issued: u64,
    /// The worker's start and end times, once reported.
    pub started: Option<u64>,
    pub done: Option<u64>,
    /// The error code of a failed acquisition.
    pub outcome: Option<String>,
    /// Its process or runtime died before it reported.
    pub void: bool,
}

impl Op {
    /// When the driver gives up waiting for it.
    pub fn deadline(&self, bounds: &Bounds) -> u64 {
        let timeout = match self.kind {
            OpKind::Acquire(mode) => mode.timeout_ms() * MS,
            _ => 0,
        };
        self.issued + timeout + bounds.hang
    }
}

/// A broken rule.
#[derive(Debug, Clone)]
pub struct Violation {
    pub rule: &'static str,
    /// When it happened (or became certain).
    pub at: u64,
    pub key: Option<usize>,
    pub message: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "[{}] {}", self.rule, self.message)
    }
}

/// Everything that happened in one run.
#[derive(Debug)]
pub struct History {
    pub bounds: Bounds,
    /// The time the run began; messages show times relative to it.
    pub origin: u64,
    pub sections: BTreeMap<u64, Section>,
    pub ghosts: Vec<Ghost>,
    pub faults: Vec<Fault>,
    pub ops: BTreeMap<u64, Op>,
    /// Violations found while running (stranded keys, hangs, worker failures).
    pub online: Vec<Violation>,
    /// Things worth knowing that break no rule (a store error while nothing was disturbed).
    pub notices: Vec<String>,
    /// Every event and fault, for the report: time, key (if any), text.
    pub log: Vec<(u64, Option<usize>, String)>,
    /// Per worker, the backend group of each provider (for the hints of a report).
    pub groups: Vec<Vec<usize>>,
}

fn parse_time(word: &str) -> Option<u64> {
    word.parse().ok()
}

fn parse_alive(word: &str) -> Result<Option<u64>, String> {
    if word == "-" {
        Ok(None)
    } else {
        parse_time(word)
            .map(Some)
            .ok_or_else(|| format!("bad time `{word}`"))
    }
}

impl History {
    pub fn new(bounds: Bounds, origin: u64) -> History {
        History {
            bounds,
            origin,
            sections: BTreeMap::new(),
            ghosts: Vec::new(),
            faults: Vec::new(),
            ops: BTreeMap::new(),
            online: Vec::new(),
            notices: Vec::new(),
            log: Vec::new(),
            groups: Vec::new(),
        }
    }

    /// `t` as seconds since the run began.
    pub fn rel(&self, t: u64) -> String {
        format!("{:.3}s", t.saturating_sub(self.origin) as f64 / 1e9)
    }

    pub fn note(&mut self, t: u64, key: Option<usize>, text: String) {
        self.log.push((t, key, text));
    }

    /// Records an operation the driver is about to send.
    pub fn issue(&mut self, op: Op) {
        self.ops.insert(op.id, op);
    }

    fn ghost(&mut self, op: u64, at: u64, lease: bool) {
        if let Some(key) = self.ops.get(&op).and_then(|o| o.key) {
            self.ghosts.push(Ghost { key, op, at, lease });
        }
    }

    /// Applies one line a worker printed. Unknown operations (of an older process) are
    /// ignored; malformed lines are errors.
    pub fn apply(&mut self, worker: usize, generation: u32, line: &str) -> Result<(), String> {
        let words: Vec<&str> = line.split_whitespace().collect();
        let bad = || format!("w{worker}/{generation}: malformed `{line}`");
        let time = |w: &str| parse_time(w).ok_or_else(bad);
        let id = |w: &str| w.parse::<u64>().map_err(|_| bad());
        let key_of = |h: &History, op: u64| h.ops.get(&op).and_then(|o| o.key);
        match words.as_slice() {
            ["ready", ..] => {}
            ["acq", op, "ok", t0, t1, alive, token] => {
                let (op, t0, t1) = (id(op)?, time(t0)?, time(t1)?);
                let alive = parse_alive(alive)?;
                let token = if *token == "-" {
                    None
                } else {
                    Some(token.parse().map_err(|_| bad())?)
                };
                let Some(o) = self.ops.get_mut(&op) else {
                    return Ok(());
                };
                o.started = Some(t0);
                // A transaction lock's operation runs on until the transaction ends.
                if o.kind != OpKind::Tx {
                    o.done = Some(t1);
                }
                let section = Section {
                    gid: op,
                    worker,
                    generation,
                    key: o.key.unwrap_or(0),
                    step: o.step,
                    via: o.via.clone(),
                    tx: o.kind == OpKind::Tx,
                    token,
                    start: t0,
                    granted: t1,
                    first: alive,
                    last: alive,
                    heard: None,
                    end: None,
                };
                let key = section.key;
                self.sections.insert(op, section);
                self.note(t1, Some(key), format!("w{worker}: {line}"));
            }
            ["acq", op, "err", kind, t0, t1] => {
                let (op, t0, t1) = (id(op)?, time(t0)?, time(t1)?);
                let key = key_of(self, op);
                let Some(o) = self.ops.get_mut(&op) else {
                    return Ok(());
                };
                o.started = Some(t0);
                o.done = Some(t1);
                o.outcome = Some((*kind).to_owned());
                match *kind {
                    "AlreadyHeld" => {}
                    "Timeout" | "Canceled" => self.ghost(op, t1, false),
                    _ => self.ghost(op, t1, true),
                }
                self.note(t1, key, format!("w{worker}: {line}"));
            }
            ["acq", op, "abandoned", t0, t1] => {
                let (op, t0, t1) = (id(op)?, time(t0)?, time(t1)?);
                let key = key_of(self, op);
                let Some(o) = self.ops.get_mut(&op) else {
                    return Ok(());
                };
                o.started = Some(t0);
                o.done = Some(t1);
                o.outcome = Some("abandoned".to_owned());
                self.ghost(op, t1, false);
                self.note(t1, key, format!("w{worker}: {line}"));
            }
            ["alive", gid, t] => {
                let (gid, t) = (id(gid)?, time(t)?);
                if let Some(s) = self.sections.get_mut(&gid) {
                    s.last = s.last.max(Some(t));
                    s.first = s.first.or(Some(t));
                }
            }
            ["lost", gid, alive, t] => {
                let (gid, t) = (id(gid)?, time(t)?);
                let alive = parse_alive(alive)?;
                let mut key = None;
                if let Some(s) = self.sections.get_mut(&gid) {
                    s.last = s.last.max(alive);
                    s.heard = Some(t);
                    key = Some(s.key);
                }
                self.note(t, key, format!("w{worker}: {line}"));
            }
            [ev @ ("rel" | "relx"), op, gid, outcome, alive, t0, t1] => {
                let (op, gid, t0, t1) = (id(op)?, id(gid)?, time(t0)?, time(t1)?);
                let alive = parse_alive(alive)?;
                if let Some(o) = self.ops.get_mut(&op) {
                    o.started = Some(t0);
                    o.done = Some(t1);
                    o.outcome = Some((*outcome).to_owned());
                }
                let mut key = None;
                if let Some(s) = self.sections.get_mut(&gid) {
                    s.last = s.last.max(alive);
                    let outcome = if *ev == "relx" && *outcome == "abandoned" {
                        "abandoned".to_owned()
                    } else {
                        (*outcome).to_owned()
                    };
                    s.end = Some(End::Released { outcome, t0, t1 });
                    key = Some(s.key);
                }
                self.note(t1, key, format!("w{worker}: {line}"));
            }
            ["drop", op, gid, alive, t0, t1] => {
                let (op, gid, t0, t1) = (id(op)?, id(gid)?, time(t0)?, time(t1)?);
                let alive = parse_alive(alive)?;
                if let Some(o) = self.ops.get_mut(&op) {
                    o.started = Some(t0);
                    o.done = Some(t1);
                }
                let mut key = None;
                if let Some(s) = self.sections.get_mut(&gid) {
                    s.last = s.last.max(alive);
                    s.end = Some(End::Dropped { t1 });
                    key = Some(s.key);
                }
                self.note(t1, key, format!("w{worker}: {line}"));
            }
            ["none", op, t] => {
                let (op, t) = (id(op)?, time(t)?);
                if let Some(o) = self.ops.get_mut(&op) {
                    o.started = Some(t);
                    o.done = Some(t);
                }
            }
            ["rt", op, r, t0, t1, gids, ops] => {
                let (op, t0, t1) = (id(op)?, time(t0)?, time(t1)?);
                let list = |w: &str, prefix: &str| -> Result<Vec<u64>, String> {
                    let w = w.strip_prefix(prefix).ok_or_else(bad)?;
                    if w == "-" {
                        return Ok(Vec::new());
                    }
                    w.split(',').map(|x| x.parse().map_err(|_| bad())).collect()
                };
                if let Some(o) = self.ops.get_mut(&op) {
                    o.started = Some(t0);
                    o.done = Some(t1);
                }
                for gid in list(gids, "g:")? {
                    if let Some(s) = self.sections.get_mut(&gid)
                        && s.end.is_none()
                    {
                        s.end = Some(End::RuntimeDropped { t: t1 });
                    }
                }
                for dead in list(ops, "o:")? {
                    let acquiring = self
                        .ops
                        .get(&dead)
                        .is_some_and(|o| matches!(o.kind, OpKind::Acquire(_)));
                    if let Some(o) = self.ops.get_mut(&dead) {
                        o.void = true;
                    }
                    if acquiring {
                        self.ghost(dead, t1, true);
                    }
                }
                self.faults.push(Fault::RuntimeDrop {
                    worker,
                    generation,
                    t0,
                    t1,
                });
                let _ = r;
                self.note(t1, None, format!("w{worker}: {line}"));
            }
            ["fail", ..] => {
                let at = self.log.last().map_or(self.origin, |l| l.0);
                self.online.push(Violation {
                    rule: "worker failed",
                    at,
                    key: None,
                    message: format!("w{worker}/{generation}: {line}"),
                });
            }
            _ => return Err(bad()),
        }
        Ok(())
    }

    /// The process `worker`/`generation` was killed by `t1`: its sections end, its unfinished
    /// operations are void.
    pub fn killed(&mut self, worker: usize, generation: u32, t0: u64, t1: u64) {
        for s in self.sections.values_mut() {
            if s.worker == worker && s.generation == generation && s.end.is_none() {
                s.end = Some(End::Killed { t: t1 });
            }
        }
        let dead: Vec<u64> = self
            .ops
            .values()
            .filter(|o| o.worker == worker && o.generation == generation && o.done.is_none())
            .map(|o| o.id)
            .collect();
        for op in dead {
            let acquiring = self
                .ops
                .get(&op)
                .is_some_and(|o| matches!(o.kind, OpKind::Acquire(_) | OpKind::Tx));
            if let Some(o) = self.ops.get_mut(&op) {
                o.void = true;
            }
            if acquiring {
                self.ghost(op, t1, true);
            }
        }
        self.faults.push(Fault::Kill {
            worker,
            generation,
            t0,
            t1,
        });
    }

    /// The latest time the store may hold `s`'s lock.
    pub fn may_hold_until(&self, s: &Section) -> u64 {
        let b = &self.bounds;
        let mut until = match &s.end {
            None => u64::MAX,
            Some(End::Released { outcome, t1, .. }) => match outcome.as_str() {
                "ok" | "rolledback" => *t1,
                "abandoned" => t1 + b.margin,
                _ if b.backend.leases() => t1 + b.unreleased(),
                _ => t1 + b.margin + b.detect,
            },
            Some(End::Dropped { t1 }) => t1 + b.margin,
            Some(End::Killed { t }) | Some(End::RuntimeDropped { t }) => t + b.unreleased(),
        };
        if let Some(heard) = s.heard {
            until = until.min(heard + b.unreleased());
        }
        for fault in &self.faults {
            match *fault {
                Fault::Server {
                    t1, up: Some(up), ..
                } if s.granted <= t1 => {
                    until = until.min(up + b.margin);
                }
                Fault::ConnKill {
                    worker,
                    generation,
                    t0,
                    t1,
                } if b.backend == Backend::Postgres
                    && worker == s.worker
                    && generation == s.generation
                    && s.granted <= t0 =>
                {
                    until = until.min(t1 + b.margin);
                }
                _ => {}
            }
        }
        until
    }

    fn ghost_until(&self, g: &Ghost) -> u64 {
        let b = &self.bounds;
        let mut until = g.at + if g.lease { b.unreleased() } else { b.margin };
        for fault in &self.faults {
            if let Fault::Server {
                t1, up: Some(up), ..
            } = *fault
                && g.at <= t1
            {
                until = until.min(up + b.margin);
            }
        }
        until
    }

    /// The latest time any earlier holder or acquisition may keep `key` taken, and what it is.
    pub fn free_by(&self, key: usize) -> (u64, String) {
        let mut latest = (0, "nothing".to_owned());
        for s in self.sections.values().filter(|s| s.key == key) {
            let until = self.may_hold_until(s);
            if until > latest.0 {
                latest = (until, format!("{} (end {:?})", s.label(), s.end));
            }
        }
        for g in self.ghosts.iter().filter(|g| g.key == key) {
            let until = self.ghost_until(g);
            if until > latest.0 {
                latest = (until, format!("abandoned acquisition {}", g.op));
            }
        }
        latest
    }

    /// Whether `[a, b]` meets a window in which the store or this worker could not answer
    /// promptly (server down, connections killed, the worker frozen; on SQLite any frozen
    /// worker, which may hold the file's write lock).
    fn disturbed(&self, worker: usize, generation: u32, a: u64, b: u64) -> bool {
        let meets = |x: u64, y: u64| a <= y && x <= b;
        self.faults.iter().any(|f| match *f {
            Fault::Server { t0, up, .. } => {
                meets(t0, up.unwrap_or(u64::MAX).saturating_add(2 * SEC))
            }
            Fault::ConnKill { t0, t1, .. } => meets(t0, t1 + 2 * SEC),
            Fault::Freeze {
                worker: w,
                generation: g,
                t0,
                t1,
            } => {
                (self.bounds.backend == Backend::Sqlite || (w == worker && g == generation))
                    && meets(t0, t1 + SEC)
            }
            Fault::Kill { t0, t1, .. } => {
                self.bounds.backend == Backend::Sqlite && meets(t0, t1 + SEC)
            }
            _ => false,
        })
    }

    /// Checks the whole history against the model.
    pub fn check(&self) -> Vec<Violation> {
        let mut found = self.online.clone();
        let keys: Vec<usize> = {
            let mut k: Vec<usize> = self.sections.values().map(|s| s.key).collect();
            k.sort_unstable();
            k.dedup();
            k
        };
        for key in keys {
            self.check_exclusion(key, &mut found);
            self.check_tokens(key, &mut found);
        }
        self.check_hearing(&mut found);
        self.check_operations(&mut found);
        found.sort_by_key(|v| v.at);
        found
    }

    /// Rule 1: no two alive intervals of one key overlap.
    fn check_exclusion(&self, key: usize, found: &mut Vec<Violation>) {
        let mut alive: Vec<&Section> = self
            .sections
            .values()
            .filter(|s| s.key == key && s.first.is_some())
            .collect();
        alive.sort_by_key(|s| s.first);
        for (i, a) in alive.iter().enumerate() {
            let (a_first, a_last) = (a.first.unwrap_or(0), a.last.unwrap_or(0));
            for b in &alive[i + 1..] {
                let (b_first, b_last) = (b.first.unwrap_or(0), b.last.unwrap_or(0));
                if b_first > a_last {
                    continue;
                }
                // The victim of a killed session may be either: one frozen while its grant
                // waited reports that grant after the next holder's first alive time.
                if self.excused(a, b_first) || self.excused(b, a_first) {
                    continue;
                }
                found.push(Violation {
                    rule: "two holders",
                    at: b_first,
                    key: Some(key),
                    message: format!(
                        "key k{key}: {} (token {}) was alive {}..{}{} while {} (token {}) was \
                         alive {}..{}{}: both held the key from {} to {}{}",
                        a.label(),
                        token(a.token),
                        self.rel(a_first),
                        self.rel(a_last),
                        self.heard_text(a),
                        b.label(),
                        token(b.token),
                        self.rel(b_first),
                        self.rel(b_last),
                        self.heard_text(b),
                        self.rel(b_first),
                        self.rel(a_last.min(b_last)),
                        self.hints(a, b),
                    ),
                });
            }
        }
    }

    /// What the two holders had been through: the faults and settings that may explain an
    /// overlap (they are hints for the reader, not part of the verdict).
    fn hints(&self, a: &Section, b: &Section) -> String {
        let mut hints = Vec::new();
        let provider = |s: &Section| -> Option<usize> {
            let p: usize = s.via.strip_prefix('p')?.split(' ').next()?.parse().ok()?;
            self.groups.get(s.worker)?.get(p).copied()
        };
        if a.worker == b.worker && a.generation == b.generation && !a.tx && !b.tx {
            if provider(a).is_some() && provider(a) == provider(b) {
                hints.push(format!(
                    "both in w{} on clones of one backend (issue 14 class 1)",
                    a.worker
                ));
            } else {
                hints.push(format!("both in w{}, on separate backends", a.worker));
            }
        }
        let until = b.first.unwrap_or(0);
        for f in &self.faults {
            match *f {
                Fault::Clock { worker, offset, t } if t <= until => {
                    let last = self.faults.iter().rev().find_map(|g| match *g {
                        Fault::Clock {
                            worker: w,
                            offset: o,
                            t: tt,
                        } if w == worker && tt <= until => Some((o, tt)),
                        _ => None,
                    });
                    let involved = worker == a.worker || worker == b.worker;
                    if involved && last == Some((offset, t)) && offset != 0 {
                        hints.push(format!(
                            "w{worker}'s wall clock at {offset:+} s since {}{}",
                            self.rel(t),
                            if self.bounds.backend == Backend::Sqlite {
                                " (class 6)"
                            } else {
                                ""
                            }
                        ));
                    }
                }
                Fault::RuntimeDrop {
                    worker,
                    generation,
                    t0,
                    ..
                } if worker == a.worker
                    && generation == a.generation
                    && t0 <= until
                    && t0 >= a.granted =>
                {
                    hints.push(format!(
                        "a runtime of w{worker} was dropped at {} (class 4)",
                        self.rel(t0)
                    ));
                }
                Fault::Freeze {
                    worker,
                    generation,
                    t0,
                    t1,
                } if ((worker == a.worker && generation == a.generation)
                    || (worker == b.worker && generation == b.generation))
                    && t0 <= until + SEC
                    && t1 + SEC >= a.granted =>
                {
                    hints.push(format!(
                        "w{worker} was frozen {}..{}",
                        self.rel(t0),
                        self.rel(t1)
                    ));
                }
                Fault::Server { t0, up, .. } if t0 <= until && t0 + 10 * SEC >= a.granted => {
                    hints.push(format!(
                        "the server stopped at {} (back at {})",
                        self.rel(t0),
                        up.map_or_else(|| "-".to_owned(), |u| self.rel(u))
                    ));
                }
                Fault::ConnKill { worker, t0, .. } if t0 <= until && t0 + 10 * SEC >= a.granted => {
                    hints.push(format!(
                        "w{worker}'s connections were killed at {}",
                        self.rel(t0)
                    ));
                }
                _ => {}
            }
        }
        hints.dedup();
        if hints.is_empty() {
            String::new()
        } else {
            format!(" [hints: {}]", hints.join("; "))
        }
    }

    fn heard_text(&self, s: &Section) -> String {
        match s.heard {
            Some(h) => format!(", heard lost at {}", self.rel(h)),
            None => String::new(),
        }
    }

    /// How long `worker`/`generation` was frozen within `[from, to]`: on session stores a
    /// frozen holder cannot run its liveness check, so its bound to hear of a loss moves by
    /// that much. (Lease stores keep a local deadline that a stall does not move: there a
    /// holder must find its lock lost as soon as it runs again.)
    fn session_stall(&self, worker: usize, generation: u32, from: u64, to: u64) -> u64 {
        if self.bounds.backend.leases() {
            return 0;
        }
        self.faults
            .iter()
            .map(|f| match *f {
                Fault::Freeze {
                    worker: w,
                    generation: g,
                    t0,
                    t1,
                } if w == worker && g == generation => t1.min(to).saturating_sub(t0.max(from)),
                _ => 0,
            })
            .sum()
    }

    /// Whether `a`'s belief past `later` is the documented limit of a killed session: the
    /// server ended `a`'s session (its connections were killed, or the server shut down, which
    /// ends the sessions one by one and may grant a waiting session the lock of one it ended)
    /// and `a` heard within the bound.
    fn excused(&self, a: &Section, later: u64) -> bool {
        if self.bounds.backend != Backend::Postgres {
            return false;
        }
        let last = a.last.unwrap_or(0);
        // The grant is the one the worker reports: frozen while its answer waited, the worker
        // reports it at the thaw, though the server granted it before the fault (on the
        // session the fault then ended). So a grant reported after the fault counts as before
        // it when the worker was frozen from the fault's end until a moment before the report.
        let granted_by = |t1: u64| {
            a.start <= t1
                && a.granted
                    <= t1 + self.session_stall(a.worker, a.generation, t1, a.granted) + THAW_REPORT
        };
        let within = |t0: u64, t1: u64| {
            granted_by(t1)
                && later >= t0
                && last
                    <= t1
                        + self.bounds.detect
                        + self.session_stall(a.worker, a.generation, t0, last)
        };
        self.faults.iter().any(|f| match *f {
            Fault::ConnKill {
                worker,
                generation,
                t0,
                t1,
            } => worker == a.worker && generation == a.generation && within(t0, t1),
            Fault::Server { t0, t1, .. } => within(t0, t1),
            _ => false,
        })
    }

    /// Rule 3: tokens present, distinct, and increasing in the order the holds began.
    fn check_tokens(&self, key: usize, found: &mut Vec<Violation>) {
        let sections: Vec<&Section> = self.sections.values().filter(|s| s.key == key).collect();
        for s in &sections {
            let expected = self.bounds.fencing || s.tx;
            if s.token.is_some() != expected {
                found.push(Violation {
                    rule: "fencing token presence",
                    at: s.granted,
                    key: Some(key),
                    message: format!(
                        "key k{key}: {} was granted {} a fencing token, the backend {} issue them",
                        s.label(),
                        if s.token.is_some() { "with" } else { "without" },
                        if expected { "does" } else { "does not" }
                    ),
                });
            }
        }
        // Redis tokens restart with an empty server: compare within one server lifetime, and
        // leave out grants made while the server went down or came back.
        let epoch = |s: &Section| -> Option<usize> {
            if self.bounds.backend != Backend::Redis {
                return Some(0);
            }
            let mut epoch = 0;
            for f in &self.faults {
                if let Fault::Server { t0, up, .. } = *f {
                    let up = up.unwrap_or(u64::MAX);
                    if s.granted >= t0 && s.start <= up {
                        return None;
                    }
                    if s.start > up {
                        epoch += 1;
                    }
                }
            }
            Some(epoch)
        };
        let mut by_epoch: BTreeMap<usize, Vec<&Section>> = BTreeMap::new();
        for s in sections.iter().filter(|s| s.token.is_some()) {
            if let Some(e) = epoch(s) {
                by_epoch.entry(e).or_default().push(s);
            }
        }
        for list in by_epoch.values() {
            let mut seen: BTreeMap<u64, &Section> = BTreeMap::new();
            for s in list {
                let t = s.token.unwrap_or(0);
                if let Some(other) = seen.get(&t) {
                    found.push(Violation {
                        rule: "fencing token repeated",
                        at: s.granted.max(other.granted),
                        key: Some(key),
                        message: format!(
                            "key k{key}: fencing token {t} was handed to {} (granted {}) and to {} (granted {})",
                            other.label(),
                            self.rel(other.granted),
                            s.label(),
                            self.rel(s.granted)
                        ),
                    });
                } else {
                    seen.insert(t, s);
                }
            }
            let mut alive: Vec<&&Section> = list.iter().filter(|s| s.first.is_some()).collect();
            alive.sort_by_key(|s| s.first);
            for pair in alive.windows(2) {
                let (a, b) = (pair[0], pair[1]);
                if b.token < a.token {
                    found.push(Violation {
                        rule: "fencing token order",
                        at: b.first.unwrap_or(0),
                        key: Some(key),
                        message: format!(
                            "key k{key}: {} began holding at {} with token {}, after {} began at {} \
                             with the larger token {}: either the store reordered tokens, or one \
                             guard was alive after its lock had ended",
                            b.label(),
                            self.rel(b.first.unwrap_or(0)),
                            token(b.token),
                            a.label(),
                            self.rel(a.first.unwrap_or(0)),
                            token(a.token)
                        ),
                    });
                }
            }
        }
    }

    /// Rule 2: holders hear of losses the driver caused within the bound.
    fn check_hearing(&self, found: &mut Vec<Violation>) {
        let b = &self.bounds;
        for f in &self.faults {
            // The process whose sections are victims (`None`: every process).
            let (victims, t0, t1, what) = match *f {
                Fault::Server { t0, t1, .. } => (None, t0, t1, "the server stopped"),
                Fault::ConnKill {
                    worker,
                    generation,
                    t0,
                    t1,
                } if b.backend == Backend::Postgres => (
                    Some((worker, generation)),
                    t0,
                    t1,
                    "its connections were killed",
                ),
                _ => continue,
            };
            for s in self.sections.values() {
                let victim = victims.is_none_or(|v| v == (s.worker, s.generation));
                if !victim || s.granted > t0 {
                    continue;
                }
                // Ended before the fault: nothing to hear.
                let ended = match &s.end {
                    Some(End::Released { t0: e, .. }) => Some(*e),
                    Some(End::Dropped { t1: e }) => Some(*e),
                    Some(End::Killed { t: e }) | Some(End::RuntimeDropped { t: e }) => Some(*e),
                    None => None,
                };
                if ended.is_some_and(|e| e < t0) {
                    continue;
                }
                if let Some(last) = s.last
                    && last > t1 + b.detect + self.session_stall(s.worker, s.generation, t0, last)
                {
                    found.push(Violation {
                        rule: "loss not heard in time",
                        at: t1 + b.detect,
                        key: Some(s.key),
                        message: format!(
                            "key k{}: {} was still alive at {}, {} ms after {} at {} (bound {} ms)",
                            s.key,
                            s.label(),
                            self.rel(last),
                            (last - t1) / MS,
                            what,
                            self.rel(t1),
                            b.detect / MS
                        ),
                    });
                }
            }
        }
        for s in self.sections.values() {
            if let (Some(heard), Some(End::Released { outcome, t0, .. })) = (s.heard, &s.end)
                && heard < *t0
                && outcome == "ok"
            {
                found.push(Violation {
                    rule: "release after a loss",
                    at: *t0,
                    key: Some(s.key),
                    message: format!(
                        "key k{}: {} heard of its loss at {}, and its release at {} returned Ok",
                        s.key,
                        s.label(),
                        self.rel(heard),
                        self.rel(*t0)
                    ),
                });
            }
        }
    }

    /// Store errors on acquisitions that met no fault.
    pub fn collect_notices(&mut self) {
        let mut notices = Vec::new();
        for op in self.ops.values() {
            let (Some(t0), Some(t1), Some(outcome)) = (op.started, op.done, op.outcome.as_deref())
            else {
                continue;
            };
            if matches!(
                outcome,
                "AlreadyHeld" | "Timeout" | "Canceled" | "abandoned" | "ok" | "rolledback" | "Lost"
            ) {
                continue;
            }
            if !self.disturbed(op.worker, op.generation, t0, t1) {
                notices.push(format!(
                    "operation {} (step {}, w{}/{} {}) answered {outcome} at {} with no fault near",
                    op.id,
                    op.step,
                    op.worker,
                    op.generation,
                    op.via,
                    self.rel(t1)
                ));
            }
        }
        self.notices = notices;
    }

    /// Timeouts and cancellations answer neither early nor late.
    fn check_operations(&self, found: &mut Vec<Violation>) {
        for op in self.ops.values() {
            let (OpKind::Acquire(mode), Some(t0), Some(t1), Some(outcome)) =
                (op.kind, op.started, op.done, op.outcome.as_deref())
            else {
                continue;
            };
            let took = t1 - t0;
            let (floor, ceiling) = match (mode, outcome) {
                (Mode::Wait(t), "Timeout") => (t * MS, t * MS + self.bounds.prompt),
                (Mode::Cancel(t, _), "Timeout") => (t * MS, t * MS + self.bounds.prompt),
                (Mode::Cancel(_, a), "Canceled") => (a * MS, a * MS + self.bounds.prompt),
                (Mode::Try, "AlreadyHeld") => (0, self.bounds.prompt),
                _ => continue,
            };
            // The worker reads its start time before it calls, and its end time after, so a
            // correct answer is never early.
            if took < floor {
                found.push(Violation {
                    rule: "early answer",
                    at: t1,
                    key: op.key,
                    message: format!(
                        "operation {} (step {}, w{}) answered {outcome} after {:.1} ms, before {} ms",
                        op.id,
                        op.step,
                        op.worker,
                        took as f64 / 1e6,
                        floor / MS
                    ),
                });
            }
            if took > ceiling && !self.disturbed(op.worker, op.generation, t0, t1) {
                found.push(Violation {
                    rule: "late answer",
                    at: t1,
                    key: op.key,
                    message: format!(
                        "operation {} (step {}, w{}) answered {outcome} after {} ms (bound {} ms)",
                        op.id,
                        op.step,
                        op.worker,
                        took / MS,
                        ceiling / MS
                    ),
                });
            }
        }
    }
}

fn token(t: Option<u64>) -> String {
    t.map_or_else(|| "-".to_owned(), |t| t.to_string())
}
