//! Read locks: shares of a key that several readers hold at once, and the intent of a waiting
//! writer, which holds back readers that come after it (see [Read locks](super#read-locks)).

use super::*;

/// The most keys a backend remembers having put a writer's intent on (to clear it once the
/// writer gets the key); past it, the intents are left to expire.
const INTENTS_KEPT: usize = 1024;

/// What one read acquisition's transaction found.
enum ReadOnce {
    /// The share is taken, with its fencing token; `fenced`: the token is above the
    /// `-fencing` file's record.
    Taken(i64, bool),
    /// A writer holds the key or waits for it.
    Held,
    /// The `-fencing` file exists but is not attached yet: the transaction was rolled back;
    /// attach it, and take again.
    Attach,
    /// The shared counter refused the increment: the transaction was rolled back.
    Refused,
}

impl Shared {
    /// Takes a reader's share of the key `name` for `owner`, unless a writer holds the key or
    /// waits for it. As [`Shared::take_row`]: a key found blocked in the last second is
    /// answered by a read first.
    pub(super) async fn take_read(
        &self,
        name: &[u8],
        owner: &[u8; 16],
        lease: Duration,
    ) -> Result<Take, Busy> {
        if self.seen_held(name) && self.read_blocked(&self.inline(), name)? {
            self.note_held(name);
            return Ok(Take::Held);
        }
        let waiting_since = Instant::now();
        let (mut pause, longest) = ACQUIRE_PAUSES;
        loop {
            let pass = self.gate.read().await;
            let mut again_now = false;
            let attempt = {
                let conn = self.inline();
                // Taken before the clock is read, as for a lock.
                let started = Instant::now();
                match self.read_once(&conn, name, owner, lease) {
                    Ok(ReadOnce::Taken(token, fenced)) => Some(Take::Taken {
                        started,
                        fencing: Ok(token),
                        fenced,
                    }),
                    Ok(ReadOnce::Held) => Some(Take::Held),
                    Ok(ReadOnce::Refused) => {
                        let refusal = match self.counted {
                            Some(counted) => counted.refusal(&conn),
                            None => LockError::config("fencing_counters: no shared counters"),
                        };
                        return Err(Busy::Failed(refusal));
                    }
                    Ok(ReadOnce::Attach) => {
                        self.fencing
                            .attach(&conn, self.busy_timeout)
                            .map_err(Busy::Failed)?;
                        again_now = true;
                        None
                    }
                    Err(err) => self.after_failed_try(err, "acquiring a read lock", || {
                        self.read_blocked(&conn, name)
                    })?,
                }
            };
            drop(pass);
            match attempt {
                Some(take) => return Ok(self.noted(name, take)),
                None if again_now => continue,
                None => {}
            }
            self.pause_between_tries(waiting_since, &mut pause, longest)
                .await?;
        }
    }

    /// One read acquisition, in one transaction: the lock row (held by readers from now on,
    /// until the latest lease end), the expired readers removed, this reader's row added.
    fn read_once(
        &self,
        conn: &Connection,
        name: &[u8],
        owner: &[u8; 16],
        lease: Duration,
    ) -> rusqlite::Result<ReadOnce> {
        let tx = Transaction::new_unchecked(conn, TransactionBehavior::Immediate)?;
        let clock = self.clock;
        let now = clock.now_ms();
        let end = now.saturating_add(millis(lease));
        let boot = clock.boot();
        let fenced = self.fencing.attached();
        let mut acquire = if fenced {
            tx.prepare_cached(READ_ACQUIRE_FENCED_SQL)?
        } else {
            tx.prepare_cached(READ_ACQUIRE_SQL)?
        };
        let token = returning_one(&mut acquire, params![name, end, now, boot])?;
        drop(acquire);
        // Dropping the transaction rolls it back.
        let Some(token) = token else {
            return Ok(ReadOnce::Held);
        };
        let token = token?;
        if let Some(counted) = self.counted {
            // Shared counters: the token is the counter's, final (above any `-fencing`
            // record, being of a later epoch).
            let Some(token) = counted.count(&tx, name)? else {
                return Ok(ReadOnce::Refused);
            };
            tx.prepare_cached(TRANSACTION_RECORD_SQL)?
                .execute(params![name, token])?;
            tx.prepare_cached(READERS_CLEAN_SQL)?
                .execute(params![name, now, boot])?;
            tx.prepare_cached(READER_INSERT_SQL)?
                .execute(params![name, &owner[..], end, boot])?;
            tx.commit()?;
            return Ok(ReadOnce::Taken(token, true));
        }
        // Looked at while this transaction holds the write lock, after the row was taken:
        // the argument of `Fencing` holds as for a lock's acquisition.
        if !fenced && self.fencing.may_exist() {
            return Ok(ReadOnce::Attach);
        }
        tx.prepare_cached(READERS_CLEAN_SQL)?
            .execute(params![name, now, boot])?;
        tx.prepare_cached(READER_INSERT_SQL)?
            .execute(params![name, &owner[..], end, boot])?;
        tx.commit()?;
        Ok(ReadOnce::Taken(token, fenced))
    }

    /// Whether a reader could not take `name` now (a writer holds it or waits for it), read
    /// without the write lock. A busy file is "not known": the write will tell.
    fn read_blocked(&self, conn: &Connection, name: &[u8]) -> Result<bool, Busy> {
        let clock = self.clock;
        let peek = conn
            .prepare_cached(READ_BLOCKED_SQL)
            .and_then(|mut peek| peek.exists(params![name, clock.now_ms(), clock.boot()]));
        self.peeked(peek)
    }

    /// Gives back reader `owner`'s share of `name` and sets the lock row from the readers
    /// left, in one transaction. `Released` when its lease was live; otherwise
    /// `NotOwned` when a writer holds the key now, `AlreadyReleased` when none does.
    pub(super) async fn release_read(
        &self,
        name: &[u8],
        owner: &[u8; 16],
    ) -> Result<ReleaseOutcome, Busy> {
        let clock = self.clock;
        self.with_busy_retry("releasing a read lock", RELEASE_PAUSES, |conn| {
            let tx = Transaction::new_unchecked(conn, TransactionBehavior::Immediate)?;
            let now = clock.now_ms();
            let boot = clock.boot();
            let live = {
                let mut release = tx.prepare_cached(READER_RELEASE_SQL)?;
                let mut rows = release.query(params![name, &owner[..], now, boot])?;
                let live = match rows.next()? {
                    Some(row) => row.get::<_, bool>(0)?,
                    None => false,
                };
                while rows.next()?.is_some() {}
                live
            };
            tx.prepare_cached(READERS_SYNC_SQL)?
                .execute(params![name, now, boot])?;
            if self.counted.is_some() {
                // The last reader out drops the row: it keeps no counter.
                tx.prepare_cached(super::counted::DROP_FREE_ROW_SQL)?
                    .execute(params![name])?;
            }
            let outcome = if live {
                ReleaseOutcome::Released
            } else if tx
                .prepare_cached(WRITER_PEEK_SQL)?
                .exists(params![name, now, boot])?
            {
                ReleaseOutcome::NotOwned
            } else {
                ReleaseOutcome::AlreadyReleased
            };
            tx.commit()?;
            Ok(outcome)
        })
        .await
    }

    /// Sets reader `owner`'s lease on `name` to `lease` from now, if it is live: `true` when
    /// done.
    pub(super) async fn extend_read(
        &self,
        name: &[u8],
        owner: &[u8; 16],
        lease: Duration,
    ) -> Result<bool, Busy> {
        let clock = self.clock;
        self.with_busy_retry("extending a lease", RELEASE_PAUSES, |conn| {
            let tx = Transaction::new_unchecked(conn, TransactionBehavior::Immediate)?;
            let renewed = renew_reader(&tx, clock, name, owner, lease)?;
            tx.commit()?;
            Ok(renewed)
        })
        .await
    }

    /// Whether reader `owner` holds a live share of `name`.
    pub(super) async fn verify_read(&self, name: &[u8], owner: &[u8; 16]) -> Result<bool, Busy> {
        let clock = self.clock;
        self.with_busy_retry("verifying a lock", RELEASE_PAUSES, |conn| {
            let mut verify = conn.prepare_cached(READER_VERIFY_SQL)?;
            let params = params![name, &owner[..], clock.now_ms(), clock.boot()];
            verify.query_row(params, |row| row.get::<_, i64>(0))
        })
        .await
        .map(|n| n > 0)
    }

    /// A waiting writer found `name` held: if readers hold it, leaves (or moves on) the
    /// writer's intent, which later readers respect, until a few of the writer's pauses from
    /// now ([`crate::lease::writer_intent`]). Best effort, one try: a busy file or a failure
    /// leaves it to the writer's next poll.
    pub(super) async fn writer_waits(&self, name: &[u8], pause: Duration) {
        let clock = self.clock;
        let _pass = self.gate.read().await;
        let conn = self.inline();
        let readers = conn
            .prepare_cached(READERS_HOLD_SQL)
            .and_then(|mut peek| peek.exists(params![name, clock.now_ms(), clock.boot()]));
        if !matches!(readers, Ok(true)) {
            return;
        }
        let until = clock
            .now_ms()
            .saturating_add(millis(crate::lease::writer_intent(pause)));
        let written = conn
            .prepare_cached(INTENT_SQL)
            .and_then(|mut intent| intent.execute(params![name, until, clock.boot()]));
        drop(conn);
        match written {
            Ok(_) => {
                self.count_commit();
                let mut intents = self.intents();
                if intents.len() >= INTENTS_KEPT {
                    intents.clear();
                }
                intents.insert(Box::from(name));
            }
            Err(err) if is_busy(&err) => {}
            Err(err) => {
                tracing::debug!(backend = NAME, error = %err, "a waiting writer's intent could not be written");
            }
        }
    }

    /// A writer got `name`: clears the intent this backend left on it, if any (best effort,
    /// one try: otherwise it expires soon).
    pub(super) async fn writer_got(&self, name: &[u8]) {
        {
            let mut intents = self.intents();
            if intents.is_empty() || !intents.remove(name) {
                return;
            }
        }
        let _pass = self.gate.read().await;
        let cleared = self
            .inline()
            .prepare_cached(INTENT_CLEAR_SQL)
            .and_then(|mut clear| clear.execute(params![name]));
        if cleared.is_ok() {
            self.count_commit();
        }
    }

    fn intents(&self) -> MutexGuard<'_, std::collections::HashSet<Box<[u8]>>> {
        self.intents.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Renews reader `owner` of `name` for `lease` from now, if its lease is live, and sets the
/// lock row from its readers; inside the caller's transaction. `true` when renewed.
pub(super) fn renew_reader(
    conn: &Connection,
    clock: &LeaseClock,
    name: &[u8],
    owner: &[u8; 16],
    lease: Duration,
) -> rusqlite::Result<bool> {
    let now = clock.now_ms();
    let boot = clock.boot();
    let end = now.saturating_add(millis(lease));
    let changed = conn.prepare_cached(READER_RENEW_SQL)?.execute(params![
        name,
        &owner[..],
        end,
        now,
        boot
    ])?;
    if changed == 1 {
        conn.prepare_cached(READERS_SYNC_SQL)?
            .execute(params![name, now, boot])?;
    }
    Ok(changed == 1)
}
