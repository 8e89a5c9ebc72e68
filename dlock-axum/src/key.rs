//! How the layer makes a lock key from a request.

use std::fmt;
use std::future::Future;
use std::pin::pin;
use std::task::{Context, Poll, Waker};

use axum::extract::{FromRequestParts, RawPathParams};
use dlock::LockError;
use dlock::key_template::{KeyTemplate, TemplateError};
use http::request::Parts;

/// Makes the lock key for a request: the strategy behind [`LockLayer`](crate::LockLayer).
///
/// [`PathKey`] (a key template over path parameters) is the default; [`KeyFn`] wraps a closure
/// for keys taken from headers, the query or anything else. Implement it yourself when neither
/// fits.
pub trait MakeLockKey: Send + Sync + 'static {
    /// The key for this request; `Ok(None)` runs the handler without a lock.
    ///
    /// An `Err` is answered as a problem without calling the handler: an
    /// [`InvalidKey`](LockError::InvalidKey) error with 400, a [`Config`](LockError::Config)
    /// error with 500.
    fn make_key(&self, parts: &mut Parts) -> Result<Option<String>, LockError>;
}

/// The default key strategy: a [`KeyTemplate`] whose placeholders name path parameters of the
/// route, such as `"account:{account_id}"` on `/accounts/{account_id}/debit`.
///
/// Parameter values are percent-decoded by the router, then encoded with
/// [`encode_component`](dlock::key_template::encode_component), exactly as the
/// `#[distributed_lock]` macro encodes argument values, so the same template locks the same key
/// from both. A placeholder that names no parameter of the route is a configuration mistake,
/// answered with 500 and logged; a parameter that is not UTF-8 once decoded is answered with 400.
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
    fn make_key(&self, parts: &mut Parts) -> Result<Option<String>, LockError> {
        if self.template.placeholders().next().is_none() {
            return self
                .template
                .render(|_| None::<&str>)
                .map(Some)
                .map_err(LockError::from);
        }
        let params = raw_path_params(parts)?;
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
                 route `{}`; placeholders must name the route's `{{param}}` segments",
                self.template.as_str().escape_debug(),
                name.escape_debug(),
                matched_path(parts).escape_debug(),
            ))),
            Err(other) => Err(other.into()),
        }
    }
}

fn matched_path(parts: &Parts) -> &str {
    parts
        .extensions
        .get::<axum::extract::MatchedPath>()
        .map_or("?", |path| path.as_str())
}

/// The route's path parameters. The extractor is synchronous inside (it reads the request's
/// extensions), so one poll completes it.
fn raw_path_params(parts: &mut Parts) -> Result<RawPathParams, LockError> {
    let poll = {
        let future = pin!(RawPathParams::from_request_parts(parts, &()));
        future.poll(&mut Context::from_waker(Waker::noop()))
    };
    match poll {
        Poll::Ready(Ok(params)) => Ok(params),
        Poll::Ready(Err(rejection)) if rejection.status().is_client_error() => {
            Err(LockError::InvalidKey {
                reason: "a path parameter is not valid UTF-8 once percent-decoded".to_owned(),
            })
        }
        Poll::Ready(Err(_)) | Poll::Pending => Err(LockError::config(
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
    fn make_key(&self, parts: &mut Parts) -> Result<Option<String>, LockError> {
        Ok((self.0)(parts))
    }
}
