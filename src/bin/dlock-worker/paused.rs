//! `dlock-worker paused URL ID ROUNDS LEASE_MS`: a holder that the test stops (`SIGSTOP`)
//! past its lease, takes its locks over from another process, and resumes (`SIGCONT`).
//!
//! Each round, one task per API holds a lock of its own, `paused-ID:API`, and steps every few
//! milliseconds under it. Once every task holds and steps, the worker prints `ready ROUND`.
//! A step that comes more than the lease after the one before it is the work's first step
//! after a pause past the lease: there each task reads every "am I still the holder?" check
//! its API offers, and the worker prints `checked ROUND API NAME=BOOL ...` (`true`: the check
//! answered "lost"), in the order the tasks check, then `done ROUND` once every task has
//! ended. Checks whose name starts with `lag_` are ones the docs say may lag behind a pause,
//! and the test counts them without requiring them: a bare lost token that no code of dlock
//! polls (a guard's), and a bare token (or `on_lost = cancel`) when the pause fell inside the
//! poll of the work that took the step, after dlock's check of the clock before that poll
//! (see `until_paused`).
//!
//! The APIs: a [`LockGuard`] (`guard`), a [`Leader`]'s term (`leader`), the tokens that
//! [`LockProvider::run_exclusive`] (`run-exclusive`), [`LockProvider::with_lock`]
//! (`with-lock`) and [`dlock::LockBuilder::with_lock`] (`builder-with-lock`) hand their
//! closures, the [`HeldLock`] of a handler behind a real [`LockLayer`] (`held-lock`), and
//! `#[distributed_lock]` functions with `on_lost = finish` and a guard (`macro-finish`) and
//! with `on_lost = cancel`, whose body must not take a step after the pause
//! (`macro-cancel`). Where the API offers a value to hand to the work's own tasks (a
//! guard's `LostSignal`, a `LeaderTerm`, a `HeldLock`), a task spawned with a clone, which
//! dlock does not poll, checks it at its own first step after the pause (`spawned_...`).

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::Request;
use axum::routing::post;
use dlock::{CancellationToken, Leader, LockError, LockGuard, LockProvider, distributed_lock};
use dlock_axum::{HeldLock, LockLayer, OnLost};
use tokio::sync::mpsc::{UnboundedSender, unbounded_channel};
use tower::ServiceExt as _;

/// The APIs, in the order their lines are printed.
pub(crate) const APIS: [&str; 8] = [
    "guard",
    "leader",
    "run-exclusive",
    "with-lock",
    "builder-with-lock",
    "held-lock",
    "macro-finish",
    "macro-cancel",
];

/// How long a task waits for its lock (the test's process holds it until the round's checks
/// are in).
const WAIT: Duration = Duration::from_secs(60);

/// The pause between two steps of the work.
const STEP: Duration = Duration::from_millis(5);

pub(crate) fn run(url: &str, id: &str, rounds: &str, lease_ms: &str) -> Result<(), String> {
    let id: u64 = id.parse().map_err(|e| format!("ID: {e}"))?;
    let rounds: u32 = rounds.parse().map_err(|e| format!("ROUNDS: {e}"))?;
    let lease = Duration::from_millis(lease_ms.parse().map_err(|e| format!("LEASE_MS: {e}"))?);
    super::runtime()?.block_on(async {
        let locks = LockProvider::connect(url)
            .await
            .map_err(|e| format!("connect: {e}"))?;
        for round in 0..rounds {
            one_round(&locks, id, round, lease).await?;
        }
        Ok(())
    })
}

/// What one task reports: its API and its checks (or why it could not check).
type Report = (&'static str, Result<String, String>);

async fn one_round(
    locks: &LockProvider,
    id: u64,
    round: u32,
    lease: Duration,
) -> Result<(), String> {
    let (held, mut holding) = unbounded_channel::<()>();
    let (report, mut reports) = unbounded_channel::<Report>();
    let context = Context {
        locks: locks.clone(),
        id,
        lease,
        held,
        report,
    };
    let tasks: Vec<_> = APIS
        .iter()
        .map(|api| tokio::spawn(context.clone().check(api)))
        .collect();
    drop(context);
    for _ in APIS {
        holding
            .recv()
            .await
            .ok_or("a task ended before it held its lock")?;
    }
    say(&format!("ready {round}"));
    // Each as it comes: a task that never reports is then the one missing.
    while let Some((api, outcome)) = reports.recv().await {
        match outcome {
            Ok(checks) => say(&format!("checked {round} {api} {checks}")),
            Err(why) => say(&format!("failed {round} {api} {why}")),
        }
    }
    for task in tasks {
        task.await.map_err(|e| format!("a task panicked: {e}"))?;
    }
    say(&format!("done {round}"));
    Ok(())
}

fn say(line: &str) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

/// Steps every [`STEP`] until a step comes more than `lease` after the one before it (the
/// process was paused past its lease), and returns what `check` reads at that step. `held`
/// is told once, before the first step.
///
/// `check` is told whether the pause fell *inside* the poll of the work that took the step
/// (the poll began before the pause): then nothing around the work could run between the
/// pause and the step, and a bare token that dlock cancels before each poll of the work has
/// not been cancelled yet; checks that read the clock see the pause all the same. Await this
/// first in the work's future, so that each poll of the work begins with a poll of it.
async fn until_paused<T>(
    lease: Duration,
    held: &UnboundedSender<()>,
    check: impl FnMut(bool) -> T,
) -> T {
    let _ = held.send(());
    steps_until_paused(lease, check).await
}

/// A task of the work that dlock does not poll (spawned by it): steps as
/// [`until_paused`] does, and answers what `check` reads at its first step after the pause.
fn spawned<T: Send + 'static>(
    lease: Duration,
    mut check: impl FnMut() -> T + Send + 'static,
) -> tokio::task::JoinHandle<T> {
    tokio::spawn(steps_until_paused(lease, move |_| check()))
}

async fn steps_until_paused<T>(lease: Duration, mut check: impl FnMut(bool) -> T) -> T {
    let mut polled = Instant::now();
    let mut steps = std::pin::pin!(async {
        let mut last = Instant::now();
        loop {
            tokio::time::sleep(STEP).await;
            let now = Instant::now();
            if now.duration_since(last) > lease {
                return now;
            }
            last = now;
        }
    });
    let at = std::future::poll_fn(|cx| {
        polled = Instant::now();
        steps.as_mut().poll(cx)
    })
    .await;
    check(at.duration_since(polled) > lease)
}

/// The name of a bare token's check: `lag_token` when the pause fell inside the poll that
/// took the step (see [`until_paused`]), `token` otherwise.
fn token_name(inside: bool) -> &'static str {
    if inside { "lag_token" } else { "token" }
}

/// `name=bool` pairs.
fn checks(pairs: &[(&str, bool)]) -> String {
    pairs
        .iter()
        .map(|(name, value)| format!("{name}={value}"))
        .collect::<Vec<_>>()
        .join(" ")
}

#[derive(Clone)]
struct Context {
    locks: LockProvider,
    id: u64,
    lease: Duration,
    held: UnboundedSender<()>,
    report: UnboundedSender<Report>,
}

impl Context {
    fn key(&self, api: &str) -> String {
        format!("paused-{}:{api}", self.id)
    }

    /// Holds `api`'s lock through the pause and reports its checks.
    async fn check(self, api: &'static str) {
        let outcome = match api {
            "guard" => self.guard().await,
            "leader" => self.leader().await,
            "run-exclusive" => self.run_exclusive().await,
            "with-lock" => self.with_lock().await,
            "builder-with-lock" => self.builder_with_lock().await,
            "held-lock" => self.held_lock().await,
            "macro-finish" => self.macro_finish().await,
            "macro-cancel" => self.macro_cancel().await,
            other => Err(format!("no such API {other}")),
        };
        let _ = self.report.send((api, outcome));
    }

    async fn guard(&self) -> Result<String, String> {
        let guard = self
            .locks
            .acquire(&self.key("guard"), WAIT)
            .await
            .map_err(|e| e.to_string())?;
        let signal = guard.lost_signal();
        let task = {
            let signal = guard.lost_signal();
            spawned(self.lease, move || signal.is_lost())
        };
        let line = until_paused(self.lease, &self.held, |_| {
            checks(&[
                ("lag_token", guard.lost_token().is_cancelled()),
                ("signal", signal.is_lost()),
                ("is_lost", guard.is_lost()),
            ])
        })
        .await;
        let in_task = task.await.map_err(|e| e.to_string())?;
        let _ = guard.release().await;
        Ok(format!("{line} {}", checks(&[("spawned_signal", in_task)])))
    }

    async fn leader(&self) -> Result<String, String> {
        let (out, mut lines) = unbounded_channel();
        let shutdown = CancellationToken::new();
        let run = {
            let (locks, key, shutdown) = (self.locks.clone(), self.key("leader"), shutdown.clone());
            let (lease, held) = (self.lease, self.held.clone());
            tokio::spawn(async move {
                Leader::new(&locks, key)
                    .run(&shutdown, |term| {
                        let (out, held) = (out.clone(), held.clone());
                        async move {
                            let task = {
                                let term = term.clone();
                                spawned(lease, move || term.has_ended())
                            };
                            let line = until_paused(lease, &held, |inside| {
                                checks(&[
                                    (token_name(inside), term.token().is_cancelled()),
                                    ("has_ended", term.has_ended()),
                                ])
                            })
                            .await;
                            let in_task = task.await.unwrap_or(false);
                            let _ = out.send(format!(
                                "{line} {}",
                                checks(&[("spawned_has_ended", in_task)])
                            ));
                        }
                    })
                    .await
            })
        };
        let line = lines.recv().await.ok_or("the leader never led")?;
        shutdown.cancel();
        match run.await {
            Ok(Ok(())) => Ok(line),
            Ok(Err(err)) => Err(err.to_string()),
            Err(err) => Err(err.to_string()),
        }
    }

    async fn run_exclusive(&self) -> Result<String, String> {
        let key = self.key("run-exclusive");
        let started = Instant::now();
        loop {
            let (out, mut lines) = unbounded_channel();
            let ran = self
                .locks
                .run_exclusive(&key, self.lease, Duration::ZERO, |token| {
                    let (lease, held) = (self.lease, self.held.clone());
                    async move {
                        let line = until_paused(lease, &held, |inside| {
                            checks(&[(token_name(inside), token.is_cancelled())])
                        })
                        .await;
                        let _ = out.send(line);
                    }
                })
                .await;
            match ran {
                Ok(None) if started.elapsed() < WAIT => {
                    // The test's process has not given the key back yet.
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Ok(None) => return Err("the job never ran".to_owned()),
                Ok(Some(())) | Err(LockError::Lost { .. }) => {
                    return lines.recv().await.ok_or_else(|| "no checks".to_owned());
                }
                Err(err) => return Err(err.to_string()),
            }
        }
    }

    async fn with_lock(&self) -> Result<String, String> {
        let (out, lines) = unbounded_channel();
        let outcome = self
            .locks
            .with_lock(&self.key("with-lock"), WAIT, self.token_work(out))
            .await;
        reported(outcome, lines).await
    }

    async fn builder_with_lock(&self) -> Result<String, String> {
        let (out, lines) = unbounded_channel();
        let outcome = self
            .locks
            .lock(&self.key("builder-with-lock"))
            .timeout(WAIT)
            .with_lock(self.token_work(out))
            .await;
        reported(outcome, lines).await
    }

    /// The work of a `with_lock`: checks the token it is handed at its first step after the
    /// pause, and sends what it found to `out`.
    fn token_work(
        &self,
        out: UnboundedSender<String>,
    ) -> impl FnOnce(CancellationToken) -> BoxedWork {
        let (lease, held) = (self.lease, self.held.clone());
        move |token| {
            Box::pin(async move {
                let line = until_paused(lease, &held, |inside| {
                    checks(&[(token_name(inside), token.is_cancelled())])
                })
                .await;
                let _ = out.send(line);
            })
        }
    }

    async fn held_lock(&self) -> Result<String, String> {
        let (out, mut lines) = unbounded_channel();
        let (lease, held) = (self.lease, self.held.clone());
        let handler = move |lock: HeldLock| {
            let (out, held) = (out.clone(), held.clone());
            async move {
                let task = {
                    let lock = lock.clone();
                    spawned(lease, move || lock.is_lost())
                };
                let line = until_paused(lease, &held, |inside| {
                    checks(&[
                        (token_name(inside), lock.lost_token().is_cancelled()),
                        ("is_lost", lock.is_lost()),
                    ])
                })
                .await;
                let in_task = task.await.unwrap_or(false);
                let _ = out.send(format!(
                    "{line} {}",
                    checks(&[("spawned_is_lost", in_task)])
                ));
                "done"
            }
        };
        let key = self.key("held-lock");
        let layer =
            LockLayer::with_key_fn(self.locks.clone(), move |_: &axum::http::request::Parts| {
                Some(key.clone())
            })
            .timeout(WAIT)
            .on_lost(OnLost::Continue);
        let app = Router::new()
            .route("/work", post(handler))
            .route_layer(layer);
        let request = Request::post("/work")
            .body(Body::empty())
            .map_err(|e| e.to_string())?;
        let response = app.oneshot(request).await.map_err(|e| e.to_string())?;
        if !response.status().is_success() {
            return Err(format!("the layer answered {}", response.status()));
        }
        lines.recv().await.ok_or_else(|| "no checks".to_owned())
    }

    async fn macro_finish(&self) -> Result<String, String> {
        let (out, lines) = unbounded_channel();
        let outcome = finishing(&self.locks, self.id, self.lease, &self.held, &out).await;
        reported(outcome, lines).await
    }

    async fn macro_cancel(&self) -> Result<String, String> {
        let stepped = [AtomicBool::new(false), AtomicBool::new(false)];
        let outcome = cancelling(&self.locks, self.id, self.lease, &self.held, &stepped).await;
        let stopped = matches!(outcome, Err(LockError::Lost { .. }));
        match outcome {
            Ok(()) | Err(LockError::Lost { .. }) => Ok(checks(&[
                ("no_step_after_pause", !stepped[0].load(Ordering::SeqCst)),
                (
                    "lag_no_step_in_the_poll",
                    !stepped[1].load(Ordering::SeqCst),
                ),
                ("answered_lost", stopped),
            ])),
            Err(err) => Err(err.to_string()),
        }
    }
}

/// The future of a `with_lock`'s work.
type BoxedWork = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>;

/// The checks a `with_lock`'s work sent, once the call ended as expected (`Ok`, or `Lost`:
/// the lock was lost while the work ran).
async fn reported(
    outcome: Result<(), LockError>,
    mut lines: tokio::sync::mpsc::UnboundedReceiver<String>,
) -> Result<String, String> {
    match outcome {
        Ok(()) | Err(LockError::Lost { .. }) => {
            lines.recv().await.ok_or_else(|| "no checks".to_owned())
        }
        Err(err) => Err(err.to_string()),
    }
}

/// `on_lost = finish` with the guard bound: the body reads the guard at its first step after
/// the pause.
#[distributed_lock("paused-{id}:macro-finish", timeout = 60, guard = lock)]
async fn finishing(
    locks: &LockProvider,
    id: u64,
    lease: Duration,
    held: &UnboundedSender<()>,
    out: &UnboundedSender<String>,
) -> Result<(), LockError> {
    let lock: &LockGuard = lock;
    let line = until_paused(lease, held, |inside| {
        checks(&[
            (token_name(inside), lock.lost_token().is_cancelled()),
            ("is_lost", lock.is_lost()),
        ])
    })
    .await;
    let _ = out.send(line);
    Ok(())
}

/// `on_lost = cancel`: the body must be stopped before its first step after the pause.
#[distributed_lock("paused-{id}:macro-cancel", timeout = 60, on_lost = cancel)]
async fn cancelling(
    locks: &LockProvider,
    id: u64,
    lease: Duration,
    held: &UnboundedSender<()>,
    stepped: &[AtomicBool; 2],
) -> Result<(), LockError> {
    until_paused(lease, held, |inside| {
        // A step in the poll the pause fell inside is that poll's own: `on_lost = cancel`
        // checks before each poll, and could not have stopped it.
        let which = if inside { &stepped[1] } else { &stepped[0] };
        which.store(true, Ordering::SeqCst);
    })
    .await;
    Ok(())
}
