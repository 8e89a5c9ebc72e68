//! The in-process table: the keys one provider holds or is acquiring.
//!
//! Every key in use has one slot, a fair async reader-writer lock. A task must own the slot
//! (exclusively for a lock, shared for a read lock) before it talks to the lock store about that
//! key, and keeps it for as long as it holds the lock. So:
//! - a contending `try_acquire` for a key held here fails on the slot with no I/O and no
//!   allocation (the error reuses the key stored in the table);
//! - local waiters queue on the slot in FIFO order and are woken by the local release, and only
//!   the one at the head talks to the store;
//! - a backend never sees two acquisitions of one key from one provider at the same time,
//!   except shared (read) ones, which it must let share;
//! - a writer waiting here holds back readers that come after it (the queue is fair), so a
//!   steady stream of local readers cannot starve a local writer;
//! - a waiter that polled the store and got the lock leaves its watch on the key's releases in
//!   the slot when another local waiter is queued behind it, and that waiter takes it over
//!   (see `provider::poll`): the backend's subscription stays in place from one local waiter to
//!   the next, so a release elsewhere while the next one starts waiting is still heard.
//!
//! Providers made from clones of one backend have separate tables; backends whose sessions
//! re-enter their own locks (PostgreSQL, MySQL, SQL Server, Oracle) keep them apart with claims
//! of their own, shared by every clone (see `lanes.rs`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tokio::sync::{OwnedRwLockReadGuard, OwnedRwLockWriteGuard, RwLock};

use crate::backend::ReleaseWatch;

/// A watch on the key's releases that one local holder left for the next (in a `Mutex` only
/// to be `Sync`: it is reached through the slot's exclusive guard, never locked while shared).
type Parked = Mutex<Option<Box<dyn ReleaseWatch>>>;
type Entry = Arc<RwLock<Parked>>;

/// What inspection shows of the locks held through the table is kept with the provider's
/// metrics, in one record per held lock (see `metrics.rs`).
#[derive(Debug, Default)]
pub(crate) struct LocalTable {
    entries: Mutex<HashMap<Arc<str>, Entry>>,
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

    fn slot(self: &Arc<Self>, guard: Guard, key: Arc<str>) -> Slot {
        Slot {
            guard,
            entry: EntryRef {
                table: Arc::clone(self),
                key,
            },
        }
    }

    /// Takes the slot of `key` if it is free (for a shared slot: held by readers only, with no
    /// writer waiting). On contention returns the key as stored in the table, without
    /// allocating.
    pub(crate) fn try_slot(self: &Arc<Self>, key: &str, shared: bool) -> Result<Slot, Arc<str>> {
        let mut map = self.map();
        if let Some((stored, entry)) = map.get_key_value(key) {
            return match Guard::try_take(entry, shared) {
                Some(guard) => Ok(self.slot(guard, Arc::clone(stored))),
                None => Err(Arc::clone(stored)),
            };
        }
        let stored: Arc<str> = Arc::from(key);
        let entry: Entry = Entry::default();
        let Some(guard) = Guard::try_take(&entry, shared) else {
            // A lock nobody else has seen is always free; answer contention rather than panic.
            return Err(stored);
        };
        map.insert(Arc::clone(&stored), entry);
        Ok(self.slot(guard, stored))
    }

    /// Waits for the slot of `key`, queueing behind the local holder and earlier waiters.
    ///
    /// Cancel safe: dropping the future leaves the queue and forgets the entry if nobody else
    /// uses it.
    pub(crate) async fn wait_slot(self: &Arc<Self>, key: &str, shared: bool) -> Slot {
        let (entry_ref, entry) = {
            let mut map = self.map();
            let (stored, entry) = match map.get_key_value(key) {
                Some((stored, entry)) => (Arc::clone(stored), Arc::clone(entry)),
                None => {
                    let stored: Arc<str> = Arc::from(key);
                    let entry: Entry = Entry::default();
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
        let guard = if shared {
            Guard::Read(entry.read_owned().await)
        } else {
            Guard::Write(entry.write_owned().await)
        };
        Slot {
            guard,
            entry: entry_ref,
        }
    }
}

/// A held slot: the whole key, or a share of it.
#[derive(Debug)]
enum Guard {
    Write(OwnedRwLockWriteGuard<Parked>),
    Read(#[allow(dead_code)] OwnedRwLockReadGuard<Parked>),
}

impl Guard {
    fn try_take(entry: &Entry, shared: bool) -> Option<Guard> {
        if shared {
            Arc::clone(entry).try_read_owned().ok().map(Guard::Read)
        } else {
            Arc::clone(entry).try_write_owned().ok().map(Guard::Write)
        }
    }
}

/// Ownership of one key's slot. Dropping it wakes the next local waiter, then forgets the key
/// if nobody else is holding or waiting for it.
#[derive(Debug)]
pub(crate) struct Slot {
    // Field order matters: the lock guard is dropped (waking the next waiter) before the
    // entry reference checks whether the entry can go.
    guard: Guard,
    entry: EntryRef,
}

impl Slot {
    pub(crate) fn key(&self) -> &Arc<str> {
        &self.entry.key
    }

    /// The table the slot is in, as an address: providers that share a table are one holder.
    pub(crate) fn table_id(&self) -> usize {
        Arc::as_ptr(&self.entry.table) as usize
    }

    /// Whether this is a share of the key (a read lock's slot).
    pub(crate) fn is_shared(&self) -> bool {
        matches!(self.guard, Guard::Read(_))
    }

    /// Takes the watch on the key's releases that the previous local holder left (see
    /// [`Slot::leave_watch`]). Always `None` for a share of the key.
    pub(crate) fn take_watch(&mut self) -> Option<Box<dyn ReleaseWatch>> {
        match &mut self.guard {
            Guard::Write(parked) => parked
                .get_mut()
                .unwrap_or_else(PoisonError::into_inner)
                .take(),
            Guard::Read(_) => None,
        }
    }

    /// Leaves `watch` in the slot for the next local holder when another local waiter is
    /// queued for the key (or about to be); drops it otherwise, and for a share of the key. A
    /// watch nobody takes ends with the entry.
    pub(crate) fn leave_watch(&mut self, watch: Box<dyn ReleaseWatch>) {
        if let Guard::Write(parked) = &mut self.guard {
            // The map's reference and this guard's; each queued waiter (and a contender that
            // is looking) holds one more, taken under the map lock.
            if Arc::strong_count(OwnedRwLockWriteGuard::rwlock(parked)) > 2 {
                *parked.get_mut().unwrap_or_else(PoisonError::into_inner) = Some(watch);
            }
        }
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
        let gone = if map
            .get(&*self.key)
            .is_some_and(|entry| Arc::strong_count(entry) == 1)
        {
            map.remove(&*self.key)
        } else {
            None
        };
        drop(map);
        // A watch left in it ends here, outside the map's lock.
        drop(gone);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn contention_and_cleanup() {
        let table = Arc::new(LocalTable::default());
        let slot = table.try_slot("a", false).unwrap();
        assert_eq!(&**slot.key(), "a");
        let err = table.try_slot("a", false).unwrap_err();
        assert!(Arc::ptr_eq(&err, slot.key()));
        assert_eq!(table.len(), 1);
        drop(slot);
        assert_eq!(table.len(), 0);
    }

    #[tokio::test]
    async fn waiters_queue_and_canceled_waits_clean_up() {
        let table = Arc::new(LocalTable::default());
        let slot = table.try_slot("k", false).unwrap();
        let waiter = {
            let table = Arc::clone(&table);
            tokio::spawn(async move {
                let s = table.wait_slot("k", false).await;
                drop(s);
            })
        };
        // A waiter that gives up must not leave anything behind.
        let canceled =
            tokio::time::timeout(Duration::from_millis(10), table.wait_slot("k", false)).await;
        assert!(canceled.is_err());
        drop(slot);
        waiter.await.unwrap();
        assert_eq!(table.len(), 0);

        let gone = tokio::time::timeout(Duration::from_millis(1), async {
            let held = table.try_slot("x", false).unwrap();
            let _never = table.wait_slot("x", false).await;
            drop(held);
        })
        .await;
        assert!(gone.is_err());
        assert_eq!(table.len(), 0);
    }

    #[tokio::test]
    async fn readers_share_and_a_waiting_writer_holds_back_later_readers() {
        let table = Arc::new(LocalTable::default());
        let first = table.try_slot("r", true).unwrap();
        let second = table.try_slot("r", true).unwrap();
        assert!(table.try_slot("r", false).is_err());
        let writer = {
            let table = Arc::clone(&table);
            tokio::spawn(async move { table.wait_slot("r", false).await })
        };
        // Once the writer has queued, a new reader no longer gets in.
        crate::testing::spin_until("the writer has queued", || {
            table.try_slot("r", true).is_err()
        })
        .await;
        drop(first);
        assert!(!writer.is_finished());
        drop(second);
        let written = writer.await.unwrap();
        assert!(table.try_slot("r", true).is_err());
        drop(written);
        let reader = table.try_slot("r", true).unwrap();
        drop(reader);
        assert_eq!(table.len(), 0);
    }
}
