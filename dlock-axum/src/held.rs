//! The held lock, as handlers behind the layer see it.

use std::fmt;
use std::sync::Arc;

use axum::extract::{FromRequestParts, OptionalFromRequestParts};
use axum::response::{IntoResponse, Response};
use dlock::{CancellationToken, LockGuard, LostSignal};
use http::request::Parts;
use http::{StatusCode, Uri};
use problem_details::ProblemDetails;

use crate::rejection::{PROBLEM_TYPE_PREFIX, ProblemCode};

/// The `code` of the answer given when a handler asks for a [`HeldLock`] that no
/// [`LockLayer`](crate::LockLayer) took.
pub const NO_LOCK_LAYER_CODE: &str = "DistributedLock.NoLockLayer";

/// The lock that [`LockLayer`](crate::LockLayer) took for this request: an axum extractor for
/// the handlers behind the layer.
///
/// It gives the handler what it needs to act on the lock, without the guard itself (which
/// stays with the layer, so the lock is released exactly when the response is produced):
/// the [`key`](HeldLock::key), the [`fencing_token`](HeldLock::fencing_token) to pass to the
/// store the handler writes to, so that the store can refuse the writes of a holder that
/// has since lost the lock, and the [`lost_token`](HeldLock::lost_token) to stop when the
/// lock is lost.
///
/// ```
/// use axum::{Router, extract::Path, routing::post};
/// use dlock_axum::{HeldLock, LockLayer};
///
/// async fn debit(Path(id): Path<u64>, lock: HeldLock) -> String {
///     // `lock.key()` is "account:42" for `/accounts/42/debit`.
///     // Write with the fencing token: the store refuses tokens lower than one it has seen.
///     format!("debit {id} under {} with token {:?}", lock.key(), lock.fencing_token())
/// }
///
/// # fn demo(locks: dlock::LockProvider) {
/// let app: Router = Router::new()
///     .route("/accounts/{id}/debit", post(debit))
///     .route_layer(LockLayer::with_extractor(locks, |Path(id): Path<u64>| format!("account:{id}")));
/// # let _ = app; }
/// ```
///
/// # When the lock is lost
///
/// What happens to the handler depends on the layer's [`on_lost`](crate::LockLayer::on_lost):
/// with [`OnLost::Cancel`](crate::OnLost::Cancel) (the default) the handler is dropped as soon
/// as the loss is known, and the client gets the `Lost` problem (500); with
/// [`OnLost::Continue`](crate::OnLost::Continue) the handler runs on and decides for itself,
/// reading [`is_lost`](HeldLock::is_lost) or awaiting `lost_token().cancelled()`.
///
/// # Without a layer
///
/// On a route the layer does not wrap, extracting `HeldLock` fails with
/// [`NoLockLayer`], a 500 `application/problem+json` answer (the route is misconfigured).
/// Take `Option<HeldLock>` where a route may run without a lock (a
/// [`with_key_fn`](crate::LockLayer::with_key_fn) closure that answered `None`).
///
/// Values cloned out of the handler (into a spawned task) describe the lock as it was while
/// the handler ran: once the response is produced the lock is released, and the lost token
/// does not fire for an ordinary release.
#[derive(Clone)]
pub struct HeldLock {
    /// Every lock of the request, in the order they were taken (one, unless the layer was
    /// made with `with_extractor_many`), with the check of each that reads the clock.
    locks: Arc<[Held]>,
    lost: CancellationToken,
}

/// One lock of a request: its key, fencing token, and the check of it that reads the clock.
type Held = (Arc<str>, Option<u64>, LostSignal);

impl HeldLock {
    /// The locks of `guards` (at least one), lost when `lost` is cancelled.
    pub(crate) fn new(guards: &[LockGuard], lost: CancellationToken) -> Self {
        HeldLock {
            locks: guards
                .iter()
                .map(|guard| {
                    (
                        Arc::from(guard.key()),
                        guard.fencing_token(),
                        guard.lost_signal(),
                    )
                })
                .collect(),
            lost,
        }
    }

    /// Every key the layer took for this request, in the order they were taken (their
    /// canonical order): one, unless the layer was made with
    /// [`with_extractor_many`](crate::LockLayer::with_extractor_many).
    pub fn keys(&self) -> impl ExactSizeIterator<Item = &str> + '_ {
        self.locks.iter().map(|(key, ..)| &**key)
    }

    /// The fencing token of each lock, in the order of [`keys`](HeldLock::keys).
    pub fn fencing_tokens(&self) -> impl ExactSizeIterator<Item = Option<u64>> + '_ {
        self.locks.iter().map(|(_, token, _)| *token)
    }

    /// The key of the lock, as the layer made it from the request (with several keys, the
    /// first of [`keys`](HeldLock::keys)).
    pub fn key(&self) -> &str {
        &self.locks[0].0
    }

    /// The lock's fencing token: strictly greater than the token of every earlier holder of
    /// the key, `None` when the backend issues none (see
    /// [`LockGuard::fencing_token`](dlock::LockGuard::fencing_token)). With several keys, the
    /// first key's; see [`fencing_tokens`](HeldLock::fencing_tokens).
    pub fn fencing_token(&self) -> Option<u64> {
        self.locks[0].1
    }

    /// The token cancelled when ownership of the lock is lost (see
    /// [`LockGuard::lost_token`](dlock::LockGuard::lost_token)); with several keys, when
    /// ownership of any of them is.
    pub fn lost_token(&self) -> &CancellationToken {
        &self.lost
    }

    /// Whether the lock (with several keys, any of them) is known to be lost.
    ///
    /// It reads the clock: for a leased lock it is `true` once the lease's local deadline has
    /// passed, as [`LockGuard::is_lost`](dlock::LockGuard::is_lost) is (and then cancels the
    /// [`lost_token`](HeldLock::lost_token)). So a handler paused past its lease, or a task it
    /// spawned with a clone of this value, sees `true` at its first step after the pause. The
    /// layer also checks before each poll of the handler, so the handler's own future finds
    /// the lost token cancelled too; a spawned task's `lost_token()` may lag (a task of the
    /// backend cancels it). Session locks keep their lock through a pause of the process.
    pub fn is_lost(&self) -> bool {
        if self.lost.is_cancelled() {
            return true;
        }
        if self.locks.iter().any(|(.., signal)| signal.is_lost()) {
            self.lost.cancel();
            return true;
        }
        false
    }
}

impl fmt::Debug for HeldLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let locks: Vec<_> = self
            .locks
            .iter()
            .map(|(key, token, _)| (key, token))
            .collect();
        f.debug_struct("HeldLock")
            .field("locks", &locks)
            .field("lost", &self.lost.is_cancelled())
            .finish()
    }
}

impl<S: Send + Sync> FromRequestParts<S> for HeldLock {
    type Rejection = NoLockLayer;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        parts
            .extensions
            .get::<HeldLock>()
            .cloned()
            .ok_or_else(|| NoLockLayer {
                instance: parts.uri.path().to_owned(),
            })
    }
}

impl<S: Send + Sync> OptionalFromRequestParts<S> for HeldLock {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(
        parts: &mut Parts,
        _state: &S,
    ) -> Result<Option<Self>, Self::Rejection> {
        Ok(parts.extensions.get::<HeldLock>().cloned())
    }
}

/// The rejection of [`HeldLock`] on a route that no [`LockLayer`](crate::LockLayer) wraps:
/// a server misconfiguration, answered with 500 `application/problem+json` (code
/// [`NO_LOCK_LAYER_CODE`]) and logged at `error` level. The body does not describe the
/// server's routes.
#[derive(Debug, Clone)]
pub struct NoLockLayer {
    instance: String,
}

impl NoLockLayer {
    /// The problem details of the answer.
    pub fn to_problem(&self) -> ProblemDetails<ProblemCode> {
        let type_uri = Uri::try_from(format!("{PROBLEM_TYPE_PREFIX}no-lock-layer"))
            .unwrap_or_else(|_| Uri::from_static("about:blank"));
        let mut problem = ProblemDetails::new()
            .with_type(type_uri)
            .with_status(StatusCode::INTERNAL_SERVER_ERROR)
            .with_title("Lock Configuration Error")
            .with_detail("The server's distributed locking is misconfigured.");
        if let Ok(instance) = Uri::try_from(self.instance.as_str()) {
            problem = problem.with_instance(instance);
        }
        problem.with_extensions(ProblemCode {
            code: NO_LOCK_LAYER_CODE,
        })
    }
}

impl fmt::Display for NoLockLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the handler of {} takes a HeldLock, but no LockLayer wraps its route (add the \
             layer with `route_layer`, or take `Option<HeldLock>`)",
            self.instance
        )
    }
}

impl std::error::Error for NoLockLayer {}

impl IntoResponse for NoLockLayer {
    fn into_response(self) -> Response {
        tracing::error!(instance = %self.instance, "{self}");
        self.to_problem().into_response()
    }
}
