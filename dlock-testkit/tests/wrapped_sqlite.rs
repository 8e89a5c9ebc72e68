// The conformance suite on a backend of another crate: a `LockBackend` of its own that hands
// each call to dlock's SQLite backend and counts the tries, as a third party's decorator (for
// metrics, tracing, a circuit breaker) would. The suite must pass through it as it passes on
// SQLite itself, and every acquisition must go through the wrapper: the tries of waits (which
// carry SQLite's fair queue across processes) and SQLite's semaphores (`PermitStore`) too.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use dlock::backend::{
    Acquired, BoxFuture, LockBackend, LockRequest, PermitRequest, PermitStore, PermitTry, WaitTry,
};
use dlock::sqlite::SqliteBackend;
use dlock::{LockError, LockGuard, LockProvider};

const LEASE: Duration = Duration::from_millis(900);

#[derive(Debug, Clone)]
struct Counted {
    inner: SqliteBackend,
    tries: Arc<AtomicU64>,
}

impl LockBackend for Counted {
    fn name(&self) -> &'static str {
        "counted-sqlite"
    }

    fn supports_native_wait(&self) -> bool {
        self.inner.supports_native_wait()
    }

    fn try_acquire<'a>(
        &'a self,
        request: LockRequest<'a>,
    ) -> BoxFuture<'a, Result<Option<Acquired>, LockError>> {
        self.tries.fetch_add(1, Ordering::Relaxed);
        self.inner.try_acquire(request)
    }

    fn try_acquire_in_wait<'a>(
        &'a self,
        request: LockRequest<'a>,
    ) -> BoxFuture<'a, Result<WaitTry, LockError>> {
        self.tries.fetch_add(1, Ordering::Relaxed);
        self.inner.try_acquire_in_wait(request)
    }

    fn semaphores(&self) -> Option<&dyn PermitStore> {
        Some(self)
    }

    fn acquire_wait<'a>(
        &'a self,
        request: LockRequest<'a>,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<Option<Acquired>, LockError>> {
        self.tries.fetch_add(1, Ordering::Relaxed);
        self.inner.acquire_wait(request, timeout)
    }

    fn ping(&self) -> BoxFuture<'_, Result<(), LockError>> {
        self.inner.ping()
    }
}

impl PermitStore for Counted {
    fn try_acquire_permit<'a>(
        &'a self,
        request: PermitRequest<'a>,
    ) -> BoxFuture<'a, Result<PermitTry, LockError>> {
        self.tries.fetch_add(1, Ordering::Relaxed);
        self.inner.try_acquire_permit(request)
    }

    fn holders<'a>(
        &'a self,
        key: &'a str,
        max_count: u32,
    ) -> BoxFuture<'a, Result<u32, LockError>> {
        self.inner.holders(key, max_count)
    }
}

struct CountedHarness {
    dir: tempfile::TempDir,
    tries: Arc<AtomicU64>,
}

impl CountedHarness {
    async fn new() -> Self {
        CountedHarness {
            dir: tempfile::tempdir().expect("temp dir"),
            tries: Arc::default(),
        }
    }

    fn path(&self) -> PathBuf {
        self.dir.path().join("locks.db")
    }

    async fn backend(&self) -> Counted {
        let url = format!(
            "sqlite://{}?lease={}ms",
            self.path().display(),
            LEASE.as_millis()
        );
        Counted {
            inner: SqliteBackend::connect(&url).await.expect("open lock file"),
            tries: self.tries.clone(),
        }
    }
}

impl dlock_testkit::Harness for CountedHarness {
    async fn provider(&self) -> LockProvider {
        LockProvider::from_backend(self.backend().await)
    }

    async fn break_lock(&self, guard: &LockGuard) {
        // Another owner takes the row over, as if the lease had run out and been taken.
        let conn = rusqlite::Connection::open(self.path()).expect("open");
        let changed = conn
            .execute(
                "UPDATE __distributed_locks SET owner = X'00' WHERE name = ?1",
                [guard.key().as_bytes()],
            )
            .expect("steal row");
        assert_eq!(changed, 1);
    }

    fn lost_within(&self) -> Duration {
        LEASE / 3 + Duration::from_secs(1)
    }

    fn retake_within(&self) -> Duration {
        LEASE + Duration::from_secs(1)
    }

    fn fencing(&self) -> bool {
        true
    }

    /// The wrapper forwards locking only, not `store_locks` (the default answers `Unsupported`).
    fn store_inspection(&self) -> dlock_testkit::StoreInspection {
        dlock_testkit::StoreInspection::Unsupported
    }

    async fn shared_providers(&self, count: usize) -> Vec<LockProvider> {
        let backend = self.backend().await;
        (0..count)
            .map(|_| LockProvider::from_backend(backend.clone()))
            .collect()
    }
}

dlock_testkit::conformance_suite!(CountedHarness::new());

/// The providers of the harness take their locks through the wrapper, not around it.
#[tokio::test]
async fn acquisitions_go_through_the_wrapper() {
    let harness = CountedHarness::new().await;
    let provider = dlock_testkit::Harness::provider(&harness).await;
    let guard = provider
        .try_acquire(&dlock_testkit::unique_key("wrapped"))
        .await
        .expect("free key");
    assert_eq!(harness.tries.load(Ordering::Relaxed), 1);
    assert_eq!(guard.fencing_token(), Some(1));
    guard.release().await.expect("release");
}
