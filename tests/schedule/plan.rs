//! Schedules: what a seed makes, and the known holes that keep parts of it out of CI.
//!
//! A seed determines everything the driver does: the configuration (processes, runtimes,
//! providers and how they share backends, leases, keepalives, fencing, which workers run under
//! libfaketime) and the list of steps, each a pause and then one operation or fault. What the
//! store answers is up to the store: a replay repeats every step at the same offsets, and most
//! failures it shows again at once; a failure that needs one exact interleaving may need a few
//! replays (`DLOCK_SCHEDULE_REPEAT`).

use std::fmt;

/// The lock stores the schedule test runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Backend {
    Sqlite,
    Postgres,
    Redis,
}

impl Backend {
    pub const ALL: [Backend; 3] = [Backend::Sqlite, Backend::Postgres, Backend::Redis];

    pub fn name(self) -> &'static str {
        match self {
            Backend::Sqlite => "sqlite",
            Backend::Postgres => "postgres",
            Backend::Redis => "redis",
        }
    }

    pub fn parse(name: &str) -> Option<Backend> {
        Backend::ALL.into_iter().find(|b| b.name() == name)
    }

    /// Whether locks are leases (they outlive a dead holder by up to the lease) rather than
    /// server sessions (they end with the holder's connection).
    pub fn leases(self) -> bool {
        matches!(self, Backend::Sqlite | Backend::Redis)
    }
}

/// The parts of a schedule that can be switched off, one by one, for a known hole.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Feature {
    /// Two or three providers on clones of one backend in one process (and, on PostgreSQL,
    /// `connections=1`).
    SharedBackend,
    /// Workers with two runtimes, one of which is dropped (and replaced) now and then.
    RuntimeDrop,
    /// Workers under libfaketime whose wall clock is stepped forward and back.
    ClockStep,
    /// SIGKILL of a worker process (a new one takes its place).
    WorkerKill,
    /// The store drops a worker's connections (`pg_terminate_backend`, `CLIENT KILL`).
    ConnKill,
    /// The server is stopped, kept down for longer than the holders need to hear of the loss,
    /// and started again.
    ServerKill,
    /// SIGSTOP of a worker for about a lease (or several keepalives), then SIGCONT.
    Freeze,
    /// SQLite transaction-bound locks, committed or rolled back.
    TxLock,
    /// Every process opens the store at the same moment (on SQLite, a new file); otherwise
    /// they start one after the other.
    ConcurrentOpen,
}

impl Feature {
    pub const ALL: [Feature; 9] = [
        Feature::SharedBackend,
        Feature::RuntimeDrop,
        Feature::ClockStep,
        Feature::WorkerKill,
        Feature::ConnKill,
        Feature::ServerKill,
        Feature::Freeze,
        Feature::TxLock,
        Feature::ConcurrentOpen,
    ];

    /// Whether the feature means anything on `backend`.
    pub fn applies(self, backend: Backend) -> bool {
        match self {
            Feature::ConnKill | Feature::ServerKill => backend != Backend::Sqlite,
            Feature::TxLock => backend == Backend::Sqlite,
            _ => true,
        }
    }
}

/// A hole that is known and being fixed: while it is listed, schedules on `backend` leave
/// `feature` out. Each entry was seen failing: `seeds` lists seeds that found it, each with the
/// `DLOCK_SCHEDULE_HOLES` value it was found with (replay one with
/// `DLOCK_SCHEDULE_SEED=backend:seed DLOCK_SCHEDULE_HOLES=value`). Remove the entry when the
/// fix is merged, and the schedules exercise the feature again.
#[derive(Debug)]
pub struct KnownHole {
    /// The class of issue 14 (`"1"`..`"8"`), or `"new"` for one found by this test.
    pub class: &'static str,
    pub backend: Backend,
    pub feature: Feature,
    pub what: &'static str,
    pub seeds: &'static [(u64, &'static str)],
}

/// The known holes. Empty it, entry by entry, as the fixes land.
pub const KNOWN_HOLES: &[KnownHole] = &[];

/// The features left out of schedules on `backend`: those of its known holes, except the
/// `opened` ones.
pub fn gated(backend: Backend, opened: &[Feature]) -> Vec<Feature> {
    KNOWN_HOLES
        .iter()
        .filter(|h| h.backend == backend && !opened.contains(&h.feature))
        .map(|h| h.feature)
        .collect()
}

/// `DLOCK_SCHEDULE_HOLES`: `open` opens every gate, a list such as `RuntimeDrop,ClockStep`
/// opens those.
pub fn opened(spec: &str) -> Vec<Feature> {
    if spec == "open" {
        return Feature::ALL.to_vec();
    }
    spec.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|name| {
            Feature::ALL
                .into_iter()
                .find(|f| format!("{f:?}") == name)
                .unwrap_or_else(|| panic!("DLOCK_SCHEDULE_HOLES: no feature `{name}`"))
        })
        .collect()
}

/// One worker process.
#[derive(Debug, Clone)]
pub struct WorkerSpec {
    /// Tokio runtimes in the process (1 or 2).
    pub runtimes: usize,
    /// Per provider: its backend group (providers of one group share a cloned backend) and the
    /// runtime it is built on.
    pub providers: Vec<(usize, usize)>,
    /// Whether the process runs under libfaketime.
    pub faketime: bool,
    /// PostgreSQL lock connections of each backend (`connections=`).
    pub connections: usize,
}

impl WorkerSpec {
    /// Whether two providers of this worker share a backend.
    pub fn shares(&self) -> bool {
        let mut groups: Vec<usize> = self.providers.iter().map(|p| p.0).collect();
        groups.sort_unstable();
        groups.windows(2).any(|w| w[0] == w[1])
    }
}

/// How an acquisition is made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Try,
    /// `acquire` with a timeout (ms).
    Wait(u64),
    /// `acquire` with a timeout and a cancellation token fired after the second number of ms.
    Cancel(u64, u64),
    /// `acquire` whose future is dropped after the second number of ms.
    Abandon(u64, u64),
}

impl Mode {
    /// The worker's words for it.
    pub fn words(self) -> String {
        match self {
            Mode::Try => "try".to_owned(),
            Mode::Wait(t) => format!("wait {t}"),
            Mode::Cancel(t, a) => format!("cancel {t} {a}"),
            Mode::Abandon(t, a) => format!("abandon {t} {a}"),
        }
    }

    /// The longest the operation may wait for the lock, in ms.
    pub fn timeout_ms(self) -> u64 {
        match self {
            Mode::Try => 0,
            Mode::Wait(t) => t,
            Mode::Cancel(t, a) | Mode::Abandon(t, a) => t.min(a),
        }
    }
}

/// What a step does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    Acquire {
        w: usize,
        prov: usize,
        rt: usize,
        key: usize,
        mode: Mode,
    },
    /// `release` of the `pick % n`-th guard the worker holds.
    Release {
        w: usize,
        pick: u32,
    },
    /// Drop of a guard.
    Drop {
        w: usize,
        pick: u32,
    },
    /// `release` whose future is dropped after `after` ms.
    ReleaseAbandon {
        w: usize,
        pick: u32,
        after: u64,
    },
    /// A SQLite transaction-bound lock held `hold` ms, then committed or rolled back.
    Tx {
        w: usize,
        key: usize,
        commit: bool,
        hold: u64,
    },
    KillWorker {
        w: usize,
    },
    ConnKill {
        w: usize,
    },
    ServerKill,
    /// Sets the worker's fake wall clock to `offset` seconds from the real one.
    ClockStep {
        w: usize,
        offset: i64,
    },
    RuntimeDrop {
        w: usize,
        rt: usize,
    },
    Freeze {
        w: usize,
        ms: u64,
    },
    /// Waits for every operation, releases every guard and checks that each key can be taken
    /// within its bound.
    Checkpoint,
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Action::Acquire {
                w,
                prov,
                rt,
                key,
                mode,
            } => write!(f, "w{w} acquire p{prov} rt{rt} k{key} {}", mode.words()),
            Action::Release { w, pick } => write!(f, "w{w} release #{pick}"),
            Action::Drop { w, pick } => write!(f, "w{w} drop #{pick}"),
            Action::ReleaseAbandon { w, pick, after } => {
                write!(f, "w{w} release #{pick}, dropped after {after} ms")
            }
            Action::Tx {
                w,
                key,
                commit,
                hold,
            } => write!(
                f,
                "w{w} transaction lock k{key} for {hold} ms, then {}",
                if *commit { "commit" } else { "rollback" }
            ),
            Action::KillWorker { w } => write!(f, "w{w} SIGKILL (and a new process)"),
            Action::ConnKill { w } => write!(f, "w{w} connections killed by the server"),
            Action::ServerKill => write!(f, "server stopped, then started again"),
            Action::ClockStep { w, offset } => write!(f, "w{w} wall clock set to {offset:+} s"),
            Action::RuntimeDrop { w, rt } => write!(f, "w{w} runtime {rt} dropped"),
            Action::Freeze { w, ms } => write!(f, "w{w} SIGSTOP for {ms} ms"),
            Action::Checkpoint => write!(f, "checkpoint"),
        }
    }
}

/// One step: a pause, then an action.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    pub delay_ms: u64,
    pub action: Action,
}

/// Everything a seed determines.
#[derive(Debug, Clone)]
pub struct Schedule {
    pub backend: Backend,
    pub seed: u64,
    /// The features this schedule may use.
    pub features: Vec<Feature>,
    pub keys: usize,
    /// Lease of SQLite and Redis locks, ms.
    pub lease_ms: u64,
    /// PostgreSQL keepalive, ms.
    pub keepalive_ms: u64,
    /// Whether the store issues fencing tokens (always on SQLite).
    pub fencing: bool,
    /// Whether the processes start at once (see [`Feature::ConcurrentOpen`]).
    pub concurrent_open: bool,
    pub workers: Vec<WorkerSpec>,
    pub steps: Vec<Step>,
}

impl fmt::Display for Schedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} seed={} keys={} {} fencing={}{} features={:?}",
            self.backend.name(),
            self.seed,
            self.keys,
            if self.backend.leases() {
                format!("lease={}ms", self.lease_ms)
            } else {
                format!("keepalive={}ms", self.keepalive_ms)
            },
            self.fencing,
            if self.concurrent_open {
                " concurrent-open"
            } else {
                ""
            },
            self.features
        )?;
        for (i, w) in self.workers.iter().enumerate() {
            write!(
                f,
                "\n  w{i}: runtimes={} providers(group:runtime)={:?}{}{}",
                w.runtimes,
                w.providers,
                if w.faketime { " faketime" } else { "" },
                if self.backend == Backend::Postgres {
                    format!(" connections={}", w.connections)
                } else {
                    String::new()
                }
            )?;
        }
        Ok(())
    }
}

/// The schedule of `seed` on `backend`, leaving out the `gated` features (and clock steps when
/// libfaketime is missing).
///
/// The generator draws the same random numbers whatever is gated, so that a gate only replaces
/// the steps of its feature (by plain acquisitions) and leaves every other step of the seed as
/// it was: a seed found with the gates open replays with them open, and its other steps stay
/// the same in CI.
pub fn generate(backend: Backend, seed: u64, gated: &[Feature], faketime: bool) -> Schedule {
    let mut rng = fastrand::Rng::with_seed(seed);
    // Each allowed feature is in about two schedules of three, so that schedules also differ
    // in what they leave out.
    let drawn: Vec<(Feature, bool)> = Feature::ALL
        .into_iter()
        .map(|f| (f, rng.u8(..3) != 0))
        .collect();
    let features: Vec<Feature> = drawn
        .into_iter()
        .filter(|(f, on)| *on && f.applies(backend) && !gated.contains(f))
        .filter(|(f, _)| *f != Feature::ClockStep || faketime)
        .map(|(f, _)| f)
        .collect();
    let has = |f: Feature| features.contains(&f);
    let processes = rng.usize(2..=4);
    let keys = rng.usize(1..=2);
    let lease_ms = [1500, 2000, 3000][rng.usize(..3)];
    let keepalive_ms = [200, 300, 500][rng.usize(..3)];
    let (pg_fencing, redis_fencing) = (rng.bool(), rng.u8(..4) != 0);
    let fencing = match backend {
        Backend::Sqlite => true,
        Backend::Postgres => pg_fencing,
        Backend::Redis => redis_fencing,
    };
    // Some workers are busy and some quiet: a quiet worker leaves its background work alone
    // for long enough that a renewal or liveness check that silently stopped shows.
    let weights: Vec<u32> = (0..processes)
        .map(|_| [1, 1, 3, 6][rng.usize(..4)])
        .collect();
    let total: u32 = weights.iter().sum();
    let workers: Vec<WorkerSpec> = (0..processes)
        .map(|_| {
            let two = rng.bool();
            let runtimes = if has(Feature::RuntimeDrop) && two {
                2
            } else {
                1
            };
            let count = [1, 1, 2, 2, 3][rng.usize(..5)];
            let mut providers: Vec<(usize, usize)> = Vec::new();
            for p in 0..count {
                let (share, with, rt) = (rng.u8(..3) != 0, rng.usize(..3), rng.usize(..2));
                let group = if p > 0 && has(Feature::SharedBackend) && share {
                    providers[with % p].0
                } else {
                    p
                };
                providers.push((group, rt % runtimes));
            }
            let faked = rng.bool();
            let mut spec = WorkerSpec {
                runtimes,
                providers,
                faketime: has(Feature::ClockStep) && faked,
                connections: [1, 2, 4][rng.usize(..3)],
            };
            if spec.shares() {
                // The setting of issue 14, class 1: one lock connection, shared.
                spec.connections = 1;
            }
            spec
        })
        .collect();

    let lease = lease_ms;
    let mut steps = Vec::new();
    let count = rng.usize(40..=80);
    let mut server_kills = 0;
    let mut offsets = vec![0i64; processes];
    let timeouts = [0, 20, 100, 400, 1500, 3000];
    for i in 0..count {
        // Every step draws the same numbers, whichever action they end up in.
        let long = rng.u8(..20) == 0;
        let (pause_lease, pause_keepalive, pause_short) = (
            rng.u64(100..=lease),
            rng.u64(100..=keepalive_ms * 3),
            rng.u64(0..=40),
        );
        let (w, prov, rt, key) = (rng.u32(..), rng.usize(..3), rng.usize(..2), rng.usize(..2));
        let roll = rng.u32(..100);
        let timeout = timeouts[rng.usize(..timeouts.len())];
        let (long_timeout, cancel_after, abandon_after) =
            (rng.u64(50..=3000), rng.u64(0..=300), rng.u64(0..=60));
        let (pick, release_after, commit, hold) =
            (rng.u32(..), rng.u64(0..=20), rng.bool(), rng.u64(0..=30));
        let (step_choice, back_to_zero, home) =
            (rng.usize(..7), rng.u8(..3) == 0, rng.u8(..3) != 0);
        let (freeze_lease, freeze_keepalive) = (
            rng.u64(lease / 2..=lease * 3 / 2),
            rng.u64(keepalive_ms..=keepalive_ms * 4),
        );

        let delay_ms = match (long, backend.leases()) {
            // Now and then a pause long enough for renewals, keepalives and leases to matter.
            (true, true) => pause_lease,
            (true, false) => pause_keepalive,
            (false, _) => pause_short,
        };
        let w = {
            let mut n = w % total;
            weights
                .iter()
                .position(|&weight| {
                    let here = n < weight;
                    n = n.saturating_sub(weight);
                    here
                })
                .unwrap_or(0)
        };
        let spec = &workers[w];
        let (prov, rt, key) = (prov % spec.providers.len(), rt % spec.runtimes, key % keys);
        let acquire = |mode| Action::Acquire {
            w,
            prov,
            rt,
            key,
            mode,
        };
        let action = match roll {
            0..=21 => acquire(Mode::Wait(timeout)),
            22..=37 => acquire(Mode::Try),
            38..=43 => acquire(Mode::Cancel(long_timeout, cancel_after)),
            44..=49 => acquire(Mode::Abandon(long_timeout, abandon_after)),
            50..=68 => Action::Release { w, pick },
            69..=74 => Action::Drop { w, pick },
            75..=77 => Action::ReleaseAbandon {
                w,
                pick,
                after: release_after,
            },
            78..=80 if has(Feature::TxLock) => Action::Tx {
                w,
                key,
                commit,
                hold,
            },
            81..=83 if has(Feature::WorkerKill) => Action::KillWorker { w },
            84..=85 if has(Feature::ConnKill) => Action::ConnKill { w },
            86 if has(Feature::ServerKill) && server_kills < 2 => {
                server_kills += 1;
                Action::ServerKill
            }
            87..=90 if spec.faketime => {
                let step = (lease / 1000) as i64 + 1;
                let choices = [0, step, -step, 2 * step, -2, 10, -10];
                offsets[w] = if back_to_zero {
                    0
                } else {
                    offsets[w] + choices[step_choice]
                };
                Action::ClockStep {
                    w,
                    offset: offsets[w],
                }
            }
            // Mostly the runtime that built a provider (its connection tasks run there).
            91..=94 if spec.runtimes > 1 => Action::RuntimeDrop {
                w,
                rt: if home { spec.providers[prov].1 } else { rt },
            },
            95..=96 if has(Feature::Freeze) => Action::Freeze {
                w,
                ms: if backend.leases() {
                    freeze_lease
                } else {
                    freeze_keepalive
                },
            },
            97 if i > 10 && i + 10 < count => Action::Checkpoint,
            _ => acquire(Mode::Wait(timeout)),
        };
        steps.push(Step { delay_ms, action });
    }
    steps.push(Step {
        delay_ms: 0,
        action: Action::Checkpoint,
    });
    let concurrent_open = has(Feature::ConcurrentOpen);
    Schedule {
        backend,
        seed,
        features,
        keys,
        lease_ms,
        keepalive_ms,
        fencing,
        concurrent_open,
        workers,
        steps,
    }
}
