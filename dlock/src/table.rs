//! The in-process table: the keys one provider holds or is acquiring.
//!
//! Every key in use has one slot, an async mutex. A task must own the slot before it talks to
//! the lock store about that key, and keeps it for as long as it holds the lock. So:
//! - a contending `try_acquire` for a key held here fails on the slot with no I/O and no
//!   allocation (the error reuses the key stored in the table);
//! - local waiters queue on the slot in FIFO order and are woken by the local release, and only
//!   the one at the head talks to the store;
//! - a backend never sees two acquisitions of one key from one provider at the same time.
//!
//! Providers made from clones of one backend have separate tables; backends whose sessions
//! re-enter their own locks (PostgreSQL, MySQL, SQL Server, Oracle) keep them apart with claims
//! of their own, shared by every clone (see `lanes.rs`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tokio::sync::{Mutex as AsyncMutex, OwnedMutexGuard};

type Entry = Arc<AsyncMutex<()>>;

#[derive(Debug, Default)]
pub(crate) struct LocalTable {
    entries: Mutex<HashMap<Arc<str>, Entry>>,
    /// What is known of each key held now (one holder per key: the slot's), for inspection.
    held: Mutex<HashMap<Arc<str>, Shown>>,
}

/// A held lock as [`LockProvider::held_locks`](crate::LockProvider::held_locks) shows it.
#[derive(Debug, Clone)]
pub(crate) struct Shown {
    pub(crate) since: std::time::SystemTime,
    pub(crate) fencing_token: Option<u64>,
    pub(crate) lease_deadline: Option<crate::backend::LeaseDeadline>,
    pub(crate) lost: tokio_util::sync::CancellationToken,
}

impl LocalTable {
    fn map(&self) -> MutexGuard<'_, HashMap<Arc<str>, Entry>> {
        // The map is only ever left in a consistent state, so a poisoned lock is still usable.
        self.entries.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Number of keys held or being acquired through this table.
    pub(crate) fn len(&self) -> usize {
        self.map().len()
    }

    fn held(&self) -> MutexGuard<'_, HashMap<Arc<str>, Shown>> {
        self.held.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The keys held now, with what is known of them.
    pub(crate) fn shown(&self) -> Vec<(Arc<str>, Shown)> {
        self.held()
            .iter()
            .map(|(key, shown)| (Arc::clone(key), shown.clone()))
            .collect()
    }

    /// Takes the slot of `key` if it is free. On contention returns the key as stored in the
    /// table, without allocating.
    pub(crate) fn try_slot(self: &Arc<Self>, key: &str) -> Result<Slot, Arc<str>> {
        let mut map = self.map();
        if let Some((stored, entry)) = map.get_key_value(key) {
            return match Arc::clone(entry).try_lock_owned() {
                Ok(guard) => Ok(Slot {
                    _guard: guard,
                    entry: EntryRef {
                        table: Arc::clone(self),
                        key: Arc::clone(stored),
                    },
                }),
                Err(_) => Err(Arc::clone(stored)),
            };
        }
        let stored: Arc<str> = Arc::from(key);
        let entry: Entry = Arc::new(AsyncMutex::new(()));
        let Ok(guard) = Arc::clone(&entry).try_lock_owned() else {
            // A mutex nobody else has seen is always free; answer contention rather than panic.
            return Err(stored);
        };
        map.insert(Arc::clone(&stored), entry);
        Ok(Slot {
            _guard: guard,
            entry: EntryRef {
                table: Arc::clone(self),
                key: stored,
            },
        })
    }

    /// Waits for the slot of `key`, queueing behind the local holder and earlier waiters.
    ///
    /// Cancel safe: dropping the future leaves the queue and forgets the entry if nobody else
    /// uses it.
    pub(crate) async fn wait_slot(self: &Arc<Self>, key: &str) -> Slot {
        let (entry_ref, entry) = {
            let mut map = self.map();
            let (stored, entry) = match map.get_key_value(key) {
                Some((stored, entry)) => (Arc::clone(stored), Arc::clone(entry)),
                None => {
                    let stored: Arc<str> = Arc::from(key);
                    let entry: Entry = Arc::new(AsyncMutex::new(()));
                    map.insert(Arc::clone(&stored), Arc::clone(&entry));
                    (stored, entry)
                }
            };
            (
                EntryRef {
                    table: Arc::clone(self),
                    key: stored,
                },
                entry,
            )
        };
        // `entry_ref` lives across the await: if this future is dropped while queued, its drop
        // removes the entry when no one else refers to it.
        let guard = entry.lock_owned().await;
        Slot {
            _guard: guard,
            entry: entry_ref,
        }
    }
}

/// Ownership of one key's slot. Dropping it wakes the next local waiter, then forgets the key
/// if nobody else is holding or waiting for it.
#[derive(Debug)]
pub(crate) struct Slot {
    // Field order matters: the mutex guard is dropped (waking the next waiter) before the
    // entry reference checks whether the entry can go.
    _guard: OwnedMutexGuard<()>,
    entry: EntryRef,
}

impl Slot {
    pub(crate) fn key(&self) -> &Arc<str> {
        &self.entry.key
    }

    /// Records the lock this slot's holder got, until the slot is freed.
    pub(crate) fn show(&self, shown: Shown) {
        let key = Arc::clone(&self.entry.key);
        self.entry.table.held().insert(key, shown);
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        // Only this slot's holder can have recorded the key: one holder per key.
        self.entry.table.held().remove(&*self.entry.key);
    }
}

#[derive(Debug)]
struct EntryRef {
    table: Arc<LocalTable>,
    key: Arc<str>,
}

impl Drop for EntryRef {
    fn drop(&mut self) {
        let mut map = self.table.map();
        // Every clone of an entry is made under the map lock, and the map holds one itself:
        // a count of one means no slot, waiter or contender refers to it any more.
        if map
            .get(&*self.key)
            .is_some_and(|entry| Arc::strong_count(entry) == 1)
        {
            map.remove(&*self.key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn contention_and_cleanup() {
        let table = Arc::new(LocalTable::default());
        let slot = table.try_slot("a").unwrap();
        assert_eq!(&**slot.key(), "a");
        let err = table.try_slot("a").unwrap_err();
        assert!(Arc::ptr_eq(&err, slot.key()));
        assert_eq!(table.len(), 1);
        drop(slot);
        assert_eq!(table.len(), 0);
    }

    #[tokio::test]
    async fn waiters_queue_and_canceled_waits_clean_up() {
        let table = Arc::new(LocalTable::default());
        let slot = table.try_slot("k").unwrap();
        let waiter = {
            let table = Arc::clone(&table);
            tokio::spawn(async move {
                let s = table.wait_slot("k").await;
                drop(s);
            })
        };
        // A waiter that gives up must not leave anything behind.
        let canceled = tokio::time::timeout(Duration::from_millis(10), table.wait_slot("k")).await;
        assert!(canceled.is_err());
        drop(slot);
        waiter.await.unwrap();
        assert_eq!(table.len(), 0);

        let gone = tokio::time::timeout(Duration::from_millis(1), async {
            let held = table.try_slot("x").unwrap();
            let _never = table.wait_slot("x").await;
            drop(held);
        })
        .await;
        assert!(gone.is_err());
        assert_eq!(table.len(), 0);
    }
}
