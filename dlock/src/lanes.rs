//! Connection machinery shared by the session-lock backends (PostgreSQL, MySQL, SQL Server,
//! Oracle): a few multiplexed lock connections ("lanes"), a bounded set of connections for
//! native waits, and liveness checks that cancel the lost token of every lock on a connection
//! that dies.
//!
//! A backend plugs in with a [`Connector`] (opens sessions, maps keys to resources) and a
//! [`Session`] (one server connection: lock, unlock, ping, interrupt). Nothing here knows SQL.
//!
//! - **Lanes** (`connections` of them) each own one session in one task. They run the tries
//!   (a lock statement with a zero wait) and keep the locks so taken; statements run one at a
//!   time per lane, never wait on the server, and are bounded by [`STATEMENT_TIMEOUT`].
//! - **Waits** run on their own sessions (at most `wait_connections` at once), because a
//!   server-side wait blocks its connection. A granted wait keeps its lock on that session
//!   until release; the session then goes back to an idle list for the next wait. When every
//!   wait session is busy, waits poll the lanes with backoff instead.
//! - A wait that is abandoned (timeout, cancel, dropped future) interrupts the server's
//!   statement ([`Session::interrupt`]: in the driver, or by a request that a lane runs from
//!   its own session) and always drops its session, which ends whatever the session may have
//!   been granted; an interrupted session is never reused.
//! - Sessions holding locks are pinged every `keepalive`; a failed ping, a failed statement
//!   or a statement that outlives its bound drops the session and cancels the lost token of
//!   every lock it held (the server frees a session's locks when the session ends).
//! - A grant may carry a fencing token issued in the same round trip ([`Grant`]).
//! - Every acquisition claims its resource in process first ([`Claims`]), so no two
//!   acquisitions of one backend ever ask the server for the same resource at once, however
//!   many providers share the backend. Servers let a session take a lock it holds again
//!   (PostgreSQL, MySQL and SQL Server count re-entries, Oracle answers "already own"), and
//!   every lane is one session that many acquisitions share: without the claim, two providers
//!   built on clones of one backend would both be granted a key on a shared lane. A waiting
//!   acquisition whose resource another acquisition of the backend holds waits for that claim
//!   to end (no server round trips), then for the server.
//! - Every task that keeps locks alive (a lane, a wait task) cancels the lost token of each
//!   lock it keeps when it stops for any reason, its runtime being dropped included: its
//!   session, and with it the locks, end with it. A lane found stopped is started again on the
//!   runtime of the acquisition that finds it, so a backend keeps working when the runtime
//!   that opened it is gone.

use std::collections::HashMap;
use std::fmt::Debug;
use std::hash::Hash;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use tokio::sync::{Notify, Semaphore, mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use crate::backend::{Acquired, BoxFuture, HeldLock};
use crate::options::parse_duration;
use crate::time::{MAX_SETTING, check_setting};
use crate::{Backoff, LockError};

/// The most a lock, unlock or interrupt statement on a lane may take before its connection
/// is presumed dead (pings have [`Connector::PING_TIMEOUT`]).
pub(crate) const STATEMENT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long an acquisition waits for a claimed resource whose abandoned acquisition is still
/// being cleaned up before it answers that the resource is held.
pub(crate) const SETTLE_LIMIT: Duration = Duration::from_secs(5);
/// The first and the longest pause between the tries that end a wait when less than the
/// server's wait resolution is left.
const TAIL_PAUSE: Duration = Duration::from_millis(2);
const TAIL_PAUSE_MAX: Duration = Duration::from_millis(50);

/// A failed statement: the error, and whether the session is still usable afterwards (a
/// server-side error such as a permission problem leaves it usable; an I/O error does not).
#[derive(Debug)]
pub(crate) struct Failure {
    pub(crate) error: LockError,
    pub(crate) connection_ok: bool,
}

impl Failure {
    /// A failure after which the session can still be used.
    pub(crate) fn statement(error: LockError) -> Self {
        Failure {
            error,
            connection_ok: true,
        }
    }

    /// A failure that leaves the session unusable.
    pub(crate) fn connection(error: LockError) -> Self {
        Failure {
            error,
            connection_ok: false,
        }
    }
}

/// A granted lock statement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Grant {
    /// The fencing token issued in the same round trip, for backends that issue them.
    pub(crate) token: Option<u64>,
}

impl Grant {
    /// A grant without a fencing token.
    pub(crate) const PLAIN: Grant = Grant { token: None };
}

/// Opens sessions and names resources for one backend.
pub(crate) trait Connector: Send + Sync + 'static {
    /// What the server locks for a key (a resource name, an integer id).
    type Resource: Clone + Send + Sync + Debug + Eq + Hash + 'static;
    /// One server connection.
    type Session: Session<Resource = Self::Resource>;

    /// The backend's name, as in `LockBackend::name`.
    const NAME: &'static str;
    /// The longest wait one lock statement is given; longer waits are split into several
    /// statements of at most this length.
    const MAX_WAIT: Duration;
    /// The most a liveness check may take.
    const PING_TIMEOUT: Duration = Duration::from_secs(2);
    /// How long past the caller's timeout a wait may take to answer before it is given up.
    const WAIT_GRACE: Duration = Duration::from_secs(2);
    /// The granularity of the server's wait timeout (1 ms for SQL Server and PostgreSQL, 1 s
    /// for Oracle and MySQL, 1 µs for MariaDB). A wait asks the server for whole units only;
    /// what is left below one unit is tried out here with short pauses, with one last try at
    /// the deadline, so timeouts are kept exactly.
    fn wait_resolution(&self) -> Duration;

    /// The resource that `key` locks.
    fn resource(&self, key: &str) -> Self::Resource;

    /// Opens a session (bounded by the backend's connect timeout).
    fn open(&self) -> BoxFuture<'_, Result<Self::Session, LockError>>;
}

/// One server connection whose session owns the locks it takes.
pub(crate) trait Session: Send + 'static {
    /// What the server locks.
    type Resource;
    /// A request that stops another session's statement from this one (see
    /// [`Session::interrupt`]); `Infallible` for drivers that stop statements themselves.
    type Interrupt: Send + 'static;

    /// Asks for `resource`, waiting up to `wait` on the server (`Duration::ZERO` is one try):
    /// `Ok(Some(grant))` when granted, `Ok(None)` when it stayed held elsewhere. A statement
    /// that fails after the lock may have been taken gives it back before it answers.
    fn lock<'a>(
        &'a mut self,
        resource: &'a Self::Resource,
        wait: Duration,
    ) -> BoxFuture<'a, Result<Option<Grant>, Failure>>;

    /// Gives `resource` back. A resource the session no longer holds is not an error.
    fn unlock<'a>(&'a mut self, resource: &'a Self::Resource)
    -> BoxFuture<'a, Result<(), Failure>>;

    /// A liveness check.
    fn ping(&mut self) -> BoxFuture<'_, Result<(), Failure>>;

    /// Asks the server to stop this session's wait for `resource`, which nobody waits for any
    /// more: best effort in the driver, and/or a request for a lane to run from its own
    /// session ([`Session::run_interrupt`]; the wait keeps its claim until the lane has run
    /// it). The session is dropped right after this call and never reused, so a late
    /// interrupt cannot hit a later statement.
    fn interrupt(&self, _resource: &Self::Resource) -> Option<Self::Interrupt> {
        None
    }

    /// Runs another session's interrupt request from this session.
    fn run_interrupt(&mut self, _request: Self::Interrupt) -> BoxFuture<'_, Result<(), Failure>> {
        Box::pin(async { Ok(()) })
    }
}

type InterruptOf<C> = <<C as Connector>::Session as Session>::Interrupt;

/// How many connections, and how often they are checked.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LaneSettings {
    pub(crate) connections: usize,
    pub(crate) wait_connections: usize,
    pub(crate) keepalive: Duration,
}

/// The most lock or wait connections a backend may be configured with.
pub(crate) const MAX_CONNECTIONS: usize = 64;

impl LaneSettings {
    /// Checks the settings, naming the option that is wrong.
    pub(crate) fn check(&self) -> Result<(), LockError> {
        check_setting(
            "keepalive",
            self.keepalive,
            Duration::from_millis(10),
            MAX_SETTING,
        )?;
        if !(1..=MAX_CONNECTIONS).contains(&self.connections) {
            return Err(LockError::config(format!(
                "connections must be between 1 and {MAX_CONNECTIONS}, not {}",
                self.connections
            )));
        }
        if self.wait_connections > MAX_CONNECTIONS {
            return Err(LockError::config(format!(
                "wait_connections must be between 0 and {MAX_CONNECTIONS}, not {}",
                self.wait_connections
            )));
        }
        Ok(())
    }
}

/// The options PostgreSQL and MySQL take alike, from their URL or their builder.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LaneOptions {
    pub(crate) fencing: bool,
    pub(crate) connect_timeout: Duration,
    pub(crate) settings: LaneSettings,
}

impl Default for LaneOptions {
    fn default() -> Self {
        LaneOptions {
            fencing: false,
            connect_timeout: Duration::from_secs(10),
            settings: LaneSettings {
                connections: 4,
                wait_connections: 4,
                keepalive: Duration::from_secs(5),
            },
        }
    }
}

#[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
impl LaneOptions {
    /// The URL options [`LaneOptions::parse`] reads.
    pub(crate) const NAMES: &[&str] = &[
        "fencing",
        "keepalive",
        "connections",
        "wait_connections",
        "connect_timeout",
    ];

    /// Reads the URL option `name` if it is one of [`LaneOptions::NAMES`]: `Ok(false)` when
    /// it is not.
    pub(crate) fn parse(&mut self, name: &str, value: &str) -> Result<bool, LockError> {
        match name {
            "fencing" => {
                self.fencing = match value {
                    "true" | "1" | "yes" | "on" => true,
                    "false" | "0" | "no" | "off" => false,
                    _ => {
                        return Err(LockError::config(format!(
                            "option `fencing` has the value `{}`; write `true` or `false`",
                            crate::options::shown(value)
                        )));
                    }
                }
            }
            "keepalive" => self.settings.keepalive = parse_duration(name, value)?,
            "connect_timeout" => self.connect_timeout = parse_duration(name, value)?,
            "connections" => self.settings.connections = parse_count(name, value)?,
            "wait_connections" => self.settings.wait_connections = parse_count(name, value)?,
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// Checks the options, naming the one that is wrong.
    pub(crate) fn check(&self) -> Result<(), LockError> {
        check_connect_timeout(self.connect_timeout)?;
        self.settings.check()
    }
}

#[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
fn parse_count(option: &str, value: &str) -> Result<usize, LockError> {
    value.trim().parse().map_err(|_| {
        LockError::config(format!(
            "option `{option}` has the value `{}`, which is not a whole number",
            crate::options::shown(value)
        ))
    })
}

/// Checks a session engine's `connect_timeout`: more than zero, at most
/// [`MAX_SETTING`](crate::time::MAX_SETTING).
pub(crate) fn check_connect_timeout(connect_timeout: Duration) -> Result<(), LockError> {
    check_setting(
        "connect_timeout",
        connect_timeout,
        Duration::from_nanos(1),
        MAX_SETTING,
    )
    .map(drop)
}

/// The shared machinery of one backend instance.
pub(crate) struct Lanes<C: Connector> {
    connector: Arc<C>,
    settings: LaneSettings,
    /// The lanes' command channels; a lane whose task has stopped (its runtime was dropped) is
    /// started again when next picked.
    lanes: Vec<Mutex<mpsc::UnboundedSender<LaneCommand<C>>>>,
    next_lane: AtomicUsize,
    next_handle: AtomicU64,
    waits: Arc<WaitPool<C::Session>>,
    claims: Arc<Claims<C::Resource>>,
}

impl<C: Connector> Lanes<C> {
    /// Opens the first lane's session (so a wrong address or password is reported at once)
    /// and starts the lane tasks. Must run inside a Tokio runtime.
    #[cfg_attr(not(any(feature = "mssql", feature = "oracle")), allow(dead_code))]
    pub(crate) async fn open(connector: C, settings: LaneSettings) -> Result<Self, LockError> {
        settings.check()?;
        Self::check_runtime()?;
        let first = connector.open().await?;
        Self::start(connector, settings, first)
    }

    fn check_runtime() -> Result<(), LockError> {
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(LockError::config(format!(
                "the {} backend must be opened inside a Tokio runtime",
                C::NAME
            )));
        }
        Ok(())
    }

    /// Starts the lane tasks with `first` as the first lane's session (the other lanes open
    /// theirs when first needed). Must run inside a Tokio runtime.
    pub(crate) fn start(
        connector: C,
        settings: LaneSettings,
        first: C::Session,
    ) -> Result<Self, LockError> {
        settings.check()?;
        Self::check_runtime()?;
        let connector = Arc::new(connector);
        let mut first = Some(first);
        let mut lanes = Vec::with_capacity(settings.connections);
        for _ in 0..settings.connections {
            lanes.push(Mutex::new(Lane::spawn(
                &connector,
                settings.keepalive,
                first.take(),
            )));
        }
        Ok(Lanes {
            connector,
            settings,
            lanes,
            next_lane: AtomicUsize::new(0),
            next_handle: AtomicU64::new(0),
            waits: Arc::new(WaitPool {
                permits: Arc::new(Semaphore::new(settings.wait_connections)),
                idle: Mutex::new(Vec::new()),
            }),
            claims: Arc::new(Claims::default()),
        })
    }

    /// The settings this instance runs with.
    pub(crate) fn settings(&self) -> LaneSettings {
        self.settings
    }

    /// The backend's connector.
    #[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
    pub(crate) fn connector(&self) -> &C {
        &self.connector
    }

    /// The next lane's command channel. A lane whose task has stopped (the runtime it ran on
    /// was dropped; its locks were reported lost then) is started again on this runtime.
    fn lane(&self) -> Result<mpsc::UnboundedSender<LaneCommand<C>>, LockError> {
        let n = self.next_lane.fetch_add(1, Ordering::Relaxed);
        // Never empty (the settings are checked), but answer an error rather than panic.
        let lane = self
            .lanes
            .get(n % self.lanes.len().max(1))
            .ok_or_else(lane_gone::<C>)?;
        let mut sender = lane.lock().unwrap_or_else(PoisonError::into_inner);
        if sender.is_closed() {
            Self::check_runtime()?;
            *sender = Lane::spawn(&self.connector, self.settings.keepalive, None);
        }
        Ok(sender.clone())
    }

    /// One try on a lane.
    pub(crate) async fn try_acquire(&self, key: &str) -> Result<Option<Acquired>, LockError> {
        let resource = self.connector.resource(key);
        self.try_resource(resource).await
    }

    async fn try_resource(&self, resource: C::Resource) -> Result<Option<Acquired>, LockError> {
        let Some(claim) = self.claims.claim(&resource, Until::Try).await else {
            return Ok(None);
        };
        self.try_claimed(resource, claim).await
    }

    /// One try on a lane for a resource this acquisition has claimed.
    async fn try_claimed(
        &self,
        resource: C::Resource,
        claim: Claim<C::Resource>,
    ) -> Result<Option<Acquired>, LockError> {
        let lane = self.lane()?;
        let handle = self.next_handle.fetch_add(1, Ordering::Relaxed);
        let lost = CancellationToken::new();
        let (reply, answer) = oneshot::channel();
        // Marks the claim as being cleaned up if this future is dropped before the answer.
        let abandoned = claim.abandon_guard();
        lane.send(LaneCommand::Try {
            resource,
            claim,
            handle,
            lost: lost.clone(),
            reply,
        })
        .map_err(|_| lane_gone::<C>())?;
        // Armed from here on: if this future is dropped before the answer is turned into a
        // guard (even after the lane has sent a grant), dropping `held` queues an unlock
        // behind the try, which frees whatever the try got.
        let held = LaneHeld::new(lane, handle);
        let answer = answer.await;
        abandoned.disarm();
        match answer.map_err(|_| lane_gone::<C>())?? {
            Some(grant) => Ok(Some(Acquired::new(grant.token, lost, Box::new(held)))),
            None => {
                held.disarm();
                Ok(None)
            }
        }
    }

    async fn poll_lanes(
        &self,
        resource: C::Resource,
        deadline: Option<Instant>,
    ) -> Result<Option<Acquired>, LockError> {
        let backoff = Backoff::default();
        let mut attempt = 0u32;
        loop {
            // Another acquisition of this backend holding the resource is waited for here,
            // without asking the server.
            let Some(claim) = self
                .claims
                .claim(&resource, Until::Deadline(deadline))
                .await
            else {
                return Ok(None);
            };
            if let Some(acquired) = self.try_claimed(resource.clone(), claim).await? {
                return Ok(Some(acquired));
            }
            let mut pause = backoff.delay(attempt);
            attempt = attempt.saturating_add(1);
            if let Some(deadline) = deadline {
                let now = Instant::now();
                if now >= deadline {
                    return Ok(None);
                }
                pause = pause.min(deadline - now);
            }
            tokio::time::sleep(pause).await;
        }
    }

    /// Waits up to `timeout` (`Duration::MAX`: no limit): a try on a lane first, then a
    /// native wait on a wait session (or polling when none is free).
    pub(crate) async fn acquire_wait(
        &self,
        key: &str,
        timeout: Duration,
    ) -> Result<Option<Acquired>, LockError> {
        let deadline = crate::time::deadline(Instant::now(), timeout);
        let resource = self.connector.resource(key);
        // A free key is taken on a lane, like a try.
        if let Some(acquired) = self.try_resource(resource.clone()).await? {
            return Ok(Some(acquired));
        }
        let remaining = deadline.map_or(Duration::MAX, |d| {
            d.saturating_duration_since(Instant::now())
        });
        if remaining.is_zero() {
            return Ok(None);
        }
        // Another acquisition of this backend (through this provider or another provider on a
        // clone of the backend) may hold the resource: wait for it to let go here, since the
        // server would let a shared session in, and could not queue this wait behind it.
        let Some(claim) = self
            .claims
            .claim(&resource, Until::Deadline(deadline))
            .await
        else {
            return Ok(None);
        };
        let Ok(permit) = Arc::clone(&self.waits.permits).try_acquire_owned() else {
            // Every wait session is busy: poll the lanes instead.
            drop(claim);
            return self.poll_lanes(resource, deadline).await;
        };
        let lost = CancellationToken::new();
        let (reply, answer) = oneshot::channel();
        let abandoned = claim.abandon_guard();
        let task = WaitTask {
            connector: Arc::clone(&self.connector),
            resource,
            claim,
            deadline,
            keepalive: self.settings.keepalive,
            pool: Arc::clone(&self.waits),
            interrupter: self.lane()?,
            lost: lost.clone(),
            tie: Mutex::new(None),
            _permit: permit,
        };
        tokio::spawn(task.run(reply));
        // If this future is dropped, the task sees the closed reply, interrupts the wait and
        // drops its session, which also ends a lock granted in the meantime.
        let answer = match remaining.checked_add(C::WAIT_GRACE) {
            Some(limit) => match tokio::time::timeout(limit, answer).await {
                Ok(answer) => answer,
                // The server did not answer in time: give up (the task cleans up; the armed
                // guard marks the claim as being cleaned up).
                Err(_) => return Ok(None),
            },
            None => answer.await,
        };
        abandoned.disarm();
        match answer.map_err(|_| lane_gone::<C>())?? {
            None => Ok(None),
            Some((grant, release)) => Ok(Some(Acquired::new(
                grant.token,
                lost,
                Box::new(WaitHeld {
                    release: Some(release),
                }),
            ))),
        }
    }
}

impl<C: Connector> Debug for Lanes<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lanes")
            .field("backend", &C::NAME)
            .field("connections", &self.lanes.len())
            .field("wait_connections", &self.settings.wait_connections)
            .field("keepalive", &self.settings.keepalive)
            .finish()
    }
}

fn lane_gone<C: Connector>() -> LockError {
    LockError::unavailable(
        C::NAME,
        "the backend's connection task has stopped (is the Tokio runtime shutting down?)",
        None,
    )
}

/// Implements [`LockBackend`](crate::backend::LockBackend) named `$name` for a backend whose
/// field `lanes` holds its [`Lanes`]: tries and native waits are the lanes' own.
macro_rules! lane_backend {
    ($backend:ty, $name:expr) => {
        impl $crate::backend::LockBackend for $backend {
            fn name(&self) -> &'static str {
                $name
            }

            fn supports_native_wait(&self) -> bool {
                true
            }

            fn try_acquire<'a>(
                &'a self,
                request: $crate::backend::LockRequest<'a>,
            ) -> $crate::backend::BoxFuture<
                'a,
                Result<Option<$crate::backend::Acquired>, $crate::LockError>,
            > {
                Box::pin(self.lanes.try_acquire(request.key))
            }

            fn acquire_wait<'a>(
                &'a self,
                request: $crate::backend::LockRequest<'a>,
                timeout: std::time::Duration,
            ) -> $crate::backend::BoxFuture<
                'a,
                Result<Option<$crate::backend::Acquired>, $crate::LockError>,
            > {
                Box::pin(self.lanes.acquire_wait(request.key, timeout))
            }
        }
    };
}
pub(crate) use lane_backend;

/// The builder setters of the options every lane backend shares ([`LaneOptions`]), for a
/// builder whose field `lane` holds them. Invoked inside the builder's `impl` block.
#[cfg_attr(
    not(any(feature = "postgres", feature = "mysql")),
    allow(unused_macros)
)]
macro_rules! lane_builder_options {
    () => {
        /// Issue fencing tokens from the `dlock_fencing` counter table (default off).
        pub fn fencing(mut self, fencing: bool) -> Self {
            self.lane.fencing = fencing;
            self
        }

        /// How often connections that hold locks are checked (default 5 s, at least 10 ms).
        pub fn keepalive(mut self, keepalive: std::time::Duration) -> Self {
            self.lane.settings.keepalive = keepalive;
            self
        }

        /// How long opening a connection may take (default 10 s).
        pub fn connect_timeout(mut self, connect_timeout: std::time::Duration) -> Self {
            self.lane.connect_timeout = connect_timeout;
            self
        }

        /// The number of lock connections, which hold the locks taken without waiting
        /// (default 4, 1 to 64).
        pub fn connections(mut self, connections: usize) -> Self {
            self.lane.settings.connections = connections;
            self
        }

        /// The most connections used for native waits at once (default 4, 0 to 64; 0 makes
        /// waits poll instead).
        pub fn wait_connections(mut self, wait_connections: usize) -> Self {
            self.lane.settings.wait_connections = wait_connections;
            self
        }
    };
}
#[cfg_attr(
    not(any(feature = "postgres", feature = "mysql")),
    allow(unused_imports)
)]
pub(crate) use lane_builder_options;

/// The option accessors of a lane backend whose connector has a `fencing` field. Invoked
/// inside the backend's `impl` block.
#[cfg_attr(
    not(any(feature = "postgres", feature = "mysql")),
    allow(unused_macros)
)]
macro_rules! lane_backend_options {
    () => {
        /// Whether this backend issues fencing tokens.
        pub fn fencing(&self) -> bool {
            self.lanes.connector().fencing
        }

        /// The liveness check cadence.
        pub fn keepalive(&self) -> std::time::Duration {
            self.lanes.settings().keepalive
        }
    };
}
#[cfg_attr(
    not(any(feature = "postgres", feature = "mysql")),
    allow(unused_imports)
)]
pub(crate) use lane_backend_options;

// ---------------------------------------------------------------------------------------------
// Claims.

/// The resources that acquisitions of one backend hold, are acquiring, or are still cleaning
/// up after they were abandoned. Every acquisition claims its resource before it asks the
/// server, and keeps the claim until the lock is given back (or its session is gone).
struct Claims<R> {
    map: Mutex<HashMap<R, ClaimState>>,
    next: AtomicU64,
}

impl<R> Default for Claims<R> {
    fn default() -> Self {
        Claims {
            map: Mutex::new(HashMap::new()),
            next: AtomicU64::new(0),
        }
    }
}

/// A claimed resource: the claim's id, whether its abandoned acquisition is being cleaned up,
/// and what wakes acquisitions waiting for the claim to end.
struct ClaimState {
    id: u64,
    settling: bool,
    ended: Arc<Notify>,
}

/// How long [`Claims::claim`] waits for a claim of another acquisition to end.
#[derive(Debug, Clone, Copy)]
enum Until {
    /// A try: a resource another acquisition holds is answered as held at once; one whose
    /// abandoned acquisition is still being cleaned up is waited for, up to [`SETTLE_LIMIT`].
    Try,
    /// A wait: any claim is waited for, up to the deadline (`None`: without limit).
    Deadline(Option<Instant>),
}

impl<R: Clone + Eq + Hash> Claims<R> {
    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<R, ClaimState>> {
        self.map.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Claims `resource`: `None` when another acquisition of this backend holds it (and, for
    /// a wait, still holds it at the deadline).
    async fn claim(self: &Arc<Self>, resource: &R, until: Until) -> Option<Claim<R>> {
        let limit = match until {
            Until::Try => crate::time::deadline(Instant::now(), SETTLE_LIMIT),
            Until::Deadline(deadline) => deadline,
        };
        loop {
            let ended = {
                let mut map = self.map();
                match map.get(resource) {
                    None => {
                        let id = self.next.fetch_add(1, Ordering::Relaxed);
                        map.insert(
                            resource.clone(),
                            ClaimState {
                                id,
                                settling: false,
                                ended: Arc::new(Notify::new()),
                            },
                        );
                        return Some(Claim {
                            claims: Arc::clone(self),
                            resource: resource.clone(),
                            id,
                        });
                    }
                    Some(state) if !state.settling && matches!(until, Until::Try) => return None,
                    Some(state) => Arc::clone(&state.ended),
                }
            };
            if limit.is_some_and(|limit| Instant::now() >= limit) {
                return None;
            }
            let notified = ended.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            // Re-check: the claim may have ended between the look and `enable`.
            let still = self
                .map()
                .get(resource)
                .is_some_and(|state| Arc::ptr_eq(&state.ended, &ended));
            if still {
                match limit {
                    Some(limit) => {
                        let _ = tokio::time::timeout_at(limit.into(), notified).await;
                    }
                    None => notified.await,
                }
            }
        }
    }

    /// Marks claim `id` of `resource` as being cleaned up (if it is still that claim): tries
    /// wait for it instead of answering that the resource is held.
    fn settle(&self, resource: &R, id: u64) {
        if let Some(state) = self.map().get_mut(resource) {
            if state.id == id {
                state.settling = true;
            }
        }
    }
}

/// A claimed resource; dropping it ends the claim and wakes the acquisitions waiting for it.
struct Claim<R: Clone + Eq + Hash> {
    claims: Arc<Claims<R>>,
    resource: R,
    id: u64,
}

impl<R: Clone + Eq + Hash> Claim<R> {
    /// Marks the resource as being cleaned up on the server: tries wait until the claim is
    /// dropped instead of answering that it is held.
    fn settling(&self) {
        self.claims.settle(&self.resource, self.id);
    }

    /// A guard that marks this claim as being cleaned up if it is dropped armed: an
    /// acquisition future dropped before its answer arrived leaves the resource to the
    /// background clean-up.
    fn abandon_guard(&self) -> AbandonGuard<R> {
        AbandonGuard {
            claims: Arc::clone(&self.claims),
            resource: self.resource.clone(),
            id: self.id,
            armed: true,
        }
    }
}

impl<R: Clone + Eq + Hash> Drop for Claim<R> {
    fn drop(&mut self) {
        let mut map = self.claims.map();
        if map
            .get(&self.resource)
            .is_some_and(|state| state.id == self.id)
        {
            if let Some(state) = map.remove(&self.resource) {
                drop(map);
                state.ended.notify_waiters();
            }
        }
    }
}

struct AbandonGuard<R: Clone + Eq + Hash> {
    claims: Arc<Claims<R>>,
    resource: R,
    id: u64,
    armed: bool,
}

impl<R: Clone + Eq + Hash> AbandonGuard<R> {
    /// The answer arrived: nothing to mark.
    fn disarm(mut self) {
        self.armed = false;
    }
}

impl<R: Clone + Eq + Hash> Drop for AbandonGuard<R> {
    fn drop(&mut self) {
        if self.armed {
            self.claims.settle(&self.resource, self.id);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Lanes.

enum LaneCommand<C: Connector> {
    /// One try; on success the lock is pinned to this lane under `handle`.
    Try {
        resource: C::Resource,
        claim: Claim<C::Resource>,
        handle: u64,
        lost: CancellationToken,
        reply: oneshot::Sender<Result<Option<Grant>, LockError>>,
    },
    /// Gives back the lock `handle` (if this lane still holds it), then acknowledges.
    Unlock {
        handle: u64,
        done: oneshot::Sender<()>,
    },
    /// Runs an abandoned wait's interrupt request, then acknowledges.
    Interrupt {
        request: InterruptOf<C>,
        done: oneshot::Sender<()>,
    },
}

/// A lock a lane holds.
struct LaneLock<C: Connector> {
    resource: C::Resource,
    lost: CancellationToken,
    /// Dropped after the lock is given back (or its session is gone).
    _claim: Claim<C::Resource>,
}

struct Lane<C: Connector> {
    connector: Arc<C>,
    keepalive: Duration,
    session: Option<C::Session>,
    held: HashMap<u64, LaneLock<C>>,
}

impl<C: Connector> Lane<C> {
    /// Starts a lane task on the current runtime (with `session`, or opening one when first
    /// needed) and returns its command channel.
    fn spawn(
        connector: &Arc<C>,
        keepalive: Duration,
        session: Option<C::Session>,
    ) -> mpsc::UnboundedSender<LaneCommand<C>> {
        let (tx, rx) = mpsc::unbounded_channel();
        let lane = Lane {
            connector: Arc::clone(connector),
            keepalive,
            session,
            held: HashMap::new(),
        };
        tokio::spawn(lane.run(rx));
        tx
    }

    async fn run(mut self, mut commands: mpsc::UnboundedReceiver<LaneCommand<C>>) {
        let mut ticker = tokio::time::interval_at(
            crate::time::later_tokio(tokio::time::Instant::now(), self.keepalive),
            self.keepalive,
        );
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                command = commands.recv() => match command {
                    Some(command) => self.handle(command).await,
                    // The backend and every lock of this lane are gone.
                    None => break,
                },
                _ = ticker.tick(), if self.session.is_some() => self.check().await,
            }
        }
    }

    async fn handle(&mut self, command: LaneCommand<C>) {
        match command {
            LaneCommand::Try {
                resource,
                claim,
                handle,
                lost,
                reply,
            } => {
                if reply.is_closed() {
                    return;
                }
                match self.try_lock(&resource).await {
                    Ok(Some(grant)) => {
                        self.held.insert(
                            handle,
                            LaneLock {
                                resource,
                                lost,
                                _claim: claim,
                            },
                        );
                        if reply.send(Ok(Some(grant))).is_err() {
                            // Abandoned while the server granted it: give it back.
                            self.unlock(handle).await;
                        }
                    }
                    other => {
                        // Free the claim before answering, so a retry can claim it again.
                        drop(claim);
                        let _ = reply.send(other);
                    }
                }
            }
            LaneCommand::Unlock { handle, done } => {
                self.unlock(handle).await;
                let _ = done.send(());
            }
            LaneCommand::Interrupt { request, done } => {
                self.interrupt(request).await;
                let _ = done.send(());
            }
        }
    }

    /// The lane's session, opening a fresh one if there is none.
    async fn session(&mut self) -> Result<&mut C::Session, LockError> {
        if self.session.is_none() {
            self.session = Some(self.connector.open().await?);
        }
        self.session.as_mut().ok_or_else(lane_gone::<C>)
    }

    /// One try. An idle session found dead (nothing held on it) is replaced once.
    async fn try_lock(&mut self, resource: &C::Resource) -> Result<Option<Grant>, LockError> {
        let reused = self.session.is_some();
        match self.try_once(resource).await {
            Err(_) if reused && self.session.is_none() && self.held.is_empty() => {
                self.try_once(resource).await
            }
            other => other,
        }
    }

    async fn try_once(&mut self, resource: &C::Resource) -> Result<Option<Grant>, LockError> {
        let session = self.session().await?;
        let outcome =
            tokio::time::timeout(STATEMENT_TIMEOUT, session.lock(resource, Duration::ZERO)).await;
        match outcome {
            Ok(Ok(granted)) => Ok(granted),
            Ok(Err(failure)) => {
                if !failure.connection_ok {
                    self.die("the lock connection failed");
                }
                Err(failure.error)
            }
            Err(_) => {
                self.die("the lock connection stopped answering");
                Err(LockError::unavailable(
                    C::NAME,
                    format!(
                        "the server did not answer a lock statement within {STATEMENT_TIMEOUT:?}"
                    ),
                    None,
                ))
            }
        }
    }

    async fn unlock(&mut self, handle: u64) {
        // A lock that is not in `held` went with a dead session: nothing to give back.
        let Some(lock) = self.held.remove(&handle) else {
            return;
        };
        let Some(session) = self.session.as_mut() else {
            return;
        };
        match tokio::time::timeout(STATEMENT_TIMEOUT, session.unlock(&lock.resource)).await {
            Ok(Ok(())) => {}
            Ok(Err(failure)) if failure.connection_ok => {
                tracing::warn!(backend = C::NAME, error = %failure.error, "releasing a lock failed; closing its connection");
                self.die("releasing a lock failed");
            }
            // The session's state is unknown: dropping it is the one sure way to free the
            // lock on the server, and it takes this lane's other locks with it.
            _ => self.die("releasing a lock failed"),
        }
    }

    /// Runs an abandoned wait's interrupt request from this lane's session.
    async fn interrupt(&mut self, request: InterruptOf<C>) {
        let Ok(session) = self.session().await else {
            return;
        };
        match tokio::time::timeout(STATEMENT_TIMEOUT, session.run_interrupt(request)).await {
            Ok(Ok(())) => {}
            Ok(Err(failure)) if failure.connection_ok => {
                tracing::warn!(backend = C::NAME, error = %failure.error, "stopping an abandoned wait failed");
            }
            _ => self.die("the lock connection failed"),
        }
    }

    async fn check(&mut self) {
        let Some(session) = self.session.as_mut() else {
            return;
        };
        match tokio::time::timeout(C::PING_TIMEOUT, session.ping()).await {
            Ok(Ok(())) => {}
            _ => self.die("the lock connection failed its liveness check"),
        }
    }

    /// Drops the session and reports every lock it held as lost.
    fn die(&mut self, why: &str) {
        if !self.held.is_empty() {
            tracing::warn!(
                backend = C::NAME,
                locks = self.held.len(),
                "{why}; its locks are lost"
            );
        }
        for (_, lock) in self.held.drain() {
            lock.lost.cancel();
        }
        self.session = None;
    }
}

impl<C: Connector> Drop for Lane<C> {
    /// The lane's task has stopped: normally only once the backend and every lock of the lane
    /// are gone, but also when the runtime it ran on is dropped with locks still held. Its
    /// session (and with it every lock it held) ends here, so their holders must hear it.
    fn drop(&mut self) {
        if !self.held.is_empty() {
            self.die("the lock connection's task stopped (was its Tokio runtime dropped?)");
        }
    }
}

/// A lock pinned to a lane (or a try in flight that may become one). Dropped without
/// [`HeldLock::release`], it queues an unlock for its handle without waiting for it; the lane
/// runs commands in order, so that unlock comes after the try it answers.
struct LaneHeld<C: Connector> {
    lane: mpsc::UnboundedSender<LaneCommand<C>>,
    handle: u64,
    armed: bool,
}

impl<C: Connector> LaneHeld<C> {
    fn new(lane: mpsc::UnboundedSender<LaneCommand<C>>, handle: u64) -> Self {
        LaneHeld {
            lane,
            handle,
            armed: true,
        }
    }

    /// For a try that was not granted: nothing to give back.
    fn disarm(mut self) {
        self.armed = false;
    }
}

impl<C: Connector> Drop for LaneHeld<C> {
    fn drop(&mut self) {
        if self.armed {
            let (done, _) = oneshot::channel();
            let _ = self.lane.send(LaneCommand::Unlock {
                handle: self.handle,
                done,
            });
        }
    }
}

impl<C: Connector> Debug for LaneHeld<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LaneHeld")
            .field("backend", &C::NAME)
            .field("handle", &self.handle)
            .finish()
    }
}

impl<C: Connector> HeldLock for LaneHeld<C> {
    fn release(mut self: Box<Self>) -> BoxFuture<'static, Result<(), LockError>> {
        self.armed = false;
        Box::pin(async move {
            let (done, acknowledged) = oneshot::channel();
            if self
                .lane
                .send(LaneCommand::Unlock {
                    handle: self.handle,
                    done,
                })
                .is_ok()
            {
                // The lane task ends only with its session, which frees the lock anyway.
                let _ = acknowledged.await;
            }
            Ok(())
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Native waits.

struct WaitPool<S> {
    /// One permit per wait session in use (waiting, or holding what its wait got).
    permits: Arc<Semaphore>,
    /// Wait sessions that hold nothing, ready for the next wait, with the runtime each was
    /// opened on.
    idle: Mutex<Vec<(S, RuntimeTie)>>,
}

impl<S> WaitPool<S> {
    /// An idle session whose runtime still runs; those whose runtime is gone are dropped.
    fn take(&self) -> Option<(S, RuntimeTie)> {
        let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        while let Some((session, tie)) = idle.pop() {
            if tie.alive() {
                return Some((session, tie));
            }
        }
        None
    }

    fn put(&self, session: S, tie: RuntimeTie) {
        self.idle
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push((session, tie));
    }
}

/// Whether the Tokio runtime a session was opened on still runs. The session's socket is
/// driven by that runtime: once it has shut down, the socket's next wait for readiness fails
/// ("A Tokio 1.x context was found, but it is being shutdown"), although a ping may still
/// pass on readiness seen before, so an idle session is not reused after that. A task on the
/// runtime holds the tie's other end: it is dropped, and the tie cut, when the runtime shuts
/// down, and it ends when the tie is dropped.
struct RuntimeTie {
    runtime_gone: CancellationToken,
    _dropped: tokio_util::sync::DropGuard,
}

impl RuntimeTie {
    /// A tie to the current runtime (cut at once outside one).
    fn current() -> RuntimeTie {
        let runtime_gone = CancellationToken::new();
        let dropped = CancellationToken::new();
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                let cut = runtime_gone.clone().drop_guard();
                let ended = dropped.clone();
                drop(runtime.spawn(async move {
                    let _cut = cut;
                    ended.cancelled().await;
                }));
            }
            Err(_) => runtime_gone.cancel(),
        }
        RuntimeTie {
            runtime_gone,
            _dropped: dropped.drop_guard(),
        }
    }

    fn alive(&self) -> bool {
        !self.runtime_gone.is_cancelled()
    }
}

type ReleaseSender = oneshot::Sender<oneshot::Sender<()>>;
type WaitReply = oneshot::Sender<Result<Option<(Grant, ReleaseSender)>, LockError>>;

/// One native wait on a wait session; once granted, the task keeps the lock (and checks the
/// session) until it is released.
struct WaitTask<C: Connector> {
    connector: Arc<C>,
    resource: C::Resource,
    /// Held until the task ends, after the lock is given back or the session dropped.
    claim: Claim<C::Resource>,
    deadline: Option<Instant>,
    keepalive: Duration,
    pool: Arc<WaitPool<C::Session>>,
    /// The lane that runs this wait's interrupt request if it is abandoned.
    interrupter: mpsc::UnboundedSender<LaneCommand<C>>,
    lost: CancellationToken,
    /// The runtime the task's session was opened on (set when the task has its session).
    tie: Mutex<Option<RuntimeTie>>,
    // Held until the session is back in the pool (or dropped).
    _permit: tokio::sync::OwnedSemaphorePermit,
}

enum Step {
    Granted(Grant),
    NotGranted,
    Abandoned,
    Failed(Failure),
}

impl<C: Connector> WaitTask<C> {
    async fn run(self, mut reply: WaitReply) {
        let (mut session, tie) = match self.reuse().await {
            Some(reused) => reused,
            None => match self.connector.open().await {
                Ok(session) => (session, RuntimeTie::current()),
                Err(err) => {
                    let _ = reply.send(Err(err));
                    return;
                }
            },
        };
        *self.tie.lock().unwrap_or_else(PoisonError::into_inner) = Some(tie);
        let resolution = self.connector.wait_resolution();
        let mut pause = TAIL_PAUSE;
        let grant = loop {
            let left = self.deadline.map_or(Duration::MAX, |deadline| {
                deadline.saturating_duration_since(Instant::now())
            });
            let last = self.deadline.is_some() && left.is_zero();
            let whole = round_down(left.min(C::MAX_WAIT), resolution);
            if whole.is_zero() && !last {
                // Less than the server's resolution is left: short pauses and tries up to
                // the deadline, the last one at it.
                tokio::select! {
                    () = tokio::time::sleep(pause.min(left)) => {}
                    () = reply.closed() => {
                        // Nothing is in flight or held on the session: keep it.
                        self.put(session);
                        return;
                    }
                }
                pause = (pause * 2).min(TAIL_PAUSE_MAX);
            }
            let step = {
                let statement = session.lock(&self.resource, whole);
                tokio::select! {
                    result = statement => match result {
                        Ok(Some(grant)) => Step::Granted(grant),
                        Ok(None) => Step::NotGranted,
                        Err(failure) => Step::Failed(failure),
                    },
                    () = reply.closed() => Step::Abandoned,
                }
            };
            match step {
                Step::Granted(grant) => break grant,
                Step::NotGranted if last => {
                    let _ = reply.send(Ok(None));
                    self.put(session);
                    return;
                }
                Step::NotGranted => continue,
                Step::Abandoned => {
                    self.abandon(session).await;
                    return;
                }
                Step::Failed(failure) => {
                    let _ = reply.send(Err(failure.error));
                    if failure.connection_ok {
                        // Make sure nothing stays held, then keep the session.
                        self.give_back(session).await;
                    }
                    return;
                }
            }
        };
        let (release_tx, release_rx) = oneshot::channel();
        if reply.send(Ok(Some((grant, release_tx)))).is_err() {
            // Abandoned after the server granted it: give it back.
            self.settling();
            self.give_back(session).await;
            return;
        }
        self.hold(session, release_rx).await;
    }

    fn settling(&self) {
        self.claim.settling();
    }

    /// Stops the server's wait (interrupting it, from a lane where the session asks for
    /// that) and drops the session, which ends anything it was granted in the meantime. The
    /// task (and with it the claim) ends once the lane has run the interrupt.
    async fn abandon(&self, session: C::Session) {
        self.settling();
        let finished = session.interrupt(&self.resource).and_then(|request| {
            let (done, finished) = oneshot::channel();
            self.interrupter
                .send(LaneCommand::Interrupt { request, done })
                .ok()
                .map(|()| finished)
        });
        drop(session);
        if let Some(finished) = finished {
            let _ = finished.await;
        }
    }

    /// An idle wait session that still answers, if there is one, with its runtime tie.
    async fn reuse(&self) -> Option<(C::Session, RuntimeTie)> {
        while let Some((mut session, tie)) = self.pool.take() {
            if let Ok(Ok(())) = tokio::time::timeout(C::PING_TIMEOUT, session.ping()).await {
                return Some((session, tie));
            }
        }
        None
    }

    /// Returns the session (which holds nothing) to the pool.
    fn put(&self, session: C::Session) {
        let tie = self
            .tie
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(tie) = tie {
            self.pool.put(session, tie);
        }
    }

    /// Gives the lock back and returns the session to the pool; drops the session (which
    /// frees the lock on the server) if that fails.
    async fn give_back(&self, mut session: C::Session) {
        if let Ok(Ok(())) =
            tokio::time::timeout(STATEMENT_TIMEOUT, session.unlock(&self.resource)).await
        {
            self.put(session);
        }
    }

    async fn hold(
        &self,
        mut session: C::Session,
        mut release: oneshot::Receiver<oneshot::Sender<()>>,
    ) {
        // The first check one period from now. (`interval`'s immediate first tick still goes
        // through the timer wheel: awaiting it here cost up to a millisecond before a release
        // could be seen, on every lock granted through a wait.)
        let mut ticker = tokio::time::interval_at(
            crate::time::later_tokio(tokio::time::Instant::now(), self.keepalive),
            self.keepalive,
        );
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // If this task stops before the lock is released (its runtime is dropped), the
        // session and the lock end with it: the holder is told.
        let lost = self.lost.clone().drop_guard();
        loop {
            tokio::select! {
                asked = &mut release => {
                    lost.disarm();
                    self.give_back(session).await;
                    if let Ok(done) = asked {
                        let _ = done.send(());
                    }
                    return;
                }
                _ = ticker.tick() => {
                    match tokio::time::timeout(C::PING_TIMEOUT, session.ping()).await {
                        Ok(Ok(())) => {}
                        _ => {
                            tracing::warn!(
                                backend = C::NAME,
                                "a wait connection failed its liveness check; its lock is lost"
                            );
                            drop(lost);
                            return;
                        }
                    }
                }
            }
        }
    }
}

/// `wait` rounded down to a whole number of `unit`s.
pub(crate) fn round_down(wait: Duration, unit: Duration) -> Duration {
    let units = wait.as_nanos().checked_div(unit.as_nanos()).unwrap_or(0);
    unit.saturating_mul(u32::try_from(units).unwrap_or(u32::MAX))
}

/// A lock taken by a native wait, held by its wait task.
#[derive(Debug)]
struct WaitHeld {
    release: Option<ReleaseSender>,
}

impl HeldLock for WaitHeld {
    fn release(mut self: Box<Self>) -> BoxFuture<'static, Result<(), LockError>> {
        let release = self.release.take();
        Box::pin(async move {
            if let Some(release) = release {
                let (done, acknowledged) = oneshot::channel();
                if release.send(done).is_ok() {
                    let _ = acknowledged.await;
                }
            }
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn claims_exclude_and_settling_claims_are_waited_for() {
        let claims: Arc<Claims<&str>> = Arc::new(Claims::default());
        let first = claims.claim(&"a", Until::Try).await.expect("free");
        assert!(
            claims.claim(&"a", Until::Try).await.is_none(),
            "held by this backend"
        );
        assert!(
            claims.claim(&"b", Until::Try).await.is_some(),
            "other resources are free"
        );
        // An abandoned acquisition: later tries wait for its clean-up, then get it.
        first.abandon_guard().disarm();
        drop(first.abandon_guard());
        let waiter = tokio::spawn({
            let claims = Arc::clone(&claims);
            async move { claims.claim(&"a", Until::Try).await.is_some() }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiter.is_finished(), "waits while the claim settles");
        drop(first);
        assert!(waiter.await.unwrap(), "claimed once the clean-up is done");
        // A settle aimed at an earlier claim of the resource changes nothing.
        let second = claims.claim(&"a", Until::Try).await.expect("free again");
        claims.settle(&"a", second.id.wrapping_sub(1));
        assert!(claims.claim(&"a", Until::Try).await.is_none());
        // Nor does the drop of a claim that is no longer the resource's.
        let stale = Claim {
            claims: Arc::clone(&claims),
            resource: "a",
            id: second.id.wrapping_sub(1),
        };
        drop(stale);
        assert!(claims.claim(&"a", Until::Try).await.is_none());
    }

    #[tokio::test]
    async fn waiting_claims_queue_behind_the_holder_and_keep_their_deadline() {
        let claims: Arc<Claims<u8>> = Arc::new(Claims::default());
        let held = claims.claim(&1, Until::Try).await.expect("free");
        // A wait that runs out while the claim is held gets nothing.
        let started = Instant::now();
        let soon = Some(started + Duration::from_millis(50));
        assert!(claims.claim(&1, Until::Deadline(soon)).await.is_none());
        assert!(started.elapsed() >= Duration::from_millis(50));
        // Waits without a limit all get it, one after another.
        let inside = Arc::new(AtomicUsize::new(0));
        let mut waiters = Vec::new();
        for _ in 0..8 {
            let (claims, inside) = (Arc::clone(&claims), Arc::clone(&inside));
            waiters.push(tokio::spawn(async move {
                let claim = claims
                    .claim(&1, Until::Deadline(None))
                    .await
                    .expect("claimed");
                assert_eq!(
                    inside.fetch_add(1, Ordering::SeqCst),
                    0,
                    "two claims at once"
                );
                tokio::task::yield_now().await;
                inside.fetch_sub(1, Ordering::SeqCst);
                drop(claim);
            }));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(
            waiters.iter().all(|w| !w.is_finished()),
            "waiting on the holder"
        );
        drop(held);
        for waiter in waiters {
            waiter.await.expect("waiter");
        }
        assert!(claims.map().is_empty(), "every claim ended");
    }

    /// An in-memory lock server with the semantics the session engines share: a session may
    /// take a lock it holds again (counted, as PostgreSQL, MySQL and SQL Server count it), and
    /// a session's locks end when the session does. It stands in for SQL Server and Oracle,
    /// which cannot run here, to pin what the lane machinery must do for every engine.
    #[derive(Default)]
    struct Server {
        locks: Mutex<HashMap<u64, (u64, u32)>>,
        next_session: AtomicU64,
    }

    struct Model(Arc<Server>);

    struct ModelSession {
        server: Arc<Server>,
        id: u64,
    }

    impl Connector for Model {
        type Resource = u64;
        type Session = ModelSession;
        const NAME: &'static str = "model";
        const MAX_WAIT: Duration = Duration::from_secs(1);

        fn wait_resolution(&self) -> Duration {
            Duration::from_millis(1)
        }

        fn resource(&self, key: &str) -> u64 {
            crate::lock_id(key) as u64
        }

        fn open(&self) -> BoxFuture<'_, Result<ModelSession, LockError>> {
            let server = Arc::clone(&self.0);
            Box::pin(async move {
                let id = server.next_session.fetch_add(1, Ordering::Relaxed);
                Ok(ModelSession { server, id })
            })
        }
    }

    impl ModelSession {
        fn take(&self, resource: u64) -> bool {
            let mut locks = self.server.locks.lock().unwrap();
            match locks.get_mut(&resource) {
                None => {
                    locks.insert(resource, (self.id, 1));
                    true
                }
                Some((owner, count)) if *owner == self.id => {
                    *count += 1;
                    true
                }
                Some(_) => false,
            }
        }
    }

    impl Session for ModelSession {
        type Resource = u64;
        type Interrupt = std::convert::Infallible;

        fn lock<'a>(
            &'a mut self,
            resource: &'a u64,
            wait: Duration,
        ) -> BoxFuture<'a, Result<Option<Grant>, Failure>> {
            Box::pin(async move {
                let deadline = Instant::now() + wait;
                loop {
                    if self.take(*resource) {
                        return Ok(Some(Grant::PLAIN));
                    }
                    if Instant::now() >= deadline {
                        return Ok(None);
                    }
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            })
        }

        fn unlock<'a>(&'a mut self, resource: &'a u64) -> BoxFuture<'a, Result<(), Failure>> {
            let mut locks = self.server.locks.lock().unwrap();
            if let Some((owner, count)) = locks.get_mut(resource) {
                if *owner == self.id {
                    *count -= 1;
                    if *count == 0 {
                        locks.remove(resource);
                    }
                }
            }
            Box::pin(async { Ok(()) })
        }

        fn ping(&mut self) -> BoxFuture<'_, Result<(), Failure>> {
            Box::pin(async { Ok(()) })
        }
    }

    impl Drop for ModelSession {
        fn drop(&mut self) {
            let id = self.id;
            self.server
                .locks
                .lock()
                .unwrap()
                .retain(|_, (owner, _)| *owner != id);
        }
    }

    fn settings(connections: usize, wait_connections: usize) -> LaneSettings {
        LaneSettings {
            connections,
            wait_connections,
            keepalive: Duration::from_secs(5),
        }
    }

    async fn model_lanes(
        server: &Arc<Server>,
        connections: usize,
        wait_connections: usize,
    ) -> Lanes<Model> {
        Lanes::open(
            Model(Arc::clone(server)),
            settings(connections, wait_connections),
        )
        .await
        .expect("lanes")
    }

    /// Acquisitions of one backend (two providers on clones of it share its lanes) never both
    /// get a resource, although the one lane's session would let them re-enter.
    #[tokio::test]
    async fn one_backend_never_grants_a_resource_twice_on_a_shared_session() {
        let server = Arc::new(Server::default());
        let lanes = model_lanes(&server, 1, 1).await;
        let first = lanes.try_acquire("k").await.unwrap().expect("free");
        assert!(
            lanes.try_acquire("k").await.unwrap().is_none(),
            "a second try on the same session was granted"
        );
        let started = Instant::now();
        assert!(
            lanes
                .acquire_wait("k", Duration::from_millis(60))
                .await
                .unwrap()
                .is_none(),
            "a wait was granted a held resource"
        );
        assert!(started.elapsed() >= Duration::from_millis(60));
        // A waiter gets it once the holder lets go.
        let lanes = Arc::new(lanes);
        let waiter = tokio::spawn({
            let lanes = Arc::clone(&lanes);
            async move { lanes.acquire_wait("k", Duration::from_secs(10)).await }
        });
        tokio::time::sleep(Duration::from_millis(30)).await;
        assert!(!waiter.is_finished());
        first.handle.release().await.unwrap();
        let second = waiter
            .await
            .unwrap()
            .unwrap()
            .expect("granted after release");
        assert_eq!(server.locks.lock().unwrap().len(), 1);
        second.handle.release().await.unwrap();
        assert!(server.locks.lock().unwrap().is_empty(), "nothing left held");
    }

    /// An idle wait session opened on a runtime that has since shut down is dropped, not
    /// reused: its socket fails its next wait for readiness, though a ping may pass.
    #[test]
    fn an_idle_session_of_a_runtime_that_is_gone_is_not_reused() {
        let runtime = || {
            tokio::runtime::Builder::new_current_thread()
                .build()
                .unwrap()
        };
        let pool: WaitPool<&str> = WaitPool {
            permits: Arc::new(Semaphore::new(2)),
            idle: Mutex::new(Vec::new()),
        };
        let (first, second) = (runtime(), runtime());
        pool.put("second", second.block_on(async { RuntimeTie::current() }));
        pool.put("first", first.block_on(async { RuntimeTie::current() }));
        drop(first);
        let (session, tie) = pool.take().expect("the live runtime's session");
        assert_eq!(session, "second");
        assert!(tie.alive());
        assert!(
            pool.take().is_none(),
            "the dropped runtime's session is not reused"
        );
        assert!(
            !RuntimeTie::current().alive(),
            "outside a runtime there is nothing to tie to"
        );
    }

    /// The lane task that keeps a lock dies with the runtime it ran on: the lock's lost token
    /// fires, and the backend keeps working from another runtime.
    #[test]
    fn a_lane_stopped_with_its_runtime_reports_its_locks_lost() {
        let server = Arc::new(Server::default());
        let first = tokio::runtime::Runtime::new().unwrap();
        let lanes = first.block_on(model_lanes(&server, 1, 1));
        let second = tokio::runtime::Runtime::new().unwrap();
        let held = second
            .block_on(lanes.try_acquire("k"))
            .unwrap()
            .expect("free");
        assert!(!held.lost.is_cancelled());
        drop(first);
        assert!(held.lost.is_cancelled(), "the lane's runtime is gone");
        assert!(
            server.locks.lock().unwrap().is_empty(),
            "the session, and its lock, ended with the lane"
        );
        second.block_on(async {
            let again = lanes.try_acquire("k").await.unwrap().expect("a new lane");
            assert!(!again.lost.is_cancelled());
            again.handle.release().await.unwrap();
            // The lost lock's release reports nothing of its own.
            held.handle.release().await.unwrap();
        });
    }

    /// The same for a lock granted through a native wait, kept by its wait task.
    #[test]
    fn a_wait_task_stopped_with_its_runtime_reports_its_lock_lost() {
        let server = Arc::new(Server::default());
        let second = tokio::runtime::Runtime::new().unwrap();
        let lanes = Arc::new(second.block_on(model_lanes(&server, 1, 1)));
        let first = tokio::runtime::Runtime::new().unwrap();
        // A holder on another session of the server, so the acquisition must wait.
        let blocker = ModelSession {
            server: Arc::clone(&server),
            id: u64::MAX,
        };
        assert!(blocker.take(lanes.connector().resource("k")));
        let waiting = first.spawn({
            let lanes = Arc::clone(&lanes);
            async move { lanes.acquire_wait("k", Duration::from_secs(10)).await }
        });
        std::thread::sleep(Duration::from_millis(30));
        drop(blocker);
        let held = first
            .block_on(waiting)
            .unwrap()
            .unwrap()
            .expect("granted to the wait");
        assert!(!held.lost.is_cancelled());
        drop(first);
        assert!(held.lost.is_cancelled(), "the wait task's runtime is gone");
        assert!(server.locks.lock().unwrap().is_empty());
    }

    #[test]
    fn rounding_waits_down_to_the_server_resolution() {
        let second = Duration::from_secs(1);
        let milli = Duration::from_millis(1);
        assert_eq!(
            round_down(Duration::from_millis(400), second),
            Duration::ZERO
        );
        assert_eq!(round_down(Duration::from_millis(2999), second), 2 * second);
        assert_eq!(
            round_down(Duration::from_secs(32766), second),
            32766 * second
        );
        assert_eq!(round_down(Duration::from_micros(1500), milli), milli);
        assert_eq!(
            round_down(Duration::from_secs(30), milli),
            Duration::from_secs(30)
        );
        assert_eq!(
            round_down(Duration::from_micros(999), milli),
            Duration::ZERO
        );
        assert_eq!(
            round_down(Duration::from_secs(5), Duration::ZERO),
            Duration::ZERO
        );
    }
}
