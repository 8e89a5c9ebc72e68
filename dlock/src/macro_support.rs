//! Support items for the code `#[distributed_lock]` generates. Not a public API: names and
//! signatures here change whenever the macro needs them to.

pub use crate::key_template::KeyBuilder;
pub use crate::run_holding;
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

/// Runs the body of a one-key function as the holder of its lock (see [`run_holding`]): the
/// body taking the same key again fails at once with [`LockError::Reentrant`].
pub fn holding<F: core::future::Future>(
    guard: &LockGuard,
    body: F,
) -> impl core::future::Future<Output = F::Output> + use<F> {
    run_holding(core::slice::from_ref(guard), body)
}

/// Runs `body` until it completes or the lock of `guard` is lost, whichever comes first
/// (`on_lost = cancel`): `None` when the lock was lost, and `body` has then been dropped.
///
/// The loss is checked before each poll of the body, with [`LockGuard::is_lost`] (which also
/// notices a leased lock whose local deadline has passed), and awaited through the lost token.
/// The body runs as the holder of the lock, as with [`holding`].
pub async fn until_lost<F: core::future::Future>(guard: &LockGuard, body: F) -> Option<F::Output> {
    let mut lost = core::pin::pin!(guard.lost_token().cancelled());
    let mut body = core::pin::pin!(holding(guard, body));
    core::future::poll_fn(|cx| {
        if guard.is_lost() || lost.as_mut().poll(cx).is_ready() {
            return core::task::Poll::Ready(None);
        }
        body.as_mut().poll(cx).map(Some)
    })
    .await
}

/// Runs `body` to its end (`on_lost = finish`), checking the lease's clock before each poll
/// of it with [`LockGuard::is_lost`]: after a pause past the lease, the guard's lost token is
/// cancelled before the body's next step, whatever task would have cancelled it.
pub async fn checked<F: core::future::Future>(guard: &LockGuard, body: F) -> F::Output {
    guard.checked(body).await
}

/// [`checked`] for several guards.
pub async fn checked_many<F: core::future::Future>(guards: &[LockGuard], body: F) -> F::Output {
    let mut body = core::pin::pin!(body);
    core::future::poll_fn(|cx| {
        for guard in guards {
            let _ = guard.is_lost();
        }
        body.as_mut().poll(cx)
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

/// Takes the keys of a `keys(...)` function, all or none, through
/// [`LockProvider::acquire_many`] (one try each when `timeout` is zero). A key rendered twice
/// (`transfer(a, a)` on `keys("account:{from}", "account:{to}")`) is taken once: the guards
/// are one per distinct key, in the order the keys were first written.
pub async fn acquire_many(
    provider: &LockProvider,
    keys: &[String],
    timeout: Duration,
) -> Result<Vec<LockGuard>, LockError> {
    let mut distinct: Vec<&str> = Vec::with_capacity(keys.len());
    for key in keys {
        if !distinct.contains(&key.as_str()) {
            distinct.push(key);
        }
    }
    provider.acquire_many(&distinct, timeout).await
}

/// Takes one of the `permits` permits of the semaphore `key` (`permits = N`): a single try
/// when `timeout` is zero, answering [`LockError::AlreadyHeld`] as a one-try lock does.
pub async fn acquire_semaphore(
    provider: &LockProvider,
    key: &str,
    permits: u32,
    timeout: Duration,
) -> Result<LockGuard, LockError> {
    if timeout.is_zero() {
        provider.try_acquire_semaphore(key, permits).await
    } else {
        provider.acquire_semaphore(key, permits, timeout).await
    }
}

/// [`finish`] for several guards (`keys(...)`): every guard is released, and the releases
/// awaited, whatever the body returned. When the body returned `Ok`, a failed release becomes
/// the function's error, [`LockError::Lost`] first if any release reports it.
pub async fn finish_many<T, E>(
    run: Result<(Vec<LockGuard>, Result<T, E>), LockError>,
) -> Result<T, E>
where
    E: From<LockError>,
{
    let (guards, output) = run.map_err(E::from)?;
    let mut failures = Vec::new();
    for guard in guards {
        if let Err(err) = guard.release().await {
            failures.push(err);
        }
    }
    let first = failures
        .iter()
        .position(|err| matches!(err, LockError::Lost { .. }))
        .unwrap_or(0);
    let failure = (!failures.is_empty()).then(|| failures.swap_remove(first));
    for other in &failures {
        tracing::warn!(error = %other, "releasing another lock of the function also failed");
    }
    match (output, failure) {
        (Ok(value), None) => Ok(value),
        (Ok(_), Some(err)) => Err(E::from(err)),
        (Err(err), None) => Err(err),
        (Err(err), Some(release_err)) => {
            tracing::warn!(error = %release_err, "releasing the locks of a function that failed also failed");
            Err(err)
        }
    }
}

/// [`until_lost`] for several guards: `None` as soon as any of them is lost. The body runs as
/// the holder of every lock (see [`run_holding`]).
pub async fn until_any_lost<F: core::future::Future>(
    guards: &[LockGuard],
    body: F,
) -> Option<F::Output> {
    let mut lost: Vec<_> = guards
        .iter()
        .map(|guard| Box::pin(guard.lost_token().cancelled()))
        .collect();
    let mut body = core::pin::pin!(run_holding(guards, body));
    core::future::poll_fn(|cx| {
        if guards.iter().any(LockGuard::is_lost)
            || lost
                .iter_mut()
                .any(|lost| lost.as_mut().poll(cx).is_ready())
        {
            return core::task::Poll::Ready(None);
        }
        body.as_mut().poll(cx).map(Some)
    })
    .await
}

/// What an `on_lost = cancel` function with `keys(...)` ends with: its guards and the body's
/// output, `None` when the body was stopped by a loss.
pub type StoppableRun<T, E> = Result<(Vec<LockGuard>, Option<Result<T, E>>), LockError>;

/// [`finish_many`] for `on_lost = cancel`: a body stopped by the loss of any of its locks
/// (`None`) ends the function with [`LockError::Lost`] (naming the lost key) at once; the
/// guards are dropped, so their release runs in the background.
pub async fn finish_many_unless_lost<T, E>(run: StoppableRun<T, E>) -> Result<T, E>
where
    E: From<LockError>,
{
    let (guards, output) = run.map_err(E::from)?;
    match output {
        Some(output) => finish_many(Ok((guards, output))).await,
        None => {
            let lost = guards
                .iter()
                .find(|guard| guard.is_lost())
                .or_else(|| guards.first())
                .map_or_else(
                    || std::sync::Arc::from(""),
                    |guard| std::sync::Arc::from(guard.key()),
                );
            drop(guards);
            Err(E::from(LockError::Lost {
                key: lost,
                reason: "ownership of one of the function's locks was lost while it ran; its \
                         body was stopped (on_lost = cancel)"
                    .to_owned(),
            }))
        }
    }
}
