//! Locked routes checked when the router is built.

use std::convert::Infallible;

use axum::Router;
use axum::routing::MethodRouter;

use crate::key::MakeLockKeys;
use crate::layer::LockLayer;

/// Adds routes with their lock to an axum [`Router`], checking the lock's key against the
/// route when the router is built.
///
/// `router.locked_route(path, method_router, layer)` is
/// `router.route(path, method_router.route_layer(layer))`, after asking the layer's key
/// strategy whether it can make keys on `path` ([`MakeLockKeys::check_route`]): a template
/// whose placeholder names no parameter of the route panics here, at start-up, as
/// [`Router::route`] does with a malformed path, instead of answering every request with a
/// 500 problem that only a `tracing` subscriber would explain. The layer wraps exactly this
/// route, so the `Router::layer` mistake cannot happen either.
///
/// ```
/// use axum::{Router, routing::post};
/// use dlock_axum::{LockLayer, LockedRouter};
///
/// async fn debit() -> &'static str { "debited" }
///
/// # fn demo(locks: dlock::LockProvider) {
/// let app: Router = Router::new().locked_route(
///     "/accounts/{account_id}/debit",
///     post(debit),
///     LockLayer::new(locks, "account:{account_id}"),
/// );
/// # let _ = app; }
/// ```
///
/// ```should_panic
/// # use axum::{Router, routing::post};
/// # use dlock_axum::{LockLayer, LockedRouter};
/// # async fn debit() -> &'static str { "debited" }
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// # let dir = tempfile::tempdir().unwrap();
/// # let locks = dlock::LockProvider::connect(&format!("sqlite://{}/l.db", dir.path().display())).await.unwrap();
/// // Panics: the route names its parameter `id`, the template `account_id`.
/// let app: Router = Router::new().locked_route(
///     "/accounts/{id}/debit",
///     post(debit),
///     LockLayer::new(locks, "account:{account_id}"),
/// );
/// # }
/// ```
pub trait LockedRouter<S>: Sized {
    /// Adds `method_router` at `path`, behind `layer`; see [`LockedRouter`].
    ///
    /// # Panics
    ///
    /// If the layer's key strategy cannot make keys on `path` (see
    /// [`MakeLockKeys::check_route`]), or where [`Router::route`] panics.
    #[track_caller]
    fn locked_route<K: MakeLockKeys>(
        self,
        path: &str,
        method_router: MethodRouter<S>,
        layer: LockLayer<K>,
    ) -> Self;
}

impl<S> LockedRouter<S> for Router<S>
where
    S: Clone + Send + Sync + 'static,
{
    #[track_caller]
    fn locked_route<K: MakeLockKeys>(
        self,
        path: &str,
        method_router: MethodRouter<S>,
        layer: LockLayer<K>,
    ) -> Self {
        if let Err(err) = layer.shared.make_key.check_route(path) {
            panic!("{err}");
        }
        let method_router: MethodRouter<S, Infallible> = method_router.route_layer(layer);
        self.route(path, method_router)
    }
}
