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
//! | `distributed_lock.lost` | counter | `{lock}` | `lock_type` |
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
//!   one overflow series, and the totals per key are lost.
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
//! `distributed_lock.wait_duration` and `distributed_lock.hold_duration` with the same
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
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use opentelemetry::KeyValue;
use opentelemetry::metrics::{Counter, Histogram, Meter};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

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
    opt_in: OptIn,
    watcher: Watcher,
}

impl Metrics {
    pub(crate) fn new(meter: &Meter, opt_in: OptIn) -> Self {
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
            opt_in,
            watcher: Watcher::default(),
        }
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

    /// Records the duration of a hold that ended.
    pub(crate) fn held(&self, backend: &'static str, key: &str, held: Duration) {
        self.with_attributes(backend, None, key, |attributes| {
            self.hold.record(millis(held), attributes);
        });
    }

    /// Starts watching the lost token of a lock just acquired: its loss is counted as soon as
    /// the token fires, until [`Hold::end`]. `runtime` runs the provider's watcher task if it
    /// has none yet.
    pub(crate) fn watch(
        self: &Arc<Self>,
        runtime: &tokio::runtime::Handle,
        backend: &'static str,
        key: &Arc<str>,
        lost: &CancellationToken,
    ) -> Arc<Hold> {
        let (slot, id) = self.watcher.reserve();
        let hold = Arc::new(Hold {
            state: AtomicU8::new(HOLDING),
            ended: Notify::new(),
            watcher: Arc::downgrade(&self.watcher.shared),
            slot,
            id,
        });
        let watch = {
            let (metrics, hold, key, lost) = (
                Arc::clone(self),
                Arc::clone(&hold),
                Arc::clone(key),
                lost.clone(),
            );
            async move {
                // A short hold may be over before the watcher first looks: nothing to register.
                if hold.state.load(Ordering::Acquire) == ENDED {
                    return;
                }
                tokio::select! {
                    biased;
                    () = lost.cancelled() => metrics.lost(&hold, backend, &key),
                    () = hold.ended.notified() => {}
                }
            }
        };
        self.watcher.watch(runtime, slot, id, Box::pin(watch));
        hold
    }

    /// Counts the loss of a held lock, unless it was counted already or its hold had ended.
    pub(crate) fn lost(&self, hold: &Hold, backend: &'static str, key: &str) {
        if hold
            .state
            .compare_exchange(HOLDING, COUNTED, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return;
        }
        tracing::warn!(key, backend, "the lock was lost while held");
        self.with_attributes(backend, None, key, |attributes| {
            self.lost.add(1, attributes);
        });
    }
}

const HOLDING: u8 = 0;
const COUNTED: u8 = 1;
const ENDED: u8 = 2;

/// What the metrics know of one held lock: whether its loss was counted, and how its watch
/// ends.
#[derive(Debug)]
pub(crate) struct Hold {
    state: AtomicU8,
    /// Ends a watch that is being polled when the hold ends.
    ended: Notify,
    /// Where its watch is: the watcher, its slot and its number there.
    watcher: Weak<Shared>,
    slot: usize,
    id: u64,
}

impl Hold {
    /// The hold is over: a loss not counted by now is not a loss of this hold. Ends the watch:
    /// a watch that waits is dropped here, with no wake-up of the watcher task; one that is
    /// being polled right now is told through `ended`.
    pub(crate) fn end(&self) {
        let _ = self
            .state
            .compare_exchange(HOLDING, ENDED, Ordering::AcqRel, Ordering::Acquire);
        let removed = self
            .watcher
            .upgrade()
            .and_then(|shared| shared.remove(self.slot, self.id));
        match removed {
            // Dropped outside the watcher's lock.
            Some(Removed::Watch(watch)) => drop(watch),
            Some(Removed::Gone) => {}
            None => self.ended.notify_one(),
        }
    }
}

/// What [`Shared::remove`] found of a watch.
enum Removed {
    /// It was waiting, and is taken out.
    Watch(Watch),
    /// It finished already.
    Gone,
}

type Watch = Pin<Box<dyn Future<Output = ()> + Send>>;

/// Runs the watches of one provider's held locks on one task: a small set of futures polled
/// when their own waker fires (what `FuturesUnordered` does), so that watching a lock costs one
/// boxed future, not a task.
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
    /// The watches, by slot.
    watches: Vec<Entry>,
    /// The number of the next watch (slots are reused; a hold finds its own watch by number).
    next_id: u64,
    /// One waker per slot, which marks the slot ready.
    wakers: Vec<Waker>,
    free: Vec<usize>,
    ready: Vec<usize>,
    /// The watcher task, when it waits for a slot to be ready.
    task: Option<Waker>,
    /// Whether a watcher task is alive (it dies with its runtime; the next watch starts one).
    running: bool,
}

/// What one slot of the watcher holds.
enum Entry {
    /// Nothing (its index is in `free`).
    Free,
    /// A watch, with its number, waiting for its waker.
    Waiting(Watch, u64),
    /// The watch with this number is being polled, by the watcher task or once by
    /// [`Watcher::watch`]; `woken`: its waker fired meanwhile and the task passed it over.
    Polled { id: u64, woken: bool },
}

impl Shared {
    /// Takes out the watch numbered `id` in `slot` if it waits (`Removed::Watch`); `None`
    /// when it is being polled.
    fn remove(&self, slot: usize, id: u64) -> Option<Removed> {
        let mut state = lock(&self.state);
        match state.watches.get(slot) {
            Some(Entry::Waiting(_, n)) if *n == id => {}
            Some(Entry::Polled { id: n, .. }) if *n == id => return None,
            // Finished, and the slot freed (maybe reused by another watch since).
            _ => return Some(Removed::Gone),
        }
        let Entry::Waiting(watch, _) = std::mem::replace(&mut state.watches[slot], Entry::Free)
        else {
            return Some(Removed::Gone);
        };
        state.free.push(slot);
        Some(Removed::Watch(watch))
    }
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = lock(&self.state);
        f.debug_struct("Watcher")
            .field("slots", &state.watches.len())
            .field("free", &state.free.len())
            .field("running", &state.running)
            .finish()
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        // The watcher task ends when it finds the shared state gone.
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
    slot: usize,
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

impl Watcher {
    /// A slot for a new watch, and the watch's number; marked as being polled until
    /// [`Watcher::watch`] puts the watch in.
    fn reserve(&self) -> (usize, u64) {
        let mut state = lock(&self.shared.state);
        let id = state.next_id;
        state.next_id = state.next_id.wrapping_add(1);
        let entry = Entry::Polled { id, woken: false };
        let slot = match state.free.pop() {
            Some(slot) => {
                state.watches[slot] = entry;
                slot
            }
            None => {
                let slot = state.watches.len();
                state.watches.push(entry);
                let waker = Waker::from(Arc::new(SlotWaker {
                    shared: Arc::downgrade(&self.shared),
                    slot,
                }));
                state.wakers.push(waker);
                slot
            }
        };
        (slot, id)
    }

    /// Starts watch `id` in its reserved `slot`: polls it once here, so that it waits on its
    /// waker without a wake-up of the watcher task (which is started on `runtime` if none
    /// runs), and leaves it to the task.
    fn watch(&self, runtime: &tokio::runtime::Handle, slot: usize, id: u64, mut watch: Watch) {
        let (start, waker) = {
            let mut state = lock(&self.shared.state);
            let start = !state.running;
            state.running = true;
            (start, state.wakers[slot].clone())
        };
        if start {
            let running = Running(Arc::downgrade(&self.shared));
            drop(runtime.spawn(run(running)));
        }
        let done = watch
            .as_mut()
            .poll(&mut Context::from_waker(&waker))
            .is_ready();
        let task = {
            let mut state = lock(&self.shared.state);
            let woken = matches!(state.watches[slot], Entry::Polled { woken: true, .. });
            if done {
                state.watches[slot] = Entry::Free;
                state.free.push(slot);
                None
            } else {
                state.watches[slot] = Entry::Waiting(watch, id);
                // Woken while polled here, and passed over by the task: it looks again.
                woken.then(|| {
                    state.ready.push(slot);
                    state.task.take()
                })
            }
        };
        if let Some(Some(task)) = task {
            task.wake();
        }
    }
}

/// The watcher task: polls the ready watches until the provider and its locks are gone.
async fn run(running: Running) {
    std::future::poll_fn(|cx| {
        let Some(shared) = running.0.upgrade() else {
            return Poll::Ready(());
        };
        let ready = {
            let mut state = lock(&shared.state);
            if state.ready.is_empty() {
                state.task = Some(cx.waker().clone());
                return Poll::Pending;
            }
            std::mem::take(&mut state.ready)
        };
        for slot in ready {
            let taken = {
                let mut state = lock(&shared.state);
                let entry = std::mem::replace(&mut state.watches[slot], Entry::Free);
                match entry {
                    Entry::Waiting(watch, id) => {
                        state.watches[slot] = Entry::Polled { id, woken: false };
                        Some((watch, id, state.wakers[slot].clone()))
                    }
                    // Being polled by `Watcher::watch`, which looks again when it is done.
                    Entry::Polled { id, .. } => {
                        state.watches[slot] = Entry::Polled { id, woken: true };
                        None
                    }
                    // Already finished, or woken twice.
                    Entry::Free => None,
                }
            };
            let Some((mut watch, id, waker)) = taken else {
                continue;
            };
            // Polled without the lock: a watch that completes may wake slots, or drop the last
            // handle on the provider's metrics.
            let done = watch
                .as_mut()
                .poll(&mut Context::from_waker(&waker))
                .is_ready();
            let mut state = lock(&shared.state);
            if done {
                state.watches[slot] = Entry::Free;
                state.free.push(slot);
                drop(state);
                drop(watch);
            } else {
                // Woken meanwhile: the slot is in `ready` again, and looked at next time.
                state.watches[slot] = Entry::Waiting(watch, id);
            }
        }
        // Let the runtime's other tasks run before the next batch.
        cx.waker().wake_by_ref();
        Poll::Pending
    })
    .await;
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
        Metrics::new(&meter, OptIn::default())
    });
    set
}

/// The instruments of transaction-bound locks.
pub(crate) fn transaction_metrics() -> &'static Metrics {
    TRANSACTION_METRICS.get_or_init(|| {
        Metrics::new(
            &opentelemetry::global::meter(DEFAULT_METER_NAME),
            OptIn::default(),
        )
    })
}

fn key_prefix_attribute(key: &str) -> KeyValue {
    // A key without `:` has no prefix: reporting the whole key would make the attribute unbounded.
    let prefix = key.split_once(':').map_or("", |(prefix, _)| prefix);
    KeyValue::new("key_prefix", prefix.to_owned())
}

fn millis(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use tokio_util::sync::CancellationToken;

    use super::{Metrics, OptIn};
    use crate::testing::Recorder;

    fn lost(n: u64) -> Vec<(Vec<(String, String)>, u64)> {
        vec![(vec![("lock_type".to_owned(), "memory".to_owned())], n)]
    }

    /// (slots, free slots, watcher running).
    fn slots(metrics: &Metrics) -> (usize, usize, bool) {
        let state = super::lock(&metrics.watcher.shared.state);
        (state.watches.len(), state.free.len(), state.running)
    }

    async fn until(condition: impl Fn() -> bool) {
        let started = Instant::now();
        while !condition() {
            assert!(started.elapsed() < Duration::from_secs(10), "never came");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    /// Ended watches give their slots back, and are reused: the watcher does not grow with the
    /// number of locks taken one after another. An ended hold is not counted when its token
    /// fires later; a loss is counted once, by whichever of the watch and the hold's end sees
    /// it first.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn watches_end_with_their_hold_and_their_slots_are_reused() {
        let recorder = Recorder::new();
        let metrics = Arc::new(Metrics::new(&recorder.meter(), OptIn::default()));
        let runtime = tokio::runtime::Handle::current();
        let key: Arc<str> = Arc::from("a");
        let all_free = || {
            let (slots, free, _) = slots(&metrics);
            slots == free
        };
        for _ in 0..50 {
            let token = CancellationToken::new();
            let hold = metrics.watch(&runtime, "memory", &key, &token);
            hold.end();
            token.cancel();
            until(all_free).await;
        }
        let (sequential, _, running) = slots(&metrics);
        assert!(running);
        assert!(sequential <= 2, "{sequential} slots for one lock at a time");

        // A burst: many watches at once, all ended.
        let token = CancellationToken::new();
        let holds: Vec<_> = (0..300)
            .map(|_| metrics.watch(&runtime, "memory", &key, &token))
            .collect();
        for hold in &holds {
            hold.end();
        }
        token.cancel();
        until(all_free).await;
        assert!(recorder.points("distributed_lock.lost").is_empty());

        let token = CancellationToken::new();
        let hold = metrics.watch(&runtime, "memory", &key, &token);
        token.cancel();
        recorder.until("distributed_lock.lost", &lost(1)).await;
        metrics.lost(&hold, "memory", &key);
        hold.end();
        until(all_free).await;
        assert_eq!(recorder.points("distributed_lock.lost"), lost(1));
    }

    /// A watch costs the watcher task no wake-up in a plain acquire and release: it is polled
    /// once where it starts, and a hold that ends takes it out at once (here the task never
    /// runs in between). A loss is still counted through the task, and a token that fired
    /// before the watch began is counted where it starts.
    #[tokio::test(flavor = "current_thread")]
    async fn a_hold_that_ends_takes_its_watch_out_at_once() {
        let recorder = Recorder::new();
        let metrics = Arc::new(Metrics::new(&recorder.meter(), OptIn::default()));
        let runtime = tokio::runtime::Handle::current();
        let key: Arc<str> = Arc::from("a");
        for _ in 0..10 {
            let token = CancellationToken::new();
            let hold = metrics.watch(&runtime, "memory", &key, &token);
            assert_eq!(slots(&metrics), (1, 0, true));
            hold.end();
            hold.end();
            assert_eq!(slots(&metrics), (1, 1, true));
            token.cancel();
        }
        // Ended twice, late, after its slot went to another watch: the other stays.
        let first = metrics.watch(&runtime, "memory", &key, &CancellationToken::new());
        first.end();
        let token = CancellationToken::new();
        let second = metrics.watch(&runtime, "memory", &key, &token);
        first.end();
        assert_eq!(slots(&metrics), (1, 0, true));
        token.cancel();
        recorder.until("distributed_lock.lost", &lost(1)).await;
        second.end();
        assert_eq!(slots(&metrics).1, 1);

        let fired = CancellationToken::new();
        fired.cancel();
        let hold = metrics.watch(&runtime, "memory", &key, &fired);
        assert_eq!(recorder.points("distributed_lock.lost"), lost(2));
        hold.end();
        assert_eq!(slots(&metrics).1, 1);
        assert_eq!(recorder.points("distributed_lock.lost"), lost(2));
    }

    /// The watcher task dies with its runtime; the next watch starts another on its own
    /// runtime, and losses are counted there.
    #[test]
    fn the_watcher_outlives_its_runtime() {
        let recorder = Recorder::new();
        let metrics = Arc::new(Metrics::new(&recorder.meter(), OptIn::default()));
        let key: Arc<str> = Arc::from("a");
        let first = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let token = CancellationToken::new();
        let hold = first.block_on(async {
            let hold = metrics.watch(&tokio::runtime::Handle::current(), "memory", &key, &token);
            tokio::task::yield_now().await;
            hold
        });
        drop(first);
        assert!(!slots(&metrics).2, "the watcher task went with its runtime");
        hold.end();

        let second = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        second.block_on(async {
            let token = CancellationToken::new();
            let _hold = metrics.watch(&tokio::runtime::Handle::current(), "memory", &key, &token);
            token.cancel();
            recorder.until("distributed_lock.lost", &lost(1)).await;
        });
    }
}
