//! Connection fencing: a managed renewal, extension or release whose outcome is unknown (it
//! timed out, or its future was dropped, after the command may have reached the server) has
//! the connection that sent it killed by its `CLIENT ID`, from another connection, so that
//! the command either ran already or never will. See [Connection fencing](super#connection-fencing).

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use futures_util::future::{Either, FutureExt as _, ready};
use redis::RedisError;
use tokio_util::sync::CancellationToken;

use super::{Shared, redis_error, timed_out};
use crate::LockError;

/// How a fenced command ended.
pub(super) enum Attempt<T> {
    /// The server answered.
    Done(T),
    /// It failed with a known outcome: an error answer, a broken connection, or a timeout
    /// before the command was sent.
    Failed(LockError),
    /// It timed out after it may have reached the server.
    Unknown {
        /// The timeout, as the error an unfenced command reports.
        error: LockError,
        /// What was done about it.
        fence: Fence,
    },
}

/// What was done about a command whose outcome is unknown.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Fence {
    /// Its connection (this `CLIENT ID`) was killed: the command ran before, or never will.
    Killed(i64),
    /// Its connection could not be killed, for this reason: it may still run later.
    NotFenced(String),
}

/// Runs `op`, a command on the backend's connection, under the command timeout, and fences
/// its connection when the outcome is unknown: on a timeout (before this returns) or when
/// this future is dropped midway (in the background, also cancelling `lost_on_cancel`).
///
/// Cancel safe in the sense above: a drop after the command may have been sent kills its
/// connection in the background.
///
/// The command counts as in flight from this call (when the connection's `CLIENT ID` is
/// known): await the future at once, as every caller does.
///
/// Built from combinators rather than as an `async fn`, so that its future holds `op` once
/// (inside the timeout) and never moves it: an `async fn` keeps its argument beside the future
/// it moves the argument into, which doubled the size of every fenced command's future (and
/// every copy of it, such as the one into a `Box`).
pub(super) fn fenced<T>(
    shared: &Arc<Shared>,
    what: &'static str,
    lost_on_cancel: Option<CancellationToken>,
    op: impl Future<Output = Result<T, RedisError>>,
) -> impl Future<Output = Attempt<T>> {
    // One deadline for both steps (one clock read).
    let deadline = tokio::time::Instant::now() + shared.timeout;
    match shared.conn.known_fence_ticket() {
        Some(ticket) => Either::Left(run_fenced(
            shared,
            what,
            lost_on_cancel,
            ticket,
            tokio::time::timeout_at(deadline, op),
        )),
        // A new connection's first command: its `CLIENT ID` is asked first (boxed: the
        // question's future is as large as a command's, and this is rare).
        None => Either::Right(Box::pin(async move {
            // Nothing is sent yet: a timeout here leaves nothing uncertain.
            let Ok(ticket) = tokio::time::timeout_at(deadline, shared.conn.fence_ticket()).await
            else {
                return Attempt::Failed(timed_out(what, shared.timeout));
            };
            let timed = tokio::time::timeout_at(deadline, op);
            run_fenced(shared, what, lost_on_cancel, ticket, timed).await
        })),
    }
}

/// The rest of [`fenced`] once the connection's `ticket` is known: `timed` (the command under
/// the deadline) is in flight until it ends, and fenced when its outcome is unknown.
fn run_fenced<T>(
    shared: &Arc<Shared>,
    what: &'static str,
    lost_on_cancel: Option<CancellationToken>,
    ticket: Option<i64>,
    timed: tokio::time::Timeout<impl Future<Output = Result<T, RedisError>>>,
) -> impl Future<Output = Attempt<T>> {
    let in_flight = InFlight {
        shared: Arc::clone(shared),
        ticket,
        what,
        lost: lost_on_cancel,
        armed: true,
    };
    timed.then(move |outcome| {
        in_flight.disarm();
        let error = match outcome {
            Ok(Ok(value)) => return Either::Left(ready(Attempt::Done(value))),
            // The driver's own response timeout (the same length): the connection lives on,
            // and the command with it.
            Ok(Err(err)) if err.is_timeout() => redis_error(what, err, &shared.prefix),
            Ok(Err(err)) => {
                return Either::Left(ready(Attempt::Failed(redis_error(
                    what,
                    err,
                    &shared.prefix,
                ))));
            }
            Err(_) => timed_out(what, shared.timeout),
        };
        // Boxed: the fence's future is large, and needed only after a timeout.
        Either::Right(Box::pin(
            fence(shared, ticket, what, "timed out")
                .map(move |fence| Attempt::Unknown { error, fence }),
        ))
    })
}

/// Kills connection `ticket` after `what` ended with its outcome unknown (`cause`), counts
/// and logs what was done.
async fn fence(
    shared: &Shared,
    ticket: Option<i64>,
    what: &'static str,
    cause: &'static str,
) -> Fence {
    let conn = &shared.conn;
    let not_fenced = |why: String| {
        conn.fence.not_fenced.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(
            operation = what,
            cause,
            reason = %why,
            "a redis command with an unknown outcome was not fenced: it may still run later"
        );
        Fence::NotFenced(why)
    };
    let Some(id) = ticket else {
        let why = if conn.fencing_on() {
            "the connection's CLIENT ID was not known".to_owned()
        } else {
            "connection fencing is off (no CLIENT ID / CLIENT KILL permission, or a connection \
             manager passed in)"
                .to_owned()
        };
        return not_fenced(why);
    };
    let kill = conn.kill_client(id, shared.timeout);
    match tokio::time::timeout(shared.timeout, kill).await {
        Ok(Ok(true)) => {
            conn.fence.killed.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                operation = what,
                cause,
                client_id = id,
                "a redis command with an unknown outcome was fenced: its connection was killed \
                 (CLIENT KILL ID), so it ran before or never will; the next command connects anew"
            );
            Fence::Killed(id)
        }
        Ok(Ok(false)) => not_fenced(format!(
            "no connection with CLIENT ID {id} was left to kill (closed already, or the \
             connection had been replaced)"
        )),
        Ok(Err(err)) => not_fenced(format!("CLIENT KILL ID {id} failed: {err}")),
        Err(_) => not_fenced(format!(
            "CLIENT KILL ID {id} timed out after {:?}",
            shared.timeout
        )),
    }
}

/// Armed while a fenced command is in flight: dropped armed (its future was dropped), it
/// fences the connection in the background and cancels `lost`.
struct InFlight {
    shared: Arc<Shared>,
    ticket: Option<i64>,
    what: &'static str,
    lost: Option<CancellationToken>,
    armed: bool,
}

impl InFlight {
    /// The command ended (with any outcome): nothing is left in flight.
    fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        if let Some(lost) = &self.lost {
            lost.cancel();
        }
        let (shared, ticket, what) = (Arc::clone(&self.shared), self.ticket, self.what);
        let fencing = async move {
            fence(&shared, ticket, what, "cancelled").await;
        };
        // Outside a runtime, or dropped by its runtime's shutdown (which refuses the task),
        // the connection is not fenced: counted as such.
        let runtime = tokio::runtime::Handle::try_current().ok();
        if crate::detach::spawn_first(runtime, fencing).is_err() {
            self.shared
                .conn
                .fence
                .not_fenced
                .fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// What connection fencing has done on a backend; see
/// [`RedisBackend::connection_fencing`](super::RedisBackend::connection_fencing).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConnectionFencing {
    /// Whether it is on: the backend was built from a client (not on a connection manager
    /// passed in), and the Redis user was not refused `CLIENT ID` or `CLIENT KILL`.
    pub enabled: bool,
    /// Connections killed because a renewal, extension or release sent on them ended with
    /// its outcome unknown.
    pub killed: u64,
    /// Such commands whose connection could not be killed (fencing off, the connection's id
    /// not known, the kill failed): they may have run later.
    pub not_fenced: u64,
}

impl ConnectionFencing {
    pub(super) fn of(shared: &Shared) -> ConnectionFencing {
        let fence = &shared.conn.fence;
        ConnectionFencing {
            enabled: shared.conn.fencing_on(),
            killed: fence.killed.load(Ordering::Relaxed),
            not_fenced: fence.not_fenced.load(Ordering::Relaxed),
        }
    }
}
