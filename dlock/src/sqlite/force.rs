//! Force release: ending one lock whoever holds it (see
//! [`LockProvider::force_release`](crate::LockProvider::force_release)).

use super::*;
use crate::backend::ForceRelease;

/// Whether `?1` is held now, by a writer or by readers (`?2` now, `?3` boot): the number of
/// live holders.
pub(super) const FORCE_LIVE_SQL: &str = "SELECT \
    (SELECT count(*) FROM main.__distributed_locks \
    WHERE name = ?1 AND owner IS NOT NULL AND owner <> x'' AND boot = ?3 AND lease_end > ?2) + \
    (SELECT count(*) FROM main.__distributed_lock_readers \
    WHERE name = ?1 AND boot = ?3 AND lease_end > ?2)";

/// Ends the readers' shares of `?1`: their renewals then find them gone.
pub(super) const FORCE_READERS_SQL: &str =
    "DELETE FROM main.__distributed_lock_readers WHERE name = ?1";

/// Frees the row of `?1`, keeping its fencing counter (a deleted row would start it over):
/// the holder's renewal then finds it free.
pub(super) const FORCE_FREE_SQL: &str = "UPDATE main.__distributed_locks \
    SET owner = NULL, lease_end = 0 WHERE name = ?1 AND owner IS NOT NULL";

/// With shared counters (`fencing_counters`) a row keeps no counter, and a released row is
/// deleted, as here.
pub(super) const FORCE_DELETE_SQL: &str =
    "DELETE FROM main.__distributed_locks WHERE name = ?1 AND owner IS NOT NULL";

impl ForceRelease for SqliteBackend {
    /// One write transaction: the readers' rows go, the lock row is freed (its counter kept).
    fn force_release<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<bool, LockError>> {
        Box::pin(async move {
            let shared = &self.shared;
            let clock = shared.clock;
            let name = key.as_bytes();
            let counted = shared.counted.is_some();
            let ended = shared
                .with_busy_retry("ending a lock by force", RELEASE_PAUSES, |conn| {
                    let (now, boot) = (clock.now_ms(), clock.boot());
                    let tx = Transaction::new_unchecked(conn, TransactionBehavior::Immediate)?;
                    let live: i64 = tx
                        .prepare_cached(FORCE_LIVE_SQL)?
                        .query_row(params![name, now, boot], |row| row.get(0))?;
                    tx.prepare_cached(FORCE_READERS_SQL)?
                        .execute(params![name])?;
                    if counted {
                        tx.prepare_cached(FORCE_DELETE_SQL)?
                            .execute(params![name])?;
                    } else {
                        tx.prepare_cached(FORCE_FREE_SQL)?.execute(params![name])?;
                    }
                    tx.commit()?;
                    Ok(live > 0)
                })
                .await
                .map_err(|busy| shared.busy_error("ending a lock by force", busy))?;
            shared.count_commit();
            Ok(ended)
        })
    }
}
