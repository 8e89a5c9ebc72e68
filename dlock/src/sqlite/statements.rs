//! The SQL of the SQLite backend: constants only, parameters bound by the callers.

pub(super) const SCHEMA: &str = "CREATE TABLE IF NOT EXISTS __distributed_locks (\
    name BLOB NOT NULL PRIMARY KEY, \
    owner BLOB, \
    lease_end INTEGER NOT NULL DEFAULT 0, \
    fencing INTEGER NOT NULL DEFAULT 0, \
    boot BLOB\
) WITHOUT ROWID";

/// Counts the column of the earlier, wall-clock table (1 when the table must be converted).
pub(super) const LEGACY_SQL: &str =
    "SELECT count(*) FROM pragma_table_info('__distributed_locks') WHERE name = 'expires_at'";

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
/// owner token, `?3` new lease end and `?4` now (lease clock), `?5` boot. Returns the new
/// fencing token, or no row when the lock is held. For a file whose `-fencing` file does not
/// exist (no transaction-bound lock ever issued a token on it).
pub(super) const ACQUIRE_SQL: &str = "INSERT INTO main.__distributed_locks (name, owner, lease_end, fencing, boot) \
    VALUES (?1, ?2, ?3, 1, ?5) \
    ON CONFLICT (name) DO UPDATE SET owner = excluded.owner, lease_end = excluded.lease_end, \
    boot = excluded.boot, fencing = __distributed_locks.fencing + 1 \
    WHERE __distributed_locks.owner IS NULL OR __distributed_locks.boot IS NOT excluded.boot \
    OR __distributed_locks.lease_end <= ?4 \
    RETURNING fencing";

/// [`ACQUIRE_SQL`] with the `-fencing` file attached: the token is above both the row's
/// counter and the `-fencing` file's record.
pub(super) const ACQUIRE_FENCED_SQL: &str = "INSERT INTO main.__distributed_locks (name, owner, lease_end, fencing, boot) \
    VALUES (?1, ?2, ?3, 1 + coalesce((SELECT fencing FROM dlock_fencing.__distributed_lock_fencing \
    WHERE name = ?1), 0), ?5) \
    ON CONFLICT (name) DO UPDATE SET owner = excluded.owner, lease_end = excluded.lease_end, \
    boot = excluded.boot, fencing = max(__distributed_locks.fencing + 1, excluded.fencing) \
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
