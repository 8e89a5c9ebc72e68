//! One key in a lock's queue, and the task that keeps it: renews its lease on the lease
//! engine's schedule (one `LeaseKeepAlive` stream per lease) and watches the key for a
//! delete. Either one finding the key gone, or the local deadline passing without a
//! confirmed renewal, cancels the lost token; the lease is then revoked, in case the key is
//! still there.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use etcd_client::{
    EventType, LeaseKeepAliveStream, LeaseKeeper, WatchFilterType, WatchOptions, WatchStream,
};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::lease::{LeaseDeadline, Term, retry_after};

use super::Shared;

/// A key this backend put in a lock's queue: `prefix/<key>/<lease id>`, created at `revision`.
pub(super) struct Entry {
    pub(super) shared: Arc<Shared>,
    pub(super) key: Vec<u8>,
    /// The key's create revision: its place in the queue, and the fencing token.
    pub(super) revision: i64,
    pub(super) lost: CancellationToken,
    state: Mutex<State>,
    /// Wakes the keeper when the state changed (an extension, renewals stopped).
    changed: Notify,
}

struct State {
    /// The lease the key is attached to (an extension moves it to a new one).
    lease_id: i64,
    term: Term,
}

impl Entry {
    /// The entry of `key`, created at `revision` on `lease_id` (granted for `lease` with a
    /// request sent at `sent`); renewed every `cadence` (a third of the lease when `None`)
    /// unless `renew` is false.
    pub(super) fn new(
        shared: Arc<Shared>,
        key: Vec<u8>,
        revision: i64,
        lease_id: i64,
        lease: Duration,
        sent: Instant,
        renew: bool,
    ) -> Arc<Entry> {
        let mut term = Term::new(lease, sent, shared.renew_every);
        if !renew {
            term.stop();
        }
        Arc::new(Entry {
            shared,
            key,
            revision,
            lost: CancellationToken::new(),
            state: Mutex::new(State { lease_id, term }),
            changed: Notify::new(),
        })
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The lease the key is attached to now.
    pub(super) fn lease_id(&self) -> i64 {
        self.state().lease_id
    }

    /// The local deadline, shared with the guard.
    pub(super) fn deadline(&self) -> LeaseDeadline {
        self.state().term.deadline()
    }

    /// Whether the lock is still counted on: not declared lost, deadline not passed.
    pub(super) fn is_live(&self) -> bool {
        !self.lost.is_cancelled() && !self.deadline().has_passed()
    }

    /// Renewals stop; the lock is presumed lost at its deadline.
    pub(super) fn stop_renewal(&self) {
        self.state().term.stop();
        self.changed.notify_one();
    }

    /// Renewals start again, the first one at once: whether the lock is still counted on
    /// (not lost, deadline not passed).
    pub(super) fn start_renewal(&self) -> bool {
        if self.lost.is_cancelled() {
            return false;
        }
        let resumed = self.state().term.resume(Instant::now());
        if resumed {
            self.changed.notify_one();
        }
        resumed
    }

    /// The key now lives on `lease_id`, of `lease`, granted with a request sent at `sent`;
    /// returns the lease it left.
    pub(super) fn moved(&self, lease_id: i64, lease: Duration, sent: Instant) -> i64 {
        let mut state = self.state();
        let old = std::mem::replace(&mut state.lease_id, lease_id);
        state.term.extended(lease, sent);
        drop(state);
        self.changed.notify_one();
        old
    }

    /// Starts the keeper on the backend's I/O thread. It runs until the returned value is
    /// dropped or the lock is lost.
    pub(super) fn keep(self: &Arc<Entry>) -> Keeper {
        let stop = CancellationToken::new();
        let entry = Arc::clone(self);
        self.shared.io.spawn(keep(entry, stop.clone()));
        Keeper {
            _stop: stop.drop_guard(),
        }
    }
}

/// Stops its entry's keeper when dropped.
pub(super) struct Keeper {
    _stop: tokio_util::sync::DropGuard,
}

/// A `LeaseKeepAlive` stream open for one lease.
struct Renewer {
    lease_id: i64,
    keeper: LeaseKeeper,
    stream: LeaseKeepAliveStream,
}

/// What a renewal found.
enum Renewal {
    /// Confirmed, or nothing was due.
    Kept,
    /// The lease is gone: so is the key.
    Gone,
    /// No answer; tried again soon.
    Failed,
}

/// How long after its acquisition a held lock's key starts to be watched. Opening a watch is
/// a stream and a round trip of its own, which most locks, held for less, would pay for
/// nothing; the watch reads the key's history from its creation, so a delete before it
/// opens is reported when it opens.
const WATCH_AFTER: Duration = Duration::from_millis(100);

/// Keeps `entry` until `stop` fires or the lock is lost.
async fn keep(entry: Arc<Entry>, stop: CancellationToken) {
    let mut renewer: Option<Renewer> = None;
    let mut watch: Option<WatchStream> = None;
    // Watching starts from the key's creation, so a delete before the watch opens is still
    // seen; a compaction moves it on. The watch opens `WATCH_AFTER` in: a lock held shorter
    // costs no watch stream.
    let mut watch_from = entry.revision + 1;
    let mut watch_at = tokio::time::Instant::now() + WATCH_AFTER;
    loop {
        let wake = entry.state().term.wake_at();
        let watching = watch.is_some();
        tokio::select! {
            biased;
            () = stop.cancelled() => return,
            () = entry.lost.cancelled() => break,
            () = entry.changed.notified() => {}
            () = tokio::time::sleep_until(wake.into()) => {
                match renew(&entry, &mut renewer).await {
                    Renewal::Kept | Renewal::Failed => {}
                    Renewal::Gone => break,
                }
                if entry.state().term.is_overdue(Instant::now()) {
                    break;
                }
            }
            () = tokio::time::sleep_until(watch_at), if !watching => {
                match open_watch(&entry, watch_from).await {
                    Ok(stream) => watch = Some(stream),
                    Err(()) => watch_at = tokio::time::Instant::now() + pause(&entry),
                }
            }
            message = next_message(&mut watch), if watching => match message {
                Watched::Quiet => {}
                Watched::Deleted => break,
                Watched::Broken => {
                    watch = None;
                    watch_at = tokio::time::Instant::now() + pause(&entry);
                }
                Watched::Compacted => {
                    watch = None;
                    match still_there(&entry).await {
                        Some(Some(revision)) => {
                            watch_from = revision + 1;
                            watch_at = tokio::time::Instant::now();
                        }
                        Some(None) => break,
                        None => watch_at = tokio::time::Instant::now() + pause(&entry),
                    }
                }
            },
        }
    }
    // Lost (or presumed lost): tell the holder, and revoke the lease in case the key is still
    // there, so that the next in line need not wait for it to expire.
    entry.lost.cancel();
    drop((renewer, watch));
    if stop.is_cancelled() {
        return;
    }
    let lease_id = entry.lease_id();
    entry.shared.revoke(lease_id).await;
}

/// The pause before a failed watch is opened again.
fn pause(entry: &Entry) -> Duration {
    retry_after(entry.state().term.lease())
}

/// Renews the lease if a renewal is due.
async fn renew(entry: &Entry, renewer: &mut Option<Renewer>) -> Renewal {
    let (lease_id, lease, deadline) = {
        let mut state = entry.state();
        let now = Instant::now();
        if !state.term.is_due(now) {
            return Renewal::Kept;
        }
        state.term.start();
        (state.lease_id, state.term.lease(), state.term.deadline())
    };
    let sent = Instant::now();
    // A keep-alive stuck on a leader that died is given up on soon enough for the retries
    // to reach the new one before the deadline.
    let limit = entry
        .shared
        .timeout
        .min(lease / 5)
        .min(deadline.at().saturating_duration_since(sent));
    let answer = tokio::time::timeout(limit, keep_alive(entry, renewer, lease_id)).await;
    let mut state = entry.state();
    if state.lease_id != lease_id {
        // An extension moved the key to another lease meanwhile: this renewal counts for
        // nothing, and the next one renews the new lease.
        state.term.failed(Instant::now());
        *renewer = None;
        return Renewal::Kept;
    }
    match answer {
        Ok(Ok(ttl)) if ttl > 0 => {
            state.term.renewed(sent);
            Renewal::Kept
        }
        Ok(Ok(_)) => Renewal::Gone,
        Ok(Err(err)) => {
            *renewer = None;
            if is_lease_gone(&err) {
                return Renewal::Gone;
            }
            tracing::debug!(error = %err, "an etcd lease keep-alive failed; retrying");
            state.term.failed(Instant::now());
            Renewal::Failed
        }
        Err(_) => {
            *renewer = None;
            state.term.failed(Instant::now());
            Renewal::Failed
        }
    }
}

/// One keep-alive of `lease_id`: the lease's TTL as the server answers it (0: gone).
async fn keep_alive(
    entry: &Entry,
    renewer: &mut Option<Renewer>,
    lease_id: i64,
) -> Result<i64, etcd_client::Error> {
    if let Some(open) = renewer.as_mut().filter(|open| open.lease_id == lease_id) {
        open.keeper.keep_alive().await?;
        return match open.stream.message().await? {
            Some(answer) => Ok(answer.ttl()),
            None => Err(etcd_client::Error::LeaseKeepAliveError(
                "the keep-alive stream ended".to_owned(),
            )),
        };
    }
    // Opening the stream sends the first keep-alive and reads its answer.
    let (keeper, stream) = entry
        .shared
        .client
        .lease_client()
        .keep_alive(lease_id)
        .await?;
    *renewer = Some(Renewer {
        lease_id,
        keeper,
        stream,
    });
    Ok(1)
}

/// Whether a keep-alive error says the lease no longer exists.
pub(super) fn is_lease_gone(err: &etcd_client::Error) -> bool {
    match err {
        etcd_client::Error::LeaseKeepAliveError(message) => message.contains("not found"),
        etcd_client::Error::GRpcStatus(status) => status.message().contains("lease not found"),
        _ => false,
    }
}

/// What the watch of the entry's own key said.
enum Watched {
    /// Nothing that matters.
    Quiet,
    /// The key was deleted.
    Deleted,
    /// The watch ended or failed: opened again after a pause.
    Broken,
    /// The revisions to watch from were compacted away: the key is read instead.
    Compacted,
}

async fn open_watch(entry: &Entry, from: i64) -> Result<WatchStream, ()> {
    let options = WatchOptions::new()
        .with_start_revision(from)
        .with_filters([WatchFilterType::NoPut]);
    let mut client = entry.shared.client.watch_client();
    let opening = client.watch(entry.key.clone(), Some(options));
    match tokio::time::timeout(entry.shared.timeout, opening).await {
        Ok(Ok(stream)) => Ok(stream),
        Ok(Err(err)) => {
            tracing::debug!(error = %err, "watching an etcd lock key failed; retrying");
            Err(())
        }
        Err(_) => Err(()),
    }
}

async fn next_message(watch: &mut Option<WatchStream>) -> Watched {
    let Some(stream) = watch.as_mut() else {
        return std::future::pending().await;
    };
    match stream.message().await {
        Ok(Some(answer)) => {
            if answer.compact_revision() > 0 {
                Watched::Compacted
            } else if answer
                .events()
                .iter()
                .any(|event| event.event_type() == EventType::Delete)
            {
                Watched::Deleted
            } else if answer.canceled() {
                Watched::Broken
            } else {
                Watched::Quiet
            }
        }
        Ok(None) | Err(_) => Watched::Broken,
    }
}

/// Reads the entry's key: `Some(Some(revision))` (the store's revision) when it is still the
/// entry's, `Some(None)` when it is gone, `None` when the read failed.
async fn still_there(entry: &Entry) -> Option<Option<i64>> {
    let mut client = entry.shared.client.kv_client();
    let read = client.get(entry.key.clone(), None);
    let answer = tokio::time::timeout(entry.shared.timeout, read)
        .await
        .ok()?
        .ok()?;
    let mine = answer
        .kvs()
        .first()
        .is_some_and(|kv| kv.create_revision() == entry.revision);
    let revision = answer.header().map_or(entry.revision, |h| h.revision());
    Some(mine.then_some(revision))
}
