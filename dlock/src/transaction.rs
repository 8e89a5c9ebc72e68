//! Locks bound to the caller's transaction: one shape for every engine that has them.

use std::sync::Arc;
use std::time::Instant;

/// A lock held until the caller's transaction commits or rolls back.
///
/// Every engine that has transaction-bound locks returns it from its
/// `try_acquire_in_transaction` and `acquire_in_transaction`
/// ([`postgres`](crate::postgres), [`sqlite`](crate::sqlite), [`mssql`](crate::mssql),
/// [`oracle`](crate::oracle); [`mysql`](crate::mysql) has none and answers
/// [`Unsupported`](crate::LockError::Unsupported)), so code that takes one can be written once
/// for every engine. Dropping it changes nothing: the lock ends with the transaction.
///
/// Each such acquisition runs in a `dlock.acquire` span (fields `key`, `backend`,
/// `timeout_ms`, `transaction = true`, `outcome`) and is counted in
/// `distributed_lock.acquisitions` and `distributed_lock.wait_duration` with the same
/// attributes as a provider's acquisitions (see [`metrics`](crate::metrics)), in the instruments
/// of the meter given to [`set_transaction_meter`](crate::metrics::set_transaction_meter), or
/// else of the global meter provider as it is at the first transaction-bound acquisition
/// (install the SDK before).
///
/// Its hold is recorded in `distributed_lock.hold_duration` when it is dropped (its last
/// clone): the time from the acquisition to the drop. The engine holds the lock until the
/// transaction ends, which dlock does not see, so keep the `TransactionLock` until the commit or
/// rollback for the hold to measure the lock:
///
/// ```
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let dir = tempfile::tempdir()?;
/// let mut conn = rusqlite::Connection::open(dir.path().join("app.db"))?;
/// let tx = conn.transaction()?;
/// let lock = dlock::sqlite::try_acquire_in_transaction(&tx, "invoices:42")?;
/// // ... the work under the lock ...
/// tx.commit()?;
/// drop(lock); // the hold ends here
/// # Ok(()) }
/// ```
///
/// Losses are not counted: a transaction-bound lock is not lost while its transaction lives.
#[derive(Debug, Clone)]
pub struct TransactionLock {
    key: Arc<str>,
    backend: &'static str,
    fencing_token: Option<u64>,
    /// Records the hold when the last clone is dropped.
    _hold: Arc<TransactionHold>,
}

impl PartialEq for TransactionLock {
    fn eq(&self, other: &Self) -> bool {
        self.key == other.key
            && self.backend == other.backend
            && self.fencing_token == other.fencing_token
    }
}

impl Eq for TransactionLock {}

/// The hold of a transaction-bound lock, recorded when it is dropped.
#[derive(Debug)]
struct TransactionHold {
    key: Arc<str>,
    backend: &'static str,
    acquired_at: Instant,
}

impl Drop for TransactionHold {
    fn drop(&mut self) {
        crate::metrics::transaction_metrics().held(
            self.backend,
            &self.key,
            self.acquired_at.elapsed(),
        );
    }
}

impl TransactionLock {
    #[cfg(any(
        feature = "postgres",
        feature = "sqlite",
        feature = "mssql",
        feature = "oracle"
    ))]
    pub(crate) fn new(backend: &'static str, key: &str, fencing_token: Option<u64>) -> Self {
        let key: Arc<str> = Arc::from(key);
        crate::metrics::transaction_metrics().hold_started(backend, &key);
        TransactionLock {
            _hold: Arc::new(TransactionHold {
                key: Arc::clone(&key),
                backend,
                acquired_at: Instant::now(),
            }),
            key,
            backend,
            fencing_token,
        }
    }

    /// The key that is locked.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The name of the backend that holds the lock (`"postgres"`, `"sqlite"`, ...).
    pub fn backend(&self) -> &'static str {
        self.backend
    }

    /// The fencing token of this acquisition, where the engine issues one for transaction
    /// locks (SQLite: above every token issued before for the key, session locks included,
    /// and never issued again, even when the transaction rolls back); `None` elsewhere.
    pub fn fencing_token(&self) -> Option<u64> {
        self.fencing_token
    }

    /// [`lock_id`](crate::lock_id) of the key: the PostgreSQL advisory lock id that is held
    /// (on the other engines, the same function of the key, which they do not use).
    pub fn lock_id(&self) -> i64 {
        crate::lock_id(&self.key)
    }
}

/// The span and the metrics of transaction-bound acquisitions.
#[cfg(any(
    feature = "postgres",
    feature = "sqlite",
    feature = "mssql",
    feature = "oracle"
))]
mod observing {
    use std::time::{Duration, Instant};

    use super::TransactionLock;
    use crate::LockError;
    use crate::metrics::transaction_metrics as metrics;

    fn span(backend: &'static str, key: &str, timeout: Duration) -> tracing::Span {
        tracing::debug_span!(
            "dlock.acquire",
            key,
            backend,
            timeout_ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX),
            transaction = true,
            outcome = tracing::field::Empty,
        )
    }

    fn record<T>(
        span: &tracing::Span,
        backend: &'static str,
        key: &str,
        outcome: &Result<T, LockError>,
        waited: Duration,
    ) {
        metrics().acquisition(backend, key, outcome, waited);
        if !span.is_disabled() {
            let status = match outcome {
                Ok(_) => "acquired",
                Err(err) => err.code(),
            };
            span.record("outcome", status);
        }
    }

    /// Runs an engine's transaction-bound acquisition in its span, and records it.
    #[cfg(any(feature = "postgres", feature = "mssql"))]
    pub(crate) async fn observe(
        backend: &'static str,
        key: &str,
        timeout: Duration,
        acquisition: impl std::future::Future<Output = Result<TransactionLock, LockError>>,
    ) -> Result<TransactionLock, LockError> {
        let span = span(backend, key, timeout);
        let started = Instant::now();
        let outcome = tracing::Instrument::instrument(acquisition, span.clone()).await;
        record(&span, backend, key, &outcome, started.elapsed());
        outcome
    }

    /// [`observe`] for the engines whose drivers block (SQLite, Oracle).
    #[cfg(any(feature = "sqlite", feature = "oracle"))]
    pub(crate) fn observe_blocking(
        backend: &'static str,
        key: &str,
        timeout: Duration,
        acquisition: impl FnOnce() -> Result<TransactionLock, LockError>,
    ) -> Result<TransactionLock, LockError> {
        let span = span(backend, key, timeout);
        let started = Instant::now();
        let outcome = span.in_scope(acquisition);
        record(&span, backend, key, &outcome, started.elapsed());
        outcome
    }
}

#[cfg(any(feature = "postgres", feature = "mssql"))]
pub(crate) use observing::observe;
#[cfg(any(feature = "sqlite", feature = "oracle"))]
pub(crate) use observing::observe_blocking;

#[cfg(test)]
#[cfg(any(
    feature = "postgres",
    feature = "sqlite",
    feature = "mssql",
    feature = "oracle"
))]
mod tests {
    use super::TransactionLock;

    /// A transaction lock names its key, backend and fencing token and the advisory lock id of
    /// its key; two are equal when all three agree.
    #[test]
    fn a_lock_names_its_key_backend_and_token_and_equals_only_its_like() {
        let lock = TransactionLock::new("postgres", "orders:7", Some(42));
        assert_eq!(lock.key(), "orders:7");
        assert_eq!(lock.backend(), "postgres");
        assert_eq!(lock.fencing_token(), Some(42));
        assert_eq!(lock.lock_id(), crate::lock_id("orders:7"));
        assert_ne!(crate::lock_id("orders:7"), 0);
        assert_eq!(lock, lock.clone());
        assert_eq!(lock, TransactionLock::new("postgres", "orders:7", Some(42)));
        for other in [
            TransactionLock::new("sqlite", "orders:7", Some(42)),
            TransactionLock::new("postgres", "orders:8", Some(42)),
            TransactionLock::new("postgres", "orders:7", Some(43)),
            TransactionLock::new("postgres", "orders:7", None),
            TransactionLock::new("sqlite", "orders:8", None),
        ] {
            assert_ne!(lock, other, "{other:?}");
        }
        assert_eq!(
            TransactionLock::new("sqlite", "k", None).fencing_token(),
            None
        );
    }
}
