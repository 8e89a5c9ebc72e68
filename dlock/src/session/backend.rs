//! The one backend type and the one builder type of every session engine.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use super::acquire::Lanes;
use super::options::SessionOptions;
use super::traits::{Connector, Engine, Mode, PermitAnswer};
use crate::LockError;
use crate::backend::{
    Acquired, BoxFuture, LockBackend, LockRequest, PermitRequest, PermitStore, PermitTry,
};

/// A backend of a session engine: session locks on a few multiplexed connections, native waits
/// on a bounded set of connections, liveness checks (see the [module docs](super)).
///
/// Made by [`LockProvider::connect`](crate::LockProvider::connect) with the engine's URL, by
/// [`SessionBackend::connect`], or by a [`SessionBuilder`]. Each engine names it:
/// [`PostgresBackend`](crate::postgres::PostgresBackend),
/// [`MySqlBackend`](crate::mysql::MySqlBackend), [`MssqlBackend`](crate::mssql::MssqlBackend),
/// [`OracleBackend`](crate::oracle::OracleBackend), with the engine's own constructors. Cheap to
/// clone: clones share the connections, and the claims that keep two acquisitions of one key
/// apart.
pub struct SessionBackend<E: Engine> {
    lanes: Arc<Lanes<E::Connector>>,
    options: SessionOptions,
}

/// Builds a [`SessionBackend`] with options. Each engine names it
/// ([`PostgresBuilder`](crate::postgres::PostgresBuilder) and so on) and makes it (`builder`,
/// `builder_from_url`).
#[must_use]
pub struct SessionBuilder<E: Engine> {
    pub(crate) target: E::Target,
    pub(crate) options: SessionOptions,
}

impl<E: Engine> SessionBuilder<E> {
    /// A builder for `target` with the default options.
    pub(crate) fn new(target: E::Target) -> Self {
        SessionBuilder {
            target,
            options: SessionOptions::default(),
        }
    }

    /// How often connections that hold locks are checked (default 5 s, at least 10 ms).
    pub fn keepalive(mut self, keepalive: Duration) -> Self {
        self.options.keepalive = keepalive;
        self
    }

    /// How long opening a connection may take (default 10 s).
    pub fn connect_timeout(mut self, connect_timeout: Duration) -> Self {
        self.options.connect_timeout = connect_timeout;
        self
    }

    /// The most one short statement may take (default 10 s, 10 ms to 365 days): a try or a
    /// release on a lock connection (with the fencing token it issues), or a release on a
    /// wait connection. A statement that outlives it is given up, its connection is dropped,
    /// and every lock that connection held is reported lost (the server ends them with the
    /// session). Native waits are not bounded by it: their timeout is the caller's. The same
    /// on every engine; the URL option `statement_timeout` sets it too.
    ///
    /// ```no_run
    /// use std::time::Duration;
    ///
    /// # #[cfg(feature = "postgres")]
    /// # async fn demo() -> Result<(), dlock::LockError> {
    /// let backend = dlock::postgres::PostgresBackend::builder_from_url("postgres://app@db.internal/app")?
    ///     .statement_timeout(Duration::from_secs(2))
    ///     .open()
    ///     .await?;
    /// assert_eq!(backend.statement_timeout(), Duration::from_secs(2));
    /// # Ok(()) }
    /// ```
    pub fn statement_timeout(mut self, statement_timeout: Duration) -> Self {
        self.options.statement_timeout = statement_timeout;
        self
    }

    /// The number of lock connections, which hold the locks taken without waiting (default 4,
    /// 1 to 64). A try runs on the first of them that is idle, so a lightly loaded service
    /// keeps to one warm connection and the others serve tries that come at once.
    pub fn connections(mut self, connections: usize) -> Self {
        self.options.connections = connections;
        self
    }

    /// The most connections used for native waits at once (default 4, 0 to 64; 0 makes waits
    /// poll instead).
    pub fn wait_connections(mut self, wait_connections: usize) -> Self {
        self.options.wait_connections = wait_connections;
        self
    }

    /// Opens the first lock connection (so a wrong address or password, or a missing client
    /// library, is reported here), sets up what the engine needs on it (the fencing table when
    /// fencing is on), and starts the backend; the other connections open when they are first
    /// needed. Must run inside a Tokio runtime.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: dropping the future closes the connection it was opening.
    pub async fn open(self) -> Result<SessionBackend<E>, LockError> {
        self.options.check()?;
        Lanes::<E::Connector>::check_runtime()?;
        let (connector, first) = E::open(self.target, &self.options).await?;
        Ok(SessionBackend {
            lanes: Arc::new(Lanes::start(connector, self.options.settings(), first)?),
            options: self.options,
        })
    }

    /// Issue fencing tokens from the `dlock_fencing` counter table (default off).
    pub fn fencing(mut self, fencing: bool) -> Self {
        self.options.fencing = fencing;
        self
    }

    /// Keep at most `counters` fencing counters (1 to 65,536) instead of one per key ever
    /// locked (default): a key's tokens come from counter number
    /// [`fencing_counter`](crate::fencing_counter)`(key, counters)`, and still increase
    /// strictly per key (see that function's docs for switching). Needs
    /// [`fencing`](Self::fencing); checked by `open`. PostgreSQL has it; the other engines
    /// refuse it with [`LockError::Config`] in this version. The URL option is
    /// `fencing_counters=N`.
    pub fn fencing_counters(mut self, counters: u32) -> Self {
        self.options.fencing_counters = Some(counters);
        self
    }

    /// Reads a URL of the engine's scheme, and checks its options.
    pub(crate) fn from_url(url: &str) -> Result<Self, LockError> {
        let (target, options) = E::parse_url(url)?;
        options.check()?;
        Ok(SessionBuilder { target, options })
    }
}

impl<E: Engine> Clone for SessionBuilder<E> {
    fn clone(&self) -> Self {
        SessionBuilder {
            target: self.target.clone(),
            options: self.options,
        }
    }
}

impl<E: Engine> fmt::Debug for SessionBuilder<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut out = f.debug_struct(E::BUILDER);
        E::fmt_target(&self.target, &mut out);
        out.field("options", &self.options).finish()
    }
}

impl<E: Engine> SessionBackend<E> {
    /// Parses a URL of the engine's scheme, with the options of the engine's module docs, into
    /// a builder, without connecting.
    pub fn builder_from_url(url: &str) -> Result<SessionBuilder<E>, LockError> {
        SessionBuilder::from_url(url)
    }

    /// Connects with a URL of the engine's scheme.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe, as [`SessionBuilder::open`].
    pub async fn connect(url: &str) -> Result<SessionBackend<E>, LockError> {
        SessionBuilder::<E>::from_url(url)?.open().await
    }

    /// The liveness check cadence.
    pub fn keepalive(&self) -> Duration {
        self.options.keepalive
    }

    /// The bound of one short statement (see [`SessionBuilder::statement_timeout`]).
    pub fn statement_timeout(&self) -> Duration {
        self.options.statement_timeout
    }

    /// Whether this backend issues fencing tokens.
    pub fn fencing(&self) -> bool {
        self.options.fencing
    }

    /// The open backend's connector.
    #[cfg_attr(not(feature = "mysql"), allow(dead_code))]
    pub(crate) fn connector(&self) -> &E::Connector {
        self.lanes.connector()
    }
}

impl<E: Engine> Clone for SessionBackend<E> {
    fn clone(&self) -> Self {
        SessionBackend {
            lanes: Arc::clone(&self.lanes),
            options: self.options,
        }
    }
}

impl<E: Engine> fmt::Debug for SessionBackend<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut out = f.debug_struct(E::BACKEND);
        out.field("connector", self.lanes.connector())
            .field("fencing", &self.options.fencing)
            .field("lanes", &self.lanes)
            .finish()
    }
}

impl<E: Engine> LockBackend for SessionBackend<E> {
    fn name(&self) -> &'static str {
        <E::Connector as Connector>::NAME
    }

    fn supports_native_wait(&self) -> bool {
        true
    }

    fn try_acquire<'a>(
        &'a self,
        request: LockRequest<'a>,
    ) -> BoxFuture<'a, Result<Option<Acquired>, LockError>> {
        Box::pin(
            self.lanes
                .try_acquire(request.key, Mode::of(request.shared)),
        )
    }

    fn acquire_wait<'a>(
        &'a self,
        request: LockRequest<'a>,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<Option<Acquired>, LockError>> {
        let mode = Mode::of(request.shared);
        Box::pin(self.lanes.acquire_wait(request.key, mode, timeout))
    }

    /// Where the engine can list the server's locks (PostgreSQL's `pg_locks`).
    fn store_locks<'a>(
        &'a self,
        known: &'a [&'a str],
    ) -> BoxFuture<'a, Result<Vec<crate::StoreLock>, LockError>> {
        self.lanes.connector().store_locks(known)
    }

    /// Read locks in the engine's own shared mode (PostgreSQL, SQL Server, Oracle); MySQL and
    /// MariaDB answer `Unsupported` (see the engine's module docs).
    fn shared_locks(&self) -> Result<(), LockError> {
        self.lanes.connector().shared_locks()
    }

    /// Refused: a session lock ends only with its session, which holds other locks too.
    fn force_releases(&self) -> Result<&dyn crate::backend::ForceRelease, LockError> {
        let name = self.name();
        let instead = match name {
            "postgres" => {
                "the server ends an advisory lock only with the session that holds it; \
                 `pg_terminate_backend(pid)` ends that whole session and every other lock it \
                 holds (find it with `SELECT pid, application_name FROM pg_locks JOIN \
                 pg_stat_activity USING (pid) WHERE locktype = 'advisory'`). Prefer stopping \
                 the process that holds the lock"
            }
            "mysql" => {
                "the server ends a user lock only with the session that holds it; \
                 `KILL <id>` (the id from `SELECT IS_USED_LOCK(name)`) ends that whole session \
                 and every other lock it holds. Prefer stopping the process that holds the lock"
            }
            "mssql" => {
                "the server ends an application lock only with the session that holds it; \
                 `KILL <session id>` (from `sys.dm_tran_locks` where resource_type = \
                 'APPLICATION') ends that whole session and every other lock it holds. Prefer \
                 stopping the process that holds the lock"
            }
            "oracle" => {
                "the server ends a DBMS_LOCK lock only with the session that holds it; \
                 `ALTER SYSTEM KILL SESSION 'sid,serial#'` (from `V$LOCK` where type = 'UL') \
                 ends that whole session and every other lock it holds. Prefer stopping the \
                 process that holds the lock"
            }
            _ => {
                "the server ends a session lock only with its session, which may hold other \
                 locks too; stop the process that holds the lock"
            }
        };
        Err(LockError::unsupported(name, "force release", instead))
    }

    fn ping(&self) -> BoxFuture<'_, Result<(), LockError>> {
        Box::pin(self.lanes.ping())
    }

    /// Semaphores as slot locks of the lanes' sessions, each try one statement (see the
    /// engine's module docs, Semaphores).
    fn semaphores(&self) -> Option<&dyn PermitStore> {
        if self.lanes.connector().keeps_permits() {
            Some(self)
        } else {
            None
        }
    }
}

/// A permit is a slot lock held by a lane's session, like a lock: it ends with the session,
/// is released by its lane, and has no lease (`lease` and `renew` are not used). A try is one
/// statement that checks the count record and the waiting mark (the semaphore's queue lock)
/// and takes the first free slot from a random one on.
impl<E: Engine> PermitStore for SessionBackend<E> {
    fn try_acquire_permit<'a>(
        &'a self,
        request: PermitRequest<'a>,
    ) -> BoxFuture<'a, Result<PermitTry, LockError>> {
        Box::pin(async move {
            let queue = request.queue_key();
            let answer = self
                .lanes
                .try_permit(
                    request.key,
                    request.max_count,
                    &queue,
                    request.waiting.is_some(),
                )
                .await?;
            match answer {
                PermitAnswer::Granted { permit, .. } => Ok(PermitTry::Acquired(permit)),
                // A holder that died frees its permit when its session ends, which the server
                // notices on its own: nothing to wait for but a release.
                PermitAnswer::Full => Ok(PermitTry::Full { retry_within: None }),
                PermitAnswer::Conflict { recorded } => Err(request.count_conflict(recorded)),
            }
        })
    }

    /// `u32::MAX` on PostgreSQL; 1,024 on the engines whose server cannot count the held
    /// slots (see their module docs, Semaphores).
    fn max_permits(&self) -> u32 {
        <E::Connector as Connector>::MAX_PERMITS
    }

    /// MySQL and MariaDB keep none (see their module docs, Semaphores).
    fn keeps_count_record(&self) -> bool {
        self.lanes.connector().keeps_count_record()
    }

    fn holders<'a>(
        &'a self,
        key: &'a str,
        max_count: u32,
    ) -> BoxFuture<'a, Result<u32, LockError>> {
        Box::pin(async move {
            let request = PermitRequest::new(key, max_count);
            let count = self
                .lanes
                .count_permits(key, max_count, &request.queue_key())
                .await?;
            match count.recorded {
                Some(recorded) if recorded != max_count => Err(request.count_conflict(recorded)),
                _ => Ok(count.holders),
            }
        })
    }
}

/// Checks how engine `E` reads the session options of its URL `base` (a URL without a query,
/// whose password is `hunter2`): the defaults, every option, the builder's setters, and the
/// refusals, none of which may show the password.
#[cfg(test)]
pub(crate) fn check_session_url<E: Engine>(base: &str) {
    let read = |query: &str| SessionBackend::<E>::builder_from_url(&format!("{base}?{query}"));
    assert_eq!(read("").unwrap().options, SessionOptions::default());
    let b = read(
        "fencing=true&keepalive=250ms&connections=2&wait_connections=0&connect_timeout=3s\
         &statement_timeout=1h%2030m",
    )
    .unwrap();
    assert!(b.options.fencing);
    assert_eq!(b.options.keepalive, Duration::from_millis(250));
    assert_eq!((b.options.connections, b.options.wait_connections), (2, 0));
    assert_eq!(b.options.connect_timeout, Duration::from_secs(3));
    assert_eq!(b.options.statement_timeout, Duration::from_secs(5400));
    let shown = format!("{b:?}");
    assert!(
        shown.contains("fencing: true") && !shown.contains("hunter2"),
        "{shown}"
    );
    let b = b
        .fencing(false)
        .statement_timeout(Duration::from_millis(250));
    assert!(!b.options.fencing);
    assert_eq!(b.options.statement_timeout, Duration::from_millis(250));
    for bad in [
        "bogus=1",
        "fencing=maybe",
        "fencing_counters=0",
        "keepalive=soon",
        "keepalive=1ms",
        "keepalive=10000000000000000s",
        "connections=0",
        "connections=many",
        "connections=100",
        "wait_connections=65",
        "connect_timeout=0",
        "connect_timeout=10000000000000000s",
        "statement_timeout=soon",
        "statement_timeout=0",
        "statement_timeout=10000000000000000s",
    ] {
        let err = read(bad).unwrap_err();
        assert_eq!(err.code(), "DistributedLock.Configuration", "{bad}: {err}");
        assert!(!err.to_string().contains("hunter2"), "{bad}: {err}");
    }
    let err = read("statement_timeout=5ms").unwrap_err().to_string();
    assert!(
        err.contains("statement_timeout is 5ms, but it must be at least 10ms"),
        "{err}"
    );
}
