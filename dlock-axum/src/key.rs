//! How the layer makes a lock key from a request.

use std::fmt;
use std::future::Future;
use std::marker::PhantomData;

use axum::extract::{FromRequestParts, RawPathParams};
use axum::response::{IntoResponse, Response};
use dlock::LockError;
use dlock::key_template::{KeyTemplate, TemplateError};
use http::request::Parts;

/// Makes the lock key for a request: the strategy behind [`LockLayer`](crate::LockLayer).
///
/// [`ExtractorKey`] (a closure over an axum extractor, so the key comes from the value the
/// handler sees) is the one to use for typed parameters; [`PathKey`] (a key template over the
/// path's text) is the default; [`KeyFn`] wraps a closure over the request head for keys taken
/// from headers, the query or anything else. Implement it yourself when none fits.
pub trait MakeLockKey: Send + Sync + 'static {
    /// The key for this request; `Ok(None)` runs the handler without a lock.
    ///
    /// An `Err` is answered without calling the handler and without taking a lock: see
    /// [`KeyRejection`]. Whatever this leaves in `parts` is what the handler gets.
    ///
    /// # Cancel safety
    ///
    /// The layer drops this future when the client goes away; no lock is held while it runs.
    fn make_key(
        &self,
        parts: &mut Parts,
    ) -> impl Future<Output = Result<Option<String>, KeyRejection>> + Send;

    /// As [`MakeLockKeys::check_route`]: whether this strategy can make keys on the route
    /// `path`, checked when the router is built. The default accepts every route.
    fn check_route(&self, path: &str) -> Result<(), LockError> {
        let _ = path;
        Ok(())
    }
}

/// Makes the lock keys for a request: what [`LockLayer`](crate::LockLayer) asks of its key
/// strategy. Every [`MakeLockKey`] is one (it makes one key, or none); [`ExtractorKeys`] makes
/// several, which the layer takes all or none.
pub trait MakeLockKeys: Send + Sync + 'static {
    /// The keys for this request: empty runs the handler without a lock; two or more are
    /// taken all or none, in a canonical order (see
    /// [`LockProvider::acquire_many`](dlock::LockProvider::acquire_many)).
    ///
    /// # Cancel safety
    ///
    /// The layer drops this future when the client goes away; no lock is held while it runs.
    fn make_keys(
        &self,
        parts: &mut Parts,
    ) -> impl Future<Output = Result<Vec<String>, KeyRejection>> + Send;

    /// Checks, when the router is built, that this strategy can make keys on the route `path`
    /// (axum's syntax, `/accounts/{id}/debit`): [`LockedRouter::locked_route`] calls it and
    /// refuses to build a router on which every request would fail. The default accepts every
    /// route; [`PathKey`] checks that each placeholder of its template names a parameter of
    /// the route.
    ///
    /// [`LockedRouter::locked_route`]: crate::LockedRouter::locked_route
    fn check_route(&self, path: &str) -> Result<(), LockError> {
        let _ = path;
        Ok(())
    }
}

impl<K: MakeLockKey> MakeLockKeys for K {
    async fn make_keys(&self, parts: &mut Parts) -> Result<Vec<String>, KeyRejection> {
        Ok(self.make_key(parts).await?.into_iter().collect())
    }

    fn check_route(&self, path: &str) -> Result<(), LockError> {
        self.check_route(path)
    }
}

/// Why a [`MakeLockKey`] made no key for a request. The layer answers it at once: the handler
/// is not called and no lock is taken.
#[derive(Debug)]
pub enum KeyRejection {
    /// A lock error, answered as a [`LockRejection`](crate::LockRejection) problem with the
    /// request's path as `instance`: [`InvalidKey`](LockError::InvalidKey) with 400,
    /// [`Config`](LockError::Config) with 500.
    Lock(LockError),
    /// A response sent as it is, such as an extractor's rejection (the answer the handler
    /// would have given had it run the same extractor).
    Response(Response),
}

impl From<LockError> for KeyRejection {
    fn from(err: LockError) -> Self {
        KeyRejection::Lock(err)
    }
}

/// The default key strategy: a [`KeyTemplate`] whose placeholders name path parameters of the
/// route, such as `"account:{account_id}"` on `/accounts/{account_id}/debit`.
///
/// **It locks the text of the path, not the value a handler parses from it.** Parameter values
/// are percent-decoded by the router (`%34%32` is `42`), then encoded with
/// [`encode_component`](dlock::key_template::encode_component); nothing else is done to them.
/// That is exactly what a handler taking the parameter as a `Path<String>` sees, so for
/// string parameters the template, [`ExtractorKey`] with `encode_component`, and
/// `#[distributed_lock]` on the handler's `String` all lock the same key. A handler that
/// parses the parameter sees one value where the template sees several texts:
///
/// | handler parameter | one value to the handler | keys of `"acct:{id}"` |
/// |---|---|---|
/// | `Path<u64>` (any integer) | `/acct/42`, `/acct/042`, `/acct/+42`, `/acct/%2B042` | `acct:42`, `acct:042`, `acct:+42`, `acct:+042` |
/// | `Path<Uuid>` | lower or upper case, with or without hyphens, braces or `urn:uuid:` | one key per spelling |
/// | `Path<f64>`, a serde enum with aliases, any `FromStr` that normalizes | spellings it accepts as equal | one key per spelling |
///
/// Requests that spell one value differently then run at the same time under different
/// locks. For such handlers use [`LockLayer::with_extractor`](crate::LockLayer::with_extractor),
/// which makes the key from the parsed value. For the same reason a template on a typed
/// parameter and `#[distributed_lock]` on the handler (which formats the parsed value) agree
/// only for the canonical spelling (`acct:42`, not `acct:042`).
///
/// A placeholder that names no parameter of the route is a configuration mistake, answered
/// with 500 and logged at `error` level; add the route with
/// [`LockedRouter::locked_route`](crate::LockedRouter::locked_route) to have it found when the
/// router is built instead. A parameter that is not UTF-8 once decoded is answered with 400.
#[derive(Clone)]
pub struct PathKey {
    template: KeyTemplate,
}

impl PathKey {
    /// A strategy rendering `template`.
    pub fn new(template: KeyTemplate) -> PathKey {
        PathKey { template }
    }

    /// The template.
    pub fn template(&self) -> &KeyTemplate {
        &self.template
    }
}

impl fmt::Debug for PathKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("PathKey")
            .field(&self.template.as_str())
            .finish()
    }
}

impl MakeLockKey for PathKey {
    fn check_route(&self, path: &str) -> Result<(), LockError> {
        let params = route_params(path);
        let missing: Vec<&str> = self
            .template
            .placeholders()
            .filter(|name| !params.contains(name))
            .collect();
        if missing.is_empty() {
            return Ok(());
        }
        let known = if params.is_empty() {
            "it has no parameters".to_owned()
        } else {
            let names: Vec<String> = params.iter().map(|p| format!("`{p}`")).collect();
            format!("its parameters are {}", names.join(", "))
        };
        Err(LockError::config(format!(
            "the lock key template `{}` names {}, which the route `{}` does not have ({known}); \
             placeholders must name the route's `{{param}}` segments",
            self.template.as_str().escape_debug(),
            missing
                .iter()
                .map(|name| format!("`{}`", name.escape_debug()))
                .collect::<Vec<_>>()
                .join(", "),
            path.escape_debug(),
        )))
    }

    async fn make_key(&self, parts: &mut Parts) -> Result<Option<String>, KeyRejection> {
        if self.template.placeholders().next().is_none() {
            return Ok(Some(
                self.template
                    .render(|_| None::<&str>)
                    .map_err(LockError::from)?,
            ));
        }
        let params = raw_path_params(parts).await?;
        let rendered = self.template.render(|name| {
            params
                .iter()
                .find(|(param, _)| *param == name)
                .map(|(_, value)| value)
        });
        match rendered {
            Ok(key) => Ok(Some(key)),
            Err(TemplateError::Missing { name }) => Err(LockError::config(format!(
                "the lock key template `{}` names `{}`, which is not a path parameter of the \
                 route `{}`; placeholders must name the route's `{{param}}` segments. A layer \
                 added with `Router::layer` wraps every route: add it with \
                 `Router::route_layer` after the routes it locks (it wraps only the routes \
                 added before it), or add each route with `LockedRouter::locked_route`, which \
                 checks the template when the router is built",
                self.template.as_str().escape_debug(),
                name.escape_debug(),
                matched_path(parts).escape_debug(),
            ))
            .into()),
            Err(other) => Err(LockError::from(other).into()),
        }
    }
}

/// The names of the parameters of an axum route path: `{id}` and `{*rest}` segments.
fn route_params(path: &str) -> Vec<&str> {
    path.split('/')
        .filter_map(|segment| segment.strip_prefix('{')?.strip_suffix('}'))
        .filter(|name| !name.starts_with('{'))
        .map(|name| name.strip_prefix('*').unwrap_or(name))
        .collect()
}

fn matched_path(parts: &Parts) -> &str {
    parts
        .extensions
        .get::<axum::extract::MatchedPath>()
        .map_or("?", |path| path.as_str())
}

/// The route's path parameters, percent-decoded.
async fn raw_path_params(parts: &mut Parts) -> Result<RawPathParams, LockError> {
    match RawPathParams::from_request_parts(parts, &()).await {
        Ok(params) => Ok(params),
        Err(rejection) if rejection.status().is_client_error() => Err(LockError::InvalidKey {
            reason: "a path parameter is not valid UTF-8 once percent-decoded".to_owned(),
        }),
        Err(_) => Err(LockError::config(
            "the lock layer found no path parameters for this request: add it with \
             `Router::route_layer`, so that it runs for matched routes only",
        )),
    }
}

/// A key strategy from a closure `Fn(&Parts) -> Option<String>`; `None` runs the handler
/// without a lock. Made by [`LockLayer::with_key_fn`](crate::LockLayer::with_key_fn).
///
/// The closure's key is used as is: encode values you put into it with
/// [`encode_component`](dlock::key_template::encode_component) where two of them could
/// otherwise give the same key.
#[derive(Clone)]
pub struct KeyFn<F>(pub F);

impl<F> fmt::Debug for KeyFn<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("KeyFn").finish_non_exhaustive()
    }
}

impl<F> MakeLockKey for KeyFn<F>
where
    F: Fn(&Parts) -> Option<String> + Send + Sync + 'static,
{
    async fn make_key(&self, parts: &mut Parts) -> Result<Option<String>, KeyRejection> {
        Ok((self.0)(parts))
    }
}

/// A key strategy from an axum extractor and a closure over its value, so the key comes from
/// the value the handler sees. Made by
/// [`LockLayer::with_extractor`](crate::LockLayer::with_extractor) (extractors that need no
/// router state) and
/// [`LockLayer::with_extractor_and_state`](crate::LockLayer::with_extractor_and_state).
///
/// For each request it runs `E`'s [`FromRequestParts`] on a copy of the request head (method,
/// URI, headers and extensions, including the path parameters `route_layer` puts there), so
/// an extractor that takes something out of the request (as `WebSocketUpgrade` takes the
/// connection upgrade) leaves the handler's request whole. Then:
///
/// - the extractor's value goes to the closure, whose `String` is the key. It is checked as
///   every key of the layer is (an empty key or one longer than
///   [`max_key_len`](crate::LockLayer::max_key_len) is answered with 400) and locked as it is:
///   encode strings you put into it with
///   [`encode_component`](dlock::key_template::encode_component), as the key template and
///   `#[distributed_lock]` do, where two values could otherwise give the same key (or where
///   the key must match the macro's);
/// - a rejection is answered with the rejection's own response, the answer the handler
///   would have given for the same extractor, before any lock is taken.
///
/// The body is not available to the extractor (`FromRequestParts`, not `FromRequest`): a key
/// from the body would need the body read before the lock is taken.
pub struct ExtractorKey<F, E, S = ()> {
    key_fn: F,
    state: S,
    // `fn() -> E`: the strategy makes `E`s, it holds none (so it is `Send + Sync` whatever `E` is).
    extractor: PhantomData<fn() -> E>,
}

impl<F, E, S> ExtractorKey<F, E, S> {
    /// A strategy extracting `E` with `state` as the router state and making the key with
    /// `key_fn`.
    pub fn new(state: S, key_fn: F) -> Self {
        ExtractorKey {
            key_fn,
            state,
            extractor: PhantomData,
        }
    }
}

impl<F: Clone, E, S: Clone> Clone for ExtractorKey<F, E, S> {
    fn clone(&self) -> Self {
        ExtractorKey::new(self.state.clone(), self.key_fn.clone())
    }
}

impl<F, E, S> fmt::Debug for ExtractorKey<F, E, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExtractorKey")
            .field("extractor", &std::any::type_name::<E>())
            .field("state", &std::any::type_name::<S>())
            .finish_non_exhaustive()
    }
}

impl<F, E, S> MakeLockKey for ExtractorKey<F, E, S>
where
    F: Fn(E) -> String + Send + Sync + 'static,
    E: FromRequestParts<S> + 'static,
    S: Send + Sync + 'static,
{
    async fn make_key(&self, parts: &mut Parts) -> Result<Option<String>, KeyRejection> {
        let mut copy = parts.clone();
        let rejection = match E::from_request_parts(&mut copy, &self.state).await {
            Ok(value) => return Ok(Some((self.key_fn)(value))),
            Err(rejection) => rejection.into_response(),
        };
        Err(extractor_rejection::<E>(parts, rejection).await)
    }
}

/// A key strategy making **several keys** from an axum extractor, taken all or none: the
/// transfer between two accounts. Made by
/// [`LockLayer::with_extractor_many`](crate::LockLayer::with_extractor_many); it extracts as
/// [`ExtractorKey`] does, and its closure returns the keys.
pub struct ExtractorKeys<F, E, S = ()> {
    key_fn: F,
    state: S,
    extractor: PhantomData<fn() -> E>,
}

impl<F, E, S> ExtractorKeys<F, E, S> {
    /// A strategy extracting `E` with `state` as the router state and making the keys with
    /// `key_fn`.
    pub fn new(state: S, key_fn: F) -> Self {
        ExtractorKeys {
            key_fn,
            state,
            extractor: PhantomData,
        }
    }
}

impl<F: Clone, E, S: Clone> Clone for ExtractorKeys<F, E, S> {
    fn clone(&self) -> Self {
        ExtractorKeys::new(self.state.clone(), self.key_fn.clone())
    }
}

impl<F, E, S> fmt::Debug for ExtractorKeys<F, E, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExtractorKeys")
            .field("extractor", &std::any::type_name::<E>())
            .field("state", &std::any::type_name::<S>())
            .finish_non_exhaustive()
    }
}

impl<F, E, S> MakeLockKeys for ExtractorKeys<F, E, S>
where
    F: Fn(E) -> Vec<String> + Send + Sync + 'static,
    E: FromRequestParts<S> + 'static,
    S: Send + Sync + 'static,
{
    async fn make_keys(&self, parts: &mut Parts) -> Result<Vec<String>, KeyRejection> {
        let mut copy = parts.clone();
        let rejection = match E::from_request_parts(&mut copy, &self.state).await {
            Ok(value) => return Ok((self.key_fn)(value)),
            Err(rejection) => rejection.into_response(),
        };
        Err(extractor_rejection::<E>(parts, rejection).await)
    }
}

/// How the layer answers a key extractor's rejection: a client error (a malformed path) as
/// the extractor answers it; a server error, which no request can fix (the extractor cannot
/// run on this route: `Path<u64>` on `/health`, or on a request that matched no route, as
/// under `Router::layer`), as the configuration problem, with a message that says so.
async fn extractor_rejection<E>(parts: &Parts, response: Response) -> KeyRejection {
    let status = response.status();
    if !status.is_server_error() {
        return KeyRejection::Response(response);
    }
    let text = axum::body::to_bytes(response.into_body(), 1024)
        .await
        .map(|bytes| String::from_utf8_lossy(&bytes).trim().to_owned())
        .unwrap_or_default();
    let route = match parts.extensions.get::<axum::extract::MatchedPath>() {
        Some(path) => format!("the route `{}`", path.as_str().escape_debug()),
        None => format!(
            "`{}`, which matches no route",
            parts.uri.path().escape_debug()
        ),
    };
    KeyRejection::Lock(LockError::config(format!(
        "the lock layer's key extractor `{}` failed on {route} with {status} ({}): the layer \
         wraps a route it cannot make a key for. A layer added with `Router::layer` wraps every \
         route, and the requests that match none: add it with `Router::route_layer` after the \
         routes it locks (it wraps only the routes added before it), or give the locked routes \
         a router of their own and merge it",
        std::any::type_name::<E>(),
        text.escape_debug(),
    )))
}
