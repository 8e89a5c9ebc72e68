//! The layer: configuration shared by the services it makes.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::FromRequestParts;
use dlock::key_template::{KeyTemplate, TemplateError};
use dlock::{CancellationToken, LockProvider};
use http::request::Parts;
use tokio::sync::Semaphore;
use tower_layer::Layer;

use crate::key::{ExtractorKey, ExtractorKeys, KeyFn, MakeLockKeys, PathKey};
use crate::rejection::LockRejection;
use crate::service::LockService;

/// A tower [`Layer`] that takes a distributed lock before the handler runs and holds it until
/// the handler's response is produced.
///
/// Add it with [`Router::route_layer`](axum::Router::route_layer), right after the routes it
/// locks, or add each route with [`LockedRouter::locked_route`](crate::LockedRouter::locked_route),
/// which also checks a key template against the route when the router is built.
///
/// **Why `route_layer`.** `route_layer` wraps the routes added before it, and runs after
/// routing, so the layer sees each route's path parameters, and only routes it was meant for.
/// [`Router::layer`](axum::Router::layer) wraps every route of the router, and the requests
/// that match none: a `/health` route, or a 404, has no `{id}` to make a key from. The layer
/// never lets such a request through unlocked (a route that should be locked but names its
/// parameter differently would then run unlocked, silently): it answers it with the 500
/// configuration problem, and logs at `error` level what went wrong and that `route_layer`
/// is the fix. A key extractor's server-error rejection (axum's "Wrong number of path
/// arguments" for a `Path<u64>` on `/health`) is such a mistake too, and is answered the same
/// way; its client-error rejections (`/accounts/abc` for a `Path<u64>`) are the client's, and
/// are answered as the extractor answers them (wrap it in [`Problem`](crate::Problem) for
/// problem details).
///
/// **Install a `tracing` subscriber** (`tracing_subscriber::fmt::init()`, or the one your
/// service uses). Mistakes in the server's own set-up (a template placeholder the route
/// lacks, the `Router::layer` mistake, a [`HeldLock`](crate::HeldLock) on a route without the
/// layer) are answered to the client with a generic 500 problem, which must not describe the
/// server; what is wrong, and how to fix it, goes only to the log.
///
/// **Not reentrant.** The handler runs as the holder of the request's locks
/// ([`dlock::run_holding`]): taking one of their keys again in the handler, through the same
/// provider or a clone (a `#[distributed_lock]` function on the same key, or by hand), fails
/// at once with [`LockError::Reentrant`](dlock::LockError::Reentrant), answered as a 500
/// problem "already held by this request (locks are not reentrant)", instead of waiting its
/// whole timeout for a lock the request itself holds. Read locks may be read again. Pass the
/// handler's [`HeldLock`](crate::HeldLock) (its key and fencing token) to what needs them
/// instead of locking again.
///
/// ```no_run
/// use std::time::Duration;
/// use axum::{Router, extract::Path, routing::post};
/// use dlock_axum::LockLayer;
///
/// async fn debit(Path(account_id): Path<u64>) -> String {
///     format!("debited {account_id}")
/// }
///
/// # async fn demo() -> Result<(), dlock::LockError> {
/// let locks = dlock::LockProvider::connect("sqlite://locks.db").await?;
/// let app: Router = Router::new()
///     .route("/accounts/{account_id}/debit", post(debit))
///     .route_layer(
///         // The key comes from the value the handler gets: `/accounts/042/debit` and
///         // `/accounts/42/debit` are account 42 to `debit`, and both lock "account:42".
///         LockLayer::with_extractor(locks.clone(), |Path(id): Path<u64>| format!("account:{id}"))
///             .timeout(Duration::from_secs(10))
///             .max_waiting(256),
///     );
/// # Ok(()) }
/// ```
///
/// For each request the layer
///
/// 1. makes the key, in one of three ways:
///    - [`with_extractor`](LockLayer::with_extractor): from an axum extractor (the handler's
///      own `Path<u64>`, a tuple of extractors, ...) and a closure over its value, so the key
///      comes from the parsed value the handler acts on. Use it whenever the handler parses
///      what it locks. A rejection is answered as the handler would answer it;
///    - [`new`](LockLayer::new): from a key template over the *text* of the path parameters
///      (percent-decoded, then encoded as
///      [`encode_component`](dlock::key_template::encode_component) does). Right for
///      parameters the handler takes as `String`, and for constant keys; for a typed
///      parameter it locks one key per spelling of a value (see [`PathKey`]);
///    - [`with_key_fn`](LockLayer::with_key_fn): from a closure over the request's [`Parts`],
///      where `None` means "no lock, just run the handler".
///
///    Empty keys and keys longer than [`max_key_len`](LockLayer::max_key_len) are answered
///    with 400, whichever way they were made;
/// 2. takes the lock, waiting up to [`timeout`](LockLayer::timeout) (zero, the default: one try):
///    an exclusive lock, or with [`read`](LockLayer::read) a read lock shared with other
///    readers of the key, or with [`permits`](LockLayer::permits) one of the permits of a
///    semaphore;
/// 3. runs the handler while holding it, with a [`HeldLock`](crate::HeldLock) in the request's
///    extensions (the key, the fencing token and the lost token, for the handler to extract).
///    If the lock is lost meanwhile, by default the handler's future is dropped and the client
///    gets the `Lost` problem (500); with [`on_lost(OnLost::Continue)`](LockLayer::on_lost) the
///    handler runs on and its response is sent as it is;
/// 4. releases the lock once the response is produced, before it is returned. If the response
///    future is dropped instead (the client disconnected), the lock is released in the
///    background at once.
///
/// The inner service is **not called** when no lock is taken: contention, timeouts, an
/// unreachable store, a bad key and the waiter limit are answered by the layer itself as
/// problem details (see [`LockRejection`]), a key extractor's rejection with its own response.
/// The service's error type stays the inner one's.
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
    pub(crate) on_lost: OnLost,
    pub(crate) mode: Mode,
}

/// What the layer takes for a request: an exclusive lock (the default), a read lock, or a
/// semaphore permit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mode {
    Exclusive,
    Read,
    Permits(u32),
}

/// What [`LockLayer`] does with a handler whose lock is lost while it runs, set with
/// [`LockLayer::on_lost`].
///
/// A lock is lost when the store no longer counts it as this request's: its connection died,
/// its lease could not be renewed in time, or another owner took it over.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum OnLost {
    /// Drop the handler's future as soon as the loss is known, and answer with the `Lost`
    /// problem (500). The handler stops at its next `.await`, whatever it was doing; work it
    /// had already done stays done. The default.
    #[default]
    Cancel,
    /// Let the handler run on, and send its response as it is. The handler learns of the
    /// loss through [`HeldLock`](crate::HeldLock) (`is_lost()`, `lost_token()`), and writes
    /// with the lock's fencing token so that the store it writes to refuses what arrives
    /// after another holder's writes. For handlers that must finish or undo what they
    /// started, and answer with their own error.
    Continue,
}

impl LockLayer<PathKey> {
    /// A layer locking the key `template` renders from the *text* of the route's path
    /// parameters, such as `"account:{account_id}"` (see [`dlock::key_template`] for the
    /// syntax).
    ///
    /// The text, not a parsed value: for a handler taking `Path<u64>`, `/accounts/42` and
    /// `/accounts/042` are one account but two keys here, so their requests would run at the
    /// same time. Use [`with_extractor`](LockLayer::with_extractor) for typed parameters; the
    /// template fits parameters the handler takes as `String` (it sees the same
    /// percent-decoded text) and constant keys (`"jobs:reconcile"`). See [`PathKey`].
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
    /// The closure sees the request's text, as the key template does. Where the handler parses
    /// what the key names (a number in a header, an id in the query), build the key from the
    /// parsed value with [`with_extractor`](LockLayer::with_extractor) instead, or parse the
    /// same way in the closure.
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

impl<F, E> LockLayer<ExtractorKey<F, E>>
where
    F: Fn(E) -> String + Send + Sync + 'static,
    E: FromRequestParts<()> + 'static,
{
    /// A layer locking the key `key_fn` makes from the value of the axum extractor `E`, so
    /// that the key comes from the value the handler sees rather than from the text of the
    /// request.
    ///
    /// ```
    /// use axum::{Router, extract::{Path, Query}, routing::post};
    /// use dlock::key_template::encode_component;
    /// use dlock_axum::LockLayer;
    ///
    /// # async fn debit() {}
    /// # async fn transfer() {}
    /// # async fn rename() {}
    /// #[derive(serde::Deserialize)]
    /// struct Branch { branch: String }
    ///
    /// # fn demo(locks: dlock::LockProvider) {
    /// // `/accounts/42/debit`, `/accounts/042/debit` and `/accounts/+42/debit` all reach a
    /// // `Path<u64>` handler as account 42, and all lock "account:42".
    /// let debits = Router::new()
    ///     .route("/accounts/{id}/debit", post(debit))
    ///     .route_layer(LockLayer::with_extractor(locks.clone(), |Path(id): Path<u64>| {
    ///         format!("account:{id}")
    ///     }));
    /// // Several path parameters, and several extractors as a tuple.
    /// let transfers = Router::new()
    ///     .route("/transfers/{from}/{to}", post(transfer))
    ///     .route_layer(LockLayer::with_extractor(
    ///         locks.clone(),
    ///         |(Path((from, to)), Query(q)): (Path<(u64, u64)>, Query<Branch>)| {
    ///             // Encode strings, as the key template and #[distributed_lock] do.
    ///             format!("transfer:{}:{from}:{to}", encode_component(&q.branch))
    ///         },
    ///     ));
    /// let users = Router::new()
    ///     .route("/users/{name}", post(rename))
    ///     .route_layer(LockLayer::with_extractor(locks, |Path(name): Path<String>| {
    ///         format!("user:{}", encode_component(&name))
    ///     }));
    /// // `route_layer` wraps every route added before it: one router per lock, merged.
    /// let app: Router = debits.merge(transfers).merge(users);
    /// # let _ = app; }
    /// ```
    ///
    /// - **The extractor** is any [`FromRequestParts`] type: the handler's own `Path<T>`,
    ///   `Query<T>`, axum-extra's `TypedHeader<T>`, your own extractors, tuples of them (up to 16), and
    ///   `Option<T>`/`Result<T, _>` where axum provides them. Name its type on the closure's
    ///   parameter (`|Path(id): Path<u64>|`); the compiler cannot guess it. It runs on a copy
    ///   of the request head, so the handler gets the request whole.
    /// - **The value** must be the one the handler acts on. If the handler normalizes further
    ///   (lower-cases an e-mail address, resolves an alias), do it in the closure too, or
    ///   better in an extractor of your own that the handler and the layer both use.
    /// - **A rejection** (`/accounts/abc/debit` for a `Path<u64>`) is answered with the
    ///   extractor's own response, as the handler would answer it, before any lock is taken.
    ///   Wrap the extractor in [`Problem`](crate::Problem)
    ///   (`|Problem(Path(id)): Problem<Path<u64>>|`) to answer it as problem details. A
    ///   server-error rejection (the extractor cannot run on this route at all) is a mistake
    ///   in the router, answered with the configuration problem and logged (see
    ///   [`LockLayer`]).
    /// - **The key** is checked like every key of the layer: empty or longer than
    ///   [`max_key_len`](LockLayer::max_key_len), it is answered with a 400 problem. It is
    ///   locked as the closure returns it: encode strings with
    ///   [`encode_component`](dlock::key_template::encode_component) (or build the key with
    ///   [`KeyBuilder`](dlock::key_template::KeyBuilder)) where two values could otherwise
    ///   give one key. So encoded, the key is the one `#[distributed_lock]` renders from the
    ///   same template and the handler's parsed value (numbers contain nothing to encode:
    ///   `format!("account:{id}")` of a `u64` is the macro's `"account:{id}"`).
    /// - **Router state.** The layer runs outside the handler, where the router's state is not
    ///   passed; this constructor extracts with the state `()`, which every extractor generic
    ///   over the state accepts (`Path`, `Query`, headers, ...). An extractor that needs the
    ///   state (`State<AppState>`, or one that reads it through `FromRef`) does not compile
    ///   here: the error says "the trait bound `State<AppState>: FromRequestParts<()>` is not
    ///   satisfied" (or names the tuple that contains it), "required by a bound in
    ///   `LockLayer::<ExtractorKey<F, E>>::with_extractor`". Give the layer the state with
    ///   [`with_extractor_and_state`](LockLayer::with_extractor_and_state):
    ///
    /// ```compile_fail,E0277
    /// # use axum::extract::{Path, State};
    /// # #[derive(Clone)] struct AppState { region: &'static str }
    /// # fn demo(locks: dlock::LockProvider) {
    /// // Does not compile: `State<AppState>` needs the router's state.
    /// let layer = dlock_axum::LockLayer::with_extractor(
    ///     locks,
    ///     |(State(s), Path(id)): (State<AppState>, Path<u64>)| format!("{}:{id}", s.region),
    /// );
    /// # }
    /// ```
    ///
    /// ```
    /// # use axum::extract::{Path, State};
    /// # #[derive(Clone)] struct AppState { region: &'static str }
    /// # fn demo(locks: dlock::LockProvider, state: AppState) {
    /// // Compiles: the layer extracts with the state it was given.
    /// let layer = dlock_axum::LockLayer::with_extractor_and_state(
    ///     locks,
    ///     state,
    ///     |(State(s), Path(id)): (State<AppState>, Path<u64>)| format!("{}:{id}", s.region),
    /// );
    /// # }
    /// ```
    pub fn with_extractor(provider: LockProvider, key_fn: F) -> Self {
        Self::with_make_key(provider, ExtractorKey::new((), key_fn))
    }
}

impl<F, E, S> LockLayer<ExtractorKey<F, E, S>>
where
    F: Fn(E) -> String + Send + Sync + 'static,
    E: FromRequestParts<S> + 'static,
    S: Send + Sync + 'static,
{
    /// As [`with_extractor`](LockLayer::with_extractor), for extractors that need the router
    /// state: `E` is extracted with `state`, normally a clone of the state given to
    /// [`Router::with_state`](axum::Router::with_state).
    ///
    /// ```
    /// use axum::{Router, extract::{FromRef, FromRequestParts, Path}, routing::post};
    /// use dlock_axum::LockLayer;
    /// use http::{StatusCode, request::Parts};
    ///
    /// #[derive(Clone)]
    /// struct AppState { tenants: Vec<&'static str> }
    ///
    /// /// The tenant of `/tenants/{tenant}/...`, checked against the state.
    /// struct Tenant(&'static str);
    ///
    /// impl<S: Send + Sync> FromRequestParts<S> for Tenant
    /// where
    ///     AppState: FromRef<S>,
    /// {
    ///     type Rejection = StatusCode;
    ///     async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, StatusCode> {
    ///         let Path(name) = Path::<String>::from_request_parts(parts, state)
    ///             .await
    ///             .map_err(|_| StatusCode::BAD_REQUEST)?;
    ///         let state = AppState::from_ref(state);
    ///         let known = state.tenants.iter().find(|t| **t == name).ok_or(StatusCode::NOT_FOUND)?;
    ///         Ok(Tenant(known))
    ///     }
    /// }
    ///
    /// async fn close_books(_tenant: Tenant) -> &'static str { "closed" }
    ///
    /// # fn demo(locks: dlock::LockProvider) {
    /// let state = AppState { tenants: vec!["acme"] };
    /// let app: Router = Router::new()
    ///     .route("/tenants/{tenant}/close", post(close_books))
    ///     .route_layer(LockLayer::with_extractor_and_state(
    ///         locks,
    ///         state.clone(),
    ///         |Tenant(name): Tenant| format!("books:{name}"),
    ///     ))
    ///     .with_state(state);
    /// # let _ = app; }
    /// ```
    pub fn with_extractor_and_state(provider: LockProvider, state: S, key_fn: F) -> Self {
        Self::with_make_key(provider, ExtractorKey::new(state, key_fn))
    }
}

impl<F, E> LockLayer<ExtractorKeys<F, E>>
where
    F: Fn(E) -> Vec<String> + Send + Sync + 'static,
    E: FromRequestParts<()> + 'static,
{
    /// A layer locking **several keys** made from an axum extractor, all or none: the
    /// transfer between two accounts, `#[distributed_lock(keys(...))]` for a route.
    ///
    /// The keys are taken in a canonical order whatever order the closure gives them in, so
    /// two requests locking the same accounts in opposite directions never deadlock; a key
    /// that appears twice is taken once, and no keys at all run the handler without a lock.
    /// A held key is answered as for one key (409, or 408 after the timeout), and no key is
    /// left held. The handler's [`HeldLock`](crate::HeldLock) lists every key
    /// ([`keys`](crate::HeldLock::keys)), and counts as lost when any of its locks is lost.
    /// Only exclusive locks are taken this way: with [`read`](LockLayer::read) or
    /// [`permits`](LockLayer::permits), a request for two or more keys is answered with the
    /// configuration problem (500).
    ///
    /// ```
    /// use axum::{Router, extract::Path, routing::post};
    /// use dlock_axum::{HeldLock, LockLayer};
    ///
    /// async fn transfer(Path((from, to)): Path<(u64, u64)>, lock: HeldLock) -> String {
    ///     let keys: Vec<&str> = lock.keys().collect();
    ///     format!("{from} -> {to} under {keys:?}")
    /// }
    ///
    /// # fn demo(locks: dlock::LockProvider) {
    /// let app: Router = Router::new()
    ///     .route("/transfers/{from}/{to}", post(transfer))
    ///     .route_layer(LockLayer::with_extractor_many(
    ///         locks,
    ///         |Path((from, to)): Path<(u64, u64)>| {
    ///             vec![format!("account:{from}"), format!("account:{to}")]
    ///         },
    ///     ));
    /// # let _ = app; }
    /// ```
    pub fn with_extractor_many(provider: LockProvider, key_fn: F) -> Self {
        Self::with_make_key(provider, ExtractorKeys::new((), key_fn))
    }
}

impl<K: MakeLockKeys> LockLayer<K> {
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
                on_lost: OnLost::Cancel,
                mode: Mode::Exclusive,
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

    /// What happens to a handler whose lock is lost while it runs: dropped, with a 500
    /// `Lost` answer ([`OnLost::Cancel`], the default), or left to run on and read the loss
    /// from its [`HeldLock`](crate::HeldLock) ([`OnLost::Continue`]).
    ///
    /// ```
    /// use axum::{Router, extract::Path, routing::post};
    /// use dlock_axum::{HeldLock, LockLayer, OnLost};
    ///
    /// async fn settle(Path(id): Path<u64>, lock: HeldLock) -> Result<String, String> {
    ///     // ... first half of the work ...
    ///     if lock.is_lost() {
    ///         // ... undo the first half ...
    ///         return Err(format!("settlement {id} rolled back: its lock was lost"));
    ///     }
    ///     Ok(format!("settled {id}"))
    /// }
    ///
    /// # fn demo(locks: dlock::LockProvider) {
    /// let app: Router = Router::new()
    ///     .route("/settlements/{id}", post(settle))
    ///     .route_layer(
    ///         LockLayer::with_extractor(locks, |Path(id): Path<u64>| format!("settlement:{id}"))
    ///             .on_lost(OnLost::Continue),
    ///     );
    /// # let _ = app; }
    /// ```
    pub fn on_lost(self, on_lost: OnLost) -> Self {
        self.update(|s| s.on_lost = on_lost)
    }

    /// Takes a read lock for each request instead of an exclusive one: requests on one key run
    /// together, while a route (of this service or any other) that takes the key exclusively
    /// excludes them and is excluded by them. See [`LockProvider::try_acquire_read`]; a
    /// backend without a shared lock mode answers every request with the `Unsupported`
    /// problem (500).
    ///
    /// ```
    /// use axum::{Router, extract::Path, routing::{get, put}};
    /// use dlock_axum::LockLayer;
    ///
    /// async fn show(Path(id): Path<u64>) -> String { format!("price list {id}") }
    /// async fn replace(Path(id): Path<u64>) -> String { format!("replaced {id}") }
    ///
    /// # fn demo(locks: dlock::LockProvider) {
    /// let key = |Path(id): Path<u64>| format!("prices:{id}");
    /// let app: Router = Router::new()
    ///     .route("/prices/{id}", get(show))
    ///     .route_layer(LockLayer::with_extractor(locks.clone(), key).read())
    ///     .merge(
    ///         Router::new()
    ///             .route("/prices/{id}", put(replace))
    ///             .route_layer(LockLayer::with_extractor(locks, key)),
    ///     );
    /// # let _ = app; }
    /// ```
    ///
    /// [`LockProvider::try_acquire_read`]: dlock::LockProvider::try_acquire_read
    pub fn read(self) -> Self {
        self.update(|s| s.mode = Mode::Read)
    }

    /// Lets up to `permits` requests of one key run at once: each takes a permit of the
    /// semaphore named by the key (see [`LockProvider::acquire_semaphore`]; semaphore keys
    /// are their own namespace, and waiting requests are served in turn). When every permit
    /// is held the request is answered as for a held lock (409, or 408 after the timeout).
    /// Zero permits, a count the semaphore is not in use with (on backends that record it),
    /// or more than 1,024 on a backend that keeps semaphores as slot locks answer with the
    /// configuration problem (500).
    ///
    /// [`LockProvider::acquire_semaphore`]: dlock::LockProvider::acquire_semaphore
    pub fn permits(self, permits: u32) -> Self {
        self.update(|s| s.mode = Mode::Permits(permits))
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
            on_lost: self.on_lost,
            mode: self.mode,
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
            .field("on_lost", &self.on_lost)
            .field("mode", &self.mode)
            .finish()
    }
}

impl<S, K: MakeLockKeys> Layer<S> for LockLayer<K> {
    type Service = LockService<S, K>;

    fn layer(&self, inner: S) -> Self::Service {
        LockService::new(inner, Arc::new(self.shared.clone()))
    }
}
