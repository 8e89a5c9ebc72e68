//! `LockBuilder::with_lock`: the caller's cancellation token ends the wait, and `f`'s token
//! follows both the caller's token and the loss of the lock. On SQLite, with a lock broken
//! for real (another owner takes its row over).
#![cfg(feature = "sqlite")]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use dlock::sqlite::SqliteBackend;
use dlock::{CancellationToken, LockError, LockProvider};
use tempfile::TempDir;
use tokio::sync::oneshot;

/// Two providers on one lock file (two replicas), with a short lease renewed every 300 ms.
async fn two_providers() -> (TempDir, LockProvider, LockProvider) {
    let dir = tempfile::tempdir().expect("temp dir");
    let mut providers = Vec::new();
    for _ in 0..2 {
        let backend = SqliteBackend::builder(dir.path().join("locks.db"))
            .lease(Duration::from_millis(900))
            .open()
            .await
            .expect("open lock file");
        providers.push(LockProvider::from_backend(backend));
    }
    let b = providers.pop().expect("b");
    let a = providers.pop().expect("a");
    (dir, a, b)
}

/// Guards a test against hanging when what it waits for never comes.
async fn within<T>(what: &str, future: impl Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(30), future)
        .await
        .unwrap_or_else(|_| panic!("{what} did not happen within 30 s"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_callers_token_ends_the_wait_with_canceled_and_f_does_not_run() {
    let (_dir, a, b) = two_providers().await;
    let held = a.try_acquire("reports:daily").await.expect("hold");
    let token = CancellationToken::new();
    let ran = Arc::new(AtomicBool::new(false));
    // No timeout: only the token can end this wait.
    let waiter = b.clone();
    let waiting = tokio::spawn({
        let (token, ran) = (token.clone(), Arc::clone(&ran));
        async move {
            waiter
                .lock("reports:daily")
                .cancel_on(&token)
                .with_lock(|_| async move { ran.store(true, Ordering::SeqCst) })
                .await
        }
    });
    // Cancelled mid-wait: once `b` has the key in its table (it is acquiring it).
    within("the start of the wait", async {
        while b.local_key_count() == 0 {
            tokio::task::yield_now().await;
        }
    })
    .await;
    assert!(!waiting.is_finished());
    token.cancel();
    let result = within("the end of the wait", waiting).await.expect("task");
    assert!(
        matches!(result, Err(LockError::Canceled { ref key }) if &**key == "reports:daily"),
        "{result:?}"
    );
    assert!(!ran.load(Ordering::SeqCst));
    held.release().await.expect("release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn once_held_the_callers_token_reaches_f_and_its_output_is_returned() {
    let (_dir, a, b) = two_providers().await;
    let token = CancellationToken::new();
    let (started_tx, started_rx) = oneshot::channel();
    let run = tokio::spawn({
        let token = token.clone();
        async move {
            b.lock("reports:daily")
                .timeout(Duration::from_secs(5))
                .cancel_on(&token)
                .with_lock(|stop| async move {
                    let _ = started_tx.send(());
                    stop.cancelled().await;
                    "stopped cleanly"
                })
                .await
        }
    });
    within("the start of f", started_rx)
        .await
        .expect("f started");
    // Held by `b` while `f` runs.
    assert!(matches!(
        a.try_acquire("reports:daily").await,
        Err(LockError::AlreadyHeld { .. })
    ));
    token.cancel();
    let result = within("the end of f", run).await.expect("task");
    assert_eq!(result.expect("f's output"), "stopped cleanly");
    // Released on the way out.
    let guard = a.try_acquire("reports:daily").await.expect("free");
    guard.release().await.expect("release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_lock_fires_fs_token_and_the_result_is_lost() {
    let (dir, _a, b) = two_providers().await;
    let token = CancellationToken::new();
    let (started_tx, started_rx) = oneshot::channel();
    let run = tokio::spawn({
        let token = token.clone();
        async move {
            b.lock("reports:daily")
                .cancel_on(&token)
                .with_lock(|stop| async move {
                    let _ = started_tx.send(());
                    // Only the loss below (the caller's token is never cancelled) ends this.
                    stop.cancelled().await;
                    "stopped"
                })
                .await
        }
    });
    within("the start of f", started_rx)
        .await
        .expect("f started");
    let conn = rusqlite::Connection::open(dir.path().join("locks.db")).expect("open");
    let changed = conn
        .execute(
            "UPDATE __distributed_locks SET owner = X'00' WHERE name = ?1",
            [b"reports:daily".as_slice()],
        )
        .expect("steal row");
    assert_eq!(changed, 1);
    let result = within("the end of f", run).await.expect("task");
    assert!(
        matches!(result, Err(LockError::Lost { ref key, .. }) if &**key == "reports:daily"),
        "{result:?}"
    );
    assert!(!token.is_cancelled(), "the caller's token is the caller's");
}
