//! The PostgreSQL backend's statements, as constants, and the values they are bound with.

use std::time::Duration;

use crate::session::Mode;

/// The backend's name.
pub(super) const NAME: &str = "postgres";

/// Session settings of lock and wait connections: no server-side timeouts that could cut a
/// wait short or drop an idle session that holds locks. Settings the server does not know
/// (older versions) are skipped.
pub(super) const SESSION_SQL: &str = "SELECT count(set_config(name, '0', false)) FROM pg_settings \
    WHERE name IN ('statement_timeout', 'idle_session_timeout', 'idle_in_transaction_session_timeout')";

/// `$1` lock id. Returns whether the lock was taken.
pub(super) const TRY_SQL: &str = "SELECT pg_try_advisory_lock($1)";

/// `$1` lock id. Takes the lock and, only if it was taken, increments its fencing counter in
/// the same statement.
pub(super) const TRY_FENCED_SQL: &str = "WITH l AS (SELECT pg_try_advisory_lock($1) AS got), \
    f AS (INSERT INTO dlock_fencing (id, token) SELECT $1, 1 FROM l WHERE l.got \
          ON CONFLICT (id) DO UPDATE SET token = dlock_fencing.token + 1 RETURNING token) \
    SELECT l.got, (SELECT token FROM f) FROM l";

/// `$1` lock id. Waits (under the session's `lock_timeout`).
pub(super) const WAIT_SQL: &str = "SELECT pg_advisory_lock($1)";

/// `$1` lock id. Waits, then increments the fencing counter in the same statement.
pub(super) const WAIT_FENCED_SQL: &str = "WITH l AS (SELECT pg_advisory_lock($1)) \
    INSERT INTO dlock_fencing (id, token) SELECT $1, 1 FROM l \
    ON CONFLICT (id) DO UPDATE SET token = dlock_fencing.token + 1 RETURNING token";

/// `$1` lock id. Increments the fencing counter of a lock this session already holds.
pub(super) const FENCE_SQL: &str = "INSERT INTO dlock_fencing (id, token) VALUES ($1, 1) \
    ON CONFLICT (id) DO UPDATE SET token = dlock_fencing.token + 1 RETURNING token";

pub(super) const UNLOCK_SQL: &str = "SELECT pg_advisory_unlock($1)";

// Shared counters (`fencing_counters`, see [`crate::fencing_counter`]): counter `i` is the
// `dlock_fencing` row `i`, the store's mode the row [`MODE_ID`] (`N << 16 | epoch`). A token
// is `epoch << 48 | count`; the increment is refused (no row returned) when the counter's
// row is in another epoch (the store was switched away from this backend's `N`) or its count
// would overflow. `ON CONFLICT DO UPDATE` reads the latest committed row, whatever the
// statement's snapshot, so a switch committed while a wait was blocked is seen.

/// The `dlock_fencing` row of the store's shared counters' mode: `N << 16 | epoch`.
pub(super) const MODE_ID: i64 = i64::MIN;

/// `$1` lock id, `$2` counter row, `$3` the epoch's base (`epoch << 48`). Takes the lock and,
/// only if it was taken, increments the shared counter, in this epoch only.
pub(super) const TRY_COUNTED_SQL: &str = "WITH l AS (SELECT pg_try_advisory_lock($1) AS got), \
    f AS (INSERT INTO dlock_fencing (id, token) SELECT $2, $3 + 1 FROM l WHERE l.got \
          ON CONFLICT (id) DO UPDATE SET token = dlock_fencing.token + 1 \
          WHERE dlock_fencing.token >= $3 AND dlock_fencing.token < $3 + 281474976710655 \
          RETURNING token) \
    SELECT l.got, (SELECT token FROM f) FROM l";

/// [`TRY_COUNTED_SQL`] for the shared lock.
pub(super) const TRY_SHARED_COUNTED_SQL: &str = "WITH l AS (SELECT pg_try_advisory_lock_shared($1) AS got), \
    f AS (INSERT INTO dlock_fencing (id, token) SELECT $2, $3 + 1 FROM l WHERE l.got \
          ON CONFLICT (id) DO UPDATE SET token = dlock_fencing.token + 1 \
          WHERE dlock_fencing.token >= $3 AND dlock_fencing.token < $3 + 281474976710655 \
          RETURNING token) \
    SELECT l.got, (SELECT token FROM f) FROM l";

/// `$1` lock id, `$2` counter row, `$3` the epoch's base. Waits, then increments the shared
/// counter in this epoch only: no row when refused.
pub(super) const WAIT_COUNTED_SQL: &str = "WITH l AS (SELECT pg_advisory_lock($1)) \
    INSERT INTO dlock_fencing (id, token) SELECT $2, $3 + 1 FROM l \
    ON CONFLICT (id) DO UPDATE SET token = dlock_fencing.token + 1 \
    WHERE dlock_fencing.token >= $3 AND dlock_fencing.token < $3 + 281474976710655 \
    RETURNING token";

/// [`WAIT_COUNTED_SQL`] for the shared lock.
pub(super) const WAIT_SHARED_COUNTED_SQL: &str = "WITH l AS (SELECT pg_advisory_lock_shared($1)) \
    INSERT INTO dlock_fencing (id, token) SELECT $2, $3 + 1 FROM l \
    ON CONFLICT (id) DO UPDATE SET token = dlock_fencing.token + 1 \
    WHERE dlock_fencing.token >= $3 AND dlock_fencing.token < $3 + 281474976710655 \
    RETURNING token";

/// `$1` counter row, `$2` the epoch's base. Increments the shared counter of a lock this
/// session already holds, in this epoch only: no row when refused.
pub(super) const FENCE_COUNTED_SQL: &str = "INSERT INTO dlock_fencing (id, token) VALUES ($1, $2 + 1) \
    ON CONFLICT (id) DO UPDATE SET token = dlock_fencing.token + 1 \
    WHERE dlock_fencing.token >= $2 AND dlock_fencing.token < $2 + 281474976710655 \
    RETURNING token";

/// `$1` [`MODE_ID`]. Creates the mode row (0: no mode) if missing; run in the join's
/// transaction before [`MODE_LOCK_SQL`].
pub(super) const MODE_CREATE_SQL: &str = "INSERT INTO dlock_fencing (id, token) VALUES ($1, 0) \
    ON CONFLICT (id) DO NOTHING";

/// `$1` [`MODE_ID`]. The store's mode, locked until the join's transaction ends (joins and
/// switches run one at a time).
pub(super) const MODE_LOCK_SQL: &str = "SELECT token FROM dlock_fencing WHERE id = $1 FOR UPDATE";

/// `$1` [`MODE_ID`]. The store's mode, if any (a per-key backend refuses a switched store).
pub(super) const MODE_SQL: &str = "SELECT token FROM dlock_fencing WHERE id = $1";

/// `$1` the number of counter rows to look at. The highest epoch in counter rows `0..$1`.
pub(super) const MAX_EPOCH_SQL: &str = "SELECT COALESCE(max(token >> 48), 0) FROM dlock_fencing \
    WHERE id >= 0 AND id < $1";

/// `$1` the number of counter rows, `$2` the new epoch's base. A switch: counter rows `0..$1`
/// start the new epoch (rows a backend of the old mode may touch included, so that it is
/// refused from now on).
pub(super) const SWITCH_SQL: &str = "INSERT INTO dlock_fencing (id, token) \
    SELECT g, $2 FROM generate_series(0::bigint, $1 - 1) AS g \
    ON CONFLICT (id) DO UPDATE SET token = excluded.token";

/// `$1` [`MODE_ID`], `$2` the new mode (`N << 16 | epoch`).
pub(super) const MODE_SET_SQL: &str = "UPDATE dlock_fencing SET token = $2 WHERE id = $1";

/// `$1` lock id. One try for the shared lock. Returns whether it was taken.
pub(super) const TRY_SHARED_SQL: &str = "SELECT pg_try_advisory_lock_shared($1)";

/// `$1` lock id. Takes the shared lock and, only if it was taken, increments the lock's
/// fencing counter (the exclusive lock's) in the same statement.
pub(super) const TRY_SHARED_FENCED_SQL: &str = "WITH l AS (SELECT pg_try_advisory_lock_shared($1) AS got), \
    f AS (INSERT INTO dlock_fencing (id, token) SELECT $1, 1 FROM l WHERE l.got \
          ON CONFLICT (id) DO UPDATE SET token = dlock_fencing.token + 1 RETURNING token) \
    SELECT l.got, (SELECT token FROM f) FROM l";

/// `$1` lock id. Waits for the shared lock (under the session's `lock_timeout`).
pub(super) const WAIT_SHARED_SQL: &str = "SELECT pg_advisory_lock_shared($1)";

/// `$1` lock id. Waits for the shared lock, then increments the fencing counter in the same
/// statement.
pub(super) const WAIT_SHARED_FENCED_SQL: &str = "WITH l AS (SELECT pg_advisory_lock_shared($1)) \
    INSERT INTO dlock_fencing (id, token) SELECT $1, 1 FROM l \
    ON CONFLICT (id) DO UPDATE SET token = dlock_fencing.token + 1 RETURNING token";

pub(super) const UNLOCK_SHARED_SQL: &str = "SELECT pg_advisory_unlock_shared($1)";

/// The statements of one lock mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct ModeSql {
    pub(super) try_lock: &'static str,
    pub(super) try_fenced: &'static str,
    pub(super) try_counted: &'static str,
    pub(super) wait: &'static str,
    pub(super) wait_fenced: &'static str,
    pub(super) wait_counted: &'static str,
    pub(super) unlock: &'static str,
}

/// The statements of `mode`: `pg_advisory_lock` and friends, or their `_shared` forms.
pub(super) fn mode_sql(mode: Mode) -> ModeSql {
    match mode {
        Mode::Exclusive => ModeSql {
            try_lock: TRY_SQL,
            try_fenced: TRY_FENCED_SQL,
            try_counted: TRY_COUNTED_SQL,
            wait: WAIT_SQL,
            wait_fenced: WAIT_FENCED_SQL,
            wait_counted: WAIT_COUNTED_SQL,
            unlock: UNLOCK_SQL,
        },
        Mode::Shared => ModeSql {
            try_lock: TRY_SHARED_SQL,
            try_fenced: TRY_SHARED_FENCED_SQL,
            try_counted: TRY_SHARED_COUNTED_SQL,
            wait: WAIT_SHARED_SQL,
            wait_fenced: WAIT_SHARED_FENCED_SQL,
            wait_counted: WAIT_SHARED_COUNTED_SQL,
            unlock: UNLOCK_SHARED_SQL,
        },
    }
}

/// `$1` lock id. Whether this session holds the lock (session or transaction level).
pub(super) const HELD_SQL: &str = "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' \
    AND pid = pg_backend_pid() AND granted AND objsubid = 1 \
    AND ((classid::bigint << 32) | objid::bigint) = $1)";

pub(super) const FENCING_TABLE_SQL: &str =
    "CREATE TABLE IF NOT EXISTS dlock_fencing (id bigint PRIMARY KEY, token bigint NOT NULL)";

/// Whether this role sees the fencing table (on its search path), and may `SELECT`, `INSERT`
/// and `UPDATE` it. Asked before [`FENCING_TABLE_SQL`], which needs `CREATE` on the schema even
/// when the table exists: a role with just the table's grants could not open the backend.
pub(super) const FENCING_TABLE_CHECK_SQL: &str = "SELECT to_regclass('dlock_fencing') IS NOT NULL, \
    COALESCE(has_table_privilege(to_regclass('dlock_fencing'), 'SELECT') \
    AND has_table_privilege(to_regclass('dlock_fencing'), 'INSERT') \
    AND has_table_privilege(to_regclass('dlock_fencing'), 'UPDATE'), false)";

/// What an administrator runs for a role that may not create the fencing table.
pub(super) const FENCING_GRANTS: &str = "CREATE TABLE dlock_fencing (id bigint PRIMARY KEY, token bigint NOT NULL); \
    GRANT USAGE ON SCHEMA <schema> TO <role>; GRANT SELECT, INSERT, UPDATE ON dlock_fencing TO <role>";

/// `$1` pid, `$2` backend start time (text) of a wait connection: cancels its statement.
pub(super) const CANCEL_SQL: &str = "SELECT pg_cancel_backend(pid) FROM pg_stat_activity \
    WHERE pid = $1 AND backend_start::text = $2";

/// `$1` pid, `$2` backend start time (text) of a wait connection: whether that session (if it
/// still exists) neither waits for nor holds any advisory lock.
pub(super) const SETTLED_SQL: &str = "SELECT NOT EXISTS (SELECT 1 FROM pg_locks l \
    JOIN pg_stat_activity a ON a.pid = l.pid \
    WHERE l.pid = $1 AND a.backend_start::text = $2 AND l.locktype = 'advisory')";

/// Process id and start time of this session, which identify it for [`CANCEL_SQL`]. Also
/// has the server look for a vanished client once a second while a statement runs
/// (`client_connection_check_interval`, PostgreSQL 14 and later; skipped where unknown), so a
/// wait whose cancel arrived before the wait began still ends soon after its connection is
/// dropped, instead of at its `lock_timeout`.
pub(super) const IDENTITY_SQL: &str = "SELECT pid, backend_start::text, \
    (SELECT count(set_config(name, '1000', false)) FROM pg_settings \
     WHERE name = 'client_connection_check_interval') \
    FROM pg_stat_activity WHERE pid = pg_backend_pid()";

pub(super) const SET_LOCK_TIMEOUT_SQL: &str = "SELECT set_config('lock_timeout', $1, false)";

/// `$1` lock id. One try for a transaction-bound lock.
pub(super) const TRY_XACT_SQL: &str = "SELECT pg_try_advisory_xact_lock($1)";

/// `$1` lock id. A wait for a transaction-bound lock (under `lock_timeout`).
pub(super) const WAIT_XACT_SQL: &str = "SELECT pg_advisory_xact_lock($1)";

/// The transaction's `lock_timeout` and `statement_timeout`, restored after a wait.
pub(super) const TIMEOUTS_SQL: &str =
    "SELECT current_setting('lock_timeout'), current_setting('statement_timeout')";

/// `$1` lock timeout: the wait's timeouts, for the rest of the savepoint; the caller's
/// `statement_timeout` must not cut the wait short (`lock_timeout` bounds it).
pub(super) const SET_WAIT_TIMEOUTS_SQL: &str =
    "SELECT set_config('lock_timeout', $1, true), set_config('statement_timeout', '0', true)";

/// `$1` lock timeout, `$2` statement timeout: the transaction's own, restored.
pub(super) const RESTORE_TIMEOUTS_SQL: &str =
    "SELECT set_config('lock_timeout', $1, true), set_config('statement_timeout', $2, true)";

pub(super) const SAVEPOINT_SQL: &str = "SAVEPOINT dlock_wait";
pub(super) const RELEASE_SAVEPOINT_SQL: &str = "RELEASE SAVEPOINT dlock_wait";
pub(super) const ROLLBACK_SAVEPOINT_SQL: &str = "ROLLBACK TO SAVEPOINT dlock_wait";

/// `lock_timeout` for a wait of `timeout`: whole milliseconds, rounded up; `0` (no limit) for
/// waits too long for the setting.
pub(super) fn lock_timeout_setting(timeout: Duration) -> String {
    let ms = timeout.as_nanos().div_ceil(1_000_000).max(1);
    if ms > i32::MAX as u128 {
        "0".to_owned()
    } else {
        format!("{ms}ms")
    }
}

/// The advisory locks granted in this database now, for store inspection: the lock id (the
/// two 32-bit halves put back together), the mode (`ShareLock` or `ExclusiveLock`), how
/// many sessions hold it so, and their `application_name`s (comma-separated; empty when
/// none is set or the user may not see the sessions).
pub(super) const STORE_LOCKS_SQL: &str = "SELECT (l.classid::bigint << 32) | l.objid::bigint, l.mode, \
    count(*)::bigint, coalesce(string_agg(DISTINCT a.application_name, ','), '') \
    FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid \
    WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted \
    AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
    GROUP BY 1, 2";

// Semaphores (see the module docs, Semaphores). A semaphore of `n` permits is the advisory
// locks of the two-key form `(class, 0)` to `(class, n - 1)` ("slots", `objsubid` 2 in
// `pg_locks`, a namespace lock keys never use); a holder holds its slot exclusively and
// `(class, n)`, the count record, shared. A try is one statement: it takes the semaphore's
// gate (a transaction lock, so tries of one semaphore run one at a time, and the gate ends
// with the statement), then reads `pg_locks` once (the live slots, a record of another count,
// the queue lock, this session's own slots), then walks the slots from `$4` on, taking the
// first free one that this session does not hold already, with its share of the record.
// Under the gate no other try takes a slot, so one free slot is met within `live + 1` steps.

/// The walk of a permit try, the common head of [`PERMIT_SQL`] and its fenced forms. `$1` the
/// gate (a one-key lock id), `$2` the class, `$3` the count, `$4` the first slot tried, `$5`
/// the queue lock's id, `$6` whether this is a waiting try (not answered full for the queue
/// lock).
macro_rules! permit_walk {
    () => {
        "WITH RECURSIVE \
gate AS MATERIALIZED (SELECT pg_advisory_xact_lock($1)::text AS done), \
seen AS MATERIALIZED (SELECT s.* FROM gate, LATERAL (SELECT \
count(*) FILTER (WHERE l.objsubid = 2 AND l.mode = 'ExclusiveLock') AS live, \
min(l.objid::bigint) FILTER (WHERE l.objsubid = 2 AND l.mode = 'ShareLock' AND l.objid::bigint <> $3) AS other, \
coalesce(bool_or(l.objsubid = 1), false) AS queued, \
coalesce(array_agg(l.objid::bigint) FILTER (WHERE l.objsubid = 2 AND l.mode = 'ExclusiveLock' \
AND l.pid = pg_backend_pid()), '{}') AS mine \
FROM pg_locks l \
WHERE gate.done IS NOT NULL AND l.locktype = 'advisory' AND l.granted \
AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
AND ((l.objsubid = 2 AND l.classid::bigint = ($2::bigint & 4294967295)) \
OR (l.objsubid = 1 AND ((l.classid::bigint << 32) | l.objid::bigint) = $5)) \
OFFSET 0) s), \
walk (step, slot, got) AS (\
SELECT 0::bigint, NULL::bigint, false FROM seen \
WHERE seen.other IS NULL AND seen.live < $3 AND ($6 OR NOT seen.queued) \
UNION ALL \
SELECT w.step + 1, ($4 + w.step) % $3, \
CASE WHEN ($4 + w.step) % $3 = ANY (seen.mine) THEN false \
WHEN pg_try_advisory_lock($2, (($4 + w.step) % $3)::bit(32)::int4) THEN \
CASE WHEN pg_try_advisory_lock_shared($2, $3::bit(32)::int4) THEN true \
ELSE NOT pg_advisory_unlock($2, (($4 + w.step) % $3)::bit(32)::int4) END \
ELSE false END \
FROM walk w, seen WHERE NOT w.got AND w.step < least($3, seen.live + 1))"
    };
}

/// One try for a permit, as [`permit_walk`] says. Answers the slot taken (`NULL`: none), a
/// count that the live permits were taken with when it is not `$3` (nothing was taken), and
/// no token.
pub(super) const PERMIT_SQL: &str = concat!(
    permit_walk!(),
    " SELECT (SELECT slot FROM walk WHERE got), seen.other, NULL::bigint FROM seen"
);

/// [`PERMIT_SQL`] that, only when a slot was taken, increments the semaphore's fencing
/// counter (row `$1`, the gate's id) in the same statement, under the gate, so tokens follow
/// the order of the grants.
pub(super) const PERMIT_FENCED_SQL: &str = concat!(
    permit_walk!(),
    ", f AS (INSERT INTO dlock_fencing (id, token) SELECT $1, 1 FROM walk WHERE got \
ON CONFLICT (id) DO UPDATE SET token = dlock_fencing.token + 1 RETURNING token) \
SELECT (SELECT slot FROM walk WHERE got), seen.other, (SELECT token FROM f) FROM seen"
);

/// [`PERMIT_SQL`] under shared counters (`fencing_counters`): `$7` the counter row, `$8` the
/// epoch's base; the increment is refused (no token beside a slot) as [`TRY_COUNTED_SQL`]'s.
pub(super) const PERMIT_COUNTED_SQL: &str = concat!(
    permit_walk!(),
    ", f AS (INSERT INTO dlock_fencing (id, token) SELECT $7, $8 + 1 FROM walk WHERE got \
ON CONFLICT (id) DO UPDATE SET token = dlock_fencing.token + 1 \
WHERE dlock_fencing.token >= $8 AND dlock_fencing.token < $8 + 281474976710655 \
RETURNING token) \
SELECT (SELECT slot FROM walk WHERE got), seen.other, (SELECT token FROM f) FROM seen"
);

/// `$1` class, `$2` slot, `$3` count (as `int4`, bit for bit). Gives back a permit: the slot
/// first, then its share of the count record (the `CASE` fixes the order), so a try never
/// sees a live slot without its record.
pub(super) const PERMIT_RELEASE_SQL: &str = "SELECT CASE WHEN pg_advisory_unlock($1, $2) \
THEN pg_advisory_unlock_shared($1, $3) ELSE pg_advisory_unlock_shared($1, $3) END";

/// `$1` class, `$2` count. The live permits of a semaphore, a count they were taken with
/// other than `$2` (if any), and any count they were taken with.
pub(super) const PERMIT_COUNT_SQL: &str = "SELECT \
count(*) FILTER (WHERE mode = 'ExclusiveLock'), \
min(objid::bigint) FILTER (WHERE mode = 'ShareLock' AND objid::bigint <> $2), \
min(objid::bigint) FILTER (WHERE mode = 'ShareLock') \
FROM pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 2 \
AND classid::bigint = ($1::bigint & 4294967295) \
AND database = (SELECT oid FROM pg_database WHERE datname = current_database())";

/// The semaphores with live permits in this database now, for store inspection: the class,
/// how many slots are held, and the count their record says.
pub(super) const STORE_PERMITS_SQL: &str = "SELECT classid::bigint, \
count(*) FILTER (WHERE mode = 'ExclusiveLock'), max(objid::bigint) FILTER (WHERE mode = 'ShareLock') \
FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 2 AND granted \
AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
GROUP BY 1";

/// The gate's lock id (also the semaphore's fencing counter row) and the class of the
/// semaphore `key`'s slots: [`lock_id`](crate::lock_id) of the key in a reserved namespace
/// of its own, and its high 32 bits.
pub(super) fn semaphore_ids(key: &str) -> (i64, i32) {
    let gate = crate::lock_id(&format!("{}permits\0{key}", crate::key::RESERVED_PREFIX));
    (gate, (gate >> 32) as i32)
}

/// An `int4` with the bits of `value` (slots and counts are `u32`; the server's two-key
/// advisory locks take `int4`s, and show them as unsigned `oid`s).
pub(super) fn int4_bits(value: u32) -> i32 {
    value as i32
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shared statements are the exclusive ones with the `_shared` functions, nothing else.
    #[test]
    fn shared_statements_mirror_the_exclusive_ones() {
        let (x, s) = (mode_sql(Mode::Exclusive), mode_sql(Mode::Shared));
        for (exclusive, shared) in [
            (x.try_lock, s.try_lock),
            (x.try_fenced, s.try_fenced),
            (x.wait, s.wait),
            (x.wait_fenced, s.wait_fenced),
        ] {
            assert_eq!(
                exclusive.replace("advisory_lock(", "advisory_lock_shared("),
                shared
            );
        }
        assert_eq!(x.unlock.replace("unlock(", "unlock_shared("), s.unlock);
        assert_eq!(s.try_lock, "SELECT pg_try_advisory_lock_shared($1)");
        assert_eq!(s.unlock, "SELECT pg_advisory_unlock_shared($1)");
    }

    #[test]
    fn lock_timeouts() {
        assert_eq!(lock_timeout_setting(Duration::from_millis(400)), "400ms");
        assert_eq!(lock_timeout_setting(Duration::from_micros(1)), "1ms");
        assert_eq!(lock_timeout_setting(Duration::from_micros(1500)), "2ms");
        assert_eq!(lock_timeout_setting(Duration::MAX), "0");
        // The setting's largest value is i32::MAX milliseconds; one more is no limit.
        let largest = Duration::from_millis(i32::MAX as u64);
        assert_eq!(lock_timeout_setting(largest), "2147483647ms");
        assert_eq!(
            lock_timeout_setting(largest + Duration::from_millis(1)),
            "0"
        );
    }

    /// The permit statements, pinned: the walk (gate, one read of `pg_locks`, the slots from
    /// `$4` on), and what each form answers. Their placeholders are `$1` to `$6` (and `$7`,
    /// `$8` for shared counters), each bound once by `permit_statement`.
    #[test]
    fn permit_statements_are_pinned() {
        assert_eq!(
            PERMIT_SQL,
            "WITH RECURSIVE gate AS MATERIALIZED (SELECT pg_advisory_xact_lock($1)::text AS \
            done), seen AS MATERIALIZED (SELECT s.* FROM gate, LATERAL (SELECT count(*) FILTER \
            (WHERE l.objsubid = 2 AND l.mode = 'ExclusiveLock') AS live, min(l.objid::bigint) \
            FILTER (WHERE l.objsubid = 2 AND l.mode = 'ShareLock' AND l.objid::bigint <> $3) \
            AS other, coalesce(bool_or(l.objsubid = 1), false) AS queued, \
            coalesce(array_agg(l.objid::bigint) FILTER (WHERE l.objsubid = 2 AND l.mode = \
            'ExclusiveLock' AND l.pid = pg_backend_pid()), '{}') AS mine FROM pg_locks l WHERE \
            gate.done IS NOT NULL AND l.locktype = 'advisory' AND l.granted AND l.database = \
            (SELECT oid FROM pg_database WHERE datname = current_database()) AND ((l.objsubid \
            = 2 AND l.classid::bigint = ($2::bigint & 4294967295)) OR (l.objsubid = 1 AND \
            ((l.classid::bigint << 32) | l.objid::bigint) = $5)) OFFSET 0) s), walk (step, \
            slot, got) AS (SELECT 0::bigint, NULL::bigint, false FROM seen WHERE seen.other IS \
            NULL AND seen.live < $3 AND ($6 OR NOT seen.queued) UNION ALL SELECT w.step + 1, \
            ($4 + w.step) % $3, CASE WHEN ($4 + w.step) % $3 = ANY (seen.mine) THEN false WHEN \
            pg_try_advisory_lock($2, (($4 + w.step) % $3)::bit(32)::int4) THEN CASE WHEN \
            pg_try_advisory_lock_shared($2, $3::bit(32)::int4) THEN true ELSE NOT \
            pg_advisory_unlock($2, (($4 + w.step) % $3)::bit(32)::int4) END ELSE false END \
            FROM walk w, seen WHERE NOT w.got AND w.step < least($3, seen.live + 1)) SELECT \
            (SELECT slot FROM walk WHERE got), seen.other, NULL::bigint FROM seen"
        );
        let walk = PERMIT_SQL
            .strip_suffix(
                " SELECT (SELECT slot FROM walk WHERE got), seen.other, NULL::bigint FROM seen",
            )
            .expect("the walk, then the answer");
        assert_eq!(
            PERMIT_FENCED_SQL.strip_prefix(walk),
            Some(
                ", f AS (INSERT INTO dlock_fencing (id, token) SELECT $1, 1 FROM walk WHERE got \
                ON CONFLICT (id) DO UPDATE SET token = dlock_fencing.token + 1 RETURNING \
                token) SELECT (SELECT slot FROM walk WHERE got), seen.other, (SELECT token \
                FROM f) FROM seen"
            )
        );
        assert_eq!(
            PERMIT_COUNTED_SQL.strip_prefix(walk),
            Some(
                ", f AS (INSERT INTO dlock_fencing (id, token) SELECT $7, $8 + 1 FROM walk \
                WHERE got ON CONFLICT (id) DO UPDATE SET token = dlock_fencing.token + 1 WHERE \
                dlock_fencing.token >= $8 AND dlock_fencing.token < $8 + 281474976710655 \
                RETURNING token) SELECT (SELECT slot FROM walk WHERE got), seen.other, (SELECT \
                token FROM f) FROM seen"
            )
        );
        for (sql, params) in [
            (PERMIT_SQL, 6),
            (PERMIT_FENCED_SQL, 6),
            (PERMIT_COUNTED_SQL, 8),
        ] {
            for n in 1..=params {
                assert!(sql.contains(&format!("${n}")), "${n} in {sql}");
            }
            assert!(!sql.contains(&format!("${}", params + 1)), "{sql}");
        }
        assert_eq!(
            PERMIT_RELEASE_SQL,
            "SELECT CASE WHEN pg_advisory_unlock($1, $2) THEN pg_advisory_unlock_shared($1, $3) \
            ELSE pg_advisory_unlock_shared($1, $3) END"
        );
        assert_eq!(
            PERMIT_COUNT_SQL,
            "SELECT count(*) FILTER (WHERE mode = 'ExclusiveLock'), min(objid::bigint) FILTER \
            (WHERE mode = 'ShareLock' AND objid::bigint <> $2), min(objid::bigint) FILTER \
            (WHERE mode = 'ShareLock') FROM pg_locks WHERE locktype = 'advisory' AND granted \
            AND objsubid = 2 AND classid::bigint = ($1::bigint & 4294967295) AND database = \
            (SELECT oid FROM pg_database WHERE datname = current_database())"
        );
        assert_eq!(
            STORE_PERMITS_SQL,
            "SELECT classid::bigint, count(*) FILTER (WHERE mode = 'ExclusiveLock'), \
            max(objid::bigint) FILTER (WHERE mode = 'ShareLock') FROM pg_locks WHERE locktype \
            = 'advisory' AND objsubid = 2 AND granted AND database = (SELECT oid FROM \
            pg_database WHERE datname = current_database()) GROUP BY 1"
        );
    }

    /// A semaphore's ids, pinned: the gate is `lock_id` of the key in the reserved
    /// namespace `permits`, the class its high 32 bits; slots and counts travel as `int4`s
    /// with the same bits, as `pg_locks` shows them (unsigned).
    #[test]
    fn semaphore_ids_are_pinned() {
        let (gate, class) = semaphore_ids("exports");
        assert_eq!(gate, crate::lock_id("dlock\0permits\0exports"));
        assert_eq!(class, (gate >> 32) as i32);
        assert_ne!(semaphore_ids("exports2"), (gate, class));
        assert_ne!(
            gate,
            crate::lock_id("exports"),
            "never the lock of the same key"
        );
        assert_eq!(int4_bits(0), 0);
        assert_eq!(int4_bits(5), 5);
        assert_eq!(int4_bits(u32::MAX), -1);
        assert_eq!(int4_bits(1 << 31), i32::MIN);
    }
}
