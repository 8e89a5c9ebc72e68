//! The MySQL backend's statements, as constants, and the server lock names keys map to.

use sha2::{Digest, Sha256};

/// The backend's name.
pub(super) const NAME: &str = "mysql";

/// Most readable characters kept in front of the hash of a hashed lock name.
pub(super) const READABLE_PREFIX: usize = 31;
/// The longest lock name the server accepts.
pub(super) const MAX_NAME: usize = 64;

/// `?` name. 1 when taken, 0 when held elsewhere.
pub(super) const TRY_SQL: &str = "SELECT GET_LOCK(?, 0)";
/// `?` name, `?` seconds (whole or fractional).
pub(super) const WAIT_SQL: &str = "SELECT GET_LOCK(?, ?)";
/// `?` name. 1 when released, 0 when another session holds it, NULL when nobody does.
pub(super) const RELEASE_SQL: &str = "SELECT RELEASE_LOCK(?)";
/// `?` name. Increments the fencing counter of a lock this session holds; the statement's
/// last insert id is the new token.
pub(super) const FENCE_SQL: &str = "INSERT INTO dlock_fencing (name, token) VALUES (?, LAST_INSERT_ID(1)) \
    ON DUPLICATE KEY UPDATE token = LAST_INSERT_ID(token + 1)";
pub(super) const FENCING_TABLE_SQL: &str = "CREATE TABLE IF NOT EXISTS dlock_fencing (\
    name VARCHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL PRIMARY KEY, \
    token BIGINT UNSIGNED NOT NULL) ENGINE=InnoDB";
/// Whether the fencing table is in the URL's database and visible to this user (it is when the
/// user holds any privilege on it). Asked before [`FENCING_TABLE_SQL`], which needs `CREATE`
/// even when the table exists: a user with just the table's grants could not open the backend.
pub(super) const FENCING_TABLE_CHECK_SQL: &str = "SELECT COUNT(*) FROM information_schema.TABLES \
    WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'dlock_fencing'";
/// What an administrator runs for a user that may not create the fencing table.
pub(super) const FENCING_GRANTS: &str = "CREATE TABLE <database>.dlock_fencing (name VARCHAR(64) CHARACTER SET ascii \
    COLLATE ascii_bin NOT NULL PRIMARY KEY, token BIGINT UNSIGNED NOT NULL) ENGINE=InnoDB; \
    GRANT SELECT, INSERT, UPDATE ON <database>.dlock_fencing TO <user>";
/// Ends a session (and with it its wait and its locks). MySQL takes no parameter in `KILL`
/// ("dynamic parameters can only be used in DML statements"), so this is the one statement
/// built by formatting: its only input is a `u64` connection id the server itself reported,
/// never text from a caller.
pub(super) fn kill_sql(id: u64) -> String {
    format!("KILL CONNECTION {id}")
}
pub(super) const IDENTITY_SQL: &str = "SELECT CAST(CONNECTION_ID() AS UNSIGNED), VERSION()";
pub(super) const MYSQL_SESSION_SQL: &str =
    "SET SESSION wait_timeout = 31536000, max_execution_time = 0";
pub(super) const MARIADB_SESSION_SQL: &str =
    "SET SESSION wait_timeout = 31536000, max_statement_time = 0";
/// [`MYSQL_SESSION_SQL`] on a server with recursive CTEs (MySQL 8.0.3 and later), which also
/// lets a permit's walk run over every slot of the largest semaphore: [`MAX_PERMITS`] steps
/// and the step that ends it.
pub(super) const MYSQL_WALK_SESSION_SQL: &str = "SET SESSION wait_timeout = 31536000, \
    max_execution_time = 0, cte_max_recursion_depth = 1025";
/// [`MARIADB_SESSION_SQL`] on a server with recursive CTEs (MariaDB 10.2.2 and later), as
/// [`MYSQL_WALK_SESSION_SQL`] (MariaDB stops a recursion at its limit without an error).
pub(super) const MARIADB_WALK_SESSION_SQL: &str = "SET SESSION wait_timeout = 31536000, \
    max_statement_time = 0, max_recursive_iterations = 1025";

/// The most permits a semaphore may have here: a try that finds the semaphore full asks for
/// each slot in turn (about 10 µs of the server's time each), in one statement.
pub(super) const MAX_PERMITS: u32 = 1024;

/// One try for a permit, in one statement: `?` the slots' name prefix, `?` the first slot
/// tried, `?` the count, `?` the queue lock's name, `?` whether this is a waiting try. A
/// single try takes nothing while any session holds the queue lock. Then the walk, one step
/// per iteration of the recursive CTE (the server evaluates the next step only from a row
/// whose slot was not taken, so at most one slot is taken): a slot this session holds already
/// is skipped (`GET_LOCK` would let the session take it again), and `GET_LOCK(name, 0)` tries
/// the others. Answers the slot taken, or `NULL`.
pub(super) const PERMIT_SQL: &str = "WITH RECURSIVE \
p (prefix, start, n, queue, waiting) AS (SELECT ?, ?, ?, ?, ?), \
walk (step, slot, got) AS (\
SELECT CAST(0 AS UNSIGNED), CAST(0 AS UNSIGNED), 0 FROM p \
WHERE p.waiting OR IS_USED_LOCK(p.queue) IS NULL \
UNION ALL \
SELECT w.step + 1, (p.start + w.step) % p.n, \
IF(IS_USED_LOCK(CONCAT(p.prefix, (p.start + w.step) % p.n)) <=> CONNECTION_ID(), 0, \
COALESCE(GET_LOCK(CONCAT(p.prefix, (p.start + w.step) % p.n), 0), 0)) \
FROM walk w, p WHERE w.got = 0 AND w.step < p.n) \
SELECT (SELECT slot FROM walk WHERE got = 1)";

/// `?` the slots' name prefix, `?` the count. How many slots of the semaphore are held, by
/// any session (one `IS_USED_LOCK` per slot, in one statement).
pub(super) const PERMIT_COUNT_SQL: &str = "WITH RECURSIVE \
p (prefix, n) AS (SELECT ?, ?), \
s (i) AS (SELECT CAST(0 AS UNSIGNED) UNION ALL SELECT s.i + 1 FROM s, p WHERE s.i + 1 < p.n) \
SELECT COUNT(IS_USED_LOCK(CONCAT(p.prefix, s.i))) FROM s, p";

/// Whether store inspection can see user locks: `performance_schema` on, and its metadata
/// lock instrument enabled (both 1 when it can). Needs `SELECT` on `performance_schema`.
pub(super) const STORE_LOCKS_CHECK_SQL: &str = "SELECT CAST(@@performance_schema AS SIGNED), \
(SELECT COUNT(*) FROM performance_schema.setup_instruments \
WHERE NAME = 'wait/lock/metadata/sql/mdl' AND ENABLED = 'YES')";

/// The user locks granted now, by any session: name, and the holding session's
/// `program_name` connect attribute where its client sent one.
pub(super) const STORE_LOCKS_SQL: &str = "SELECT m.OBJECT_NAME, MIN(a.ATTR_VALUE) \
FROM performance_schema.metadata_locks m \
LEFT JOIN performance_schema.threads t ON t.THREAD_ID = m.OWNER_THREAD_ID \
LEFT JOIN performance_schema.session_connect_attrs a \
ON a.PROCESSLIST_ID = t.PROCESSLIST_ID AND a.ATTR_NAME = 'program_name' \
WHERE m.OBJECT_TYPE = 'USER LEVEL LOCK' AND m.LOCK_STATUS = 'GRANTED' \
GROUP BY m.OBJECT_NAME";

/// The name prefix of the semaphore `key`'s slots: `#sem#`, 32 lowercase hex digits of
/// SHA-256 of the key, `#` (slot *n* is the prefix and *n* in decimal, at most 48
/// characters). No lock's name has more than one `#`, so no slot is a lock.
pub(super) fn semaphore_prefix(key: &str) -> String {
    let digest = Sha256::digest(key.as_bytes());
    let mut name = String::with_capacity(MAX_NAME);
    name.push_str("#sem#");
    for byte in &digest[..16] {
        name.push(hex_digit(byte >> 4));
        name.push(hex_digit(byte & 0x0f));
    }
    name.push('#');
    name
}

/// The server's user lock name of slot `slot` of the semaphore `key` (see the
/// [module docs](crate::mysql#semaphores)): `#sem#`, 32 lowercase hex digits of SHA-256 of the
/// key, `#`, and the slot in decimal. Other programs can compute it to see who holds a slot.
///
/// ```
/// use dlock::mysql::semaphore_slot_name;
/// let name = semaphore_slot_name("exports", 3);
/// assert!(name.starts_with("#sem#") && name.ends_with("#3"));
/// assert_eq!(name.len(), 5 + 32 + 1 + 1);
/// ```
pub fn semaphore_slot_name(key: &str, slot: u32) -> String {
    format!("{}{slot}", semaphore_prefix(key))
}

/// The version of a server, as `VERSION()` gives it (`9.7.4-2`, `10.11.19-MariaDB-0+deb12u1`):
/// major, minor and patch.
pub(super) fn version_numbers(version: &str) -> (u32, u32, u32) {
    let mut parts = version
        .split(|c: char| !c.is_ascii_digit())
        .map(|part| part.parse::<u32>().unwrap_or(0));
    let mut next = || parts.next().unwrap_or(0);
    (next(), next(), next())
}

/// MySQL's error for a `GET_LOCK` wait that would deadlock.
pub(super) const ER_USER_LOCK_DEADLOCK: u16 = 3058;
/// `KILL` of a connection id the server does not know ("Unknown thread id"): that session
/// has ended.
pub(super) const ER_NO_SUCH_THREAD: u16 = 1094;
/// MariaDB's (and InnoDB's) deadlock error.
pub(super) const ER_LOCK_DEADLOCK: u16 = 1213;

/// The server's user lock name for `key`; see the [module docs](crate::mysql#lock-names) for the rule.
///
/// ```
/// use dlock::mysql::server_lock_name;
/// assert_eq!(server_lock_name("jobs:billing"), "jobs:billing");
/// assert_eq!(
///     server_lock_name("Jobs"),
///     "jobs#2f17a0f8d518e491c5a0c490b2c19918"
/// );
/// assert!(server_lock_name(&"x".repeat(1000)).len() <= 64);
/// ```
pub fn server_lock_name(key: &str) -> String {
    let verbatim = (1..=MAX_NAME).contains(&key.len()) && key.bytes().all(is_name_byte);
    if verbatim {
        return key.to_owned();
    }
    let digest = Sha256::digest(key.as_bytes());
    let mut name = String::with_capacity(MAX_NAME);
    for c in key.chars() {
        if name.len() == READABLE_PREFIX {
            break;
        }
        let c = c.to_ascii_lowercase();
        if c.is_ascii() && is_name_byte(c as u8) {
            name.push(c);
        }
    }
    name.push('#');
    for byte in &digest[..16] {
        name.push(hex_digit(byte >> 4));
        name.push(hex_digit(byte & 0x0f));
    }
    name
}

fn is_name_byte(b: u8) -> bool {
    matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'_' | b'-' | b'.' | b':' | b'/' | b'@')
}

fn hex_digit(nibble: u8) -> char {
    char::from(b"0123456789abcdef"[usize::from(nibble & 0x0f)])
}

#[cfg(test)]
mod tests {
    use sha2::{Digest, Sha256};

    use super::*;

    #[test]
    fn names_kept_verbatim() {
        for key in ["jobs", "jobs:billing", "a/b@c.d-e_f", &"x".repeat(64)] {
            assert_eq!(server_lock_name(key), key);
        }
    }

    #[test]
    fn names_hashed() {
        // Pinned: changing these changes which server locks deployed clients take.
        assert_eq!(
            server_lock_name("Jobs"),
            "jobs#2f17a0f8d518e491c5a0c490b2c19918"
        );
        let long = "x".repeat(65);
        let name = server_lock_name(&long);
        assert_eq!(name.len(), 31 + 1 + 32);
        assert!(name.starts_with(&"x".repeat(31)));
        assert_eq!(
            server_lock_name("ключ"),
            format!("#{}", &hex(&Sha256::digest("ключ".as_bytes()))[..32])
        );
        assert_eq!(
            server_lock_name("a b"),
            format!("ab#{}", &hex(&Sha256::digest(b"a b"))[..32])
        );
        for key in ["", " ", "\0", "JOBS", "jobs ", "a#b", &"é".repeat(200)] {
            let name = server_lock_name(key);
            assert!(name.len() <= MAX_NAME, "{key:?}");
            assert!(name.is_ascii());
            assert_eq!(name, name.to_ascii_lowercase());
            assert_eq!(name.matches('#').count(), 1, "{key:?} -> {name}");
        }
    }

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    #[test]
    fn distinct_keys_get_distinct_names() {
        let mut keys: Vec<String> = vec![
            "Jobs".into(),
            "jobs".into(),
            "JOBS".into(),
            "jObs".into(),
            "a\0b".into(),
            "a\0c".into(),
            "x".into(),
            "x\0".into(),
            "k ".into(),
            "k".into(),
            "é".into(),
            "e\u{301}".into(),
            "E".into(),
            "e".into(),
        ];
        let long = "p".repeat(10_000);
        for i in 0..200 {
            keys.push(format!("{long}{i}"));
            keys.push(format!("{}{i}", "q".repeat(60)));
            keys.push(format!("Key{i}"));
            keys.push(format!("key{i}"));
        }
        // Keys that look like hashed names stay themselves (no `#` in a verbatim name).
        let hashed = server_lock_name("Jobs");
        keys.push(hashed.clone());
        let mut seen = std::collections::HashMap::new();
        for key in &keys {
            // The server may fold case: compare lowered names.
            let name = server_lock_name(key).to_ascii_lowercase();
            if let Some(other) = seen.insert(name.clone(), key.clone()) {
                assert_eq!(&other, key, "{other:?} and {key:?} share {name}");
            }
        }
        assert_ne!(server_lock_name(&hashed), hashed);
    }

    /// The permit statements, pinned, with their five and two `?` (bound in this order by
    /// the session: prefix, first slot, count, queue lock, waiting; prefix, count).
    #[test]
    fn permit_statements_are_pinned() {
        assert_eq!(
            PERMIT_SQL,
            "WITH RECURSIVE p (prefix, start, n, queue, waiting) AS (SELECT ?, ?, ?, ?, ?), \
            walk (step, slot, got) AS (SELECT CAST(0 AS UNSIGNED), CAST(0 AS UNSIGNED), 0 FROM \
            p WHERE p.waiting OR IS_USED_LOCK(p.queue) IS NULL UNION ALL SELECT w.step + 1, \
            (p.start + w.step) % p.n, IF(IS_USED_LOCK(CONCAT(p.prefix, (p.start + w.step) % \
            p.n)) <=> CONNECTION_ID(), 0, COALESCE(GET_LOCK(CONCAT(p.prefix, (p.start + \
            w.step) % p.n), 0), 0)) FROM walk w, p WHERE w.got = 0 AND w.step < p.n) SELECT \
            (SELECT slot FROM walk WHERE got = 1)"
        );
        assert_eq!(PERMIT_SQL.matches('?').count(), 5);
        assert_eq!(
            PERMIT_COUNT_SQL,
            "WITH RECURSIVE p (prefix, n) AS (SELECT ?, ?), s (i) AS (SELECT CAST(0 AS \
            UNSIGNED) UNION ALL SELECT s.i + 1 FROM s, p WHERE s.i + 1 < p.n) SELECT \
            COUNT(IS_USED_LOCK(CONCAT(p.prefix, s.i))) FROM s, p"
        );
        assert_eq!(PERMIT_COUNT_SQL.matches('?').count(), 2);
        // Store inspection: user locks granted now, by any session, with no parameter.
        assert_eq!(
            STORE_LOCKS_SQL,
            "SELECT m.OBJECT_NAME, MIN(a.ATTR_VALUE) FROM performance_schema.metadata_locks m \
            LEFT JOIN performance_schema.threads t ON t.THREAD_ID = m.OWNER_THREAD_ID LEFT \
            JOIN performance_schema.session_connect_attrs a ON a.PROCESSLIST_ID = \
            t.PROCESSLIST_ID AND a.ATTR_NAME = 'program_name' WHERE m.OBJECT_TYPE = 'USER \
            LEVEL LOCK' AND m.LOCK_STATUS = 'GRANTED' GROUP BY m.OBJECT_NAME"
        );
        assert!(!STORE_LOCKS_SQL.contains('?') && !STORE_LOCKS_CHECK_SQL.contains('?'));
        assert!(STORE_LOCKS_CHECK_SQL.contains("'wait/lock/metadata/sql/mdl'"));
        // The recursion limits cover every step of the largest walk and the one that ends it.
        for session in [MYSQL_WALK_SESSION_SQL, MARIADB_WALK_SESSION_SQL] {
            assert!(
                session.ends_with(&format!(" = {}", MAX_PERMITS + 1)),
                "{session}"
            );
        }
        assert_eq!(
            MYSQL_WALK_SESSION_SQL.replace(", cte_max_recursion_depth = 1025", ""),
            MYSQL_SESSION_SQL
        );
        assert_eq!(
            MARIADB_WALK_SESSION_SQL.replace(", max_recursive_iterations = 1025", ""),
            MARIADB_SESSION_SQL
        );
    }

    /// Slot names, pinned: `#sem#`, 32 hex digits of SHA-256 of the key, `#`, the slot;
    /// never a lock's name (those have at most one `#`), distinct per key and slot, and
    /// within the server's 64 characters for every slot.
    #[test]
    fn semaphore_slot_names_are_pinned() {
        assert_eq!(
            semaphore_slot_name("exports", 0),
            "#sem#4b4e49dd2de5eae9881688638d745380#0"
        );
        let last = semaphore_slot_name(&"k".repeat(1000), u32::MAX);
        assert!(last.len() <= MAX_NAME, "{last}");
        assert_eq!(last.matches('#').count(), 3);
        for key in ["exports", "Jobs", "a#b", "#sem#x"] {
            assert!(server_lock_name(key).matches('#').count() <= 1, "{key}");
        }
        assert_ne!(semaphore_slot_name("a", 1), semaphore_slot_name("a", 10));
        assert_ne!(semaphore_slot_name("a", 1), semaphore_slot_name("b", 1));
        assert_eq!(
            semaphore_prefix("exports").trim_end_matches('#'),
            "#sem#4b4e49dd2de5eae9881688638d745380",
            "the fencing counter's name"
        );
    }

    #[test]
    fn server_versions() {
        assert_eq!(version_numbers("9.7.4-2"), (9, 7, 4));
        assert_eq!(version_numbers("10.11.19-MariaDB-0+deb12u1"), (10, 11, 19));
        assert_eq!(version_numbers("5.7.44-log"), (5, 7, 44));
        assert_eq!(version_numbers("8.0"), (8, 0, 0));
        assert_eq!(version_numbers("garbage"), (0, 0, 0));
    }
}
