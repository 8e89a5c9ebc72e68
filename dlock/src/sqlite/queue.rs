//! The waiters' queue: fair waiting across the processes that share a lock file.
//!
//! Without it, the process that holds a key hands it to its own next waiter (the in-process
//! table queues local waiters, and the next one tries at once), while waiters in other
//! processes poll with backoff and seldom find the key free: one process can take every
//! acquisition while another waits out its timeout.
//!
//! So an exclusive wait that finds the key held takes a place in the key's queue
//! (`__distributed_lock_waiters`: one row per backend and key, keeping the time it joined).
//! A try of a wait takes the key only when no live waiter of another backend joined before
//! it, so the key goes to the processes in the order their waits began, and a process's own
//! waiters queue behind the others' once it has held the key. A waiter polls every
//! [`POLL_MIN`] after the queue moved for it (it joined, or a waiter ahead of it got the key),
//! less often the longer the queue stands still (an eighth of that time, at most
//! [`POLL_MAX`]), so handovers under contention cost about a millisecond and a key held long
//! costs few reads. A place lasts [`PLACE`] unless the waiter's polls renew it, so a waiter
//! that gave up or died holds the others back for at most that long.
//!
//! A single try (`try_acquire`) does not queue, and takes a free key even when waiters are
//! queued; so do versions without the queue.

use std::collections::HashMap;
use std::sync::{MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use rusqlite::params;

use super::Shared;
use super::file::{is_busy, millis};
use super::statements::{QUEUE_AHEAD_SQL, QUEUE_JOIN_SQL, QUEUE_LEAVE_SQL};

/// How long a waiter's place lasts after its last poll renewed it.
const PLACE: Duration = Duration::from_millis(500);
/// A place is renewed once less than this is left of it.
const RENEW_BELOW: Duration = Duration::from_millis(250);
/// A waiter's first pause after the queue moved (it joined, or fewer waiters are ahead of it
/// than at its last poll). The pause grows with the time the queue has not moved (an eighth
/// of it), since a key held long is likely to stay held a while longer.
const POLL_MIN: Duration = Duration::from_millis(1);
/// The longest pause of a waiter in the queue (well under [`RENEW_BELOW`], so that its polls
/// keep its place).
const POLL_MAX: Duration = Duration::from_millis(64);
/// The most keys a backend keeps places for; past it, it forgets them (they lapse).
const PLACES_KEPT: usize = 4096;

/// This backend's place in one key's queue.
#[derive(Debug, Clone, Copy)]
pub(super) struct Place {
    /// When the place lapses (lease clock, ms).
    until: i64,
    /// How many waiters were ahead of it at its last poll.
    ahead: u64,
    /// When the queue last moved for it.
    moved: Instant,
}

impl Shared {
    fn places(&self) -> MutexGuard<'_, HashMap<Box<[u8]>, Place>> {
        self.places.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// How many live waiters of other backends are ahead of this one in the queue of
    /// `name`. A failed read answers 0: the try that follows decides.
    pub(super) async fn queue_ahead(&self, name: &[u8]) -> u64 {
        let clock = self.clock;
        let _pass = self.gate.read().await;
        let ahead = self
            .inline()
            .prepare_cached(QUEUE_AHEAD_SQL)
            .and_then(|mut ahead| {
                ahead.query_row(
                    params![name, &self.waiter[..], clock.now_ms(), clock.boot()],
                    |row| row.get::<_, i64>(0),
                )
            });
        ahead.map_or(0, |n| u64::try_from(n).unwrap_or(0))
    }

    /// A try of a wait for `name` found it held, by its holder or by `ahead` waiters ahead
    /// in the queue: keeps this backend's place in the queue, joining it first, and answers
    /// how soon the wait should try again. Best effort: a busy file leaves the place to the
    /// next poll.
    pub(super) async fn queue_wait(&self, name: &[u8], ahead: u64) -> Duration {
        let clock = self.clock;
        let now = clock.now_ms();
        let place = self.places().get(name).copied();
        let mut place = match place {
            Some(place) if place.until.saturating_sub(now) >= millis(RENEW_BELOW) => place,
            _ => {
                let until = now.saturating_add(millis(PLACE));
                let _pass = self.gate.read().await;
                let joined = self
                    .inline()
                    .prepare_cached(QUEUE_JOIN_SQL)
                    .and_then(|mut join| {
                        join.execute(params![name, &self.waiter[..], now, until, clock.boot()])
                    });
                let joined = match joined {
                    Ok(_) => {
                        self.count_commit();
                        true
                    }
                    Err(err) => {
                        if !is_busy(&err) {
                            tracing::debug!(backend = super::NAME, error = %err, "a waiter's place in the queue could not be written");
                        }
                        false
                    }
                };
                let until = if joined { until } else { now };
                match place {
                    Some(place) => Place { until, ..place },
                    None => Place {
                        until,
                        ahead,
                        moved: Instant::now(),
                    },
                }
            }
        };
        if ahead < place.ahead {
            place.moved = Instant::now();
        }
        place.ahead = ahead;
        let pause = (place.moved.elapsed() / 8).clamp(POLL_MIN, POLL_MAX);
        let mut places = self.places();
        if places.len() >= PLACES_KEPT && !places.contains_key(name) {
            places.clear();
        }
        places.insert(Box::from(name), place);
        pause
    }

    /// A wait got `name`: takes this backend out of its queue, if it had a place there. Tries
    /// again while another writer holds the file, up to the busy timeout (a place left behind
    /// would keep this backend at the head, since its later waits would find it theirs);
    /// past it, the place lapses within [`PLACE`].
    pub(super) async fn queue_leave(&self, name: &[u8]) {
        {
            let mut places = self.places();
            if places.is_empty() || places.remove(name).is_none() {
                return;
            }
        }
        let clock = self.clock;
        let left = self
            .with_busy_retry("leaving a queue", super::RELEASE_PAUSES, |conn| {
                conn.prepare_cached(QUEUE_LEAVE_SQL)?.execute(params![
                    name,
                    &self.waiter[..],
                    clock.now_ms(),
                    clock.boot()
                ])
            })
            .await;
        if left.is_ok() {
            self.count_commit();
        }
    }
}
