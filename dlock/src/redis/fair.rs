//! Fair waiting across processes (see [Fair waiting](super#fair-waiting)).
//!
//! A release wakes the key's waiters in every process at once (its announcement), but the
//! releasing process has its own next waiter ready (local waiters queue in the in-process
//! table and the next one tries as soon as the release is done), and would win most races.
//! So when a release's announcement reached subscribers of other backends, this backend's
//! next waiting try of that key holds off for a moment, long enough for a woken waiter
//! elsewhere to take the key: about four of the release's round trips, from 1 ms to 50 ms.
//! If nobody took it by then, the local waiter tries as usual. A release of the key by
//! another backend, heard by this backend's subscriber, ends the hold-off at once: the key
//! changed hands since.
//!
//! Waiters woken by a key's releases queue with the key instead (see `queue_lua!` in
//! `commands.rs`), which orders them whatever order the server delivers a release in: their
//! tries never hold off. The hold-off serves the waits that do not queue (`fencing=false`,
//! `key_layout=plain`, a user refused the queue's commands).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

/// The shortest hold-off.
const HOLD_OFF_MIN: Duration = Duration::from_millis(1);
/// The longest hold-off.
const HOLD_OFF_MAX: Duration = Duration::from_millis(50);
/// Past this many keys, expired hold-offs are dropped.
const KEPT: usize = 1024;

/// The keys this backend gave back to waiters elsewhere, and until when its own waiters
/// hold off.
#[derive(Debug, Default)]
pub(super) struct HoldOffs {
    until: Mutex<HashMap<Arc<[u8]>, Instant>>,
}

impl HoldOffs {
    fn until(&self) -> MutexGuard<'_, HashMap<Arc<[u8]>, Instant>> {
        self.until.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// This backend released `key` in a round trip of `took`, and the announcement woke
    /// `others` subscribers of other backends.
    pub(super) fn released(&self, key: &Arc<[u8]>, others: u64, took: Duration) {
        if others == 0 {
            return;
        }
        let now = Instant::now();
        let hold_off = took.saturating_mul(4).clamp(HOLD_OFF_MIN, HOLD_OFF_MAX);
        let mut until = self.until();
        if until.len() >= KEPT {
            until.retain(|_, at| *at > now);
        }
        until.insert(Arc::clone(key), now + hold_off);
    }

    /// Ends the hold-off on `key`, if any: another backend released it (see
    /// [`Heard`](super::wake::Heard)).
    pub(super) fn end(&self, key: &[u8]) {
        let mut until = self.until();
        if !until.is_empty() {
            until.remove(key);
        }
    }

    /// How long a waiting try of `key` still holds off, if it does.
    pub(super) fn left(&self, key: &[u8]) -> Option<Duration> {
        let mut until = self.until();
        if until.is_empty() {
            return None;
        }
        let at = *until.get(key)?;
        let left = at
            .checked_duration_since(Instant::now())
            .filter(|d| !d.is_zero());
        if left.is_none() {
            until.remove(key);
        }
        left
    }
}
