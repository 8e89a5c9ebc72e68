//! Distributed locks on the storage you already run.
//!
//! Services run as many replicas; billing runs, webhook handlers, ledger updates and cron jobs
//! must run on exactly one of them at a time. `dlock` puts mutual exclusion on a store the
//! replicas already share: a SQLite file (the embedded default, for the processes of **one
//! machine only**), PostgreSQL, MySQL/MariaDB, SQL Server, Oracle, Redis/Valkey and etcd.
//! Across hosts, lock on a store they all reach; where exclusion must survive the loss of a
//! machine, on an etcd cluster.
//!
//! The crate is `dlock-rs` (`cargo add dlock-rs`); its library is `dlock`. For axum services,
//! [`dlock-axum`](https://docs.rs/dlock-axum) takes the lock before a handler runs and answers
//! contention with RFC 9457 problem details.
//!
//! ```
//! use std::time::Duration;
//! use dlock::{LockError, LockProvider};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), LockError> {
//! # let dir = tempfile::tempdir().unwrap();
//! # let url = format!("sqlite://{}/locks.db", dir.path().display());
//! let locks = LockProvider::connect(&url).await?; // e.g. "sqlite://locks.db"
//!
//! // One attempt, no waiting: contention is `Err(LockError::AlreadyHeld { .. })`.
//! match locks.try_acquire("jobs:billing").await {
//!     Ok(guard) => {
//!         // ... run the job; stop if `guard.lost_token()` fires ...
//!         guard.release().await?;
//!     }
//!     Err(LockError::AlreadyHeld { .. }) => { /* another replica runs it */ }
//!     Err(other) => return Err(other),
//! }
//!
//! // Wait up to ten seconds.
//! let guard = locks.acquire("invoices:42", Duration::from_secs(10)).await?;
//! println!("fencing token {:?}", guard.fencing_token());
//! drop(guard); // releases in the background
//! # Ok(()) }
//! ```
//!
//! # Concepts
//!
//! - [`LockProvider`] hands out locks on one store; clone it freely. It keeps an in-process
//!   table of the keys it holds, so contention inside one process costs no I/O, and local
//!   waiters queue instead of polling the store.
//! - [`LockGuard`] is a held lock: its [`key`](LockGuard::key), a
//!   [`fencing_token`](LockGuard::fencing_token), and a
//!   [`lost_token`](LockGuard::lost_token) that fires if ownership is lost. Dropping it releases
//!   the lock (in the background); [`release`](LockGuard::release) waits for it.
//! - [`LockError`] says what went wrong, with a stable [`code`](LockError::code) and an HTTP
//!   [`status`](LockError::status).
//! - Keys are any non-empty strings. [`lock_id`] is the 64-bit id that integer-keyed engines
//!   lock.
//!
//! # Features
//!
//! | cargo feature | what it adds |
//! |---|---|
//! | `sqlite` (default) | the `sqlite://` backend (`dlock::sqlite`), SQLite bundled |
//! | `macros` (default) | the [`distributed_lock`] attribute |
//! | `postgres` | `postgres://` (`dlock::postgres`), with transaction-bound locks |
//! | `mysql` | `mysql://` and `mariadb://` (`dlock::mysql`) |
//! | `mssql` | `mssql://` and `sqlserver://` (`dlock::mssql`) |
//! | `oracle` | `oracle://` (`dlock::oracle`; the Oracle client library at run time) |
//! | `redis` | `redis://`, `rediss://`, `redis+sentinel://`, `redis+cluster://`, `redlock://` (`dlock::redis`) |
//! | `etcd` | `etcd://` (`dlock::etcd`; `protoc` to build) |
//! | `full` | all of the above |
//!
//! # Backends
//!
//! The same table as the README's (a test keeps the two the same); each backend's module
//! gives its URL options.
//!
#![doc = include_str!("backends.md")]
//!
//! SQLite, PostgreSQL, MariaDB, MySQL, Redis, Valkey and etcd are verified against real
//! servers in CI; SQL Server and Oracle are not (their servers cannot run there): their statements,
//! parameters and return-code mappings are pinned by unit tests, and their conformance suites
//! run when `DLOCK_MSSQL_URL` / `DLOCK_ORACLE_URL` are set.
//!
//! # Cancellation
//!
//! Every future of this crate is cancel safe as far as locks go: dropping an acquisition never
//! leaves a lock held, and dropping a release finishes it in the background. To end a wait on a
//! signal and get [`LockError::Canceled`], pass a token:
//! [`locks.lock(key).cancel_on(&token)`](LockProvider::lock), or one for the whole provider
//! with [`ProviderBuilder::cancel_on`].
//!
//! # Fencing tokens: what every holder of a key must share
//!
//! A key's tokens increase strictly as long as every process that locks it counts them in the
//! same place. These are refused when they would break that: going back from
//! `fencing_counters=N` to per-key counters (SQLite, PostgreSQL and Redis refuse it), a
//! backend whose `N` another process switched away (it refuses its fenced acquisitions). These
//! are the caller's to keep the same, as each backend's docs say: the database in a MySQL URL,
//! the schema the fencing table is found in (PostgreSQL `search_path`, SQL Server default
//! schema, Oracle user), the key layout of a Redis lock whose plain name is a hash tag, and
//! plain Redis prefixes that extend one another. SQLite's `-fencing` file follows the lock
//! file through symbolic links. etcd's tokens are the cluster's revisions, which no setting
//! moves back.
//!
//! # Pauses: which checks read the clock
//!
//! A process can stop for longer than its lease: `SIGSTOP`, a suspended machine, a thread that
//! did not run. Another process may then hold its locks, and the first step of its work after
//! the pause must not run as if it still held them. On the lease backends (SQLite, Redis,
//! Redlock, etcd) these checks read the clock, and answer "lost" from the lease's local
//! deadline on, whatever task has run since:
//!
//! - [`LockGuard::is_lost`], and a [`LostSignal`] from [`LockGuard::lost_signal`] (its
//!   [`is_lost`](LostSignal::is_lost) and [`lost`](LostSignal::lost)): cheap to clone, for the
//!   tasks the work spawns;
//! - [`LeaderTerm::has_ended`] and [`LeaderTerm::ended`];
//! - `dlock_axum::HeldLock::is_lost` in handlers.
//!
//! A bare [`CancellationToken`] ([`LockGuard::lost_token`], [`LeaderTerm::token`], the token
//! [`with_lock`](LockProvider::with_lock) and [`run_exclusive`](LockProvider::run_exclusive)
//! hand their closures, `HeldLock::lost_token`) is cancelled by a task, and **may lag** after
//! a pause, except where dlock drives the work's future itself: `with_lock` (and the builder's),
//! `run_exclusive`, [`Leader::run`], the axum layer and `#[distributed_lock]` check the clock
//! before each poll of the work and cancel the token first, so the work's own next step sees
//! it cancelled (and `on_lost = cancel` stops the body before it). Two limits remain, both
//! covered by the checks that read the clock: a pause that falls *inside* a poll of the work
//! (after that check, before the step) is seen by the token only at the work's next poll; and
//! a task the work spawns is not polled by dlock: give it a [`LostSignal`] or a [`LeaderTerm`].
//! So check [`is_lost`](LostSignal::is_lost) right before a step that must not run without
//! the lock.
//!
//! The session engines (PostgreSQL, MySQL/MariaDB, SQL Server, Oracle) keep their locks
//! through a pause: the server keeps the stopped process's session, so nobody else gets the
//! lock meanwhile, and a session that ended is reported when the keepalive runs again.
#![forbid(unsafe_code)]
#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]
#![cfg_attr(docsrs, feature(doc_cfg))]
// The docs link to every backend's module; a build without some backends keeps the link text
// (the links are checked with every feature on).
#![cfg_attr(not(feature = "full"), allow(rustdoc::broken_intra_doc_links))]

pub mod backend;
mod backoff;
// Used by the backends that have the option; with none of them built, only the public hash.
#[cfg_attr(not(any(feature = "postgres", feature = "redis")), allow(dead_code))]
mod counters;
mod detach;
mod error;
mod guard;
mod inspect;
mod jobs;
mod key;
pub mod key_template;
mod leader;
mod lease;
mod lost;
mod many;
pub mod metrics;
#[cfg(feature = "mysql")]
pub mod mysql;
mod options;
mod owner;
mod provider;
mod reentry;
mod semaphore;
#[cfg(any(
    feature = "mssql",
    feature = "oracle",
    feature = "postgres",
    feature = "mysql"
))]
pub mod session;
#[cfg(feature = "redis")]
mod settling;
#[cfg(any(feature = "postgres", feature = "mysql"))]
mod sqlx_engine;
mod table;
#[cfg(test)]
mod testing;
mod time;
#[cfg(any(feature = "postgres", feature = "mysql", feature = "redis"))]
mod tls;
mod transaction;

#[cfg(feature = "etcd")]
pub mod etcd;
#[cfg(feature = "mssql")]
pub mod mssql;
#[cfg(feature = "oracle")]
pub mod oracle;
#[cfg(feature = "postgres")]
pub mod postgres;
#[cfg(feature = "redis")]
pub mod redis;
#[cfg(feature = "sqlite")]
pub mod sqlite;

#[doc(hidden)]
#[path = "macro_support.rs"]
pub mod __private;

pub use backend::{ReleaseOutcome, StoreLock};
pub use backoff::Backoff;
pub use counters::fencing_counter;
pub use error::{BoxError, LockError};
pub use guard::LockGuard;
pub use inspect::LockInfo;
pub use key::lock_id;
pub use leader::{Leader, LeaderTerm};
pub use lost::LostSignal;
pub use options::parse_duration;
pub use provider::{LockBuilder, LockProvider, LockedCommand, ProviderBuilder, SUPPORTED_SCHEMES};
pub use reentry::run_holding;
pub use tokio_util::sync::CancellationToken;
pub use transaction::TransactionLock;

#[cfg(feature = "macros")]
pub use dlock_macros::distributed_lock;
