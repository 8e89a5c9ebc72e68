//! Locks are not reentrant: work that runs while holding a lock and asks for the same key again,
//! in the same task, would wait for itself. [`run_holding`] marks the locks a task's work holds,
//! so that such an acquisition fails at once with [`LockError::Reentrant`] instead.

use std::future::Future;
use std::sync::Arc;

use crate::{LockError, LockGuard};

/// One lock a task holds: the in-process table it was taken through (a provider and its
/// clones share one), its key, and whether it is a read lock.
#[derive(Clone)]
struct Held {
    table: usize,
    key: Arc<str>,
    shared: bool,
}

tokio::task_local! {
    /// The locks the current task's work holds, innermost scope included.
    static HELD: Arc<[Held]>;
}

/// Runs `work` as the holder of `guards`: while it runs, an acquisition made in this task (in
/// `work`, or anything it awaits) of a key one of the guards holds, through the same provider
/// or one of its clones, fails at once with [`LockError::Reentrant`] rather than wait for a
/// lock its own task holds, which only the end of `work` could release.
///
/// Locks are not reentrant: taking a held key again is contention, and from inside the holder
/// it is a wait that can only time out. `dlock_axum::LockLayer` runs every handler this way,
/// and `#[distributed_lock]` runs its function's body this way, so a handler behind the layer
/// that calls a `#[distributed_lock]` function on the same key gets `Reentrant` (an HTTP 500
/// that says why) at once, not a timeout. Read locks may be taken again as read locks (readers
/// share a key); any other pair is refused. Scopes nest: an inner scope adds its guards to the
/// outer one's.
///
/// Only this task is covered: a task spawned from `work` starts without the scope (its
/// acquisition is ordinary contention, as from any other task), and a provider with its own
/// in-process table (made by another `connect` or `from_backend`, even on the same store) is
/// not compared.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), dlock::LockError> {
/// # let dir = tempfile::tempdir().unwrap();
/// # let url = format!("sqlite://{}/locks.db", dir.path().display());
/// let locks = dlock::LockProvider::connect(&url).await?;
/// let guard = locks.try_acquire("invoices:42").await?;
/// let again = dlock::run_holding(std::slice::from_ref(&guard), async {
///     locks.acquire("invoices:42", std::time::Duration::from_secs(10)).await
/// })
/// .await;
/// // At once, not after ten seconds.
/// assert!(matches!(again, Err(dlock::LockError::Reentrant { .. })));
/// guard.release().await?;
/// # Ok(()) }
/// ```
///
/// # Cancel safety
///
/// Dropping the returned future drops `work`; the guards are the caller's and stay held.
pub fn run_holding<F: Future>(
    guards: &[LockGuard],
    work: F,
) -> impl Future<Output = F::Output> + use<F> {
    let outer = HELD.try_with(Arc::clone).ok();
    let mut held: Vec<Held> = outer.as_deref().map(<[Held]>::to_vec).unwrap_or_default();
    held.extend(guards.iter().filter_map(|guard| {
        let (table, key, shared) = guard.held_entry()?;
        Some(Held { table, key, shared })
    }));
    HELD.scope(held.into(), work)
}

/// The answer for an acquisition of `key` (`shared` for a read lock) through the table
/// `table`: [`LockError::Reentrant`] when this task's work already holds it.
pub(crate) fn check(table: usize, key: &str, shared: bool) -> Result<(), LockError> {
    let conflict = HELD
        .try_with(|held| {
            held.iter()
                .find(|h| h.table == table && &*h.key == key && !(h.shared && shared))
                .map(|h| Arc::clone(&h.key))
        })
        .ok()
        .flatten();
    match conflict {
        None => Ok(()),
        Some(key) => Err(LockError::Reentrant { key }),
    }
}
