//! Store inspection (see [`LockBackend::store_locks`](crate::backend::LockBackend::store_locks)):
//! the locks under the backend's prefix, read in one range request, with each holder's lease.

use super::*;
use crate::backend::StoreLock;

/// A lock's name from its queue prefix (`<prefix><key'>/`), undoing the encoding of
/// [`queue_prefix`]; `None` for a shortened (hashed) name, which cannot be undone.
fn decode_name(prefix: &[u8], queue: &[u8]) -> Option<String> {
    let encoded = queue.strip_prefix(prefix)?.strip_suffix(b"/")?;
    let encoded = std::str::from_utf8(encoded).ok()?;
    let mut name = String::with_capacity(encoded.len());
    let mut rest = encoded;
    while let Some(at) = rest.find('%') {
        name.push_str(&rest[..at]);
        let escape = rest.get(at..at + 3)?;
        match escape {
            "%25" => name.push('%'),
            "%2F" => name.push('/'),
            // `%#`: a shortened name.
            _ => return None,
        }
        rest = &rest[at + 3..];
    }
    name.push_str(rest);
    Some(name)
}

/// The holders of the locks under `prefix` among `entries` (each queue's entry with the
/// smallest create revision, `revision` reading it; waiters and semaphores left out), as
/// `(queue, holder)`.
fn heads<'a, T>(
    prefix: &[u8],
    entries: &'a [T],
    key: impl Fn(&T) -> &[u8],
    revision: impl Fn(&T) -> i64,
) -> Vec<(Vec<u8>, &'a T)> {
    let mut semaphores = prefix.to_vec();
    semaphores.extend_from_slice(b"%S/");
    let mut heads: std::collections::BTreeMap<Vec<u8>, &T> = std::collections::BTreeMap::new();
    for entry in entries {
        let name = key(entry);
        if name.starts_with(&semaphores) || !name.starts_with(prefix) {
            continue;
        }
        let queue = queue_of(name);
        if queue.len() <= prefix.len() {
            // Not a queue entry (a key of another application under the prefix).
            continue;
        }
        match heads.get(&queue) {
            Some(head) if revision(head) <= revision(entry) => {}
            _ => {
                heads.insert(queue, entry);
            }
        }
    }
    heads.into_iter().collect()
}

impl EtcdBackend {
    /// Every lock held under the prefix now: one range read of the prefix, then one lease
    /// read per held lock (its time to live, in whole seconds, rounded down by etcd: `None`
    /// when less than a second is left). `known` names the locks whose
    /// shortened names cannot be decoded.
    pub(super) async fn list_locks(&self, known: &[&str]) -> Result<Vec<StoreLock>, LockError> {
        let shared = &*self.shared;
        let answer = shared
            .retrying("listing the locks", || {
                let mut client = shared.client.kv_client();
                let options = GetOptions::new().with_prefix();
                let key = shared.prefix.clone();
                async move { client.get(key, Some(options)).await }
            })
            .await?;
        let mut locks = Vec::new();
        let held = heads(
            &shared.prefix,
            answer.kvs(),
            etcd_client::KeyValue::key,
            etcd_client::KeyValue::create_revision,
        );
        for (queue, holder) in held {
            let lease_id = holder.lease();
            let remaining = if lease_id == 0 {
                None
            } else {
                let ttl = shared
                    .retrying("reading a lock's lease", || {
                        let mut client = shared.client.lease_client();
                        async move { client.time_to_live(lease_id, None).await }
                    })
                    .await?
                    .ttl();
                match ttl {
                    // Expired (or revoked) since the read: no longer held.
                    ..0 => continue,
                    // Less than a second left: etcd counts whole seconds, so no finer answer.
                    0 => None,
                    ttl => Some(Duration::from_secs(ttl.unsigned_abs())),
                }
            };
            let key = decode_name(&shared.prefix, &queue).or_else(|| {
                known
                    .iter()
                    .find(|key| queue_prefix(&shared.prefix, key) == queue)
                    .map(|key| (*key).to_owned())
            });
            let owner = std::str::from_utf8(holder.value()).ok().map(str::to_owned);
            locks.push(
                StoreLock::new(String::from_utf8_lossy(holder.key()).into_owned())
                    .with_key(key)
                    .with_fencing_token(u64::try_from(holder.create_revision()).ok())
                    .with_remaining_lease(remaining)
                    .with_owner(owner),
            );
        }
        Ok(locks)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_decode_as_they_were_encoded() {
        let prefix = b"dlock/";
        for name in [
            "jobs:a",
            "a/b",
            "100%",
            "%2F",
            "%25/%",
            "",
            "dlock\0semaphore\0\x31\0x",
        ] {
            let queue = queue_prefix(prefix, name);
            assert_eq!(
                decode_name(prefix, &queue).as_deref(),
                Some(name),
                "{name:?}"
            );
        }
        let long = "x".repeat(300);
        assert_eq!(decode_name(prefix, &queue_prefix(prefix, &long)), None);
        assert_eq!(decode_name(prefix, b"other/a/"), None);
    }

    #[test]
    fn the_holder_is_the_oldest_key_of_each_queue() {
        let entries: [(&[u8], i64); 5] = [
            (b"dlock/a/2", 7),
            (b"dlock/a/1", 5),
            (b"dlock/b/9", 6),
            (b"dlock/%S/s/3", 1),
            (b"dlock/loose", 2),
        ];
        let heads: Vec<(String, i64)> = heads(b"dlock/", &entries, |e| e.0, |e| e.1)
            .into_iter()
            .map(|(queue, entry)| (String::from_utf8(queue).unwrap(), entry.1))
            .collect();
        assert_eq!(
            heads,
            [("dlock/a/".to_owned(), 5), ("dlock/b/".to_owned(), 6)]
        );
    }
}
