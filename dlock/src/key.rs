//! Lock keys: validation and the 64-bit lock id.

use sha2::{Digest, Sha256};

use crate::LockError;

/// The 64-bit id of a lock key: the first 8 bytes, little-endian, of SHA-256 of the key's UTF-8
/// bytes, as a signed integer.
///
/// Backends whose native lock names are integers (PostgreSQL advisory locks, Oracle
/// `DBMS_LOCK`) lock this id. It is the same id other implementations of this scheme compute,
/// so a fleet that mixes them locks the same rows. The derivation is part of the contract and
/// never changes:
///
/// ```
/// assert_eq!(dlock::lock_id("jobs:recurring-monthly-billing"), -4568809572337086091);
/// assert_eq!(dlock::lock_id("account:42"), 7645020056959376184);
/// assert_eq!(dlock::lock_id("ü:ключ:鍵"), 7111160815247340053);
/// ```
///
/// Computing it does not allocate, whatever the key's length.
pub fn lock_id(key: &str) -> i64 {
    let digest = Sha256::digest(key.as_bytes());
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    i64::from_le_bytes(first)
}

/// Checks that `key` can be a lock key: any non-empty UTF-8 string can.
///
/// Keys are compared byte for byte; NUL, quotes, newlines and keys of any length are allowed
/// and locked exactly (each backend documents how it maps long or unusual keys onto its own
/// names).
/// The prefix of the names this crate locks for itself (a semaphore's queue lock, and its
/// slots on a backend without a permit store); a lock key may not start with it.
pub(crate) const RESERVED_PREFIX: &str = "dlock\0";

/// Refuses a key that starts with [`RESERVED_PREFIX`].
pub(crate) fn refuse_reserved(key: &str) -> Result<(), LockError> {
    if key.starts_with(RESERVED_PREFIX) {
        return Err(LockError::InvalidKey {
            reason: "keys that start with \"dlock\\0\" (dlock and a NUL character) are reserved for the locks of semaphores".to_owned(),
        });
    }
    Ok(())
}

pub(crate) fn validate_key(key: &str) -> Result<(), LockError> {
    if key.is_empty() {
        return Err(LockError::InvalidKey {
            reason:
                "the key is empty; a lock key must be a non-empty string such as \"jobs:billing\""
                    .to_owned(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pinned_vectors() {
        assert_eq!(
            lock_id("jobs:recurring-monthly-billing"),
            -4568809572337086091
        );
        assert_eq!(lock_id("account:42"), 7645020056959376184);
        assert_eq!(lock_id("ü:ключ:鍵"), 7111160815247340053);
    }

    #[test]
    fn empty_key_is_invalid() {
        let err = validate_key("").unwrap_err();
        assert_eq!(err.code(), "DistributedLock.InvalidKey");
        assert!(validate_key("\0").is_ok());
        assert!(validate_key("'; DROP TABLE x; --").is_ok());
    }
}
