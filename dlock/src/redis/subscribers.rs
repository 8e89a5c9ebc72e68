//! Which subscriber hears the releases of a key: the backend's one subscriber, or on a Redis
//! Cluster the subscriber on the master that serves the key's slot.
//!
//! A release runs its `PUBLISH` on the master of the key's slot. That master delivers it to
//! its own subscribers at once, and broadcasts it over the cluster bus to every other node,
//! where it may arrive tens of milliseconds later. So on a cluster each key's channel is
//! subscribed on its master, found in the slot map (`CLUSTER NODES`, read on the first wait
//! and again when it is older than [`MAP_AGE`]). A stale map costs only time: any node hears
//! every release. Until the map is known, or when it cannot be read (a user without
//! `+cluster|nodes`), channels are subscribed on the URL's first node.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use redis::aio::ConnectionManagerConfig;

use super::cluster::{masters_and_slots, slot};
use super::wake::{Heard, Wakes};
use crate::LockError;
use crate::backend::ReleaseWatch;

/// How long a cluster's slot map is used before a wait reads it again.
pub(crate) const MAP_AGE: Duration = Duration::from_secs(10);

/// The subscribers of one backend.
pub(crate) enum Subscribers {
    /// One subscriber: on one server, the master behind Sentinel, or none (a backend on a
    /// connection the application passed in, or a cluster built from a `ClusterClient`).
    One(Arc<Wakes>),
    /// A Redis Cluster reached by URL: a subscriber per master.
    PerMaster(Box<PerMaster>),
}

impl Subscribers {
    /// Starts watching `channel` on the subscriber that hears it first; on a cluster whose slot
    /// map is unknown or old, reads it first with `read_nodes` (the text of `CLUSTER NODES`).
    /// `None` when wake-ups are not available.
    pub(crate) async fn watch<F>(
        &self,
        channel: &[u8],
        read_nodes: impl FnOnce() -> F,
    ) -> Option<Box<dyn ReleaseWatch>>
    where
        F: Future<Output = Result<String, LockError>>,
    {
        match self {
            Subscribers::One(wakes) => wakes.watch(channel).await,
            Subscribers::PerMaster(masters) => {
                masters.refresh(read_nodes).await;
                masters.of(channel).watch(channel).await
            }
        }
    }

    /// Whether one of the backend's subscribers watches `channel`.
    pub(crate) fn wanted(&self, channel: &[u8]) -> bool {
        match self {
            Subscribers::One(wakes) => wakes.wanted(channel),
            Subscribers::PerMaster(masters) => {
                masters.first.wanted(channel)
                    || masters.routes().masters.values().any(|w| w.wanted(channel))
            }
        }
    }

    /// Whether one of the backend's subscribers has `channel` subscribed right now: its
    /// waiters are woken by the key's releases.
    pub(crate) fn live(&self, channel: &[u8]) -> bool {
        match self {
            Subscribers::One(wakes) => wakes.live(channel),
            Subscribers::PerMaster(masters) => {
                masters.first.live(channel)
                    || masters.routes().masters.values().any(|w| w.live(channel))
            }
        }
    }

    /// A waiter of this backend took the key of `channel`: its subscriber moves to the back of
    /// the channel's delivery order (see [`Wakes::to_back`]).
    pub(crate) fn to_back(&self, channel: &[u8]) {
        match self {
            Subscribers::One(wakes) => wakes.to_back(channel),
            Subscribers::PerMaster(masters) => {
                masters.all().iter().for_each(|w| w.to_back(channel));
            }
        }
    }

    /// Ends every subscriber's driver (the backend is gone).
    pub(crate) fn shut_down(&self) {
        match self {
            Subscribers::One(wakes) => wakes.shut_down(),
            Subscribers::PerMaster(masters) => masters.all().iter().for_each(|w| w.shut_down()),
        }
    }
}

/// The subscribers of a backend on a Redis Cluster, one per master.
pub(crate) struct PerMaster {
    /// The subscriber on the URL's first node.
    first: Arc<Wakes>,
    /// How the first node is reached: every other node is reached alike, at its own address.
    client: redis::Client,
    config: ConnectionManagerConfig,
    timeout: Duration,
    heard: Option<Heard>,
    routes: Mutex<Routes>,
    /// One reader of the slot map at a time; the others wait for its map.
    reading: tokio::sync::Mutex<()>,
}

#[derive(Default)]
struct Routes {
    /// Slot ranges (first and last slot), sorted, with the subscriber on their master.
    ranges: Vec<(u16, u16, Arc<Wakes>)>,
    /// Every master seen, by address: its subscriber is kept for the backend's life.
    masters: HashMap<(String, u16), Arc<Wakes>>,
    /// When the map was last read (or failed to be).
    read_at: Option<Instant>,
}

impl PerMaster {
    /// The subscribers of a cluster whose first node `client` connects to.
    pub(crate) fn new(
        client: redis::Client,
        config: ConnectionManagerConfig,
        timeout: Duration,
        heard: Option<Heard>,
    ) -> PerMaster {
        let slot = Arc::new(Mutex::new(Some((client.clone(), config.clone()))));
        let first = Arc::new(Wakes::new(Some(slot), timeout, heard.clone()));
        // The first node is one of the masters (or was): its subscriber serves its slots too.
        let mut routes = Routes::default();
        if let Some(addr) = super::host_port_of(&client) {
            routes.masters.insert(addr, Arc::clone(&first));
        }
        PerMaster {
            first,
            client,
            config,
            timeout,
            heard,
            routes: Mutex::new(routes),
            reading: tokio::sync::Mutex::new(()),
        }
    }

    fn routes(&self) -> MutexGuard<'_, Routes> {
        self.routes.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn fresh(&self) -> bool {
        self.routes()
            .read_at
            .is_some_and(|read| read.elapsed() < MAP_AGE)
    }

    /// Reads the slot map when it is unknown or older than [`MAP_AGE`]. A failed read is
    /// logged, and tried again after [`MAP_AGE`]; meanwhile the last map (or the first node)
    /// serves.
    async fn refresh<F>(&self, read_nodes: impl FnOnce() -> F)
    where
        F: Future<Output = Result<String, LockError>>,
    {
        if self.fresh() {
            return;
        }
        let _reading = self.reading.lock().await;
        if self.fresh() {
            return;
        }
        match read_nodes().await {
            Ok(text) => self.install(&text),
            Err(err) => {
                tracing::debug!(
                    error = %err,
                    "the redis cluster's slot map could not be read; waiters subscribe on the \
                     URL's first node"
                );
                self.routes().read_at = Some(Instant::now());
            }
        }
    }

    /// Takes the slot map from the text of `CLUSTER NODES`.
    fn install(&self, nodes: &str) {
        let masters = masters_and_slots(nodes);
        let mut routes = self.routes();
        let mut ranges = Vec::new();
        for (addr, slots) in masters {
            let Some(wakes) = self.subscriber_at(&mut routes, addr) else {
                continue;
            };
            ranges.extend(
                slots
                    .into_iter()
                    .map(|(first, last)| (first, last, Arc::clone(&wakes))),
            );
        }
        ranges.sort_by_key(|&(first, ..)| first);
        routes.ranges = ranges;
        routes.read_at = Some(Instant::now());
    }

    /// The subscriber on the master at `addr`, made when first needed. `None` when no client
    /// can be made for that address (the first node then serves its slots).
    fn subscriber_at(&self, routes: &mut Routes, addr: (String, u16)) -> Option<Arc<Wakes>> {
        if let Some(wakes) = routes.masters.get(&addr) {
            return Some(Arc::clone(wakes));
        }
        // The first node's settings, TLS included.
        let wakes = match super::client_at(&self.client, &addr.0, addr.1) {
            Ok(client) => {
                let slot = Arc::new(Mutex::new(Some((client, self.config.clone()))));
                Arc::new(Wakes::new(Some(slot), self.timeout, self.heard.clone()))
            }
            Err(err) => {
                tracing::debug!(
                    error = %err,
                    "no subscriber for a redis cluster master; its keys' waiters subscribe on \
                     the URL's first node"
                );
                return None;
            }
        };
        routes.masters.insert(addr, Arc::clone(&wakes));
        Some(wakes)
    }

    /// The subscriber on the master of `channel`'s slot, by the map; the first node's when the
    /// map has no master for it.
    fn of(&self, channel: &[u8]) -> Arc<Wakes> {
        let slot = slot(channel);
        let routes = self.routes();
        let at = routes.ranges.partition_point(|&(first, ..)| first <= slot);
        match at.checked_sub(1).map(|i| &routes.ranges[i]) {
            Some((_, last, wakes)) if slot <= *last => Arc::clone(wakes),
            _ => Arc::clone(&self.first),
        }
    }

    /// Every subscriber: the first node's and each master's.
    fn all(&self) -> Vec<Arc<Wakes>> {
        let routes = self.routes();
        let mut all = vec![Arc::clone(&self.first)];
        all.extend(
            routes
                .masters
                .values()
                .filter(|w| !Arc::ptr_eq(w, &self.first))
                .cloned(),
        );
        all
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn per_master() -> PerMaster {
        let client = redis::Client::open("redis://127.0.0.1:7000").unwrap();
        PerMaster::new(
            client,
            ConnectionManagerConfig::new(),
            Duration::from_secs(1),
            None,
        )
    }

    const NODES: &str = "\
a 127.0.0.1:7000@17000 myself,master - 0 0 1 connected 0-5460
b 127.0.0.1:7001@17001 master - 0 0 2 connected 5461-10922
c 127.0.0.1:7002@17002 master - 0 0 3 connected 10923-16382
d 127.0.0.1:7003@17003 slave c 0 0 3 connected
";

    #[test]
    fn channels_go_to_the_master_of_their_slot() {
        let masters = per_master();
        // Before a map is known: the first node.
        assert!(Arc::ptr_eq(&masters.of(b"x"), &masters.first));
        masters.install(NODES);
        assert!(masters.fresh());
        let routes = masters.routes().ranges.clone();
        assert_eq!(routes.len(), 3);
        assert!(
            Arc::ptr_eq(&routes[0].2, &masters.first),
            "7000 is the first node"
        );
        for key in [
            &b"123456789"[..],
            b"foo{user1000}",
            b"foo",
            b"{k}:fence",
            b"bar",
        ] {
            let at = match slot(key) {
                0..=5460 => 0,
                5461..=10922 => 1,
                _ => 2,
            };
            assert!(Arc::ptr_eq(&masters.of(key), &routes[at].2), "{key:?}");
        }
        // Slot 16383 belongs to nobody in this map: the first node.
        let unserved = (0u32..)
            .map(|i| i.to_string().into_bytes())
            .find(|k| slot(k) == 16383)
            .unwrap();
        assert!(Arc::ptr_eq(&masters.of(&unserved), &masters.first));
        // Three subscribers in all: the first node's serves 7000.
        assert_eq!(masters.all().len(), 3);
        // A new map keeps the subscribers it already had.
        masters.install(
            "b 127.0.0.1:7001@17001 master - 0 0 2 connected 0-16383\n\
             a 127.0.0.1:7000@17000 master - 0 0 2 connected\n",
        );
        assert!(Arc::ptr_eq(&masters.of(b"foo"), &routes[1].2));
        assert_eq!(masters.all().len(), 3);
    }
}
