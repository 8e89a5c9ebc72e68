//! A lock store in memory, for the unit tests of the provider and the guard: it records what
//! the provider asked of it, and can be told to answer a try with contention, a late grant
//! (`Lost`) or a failure, or to fail a release.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use opentelemetry::KeyValue;
use opentelemetry::metrics::MeterProvider as _;
use opentelemetry_sdk::metrics::data::{AggregatedMetrics, MetricData};
use opentelemetry_sdk::metrics::{InMemoryMetricExporter, PeriodicReader, SdkMeterProvider};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::LockError;
use crate::backend::{
    Acquired, BoxFuture, HeldLock, LeaseControl, LeaseDeadline, LockBackend, LockRequest,
    PermitRequest, PermitStore, PermitTry, ReleaseWatch, WaitTry,
};

/// A forced answer to the next `try_acquire`.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Answer {
    /// Granted too late: `Err(Lost)`.
    Late,
    /// The store fails: `Err(Backend)`.
    Fail,
}

#[derive(Debug, Default)]
pub(crate) struct Store {
    /// Held keys and the fencing token each was granted with.
    pub(crate) held: HashMap<String, u64>,
    pub(crate) next_token: u64,
    pub(crate) tries: usize,
    /// The timeouts passed to `acquire_wait`.
    pub(crate) waits: Vec<Duration>,
    /// The lease of every request.
    pub(crate) leases: Vec<Option<Duration>>,
    pub(crate) releases: usize,
    pub(crate) answers: VecDeque<Answer>,
    /// When set, a release fails (and still frees the key).
    pub(crate) fail_release: bool,
    /// When set, a release waits for this to be notified before it frees the key.
    pub(crate) release_gate: Option<Arc<Notify>>,
    /// When set, locks are granted with this local lease deadline.
    pub(crate) lease_deadline: Option<Instant>,
    /// What a try of a wait reports on contention.
    pub(crate) retry_within: Option<Duration>,
    /// Watches asked for ([`LockBackend::watch_releases`]).
    pub(crate) watches: usize,
    /// When set, a native wait answers only after this long (a store slow to answer).
    pub(crate) wait_delay: Option<Duration>,
    /// Semaphores kept natively (when the backend has `permits` on), by key.
    pub(crate) semaphores: HashMap<String, Semaphore>,
    /// Tries for a permit of a native semaphore, and how many of them were single tries.
    pub(crate) permit_tries: usize,
    /// The waiting mark of every try for a permit.
    pub(crate) permit_waitings: Vec<Option<Duration>>,
    /// When set, locks have a lease control, whose extensions are recorded in `extends`.
    pub(crate) lease_control: bool,
    /// The leases asked of [`LeaseControl::extend`].
    pub(crate) extends: Vec<Duration>,
    /// The lost token of every lock granted, in order.
    pub(crate) lost_tokens: Vec<CancellationToken>,
}

/// A semaphore kept natively by [`MemoryBackend`].
#[derive(Debug, Default)]
pub(crate) struct Semaphore {
    /// The count record.
    pub(crate) max_count: u32,
    /// The live permits: id and fencing token.
    pub(crate) permits: HashMap<u64, u64>,
    pub(crate) next_token: u64,
    /// The waiting mark, while it lasts.
    pub(crate) mark_until: Option<Instant>,
}

impl Semaphore {
    fn marked(&self) -> bool {
        self.mark_until.is_some_and(|until| until > Instant::now())
    }
}

/// The backend: clones share one store.
#[derive(Debug, Clone, Default)]
pub(crate) struct MemoryBackend {
    pub(crate) store: Arc<Mutex<Store>>,
    pub(crate) native_wait: bool,
    /// Notified on every release.
    pub(crate) released: Arc<Notify>,
    /// Wake-ups for waiters, when set: [`MemoryBackend::wake`] sends one.
    pub(crate) wakes: Option<Arc<tokio::sync::watch::Sender<u64>>>,
    /// Keeps semaphores natively ([`LockBackend::semaphores`]).
    pub(crate) permits: bool,
}

/// A waiter's watch on a [`MemoryBackend`]'s wake-ups (always live).
#[derive(Debug)]
struct MemoryWatch(tokio::sync::watch::Receiver<u64>);

impl ReleaseWatch for MemoryWatch {
    fn is_live(&self) -> bool {
        true
    }

    fn mark_seen(&mut self) {
        self.0.borrow_and_update();
    }

    fn woken(&mut self) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            let _ = self.0.changed().await;
        })
    }
}

impl MemoryBackend {
    pub(crate) fn store(&self) -> std::sync::MutexGuard<'_, Store> {
        self.store.lock().unwrap()
    }

    /// Marks `key` held by someone else.
    pub(crate) fn hold_elsewhere(&self, key: &str) {
        self.store().held.insert(key.to_owned(), 0);
    }

    pub(crate) fn free(&self, key: &str) {
        self.store().held.remove(key);
    }

    /// Wakes every waiter.
    pub(crate) fn wake(&self) {
        if let Some(wakes) = &self.wakes {
            wakes.send_modify(|n| *n += 1);
        }
    }

    pub(crate) fn is_held(&self, key: &str) -> bool {
        self.store().held.contains_key(key)
    }

    fn grant(&self, request: LockRequest<'_>) -> Result<Option<Acquired>, LockError> {
        let mut store = self.store();
        store.leases.push(request.lease);
        if store.held.contains_key(request.key) {
            return Ok(None);
        }
        store.next_token += 1;
        let token = store.next_token;
        store.held.insert(request.key.to_owned(), token);
        let lost = CancellationToken::new();
        store.lost_tokens.push(lost.clone());
        let acquired = Acquired::new(
            Some(token),
            lost,
            Box::new(MemoryLock {
                backend: self.clone(),
                key: request.key.to_owned(),
            }),
        );
        Ok(Some(match store.lease_deadline {
            Some(at) => acquired.with_lease_deadline(LeaseDeadline::new(at)),
            None => acquired,
        }))
    }
}

impl LockBackend for MemoryBackend {
    fn name(&self) -> &'static str {
        "memory"
    }

    fn semaphores(&self) -> Option<&dyn PermitStore> {
        self.permits.then_some(self as &dyn PermitStore)
    }

    fn held_keys<'a>(&'a self, keys: &'a [String]) -> BoxFuture<'a, Result<Vec<bool>, LockError>> {
        Box::pin(async move { Ok(keys.iter().map(|key| self.is_held(key)).collect()) })
    }

    fn supports_native_wait(&self) -> bool {
        self.native_wait
    }

    fn try_acquire<'a>(
        &'a self,
        request: LockRequest<'a>,
    ) -> BoxFuture<'a, Result<Option<Acquired>, LockError>> {
        Box::pin(async move {
            let answer = {
                let mut store = self.store();
                store.tries += 1;
                store.answers.pop_front()
            };
            match answer {
                Some(Answer::Late) => Err(LockError::Lost {
                    key: Arc::from(request.key),
                    reason: "granted too late".to_owned(),
                }),
                Some(Answer::Fail) => Err(LockError::backend("memory", "failed", None, None)),
                None => self.grant(request),
            }
        })
    }

    fn try_acquire_in_wait<'a>(
        &'a self,
        request: LockRequest<'a>,
    ) -> BoxFuture<'a, Result<WaitTry, LockError>> {
        Box::pin(async move {
            Ok(match self.try_acquire(request).await? {
                Some(acquired) => WaitTry::Acquired(acquired),
                None => WaitTry::Held {
                    retry_within: self.store().retry_within,
                },
            })
        })
    }

    fn watch_releases<'a>(
        &'a self,
        _request: LockRequest<'a>,
    ) -> BoxFuture<'a, Option<Box<dyn ReleaseWatch>>> {
        Box::pin(async move {
            self.store().watches += 1;
            self.wakes
                .as_ref()
                .map(|wakes| Box::new(MemoryWatch(wakes.subscribe())) as Box<dyn ReleaseWatch>)
        })
    }

    fn acquire_wait<'a>(
        &'a self,
        request: LockRequest<'a>,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<Option<Acquired>, LockError>> {
        Box::pin(async move {
            let delay = {
                let mut store = self.store();
                store.waits.push(timeout);
                store.wait_delay
            };
            if let Some(delay) = delay {
                tokio::time::sleep(delay).await;
            }
            self.grant(request)
        })
    }
}

#[derive(Debug)]
struct MemoryLock {
    backend: MemoryBackend,
    key: String,
}

impl LeaseControl for MemoryLock {
    fn extend(&self, lease: Duration) -> BoxFuture<'_, Result<bool, LockError>> {
        Box::pin(async move {
            self.backend.store().extends.push(lease);
            Ok(true)
        })
    }

    fn verify_still_held(&self) -> BoxFuture<'_, Result<bool, LockError>> {
        Box::pin(async move { Ok(self.backend.is_held(&self.key)) })
    }

    fn stop_renewal(&self) {}
}

impl HeldLock for MemoryLock {
    fn lease_control(&self) -> Option<&dyn LeaseControl> {
        self.backend
            .store()
            .lease_control
            .then_some(self as &dyn LeaseControl)
    }

    fn release(self: Box<Self>) -> BoxFuture<'static, Result<(), LockError>> {
        Box::pin(async move {
            let gate = self.backend.store().release_gate.clone();
            if let Some(gate) = gate {
                gate.notified().await;
            }
            let fail = {
                let mut store = self.backend.store();
                store.releases += 1;
                store.held.remove(&self.key);
                store.fail_release
            };
            self.backend.released.notify_waiters();
            if fail {
                Err(LockError::backend("memory", "release failed", None, None))
            } else {
                Ok(())
            }
        })
    }
}

/// An in-memory metrics exporter and the meter provider that feeds it.
#[derive(Debug)]
pub(crate) struct Recorder {
    pub(crate) provider: SdkMeterProvider,
    exporter: InMemoryMetricExporter,
}

impl Recorder {
    pub(crate) fn new() -> Self {
        let exporter = InMemoryMetricExporter::default();
        let provider = SdkMeterProvider::builder()
            .with_reader(PeriodicReader::builder(exporter.clone()).build())
            .build();
        Recorder { provider, exporter }
    }

    pub(crate) fn meter(&self) -> opentelemetry::metrics::Meter {
        self.provider.meter("dlock")
    }

    /// Waits until `name`'s points are `expected`, failing (not hanging) after 10 s.
    pub(crate) async fn until(&self, name: &str, expected: &[(Vec<(String, String)>, u64)]) {
        let started = Instant::now();
        while self.points(name) != expected {
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "{name}: {:?}, expected {expected:?}",
                self.points(name)
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    /// (sorted attributes, value) of every point of `name`: sums for counters, counts for
    /// histograms.
    pub(crate) fn points(&self, name: &str) -> Vec<(Vec<(String, String)>, u64)> {
        self.provider.force_flush().unwrap();
        let exported = self.exporter.get_finished_metrics().unwrap();
        let mut points = Vec::new();
        let Some(last) = exported.last() else {
            return points;
        };
        for scope in last.scope_metrics() {
            for metric in scope.metrics().filter(|m| m.name() == name) {
                match metric.data() {
                    AggregatedMetrics::U64(MetricData::Sum(sum)) => {
                        for p in sum.data_points() {
                            points.push((attrs(p.attributes()), p.value()));
                        }
                    }
                    AggregatedMetrics::I64(MetricData::Sum(sum)) => {
                        for p in sum.data_points() {
                            let value = u64::try_from(p.value()).unwrap_or_else(|_| {
                                panic!("{name} went below zero: {}", p.value())
                            });
                            points.push((attrs(p.attributes()), value));
                        }
                    }
                    AggregatedMetrics::F64(MetricData::Histogram(h)) => {
                        for p in h.data_points() {
                            points.push((attrs(p.attributes()), p.count()));
                        }
                    }
                    other => panic!("unexpected data for {name}: {other:?}"),
                }
            }
        }
        points.sort();
        points
    }
}

fn attrs<'a>(kvs: impl Iterator<Item = &'a KeyValue>) -> Vec<(String, String)> {
    let mut v: Vec<_> = kvs
        .map(|kv| (kv.key.to_string(), kv.value.to_string()))
        .collect();
    v.sort();
    v
}

impl MemoryBackend {
    /// The number of live permits of the native semaphore `key`.
    pub(crate) fn permits_held(&self, key: &str) -> usize {
        self.store()
            .semaphores
            .get(key)
            .map_or(0, |semaphore| semaphore.permits.len())
    }
}

impl PermitStore for MemoryBackend {
    fn try_acquire_permit<'a>(
        &'a self,
        request: PermitRequest<'a>,
    ) -> BoxFuture<'a, Result<PermitTry, LockError>> {
        Box::pin(async move {
            let mut store = self.store();
            store.permit_tries += 1;
            store.permit_waitings.push(request.waiting);
            store.next_token += 1;
            let id = store.next_token;
            let semaphore = store.semaphores.entry(request.key.to_owned()).or_default();
            let in_use = !semaphore.permits.is_empty() || semaphore.marked();
            if in_use && semaphore.max_count != request.max_count {
                return Err(request.count_conflict(semaphore.max_count));
            }
            semaphore.max_count = request.max_count;
            let full = u64::try_from(semaphore.permits.len()).unwrap_or(u64::MAX)
                >= u64::from(request.max_count);
            if full || (request.waiting.is_none() && semaphore.marked()) {
                if let Some(mark) = request.waiting {
                    semaphore.mark_until = Some(Instant::now() + mark);
                }
                return Ok(PermitTry::Full { retry_within: None });
            }
            if request.waiting.is_some() {
                semaphore.mark_until = None;
            }
            semaphore.next_token += 1;
            let token = semaphore.next_token;
            semaphore.permits.insert(id, token);
            Ok(PermitTry::Acquired(Acquired::new(
                Some(token),
                CancellationToken::new(),
                Box::new(MemoryPermit {
                    backend: self.clone(),
                    key: request.key.to_owned(),
                    id,
                }),
            )))
        })
    }

    fn holders<'a>(
        &'a self,
        key: &'a str,
        max_count: u32,
    ) -> BoxFuture<'a, Result<u32, LockError>> {
        Box::pin(async move {
            let store = self.store();
            let Some(semaphore) = store.semaphores.get(key) else {
                return Ok(0);
            };
            if (!semaphore.permits.is_empty() || semaphore.marked())
                && semaphore.max_count != max_count
            {
                return Err(PermitRequest::new(key, max_count).count_conflict(semaphore.max_count));
            }
            Ok(u32::try_from(semaphore.permits.len()).unwrap_or(u32::MAX))
        })
    }
}

/// A permit of a [`MemoryBackend`] semaphore.
#[derive(Debug)]
struct MemoryPermit {
    backend: MemoryBackend,
    key: String,
    id: u64,
}

impl HeldLock for MemoryPermit {
    fn release(self: Box<Self>) -> BoxFuture<'static, Result<(), LockError>> {
        Box::pin(async move {
            let mut store = self.backend.store();
            store.releases += 1;
            if let Some(semaphore) = store.semaphores.get_mut(&self.key) {
                semaphore.permits.remove(&self.id);
            }
            drop(store);
            self.backend.released.notify_waiters();
            Ok(())
        })
    }
}

/// Yields to the runtime until `condition` holds, and fails the test naming `what` if it does
/// not within 30 s of wall time (a real clock, so a paused Tokio clock cannot stretch it): a
/// test that waits for a state the code never reaches fails instead of hanging the run.
pub(crate) async fn spin_until(what: &str, mut condition: impl FnMut() -> bool) {
    let limit = Duration::from_secs(30);
    let start = Instant::now();
    while !condition() {
        assert!(
            start.elapsed() < limit,
            "not reached within {limit:?}: {what}"
        );
        tokio::task::yield_now().await;
    }
}
