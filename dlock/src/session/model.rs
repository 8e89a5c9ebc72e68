//! An in-memory model server for the session engine's unit tests.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::acquire::Lanes;
use super::options::LaneSettings;
use super::traits::{Connector, Failure, Grant, Mode, PermitAnswer, PermitCount, Session};
use crate::LockError;
use crate::backend::BoxFuture;

/// An in-memory lock server with the semantics the session engines share: a session may
/// take a lock it holds again (counted, as PostgreSQL, MySQL and SQL Server count it), in
/// either mode, shared locks of several sessions share a resource, and a session's locks
/// end when the session does. It stands in for SQL Server and Oracle,
/// which cannot run here, to pin what the lane machinery must do for every engine.
#[derive(Debug, Default)]
pub(super) struct Server {
    pub(super) locks: Mutex<HashMap<u64, Held>>,
    /// Resources whose lock statements never answer (a server that stopped responding).
    pub(super) hang: Mutex<std::collections::HashSet<u64>>,
    /// Resources whose grant takes 50 ms to reach the client (a lock taken on the server
    /// while its answer is still on the way).
    pub(super) slow: Mutex<std::collections::HashSet<u64>>,
    /// The permits held, per semaphore key.
    pub(super) permits: Mutex<HashMap<Arc<str>, Slots>>,
    /// Permit grants take 50 ms to reach the client.
    pub(super) slow_permits: AtomicBool,
    /// Every statement any session ran (round trips).
    pub(super) statements: AtomicU64,
    next_session: AtomicU64,
}

/// The held slots of one semaphore: slot → (session, the count it was taken with).
pub(super) type Slots = HashMap<u32, (u64, u32)>;

/// A held resource: its mode, and the sessions that hold it with their counts.
#[derive(Debug, Default)]
pub(super) struct Held {
    pub(super) shared: bool,
    pub(super) owners: HashMap<u64, u32>,
}

#[derive(Debug)]
pub(super) struct Model(Arc<Server>);

pub(super) struct ModelSession {
    pub(super) server: Arc<Server>,
    pub(super) id: u64,
}

/// A semaphore of the model: its key, count and queue lock.
#[derive(Debug, Clone)]
pub(super) struct ModelSemaphore {
    pub(super) key: Arc<str>,
    pub(super) max_count: u32,
    pub(super) queue: u64,
}

/// A permit of the model: its semaphore and slot.
#[derive(Debug)]
pub(super) struct ModelPermit {
    pub(super) key: Arc<str>,
    pub(super) slot: u32,
}

impl Server {
    /// How many sessions were opened (lanes and waits).
    pub(super) fn sessions_opened(&self) -> u64 {
        self.next_session.load(Ordering::Relaxed)
    }
}

impl Connector for Model {
    type Resource = u64;
    type Semaphore = ModelSemaphore;
    type Session = ModelSession;
    const NAME: &'static str = "model";
    const MAX_WAIT: Duration = Duration::from_secs(1);
    const MAX_PERMITS: u32 = u32::MAX;

    fn semaphore(&self, key: &str, max_count: u32, queue: u64) -> ModelSemaphore {
        ModelSemaphore {
            key: Arc::from(key),
            max_count,
            queue,
        }
    }

    fn wait_resolution(&self) -> Duration {
        Duration::from_millis(1)
    }

    fn resource(&self, key: &str) -> u64 {
        crate::lock_id(key) as u64
    }

    fn shared_locks(&self) -> Result<(), LockError> {
        Ok(())
    }

    fn open(&self) -> BoxFuture<'_, Result<ModelSession, LockError>> {
        let server = Arc::clone(&self.0);
        Box::pin(async move {
            let id = server.next_session.fetch_add(1, Ordering::Relaxed);
            Ok(ModelSession { server, id })
        })
    }
}

impl ModelSession {
    pub(super) fn take(&self, resource: u64) -> bool {
        self.take_mode(resource, Mode::Exclusive)
    }

    /// Takes `resource` in `mode` if no other session holds it in a conflicting mode; a
    /// session's own locks never conflict with it (the re-entry the claims guard against).
    pub(super) fn take_mode(&self, resource: u64, mode: Mode) -> bool {
        let mut locks = self.server.locks.lock().unwrap();
        let held = locks.entry(resource).or_default();
        let others = held.owners.keys().any(|owner| *owner != self.id);
        if others && !(mode.is_shared() && held.shared) {
            return false;
        }
        if held.owners.is_empty() {
            held.shared = mode.is_shared();
        } else if !mode.is_shared() {
            held.shared = false;
        }
        *held.owners.entry(self.id).or_insert(0) += 1;
        true
    }

    /// The slots of `key` held now (tests): slot → (session, count).
    pub(super) fn slots(server: &Server, key: &str) -> Slots {
        server
            .permits
            .lock()
            .unwrap()
            .get(key)
            .cloned()
            .unwrap_or_default()
    }

    /// One try for a permit, as the engines' statements run it: the count record (any held
    /// slot's count), the waiting mark (the queue lock held by any session, for a single
    /// try), then a walk from a random slot, skipping this session's own, for at most one
    /// more slot than are held.
    fn permit(&self, semaphore: &ModelSemaphore, waiting: bool) -> PermitAnswer<ModelPermit> {
        let marked = !waiting
            && self
                .server
                .locks
                .lock()
                .unwrap()
                .get(&semaphore.queue)
                .is_some_and(|held| !held.owners.is_empty());
        let mut permits = self.server.permits.lock().unwrap();
        let slots = permits.entry(Arc::clone(&semaphore.key)).or_default();
        let n = semaphore.max_count;
        if let Some(recorded) = slots.values().map(|(_, count)| *count).find(|c| *c != n) {
            return PermitAnswer::Conflict { recorded };
        }
        let live = u32::try_from(slots.len()).unwrap_or(u32::MAX);
        if marked || live >= n {
            if slots.is_empty() {
                permits.remove(&semaphore.key);
            }
            return PermitAnswer::Full;
        }
        let start = fastrand::u32(0..n);
        for step in 0..n.min(live.saturating_add(1)) {
            let slot =
                u32::try_from((u64::from(start) + u64::from(step)) % u64::from(n)).unwrap_or(0);
            if let std::collections::hash_map::Entry::Vacant(free) = slots.entry(slot) {
                free.insert((self.id, n));
                return PermitAnswer::Granted {
                    permit: ModelPermit {
                        key: Arc::clone(&semaphore.key),
                        slot,
                    },
                    token: None,
                };
            }
        }
        PermitAnswer::Full
    }

    /// How many sessions hold `resource` (tests).
    pub(super) fn holders(server: &Server, resource: u64) -> usize {
        server
            .locks
            .lock()
            .unwrap()
            .get(&resource)
            .map_or(0, |held| held.owners.len())
    }
}

impl Session for ModelSession {
    type Resource = u64;
    type Semaphore = ModelSemaphore;
    type Permit = ModelPermit;
    type Interrupt = std::convert::Infallible;

    fn try_permit<'a>(
        &'a mut self,
        semaphore: &'a ModelSemaphore,
        waiting: bool,
    ) -> BoxFuture<'a, Result<PermitAnswer<ModelPermit>, Failure>> {
        self.server.statements.fetch_add(1, Ordering::Relaxed);
        Box::pin(async move {
            let answer = self.permit(semaphore, waiting);
            if matches!(answer, PermitAnswer::Granted { .. })
                && self.server.slow_permits.load(Ordering::Relaxed)
            {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Ok(answer)
        })
    }

    fn release_permit<'a>(
        &'a mut self,
        permit: &'a ModelPermit,
    ) -> BoxFuture<'a, Result<(), Failure>> {
        self.server.statements.fetch_add(1, Ordering::Relaxed);
        let mut permits = self.server.permits.lock().unwrap();
        if let Some(slots) = permits.get_mut(&permit.key)
            && slots
                .get(&permit.slot)
                .is_some_and(|(owner, _)| *owner == self.id)
        {
            slots.remove(&permit.slot);
            if slots.is_empty() {
                permits.remove(&permit.key);
            }
        }
        Box::pin(async { Ok(()) })
    }

    fn count_permits<'a>(
        &'a mut self,
        semaphore: &'a ModelSemaphore,
    ) -> BoxFuture<'a, Result<PermitCount, Failure>> {
        self.server.statements.fetch_add(1, Ordering::Relaxed);
        let slots = ModelSession::slots(&self.server, &semaphore.key);
        Box::pin(async move {
            Ok(PermitCount {
                holders: u32::try_from(slots.len()).unwrap_or(u32::MAX),
                recorded: slots.values().map(|(_, count)| *count).next(),
            })
        })
    }

    fn lock<'a>(
        &'a mut self,
        resource: &'a u64,
        mode: Mode,
        wait: Duration,
    ) -> BoxFuture<'a, Result<Option<Grant>, Failure>> {
        self.server.statements.fetch_add(1, Ordering::Relaxed);
        Box::pin(async move {
            if self.server.hang.lock().unwrap().contains(resource) {
                std::future::pending::<()>().await;
            }
            let deadline = Instant::now() + wait;
            loop {
                if self.take_mode(*resource, mode) {
                    if self.server.slow.lock().unwrap().contains(resource) {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                    return Ok(Some(Grant::PLAIN));
                }
                if Instant::now() >= deadline {
                    return Ok(None);
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        })
    }

    fn unlock<'a>(
        &'a mut self,
        resource: &'a u64,
        _mode: Mode,
    ) -> BoxFuture<'a, Result<(), Failure>> {
        self.server.statements.fetch_add(1, Ordering::Relaxed);
        let mut locks = self.server.locks.lock().unwrap();
        if let Some(held) = locks.get_mut(resource)
            && let Some(count) = held.owners.get_mut(&self.id)
        {
            *count -= 1;
            if *count == 0 {
                held.owners.remove(&self.id);
            }
            if held.owners.is_empty() {
                locks.remove(resource);
            }
        }
        Box::pin(async { Ok(()) })
    }

    fn ping(&mut self) -> BoxFuture<'_, Result<(), Failure>> {
        self.server.statements.fetch_add(1, Ordering::Relaxed);
        Box::pin(async { Ok(()) })
    }
}

impl Drop for ModelSession {
    fn drop(&mut self) {
        let id = self.id;
        let mut locks = self.server.locks.lock().unwrap();
        for held in locks.values_mut() {
            held.owners.remove(&id);
        }
        locks.retain(|_, held| !held.owners.is_empty());
        drop(locks);
        let mut permits = self.server.permits.lock().unwrap();
        for slots in permits.values_mut() {
            slots.retain(|_, (owner, _)| *owner != id);
        }
        permits.retain(|_, slots| !slots.is_empty());
    }
}

pub(super) fn settings(connections: usize, wait_connections: usize) -> LaneSettings {
    LaneSettings {
        connections,
        wait_connections,
        keepalive: Duration::from_secs(5),
        statement_timeout: Duration::from_secs(10),
    }
}

pub(super) async fn model_lanes(
    server: &Arc<Server>,
    connections: usize,
    wait_connections: usize,
) -> Lanes<Model> {
    model_lanes_with(server, settings(connections, wait_connections)).await
}

pub(super) async fn model_lanes_with(server: &Arc<Server>, settings: LaneSettings) -> Lanes<Model> {
    let model = Model(Arc::clone(server));
    let first = model.open().await.expect("a session");
    Lanes::start(model, settings, first).expect("lanes")
}
