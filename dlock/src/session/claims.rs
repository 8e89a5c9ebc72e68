//! Claims: the resources acquisitions of one backend hold, are acquiring, or are still
//! cleaning up after.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

/// How long an acquisition waits for a claimed resource whose abandoned acquisition is still
/// being cleaned up before it answers that the resource is held.
pub(crate) const SETTLE_LIMIT: Duration = Duration::from_secs(5);

// Claims.

/// The resources that acquisitions of one backend hold, are acquiring, or are still cleaning
/// up after they were abandoned. Every acquisition claims its resource before it asks the
/// server, and keeps the claim until the lock is given back (or its session is gone).
pub(super) struct Claims<R> {
    map: Mutex<HashMap<R, ClaimState>>,
    next: AtomicU64,
}

impl<R> Default for Claims<R> {
    fn default() -> Self {
        Claims {
            map: Mutex::new(HashMap::new()),
            next: AtomicU64::new(0),
        }
    }
}

/// A claimed resource: the claim's id, whether its abandoned acquisition is being cleaned up,
/// and what wakes acquisitions waiting for the claim to end.
pub(super) struct ClaimState {
    id: u64,
    settling: bool,
    ended: Arc<Notify>,
}

/// How long [`Claims::claim`] waits for a claim of another acquisition to end.
#[derive(Debug, Clone, Copy)]
pub(super) enum Until {
    /// A try: a resource another acquisition holds is answered as held at once; one whose
    /// abandoned acquisition is still being cleaned up is waited for, up to [`SETTLE_LIMIT`].
    Try,
    /// A wait: any claim is waited for, up to the deadline (`None`: without limit).
    Deadline(Option<Instant>),
}

impl<R: Clone + Eq + Hash> Claims<R> {
    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<R, ClaimState>> {
        self.map.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Claims `resource`: `None` when another acquisition of this backend holds it (and, for
    /// a wait, still holds it at the deadline).
    pub(super) async fn claim(self: &Arc<Self>, resource: &R, until: Until) -> Option<Claim<R>> {
        let limit = match until {
            Until::Try => crate::time::deadline(Instant::now(), SETTLE_LIMIT),
            Until::Deadline(deadline) => deadline,
        };
        loop {
            let ended = {
                let mut map = self.map();
                match map.get(resource) {
                    None => {
                        let id = self.next.fetch_add(1, Ordering::Relaxed);
                        map.insert(
                            resource.clone(),
                            ClaimState {
                                id,
                                settling: false,
                                ended: Arc::new(Notify::new()),
                            },
                        );
                        return Some(Claim {
                            claims: Arc::clone(self),
                            resource: resource.clone(),
                            id,
                        });
                    }
                    Some(state) if !state.settling && matches!(until, Until::Try) => return None,
                    Some(state) => Arc::clone(&state.ended),
                }
            };
            if limit.is_some_and(|limit| Instant::now() >= limit) {
                return None;
            }
            let notified = ended.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            // Re-check: the claim may have ended between the look and `enable`.
            let still = self
                .map()
                .get(resource)
                .is_some_and(|state| Arc::ptr_eq(&state.ended, &ended));
            if still {
                match limit {
                    Some(limit) => {
                        let _ = tokio::time::timeout_at(limit.into(), notified).await;
                    }
                    None => notified.await,
                }
            }
        }
    }

    /// Whether `resource` is claimed (tests).
    #[cfg(test)]
    pub(super) fn is_claimed(&self, resource: &R) -> bool {
        self.map().contains_key(resource)
    }

    /// Marks claim `id` of `resource` as being cleaned up (if it is still that claim): tries
    /// wait for it instead of answering that the resource is held.
    pub(super) fn settle(&self, resource: &R, id: u64) {
        if let Some(state) = self.map().get_mut(resource)
            && state.id == id
        {
            state.settling = true;
        }
    }
}

/// A claimed resource; dropping it ends the claim and wakes the acquisitions waiting for it.
pub(super) struct Claim<R: Clone + Eq + Hash> {
    claims: Arc<Claims<R>>,
    resource: R,
    id: u64,
}

impl<R: Clone + Eq + Hash> Claim<R> {
    /// Marks the resource as being cleaned up on the server: tries wait until the claim is
    /// dropped instead of answering that it is held.
    pub(super) fn settling(&self) {
        self.claims.settle(&self.resource, self.id);
    }

    /// A guard that marks this claim as being cleaned up if it is dropped armed: an
    /// acquisition future dropped before its answer arrived leaves the resource to the
    /// background clean-up.
    pub(super) fn abandon_guard(&self) -> AbandonGuard<R> {
        AbandonGuard {
            claims: Arc::clone(&self.claims),
            resource: self.resource.clone(),
            id: self.id,
            armed: true,
        }
    }
}

impl<R: Clone + Eq + Hash> Drop for Claim<R> {
    fn drop(&mut self) {
        let mut map = self.claims.map();
        if map
            .get(&self.resource)
            .is_some_and(|state| state.id == self.id)
            && let Some(state) = map.remove(&self.resource)
        {
            drop(map);
            state.ended.notify_waiters();
        }
    }
}

pub(super) struct AbandonGuard<R: Clone + Eq + Hash> {
    claims: Arc<Claims<R>>,
    resource: R,
    id: u64,
    armed: bool,
}

impl<R: Clone + Eq + Hash> AbandonGuard<R> {
    /// The answer arrived: nothing to mark.
    pub(super) fn disarm(mut self) {
        self.armed = false;
    }
}

impl<R: Clone + Eq + Hash> Drop for AbandonGuard<R> {
    fn drop(&mut self) {
        if self.armed {
            self.claims.settle(&self.resource, self.id);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use super::*;

    #[tokio::test]
    async fn claims_exclude_and_settling_claims_are_waited_for() {
        let claims: Arc<Claims<&str>> = Arc::new(Claims::default());
        let first = claims.claim(&"a", Until::Try).await.expect("free");
        assert!(
            claims.claim(&"a", Until::Try).await.is_none(),
            "held by this backend"
        );
        assert!(
            claims.claim(&"b", Until::Try).await.is_some(),
            "other resources are free"
        );
        // An abandoned acquisition: later tries wait for its clean-up, then get it.
        first.abandon_guard().disarm();
        drop(first.abandon_guard());
        let waiter = tokio::spawn({
            let claims = Arc::clone(&claims);
            async move { claims.claim(&"a", Until::Try).await.is_some() }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiter.is_finished(), "waits while the claim settles");
        drop(first);
        assert!(waiter.await.unwrap(), "claimed once the clean-up is done");
        // A settle aimed at an earlier claim of the resource changes nothing.
        let second = claims.claim(&"a", Until::Try).await.expect("free again");
        claims.settle(&"a", second.id.wrapping_sub(1));
        assert!(claims.claim(&"a", Until::Try).await.is_none());
        // Nor does the drop of a claim that is no longer the resource's.
        let stale = Claim {
            claims: Arc::clone(&claims),
            resource: "a",
            id: second.id.wrapping_sub(1),
        };
        drop(stale);
        assert!(claims.claim(&"a", Until::Try).await.is_none());
    }

    #[tokio::test]
    async fn waiting_claims_queue_behind_the_holder_and_keep_their_deadline() {
        let claims: Arc<Claims<u8>> = Arc::new(Claims::default());
        let held = claims.claim(&1, Until::Try).await.expect("free");
        // A wait that runs out while the claim is held gets nothing.
        let started = Instant::now();
        let soon = Some(started + Duration::from_millis(50));
        assert!(claims.claim(&1, Until::Deadline(soon)).await.is_none());
        assert!(started.elapsed() >= Duration::from_millis(50));
        // Waits without a limit all get it, one after another.
        let inside = Arc::new(AtomicUsize::new(0));
        let mut waiters = Vec::new();
        for _ in 0..8 {
            let (claims, inside) = (Arc::clone(&claims), Arc::clone(&inside));
            waiters.push(tokio::spawn(async move {
                let claim = claims
                    .claim(&1, Until::Deadline(None))
                    .await
                    .expect("claimed");
                assert_eq!(
                    inside.fetch_add(1, Ordering::SeqCst),
                    0,
                    "two claims at once"
                );
                tokio::task::yield_now().await;
                inside.fetch_sub(1, Ordering::SeqCst);
                drop(claim);
            }));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(
            waiters.iter().all(|w| !w.is_finished()),
            "waiting on the holder"
        );
        drop(held);
        for waiter in waiters {
            waiter.await.expect("waiter");
        }
        assert!(claims.map().is_empty(), "every claim ended");
    }
}
