//! `on_lost` at run time, on SQLite: a lock is broken for real (another owner takes its row
//! over in the lock file), and the renewal finds it gone.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use dlock::sqlite::SqliteBackend;
use dlock::{LockError, LockProvider, distributed_lock};
use tempfile::TempDir;
use tokio::sync::oneshot;

#[derive(Debug)]
enum JobError {
    Lock(LockError),
}

impl From<LockError> for JobError {
    fn from(err: LockError) -> Self {
        JobError::Lock(err)
    }
}

/// A provider on a lock file with a short lease (renewed every 300 ms), so that a broken
/// lock is found within a fraction of a second.
async fn provider() -> (TempDir, LockProvider) {
    let dir = tempfile::tempdir().expect("temp dir");
    let backend = SqliteBackend::builder(dir.path().join("locks.db"))
        .lease(Duration::from_millis(900))
        .open()
        .await
        .expect("open lock file");
    (dir, LockProvider::from_backend(backend))
}

/// Another owner takes `key`'s row over, as if the lease had run out and been taken.
fn steal(dir: &TempDir, key: &str) {
    let conn = rusqlite::Connection::open(dir.path().join("locks.db")).expect("open");
    let changed = conn
        .execute(
            "UPDATE __distributed_locks SET owner = X'00' WHERE name = ?1",
            [key.as_bytes()],
        )
        .expect("steal row");
    assert_eq!(changed, 1, "the row of {key} is in the lock file");
}

/// Runs for an hour unless stopped; tells `started` the key and fencing token it holds.
#[distributed_lock("job:{name}", on_lost = cancel, guard = lock)]
async fn long_job(
    locks: &LockProvider,
    name: &str,
    started: oneshot::Sender<(String, Option<u64>)>,
    reached_end: Arc<AtomicBool>,
) -> Result<&'static str, JobError> {
    let _ = started.send((lock.key().to_owned(), lock.fencing_token()));
    tokio::time::sleep(Duration::from_secs(3600)).await;
    reached_end.store(true, Ordering::SeqCst);
    Ok("done")
}

/// The default: runs to its end (which comes once the lock is lost), then reports `Lost`.
#[distributed_lock("job:{name}", guard = lock)]
async fn finishing_job(
    locks: &LockProvider,
    name: &str,
    started: oneshot::Sender<()>,
    reached_end: Arc<AtomicBool>,
) -> Result<&'static str, JobError> {
    let _ = started.send(());
    lock.lost_token().cancelled().await;
    reached_end.store(true, Ordering::SeqCst);
    Ok("done")
}

/// `on_lost = finish` spelled out is the default.
#[distributed_lock("job:{name}", on_lost = finish, timeout = 1)]
async fn explicit_finish(locks: &LockProvider, name: &str) -> Result<u32, JobError> {
    Ok(7)
}

#[distributed_lock("job:{name}", on_lost = cancel)]
async fn quick_job(locks: &LockProvider, name: &str) -> Result<u32, JobError> {
    tokio::task::yield_now().await;
    Ok(42)
}

#[tokio::test]
async fn on_lost_cancel_stops_the_body_and_returns_lost() {
    let (dir, locks) = provider().await;
    let reached_end = Arc::new(AtomicBool::new(false));
    let (started_tx, started_rx) = oneshot::channel();
    let job = tokio::spawn({
        let (locks, reached_end) = (locks.clone(), Arc::clone(&reached_end));
        async move { long_job(&locks, "nightly", started_tx, reached_end).await }
    });
    let (key, token) = started_rx.await.expect("the body started");
    assert_eq!(key, "job:nightly");
    assert!(token.is_some(), "`guard = lock` works beside `on_lost`");

    steal(&dir, "job:nightly");
    // The body would sleep for an hour; the job ends once the renewal finds the row taken.
    // The timeout only keeps a broken build from hanging the test run.
    let result = tokio::time::timeout(Duration::from_secs(30), job)
        .await
        .expect("the job ended long before its body would have")
        .expect("job task");
    match result {
        Err(JobError::Lock(LockError::Lost { key, .. })) => assert_eq!(&*key, "job:nightly"),
        other => panic!("expected Lost, got {other:?}"),
    }
    assert!(!reached_end.load(Ordering::SeqCst), "the body was stopped");
}

#[tokio::test]
async fn by_default_the_body_runs_to_its_end_and_lost_is_reported() {
    let (dir, locks) = provider().await;
    let reached_end = Arc::new(AtomicBool::new(false));
    let (started_tx, started_rx) = oneshot::channel();
    let job = tokio::spawn({
        let (locks, reached_end) = (locks.clone(), Arc::clone(&reached_end));
        async move { finishing_job(&locks, "daily", started_tx, reached_end).await }
    });
    started_rx.await.expect("the body started");
    steal(&dir, "job:daily");
    let result = tokio::time::timeout(Duration::from_secs(30), job)
        .await
        .expect("the job ends once the loss is known")
        .expect("job task");
    assert!(
        matches!(result, Err(JobError::Lock(LockError::Lost { .. }))),
        "{result:?}"
    );
    assert!(
        reached_end.load(Ordering::SeqCst),
        "the body ran to its end"
    );
}

#[tokio::test]
async fn on_lost_cancel_without_a_loss_returns_the_body_and_releases() {
    let (_dir, locks) = provider().await;
    assert_eq!(quick_job(&locks, "a").await.expect("runs"), 42);
    assert_eq!(explicit_finish(&locks, "a").await.expect("runs"), 7);
    // Released when the function returned.
    let guard = locks.try_acquire("job:a").await.expect("free");
    guard.release().await.expect("release");
    // A held lock is still an error before the body runs.
    let other = locks.clone();
    let held = other.try_acquire("job:b").await.expect("hold");
    assert!(matches!(
        quick_job(&locks, "b").await,
        Err(JobError::Lock(LockError::AlreadyHeld { .. }))
    ));
    held.release().await.expect("release");
}
