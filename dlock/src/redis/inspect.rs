//! Store inspection: the locks under the backend's prefix, found with `SCAN`.

use std::time::Duration;

use redis::{Cmd, Value};

use super::cluster::masters;
use super::permits::semaphore_name;
use super::read::readers_key;
use super::{KeyLayout, Shared, fence_key, owner};
use crate::LockError;
use crate::backend::StoreLock;

/// Keys asked for per `SCAN` call.
const SCAN_COUNT: u64 = 1000;

/// The cluster's `CLUSTER NODES` answer, as text.
pub(super) async fn cluster_nodes(shared: &Shared) -> Result<String, LockError> {
    let nodes: Cmd = redis::cmd("CLUSTER").arg("NODES").clone();
    let what = "reading the cluster's nodes";
    Ok(
        match shared.bounded(what, shared.conn.query(&nodes)).await? {
            Value::BulkString(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
            Value::VerbatimString { text, .. } => text,
            _ => String::new(),
        },
    )
}

/// Every lock held under `shared`'s prefix now, in the backend's layout.
pub(super) async fn store_locks(shared: &Shared) -> Result<Vec<StoreLock>, LockError> {
    let what = "listing the locks";
    let mut pattern = glob_escaped(&shared.prefix);
    if shared.layout == KeyLayout::Tagged {
        pattern.push(b'{');
    }
    pattern.push(b'*');
    let time: Cmd = redis::cmd("TIME");
    let now_ms = server_ms(&shared.bounded(what, shared.conn.query(&time)).await?);
    // On a cluster, each master's keys are scanned on that master.
    let masters = if shared.conn.is_cluster() {
        let masters = masters(&cluster_nodes(shared).await?);
        if masters.is_empty() {
            return Err(LockError::backend(
                "redis",
                "the cluster answered CLUSTER NODES without a master that serves slots",
                None,
                None,
            ));
        }
        masters.into_iter().map(Some).collect()
    } else {
        vec![None]
    };
    let mut found = Vec::new();
    for master in masters {
        let mut cursor = 0u64;
        loop {
            let mut scan: Cmd = redis::cmd("SCAN");
            scan.arg(cursor)
                .arg("MATCH")
                .arg(&pattern)
                .arg("COUNT")
                .arg(SCAN_COUNT);
            let reply = match &master {
                Some(addr) => {
                    shared
                        .bounded(what, shared.conn.query_at(addr, &scan))
                        .await?
                }
                None => shared.bounded(what, shared.conn.query(&scan)).await?,
            };
            let (next, keys) = scan_page(reply).ok_or_else(|| {
                LockError::backend("redis", "the server answered SCAN unexpectedly", None, None)
            })?;
            found.extend(keys.into_iter().filter_map(|key| {
                if let Some(name) = lock_name(shared.layout, &shared.prefix, &key) {
                    return Some((key, name, false));
                }
                let name = semaphore_name(shared.layout, &shared.prefix, &key)?;
                Some((key, name, true))
            }));
            cursor = next;
            if cursor == 0 {
                break;
            }
        }
    }
    let mut locks = Vec::new();
    // Owner labels by backend id, each read once.
    let mut labels: std::collections::HashMap<Vec<u8>, Option<String>> =
        std::collections::HashMap::new();
    for (key, name, semaphore) in found {
        if semaphore {
            locks.extend(semaphore_entry(shared, key, name, now_ms).await?);
            continue;
        }
        let mut get: Cmd = redis::cmd("GET");
        get.arg(&key);
        // A key of another type under the prefix is not a lock: skipped.
        let Ok(Value::BulkString(owner)) = shared.bounded(what, shared.conn.query(&get)).await
        else {
            continue;
        };
        let mut pttl: Cmd = redis::cmd("PTTL");
        pttl.arg(&key);
        let remaining = match shared.bounded(what, shared.conn.query(&pttl)).await? {
            Value::Int(ms) if ms >= 0 => Some(Duration::from_millis(ms.unsigned_abs())),
            _ => None,
        };
        // The holder's token, or the live readers' tokens.
        let tokens: Vec<Vec<u8>> = if owner.is_empty() {
            let mut live: Cmd = redis::cmd("ZRANGEBYSCORE");
            live.arg(readers_key(shared.layout, &key))
                .arg(format!("({now_ms}"))
                .arg("+inf");
            match shared.bounded(what, shared.conn.query(&live)).await? {
                Value::Array(members) => members
                    .into_iter()
                    .filter_map(|member| match member {
                        Value::BulkString(token) => Some(token),
                        _ => None,
                    })
                    .collect(),
                _ => Vec::new(),
            }
        } else {
            vec![owner.clone()]
        };
        let readers = if owner.is_empty() {
            u32::try_from(tokens.len()).unwrap_or(u32::MAX)
        } else {
            0
        };
        let mut owners: Vec<String> = Vec::new();
        for token in &tokens {
            let Some(id) = owner::id_of(token) else {
                continue;
            };
            if !labels.contains_key(id) {
                let mut get: Cmd = redis::cmd("GET");
                get.arg(owner::label_key(&shared.prefix, id));
                let label = match shared.bounded(what, shared.conn.query(&get)).await {
                    Ok(Value::BulkString(label)) => {
                        Some(String::from_utf8_lossy(&label).into_owned())
                    }
                    _ => None,
                };
                labels.insert(id.to_vec(), label);
            }
            if let Some(Some(label)) = labels.get(id)
                && !owners.contains(label)
            {
                owners.push(label.clone());
            }
        }
        // A shared counter (`fencing_counters`) says nothing of this holder's token.
        let fencing_token = if shared.counters.is_some() {
            None
        } else {
            let mut fence: Cmd = redis::cmd("GET");
            fence.arg(fence_key(shared.layout, &key));
            match shared.bounded(what, shared.conn.query(&fence)).await {
                Ok(Value::BulkString(text)) => {
                    std::str::from_utf8(&text).ok().and_then(|t| t.parse().ok())
                }
                _ => None,
            }
        };
        locks.push(
            StoreLock::new(String::from_utf8_lossy(&key).into_owned())
                .with_key(Some(name))
                .with_readers(readers)
                .with_fencing_token(fencing_token)
                .with_remaining_lease(remaining)
                .with_owner((!owners.is_empty()).then(|| owners.join(","))),
        );
    }
    Ok(locks)
}

/// Whether each exclusive lock of `keys` is held now: its key holds an owner (a key that
/// expired with its lease is gone; readers leave it empty). One `GET` per key, all in one
/// pipeline (on a Cluster, each in its own, all at once).
pub(super) async fn held_keys(shared: &Shared, keys: &[String]) -> Result<Vec<bool>, LockError> {
    let what = "reading whether locks are held";
    let gets: Vec<Cmd> = keys
        .iter()
        .map(|key| {
            let mut get: Cmd = redis::cmd("GET");
            get.arg(shared.lock_key(key));
            get
        })
        .collect();
    let replies = shared.bounded(what, shared.conn.pipelines(gets)).await?;
    replies
        .into_iter()
        .map(|reply| match reply {
            Ok(Value::BulkString(owner)) => Ok(!owner.is_empty()),
            // Not there, or a key of another type under the prefix: not a held lock.
            Ok(_) => Ok(false),
            Err(err) => Err(super::redis_error(what, err, &shared.prefix)),
        })
        .collect()
}

/// The entry of the semaphore `name` whose permits are under `key`: its live permits (as the
/// holders that share it), the latest lease end and its fencing counter; `None` when no permit
/// is live.
async fn semaphore_entry(
    shared: &Shared,
    key: Vec<u8>,
    name: String,
    now_ms: u64,
) -> Result<Option<StoreLock>, LockError> {
    let what = "listing the locks";
    let mut count: Cmd = redis::cmd("ZCOUNT");
    count.arg(&key).arg(format!("({now_ms}")).arg("+inf");
    let live = match shared.bounded(what, shared.conn.query(&count)).await {
        Ok(Value::Int(n)) if n > 0 => u32::try_from(n).unwrap_or(u32::MAX),
        // No live permit, or a key of another type under the prefix.
        _ => return Ok(None),
    };
    let mut pttl: Cmd = redis::cmd("PTTL");
    pttl.arg(&key);
    let remaining = match shared.bounded(what, shared.conn.query(&pttl)).await? {
        Value::Int(ms) if ms >= 0 => Some(Duration::from_millis(ms.unsigned_abs())),
        _ => None,
    };
    let fencing_token = if shared.counters.is_some() {
        None
    } else {
        let mut fence: Cmd = redis::cmd("GET");
        fence.arg(fence_key(shared.layout, &key));
        match shared.bounded(what, shared.conn.query(&fence)).await {
            Ok(Value::BulkString(text)) => {
                std::str::from_utf8(&text).ok().and_then(|t| t.parse().ok())
            }
            _ => None,
        }
    };
    Ok(Some(
        StoreLock::new(String::from_utf8_lossy(&key).into_owned())
            .with_key(Some(name))
            .with_readers(live)
            .with_fencing_token(fencing_token)
            .with_remaining_lease(remaining),
    ))
}

/// `prefix` with the glob characters of `SCAN MATCH` escaped.
fn glob_escaped(prefix: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(prefix.len() + 2);
    for &byte in prefix {
        if matches!(byte, b'*' | b'?' | b'[' | b']' | b'\\') {
            out.push(b'\\');
        }
        out.push(byte);
    }
    out
}

/// The server's clock in milliseconds, from `TIME`'s answer (0 when it cannot be read).
fn server_ms(reply: &Value) -> u64 {
    let Value::Array(parts) = reply else { return 0 };
    let number = |v: Option<&Value>| match v {
        Some(Value::BulkString(text)) => std::str::from_utf8(text).ok()?.parse::<u64>().ok(),
        _ => None,
    };
    match (number(parts.first()), number(parts.get(1))) {
        (Some(secs), Some(micros)) => secs.saturating_mul(1000).saturating_add(micros / 1000),
        _ => 0,
    }
}

/// A `SCAN` answer: the next cursor and the keys of this page.
fn scan_page(reply: Value) -> Option<(u64, Vec<Vec<u8>>)> {
    let Value::Array(mut parts) = reply else {
        return None;
    };
    if parts.len() != 2 {
        return None;
    }
    let keys = match parts.pop()? {
        Value::Array(keys) => keys
            .into_iter()
            .filter_map(|k| match k {
                Value::BulkString(k) => Some(k),
                _ => None,
            })
            .collect(),
        _ => return None,
    };
    let cursor = match parts.pop()? {
        Value::BulkString(c) => std::str::from_utf8(&c).ok()?.parse().ok()?,
        _ => return None,
    };
    Some((cursor, keys))
}

/// The lock name a Redis key stands for, or `None` for a key that is no lock (a fencing
/// counter, a readers set, a writer's intent, a waiting mark, anything else under the prefix).
pub(super) fn lock_name(layout: KeyLayout, prefix: &[u8], key: &[u8]) -> Option<String> {
    let rest = key.strip_prefix(prefix)?;
    match layout {
        KeyLayout::Tagged => {
            let inner = rest.strip_prefix(b"{")?.strip_suffix(b"}")?;
            if inner.contains(&b'{') || inner.contains(&b'}') {
                return None;
            }
            let mut name = Vec::with_capacity(inner.len());
            let mut i = 0;
            while i < inner.len() {
                match &inner[i..] {
                    [b'%', b'2', b'5', ..] => (name.push(b'%'), i += 3).1,
                    [b'%', b'7', b'B', ..] => (name.push(b'{'), i += 3).1,
                    [b'%', b'7', b'D', ..] => (name.push(b'}'), i += 3).1,
                    [b'%', ..] => return None,
                    [byte, ..] => (name.push(*byte), i += 1).1,
                    [] => break,
                }
            }
            String::from_utf8(name).ok()
        }
        // Companion keys carry byte 0xFF, which no lock name (UTF-8) holds.
        KeyLayout::Plain if rest.contains(&0xFF) => None,
        KeyLayout::Plain => String::from_utf8(rest.to_vec()).ok(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lock_names_come_back_from_their_keys_and_companions_are_skipped() {
        for name in ["a", "x:{1}%2", "", "ünï", "%7B"] {
            let key = super::super::storage_key(b"p:", name);
            assert_eq!(
                lock_name(KeyLayout::Tagged, b"p:", &key).as_deref(),
                Some(name)
            );
            let fence = fence_key(KeyLayout::Tagged, &key);
            assert_eq!(lock_name(KeyLayout::Tagged, b"p:", &fence), None);
            let readers = readers_key(KeyLayout::Tagged, &key);
            assert_eq!(lock_name(KeyLayout::Tagged, b"p:", &readers), None);
            let mark = [&key[..], super::super::commands::WAITING_MARK].concat();
            assert_eq!(lock_name(KeyLayout::Tagged, b"p:", &mark), None);
            // The shared counters (`fencing_counters`) and their mode are no locks either.
            let record = super::super::bounded::record_key(b"p:", KeyLayout::Tagged);
            assert_eq!(lock_name(KeyLayout::Tagged, b"p:", &record), None);
            let counter = super::super::bounded::counter_key(&record, 3);
            assert_eq!(lock_name(KeyLayout::Tagged, b"p:", &counter), None);
            let record = super::super::bounded::record_key(b"p:", KeyLayout::Plain);
            assert_eq!(lock_name(KeyLayout::Plain, b"p:", &record), None);
            // Nor are the owner labels.
            let label = super::super::owner::label_key(b"p:", b"0123456789abcdef");
            assert_eq!(lock_name(KeyLayout::Tagged, b"p:", &label), None);
            assert_eq!(lock_name(KeyLayout::Plain, b"p:", &label), None);
            let counter = super::super::bounded::counter_key(&record, 3);
            assert_eq!(lock_name(KeyLayout::Plain, b"p:", &counter), None);
            let plain = [b"p:".as_slice(), name.as_bytes()].concat();
            assert_eq!(
                lock_name(KeyLayout::Plain, b"p:", &plain).as_deref(),
                Some(name)
            );
            let fence = fence_key(KeyLayout::Plain, &plain);
            assert_eq!(lock_name(KeyLayout::Plain, b"p:", &fence), None);
            let mark = super::super::read::companion_key(
                KeyLayout::Plain,
                &plain,
                super::super::commands::WAITING_MARK,
            );
            assert_eq!(lock_name(KeyLayout::Plain, b"p:", &mark), None);
        }
        assert_eq!(lock_name(KeyLayout::Tagged, b"p:", b"q:{a}"), None);
        assert_eq!(glob_escaped(b"a*b?[c]\\"), b"a\\*b\\?\\[c\\]\\\\".to_vec());
    }
}
