//! The provider: the entry point of the crate.

use std::borrow::Cow;
use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use opentelemetry::metrics::Meter;
use tokio_util::sync::CancellationToken;

use crate::backend::{Acquired, LockBackend, LockRequest, ReleaseWatch, WaitTry};
use crate::backoff::Pauses;
use crate::key::validate_key;
use crate::metrics::{Metrics, OptIn};
use crate::table::{LocalTable, Slot};
use crate::{Backoff, LockError, LockGuard};

/// Hands out distributed locks on one lock store.
///
/// A provider is cheap to clone (an [`Arc`] inside) and is meant to be created once and shared
/// (in application state, an axum `State`, a `static`). It does not depend on the backend's
/// type, so the attribute macro and the axum layer work with every backend.
///
/// Locks are **not reentrant**: a second acquisition of a key this provider holds is contention,
/// answered from the provider's in-process table without asking the store. Tasks of this
/// process that wait for such a key queue in order and take it when the local holder lets go.
///
/// ```
/// use std::time::Duration;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), dlock::LockError> {
/// # let dir = tempfile::tempdir().unwrap();
/// # let url = format!("sqlite://{}/locks.db", dir.path().display());
/// let locks = dlock::LockProvider::connect(&url).await?;
///
/// let guard = locks.acquire("invoices:42", Duration::from_secs(10)).await?;
/// assert!(matches!(
///     locks.try_acquire("invoices:42").await,
///     Err(dlock::LockError::AlreadyHeld { .. })
/// ));
/// guard.release().await?;
///
/// let total = locks
///     .with_lock("reports:daily", Duration::from_secs(15), |_lost| async { 40 + 2 })
///     .await?;
/// assert_eq!(total, 42);
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct LockProvider {
    inner: Arc<Inner>,
}

struct Inner {
    backend: Arc<dyn LockBackend>,
    table: Arc<LocalTable>,
    backoff: Backoff,
    lease: Option<Duration>,
    /// Whether leased locks are renewed while held, unless an acquisition says otherwise.
    renew: bool,
    shutdown: Option<CancellationToken>,
    metrics: Arc<Metrics>,
    /// The owner label stored with this provider's locks.
    owner_label: Arc<str>,
    /// Records nothing, and shows nothing to inspection: the metrics of the locks this crate
    /// takes for itself (a semaphore's queue lock).
    quiet: Arc<Metrics>,
}

/// A lock taken in the store, with its slot in the table, before it is handed out in a
/// guard.
pub(crate) struct Taken {
    pub(crate) slot: Slot,
    pub(crate) acquired: Acquired,
    pub(crate) runtime: tokio::runtime::Handle,
}

/// The lease terms one acquisition asks for: `None` takes the provider's.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Terms {
    pub(crate) lease: Option<Duration>,
    pub(crate) renew: Option<bool>,
    /// An acquisition of this crate's own (a semaphore's slot or queue lock), whose key may
    /// use the reserved prefix.
    pub(crate) internal: bool,
    /// A read (shared) lock.
    pub(crate) shared: bool,
}

impl Terms {
    pub(crate) fn read() -> Self {
        Terms {
            shared: true,
            ..Terms::default()
        }
    }
}

/// The URL schemes [`LockProvider::connect`] understands.
pub const SUPPORTED_SCHEMES: &str = "sqlite://, postgres:// (postgresql://), mysql://, mariadb://, mssql:// (sqlserver://), oracle://, redis:// (rediss://), redis+sentinel:// (rediss+sentinel://), redis+cluster:// (rediss+cluster://), redlock:// (rediss+redlock://), etcd://";

impl LockProvider {
    /// Connects to the lock store named by `url`; the scheme picks the backend.
    ///
    /// | scheme | backend | cargo feature |
    /// |---|---|---|
    /// | `sqlite://relative.db`, `sqlite:///absolute/path.db` | [`sqlite`](crate::sqlite) | `sqlite` (default) |
    /// | `postgres://`, `postgresql://` | PostgreSQL | `postgres` |
    /// | `mysql://`, `mariadb://` | [MySQL / MariaDB](crate::mysql) | `mysql` |
    /// | `mssql://`, `sqlserver://` | SQL Server | `mssql` |
    /// | `oracle://` | Oracle | `oracle` |
    /// | `redis://`, `rediss://` | [Redis / Valkey](crate::redis) | `redis` |
    /// | `redis+sentinel://host:port,host:port/SERVICE`, `rediss+sentinel://...` (TLS) | [Redis behind Sentinel](crate::redis#sentinel): the master the sentinels name | `redis` |
    /// | `redis+cluster://host:port,host:port`, `rediss+cluster://...` (TLS) | [Redis Cluster](crate::redis#cluster) | `redis` |
    /// | `redlock://host:port,host:port,host:port`, `rediss+redlock://...` (TLS) | [Redlock](crate::redis::RedlockBackend) over independent Redis / Valkey nodes | `redis` |
    /// | `etcd://host:port[,host:port...]` | [etcd](crate::etcd) | `etcd` |
    ///
    /// Each backend documents its own query options (for example `?lease=30s`). Their values
    /// are read the same way everywhere: durations as [`parse_duration`](crate::parse_duration)
    /// reads them (`30s`, `500ms`, `1h 30m`, `1.5s`, a bare number of seconds); booleans as
    /// `true`, `false`, `1`, `0`, `yes`, `no`, `on` or `off`, in any case; counts as whole
    /// numbers. An option the backend does not know is an error that lists the ones it does.
    ///
    /// Errors with [`LockError::Config`] for an unknown scheme, a malformed URL, or a backend
    /// this build was compiled without; with [`LockError::Unavailable`] when the store cannot
    /// be reached. Error messages never repeat the URL (it may carry a password).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: dropping the future closes whatever connection it had opened.
    pub async fn connect(url: &str) -> Result<LockProvider, LockError> {
        let Some((scheme, _)) = url.split_once(':') else {
            return Err(LockError::config(format!(
                "the lock store URL has no scheme; expected one of {SUPPORTED_SCHEMES}"
            )));
        };
        let scheme = scheme.to_ascii_lowercase();
        match scheme.as_str() {
            "sqlite" => connect_sqlite(url).await,
            "postgres" | "postgresql" => connect_postgres(url).await,
            "mysql" | "mariadb" => connect_mysql(url).await,
            "mssql" | "sqlserver" => connect_mssql(url).await,
            "oracle" => connect_oracle(url).await,
            "redis" | "rediss" | "redis+sentinel" | "rediss+sentinel" | "redis+cluster"
            | "rediss+cluster" => connect_redis(url).await,
            "redlock" | "rediss+redlock" => connect_redlock(url).await,
            "etcd" => connect_etcd(url).await,
            _ => Err(LockError::config(format!(
                "unknown lock store URL scheme `{}`; expected one of {SUPPORTED_SCHEMES}",
                crate::options::shown(&scheme)
            ))),
        }
    }

    /// A provider on a backend with the default settings. See [`builder`](LockProvider::builder)
    /// for the others.
    pub fn from_backend(backend: impl LockBackend) -> LockProvider {
        LockProvider::builder(backend).build()
    }

    /// A builder for a provider on `backend`, to set the backoff, the default lease and a
    /// shutdown token.
    pub fn builder(backend: impl LockBackend) -> ProviderBuilder {
        ProviderBuilder {
            backend: Arc::new(backend),
            backoff: Backoff::default(),
            lease: None,
            renew: true,
            shutdown: None,
            meter: None,
            meter_name: None,
            metrics: OptIn::default(),
            owner_label: None,
        }
    }

    /// One attempt to take the lock, without waiting.
    ///
    /// Returns [`LockError::AlreadyHeld`] when it is held elsewhere. When this provider holds
    /// the key itself (another task of the process has it), the answer comes from the
    /// in-process table with no I/O and no allocation. On a lease backend, returns
    /// [`LockError::Lost`] when the store granted the lock but answered too late to count on
    /// its lease (the lock has been given back); [`acquire`](LockProvider::acquire) tries
    /// again instead.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: if the future is dropped, no lock is left held.
    pub async fn try_acquire(&self, key: &str) -> Result<LockGuard, LockError> {
        self.acquire_with(key, Duration::ZERO, None, Terms::default(), None)
            .await
    }

    /// Takes the lock, waiting up to `timeout` for it.
    ///
    /// Backends with a blocking wait of their own (PostgreSQL, MySQL, SQL Server, Oracle) wait
    /// on the server; Redis and Valkey wake their waiters when the lock is released, and are
    /// polled only as a fallback (see [`Backoff`]); the others are polled with exponential
    /// backoff and jitter. Returns
    /// [`LockError::Timeout`] after at least `timeout` (and at most one backoff pause more).
    /// `Duration::ZERO` is one try (contention is then [`LockError::AlreadyHeld`]);
    /// `Duration::MAX` waits without limit.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: if the future is dropped while waiting, the wait ends and no lock is left
    /// held. Use [`lock`](LockProvider::lock) with
    /// [`cancel_on`](LockBuilder::cancel_on) to end a wait with [`LockError::Canceled`].
    pub async fn acquire(&self, key: &str, timeout: Duration) -> Result<LockGuard, LockError> {
        self.acquire_with(key, timeout, None, Terms::default(), None)
            .await
    }

    /// One attempt to take a read lock on `key`, without waiting.
    ///
    /// Read locks share the key space of [`try_acquire`](LockProvider::try_acquire): any
    /// number of readers hold a key together, while an exclusive lock of the key excludes them
    /// all and is excluded by each of them. Readers of one provider share the key with no
    /// extra round trip through the in-process table, but each holds its own share in the
    /// store. Contention (a writer holds the key, or, in this process, a writer is waiting for
    /// it) is [`LockError::AlreadyHeld`]. Backends without a shared lock mode answer
    /// [`LockError::Unsupported`] (see the crate docs for which have one).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), dlock::LockError> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let url = format!("sqlite://{}/locks.db", dir.path().display());
    /// let locks = dlock::LockProvider::connect(&url).await?;
    /// let first = locks.try_acquire_read("prices").await?;
    /// let second = locks.try_acquire_read("prices").await?;
    /// assert!(matches!(
    ///     locks.try_acquire("prices").await,
    ///     Err(dlock::LockError::AlreadyHeld { .. })
    /// ));
    /// first.release().await?;
    /// second.release().await?;
    /// locks.try_acquire("prices").await?.release().await?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: if the future is dropped, no lock is left held.
    pub async fn try_acquire_read(&self, key: &str) -> Result<LockGuard, LockError> {
        self.acquire_with(key, Duration::ZERO, None, Terms::read(), None)
            .await
    }

    /// Takes a read lock on `key`, waiting up to `timeout` for writers to leave: readers share
    /// the key, writers exclude them (see [`try_acquire_read`](LockProvider::try_acquire_read)).
    ///
    /// Writers are not starved by a steady stream of readers: in this process a waiting writer
    /// holds back readers that come after it, and each backend's store does the same across
    /// processes (the backend docs say how). Timeouts, backoff and cancellation work as in
    /// [`acquire`](LockProvider::acquire).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: if the future is dropped while waiting, the wait ends and no lock is left
    /// held.
    pub async fn acquire_read(&self, key: &str, timeout: Duration) -> Result<LockGuard, LockError> {
        self.acquire_with(key, timeout, None, Terms::read(), None)
            .await
    }

    /// Runs `f` while holding the lock, then releases it.
    ///
    /// `f` gets the lock's lost token, cancelled if ownership is lost while it runs. Before
    /// each poll of `f`'s future the lease's clock is checked (as
    /// [`LockGuard::is_lost`] does), so after a pause of the process past the lease the token
    /// is already cancelled at `f`'s next step; a task `f` spawns with the token is not polled
    /// here, and may see it late (give it a [`LostSignal`](crate::LostSignal) instead, from
    /// [`lock`](LockProvider::lock)'s guard). If `f`
    /// panics or its future is dropped, the guard is dropped with it and the lock is released
    /// in the background. Returns [`LockError::Lost`] instead of `f`'s output when the lock was
    /// lost before `f` finished (the work may have overlapped with another holder's).
    ///
    /// To end the wait on a cancellation token of the caller's (with [`LockError::Canceled`]),
    /// and give `f` a token linked to both, use the builder's
    /// [`with_lock`](LockBuilder::with_lock):
    /// `locks.lock(key).timeout(t).cancel_on(&token).with_lock(f)`.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe as far as the lock goes (it is released); whatever `f` was doing is dropped
    /// mid-way, as with any future.
    pub async fn with_lock<F, Fut, T>(
        &self,
        key: &str,
        timeout: Duration,
        f: F,
    ) -> Result<T, LockError>
    where
        F: FnOnce(CancellationToken) -> Fut,
        Fut: Future<Output = T>,
    {
        let guard = self.acquire(key, timeout).await?;
        let output = guard.checked(f(guard.lost_token().clone())).await;
        guard.release().await?;
        Ok(output)
    }

    /// Takes the lock for a command whose key and timeout it defines itself (see
    /// [`LockedCommand`], which `#[distributed_lock]` implements for structs).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe, as [`acquire`](LockProvider::acquire).
    pub async fn acquire_for<C>(&self, command: &C) -> Result<LockGuard, LockError>
    where
        C: LockedCommand + ?Sized,
    {
        let key = command.lock_key();
        self.acquire(&key, command.lock_timeout()).await
    }

    /// Starts building an acquisition of `key` with the less common options: a cancellation
    /// token, a lease, a backoff policy.
    ///
    /// ```
    /// # async fn demo(locks: dlock::LockProvider) -> Result<(), dlock::LockError> {
    /// use std::time::Duration;
    /// let shutdown = tokio_util::sync::CancellationToken::new();
    /// let guard = locks
    ///     .lock("jobs:nightly")
    ///     .timeout(Duration::from_secs(30))
    ///     .cancel_on(&shutdown)
    ///     .lease(Duration::from_secs(60))
    ///     .acquire()
    ///     .await?;
    /// # drop(guard); Ok(()) }
    /// ```
    pub fn lock<'a>(&'a self, key: &'a str) -> LockBuilder<'a> {
        LockBuilder {
            provider: self,
            key,
            timeout: Duration::MAX,
            cancel: None,
            terms: Terms::default(),
            backoff: None,
        }
    }

    /// A provider on the same store and the same in-process table (so the two exclude each
    /// other as one provider would) whose pending and future acquisitions also end with
    /// [`LockError::Canceled`] once `shutdown` is cancelled, for graceful shutdown of a
    /// provider made by [`connect`](LockProvider::connect). Replaces a token set with
    /// [`ProviderBuilder::cancel_on`]; locks already held are not released by it.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), dlock::LockError> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let url = format!("sqlite://{}/locks.db", dir.path().display());
    /// let shutdown = dlock::CancellationToken::new();
    /// let locks = dlock::LockProvider::connect(&url).await?.with_shutdown(&shutdown);
    /// shutdown.cancel();
    /// assert!(matches!(
    ///     locks.try_acquire("jobs:billing").await,
    ///     Err(dlock::LockError::Canceled { .. })
    /// ));
    /// # Ok(()) }
    /// ```
    pub fn with_shutdown(&self, shutdown: &CancellationToken) -> LockProvider {
        LockProvider {
            inner: Arc::new(Inner {
                backend: Arc::clone(&self.inner.backend),
                table: Arc::clone(&self.inner.table),
                backoff: self.inner.backoff,
                lease: self.inner.lease,
                renew: self.inner.renew,
                shutdown: Some(shutdown.clone()),
                metrics: Arc::clone(&self.inner.metrics),
                owner_label: Arc::clone(&self.inner.owner_label),
                quiet: Arc::clone(&self.inner.quiet),
            }),
        }
    }

    /// The provider's metrics, which also keep what inspection shows of its held locks.
    pub(crate) fn metrics(&self) -> &Arc<Metrics> {
        &self.inner.metrics
    }

    /// The metrics of the locks this crate takes for itself: they record nothing and are not
    /// shown by inspection.
    pub(crate) fn quiet_metrics(&self) -> &Arc<Metrics> {
        &self.inner.quiet
    }

    /// The lease asked for by default, and whether leases are renewed by default.
    pub(crate) fn lease_terms(&self) -> (Option<Duration>, bool) {
        (self.inner.lease, self.inner.renew)
    }

    /// The provider's backend.
    pub(crate) fn backend(&self) -> &dyn LockBackend {
        &*self.inner.backend
    }

    /// The provider's in-process table.
    pub(crate) fn table(&self) -> &Arc<LocalTable> {
        &self.inner.table
    }

    /// The provider's backoff, for waits that poll (for the helpers over the provider; the
    /// semaphore's waits pause on a schedule of their own).
    #[allow(dead_code)]
    pub(crate) fn backoff(&self) -> Backoff {
        self.inner.backoff
    }

    /// The provider's shutdown token, if it has one.
    pub(crate) fn shutdown_token(&self) -> Option<&CancellationToken> {
        self.inner.shutdown.as_ref()
    }

    /// The backend's name (`"sqlite"`, `"postgres"`, ...).
    pub fn backend_name(&self) -> &'static str {
        self.inner.backend.name()
    }

    /// The label stored with this provider's locks where the store keeps one (see
    /// [`ProviderBuilder::owner_label`]).
    pub fn owner_label(&self) -> &str {
        &self.inner.owner_label
    }

    /// Checks that the lock store answers, with one cheap round trip: a `SELECT 1` on a lock
    /// connection (PostgreSQL, MySQL, SQL Server, Oracle), a `PING` (Redis), a read of the lock
    /// table (SQLite), a linearizable read of one key (etcd, sent again to another member when
    /// an attempt reaches one that is down). For health checks: `Ok(())` when the store can be
    /// reached, otherwise
    /// the error an acquisition would meet ([`LockError::Unavailable`] for a store that is
    /// down). Must run inside a Tokio runtime.
    ///
    /// ```
    /// # async fn demo(locks: dlock::LockProvider) {
    /// let healthy = locks.ping().await.is_ok();
    /// # let _ = healthy; }
    /// ```
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it takes and holds nothing.
    pub async fn ping(&self) -> Result<(), LockError> {
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(LockError::config(
                "LockProvider::ping must run inside a Tokio runtime",
            ));
        }
        self.inner.backend.ping().await
    }

    /// Ends the lock of `key` in the store, **whoever holds it**: for an operator clearing a
    /// lock left by a stuck or dead deployment (`dlock release --force KEY` on the command
    /// line). `Ok(true)` when a lock was held and is now ended (every reader's share, for a
    /// read lock), `Ok(false)` when none was held.
    ///
    /// - **Lease stores** (SQLite, Redis and Valkey in every topology, Redlock on every node,
    ///   etcd) delete the lock. Its holder is not told at once: its
    ///   [lost token](crate::LockGuard::lost_token) fires at its next renewal (within a third of
    ///   its lease; on etcd at once, through its watch of the key), and its release then reports
    ///   [`LockError::Lost`]. Until then it may still be working as if it held the lock, so pass
    ///   [fencing tokens](crate::LockGuard::fencing_token) to what the lock protects: the key's
    ///   fencing counter is left as it was, so the next holder's token is greater than the
    ///   ended holder's, and a forced release never lets a token be issued twice or go down.
    /// - **Session engines** (PostgreSQL, MySQL/MariaDB, SQL Server, Oracle) answer
    ///   [`LockError::Unsupported`]: their locks belong to the session that took them, and the
    ///   server can end one only by ending that session with every other lock it holds. The
    ///   message says how to find and end the session, if that is what you want.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), dlock::LockError> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let url = format!("sqlite://{}/locks.db", dir.path().display());
    /// let stuck = dlock::LockProvider::connect(&url).await?;
    /// let operator = dlock::LockProvider::connect(&url).await?;
    /// let guard = stuck.try_acquire("jobs:billing").await?;
    /// assert!(operator.force_release("jobs:billing").await?);
    /// assert!(!operator.force_release("jobs:billing").await?, "nothing left to end");
    /// let next = operator.try_acquire("jobs:billing").await?;
    /// assert!(next.fencing_token() > guard.fencing_token());
    /// # next.release().await?; drop(guard);
    /// # Ok(()) }
    /// ```
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe: a dropped future may or may not have ended the lock (run it again:
    /// `Ok(false)` then says it is gone).
    pub async fn force_release(&self, key: &str) -> Result<bool, LockError> {
        validate_key(key)?;
        crate::key::refuse_reserved(key)?;
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(LockError::config(
                "LockProvider::force_release must run inside a Tokio runtime",
            ));
        }
        let ended = self
            .inner
            .backend
            .force_releases()?
            .force_release(key)
            .await?;
        if ended {
            tracing::warn!(
                key,
                backend = self.backend_name(),
                "a lock was ended by force; its holder finds it lost at its next renewal"
            );
        }
        Ok(ended)
    }

    /// How many keys this provider holds or is acquiring right now: its locks and read locks
    /// (a key read by several tasks counts once), each semaphore it is waiting for, and, on
    /// a backend that keeps semaphores as slot locks, each slot it holds. A permit of a
    /// semaphore the store keeps natively takes no key of the provider.
    pub fn local_key_count(&self) -> usize {
        self.inner.table.len()
    }

    pub(crate) async fn acquire_with(
        &self,
        key: &str,
        timeout: Duration,
        cancel: Option<&CancellationToken>,
        terms: Terms,
        backoff: Option<&Backoff>,
    ) -> Result<LockGuard, LockError> {
        self.observed(
            key,
            timeout,
            self.acquire_untraced(key, timeout, cancel, terms, backoff),
        )
        .await
    }

    /// Runs the acquisition `attempt` of `key` in a span of its own, and records its outcome
    /// and wait in the metrics.
    pub(crate) async fn observed(
        &self,
        key: &str,
        timeout: Duration,
        attempt: impl Future<Output = Result<LockGuard, LockError>>,
    ) -> Result<LockGuard, LockError> {
        let backend = self.inner.backend.name();
        let span = tracing::debug_span!(
            "dlock.acquire",
            key,
            backend,
            timeout_ms = timeout.as_millis() as u64,
            outcome = tracing::field::Empty,
        );
        let started = Instant::now();
        // A wait is counted as waiting until its answer (or its drop); a single try is not.
        let waiting = (!timeout.is_zero()).then(|| self.inner.metrics.wait_started(backend, key));
        let outcome = crate::metrics::in_span(span.clone(), attempt).await;
        drop(waiting);
        let waited = started.elapsed();
        self.inner
            .metrics
            .acquisition(backend, key, &outcome, waited);
        if !span.is_disabled() {
            let status = match &outcome {
                Ok(_) => "acquired",
                Err(err) => err.code(),
            };
            span.record("outcome", status);
            span.in_scope(|| {
                tracing::debug!(
                    wait_ms = waited.as_secs_f64() * 1000.0,
                    outcome = status,
                    "lock acquisition ended"
                );
            });
        }
        outcome
    }

    async fn acquire_untraced(
        &self,
        key: &str,
        timeout: Duration,
        cancel: Option<&CancellationToken>,
        terms: Terms,
        backoff: Option<&Backoff>,
    ) -> Result<LockGuard, LockError> {
        let taken = self
            .acquire_raw(key, timeout, cancel, terms, backoff)
            .await?;
        Ok(LockGuard::new(
            taken.slot,
            taken.acquired,
            Arc::clone(&self.inner.metrics),
            taken.runtime,
        ))
    }

    /// Takes the lock `key` (its table slot, then the store's lock), without recording
    /// metrics or making a guard.
    pub(crate) async fn acquire_raw(
        &self,
        key: &str,
        timeout: Duration,
        cancel: Option<&CancellationToken>,
        terms: Terms,
        backoff: Option<&Backoff>,
    ) -> Result<Taken, LockError> {
        validate_key(key)?;
        let inner = &*self.inner;
        if !terms.internal {
            crate::key::refuse_reserved(key)?;
            crate::reentry::check(Arc::as_ptr(&inner.table) as usize, key, terms.shared)?;
        }
        let shutdown = inner.shutdown.as_ref();
        let one_try = timeout.is_zero();
        // `None` when the timeout is too long to represent: wait without limit. A single try
        // waits for nothing, and reads no clock for it.
        let deadline = if one_try {
            None
        } else {
            crate::time::deadline(Instant::now(), timeout)
        };
        if is_cancelled(cancel, shutdown) {
            return Err(LockError::Canceled {
                key: Arc::from(key),
            });
        }

        if terms.shared {
            inner.backend.shared_locks()?;
        }
        let mut slot = match inner.table.try_slot(key, terms.shared) {
            Ok(slot) => slot,
            Err(stored) if one_try => return Err(LockError::AlreadyHeld { key: stored }),
            Err(stored) => tokio::select! {
                biased;
                () = cancelled(cancel, shutdown) => return Err(LockError::Canceled { key: stored }),
                () = sleep_until(deadline) => return Err(LockError::Timeout { key: stored, timeout }),
                slot = inner.table.wait_slot(key, terms.shared) => slot,
            },
        };

        // The guard releases in the background on drop, which needs the runtime.
        let runtime = current_runtime()?;
        let request = LockRequest::new(key)
            .with_lease(terms.lease.or(inner.lease))
            .with_renewal(terms.renew.unwrap_or(inner.renew))
            .with_shared(terms.shared);
        let backend = &*inner.backend;
        let stored = Arc::clone(slot.key());
        let attempt = async {
            if one_try {
                return match backend.try_acquire(request).await? {
                    Some(acquired) => Ok(acquired),
                    None => Err(LockError::AlreadyHeld {
                        key: Arc::clone(&stored),
                    }),
                };
            }
            if backend.supports_native_wait() {
                let remaining = deadline.map_or(Duration::MAX, |deadline| {
                    deadline.saturating_duration_since(Instant::now())
                });
                return match backend.acquire_wait(request, remaining).await? {
                    Some(acquired) => Ok(acquired),
                    None => Err(LockError::Timeout {
                        key: Arc::clone(&stored),
                        timeout,
                    }),
                };
            }
            poll(
                backend,
                request,
                &mut slot,
                deadline,
                timeout,
                backoff.unwrap_or(&inner.backoff),
            )
            .await
        };
        let acquired = tokio::select! {
            biased;
            () = cancelled(cancel, shutdown) => {
                return Err(LockError::Canceled { key: stored })
            }
            acquired = attempt => acquired?,
        };
        Ok(Taken {
            slot,
            acquired,
            runtime,
        })
    }
}

/// The runtime a guard releases on when it is dropped: the current one, which every
/// acquisition needs.
pub(crate) fn current_runtime() -> Result<tokio::runtime::Handle, LockError> {
    tokio::runtime::Handle::try_current().map_err(|_| {
        LockError::config(
            "dlock runs on Tokio: acquire locks from within a Tokio runtime (for example under #[tokio::main])",
        )
    })
}

/// Polls `backend` until the lock is taken or the deadline passes. The last try happens at the
/// deadline, so a timeout is answered after at least `timeout`.
///
/// After the first try that meets contention, the backend is asked for a watch on the key's
/// releases ([`LockBackend::watch_releases`]). While that watch is live, the wait tries again
/// at each wake-up, and otherwise after the backend's `retry_within` (the holder's lease
/// running out) or the backoff's fallback poll, whichever is shorter; while it is not (or
/// without one), it polls with the backoff's pauses.
///
/// A watch goes on from one local waiter to the next: a wait starts with the watch the previous
/// local holder left in the slot, if any, and leaves its own there when it ends while another
/// local waiter is queued (see `table.rs`). Without that, each local waiter in turn dropped the
/// subscription when it got the lock and asked for it again when its first try met contention:
/// a release by another process in between went unheard, and on Redis the wait then slept out
/// its whole fair-waiting hold-off (see `dlock::redis`, Fair waiting).
async fn poll(
    backend: &dyn LockBackend,
    request: LockRequest<'_>,
    slot: &mut Slot,
    deadline: Option<Instant>,
    timeout: Duration,
    backoff: &Backoff,
) -> Result<Acquired, LockError> {
    let mut watch = slot.take_watch();
    let outcome = poll_watched(
        backend, request, slot, &mut watch, deadline, timeout, backoff,
    )
    .await;
    if let Some(watch) = watch {
        slot.leave_watch(watch);
    }
    outcome
}

/// [`poll`] with the watch it was handed (`None`: ask for one after the first try that meets
/// contention).
async fn poll_watched(
    backend: &dyn LockBackend,
    request: LockRequest<'_>,
    slot: &Slot,
    watch: &mut Option<Box<dyn ReleaseWatch>>,
    deadline: Option<Instant>,
    timeout: Duration,
    backoff: &Backoff,
) -> Result<Acquired, LockError> {
    let mut pauses = Pauses::new(*backoff, deadline);
    // The longest pause the backoff takes, jitter included.
    let longest = backoff.max().mul_f64(1.0 + backoff.jitter());
    let mut asked_for_watch = watch.is_some();
    loop {
        let live = watch.as_ref().is_some_and(|watch| watch.is_live());
        let longest = if live {
            backoff.fallback_poll()
        } else {
            longest
        };
        let left = deadline.map_or(longest, |deadline| {
            deadline.saturating_duration_since(Instant::now())
        });
        let request = request.with_poll_pause(Some(longest.min(left)));
        if let Some(watch) = watch {
            watch.mark_seen();
        }
        let retry_within = match backend.try_acquire_in_wait(request).await {
            Ok(WaitTry::Acquired(acquired)) => return Ok(acquired),
            Ok(WaitTry::Held { retry_within }) => retry_within,
            // Taken, but the store's answer came too late to count on the lease; the backend
            // gave it back. A wait tries again (see `LockBackend::try_acquire`).
            Err(LockError::Lost { .. }) => None,
            Err(err) => return Err(err),
        };
        if !asked_for_watch {
            asked_for_watch = true;
            let watching = backend.watch_releases(request);
            *watch = match deadline {
                Some(deadline) => tokio::time::timeout_at(deadline.into(), watching)
                    .await
                    .unwrap_or(None),
                None => watching.await,
            };
            if watch.as_ref().is_some_and(|watch| watch.is_live()) {
                // The lock may have been given back before the watch was in place, with no
                // wake-up for this waiter: one more try at once.
                continue;
            }
        }
        let live = watch.as_ref().is_some_and(|watch| watch.is_live());
        let pause = if live {
            let fallback = backoff.fallback_delay();
            pauses.cut(retry_within.map_or(fallback, |within| within.min(fallback)))
        } else {
            pauses
                .next_pause()
                .map(|pause| retry_within.map_or(pause, |within| pause.min(within)))
        };
        let Some(pause) = pause else {
            return Err(LockError::Timeout {
                key: Arc::clone(slot.key()),
                timeout,
            });
        };
        match watch {
            Some(watch) => tokio::select! {
                () = tokio::time::sleep(pause) => {}
                () = watch.woken() => {}
            },
            None => tokio::time::sleep(pause).await,
        }
    }
}

pub(crate) fn is_cancelled(a: Option<&CancellationToken>, b: Option<&CancellationToken>) -> bool {
    a.is_some_and(CancellationToken::is_cancelled) || b.is_some_and(CancellationToken::is_cancelled)
}

pub(crate) async fn cancelled(a: Option<&CancellationToken>, b: Option<&CancellationToken>) {
    match (a, b) {
        (Some(a), Some(b)) => tokio::select! {
            () = a.cancelled() => {}
            () = b.cancelled() => {}
        },
        (Some(token), None) | (None, Some(token)) => token.cancelled().await,
        (None, None) => std::future::pending().await,
    }
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline.into()).await,
        None => std::future::pending().await,
    }
}

/// Defines `connect_<backend>(url)` for each backend: the backend's own `connect` when its
/// feature is on, a configuration error naming the feature when it is off.
macro_rules! connectors {
    ($($name:ident => $feature:literal, $engine:literal, $backend:path;)*) => {$(
        #[cfg(feature = $feature)]
        async fn $name(url: &str) -> Result<LockProvider, LockError> {
            <$backend>::connect(url)
                .await
                .map(LockProvider::from_backend)
        }

        #[cfg(not(feature = $feature))]
        async fn $name(_url: &str) -> Result<LockProvider, LockError> {
            Err(not_built($feature, $engine))
        }
    )*};
}

connectors! {
    connect_sqlite => "sqlite", "SQLite", crate::sqlite::SqliteBackend;
    connect_postgres => "postgres", "PostgreSQL", crate::postgres::PostgresBackend;
    connect_mysql => "mysql", "MySQL and MariaDB", crate::mysql::MySqlBackend;
    connect_mssql => "mssql", "SQL Server", crate::mssql::MssqlBackend;
    connect_oracle => "oracle", "Oracle", crate::oracle::OracleBackend;
    connect_redis => "redis", "Redis", crate::redis::RedisBackend;
    connect_redlock => "redis", "Redlock (Redis)", crate::redis::RedlockBackend;
    connect_etcd => "etcd", "etcd", crate::etcd::EtcdBackend;
}

// Unused only in a build with every backend.
#[cfg_attr(
    all(
        feature = "sqlite",
        feature = "postgres",
        feature = "mysql",
        feature = "mssql",
        feature = "oracle",
        feature = "redis",
        feature = "etcd"
    ),
    allow(dead_code)
)]
fn not_built(feature: &str, engine: &str) -> LockError {
    LockError::config(format!(
        "this build of dlock has no {engine} backend: enable the `{feature}` cargo feature of dlock"
    ))
}

impl fmt::Debug for LockProvider {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockProvider")
            .field("backend", &self.inner.backend)
            .field("backoff", &self.inner.backoff)
            .field("lease", &self.inner.lease)
            .field("local_keys", &self.inner.table.len())
            .finish()
    }
}

/// Builds a [`LockProvider`] with non-default settings.
#[derive(Debug)]
#[must_use]
pub struct ProviderBuilder {
    backend: Arc<dyn LockBackend>,
    backoff: Backoff,
    lease: Option<Duration>,
    renew: bool,
    shutdown: Option<CancellationToken>,
    meter: Option<Meter>,
    meter_name: Option<Cow<'static, str>>,
    metrics: OptIn,
    owner_label: Option<String>,
}

impl ProviderBuilder {
    /// The label stored with each lock this provider takes, where the store can keep one, so
    /// that [`LockProvider::store_locks`] (and `dlock ls`) can say who holds a lock. Default:
    /// the host name and the process id, `host:pid`. Give it something an operator can act
    /// on: a deployment, a pod, a job name.
    ///
    /// Where it is kept, and what it costs (nothing is added to an uncontended acquisition's
    /// round trips):
    ///
    /// | store | kept | how |
    /// |---|---|---|
    /// | SQLite | yes | a row of the table `__distributed_lock_owners (id, label, written)`; each lock row's owner token starts with the backend's random 8-byte id |
    /// | Redis, Valkey (single, Sentinel, Cluster) | yes | the key `<prefix>` + byte `0xFF` + `owner:<id>`, with a day to live; each owner token starts with the backend's random id (16 hex digits), and is 32 digits long as before |
    /// | PostgreSQL | the session's `application_name` | read from `pg_stat_activity` (the URL's `application_name`, `dlock` by default); this label is not sent |
    /// | Redlock, MySQL, SQL Server, Oracle, etcd | no | Redlock does not pass it to its nodes; the others cannot list their locks |
    ///
    /// The record is written by the backend's first acquisition after the label is set (on
    /// SQLite in the acquisition's task, after its statement; on Redis by a task of its own),
    /// then by the first acquisition 12 hours after the last write; records not written for a
    /// day go (on SQLite, only those of backends that hold nothing). An acquisition pays one
    /// atomic load for it: its statement, command and owner token are as long as before.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), dlock::LockError> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// let backend = dlock::sqlite::SqliteBackend::open(dir.path().join("locks.db")).await?;
    /// let locks = dlock::LockProvider::builder(backend)
    ///     .owner_label("billing-worker-7")
    ///     .build();
    /// let guard = locks.try_acquire("jobs:billing").await?;
    /// let held = locks.store_locks().await?;
    /// assert_eq!(held[0].owner(), Some("billing-worker-7"));
    /// # drop(guard); Ok(()) }
    /// ```
    pub fn owner_label(mut self, label: impl Into<String>) -> Self {
        self.owner_label = Some(label.into());
        self
    }

    /// The OpenTelemetry meter to record into, instead of the global provider's meter named
    /// `dlock` (see the [`metrics` docs](crate::metrics) for the instruments). It takes
    /// precedence over [`meter_name`](ProviderBuilder::meter_name).
    pub fn meter(mut self, meter: Meter) -> Self {
        self.meter = Some(meter);
        self
    }

    /// The name of the global meter provider's meter to record into (default `dlock`,
    /// [`DEFAULT_METER_NAME`](crate::metrics::DEFAULT_METER_NAME)). Services that share
    /// dashboards with .NET services using the distributed-lock library dlock follows give
    /// it that library's meter name, `EricksonLopez.DistributedLock`
    /// ([`DOTNET_METER_NAME`](crate::metrics::DOTNET_METER_NAME)):
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), dlock::LockError> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// let backend = dlock::sqlite::SqliteBackend::open(dir.path().join("locks.db")).await?;
    /// let locks = dlock::LockProvider::builder(backend)
    ///     .meter_name("EricksonLopez.DistributedLock")
    ///     .build();
    /// # let _ = locks; Ok(()) }
    /// ```
    ///
    /// The meter is taken from the global meter provider when the provider is built: install
    /// the SDK before.
    pub fn meter_name(mut self, name: impl Into<Cow<'static, str>>) -> Self {
        self.meter_name = Some(name.into());
        self
    }

    /// Adds the attribute `key_prefix` (the key's text before its first `:`) to the metrics.
    /// Off by default; turn it on only when key prefixes are few (`jobs`, `account`, ...).
    pub fn metric_key_prefix(mut self, enabled: bool) -> Self {
        self.metrics.key_prefix = enabled;
        self
    }

    /// Adds the attribute `resource_id`, the whole key, to the metrics. Off by default.
    ///
    /// **Cardinality:** every distinct key becomes a time series of its own in every
    /// instrument, kept for the life of the process. Turn it on only when the keys are few and
    /// fixed (a handful of job names); keys made from ids (`account:{id}`) would grow the
    /// metrics without bound, until the SDK's cardinality limit folds them into one overflow
    /// series. [`metric_key_prefix`](ProviderBuilder::metric_key_prefix) is the bounded choice.
    pub fn metric_resource_id(mut self, enabled: bool) -> Self {
        self.metrics.resource_id = enabled;
        self
    }

    /// How waits are polled on backends without a native wait.
    pub fn backoff(mut self, backoff: Backoff) -> Self {
        self.backoff = backoff;
        self
    }

    /// The lease asked for by default on lease-based backends (SQLite, Redis), instead of the
    /// backend's own default. Ignored by session-based backends.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = Some(lease);
        self
    }

    /// Whether leased locks (SQLite, Redis) are renewed while they are held (default `true`).
    /// With `false`, a lock simply expires with its lease unless its holder calls
    /// [`LockGuard::extend`]; its lost token fires at the local deadline, four fifths of the
    /// lease after the acquisition was sent (the store frees it at the full lease). An
    /// acquisition can choose otherwise with [`LockBuilder::renewal`]. Ignored by
    /// session-based backends, whose locks last as long as their session.
    pub fn renewal(mut self, renew: bool) -> Self {
        self.renew = renew;
        self
    }

    /// A token that cancels every pending and future acquisition of the provider (with
    /// [`LockError::Canceled`]), for graceful shutdown. Locks already held are not released by
    /// it; drop their guards.
    pub fn cancel_on(mut self, shutdown: &CancellationToken) -> Self {
        self.shutdown = Some(shutdown.clone());
        self
    }

    /// The provider.
    pub fn build(self) -> LockProvider {
        let meter = self.meter.unwrap_or_else(|| {
            let name = self
                .meter_name
                .unwrap_or(Cow::Borrowed(crate::metrics::DEFAULT_METER_NAME));
            opentelemetry::global::meter_with_scope(
                opentelemetry::InstrumentationScope::builder(name).build(),
            )
        });
        let metrics = Arc::new(Metrics::new(&meter, self.metrics, self.backend.name()));
        let owner_label: Arc<str> = match self.owner_label {
            Some(label) => Arc::from(label),
            None => default_owner_label(),
        };
        self.backend.set_owner_label(&owner_label);
        let quiet = {
            use opentelemetry::metrics::MeterProvider as _;
            let meter = opentelemetry::metrics::noop::NoopMeterProvider::new().meter("dlock");
            Arc::new(Metrics::new(&meter, OptIn::default(), self.backend.name()))
        };
        LockProvider {
            inner: Arc::new(Inner {
                quiet,
                backend: self.backend,
                table: Arc::new(LocalTable::default()),
                backoff: self.backoff,
                lease: self.lease,
                renew: self.renew,
                shutdown: self.shutdown,
                metrics,
                owner_label,
            }),
        }
    }
}

/// This process's default owner label: `host:pid`, the host name as the kernel has it (or
/// `HOSTNAME`, else `unknown-host`).
/// Read at each build: a process forked after an earlier build has a process id of its own.
fn default_owner_label() -> Arc<str> {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|host| host.trim().to_owned())
        .filter(|host| !host.is_empty())
        .or_else(|| {
            std::env::var("HOSTNAME")
                .ok()
                .filter(|host| !host.is_empty())
        })
        .unwrap_or_else(|| "unknown-host".to_owned());
    Arc::from(format!("{host}:{}", std::process::id()))
}

/// One acquisition with options, started by [`LockProvider::lock`].
#[derive(Debug)]
#[must_use = "nothing is locked until `acquire` or `try_acquire` is awaited"]
pub struct LockBuilder<'a> {
    provider: &'a LockProvider,
    key: &'a str,
    timeout: Duration,
    cancel: Option<&'a CancellationToken>,
    terms: Terms,
    backoff: Option<Backoff>,
}

impl<'a> LockBuilder<'a> {
    /// How long [`acquire`](LockBuilder::acquire) waits; without limit unless set.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Ends the wait with [`LockError::Canceled`] when `token` is cancelled.
    pub fn cancel_on(mut self, token: &'a CancellationToken) -> Self {
        self.cancel = Some(token);
        self
    }

    /// The lease for this acquisition on lease-based backends (SQLite, Redis).
    pub fn lease(mut self, lease: Duration) -> Self {
        self.terms.lease = Some(lease);
        self
    }

    /// Whether this lock is renewed while held, instead of the provider's choice (see
    /// [`ProviderBuilder::renewal`]); lease-based backends only.
    pub fn renewal(mut self, renew: bool) -> Self {
        self.terms.renew = Some(renew);
        self
    }

    /// The backoff for this acquisition, instead of the provider's.
    pub fn backoff(mut self, backoff: Backoff) -> Self {
        self.backoff = Some(backoff);
        self
    }

    /// Takes a read lock, shared with other readers of the key, instead of an exclusive one
    /// (see [`LockProvider::try_acquire_read`]).
    pub fn read(mut self) -> Self {
        self.terms.shared = true;
        self
    }

    /// Takes the lock, waiting up to the timeout.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe, as [`LockProvider::acquire`].
    pub async fn acquire(self) -> Result<LockGuard, LockError> {
        self.provider
            .acquire_with(
                self.key,
                self.timeout,
                self.cancel,
                self.terms,
                self.backoff.as_ref(),
            )
            .await
    }

    /// One attempt, ignoring the timeout.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe, as [`LockProvider::try_acquire`].
    pub async fn try_acquire(self) -> Result<LockGuard, LockError> {
        self.provider
            .acquire_with(
                self.key,
                Duration::ZERO,
                self.cancel,
                self.terms,
                self.backoff.as_ref(),
            )
            .await
    }

    /// Takes the lock as [`acquire`](LockBuilder::acquire) does, runs `f` while holding it,
    /// then releases it: [`LockProvider::with_lock`] with this acquisition's options, notably
    /// the caller's cancellation token.
    ///
    /// - The token of [`cancel_on`](LockBuilder::cancel_on) ends the **wait** with
    ///   [`LockError::Canceled`]; `f` is then not called.
    /// - Once the lock is held, `f` gets a token cancelled when the caller's token is
    ///   cancelled **or** the lock is lost, whichever comes first (the two linked). The
    ///   lease's clock is checked before each poll of `f`'s future, as in
    ///   [`LockProvider::with_lock`], so after a pause past the lease the token is cancelled
    ///   before `f`'s next step. What `f`
    ///   does with it is up to `f`: its output is returned once it finishes, unless the lock
    ///   was lost meanwhile, in which case the result is [`LockError::Lost`] (the work may have
    ///   overlapped with another holder's).
    ///
    /// Without [`timeout`](LockBuilder::timeout) the wait has no limit.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), dlock::LockError> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let url = format!("sqlite://{}/locks.db", dir.path().display());
    /// use std::time::Duration;
    /// let locks = dlock::LockProvider::connect(&url).await?;
    /// let shutdown = dlock::CancellationToken::new();
    /// let sent = locks
    ///     .lock("reports:daily")
    ///     .timeout(Duration::from_secs(15))
    ///     .cancel_on(&shutdown)
    ///     .with_lock(|stop| async move {
    ///         // `stop` fires on shutdown or when the lock is lost.
    ///         if stop.is_cancelled() { 0 } else { 12 }
    ///     })
    ///     .await?;
    /// assert_eq!(sent, 12);
    ///
    /// shutdown.cancel();
    /// let again = locks.lock("reports:daily").cancel_on(&shutdown).with_lock(|_| async { 1 }).await;
    /// assert!(matches!(again, Err(dlock::LockError::Canceled { .. })));
    /// # Ok(()) }
    /// ```
    ///
    /// # Cancel safety
    ///
    /// Cancel safe as far as the lock goes: dropping the future while it waits ends the wait
    /// with no lock left held, and dropping it while `f` runs drops `f`'s future and the
    /// guard, which releases the lock in the background. Prefer the cancellation token to
    /// dropping: it ends the wait with a clear [`LockError::Canceled`], and lets `f` stop at a
    /// point of its choosing.
    pub async fn with_lock<F, Fut, T>(self, f: F) -> Result<T, LockError>
    where
        F: FnOnce(CancellationToken) -> Fut,
        Fut: Future<Output = T>,
    {
        let token = self
            .cancel
            .map_or_else(CancellationToken::new, CancellationToken::child_token);
        let guard = self.acquire().await?;
        let output = {
            let mut work = std::pin::pin!(f(token.clone()));
            let mut lost = std::pin::pin!(guard.lost_token().cancelled());
            std::future::poll_fn(|cx| {
                // `is_lost` also notices a leased lock past its local deadline.
                if !token.is_cancelled() && (guard.is_lost() || lost.as_mut().poll(cx).is_ready()) {
                    token.cancel();
                }
                work.as_mut().poll(cx)
            })
            .await
        };
        guard.release().await?;
        Ok(output)
    }
}

/// A command that names the lock it must run under.
///
/// `#[distributed_lock("account:{account_id}", timeout = 10)]` on a struct implements it; take
/// the lock with [`LockProvider::acquire_for`].
pub trait LockedCommand {
    /// The key of the lock this command runs under.
    fn lock_key(&self) -> String;
    /// How long to wait for the lock (`Duration::ZERO`: one try).
    fn lock_timeout(&self) -> Duration;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{Answer, MemoryBackend, Recorder};

    fn quick() -> Backoff {
        Backoff::new(Duration::from_millis(1), Duration::from_millis(2), 0.0).unwrap()
    }

    fn provider(backend: &MemoryBackend) -> LockProvider {
        LockProvider::builder(backend.clone())
            .backoff(quick())
            .build()
    }

    #[tokio::test]
    async fn a_try_takes_a_free_key_and_answers_local_contention_without_the_store() {
        let backend = MemoryBackend::default();
        let locks = provider(&backend);
        assert_eq!(locks.backend_name(), "memory");
        let guard = locks.try_acquire("a").await.unwrap();
        assert_eq!(guard.key(), "a");
        assert_eq!(guard.fencing_token(), Some(1));
        assert_eq!(locks.local_key_count(), 1);
        let err = locks.try_acquire("a").await.unwrap_err();
        assert!(matches!(err, LockError::AlreadyHeld { ref key } if &**key == "a"));
        assert_eq!(backend.store().tries, 1, "local contention asked the store");
        guard.release().await.unwrap();
        assert_eq!(locks.local_key_count(), 0);
        assert!(!backend.is_held("a"));
    }

    #[tokio::test]
    async fn a_try_on_a_key_held_elsewhere_is_one_question() {
        let backend = MemoryBackend::default();
        backend.hold_elsewhere("a");
        let locks = provider(&backend);
        let err = locks.try_acquire("a").await.unwrap_err();
        assert!(matches!(err, LockError::AlreadyHeld { ref key } if &**key == "a"));
        assert_eq!(backend.store().tries, 1);
        assert_eq!(locks.local_key_count(), 0);
        // A zero timeout is one try as well, even on a backend that waits natively.
        let native = MemoryBackend {
            native_wait: true,
            ..MemoryBackend::default()
        };
        native.hold_elsewhere("a");
        let locks = provider(&native);
        let err = locks.acquire("a", Duration::ZERO).await.unwrap_err();
        assert!(matches!(err, LockError::AlreadyHeld { .. }));
        assert_eq!(native.store().tries, 1);
        assert!(native.store().waits.is_empty());
    }

    /// Read locks share a key, with each other only: the terms of a read acquisition ask
    /// for shared mode all the way to the store.
    #[cfg(feature = "sqlite")]
    #[tokio::test]
    async fn read_locks_share_a_key_and_keep_a_writer_out() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}/locks.db", dir.path().display());
        let locks = LockProvider::connect(&url).await.unwrap();
        let other = LockProvider::connect(&url).await.unwrap();
        let first = locks.try_acquire_read("r").await.unwrap();
        let second = locks.try_acquire_read("r").await.unwrap();
        let third = other.try_acquire_read("r").await.unwrap();
        for provider in [&locks, &other] {
            let err = provider.try_acquire("r").await.unwrap_err();
            assert!(matches!(err, LockError::AlreadyHeld { .. }), "{err:?}");
        }
        for guard in [first, second, third] {
            guard.release().await.unwrap();
        }
        other
            .try_acquire("r")
            .await
            .unwrap()
            .release()
            .await
            .unwrap();
    }

    #[tokio::test]
    async fn an_invalid_key_never_reaches_the_store() {
        let backend = MemoryBackend::default();
        let locks = provider(&backend);
        let err = locks.try_acquire("").await.unwrap_err();
        assert!(matches!(err, LockError::InvalidKey { .. }));
        assert_eq!(backend.store().tries, 0);
    }

    #[tokio::test]
    async fn a_polled_wait_times_out_after_the_timeout_and_tries_at_the_deadline() {
        let backend = MemoryBackend::default();
        backend.hold_elsewhere("a");
        // Pauses far longer than the timeout: the wait tries once at the start and once at
        // the deadline, not a pause later.
        let slow = Backoff::new(Duration::from_secs(3600), Duration::from_secs(3600), 0.0).unwrap();
        let locks = LockProvider::builder(backend.clone()).backoff(slow).build();
        let timeout = Duration::from_millis(60);
        let started = Instant::now();
        let err = locks.acquire("a", timeout).await.unwrap_err();
        let waited = started.elapsed();
        assert!(
            matches!(err, LockError::Timeout { ref key, timeout: t } if &**key == "a" && t == timeout),
            "{err:?}"
        );
        assert!(waited >= timeout, "answered after {waited:?}");
        assert!(
            waited < Duration::from_secs(10),
            "answered after {waited:?}"
        );
        assert_eq!(backend.store().tries, 2);
    }

    #[tokio::test]
    async fn a_polled_wait_takes_the_key_once_it_is_free() {
        let backend = MemoryBackend::default();
        backend.hold_elsewhere("a");
        let locks = provider(&backend);
        let freer = {
            let backend = backend.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(30)).await;
                backend.free("a");
            })
        };
        let guard = locks.acquire("a", Duration::from_secs(30)).await.unwrap();
        freer.await.unwrap();
        assert!(backend.store().tries > 1);
        assert_eq!(guard.fencing_token(), Some(1));
        // An unlimited wait polls as well.
        backend.hold_elsewhere("b");
        let waiting = {
            let locks = locks.clone();
            tokio::spawn(async move { locks.acquire("b", Duration::MAX).await })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiting.is_finished());
        backend.free("b");
        let b = waiting.await.unwrap().unwrap();
        assert_eq!(b.key(), "b");
    }

    #[tokio::test]
    async fn a_late_grant_is_tried_again_in_a_wait_and_reported_by_a_try() {
        let backend = MemoryBackend::default();
        let locks = provider(&backend);
        backend.store().answers.push_back(Answer::Late);
        let err = locks.try_acquire("a").await.unwrap_err();
        assert!(matches!(err, LockError::Lost { .. }), "{err:?}");
        assert_eq!(locks.local_key_count(), 0);

        backend.store().answers.extend([Answer::Late, Answer::Late]);
        let guard = locks.acquire("a", Duration::from_secs(30)).await.unwrap();
        assert_eq!(backend.store().tries, 4);
        drop(guard);
    }

    fn watched() -> MemoryBackend {
        MemoryBackend {
            wakes: Some(Arc::new(tokio::sync::watch::channel(0).0)),
            ..MemoryBackend::default()
        }
    }

    async fn tries_reach(backend: &MemoryBackend, n: usize) {
        while backend.store().tries < n {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    /// With a live watch, a wait tries once more after subscribing, then sleeps through its
    /// hour-long fallback poll until a wake-up; a release between its tries is not missed.
    #[tokio::test]
    async fn a_watched_wait_sleeps_until_woken() {
        let backend = watched();
        let hour = Backoff::default()
            .with_fallback_poll(Duration::from_secs(3600))
            .unwrap();
        let locks = LockProvider::builder(backend.clone()).backoff(hour).build();
        backend.hold_elsewhere("a");
        let waiter = {
            let locks = locks.clone();
            tokio::spawn(async move { locks.acquire("a", Duration::from_secs(600)).await })
        };
        tries_reach(&backend, 2).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(backend.store().tries, 2, "the wait polled");
        assert!(!waiter.is_finished());
        backend.free("a");
        backend.wake();
        let guard = tokio::time::timeout(Duration::from_secs(20), waiter)
            .await
            .expect("woken")
            .unwrap()
            .unwrap();
        assert_eq!(backend.store().tries, 3);
        drop(guard);
    }

    /// Lets the tasks spawned on this (current-thread) runtime run until each waits.
    async fn let_tasks_run() {
        for _ in 0..8 {
            tokio::task::yield_now().await;
        }
    }

    /// A local waiter that got the lock leaves its watch to the local waiter queued behind it:
    /// the store is asked for one watch, and the next waiter, meeting contention at its first
    /// try, sleeps on that watch until woken (without it, it asked for a watch of its own and
    /// tried once more). No watch outlives the waits.
    #[tokio::test]
    async fn the_next_local_waiter_takes_over_the_watch() {
        let backend = watched();
        let hour = Backoff::default()
            .with_fallback_poll(Duration::from_secs(3600))
            .unwrap();
        let locks = LockProvider::builder(backend.clone()).backoff(hour).build();
        backend.hold_elsewhere("a");
        let wait = |locks: &LockProvider| {
            let locks = locks.clone();
            tokio::spawn(async move { locks.acquire("a", Duration::from_secs(600)).await })
        };
        let first = wait(&locks);
        tries_reach(&backend, 2).await;
        let second = wait(&locks);
        let_tasks_run().await;
        assert_eq!(backend.store().watches, 1);

        backend.free("a");
        backend.wake();
        let held = first.await.unwrap().unwrap();
        assert_eq!(backend.store().tries, 3);
        // Taken elsewhere again as soon as it is given back, before the next waiter's try
        // (nothing else runs on this runtime in between).
        held.release().await.unwrap();
        backend.hold_elsewhere("a");
        tries_reach(&backend, 4).await;
        let_tasks_run().await;
        assert!(!second.is_finished());
        assert_eq!(
            backend.store().tries,
            4,
            "tried once, then slept on the watch"
        );
        assert_eq!(backend.store().watches, 1, "took the watch over");

        backend.free("a");
        backend.wake();
        let held = tokio::time::timeout(Duration::from_secs(20), second)
            .await
            .expect("woken")
            .unwrap()
            .unwrap();
        assert_eq!(backend.store().tries, 5);
        drop(held);
        let_tasks_run().await;
        let wakes = backend.wakes.as_ref().unwrap();
        assert_eq!(wakes.receiver_count(), 0, "a watch outlived the waits");
        assert_eq!(locks.local_key_count(), 0);
    }

    /// A watch left for a local waiter that then gave up ends with the last use of the key.
    #[tokio::test]
    async fn a_watch_left_for_a_waiter_that_gave_up_ends() {
        let backend = watched();
        let locks = provider(&backend);
        backend.hold_elsewhere("a");
        let first = {
            let locks = locks.clone();
            tokio::spawn(async move { locks.acquire("a", Duration::from_secs(600)).await })
        };
        tries_reach(&backend, 2).await;
        let second = {
            let locks = locks.clone();
            tokio::spawn(async move { locks.acquire("a", Duration::from_secs(600)).await })
        };
        let_tasks_run().await;
        backend.free("a");
        backend.wake();
        let held = first.await.unwrap().unwrap();
        let wakes = backend.wakes.as_ref().unwrap();
        assert_eq!(
            wakes.receiver_count(),
            1,
            "the watch was left for the next waiter"
        );
        second.abort();
        assert!(second.await.unwrap_err().is_cancelled());
        held.release().await.unwrap();
        assert_eq!(wakes.receiver_count(), 0, "the left watch outlived the key");
        assert_eq!(locks.local_key_count(), 0);
    }

    /// Without a wake-up, a watched wait tries again after the `retry_within` its try
    /// reported (a lease running out), long before its fallback poll; and it still times out
    /// at its deadline.
    #[tokio::test]
    async fn a_watched_wait_tries_again_when_the_lease_ends() {
        let backend = watched();
        backend.store().retry_within = Some(Duration::from_millis(30));
        let hour = Backoff::default()
            .with_fallback_poll(Duration::from_secs(3600))
            .unwrap();
        let locks = LockProvider::builder(backend.clone()).backoff(hour).build();
        backend.hold_elsewhere("a");
        let waiter = {
            let locks = locks.clone();
            tokio::spawn(async move { locks.acquire("a", Duration::from_secs(600)).await })
        };
        tries_reach(&backend, 3).await;
        backend.free("a");
        let guard = tokio::time::timeout(Duration::from_secs(20), waiter)
            .await
            .expect("tried again at the lease's end")
            .unwrap()
            .unwrap();
        drop(guard);

        backend.store().retry_within = None;
        backend.hold_elsewhere("b");
        let started = Instant::now();
        let err = locks
            .acquire("b", Duration::from_millis(80))
            .await
            .unwrap_err();
        assert!(matches!(err, LockError::Timeout { .. }), "{err:?}");
        assert!(started.elapsed() >= Duration::from_millis(80));
        assert!(started.elapsed() < Duration::from_secs(20));
    }

    /// Without a watch, a wait's backoff pause is cut to the `retry_within` its try reported:
    /// the backend sets the pace (SQLite's waiters queue polls from every millisecond).
    #[tokio::test]
    async fn an_unwatched_wait_tries_again_within_what_its_try_said() {
        let backend = MemoryBackend::default();
        backend.store().retry_within = Some(Duration::from_millis(5));
        let slow = Backoff::new(Duration::from_secs(3600), Duration::from_secs(3600), 0.0).unwrap();
        let locks = LockProvider::builder(backend.clone()).backoff(slow).build();
        backend.hold_elsewhere("a");
        let waiter = {
            let locks = locks.clone();
            tokio::spawn(async move { locks.acquire("a", Duration::from_secs(600)).await })
        };
        tokio::time::timeout(Duration::from_secs(20), tries_reach(&backend, 3))
            .await
            .expect("tried again within its retry_within, not its hour-long pause");
        backend.free("a");
        let guard = tokio::time::timeout(Duration::from_secs(20), waiter)
            .await
            .expect("tried again within its retry_within")
            .unwrap()
            .unwrap();
        drop(guard);
    }

    #[tokio::test]
    async fn a_failure_ends_a_polled_wait_at_once() {
        let backend = MemoryBackend::default();
        let locks = provider(&backend);
        backend.store().answers.push_back(Answer::Fail);
        let err = locks
            .acquire("a", Duration::from_secs(30))
            .await
            .unwrap_err();
        assert!(matches!(err, LockError::Backend { .. }), "{err:?}");
        assert_eq!(backend.store().tries, 1);
        assert_eq!(locks.local_key_count(), 0);
    }

    #[tokio::test]
    async fn a_native_wait_gets_what_is_left_of_the_timeout() {
        let backend = MemoryBackend {
            native_wait: true,
            ..MemoryBackend::default()
        };
        let locks = provider(&backend);
        let timeout = Duration::from_secs(30);
        let guard = locks.acquire("a", timeout).await.unwrap();
        let waits = backend.store().waits.clone();
        assert_eq!(waits.len(), 1);
        assert!(
            waits[0] <= timeout && waits[0] > Duration::from_secs(20),
            "{waits:?}"
        );
        assert_eq!(backend.store().tries, 0);
        drop(guard);

        let unlimited = locks.acquire("b", Duration::MAX).await.unwrap();
        assert_eq!(backend.store().waits[1], Duration::MAX);
        drop(unlimited);

        backend.hold_elsewhere("c");
        let err = locks.acquire("c", timeout).await.unwrap_err();
        assert!(
            matches!(err, LockError::Timeout { ref key, timeout: t } if &**key == "c" && t == timeout),
            "{err:?}"
        );
    }

    #[tokio::test]
    async fn local_waiters_queue_behind_the_holder_and_time_out() {
        let backend = MemoryBackend::default();
        let locks = provider(&backend);
        let held = locks.try_acquire("a").await.unwrap();

        let timeout = Duration::from_millis(40);
        let started = Instant::now();
        let err = locks.acquire("a", timeout).await.unwrap_err();
        assert!(matches!(err, LockError::Timeout { ref key, .. } if &**key == "a"));
        assert!(started.elapsed() >= timeout);
        assert_eq!(backend.store().tries, 1, "a local wait asked the store");

        let waiter = {
            let locks = locks.clone();
            tokio::spawn(async move { locks.acquire("a", Duration::from_secs(30)).await })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiter.is_finished());
        held.release().await.unwrap();
        let next = waiter.await.unwrap().unwrap();
        assert_eq!(next.fencing_token(), Some(2));
    }

    #[tokio::test]
    async fn cancellation_ends_every_kind_of_wait() {
        let backend = MemoryBackend::default();
        let locks = provider(&backend);

        // Already cancelled: no question to the store.
        let token = CancellationToken::new();
        token.cancel();
        let err = locks
            .lock("a")
            .cancel_on(&token)
            .try_acquire()
            .await
            .unwrap_err();
        assert!(matches!(err, LockError::Canceled { ref key } if &**key == "a"));
        assert_eq!(backend.store().tries, 0);

        // Waiting behind a local holder.
        let held = locks.try_acquire("a").await.unwrap();
        // A cancelled acquisition is Canceled, even where it would have met contention.
        let err = locks
            .lock("a")
            .cancel_on(&token)
            .try_acquire()
            .await
            .unwrap_err();
        assert!(matches!(err, LockError::Canceled { .. }), "{err:?}");
        let token = CancellationToken::new();
        let canceler = {
            let token = token.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(20)).await;
                token.cancel();
            })
        };
        let err = locks
            .lock("a")
            .cancel_on(&token)
            .acquire()
            .await
            .unwrap_err();
        assert!(matches!(err, LockError::Canceled { ref key } if &**key == "a"));
        canceler.await.unwrap();
        drop(held);

        // Polling a key held elsewhere, through the provider's shutdown token while the
        // acquisition has a token of its own.
        backend.hold_elsewhere("b");
        let shutdown = CancellationToken::new();
        let stopping = locks.with_shutdown(&shutdown);
        let own = CancellationToken::new();
        let canceler = {
            let shutdown = shutdown.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(20)).await;
                shutdown.cancel();
            })
        };
        let err = stopping
            .lock("b")
            .cancel_on(&own)
            .acquire()
            .await
            .unwrap_err();
        assert!(matches!(err, LockError::Canceled { ref key } if &**key == "b"));
        canceler.await.unwrap();
        assert!(!own.is_cancelled());
        assert_eq!(stopping.local_key_count(), 0);
        // The original provider is not shut down, and shares its table with the other.
        backend.free("b");
        let b = locks.try_acquire("b").await.unwrap();
        assert!(matches!(
            stopping.try_acquire("c").await,
            Err(LockError::Canceled { .. })
        ));
        assert_eq!(stopping.local_key_count(), 1);
        drop(b);

        // A builder's shutdown token.
        let shutdown = CancellationToken::new();
        shutdown.cancel();
        let stopped = LockProvider::builder(backend.clone())
            .cancel_on(&shutdown)
            .build();
        assert!(matches!(
            stopped.try_acquire("d").await,
            Err(LockError::Canceled { .. })
        ));
    }

    #[tokio::test]
    async fn leases_and_backoffs_come_from_the_acquisition_then_the_provider() {
        let backend = MemoryBackend::default();
        let slow = Backoff::new(Duration::from_secs(3600), Duration::from_secs(3600), 0.0).unwrap();
        let locks = LockProvider::builder(backend.clone())
            .lease(Duration::from_secs(7))
            .backoff(slow)
            .build();
        drop(locks.try_acquire("a").await.unwrap());
        drop(
            locks
                .lock("b")
                .lease(Duration::from_secs(3))
                .try_acquire()
                .await
                .unwrap(),
        );
        let plain = provider(&backend);
        drop(plain.try_acquire("c").await.unwrap());
        assert_eq!(
            backend.store().leases,
            [
                Some(Duration::from_secs(7)),
                Some(Duration::from_secs(3)),
                None
            ]
        );

        // The acquisition's backoff polls often; the provider's would try twice only.
        backend.hold_elsewhere("d");
        let err = locks
            .lock("d")
            .backoff(quick())
            .timeout(Duration::from_millis(60))
            .acquire()
            .await
            .unwrap_err();
        assert!(matches!(err, LockError::Timeout { .. }));
        assert!(backend.store().tries > 5, "{}", backend.store().tries);
    }

    #[tokio::test]
    async fn with_lock_runs_under_the_lock_and_reports_a_loss() {
        let backend = MemoryBackend::default();
        let locks = provider(&backend);
        let out = locks
            .with_lock("a", Duration::from_secs(1), |_lost| {
                let backend = backend.clone();
                async move { backend.is_held("a") }
            })
            .await
            .unwrap();
        assert!(out);
        assert!(!backend.is_held("a"));
        let err = locks
            .with_lock(
                "a",
                Duration::from_secs(1),
                |lost| async move { lost.cancel() },
            )
            .await
            .unwrap_err();
        assert!(matches!(err, LockError::Lost { .. }), "{err:?}");
        backend.hold_elsewhere("b");
        let err = locks
            .with_lock("b", Duration::ZERO, |_| async {})
            .await
            .unwrap_err();
        assert!(matches!(err, LockError::AlreadyHeld { .. }));
    }

    struct Command(u32);

    impl LockedCommand for Command {
        fn lock_key(&self) -> String {
            format!("cmd:{}", self.0)
        }
        fn lock_timeout(&self) -> Duration {
            Duration::ZERO
        }
    }

    #[tokio::test]
    async fn a_command_names_its_key_and_timeout() {
        let backend = MemoryBackend::default();
        let locks = provider(&backend);
        let guard = locks.acquire_for(&Command(7)).await.unwrap();
        assert_eq!(guard.key(), "cmd:7");
        // A zero timeout: one try, contention at once.
        backend.hold_elsewhere("cmd:8");
        let err = locks.acquire_for(&Command(8)).await.unwrap_err();
        assert!(matches!(err, LockError::AlreadyHeld { .. }));
    }

    #[test]
    fn acquisitions_need_a_tokio_runtime() {
        let backend = MemoryBackend::default();
        let locks = provider(&backend);
        let err = futures_executor(locks.try_acquire("a")).unwrap_err();
        assert!(matches!(err, LockError::Config { .. }), "{err:?}");
        // Cancellation is checked first.
        let token = CancellationToken::new();
        token.cancel();
        let err = futures_executor(locks.lock("a").cancel_on(&token).try_acquire()).unwrap_err();
        assert!(matches!(err, LockError::Canceled { .. }), "{err:?}");
        assert_eq!(locks.local_key_count(), 0);
    }

    /// Polls a future to completion outside any Tokio runtime.
    fn futures_executor<F: Future>(future: F) -> F::Output {
        use std::task::{Context, Poll, Wake, Waker};
        struct Noop;
        impl Wake for Noop {
            fn wake(self: Arc<Self>) {}
        }
        let waker = Waker::from(Arc::new(Noop));
        let mut cx = Context::from_waker(&waker);
        let mut future = std::pin::pin!(future);
        loop {
            if let Poll::Ready(out) = future.as_mut().poll(&mut cx) {
                return out;
            }
        }
    }

    #[tokio::test]
    async fn urls_pick_their_backend_or_name_what_is_wrong() {
        let no_scheme = LockProvider::connect("locks.db").await.unwrap_err();
        assert!(
            matches!(&no_scheme, LockError::Config { message } if message.contains("no scheme")),
            "{no_scheme:?}"
        );
        let unknown = LockProvider::connect("ftp://host/x").await.unwrap_err();
        assert!(
            matches!(&unknown, LockError::Config { message } if message.contains("`ftp`")),
            "{unknown:?}"
        );
        let not_built = |url: &'static str, feature: &'static str| async move {
            let err = LockProvider::connect(url).await.unwrap_err();
            assert!(
                matches!(&err, LockError::Config { message }
                    if message.contains(&format!("enable the `{feature}` cargo feature"))),
                "{url}: {err:?}"
            );
        };
        #[cfg(not(feature = "mssql"))]
        {
            not_built("mssql://h/db", "mssql").await;
            not_built("SQLSERVER://h/db", "mssql").await;
        }
        #[cfg(not(feature = "oracle"))]
        not_built("oracle://h/db", "oracle").await;
        #[cfg(not(feature = "mysql"))]
        {
            not_built("mysql://h/db", "mysql").await;
            not_built("mariadb://h/db", "mysql").await;
        }
        #[cfg(not(feature = "postgres"))]
        {
            not_built("postgres://h/db", "postgres").await;
            not_built("postgresql://h/db", "postgres").await;
        }
        #[cfg(not(feature = "redis"))]
        {
            not_built("redis://h", "redis").await;
            not_built("rediss://h", "redis").await;
            not_built("redis+sentinel://h:26379/mymaster", "redis").await;
            not_built("redis+cluster://h:6379,h:6380", "redis").await;
        }
        let _ = not_built;
        // Built backends get the URL: nothing listens on port 1, so they cannot connect.
        for url in [
            "postgres://u@127.0.0.1:1/db",
            "redis://127.0.0.1:1",
            "redis+sentinel://127.0.0.1:1,127.0.0.1:2/mymaster",
            "redis+cluster://127.0.0.1:1,127.0.0.1:2?timeout=2s",
        ] {
            let scheme = url.split_once(':').unwrap().0;
            if cfg!(feature = "postgres") && scheme == "postgres"
                || cfg!(feature = "redis") && scheme.starts_with("redis")
            {
                let err = tokio::time::timeout(Duration::from_secs(20), LockProvider::connect(url))
                    .await
                    .expect("a refused connection is answered")
                    .unwrap_err();
                assert!(!err.to_string().contains("scheme"), "{url}: {err}");
                assert!(!err.to_string().contains("cargo feature"), "{url}: {err}");
            }
        }
        #[cfg(feature = "sqlite")]
        {
            let dir = tempfile::tempdir().unwrap();
            let url = format!("sqlite://{}/locks.db", dir.path().display());
            let locks = LockProvider::connect(&url).await.unwrap();
            assert_eq!(locks.backend_name(), "sqlite");
        }
    }

    #[tokio::test]
    async fn acquisitions_are_counted_by_outcome() {
        let recorder = Recorder::new();
        let backend = MemoryBackend::default();
        let locks = LockProvider::builder(backend.clone())
            .meter(recorder.meter())
            .metric_key_prefix(true)
            .build();
        let guard = locks.try_acquire("jobs:a").await.unwrap();
        let _ = locks.try_acquire("jobs:a").await.unwrap_err();
        guard.release().await.unwrap();
        let points = recorder.points("distributed_lock.acquisitions");
        let statuses: Vec<_> = points
            .iter()
            .map(|(attrs, n)| {
                assert!(attrs.contains(&("key_prefix".to_owned(), "jobs".to_owned())));
                let status = attrs.iter().find(|(k, _)| k == "status").unwrap();
                (status.1.clone(), *n)
            })
            .collect();
        assert_eq!(
            statuses,
            [("acquired".to_owned(), 1), ("already_held".to_owned(), 1)]
        );
    }
}
