//! Lock keys: validation, the 64-bit lock id, and keys built from values.

use std::fmt::{self, Display, Write as _};

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

/// Appends `value`'s [`Display`] output to `key`, percent-encoding the characters that lock key
/// templates use as structure.
///
/// `:` `%` `{` `}` `<` `>` and control characters become `%XX` (uppercase hex, one per UTF-8
/// byte); everything else, including other Unicode, is written as it is. No encoded value
/// contains `:`, so keys such as `transfer:{from}:{to}` cannot collide for distinct values:
/// `("1:2", "3")` and `("1", "2:3")` give `transfer:1%3A2:3` and `transfer:1:2%3A3`.
fn write_encoded(key: &mut String, value: &(impl Display + ?Sized)) {
    struct Encoder<'a>(&'a mut String);

    impl fmt::Write for Encoder<'_> {
        fn write_str(&mut self, s: &str) -> fmt::Result {
            let mut rest = s;
            while let Some(at) = rest.find(needs_encoding) {
                self.0.push_str(&rest[..at]);
                let c = rest[at..].chars().next().unwrap_or_default();
                let mut utf8 = [0u8; 4];
                for byte in c.encode_utf8(&mut utf8).bytes() {
                    self.0.push('%');
                    self.0.push(hex_digit(byte >> 4));
                    self.0.push(hex_digit(byte & 0xF));
                }
                rest = &rest[at + c.len_utf8()..];
            }
            self.0.push_str(rest);
            Ok(())
        }
    }

    // Writing to a `String` cannot fail; a `Display` impl that reports an error anyway keeps
    // what it wrote before the error.
    let _ = write!(Encoder(key), "{value}");
}

/// Whether a character of a value is percent-encoded in a lock key.
fn needs_encoding(c: char) -> bool {
    matches!(c, ':' | '%' | '{' | '}' | '<' | '>') || c.is_control()
}

fn hex_digit(nibble: u8) -> char {
    char::from(b"0123456789ABCDEF"[usize::from(nibble & 0xF)])
}

/// Percent-encodes `value`'s [`Display`] output for use inside a lock key.
///
/// `:` `%` `{` `}` `<` `>` and control characters become `%XX` (uppercase hex, one per UTF-8
/// byte of the character); every other character is kept. This is what
/// `#[distributed_lock("account:{account_id}")]` does to each placeholder's value, so distinct
/// values always give distinct keys as long as placeholders are separated by a `:`:
///
/// ```
/// use dlock::encode_key_component;
///
/// assert_eq!(encode_key_component(&42), "42");
/// assert_eq!(encode_key_component("a:b%c{d}<e>"), "a%3Ab%25c%7Bd%7D%3Ce%3E");
/// assert_eq!(encode_key_component("line\nbreak, ü"), "line%0Abreak, ü");
/// ```
pub fn encode_key_component(value: &(impl Display + ?Sized)) -> String {
    let mut key = String::new();
    write_encoded(&mut key, value);
    key
}

/// Builds a lock key from literal text and encoded values, the way
/// `#[distributed_lock("...")]` does.
///
/// [`literal`](KeyBuilder::literal) appends text as it is; [`value`](KeyBuilder::value)
/// appends a value's [`Display`] output encoded by [`encode_key_component`].
///
/// ```
/// use dlock::KeyBuilder;
///
/// let mut key = KeyBuilder::new();
/// key.literal("transfer:").value(&"1:2").literal(":").value(&3);
/// assert_eq!(key.finish(), "transfer:1%3A2:3");
/// ```
#[derive(Debug, Default, Clone)]
pub struct KeyBuilder {
    key: String,
}

impl KeyBuilder {
    /// An empty key.
    pub fn new() -> Self {
        KeyBuilder::default()
    }

    /// An empty key with room for `capacity` bytes.
    pub fn with_capacity(capacity: usize) -> Self {
        KeyBuilder {
            key: String::with_capacity(capacity),
        }
    }

    /// Appends `text` as it is.
    pub fn literal(&mut self, text: &str) -> &mut Self {
        self.key.push_str(text);
        self
    }

    /// Appends `value`'s [`Display`] output, percent-encoded (see [`encode_key_component`]).
    pub fn value(&mut self, value: &(impl Display + ?Sized)) -> &mut Self {
        write_encoded(&mut self.key, value);
        self
    }

    /// The key.
    pub fn finish(self) -> String {
        self.key
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodes_structure_and_control_characters() {
        assert_eq!(
            encode_key_component("a:b%c{d}<e>\n\u{7f}\u{85}é鍵 /"),
            "a%3Ab%25c%7Bd%7D%3Ce%3E%0A%7F%C2%85é鍵 /"
        );
        assert_eq!(encode_key_component(""), "");
        assert_eq!(encode_key_component(&-7i64), "-7");
        assert_eq!(encode_key_component("%3A"), "%253A");
    }

    #[test]
    fn builder_keeps_literals_and_encodes_values() {
        let mut a = KeyBuilder::with_capacity(16);
        a.literal("t:").value("1:2").literal(":").value("3");
        let mut b = KeyBuilder::new();
        b.literal("t:").value("1").literal(":").value("2:3");
        assert_eq!(a.clone().finish(), "t:1%3A2:3");
        assert_ne!(a.finish(), b.finish());
    }

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
