//! Multi-key locks: several keys taken all or none, in one canonical order.

use std::time::{Duration, Instant};

use crate::{LockError, LockGuard, LockProvider};

impl LockProvider {
    /// Takes every key of `keys`, or none: one try per key, in the canonical (sorted) order.
    /// When a key is held elsewhere, the keys already taken are released (and the release
    /// awaited) before [`LockError::AlreadyHeld`] names that key.
    ///
    /// The guards come back in the order of `keys`. A key given twice is a
    /// [`LockError::InvalidKey`] (a lock is not re-entrant, so it could never be taken twice);
    /// no keys at all is `Ok` with no guards.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), dlock::LockError> {
    /// # let dir = tempfile::tempdir().unwrap();
    /// # let url = format!("sqlite://{}/locks.db", dir.path().display());
    /// let locks = dlock::LockProvider::connect(&url).await?;
    /// // A transfer locks both accounts; another transfer between them, in either direction,
    /// // takes them in the same order, so the two never wait on each other.
    /// let guards = locks.try_acquire_many(&["account:7", "account:3"]).await?;
    /// assert_eq!(guards[0].key(), "account:7");
    /// for guard in guards {
    ///     guard.release().await?;
    /// }
    /// # Ok(()) }
    /// ```
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a dropped future drops the guards it has taken, which releases them in the
    /// background.
    pub async fn try_acquire_many(&self, keys: &[&str]) -> Result<Vec<LockGuard>, LockError> {
        self.acquire_many_until(keys, None).await
    }

    /// Takes every key of `keys`, or none, waiting up to `timeout` in all: the keys are taken
    /// one after another in the canonical (sorted) order, each waiting for what is left of the
    /// timeout, so two callers whose sets overlap never wait on each other in a cycle. When
    /// the time runs out, the keys already taken are released (and the release awaited), and
    /// the answer is [`LockError::Timeout`] naming the key still missing. `Duration::ZERO` is
    /// [`try_acquire_many`](LockProvider::try_acquire_many); `Duration::MAX` waits without
    /// limit.
    ///
    /// Keys taken early are held while later ones are waited for. The guards come back in the
    /// order of `keys`; a key given twice is a [`LockError::InvalidKey`].
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a dropped future ends the wait and drops the guards it has taken, which
    /// releases them in the background.
    pub async fn acquire_many(
        &self,
        keys: &[&str],
        timeout: Duration,
    ) -> Result<Vec<LockGuard>, LockError> {
        if timeout.is_zero() {
            return self.try_acquire_many(keys).await;
        }
        let deadline = crate::time::deadline(Instant::now(), timeout);
        self.acquire_many_until(keys, Some(deadline))
            .await
            .map_err(|err| match err {
                LockError::Timeout { key, .. } => LockError::Timeout { key, timeout },
                other => other,
            })
    }

    /// One try per key (`wait` `None`), or a wait up to the deadline (`Some(None)`: none).
    async fn acquire_many_until(
        &self,
        keys: &[&str],
        wait: Option<Option<Instant>>,
    ) -> Result<Vec<LockGuard>, LockError> {
        let order = canonical_order(keys)?;
        let mut taken: Vec<(usize, LockGuard)> = Vec::with_capacity(keys.len());
        for index in order {
            let key = keys[index];
            let outcome = match wait {
                None => self.try_acquire(key).await,
                Some(deadline) => {
                    let left = deadline.map_or(Duration::MAX, |d| {
                        d.saturating_duration_since(Instant::now())
                    });
                    self.acquire(key, left).await
                }
            };
            match outcome {
                Ok(guard) => taken.push((index, guard)),
                Err(err) => {
                    for (_, guard) in taken {
                        if let Err(release) = guard.release().await {
                            tracing::warn!(error = %release, "giving back a key of an incomplete multi-key acquisition failed");
                        }
                    }
                    return Err(err);
                }
            }
        }
        taken.sort_by_key(|(index, _)| *index);
        Ok(taken.into_iter().map(|(_, guard)| guard).collect())
    }
}

/// The indices of `keys` in the order they are taken: sorted by the key's bytes. A key given
/// twice is refused.
fn canonical_order(keys: &[&str]) -> Result<Vec<usize>, LockError> {
    let mut order: Vec<usize> = (0..keys.len()).collect();
    order.sort_by_key(|&index| keys[index]);
    if order.windows(2).any(|pair| keys[pair[0]] == keys[pair[1]]) {
        return Err(LockError::InvalidKey {
            reason: "a key is given twice in one multi-key acquisition".to_owned(),
        });
    }
    Ok(order)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_taken_in_byte_order_and_never_twice() {
        assert_eq!(canonical_order(&["b", "a", "c"]).unwrap(), vec![1, 0, 2]);
        assert_eq!(canonical_order(&[]).unwrap(), Vec::<usize>::new());
        assert!(matches!(
            canonical_order(&["a", "b", "a"]),
            Err(LockError::InvalidKey { .. })
        ));
    }
}
