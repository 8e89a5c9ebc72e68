//! The service: one lock per request around the inner service.

use std::fmt;
use std::future::poll_fn;
use std::pin::pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::response::{IntoResponse, Response};
use dlock::{CancellationToken, LockError, LockGuard};
use http::Request;
use tower_service::Service;

use crate::future::ResponseFuture;
use crate::held::HeldLock;
use crate::key::{KeyRejection, MakeLockKeys, PathKey};
use crate::layer::{Mode, OnLost, Shared};
use crate::rejection::LockRejection;

/// The service [`LockLayer`](crate::LockLayer) wraps around a route: see the layer for what it
/// does with each request.
pub struct LockService<S, K = PathKey> {
    inner: S,
    shared: Arc<Shared<K>>,
}

impl<S, K> LockService<S, K> {
    pub(crate) fn new(inner: S, shared: Arc<Shared<K>>) -> Self {
        LockService { inner, shared }
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// The inner service, consuming this one.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S: Clone, K> Clone for LockService<S, K> {
    fn clone(&self) -> Self {
        LockService {
            inner: self.inner.clone(),
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<S: fmt::Debug, K: fmt::Debug> fmt::Debug for LockService<S, K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut s = f.debug_struct("LockService");
        s.field("inner", &self.inner);
        self.shared.fmt_fields(s)
    }
}

impl<S, K, B> Service<Request<B>> for LockService<S, K>
where
    S: Service<Request<B>> + Clone + Send + 'static,
    S::Response: IntoResponse,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    K: MakeLockKeys,
    B: Send + 'static,
{
    type Response = Response;
    type Error = S::Error;
    type Future = ResponseFuture<S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        // The service that was driven to readiness goes with this request; a clone stays.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        ResponseFuture::new(Box::pin(handle(Arc::clone(&self.shared), inner, request)))
    }
}

async fn handle<S, K, B>(
    shared: Arc<Shared<K>>,
    mut inner: S,
    request: Request<B>,
) -> Result<Response, S::Error>
where
    S: Service<Request<B>>,
    S::Response: IntoResponse,
    K: MakeLockKeys,
{
    let (mut parts, body) = request.into_parts();
    // The path is copied only for a rejection: a `Uri` from the server shares its bytes.
    let uri = parts.uri.clone();
    let reject = |err: LockRejection| {
        Ok(err
            .with_instance(uri.path())
            .with_retry_after(shared.retry_after)
            .into_response())
    };

    let mut keys = match shared.make_key.make_keys(&mut parts).await {
        Ok(keys) if keys.is_empty() => {
            let response = inner.call(Request::from_parts(parts, body)).await?;
            return Ok(response.into_response());
        }
        Ok(keys) => keys,
        Err(KeyRejection::Lock(err)) => return reject(err.into()),
        Err(KeyRejection::Response(response)) => return Ok(response),
    };
    keys.sort_unstable();
    keys.dedup();
    if let Some(key) = keys.iter().find(|key| key.len() > shared.max_key_len) {
        return reject(
            LockError::InvalidKey {
                reason: format!(
                    "the lock key would be {} bytes long, more than the {} this route accepts",
                    key.len(),
                    shared.max_key_len
                ),
            }
            .into(),
        );
    }

    let guards = match acquire(&shared, &keys).await {
        Ok(guards) => guards,
        Err(rejection) => return reject(rejection),
    };

    // One lock: the handler's lost token is the guard's own. Several: a token of the request's,
    // cancelled below as soon as any of them is lost.
    let lost = match guards.as_slice() {
        [guard] => guard.lost_token().clone(),
        _ => CancellationToken::new(),
    };
    parts
        .extensions
        .insert(HeldLock::new(&guards, lost.clone()));
    let cancel_on_loss = shared.on_lost == OnLost::Cancel;
    // In a block of its own: the handler's future is dropped at its end, before the guards.
    let outcome = {
        // One lock: its token is `lost`, watched without a box. Several: each guard's.
        let mut signal = pin!(lost.cancelled());
        let mut signals: Vec<_> = match guards.as_slice() {
            [_] => Vec::new(),
            _ => guards
                .iter()
                .map(|guard| Box::pin(guard.lost_token().cancelled()))
                .collect(),
        };
        // The handler runs as the holder of the request's locks: taking one of them again
        // (a `#[distributed_lock]` function on the same key) fails at once with `Reentrant`
        // instead of waiting for a lock this request holds.
        let mut call = pin!(dlock::run_holding(
            &guards,
            inner.call(Request::from_parts(parts, body))
        ));
        poll_fn(|cx| {
            // `is_lost` also compares the clock with a leased lock's deadline, and cancels
            // the lost token when it has passed: the handler's `HeldLock` sees what the
            // guards know.
            let lost_now = guards.iter().any(LockGuard::is_lost)
                | signals.iter_mut().fold(false, |any, signal| {
                    signal.as_mut().poll(cx).is_ready() | any
                })
                | (guards.len() == 1 && signal.as_mut().poll(cx).is_ready());
            if lost_now {
                lost.cancel();
                if cancel_on_loss {
                    return Poll::Ready(None);
                }
            }
            call.as_mut()
                .poll(cx)
                .map(|result| Some(result.map(IntoResponse::into_response)))
        })
        .await
    };
    match outcome {
        // The handler's future was dropped mid-way, at the end of the block above.
        None => {
            let key = guards
                .iter()
                .find(|guard| guard.is_lost())
                .unwrap_or(&guards[0])
                .key()
                .into();
            drop(guards);
            reject(
                LockError::Lost {
                    key,
                    reason: "ownership ended while the handler ran".to_owned(),
                }
                .into(),
            )
        }
        Some(result) => {
            let response = result?;
            for guard in guards {
                match guard.release().await {
                    Ok(()) => {}
                    // `OnLost::Continue`: the handler saw the loss through its `HeldLock` and
                    // answered as it saw fit.
                    Err(err @ LockError::Lost { .. }) => {
                        tracing::warn!(
                            error = %err,
                            "the request's lock was lost while the handler ran on \
                             (OnLost::Continue); its response is sent as it is"
                        );
                    }
                    Err(err) => {
                        tracing::warn!(
                            error = &err as &(dyn std::error::Error + 'static),
                            "releasing the request's lock failed; the store frees it when its \
                             lease or session ends"
                        );
                    }
                }
            }
            Ok(response)
        }
    }
}

/// Takes the locks within the layer's timeout and waiter limit: `keys` (sorted, distinct, at
/// least one) all or none.
async fn acquire<K>(shared: &Shared<K>, keys: &[String]) -> Result<Vec<LockGuard>, LockRejection> {
    if keys.len() > 1 && shared.mode != Mode::Exclusive {
        return Err(LockError::config(
            "this layer makes several keys for a request, and takes several keys only as \
             exclusive locks: remove `read()` or `permits(..)`, or make one key",
        )
        .into());
    }
    if shared.timeout.is_zero() {
        return Ok(take(shared, keys, Duration::ZERO).await?);
    }
    let permit = match &shared.waiters {
        None => None,
        Some(waiters) => match Arc::clone(waiters).try_acquire_owned() {
            Ok(permit) => Some(permit),
            // Full: no waiting for this one, but free locks are still taken.
            Err(_) => {
                return match take(shared, keys, Duration::ZERO).await {
                    Ok(guards) => Ok(guards),
                    Err(LockError::AlreadyHeld { .. }) => Err(LockRejection::too_many_waiters()),
                    Err(err) => Err(err.into()),
                };
            }
        },
    };
    let result = take(shared, keys, shared.timeout).await;
    drop(permit);
    Ok(result?)
}

/// Takes what the layer's mode asks for: one try when `timeout` is zero.
async fn take<K>(
    shared: &Shared<K>,
    keys: &[String],
    timeout: Duration,
) -> Result<Vec<LockGuard>, LockError> {
    let provider = &shared.provider;
    let key = match keys {
        [key] => key,
        _ => {
            let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
            let many = provider.acquire_many(&keys, timeout);
            return match &shared.cancel {
                None => many.await,
                Some(token) => tokio::select! {
                    biased;
                    () = token.cancelled() => Err(LockError::Canceled { key: Arc::from(keys[0]) }),
                    many = many => many,
                },
            };
        }
    };
    if let Mode::Permits(permits) = shared.mode {
        let slot = provider.acquire_semaphore(key, permits, timeout);
        return match &shared.cancel {
            None => slot.await,
            Some(token) => tokio::select! {
                biased;
                () = token.cancelled() => Err(LockError::Canceled { key: Arc::from(key.as_str()) }),
                slot = slot => slot,
            },
        }
        .map(|guard| vec![guard]);
    }
    let mut builder = provider.lock(key);
    if shared.mode == Mode::Read {
        builder = builder.read();
    }
    if let Some(token) = &shared.cancel {
        builder = builder.cancel_on(token);
    }
    if timeout.is_zero() {
        builder.try_acquire().await
    } else {
        builder.timeout(timeout).acquire().await
    }
    .map(|guard| vec![guard])
}
