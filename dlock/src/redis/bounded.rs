//! Shared fencing counters on Redis (`fencing_counters=N`, see [`crate::counters`]): where
//! they live, joining the store's mode, and which counter an acquisition increments.

use redis::Value;
use tokio::sync::OnceCell;

use super::commands::Counter;
use super::{KeyLayout, NAME, Shared, fence_key};
use crate::LockError;
use crate::counters;

/// The shared counters of a backend with `fencing_counters`.
pub(super) struct Counters {
    /// `N`.
    pub(super) n: u32,
    /// The key of the store's record of the counters' mode.
    record: Vec<u8>,
    /// The epoch and mode (`N:epoch`) this backend joined, once it has.
    joined: OnceCell<(u64, Vec<u8>)>,
}

impl Counters {
    /// The key of the counter the lock `key` increments.
    pub(super) fn key_of(&self, key: &str) -> Vec<u8> {
        counter_key(&self.record, counters::fencing_counter(key, self.n))
    }

    pub(super) fn new(n: u32, prefix: &[u8], layout: KeyLayout) -> Counters {
        Counters {
            n,
            record: record_key(prefix, layout),
            joined: OnceCell::new(),
        }
    }
}

/// The check of a backend with per-key counters that its store was never switched to shared
/// ones: made once, at the backend's first fenced acquisition (see [`plan`]).
pub(super) struct PerKey {
    /// The key of the store's record of the counters' mode.
    record: Vec<u8>,
    checked: OnceCell<()>,
}

impl PerKey {
    pub(super) fn new(prefix: &[u8], layout: KeyLayout) -> PerKey {
        PerKey {
            record: record_key(prefix, layout),
            checked: OnceCell::new(),
        }
    }
}

/// The key of the record of a prefix's counters' mode: `{prefix}{%fence}` when tagged (no
/// lock key: in a lock's tag `%` is always followed by `25`, `7B` or `7D`), `{prefix}` + byte
/// 0xFF + `fence` when plain (no lock key: a lock name is UTF-8, which has no 0xFF, and a
/// per-key counter or readers' set of a plain key has a name before its 0xFF).
pub(super) fn record_key(prefix: &[u8], layout: KeyLayout) -> Vec<u8> {
    let mut key = prefix.to_vec();
    match layout {
        KeyLayout::Tagged => key.extend_from_slice(b"{%fence}"),
        KeyLayout::Plain => {
            key.push(0xff);
            key.extend_from_slice(b"fence");
        }
    }
    key
}

/// The key of counter number `i`: the record's key, `:` and `i` in decimal.
pub(super) fn counter_key(record: &[u8], i: u32) -> Vec<u8> {
    let mut key = record.to_vec();
    key.push(b':');
    key.extend_from_slice(i.to_string().as_bytes());
    key
}

/// What one acquisition increments: its keys, owned.
pub(super) enum Plan {
    /// No fencing.
    Off,
    /// The key's own counter.
    PerKey(Vec<u8>),
    /// A shared counter, in the epoch the backend joined.
    Shared {
        counter: Vec<u8>,
        record: Vec<u8>,
        mode: Vec<u8>,
        epoch: u64,
    },
}

impl Plan {
    /// The counter as the acquisition script takes it.
    pub(super) fn counter(&self) -> Option<Counter<'_>> {
        match self {
            Plan::Off => None,
            Plan::PerKey(key) => Some(Counter::PerKey(key)),
            Plan::Shared {
                counter,
                record,
                mode,
                ..
            } => Some(Counter::Shared {
                counter,
                record,
                mode,
            }),
        }
    }

    /// The fencing token of a counter's new value `count`.
    pub(super) fn token(&self, count: Option<u64>) -> Result<Option<u64>, LockError> {
        match (self, count) {
            (Plan::Shared { epoch, .. }, Some(count)) => counters::token(*epoch, count).map(Some),
            (_, count) => Ok(count),
        }
    }

    /// `err` as a typed error when the script refused a mode that is not the store's.
    pub(super) fn refine(&self, shared: &Shared, err: LockError) -> LockError {
        match (self, &shared.counters, err.db_code()) {
            (Plan::Shared { epoch, .. }, Some(ours), Some("DLOCKCOUNTERS")) => {
                let store = store_of(&err);
                counters::switched_away(NAME, ours.n, *epoch, &store)
            }
            _ => err,
        }
    }
}

/// The record the server quoted in a `DLOCKCOUNTERS` error, as `fencing_counters=N, epoch e`.
fn store_of(err: &LockError) -> String {
    let text = err.to_string();
    let record = text
        .split("DLOCKCOUNTERS")
        .nth(1)
        .unwrap_or("")
        .split_whitespace()
        .next()
        .unwrap_or("");
    match record.split_once(':') {
        Some((n, e)) => format!("fencing_counters={n}, epoch {e}"),
        None => "no record: per-key counters".to_owned(),
    }
}

/// What the acquisition of `key` (stored under `lock_key`) increments: joins the store's
/// counters first, once per backend (see [`crate::counters`]); with per-key counters,
/// checks once that the store was not switched to shared ones.
pub(super) async fn plan(shared: &Shared, key: &str, lock_key: &[u8]) -> Result<Plan, LockError> {
    if !shared.fencing {
        return Ok(Plan::Off);
    }
    let Some(ours) = &shared.counters else {
        let check = &shared.per_key;
        check
            .checked
            .get_or_try_init(|| refuse_if_switched(shared, &check.record))
            .await?;
        return Ok(Plan::PerKey(fence_key(shared.layout, lock_key)));
    };
    let (epoch, mode) = ours.joined.get_or_try_init(|| join(shared, ours)).await?;
    Ok(Plan::Shared {
        counter: ours.key_of(key),
        record: ours.record.clone(),
        mode: mode.clone(),
        epoch: *epoch,
    })
}

/// Joins (or switches) the store's counters: the epoch and the mode `N:epoch`.
async fn join(shared: &Shared, ours: &Counters) -> Result<(u64, Vec<u8>), LockError> {
    let what = "joining the store's fencing counters";
    let n = ours.n.to_string();
    let max = counters::MAX_EPOCH.to_string();
    let keys: [&[u8]; 1] = [&ours.record];
    let args: [&[u8]; 2] = [n.as_bytes(), max.as_bytes()];
    let eval = shared
        .conn
        .eval(&shared.conn.scripts.join_counters, &keys, &args);
    let reply = shared.bounded(what, eval).await.map_err(|err| {
        if err.db_code() == Some("DLOCKCOUNTERS") {
            LockError::config(format!("{NAME}: {what}: {err}"))
        } else {
            err
        }
    })?;
    let epoch = match reply {
        Value::Int(e) if e > 0 => e.unsigned_abs(),
        other => {
            return Err(LockError::backend(
                NAME,
                format!("{what}: the script answered {other:?}"),
                None,
                None,
            ));
        }
    };
    tracing::debug!(
        counters = ours.n,
        epoch,
        "joined the store's fencing counters"
    );
    Ok((epoch, format!("{n}:{epoch}").into_bytes()))
}

/// Refuses per-key counters on a store that was switched to shared ones (`fencing_counters`):
/// a key's own counter is far below the tokens issued since the switch (`epoch × 2^48 +
/// count`), so going back would hand out tokens lower than ones already issued. The record
/// of the counters' mode (`record`) is read with `GET`, which the least-privileged users of
/// the script paths may run, or with `EXISTS` where `GET` is refused (the native paths'
/// users; see Permissions in the module docs): one of the two must be allowed on the
/// prefix's keys. dlock never deletes the record: once a prefix had shared counters, it
/// keeps them.
async fn refuse_if_switched(shared: &Shared, record: &[u8]) -> Result<(), LockError> {
    let what = "checking that the store's fencing counters were never made shared";
    let noperm = |err: &LockError| err.db_code() == Some("NOPERM");
    let mut get = redis::cmd("GET");
    get.arg(record);
    let store = match shared.bounded(what, shared.conn.query(&get)).await {
        Ok(Value::Nil) => return Ok(()),
        Ok(Value::BulkString(mode)) => match String::from_utf8_lossy(&mode).split_once(':') {
            Some((n, epoch)) => format!("fencing_counters={n}, epoch {epoch}"),
            None => "a record of the counters that is not N:epoch".to_owned(),
        },
        Ok(other) => {
            return Err(LockError::backend(
                NAME,
                format!("{what}: GET answered {other:?}"),
                None,
                None,
            ));
        }
        Err(err) if noperm(&err) => {
            let mut exists = redis::cmd("EXISTS");
            exists.arg(record);
            match shared.bounded(what, shared.conn.query(&exists)).await {
                Ok(Value::Int(0)) => return Ok(()),
                Ok(_) => "shared counters (the user may not read the record)".to_owned(),
                Err(err) if noperm(&err) => {
                    return Err(LockError::backend(
                        NAME,
                        format!(
                            "{what}: the Redis user may run neither `get` nor `exists` on the \
                             record of the prefix's fencing counters `{}`; grant `+get` or \
                             `+exists` (see Permissions in the dlock::redis docs)",
                            String::from_utf8_lossy(record).escape_debug()
                        ),
                        Some("NOPERM".to_owned()),
                        Some(Box::new(err)),
                    ));
                }
                Err(err) => return Err(err),
            }
        }
        Err(err) => return Err(err),
    };
    Err(counters::per_key_refused(NAME, &store))
}
