//! Semaphores on etcd (see [Semaphores](super#semaphores)): each permit holder and waiter is a
//! key under the semaphore's prefix, on a lease of its own, whose value is the semaphore's
//! count; the first `max_count` keys by create revision hold the permits, the others wait in
//! that order.

use super::*;
use crate::backend::{PermitRequest, PermitStore, PermitTry};

/// `<prefix>%S/<key'>/`: the queue prefix of `key` under `<prefix>%S/`. No lock's queue is
/// `<prefix>%S/` (a lock's encoded name holds `%` only in `%25`, `%2F` and `%#`), so no
/// semaphore key lies under a lock's queue, nor a lock's key under a semaphore's prefix.
fn semaphore_prefix(prefix: &[u8], key: &str) -> Vec<u8> {
    let mut semaphores = Vec::with_capacity(prefix.len() + 3);
    semaphores.extend_from_slice(prefix);
    semaphores.extend_from_slice(b"%S/");
    queue_prefix(&semaphores, key)
}

/// What putting our key under the semaphore's prefix found.
enum Joined {
    /// Our key is in, `rank`-th by create revision (1: the first), as of `revision`.
    In {
        queued: Queued,
        rank: i64,
        revision: i64,
        sent: Instant,
    },
    /// The semaphore is in use with this count (nothing was put; the lease is revoked).
    Conflict(u32),
}

/// What a waiter saw while it waited for its turn.
enum Moved {
    /// Fewer than `max_count` keys are ahead of its own.
    Mine,
    /// The watch could not say (compacted, cancelled, ended, failed): count again.
    Unknown,
}

impl EtcdBackend {
    /// The prefix under which the semaphore `key` keeps its holders' and waiters' keys
    /// (`<prefix>%S/<key'>/`, see [Semaphores](super#semaphores)): the `max_count` keys with
    /// the smallest create revisions under it hold its permits.
    pub fn semaphore_prefix(&self, key: &str) -> Vec<u8> {
        semaphore_prefix(&self.shared.prefix, key)
    }

    /// Grants a lease and, in one transaction, puts our key under `prefix` (valued with the
    /// count) if every key there has the same count or none is there, and counts the keys
    /// up to ours.
    async fn join(
        &self,
        prefix: &[u8],
        request: &PermitRequest<'_>,
        lease: Duration,
    ) -> Result<Joined, LockError> {
        let shared = &self.shared;
        let sent = Instant::now();
        let lease_id = shared.grant(lease).await?;
        let claim = Claim {
            shared: Arc::clone(shared),
            lease_id,
            armed: true,
        };
        let key = entry_key(prefix, lease_id);
        let count = request.max_count.to_string();
        let put = TxnOp::put(
            key.clone(),
            count.clone(),
            Some(PutOptions::new().with_lease(lease_id)),
        );
        let ranked = TxnOp::get(
            prefix.to_vec(),
            Some(GetOptions::new().with_prefix().with_count_only()),
        );
        let mine = TxnOp::get(key.clone(), None);
        let first = TxnOp::get(
            prefix.to_vec(),
            Some(
                GetOptions::new()
                    .with_prefix()
                    .with_sort(SortTarget::Create, SortOrder::Ascend)
                    .with_limit(1),
            ),
        );
        // Nobody holds or waits: any count is taken.
        let unused = Txn::new()
            .when([Compare::create_revision(prefix.to_vec(), CompareOp::Equal, 0).with_prefix()])
            .and_then([put.clone(), ranked.clone(), mine.clone()])
            .or_else([first]);
        // Safe to send twice: a second attempt finds our own key there with our count, puts
        // it again (its create revision is kept) and reads it.
        let txn = Txn::new()
            .when([Compare::value(prefix.to_vec(), CompareOp::Equal, count).with_prefix()])
            .and_then([put, ranked, mine])
            .or_else([TxnOp::txn(unused)]);
        let (answer, attempts) = shared.txn("queueing for a permit", txn).await?;
        let (branch, succeeded) = if answer.succeeded() {
            (answer, true)
        } else {
            match answer.op_responses().into_iter().next() {
                Some(TxnOpResponse::Txn(inner)) => {
                    let succeeded = inner.succeeded();
                    (inner, succeeded)
                }
                _ => return Err(malformed("queueing for a permit")),
            }
        };
        if !succeeded {
            // In use with another count (the claim revokes the lease).
            let recorded = first_kv(&branch)
                .and_then(|kv| std::str::from_utf8(kv.value()).ok()?.parse::<u32>().ok());
            return match recorded {
                Some(recorded) => Ok(Joined::Conflict(recorded)),
                None => Err(malformed("reading a semaphore's count")),
            };
        }
        let responses = branch.op_responses();
        let (Some(TxnOpResponse::Get(ranked)), Some(TxnOpResponse::Get(mine))) =
            (responses.get(1), responses.get(2))
        else {
            return Err(malformed("queueing for a permit"));
        };
        let Some(revision) = mine
            .kvs()
            .first()
            .map(etcd_client::KeyValue::create_revision)
        else {
            return Err(malformed("queueing for a permit"));
        };
        let mut rank = ranked.count();
        let mut read_at = branch.header().map_or(revision, |h| h.revision());
        if attempts > 1 {
            // Keys may have joined after ours between the attempts: count ours and those
            // ahead of it only.
            (rank, read_at) =
                self.ahead(prefix, &key, revision)
                    .await?
                    .ok_or_else(|| LockError::Lost {
                        key: Arc::from(request.key),
                        reason: "the permit's key went as it was put".to_owned(),
                    })?;
            rank += 1;
        }
        let entry = Entry::new(
            Arc::clone(shared),
            key,
            revision,
            lease_id,
            lease,
            sent,
            request.renew,
        );
        let keeper = entry.keep();
        Ok(Joined::In {
            queued: Queued {
                entry,
                keeper,
                claim,
            },
            rank,
            revision: read_at,
            sent,
        })
    }

    /// How many keys under `prefix` are ahead of ours (`key`, created at `revision`), and
    /// the revision of that read; `None` when our key is gone.
    async fn ahead(
        &self,
        prefix: &[u8],
        key: &[u8],
        revision: i64,
    ) -> Result<Option<(i64, i64)>, LockError> {
        let ahead = GetOptions::new()
            .with_prefix()
            .with_max_create_revision(revision - 1)
            .with_count_only();
        let txn = Txn::new()
            .when([Compare::create_revision(
                key.to_vec(),
                CompareOp::Equal,
                revision,
            )])
            .and_then([TxnOp::get(prefix.to_vec(), Some(ahead))]);
        let (answer, _) = self.shared.txn("waiting for a permit", txn).await?;
        if !answer.succeeded() {
            return Ok(None);
        }
        let count = answer.op_responses().into_iter().find_map(|op| match op {
            TxnOpResponse::Get(get) => Some(get.count()),
            _ => None,
        });
        let read_at = answer.header().map_or(revision, |h| h.revision());
        Ok(count.map(|count| (count, read_at)))
    }

    /// Takes our key out at once (a single try that found the semaphore full), so that it
    /// does not stand ahead of later tries while its lease is revoked; then the claim revokes
    /// the lease.
    async fn leave(&self, queued: Queued) {
        let entry = &queued.entry;
        let txn = Txn::new()
            .when([Compare::create_revision(
                entry.key.clone(),
                CompareOp::Equal,
                entry.revision,
            )])
            .and_then([TxnOp::delete(entry.key.clone(), None)]);
        if let Err(err) = self.shared.txn("leaving a semaphore", txn).await {
            tracing::debug!(error = %err, "an etcd permit key could not be deleted; its lease is revoked");
        }
        drop(queued);
    }

    /// Waits until fewer than `max_count` keys under `prefix` are ahead of `queued`'s (from
    /// `ahead` of them as of `revision`), its key is lost, or `deadline` passes. Each delete
    /// under the prefix from then on says (with the deleted key's create revision) whether a
    /// key ahead went; when a watch cannot say, the keys ahead are counted again.
    async fn wait_permit(
        &self,
        prefix: &[u8],
        queued: &Queued,
        max_count: u32,
        mut ahead: i64,
        mut revision: i64,
        deadline: Option<tokio::time::Instant>,
    ) -> Result<Turn, LockError> {
        let shared = &self.shared;
        let entry = &queued.entry;
        let max_count = i64::from(max_count);
        let expire = async {
            match deadline {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        tokio::pin!(expire);
        loop {
            if ahead < max_count {
                return Ok(if entry.is_live() {
                    Turn::Mine
                } else {
                    Turn::Lost
                });
            }
            let ours = entry.revision;
            let watched = async {
                let options = WatchOptions::new()
                    .with_prefix()
                    .with_start_revision(revision + 1)
                    .with_filters([WatchFilterType::NoPut])
                    .with_prev_key();
                let mut stream = shared
                    .client
                    .watch_client()
                    .watch(prefix.to_vec(), Some(options))
                    .await?;
                while let Some(answer) = stream.message().await? {
                    if answer.canceled() || answer.compact_revision() > 0 {
                        return Ok(Moved::Unknown);
                    }
                    for event in answer.events() {
                        if event.event_type() != etcd_client::EventType::Delete {
                            continue;
                        }
                        match event.prev_kv() {
                            Some(kv) if kv.create_revision() < ours => ahead -= 1,
                            Some(_) => {}
                            // Its history compacted away: it may have been ahead.
                            None => return Ok(Moved::Unknown),
                        }
                    }
                    if ahead < max_count {
                        return Ok(Moved::Mine);
                    }
                }
                Ok::<Moved, etcd_client::Error>(Moved::Unknown)
            };
            let moved = tokio::select! {
                biased;
                () = entry.lost.cancelled() => return Ok(Turn::Lost),
                () = &mut expire => return Ok(Turn::TimedOut),
                moved = watched => moved,
            };
            match moved {
                Ok(Moved::Mine) => {}
                Ok(Moved::Unknown) | Err(_) => {
                    if let Err(err) = &moved {
                        tracing::debug!(error = %err, "an etcd semaphore wait's watch failed; counting again");
                        tokio::select! {
                            biased;
                            () = entry.lost.cancelled() => return Ok(Turn::Lost),
                            () = &mut expire => return Ok(Turn::TimedOut),
                            () = tokio::time::sleep(retry_after(shared.lease)) => {}
                        }
                    }
                    let counted = tokio::select! {
                        biased;
                        () = entry.lost.cancelled() => return Ok(Turn::Lost),
                        () = &mut expire => return Ok(Turn::TimedOut),
                        counted = self.ahead(prefix, &entry.key, ours) => counted,
                    };
                    match counted {
                        Ok(Some((now_ahead, at))) => (ahead, revision) = (now_ahead, at),
                        Ok(None) => return Ok(Turn::Lost),
                        Err(err) if err.is_retryable() => {
                            tracing::debug!(error = %err, "an etcd semaphore wait could not count; retrying");
                        }
                        Err(err) => return Err(err),
                    }
                }
            }
        }
    }

    /// A permit from a key that joined: the permit is handed out after the lease check of a
    /// lease granted with a request sent at `sent`.
    fn granted(
        queued: Queued,
        request: &PermitRequest<'_>,
        lease: Duration,
        sent: Instant,
    ) -> Result<Acquired, LockError> {
        // An answer that came late leaves too little of the lease to count on: the permit is
        // given back (the claim revokes the lease) and reported lost.
        crate::lease::check_answer_time(request.key, lease, sent.elapsed(), "permit", NAME)?;
        Ok(queued.into_permit(request.key))
    }
}

impl Queued {
    /// The permit of this key, named by its semaphore's key.
    fn into_permit(mut self, name: &str) -> Acquired {
        self.claim.armed = false;
        let entry = Arc::clone(&self.entry);
        let deadline = entry.deadline();
        Acquired::new(
            u64::try_from(entry.revision).ok(),
            entry.lost.clone(),
            Box::new(EtcdHeld {
                name: Arc::from(name),
                entry: self.entry,
                keeper: Some(self.keeper),
                permit: true,
            }),
        )
        .with_lease_deadline(deadline)
    }
}

/// The server's answer was not what the request asks for.
fn malformed(what: &str) -> LockError {
    LockError::backend(
        NAME,
        format!("{what}: the server's answer was not in the expected form"),
        None,
        None,
    )
}

/// Semaphores are keys in etcd's own FIFO order (see [Semaphores](super#semaphores)).
impl PermitStore for EtcdBackend {
    fn try_acquire_permit<'a>(
        &'a self,
        request: PermitRequest<'a>,
    ) -> BoxFuture<'a, Result<PermitTry, LockError>> {
        Box::pin(async move {
            let lease = request.lease.unwrap_or(self.shared.lease);
            check_lease(lease)?;
            let prefix = self.semaphore_prefix(request.key);
            match self.join(&prefix, &request, lease).await? {
                Joined::Conflict(recorded) => Err(request.count_conflict(recorded)),
                Joined::In {
                    queued, rank, sent, ..
                } if rank <= i64::from(request.max_count) => Ok(PermitTry::Acquired(
                    Self::granted(queued, &request, lease, sent)?,
                )),
                Joined::In { queued, .. } => {
                    self.leave(queued).await;
                    Ok(PermitTry::Full { retry_within: None })
                }
            }
        })
    }

    fn supports_native_permit_wait(&self) -> bool {
        true
    }

    fn acquire_permit_wait<'a>(
        &'a self,
        request: PermitRequest<'a>,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<Option<Acquired>, LockError>> {
        Box::pin(async move {
            let lease = request.lease.unwrap_or(self.shared.lease);
            check_lease(lease)?;
            let deadline = tokio::time::Instant::now().checked_add(timeout);
            let prefix = self.semaphore_prefix(request.key);
            loop {
                let (queued, rank, revision) = match self.join(&prefix, &request, lease).await? {
                    Joined::Conflict(recorded) => return Err(request.count_conflict(recorded)),
                    Joined::In {
                        queued,
                        rank,
                        revision,
                        ..
                    } => (queued, rank, revision),
                };
                // Waiting may take long: the lease that counts is the one kept alive from
                // here on (the keeper renews it meanwhile), so no answer-time check once
                // the key has waited.
                let turn = self
                    .wait_permit(
                        &prefix,
                        &queued,
                        request.max_count,
                        rank - 1,
                        revision,
                        deadline,
                    )
                    .await?;
                match turn {
                    Turn::Mine => return Ok(Some(queued.into_permit(request.key))),
                    Turn::TimedOut => return Ok(None),
                    Turn::Lost => {
                        // Our key or lease went while we waited: queue again at the back (the
                        // claim revokes the old lease), unless the time is up.
                        if deadline.is_some_and(|at| tokio::time::Instant::now() >= at) {
                            return Ok(None);
                        }
                    }
                }
            }
        })
    }

    fn holders<'a>(
        &'a self,
        key: &'a str,
        max_count: u32,
    ) -> BoxFuture<'a, Result<u32, LockError>> {
        Box::pin(async move {
            let prefix = self.semaphore_prefix(key);
            let counted = TxnOp::get(
                prefix.clone(),
                Some(GetOptions::new().with_prefix().with_count_only()),
            );
            let first = TxnOp::get(
                prefix.clone(),
                Some(
                    GetOptions::new()
                        .with_prefix()
                        .with_sort(SortTarget::Create, SortOrder::Ascend)
                        .with_limit(1),
                ),
            );
            let (answer, _) = self
                .shared
                .txn("counting permits", Txn::new().and_then([counted, first]))
                .await?;
            let responses = answer.op_responses();
            let (Some(TxnOpResponse::Get(counted)), Some(TxnOpResponse::Get(first))) =
                (responses.first(), responses.get(1))
            else {
                return Err(malformed("counting permits"));
            };
            if let Some(kv) = first.kvs().first() {
                let recorded = std::str::from_utf8(kv.value())
                    .ok()
                    .and_then(|text| text.parse::<u32>().ok())
                    .ok_or_else(|| malformed("reading a semaphore's count"))?;
                if recorded != max_count {
                    return Err(PermitRequest::new(key, max_count).count_conflict(recorded));
                }
            }
            let live = u32::try_from(counted.count()).unwrap_or(u32::MAX);
            Ok(live.min(max_count))
        })
    }
}
