//! Semaphores: up to `max_count` holders per key, as slots that are ordinary locks of the
//! backend, in a namespace of their own.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::backoff::Pauses;
use crate::key::{RESERVED_PREFIX, validate_key};
use crate::provider::Terms;
use crate::{LockError, LockGuard, LockProvider};

/// The name of slot `slot` of the semaphore `key`: the reserved prefix (which no lock key may
/// start with), then `semaphore`, the slot number and the key, NUL-separated. Distinct keys or
/// slots give distinct names, and no name is a lock key, so a semaphore "x" and a lock "x"
/// are unrelated.
fn slot_name(key: &str, slot: u32) -> String {
    format!("{RESERVED_PREFIX}semaphore\0{slot}\0{key}")
}

impl LockProvider {
    /// Takes one of the `max_count` slots of the semaphore `key`, without waiting: up to
    /// `max_count` holders at once, in any process. [`LockError::AlreadyHeld`] when every slot
    /// is held.
    ///
    /// Each slot is an ordinary lock of the backend (so a semaphore works on every backend,
    /// with its lost token, fencing tokens per slot, lease and cancellation), named in a
    /// namespace of its own: the semaphore "x" and the lock "x" are unrelated. The slots are
    /// tried in a random order, so holders spread over them instead of piling onto the first;
    /// a try on a full semaphore costs up to `max_count` round trips. Every holder of one key
    /// should use the same `max_count`: slot *n* is the same lock whatever count asks for it,
    /// so callers with a smaller count use fewer of the slots. The guard's
    /// [`key`](LockGuard::key) is the slot's name; its
    /// [`fencing_token`](LockGuard::fencing_token) increases per slot.
    ///
    /// `max_count` 0 is a [`LockError::Config`].
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), dlock::LockError> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let url = format!("sqlite://{}/locks.db", dir.path().display());
    /// let locks = dlock::LockProvider::connect(&url).await?;
    /// // At most two exports run at once across the replicas.
    /// let first = locks.try_acquire_semaphore("exports", 2).await?;
    /// let second = locks.try_acquire_semaphore("exports", 2).await?;
    /// assert!(matches!(
    ///     locks.try_acquire_semaphore("exports", 2).await,
    ///     Err(dlock::LockError::AlreadyHeld { .. })
    /// ));
    /// // The lock "exports" is another thing altogether.
    /// locks.try_acquire("exports").await?.release().await?;
    /// first.release().await?;
    /// second.release().await?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Cancel safety
    ///
    /// Cancel safe, as [`try_acquire`](LockProvider::try_acquire).
    pub async fn try_acquire_semaphore(
        &self,
        key: &str,
        max_count: u32,
    ) -> Result<LockGuard, LockError> {
        check_semaphore(key, max_count)?;
        match self.try_slots(key, max_count).await? {
            Some(guard) => Ok(guard),
            None => Err(LockError::AlreadyHeld {
                key: Arc::from(key),
            }),
        }
    }

    /// Takes one of the `max_count` slots of the semaphore `key`, waiting up to `timeout` for
    /// one to be free: every slot is tried (in a random order), then again after a pause of
    /// the provider's backoff, until the deadline. [`LockError::Timeout`] when it runs out;
    /// `Duration::ZERO` is one round of tries (answered [`LockError::AlreadyHeld`], as
    /// [`try_acquire_semaphore`](LockProvider::try_acquire_semaphore)), `Duration::MAX` waits
    /// without limit. See
    /// [`try_acquire_semaphore`](LockProvider::try_acquire_semaphore) for what a slot is.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a dropped future ends the wait, and a slot it had just taken is released
    /// in the background.
    pub async fn acquire_semaphore(
        &self,
        key: &str,
        max_count: u32,
        timeout: Duration,
    ) -> Result<LockGuard, LockError> {
        if timeout.is_zero() {
            // One round of tries, answered as a try is: `AlreadyHeld` when every slot is held.
            return self.try_acquire_semaphore(key, max_count).await;
        }
        check_semaphore(key, max_count)?;
        let deadline = crate::time::deadline(Instant::now(), timeout);
        let mut pauses = Pauses::new(self.backoff(), deadline);
        loop {
            if let Some(guard) = self.try_slots(key, max_count).await? {
                return Ok(guard);
            }
            let Some(pause) = pauses.next_pause() else {
                return Err(LockError::Timeout {
                    key: Arc::from(key),
                    timeout,
                });
            };
            // The provider's shutdown ends the pause; the next round then answers `Canceled`.
            match self.shutdown_token() {
                Some(shutdown) => tokio::select! {
                    () = tokio::time::sleep(pause) => {}
                    () = shutdown.cancelled() => {}
                },
                None => tokio::time::sleep(pause).await,
            }
        }
    }

    /// One try of every slot, in a random order: the first slot taken, or `None` when all
    /// are held.
    async fn try_slots(&self, key: &str, max_count: u32) -> Result<Option<LockGuard>, LockError> {
        let mut slots: Vec<u32> = (0..max_count).collect();
        fastrand::shuffle(&mut slots);
        let terms = Terms {
            internal: true,
            ..Terms::default()
        };
        for slot in slots {
            let name = slot_name(key, slot);
            match self
                .acquire_with(&name, Duration::ZERO, None, terms, None)
                .await
            {
                Ok(guard) => return Ok(Some(guard)),
                Err(LockError::AlreadyHeld { .. }) => {}
                Err(err) => return Err(err),
            }
        }
        Ok(None)
    }
}

fn check_semaphore(key: &str, max_count: u32) -> Result<(), LockError> {
    validate_key(key)?;
    if max_count == 0 {
        return Err(LockError::config(
            "a semaphore needs a max_count of at least 1",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slot_names_are_distinct_and_never_lock_keys() {
        let names = [
            slot_name("x", 0),
            slot_name("x", 1),
            slot_name("x", 10),
            slot_name("x\u{0}1", 0),
            slot_name("1\u{0}x", 0),
        ];
        for (i, a) in names.iter().enumerate() {
            assert!(crate::key::refuse_reserved(a).is_err(), "{a:?} is reserved");
            for b in &names[i + 1..] {
                assert_ne!(a, b);
            }
        }
        assert!(crate::key::refuse_reserved("x").is_ok());
        assert!(crate::key::refuse_reserved("dlock:x").is_ok());
    }

    #[tokio::test]
    async fn the_providers_shutdown_ends_a_semaphore_wait_during_its_pause() {
        use crate::testing::MemoryBackend;
        let backend = MemoryBackend::default();
        backend.hold_elsewhere(&slot_name("s", 0));
        let shutdown = tokio_util::sync::CancellationToken::new();
        let locks = LockProvider::builder(backend.clone())
            .backoff(
                crate::Backoff::new(Duration::from_secs(5), Duration::from_secs(5), 0.0).unwrap(),
            )
            .cancel_on(&shutdown)
            .build();
        let wait = tokio::spawn(async move {
            locks
                .acquire_semaphore("s", 1, Duration::from_secs(60))
                .await
        });
        while backend.store().tries == 0 {
            tokio::task::yield_now().await;
        }
        shutdown.cancel();
        let answer = tokio::time::timeout(Duration::from_secs(2), wait)
            .await
            .expect("the wait ends before its 5 s pause does")
            .expect("join");
        assert!(
            matches!(answer, Err(LockError::Canceled { .. })),
            "{answer:?}"
        );
    }
}
