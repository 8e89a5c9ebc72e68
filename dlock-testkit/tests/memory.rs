// The conformance suite on a backend defined outside dlock: an in-process table, as small as a
// `LockBackend` can be. The crate docs show this file.
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dlock::backend::{Acquired, BoxFuture, HeldLock, LockBackend, LockRequest};
use dlock::{CancellationToken, LockError, LockGuard, LockProvider};

/// The store: each held key's owner and lost token, and the last fencing token per key.
#[derive(Debug, Default)]
struct Store {
    held: HashMap<String, (u64, CancellationToken)>,
    tokens: HashMap<String, u64>,
    owners: u64,
}

#[derive(Debug, Clone, Default)]
struct MemoryBackend(Arc<Mutex<Store>>);

#[derive(Debug)]
struct Held {
    store: Arc<Mutex<Store>>,
    key: String,
    owner: u64,
}

/// Gives the lock back when the handle goes: after `release`, and just as well without one
/// (a guard dropped in its runtime's shutdown cannot run its release).
impl Drop for Held {
    fn drop(&mut self) {
        let mut store = self.store.lock().unwrap();
        if store
            .held
            .get(&self.key)
            .is_some_and(|(owner, _)| *owner == self.owner)
        {
            store.held.remove(&self.key);
        }
    }
}

impl HeldLock for Held {
    fn release(self: Box<Self>) -> BoxFuture<'static, Result<(), LockError>> {
        // A key taken from its holder was lost; the provider reports that itself.
        drop(self);
        Box::pin(async { Ok(()) })
    }
}

impl LockBackend for MemoryBackend {
    fn name(&self) -> &'static str {
        "memory"
    }

    /// The store is this process's memory: it always answers.
    fn ping(&self) -> BoxFuture<'_, Result<(), LockError>> {
        Box::pin(async { Ok(()) })
    }

    fn try_acquire<'a>(
        &'a self,
        request: LockRequest<'a>,
    ) -> BoxFuture<'a, Result<Option<Acquired>, LockError>> {
        let mut store = self.0.lock().unwrap();
        let acquired = (!store.held.contains_key(request.key)).then(|| {
            store.owners += 1;
            let owner = store.owners;
            let lost = CancellationToken::new();
            store
                .held
                .insert(request.key.to_owned(), (owner, lost.clone()));
            let token = store.tokens.entry(request.key.to_owned()).or_default();
            *token += 1;
            let handle = Held {
                store: self.0.clone(),
                key: request.key.to_owned(),
                owner,
            };
            Acquired::new(Some(*token), lost, Box::new(handle))
        });
        Box::pin(async move { Ok(acquired) })
    }
}

/// One store; each provider is a process of its own on it.
struct MemoryHarness(Arc<Mutex<Store>>);

impl dlock_testkit::Harness for MemoryHarness {
    async fn provider(&self) -> LockProvider {
        LockProvider::from_backend(MemoryBackend(self.0.clone()))
    }

    async fn break_lock(&self, guard: &LockGuard) {
        // The store hands the key to nobody and tells the holder.
        let (_, lost) = self
            .0
            .lock()
            .unwrap()
            .held
            .remove(guard.key())
            .expect("held");
        lost.cancel();
    }

    fn lost_within(&self) -> Duration {
        Duration::from_millis(100)
    }

    fn fencing(&self) -> bool {
        true
    }

    /// The memory backend keeps the default `store_locks`.
    fn store_inspection(&self) -> dlock_testkit::StoreInspection {
        dlock_testkit::StoreInspection::Unsupported
    }

    fn unfair_waits(&self) -> Option<&'static str> {
        // As small as a backend can be: the provider polls it, and nothing queues waiters of
        // different providers (see `LockBackend::try_acquire_in_wait`), so a provider's own
        // next waiter takes a key its task gave back first.
        Some("the memory backend has no fair waits across providers")
    }

    async fn shared_providers(&self, count: usize) -> Vec<LockProvider> {
        let backend = MemoryBackend(self.0.clone());
        (0..count)
            .map(|_| LockProvider::from_backend(backend.clone()))
            .collect()
    }
}

// One test per case, each on a new store.
dlock_testkit::conformance_suite!(async { MemoryHarness(Arc::default()) });
