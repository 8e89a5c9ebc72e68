//! An in-memory model server for the session engine's unit tests.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::acquire::Lanes;
use super::options::LaneSettings;
use super::traits::{Connector, Failure, Grant, Mode, Session};
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
    next_session: AtomicU64,
}

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

impl Connector for Model {
    type Resource = u64;
    type Session = ModelSession;
    const NAME: &'static str = "model";
    const MAX_WAIT: Duration = Duration::from_secs(1);

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
    type Interrupt = std::convert::Infallible;

    fn lock<'a>(
        &'a mut self,
        resource: &'a u64,
        mode: Mode,
        wait: Duration,
    ) -> BoxFuture<'a, Result<Option<Grant>, Failure>> {
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
