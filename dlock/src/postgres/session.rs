//! What the session engine runs on a PostgreSQL connection.

use std::time::Duration;

use sqlx::error::DatabaseError;
use sqlx::postgres::{PgConnectOptions, PgConnection};
use sqlx::{Connection, Row};

use super::Postgres;
use super::statements::*;
use crate::backend::{BoxFuture, StoreLock};
use crate::session::{Connector, Dial, Failure, Grant, Mode, PermitAnswer, PermitCount, Session};
use crate::sqlx_engine::{
    SqlxErrors, connect_within, db_code, driver_error, is_connection_error, ping, settle,
    settle_pauses,
};
use crate::{LockError, lock_id};

// ---------------------------------------------------------------------------------------------
// Sessions: what the shared connection machinery runs on a PostgreSQL connection.

/// Opens lock and wait connections.
#[derive(Debug)]
pub struct PgConnector {
    pub(super) dial: Dial<Postgres>,
    /// The shared counters the backend joined (`fencing_counters`), if any.
    pub(super) counted: Option<Counted>,
}

impl PgConnector {
    pub(super) async fn open_session(&self) -> Result<PgSession, LockError> {
        let mut conn = open_connection(&self.dial.target, self.dial.connect_timeout).await?;
        let (pid, started, _): (i32, String, i64) = sqlx::query_as(IDENTITY_SQL)
            .fetch_one(&mut conn)
            .await
            .map_err(|e| driver_error::<Postgres>("opening a connection", e))?;
        Ok(PgSession {
            conn,
            fencing: self.dial.fencing,
            counted: self.counted,
            identity: PgCancel { pid, started },
        })
    }
}

/// A semaphore: its gate (a one-key lock id, also its fencing counter row), the class of its
/// slots (the first key of the two-key form), its count and its queue lock's id.
#[derive(Debug, Clone, Copy)]
pub struct PgSemaphore {
    gate: i64,
    class: i32,
    count: u32,
    queue: i64,
}

/// A permit: the slot `(class, slot)` held exclusively and the record `(class, count)`
/// shared.
#[derive(Debug, Clone, Copy)]
pub struct PgPermit {
    class: i32,
    slot: u32,
    count: u32,
}

impl Connector for PgConnector {
    /// The advisory lock id.
    type Resource = i64;
    type Semaphore = PgSemaphore;
    type Session = PgSession;
    /// The server counts the live slots in `pg_locks`, so a try walks at most one more slot
    /// than are held: any count.
    const MAX_PERMITS: u32 = u32::MAX;

    const NAME: &'static str = NAME;
    /// The longest `lock_timeout` the server takes.
    const MAX_WAIT: Duration = Duration::from_millis(i32::MAX as u64);
    const PING_TIMEOUT: Duration = Duration::from_secs(1);
    const WAIT_GRACE: Duration = Duration::from_secs(1);

    fn wait_resolution(&self) -> Duration {
        Duration::from_millis(1)
    }

    fn resource(&self, key: &str) -> i64 {
        lock_id(key)
    }

    fn semaphore(&self, key: &str, max_count: u32, queue: i64) -> PgSemaphore {
        let (gate, class) = semaphore_ids(key);
        PgSemaphore {
            gate,
            class,
            count: max_count,
            queue,
        }
    }

    /// `pg_advisory_lock_shared` and friends.
    fn shared_locks(&self) -> Result<(), LockError> {
        Ok(())
    }

    fn open(&self) -> BoxFuture<'_, Result<PgSession, LockError>> {
        Box::pin(self.open_session())
    }

    /// `pg_locks`, on a connection of its own: advisory locks carry only their id, so a lock
    /// is named by its key when it is one of `known`'s, and by its id otherwise.
    fn store_locks<'a>(
        &'a self,
        known: &'a [&'a str],
    ) -> BoxFuture<'a, Result<Vec<StoreLock>, LockError>> {
        Box::pin(async move {
            let mut conn = open_connection(&self.dial.target, self.dial.connect_timeout).await?;
            let rows: Vec<(i64, String, i64, String)> = sqlx::query_as(STORE_LOCKS_SQL)
                .fetch_all(&mut conn)
                .await
                .map_err(|e| driver_error::<Postgres>("listing the locks", e))?;
            let semaphores: Vec<(i64, i64, Option<i64>)> = sqlx::query_as(STORE_PERMITS_SQL)
                .fetch_all(&mut conn)
                .await
                .map_err(|e| driver_error::<Postgres>("listing the semaphores", e))?;
            let _ = conn.close().await;
            let keys: std::collections::HashMap<i64, &str> =
                known.iter().map(|key| (lock_id(key), *key)).collect();
            let classes: std::collections::HashMap<i64, &str> = known
                .iter()
                .map(|key| (i64::from(semaphore_ids(key).1 as u32), *key))
                .collect();
            let locks = rows.into_iter().map(|(id, mode, holders, names)| {
                let readers = if mode == "ShareLock" {
                    u32::try_from(holders).unwrap_or(u32::MAX)
                } else {
                    0
                };
                StoreLock::new(id.to_string())
                    .with_key(keys.get(&id).map(|key| (*key).to_owned()))
                    .with_readers(readers)
                    // The holding sessions' `application_name`: PostgreSQL's owner.
                    .with_owner(Some(names))
            });
            // A semaphore is one entry, shared by its holders: `semaphore <class> of <count>`.
            let permits = semaphores.into_iter().map(|(class, holders, count)| {
                let count = count.map_or_else(|| "?".to_owned(), |count| count.to_string());
                StoreLock::new(format!("semaphore {class} of {count}"))
                    .with_key(classes.get(&class).map(|key| (*key).to_owned()))
                    .with_readers(u32::try_from(holders).unwrap_or(u32::MAX))
            });
            Ok(locks.chain(permits).collect())
        })
    }
}

/// One connection, with the identity that [`CANCEL_SQL`] aims at.
#[derive(Debug)]
pub struct PgSession {
    pub(super) conn: PgConnection,
    fencing: bool,
    pub(super) counted: Option<Counted>,
    identity: PgCancel,
}

/// `pg_cancel_backend` for an abandoned wait on another connection, identified by its process
/// id and start time (so a reused process id is never hit).
#[derive(Debug)]
pub struct PgCancel {
    pid: i32,
    started: String,
}

/// Shared counters (`fencing_counters`) a backend joined: how many, and the epoch's base
/// (`epoch << 48`).
#[derive(Debug, Clone, Copy)]
pub(super) struct Counted {
    pub(super) n: u32,
    pub(super) base: i64,
}

impl Counted {
    /// The counter row of the lock `id` (the key's [`crate::fencing_counter`]).
    fn row(self, id: i64) -> i64 {
        i64::from(u32::try_from((id as u64) % u64::from(self.n)).unwrap_or(0))
    }
}

impl PgSession {
    /// One try; the fencing token is issued in the same statement. Under shared counters, a
    /// grant without a token means the increment was refused (see [`TRY_COUNTED_SQL`]).
    async fn try_lock(&mut self, id: i64, sql: ModeSql) -> Result<Option<Grant>, sqlx::Error> {
        if let Some(counted) = self.counted {
            let row = sqlx::query(sql.try_counted)
                .bind(id)
                .bind(counted.row(id))
                .bind(counted.base)
                .fetch_one(&mut self.conn)
                .await?;
            let got: bool = row.try_get(0)?;
            let token: Option<i64> = row.try_get(1)?;
            Ok(got.then(|| Grant {
                token: token.and_then(|t| u64::try_from(t).ok()),
            }))
        } else if self.fencing {
            let row = sqlx::query(sql.try_fenced)
                .bind(id)
                .fetch_one(&mut self.conn)
                .await?;
            let got: bool = row.try_get(0)?;
            let token: Option<i64> = row.try_get(1)?;
            Ok(got.then(|| Grant {
                token: token.and_then(|t| u64::try_from(t).ok()),
            }))
        } else {
            let got: bool = sqlx::query_scalar(sql.try_lock)
                .bind(id)
                .fetch_one(&mut self.conn)
                .await?;
            Ok(got.then_some(Grant::PLAIN))
        }
    }

    /// A native wait under `lock_timeout`. If the timeout (or a cancel) fires at the moment
    /// the lock is granted, `pg_locks` decides.
    async fn wait_lock(
        &mut self,
        id: i64,
        sql: ModeSql,
        wait: Duration,
    ) -> Result<Option<Grant>, sqlx::Error> {
        // Answers are read with `fetch_optional` rather than `execute`, which reads them
        // through sqlx's row stream at a few thousand more instructions per statement.
        sqlx::query(SET_LOCK_TIMEOUT_SQL)
            .bind(lock_timeout_setting(wait))
            .fetch_optional(&mut self.conn)
            .await?;
        let waited = if let Some(counted) = self.counted {
            sqlx::query_scalar::<_, i64>(sql.wait_counted)
                .bind(id)
                .bind(counted.row(id))
                .bind(counted.base)
                .fetch_optional(&mut self.conn)
                .await
                .map(|token| token.and_then(|t| u64::try_from(t).ok()))
        } else if self.fencing {
            sqlx::query_scalar::<_, i64>(sql.wait_fenced)
                .bind(id)
                .fetch_one(&mut self.conn)
                .await
                .map(|token| u64::try_from(token).ok())
        } else {
            sqlx::query(sql.wait)
                .bind(id)
                .fetch_optional(&mut self.conn)
                .await
                .map(|_| None)
        };
        match waited {
            Ok(token) => Ok(Some(Grant { token })),
            Err(err) if is_wait_ended(&err) => {
                let held: bool = sqlx::query_scalar(HELD_SQL)
                    .bind(id)
                    .fetch_one(&mut self.conn)
                    .await?;
                if !held {
                    return Ok(None);
                }
                let token = if let Some(counted) = self.counted {
                    let token: Option<i64> = sqlx::query_scalar(FENCE_COUNTED_SQL)
                        .bind(counted.row(id))
                        .bind(counted.base)
                        .fetch_optional(&mut self.conn)
                        .await?;
                    token.and_then(|t| u64::try_from(t).ok())
                } else if self.fencing {
                    let token: i64 = sqlx::query_scalar(FENCE_SQL)
                        .bind(id)
                        .fetch_one(&mut self.conn)
                        .await?;
                    u64::try_from(token).ok()
                } else {
                    None
                };
                Ok(Some(Grant { token }))
            }
            Err(err) => Err(err),
        }
    }
}

impl PgSession {
    /// Gives back lock `id` after `error`, with the unlock statement of its mode's `sql`: the
    /// session stays usable when the unlock goes through.
    async fn give_back(&mut self, id: i64, sql: ModeSql, error: LockError) -> Failure {
        match sqlx::query(sql.unlock)
            .bind(id)
            .execute(&mut self.conn)
            .await
        {
            Ok(_) => Failure::statement(error),
            Err(_) => Failure::connection(error),
        }
    }

    /// Why a shared counter refused an increment: the store was switched to another mode
    /// (or, in theory, the counter ran out of counts in this epoch).
    async fn refusal(&mut self) -> LockError {
        let Some(counted) = self.counted else {
            return LockError::config("fencing_counters: no shared counters");
        };
        let epoch = (counted.base >> crate::counters::EPOCH_SHIFT).unsigned_abs();
        let mode: Option<i64> = sqlx::query_scalar(MODE_SQL)
            .bind(MODE_ID)
            .fetch_optional(&mut self.conn)
            .await
            .ok()
            .flatten();
        match mode {
            Some(mode) if mode != mode_value(counted.n, epoch) => {
                crate::counters::switched_away(NAME, counted.n, epoch, &describe_mode(mode))
            }
            _ => crate::counters::token(epoch, crate::counters::MAX_COUNT + 1)
                .err()
                .unwrap_or_else(|| LockError::config("fencing_counters: the counter refused")),
        }
    }
}

/// The mode row's value of `n` counters in `epoch`.
fn mode_value(n: u32, epoch: u64) -> i64 {
    (i64::from(n) << 16) | i64::try_from(epoch).unwrap_or(0)
}

/// A mode row's value, for messages.
fn describe_mode(mode: i64) -> String {
    if mode <= 0 {
        "no record: per-key counters".to_owned()
    } else {
        format!("fencing_counters={}, epoch {}", mode >> 16, mode & 0xffff)
    }
}

/// Joins the store's shared counters with `n` counters, or switches the store to them (see
/// [`crate::fencing_counter`]): one transaction, which locks the mode row, so joins and
/// switches run one at a time. Returns the epoch's base (`epoch << 48`).
pub(super) async fn join_counters(conn: &mut PgConnection, n: u32) -> Result<i64, LockError> {
    let what = "joining the store's fencing counters (dlock_fencing)";
    let fail = |e| driver_error::<Postgres>(what, e);
    let mut tx = conn.begin().await.map_err(fail)?;
    sqlx::query(MODE_CREATE_SQL)
        .bind(MODE_ID)
        .execute(&mut *tx)
        .await
        .map_err(fail)?;
    let mode: i64 = sqlx::query_scalar(MODE_LOCK_SQL)
        .bind(MODE_ID)
        .fetch_one(&mut *tx)
        .await
        .map_err(fail)?;
    let (store_n, store_epoch) = if mode > 0 {
        (mode >> 16, mode & 0xffff)
    } else {
        (0, 0)
    };
    if store_n == i64::from(n) && store_epoch > 0 {
        tx.commit().await.map_err(fail)?;
        return Ok(store_epoch << crate::counters::EPOCH_SHIFT);
    }
    // A switch: every counter row a backend of the old mode may touch, and every one of
    // ours, starts the next epoch, above every epoch seen in them.
    let rows = store_n.max(i64::from(n));
    let top: i64 = sqlx::query_scalar(MAX_EPOCH_SQL)
        .bind(rows)
        .fetch_one(&mut *tx)
        .await
        .map_err(fail)?;
    let epoch = store_epoch.max(top) + 1;
    if epoch.unsigned_abs() > crate::counters::MAX_EPOCH {
        return Err(LockError::config(format!(
            "{NAME}: {what}: no epoch is left for a switch (the store was switched \
             {} times)",
            crate::counters::MAX_EPOCH
        )));
    }
    let base = epoch << crate::counters::EPOCH_SHIFT;
    sqlx::query(SWITCH_SQL)
        .bind(rows)
        .bind(base)
        .execute(&mut *tx)
        .await
        .map_err(fail)?;
    sqlx::query(MODE_SET_SQL)
        .bind(MODE_ID)
        .bind(mode_value(n, epoch.unsigned_abs()))
        .execute(&mut *tx)
        .await
        .map_err(fail)?;
    tx.commit().await.map_err(fail)?;
    tracing::info!(
        counters = n,
        epoch,
        "switched the store's fencing counters (dlock_fencing) to fencing_counters"
    );
    Ok(base)
}

/// With per-key counters: refuses a store switched to shared ones.
pub(super) async fn refuse_if_switched(conn: &mut PgConnection) -> Result<(), LockError> {
    let mode: Option<i64> = sqlx::query_scalar(MODE_SQL)
        .bind(MODE_ID)
        .fetch_optional(&mut *conn)
        .await
        .map_err(|e| driver_error::<Postgres>("looking for the store's fencing counters", e))?;
    match mode {
        Some(mode) if mode > 0 => Err(crate::counters::per_key_refused(NAME, &describe_mode(mode))),
        _ => Ok(()),
    }
}

impl PgSession {
    /// One permit statement: the slot taken (if any), a conflicting count, the token.
    async fn permit_statement(
        &mut self,
        semaphore: &PgSemaphore,
        waiting: bool,
    ) -> Result<(Option<i64>, Option<i64>, Option<i64>), sqlx::Error> {
        let start = i64::from(fastrand::u32(0..semaphore.count.max(1)));
        let permit_sql = if self.counted.is_some() {
            PERMIT_COUNTED_SQL
        } else if self.fencing {
            PERMIT_FENCED_SQL
        } else {
            PERMIT_SQL
        };
        let query = sqlx::query_as(permit_sql)
            .bind(semaphore.gate)
            .bind(semaphore.class)
            .bind(i64::from(semaphore.count))
            .bind(start)
            .bind(semaphore.queue)
            .bind(waiting);
        let query = match self.counted {
            Some(counted) => query.bind(counted.row(semaphore.gate)).bind(counted.base),
            None => query,
        };
        query.fetch_one(&mut self.conn).await
    }
}

impl Session for PgSession {
    type Resource = i64;
    type Semaphore = PgSemaphore;
    type Permit = PgPermit;
    type Interrupt = PgCancel;

    fn try_permit<'a>(
        &'a mut self,
        semaphore: &'a PgSemaphore,
        waiting: bool,
    ) -> BoxFuture<'a, Result<PermitAnswer<PgPermit>, Failure>> {
        Box::pin(async move {
            let (slot, other, token) = match self.permit_statement(semaphore, waiting).await {
                Ok(row) => row,
                // The walk may have taken a slot before the statement failed, and session
                // advisory locks outlive their statement: only the session's end frees it.
                Err(err) => {
                    return Err(Failure::connection(driver_error::<Postgres>(
                        "taking a permit",
                        err,
                    )));
                }
            };
            if let Some(recorded) = other {
                return Ok(PermitAnswer::Conflict {
                    recorded: u32::try_from(recorded).unwrap_or(u32::MAX),
                });
            }
            let Some(slot) = slot.and_then(|slot| u32::try_from(slot).ok()) else {
                return Ok(PermitAnswer::Full);
            };
            let permit = PgPermit {
                class: semaphore.class,
                slot,
                count: semaphore.count,
            };
            if self.counted.is_some() && token.is_none() {
                // The shared counter refused the increment: give the permit back, say why.
                let refusal = self.refusal().await;
                return Err(match self.release_permit(&permit).await {
                    Ok(()) => Failure::statement(refusal),
                    Err(_) => Failure::connection(refusal),
                });
            }
            Ok(PermitAnswer::Granted {
                permit,
                token: token.and_then(|t| u64::try_from(t).ok()),
            })
        })
    }

    fn release_permit<'a>(
        &'a mut self,
        permit: &'a PgPermit,
    ) -> BoxFuture<'a, Result<(), Failure>> {
        Box::pin(async move {
            sqlx::query_scalar::<_, bool>(PERMIT_RELEASE_SQL)
                .bind(permit.class)
                .bind(int4_bits(permit.slot))
                .bind(int4_bits(permit.count))
                .fetch_one(&mut self.conn)
                .await
                .map(drop)
                .map_err(|err| {
                    Failure::connection(driver_error::<Postgres>("releasing a permit", err))
                })
        })
    }

    fn count_permits<'a>(
        &'a mut self,
        semaphore: &'a PgSemaphore,
    ) -> BoxFuture<'a, Result<PermitCount, Failure>> {
        Box::pin(async move {
            let (holders, other, any): (i64, Option<i64>, Option<i64>) =
                sqlx::query_as(PERMIT_COUNT_SQL)
                    .bind(semaphore.class)
                    .bind(i64::from(semaphore.count))
                    .fetch_one(&mut self.conn)
                    .await
                    .map_err(|err| {
                        crate::sqlx_engine::failure::<Postgres>("counting the permits", err)
                    })?;
            Ok(PermitCount {
                holders: u32::try_from(holders).unwrap_or(u32::MAX),
                recorded: other.or(any).and_then(|count| u32::try_from(count).ok()),
            })
        })
    }

    fn lock<'a>(
        &'a mut self,
        id: &'a i64,
        mode: Mode,
        wait: Duration,
    ) -> BoxFuture<'a, Result<Option<Grant>, Failure>> {
        let sql = mode_sql(mode);
        Box::pin(async move {
            let (what, outcome) = if wait.is_zero() {
                ("taking a lock", self.try_lock(*id, sql).await)
            } else {
                ("waiting for a lock", self.wait_lock(*id, sql, wait).await)
            };
            match outcome {
                Ok(Some(Grant { token: None })) if self.counted.is_some() => {
                    // The shared counter refused the increment: no token lower than one
                    // issued already. Give the lock back and say why.
                    let refusal = self.refusal().await;
                    Err(self.give_back(*id, sql, refusal).await)
                }
                Ok(grant) => Ok(grant),
                Err(err) if !is_connection_error::<Postgres>(&err) => {
                    // The statement failed (say, the fencing table is missing) after the lock
                    // may have been taken: give it back. The unlock cannot end another
                    // acquisition's hold on this session: the backend's claims admit one
                    // exclusive acquisition per lock id at a time, however many providers
                    // share it, and a session is never asked for a shared lock it holds.
                    let error = driver_error::<Postgres>(what, err);
                    Err(self.give_back(*id, sql, error).await)
                }
                Err(err) => Err(Failure::connection(driver_error::<Postgres>(what, err))),
            }
        })
    }

    fn unlock<'a>(&'a mut self, id: &'a i64, mode: Mode) -> BoxFuture<'a, Result<(), Failure>> {
        let sql = mode_sql(mode);
        Box::pin(async move {
            sqlx::query_scalar::<_, bool>(sql.unlock)
                .bind(*id)
                .fetch_one(&mut self.conn)
                .await
                .map(drop)
                .map_err(|err| {
                    Failure::connection(driver_error::<Postgres>("releasing a lock", err))
                })
        })
    }

    fn ping(&mut self) -> BoxFuture<'_, Result<(), Failure>> {
        Box::pin(ping::<Postgres>(&mut self.conn))
    }

    fn interrupt(&self, _id: &i64) -> Option<PgCancel> {
        Some(PgCancel {
            pid: self.identity.pid,
            started: self.identity.started.clone(),
        })
    }

    /// Cancels another session's abandoned wait, then watches the server until that session
    /// neither waits for nor holds an advisory lock. The cancel only asks, and a wait granted
    /// just before it holds its lock until the server sees the dropped connection; the
    /// acquisition's claim is kept until then, so a later acquisition of the key through the
    /// same backend never finds it held by a session that is going away.
    fn run_interrupt(&mut self, cancel: PgCancel) -> BoxFuture<'_, Result<(), Failure>> {
        Box::pin(settle::<Postgres>(
            "cancelling an abandoned wait",
            async move {
                let (pid, started) = (cancel.pid, &cancel.started);
                let cancelled = sqlx::query(CANCEL_SQL).bind(pid).bind(started);
                cancelled.execute(&mut self.conn).await?;
                let mut pauses = settle_pauses();
                loop {
                    let settled = sqlx::query_scalar(SETTLED_SQL).bind(pid).bind(started);
                    if settled.fetch_one(&mut self.conn).await? {
                        return Ok(());
                    }
                    tokio::time::sleep(pauses.next_pause().unwrap_or_default()).await;
                }
            },
        ))
    }
}

/// Opens a connection and sets its session up, within `timeout`.
async fn open_connection(
    options: &PgConnectOptions,
    timeout: Duration,
) -> Result<PgConnection, LockError> {
    let connect = async {
        let mut conn = PgConnection::connect_with(options).await?;
        sqlx::query(SESSION_SQL).execute(&mut conn).await?;
        Ok::<_, sqlx::Error>(conn)
    };
    let address = match options.get_socket() {
        Some(socket) => socket.display().to_string(),
        None => format!("{}:{}", options.get_host(), options.get_port()),
    };
    connect_within::<Postgres, _>(&address, timeout, connect).await
}

/// Makes sure the fencing table is there and usable: a table this role sees needs only its
/// three privileges (never `CREATE` on the schema); a missing one is created.
pub(super) async fn create_fencing_table(conn: &mut PgConnection) -> Result<(), LockError> {
    let (exists, usable): (bool, bool) = sqlx::query_as(FENCING_TABLE_CHECK_SQL)
        .fetch_one(&mut *conn)
        .await
        .map_err(|e| driver_error::<Postgres>("looking for the fencing table dlock_fencing", e))?;
    if exists {
        return if usable {
            Ok(())
        } else {
            Err(LockError::config(format!(
                "fencing=true: this role lacks a privilege the table dlock_fencing needs \
                 (all three of select, insert and update); an administrator grants them: \
                 {FENCING_GRANTS}"
            )))
        };
    }
    match sqlx::query(FENCING_TABLE_SQL).execute(&mut *conn).await {
        Ok(_) => Ok(()),
        // Another process created it at the same moment: `IF NOT EXISTS` checks before it
        // creates, so a race surfaces as a duplicate key in the catalogue (23505), a duplicate
        // table (42P07), or the table's row type already there (42710, "type ... already
        // exists").
        Err(e)
            if matches!(
                db_code::<Postgres>(&e).as_deref(),
                Some("23505" | "42P07" | "42710")
            ) =>
        {
            Ok(())
        }
        // No `CREATE` on the schema (nor `USAGE`, if the table is there but out of sight), or
        // no schema on the search path this role may use at all.
        Err(e) if matches!(db_code::<Postgres>(&e).as_deref(), Some("42501" | "3F000")) => {
            Err(LockError::config(format!(
                "fencing=true needs the table dlock_fencing, which this role does not see and \
             may not create ({}); an administrator creates it and grants it: {FENCING_GRANTS}",
                match &e {
                    sqlx::Error::Database(db) => db.message().to_owned(),
                    other => other.to_string(),
                }
            )))
        }
        Err(e) => Err(driver_error::<Postgres>(
            "creating the fencing table dlock_fencing",
            e,
        )),
    }
}

/// Whether a wait ended without error of its own: `lock_timeout` (55P03) or a cancel (57014).
pub(super) fn is_wait_ended(err: &sqlx::Error) -> bool {
    matches!(db_code::<Postgres>(err).as_deref(), Some("55P03" | "57014"))
}

/// Whether a SQLSTATE means the connection can no longer be trusted: connection exceptions
/// (08), operator intervention such as a terminated backend (57P), too many connections.
fn ends_connection(code: &str) -> bool {
    code.starts_with("08") || code.starts_with("57P") || code == "53300"
}

impl SqlxErrors for Postgres {
    const NAME: &'static str = NAME;
    const TLS_MODE_OPTION: &'static str = "sslmode";
    const TLS_CA_OPTION: &'static str = "sslrootcert";
    const SERVER_TLS_HINT: &'static str = "turn `ssl` on at the server";

    fn code(db: &dyn DatabaseError) -> Option<String> {
        db.code().map(|c| c.into_owned())
    }

    fn ends_connection(db: &dyn DatabaseError) -> bool {
        db.code().is_some_and(|code| ends_connection(&code))
    }

    fn config_error(what: &str, db: &dyn DatabaseError) -> Option<LockError> {
        let message = db.message();
        let text = match db.code()?.as_ref() {
            // pg_hba.conf has no line for this client without TLS.
            "28000" if message.ends_with("no encryption") => format!(
                "{what}: the server accepts this client only over TLS ({message}); connect with sslmode=verify-full and sslrootcert"
            ),
            "28P01" | "28000" => format!(
                "{what}: the server refused the credentials ({message}); check the user name and password in the URL"
            ),
            "3D000" => format!("{what}: {message}; check the database name in the URL"),
            _ => return None,
        };
        Some(LockError::config(text))
    }
}
