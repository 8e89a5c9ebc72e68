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

mod acquire;
mod claims;
mod lane;
mod options;
mod traits;
mod wait;

#[cfg(test)]
mod model;

pub(crate) use acquire::Lanes;
#[cfg_attr(
    not(any(feature = "postgres", feature = "mysql")),
    allow(unused_imports)
)]
pub(crate) use claims::SETTLE_LIMIT;
#[cfg_attr(
    not(any(feature = "postgres", feature = "mysql")),
    allow(unused_imports)
)]
pub(crate) use options::LaneOptions;
#[cfg_attr(not(any(feature = "mssql", feature = "oracle")), allow(unused_imports))]
pub(crate) use options::{LaneSettings, check_connect_timeout};
pub(crate) use traits::{Connector, Failure, Grant, Session};

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
