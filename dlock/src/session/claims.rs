//! Claims: the resources acquisitions of one backend hold, are acquiring, or are still
//! cleaning up after.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::hash::Hash;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use smallvec::SmallVec;
use tokio::sync::Notify;

use super::traits::Mode;

/// How long an acquisition waits for a claimed resource whose abandoned acquisition is still
/// being cleaned up before it answers that the resource is held.
pub(crate) const SETTLE_LIMIT: Duration = Duration::from_secs(5);

// Claims.

/// The resources that acquisitions of one backend hold, are acquiring, or are still cleaning
/// up after they were abandoned. Every acquisition claims its resource before it asks the
/// server, and keeps the claim until the lock is given back (or its session is gone).
///
/// A claim has a mode: shared claims of a resource share it with each other (read locks),
/// an exclusive claim excludes every other claim and is excluded by them. An exclusive
/// acquisition that waits for a resource holds back later shared claims of it, so the
/// readers of one backend cannot keep a writer of the same backend out.
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

/// A claimed resource: its holders (one exclusive claim, or any number of shared ones), the
/// exclusive acquisitions waiting for it, and what wakes acquisitions waiting for a change.
/// The entry lives while it has a holder or a waiting exclusive acquisition.
pub(super) struct ClaimState {
    shared: bool,
    /// Kept inline while there is one (a resource held by one acquisition, as nearly all
    /// are, costs no allocation of its own).
    holders: SmallVec<[Holder; 1]>,
    writers_waiting: usize,
    /// Moves on with every change a waiting acquisition may be waiting for.
    generation: u64,
    /// Wakes the acquisitions waiting for a change; made by the first of them (most claims
    /// are never waited for).
    ended: Option<Arc<Notify>>,
}

/// One claim of a resource: whether its abandoned acquisition is being cleaned up, and the
/// lane that holds (or is asked for) its lock, if any.
struct Holder {
    id: u64,
    settling: bool,
    lane: Option<u32>,
}

impl ClaimState {
    fn changed(&mut self) {
        self.generation = self.generation.wrapping_add(1);
        if let Some(ended) = &self.ended {
            ended.notify_waiters();
        }
    }

    fn is_unused(&self) -> bool {
        self.holders.is_empty() && self.writers_waiting == 0
    }
}

/// How long [`Claims::claim`] waits for a claim of another acquisition to end.
#[derive(Debug, Clone, Copy)]
pub(super) enum Until {
    /// A try: a resource another acquisition holds (in a conflicting mode) is answered as
    /// held at once; one whose abandoned acquisition is still being cleaned up is waited for,
    /// up to [`SETTLE_LIMIT`].
    Try,
    /// A wait: any conflicting claim is waited for, up to the deadline (`None`: without
    /// limit).
    Deadline(Option<Instant>),
}

impl<R: Clone + Eq + Hash> Claims<R> {
    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<R, ClaimState>> {
        self.map.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Claims `resource` in `mode`: `None` when another acquisition of this backend holds it
    /// in a conflicting mode (and, for a wait, still holds it at the deadline). A shared
    /// claim also conflicts with an exclusive acquisition that waits for the resource.
    pub(super) async fn claim(
        self: &Arc<Self>,
        resource: &R,
        mode: Mode,
        until: Until,
    ) -> Option<Claim<R>> {
        let shared = mode.is_shared();
        // A try's limit starts when it first has to wait: most tries never do, and so read
        // no clock.
        let mut limit = match until {
            Until::Try => None,
            Until::Deadline(deadline) => Some(deadline),
        };
        // Counts this acquisition among the resource's waiting writers while it waits (made
        // when it starts to wait: most claims never do).
        let mut waiting: Option<WaitingWriter<R>> = None;
        loop {
            let (ended, generation) = {
                let mut map = self.map();
                let state = map.entry(resource.clone()).or_insert_with(|| ClaimState {
                    shared,
                    holders: SmallVec::new(),
                    writers_waiting: 0,
                    generation: 0,
                    ended: None,
                });
                let free = if shared {
                    state.writers_waiting == 0 && (state.holders.is_empty() || state.shared)
                } else {
                    state.holders.is_empty()
                };
                if free {
                    if let Some(waiting) = waiting.as_mut()
                        && waiting.armed
                    {
                        waiting.armed = false;
                        state.writers_waiting -= 1;
                    }
                    let id = self.next.fetch_add(1, Ordering::Relaxed);
                    state.shared = shared;
                    state.holders.push(Holder {
                        id,
                        settling: false,
                        lane: None,
                    });
                    return Some(Claim {
                        claims: Arc::clone(self),
                        resource: resource.clone(),
                        id,
                    });
                }
                let live = state.holders.iter().any(|holder| !holder.settling)
                    || (shared && state.writers_waiting > 0);
                if matches!(until, Until::Try) && live {
                    if state.is_unused() {
                        map.remove(resource);
                    }
                    return None;
                }
                if !shared && waiting.is_none() && matches!(until, Until::Deadline(_)) {
                    waiting = Some(WaitingWriter {
                        claims: Arc::clone(self),
                        resource: resource.clone(),
                        armed: true,
                    });
                    state.writers_waiting += 1;
                }
                let ended = state.ended.get_or_insert_with(|| Arc::new(Notify::new()));
                (Arc::clone(ended), state.generation)
            };
            let limit =
                *limit.get_or_insert_with(|| crate::time::deadline(Instant::now(), SETTLE_LIMIT));
            if limit.is_some_and(|limit| Instant::now() >= limit) {
                return None;
            }
            let notified = ended.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            // Re-check: the claims may have changed between the look and `enable`.
            let still = self.map().get(resource).is_some_and(|state| {
                state
                    .ended
                    .as_ref()
                    .is_some_and(|now| Arc::ptr_eq(now, &ended))
                    && state.generation == generation
            });
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
        self.map()
            .get(resource)
            .is_some_and(|state| !state.holders.is_empty())
    }

    /// Whether an exclusive acquisition waits for `resource` (tests).
    #[cfg(test)]
    pub(super) fn writer_waits(&self, resource: &R) -> bool {
        self.map()
            .get(resource)
            .is_some_and(|state| state.writers_waiting > 0)
    }

    /// Whether no resource is claimed or waited for (tests).
    #[cfg(test)]
    pub(super) fn is_empty(&self) -> bool {
        self.map().is_empty()
    }

    /// Marks claim `id` of `resource` as being cleaned up (if it is still a claim of it):
    /// conflicting tries wait for it instead of answering that the resource is held.
    pub(super) fn settle(&self, resource: &R, id: u64) {
        if let Some(state) = self.map().get_mut(resource)
            && let Some(holder) = state.holders.iter_mut().find(|holder| holder.id == id)
        {
            holder.settling = true;
            state.changed();
        }
    }

    /// The lanes that hold (or are asked for) the claims of `resource`.
    pub(super) fn lanes_of(&self, resource: &R) -> Vec<usize> {
        self.map().get(resource).map_or_else(Vec::new, |state| {
            state
                .holders
                .iter()
                .filter_map(|holder| usize::try_from(holder.lane?).ok())
                .collect()
        })
    }
}

/// An exclusive acquisition counted among a resource's waiting writers; dropped armed (the
/// wait ran out or was abandoned), it stops holding back shared claims.
struct WaitingWriter<R: Clone + Eq + Hash> {
    claims: Arc<Claims<R>>,
    resource: R,
    armed: bool,
}

impl<R: Clone + Eq + Hash> Drop for WaitingWriter<R> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let mut map = self.claims.map();
        if let Some(state) = map.get_mut(&self.resource) {
            state.writers_waiting = state.writers_waiting.saturating_sub(1);
            state.changed();
            if state.is_unused() {
                map.remove(&self.resource);
            }
        }
    }
}

/// A claimed resource; dropping it ends the claim and wakes the acquisitions waiting for a
/// change.
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

    /// Records the lane asked for this claim's lock.
    pub(super) fn on_lane(&self, lane: usize) {
        if let Some(state) = self.claims.map().get_mut(&self.resource)
            && let Some(holder) = state.holders.iter_mut().find(|h| h.id == self.id)
        {
            // A lane index past `u32` (never: lanes are a handful) is not recorded.
            holder.lane = u32::try_from(lane).ok();
        }
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
        // One lookup (the key hashed once) both updates and, when unused, removes the entry.
        if let Entry::Occupied(mut entry) = map.entry(self.resource.clone())
            && let Some(at) = entry.get().holders.iter().position(|h| h.id == self.id)
        {
            let state = entry.get_mut();
            state.holders.swap_remove(at);
            state.changed();
            if state.is_unused() {
                entry.remove();
            }
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
        let first = claims
            .claim(&"a", Mode::Exclusive, Until::Try)
            .await
            .expect("free");
        assert!(
            claims
                .claim(&"a", Mode::Exclusive, Until::Try)
                .await
                .is_none(),
            "held by this backend"
        );
        assert!(
            claims
                .claim(&"b", Mode::Exclusive, Until::Try)
                .await
                .is_some(),
            "other resources are free"
        );
        // An abandoned acquisition: later tries wait for its clean-up, then get it.
        first.abandon_guard().disarm();
        drop(first.abandon_guard());
        let waiter = tokio::spawn({
            let claims = Arc::clone(&claims);
            async move {
                claims
                    .claim(&"a", Mode::Exclusive, Until::Try)
                    .await
                    .is_some()
            }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiter.is_finished(), "waits while the claim settles");
        drop(first);
        assert!(waiter.await.unwrap(), "claimed once the clean-up is done");
        // A settle aimed at an earlier claim of the resource changes nothing.
        let second = claims
            .claim(&"a", Mode::Exclusive, Until::Try)
            .await
            .expect("free again");
        claims.settle(&"a", second.id.wrapping_sub(1));
        assert!(
            claims
                .claim(&"a", Mode::Exclusive, Until::Try)
                .await
                .is_none()
        );
        // Nor does the drop of a claim that is no longer the resource's.
        let stale = Claim {
            claims: Arc::clone(&claims),
            resource: "a",
            id: second.id.wrapping_sub(1),
        };
        drop(stale);
        assert!(
            claims
                .claim(&"a", Mode::Exclusive, Until::Try)
                .await
                .is_none()
        );
    }

    #[tokio::test]
    async fn waiting_claims_queue_behind_the_holder_and_keep_their_deadline() {
        let claims: Arc<Claims<u8>> = Arc::new(Claims::default());
        let held = claims
            .claim(&1, Mode::Exclusive, Until::Try)
            .await
            .expect("free");
        // A wait that runs out while the claim is held gets nothing.
        let started = Instant::now();
        let soon = Some(started + Duration::from_millis(50));
        assert!(
            claims
                .claim(&1, Mode::Exclusive, Until::Deadline(soon))
                .await
                .is_none()
        );
        assert!(started.elapsed() >= Duration::from_millis(50));
        // Waits without a limit all get it, one after another.
        let inside = Arc::new(AtomicUsize::new(0));
        let mut waiters = Vec::new();
        for _ in 0..8 {
            let (claims, inside) = (Arc::clone(&claims), Arc::clone(&inside));
            waiters.push(tokio::spawn(async move {
                let claim = claims
                    .claim(&1, Mode::Exclusive, Until::Deadline(None))
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

    #[tokio::test]
    async fn shared_claims_share_and_exclusive_ones_exclude_them() {
        let claims: Arc<Claims<u8>> = Arc::new(Claims::default());
        let r1 = claims
            .claim(&1, Mode::Shared, Until::Try)
            .await
            .expect("free");
        let r2 = claims
            .claim(&1, Mode::Shared, Until::Try)
            .await
            .expect("readers share");
        assert!(
            claims
                .claim(&1, Mode::Exclusive, Until::Try)
                .await
                .is_none(),
            "a writer among readers"
        );
        drop(r1);
        assert!(
            claims
                .claim(&1, Mode::Exclusive, Until::Try)
                .await
                .is_none(),
            "a writer beside the last reader"
        );
        drop(r2);
        let w = claims
            .claim(&1, Mode::Exclusive, Until::Try)
            .await
            .expect("free once the readers left");
        assert!(
            claims.claim(&1, Mode::Shared, Until::Try).await.is_none(),
            "a reader beside a writer"
        );
        assert!(
            claims
                .claim(&1, Mode::Exclusive, Until::Try)
                .await
                .is_none(),
            "two writers"
        );
        drop(w);
        assert!(claims.map().is_empty(), "every claim ended");
    }

    /// A settling reader is no holder to a new reader, and is waited for by a writer's try;
    /// the settle and the drop of one reader leave the other readers' claims alone.
    #[tokio::test]
    async fn settling_shared_claims_are_counted_one_by_one() {
        let claims: Arc<Claims<u8>> = Arc::new(Claims::default());
        let r1 = claims
            .claim(&1, Mode::Shared, Until::Try)
            .await
            .expect("free");
        let r2 = claims
            .claim(&1, Mode::Shared, Until::Try)
            .await
            .expect("share");
        drop(r1.abandon_guard());
        let r3 = claims
            .claim(&1, Mode::Shared, Until::Try)
            .await
            .expect("a reader shares with a settling reader");
        drop(r3);
        assert!(
            claims
                .claim(&1, Mode::Exclusive, Until::Try)
                .await
                .is_none(),
            "r2 is not settling: the writer's try is answered at once"
        );
        drop(r2);
        let writer = tokio::spawn({
            let claims = Arc::clone(&claims);
            async move {
                claims
                    .claim(&1, Mode::Exclusive, Until::Try)
                    .await
                    .is_some()
            }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(
            !writer.is_finished(),
            "the writer's try waits for the clean-up"
        );
        drop(r1);
        assert!(writer.await.unwrap(), "claimed once the clean-up is done");
        assert!(claims.map().is_empty());
    }

    /// A waiting writer holds back later readers (tried or waiting) until it has had the
    /// resource, and stops holding them back when its wait runs out.
    #[tokio::test]
    async fn a_waiting_writer_holds_back_later_readers() {
        let claims: Arc<Claims<u8>> = Arc::new(Claims::default());
        let r1 = claims
            .claim(&1, Mode::Shared, Until::Try)
            .await
            .expect("free");
        let writer = tokio::spawn({
            let claims = Arc::clone(&claims);
            async move {
                let w = claims
                    .claim(&1, Mode::Exclusive, Until::Deadline(None))
                    .await
                    .expect("the writer gets it");
                tokio::time::sleep(Duration::from_millis(30)).await;
                drop(w);
            }
        });
        crate::testing::spin_until("the writer waits", || {
            claims.map().get(&1).is_some_and(|s| s.writers_waiting > 0)
        })
        .await;
        assert!(
            claims.claim(&1, Mode::Shared, Until::Try).await.is_none(),
            "a reader's try went ahead of a waiting writer"
        );
        let reader = tokio::spawn({
            let claims = Arc::clone(&claims);
            async move {
                claims
                    .claim(&1, Mode::Shared, Until::Deadline(None))
                    .await
                    .is_some()
            }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(
            !reader.is_finished(),
            "a reader's wait went ahead of the writer"
        );
        drop(r1);
        writer.await.unwrap();
        assert!(reader.await.unwrap(), "the reader follows the writer");
        // A writer whose wait runs out stops holding readers back.
        let r = claims
            .claim(&1, Mode::Shared, Until::Try)
            .await
            .expect("free");
        let soon = Some(Instant::now() + Duration::from_millis(30));
        assert!(
            claims
                .claim(&1, Mode::Exclusive, Until::Deadline(soon))
                .await
                .is_none()
        );
        let again = claims
            .claim(&1, Mode::Shared, Until::Try)
            .await
            .expect("no writer waits any more");
        drop((r, again));
        assert!(claims.map().is_empty(), "nothing left behind");
    }
}
