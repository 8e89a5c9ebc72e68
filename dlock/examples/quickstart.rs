//! The README's core-API snippet, as it is there (a test in `tests/docs.rs` keeps the two
//! the same): one try, a wait with a closure, a wait under a cancellation token.
//!
//! Run with `cargo run -p dlock-rs --example quickstart` (the lock file `locks.db` goes to the
//! current directory). On another store: `DLOCK_URL=redis://127.0.0.1:6379 cargo run -p
//! dlock-rs --features redis --example quickstart` (or `postgres`, `mysql`, `etcd`, ... with
//! their URLs).

use dlock::{CancellationToken, LockError, LockProvider};
use std::time::Duration;

#[tokio::main]
async fn main() -> Result<(), LockError> {
    // SQLite by default; DLOCK_URL=redis://127.0.0.1:6379 (with `--features redis`) or any
    // other store's URL runs the same code there.
    let url = std::env::var("DLOCK_URL").unwrap_or_else(|_| "sqlite://locks.db".to_owned());
    let locks = LockProvider::connect(&url).await?;

    // One try: contention is Err(LockError::AlreadyHeld { .. }).
    match locks.try_acquire("jobs:monthly-billing").await {
        Ok(guard) => {
            // ... run the job, passing guard.fencing_token() to what it writes;
            // stop if guard.lost_token() fires ...
            guard.release().await?;
        }
        Err(LockError::AlreadyHeld { .. }) => println!("another replica runs it"),
        Err(other) => return Err(other),
    }

    // Wait up to 10 s; the closure gets the lost-lock token.
    let total = locks
        .with_lock("reports:daily", Duration::from_secs(10), |_lost| async {
            42
        })
        .await?;

    // The same under the caller's cancellation token: cancelling it ends the wait with
    // Err(LockError::Canceled { .. }); once held, the closure's token fires on either
    // the caller's token or the loss of the lock.
    let shutdown = CancellationToken::new();
    let sent = locks
        .lock("reports:weekly")
        .timeout(Duration::from_secs(10))
        .cancel_on(&shutdown)
        .with_lock(|stop| async move { if stop.is_cancelled() { 0 } else { 7 } })
        .await?;
    println!("{total} {sent}");
    Ok(())
}
