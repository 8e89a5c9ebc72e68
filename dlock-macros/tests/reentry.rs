//! Locks are not reentrant: a `#[distributed_lock]` function that, in its body, takes a key it
//! already holds (by calling another such function, or by hand) is told so at once with
//! `LockError::Reentrant`, instead of waiting its whole timeout for itself.

use std::time::{Duration, Instant};

use dlock::{LockError, LockProvider, distributed_lock};

async fn provider() -> (tempfile::TempDir, LockProvider) {
    let dir = tempfile::tempdir().expect("temp dir");
    let url = format!("sqlite://{}/locks.db", dir.path().display());
    let locks = LockProvider::connect(&url).await.expect("connect");
    (dir, locks)
}

#[distributed_lock("account:{id}", timeout = 5)]
async fn credit(locks: &LockProvider, id: u64) -> Result<u64, LockError> {
    Ok(id)
}

/// Holds `account:{id}` and calls `credit` on the same account.
#[distributed_lock("account:{id}", timeout = 5)]
async fn refund(locks: &LockProvider, id: u64) -> Result<u64, LockError> {
    credit(locks, id).await
}

/// Holds both accounts and takes one of them by hand; then a reader reads again.
#[distributed_lock(keys("account:{from}", "account:{to}"), timeout = 5)]
async fn transfer(locks: &LockProvider, from: u64, to: u64) -> Result<(), LockError> {
    let again = locks
        .acquire(&format!("account:{to}"), Duration::from_secs(5))
        .await?;
    again.release().await
}

#[distributed_lock("prices:{region}", mode = read, timeout = 5)]
async fn quote(locks: &LockProvider, region: &str) -> Result<u64, LockError> {
    let again = locks
        .acquire_read(&format!("prices:{region}"), Duration::from_secs(5))
        .await?;
    again.release().await?;
    Ok(42)
}

#[tokio::test(flavor = "current_thread")]
async fn a_function_taking_its_own_key_again_is_told_at_once() {
    let (_dir, locks) = provider().await;
    let started = Instant::now();
    let err = refund(&locks, 7).await.expect_err("reentrant");
    assert!(
        matches!(&err, LockError::Reentrant { key } if &**key == "account:7"),
        "{err:?}"
    );
    assert!(
        err.to_string()
            .contains("already held by this request (locks are not reentrant)"),
        "{err}"
    );
    let err = transfer(&locks, 1, 2).await.expect_err("reentrant");
    assert!(
        matches!(&err, LockError::Reentrant { key } if &**key == "account:2"),
        "{err:?}"
    );
    // Far below the 5 s timeouts: nothing waited.
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "{:?}",
        started.elapsed()
    );
    // Readers share: a reader may read its key again.
    assert_eq!(quote(&locks, "eu").await.expect("readers share"), 42);
    // Outside the functions the keys are free, and the function works on its own.
    assert_eq!(credit(&locks, 7).await.expect("free"), 7);
}

/// The scope is the task's: work the function spawns is another task, whose acquisition is
/// ordinary contention (here one try, while the function holds the key).
#[tokio::test(flavor = "current_thread")]
async fn a_spawned_task_is_not_the_holder() {
    let (_dir, locks) = provider().await;
    #[distributed_lock("job:{name}", timeout = 5)]
    async fn run(locks: &LockProvider, name: &str) -> Result<LockError, LockError> {
        let other = locks.clone();
        let key = format!("job:{name}");
        let spawned = tokio::spawn(async move { other.try_acquire(&key).await.map(drop) });
        Ok(spawned.await.expect("spawned").expect_err("held"))
    }
    let err = run(&locks, "nightly").await.expect("ran");
    assert!(matches!(err, LockError::AlreadyHeld { .. }), "{err:?}");
}
