//! What the SQL Server backend sends, as plain data: statement text and typed parameters, the
//! resource name of a key, and the meaning of every `sp_getapplock` / `sp_releaseapplock`
//! return code. No I/O here, so unit tests pin all of it.

use std::fmt::Write;
use std::sync::Arc;
use std::time::Duration;

use sha2::{Digest, Sha256};

use crate::LockError;
use crate::session::Mode;

pub(crate) const NAME: &str = "mssql";

/// The prefix of every resource name this crate locks.
pub(crate) const RESOURCE_PREFIX: &str = "dlock:";

/// The liveness check.
pub(crate) const KEEPALIVE_SQL: &str = "SELECT 1";

/// The longest `@LockTimeout` one `sp_getapplock` is given (longer waits are repeated), so a
/// wait whose client went away ends on the server within this time at the latest.
pub(crate) const MAX_WAIT: Duration = Duration::from_secs(30);

/// The `sp_getapplock` call with `@LockOwner = 'Session'`.
pub(crate) const GETAPPLOCK_SESSION_SQL: &str = "DECLARE @r int; \
EXEC @r = sp_getapplock @Resource = @P1, @LockMode = 'Exclusive', @LockOwner = 'Session', \
@LockTimeout = @P2, @DbPrincipal = 'public'; \
SELECT @r;";

/// The `sp_getapplock` call in shared mode (a read lock) with `@LockOwner = 'Session'`.
pub(crate) const GETAPPLOCK_SESSION_SHARED_SQL: &str = "DECLARE @r int; \
EXEC @r = sp_getapplock @Resource = @P1, @LockMode = 'Shared', @LockOwner = 'Session', \
@LockTimeout = @P2, @DbPrincipal = 'public'; \
SELECT @r;";

/// The `sp_getapplock` call with `@LockOwner = 'Transaction'`.
pub(crate) const GETAPPLOCK_TRANSACTION_SQL: &str = "DECLARE @r int; \
EXEC @r = sp_getapplock @Resource = @P1, @LockMode = 'Exclusive', @LockOwner = 'Transaction', \
@LockTimeout = @P2, @DbPrincipal = 'public'; \
SELECT @r;";

/// The `sp_getapplock` call with `@LockOwner = 'Session'` that, only when the lock is granted,
/// increments the key's fencing counter in the same batch (one round trip), and answers the
/// return code and the new token (`NULL` when not granted). The counter is updated through
/// `sp_executesql`, so that even an error SQL Server raises while compiling it (the table
/// dropped since the backend opened) is caught here: the lock is then given back before the
/// error reaches the client, and no lock is kept without its token. Each statement commits on
/// its own (autocommit), so a token once issued is never issued again, also across server
/// restarts.
pub(crate) const GETAPPLOCK_FENCED_SQL: &str = "DECLARE @r int, @t bigint; \
EXEC @r = sp_getapplock @Resource = @P1, @LockMode = 'Exclusive', @LockOwner = 'Session', \
@LockTimeout = @P2, @DbPrincipal = 'public'; \
IF @r >= 0 \
BEGIN \
BEGIN TRY \
EXEC sp_executesql N'UPDATE dlock_fencing SET @t = token = token + 1 WHERE resource = @n; \
IF @@ROWCOUNT = 0 BEGIN INSERT INTO dlock_fencing (resource, token) VALUES (@n, 1); SET @t = 1; END', \
N'@n nvarchar(255), @t bigint OUTPUT', @n = @P1, @t = @t OUTPUT; \
END TRY \
BEGIN CATCH \
EXEC sp_releaseapplock @Resource = @P1, @LockOwner = 'Session', @DbPrincipal = 'public'; \
THROW; \
END CATCH; \
END; \
SELECT @r, @t;";

/// [`GETAPPLOCK_FENCED_SQL`] in shared mode (a read lock): the token comes from the same
/// counter as the exclusive lock's, so a writer's token exceeds every reader's before it.
pub(crate) const GETAPPLOCK_FENCED_SHARED_SQL: &str = "DECLARE @r int, @t bigint; \
EXEC @r = sp_getapplock @Resource = @P1, @LockMode = 'Shared', @LockOwner = 'Session', \
@LockTimeout = @P2, @DbPrincipal = 'public'; \
IF @r >= 0 \
BEGIN \
BEGIN TRY \
EXEC sp_executesql N'UPDATE dlock_fencing SET @t = token = token + 1 WHERE resource = @n; \
IF @@ROWCOUNT = 0 BEGIN INSERT INTO dlock_fencing (resource, token) VALUES (@n, 1); SET @t = 1; END', \
N'@n nvarchar(255), @t bigint OUTPUT', @n = @P1, @t = @t OUTPUT; \
END TRY \
BEGIN CATCH \
EXEC sp_releaseapplock @Resource = @P1, @LockOwner = 'Session', @DbPrincipal = 'public'; \
THROW; \
END CATCH; \
END; \
SELECT @r, @t;";

/// Whether the fencing table exists (in the user's default schema, as the unqualified name
/// resolves) and this user may `SELECT`, `INSERT` and `UPDATE` it: two `int`s, 1 or 0.
/// Asked at open before [`FENCING_TABLE_SQL`], which needs `CREATE TABLE` even when the table
/// exists: a user with just the table's grants could not open the backend.
pub(crate) const FENCING_TABLE_CHECK_SQL: &str = "SELECT \
CAST(CASE WHEN OBJECT_ID(N'dlock_fencing', N'U') IS NULL THEN 0 ELSE 1 END AS int), \
CAST(ISNULL(HAS_PERMS_BY_NAME(N'dlock_fencing', N'OBJECT', N'SELECT') \
& HAS_PERMS_BY_NAME(N'dlock_fencing', N'OBJECT', N'INSERT') \
& HAS_PERMS_BY_NAME(N'dlock_fencing', N'OBJECT', N'UPDATE'), 0) AS int)";

/// Creates the fencing table, one counter row per resource name.
pub(crate) const FENCING_TABLE_SQL: &str = "CREATE TABLE dlock_fencing \
(resource nvarchar(255) NOT NULL PRIMARY KEY, token bigint NOT NULL)";

/// What an administrator runs for a user that may not create the fencing table.
pub(crate) const FENCING_GRANTS: &str = "CREATE TABLE dbo.dlock_fencing (resource nvarchar(255) NOT NULL \
PRIMARY KEY, token bigint NOT NULL); GRANT SELECT, INSERT, UPDATE ON dbo.dlock_fencing TO <user> \
(the user's default schema must be dbo, or the table created in it)";

/// SQL Server error 2714: "There is already an object named ... in the database."
pub(crate) const ALREADY_EXISTS_ERROR: u32 = 2714;
/// SQL Server errors that refuse `CREATE TABLE` to this user: 262 (permission denied in the
/// database), 2760 (the schema does not exist or may not be used), 1088 (cannot find the
/// object, or no permission).
pub(crate) const CREATE_DENIED_ERRORS: &[u32] = &[262, 2760, 1088];

/// The `sp_releaseapplock` call for session locks.
pub(crate) const RELEASEAPPLOCK_SESSION_SQL: &str = "DECLARE @r int; \
EXEC @r = sp_releaseapplock @Resource = @P1, @LockOwner = 'Session', @DbPrincipal = 'public'; \
SELECT @r;";

// Semaphores (see the module docs, Semaphores). A semaphore of `n` permits (at most
// [`MAX_PERMITS`]) is the session application locks `<base>:0` to `<base>:<n - 1>` ("slots",
// held exclusively) and its count record, the locks `<base>:count:<j>` held shared for each bit
// `j` set in `n` by every holder (SQL Server lists no locks without `VIEW SERVER STATE`, so the
// record is read bit by bit with `APPLOCK_TEST`). A try is one batch, in a transaction that
// holds the semaphore's gate (`<base>:gate`, owned by the transaction), so tries of one
// semaphore run one at a time.

/// The common head of [`PERMIT_SQL`]: the gate, the record, the walk.
macro_rules! permit_head {
    () => {
        "SET XACT_ABORT ON; \
DECLARE @r int, @g int, @i int = 0, @s int, @j int, @name nvarchar(255), @got int = -1, \
@rec int = 0, @took int = 0, @t bigint = NULL; \
BEGIN TRAN; \
SET @name = @P1 + N':gate'; \
EXEC @g = sp_getapplock @Resource = @name, @LockMode = 'Exclusive', @LockOwner = 'Transaction', \
@LockTimeout = @P6, @DbPrincipal = 'public'; \
IF @g >= 0 \
BEGIN \
SET @j = 0; \
WHILE @j < 11 \
BEGIN \
SET @name = @P1 + N':count:' + CAST(@j AS nvarchar(2)); \
IF APPLOCK_MODE('public', @name, 'Session') <> 'NoLock' \
OR APPLOCK_TEST('public', @name, 'Exclusive', 'Session') = 0 \
SET @rec = @rec | POWER(2, @j); \
SET @j = @j + 1; \
END; \
IF (@rec = 0 OR @rec = @P2) AND (@P5 = 1 OR (APPLOCK_MODE('public', @P4, 'Session') = 'NoLock' \
AND APPLOCK_TEST('public', @P4, 'Exclusive', 'Session') = 1)) \
BEGIN \
WHILE @i < @P2 AND @got < 0 \
BEGIN \
SET @s = (@P3 + @i) % @P2; \
SET @name = @P1 + N':' + CAST(@s AS nvarchar(10)); \
IF APPLOCK_MODE('public', @name, 'Session') = 'NoLock' \
BEGIN \
EXEC @r = sp_getapplock @Resource = @name, @LockMode = 'Exclusive', @LockOwner = 'Session', \
@LockTimeout = 0, @DbPrincipal = 'public'; \
IF @r >= 0 SET @got = @s; \
END; \
SET @i = @i + 1; \
END; \
IF @got >= 0 \
BEGIN \
SET @j = 0; \
WHILE @j < 11 \
BEGIN \
IF (@P2 & POWER(2, @j)) <> 0 \
BEGIN \
SET @name = @P1 + N':count:' + CAST(@j AS nvarchar(2)); \
EXEC @r = sp_getapplock @Resource = @name, @LockMode = 'Shared', @LockOwner = 'Session', \
@LockTimeout = 0, @DbPrincipal = 'public'; \
IF @r >= 0 SET @took = @took | POWER(2, @j); \
END; \
SET @j = @j + 1; \
END; \
IF @took <> @P2 \
BEGIN \
SET @j = 0; \
WHILE @j < 11 \
BEGIN \
IF (@took & POWER(2, @j)) <> 0 \
BEGIN \
SET @name = @P1 + N':count:' + CAST(@j AS nvarchar(2)); \
EXEC sp_releaseapplock @Resource = @name, @LockOwner = 'Session', @DbPrincipal = 'public'; \
END; \
SET @j = @j + 1; \
END; \
SET @name = @P1 + N':' + CAST(@got AS nvarchar(10)); \
EXEC sp_releaseapplock @Resource = @name, @LockOwner = 'Session', @DbPrincipal = 'public'; \
SET @got = -1; \
END; \
END; \
"
    };
}

/// The end of [`PERMIT_SQL`]: `$fence` runs with a slot taken, under the gate.
macro_rules! permit_tail {
    ($fence:literal) => {
        concat!(
            "IF @got >= 0 \
BEGIN ",
            $fence,
            "END; \
END; \
END; \
COMMIT; \
SET XACT_ABORT OFF; \
SELECT @g, @got, @rec, @t;"
        )
    };
}

/// The most permits a semaphore may have here: a try that finds the semaphore full asks for
/// each slot in turn, in one batch; 1,024 is the 11 bits of the count record.
pub(crate) const MAX_PERMITS: u32 = 1024;

/// One try for a permit, in one batch. `@P1` the semaphore's base name, `@P2` the count,
/// `@P3` the first slot tried, `@P4` the queue lock's resource, `@P5` 1 for a waiting try,
/// `@P6` how long to wait for the gate (ms). Reads the count record (`@rec`, 0 when no permit
/// is live); unless it names another count, or (for a single try) a session holds the queue
/// lock, walks the slots from `@P3` on, skipping those this session holds already
/// (`sp_getapplock` would grant them again), and takes the first free one with its share of
/// the record (both given back if a share is refused); with fencing, increments the
/// semaphore's counter. Answers the gate's code, the slot taken (-1: none), the record read,
/// and the token.
pub(crate) const PERMIT_SQL: &str = concat!(permit_head!(), permit_tail!("SET @t = NULL; "));

/// [`PERMIT_SQL`] that, with a slot taken, increments the semaphore's fencing counter (row
/// `@P1`) in the same transaction, under the gate.
pub(crate) const PERMIT_FENCED_SQL: &str = concat!(
    permit_head!(),
    permit_tail!(
        "UPDATE dlock_fencing SET @t = token = token + 1 WHERE resource = @P1; \
IF @@ROWCOUNT = 0 BEGIN INSERT INTO dlock_fencing (resource, token) VALUES (@P1, 1); SET @t = 1; END; "
    )
);

/// `@P1` the semaphore's base name, `@P2` the slot, `@P3` the count. Gives back a permit: its
/// slot first, then its share of the count record (each only if this session holds it).
pub(crate) const PERMIT_RELEASE_SQL: &str = "DECLARE @j int = 0, @name nvarchar(255); \
SET @name = @P1 + N':' + CAST(@P2 AS nvarchar(10)); \
IF APPLOCK_MODE('public', @name, 'Session') <> 'NoLock' \
EXEC sp_releaseapplock @Resource = @name, @LockOwner = 'Session', @DbPrincipal = 'public'; \
WHILE @j < 11 \
BEGIN \
IF (@P3 & POWER(2, @j)) <> 0 \
BEGIN \
SET @name = @P1 + N':count:' + CAST(@j AS nvarchar(2)); \
IF APPLOCK_MODE('public', @name, 'Session') <> 'NoLock' \
EXEC sp_releaseapplock @Resource = @name, @LockOwner = 'Session', @DbPrincipal = 'public'; \
END; \
SET @j = @j + 1; \
END; \
SELECT 0;";

/// `@P1` the semaphore's base name, `@P2` the count. How many of the semaphore's slots below
/// `@P2` are held, by any session, and the count record.
pub(crate) const PERMIT_COUNT_SQL: &str = "DECLARE @i int = 0, @j int = 0, @n int = 0, @rec int = 0, \
@name nvarchar(255); \
WHILE @i < @P2 \
BEGIN \
SET @name = @P1 + N':' + CAST(@i AS nvarchar(10)); \
IF APPLOCK_MODE('public', @name, 'Session') <> 'NoLock' \
OR APPLOCK_TEST('public', @name, 'Exclusive', 'Session') = 0 \
SET @n = @n + 1; \
SET @i = @i + 1; \
END; \
WHILE @j < 11 \
BEGIN \
SET @name = @P1 + N':count:' + CAST(@j AS nvarchar(2)); \
IF APPLOCK_MODE('public', @name, 'Session') <> 'NoLock' \
OR APPLOCK_TEST('public', @name, 'Exclusive', 'Session') = 0 \
SET @rec = @rec | POWER(2, @j); \
SET @j = @j + 1; \
END; \
SELECT @n, @rec;";

/// The base name of the semaphore `key`'s application locks: `dlock-sem:` and the 64
/// lowercase hex digits of SHA-256 of the key (74 characters; its slots, count bits and gate
/// add at most 11). No lock's resource starts with it (theirs start `dlock:`).
pub(crate) fn semaphore_base(key: &str) -> String {
    let digest = Sha256::digest(key.as_bytes());
    let mut name = String::with_capacity(90);
    name.push_str("dlock-sem:");
    for byte in digest {
        let _ = write!(name, "{byte:02x}");
    }
    name
}

/// The permit try for the semaphore `base` of `count` permits, from slot `first`
/// ([`PERMIT_SQL`], or [`PERMIT_FENCED_SQL`] with fencing).
#[allow(clippy::too_many_arguments)]
pub(crate) fn permit_call(
    base: &str,
    count: u32,
    first: u32,
    queue: &str,
    waiting: bool,
    gate_wait: Duration,
    fencing: bool,
) -> Call {
    Call {
        sql: if fencing {
            PERMIT_FENCED_SQL
        } else {
            PERMIT_SQL
        },
        params: vec![
            Param::NVarChar(base.to_owned()),
            Param::Int(i32::try_from(count).unwrap_or(i32::MAX)),
            Param::Int(i32::try_from(first).unwrap_or(0)),
            Param::NVarChar(queue.to_owned()),
            Param::Int(i32::from(waiting)),
            Param::Int(lock_timeout_ms(gate_wait)),
        ],
    }
}

/// Giving back the permit `slot` of the semaphore `base` of `count` permits.
pub(crate) fn permit_release_call(base: &str, slot: u32, count: u32) -> Call {
    Call {
        sql: PERMIT_RELEASE_SQL,
        params: vec![
            Param::NVarChar(base.to_owned()),
            Param::Int(i32::try_from(slot).unwrap_or(i32::MAX)),
            Param::Int(i32::try_from(count).unwrap_or(i32::MAX)),
        ],
    }
}

/// Counting the permits of the semaphore `base` of `count` permits.
pub(crate) fn permit_count_call(base: &str, count: u32) -> Call {
    Call {
        sql: PERMIT_COUNT_SQL,
        params: vec![
            Param::NVarChar(base.to_owned()),
            Param::Int(i32::try_from(count).unwrap_or(i32::MAX)),
        ],
    }
}

/// SQL Server error 1223: "Cannot release the application lock ... because it is not currently
/// held." Releasing a lock that is already gone is not an error for the backend.
pub(crate) const NOT_HELD_ERROR: u32 = 1223;
/// SQL Server error 1205: the session was chosen as deadlock victim.
pub(crate) const DEADLOCK_ERROR: u32 = 1205;

/// Who owns an application lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Owner {
    /// Held until released or the session ends.
    Session,
    /// Held until the caller's transaction commits or rolls back.
    Transaction,
}

/// A bound parameter, with the SQL type it is sent as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Param {
    /// `nvarchar`.
    NVarChar(String),
    /// `int`.
    Int(i32),
}

/// One statement and its parameters (`@P1`, `@P2`, ... in order).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Call {
    pub(crate) sql: &'static str,
    pub(crate) params: Vec<Param>,
}

/// The SQL Server application-lock resource that locks `key`.
///
/// `"dlock:"` followed by the 64 lowercase hex digits of SHA-256 of the key's UTF-8 bytes
/// (70 characters). Resource names are compared under the database's collation (often
/// case-insensitive) and are limited to 255 characters; a lowercase hex digest is the same under
/// every collation and always fits, and keys that differ in any way (case, length, Unicode
/// normalization, NUL bytes) get different digests. Other clients lock the same resource by
/// computing the same string.
///
/// ```
/// assert_eq!(
///     dlock::mssql::resource_name("account:42"),
///     "dlock:38dbcc9b3c91186a47fe584026e251871e4e5940987bf29436754c1fb177446d"
/// );
/// ```
pub fn resource_name(key: &str) -> String {
    let digest = Sha256::digest(key.as_bytes());
    let mut name = String::with_capacity(RESOURCE_PREFIX.len() + 64);
    name.push_str(RESOURCE_PREFIX);
    for byte in digest {
        let _ = write!(name, "{byte:02x}");
    }
    name
}

/// The `@LockTimeout` for a wait: milliseconds, `-1` for no limit (`Duration::MAX`), capped at
/// `i32::MAX` milliseconds (about 24.8 days) otherwise.
pub(crate) fn lock_timeout_ms(wait: Duration) -> i32 {
    if wait == Duration::MAX {
        return -1;
    }
    i32::try_from(wait.as_millis()).unwrap_or(i32::MAX)
}

/// The `sp_getapplock` call for `resource`.
pub(crate) fn getapplock_call(resource: &str, owner: Owner, timeout_ms: i32) -> Call {
    Call {
        sql: match owner {
            Owner::Session => GETAPPLOCK_SESSION_SQL,
            Owner::Transaction => GETAPPLOCK_TRANSACTION_SQL,
        },
        params: vec![Param::NVarChar(resource.to_owned()), Param::Int(timeout_ms)],
    }
}

/// The `sp_getapplock` call for a session lock on `resource` in `mode`.
pub(crate) fn getapplock_session_call(resource: &str, mode: Mode, timeout_ms: i32) -> Call {
    match mode {
        Mode::Exclusive => getapplock_call(resource, Owner::Session, timeout_ms),
        Mode::Shared => Call {
            sql: GETAPPLOCK_SESSION_SHARED_SQL,
            params: vec![Param::NVarChar(resource.to_owned()), Param::Int(timeout_ms)],
        },
    }
}

/// The fenced `sp_getapplock` call for a session lock on `resource` in `mode`: the lock and,
/// if it is granted, its next fencing token ([`GETAPPLOCK_FENCED_SQL`],
/// [`GETAPPLOCK_FENCED_SHARED_SQL`]).
pub(crate) fn getapplock_fenced_call(resource: &str, mode: Mode, timeout_ms: i32) -> Call {
    Call {
        sql: match mode {
            Mode::Exclusive => GETAPPLOCK_FENCED_SQL,
            Mode::Shared => GETAPPLOCK_FENCED_SHARED_SQL,
        },
        params: vec![Param::NVarChar(resource.to_owned()), Param::Int(timeout_ms)],
    }
}

/// The fencing table check ([`FENCING_TABLE_CHECK_SQL`]).
pub(crate) fn fencing_table_check_call() -> Call {
    Call {
        sql: FENCING_TABLE_CHECK_SQL,
        params: Vec::new(),
    }
}

/// Creating the fencing table ([`FENCING_TABLE_SQL`]).
pub(crate) fn fencing_table_call() -> Call {
    Call {
        sql: FENCING_TABLE_SQL,
        params: Vec::new(),
    }
}

/// Reads the answer of a fenced `sp_getapplock` call: its return code (as
/// [`getapplock_result`]) and the token issued with a grant. A grant must carry a positive
/// token; a grant without one is an error (the caller gives the lock back), and a token beside
/// a refusal is ignored.
pub(crate) fn fenced_result(
    code: Option<i32>,
    token: Option<i64>,
    key: &str,
) -> Result<Option<u64>, LockError> {
    match getapplock_result(code, key)? {
        Grant::TimedOut => Ok(None),
        Grant::Granted => match token.and_then(|t| u64::try_from(t).ok()).filter(|t| *t > 0) {
            Some(token) => Ok(Some(token)),
            None => Err(LockError::backend(
                NAME,
                format!(
                    "sp_getapplock granted the lock, but the fencing counter in dlock_fencing \
                     answered {token:?} instead of a positive token; the lock was given back"
                ),
                None,
                None,
            )),
        },
    }
}

/// The error for a fencing table this user can see but lacks a privilege on.
pub(crate) fn fencing_privilege_error() -> LockError {
    LockError::config(format!(
        "fencing=true: this user lacks a privilege the table dlock_fencing needs (all three of \
         SELECT, INSERT and UPDATE); an administrator grants them: {FENCING_GRANTS}"
    ))
}

/// The error for a fencing table this user neither sees nor may create.
pub(crate) fn fencing_create_error(message: &str) -> LockError {
    LockError::config(format!(
        "fencing=true needs the table dlock_fencing, which this user does not see and may not \
         create ({message}); an administrator creates it and grants it: {FENCING_GRANTS}"
    ))
}

/// The `sp_releaseapplock` call for a session lock on `resource`.
pub(crate) fn releaseapplock_call(resource: &str) -> Call {
    Call {
        sql: RELEASEAPPLOCK_SESSION_SQL,
        params: vec![Param::NVarChar(resource.to_owned())],
    }
}

/// The keepalive statement.
pub(crate) fn keepalive_call() -> Call {
    Call {
        sql: KEEPALIVE_SQL,
        params: Vec::new(),
    }
}

/// What an `sp_getapplock` return code means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Grant {
    /// 0 (granted at once) or 1 (granted after waiting).
    Granted,
    /// -1: the timeout ran out with the lock held elsewhere.
    TimedOut,
}

/// Maps an `sp_getapplock` return code. -1 is contention ([`Grant::TimedOut`]); the caller
/// turns it into `AlreadyHeld` or `Timeout`. Every other failure is an error that carries the
/// code in its message and as its `db_code`.
pub(crate) fn getapplock_result(code: Option<i32>, key: &str) -> Result<Grant, LockError> {
    match code {
        Some(0 | 1) => Ok(Grant::Granted),
        Some(-1) => Ok(Grant::TimedOut),
        Some(-2) => {
            tracing::debug!(
                backend = NAME,
                code = -2,
                "sp_getapplock returned -2: the lock request was canceled"
            );
            Err(LockError::Canceled {
                key: Arc::from(key),
            })
        }
        Some(-3) => Err(LockError::backend(
            NAME,
            "sp_getapplock returned -3: the lock request was chosen as a deadlock victim; \
             retry the acquisition",
            Some("-3".to_owned()),
            None,
        )),
        Some(-999) => Err(LockError::backend(
            NAME,
            "sp_getapplock returned -999: parameter validation or another call error \
             (for a transaction-bound lock: is a transaction open on this connection?)",
            Some("-999".to_owned()),
            None,
        )),
        Some(other) => Err(LockError::backend(
            NAME,
            format!("sp_getapplock returned the unexpected code {other}"),
            Some(other.to_string()),
            None,
        )),
        None => Err(LockError::backend(
            NAME,
            "sp_getapplock returned no result",
            None,
            None,
        )),
    }
}

/// Maps an `sp_releaseapplock` return code: 0 released; -999 (not held, or a parameter error)
/// and anything else are errors with the code.
pub(crate) fn releaseapplock_result(code: Option<i32>) -> Result<(), LockError> {
    match code {
        Some(0) => Ok(()),
        Some(other) => Err(LockError::backend(
            NAME,
            format!("sp_releaseapplock returned {other}"),
            Some(other.to_string()),
            None,
        )),
        None => Err(LockError::backend(
            NAME,
            "sp_releaseapplock returned no result",
            None,
            None,
        )),
    }
}

/// The error for a server error (an error token) while doing `what`: its number is the
/// `db_code`; the message says what to do for the ones with a known remedy.
pub(crate) fn server_error(what: &str, number: u32, message: &str) -> LockError {
    let hint = match number {
        DEADLOCK_ERROR => "; the session was chosen as deadlock victim, retry the acquisition",
        18456 => "; login failed: check the user name and password",
        4060 => "; the database cannot be opened: check the database name and the user's access",
        229 | 230 => {
            "; permission denied: the user needs EXECUTE on sp_getapplock and sp_releaseapplock (granted to public by default)"
        }
        _ => "",
    };
    LockError::backend(
        NAME,
        format!("{what}: server error {number}: {message}{hint}"),
        Some(number.to_string()),
        None,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn session_getapplock_statement_and_parameters() {
        let call = getapplock_call("dlock:ab", Owner::Session, 0);
        assert_eq!(
            call.sql,
            "DECLARE @r int; EXEC @r = sp_getapplock @Resource = @P1, @LockMode = 'Exclusive', \
             @LockOwner = 'Session', @LockTimeout = @P2, @DbPrincipal = 'public'; SELECT @r;"
        );
        assert_eq!(
            call.params,
            vec![Param::NVarChar("dlock:ab".into()), Param::Int(0)]
        );
    }

    #[test]
    fn shared_session_getapplock_statement_and_parameters() {
        let call = getapplock_session_call("dlock:ab", Mode::Shared, 250);
        assert_eq!(
            call.sql,
            "DECLARE @r int; EXEC @r = sp_getapplock @Resource = @P1, @LockMode = 'Shared', \
             @LockOwner = 'Session', @LockTimeout = @P2, @DbPrincipal = 'public'; SELECT @r;"
        );
        assert_eq!(
            call.params,
            vec![Param::NVarChar("dlock:ab".into()), Param::Int(250)]
        );
        assert_eq!(
            getapplock_session_call("dlock:ab", Mode::Exclusive, 250),
            getapplock_call("dlock:ab", Owner::Session, 250)
        );
    }

    #[test]
    fn shared_fenced_getapplock_statement_and_parameters() {
        let call = getapplock_fenced_call("dlock:ab", Mode::Shared, 0);
        assert_eq!(
            call.sql,
            "DECLARE @r int, @t bigint; \
             EXEC @r = sp_getapplock @Resource = @P1, @LockMode = 'Shared', \
             @LockOwner = 'Session', @LockTimeout = @P2, @DbPrincipal = 'public'; \
             IF @r >= 0 \
             BEGIN \
             BEGIN TRY \
             EXEC sp_executesql N'UPDATE dlock_fencing SET @t = token = token + 1 WHERE resource = @n; \
             IF @@ROWCOUNT = 0 BEGIN INSERT INTO dlock_fencing (resource, token) VALUES (@n, 1); \
             SET @t = 1; END', N'@n nvarchar(255), @t bigint OUTPUT', @n = @P1, @t = @t OUTPUT; \
             END TRY \
             BEGIN CATCH \
             EXEC sp_releaseapplock @Resource = @P1, @LockOwner = 'Session', @DbPrincipal = 'public'; \
             THROW; \
             END CATCH; \
             END; \
             SELECT @r, @t;"
        );
        assert_eq!(
            call.params,
            vec![Param::NVarChar("dlock:ab".into()), Param::Int(0)]
        );
        // The same counter (and the same table row) as the exclusive lock's.
        assert_eq!(
            call.sql.replace("'Shared'", "'Exclusive'"),
            getapplock_fenced_call("dlock:ab", Mode::Exclusive, 0).sql
        );
    }

    #[test]
    fn transaction_getapplock_statement_and_parameters() {
        let call = getapplock_call("dlock:cd", Owner::Transaction, 2500);
        assert_eq!(
            call.sql,
            "DECLARE @r int; EXEC @r = sp_getapplock @Resource = @P1, @LockMode = 'Exclusive', \
             @LockOwner = 'Transaction', @LockTimeout = @P2, @DbPrincipal = 'public'; SELECT @r;"
        );
        assert_eq!(
            call.params,
            vec![Param::NVarChar("dlock:cd".into()), Param::Int(2500)]
        );
    }

    #[test]
    fn release_and_keepalive_statements() {
        let call = releaseapplock_call("dlock:ef");
        assert_eq!(
            call.sql,
            "DECLARE @r int; EXEC @r = sp_releaseapplock @Resource = @P1, @LockOwner = 'Session', \
             @DbPrincipal = 'public'; SELECT @r;"
        );
        assert_eq!(call.params, vec![Param::NVarChar("dlock:ef".into())]);
        assert_eq!(keepalive_call().sql, "SELECT 1");
        assert!(keepalive_call().params.is_empty());
    }

    #[test]
    fn fenced_getapplock_statement_and_parameters() {
        let call = getapplock_fenced_call("dlock:ab", Mode::Exclusive, 1500);
        assert_eq!(
            call.sql,
            "DECLARE @r int, @t bigint; \
             EXEC @r = sp_getapplock @Resource = @P1, @LockMode = 'Exclusive', \
             @LockOwner = 'Session', @LockTimeout = @P2, @DbPrincipal = 'public'; \
             IF @r >= 0 \
             BEGIN \
             BEGIN TRY \
             EXEC sp_executesql N'UPDATE dlock_fencing SET @t = token = token + 1 WHERE resource = @n; \
             IF @@ROWCOUNT = 0 BEGIN INSERT INTO dlock_fencing (resource, token) VALUES (@n, 1); \
             SET @t = 1; END', N'@n nvarchar(255), @t bigint OUTPUT', @n = @P1, @t = @t OUTPUT; \
             END TRY \
             BEGIN CATCH \
             EXEC sp_releaseapplock @Resource = @P1, @LockOwner = 'Session', @DbPrincipal = 'public'; \
             THROW; \
             END CATCH; \
             END; \
             SELECT @r, @t;"
        );
        assert_eq!(
            call.params,
            vec![Param::NVarChar("dlock:ab".into()), Param::Int(1500)]
        );
        // The counter is touched only under `IF @r >= 0` (0 and 1 are the grants), and the
        // key only ever travels as the bound resource name.
        assert!(call.sql.contains("IF @r >= 0 BEGIN BEGIN TRY"));
        let key = "'; DROP TABLE dlock_fencing; --";
        let call = getapplock_fenced_call(&resource_name(key), Mode::Exclusive, 0);
        assert!(!call.sql.contains("DROP"));
        assert_eq!(call.params[0], Param::NVarChar(resource_name(key)));
        // The counter's key column holds every resource name.
        assert!(resource_name(key).len() <= 255);
    }

    #[test]
    fn fencing_table_statements() {
        let check = fencing_table_check_call();
        assert_eq!(
            check.sql,
            "SELECT CAST(CASE WHEN OBJECT_ID(N'dlock_fencing', N'U') IS NULL THEN 0 ELSE 1 END AS int), \
             CAST(ISNULL(HAS_PERMS_BY_NAME(N'dlock_fencing', N'OBJECT', N'SELECT') \
             & HAS_PERMS_BY_NAME(N'dlock_fencing', N'OBJECT', N'INSERT') \
             & HAS_PERMS_BY_NAME(N'dlock_fencing', N'OBJECT', N'UPDATE'), 0) AS int)"
        );
        assert!(check.params.is_empty());
        let create = fencing_table_call();
        assert_eq!(
            create.sql,
            "CREATE TABLE dlock_fencing (resource nvarchar(255) NOT NULL PRIMARY KEY, token bigint NOT NULL)"
        );
        assert!(create.params.is_empty());
        let err = fencing_privilege_error().to_string();
        assert!(
            err.contains("GRANT SELECT, INSERT, UPDATE ON dbo.dlock_fencing TO <user>"),
            "{err}"
        );
        let err = fencing_create_error("CREATE TABLE permission denied").to_string();
        assert!(err.contains("CREATE TABLE dbo.dlock_fencing"), "{err}");
        assert!(err.contains("CREATE TABLE permission denied"), "{err}");
    }

    #[test]
    fn fenced_results() {
        assert_eq!(fenced_result(Some(0), Some(1), "k").unwrap(), Some(1));
        assert_eq!(fenced_result(Some(1), Some(42), "k").unwrap(), Some(42));
        // Not granted: no token, whatever the second column says.
        assert_eq!(fenced_result(Some(-1), None, "k").unwrap(), None);
        assert_eq!(fenced_result(Some(-1), Some(9), "k").unwrap(), None);
        // A grant without a positive token is an error, never a lock without its token.
        for token in [None, Some(0), Some(-5)] {
            let err = fenced_result(Some(0), token, "k").unwrap_err();
            assert_eq!(err.code(), "DistributedLock.BackendError", "{token:?}");
            assert!(err.to_string().contains("given back"), "{err}");
        }
        // Refusals map as for the plain call.
        assert!(matches!(
            fenced_result(Some(-2), None, "k"),
            Err(LockError::Canceled { .. })
        ));
        assert_eq!(
            fenced_result(Some(-3), None, "k").unwrap_err().db_code(),
            Some("-3")
        );
    }

    #[test]
    fn statements_never_contain_the_key() {
        // Keys travel only as bound parameters, and only as their digest.
        let key = "'; DROP TABLE t; --";
        let call = getapplock_call(&resource_name(key), Owner::Session, 0);
        assert!(!call.sql.contains("DROP"));
        assert_eq!(call.params[0], Param::NVarChar(resource_name(key)));
    }

    #[test]
    fn lock_timeouts() {
        assert_eq!(lock_timeout_ms(Duration::ZERO), 0);
        assert_eq!(lock_timeout_ms(Duration::from_micros(1500)), 1);
        assert_eq!(lock_timeout_ms(Duration::from_secs(30)), 30_000);
        assert_eq!(lock_timeout_ms(Duration::MAX), -1);
        assert_eq!(lock_timeout_ms(Duration::from_secs(30 * 86_400)), i32::MAX);
        assert_eq!(lock_timeout_ms(MAX_WAIT), 30_000);
    }

    #[test]
    fn resource_names_are_pinned() {
        assert_eq!(
            resource_name("account:42"),
            "dlock:38dbcc9b3c91186a47fe584026e251871e4e5940987bf29436754c1fb177446d"
        );
        let long = "x".repeat(10_000);
        assert_eq!(resource_name(&long).len(), 70);
        assert_eq!(resource_name("a"), resource_name("a"));
    }

    #[test]
    fn resource_names_fit_and_survive_collations() {
        for key in ["a", "A", "ключ", "\0", &"é".repeat(300)] {
            let name = resource_name(key);
            assert!(name.len() <= 255);
            assert!(name.is_ascii());
            // Lowercase only: a case-insensitive collation cannot merge two names.
            assert_eq!(name, name.to_ascii_lowercase());
        }
    }

    #[test]
    fn distinct_keys_get_distinct_resources() {
        let long_a = format!("{}a", "k".repeat(300));
        let long_b = format!("{}b", "k".repeat(300));
        let keys = [
            "jobs:billing",
            "JOBS:BILLING",
            "Jobs:Billing",
            "a",
            "a\0",
            "a\0b",
            "\0",
            "é",        // precomposed
            "e\u{301}", // decomposed: a different key
            "ß",
            "ss",
            "İ",
            "i",
            "dlock:a",
            " a",
            "a ",
            long_a.as_str(),
            long_b.as_str(),
        ];
        let mut names = std::collections::HashSet::new();
        for key in keys {
            // Compare the way a case-insensitive collation would.
            assert!(
                names.insert(resource_name(key).to_lowercase()),
                "{key:?} collides"
            );
        }
    }

    #[test]
    fn every_getapplock_code() {
        assert_eq!(getapplock_result(Some(0), "k").unwrap(), Grant::Granted);
        assert_eq!(getapplock_result(Some(1), "k").unwrap(), Grant::Granted);
        assert_eq!(getapplock_result(Some(-1), "k").unwrap(), Grant::TimedOut);
        let canceled = getapplock_result(Some(-2), "k").unwrap_err();
        assert!(matches!(&canceled, LockError::Canceled { key } if &**key == "k"));
        for (code, words) in [
            (-3, "deadlock victim"),
            (-999, "parameter validation"),
            (-7, "unexpected code -7"),
        ] {
            let err = getapplock_result(Some(code), "k").unwrap_err();
            assert_eq!(err.code(), "DistributedLock.BackendError");
            assert_eq!(err.db_code(), Some(code.to_string().as_str()));
            let text = err.to_string();
            assert!(text.contains(&code.to_string()), "{text}");
            assert!(text.contains(words), "{text}");
        }
        let none = getapplock_result(None, "k").unwrap_err();
        assert_eq!(none.code(), "DistributedLock.BackendError");
    }

    #[test]
    fn every_releaseapplock_code() {
        assert!(releaseapplock_result(Some(0)).is_ok());
        let err = releaseapplock_result(Some(-999)).unwrap_err();
        assert_eq!(err.db_code(), Some("-999"));
        assert!(err.to_string().contains("-999"));
        assert!(releaseapplock_result(None).is_err());
    }

    #[test]
    fn server_errors() {
        let err = server_error("taking a lock", 1205, "Transaction was deadlocked");
        assert_eq!(err.db_code(), Some("1205"));
        assert!(err.to_string().contains("deadlock victim"));
        let err = server_error("connecting", 18456, "Login failed for user 'app'.");
        assert!(err.to_string().contains("check the user name and password"));
        let err = server_error("taking a lock", 229, "The EXECUTE permission was denied");
        assert!(err.to_string().contains("EXECUTE on sp_getapplock"));
        let err = server_error("taking a lock", 50000, "custom");
        assert_eq!(err.db_code(), Some("50000"));
        assert!(err.to_string().contains("custom"));
    }

    /// The words of a batch, for its structure: `BEGIN`s (but `BEGIN TRAN`) and `END`s pair
    /// up, and so do `BEGIN TRAN` and `COMMIT`.
    fn balanced(sql: &str) -> bool {
        let words: Vec<&str> = sql
            .split(|c: char| !c.is_ascii_alphanumeric() && c != '_')
            .filter(|w| !w.is_empty())
            .collect();
        let mut depth = 0i32;
        for (at, word) in words.iter().enumerate() {
            match *word {
                "BEGIN" if words.get(at + 1) == Some(&"TRAN") => {}
                "BEGIN" => depth += 1,
                "END" => depth -= 1,
                _ => {}
            }
            if depth < 0 {
                return false;
            }
        }
        depth == 0 && sql.matches("BEGIN TRAN;").count() == sql.matches("COMMIT;").count()
    }

    /// The permit batches, pinned word for word (SQL Server cannot run here: these are what
    /// the live suite, `tests/mssql.rs` with `DLOCK_MSSQL_URL`, runs), with their structure
    /// and parameters checked.
    #[test]
    fn permit_batches_are_pinned() {
        assert_eq!(
            PERMIT_SQL,
            "SET XACT_ABORT ON; DECLARE @r int, @g int, @i int = 0, @s int, @j int, @name \
            nvarchar(255), @got int = -1, @rec int = 0, @took int = 0, @t bigint = NULL; BEGIN \
            TRAN; SET @name = @P1 + N':gate'; EXEC @g = sp_getapplock @Resource = @name, \
            @LockMode = 'Exclusive', @LockOwner = 'Transaction', @LockTimeout = @P6, \
            @DbPrincipal = 'public'; IF @g >= 0 BEGIN SET @j = 0; WHILE @j < 11 BEGIN SET \
            @name = @P1 + N':count:' + CAST(@j AS nvarchar(2)); IF APPLOCK_MODE('public', \
            @name, 'Session') <> 'NoLock' OR APPLOCK_TEST('public', @name, 'Exclusive', \
            'Session') = 0 SET @rec = @rec | POWER(2, @j); SET @j = @j + 1; END; IF (@rec = 0 \
            OR @rec = @P2) AND (@P5 = 1 OR (APPLOCK_MODE('public', @P4, 'Session') = 'NoLock' \
            AND APPLOCK_TEST('public', @P4, 'Exclusive', 'Session') = 1)) BEGIN WHILE @i < @P2 \
            AND @got < 0 BEGIN SET @s = (@P3 + @i) % @P2; SET @name = @P1 + N':' + CAST(@s AS \
            nvarchar(10)); IF APPLOCK_MODE('public', @name, 'Session') = 'NoLock' BEGIN EXEC \
            @r = sp_getapplock @Resource = @name, @LockMode = 'Exclusive', @LockOwner = \
            'Session', @LockTimeout = 0, @DbPrincipal = 'public'; IF @r >= 0 SET @got = @s; \
            END; SET @i = @i + 1; END; IF @got >= 0 BEGIN SET @j = 0; WHILE @j < 11 BEGIN IF \
            (@P2 & POWER(2, @j)) <> 0 BEGIN SET @name = @P1 + N':count:' + CAST(@j AS \
            nvarchar(2)); EXEC @r = sp_getapplock @Resource = @name, @LockMode = 'Shared', \
            @LockOwner = 'Session', @LockTimeout = 0, @DbPrincipal = 'public'; IF @r >= 0 SET \
            @took = @took | POWER(2, @j); END; SET @j = @j + 1; END; IF @took <> @P2 BEGIN SET \
            @j = 0; WHILE @j < 11 BEGIN IF (@took & POWER(2, @j)) <> 0 BEGIN SET @name = @P1 + \
            N':count:' + CAST(@j AS nvarchar(2)); EXEC sp_releaseapplock @Resource = @name, \
            @LockOwner = 'Session', @DbPrincipal = 'public'; END; SET @j = @j + 1; END; SET \
            @name = @P1 + N':' + CAST(@got AS nvarchar(10)); EXEC sp_releaseapplock @Resource \
            = @name, @LockOwner = 'Session', @DbPrincipal = 'public'; SET @got = -1; END; END; \
            IF @got >= 0 BEGIN SET @t = NULL; END; END; END; COMMIT; SET XACT_ABORT OFF; \
            SELECT @g, @got, @rec, @t;"
        );
        // The fenced batch differs in its fence alone.
        assert_eq!(
            PERMIT_SQL.replace(
                "IF @got >= 0 BEGIN SET @t = NULL; END;",
                "IF @got >= 0 BEGIN UPDATE dlock_fencing SET @t = token = token + 1 WHERE \
                 resource = @P1; IF @@ROWCOUNT = 0 BEGIN INSERT INTO dlock_fencing (resource, \
                 token) VALUES (@P1, 1); SET @t = 1; END; END;"
            ),
            PERMIT_FENCED_SQL
        );
        assert_eq!(
            PERMIT_RELEASE_SQL,
            "DECLARE @j int = 0, @name nvarchar(255); SET @name = @P1 + N':' + CAST(@P2 AS \
            nvarchar(10)); IF APPLOCK_MODE('public', @name, 'Session') <> 'NoLock' EXEC \
            sp_releaseapplock @Resource = @name, @LockOwner = 'Session', @DbPrincipal = \
            'public'; WHILE @j < 11 BEGIN IF (@P3 & POWER(2, @j)) <> 0 BEGIN SET @name = @P1 + \
            N':count:' + CAST(@j AS nvarchar(2)); IF APPLOCK_MODE('public', @name, 'Session') \
            <> 'NoLock' EXEC sp_releaseapplock @Resource = @name, @LockOwner = 'Session', \
            @DbPrincipal = 'public'; END; SET @j = @j + 1; END; SELECT 0;"
        );
        assert_eq!(
            PERMIT_COUNT_SQL,
            "DECLARE @i int = 0, @j int = 0, @n int = 0, @rec int = 0, @name nvarchar(255); \
            WHILE @i < @P2 BEGIN SET @name = @P1 + N':' + CAST(@i AS nvarchar(10)); IF \
            APPLOCK_MODE('public', @name, 'Session') <> 'NoLock' OR APPLOCK_TEST('public', \
            @name, 'Exclusive', 'Session') = 0 SET @n = @n + 1; SET @i = @i + 1; END; WHILE @j \
            < 11 BEGIN SET @name = @P1 + N':count:' + CAST(@j AS nvarchar(2)); IF \
            APPLOCK_MODE('public', @name, 'Session') <> 'NoLock' OR APPLOCK_TEST('public', \
            @name, 'Exclusive', 'Session') = 0 SET @rec = @rec | POWER(2, @j); SET @j = @j + \
            1; END; SELECT @n, @rec;"
        );
        for (sql, params) in [
            (PERMIT_SQL, 6),
            (PERMIT_FENCED_SQL, 6),
            (PERMIT_RELEASE_SQL, 3),
            (PERMIT_COUNT_SQL, 2),
        ] {
            assert!(balanced(sql), "unbalanced: {sql}");
            for n in 1..=params {
                assert!(sql.contains(&format!("@P{n}")), "@P{n} in {sql}");
            }
            assert!(!sql.contains(&format!("@P{}", params + 1)), "{sql}");
        }
        // The count record is read and held over the 11 bits of the largest count.
        assert_eq!(MAX_PERMITS, 1 << 10);
        assert_eq!(PERMIT_SQL.matches("WHILE @j < 11").count(), 3);
    }

    #[test]
    fn permit_calls_bind_their_parameters() {
        let base = semaphore_base("exports");
        assert_eq!(
            base,
            "dlock-sem:4b4e49dd2de5eae9881688638d7453803ea88b3721146b8f97a5508b5b5c6aa5"
        );
        // The longest name: a slot or a count bit, within the 255 characters of a resource.
        assert!(base.len() + ":count:10".len() <= 255 && base.len() + ":1023".len() <= 255);
        assert!(
            !base.starts_with(RESOURCE_PREFIX),
            "never a lock's resource"
        );
        let call = permit_call(&base, 3, 2, "dlock:q", true, Duration::from_secs(10), false);
        assert_eq!(call.sql, PERMIT_SQL);
        assert_eq!(
            call.params,
            vec![
                Param::NVarChar(base.clone()),
                Param::Int(3),
                Param::Int(2),
                Param::NVarChar("dlock:q".into()),
                Param::Int(1),
                Param::Int(10_000),
            ]
        );
        let fenced = permit_call(&base, 1024, 0, "dlock:q", false, Duration::MAX, true);
        assert_eq!(fenced.sql, PERMIT_FENCED_SQL);
        assert_eq!(fenced.params[1], Param::Int(1024));
        assert_eq!(fenced.params[4], Param::Int(0));
        // The gate's wait is the statement's bound (`statement_timeout`, which the client
        // keeps anyway): -1, no limit of the server's own, for `Duration::MAX`.
        assert_eq!(fenced.params[5], Param::Int(-1));
        assert_eq!(
            permit_release_call(&base, 7, 3).params,
            vec![Param::NVarChar(base.clone()), Param::Int(7), Param::Int(3)]
        );
        assert_eq!(
            permit_count_call(&base, 3).params,
            vec![Param::NVarChar(base), Param::Int(3)]
        );
    }
}
