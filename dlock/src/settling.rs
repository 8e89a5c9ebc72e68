//! Clean-ups of abandoned acquisitions, which a later acquisition of the same key through the
//! same backend waits for.
//!
//! An acquisition dropped after its command may have reached the store (a cancelled or timed
//! out wait, a dropped future) gives back what it may have taken in the background. Until
//! that clean-up has run, the store may still show the key taken under the abandoned
//! acquisition's token: a try of the same backend sent in that moment would answer that a key
//! nobody holds is held. So each clean-up is registered here before its acquisition's future
//! is gone, and an acquisition first waits (up to a bound) for the clean-ups of its key.

use std::borrow::Borrow;
use std::collections::HashMap;
use std::hash::Hash;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::sync::Notify;

/// The most an acquisition waits for clean-ups that have no command timeout of their own to
/// go by (each of their commands is bounded by its node's).
pub(crate) const SETTLE_LIMIT: Duration = Duration::from_secs(5);

/// The clean-ups under way, per key.
pub(crate) struct Settling<K> {
    /// How many clean-ups run, of every key: an acquisition with none to wait for looks no
    /// further.
    running: AtomicUsize,
    keys: Mutex<HashMap<K, Pending>>,
}

/// The clean-ups of one key, and what wakes the acquisitions waiting for them.
struct Pending {
    count: usize,
    done: Arc<Notify>,
}

impl<K> Default for Settling<K> {
    fn default() -> Self {
        Settling {
            running: AtomicUsize::new(0),
            keys: Mutex::new(HashMap::new()),
        }
    }
}

impl<K: Clone + Eq + Hash> Settling<K> {
    fn keys(&self) -> MutexGuard<'_, HashMap<K, Pending>> {
        self.keys.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Registers a clean-up of `key`; it counts until the returned guard is dropped (when the
    /// clean-up has run, or given up).
    pub(crate) fn begin(self: &Arc<Self>, key: K) -> Settle<K> {
        self.running.fetch_add(1, Ordering::AcqRel);
        self.keys()
            .entry(key.clone())
            .or_insert_with(|| Pending {
                count: 0,
                done: Arc::new(Notify::new()),
            })
            .count += 1;
        Settle {
            settling: Arc::clone(self),
            key,
        }
    }

    /// Waits until no clean-up of `key` runs, or `limit` has passed (the clean-ups are
    /// bounded by the backend's command timeout; past that, the acquisition goes ahead).
    ///
    /// Cancel safe: it only waits.
    pub(crate) async fn wait<Q>(&self, key: &Q, limit: Duration)
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        if self.running.load(Ordering::Acquire) == 0 {
            return;
        }
        let wait = async {
            loop {
                let done = match self.keys().get(key) {
                    Some(pending) => Arc::clone(&pending.done),
                    None => return,
                };
                let notified = done.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                // Ended between the look and `enable`?
                if !self.keys().contains_key(key) {
                    return;
                }
                notified.await;
            }
        };
        let _ = tokio::time::timeout(limit, wait).await;
    }
}

/// A clean-up under way; dropped, it ends.
pub(crate) struct Settle<K: Clone + Eq + Hash> {
    settling: Arc<Settling<K>>,
    key: K,
}

impl<K: Clone + Eq + Hash> Drop for Settle<K> {
    fn drop(&mut self) {
        {
            let mut keys = self.settling.keys();
            if let Some(pending) = keys.get_mut(&self.key) {
                pending.count -= 1;
                if pending.count == 0
                    && let Some(pending) = keys.remove(&self.key)
                {
                    pending.done.notify_waiters();
                }
            }
        }
        self.settling.running.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An acquisition waits for the clean-ups of its own key only, until the last one ends,
    /// and no longer than its limit.
    #[tokio::test]
    async fn waits_for_the_clean_ups_of_its_key() {
        let settling: Arc<Settling<&str>> = Arc::default();
        let limit = Duration::from_secs(30);
        // Nothing running: no wait.
        tokio::time::timeout(Duration::from_secs(1), settling.wait(&"a", limit))
            .await
            .expect("nothing to wait for");
        let (first, second) = (settling.begin("a"), settling.begin("a"));
        let other = settling.begin("b");
        tokio::time::timeout(Duration::from_secs(1), settling.wait(&"c", limit))
            .await
            .expect("another key's clean-ups are not waited for");
        let waiter = tokio::spawn({
            let settling = Arc::clone(&settling);
            async move { settling.wait(&"a", limit).await }
        });
        // (One thread: the waiter runs up to its wait at the first yield.)
        tokio::task::yield_now().await;
        drop(first);
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished(), "one clean-up of the key still runs");
        drop(second);
        tokio::time::timeout(Duration::from_secs(1), waiter)
            .await
            .expect("woken when the last one ended")
            .unwrap();
        // Bounded: a clean-up that never ends holds a wait up for `limit` only.
        let started = std::time::Instant::now();
        settling.wait(&"b", Duration::from_millis(50)).await;
        assert!(started.elapsed() >= Duration::from_millis(50));
        drop(other);
        assert!(settling.keys().is_empty());
        assert_eq!(settling.running.load(Ordering::Acquire), 0);
    }
}
