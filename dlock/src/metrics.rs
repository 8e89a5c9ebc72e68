//! OpenTelemetry instruments of a provider.
//!
//! Instruments come from the meter named `dlock` ([`DEFAULT_METER_NAME`]), by default from the
//! global meter provider (a no-op until the application installs an SDK; install it before
//! creating providers). [`ProviderBuilder::meter_name`](crate::ProviderBuilder::meter_name)
//! names the meter otherwise, and [`ProviderBuilder::meter`](crate::ProviderBuilder::meter)
//! takes a meter from any meter provider.
//!
//! | instrument | kind | unit | attributes |
//! |---|---|---|---|
//! | `distributed_lock.acquisitions` | counter | `{acquisition}` | `lock_type`, `status` (`acquired`, `already_held`, `timeout`, `canceled`, `error`) |
//! | `distributed_lock.wait_duration` | histogram | `ms` | `lock_type`, `status` |
//! | `distributed_lock.hold_duration` | histogram | `ms` | `lock_type` |
//! | `distributed_lock.lost` | counter | `{lock}` | `lock_type` (and `lock_id` with `resource_id`, below) |
//! | `distributed_lock.held` | up-down counter (a gauge) | `{lock}` | `lock_type` |
//! | `distributed_lock.waiting` | up-down counter (a gauge) | `{acquisition}` | `lock_type` |
//!
//! `distributed_lock.held` is the number of locks held now: one from the moment an acquisition
//! hands out its guard until the guard's release has finished (or its background release,
//! after a drop), as [`LockProvider::held_locks`](crate::LockProvider::held_locks) lists them;
//! a lost lock counts until its guard is released. `distributed_lock.waiting` is the number of
//! acquisitions waiting now: those with a timeout (not single tries), from their start until
//! they have their answer, including the time they queue behind a holder in this process.
//! Semaphore waits ([`acquire_semaphore`](crate::LockProvider::acquire_semaphore)) are rounds
//! of single tries and are not counted there.
//!
//! `lock_type` is the backend's name. Two attributes are opt-in, on every instrument:
//!
//! - `key_prefix`, with [`ProviderBuilder::metric_key_prefix`](crate::ProviderBuilder::metric_key_prefix):
//!   the text before the key's first `:` (empty when there is none).
//! - `resource_id`, with [`ProviderBuilder::metric_resource_id`](crate::ProviderBuilder::metric_resource_id):
//!   the whole key. **Every distinct key becomes its own time series** in every instrument, and
//!   the SDK keeps each one for the life of the process: turn it on only when the keys are few
//!   and fixed (a handful of job names), never for keys made from ids (`account:{id}`). The
//!   SDK's cardinality limit (2,000 series per instrument by default) then folds the rest into
//!   one overflow series, and the totals per key are lost. `distributed_lock.lost` then also
//!   carries `lock_id`, the key's 64-bit id ([`lock_id`](crate::lock_id)), as the .NET library
//!   dlock follows tags it.
//!
//! # When a loss is counted
//!
//! `distributed_lock.lost` counts a lock once, when its loss is detected: when its
//! [lost token](crate::LockGuard::lost_token) fires (its connection died, a renewal failed or
//! was refused, its lease's local deadline passed, including when
//! [`LockGuard::is_lost`](crate::LockGuard::is_lost) finds it passed), or when the release finds
//! it gone. A lost lock that is then released or dropped is not counted again. Each provider
//! watches the lost tokens of its held locks from one background task (no task per lock), started
//! on the Tokio runtime of its first acquisition.
//!
//! `distributed_lock.hold_duration` is recorded when the hold ends: the time from the
//! acquisition to the start of the release (or the drop of the guard).
//!
//! # Transaction-bound locks
//!
//! [`TransactionLock`](crate::TransactionLock)s record `distributed_lock.acquisitions`,
//! `distributed_lock.wait_duration`, `distributed_lock.hold_duration` and
//! `distributed_lock.held` (not `distributed_lock.waiting`) with the same
//! attributes (`lock_type`, `status`; no opt-in attributes), into the meter given to
//! [`set_transaction_meter`], or else the global meter provider's meter named `dlock` as it is
//! at the first transaction-bound acquisition. Their hold runs from the acquisition until the
//! `TransactionLock` (its last clone) is dropped: keep it until the transaction commits or rolls
//! back for the hold to measure the lock. Losses are not counted: the lock ends with the
//! transaction, which dlock does not see.
//!
//! # Dashboards shared with .NET services
//!
//! The .NET distributed-lock library whose design dlock follows records the same four
//! instruments, with the same names, units and `lock_type`/`status` values, under the meter
//! named `EricksonLopez.DistributedLock` ([`DOTNET_METER_NAME`]). Give a provider that name to
//! have both in one meter. That library also tags its points with the key as `resource_id`;
//! [`metric_resource_id`](crate::ProviderBuilder::metric_resource_id) does the same here (mind
//! the cardinality warning above):
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), dlock::LockError> {
//! # let dir = tempfile::tempdir().unwrap();
//! # let path = dir.path().join("locks.db");
//! let backend = dlock::sqlite::SqliteBackend::open(&path).await?;
//! let locks = dlock::LockProvider::builder(backend)
//!     .meter_name(dlock::metrics::DOTNET_METER_NAME)
//!     .build();
//! // Transaction-bound locks too:
//! dlock::metrics::set_transaction_meter(opentelemetry::global::meter(
//!     dlock::metrics::DOTNET_METER_NAME,
//! ));
//! # let _ = locks; Ok(()) }
//! ```

use std::pin::Pin;
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use opentelemetry::KeyValue;
use opentelemetry::metrics::{Counter, Histogram, Meter, UpDownCounter};
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};

use crate::LockError;

/// The name of the meter providers record into unless told otherwise.
pub const DEFAULT_METER_NAME: &str = "dlock";

/// The meter name of the .NET distributed-lock library whose design dlock follows, for
/// dashboards shared with .NET services (see [the module docs](self)).
pub const DOTNET_METER_NAME: &str = "EricksonLopez.DistributedLock";

/// The attributes a provider adds beyond `lock_type` and `status`.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct OptIn {
    pub(crate) key_prefix: bool,
    pub(crate) resource_id: bool,
}

/// The instruments one provider records into.
#[derive(Debug)]
pub(crate) struct Metrics {
    acquisitions: Counter<u64>,
    wait: Histogram<f64>,
    hold: Histogram<f64>,
    lost: Counter<u64>,
    /// The locks held now.
    held_now: UpDownCounter<i64>,
    /// The acquisitions waiting now.
    waiting: UpDownCounter<i64>,
    opt_in: OptIn,
    /// The provider's backend, named by its guards (empty for transaction-bound locks, which
    /// name theirs at each point).
    backend: &'static str,
    watcher: Watcher,
}

impl Metrics {
    pub(crate) fn new(meter: &Meter, opt_in: OptIn, backend: &'static str) -> Self {
        Metrics {
            acquisitions: meter
                .u64_counter("distributed_lock.acquisitions")
                .with_description("Lock acquisitions, by outcome")
                .with_unit("{acquisition}")
                .build(),
            wait: meter
                .f64_histogram("distributed_lock.wait_duration")
                .with_description("Time from asking for a lock to the answer")
                .with_unit("ms")
                .build(),
            hold: meter
                .f64_histogram("distributed_lock.hold_duration")
                .with_description("Time a lock was held, from acquisition to release or drop")
                .with_unit("ms")
                .build(),
            lost: meter
                .u64_counter("distributed_lock.lost")
                .with_description("Locks lost while held, counted when the loss is detected")
                .with_unit("{lock}")
                .build(),
            held_now: meter
                .i64_up_down_counter("distributed_lock.held")
                .with_description("Locks held now, from acquisition until their release ends")
                .with_unit("{lock}")
                .build(),
            waiting: meter
                .i64_up_down_counter("distributed_lock.waiting")
                .with_description("Acquisitions with a timeout waiting for their answer now")
                .with_unit("{acquisition}")
                .build(),
            opt_in,
            backend,
            watcher: Watcher::default(),
        }
    }

    /// The provider's backend.
    pub(crate) fn backend(&self) -> &'static str {
        self.backend
    }

    /// Calls `f` with the attributes of one point: `lock_type`, `status` when given, and the
    /// opt-in ones. Allocates only for the opt-in ones.
    fn with_attributes(
        &self,
        backend: &'static str,
        status: Option<&'static str>,
        key: &str,
        f: impl FnOnce(&[KeyValue]),
    ) {
        let lock_type = KeyValue::new("lock_type", backend);
        let OptIn {
            key_prefix,
            resource_id,
        } = self.opt_in;
        if !key_prefix && !resource_id {
            return match status {
                Some(status) => f(&[lock_type, KeyValue::new("status", status)]),
                None => f(&[lock_type]),
            };
        }
        let mut attributes = Vec::with_capacity(4);
        attributes.push(lock_type);
        if let Some(status) = status {
            attributes.push(KeyValue::new("status", status));
        }
        if key_prefix {
            attributes.push(key_prefix_attribute(key));
        }
        if resource_id {
            attributes.push(KeyValue::new("resource_id", key.to_owned()));
        }
        f(&attributes);
    }

    /// Records the outcome of one acquisition.
    pub(crate) fn acquisition<T>(
        &self,
        backend: &'static str,
        key: &str,
        outcome: &Result<T, LockError>,
        waited: Duration,
    ) {
        let status = match outcome {
            Ok(_) => "acquired",
            Err(LockError::AlreadyHeld { .. }) => "already_held",
            Err(LockError::Timeout { .. }) => "timeout",
            Err(LockError::Canceled { .. }) => "canceled",
            // A key that is not a key never reached a store.
            Err(LockError::InvalidKey { .. }) => return,
            Err(_) => "error",
        };
        self.with_attributes(backend, Some(status), key, |attributes| {
            self.acquisitions.add(1, attributes);
            self.wait.record(millis(waited), attributes);
        });
    }

    /// A hold began: counted in `distributed_lock.held` until [`held`](Metrics::held) records
    /// its end (once for each hold).
    pub(crate) fn hold_started(&self, backend: &'static str, key: &str) {
        self.with_attributes(backend, None, key, |attributes| {
            self.held_now.add(1, attributes);
        });
    }

    /// Records the duration of a hold that ended, and takes it out of `distributed_lock.held`.
    pub(crate) fn held(&self, backend: &'static str, key: &str, held: Duration) {
        self.with_attributes(backend, None, key, |attributes| {
            self.hold.record(millis(held), attributes);
            self.held_now.add(-1, attributes);
        });
    }

    /// An acquisition of `key` starts waiting: counted in `distributed_lock.waiting` until the
    /// returned mark is dropped (its answer came, or its future was dropped).
    pub(crate) fn wait_started<'a>(&'a self, backend: &'static str, key: &'a str) -> Waiting<'a> {
        self.with_attributes(backend, None, key, |attributes| {
            self.waiting.add(1, attributes);
        });
        Waiting {
            metrics: self,
            backend,
            key,
        }
    }

    /// Starts keeping a lock just acquired: what inspection shows of it, and a waiter on its
    /// lost token, so that its loss is counted as soon as the token fires, until
    /// [`Metrics::end`]. `runtime` runs the provider's watcher task if it has none yet.
    pub(crate) fn watch(self: &Arc<Self>, runtime: &tokio::runtime::Handle, shown: Shown) -> Hold {
        let key = Arc::clone(&shown.key);
        let mut record = Box::pin(Record {
            waiter: shown.lost.clone().cancelled_owned(),
            shown,
            counted: false,
        });
        let (hold, fired, start) = {
            let mut state = lock(&self.watcher.shared.state);
            let slot = match state.free.pop() {
                Some(slot) => slot,
                None => {
                    let slot = u32::try_from(state.slots.len()).unwrap_or(u32::MAX);
                    let waker = Arc::new(SlotWaker {
                        shared: Arc::downgrade(&self.watcher.shared),
                        slot,
                    });
                    state.slots.push(Slot {
                        waker,
                        id: 0,
                        record: None,
                    });
                    slot
                }
            };
            let id = state.next_id;
            state.next_id = state.next_id.wrapping_add(1);
            let start = !state.running;
            state.running = true;
            // Polled here, under the lock: registers the waiter on the token with the slot's
            // waker (a poll of the waiter never wakes anything), or finds it fired already.
            let entry = &mut state.slots[slot as usize];
            let fired = record
                .as_mut()
                .project()
                .waiter
                .poll(&mut Context::from_waker(&Waker::from(Arc::clone(
                    &entry.waker,
                ))))
                .is_ready();
            if fired {
                *record.as_mut().project().counted = true;
            }
            entry.id = id;
            entry.record = Some(record);
            (Hold { slot, id }, fired, start)
        };
        if start {
            // Made here: a task dropped unrun (its runtime shutting down) still marks itself
            // gone, and the next watch starts another.
            let running = Running(Arc::downgrade(&self.watcher.shared));
            drop(runtime.spawn(run(Arc::downgrade(self), running)));
        }
        if fired {
            self.count_lost(self.backend, &key);
        }
        hold
    }

    /// Counts the loss of a held lock, unless it was counted already or its hold had ended.
    pub(crate) fn lost(&self, hold: Hold, backend: &'static str, key: &str) {
        let first = {
            let mut state = lock(&self.watcher.shared.state);
            match state.record(hold) {
                Some(record) if !record.counted => {
                    *record.project().counted = true;
                    true
                }
                _ => false,
            }
        };
        if first {
            self.count_lost(backend, key);
        }
    }

    /// The hold is over: a loss not counted by now is not a loss of this hold, and inspection
    /// no longer shows it. Its waiter goes at once, with no wake-up of the watcher task.
    pub(crate) fn end(&self, hold: Hold) {
        let removed = {
            let mut state = lock(&self.watcher.shared.state);
            let removed = state
                .slots
                .get_mut(hold.slot as usize)
                .filter(|entry| entry.id == hold.id)
                .and_then(|entry| entry.record.take());
            if removed.is_some() {
                state.free.push(hold.slot);
            }
            removed
        };
        // Dropped outside the watcher's lock.
        drop(removed);
    }

    /// What inspection shows of each lock held now.
    pub(crate) fn shown(&self) -> Vec<Shown> {
        let state = lock(&self.watcher.shared.state);
        state
            .slots
            .iter()
            .filter_map(|entry| entry.record.as_ref().map(|record| record.shown.clone()))
            .collect()
    }

    fn count_lost(&self, backend: &'static str, key: &str) {
        tracing::warn!(key, backend, "the lock was lost while held");
        self.with_attributes(backend, None, key, |attributes| {
            if self.opt_in.resource_id {
                // With the key, its 64-bit id, as the .NET library tags its losses.
                let mut attributes = attributes.to_vec();
                attributes.push(KeyValue::new("lock_id", crate::lock_id(key)));
                self.lost.add(1, &attributes);
            } else {
                self.lost.add(1, attributes);
            }
        });
    }
}

/// An acquisition counted in `distributed_lock.waiting`, until this is dropped.
pub(crate) struct Waiting<'a> {
    metrics: &'a Metrics,
    backend: &'static str,
    key: &'a str,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.metrics
            .with_attributes(self.backend, None, self.key, |attributes| {
                self.metrics.waiting.add(-1, attributes);
            });
    }
}

/// A held lock as [`LockProvider::held_locks`](crate::LockProvider::held_locks) shows it.
#[derive(Debug, Clone)]
pub(crate) struct Shown {
    pub(crate) key: Arc<str>,
    pub(crate) since: std::time::SystemTime,
    pub(crate) fencing_token: Option<u64>,
    pub(crate) lease_deadline: Option<crate::backend::LeaseDeadline>,
    pub(crate) lost: CancellationToken,
    /// A read (shared) lock.
    pub(crate) shared: bool,
    /// A permit of a semaphore of this many permits.
    pub(crate) semaphore: Option<u32>,
}

/// Where the watcher keeps one held lock: its slot, and the number of the hold there (slots
/// are reused once a hold ends).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Hold {
    slot: u32,
    id: u32,
}

pin_project_lite::pin_project! {
    /// One held lock, in one allocation: what inspection shows, whether its loss was counted,
    /// and the waiter on its lost token (registered with its slot's waker).
    struct Record {
        #[pin]
        waiter: WaitForCancellationFutureOwned,
        shown: Shown,
        counted: bool,
    }
}

/// Keeps the held locks of one provider, and counts their losses from one task: the waker of
/// each slot marks it ready, and the task looks at the ready slots only. Watching a lock costs
/// its record (one allocation) and a slot, not a task or a future of its own.
#[derive(Debug, Default)]
struct Watcher {
    shared: Arc<Shared>,
}

#[derive(Default)]
struct Shared {
    state: Mutex<WatchState>,
}

#[derive(Default)]
struct WatchState {
    /// The held locks, by slot.
    slots: Vec<Slot>,
    /// The number of the next hold.
    next_id: u32,
    free: Vec<u32>,
    ready: Vec<u32>,
    /// The watcher task, when it waits for a slot to be ready.
    task: Option<Waker>,
    /// Whether a watcher task is alive (it dies with its runtime; the next watch starts one).
    running: bool,
}

/// One slot of the watcher: its waker (made once, kept while the slot is reused), and the
/// record of the hold in it, if any.
struct Slot {
    /// Kept as the `Arc` a waker is made from (a pointer, not a waker's two).
    waker: Arc<SlotWaker>,
    id: u32,
    record: Option<Pin<Box<Record>>>,
}

impl WatchState {
    /// The record of `hold`, if it has not ended.
    fn record(&mut self, hold: Hold) -> Option<Pin<&mut Record>> {
        self.slots
            .get_mut(hold.slot as usize)
            .filter(|entry| entry.id == hold.id)
            .and_then(|entry| entry.record.as_mut())
            .map(Pin::as_mut)
    }
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = lock(&self.state);
        f.debug_struct("Watcher")
            .field("slots", &state.slots.len())
            .field("free", &state.free.len())
            .field("running", &state.running)
            .finish()
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        // The watcher task ends when it finds the provider's metrics gone.
        let task = self
            .state
            .get_mut()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .task
            .take();
        if let Some(task) = task {
            task.wake();
        }
    }
}

fn lock(state: &Mutex<WatchState>) -> std::sync::MutexGuard<'_, WatchState> {
    // Nothing panics while holding it; if something did, the state is still consistent.
    state
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The waker of one slot.
struct SlotWaker {
    shared: Weak<Shared>,
    slot: u32,
}

impl Wake for SlotWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        if let Some(shared) = self.shared.upgrade() {
            let task = {
                let mut state = lock(&shared.state);
                state.ready.push(self.slot);
                state.task.take()
            };
            if let Some(task) = task {
                task.wake();
            }
        }
    }
}

/// Marks the watcher task gone when it is dropped (finished, or dropped with its runtime).
struct Running(Weak<Shared>);

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(shared) = self.0.upgrade() {
            let mut state = lock(&shared.state);
            state.running = false;
            state.task = None;
        }
    }
}

/// The watcher task: looks at the ready slots, counting the losses of their locks, until the
/// provider's metrics are gone.
async fn run(metrics: Weak<Metrics>, running: Running) {
    let mut lost: Vec<Arc<str>> = Vec::new();
    std::future::poll_fn(|cx| {
        let Some(metrics) = metrics.upgrade() else {
            return Poll::Ready(());
        };
        {
            let mut state = lock(&metrics.watcher.shared.state);
            if state.ready.is_empty() {
                state.task = Some(cx.waker().clone());
                return Poll::Pending;
            }
            let WatchState { slots, ready, .. } = &mut *state;
            for slot in ready.drain(..) {
                // A slot whose hold ended (or that was woken twice) has nothing to look at;
                // a wake-up left from an earlier hold of the slot is answered by the one there
                // now.
                let Some(entry) = slots.get_mut(slot as usize) else {
                    continue;
                };
                let Some(record) = entry.record.as_mut() else {
                    continue;
                };
                let record = record.as_mut().project();
                if *record.counted {
                    continue;
                }
                // Under the lock: a poll of the waiter never wakes anything. Not fired (the
                // wake-up was for an earlier hold): it waits again.
                if record
                    .waiter
                    .poll(&mut Context::from_waker(&Waker::from(Arc::clone(
                        &entry.waker,
                    ))))
                    .is_ready()
                {
                    *record.counted = true;
                    lost.push(Arc::clone(&record.shown.key));
                }
            }
        }
        // Counted without the lock.
        for key in lost.drain(..) {
            metrics.count_lost(metrics.backend, &key);
        }
        // Let the runtime's other tasks run before the next batch.
        cx.waker().wake_by_ref();
        Poll::Pending
    })
    .await;
    drop(running);
}

/// The instruments transaction-bound locks record into: the meter given to
/// [`set_transaction_meter`], or the global meter provider's meter named `dlock` at the first
/// transaction-bound acquisition.
static TRANSACTION_METRICS: OnceLock<Metrics> = OnceLock::new();

/// Sets the meter that transaction-bound locks ([`TransactionLock`](crate::TransactionLock))
/// record into, instead of the global meter provider's meter named `dlock`. Call it once, before
/// the first transaction-bound acquisition; returns `false` (and changes nothing) when they
/// already record into a meter.
pub fn set_transaction_meter(meter: Meter) -> bool {
    let mut set = false;
    TRANSACTION_METRICS.get_or_init(|| {
        set = true;
        Metrics::new(&meter, OptIn::default(), "")
    });
    set
}

/// The instruments of transaction-bound locks.
pub(crate) fn transaction_metrics() -> &'static Metrics {
    TRANSACTION_METRICS.get_or_init(|| {
        Metrics::new(
            &opentelemetry::global::meter(DEFAULT_METER_NAME),
            OptIn::default(),
            "",
        )
    })
}

fn key_prefix_attribute(key: &str) -> KeyValue {
    // A key without `:` has no prefix: reporting the whole key would make the attribute unbounded.
    let prefix = key.split_once(':').map_or("", |(prefix, _)| prefix);
    KeyValue::new("key_prefix", prefix.to_owned())
}

/// Runs `future` inside `span`. A disabled span (no subscriber takes it) is not entered and
/// left on every poll: with `tracing`'s `log` feature on (sqlx turns it on) and no subscriber
/// set, each entry and exit asks the `log` crate whether to log it (about 600 instructions of
/// the 19,000 that dlock adds to an uncontended MySQL acquire and release, counted with
/// callgrind).
pub(crate) async fn in_span<F: std::future::Future>(span: tracing::Span, future: F) -> F::Output {
    if span.is_disabled() {
        future.await
    } else {
        tracing::Instrument::instrument(future, span).await
    }
}

fn millis(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use tokio_util::sync::CancellationToken;

    use super::{Hold, Metrics, OptIn, Shown};
    use crate::testing::Recorder;

    fn lost(n: u64) -> Vec<(Vec<(String, String)>, u64)> {
        vec![(vec![("lock_type".to_owned(), "memory".to_owned())], n)]
    }

    /// (slots, free slots, watcher running).
    fn slots(metrics: &Metrics) -> (usize, usize, bool) {
        let state = super::lock(&metrics.watcher.shared.state);
        (state.slots.len(), state.free.len(), state.running)
    }

    fn watch(metrics: &Arc<Metrics>, key: &str, token: &CancellationToken) -> Hold {
        let shown = Shown {
            key: Arc::from(key),
            since: std::time::SystemTime::now(),
            fencing_token: None,
            lease_deadline: None,
            lost: token.clone(),
            shared: false,
            semaphore: None,
        };
        metrics.watch(&tokio::runtime::Handle::current(), shown)
    }

    /// Ended holds give their slots back, and the slots are reused: the watcher does not grow
    /// with the number of locks taken one after another. An ended hold is not counted when its
    /// token fires later; a loss is counted once, by whichever of the watcher and the hold
    /// sees it first.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn holds_end_and_their_slots_are_reused() {
        let recorder = Recorder::new();
        let metrics = Arc::new(Metrics::new(&recorder.meter(), OptIn::default(), "memory"));
        for _ in 0..50 {
            let token = CancellationToken::new();
            let hold = watch(&metrics, "a", &token);
            metrics.end(hold);
            token.cancel();
        }
        assert_eq!(slots(&metrics), (1, 1, true));

        // A burst: many holds at once, all ended.
        let token = CancellationToken::new();
        let holds: Vec<_> = (0..300).map(|_| watch(&metrics, "a", &token)).collect();
        assert_eq!(metrics.shown().len(), 300);
        for hold in holds {
            metrics.end(hold);
        }
        token.cancel();
        assert_eq!(slots(&metrics), (300, 300, true));
        assert!(metrics.shown().is_empty());

        let token = CancellationToken::new();
        let hold = watch(&metrics, "a", &token);
        token.cancel();
        recorder.until("distributed_lock.lost", &lost(1)).await;
        metrics.lost(hold, "memory", "a");
        assert_eq!(metrics.shown().len(), 1, "shown until the hold ends");
        metrics.end(hold);
        assert!(metrics.shown().is_empty());
        // Later wake-ups of the slot (none is due here) would find nothing to count.
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(recorder.points("distributed_lock.lost"), lost(1));
    }

    /// A hold that ends takes its record out at once, with no wake-up of the watcher task
    /// (here the task never runs in between). A loss is still counted through the task, and a
    /// token that fired before the watch began is counted where it starts. A hold ended late,
    /// after its slot went to another, leaves the other alone.
    #[tokio::test(flavor = "current_thread")]
    async fn a_hold_that_ends_takes_its_record_out_at_once() {
        let recorder = Recorder::new();
        let metrics = Arc::new(Metrics::new(&recorder.meter(), OptIn::default(), "memory"));
        for _ in 0..10 {
            let token = CancellationToken::new();
            let hold = watch(&metrics, "a", &token);
            assert_eq!(slots(&metrics), (1, 0, true));
            metrics.end(hold);
            metrics.end(hold);
            assert_eq!(slots(&metrics), (1, 1, true));
            token.cancel();
        }
        let first = watch(&metrics, "a", &CancellationToken::new());
        metrics.end(first);
        let token = CancellationToken::new();
        let second = watch(&metrics, "b", &token);
        metrics.end(first);
        metrics.lost(first, "memory", "a");
        assert_eq!(slots(&metrics), (1, 0, true));
        assert!(recorder.points("distributed_lock.lost").is_empty());
        let shown = metrics.shown();
        assert_eq!(shown.len(), 1);
        assert_eq!(&*shown[0].key, "b");
        token.cancel();
        recorder.until("distributed_lock.lost", &lost(1)).await;
        metrics.end(second);
        assert_eq!(slots(&metrics).1, 1);

        let fired = CancellationToken::new();
        fired.cancel();
        let hold = watch(&metrics, "c", &fired);
        assert_eq!(recorder.points("distributed_lock.lost"), lost(2));
        metrics.lost(hold, "memory", "c");
        metrics.end(hold);
        assert_eq!(slots(&metrics).1, 1);
        assert_eq!(recorder.points("distributed_lock.lost"), lost(2));
    }

    /// The watcher task dies with its runtime; the next watch starts another on its own
    /// runtime, and losses are counted there.
    #[test]
    fn the_watcher_outlives_its_runtime() {
        let recorder = Recorder::new();
        let metrics = Arc::new(Metrics::new(&recorder.meter(), OptIn::default(), "memory"));
        let first = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let token = CancellationToken::new();
        let hold = first.block_on(async {
            let hold = watch(&metrics, "a", &token);
            tokio::task::yield_now().await;
            hold
        });
        drop(first);
        assert!(!slots(&metrics).2, "the watcher task went with its runtime");
        metrics.end(hold);

        let second = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        second.block_on(async {
            let token = CancellationToken::new();
            let _hold = watch(&metrics, "a", &token);
            token.cancel();
            recorder.until("distributed_lock.lost", &lost(1)).await;
        });
    }
}
