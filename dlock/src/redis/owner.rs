//! Owner labels (see [`ProviderBuilder::owner_label`](crate::ProviderBuilder::owner_label)):
//! who holds a lock, for store inspection, at no cost to an acquisition's round trips or
//! bytes.
//!
//! Each backend has a random 64-bit id, and every owner token it makes (a lock's or a
//! reader's) starts with it in 16 hex digits; the other 16 stay random, so a token is as long
//! as before. The backend's label is the string key `<prefix>` + byte `0xFF` + `owner:<id>`
//! (no lock key can be that: a lock key is UTF-8, which never has the byte `0xFF`), set at the
//! backend's first acquisition with a day to live, and set again by the first acquisition 12
//! hours later (so a backend's label outlives it by a day at most; a lock held a day with no
//! acquisition by its backend in between shows no owner).

use std::sync::Arc;
use std::time::Instant;

use redis::Cmd;

use super::{OwnerToken, Shared};
use crate::LockError;
use crate::owner::LABEL_TTL;

/// A backend's id and owner label.
pub(super) struct OwnerLabel {
    /// The backend's id, as 16 lowercase hex digits: the first half of its owner tokens.
    id: [u8; 16],
    label: crate::owner::OwnerLabel,
}

impl OwnerLabel {
    pub(super) fn new() -> Result<OwnerLabel, LockError> {
        let token = OwnerToken::random()?;
        let mut id = [0; 16];
        id.copy_from_slice(&token.as_bytes()[..16]);
        Ok(OwnerLabel {
            id,
            label: crate::owner::OwnerLabel::new(),
        })
    }

    pub(super) fn set(&self, label: &str) {
        self.label.set(label);
    }

    /// A fresh owner token of this backend: its id, then 16 random hex digits.
    pub(super) fn token(&self) -> Result<OwnerToken, LockError> {
        let random = OwnerToken::random()?;
        let mut bytes = random.as_bytes().to_vec();
        bytes[..16].copy_from_slice(&self.id);
        OwnerToken::from_bytes(bytes)
    }
}

/// The label key of the backend whose id is `id` (16 hex digits).
pub(super) fn label_key(prefix: &[u8], id: &[u8]) -> Vec<u8> {
    [prefix, b"\xffowner:", id].concat()
}

/// The id (the first 16 bytes) of an owner token of this version, if it can be one.
pub(super) fn id_of(token: &[u8]) -> Option<&[u8]> {
    (token.len() == 32 && token.iter().all(u8::is_ascii_hexdigit)).then(|| &token[..16])
}

impl Shared {
    /// After an acquisition whose command was sent at `sent`: writes the backend's label when
    /// it is due (at the first acquisition, then every 12 hours), on a task of its own, so the
    /// acquisition waits for nothing. Best effort: a failure is logged, and the next
    /// acquisition tries again.
    pub(super) fn write_owner_label(self: &Arc<Self>, sent: Instant) {
        let Some(label) = self.owner_label.label.take_due(sent) else {
            return;
        };
        let shared = Arc::clone(self);
        let write = async move {
            let mut set: Cmd = redis::cmd("SET");
            set.arg(label_key(&shared.prefix, &shared.owner_label.id))
                .arg(&*label)
                .arg("EX")
                .arg(LABEL_TTL.as_secs());
            let what = "recording the owner label";
            if let Err(err) = shared.bounded(what, shared.conn.query(&set)).await {
                // Tried again by the next acquisition.
                shared.owner_label.label.failed();
                tracing::warn!(error = %err, "the owner label could not be recorded");
            }
        };
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            drop(runtime.spawn(write));
        }
    }
}
