//! Force release: ending one lock whoever holds it (see
//! [`LockProvider::force_release`](crate::LockProvider::force_release)).

use redis::{Cmd, Value};

use super::read::readers_key;
use super::{RedisBackend, RedlockBackend};
use crate::LockError;
use crate::backend::{BoxFuture, ForceRelease};

impl ForceRelease for RedisBackend {
    /// `DEL` of the lock key, then of its readers' set: the holder's renewal (an owner-checked
    /// command) then finds the key gone, and so does each reader's. The fencing counter is a
    /// key of its own, left alone. The lock key goes first: a reader that joins in between
    /// holds a share the second `DEL` ends, never one beside a writer.
    fn force_release<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<bool, LockError>> {
        Box::pin(async move {
            let shared = &*self.shared;
            let what = "ending a lock by force";
            let lock_key = shared.lock_key(key);
            let mut del: Cmd = redis::cmd("DEL");
            del.arg(&lock_key);
            let ended = matches!(
                shared.bounded(what, shared.conn.query(&del)).await?,
                Value::Int(n) if n > 0
            );
            let mut readers: Cmd = redis::cmd("DEL");
            readers.arg(readers_key(shared.layout, &lock_key));
            shared.bounded(what, shared.conn.query(&readers)).await?;
            Ok(ended)
        })
    }
}

impl ForceRelease for RedlockBackend {
    /// Every node's lock is ended (each as the single-node backend does). `true` when any node
    /// held it; an error when none did and a node failed (it may still hold it there).
    fn force_release<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<bool, LockError>> {
        Box::pin(self.force_release_nodes(key))
    }
}
