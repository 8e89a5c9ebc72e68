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
