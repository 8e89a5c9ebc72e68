//! Semaphores kept in the lock file (see [Semaphores](super#semaphores)): a counted table of
//! permits, each a row with a lease of its own, and a record per semaphore with its count,
//! its fencing counter and the waiting mark of the waiter at the head of its queue.
//!
//! A try is one write transaction: it removes the semaphore's expired permits, counts the
//! live ones, checks the record and, when a permit is free, adds one and records the count
//! and token. A try that can be answered without writing (a full semaphore, another count in
//! use) is answered by a read first, without the file's write lock, when the semaphore was
//! found full in the last second or the try is a waiter's.

use rusqlite::OptionalExtension;

use super::*;
use crate::backend::{PermitRequest, PermitStore, PermitTry};

/// Removes the permits of `?1` whose lease has ended (`?2` now, `?3` boot).
const PERMITS_CLEAN_SQL: &str = "DELETE FROM main.__distributed_lock_permits \
    WHERE name = ?1 AND (boot IS NOT ?3 OR lease_end <= ?2)";

/// The live permits of `?1` (`?2` now, `?3` boot): how many, and the earliest lease end.
const PERMITS_LIVE_SQL: &str = "SELECT count(*), min(lease_end) FROM main.__distributed_lock_permits \
    WHERE name = ?1 AND boot IS ?3 AND lease_end > ?2";

/// The record of semaphore `?1`: its count, its fencing counter, and the end of its waiting
/// mark while that is live (0 otherwise; `?2` now, `?3` boot).
const SEMAPHORE_SQL: &str = "SELECT max_count, fencing, \
    CASE WHEN boot IS ?3 AND mark_until > ?2 THEN mark_until ELSE 0 END \
    FROM main.__distributed_lock_semaphores WHERE name = ?1";

/// Sets the record of semaphore `?1`: count `?2`, fencing counter `?3`, waiting mark until
/// `?4`, boot `?5`.
const SEMAPHORE_SET_SQL: &str = "INSERT INTO main.__distributed_lock_semaphores \
    (name, max_count, fencing, mark_until, boot) VALUES (?1, ?2, ?3, ?4, ?5) \
    ON CONFLICT (name) DO UPDATE SET max_count = excluded.max_count, \
    fencing = excluded.fencing, mark_until = excluded.mark_until, boot = excluded.boot";

/// Adds permit `?2` of `?1`, until `?3` (boot `?4`).
const PERMIT_INSERT_SQL: &str = "INSERT INTO main.__distributed_lock_permits \
    (name, owner, lease_end, boot) VALUES (?1, ?2, ?3, ?4)";

/// Sets the lease end of permit `?2` of `?1` to `?3` if its lease is live (`?4` now, `?5`
/// boot): an expired permit may have let another holder in, so it is never revived.
const PERMIT_RENEW_SQL: &str = "UPDATE main.__distributed_lock_permits SET lease_end = ?3 \
    WHERE name = ?1 AND owner = ?2 AND boot IS ?5 AND lease_end > ?4";

/// Removes permit `?2` of `?1`; returns whether its lease was live (`?3` now, `?4` boot), or
/// no row when it was gone.
const PERMIT_RELEASE_SQL: &str = "DELETE FROM main.__distributed_lock_permits \
    WHERE name = ?1 AND owner = ?2 \
    RETURNING boot IS ?4 AND lease_end > ?3";

/// Whether permit `?2` of `?1` holds a live lease: `?3` now, `?4` boot.
const PERMIT_VERIFY_SQL: &str = "SELECT count(*) FROM main.__distributed_lock_permits \
    WHERE name = ?1 AND owner = ?2 AND boot = ?4 AND lease_end > ?3";

/// Under shared counters: removes the record of `?1` once no permit and no live waiting mark
/// are left (`?2` now, `?3` boot), so that the file keeps the semaphores in use only.
const SEMAPHORE_DROP_SQL: &str = "DELETE FROM main.__distributed_lock_semaphores \
    WHERE name = ?1 AND NOT (boot IS ?3 AND mark_until > ?2) \
    AND NOT EXISTS (SELECT 1 FROM main.__distributed_lock_permits \
    WHERE name = ?1 AND boot IS ?3 AND lease_end > ?2)";

/// The prefix of a semaphore's name in the memory of names found held
/// ([`Shared::seen_held`]), which a lock's key cannot start with (it is reserved).
const SEEN_PREFIX: &[u8] = b"dlock\0semaphore\0";

/// What a look at a semaphore found: its live permits and record.
#[derive(Debug, Clone, Copy)]
struct Look {
    live: i64,
    /// The earliest lease end of a live permit.
    earliest: Option<i64>,
    /// The count, fencing counter and live mark's end (0: none) of the record, if any.
    record: Option<(i64, i64, i64)>,
}

/// What that look decides, for a request of `asked` permits.
enum Verdict {
    /// The record names another count, and the semaphore is in use.
    Conflict(u32),
    /// Full (or, for a single try, a waiter is marked): with the earliest lease end, when the
    /// permits are what fills it.
    Full(Option<i64>),
    /// A permit is free.
    Free,
}

impl Look {
    fn read(conn: &Connection, name: &[u8], now: i64, boot: &[u8]) -> rusqlite::Result<Look> {
        let (live, earliest) = conn
            .prepare_cached(PERMITS_LIVE_SQL)?
            .query_row(params![name, now, boot], |row| {
                Ok((row.get::<_, i64>(0)?, row.get::<_, Option<i64>>(1)?))
            })?;
        let record = conn
            .prepare_cached(SEMAPHORE_SQL)?
            .query_row(params![name, now, boot], |row| {
                Ok((row.get(0)?, row.get(1)?, row.get(2)?))
            })
            .optional()?;
        Ok(Look {
            live,
            earliest,
            record,
        })
    }

    /// The end of the live waiting mark (0: none).
    fn mark_until(&self) -> i64 {
        self.record.map_or(0, |(_, _, mark)| mark)
    }

    fn verdict(&self, request: &PermitRequest<'_>) -> Verdict {
        let asked = i64::from(request.max_count);
        let marked = self.mark_until() > 0;
        if let Some((recorded, ..)) = self.record
            && recorded != asked
            && (self.live > 0 || marked)
        {
            return Verdict::Conflict(u32::try_from(recorded).unwrap_or(u32::MAX));
        }
        if self.live >= asked {
            Verdict::Full(self.earliest)
        } else if request.waiting.is_none() && marked {
            Verdict::Full(None)
        } else {
            Verdict::Free
        }
    }
}

/// What one try's transaction did.
enum PermitOnce {
    /// A permit is ours, with this token.
    Taken(i64),
    /// No permit: with the earliest lease end of a live permit, when known.
    Full(Option<i64>),
    /// Another count is in use.
    Conflict(u32),
    /// The shared counter refused the increment (nothing was written).
    Refused,
}

impl Shared {
    /// One try for a permit of `name` for `owner`, for `lease`: a look first when it may
    /// answer without writing, then the write transaction (tried again while the file is
    /// busy, up to the busy timeout). `started` is taken before the lease clock is read.
    async fn take_permit(
        &self,
        name: &[u8],
        owner: &[u8; 16],
        lease: Duration,
        request: &PermitRequest<'_>,
    ) -> Result<(PermitOnce, Instant), Busy> {
        let clock = self.clock;
        let mut seen: Vec<u8> = Vec::with_capacity(SEEN_PREFIX.len() + name.len());
        seen.extend_from_slice(SEEN_PREFIX);
        seen.extend_from_slice(name);
        // A look (no write lock) answers what needs no write: a busy file is "not known".
        let look = |conn: &Connection| -> Result<Option<PermitOnce>, Busy> {
            let now = clock.now_ms();
            let look = match Look::read(conn, name, now, clock.boot()) {
                Ok(look) => look,
                Err(err) if is_busy(&err) => return Ok(None),
                Err(err) => {
                    return Err(Busy::Failed(sqlite_error(
                        &self.path,
                        "acquiring a permit",
                        err,
                    )));
                }
            };
            Ok(match look.verdict(request) {
                Verdict::Conflict(recorded) => Some(PermitOnce::Conflict(recorded)),
                // A waiter's mark that lasts at least half its length needs no write.
                Verdict::Full(earliest)
                    if request.waiting.is_none_or(|mark| {
                        look.mark_until() >= now.saturating_add(millis(mark) / 2)
                    }) =>
                {
                    Some(PermitOnce::Full(earliest))
                }
                Verdict::Full(_) | Verdict::Free => None,
            })
        };
        if (request.waiting.is_some() || self.seen_held(&seen))
            && let Some(answer) = look(&self.inline())?
        {
            return Ok((self.noted_permit(&seen, answer), Instant::now()));
        }
        let waiting_since = Instant::now();
        let (mut pause, longest) = ACQUIRE_PAUSES;
        loop {
            let pass = self.gate.read().await;
            let attempt = {
                let conn = self.inline();
                // Taken before the clock is read: the holder's deadlines start no later than
                // the lease it writes.
                let started = Instant::now();
                match self.permit_once(&conn, name, owner, lease, request) {
                    Ok(PermitOnce::Refused) => {
                        let refusal = match self.counted {
                            Some(counted) => counted.refusal(&conn),
                            None => LockError::config("fencing_counters: no shared counters"),
                        };
                        return Err(Busy::Failed(refusal));
                    }
                    Ok(once) => Some((once, started)),
                    Err(err) if is_busy(&err) => look(&conn)?.map(|once| (once, started)),
                    Err(err) => {
                        return Err(Busy::Failed(sqlite_error(
                            &self.path,
                            "acquiring a permit",
                            err,
                        )));
                    }
                }
            };
            drop(pass);
            if let Some((once, started)) = attempt {
                return Ok((self.noted_permit(&seen, once), started));
            }
            self.pause_between_tries(waiting_since, &mut pause, longest)
                .await?;
        }
    }

    /// The end of a try for the semaphore remembered as `seen`: one found full is remembered
    /// for a while (the next single try looks before it writes), any other end forgets it.
    fn noted_permit(&self, seen: &[u8], once: PermitOnce) -> PermitOnce {
        if matches!(once, PermitOnce::Full(_)) {
            self.note_held(seen);
        } else {
            self.forget_held(seen);
        }
        once
    }

    /// One try, in one write transaction (see the module docs).
    fn permit_once(
        &self,
        conn: &Connection,
        name: &[u8],
        owner: &[u8; 16],
        lease: Duration,
        request: &PermitRequest<'_>,
    ) -> rusqlite::Result<PermitOnce> {
        let tx = Transaction::new_unchecked(conn, TransactionBehavior::Immediate)?;
        let clock = self.clock;
        let now = clock.now_ms();
        let boot = clock.boot();
        tx.prepare_cached(PERMITS_CLEAN_SQL)?
            .execute(params![name, now, boot])?;
        let look = Look::read(&tx, name, now, boot)?;
        let asked = i64::from(request.max_count);
        let (fencing, mark_until) = look
            .record
            .map_or((0, 0), |(_, fencing, mark)| (fencing, mark));
        // Dropping the transaction rolls it back: nothing is written unless it commits.
        match look.verdict(request) {
            Verdict::Conflict(recorded) => return Ok(PermitOnce::Conflict(recorded)),
            Verdict::Full(earliest) => {
                let Some(mark) = request.waiting else {
                    return Ok(PermitOnce::Full(earliest));
                };
                // The waiter's mark, moved on (never back).
                let until = now.saturating_add(millis(mark)).max(mark_until);
                tx.prepare_cached(SEMAPHORE_SET_SQL)?
                    .execute(params![name, asked, fencing, until, boot])?;
                tx.commit()?;
                return Ok(PermitOnce::Full(earliest));
            }
            Verdict::Free => {}
        }
        let (token, counter) = match self.counted {
            Some(counted) => match counted.count(&tx, name)? {
                Some(token) => (token, fencing),
                None => return Ok(PermitOnce::Refused),
            },
            None => {
                let token = fencing.saturating_add(1);
                (token, token)
            }
        };
        // A waiter that is served clears its mark; a single try leaves it.
        let mark = if request.waiting.is_some() {
            0
        } else {
            mark_until
        };
        tx.prepare_cached(SEMAPHORE_SET_SQL)?
            .execute(params![name, asked, counter, mark, boot])?;
        tx.prepare_cached(PERMIT_INSERT_SQL)?.execute(params![
            name,
            &owner[..],
            now.saturating_add(millis(lease)),
            boot
        ])?;
        tx.commit()?;
        Ok(PermitOnce::Taken(token))
    }

    /// Gives back permit `owner` of `name`: `Released` when its lease was live, otherwise
    /// `AlreadyReleased` (a permit has one owner: nobody else can hold it). Under shared
    /// counters, the semaphore's record goes once nobody holds or waits.
    pub(super) async fn release_permit(
        &self,
        name: &[u8],
        owner: &[u8; 16],
    ) -> Result<ReleaseOutcome, Busy> {
        let clock = self.clock;
        self.with_busy_retry("releasing a permit", RELEASE_PAUSES, |conn| {
            let tx = Transaction::new_unchecked(conn, TransactionBehavior::Immediate)?;
            let now = clock.now_ms();
            let boot = clock.boot();
            let live = {
                let mut release = tx.prepare_cached(PERMIT_RELEASE_SQL)?;
                let mut rows = release.query(params![name, &owner[..], now, boot])?;
                let live = match rows.next()? {
                    Some(row) => row.get::<_, bool>(0)?,
                    None => false,
                };
                while rows.next()?.is_some() {}
                live
            };
            if self.counted.is_some() {
                tx.prepare_cached(PERMITS_CLEAN_SQL)?
                    .execute(params![name, now, boot])?;
                tx.prepare_cached(SEMAPHORE_DROP_SQL)?
                    .execute(params![name, now, boot])?;
            }
            tx.commit()?;
            Ok(if live {
                ReleaseOutcome::Released
            } else {
                ReleaseOutcome::AlreadyReleased
            })
        })
        .await
    }

    /// Sets permit `owner`'s lease on `name` to `lease` from now, if it is live: `true` when
    /// done.
    pub(super) async fn extend_permit(
        &self,
        name: &[u8],
        owner: &[u8; 16],
        lease: Duration,
    ) -> Result<bool, Busy> {
        let clock = self.clock;
        self.with_busy_retry("extending a lease", RELEASE_PAUSES, |conn| {
            renew_permit(conn, clock, name, owner, lease)
        })
        .await
    }

    /// Whether permit `owner` of `name` holds a live lease.
    pub(super) async fn verify_permit(&self, name: &[u8], owner: &[u8; 16]) -> Result<bool, Busy> {
        let clock = self.clock;
        self.with_busy_retry("verifying a permit", RELEASE_PAUSES, |conn| {
            let mut verify = conn.prepare_cached(PERMIT_VERIFY_SQL)?;
            let params = params![name, &owner[..], clock.now_ms(), clock.boot()];
            verify.query_row(params, |row| row.get::<_, i64>(0))
        })
        .await
        .map(|n| n > 0)
    }
}

/// Renews permit `owner` of `name` for `lease` from now, if its lease is live (in the
/// caller's transaction, or on its own). `true` when renewed.
pub(super) fn renew_permit(
    conn: &Connection,
    clock: &LeaseClock,
    name: &[u8],
    owner: &[u8; 16],
    lease: Duration,
) -> rusqlite::Result<bool> {
    let now = clock.now_ms();
    let changed = conn.prepare_cached(PERMIT_RENEW_SQL)?.execute(params![
        name,
        &owner[..],
        now.saturating_add(millis(lease)),
        now,
        clock.boot()
    ])?;
    Ok(changed == 1)
}

/// Semaphores are a counted table of the lock file (see [Semaphores](super#semaphores)).
impl PermitStore for SqliteBackend {
    fn try_acquire_permit<'a>(
        &'a self,
        request: PermitRequest<'a>,
    ) -> BoxFuture<'a, Result<PermitTry, LockError>> {
        Box::pin(async move {
            let lease = request.lease.unwrap_or(self.shared.lease);
            check_lease(lease)?;
            // Everything that can fail for want of resources fails before the row is written.
            self.shared.renewer.ensure_running()?;
            let owner = self.shared.new_owner()?;
            let name = request.key.as_bytes();
            let (once, started) = match self.shared.take_permit(name, &owner, lease, &request).await
            {
                Ok(taken) => taken,
                // Another writer kept the file for the whole busy timeout: contention.
                Err(Busy::Timeout) => return Ok(PermitTry::Full { retry_within: None }),
                Err(Busy::Failed(err)) => return Err(err),
            };
            let token = match once {
                PermitOnce::Taken(token) => token,
                PermitOnce::Full(earliest) => {
                    let now = self.shared.clock.now_ms();
                    let retry_within = earliest.map(|end| {
                        Duration::from_millis(u64::try_from(end.saturating_sub(now)).unwrap_or(0))
                    });
                    return Ok(PermitTry::Full { retry_within });
                }
                PermitOnce::Conflict(recorded) => return Err(request.count_conflict(recorded)),
                PermitOnce::Refused => {
                    return Err(LockError::config(
                        "fencing_counters: the counter refused the increment",
                    ));
                }
            };
            self.shared.count_commit();
            let name: Arc<[u8]> = Arc::from(name);
            let lost = CancellationToken::new();
            let mut renewal = Renewal::new(Arc::clone(&name), owner, lease, lost.clone(), started)
                .every(self.shared.renew_every, started)
                .of_kind(Kind::Permit);
            if !request.renew {
                renewal = renewal.unrenewed();
            }
            let deadline = renewal.deadline();
            let id = match self.shared.renewer.register(renewal) {
                Ok(id) => id,
                Err(err) => {
                    if self.shared.release_permit(&name, &owner).await.is_err() {
                        tracing::warn!(
                            backend = NAME,
                            "a permit taken but not handed out could not be given back; it frees itself when its lease ends"
                        );
                    }
                    return Err(err);
                }
            };
            Ok(PermitTry::Acquired(
                Acquired::new(
                    u64::try_from(token).ok(),
                    lost.clone(),
                    Box::new(SqliteHeld {
                        shared: Arc::clone(&self.shared),
                        id,
                        name,
                        owner,
                        lost,
                        kind: Kind::Permit,
                    }),
                )
                .with_lease_deadline(deadline),
            ))
        })
    }

    fn holders<'a>(
        &'a self,
        key: &'a str,
        max_count: u32,
    ) -> BoxFuture<'a, Result<u32, LockError>> {
        Box::pin(async move {
            let clock = self.shared.clock;
            let name = key.as_bytes();
            let look = self
                .shared
                .with_busy_retry("counting permits", RELEASE_PAUSES, |conn| {
                    Look::read(conn, name, clock.now_ms(), clock.boot())
                })
                .await
                .map_err(|busy| self.shared.busy_error("counting permits", busy))?;
            let request = PermitRequest::new(key, max_count).with_waiting(Some(Duration::ZERO));
            match look.verdict(&request) {
                Verdict::Conflict(recorded) => Err(request.count_conflict(recorded)),
                _ => Ok(u32::try_from(look.live).unwrap_or(u32::MAX)),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn open(dir: &tempfile::TempDir) -> SqliteBackend {
        SqliteBackend::builder(dir.path().join("p.db"))
            .busy_timeout(Duration::from_millis(500))
            .open()
            .await
            .unwrap()
    }

    async fn try_permit(
        backend: &SqliteBackend,
        request: PermitRequest<'_>,
    ) -> Result<Option<Acquired>, LockError> {
        Ok(match backend.try_acquire_permit(request).await? {
            PermitTry::Acquired(acquired) => Some(acquired),
            PermitTry::Full { .. } => None,
        })
    }

    /// (commits, rows changed) of the backend's connection so far.
    fn writes(backend: &SqliteBackend) -> (u64, u64) {
        (
            backend.shared.commits.load(Ordering::Relaxed),
            backend.shared.inline().total_changes(),
        )
    }

    /// Defect 2 of issue 43: a try is one transaction that writes the same two rows whatever
    /// the count, and a single try of a full semaphore writes nothing.
    #[tokio::test]
    async fn a_try_is_one_transaction_whatever_the_count() {
        let dir = tempfile::tempdir().unwrap();
        let backend = open(&dir).await;
        for count in [1, 1_000_000, u32::MAX] {
            let key = format!("s{count}");
            let before = writes(&backend);
            let held = try_permit(&backend, PermitRequest::new(&key, count))
                .await
                .unwrap()
                .expect("a permit");
            let after = writes(&backend);
            assert_eq!(after.0 - before.0, 1, "one commit for a count of {count}");
            assert_eq!(after.1 - before.1, 2, "two rows for a count of {count}");
            if count == 1 {
                for _ in 0..3 {
                    assert!(
                        try_permit(&backend, PermitRequest::new(&key, 1))
                            .await
                            .unwrap()
                            .is_none()
                    );
                }
                assert_eq!(writes(&backend), after, "a full semaphore is not written");
            }
            held.handle.release().await.unwrap();
        }
    }

    /// Defect 3 of issue 43: the count is recorded while a permit is live or a waiter's mark
    /// is, and replaced once neither is; a waiter's mark holds single tries back; a served
    /// waiter clears it.
    #[tokio::test]
    async fn the_count_and_the_mark_are_recorded() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (open(&dir).await, open(&dir).await);
        let one = PermitRequest::new("s", 1);
        let held = try_permit(&a, one).await.unwrap().unwrap();
        let conflict = try_permit(&b, PermitRequest::new("s", 5))
            .await
            .unwrap_err();
        assert!(
            matches!(&conflict, LockError::Config { message }
                if message.contains("max_count 1") && message.contains("max_count 5")),
            "{conflict:?}"
        );
        let waiting = one.with_waiting(Some(Duration::from_secs(3600)));
        assert!(try_permit(&b, waiting).await.unwrap().is_none());
        held.handle.release().await.unwrap();
        // Free, but the waiter is marked: a single try does not take it, another count is
        // refused, and the waiter's next try is served.
        assert!(try_permit(&a, one).await.unwrap().is_none());
        assert!(matches!(
            try_permit(&a, PermitRequest::new("s", 5)).await,
            Err(LockError::Config { .. })
        ));
        assert_eq!(a.holders("s", 1).await.unwrap(), 0);
        assert!(matches!(
            a.holders("s", 5).await,
            Err(LockError::Config { .. })
        ));
        let served = try_permit(&b, waiting).await.unwrap().unwrap();
        served.handle.release().await.unwrap();
        // Nobody holds or waits: a new count is taken.
        let mut five = Vec::new();
        for _ in 0..5 {
            let taken = try_permit(&a, PermitRequest::new("s", 5)).await.unwrap();
            five.push(taken.expect("a permit of five"));
        }
        assert_eq!(b.holders("s", 5).await.unwrap(), 5);
        assert!(
            try_permit(&b, PermitRequest::new("s", 5))
                .await
                .unwrap()
                .is_none()
        );
        // Tokens increase per semaphore across its permits.
        let mut tokens: Vec<u64> = five.iter().map(|p| p.fencing_token.unwrap()).collect();
        tokens.sort_unstable();
        tokens.dedup();
        assert_eq!(tokens.len(), 5);
        assert!(tokens[0] > served.fencing_token.unwrap());
        for permit in five {
            permit.handle.release().await.unwrap();
        }
    }

    /// A permit whose lease ran out no longer counts, and is never revived: its holder finds
    /// it lost; a renewed permit lasts past its lease.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_expired_permit_frees_its_place_and_stays_lost() {
        let dir = tempfile::tempdir().unwrap();
        let backend = open(&dir).await;
        let lease = Duration::from_millis(200);
        let short = PermitRequest::new("s", 1)
            .with_lease(Some(lease))
            .with_renewal(false);
        let first = try_permit(&backend, short).await.unwrap().unwrap();
        let renewed = try_permit(&backend, PermitRequest::new("r", 1).with_lease(Some(lease)))
            .await
            .unwrap()
            .unwrap();
        tokio::time::sleep(lease * 3).await;
        let second = try_permit(&backend, PermitRequest::new("s", 1))
            .await
            .unwrap()
            .expect("the expired permit no longer counts");
        assert!(second.fencing_token > first.fencing_token);
        let control = first.handle.lease_control().unwrap();
        assert!(!control.verify_still_held().await.unwrap());
        assert!(!control.extend(Duration::from_secs(30)).await.unwrap());
        assert!(first.lost.is_cancelled());
        assert_eq!(
            first.handle.release_outcome().await.unwrap(),
            ReleaseOutcome::AlreadyReleased
        );
        assert!(
            renewed
                .handle
                .lease_control()
                .unwrap()
                .verify_still_held()
                .await
                .unwrap()
        );
        assert!(!renewed.lost.is_cancelled());
        assert!(
            try_permit(&backend, PermitRequest::new("r", 1))
                .await
                .unwrap()
                .is_none()
        );
        renewed.handle.release().await.unwrap();
        second.handle.release().await.unwrap();
    }

    /// With shared fencing counters, a permit's token comes from its key's counter (above
    /// every earlier one), and the semaphore's row goes once nobody holds or waits.
    #[tokio::test]
    async fn shared_counters_issue_the_tokens_and_keep_no_idle_semaphore() {
        let dir = tempfile::tempdir().unwrap();
        let backend = SqliteBackend::builder(dir.path().join("p.db"))
            .fencing_counters(4)
            .open()
            .await
            .unwrap();
        let first = try_permit(&backend, PermitRequest::new("s", 2))
            .await
            .unwrap()
            .unwrap();
        let second = try_permit(&backend, PermitRequest::new("s", 2))
            .await
            .unwrap()
            .unwrap();
        assert!(first.fencing_token.unwrap() >= 1 << 48, "{first:?}");
        assert!(second.fencing_token > first.fencing_token);
        first.handle.release().await.unwrap();
        second.handle.release().await.unwrap();
        let rows: i64 = Connection::open(dir.path().join("p.db"))
            .unwrap()
            .query_row(
                "SELECT count(*) FROM __distributed_lock_semaphores",
                [],
                |row| row.get(0),
            )
            .unwrap();
        assert_eq!(rows, 0);
        let third = try_permit(&backend, PermitRequest::new("s", 3))
            .await
            .unwrap()
            .unwrap();
        assert!(third.fencing_token > second.fencing_token);
        third.handle.release().await.unwrap();
    }
}
