//! Lease renewal for every lock a backend holds, driven by one task per backend.
//!
//! Each lock follows the lease schedule of [`crate::lease`]: renewed every third of its lease,
//! presumed lost if no renewal has succeeded by four fifths of the lease after the last one was
//! sent (the local deadline; the server may let someone else take it at the full lease, and
//! the holder must know first). A renewal that finds the key gone or owned by another token
//! means the lock is lost at once. One renewal of a lock is in flight at a time.
//!
//! One driver task sleeps until the earliest renewal or deadline of all entries and sends the
//! renewals that are due, together with those due within a tenth of their renewal period
//! ([`renew_early`]), in batches of up to [`BATCH`] commands, each batch one pipeline (one
//! round trip) from a task of its own (on a Cluster, whose pipelines stay within one slot, one
//! pipeline per lock, all at once). Entries are kept in the order of when the driver must
//! look at them, so a wake-up costs the entries it finds due, not all of them. Registering a
//! lock is a map insert; only a lock due earlier than the driver's planned wake-up wakes it
//! (the first one, or one with a shorter lease). A task per lock, as before, cost a spawn and a
//! cross-thread wake on every acquisition and release; a command and a task per renewal, as
//! before too, could not keep up with 100,000 locks of 9 s leases, which were lost.
//!
//! The driver runs on the runtime of the acquisition that started it, and renews the locks
//! taken from every runtime. If it stops for any reason (its runtime shut down, a panic), the
//! [`DriverStop`] its future owns declares every entry lost at once: nothing renews them any
//! more, and their holders hear it a fifth of a lease or more before anyone else can take the
//! keys. The next registration starts a new driver on its own runtime.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::{Duration, Instant};

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::commands::Extension;
use super::{Kind, OwnerToken, Shared};
use crate::LockError;
use crate::lease::{LeaseDeadline, Mark, Term, renew_early, renew_every};
use crate::time::later;

/// The renewal entries of one backend.
#[derive(Default)]
pub(super) struct Renewals {
    state: Mutex<State>,
    /// Wakes the driver when its planned wake-up is too late, or the backend is gone.
    wake: Notify,
}

/// The most renewals sent in one pipeline. A batch whose outcome is unknown (no answer in
/// time) fails every renewal in it, which are then tried again like any failed renewal.
pub(super) const BATCH: usize = 512;

#[derive(Default)]
struct State {
    /// Boxed: the map's spare room (up to half of it after it grows) costs a pointer per
    /// bucket, not a whole entry.
    entries: HashMap<u64, Box<Entry>>,
    /// Every entry by when the driver must look at it ([`Term::wake_at`]), then by id.
    queue: BTreeSet<(Mark, u64)>,
    next_id: u64,
    /// When the driver will next look, if it sleeps on a timer.
    planned: Option<Instant>,
    /// The number of the running driver, if one runs; cleared when it stops.
    driver: Option<u64>,
    /// The number of the next driver to start.
    next_driver: u64,
    /// Batches of renewals sent so far (tests).
    #[cfg(test)]
    batches: u64,
}

struct Entry {
    key: Arc<[u8]>,
    token: OwnerToken,
    /// Its place in the lease schedule. The local deadline (lost if no renewal has succeeded
    /// by then) is shared with the guard, which checks it itself: a holder paused past it
    /// hears of the loss before the driver runs again.
    term: Term,
    lost: CancellationToken,
    /// A lock, a reader's share (renewed by the read script, see `read.rs`) or a semaphore's
    /// permit (by the permit script, see `permits.rs`).
    kind: Kind,
    /// Where it is in the queue: its wake-up when last queued.
    queued: Mark,
}

impl State {
    /// Puts entry `id` back in the queue after its term changed; its new wake-up.
    fn requeue(&mut self, id: u64) -> Option<Instant> {
        let entry = self.entries.get_mut(&id)?;
        let wake_at = entry.term.wake_at();
        let queued = Mark::of(wake_at);
        if queued != entry.queued {
            self.queue.remove(&(entry.queued, id));
            self.queue.insert((queued, id));
            entry.queued = queued;
        }
        Some(wake_at)
    }

    /// Takes entry `id` out.
    fn take(&mut self, id: u64) -> Option<Entry> {
        let entry = self.entries.remove(&id)?;
        self.queue.remove(&(entry.queued, id));
        Some(*entry)
    }
}

impl Renewals {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Starts renewing a lock (a reader's share, a permit: `kind`) taken with a command sent
    /// at `sent`; returns the entry's id and the lock's local deadline (for the guard). Starts
    /// a driver on the current runtime if none runs.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn register(
        shared: &Arc<Shared>,
        kind: Kind,
        key: Arc<[u8]>,
        token: OwnerToken,
        lease: Duration,
        sent: Instant,
        lost: CancellationToken,
        renew: bool,
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
            queued: Mark::of(term.wake_at()),
            term,
            lost,
            kind,
        };
        // The entry goes in only while a driver runs (under the lock its stop takes too), so
        // no entry is ever left without a driver that renews it or declares it lost. Two
        // rounds: a driver spawned on a runtime that is shutting down stops at once.
        for _ in 0..2 {
            let mut state = renewals.state();
            if state.driver.is_some() {
                let id = state.next_id;
                state.next_id += 1;
                let (queued, wake_at) = (entry.queued, entry.term.wake_at());
                state.entries.insert(id, Box::new(entry));
                state.queue.insert((queued, id));
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
        self.state().take(id);
    }

    /// Lock `id`'s lease was set to `lease` by a command sent at `sent`: later renewals ask
    /// for it, and the driver looks at the new schedule.
    pub(super) fn extended(&self, id: u64, lease: Duration, sent: Instant) {
        let mut state = self.state();
        if let Some(entry) = state.entries.get_mut(&id) {
            entry.term.extended(lease, sent);
            if let Some(wake_at) = state.requeue(id) {
                self.plan(state, wake_at);
            }
        }
    }

    /// Stops renewing lock `id`; the driver still fires its lost token at its deadline.
    pub(super) fn stop(&self, id: u64) {
        let mut state = self.state();
        if let Some(entry) = state.entries.get_mut(&id) {
            entry.term.stop();
            state.requeue(id);
        }
    }

    /// Starts renewing lock `id` again, the first renewal at once: whether it is still
    /// counted on (renewed by the driver, its deadline not passed).
    pub(super) fn resume(&self, id: u64) -> bool {
        let mut state = self.state();
        let resumed = state
            .entries
            .get_mut(&id)
            .is_some_and(|entry| entry.term.resume(Instant::now()));
        if resumed && let Some(wake_at) = state.requeue(id) {
            self.plan(state, wake_at);
        }
        resumed
    }

    /// Lock `id` was found lost: its renewals end, and its lost token fires.
    pub(super) fn lose(&self, id: u64) {
        if let Some(entry) = self.state().take(id) {
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
            state.queue.clear();
            state.entries.drain().map(|(_, entry)| *entry).collect()
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

/// A renewal the driver started: the entry's id, key, owner, the lease asked for, and what it
/// renews.
struct Due {
    id: u64,
    key: Arc<[u8]>,
    token: OwnerToken,
    lease: Duration,
    kind: Kind,
}

/// The driver: declares overdue entries lost, sends the due renewals in batches, sleeps until
/// the next renewal or deadline. It holds the backend only while it works, and ends with it.
async fn drive(shared: Weak<Shared>, _stop: DriverStop) {
    loop {
        let Some(backend) = shared.upgrade() else {
            return;
        };
        let now = Instant::now();
        let mut due = Vec::new();
        let mut lost = Vec::new();
        let planned = {
            let mut state = backend.renewals.state();
            // The entries to look at: those whose wake-up has come, and those that may be
            // renewed early with them (within the earliest entry's early window).
            let horizon = later(now, early_window(&state));
            let look: Vec<(Mark, u64)> = state
                .queue
                .range(..=(Mark::of(horizon), u64::MAX))
                .copied()
                .collect();
            for (_, id) in look {
                let Some(entry) = state.entries.get_mut(&id) else {
                    continue;
                };
                if entry.term.is_overdue(now) {
                    if let Some(entry) = state.take(id) {
                        lost.push(entry.lost);
                    }
                } else if entry.term.may_renew(now) {
                    entry.term.start();
                    due.push(Due {
                        id,
                        key: Arc::clone(&entry.key),
                        token: entry.token.clone(),
                        lease: entry.term.lease(),
                        kind: entry.kind,
                    });
                    state.requeue(id);
                }
            }
            // With nothing to renew it still looks again a third of the default lease from
            // now, so that locks taken meanwhile with that lease need no wake-up: a busy
            // acquire/release loop then never wakes the driver.
            let planned = state
                .queue
                .first()
                .map(|&(at, _)| at.at())
                .unwrap_or_else(|| later(now, renew_every(backend.lease)));
            state.planned = Some(planned);
            #[cfg(test)]
            {
                state.batches += u64::try_from(due.len().div_ceil(BATCH)).unwrap_or(u64::MAX);
            }
            planned
        };
        if !lost.is_empty() {
            tracing::warn!(
                locks = lost.len(),
                "redis locks are presumed lost: no renewal succeeded before their lease could run out"
            );
        }
        for lost in lost {
            lost.cancel();
        }
        let mut due = due.into_iter().peekable();
        while due.peek().is_some() {
            let batch: Vec<Due> = due.by_ref().take(BATCH).collect();
            tokio::spawn(renew(Arc::clone(&backend), batch));
        }
        let renewals = Arc::clone(&backend.renewals);
        drop(backend);
        tokio::select! {
            () = renewals.wake.notified() => {}
            () = tokio::time::sleep_until(planned.into()) => {}
        }
    }
}

/// How far ahead of now the driver looks for entries to renew early with those due: the
/// [`renew_early`] window of the entry it woke for (the first in the queue). Entries with a
/// shorter window are renewed only within their own ([`Term::may_renew`]).
fn early_window(state: &State) -> Duration {
    state
        .queue
        .first()
        .and_then(|(_, id)| state.entries.get(id))
        .map_or(Duration::ZERO, |entry| {
            renew_early(crate::lease::every(
                entry.term.lease(),
                entry.term.cadence(),
            ))
        })
}

/// One batch of renewals, sent as one pipeline; updates each entry with its outcome.
async fn renew(shared: Arc<Shared>, batch: Vec<Due>) {
    // Taken before the commands are sent: the server's new leases start no earlier, so a
    // late answer never moves a deadline past what the server granted.
    let attempt = Instant::now();
    // A reader's share and a permit are renewed by a script of their own, with a second key.
    let seconds: Vec<Option<(&'static super::commands::Script, Vec<u8>)>> = batch
        .iter()
        .map(|due| match due.kind {
            Kind::Lock => None,
            Kind::Read => Some((
                super::read::extend_script(),
                super::read::readers_key(shared.layout, &due.key),
            )),
            Kind::Permit => Some((
                super::permits::extend_script(),
                super::permits::record_key(shared.layout, &due.key),
            )),
        })
        .collect();
    let items: Vec<Extension<'_>> = batch
        .iter()
        .zip(&seconds)
        .map(|(due, second)| Extension {
            key: &due.key,
            token: &due.token,
            lease: due.lease,
            script: second
                .as_ref()
                .map(|(script, second)| (*script, &second[..])),
        })
        .collect();
    // A batch with an unknown outcome has its connection killed (when fencing is on): none
    // of its renewals can extend a lease later, after the holder was told the lock is lost.
    let what = "renewing a lock";
    let outcome =
        match super::fence::fenced(&shared, what, None, shared.conn.extend_many(&items)).await {
            super::fence::Attempt::Done(outcomes) => Ok(outcomes),
            super::fence::Attempt::Failed(err)
            | super::fence::Attempt::Unknown { error: err, .. } => Err(err),
        };
    drop(items);
    let failed_at = Instant::now();
    let (mut lost, mut failed) = (Vec::new(), 0usize);
    let mut first_error = None;
    let renewals = &shared.renewals;
    let mut state = renewals.state();
    for (i, due) in batch.iter().enumerate() {
        // Released, or declared lost at its deadline, while the renewal ran.
        let Some(entry) = state.entries.get_mut(&due.id) else {
            continue;
        };
        let result = match &outcome {
            Ok(outcomes) => match outcomes.get(i) {
                Some(Ok(owned)) => Some(*owned),
                Some(Err(err)) => {
                    if first_error.is_none() {
                        first_error = Some(super::redis_error(what, err.clone(), &shared.prefix));
                    }
                    None
                }
                None => None,
            },
            Err(_) => None,
        };
        match result {
            Some(true) => entry.term.renewed(attempt),
            Some(false) => {
                if let Some(entry) = state.take(due.id) {
                    lost.push(entry.lost);
                }
                continue;
            }
            None => {
                failed += 1;
                entry.term.failed(failed_at);
            }
        }
        state.requeue(due.id);
    }
    let earliest = batch
        .iter()
        .filter_map(|due| state.entries.get(&due.id))
        .map(|entry| entry.queued.at())
        .min();
    match earliest {
        Some(wake_at) => renewals.plan(state, wake_at),
        None => drop(state),
    }
    if !lost.is_empty() {
        tracing::warn!(
            locks = lost.len(),
            "redis locks were lost: the renewal found them gone or held by another owner"
        );
    }
    for lost in lost {
        lost.cancel();
    }
    let first_error = match outcome {
        Err(err) => Some(err),
        Ok(_) => first_error,
    };
    if failed > 0 {
        let err = first_error.map_or_else(
            || "a batch of renewals got too few answers".to_owned(),
            |err| err.to_string(),
        );
        tracing::warn!(
            locks = failed,
            error = %err,
            "renewing redis locks failed; retrying until their lease may have run out"
        );
    }
}

#[cfg(test)]
mod tests;
