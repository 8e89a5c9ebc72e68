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
    /// the answer is [`LockError::Timeout`] naming the key still missing, with `timeout`. That
    /// holds as well when the keys before it took the whole timeout: the keys left are then
    /// tried once more each (a free one is still taken), and one held elsewhere is a
    /// `Timeout`, never the [`LockError::AlreadyHeld`] of a single try. `Duration::ZERO` is
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
                Some(deadline) => self.acquire_before(key, deadline).await,
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

impl LockProvider {
    /// Takes `key` within what is left until `deadline` (`None`: no limit). Once the deadline
    /// has passed (the keys before took the whole timeout), one last try is made, and
    /// contention is the [`LockError::Timeout`] it is: a zero `timeout` passed to
    /// [`acquire`](LockProvider::acquire) would be one try, whose contention is
    /// [`LockError::AlreadyHeld`], and a wait that ran out of time must never answer that. A
    /// grant that came too late to count on ([`LockError::Lost`], given back already) is a
    /// timeout as well: a wait would try again, and there is no time left to.
    async fn acquire_before(
        &self,
        key: &str,
        deadline: Option<Instant>,
    ) -> Result<LockGuard, LockError> {
        let left = deadline.map_or(Duration::MAX, |d| {
            d.saturating_duration_since(Instant::now())
        });
        if !left.is_zero() {
            return self.acquire(key, left).await;
        }
        match self.try_acquire(key).await {
            Err(LockError::AlreadyHeld { key } | LockError::Lost { key, .. }) => {
                Err(LockError::Timeout {
                    key,
                    timeout: Duration::ZERO,
                })
            }
            other => other,
        }
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
    use crate::testing::MemoryBackend;

    /// A key whose grant takes the whole timeout leaves no time for the next, which is held
    /// elsewhere: the answer is the timeout the wait ran out of (a 408 behind the layer), not
    /// the contention of a single try (a 409), and the key taken is given back. The same when
    /// the deadline has passed before the first key.
    #[tokio::test]
    async fn a_wait_that_runs_out_between_keys_is_a_timeout() {
        let backend = MemoryBackend {
            native_wait: true,
            ..MemoryBackend::default()
        };
        backend.store().wait_delay = Some(Duration::from_millis(200));
        backend.hold_elsewhere("b");
        let locks = LockProvider::from_backend(backend.clone());
        let timeout = Duration::from_millis(100);
        let err = locks.acquire_many(&["b", "a"], timeout).await.unwrap_err();
        assert!(
            matches!(&err, LockError::Timeout { key, timeout: t } if &**key == "b" && *t == timeout),
            "{err:?}"
        );
        assert!(!backend.is_held("a"), "the key taken was given back");
        assert_eq!(locks.local_key_count(), 0);

        backend.store().wait_delay = None;
        for keys in [["a", "b"], ["b", "c"]] {
            let err = locks
                .acquire_many(&keys, Duration::from_nanos(1))
                .await
                .unwrap_err();
            assert!(
                matches!(&err, LockError::Timeout { key, .. } if &**key == "b"),
                "{keys:?}: {err:?}"
            );
        }
        // Keys that are free are still taken at the deadline, as a polled wait's last try.
        let guards = locks
            .acquire_many(&["c", "a"], Duration::from_nanos(1))
            .await
            .expect("free keys");
        assert_eq!(guards.len(), 2);
    }

    /// A key held elsewhere that is given back during the wait is taken: each key waits for
    /// what is left of the timeout (never a single try while time is left), and the guards
    /// come back in the order of `keys`, each with the key it names.
    #[tokio::test]
    async fn a_key_given_back_during_the_wait_is_taken() {
        let backend = MemoryBackend::default();
        backend.hold_elsewhere("b");
        let locks = LockProvider::from_backend(backend.clone());
        let freeing = {
            let backend = backend.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(50)).await;
                backend.free("b");
            })
        };
        let guards = locks
            .acquire_many(&["c", "b", "a"], Duration::from_secs(10))
            .await
            .expect("b is given back within the timeout");
        freeing.await.unwrap();
        let keys: Vec<&str> = guards.iter().map(LockGuard::key).collect();
        assert_eq!(keys, ["c", "b", "a"]);
        assert!(["a", "b", "c"].iter().all(|key| backend.is_held(key)));
        for guard in guards {
            guard.release().await.unwrap();
        }

        // The single tries answer the first key held elsewhere, and give back what they took.
        backend.hold_elsewhere("b");
        let err = locks.try_acquire_many(&["c", "b", "a"]).await.unwrap_err();
        assert!(
            matches!(&err, LockError::AlreadyHeld { key } if &**key == "b"),
            "{err:?}"
        );
        assert!(!backend.is_held("a") && !backend.is_held("c"));
        let guards = locks.try_acquire_many(&["c", "a"]).await.unwrap();
        let keys: Vec<&str> = guards.iter().map(LockGuard::key).collect();
        assert_eq!(keys, ["c", "a"]);
    }

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
