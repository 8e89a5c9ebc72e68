//! The SQL of the SQLite backend: constants only, parameters bound by the callers.

pub(super) const SCHEMA: &str = "CREATE TABLE IF NOT EXISTS __distributed_locks (\
    name BLOB NOT NULL PRIMARY KEY, \
    owner BLOB, \
    lease_end INTEGER NOT NULL DEFAULT 0, \
    fencing INTEGER NOT NULL DEFAULT 0, \
    boot BLOB, \
    taken_by BLOB, \
    taken_at INTEGER\
) WITHOUT ROWID; \
CREATE TABLE IF NOT EXISTS __distributed_lock_readers (\
    name BLOB NOT NULL, \
    owner BLOB NOT NULL, \
    lease_end INTEGER NOT NULL, \
    boot BLOB, \
    PRIMARY KEY (name, owner)\
) WITHOUT ROWID; \
CREATE TABLE IF NOT EXISTS __distributed_lock_intents (\
    name BLOB NOT NULL PRIMARY KEY, \
    until INTEGER NOT NULL, \
    boot BLOB\
) WITHOUT ROWID; \
CREATE TABLE IF NOT EXISTS __distributed_lock_waiters (\
    name BLOB NOT NULL, \
    owner BLOB NOT NULL, \
    since INTEGER NOT NULL, \
    until INTEGER NOT NULL, \
    boot BLOB, \
    PRIMARY KEY (name, owner)\
) WITHOUT ROWID; \
CREATE TABLE IF NOT EXISTS __distributed_lock_counters (\
    id INTEGER PRIMARY KEY, \
    counter INTEGER NOT NULL\
); \
CREATE TABLE IF NOT EXISTS __distributed_lock_semaphores (\
    name BLOB NOT NULL PRIMARY KEY, \
    max_count INTEGER NOT NULL, \
    fencing INTEGER NOT NULL DEFAULT 0, \
    mark_until INTEGER NOT NULL DEFAULT 0, \
    boot BLOB\
) WITHOUT ROWID; \
CREATE TABLE IF NOT EXISTS __distributed_lock_permits (\
    name BLOB NOT NULL, \
    owner BLOB NOT NULL, \
    lease_end INTEGER NOT NULL, \
    boot BLOB, \
    PRIMARY KEY (name, owner)\
) WITHOUT ROWID";

/// Counts the column of the earlier, wall-clock table (1 when the table must be converted).
pub(super) const LEGACY_SQL: &str =
    "SELECT count(*) FROM pragma_table_info('__distributed_locks') WHERE name = 'expires_at'";

/// Counts the acquisition-time column (0 when a table of an earlier version lacks it).
pub(super) const TAKEN_AT_SQL: &str =
    "SELECT count(*) FROM pragma_table_info('__distributed_locks') WHERE name = 'taken_at'";

/// Adds the columns that record when a lock was taken, and by which owner token: an
/// acquisition sets both, so a row taken over by an earlier version (which sets neither) shows
/// no time rather than its previous holder's.
pub(super) const ADD_TAKEN_AT_SQL: &str = "ALTER TABLE __distributed_locks ADD COLUMN taken_by BLOB; \
    ALTER TABLE __distributed_locks ADD COLUMN taken_at INTEGER";

/// Converts the earlier table: the lease column gets its new name (so statements of earlier
/// versions fail instead of misreading it) and the boot column is added.
pub(super) const MIGRATE_SQL: &str = "ALTER TABLE __distributed_locks RENAME COLUMN expires_at TO lease_end; \
    ALTER TABLE __distributed_locks ADD COLUMN boot BLOB";

/// Moves held rows' lease ends from the wall clock to the lease clock, keeping what was left of
/// each lease (at most `?4` ms): `?1` wall-clock now, `?2` lease-clock now, `?3` boot.
pub(super) const MIGRATE_ROWS_SQL: &str = "UPDATE __distributed_locks SET boot = ?3, lease_end = \
    CASE WHEN owner IS NULL THEN 0 ELSE ?2 + max(0, min(lease_end - ?1, ?4)) END";

/// The table of the `-fencing` file: the highest token issued to a transaction-bound lock.
pub(super) const FENCING_SCHEMA: &str = "CREATE TABLE IF NOT EXISTS __distributed_lock_fencing (\
    name BLOB NOT NULL PRIMARY KEY, \
    fencing INTEGER NOT NULL\
) WITHOUT ROWID";

/// Makes the `-fencing` file (`?1`) readable by the acquisition statement.
pub(super) const ATTACH_FENCING_SQL: &str = "ATTACH DATABASE ?1 AS dlock_fencing";

/// Issues a token in the `-fencing` file, above both its record and `?2` (the lock table's
/// counter): `?1` name. Returns the token.
pub(super) const ISSUE_SQL: &str = "INSERT INTO __distributed_lock_fencing (name, fencing) VALUES (?1, ?2 + 1) \
    ON CONFLICT (name) DO UPDATE SET fencing = max(__distributed_lock_fencing.fencing, ?2) + 1 \
    RETURNING fencing";

/// Whether row `?1` is held by a live lease: `?2` now on the lease clock, `?3` boot.
pub(super) const PEEK_SQL: &str = "SELECT 1 FROM main.__distributed_locks \
    WHERE name = ?1 AND owner IS NOT NULL AND boot = ?3 AND lease_end > ?2";

/// The statement of an acquisition: takes a free or expired row (expired: its lease ended,
/// or it was written during another boot). Parameters: `?1` name (the key's bytes), `?2`
/// owner token, `?3` new lease end and `?4` now (lease clock), `?5` boot, `?6` now on the
/// wall clock (Unix milliseconds, recorded with the owner token as the acquisition time). Returns the new
/// fencing token, or no row when the lock is held. For a file whose `-fencing` file does not
/// exist (no transaction-bound lock ever issued a token on it).
pub(super) const ACQUIRE_SQL: &str = "INSERT INTO main.__distributed_locks (name, owner, lease_end, fencing, boot, taken_by, taken_at) \
    VALUES (?1, ?2, ?3, 1, ?5, ?2, ?6) \
    ON CONFLICT (name) DO UPDATE SET owner = excluded.owner, lease_end = excluded.lease_end, \
    boot = excluded.boot, fencing = __distributed_locks.fencing + 1, \
    taken_by = excluded.taken_by, taken_at = excluded.taken_at \
    WHERE __distributed_locks.owner IS NULL OR __distributed_locks.boot IS NOT excluded.boot \
    OR __distributed_locks.lease_end <= ?4 \
    RETURNING fencing";

/// [`ACQUIRE_SQL`] with the `-fencing` file attached: the token is above both the row's
/// counter and the `-fencing` file's record.
pub(super) const ACQUIRE_FENCED_SQL: &str = "INSERT INTO main.__distributed_locks (name, owner, lease_end, fencing, boot, taken_by, taken_at) \
    VALUES (?1, ?2, ?3, 1 + coalesce((SELECT fencing FROM dlock_fencing.__distributed_lock_fencing \
    WHERE name = ?1), 0), ?5, ?2, ?6) \
    ON CONFLICT (name) DO UPDATE SET owner = excluded.owner, lease_end = excluded.lease_end, \
    boot = excluded.boot, fencing = max(__distributed_locks.fencing + 1, excluded.fencing), \
    taken_by = excluded.taken_by, taken_at = excluded.taken_at \
    WHERE __distributed_locks.owner IS NULL OR __distributed_locks.boot IS NOT excluded.boot \
    OR __distributed_locks.lease_end <= ?4 \
    RETURNING fencing";

/// Raises the token of row `?1`, just taken by owner `?2` with [`ACQUIRE_SQL`], above the
/// `-fencing` file's record (found to exist only after the row was taken). Returns the token.
pub(super) const RAISE_TOKEN_SQL: &str = "UPDATE main.__distributed_locks SET fencing = max(fencing, 1 + \
    coalesce((SELECT fencing FROM dlock_fencing.__distributed_lock_fencing WHERE name = ?1), 0)) \
    WHERE name = ?1 AND owner = ?2 \
    RETURNING fencing";

/// The statement of a release: frees row `?1` if owner `?2` still holds it.
pub(super) const RELEASE_SQL: &str = "UPDATE main.__distributed_locks SET owner = NULL, lease_end = 0 \
    WHERE name = ?1 AND owner = ?2";

/// Extends the lease to `?3` if `?2` still owns the row.
pub(super) const RENEW_SQL: &str =
    "UPDATE main.__distributed_locks SET lease_end = ?3 WHERE name = ?1 AND owner = ?2";

/// A transaction-bound lock takes a free row inside the caller's transaction (which gives it
/// the file's write lock until the transaction ends): `?1` name, `?2` now, `?3` boot. Returns
/// the row's counter.
pub(super) const TRANSACTION_CLAIM_SQL: &str = "INSERT INTO main.__distributed_locks \
    (name, owner, lease_end, fencing, boot) VALUES (?1, NULL, 0, 0, NULL) \
    ON CONFLICT (name) DO UPDATE SET fencing = __distributed_locks.fencing \
    WHERE __distributed_locks.owner IS NULL OR __distributed_locks.boot IS NOT ?3 \
    OR __distributed_locks.lease_end <= ?2 \
    RETURNING fencing";

/// Stores token `?2` in row `?1` inside the caller's transaction (when it commits, the lock
/// table alone knows the token too).
pub(super) const TRANSACTION_RECORD_SQL: &str =
    "UPDATE main.__distributed_locks SET fencing = ?2 WHERE name = ?1";

/// Writes the write-ahead log into the database without holding writers back.
pub(super) const CHECKPOINT_PASSIVE_SQL: &str = "PRAGMA wal_checkpoint(PASSIVE)";

/// Writes the rest of the log into the database and lets the log start over, waiting for
/// readers (for at most the checkpoint connection's busy timeout) and holding writers back
/// meanwhile.
pub(super) const CHECKPOINT_RESTART_SQL: &str = "PRAGMA wal_checkpoint(RESTART)";

/// A health check: one read of the lock table (no row matches the empty name).
pub(super) const PING_SQL: &str = "SELECT count(*) FROM main.__distributed_locks WHERE name = x''";

/// Whether owner `?2` holds row `?1` under a live lease: `?3` now on the lease clock, `?4`
/// boot.
pub(super) const VERIFY_SQL: &str = "SELECT count(*) FROM main.__distributed_locks \
    WHERE name = ?1 AND owner = ?2 AND boot = ?4 AND lease_end > ?3";

// Read locks. While readers hold a key, its row in the lock table is held by the empty owner
// `x''` (which no acquisition's 128-bit token can equal) until the latest of their lease ends:
// every exclusive acquisition, of this version or an earlier one, finds it held. Each reader
// has a row of its own in `__distributed_lock_readers`, and every statement that changes a
// reader's row also sets the lock row from the readers' rows (`READERS_SYNC_SQL`), in one
// transaction.

/// A reader's share of row `?1`: taken when the row is free, expired or held by readers, and
/// no writer waits for it. `?2` the reader's lease end, `?3` now (lease clock), `?4` boot.
/// The row's lease end becomes the later of its readers' (an expired row's is replaced).
/// Returns the new fencing token (the row's counter, shared with exclusive locks), or no row
/// when a writer holds the key or waits for it.
pub(super) const READ_ACQUIRE_SQL: &str = "INSERT INTO main.__distributed_locks (name, owner, lease_end, fencing, boot) \
    VALUES (?1, x'', ?2, 1, ?4) \
    ON CONFLICT (name) DO UPDATE SET owner = x'', \
    lease_end = CASE WHEN __distributed_locks.owner = x'' AND __distributed_locks.boot IS excluded.boot \
    AND __distributed_locks.lease_end > ?3 \
    THEN max(__distributed_locks.lease_end, excluded.lease_end) ELSE excluded.lease_end END, \
    boot = excluded.boot, fencing = __distributed_locks.fencing + 1 \
    WHERE (__distributed_locks.owner IS NULL OR __distributed_locks.owner = x'' \
    OR __distributed_locks.boot IS NOT excluded.boot OR __distributed_locks.lease_end <= ?3) \
    AND NOT EXISTS (SELECT 1 FROM main.__distributed_lock_intents \
    WHERE name = ?1 AND boot IS ?4 AND until > ?3) \
    RETURNING fencing";

/// [`READ_ACQUIRE_SQL`] with the `-fencing` file attached (see [`ACQUIRE_FENCED_SQL`]).
pub(super) const READ_ACQUIRE_FENCED_SQL: &str = "INSERT INTO main.__distributed_locks (name, owner, lease_end, fencing, boot) \
    VALUES (?1, x'', ?2, 1 + coalesce((SELECT fencing FROM dlock_fencing.__distributed_lock_fencing \
    WHERE name = ?1), 0), ?4) \
    ON CONFLICT (name) DO UPDATE SET owner = x'', \
    lease_end = CASE WHEN __distributed_locks.owner = x'' AND __distributed_locks.boot IS excluded.boot \
    AND __distributed_locks.lease_end > ?3 \
    THEN max(__distributed_locks.lease_end, excluded.lease_end) ELSE excluded.lease_end END, \
    boot = excluded.boot, fencing = max(__distributed_locks.fencing + 1, excluded.fencing) \
    WHERE (__distributed_locks.owner IS NULL OR __distributed_locks.owner = x'' \
    OR __distributed_locks.boot IS NOT excluded.boot OR __distributed_locks.lease_end <= ?3) \
    AND NOT EXISTS (SELECT 1 FROM main.__distributed_lock_intents \
    WHERE name = ?1 AND boot IS ?4 AND until > ?3) \
    RETURNING fencing";

/// Removes the expired readers of `?1` (`?2` now, `?3` boot), in the transaction of a read
/// acquisition.
pub(super) const READERS_CLEAN_SQL: &str = "DELETE FROM main.__distributed_lock_readers \
    WHERE name = ?1 AND (boot IS NOT ?3 OR lease_end <= ?2)";

/// Records reader `?2` of `?1` until `?3` (boot `?4`).
pub(super) const READER_INSERT_SQL: &str = "INSERT INTO main.__distributed_lock_readers \
    (name, owner, lease_end, boot) VALUES (?1, ?2, ?3, ?4)";

/// Sets the lease end of reader `?2` of `?1` to `?3` if its lease is live (`?4` now, `?5`
/// boot): an expired reader may have let a writer in, so it is never revived.
pub(super) const READER_RENEW_SQL: &str = "UPDATE main.__distributed_lock_readers SET lease_end = ?3 \
    WHERE name = ?1 AND owner = ?2 AND boot IS ?5 AND lease_end > ?4";

/// Sets the lock row of `?1`, while readers hold it, from its live readers (`?2` now, `?3`
/// boot): the latest lease end, or free when none is left.
pub(super) const READERS_SYNC_SQL: &str = "UPDATE main.__distributed_locks SET \
    lease_end = coalesce((SELECT max(lease_end) FROM main.__distributed_lock_readers \
    WHERE name = ?1 AND boot IS ?3 AND lease_end > ?2), 0), \
    owner = CASE WHEN EXISTS (SELECT 1 FROM main.__distributed_lock_readers \
    WHERE name = ?1 AND boot IS ?3 AND lease_end > ?2) THEN x'' END \
    WHERE name = ?1 AND owner = x''";

/// Removes reader `?2` of `?1`; returns whether its lease was live (`?3` now, `?4` boot), or
/// no row when it was gone.
pub(super) const READER_RELEASE_SQL: &str = "DELETE FROM main.__distributed_lock_readers \
    WHERE name = ?1 AND owner = ?2 \
    RETURNING boot IS ?4 AND lease_end > ?3";

/// Whether reader `?2` of `?1` holds a live lease: `?3` now, `?4` boot.
pub(super) const READER_VERIFY_SQL: &str = "SELECT count(*) FROM main.__distributed_lock_readers \
    WHERE name = ?1 AND owner = ?2 AND boot = ?4 AND lease_end > ?3";

/// Whether a writer holds `?1` under a live lease: `?2` now, `?3` boot.
pub(super) const WRITER_PEEK_SQL: &str = "SELECT 1 FROM main.__distributed_locks \
    WHERE name = ?1 AND owner IS NOT NULL AND owner <> x'' AND boot = ?3 AND lease_end > ?2";

/// Whether a reader could not take `?1` now: a writer holds it, or one waits for it (`?2`
/// now, `?3` boot).
pub(super) const READ_BLOCKED_SQL: &str = "SELECT 1 FROM main.__distributed_locks \
    WHERE name = ?1 AND owner IS NOT NULL AND owner <> x'' AND boot = ?3 AND lease_end > ?2 \
    UNION ALL SELECT 1 FROM main.__distributed_lock_intents \
    WHERE name = ?1 AND boot IS ?3 AND until > ?2";

/// Whether readers hold `?1`: `?2` now, `?3` boot.
pub(super) const READERS_HOLD_SQL: &str = "SELECT 1 FROM main.__distributed_locks \
    WHERE name = ?1 AND owner = x'' AND boot = ?3 AND lease_end > ?2";

/// A waiting writer's intent on `?1`, until `?2` (boot `?3`): readers that come later wait.
/// Kept at the later of the intents of several waiting writers.
pub(super) const INTENT_SQL: &str = "INSERT INTO main.__distributed_lock_intents (name, until, boot) \
    VALUES (?1, ?2, ?3) \
    ON CONFLICT (name) DO UPDATE SET until = CASE WHEN __distributed_lock_intents.boot IS excluded.boot \
    THEN max(__distributed_lock_intents.until, excluded.until) ELSE excluded.until END, \
    boot = excluded.boot";

/// Removes the intent on `?1`, once a writer got the key.
pub(super) const INTENT_CLEAR_SQL: &str =
    "DELETE FROM main.__distributed_lock_intents WHERE name = ?1";

// The waiters' queue (see `queue.rs`). A backend that waits for a key (a polled exclusive
// wait) has one row per key: `owner` the backend's waiter id, `since` when it joined the
// queue and `until` when its place lapses unless its next poll renews it (lease clock, boot).
// A wait takes the key only when no live waiter of another backend joined before it.

/// How many live waiters other than `?2` are ahead of `?2` in the queue of `?1` (`?3` now,
/// `?4` boot): those that joined before it, or every live one when `?2` has no live place.
pub(super) const QUEUE_AHEAD_SQL: &str = "SELECT count(*) FROM main.__distributed_lock_waiters \
    WHERE name = ?1 AND owner <> ?2 AND boot IS ?4 AND until > ?3 \
    AND (since, owner) < (SELECT coalesce(max(since), 9223372036854775807), ?2 \
    FROM main.__distributed_lock_waiters \
    WHERE name = ?1 AND owner = ?2 AND boot IS ?4 AND until > ?3)";

/// Puts waiter `?2` in the queue of `?1` until `?4` (`?3` now, `?5` boot), keeping its
/// place (when it joined) when it has a live one.
pub(super) const QUEUE_JOIN_SQL: &str = "INSERT INTO main.__distributed_lock_waiters \
    (name, owner, since, until, boot) VALUES (?1, ?2, ?3, ?4, ?5) \
    ON CONFLICT (name, owner) DO UPDATE SET \
    since = CASE WHEN __distributed_lock_waiters.boot IS excluded.boot \
    AND __distributed_lock_waiters.until > ?3 \
    THEN __distributed_lock_waiters.since ELSE excluded.since END, \
    until = excluded.until, boot = excluded.boot";

/// Takes waiter `?2` out of the queue of `?1`, with the places there that lapsed (`?3` now,
/// `?4` boot).
pub(super) const QUEUE_LEAVE_SQL: &str = "DELETE FROM main.__distributed_lock_waiters \
    WHERE name = ?1 AND (owner = ?2 OR boot IS NOT ?4 OR until <= ?3)";
