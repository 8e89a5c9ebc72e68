//! A tower [`Layer`](tower_layer::Layer) for axum that takes a distributed lock before the
//! handler runs, and answers lock failures with RFC 9457 problem details.
//!
//! ```no_run
//! use std::time::Duration;
//! use axum::{Router, routing::{get, post}};
//! use dlock_axum::LockLayer;
//!
//! # async fn debit() -> &'static str { "ok" }
//! # async fn balance() -> &'static str { "0" }
//! # async fn demo() -> Result<(), dlock::LockError> {
//! let locks = dlock::LockProvider::connect("sqlite://locks.db").await?;
//! let app: Router = Router::new()
//!     // Two debits of one account never run at the same time, in any replica.
//!     .route("/accounts/{account_id}/debit", post(debit))
//!     .route_layer(LockLayer::new(locks.clone(), "account:{account_id}").timeout(Duration::from_secs(10)))
//!     // Routes added after `route_layer` are not locked.
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
//! | item | role |
//! |---|---|
//! | [`LockLayer`] | the layer and its options: timeout, waiter limit, key length limit, `Retry-After`, cancellation |
//! | [`LockService`], [`ResponseFuture`](future::ResponseFuture) | what it wraps around each route; the future owns the lock guard |
//! | [`MakeLockKey`], [`PathKey`], [`KeyFn`] | how a request becomes a key: a template over path parameters, or a closure |
//! | [`LockRejection`] | lock errors as `application/problem+json`, also for handlers that lock by hand |
//! | [`problem_instance`] | middleware that gives handler-returned lock problems their `instance` |
#![forbid(unsafe_code)]
#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]

pub mod future;
mod instance;
mod key;
mod layer;
mod rejection;
mod service;

pub use instance::problem_instance;
pub use key::{KeyFn, MakeLockKey, PathKey};
pub use layer::LockLayer;
pub use rejection::{LockRejection, PROBLEM_TYPE_PREFIX, ProblemCode, TOO_MANY_WAITERS_CODE};
pub use service::LockService;
