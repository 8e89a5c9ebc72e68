//! The conformance [`Harness`] of the Redis deployments: one server, a Cluster, a master
//! behind Sentinel, Redlock's nodes. They differ only in their URL, the backend it connects
//! and where another owner takes a lock over.

use std::fmt;
use std::future::Future;
use std::time::Duration;

use dlock::backend::LockBackend;
use dlock::redis::{RedisBackend, RedlockBackend};
use dlock::{LockError, LockGuard, LockProvider};

use super::{RedisCluster, RedisServer, SentinelDeployment, take_over};
use crate::{Harness, StoreInspection};

/// The lease of the harness's locks.
pub const HARNESS_LEASE: Duration = Duration::from_secs(1);

/// A backend that connects to a URL.
pub trait Connect: LockBackend + Clone {
    /// A backend on `url`.
    fn connect(url: &str) -> impl Future<Output = Result<Self, LockError>> + Send;
}

impl Connect for RedisBackend {
    fn connect(url: &str) -> impl Future<Output = Result<Self, LockError>> + Send {
        RedisBackend::connect(url)
    }
}

impl Connect for RedlockBackend {
    fn connect(url: &str) -> impl Future<Output = Result<Self, LockError>> + Send {
        RedlockBackend::connect(url)
    }
}

/// A Redis deployment the conformance suite runs on, through [`LeaseHarness`].
pub trait Deployment: Send + Sync + 'static {
    /// What its URL connects: a [`RedisBackend`], or a [`RedlockBackend`].
    type Backend: Connect;

    /// Its URL with the query `options` (`lease=60s`, ...).
    fn url_with(&self, options: &str) -> String;

    /// Another owner takes over the lock `key`, held through `backend`, where its holder must
    /// notice (the master of its slot, the master, a quorum of nodes), keeping the key's time
    /// to live ([`take_over`]).
    fn take_over(&self, backend: &Self::Backend, key: &str) -> impl Future<Output = ()> + Send;

    /// Why waits are not fair between processes on this deployment (see
    /// [`Harness::unfair_waits`]); `None` (the default) when they are.
    fn unfair_waits(&self) -> Option<&'static str> {
        None
    }

    /// What `store_locks` answers on this deployment, as its URL's account sees it (see
    /// [`Harness::store_inspection`]).
    fn store_inspection(&self) -> StoreInspection;
}

/// The [`Harness`] of a [`Deployment`], its locks on leases of [`HARNESS_LEASE`]: fenced,
/// with read locks, lost within a third of the lease and a second of a
/// [`take_over`](Deployment::take_over), and free for another owner within the lease and a
/// second (the owner that took over kept the key's time to live).
pub struct LeaseHarness<D: Deployment> {
    deployment: D,
    /// The backend whose storage keys `break_lock` takes over.
    backend: D::Backend,
}

impl<D: Deployment> fmt::Debug for LeaseHarness<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeaseHarness").finish_non_exhaustive()
    }
}

impl<D: Deployment> LeaseHarness<D> {
    /// The harness of `deployment`, with a backend connected to it.
    pub async fn start(deployment: D) -> LeaseHarness<D> {
        let backend = D::Backend::connect(&url(&deployment))
            .await
            .expect("connect");
        LeaseHarness {
            deployment,
            backend,
        }
    }

    /// The backend connected at the start.
    pub fn backend(&self) -> &D::Backend {
        &self.backend
    }
}

/// The deployment's URL, with the harness's lease.
fn url(deployment: &impl Deployment) -> String {
    deployment.url_with(&format!("lease={}ms", HARNESS_LEASE.as_millis()))
}

impl<D: Deployment> Harness for LeaseHarness<D> {
    async fn provider(&self) -> LockProvider {
        LockProvider::connect(&url(&self.deployment))
            .await
            .expect("connect")
    }

    async fn break_lock(&self, guard: &LockGuard) {
        self.deployment.take_over(&self.backend, guard.key()).await;
    }

    fn lost_within(&self) -> Duration {
        HARNESS_LEASE / 3 + Duration::from_secs(1)
    }

    fn retake_within(&self) -> Duration {
        HARNESS_LEASE + Duration::from_secs(1)
    }

    fn fencing(&self) -> bool {
        true
    }

    fn read_locks(&self) -> bool {
        true
    }

    fn unfair_waits(&self) -> Option<&'static str> {
        self.deployment.unfair_waits()
    }

    fn store_inspection(&self) -> StoreInspection {
        self.deployment.store_inspection()
    }

    async fn shared_providers(&self, count: usize) -> Vec<LockProvider> {
        let backend = D::Backend::connect(&url(&self.deployment))
            .await
            .expect("connect");
        (0..count)
            .map(|_| LockProvider::from_backend(backend.clone()))
            .collect()
    }
}

/// Another owner takes over `storage_key` on `server`.
async fn take_over_on(server: &RedisServer, storage_key: Vec<u8>) {
    let client = server.client();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    take_over(&mut conn, storage_key, "someone-else").await;
}

/// A deployment shared by the harnesses of several tests (a static started once, such as
/// [`RedisCluster::shared`]).
impl<D: Deployment> Deployment for &'static D {
    type Backend = D::Backend;

    fn url_with(&self, options: &str) -> String {
        (**self).url_with(options)
    }

    fn take_over(&self, backend: &D::Backend, key: &str) -> impl Future<Output = ()> + Send {
        (**self).take_over(backend, key)
    }

    fn unfair_waits(&self) -> Option<&'static str> {
        (**self).unfair_waits()
    }

    fn store_inspection(&self) -> StoreInspection {
        (**self).store_inspection()
    }
}

/// One server (`redis://`).
impl Deployment for RedisServer {
    type Backend = RedisBackend;

    fn url_with(&self, options: &str) -> String {
        self.url(options)
    }

    async fn take_over(&self, backend: &RedisBackend, key: &str) {
        take_over_on(self, backend.storage_key(key)).await;
    }

    fn store_inspection(&self) -> StoreInspection {
        StoreInspection::Listed
    }
}

/// A Redis Cluster (`redis+cluster://`): the lock is taken over on the master of its slot.
impl Deployment for RedisCluster {
    type Backend = RedisBackend;

    fn url_with(&self, options: &str) -> String {
        self.url(options)
    }

    async fn take_over(&self, backend: &RedisBackend, key: &str) {
        let key = backend.storage_key(key);
        let master = tokio::task::block_in_place(|| self.owner_of(self.slot_of(&key)));
        take_over_on(self.node(master), key).await;
    }

    /// `SCAN` on each master.
    fn store_inspection(&self) -> StoreInspection {
        StoreInspection::Listed
    }
}

/// A master behind Sentinel (`redis+sentinel://`): the lock is taken over on the master.
impl Deployment for SentinelDeployment {
    type Backend = RedisBackend;

    fn url_with(&self, options: &str) -> String {
        self.url(options)
    }

    async fn take_over(&self, backend: &RedisBackend, key: &str) {
        take_over_on(self.node(self.master_port()), backend.storage_key(key)).await;
    }

    fn store_inspection(&self) -> StoreInspection {
        StoreInspection::Listed
    }
}
