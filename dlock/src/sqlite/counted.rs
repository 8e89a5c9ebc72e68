//! Shared fencing counters on SQLite (`fencing_counters=N`, see
//! [`fencing_counter`](crate::fencing_counter)): counter `i` is the row `i` of
//! `__distributed_lock_counters`, the file's mode the row [`MODE_ID`] (`N << 16 | epoch`). A
//! token is `epoch << 48 | count`; the increment, in the acquisition's transaction, is
//! refused (no row returned) when the counter's row is in another epoch (the file was
//! switched away from this backend's `N`) or its count would overflow.

use rusqlite::{Connection, OptionalExtension, TransactionBehavior, params};

use super::file::returning_one;
use super::statements::{ACQUIRE_SQL, TRANSACTION_RECORD_SQL};
use super::{NAME, sqlite_error};
use crate::LockError;
use crate::counters::{EPOCH_SHIFT, MAX_COUNT, MAX_EPOCH, switched_away, token};

/// The row of the file's shared counters' mode.
pub(super) const MODE_ID: i64 = -1;

/// `?1` counter row, `?2` the epoch's base (`epoch << 48`), `?3` the largest count. Increments
/// the counter in this epoch only; returns the token, or no row when refused.
pub(super) const COUNT_SQL: &str = "INSERT INTO main.__distributed_lock_counters (id, counter) \
    VALUES (?1, ?2 + 1) \
    ON CONFLICT (id) DO UPDATE SET counter = __distributed_lock_counters.counter + 1 \
    WHERE __distributed_lock_counters.counter >= ?2 \
    AND __distributed_lock_counters.counter < ?2 + ?3 \
    RETURNING counter";

/// `?1` [`MODE_ID`]: the file's mode, if it has one.
pub(super) const MODE_SQL: &str =
    "SELECT counter FROM main.__distributed_lock_counters WHERE id = ?1";

/// `?1` the number of counter rows to look at: the highest epoch in counter rows `0..?1`.
const MAX_EPOCH_SQL: &str = "SELECT coalesce(max(counter >> 48), 0) \
    FROM main.__distributed_lock_counters WHERE id >= 0 AND id < ?1";

/// `?1` the number of counter rows, `?2` the new epoch's base: counter rows `0..?1` start the
/// new epoch (those a backend of the old mode may touch included, so that it is refused).
const SWITCH_SQL: &str = "WITH RECURSIVE g(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM g \
    WHERE i + 1 < ?1) \
    INSERT INTO main.__distributed_lock_counters (id, counter) SELECT i, ?2 FROM g WHERE true \
    ON CONFLICT (id) DO UPDATE SET counter = excluded.counter";

/// `?1` [`MODE_ID`], `?2` the new mode.
const MODE_SET_SQL: &str = "INSERT INTO main.__distributed_lock_counters (id, counter) \
    VALUES (?1, ?2) ON CONFLICT (id) DO UPDATE SET counter = excluded.counter";

/// `?1` name. After a release under shared counters: drops the key's row once it is free, so
/// that the table holds the keys held now only.
pub(super) const DROP_FREE_ROW_SQL: &str =
    "DELETE FROM main.__distributed_locks WHERE name = ?1 AND owner IS NULL";

/// The release of [`super::statements::RELEASE_SQL`] under shared counters: deletes row `?1`
/// if owner `?2` still holds it.
pub(super) const RELEASE_DELETE_SQL: &str =
    "DELETE FROM main.__distributed_locks WHERE name = ?1 AND owner = ?2";

/// Shared counters a backend joined: how many, and the epoch's base (`epoch << 48`).
#[derive(Debug, Clone, Copy)]
pub(super) struct Counted {
    pub(super) n: u32,
    pub(super) base: i64,
}

impl Counted {
    /// The counter row of the key `name` (its [`crate::fencing_counter`]).
    pub(super) fn row(self, name: &[u8]) -> i64 {
        let key = std::str::from_utf8(name).unwrap_or_default();
        i64::from(crate::fencing_counter(key, self.n))
    }

    /// Increments the key's counter in the caller's transaction: the token, or `None` when
    /// refused.
    pub(super) fn count(self, conn: &Connection, name: &[u8]) -> rusqlite::Result<Option<i64>> {
        let max = i64::try_from(MAX_COUNT).unwrap_or(i64::MAX);
        match returning_one(
            &mut conn.prepare_cached(COUNT_SQL)?,
            params![self.row(name), self.base, max],
        )? {
            Some(token) => token.map(Some),
            None => Ok(None),
        }
    }

    /// Why an increment was refused: the file was switched to another mode (or, in theory,
    /// the counter ran out of counts in this epoch).
    pub(super) fn refusal(self, conn: &Connection) -> LockError {
        let epoch = (self.base >> EPOCH_SHIFT).unsigned_abs();
        let mode: Option<i64> = conn
            .query_row(MODE_SQL, params![MODE_ID], |row| row.get(0))
            .optional()
            .ok()
            .flatten();
        match mode {
            Some(mode) if mode != mode_value(self.n, epoch) => {
                switched_away(NAME, self.n, epoch, &describe_mode(mode))
            }
            _ => token(epoch, MAX_COUNT + 1).err().unwrap_or_else(|| {
                LockError::config("fencing_counters: the counter refused the increment")
            }),
        }
    }
}

/// What an acquisition under shared counters found.
pub(super) enum CountedTake {
    /// The row is ours, with this token.
    Taken(i64),
    /// Someone else holds the lock.
    Held,
    /// The counter refused the increment (see [`Counted::refusal`]); nothing was written.
    Refused,
}

impl Counted {
    /// An exclusive acquisition under shared counters, in one write transaction: the row (as
    /// [`ACQUIRE_SQL`]), then the counter's increment, whose token the row records.
    pub(super) fn acquire(
        self,
        conn: &Connection,
        name: &[u8],
        owner: &[u8; 16],
        end: i64,
        now: i64,
        boot: &[u8],
    ) -> rusqlite::Result<CountedTake> {
        let tx = rusqlite::Transaction::new_unchecked(conn, TransactionBehavior::Immediate)?;
        let taken = returning_one(
            &mut tx.prepare_cached(ACQUIRE_SQL)?,
            params![name, &owner[..], end, now, boot, super::file::wall_now_ms()],
        )?;
        // Dropping the transaction rolls it back.
        match taken {
            None => return Ok(CountedTake::Held),
            Some(taken) => drop(taken?),
        }
        let Some(token) = self.count(&tx, name)? else {
            return Ok(CountedTake::Refused);
        };
        tx.prepare_cached(TRANSACTION_RECORD_SQL)?
            .execute(params![name, token])?;
        tx.commit()?;
        Ok(CountedTake::Taken(token))
    }
}

/// The mode row's value of `n` counters in `epoch`.
fn mode_value(n: u32, epoch: u64) -> i64 {
    (i64::from(n) << 16) | i64::try_from(epoch).unwrap_or(0)
}

/// A mode row's value, for messages.
pub(super) fn describe_mode(mode: i64) -> String {
    if mode <= 0 {
        "no record: per-key counters".to_owned()
    } else {
        format!("fencing_counters={}, epoch {}", mode >> 16, mode & 0xffff)
    }
}

/// The file's mode (`N << 16 | epoch`), if it was ever switched to shared counters.
pub(super) fn mode(conn: &Connection) -> rusqlite::Result<Option<i64>> {
    conn.query_row(MODE_SQL, params![MODE_ID], |row| row.get(0))
        .optional()
        .map(|mode| mode.filter(|m| *m > 0))
}

/// Joins the file's shared counters with `n` counters, or switches the file to them, in one
/// write transaction. Returns the epoch's base.
pub(super) fn join(conn: &Connection, n: u32) -> rusqlite::Result<Result<i64, LockError>> {
    let tx = rusqlite::Transaction::new_unchecked(conn, TransactionBehavior::Immediate)?;
    let (store_n, store_epoch) = match mode(&tx)? {
        Some(mode) => (mode >> 16, mode & 0xffff),
        None => (0, 0),
    };
    if store_n == i64::from(n) && store_epoch > 0 {
        tx.commit()?;
        return Ok(Ok(store_epoch << EPOCH_SHIFT));
    }
    let rows = store_n.max(i64::from(n));
    let top: i64 = tx.query_row(MAX_EPOCH_SQL, params![rows], |row| row.get(0))?;
    let epoch = store_epoch.max(top) + 1;
    if epoch.unsigned_abs() > MAX_EPOCH {
        return Ok(Err(LockError::config(format!(
            "{NAME}: joining the file's fencing counters: no epoch is left for a switch"
        ))));
    }
    let base = epoch << EPOCH_SHIFT;
    tx.execute(SWITCH_SQL, params![rows, base])?;
    tx.execute(
        MODE_SET_SQL,
        params![MODE_ID, mode_value(n, epoch.unsigned_abs())],
    )?;
    tx.commit()?;
    tracing::info!(
        counters = n,
        epoch,
        "switched the lock file's fencing counters to fencing_counters"
    );
    Ok(Ok(base))
}

/// Joins with busy retries, as the file is opened.
pub(super) fn join_file(
    conn: &Connection,
    path: &std::path::Path,
    n: u32,
    busy_timeout: std::time::Duration,
) -> Result<Counted, LockError> {
    let base = super::file::retry_busy(busy_timeout, || join(conn, n))
        .map_err(|e| sqlite_error(path, "joining the file's fencing counters", e))??;
    Ok(Counted { n, base })
}

/// With per-key counters: refuses a file switched to shared ones.
pub(super) fn refuse_if_switched(
    conn: &Connection,
    path: &std::path::Path,
    busy_timeout: std::time::Duration,
) -> Result<(), LockError> {
    let found = super::file::retry_busy(busy_timeout, || mode(conn))
        .map_err(|e| sqlite_error(path, "looking for the file's fencing counters", e))?;
    match found {
        Some(mode) => Err(crate::counters::per_key_refused(NAME, &describe_mode(mode))),
        None => Ok(()),
    }
}
