//! Owner labels (see [`ProviderBuilder::owner_label`](crate::ProviderBuilder::owner_label)):
//! who holds a lock, for store inspection, at no cost to an acquisition.
//!
//! Each backend has a random 8-byte id, and every owner token it makes (a lock's or a
//! reader's) starts with it; the rest of the token stays random. The backend's label is a row
//! of `__distributed_lock_owners (id, label, written)`, written by the backend's first
//! acquisition and then by the first one 12 hours after the last write (see
//! `crate::owner`); writing it also deletes the rows not written for a day of backends that
//! hold nothing now. Store inspection joins each lock row to its owner's label.

use super::*;

/// The owners' labels, by backend id.
pub(super) const OWNERS_SCHEMA: &str = "CREATE TABLE IF NOT EXISTS __distributed_lock_owners (\
    id BLOB NOT NULL PRIMARY KEY, \
    label TEXT NOT NULL, \
    written INTEGER NOT NULL\
) WITHOUT ROWID";

/// Records label `?2` for backend `?1`, written at `?3` (Unix milliseconds).
pub(super) const OWNER_WRITE_SQL: &str = "INSERT INTO main.__distributed_lock_owners (id, label, written) \
    VALUES (?1, ?2, ?3) ON CONFLICT (id) DO UPDATE SET label = excluded.label, written = excluded.written";

/// Deletes the labels written before `?2` (Unix milliseconds) of backends other than `?1` that
/// hold no lock or share now.
pub(super) const OWNERS_PRUNE_SQL: &str = "DELETE FROM main.__distributed_lock_owners \
    WHERE id <> ?1 AND written < ?2 \
    AND id NOT IN (SELECT substr(owner, 1, 8) FROM main.__distributed_locks WHERE length(owner) = 16) \
    AND id NOT IN (SELECT substr(owner, 1, 8) FROM main.__distributed_lock_readers)";

/// The rows held now (`?1` now, `?2` boot), for store inspection: name, whether readers hold it
/// (the empty owner), lease end, fencing counter, the holder's label, and when the holder took
/// it (wall clock, Unix milliseconds; NULL when the row's time is not the holder's: taken by an
/// earlier version, or held by readers).
pub(super) const STORE_LOCKS_SQL: &str = "SELECT l.name, l.owner = x'', l.lease_end, l.fencing, o.label, \
    CASE WHEN l.taken_by = l.owner THEN l.taken_at END \
    FROM main.__distributed_locks l LEFT JOIN main.__distributed_lock_owners o \
    ON length(l.owner) = 16 AND o.id = substr(l.owner, 1, 8) \
    WHERE l.owner IS NOT NULL AND l.boot = ?2 AND l.lease_end > ?1";

/// The live readers of each name (`?1` now, `?2` boot), for store inspection, with their
/// labels (comma-separated).
pub(super) const STORE_READERS_SQL: &str = "SELECT r.name, count(*), group_concat(DISTINCT o.label) \
    FROM main.__distributed_lock_readers r LEFT JOIN main.__distributed_lock_owners o \
    ON o.id = substr(r.owner, 1, 8) \
    WHERE r.boot = ?2 AND r.lease_end > ?1 GROUP BY r.name";

/// A backend's id and owner label.
pub(super) struct OwnerLabel {
    /// The backend's id: the first 8 bytes of its owner tokens.
    pub(super) id: [u8; 8],
    label: crate::owner::OwnerLabel,
}

impl OwnerLabel {
    pub(super) fn new() -> Result<OwnerLabel, LockError> {
        let mut id = [0; 8];
        random_fill(&mut id)?;
        Ok(OwnerLabel {
            id,
            label: crate::owner::OwnerLabel::new(),
        })
    }

    pub(super) fn set(&self, label: &str) {
        self.label.set(label);
    }
}

impl Shared {
    /// Writes the backend's label when it is due (see `crate::owner`), after an acquisition
    /// whose statement began at `started`. Best effort: a failure only leaves its locks
    /// without an owner until the next acquisition tries again, and is logged.
    pub(super) async fn write_owner_label(&self, started: Instant) {
        let Some(label) = self.owner_label.label.take_due(started) else {
            return;
        };
        let id = &self.owner_label.id[..];
        let wall =
            |at: std::time::SystemTime| at.duration_since(std::time::UNIX_EPOCH).map_or(0, millis);
        let now = std::time::SystemTime::now();
        let stale = wall(now).saturating_sub(millis(crate::owner::LABEL_TTL));
        let written = self
            .with_busy_retry("recording the owner label", RELEASE_PAUSES, |conn| {
                let tx = Transaction::new_unchecked(conn, TransactionBehavior::Immediate)?;
                tx.prepare_cached(OWNERS_PRUNE_SQL)?
                    .execute(params![id, stale])?;
                tx.prepare_cached(OWNER_WRITE_SQL)?
                    .execute(params![id, &*label, wall(now)])?;
                tx.commit()
            })
            .await;
        match written {
            Ok(()) => self.count_commit(),
            Err(busy) => {
                self.owner_label.label.failed();
                let err = self.busy_error("recording the owner label", busy);
                tracing::warn!(error = %err, "the owner label could not be recorded; the backend's locks show no owner for now");
            }
        }
    }
}
