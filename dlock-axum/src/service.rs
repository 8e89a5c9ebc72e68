//! The service: one lock per request around the inner service.

use std::fmt;
use std::future::poll_fn;
use std::pin::pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::response::{IntoResponse, Response};
use dlock::{LockError, LockGuard};
use http::Request;
use tower_service::Service;

use crate::future::ResponseFuture;
use crate::held::HeldLock;
use crate::key::{KeyRejection, MakeLockKey, PathKey};
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
    K: MakeLockKey,
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
    K: MakeLockKey,
{
    let (mut parts, body) = request.into_parts();
    let instance = parts.uri.path().to_owned();
    let reject = |err: LockRejection| {
        Ok(err
            .with_instance(instance.as_str())
            .with_retry_after(shared.retry_after)
            .into_response())
    };

    let key = match shared.make_key.make_key(&mut parts).await {
        Ok(Some(key)) => key,
        Ok(None) => {
            let response = inner.call(Request::from_parts(parts, body)).await?;
            return Ok(response.into_response());
        }
        Err(KeyRejection::Lock(err)) => return reject(err.into()),
        Err(KeyRejection::Response(response)) => return Ok(response),
    };
    if key.len() > shared.max_key_len {
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

    let guard = match acquire(&shared, &key).await {
        Ok(guard) => guard,
        Err(rejection) => return reject(rejection),
    };

    parts.extensions.insert(HeldLock::new(&guard));
    let cancel_on_loss = shared.on_lost == OnLost::Cancel;
    let lost = guard.lost_token().clone();
    // In a block of its own: the handler's future is dropped at its end, before the guard.
    let outcome = {
        let mut lost_signal = pin!(lost.cancelled());
        let mut call = pin!(inner.call(Request::from_parts(parts, body)));
        poll_fn(|cx| {
            // `is_lost` also compares the clock with a leased lock's deadline, and cancels
            // the lost token when it has passed: the handler's `HeldLock` sees what the
            // guard knows.
            let lost = guard.is_lost();
            if cancel_on_loss && (lost || lost_signal.as_mut().poll(cx).is_ready()) {
                return Poll::Ready(None);
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
            let key = guard.key().into();
            drop(guard);
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
            match guard.release().await {
                Ok(()) => {}
                // `OnLost::Continue`: the handler saw the loss through its `HeldLock` and
                // answered as it saw fit.
                Err(err @ LockError::Lost { .. }) => {
                    tracing::warn!(
                        error = %err,
                        "the request's lock was lost while the handler ran on (OnLost::Continue); \
                         its response is sent as it is"
                    );
                }
                Err(err) => {
                    tracing::warn!(
                        error = &err as &(dyn std::error::Error + 'static),
                        "releasing the request's lock failed; the store frees it when its lease \
                         or session ends"
                    );
                }
            }
            Ok(response)
        }
    }
}

/// Takes the lock within the layer's timeout and waiter limit.
async fn acquire<K>(shared: &Shared<K>, key: &str) -> Result<LockGuard, LockRejection> {
    if shared.timeout.is_zero() {
        return Ok(take(shared, key, Duration::ZERO).await?);
    }
    let permit = match &shared.waiters {
        None => None,
        Some(waiters) => match Arc::clone(waiters).try_acquire_owned() {
            Ok(permit) => Some(permit),
            // Full: no waiting for this one, but a free lock is still taken.
            Err(_) => {
                return match take(shared, key, Duration::ZERO).await {
                    Ok(guard) => Ok(guard),
                    Err(LockError::AlreadyHeld { .. }) => Err(LockRejection::too_many_waiters()),
                    Err(err) => Err(err.into()),
                };
            }
        },
    };
    let result = take(shared, key, shared.timeout).await;
    drop(permit);
    Ok(result?)
}

/// Takes what the layer's mode asks for: one try when `timeout` is zero.
async fn take<K>(shared: &Shared<K>, key: &str, timeout: Duration) -> Result<LockGuard, LockError> {
    let provider = &shared.provider;
    if let Mode::Permits(permits) = shared.mode {
        let slot = provider.acquire_semaphore(key, permits, timeout);
        return match &shared.cancel {
            None => slot.await,
            Some(token) => tokio::select! {
                biased;
                () = token.cancelled() => Err(LockError::Canceled { key: Arc::from(key) }),
                slot = slot => slot,
            },
        };
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
}
