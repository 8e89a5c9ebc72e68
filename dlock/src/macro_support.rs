//! Support items for the code `#[distributed_lock]` generates. Not a public API: names and
//! signatures here change whenever the macro needs them to.

pub use crate::key_template::KeyBuilder;
pub use crate::{LockError, LockGuard, LockProvider, LockedCommand};
pub use core::time::Duration;

/// Ends the run of an annotated function: converts a failed acquisition into the function's
/// error, or releases the lock after the body and waits for the store to have it back, so the
/// lock is free when the function returns.
///
/// When the body returned `Ok`, a failed release (notably [`LockError::Lost`]: the body's work
/// may have overlapped with another holder's) becomes the function's error. When the body
/// returned `Err`, that error is what the caller sees; a failed release is then only logged.
///
/// One function for both ends, so an error type without `From<LockError>` is reported once.
pub async fn finish<T, E>(run: Result<(LockGuard, Result<T, E>), LockError>) -> Result<T, E>
where
    E: From<LockError>,
{
    let (guard, output) = run.map_err(E::from)?;
    let released = guard.release().await;
    match (output, released) {
        (Ok(value), Ok(())) => Ok(value),
        (Ok(_), Err(err)) => Err(E::from(err)),
        (Err(err), Ok(())) => Err(err),
        (Err(err), Err(release_err)) => {
            tracing::warn!(error = %release_err, "releasing the lock of a function that failed also failed");
            Err(err)
        }
    }
}

/// Runs `body` until it completes or the lock of `guard` is lost, whichever comes first
/// (`on_lost = cancel`): `None` when the lock was lost, and `body` has then been dropped.
///
/// The loss is checked before each poll of the body, with [`LockGuard::is_lost`] (which also
/// notices a leased lock whose local deadline has passed), and awaited through the lost token.
pub async fn until_lost<F: core::future::Future>(guard: &LockGuard, body: F) -> Option<F::Output> {
    let mut lost = core::pin::pin!(guard.lost_token().cancelled());
    let mut body = core::pin::pin!(body);
    core::future::poll_fn(|cx| {
        if guard.is_lost() || lost.as_mut().poll(cx).is_ready() {
            return core::task::Poll::Ready(None);
        }
        body.as_mut().poll(cx).map(Some)
    })
    .await
}

/// [`finish`] for `on_lost = cancel`: a body stopped by the loss of the lock (`None`) ends the
/// function with [`LockError::Lost`] at once. The guard is dropped, so the release runs in the
/// background: a lost lock's store may be the very thing that stopped answering.
pub async fn finish_unless_lost<T, E>(
    run: Result<(LockGuard, Option<Result<T, E>>), LockError>,
) -> Result<T, E>
where
    E: From<LockError>,
{
    let (guard, output) = run.map_err(E::from)?;
    match output {
        Some(output) => finish(Ok((guard, output))).await,
        None => {
            let key = std::sync::Arc::from(guard.key());
            drop(guard);
            Err(E::from(LockError::Lost {
                key,
                reason: "ownership was lost while the function ran; its body was stopped \
                         (on_lost = cancel)"
                    .to_owned(),
            }))
        }
    }
}
