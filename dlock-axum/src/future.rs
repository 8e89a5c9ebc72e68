//! The layer's response future.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use axum::response::Response;

type BoxFuture<E> = Pin<Box<dyn Future<Output = Result<Response, E>> + Send + 'static>>;

/// The response future of [`LockService`](crate::LockService).
///
/// It owns the whole request: making the key, waiting for the lock, the [`LockGuard`] and the
/// inner service's future. So the lock is held exactly while this
/// future runs the handler, and is released when it completes or when it is dropped (the
/// client went away, a timeout layer above gave up); release on drop happens in the
/// background, as for any dropped guard.
///
/// [`LockGuard`]: dlock::LockGuard
#[must_use = "futures do nothing unless polled"]
pub struct ResponseFuture<E> {
    inner: BoxFuture<E>,
}

impl<E> ResponseFuture<E> {
    pub(crate) fn new(inner: BoxFuture<E>) -> Self {
        ResponseFuture { inner }
    }
}

impl<E> Future for ResponseFuture<E> {
    type Output = Result<Response, E>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.inner.as_mut().poll(cx)
    }
}

impl<E> fmt::Debug for ResponseFuture<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}
