//! The layer: configuration shared by the services it makes.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use dlock::key_template::{KeyTemplate, TemplateError};
use dlock::{CancellationToken, LockProvider};
use http::request::Parts;
use tokio::sync::Semaphore;
use tower_layer::Layer;

use crate::key::{KeyFn, MakeLockKey, PathKey};
use crate::rejection::LockRejection;
use crate::service::LockService;

/// A tower [`Layer`] that takes a distributed lock before the handler runs and holds it until
/// the handler's response is produced.
///
/// Add it with [`Router::route_layer`](axum::Router::route_layer), so that it runs after
/// routing, for matched routes only, and sees the route's path parameters. (Under
/// [`Router::layer`](axum::Router::layer) it also sees requests that match no route; a key
/// template cannot be rendered for those, and they are answered with a 500 configuration
/// problem rather than let through unlocked.)
///
/// ```no_run
/// use std::time::Duration;
/// use axum::{Router, routing::post};
/// use dlock_axum::LockLayer;
///
/// # async fn debit() -> &'static str { "ok" }
/// # async fn demo() -> Result<(), dlock::LockError> {
/// let locks = dlock::LockProvider::connect("sqlite://locks.db").await?;
/// let app: Router = Router::new()
///     .route("/accounts/{account_id}/debit", post(debit))
///     .route_layer(
///         LockLayer::new(locks.clone(), "account:{account_id}")
///             .timeout(Duration::from_secs(10))
///             .max_waiting(256),
///     );
/// # Ok(()) }
/// ```
///
/// For each request the layer
///
/// 1. makes the key: by default from the key template, whose placeholders name path parameters
///    (values encoded as [`encode_component`](dlock::key_template::encode_component) does, as
///    the `#[distributed_lock]` macro does); with [`with_key_fn`](LockLayer::with_key_fn) from
///    a closure over the request's [`Parts`], where `None` means "no lock, just run the
///    handler". Keys longer than [`max_key_len`](LockLayer::max_key_len) are answered with 400;
/// 2. takes the lock, waiting up to [`timeout`](LockLayer::timeout) (zero, the default: one try);
/// 3. runs the handler while holding it. If the lock is lost meanwhile, the handler's future is
///    dropped and the client gets the `Lost` problem (500);
/// 4. releases the lock once the response is produced, before it is returned. If the response
///    future is dropped instead (the client disconnected), the lock is released in the
///    background at once.
///
/// The inner service is **not called** when no lock is taken: contention, timeouts, an
/// unreachable store, a bad key and the waiter limit are answered by the layer itself as
/// problem details (see [`LockRejection`]). The service's error type stays the inner one's.
///
/// The lock covers producing the response, not streaming its body.
#[must_use]
pub struct LockLayer<K = PathKey> {
    pub(crate) shared: Shared<K>,
}

pub(crate) struct Shared<K> {
    pub(crate) provider: LockProvider,
    pub(crate) make_key: Arc<K>,
    pub(crate) timeout: Duration,
    pub(crate) waiters: Option<Arc<Semaphore>>,
    pub(crate) max_waiting: Option<usize>,
    pub(crate) max_key_len: usize,
    pub(crate) retry_after: Duration,
    pub(crate) cancel: Option<CancellationToken>,
}

impl LockLayer<PathKey> {
    /// A layer locking the key `template` renders from the route's path parameters, such as
    /// `"account:{account_id}"` (see [`dlock::key_template`] for the syntax).
    ///
    /// # Panics
    ///
    /// If `template` does not parse (an unclosed `{`, a stray `}`, an empty name). Like
    /// [`Router::route`](axum::Router::route) with a bad path, this is a programming mistake
    /// found at start-up; use [`try_new`](LockLayer::try_new) for templates that come from
    /// configuration.
    #[track_caller]
    pub fn new(provider: LockProvider, template: &str) -> Self {
        match Self::try_new(provider, template) {
            Ok(layer) => layer,
            Err(err) => panic!("invalid lock key template {template:?}: {err}"),
        }
    }

    /// As [`new`](LockLayer::new), returning the template's error instead of panicking.
    pub fn try_new(provider: LockProvider, template: &str) -> Result<Self, TemplateError> {
        let template = KeyTemplate::parse(template)?;
        Ok(Self::with_make_key(provider, PathKey::new(template)))
    }
}

impl<F> LockLayer<KeyFn<F>>
where
    F: Fn(&Parts) -> Option<String> + Send + Sync + 'static,
{
    /// A layer locking the key `key_fn` makes from the request (headers, query, extensions,
    /// anything); `None` runs the handler without a lock.
    ///
    /// ```
    /// # fn demo(locks: dlock::LockProvider) {
    /// use dlock::key_template::encode_component;
    /// let layer = dlock_axum::LockLayer::with_key_fn(locks, |parts: &http::request::Parts| {
    ///     let tenant = parts.headers.get("x-tenant")?.to_str().ok()?;
    ///     Some(format!("tenant:{}", encode_component(tenant)))
    /// });
    /// # let _ = layer; }
    /// ```
    pub fn with_key_fn(provider: LockProvider, key_fn: F) -> Self {
        Self::with_make_key(provider, KeyFn(key_fn))
    }
}

impl<K: MakeLockKey> LockLayer<K> {
    /// The default longest key, in bytes: 1024.
    pub const DEFAULT_MAX_KEY_LEN: usize = 1024;

    /// A layer with its own key strategy.
    pub fn with_make_key(provider: LockProvider, make_key: K) -> Self {
        LockLayer {
            shared: Shared {
                provider,
                make_key: Arc::new(make_key),
                timeout: Duration::ZERO,
                waiters: None,
                max_waiting: None,
                max_key_len: Self::DEFAULT_MAX_KEY_LEN,
                retry_after: LockRejection::DEFAULT_RETRY_AFTER,
                cancel: None,
            },
        }
    }

    fn update(mut self, f: impl FnOnce(&mut Shared<K>)) -> Self {
        f(&mut self.shared);
        self
    }

    /// How long a request waits for the lock before it is answered with 408. Zero (the
    /// default) is one try: contention is answered with 409 at once.
    pub fn timeout(self, timeout: Duration) -> Self {
        self.update(|s| s.timeout = timeout)
    }

    /// At most `n` requests of this layer (over all the routes it is on) wait for a lock at a
    /// time. A request beyond that gets one try, and if the lock is held it is answered with
    /// 503 and `Retry-After` instead of joining the queue. Without a limit (the default) every
    /// request waits up to the timeout.
    pub fn max_waiting(self, n: usize) -> Self {
        self.update(|s| {
            s.max_waiting = Some(n);
            s.waiters = Some(Arc::new(Semaphore::new(n.min(Semaphore::MAX_PERMITS))));
        })
    }

    /// The longest key, in bytes, the layer will lock; longer ones (a 10 KB path parameter, a
    /// huge header) are answered with 400 before the store is asked. Default 1024.
    pub fn max_key_len(self, max: usize) -> Self {
        self.update(|s| s.max_key_len = max)
    }

    /// The `Retry-After` sent with 409, 408 and 503 answers (whole seconds, rounded up, at
    /// least 1). Default one second.
    pub fn retry_after(self, retry_after: Duration) -> Self {
        self.update(|s| s.retry_after = retry_after)
    }

    /// Ends pending waits with 499 (`Canceled`) once `token` is cancelled, for graceful
    /// shutdown. (A provider made with a shutdown token does the same for every acquisition.)
    pub fn cancel_on(self, token: &CancellationToken) -> Self {
        let token = token.clone();
        self.update(|s| s.cancel = Some(token))
    }

    /// How many requests wait for a lock right now, when [`max_waiting`](Self::max_waiting)
    /// is set (otherwise 0).
    pub fn waiting(&self) -> usize {
        match (&self.shared.waiters, self.shared.max_waiting) {
            (Some(sem), Some(max)) => max
                .min(Semaphore::MAX_PERMITS)
                .saturating_sub(sem.available_permits()),
            _ => 0,
        }
    }

    /// The provider locks are taken from.
    pub fn provider(&self) -> &LockProvider {
        &self.shared.provider
    }
}

impl<K> Clone for Shared<K> {
    fn clone(&self) -> Self {
        Shared {
            provider: self.provider.clone(),
            make_key: Arc::clone(&self.make_key),
            timeout: self.timeout,
            waiters: self.waiters.clone(),
            max_waiting: self.max_waiting,
            max_key_len: self.max_key_len,
            retry_after: self.retry_after,
            cancel: self.cancel.clone(),
        }
    }
}

/// Clones share the waiter limit: requests through any of them count against one limit.
impl<K> Clone for LockLayer<K> {
    fn clone(&self) -> Self {
        LockLayer {
            shared: self.shared.clone(),
        }
    }
}

impl<K: fmt::Debug> fmt::Debug for LockLayer<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.shared.fmt_fields(f.debug_struct("LockLayer"))
    }
}

impl<K: fmt::Debug> Shared<K> {
    pub(crate) fn fmt_fields(&self, mut s: fmt::DebugStruct<'_, '_>) -> fmt::Result {
        s.field("provider", &self.provider)
            .field("make_key", &self.make_key)
            .field("timeout", &self.timeout)
            .field("max_waiting", &self.max_waiting)
            .field("max_key_len", &self.max_key_len)
            .field("retry_after", &self.retry_after)
            .field("cancel", &self.cancel.is_some())
            .finish()
    }
}

impl<S, K: MakeLockKey> Layer<S> for LockLayer<K> {
    type Service = LockService<S, K>;

    fn layer(&self, inner: S) -> Self::Service {
        LockService::new(inner, Arc::new(self.shared.clone()))
    }
}
