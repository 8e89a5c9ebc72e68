//! Opening lock files and `-fencing` files, their schema, and SQLite's errors.

use super::*;

/// The connection to the `-fencing` file of `db_file`, created (with the file) the first time
/// this process asks. Connections are kept for the life of the process, one per lock
/// database. The first time, it waits [`FENCING_LOOK`] after opening the file, so that no
/// backend still trusts a look that found no file when a token recorded in it is handed out
/// (see [`Fencing`]).
pub(super) fn fencing_connection(db_file: &Path) -> Result<Arc<Mutex<Connection>>, LockError> {
    static FENCING: LazyLock<Mutex<HashMap<PathBuf, Arc<Mutex<Connection>>>>> =
        LazyLock::new(|| Mutex::new(HashMap::new()));
    let path = fencing_path(db_file);
    let mut files = FENCING.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(conn) = files.get(&path) {
        return Ok(Arc::clone(conn));
    }
    let conn = Arc::new(Mutex::new(open_fencing(&path, DEFAULT_BUSY_TIMEOUT)?));
    std::thread::sleep(FENCING_LOOK);
    files.insert(path, Arc::clone(&conn));
    Ok(conn)
}

/// Issues a token for `name` in the `-fencing` file, above `at_least`, and commits it.
pub(super) fn issue_token(
    fencing: &Mutex<Connection>,
    db_file: &Path,
    name: &[u8],
    at_least: i64,
) -> Result<i64, LockError> {
    let path = fencing_path(db_file);
    let conn = fencing.lock().unwrap_or_else(PoisonError::into_inner);
    let issued = conn
        .prepare_cached(ISSUE_SQL)
        .and_then(|mut issue| returning_one(&mut issue, params![name, at_least]));
    match issued {
        Ok(Some(Ok(token))) => Ok(token),
        Ok(Some(Err(err))) | Err(err) => Err(sqlite_error(&path, "issuing a fencing token", err)),
        Ok(None) => Err(LockError::backend(
            NAME,
            "issuing a fencing token: the fencing file returned no token",
            None,
            None,
        )),
    }
}

/// `<db_file>-fencing`.
pub(super) fn fencing_path(db_file: &Path) -> PathBuf {
    let mut path = db_file.as_os_str().to_owned();
    path.push(FENCING_SUFFIX);
    PathBuf::from(path)
}

/// Opens (creating if needed) a `-fencing` file and its table.
pub(super) fn open_fencing(path: &Path, busy_timeout: Duration) -> Result<Connection, LockError> {
    let conn = open_file(path, busy_timeout)?;
    retry_busy(busy_timeout, || conn.execute_batch(FENCING_SCHEMA))
        .map_err(|e| sqlite_error(path, "creating the fencing table", e))?;
    Ok(conn)
}

/// Runs a `... RETURNING` statement to completion and gives its one value, if it returned a
/// row. `query_row` would stop after the first row: the statement's implicit commit then
/// happens when it is reset, where an error (a full disk, an I/O error) is dropped, and the
/// caller would take a lock whose row was never written. Stepping until the statement is done
/// makes such an error this call's error. The value is read apart (inner result): when it
/// cannot be read, the statement has still run, and a written row must be given back.
pub(super) fn returning_one(
    statement: &mut rusqlite::CachedStatement<'_>,
    params: impl rusqlite::Params,
) -> rusqlite::Result<Option<rusqlite::Result<i64>>> {
    let mut rows = statement.query(params)?;
    let value = rows.next()?.map(|row| row.get::<_, i64>(0));
    while rows.next()?.is_some() {}
    Ok(value)
}

/// Opens a SQLite file for dlock: read-write, WAL, `synchronous=NORMAL`, no automatic
/// checkpoints (see [`Shared::count_commit`]).
pub(super) fn open_file(path: &Path, busy_timeout: Duration) -> Result<Connection, LockError> {
    let flags = OpenFlags::SQLITE_OPEN_READ_WRITE
        | OpenFlags::SQLITE_OPEN_CREATE
        | OpenFlags::SQLITE_OPEN_NO_MUTEX;
    let conn = Connection::open_with_flags(path, flags)
        .map_err(|e| sqlite_error(path, "opening the lock file", e))?;
    // SQLite takes the busy timeout in `int` milliseconds (about 24 days); longer is the same.
    conn.busy_timeout(busy_timeout.min(Duration::from_millis(i32::MAX as u64)))
        .map_err(|e| sqlite_error(path, "configuring the lock file", e))?;
    if conn
        .is_readonly(rusqlite::MAIN_DB)
        .map_err(|e| sqlite_error(path, "opening the lock file", e))?
    {
        return Err(LockError::config(format!(
            "the lock file `{}` is read-only; locks need a file this process can write",
            path.display()
        )));
    }
    // Small pages for a file created now (no effect on an existing one): every commit appends
    // whole pages to the write-ahead log, and lock rows are short.
    conn.execute_batch("PRAGMA page_size = 1024")
        .map_err(|e| sqlite_error(path, "configuring the lock file", e))?;
    retry_busy(busy_timeout, || {
        conn.query_row("PRAGMA journal_mode = WAL", [], |_| Ok(()))
    })
    .map_err(|e| sqlite_error(path, "opening the lock file", e))?;
    conn.pragma_update(None, "synchronous", "NORMAL")
        .map_err(|e| sqlite_error(path, "configuring the lock file", e))?;
    conn.pragma_update(None, "wal_autocheckpoint", 0)
        .map_err(|e| sqlite_error(path, "configuring the lock file", e))?;
    conn.query_row("PRAGMA journal_size_limit = 8388608", [], |_| Ok(()))
        .map_err(|e| sqlite_error(path, "configuring the lock file", e))?;
    Ok(conn)
}

pub(super) fn open_connection(
    path: &Path,
    busy_timeout: Duration,
    clock: &LeaseClock,
) -> Result<Connection, LockError> {
    let conn = open_file(path, busy_timeout)?;
    retry_busy(busy_timeout, || ensure_schema(&conn, clock))
        .map_err(|e| sqlite_error(path, "creating the lock table", e))?;
    Ok(conn)
}

/// Runs `op` again while it fails with `SQLITE_BUSY`, for up to `busy_timeout`. SQLite does
/// not wait by itself in every case: a connection that would have to upgrade its lock while
/// another waits for the same (several processes creating or converting a file at once) gets
/// `SQLITE_BUSY` at once, to avoid a deadlock. Blocking: for opening the file only.
pub(super) fn retry_busy<T>(
    busy_timeout: Duration,
    mut op: impl FnMut() -> rusqlite::Result<T>,
) -> rusqlite::Result<T> {
    let started = Instant::now();
    let mut pause = Duration::from_millis(1);
    loop {
        match op() {
            Err(err) if is_busy(&err) && started.elapsed() < busy_timeout => {
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(50));
            }
            outcome => return outcome,
        }
    }
}

/// Adds the acquisition-time columns to a lock table of an earlier version (in a write
/// transaction of its own outside the caller's, so that two processes opening the file at once
/// add them once).
fn add_taken_at(conn: &Connection) -> rusqlite::Result<()> {
    let missing = |conn: &Connection| -> rusqlite::Result<bool> {
        conn.prepare_cached(TAKEN_AT_SQL)?
            .query_row([], |row| row.get::<_, i64>(0))
            .map(|n| n == 0)
    };
    if !missing(conn)? {
        return Ok(());
    }
    if !conn.is_autocommit() {
        return conn.execute_batch(ADD_TAKEN_AT_SQL);
    }
    let tx = Transaction::new_unchecked(conn, TransactionBehavior::Immediate)?;
    if missing(conn)? {
        conn.execute_batch(ADD_TAKEN_AT_SQL)?;
    }
    tx.commit()
}

/// Creates the lock table, or converts an earlier version's (see the module docs). On a
/// connection outside a transaction, the conversion runs in a transaction of its own; inside
/// the caller's transaction, it is part of it.
pub(super) fn ensure_schema(conn: &Connection, clock: &LeaseClock) -> rusqlite::Result<()> {
    conn.execute_batch(SCHEMA)?;
    conn.execute_batch(super::owners::OWNERS_SCHEMA)?;
    add_taken_at(conn)?;
    let legacy = |conn: &Connection| -> rusqlite::Result<bool> {
        conn.prepare_cached(LEGACY_SQL)?
            .query_row([], |row| row.get::<_, i64>(0))
            .map(|n| n > 0)
    };
    if !legacy(conn)? {
        return Ok(());
    }
    let own = conn.is_autocommit();
    let tx = if own {
        Some(Transaction::new_unchecked(
            conn,
            TransactionBehavior::Immediate,
        )?)
    } else {
        None
    };
    if legacy(conn)? {
        conn.execute_batch(MIGRATE_SQL)?;
        let wall_now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, millis);
        conn.prepare_cached(MIGRATE_ROWS_SQL)?.execute(params![
            wall_now,
            clock.now_ms(),
            clock.boot(),
            millis(MAX_SETTING)
        ])?;
        tracing::info!(
            backend = NAME,
            "converted a lock table of an earlier version to the lease clock"
        );
    }
    if let Some(tx) = tx {
        tx.commit()?;
    }
    Ok(())
}

pub(super) fn is_busy(err: &rusqlite::Error) -> bool {
    matches!(
        err.sqlite_error_code(),
        Some(ErrorCode::DatabaseBusy | ErrorCode::DatabaseLocked)
    )
}

pub(super) fn sqlite_error(path: &Path, what: &str, err: rusqlite::Error) -> LockError {
    let shown = path.display();
    let db_code = err
        .sqlite_error()
        .map(|e| format!("SQLITE_{}", e.extended_code));
    match err.sqlite_error_code() {
        Some(ErrorCode::NotADatabase) => LockError::config(format!(
            "{what}: `{shown}` is not a SQLite database (it was left untouched); point dlock at a new or existing SQLite file"
        )),
        Some(ErrorCode::CannotOpen) => LockError::config(format!(
            "{what}: cannot open `{shown}`; it must be a file (not a directory) in an existing directory this process can write"
        )),
        Some(ErrorCode::ReadOnly | ErrorCode::PermissionDenied) => LockError::config(format!(
            "{what}: the lock file `{shown}` cannot be written; locks need a file this process can write"
        )),
        Some(ErrorCode::DiskFull) => LockError::unavailable(
            NAME,
            format!("{what}: the disk holding `{shown}` is full"),
            Some(Box::new(err) as _),
        ),
        Some(ErrorCode::SystemIoFailure) => LockError::unavailable(
            NAME,
            format!("{what}: I/O error on `{shown}`"),
            Some(Box::new(err) as _),
        ),
        _ => LockError::backend(
            NAME,
            format!("{what}: {err}"),
            db_code,
            Some(Box::new(err) as _),
        ),
    }
}

/// Now on the wall clock, in Unix milliseconds (0 before 1970), as lock rows record when they
/// were taken.
pub(super) fn wall_now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, millis)
}

pub(super) fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}
