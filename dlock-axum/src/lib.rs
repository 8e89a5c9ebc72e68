//! A tower [`Layer`](tower_layer::Layer) for axum that takes a distributed lock before the
//! handler runs, and answers lock failures with RFC 9457 problem details.
//!
//! ```no_run
//! use std::time::Duration;
//! use axum::{Router, extract::Path, routing::{get, post}};
//! use dlock_axum::LockLayer;
//!
//! async fn debit(Path(account_id): Path<u64>) -> String { format!("debited {account_id}") }
//! # async fn balance() -> &'static str { "0" }
//! # async fn demo() -> Result<(), dlock::LockError> {
//! let locks = dlock::LockProvider::connect("sqlite://locks.db").await?;
//! let app: Router = Router::new()
//!     // Two debits of one account never run at the same time, in any replica. The key is
//!     // made from the `Path<u64>` the handler gets, so `/accounts/42/debit` and
//!     // `/accounts/042/debit` (account 42 both) lock the same "account:42".
//!     .route("/accounts/{account_id}/debit", post(debit))
//!     .route_layer(
//!         LockLayer::with_extractor(locks.clone(), |Path(id): Path<u64>| format!("account:{id}"))
//!             .timeout(Duration::from_secs(10)),
//!     )
//!     // `route_layer` wraps the routes added before it; routes added after it are not locked.
//!     .route("/accounts/{account_id}", get(balance));
//! # Ok(()) }
//! ```
//!
//! A request whose lock is held elsewhere gets (with one try, the default):
//!
//! ```text
//! HTTP/1.1 409 Conflict
//! content-type: application/problem+json
//! retry-after: 1
//!
//! {"type":"/problems/distributed-lock/already-held","status":409,"title":"Lock Already Held",
//!  "detail":"Another request holds the lock this request needs; retry later.",
//!  "instance":"/accounts/42/debit","code":"DistributedLock.AlreadyHeld"}
//! ```
//!
//! # Which key: extractor or template
//!
//! A lock protects what the handler acts on, so its key must come from the same value.
//! [`LockLayer::with_extractor`] makes the key from an axum extractor, normally the one the
//! handler takes, and is the way for typed parameters. [`LockLayer::new`] takes a key template
//! such as `"account:{account_id}"`, which locks the **text** of the path parameter
//! (percent-decoded): that is the handler's value when the handler takes a `String`, but for
//! a `Path<u64>` handler `/accounts/42`, `/accounts/042` and `/accounts/+42` are one account
//! locked under three keys, and requests spelling it differently run at the same time. The
//! same goes for `#[distributed_lock]`: it formats the handler's parsed value, so on a typed
//! parameter it agrees with a template only for the canonical spelling, and with
//! `with_extractor` always (encode strings with
//! [`encode_component`](dlock::key_template::encode_component), as the macro does).
//!
//! | handler parameter | key strategy | same key as `#[distributed_lock("account:{id}")]` on the handler |
//! |---|---|---|
//! | `Path<u64>` (or any type parsed from the path) | `with_extractor(.., \|Path(id): Path<u64>\| format!("account:{id}"))` | yes |
//! | `Path<u64>` | `new(.., "account:{id}")` | only for canonical spellings: `/accounts/042` locks `account:042`, the macro `account:42` |
//! | `Path<String>` | `new(.., "account:{id}")`, or `with_extractor` with `encode_component` | yes (both see the decoded text and encode it) |
//!
//! | item | role |
//! |---|---|
//! | [`LockLayer`] | the layer and its options: timeout, waiter limit, key length limit, `Retry-After`, cancellation, [`OnLost`] |
//! | [`HeldLock`], [`NoLockLayer`] | the extractor that gives the handler the lock's key, fencing token and lost token; its rejection on a route without the layer |
//! | [`LockService`], [`ResponseFuture`](future::ResponseFuture) | what it wraps around each route; the future owns the lock guard |
//! | [`MakeLockKey`], [`ExtractorKey`], [`PathKey`], [`KeyFn`], [`KeyRejection`] | how a request becomes a key: an extractor and a closure, a template over the path's text, or a closure over the request head |
//! | [`MakeLockKeys`], [`ExtractorKeys`] | several keys for a request, taken all or none |
//! | [`LockRejection`] | lock errors as `application/problem+json`, also for handlers that lock by hand or with `#[distributed_lock]` |
//! | [`problem_instance`] | middleware that gives handler-returned lock problems their `instance` |
//! | [`Problem`] | any extractor, its rejections answered as problem details (for the layer's key extractor and the handler's own) |
//! | [`LockedRouter`] | `router.locked_route(path, handler, layer)`: a route and its lock, the key checked against the route when the router is built |
//!
//! # Mistakes, answered loudly
//!
//! - **Install a `tracing` subscriber.** A mistake in the server's set-up (the layer added
//!   with `Router::layer` instead of `Router::route_layer`, a template placeholder its route
//!   lacks, a [`HeldLock`] on a route without the layer) is answered with a generic 500
//!   problem, and explained, with the fix, only in the log.
//! - **Locks are not reentrant.** A handler behind the layer that takes its own key again (a
//!   `#[distributed_lock]` function on the same key) is answered at once with a 500 problem
//!   "already held by this request (locks are not reentrant)" (code
//!   `DistributedLock.Reentrant`), not after its timeout.
//! - **Templates against routes.** [`LockedRouter::locked_route`] refuses, when the router is
//!   built, a template whose placeholder names no parameter of the route.
#![forbid(unsafe_code)]
#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]

pub mod future;
mod held;
mod instance;
mod key;
mod layer;
mod problem;
mod rejection;
mod router;
mod service;

pub use held::{HeldLock, NO_LOCK_LAYER_CODE, NoLockLayer};
pub use instance::problem_instance;
pub use key::{
    ExtractorKey, ExtractorKeys, KeyFn, KeyRejection, MakeLockKey, MakeLockKeys, PathKey,
};
pub use layer::{LockLayer, OnLost};
pub use problem::Problem;
pub use rejection::{LockRejection, PROBLEM_TYPE_PREFIX, ProblemCode, TOO_MANY_WAITERS_CODE};
pub use router::LockedRouter;
pub use service::LockService;

/// The workspace README's Rust snippets, compiled as doctests here: this crate's tests have
/// every dependency they use (dlock with SQLite and the macro, axum, tokio, tracing-subscriber).
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
struct ReadmeDoctests;

/// The pages of `docs/`, for any Rust snippet they hold (today: shell, SQL and text only).
#[cfg(doctest)]
#[doc = include_str!("../../docs/backends.md")]
#[doc = include_str!("../../docs/production.md")]
#[doc = include_str!("../../docs/observability.md")]
#[doc = include_str!("../../docs/benchmarks.md")]
struct DocsDoctests;
