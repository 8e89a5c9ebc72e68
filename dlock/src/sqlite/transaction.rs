//! Transaction-bound locks: a row taken inside the caller's transaction.

use super::*;

/// Locks `key` until `transaction` commits or rolls back; one try.
///
/// Creates the lock table in the transaction's database if it is missing (and converts an
/// earlier version's table), and the `-fencing` file next to the database. Errors with
/// [`LockError::AlreadyHeld`] when a session lock holds the key, or when another connection is
/// writing the database for longer than the connection's busy timeout; with
/// [`LockError::Config`] when the database is not a file (in memory or temporary). Blocking
/// (it is `rusqlite`): call it where blocking is allowed.
pub fn try_acquire_in_transaction(
    transaction: &Transaction<'_>,
    key: &str,
) -> Result<TransactionLock, LockError> {
    crate::transaction::observe_blocking(NAME, key, Duration::ZERO, || {
        try_in_transaction(transaction, key)
    })
}

pub(super) fn try_in_transaction(
    transaction: &Transaction<'_>,
    key: &str,
) -> Result<TransactionLock, LockError> {
    validate_key(key)?;
    match transaction_attempt(transaction, key)? {
        Some(lock) => Ok(lock),
        None => Err(LockError::AlreadyHeld {
            key: Arc::from(key),
        }),
    }
}

/// Locks `key` until `transaction` commits or rolls back, trying again with backoff for up to
/// `timeout` (errors with [`LockError::Timeout`] then). Blocking: it sleeps between tries. See
/// the [module docs](super#transaction-bound-locks) for what it can wait for.
pub fn acquire_in_transaction(
    transaction: &Transaction<'_>,
    key: &str,
    timeout: Duration,
) -> Result<TransactionLock, LockError> {
    crate::transaction::observe_blocking(NAME, key, timeout, || {
        wait_in_transaction(transaction, key, timeout)
    })
}

pub(super) fn wait_in_transaction(
    transaction: &Transaction<'_>,
    key: &str,
    timeout: Duration,
) -> Result<TransactionLock, LockError> {
    validate_key(key)?;
    if timeout.is_zero() {
        return try_in_transaction(transaction, key);
    }
    let deadline = crate::time::deadline(Instant::now(), timeout);
    let mut pauses = Pauses::new(Backoff::default(), deadline);
    loop {
        if let Some(lock) = transaction_attempt(transaction, key)? {
            return Ok(lock);
        }
        let Some(pause) = pauses.next_pause() else {
            return Err(LockError::Timeout {
                key: Arc::from(key),
                timeout,
            });
        };
        std::thread::sleep(pause);
    }
}

pub(super) fn transaction_attempt(
    transaction: &Transaction<'_>,
    key: &str,
) -> Result<Option<TransactionLock>, LockError> {
    let db_file = match transaction.path() {
        Some(path) if !path.is_empty() => PathBuf::from(path),
        _ => {
            return Err(LockError::config(
                "a transaction-bound lock needs a database file (not an in-memory or temporary database): its fencing tokens are recorded in a file next to it",
            ));
        }
    };
    let clock = LeaseClock::get()?;
    // Before the claim, which takes the file's write lock for the rest of the transaction.
    let fencing = fencing_connection(&db_file)?;
    let name = key.as_bytes();
    if let Some(mode) = ensure_schema(transaction, clock)
        .and_then(|()| super::counted::mode(transaction))
        .map_err(|e| sqlite_error(&db_file, "acquiring a transaction-bound lock", e))?
    {
        return Err(LockError::config(format!(
            "transaction-bound locks are not available on a lock file with shared fencing \
             counters ({}) in this version: their tokens would be recorded per key in the \
             `-fencing` file, below the shared counters'",
            super::counted::describe_mode(mode)
        )));
    }
    let claimed = ensure_schema(transaction, clock)
        .and_then(|()| {
            // A held lock is answered by a read, without taking the file's write lock.
            let mut peek = transaction.prepare_cached(PEEK_SQL)?;
            let held = peek
                .query(params![name, clock.now_ms(), clock.boot()])?
                .next()?
                .is_some();
            Ok(held)
        })
        .and_then(|held| {
            if held {
                return Ok(None);
            }
            returning_one(
                &mut transaction.prepare_cached(TRANSACTION_CLAIM_SQL)?,
                params![name, clock.now_ms(), clock.boot()],
            )
        });
    let counter = match claimed {
        Ok(Some(counter)) => counter,
        Ok(None) => return Ok(None),
        Err(err) if is_busy(&err) => return Ok(None),
        Err(err) => return Err(sqlite_error(&db_file, "acquiring a transaction lock", err)),
    };
    let counter = counter.map_err(|e| sqlite_error(&db_file, "acquiring a transaction lock", e))?;
    // The token must outlive a rollback of the caller's transaction: it is recorded in the
    // `-fencing` file, committed, before it is handed out.
    let token = issue_token(&fencing, &db_file, name, counter)?;
    transaction
        .prepare_cached(TRANSACTION_RECORD_SQL)
        .and_then(|mut record| record.execute(params![name, token]))
        .map_err(|e| sqlite_error(&db_file, "acquiring a transaction lock", e))?;
    let fencing_token = u64::try_from(token).map_err(|_| {
        LockError::backend(
            NAME,
            "acquiring a transaction lock: the fencing counter is not a positive integer",
            None,
            None,
        )
    })?;
    Ok(Some(TransactionLock::new(NAME, key, Some(fencing_token))))
}
