//! What an engine implements to plug into the session engine.

use std::fmt::Debug;
use std::hash::Hash;
use std::time::Duration;

use super::options::SessionOptions;
use crate::LockError;
use crate::backend::{BoxFuture, StoreLock};

/// A failed statement: the error, and whether the session is still usable afterwards (a
/// server-side error such as a permission problem leaves it usable; an I/O error does not).
#[derive(Debug)]
pub struct Failure {
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
pub struct Grant {
    /// The fencing token issued in the same round trip, for backends that issue them.
    pub(crate) token: Option<u64>,
}

impl Grant {
    /// A grant without a fencing token.
    pub(crate) const PLAIN: Grant = Grant { token: None };
}

/// The mode of a lock statement: the exclusive lock, or a read lock that shares the resource
/// with other read locks of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Mode {
    /// Excludes every other lock of the resource.
    Exclusive,
    /// Shares the resource with other shared locks, excludes (and is excluded by) the
    /// exclusive lock.
    Shared,
}

impl Mode {
    /// The mode of a request: shared for a read lock.
    pub(crate) fn of(shared: bool) -> Mode {
        if shared {
            Mode::Shared
        } else {
            Mode::Exclusive
        }
    }

    /// Whether this is the shared mode.
    pub(crate) fn is_shared(self) -> bool {
        self == Mode::Shared
    }
}

/// What one try for a permit of a semaphore found on the server (see
/// [`Session::try_permit`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PermitAnswer<P> {
    /// The session took a permit, `permit`, with the fencing token issued in the same round
    /// trip (for backends that issue them).
    Granted {
        /// What [`Session::release_permit`] gives back.
        permit: P,
        /// The permit's fencing token.
        token: Option<u64>,
    },
    /// Every permit is held, or (for a single try) a waiter holds the semaphore's queue lock:
    /// nothing was taken.
    Full,
    /// The semaphore's permits are held under another count, `recorded`: nothing was taken.
    Conflict {
        /// The count the live permits were taken with.
        recorded: u32,
    },
}

impl<P> PermitAnswer<P> {
    /// The same answer without its permit.
    pub(crate) fn forget(&self) -> PermitAnswer<()> {
        match *self {
            PermitAnswer::Granted { token, .. } => PermitAnswer::Granted { permit: (), token },
            PermitAnswer::Full => PermitAnswer::Full,
            PermitAnswer::Conflict { recorded } => PermitAnswer::Conflict { recorded },
        }
    }
}

/// How many permits of a semaphore are live on the server, and the count they were taken
/// with (see [`Session::count_permits`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PermitCount {
    /// The live permits, by any session.
    pub(crate) holders: u32,
    /// Their count, when any is live.
    pub(crate) recorded: Option<u32>,
}

/// Opens sessions and names resources for one backend. Its `Debug` output shows where it
/// connects (never a password).
pub trait Connector: Debug + Send + Sync + 'static {
    /// What the server locks for a key (a resource name, an integer id).
    type Resource: Clone + Send + Sync + Debug + Eq + Hash + 'static;
    /// A semaphore of some count, as the engine names it on the server: what its tries and
    /// counts are asked with.
    type Semaphore: Clone + Send + Sync + Debug + 'static;
    /// One server connection.
    type Session: Session<Resource = Self::Resource, Semaphore = Self::Semaphore>;

    /// The most permits one semaphore may have on this engine: a try that finds the
    /// semaphore full walks every slot on the server, and the engine bounds that walk
    /// (`u32::MAX` where the server counts the holders instead of walking).
    const MAX_PERMITS: u32;

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

    /// The semaphore `key` of `max_count` permits (1 to [`MAX_PERMITS`](Self::MAX_PERMITS),
    /// checked before), whose queue lock is `queue` (the resource of the provider's queue
    /// lock, the waiting mark of single tries).
    fn semaphore(&self, key: &str, max_count: u32, queue: Self::Resource) -> Self::Semaphore;

    /// Whether this server runs the engine's permit statements (`LockBackend::semaphores`):
    /// the default; an engine answers `false` for a server too old for them, whose
    /// semaphores the provider then keeps as slot locks.
    fn keeps_permits(&self) -> bool {
        true
    }

    /// Whether the engine keeps the semaphores' count record (`PermitStore::
    /// keeps_count_record`): the default; MySQL and MariaDB cannot.
    fn keeps_count_record(&self) -> bool {
        true
    }

    /// Whether the engine takes shared locks ([`Mode::Shared`]): `Ok(())`, or the
    /// `Unsupported` error that says why not (the answer of `LockBackend::shared_locks`).
    fn shared_locks(&self) -> Result<(), LockError>;

    /// Opens a session (bounded by the backend's connect timeout).
    fn open(&self) -> BoxFuture<'_, Result<Self::Session, LockError>>;

    /// The locks held on the server now, by any session (`LockBackend::store_locks`); `known`
    /// names those whose resource is one of these keys'. The default answers `Unsupported`.
    fn store_locks<'a>(
        &'a self,
        known: &'a [&'a str],
    ) -> BoxFuture<'a, Result<Vec<StoreLock>, LockError>> {
        let _ = known;
        Box::pin(async {
            Err(LockError::unsupported(
                Self::NAME,
                "store inspection",
                "this backend cannot list the locks on its server",
            ))
        })
    }
}

/// One server connection whose session owns the locks it takes.
pub trait Session: Send + 'static {
    /// What the server locks.
    type Resource;
    /// A semaphore, as [`Connector::semaphore`] names it.
    type Semaphore;
    /// A permit this session holds: what [`release_permit`](Session::release_permit) gives
    /// back.
    type Permit: Send + Sync + Debug + 'static;
    /// A request that stops another session's statement from this one (see
    /// [`Session::interrupt`]); `Infallible` for drivers that stop statements themselves.
    type Interrupt: Send + 'static;

    /// Asks for `resource` in `mode`, waiting up to `wait` on the server (`Duration::ZERO`
    /// is one try): `Ok(Some(grant))` when granted, `Ok(None)` when it stayed held elsewhere.
    /// A statement that fails after the lock may have been taken gives it back before it
    /// answers. The engine never asks a session for a resource it holds already (in any
    /// mode): the claims and the lanes' shared holds see to that. `Mode::Shared` is asked
    /// only of an engine whose [`Connector::shared_locks`] answers `Ok`.
    fn lock<'a>(
        &'a mut self,
        resource: &'a Self::Resource,
        mode: Mode,
        wait: Duration,
    ) -> BoxFuture<'a, Result<Option<Grant>, Failure>>;

    /// Gives back `resource`, held in `mode`. A resource the session no longer holds is not
    /// an error.
    fn unlock<'a>(
        &'a mut self,
        resource: &'a Self::Resource,
        mode: Mode,
    ) -> BoxFuture<'a, Result<(), Failure>>;

    /// One try for a permit of `semaphore`, in one round trip whatever its count: the
    /// server checks the semaphore's count record, and, unless it names another count (or,
    /// for a single try, `waiting` false, the semaphore's queue lock is held by any session),
    /// takes the first free slot it finds from a random one on, skipping the slots this
    /// session holds already (a session may take its own lock again, and a lane is shared by
    /// every acquisition of the backend). At most one permit is taken. A try that fails after
    /// it may have taken a permit answers a failure that ends the session (the server then
    /// frees what it took), unless it gave the permit back.
    fn try_permit<'a>(
        &'a mut self,
        semaphore: &'a Self::Semaphore,
        waiting: bool,
    ) -> BoxFuture<'a, Result<PermitAnswer<Self::Permit>, Failure>>;

    /// Gives back `permit` (its slot, then its share of the count record). A permit the
    /// session no longer holds is not an error.
    fn release_permit<'a>(
        &'a mut self,
        permit: &'a Self::Permit,
    ) -> BoxFuture<'a, Result<(), Failure>>;

    /// How many permits of `semaphore` are live, by any session, and under which count, in
    /// one round trip.
    fn count_permits<'a>(
        &'a mut self,
        semaphore: &'a Self::Semaphore,
    ) -> BoxFuture<'a, Result<PermitCount, Failure>>;

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

pub(super) type InterruptOf<C> = <<C as Connector>::Session as Session>::Interrupt;

/// An engine of the session engine (PostgreSQL, MySQL, SQL Server, Oracle): the type parameter
/// of [`SessionBackend`](super::SessionBackend) and [`SessionBuilder`](super::SessionBuilder).
/// Sealed: the engines are the ones this crate has.
pub trait Engine: Driver {}

impl<T: Driver> Engine for T {}

/// An engine that issues fencing tokens: every engine (PostgreSQL, MySQL, SQL Server, Oracle),
/// opt-in through [`fencing`](super::SessionBuilder::fencing) or the URL's `fencing` option.
/// Kept for code that names it in bounds; [`Engine`] says as much.
pub trait Fencing: Engine {}

impl<T: Engine> Fencing for T {}

/// What an engine gives the session engine, beside its [`Connector`] and [`Session`]: where it
/// connects, how its URL reads, and how it opens its first session. Not nameable outside the
/// crate, which seals [`Engine`].
pub trait Driver: Sized + Send + Sync + 'static {
    /// The backend's type name in `Debug` output (`"PostgresBackend"`).
    const BACKEND: &'static str;
    /// The builder's type name in `Debug` output (`"PostgresBuilder"`).
    const BUILDER: &'static str;

    /// Where and as whom the engine connects (the driver's connect options).
    type Target: Clone + Send + Sync + 'static;
    /// Opens the backend's sessions.
    type Connector: Connector;

    /// Reads a URL of the engine's scheme into a target and options, which are not checked yet.
    fn parse_url(url: &str) -> Result<(Self::Target, SessionOptions), LockError>;

    /// Opens the first session (so a wrong address or password is reported at once), with
    /// whatever the engine sets up on it (the fencing table), and the connector for the rest.
    fn open(target: Self::Target, options: &SessionOptions) -> BoxFuture<'static, Opened<Self>>;

    /// Adds where `target` points to a `Debug` output; never a password.
    fn fmt_target(target: &Self::Target, f: &mut std::fmt::DebugStruct<'_, '_>);
}

/// Where and how an engine's connector connects: the engine's target, the bound of opening a
/// connection, and whether its sessions issue fencing tokens. Its `Debug` output shows where
/// the target points ([`Driver::fmt_target`]), never a password.
pub(crate) struct Dial<E: Driver> {
    pub(crate) target: E::Target,
    pub(crate) connect_timeout: Duration,
    pub(crate) fencing: bool,
}

impl<E: Driver> Dial<E> {
    /// The dial of a backend built with `options`.
    pub(crate) fn new(target: E::Target, options: &SessionOptions) -> Self {
        Dial {
            target,
            connect_timeout: options.connect_timeout,
            fencing: options.fencing,
        }
    }
}

impl<E: Driver> Debug for Dial<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut out = f.debug_struct("Dial");
        E::fmt_target(&self.target, &mut out);
        out.field("fencing", &self.fencing).finish_non_exhaustive()
    }
}

/// An engine's connector and first session, or why they could not be had.
pub(crate) type Opened<E> = Result<
    (
        <E as Driver>::Connector,
        <<E as Driver>::Connector as Connector>::Session,
    ),
    LockError,
>;
