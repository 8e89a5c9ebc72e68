//! Lease renewal for every lock a backend holds, driven by one task per backend.
//!
//! Each lock follows the lease schedule of [`crate::lease`]: renewed every third of its lease,
//! presumed lost if no renewal has succeeded by four fifths of the lease after the last one was
//! sent (the local deadline; the server may let someone else take it at the full lease, and
//! the holder must know first). A renewal that finds the key gone or owned by another token
//! means the lock is lost at once. One renewal of a lock is in flight at a time.
//!
//! One driver task sleeps until the earliest renewal or deadline of all entries and spawns the
//! renewals that are due. Registering a lock is a map insert; only a lock due earlier than the
//! driver's planned wake-up wakes it (the first one, or one with a shorter lease). A task per
//! lock, as before, cost a spawn and a cross-thread wake on every acquisition and release:
//! more than the two round trips of an uncontended acquire + release on a local server.
//!
//! The driver runs on the runtime of the acquisition that started it, and renews the locks
//! taken from every runtime. If it stops for any reason (its runtime shut down, a panic), the
//! [`DriverStop`] its future owns declares every entry lost at once: nothing renews them any
//! more, and their holders hear it a fifth of a lease or more before anyone else can take the
//! keys. The next registration starts a new driver on its own runtime.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::{Duration, Instant};

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::{OwnerToken, Shared};
use crate::LockError;
use crate::lease::{LeaseDeadline, Term, renew_every};
use crate::time::later;

/// The renewal entries of one backend.
#[derive(Default)]
pub(super) struct Renewals {
    state: Mutex<State>,
    /// Wakes the driver when its planned wake-up is too late, or the backend is gone.
    wake: Notify,
}

#[derive(Default)]
struct State {
    entries: HashMap<u64, Entry>,
    next_id: u64,
    /// When the driver will next look, if it sleeps on a timer.
    planned: Option<Instant>,
    /// The number of the running driver, if one runs; cleared when it stops.
    driver: Option<u64>,
    /// The number of the next driver to start.
    next_driver: u64,
}

struct Entry {
    key: Arc<[u8]>,
    token: OwnerToken,
    /// Its place in the lease schedule. The local deadline (lost if no renewal has succeeded
    /// by then) is shared with the guard, which checks it itself: a holder paused past it
    /// hears of the loss before the driver runs again.
    term: Term,
    lost: CancellationToken,
    /// A reader's share: renewed by the read script (see `read.rs`).
    read: bool,
}

impl Renewals {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Starts renewing a lock taken with a command sent at `sent`; returns the entry's id and
    /// the lock's local deadline (for the guard). Starts a driver on the current runtime if
    /// none runs.
    pub(super) fn register(
        shared: &Arc<Shared>,
        key: Arc<[u8]>,
        token: OwnerToken,
        lease: Duration,
        sent: Instant,
        lost: CancellationToken,
        renew: bool,
    ) -> Result<(u64, LeaseDeadline), LockError> {
        Self::register_as(shared, key, token, lease, sent, lost, renew, false)
    }

    /// [`Renewals::register`] for a reader's share of a lock.
    pub(super) fn register_read(
        shared: &Arc<Shared>,
        key: Arc<[u8]>,
        token: OwnerToken,
        lease: Duration,
        sent: Instant,
        lost: CancellationToken,
        renew: bool,
    ) -> Result<(u64, LeaseDeadline), LockError> {
        Self::register_as(shared, key, token, lease, sent, lost, renew, true)
    }

    #[allow(clippy::too_many_arguments)]
    fn register_as(
        shared: &Arc<Shared>,
        key: Arc<[u8]>,
        token: OwnerToken,
        lease: Duration,
        sent: Instant,
        lost: CancellationToken,
        renew: bool,
        read: bool,
    ) -> Result<(u64, LeaseDeadline), LockError> {
        let renewals = &shared.renewals;
        let mut term = Term::new(lease, sent, shared.renew_every);
        if !renew {
            term.stop();
        }
        let deadline = term.deadline();
        let entry = Entry {
            key,
            token,
            term,
            lost,
            read,
        };
        // The entry goes in only while a driver runs (under the lock its stop takes too), so
        // no entry is ever left without a driver that renews it or declares it lost. Two
        // rounds: a driver spawned on a runtime that is shutting down stops at once.
        for _ in 0..2 {
            let mut state = renewals.state();
            if state.driver.is_some() {
                let id = state.next_id;
                state.next_id += 1;
                let wake_at = entry.term.wake_at();
                state.entries.insert(id, entry);
                renewals.plan(state, wake_at);
                return Ok((id, deadline));
            }
            let runtime = tokio::runtime::Handle::try_current().map_err(|_| {
                LockError::config(
                    "redis locks must be taken inside a Tokio runtime (lease renewal)",
                )
            })?;
            let number = state.next_driver;
            state.next_driver += 1;
            state.driver = Some(number);
            // A new driver must look at every entry now.
            state.planned = None;
            drop(state);
            let stop = DriverStop {
                renewals: Arc::clone(renewals),
                number,
                _suspect: shared.conn.suspect_on_drop(),
            };
            // Spawned outside the lock: on a runtime that is shutting down, the future (and
            // its stop) is dropped at once, inside `spawn`.
            drop(runtime.spawn(drive(Arc::downgrade(shared), stop)));
        }
        Err(LockError::unavailable(
            super::NAME,
            "the Tokio runtime is shutting down: the lock's lease could not be renewed",
            None,
        ))
    }

    /// Stops renewing entry `id` (released, or the guard dropped). No wake-up needed: the
    /// driver skips what it no longer finds.
    pub(super) fn remove(&self, id: u64) {
        self.state().entries.remove(&id);
    }

    /// Lock `id`'s lease was set to `lease` by a command sent at `sent`: later renewals ask
    /// for it, and the driver looks at the new schedule.
    pub(super) fn extended(&self, id: u64, lease: Duration, sent: Instant) {
        let mut state = self.state();
        if let Some(entry) = state.entries.get_mut(&id) {
            entry.term.extended(lease, sent);
            let wake_at = entry.term.wake_at();
            self.plan(state, wake_at);
        }
    }

    /// Stops renewing lock `id`; the driver still fires its lost token at its deadline.
    pub(super) fn stop(&self, id: u64) {
        if let Some(entry) = self.state().entries.get_mut(&id) {
            entry.term.stop();
        }
    }

    /// Lock `id` was found lost: its renewals end, and its lost token fires.
    pub(super) fn lose(&self, id: u64) {
        if let Some(entry) = self.state().entries.remove(&id) {
            entry.lost.cancel();
        }
    }

    /// Wakes the driver if `wake_at` is before its planned wake-up.
    fn plan(&self, mut state: MutexGuard<'_, State>, wake_at: Instant) {
        if state.planned.is_none_or(|planned| wake_at < planned) {
            state.planned = Some(wake_at);
            drop(state);
            self.wake.notify_one();
        }
    }

    /// Tells the driver to look again (the backend is being dropped).
    pub(super) fn shut_down(&self) {
        self.wake.notify_one();
    }
}

/// Owned by the driver's future: when the driver stops (its runtime shut down, a panic, or the
/// backend is gone), every entry is declared lost, for nothing renews it any more, and the
/// next registration starts a new driver. It also marks the connection suspect: its task may
/// have run on the same runtime (see [`Conn::suspect_on_drop`](super::commands::Conn::suspect_on_drop)).
struct DriverStop {
    renewals: Arc<Renewals>,
    number: u64,
    _suspect: super::commands::SuspectOnDrop,
}

impl Drop for DriverStop {
    fn drop(&mut self) {
        let orphans: Vec<Entry> = {
            let mut state = self.renewals.state();
            if state.driver != Some(self.number) {
                return;
            }
            state.driver = None;
            state.planned = None;
            state.entries.drain().map(|(_, entry)| entry).collect()
        };
        if !orphans.is_empty() {
            tracing::warn!(
                locks = orphans.len(),
                "the redis renewal task stopped (its Tokio runtime shut down?): its locks are presumed lost"
            );
        }
        for entry in orphans {
            entry.lost.cancel();
        }
    }
}

/// The driver: declares overdue entries lost, spawns due renewals, sleeps until the next
/// renewal or deadline. It holds the backend only while it works, and ends with it.
async fn drive(shared: Weak<Shared>, _stop: DriverStop) {
    loop {
        let Some(backend) = shared.upgrade() else {
            return;
        };
        let now = Instant::now();
        let mut due = Vec::new();
        let planned = {
            let mut state = backend.renewals.state();
            let overdue: Vec<u64> = state
                .entries
                .iter()
                .filter(|(_, e)| e.term.is_overdue(now))
                .map(|(id, _)| *id)
                .collect();
            for id in overdue {
                if let Some(entry) = state.entries.remove(&id) {
                    tracing::warn!(
                        "a redis lock is presumed lost: no renewal succeeded before its lease could run out"
                    );
                    entry.lost.cancel();
                }
            }
            for (id, entry) in &mut state.entries {
                if entry.term.is_due(now) {
                    entry.term.start();
                    due.push((
                        *id,
                        Arc::clone(&entry.key),
                        entry.token.clone(),
                        entry.term.lease(),
                        entry.read,
                    ));
                }
            }
            // With nothing to renew it still looks again a third of the default lease from
            // now, so that locks taken meanwhile with that lease need no wake-up: a busy
            // acquire/release loop then never wakes the driver.
            let planned = state
                .entries
                .values()
                .map(|entry| entry.term.wake_at())
                .min()
                .unwrap_or_else(|| later(now, renew_every(backend.lease)));
            state.planned = Some(planned);
            planned
        };
        for (id, key, token, lease, read) in due {
            tokio::spawn(renew(Arc::clone(&backend), id, key, token, lease, read));
        }
        let renewals = Arc::clone(&backend.renewals);
        drop(backend);
        tokio::select! {
            () = renewals.wake.notified() => {}
            () = tokio::time::sleep_until(planned.into()) => {}
        }
    }
}

/// One renewal of entry `id`; updates the entry with the outcome.
async fn renew(
    shared: Arc<Shared>,
    id: u64,
    key: Arc<[u8]>,
    token: OwnerToken,
    lease: Duration,
    read: bool,
) {
    // Taken before the command is sent: the server's new lease starts no earlier, so a late
    // answer never moves the deadline past what the server granted.
    let attempt = Instant::now();
    let extend = async {
        if read {
            super::read::extend(&shared, &key, &token, lease).await
        } else {
            shared.conn.extend(&key, &token, lease).await
        }
    };
    // A renewal with an unknown outcome has its connection killed (when fencing is on): it
    // cannot extend the lease later, after the holder was told the lock is lost.
    let outcome = match super::fence::fenced(&shared, "renewing a lock", None, extend).await {
        super::fence::Attempt::Done(done) => Ok(done),
        super::fence::Attempt::Failed(err) | super::fence::Attempt::Unknown { error: err, .. } => {
            Err(err)
        }
    };
    let renewals = &shared.renewals;
    let mut state = renewals.state();
    // Released, or declared lost at its deadline, while the renewal ran.
    let Some(entry) = state.entries.get_mut(&id) else {
        return;
    };
    match outcome {
        Ok((true, _)) => entry.term.renewed(attempt),
        Ok((false, _)) => {
            if let Some(entry) = state.entries.remove(&id) {
                tracing::warn!(
                    "a redis lock was lost: the renewal found it gone or held by another owner"
                );
                entry.lost.cancel();
            }
            return;
        }
        Err(err) => {
            tracing::warn!(error = %err, "renewing a redis lock failed; retrying until its lease may have run out");
            entry.term.failed(Instant::now());
        }
    }
    let wake_at = entry.term.wake_at();
    renewals.plan(state, wake_at);
}

#[cfg(test)]
mod tests;
