//! The one error type of the crate.

use std::error::Error as StdError;
use std::sync::Arc;
use std::time::Duration;

/// A boxed error from a driver, kept as the [`source`](std::error::Error::source) of a [`LockError`].
pub type BoxError = Box<dyn StdError + Send + Sync + 'static>;

/// Everything that can go wrong while taking, keeping or giving back a lock.
///
/// Each variant has a stable machine-readable [`code`](LockError::code) and an HTTP
/// [`status`](LockError::status), so a service can answer contention without matching on
/// the variants itself. Messages say what happened and, where there is something to do,
/// what to do about it. Connection strings and passwords never appear in them.
///
/// Contention is an error (`Err(LockError::AlreadyHeld { .. })`), not an `Option`, so `?`
/// works in handlers; match on it where contention is expected:
///
/// ```
/// # async fn demo(locks: dlock::LockProvider) -> Result<(), dlock::LockError> {
/// match locks.try_acquire("jobs:billing").await {
///     Ok(guard) => { /* run the job */ guard.release().await?; }
///     Err(dlock::LockError::AlreadyHeld { .. }) => { /* another replica runs it */ }
///     Err(other) => return Err(other),
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LockError {
    /// The lock is held by someone else (another process, or another task of this process),
    /// and the acquisition was a single try (or had a zero timeout).
    #[error("lock `{key}` is already held")]
    AlreadyHeld {
        /// The key that was asked for.
        key: Arc<str>,
    },

    /// The lock stayed held by someone else for the whole timeout.
    #[error("timed out after {timeout:?} waiting for lock `{key}`")]
    Timeout {
        /// The key that was asked for.
        key: Arc<str>,
        /// The timeout that ran out.
        timeout: Duration,
    },

    /// Ownership of a lock was lost while it was held (its connection died, its lease ran out,
    /// or another owner took it over). Work protected by it may have overlapped with another
    /// holder's from that moment on. Also the answer of a single try on a lease store that
    /// granted the lock too late to count on its lease (the lock was given back at once).
    #[error("lock `{key}` was lost: {reason}")]
    Lost {
        /// The key of the lost lock.
        key: Arc<str>,
        /// Why the lock is known or presumed lost.
        reason: String,
    },

    /// The lock asked for is already held by the task asking (by this request, behind
    /// `dlock_axum::LockLayer`): locks are not reentrant, and waiting would wait for itself.
    /// Found where the holder runs its work through [`run_holding`](crate::run_holding), as
    /// the axum layer and `#[distributed_lock]` do; take the lock once, and pass its guard (or
    /// `HeldLock`) to what needs it.
    #[error(
        "lock `{key}` is already held by this request (locks are not reentrant): the task that \
         asks for it holds it already, so waiting would only wait for itself; take it once"
    )]
    Reentrant {
        /// The key that was asked for.
        key: Arc<str>,
    },

    /// The acquisition was canceled through its cancellation token before it completed.
    #[error("acquisition of lock `{key}` was canceled")]
    Canceled {
        /// The key that was asked for.
        key: Arc<str>,
    },

    /// The key cannot be used as a lock key.
    #[error("invalid lock key: {reason}")]
    InvalidKey {
        /// What is wrong with the key.
        reason: String,
    },

    /// The provider was configured wrongly: an unknown URL scheme, a malformed URL, an option
    /// with a bad value, a lock file that cannot be used.
    #[error("configuration error: {message}")]
    Config {
        /// What is wrong and how to fix it.
        message: String,
    },

    /// The backend cannot do what was asked (for example a transaction-bound lock on an engine
    /// that has no such thing).
    #[error("{backend} does not support {operation}: {message}")]
    Unsupported {
        /// The backend's name, as in [`LockBackend::name`](crate::backend::LockBackend::name).
        backend: &'static str,
        /// The operation that was asked for.
        operation: &'static str,
        /// Why not, and what to use instead.
        message: String,
    },

    /// The lock store could not be reached (connection refused, connection lost, server
    /// shutting down). Retrying later may succeed.
    #[error("{backend} lock store is unavailable: {message}")]
    Unavailable {
        /// The backend's name.
        backend: &'static str,
        /// What failed, without connection strings or passwords.
        message: String,
        /// The driver's error.
        #[source]
        source: Option<BoxError>,
    },

    /// The lock store answered with an error.
    #[error("{backend} lock store failed: {message}")]
    Backend {
        /// The backend's name.
        backend: &'static str,
        /// What failed.
        message: String,
        /// The database's own error code (SQLSTATE, SQLite extended code, MySQL error number,
        /// Redis error prefix), for callers who must branch on it.
        db_code: Option<String>,
        /// The driver's error.
        #[source]
        source: Option<BoxError>,
    },
}

impl LockError {
    /// A stable, machine-readable code for the error, such as `"DistributedLock.AlreadyHeld"`.
    ///
    /// ```
    /// let err = dlock::LockError::AlreadyHeld { key: "k".into() };
    /// assert_eq!(err.code(), "DistributedLock.AlreadyHeld");
    /// assert_eq!(err.status(), 409);
    /// ```
    pub fn code(&self) -> &'static str {
        match self {
            LockError::AlreadyHeld { .. } => "DistributedLock.AlreadyHeld",
            LockError::Timeout { .. } => "DistributedLock.Timeout",
            LockError::Lost { .. } => "DistributedLock.Lost",
            LockError::Canceled { .. } => "DistributedLock.Canceled",
            LockError::Reentrant { .. } => "DistributedLock.Reentrant",
            LockError::InvalidKey { .. } => "DistributedLock.InvalidKey",
            LockError::Config { .. } => "DistributedLock.Configuration",
            LockError::Unsupported { .. } => "DistributedLock.Unsupported",
            LockError::Unavailable { .. } => "DistributedLock.Unavailable",
            LockError::Backend { .. } => "DistributedLock.BackendError",
        }
    }

    /// The HTTP status that best answers a request that failed with this error:
    /// 409 held, 408 timeout, 500 lost, 499 canceled, 400 invalid key, 503 store unreachable,
    /// 501 unsupported, 500 otherwise (a reentrant acquisition included: a server mistake).
    pub fn status(&self) -> u16 {
        match self {
            LockError::AlreadyHeld { .. } => 409,
            LockError::Timeout { .. } => 408,
            LockError::Lost { .. } => 500,
            LockError::Canceled { .. } => 499,
            LockError::Reentrant { .. } => 500,
            LockError::InvalidKey { .. } => 400,
            LockError::Config { .. } => 500,
            LockError::Unsupported { .. } => 501,
            LockError::Unavailable { .. } => 503,
            LockError::Backend { .. } => 500,
        }
    }

    /// Whether this error is contention (the lock is held elsewhere), either at once
    /// ([`AlreadyHeld`](LockError::AlreadyHeld)) or for the whole timeout
    /// ([`Timeout`](LockError::Timeout)).
    pub fn is_contention(&self) -> bool {
        matches!(
            self,
            LockError::AlreadyHeld { .. } | LockError::Timeout { .. }
        )
    }

    /// Whether trying again later may succeed: contention, a canceled wait, an unreachable store.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            LockError::AlreadyHeld { .. }
                | LockError::Timeout { .. }
                | LockError::Canceled { .. }
                | LockError::Unavailable { .. }
        )
    }

    /// The key this error is about, where it names one.
    pub fn key(&self) -> Option<&str> {
        match self {
            LockError::AlreadyHeld { key }
            | LockError::Timeout { key, .. }
            | LockError::Lost { key, .. }
            | LockError::Reentrant { key }
            | LockError::Canceled { key } => Some(key),
            _ => None,
        }
    }

    /// The database's own error code, where the store answered with one.
    pub fn db_code(&self) -> Option<&str> {
        match self {
            LockError::Backend { db_code, .. } => db_code.as_deref(),
            _ => None,
        }
    }

    /// A configuration error with the given message.
    pub fn config(message: impl Into<String>) -> Self {
        LockError::Config {
            message: message.into(),
        }
    }

    /// An [`Unavailable`](LockError::Unavailable) error for `backend`.
    pub fn unavailable(
        backend: &'static str,
        message: impl Into<String>,
        source: Option<BoxError>,
    ) -> Self {
        LockError::Unavailable {
            backend,
            message: message.into(),
            source,
        }
    }

    /// A [`Backend`](LockError::Backend) error for `backend`.
    pub fn backend(
        backend: &'static str,
        message: impl Into<String>,
        db_code: Option<String>,
        source: Option<BoxError>,
    ) -> Self {
        LockError::Backend {
            backend,
            message: message.into(),
            db_code,
            source,
        }
    }

    /// An [`Unsupported`](LockError::Unsupported) error.
    pub fn unsupported(
        backend: &'static str,
        operation: &'static str,
        message: impl Into<String>,
    ) -> Self {
        LockError::Unsupported {
            backend,
            operation,
            message: message.into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_and_statuses() {
        let k: Arc<str> = "k".into();
        let cases = [
            (
                LockError::AlreadyHeld { key: k.clone() },
                "DistributedLock.AlreadyHeld",
                409,
            ),
            (
                LockError::Timeout {
                    key: k.clone(),
                    timeout: Duration::from_secs(1),
                },
                "DistributedLock.Timeout",
                408,
            ),
            (
                LockError::Lost {
                    key: k.clone(),
                    reason: "x".into(),
                },
                "DistributedLock.Lost",
                500,
            ),
            (
                LockError::Canceled { key: k.clone() },
                "DistributedLock.Canceled",
                499,
            ),
            (
                LockError::InvalidKey { reason: "x".into() },
                "DistributedLock.InvalidKey",
                400,
            ),
            (
                LockError::Reentrant { key: k.clone() },
                "DistributedLock.Reentrant",
                500,
            ),
            (
                LockError::unavailable("sqlite", "down", None),
                "DistributedLock.Unavailable",
                503,
            ),
        ];
        for (err, code, status) in cases {
            assert_eq!(err.code(), code);
            assert_eq!(err.status(), status);
        }
    }

    #[test]
    fn the_other_codes_and_statuses() {
        let cases = [
            (LockError::config("x"), "DistributedLock.Configuration", 500),
            (
                LockError::unsupported("memory", "transactions", "no"),
                "DistributedLock.Unsupported",
                501,
            ),
            (
                LockError::backend("memory", "failed", Some("40001".into()), None),
                "DistributedLock.BackendError",
                500,
            ),
        ];
        for (err, code, status) in cases {
            assert_eq!(err.code(), code);
            assert_eq!(err.status(), status);
        }
    }

    #[test]
    fn classes_keys_and_database_codes() {
        let k: Arc<str> = "k".into();
        let held = LockError::AlreadyHeld { key: k.clone() };
        let timeout = LockError::Timeout {
            key: k.clone(),
            timeout: Duration::from_secs(1),
        };
        let lost = LockError::Lost {
            key: k.clone(),
            reason: "gone".into(),
        };
        let canceled = LockError::Canceled { key: k.clone() };
        let invalid = LockError::InvalidKey { reason: "x".into() };
        let unavailable = LockError::unavailable("memory", "down", None);
        let backend = LockError::backend("memory", "failed", Some("40001".into()), None);
        let config = LockError::config("bad");

        let contention: Vec<bool> = [&held, &timeout, &lost, &canceled, &unavailable, &config]
            .iter()
            .map(|e| e.is_contention())
            .collect();
        assert_eq!(contention, [true, true, false, false, false, false]);
        let retryable: Vec<bool> = [
            &held,
            &timeout,
            &lost,
            &canceled,
            &invalid,
            &unavailable,
            &backend,
            &config,
        ]
        .iter()
        .map(|e| e.is_retryable())
        .collect();
        assert_eq!(
            retryable,
            [true, true, false, true, false, true, false, false]
        );
        for e in [&held, &timeout, &lost, &canceled] {
            assert_eq!(e.key(), Some("k"), "{e:?}");
        }
        assert_eq!(invalid.key(), None);
        assert_eq!(backend.db_code(), Some("40001"));
        assert_eq!(unavailable.db_code(), None);
        assert_eq!(
            LockError::backend("memory", "failed", None, None).db_code(),
            None
        );
        assert_eq!(config.to_string(), "configuration error: bad");
        assert_eq!(
            unavailable.to_string(),
            "memory lock store is unavailable: down"
        );
        assert_eq!(backend.to_string(), "memory lock store failed: failed");
        assert_eq!(
            LockError::unsupported("memory", "transactions", "no").to_string(),
            "memory does not support transactions: no"
        );
    }
}
