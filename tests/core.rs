//! Provider behaviour that does not depend on the store: the in-process table talks to the
//! backend only when it must. A counting wrapper around the SQLite backend watches every call.
#![cfg(feature = "sqlite")]

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dlock::backend::{Acquired, BoxFuture, LeaseDeadline, LockBackend, LockRequest};
use dlock::sqlite::SqliteBackend;
use dlock::{Backoff, LockError, LockProvider};
use dlock_testkit::unique_key;

#[derive(Debug, Default)]
struct Calls {
    total: AtomicUsize,
    in_flight: Mutex<HashMap<String, usize>>,
    max_in_flight: AtomicUsize,
}

#[derive(Debug)]
struct Counting {
    inner: SqliteBackend,
    calls: Arc<Calls>,
}

impl LockBackend for Counting {
    fn name(&self) -> &'static str {
        "counting"
    }

    fn try_acquire<'a>(
        &'a self,
        request: LockRequest<'a>,
    ) -> BoxFuture<'a, Result<Option<Acquired>, LockError>> {
        Box::pin(async move {
            self.calls.total.fetch_add(1, Ordering::SeqCst);
            let now = {
                let mut map = self.calls.in_flight.lock().unwrap();
                let n = map.entry(request.key.to_owned()).or_default();
                *n += 1;
                *n
            };
            self.calls.max_in_flight.fetch_max(now, Ordering::SeqCst);
            // Stay in flight long enough for a second caller to show up if it could.
            tokio::time::sleep(Duration::from_millis(2)).await;
            let outcome = self.inner.try_acquire(request).await;
            *self
                .calls
                .in_flight
                .lock()
                .unwrap()
                .get_mut(request.key)
                .unwrap() -= 1;
            outcome
        })
    }
}

async fn counting(path: &std::path::Path) -> (LockProvider, Arc<Calls>) {
    let calls = Arc::new(Calls::default());
    let backend = Counting {
        inner: SqliteBackend::open(path).await.unwrap(),
        calls: calls.clone(),
    };
    let provider = LockProvider::builder(backend)
        .backoff(Backoff::new(Duration::from_millis(5), Duration::from_millis(20), 0.2).unwrap())
        .build();
    (provider, calls)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_contention_never_reaches_the_store() {
    let dir = tempfile::tempdir().unwrap();
    let (locks, calls) = counting(&dir.path().join("l.db")).await;
    let key = unique_key("local");
    let guard = locks.try_acquire(&key).await.unwrap();
    let before = calls.total.load(Ordering::SeqCst);
    for _ in 0..100 {
        assert!(matches!(
            locks.try_acquire(&key).await,
            Err(LockError::AlreadyHeld { .. })
        ));
    }
    // Local waiters queue on the table instead of polling the store.
    let waiters: Vec<_> = (0..5)
        .map(|_| {
            let (locks, key) = (locks.clone(), key.clone());
            tokio::spawn(async move { locks.acquire(&key, Duration::from_millis(300)).await })
        })
        .collect();
    for w in waiters {
        assert!(matches!(w.await.unwrap(), Err(LockError::Timeout { .. })));
    }
    assert_eq!(
        calls.total.load(Ordering::SeqCst),
        before,
        "the store was asked"
    );
    guard.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_local_waiter_talks_to_the_store_per_key() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("l.db");
    let remote = LockProvider::connect(&format!("sqlite://{}", path.display()))
        .await
        .unwrap();
    let (locks, calls) = counting(&path).await;
    let key = unique_key("herd");
    let held_elsewhere = remote.try_acquire(&key).await.unwrap();
    let served = Arc::new(AtomicUsize::new(0));
    let waiters: Vec<_> = (0..8)
        .map(|_| {
            let (locks, key, served) = (locks.clone(), key.clone(), served.clone());
            tokio::spawn(async move {
                let g = locks.acquire(&key, Duration::from_secs(20)).await.unwrap();
                served.fetch_add(1, Ordering::SeqCst);
                g.release().await.unwrap();
            })
        })
        .collect();
    // Let the waiters poll for a while against the remote holder: the one-talker bound below
    // means nothing unless they did talk to the store while it was held elsewhere.
    assert!(
        dlock_testkit::eventually(Duration::from_secs(5), || {
            calls.total.load(Ordering::SeqCst) >= 10
        })
        .await,
        "the waiters asked the store fewer than 10 times in 5 s while the key was held \
         elsewhere ({} calls)",
        calls.total.load(Ordering::SeqCst)
    );
    assert_eq!(
        served.load(Ordering::SeqCst),
        0,
        "a waiter was served while the key was held elsewhere"
    );
    held_elsewhere.release().await.unwrap();
    for w in waiters {
        w.await.unwrap();
    }
    assert_eq!(served.load(Ordering::SeqCst), 8);
    assert_eq!(
        calls.max_in_flight.load(Ordering::SeqCst),
        1,
        "two local waiters talked to the store about one key at once"
    );
}

#[tokio::test]
async fn provider_shutdown_token_cancels_waits() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("l.db");
    let shutdown = dlock::CancellationToken::new();
    let locks = LockProvider::builder(SqliteBackend::open(&path).await.unwrap())
        .cancel_on(&shutdown)
        .build();
    let key = unique_key("shutdown");
    let guard = locks.try_acquire(&key).await.unwrap();
    let waiter = {
        let (locks, key) = (locks.clone(), key.clone());
        tokio::spawn(async move { locks.acquire(&key, Duration::MAX).await })
    };
    tokio::task::yield_now().await;
    shutdown.cancel();
    assert!(matches!(
        waiter.await.unwrap(),
        Err(LockError::Canceled { .. })
    ));
    assert!(matches!(
        locks.try_acquire(&unique_key("after")).await,
        Err(LockError::Canceled { .. })
    ));
    // Held locks are not touched by the shutdown token.
    assert!(!guard.is_lost());
    guard.release().await.unwrap();
}

/// Passes acquisitions through to SQLite, but gives each guard a lease deadline `after` from
/// the acquisition that nothing moves on: a holder whose renewals have stopped being confirmed,
/// as after a pause of the whole process, before the renewal thread has run again.
#[derive(Debug)]
struct Unrenewed {
    inner: SqliteBackend,
    after: Duration,
}

impl LockBackend for Unrenewed {
    fn name(&self) -> &'static str {
        "unrenewed"
    }

    fn try_acquire<'a>(
        &'a self,
        request: LockRequest<'a>,
    ) -> BoxFuture<'a, Result<Option<Acquired>, LockError>> {
        Box::pin(async move {
            let at = std::time::Instant::now() + self.after;
            Ok(self
                .inner
                .try_acquire(request)
                .await?
                .map(|acquired| acquired.with_lease_deadline(LeaseDeadline::new(at))))
        })
    }
}

/// A holder whose lease deadline has passed with no renewal confirmed finds the lock lost at
/// once, from `is_lost()` and its lost token, and its release reports the loss, though the
/// backend's own renewal never said so.
#[tokio::test]
async fn a_lease_past_its_deadline_is_lost_before_the_renewal_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let inner = SqliteBackend::open(dir.path().join("deadline.db"))
        .await
        .unwrap();
    let provider = LockProvider::from_backend(Unrenewed {
        inner,
        after: Duration::from_millis(200),
    });
    let guard = provider.try_acquire(&unique_key("deadline")).await.unwrap();
    assert!(!guard.is_lost(), "the deadline is ahead");
    assert!(!guard.lost_token().is_cancelled());
    let token = guard.lost_token().clone();
    dlock_testkit::wait_until("the deadline passes", Duration::from_secs(5), async || {
        guard.is_lost()
    })
    .await;
    assert!(token.is_cancelled(), "is_lost() fires the lost token");
    let released = guard.release().await;
    assert!(
        matches!(released, Err(LockError::Lost { .. })),
        "{released:?}"
    );

    // Released before its deadline, a lock is not lost.
    let guard = provider.try_acquire(&unique_key("deadline")).await.unwrap();
    guard.release().await.expect("released in time");
}
