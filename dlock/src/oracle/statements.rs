//! The Oracle backend's statements, as plain data: PL/SQL blocks, their parameters, and what
//! their return codes mean.

use std::time::Duration;

use crate::LockError;
use crate::session::Mode;

/// The backend's name.
pub(super) const NAME: &str = "oracle";

/// `DBMS_LOCK.MAXWAIT`: a `timeout` of this many seconds waits without limit.
pub(super) const MAXWAIT_SECS: i64 = 32767;

/// The highest id of the range `DBMS_LOCK` leaves to applications.
pub(super) const MAX_USER_ID: i64 = 1_073_741_823;

/// `DBMS_LOCK.REQUEST` in exclusive mode, held by the session.
pub(super) const REQUEST_SESSION_SQL: &str = "BEGIN :1 := DBMS_LOCK.REQUEST(id => :2, \
lockmode => DBMS_LOCK.X_MODE, timeout => :3, release_on_commit => FALSE); END;";

/// `DBMS_LOCK.REQUEST` in shared mode (`S_MODE`, 4: a read lock), held by the session.
pub(super) const REQUEST_SESSION_SHARED_SQL: &str = "BEGIN :1 := DBMS_LOCK.REQUEST(id => :2, \
lockmode => DBMS_LOCK.S_MODE, timeout => :3, release_on_commit => FALSE); END;";

/// `DBMS_LOCK.REQUEST` in exclusive mode, released at commit or rollback.
pub(super) const REQUEST_TRANSACTION_SQL: &str = "BEGIN :1 := DBMS_LOCK.REQUEST(id => :2, \
lockmode => DBMS_LOCK.X_MODE, timeout => :3, release_on_commit => TRUE); END;";

/// `DBMS_LOCK.REQUEST` in exclusive mode, held by the session, that, only when the lock is
/// granted, increments its fencing counter and commits it, in the same block (one round
/// trip). `:1` lock id, `:2` timeout (IN); `:3` return code, `:4` token (OUT, `NULL` when not
/// granted). Each bind appears once, in the order of its number, so binding by position is
/// unambiguous. A failure after the grant rolls the counter back, gives the lock back, and
/// raises the error again: no lock is kept without its token. The session lock survives the
/// `COMMIT` (`release_on_commit => FALSE`), and a committed token is never issued again, also
/// across server restarts.
pub(super) const REQUEST_FENCED_SQL: &str = "DECLARE k INTEGER := :1; r INTEGER; t NUMBER; \
BEGIN \
r := DBMS_LOCK.REQUEST(id => k, lockmode => DBMS_LOCK.X_MODE, timeout => :2, release_on_commit => FALSE); \
IF r = 0 THEN \
BEGIN \
UPDATE dlock_fencing SET token = token + 1 WHERE id = k RETURNING token INTO t; \
IF SQL%ROWCOUNT = 0 THEN INSERT INTO dlock_fencing (id, token) VALUES (k, 1); t := 1; END IF; \
COMMIT; \
EXCEPTION WHEN OTHERS THEN \
ROLLBACK; \
r := DBMS_LOCK.RELEASE(id => k); \
RAISE; \
END; \
END IF; \
:3 := r; \
:4 := t; \
END;";

/// [`REQUEST_FENCED_SQL`] in shared mode (`S_MODE`, a read lock): the token comes from the
/// same counter as the exclusive lock's, so a writer's token exceeds every reader's before it.
pub(super) const REQUEST_FENCED_SHARED_SQL: &str = "DECLARE k INTEGER := :1; r INTEGER; t NUMBER; \
BEGIN \
r := DBMS_LOCK.REQUEST(id => k, lockmode => DBMS_LOCK.S_MODE, timeout => :2, release_on_commit => FALSE); \
IF r = 0 THEN \
BEGIN \
UPDATE dlock_fencing SET token = token + 1 WHERE id = k RETURNING token INTO t; \
IF SQL%ROWCOUNT = 0 THEN INSERT INTO dlock_fencing (id, token) VALUES (k, 1); t := 1; END IF; \
COMMIT; \
EXCEPTION WHEN OTHERS THEN \
ROLLBACK; \
r := DBMS_LOCK.RELEASE(id => k); \
RAISE; \
END; \
END IF; \
:3 := r; \
:4 := t; \
END;";

/// Whether the fencing table can be read (it exists, and this user sees it): fails with
/// ORA-00942 otherwise.
pub(super) const FENCING_TABLE_CHECK_SQL: &str = "SELECT COUNT(*) FROM dlock_fencing WHERE 1 = 0";
/// Whether this user may update the fencing table (checked when parsed; touches no row).
pub(super) const FENCING_UPDATE_CHECK_SQL: &str =
    "UPDATE dlock_fencing SET token = token WHERE 1 = 0";
/// Whether this user may insert into the fencing table (checked when parsed; inserts nothing).
pub(super) const FENCING_INSERT_CHECK_SQL: &str =
    "INSERT INTO dlock_fencing (id, token) SELECT 0, 0 FROM DUAL WHERE 1 = 0";
/// Creates the fencing table: one counter row per `DBMS_LOCK` id.
pub(super) const FENCING_TABLE_SQL: &str =
    "CREATE TABLE dlock_fencing (id NUMBER(10) PRIMARY KEY, token NUMBER(19) NOT NULL)";
/// What an administrator runs for a user that may not create the fencing table.
pub(super) const FENCING_GRANTS: &str = "CREATE TABLE <owner>.dlock_fencing (id NUMBER(10) PRIMARY KEY, \
token NUMBER(19) NOT NULL); GRANT SELECT, INSERT, UPDATE ON <owner>.dlock_fencing TO <user>; \
CREATE SYNONYM <user>.dlock_fencing FOR <owner>.dlock_fencing";

/// ORA-00942: table or view does not exist (or is out of this user's sight).
pub(super) const NO_TABLE_ERROR: &str = "ORA-00942";
/// ORA-00955: name is already used by an existing object.
pub(super) const NAME_USED_ERROR: &str = "ORA-00955";
/// ORA-01031: insufficient privileges.
pub(super) const NO_PRIVILEGE_ERROR: &str = "ORA-01031";

// Semaphores (see the module docs, Semaphores). A semaphore of `n` permits (at most
// [`MAX_PERMITS`]) is a family of `DBMS_LOCK` ids computed from its base `b` (a 30-bit hash of
// the key): `lock_of(x) = (b + x × 2654435761) mod 2^30`, distinct for every `x` of one
// semaphore (2654435761 is odd). Slots are `x` = 0 to `n - 1`, held in `X_MODE`; the count
// record is `x` = 1024 + `j`, held in `S_MODE` for each bit `j` set in `n` (Oracle lists no
// locks without `SELECT` on `V$LOCK`, so the record is read bit by bit); the gate, which
// tries of one semaphore hold one block each, is `x` = 1100.

/// The most permits a semaphore may have here: a try that finds the semaphore full asks for
/// each slot in turn, in one block; 1,024 is the 11 bits of the count record.
pub(super) const MAX_PERMITS: u32 = 1024;

/// The declarations of the semaphore blocks: `lock_of`, and `held`, whether a session (this
/// one included) holds a lock (an `X_MODE` request with no wait: 1 held elsewhere, 4 held
/// here, 0 free and given back at once).
macro_rules! semaphore_functions {
    () => {
        "FUNCTION lock_of(x NUMBER) RETURN INTEGER IS \
BEGIN RETURN MOD(b + MOD(x * 2654435761, 1073741824), 1073741824); END; \
FUNCTION held(k INTEGER) RETURN BOOLEAN IS c INTEGER; \
BEGIN \
c := DBMS_LOCK.REQUEST(id => k, lockmode => DBMS_LOCK.X_MODE, timeout => 0, release_on_commit => FALSE); \
IF c = 0 THEN c := DBMS_LOCK.RELEASE(id => k); RETURN FALSE; END IF; \
RETURN c IN (1, 4); \
END; "
    };
}

/// One try for a permit, with `$fence` run once a slot is taken (under the gate).
macro_rules! permit_block {
    ($fence:literal) => {
        concat!(
            "DECLARE b NUMBER := :1; n NUMBER := :2; first_ NUMBER := :3; q INTEGER := :4; \
waiting NUMBER := :5; gate_wait NUMBER := :6; \
g INTEGER; r INTEGER; k INTEGER; i NUMBER := 0; s NUMBER; got NUMBER := -1; rec NUMBER := 0; \
took NUMBER := 0; fresh NUMBER := 0; t NUMBER; ",
            semaphore_functions!(),
            "BEGIN \
g := DBMS_LOCK.REQUEST(id => lock_of(1100), lockmode => DBMS_LOCK.X_MODE, timeout => gate_wait, \
release_on_commit => FALSE); \
IF g IN (0, 4) THEN \
BEGIN \
FOR j IN 0 .. 10 LOOP \
IF held(lock_of(1024 + j)) THEN rec := rec + POWER(2, j); END IF; \
END LOOP; \
IF (rec = 0 OR rec = n) AND (waiting = 1 OR NOT held(q)) THEN \
WHILE i < n AND got < 0 LOOP \
s := MOD(first_ + i, n); \
r := DBMS_LOCK.REQUEST(id => lock_of(s), lockmode => DBMS_LOCK.X_MODE, timeout => 0, \
release_on_commit => FALSE); \
IF r = 0 THEN got := s; END IF; \
i := i + 1; \
END LOOP; \
IF got >= 0 THEN \
FOR j IN 0 .. 10 LOOP \
IF BITAND(n, POWER(2, j)) <> 0 THEN \
r := DBMS_LOCK.REQUEST(id => lock_of(1024 + j), lockmode => DBMS_LOCK.S_MODE, timeout => 0, \
release_on_commit => FALSE); \
IF r IN (0, 4) THEN took := took + POWER(2, j); END IF; \
IF r = 0 THEN fresh := fresh + POWER(2, j); END IF; \
END IF; \
END LOOP; \
IF took <> n THEN \
FOR j IN 0 .. 10 LOOP \
IF BITAND(fresh, POWER(2, j)) <> 0 THEN r := DBMS_LOCK.RELEASE(id => lock_of(1024 + j)); END IF; \
END LOOP; \
r := DBMS_LOCK.RELEASE(id => lock_of(got)); \
got := -1; \
END IF; \
END IF; \
IF got >= 0 THEN ",
            $fence,
            "END IF; \
END IF; \
r := DBMS_LOCK.RELEASE(id => lock_of(1100)); \
EXCEPTION WHEN OTHERS THEN \
ROLLBACK; \
r := DBMS_LOCK.RELEASE(id => lock_of(1100)); \
RAISE; \
END; \
END IF; \
:7 := g; \
:8 := got; \
:9 := rec; \
:10 := t; \
END;"
        )
    };
}

/// One try for a permit, in one block. `:1` the semaphore's base, `:2` the count, `:3` the
/// first slot tried, `:4` the queue lock's id, `:5` 1 for a waiting try, `:6` how long to wait
/// for the gate (s); OUT `:7` the gate's code, `:8` the slot taken (-1: none), `:9` the count
/// record read (0: no permit live), `:10` the token. Reads the record; unless it names another
/// count, or (for a single try) a session holds the queue lock, walks the slots from `:3` on
/// (a slot this session holds answers 4, "already own", and is passed over) and takes the
/// first free one with its shares of the record (both given back if a share is refused).
/// Each bind appears once, in the order of its number.
pub(super) const PERMIT_SQL: &str = permit_block!("t := NULL; ");

/// [`PERMIT_SQL`] that, with a slot taken, increments the semaphore's fencing counter (row
/// `lock_of(1100)`, the gate's id) and commits it, under the gate.
pub(super) const PERMIT_FENCED_SQL: &str = permit_block!(
    "k := lock_of(1100); \
UPDATE dlock_fencing SET token = token + 1 WHERE id = k RETURNING token INTO t; \
IF SQL%ROWCOUNT = 0 THEN INSERT INTO dlock_fencing (id, token) VALUES (k, 1); t := 1; END IF; \
COMMIT; "
);

/// `:1` the semaphore's base, `:2` the slot, `:3` the count, `:4` 1 when this session holds no
/// other permit of the semaphore. Gives back a permit: its slot, then (for the session's last
/// permit of the semaphore: `DBMS_LOCK` locks do not count re-entries) its shares of the
/// count record.
pub(super) const PERMIT_RELEASE_SQL: &str = concat!(
    "DECLARE b NUMBER := :1; s NUMBER := :2; n NUMBER := :3; last_ NUMBER := :4; r INTEGER; ",
    semaphore_functions!(),
    "BEGIN \
r := DBMS_LOCK.RELEASE(id => lock_of(s)); \
IF last_ = 1 THEN \
FOR j IN 0 .. 10 LOOP \
IF BITAND(n, POWER(2, j)) <> 0 THEN r := DBMS_LOCK.RELEASE(id => lock_of(1024 + j)); END IF; \
END LOOP; \
END IF; \
END;"
);

/// `:1` the semaphore's base, `:2` the count, `:3` how long to wait for the gate (s); OUT `:4`
/// how many of its slots below `:2` are held (-1: the gate stayed held), `:5` the count
/// record. Under the gate, as a try (`held` takes a free lock for a moment).
pub(super) const PERMIT_COUNT_SQL: &str = concat!(
    "DECLARE b NUMBER := :1; n NUMBER := :2; gate_wait NUMBER := :3; g INTEGER; r INTEGER; \
c NUMBER := -1; rec NUMBER := 0; ",
    semaphore_functions!(),
    "BEGIN \
g := DBMS_LOCK.REQUEST(id => lock_of(1100), lockmode => DBMS_LOCK.X_MODE, timeout => gate_wait, \
release_on_commit => FALSE); \
IF g IN (0, 4) THEN \
c := 0; \
FOR s IN 0 .. n - 1 LOOP IF held(lock_of(s)) THEN c := c + 1; END IF; END LOOP; \
FOR j IN 0 .. 10 LOOP IF held(lock_of(1024 + j)) THEN rec := rec + POWER(2, j); END IF; END LOOP; \
r := DBMS_LOCK.RELEASE(id => lock_of(1100)); \
END IF; \
:4 := c; \
:5 := rec; \
END;"
);

/// The base of the semaphore `key`'s lock ids: [`dbms_lock_id`] of the key in a reserved
/// namespace of its own.
pub(super) fn semaphore_base(key: &str) -> i32 {
    dbms_lock_id(&format!("{}permits\0{key}", crate::key::RESERVED_PREFIX))
}

/// The permit try for the semaphore `base` of `count` permits, from slot `first`.
pub(super) fn permit_call(
    base: i32,
    count: u32,
    first: u32,
    queue: i32,
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
            Param::Number(i64::from(base)),
            Param::Number(i64::from(count)),
            Param::Number(i64::from(first)),
            Param::Number(i64::from(queue)),
            Param::Number(i64::from(waiting)),
            Param::Number(timeout_secs(gate_wait)),
            Param::OutNumber,
            Param::OutNumber,
            Param::OutNumber,
            Param::OutToken,
        ],
    }
}

/// Giving back the permit `slot` of the semaphore `base` of `count` permits (`last`: the
/// session's last permit of it).
pub(super) fn permit_release_call(base: i32, slot: u32, count: u32, last: bool) -> Call {
    Call {
        sql: PERMIT_RELEASE_SQL,
        params: vec![
            Param::Number(i64::from(base)),
            Param::Number(i64::from(slot)),
            Param::Number(i64::from(count)),
            Param::Number(i64::from(last)),
        ],
    }
}

/// Counting the permits of the semaphore `base` of `count` permits.
pub(super) fn permit_count_call(base: i32, count: u32, gate_wait: Duration) -> Call {
    Call {
        sql: PERMIT_COUNT_SQL,
        params: vec![
            Param::Number(i64::from(base)),
            Param::Number(i64::from(count)),
            Param::Number(timeout_secs(gate_wait)),
            Param::OutNumber,
            Param::OutNumber,
        ],
    }
}

/// `DBMS_LOCK.RELEASE`.
pub(super) const RELEASE_SQL: &str = "BEGIN :1 := DBMS_LOCK.RELEASE(id => :2); END;";

/// The liveness check (Oracle needs a `FROM`).
pub(super) const KEEPALIVE_SQL: &str = "SELECT 1 FROM DUAL";

/// The longest wait one statement is given: one second short of `MAXWAIT`, which waits
/// without limit.
pub(super) const MAX_WAIT: Duration = Duration::from_secs(MAXWAIT_SECS as u64 - 1);

/// The `DBMS_LOCK` user-lock id of `key`: the low 30 bits of [`lock_id`](crate::lock_id),
/// in `0..=1073741823`. See the [module docs](crate::oracle) for why, and for the collision odds.
///
/// ```
/// assert_eq!(dlock::oracle::dbms_lock_id("account:42"), 7645020056959376184_i64 as i32 & 0x3FFF_FFFF);
/// assert!((0..=1_073_741_823).contains(&dlock::oracle::dbms_lock_id("anything")));
/// ```
pub fn dbms_lock_id(key: &str) -> i32 {
    let id = crate::lock_id(key) & MAX_USER_ID;
    i32::try_from(id).unwrap_or(0)
}

/// A bound parameter, with the Oracle type it is bound as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Param {
    /// An OUT bind for the function's result, `NUMBER(10)`.
    OutNumber,
    /// An OUT bind for a fencing token, `NUMBER(19)`.
    OutToken,
    /// An IN bind, `NUMBER` from a Rust `i64`.
    Number(i64),
}

/// One PL/SQL block and its parameters (`:1`, `:2`, ... in order).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Call {
    pub(super) sql: &'static str,
    pub(super) params: Vec<Param>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Scope {
    Session,
    Transaction,
}

/// The `timeout` argument, in whole seconds (rounded up), for a wait of `wait`;
/// `Duration::MAX` and anything from `MAXWAIT` seconds up is `MAXWAIT` (no limit).
pub(super) fn timeout_secs(wait: Duration) -> i64 {
    let secs = wait
        .as_secs()
        .saturating_add(u64::from(wait.subsec_nanos() > 0));
    i64::try_from(secs)
        .unwrap_or(MAXWAIT_SECS)
        .min(MAXWAIT_SECS)
}

pub(super) fn request_call(id: i32, scope: Scope, timeout_secs: i64) -> Call {
    Call {
        sql: match scope {
            Scope::Session => REQUEST_SESSION_SQL,
            Scope::Transaction => REQUEST_TRANSACTION_SQL,
        },
        params: vec![
            Param::OutNumber,
            Param::Number(i64::from(id)),
            Param::Number(timeout_secs),
        ],
    }
}

/// The `DBMS_LOCK.REQUEST` of a session lock in `mode`.
pub(super) fn session_request_call(id: i32, mode: Mode, timeout_secs: i64) -> Call {
    match mode {
        Mode::Exclusive => request_call(id, Scope::Session, timeout_secs),
        Mode::Shared => Call {
            sql: REQUEST_SESSION_SHARED_SQL,
            params: vec![
                Param::OutNumber,
                Param::Number(i64::from(id)),
                Param::Number(timeout_secs),
            ],
        },
    }
}

/// The fenced `DBMS_LOCK.REQUEST` of a session lock in `mode` ([`REQUEST_FENCED_SQL`],
/// [`REQUEST_FENCED_SHARED_SQL`]).
pub(super) fn request_fenced_call(id: i32, mode: Mode, timeout_secs: i64) -> Call {
    Call {
        sql: match mode {
            Mode::Exclusive => REQUEST_FENCED_SQL,
            Mode::Shared => REQUEST_FENCED_SHARED_SQL,
        },
        params: vec![
            Param::Number(i64::from(id)),
            Param::Number(timeout_secs),
            Param::OutNumber,
            Param::OutToken,
        ],
    }
}

/// Reads the answer of a fenced request: its return code (as [`request_result`]) and the
/// token issued with a grant. A grant must carry a positive token; one without is an error
/// (the caller gives the lock back).
pub(super) fn fenced_result(
    code: Option<i64>,
    token: Option<i64>,
) -> Result<Option<u64>, LockError> {
    match request_result(code)? {
        Grant::NotGranted => Ok(None),
        Grant::Granted => match token.and_then(|t| u64::try_from(t).ok()).filter(|t| *t > 0) {
            Some(token) => Ok(Some(token)),
            None => Err(LockError::backend(
                NAME,
                format!(
                    "DBMS_LOCK.REQUEST granted the lock, but the fencing counter in \
                     dlock_fencing answered {token:?} instead of a positive token; the lock \
                     was given back"
                ),
                None,
                None,
            )),
        },
    }
}

/// The error for a fencing table this user sees but lacks a privilege on (`ORA-01031`).
pub(super) fn fencing_privilege_error(text: &str) -> LockError {
    LockError::config(format!(
        "fencing=true: this user lacks a privilege the table dlock_fencing needs (all three of \
         SELECT, INSERT and UPDATE); an administrator grants them: {FENCING_GRANTS} ({text})"
    ))
}

/// The error for a fencing table this user neither sees nor may create.
pub(super) fn fencing_create_error(text: &str) -> LockError {
    LockError::config(format!(
        "fencing=true needs the table dlock_fencing, which this user does not see and may not \
         create; an administrator creates it and grants it: {FENCING_GRANTS} ({text})"
    ))
}

pub(super) fn release_call(id: i32) -> Call {
    Call {
        sql: RELEASE_SQL,
        params: vec![Param::OutNumber, Param::Number(i64::from(id))],
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Grant {
    /// 0.
    Granted,
    /// 1 (timeout) or 4 (this session already owns the id, for a key that shares it).
    NotGranted,
}

pub(super) fn dbms_error(function: &str, code: i64, meaning: &str) -> LockError {
    LockError::backend(
        NAME,
        format!("DBMS_LOCK.{function} returned {code}: {meaning}"),
        Some(format!("DBMS_LOCK {code}")),
        None,
    )
}

pub(super) fn request_result(code: Option<i64>) -> Result<Grant, LockError> {
    match code {
        Some(0) => Ok(Grant::Granted),
        Some(1 | 4) => Ok(Grant::NotGranted),
        Some(2) => Err(dbms_error(
            "REQUEST",
            2,
            "deadlock; the request was chosen to break it, retry the acquisition",
        )),
        Some(3) => Err(dbms_error("REQUEST", 3, "parameter error")),
        Some(5) => Err(dbms_error("REQUEST", 5, "illegal lock handle")),
        Some(other) => Err(dbms_error("REQUEST", other, "an unexpected return code")),
        None => Err(LockError::backend(
            NAME,
            "DBMS_LOCK.REQUEST returned no result",
            None,
            None,
        )),
    }
}

pub(super) fn release_result(code: Option<i64>) -> Result<(), LockError> {
    match code {
        // 4: not owned any more; nothing to give back.
        Some(0 | 4) => Ok(()),
        Some(3) => Err(dbms_error("RELEASE", 3, "parameter error")),
        Some(5) => Err(dbms_error("RELEASE", 5, "illegal lock handle")),
        Some(other) => Err(dbms_error("RELEASE", other, "an unexpected return code")),
        None => Err(LockError::backend(
            NAME,
            "DBMS_LOCK.RELEASE returned no result",
            None,
            None,
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::super::session::OracleConnector;
    use super::*;
    use crate::session::Connector;

    #[test]
    fn request_statements_and_parameters() {
        let call = request_call(123, Scope::Session, 0);
        assert_eq!(
            call.sql,
            "BEGIN :1 := DBMS_LOCK.REQUEST(id => :2, lockmode => DBMS_LOCK.X_MODE, \
             timeout => :3, release_on_commit => FALSE); END;"
        );
        assert_eq!(
            call.params,
            vec![Param::OutNumber, Param::Number(123), Param::Number(0)]
        );
        let call = request_call(7, Scope::Transaction, 5);
        assert_eq!(
            call.sql,
            "BEGIN :1 := DBMS_LOCK.REQUEST(id => :2, lockmode => DBMS_LOCK.X_MODE, \
             timeout => :3, release_on_commit => TRUE); END;"
        );
        assert_eq!(
            call.params,
            vec![Param::OutNumber, Param::Number(7), Param::Number(5)]
        );
    }

    #[test]
    fn fenced_request_statement_and_parameters() {
        let call = request_fenced_call(123, Mode::Exclusive, 4);
        assert_eq!(
            call.sql,
            "DECLARE k INTEGER := :1; r INTEGER; t NUMBER; BEGIN \
             r := DBMS_LOCK.REQUEST(id => k, lockmode => DBMS_LOCK.X_MODE, timeout => :2, \
             release_on_commit => FALSE); \
             IF r = 0 THEN BEGIN \
             UPDATE dlock_fencing SET token = token + 1 WHERE id = k RETURNING token INTO t; \
             IF SQL%ROWCOUNT = 0 THEN INSERT INTO dlock_fencing (id, token) VALUES (k, 1); t := 1; END IF; \
             COMMIT; \
             EXCEPTION WHEN OTHERS THEN ROLLBACK; r := DBMS_LOCK.RELEASE(id => k); RAISE; \
             END; END IF; :3 := r; :4 := t; END;"
        );
        assert_eq!(
            call.params,
            vec![
                Param::Number(123),
                Param::Number(4),
                Param::OutNumber,
                Param::OutToken
            ]
        );
        // Each placeholder appears once, in the order of its number (positional binds of a
        // PL/SQL block go by unique name).
        let positions: Vec<usize> = (1..=4)
            .map(|n| {
                let placeholder = format!(":{n}");
                assert_eq!(call.sql.matches(&placeholder).count(), 1, "{placeholder}");
                call.sql.find(&placeholder).unwrap()
            })
            .collect();
        assert!(positions.windows(2).all(|w| w[0] < w[1]), "{positions:?}");
        // The counter is touched only after a grant (0), and committed with the lock kept.
        let granted = call.sql.find("IF r = 0 THEN").unwrap();
        assert!(call.sql.find("UPDATE dlock_fencing").unwrap() > granted);
        assert!(call.sql.contains("release_on_commit => FALSE"));
    }

    #[test]
    fn shared_request_statements_and_parameters() {
        let call = session_request_call(123, Mode::Shared, 0);
        assert_eq!(
            call.sql,
            "BEGIN :1 := DBMS_LOCK.REQUEST(id => :2, lockmode => DBMS_LOCK.S_MODE, \
             timeout => :3, release_on_commit => FALSE); END;"
        );
        assert_eq!(
            call.params,
            vec![Param::OutNumber, Param::Number(123), Param::Number(0)]
        );
        assert_eq!(
            session_request_call(123, Mode::Exclusive, 3),
            request_call(123, Scope::Session, 3)
        );
        let call = request_fenced_call(9, Mode::Shared, 2);
        assert_eq!(
            call.sql,
            "DECLARE k INTEGER := :1; r INTEGER; t NUMBER; BEGIN \
             r := DBMS_LOCK.REQUEST(id => k, lockmode => DBMS_LOCK.S_MODE, timeout => :2, \
             release_on_commit => FALSE); \
             IF r = 0 THEN BEGIN \
             UPDATE dlock_fencing SET token = token + 1 WHERE id = k RETURNING token INTO t; \
             IF SQL%ROWCOUNT = 0 THEN INSERT INTO dlock_fencing (id, token) VALUES (k, 1); t := 1; END IF; \
             COMMIT; \
             EXCEPTION WHEN OTHERS THEN ROLLBACK; r := DBMS_LOCK.RELEASE(id => k); RAISE; \
             END; END IF; :3 := r; :4 := t; END;"
        );
        assert_eq!(
            call.params,
            vec![
                Param::Number(9),
                Param::Number(2),
                Param::OutNumber,
                Param::OutToken
            ]
        );
        // The same counter as the exclusive lock's; only the mode differs.
        assert_eq!(
            call.sql.replace("S_MODE", "X_MODE"),
            request_fenced_call(9, Mode::Exclusive, 2).sql
        );
    }

    #[test]
    fn fencing_table_statements() {
        assert_eq!(
            FENCING_TABLE_CHECK_SQL,
            "SELECT COUNT(*) FROM dlock_fencing WHERE 1 = 0"
        );
        assert_eq!(
            FENCING_UPDATE_CHECK_SQL,
            "UPDATE dlock_fencing SET token = token WHERE 1 = 0"
        );
        assert_eq!(
            FENCING_INSERT_CHECK_SQL,
            "INSERT INTO dlock_fencing (id, token) SELECT 0, 0 FROM DUAL WHERE 1 = 0"
        );
        assert_eq!(
            FENCING_TABLE_SQL,
            "CREATE TABLE dlock_fencing (id NUMBER(10) PRIMARY KEY, token NUMBER(19) NOT NULL)"
        );
        let err = fencing_create_error("ORA-01031: insufficient privileges").to_string();
        assert!(
            err.contains("GRANT SELECT, INSERT, UPDATE ON <owner>.dlock_fencing TO <user>"),
            "{err}"
        );
        assert!(err.contains("ORA-01031"), "{err}");
        let err = fencing_privilege_error("ORA-01031").to_string();
        assert!(
            err.contains("all three of SELECT, INSERT and UPDATE"),
            "{err}"
        );
        // Every id fits the counter's key column.
        assert!(MAX_USER_ID < 10_i64.pow(10));
    }

    #[test]
    fn fenced_results() {
        assert_eq!(fenced_result(Some(0), Some(1)).unwrap(), Some(1));
        assert_eq!(fenced_result(Some(0), Some(77)).unwrap(), Some(77));
        assert_eq!(fenced_result(Some(1), None).unwrap(), None);
        assert_eq!(fenced_result(Some(4), Some(3)).unwrap(), None);
        for token in [None, Some(0), Some(-1)] {
            let err = fenced_result(Some(0), token).unwrap_err();
            assert_eq!(err.code(), "DistributedLock.BackendError");
            assert!(err.to_string().contains("given back"), "{err}");
        }
        assert_eq!(
            fenced_result(Some(2), None).unwrap_err().db_code(),
            Some("DBMS_LOCK 2")
        );
    }

    #[test]
    fn release_and_keepalive_statements() {
        let call = release_call(42);
        assert_eq!(call.sql, "BEGIN :1 := DBMS_LOCK.RELEASE(id => :2); END;");
        assert_eq!(call.params, vec![Param::OutNumber, Param::Number(42)]);
        assert_eq!(KEEPALIVE_SQL, "SELECT 1 FROM DUAL");
    }

    #[test]
    fn timeouts_in_seconds() {
        assert_eq!(timeout_secs(Duration::ZERO), 0);
        assert_eq!(timeout_secs(Duration::from_millis(1)), 1);
        assert_eq!(timeout_secs(Duration::from_millis(1000)), 1);
        assert_eq!(timeout_secs(Duration::from_millis(1001)), 2);
        assert_eq!(timeout_secs(Duration::from_secs(32766)), 32766);
        assert_eq!(timeout_secs(Duration::from_secs(40000)), MAXWAIT_SECS);
        assert_eq!(timeout_secs(Duration::MAX), MAXWAIT_SECS);
        assert_eq!(
            timeout_secs(<OracleConnector as Connector>::MAX_WAIT),
            MAXWAIT_SECS - 1
        );
    }

    #[test]
    fn ids_are_pinned_and_in_the_user_range() {
        // Low 30 bits of lock_id, whose own vectors are pinned in the key module.
        assert_eq!(
            i64::from(dbms_lock_id("account:42")),
            7645020056959376184_i64 & 0x3FFF_FFFF
        );
        assert_eq!(
            i64::from(dbms_lock_id("jobs:recurring-monthly-billing")),
            -4568809572337086091_i64 & 0x3FFF_FFFF
        );
        for key in ["a", "A", "\0", "ключ", &"x".repeat(5000)] {
            assert!((0..=1_073_741_823).contains(&dbms_lock_id(key)), "{key:?}");
        }
        assert_ne!(dbms_lock_id("a"), dbms_lock_id("A"));
    }

    #[test]
    fn every_request_code() {
        assert_eq!(request_result(Some(0)).unwrap(), Grant::Granted);
        assert_eq!(request_result(Some(1)).unwrap(), Grant::NotGranted);
        assert_eq!(request_result(Some(4)).unwrap(), Grant::NotGranted);
        for (code, words) in [
            (2, "deadlock"),
            (3, "parameter error"),
            (5, "illegal lock handle"),
            (9, "unexpected"),
        ] {
            let err = request_result(Some(code)).unwrap_err();
            assert_eq!(err.code(), "DistributedLock.BackendError");
            assert_eq!(err.db_code(), Some(format!("DBMS_LOCK {code}").as_str()));
            let text = err.to_string();
            assert!(text.contains(&format!("returned {code}")), "{text}");
            assert!(text.contains(words), "{text}");
        }
        assert!(request_result(None).is_err());
    }

    #[test]
    fn every_release_code() {
        assert!(release_result(Some(0)).is_ok());
        assert!(release_result(Some(4)).is_ok());
        for code in [3, 5, 8] {
            let err = release_result(Some(code)).unwrap_err();
            assert_eq!(err.db_code(), Some(format!("DBMS_LOCK {code}").as_str()));
        }
        assert!(release_result(None).is_err());
    }

    /// Whether a PL/SQL block's `IF`/`END IF`, `LOOP`/`END LOOP` and the remaining
    /// `BEGIN`/`END` (a function's `END;` among them) pair up, in order.
    fn balanced(sql: &str) -> bool {
        let words: Vec<&str> = sql
            .split(|c: char| !c.is_ascii_alphanumeric() && c != '_')
            .filter(|w| !w.is_empty())
            .collect();
        let mut open: Vec<&str> = Vec::new();
        let mut at = 0;
        while let Some(word) = words.get(at) {
            match *word {
                "END" => {
                    let what = match words.get(at + 1) {
                        Some(&"IF") => "IF",
                        Some(&"LOOP") => "LOOP",
                        _ => "BEGIN",
                    };
                    if open.pop() != Some(what) {
                        return false;
                    }
                    if what != "BEGIN" {
                        at += 1;
                    }
                }
                "IF" | "LOOP" | "BEGIN" => open.push(word),
                _ => {}
            }
            at += 1;
        }
        open.is_empty()
    }

    /// Each of `:1` to `:n` appears once, in the order of its number, and no other.
    fn binds_in_order(sql: &str, n: usize) -> bool {
        let mut seen = Vec::new();
        let mut rest = sql;
        while let Some(at) = rest.find(':') {
            rest = &rest[at + 1..];
            let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
            if let Ok(number) = digits.parse::<usize>() {
                seen.push(number);
            }
        }
        seen == (1..=n).collect::<Vec<_>>()
    }

    /// The permit blocks, pinned word for word (Oracle cannot run here: these are what the
    /// live suite, `tests/oracle.rs` with `DLOCK_ORACLE_URL`, runs), with their structure and
    /// binds checked.
    #[test]
    fn permit_blocks_are_pinned() {
        assert_eq!(
            PERMIT_SQL,
            "DECLARE b NUMBER := :1; n NUMBER := :2; first_ NUMBER := :3; q INTEGER := :4; \
            waiting NUMBER := :5; gate_wait NUMBER := :6; g INTEGER; r INTEGER; k INTEGER; i \
            NUMBER := 0; s NUMBER; got NUMBER := -1; rec NUMBER := 0; took NUMBER := 0; fresh \
            NUMBER := 0; t NUMBER; FUNCTION lock_of(x NUMBER) RETURN INTEGER IS BEGIN RETURN \
            MOD(b + MOD(x * 2654435761, 1073741824), 1073741824); END; FUNCTION held(k \
            INTEGER) RETURN BOOLEAN IS c INTEGER; BEGIN c := DBMS_LOCK.REQUEST(id => k, \
            lockmode => DBMS_LOCK.X_MODE, timeout => 0, release_on_commit => FALSE); IF c = 0 \
            THEN c := DBMS_LOCK.RELEASE(id => k); RETURN FALSE; END IF; RETURN c IN (1, 4); \
            END; BEGIN g := DBMS_LOCK.REQUEST(id => lock_of(1100), lockmode => \
            DBMS_LOCK.X_MODE, timeout => gate_wait, release_on_commit => FALSE); IF g IN (0, \
            4) THEN BEGIN FOR j IN 0 .. 10 LOOP IF held(lock_of(1024 + j)) THEN rec := rec + \
            POWER(2, j); END IF; END LOOP; IF (rec = 0 OR rec = n) AND (waiting = 1 OR NOT \
            held(q)) THEN WHILE i < n AND got < 0 LOOP s := MOD(first_ + i, n); r := \
            DBMS_LOCK.REQUEST(id => lock_of(s), lockmode => DBMS_LOCK.X_MODE, timeout => 0, \
            release_on_commit => FALSE); IF r = 0 THEN got := s; END IF; i := i + 1; END LOOP; \
            IF got >= 0 THEN FOR j IN 0 .. 10 LOOP IF BITAND(n, POWER(2, j)) <> 0 THEN r := \
            DBMS_LOCK.REQUEST(id => lock_of(1024 + j), lockmode => DBMS_LOCK.S_MODE, timeout \
            => 0, release_on_commit => FALSE); IF r IN (0, 4) THEN took := took + POWER(2, j); \
            END IF; IF r = 0 THEN fresh := fresh + POWER(2, j); END IF; END IF; END LOOP; IF \
            took <> n THEN FOR j IN 0 .. 10 LOOP IF BITAND(fresh, POWER(2, j)) <> 0 THEN r := \
            DBMS_LOCK.RELEASE(id => lock_of(1024 + j)); END IF; END LOOP; r := \
            DBMS_LOCK.RELEASE(id => lock_of(got)); got := -1; END IF; END IF; IF got >= 0 THEN \
            t := NULL; END IF; END IF; r := DBMS_LOCK.RELEASE(id => lock_of(1100)); EXCEPTION \
            WHEN OTHERS THEN ROLLBACK; r := DBMS_LOCK.RELEASE(id => lock_of(1100)); RAISE; \
            END; END IF; :7 := g; :8 := got; :9 := rec; :10 := t; END;"
        );
        // The fenced block differs in its fence alone.
        assert_eq!(
            PERMIT_SQL.replace(
                "IF got >= 0 THEN t := NULL; END IF;",
                "IF got >= 0 THEN k := lock_of(1100); UPDATE dlock_fencing SET token = token \
                 + 1 WHERE id = k RETURNING token INTO t; IF SQL%ROWCOUNT = 0 THEN INSERT INTO \
                 dlock_fencing (id, token) VALUES (k, 1); t := 1; END IF; COMMIT; END IF;"
            ),
            PERMIT_FENCED_SQL
        );
        assert_eq!(
            PERMIT_RELEASE_SQL,
            "DECLARE b NUMBER := :1; s NUMBER := :2; n NUMBER := :3; last_ NUMBER := :4; r \
            INTEGER; FUNCTION lock_of(x NUMBER) RETURN INTEGER IS BEGIN RETURN MOD(b + MOD(x * \
            2654435761, 1073741824), 1073741824); END; FUNCTION held(k INTEGER) RETURN BOOLEAN \
            IS c INTEGER; BEGIN c := DBMS_LOCK.REQUEST(id => k, lockmode => DBMS_LOCK.X_MODE, \
            timeout => 0, release_on_commit => FALSE); IF c = 0 THEN c := DBMS_LOCK.RELEASE(id \
            => k); RETURN FALSE; END IF; RETURN c IN (1, 4); END; BEGIN r := \
            DBMS_LOCK.RELEASE(id => lock_of(s)); IF last_ = 1 THEN FOR j IN 0 .. 10 LOOP IF \
            BITAND(n, POWER(2, j)) <> 0 THEN r := DBMS_LOCK.RELEASE(id => lock_of(1024 + j)); \
            END IF; END LOOP; END IF; END;"
        );
        assert_eq!(
            PERMIT_COUNT_SQL,
            "DECLARE b NUMBER := :1; n NUMBER := :2; gate_wait NUMBER := :3; g INTEGER; r \
            INTEGER; c NUMBER := -1; rec NUMBER := 0; FUNCTION lock_of(x NUMBER) RETURN \
            INTEGER IS BEGIN RETURN MOD(b + MOD(x * 2654435761, 1073741824), 1073741824); END; \
            FUNCTION held(k INTEGER) RETURN BOOLEAN IS c INTEGER; BEGIN c := \
            DBMS_LOCK.REQUEST(id => k, lockmode => DBMS_LOCK.X_MODE, timeout => 0, \
            release_on_commit => FALSE); IF c = 0 THEN c := DBMS_LOCK.RELEASE(id => k); RETURN \
            FALSE; END IF; RETURN c IN (1, 4); END; BEGIN g := DBMS_LOCK.REQUEST(id => \
            lock_of(1100), lockmode => DBMS_LOCK.X_MODE, timeout => gate_wait, \
            release_on_commit => FALSE); IF g IN (0, 4) THEN c := 0; FOR s IN 0 .. n - 1 LOOP \
            IF held(lock_of(s)) THEN c := c + 1; END IF; END LOOP; FOR j IN 0 .. 10 LOOP IF \
            held(lock_of(1024 + j)) THEN rec := rec + POWER(2, j); END IF; END LOOP; r := \
            DBMS_LOCK.RELEASE(id => lock_of(1100)); END IF; :4 := c; :5 := rec; END;"
        );
        for (sql, binds) in [
            (PERMIT_SQL, 10),
            (PERMIT_FENCED_SQL, 10),
            (PERMIT_RELEASE_SQL, 4),
            (PERMIT_COUNT_SQL, 5),
        ] {
            assert!(balanced(sql), "unbalanced: {sql}");
            assert!(binds_in_order(sql, binds), "binds of {sql}");
        }
        // The record's 11 bits cover the largest count.
        assert_eq!(MAX_PERMITS, 1 << 10);
    }

    /// `lock_of`, as the blocks compute it: distinct ids for every slot, count bit and the
    /// gate of one semaphore, all in the range `DBMS_LOCK` leaves to applications.
    #[test]
    fn a_semaphores_lock_ids_are_distinct() {
        let lock_of =
            |base: i32, x: i64| (i64::from(base) + (x * 2_654_435_761) % (1 << 30)) % (1 << 30);
        for key in ["exports", "x", ""] {
            let base = semaphore_base(key);
            assert!((0..=MAX_USER_ID).contains(&i64::from(base)));
            let mut ids: Vec<i64> = (0..i64::from(MAX_PERMITS))
                .chain(1024..=1034)
                .chain([1100])
                .map(|x| lock_of(base, x))
                .collect();
            assert!(ids.iter().all(|id| (0..=MAX_USER_ID).contains(id)));
            let all = ids.len();
            ids.sort_unstable();
            ids.dedup();
            assert_eq!(ids.len(), all, "{key}");
        }
        assert_eq!(
            semaphore_base("exports"),
            dbms_lock_id("dlock\0permits\0exports")
        );
    }

    #[test]
    fn permit_calls_bind_their_parameters() {
        let call = permit_call(7, 3, 2, 99, true, Duration::from_millis(1500), false);
        assert_eq!(call.sql, PERMIT_SQL);
        assert_eq!(
            call.params,
            vec![
                Param::Number(7),
                Param::Number(3),
                Param::Number(2),
                Param::Number(99),
                Param::Number(1),
                Param::Number(2),
                Param::OutNumber,
                Param::OutNumber,
                Param::OutNumber,
                Param::OutToken,
            ]
        );
        assert_eq!(
            permit_call(7, 3, 2, 99, false, Duration::from_secs(1), true).sql,
            PERMIT_FENCED_SQL
        );
        assert_eq!(
            permit_release_call(7, 1, 3, true).params,
            vec![
                Param::Number(7),
                Param::Number(1),
                Param::Number(3),
                Param::Number(1)
            ]
        );
        assert_eq!(
            permit_count_call(7, 3, Duration::from_secs(10)).params,
            vec![
                Param::Number(7),
                Param::Number(3),
                Param::Number(10),
                Param::OutNumber,
                Param::OutNumber
            ]
        );
    }
}
