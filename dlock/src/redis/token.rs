//! Owner tokens: the value stored under a Redis lock key.

use std::fmt;
use std::sync::Arc;

use crate::LockError;

/// The bytes that say who holds a Redis lock: the value stored under the lock's key.
///
/// Acquisitions through a [`LockProvider`](crate::LockProvider) make a fresh token each time:
/// the backend's random 64-bit id (which names its [owner
/// label](crate::ProviderBuilder::owner_label)) and 64 unpredictable bits from
/// [`OwnerToken::random`], written as 32 lowercase hex digits: text, so that other clients and `redis-cli` show it as it is, and so
/// that a server's answer quoting it is readable (see
/// [Native commands first](super#native-commands-first-per-connection)). Processes that
/// share one lock between them (one takes it, another renews or releases it) pass a token
/// around and use the raw-token methods of [`RedisBackend`](super::RedisBackend).
///
/// Tokens are byte strings: equality and hashing are on the exact bytes (no text
/// normalization), and [`Display`](fmt::Display) writes them as lowercase hex, two digits a byte,
/// so nothing is lost or escaped away; [`OwnerToken::from_hex`] reads that form back. The empty
/// token is rejected (it could not be told apart from a missing value by every client).
///
/// ```
/// use dlock::redis::OwnerToken;
/// let token = OwnerToken::from_text("worker-7")?;
/// assert_eq!(token.as_bytes(), b"worker-7");
/// assert_eq!(token.to_string(), "776f726b65722d37");
/// assert_eq!(OwnerToken::from_hex(&token.to_string())?, token);
/// assert!(OwnerToken::from_bytes(Vec::new()).is_err());
/// assert_ne!(OwnerToken::random()?, OwnerToken::random()?);
/// # Ok::<(), dlock::LockError>(())
/// ```
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct OwnerToken(Arc<[u8]>);

impl OwnerToken {
    /// 16 bytes from a cryptographically secure generator, as 32 lowercase hex digits (the
    /// token is those 32 ASCII bytes).
    ///
    /// The generator is seeded once per process with 256 bits from the operating system's
    /// generator, and yields SHA-256 of that key and a counter, whose 32 bytes make two
    /// tokens of 16 (the second kept for the next call): as unpredictable as 16 bytes read
    /// from the operating system each time, and never the same twice in a process, without a
    /// random-generator system call per token. A process that was forked from one that had made
    /// tokens seeds its own, and never hands out a half its parent kept (the process id is
    /// checked on each call).
    pub fn random() -> Result<OwnerToken, LockError> {
        let bytes = generator::next()?;
        let mut text = Vec::with_capacity(32);
        for byte in bytes {
            text.push(HEX[usize::from(byte >> 4)]);
            text.push(HEX[usize::from(byte & 0x0f)]);
        }
        Ok(OwnerToken(Arc::from(text)))
    }

    /// A token made of these exact bytes. Errors when they are empty.
    pub fn from_bytes(bytes: impl Into<Vec<u8>>) -> Result<OwnerToken, LockError> {
        let bytes = bytes.into();
        if bytes.is_empty() {
            return Err(LockError::config(
                "an owner token must not be empty; use OwnerToken::random() for a fresh one",
            ));
        }
        Ok(OwnerToken(Arc::from(bytes)))
    }

    /// A token made of the UTF-8 bytes of `text`. Errors when it is empty.
    pub fn from_text(text: &str) -> Result<OwnerToken, LockError> {
        OwnerToken::from_bytes(text.as_bytes())
    }

    /// Reads the hex form that [`Display`](fmt::Display) writes (either case). Errors on an odd
    /// length, a non-hex digit or an empty string.
    pub fn from_hex(hex: &str) -> Result<OwnerToken, LockError> {
        let digits = hex.as_bytes();
        if !digits.len().is_multiple_of(2) {
            return Err(LockError::config(
                "a hex owner token must have an even number of digits",
            ));
        }
        let bytes = digits
            .chunks(2)
            .map(|pair| match pair {
                [high, low] => match (hex_value(*high), hex_value(*low)) {
                    (Some(high), Some(low)) => Ok(high << 4 | low),
                    _ => Err(LockError::config(
                        "a hex owner token may only contain the digits 0-9, a-f and A-F",
                    )),
                },
                _ => Err(LockError::config(
                    "a hex owner token must have an even number of digits",
                )),
            })
            .collect::<Result<Vec<u8>, _>>()?;
        OwnerToken::from_bytes(bytes)
    }

    /// The token's bytes, as stored in Redis.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }
}

const HEX: &[u8; 16] = b"0123456789abcdef";

/// The per-process generator behind [`OwnerToken::random`].
mod generator {
    use std::sync::{Mutex, PoisonError};

    use sha2::{Digest, Sha256};

    use crate::LockError;

    struct State {
        /// The process that seeded it: a forked child must not repeat its parent's tokens
        /// (nor hand out the half its parent kept).
        pid: u32,
        key: [u8; 32],
        counter: u64,
        /// The second half of the last digest, not handed out yet (taken at most once).
        kept: Option<[u8; 16]>,
    }

    static STATE: Mutex<Option<State>> = Mutex::new(None);

    /// The next 16 bytes: a half of SHA-256(key ‖ counter), the counter never repeating under
    /// one key (one hash block: 40 bytes of input). Each digest gives two: the first half at
    /// once, the second at the next call.
    pub(super) fn next() -> Result<[u8; 16], LockError> {
        let pid = std::process::id();
        let mut state = STATE.lock().unwrap_or_else(PoisonError::into_inner);
        let state = match &mut *state {
            Some(seeded) if seeded.pid == pid => seeded,
            unseeded => unseeded.insert(State {
                pid,
                key: seed()?,
                counter: 0,
                kept: None,
            }),
        };
        if let Some(half) = state.kept.take() {
            return Ok(half);
        }
        let counter = state.counter;
        state.counter = counter.wrapping_add(1);
        if state.counter == 0 {
            // 2^64 digests under one key: a new key before any could repeat.
            state.key = seed()?;
        }
        // Hashed under the lock (one block, about a microsecond, every other call): the
        // second half must be kept before another call can look for it.
        let (first, second) = halves(&state.key, counter);
        state.kept = Some(second);
        Ok(first)
    }

    /// SHA-256(key ‖ counter) as two halves.
    fn halves(key: &[u8; 32], counter: u64) -> ([u8; 16], [u8; 16]) {
        let digest = Sha256::new()
            .chain_update(key)
            .chain_update(counter.to_le_bytes())
            .finalize();
        let (mut first, mut second) = ([0u8; 16], [0u8; 16]);
        first.copy_from_slice(&digest[..16]);
        second.copy_from_slice(&digest[16..32]);
        (first, second)
    }

    fn seed() -> Result<[u8; 32], LockError> {
        let mut key = [0u8; 32];
        getrandom::fill(&mut key).map_err(|err| {
            LockError::backend(
                "redis",
                format!("the operating system's random generator failed: {err}"),
                None,
                None,
            )
        })?;
        Ok(key)
    }
}

fn hex_value(digit: u8) -> Option<u8> {
    match digit {
        b'0'..=b'9' => Some(digit - b'0'),
        b'a'..=b'f' => Some(digit - b'a' + 10),
        b'A'..=b'F' => Some(digit - b'A' + 10),
        _ => None,
    }
}

impl fmt::Display for OwnerToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for byte in self.0.iter() {
            write!(f, "{byte:02x}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for OwnerToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "OwnerToken({self})")
    }
}

impl AsRef<[u8]> for OwnerToken {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn byte_exact() {
        let a = OwnerToken::from_bytes(vec![0u8, 255, b'{']).unwrap();
        assert_eq!(a.to_string(), "00ff7b");
        assert_eq!(OwnerToken::from_hex("00FF7b").unwrap(), a);
        // "é" precomposed and decomposed are different tokens.
        let x = OwnerToken::from_text("\u{e9}").unwrap();
        let y = OwnerToken::from_text("e\u{301}").unwrap();
        assert_ne!(x, y);
        let set: HashSet<_> = [x.clone(), y, x].into_iter().collect();
        assert_eq!(set.len(), 2);
        for bad in ["", "0", "zz", "0g"] {
            assert!(OwnerToken::from_hex(bad).is_err(), "{bad}");
        }
        assert!(OwnerToken::from_text("").is_err());
        let random = OwnerToken::random().unwrap();
        assert_eq!(random.as_bytes().len(), 32);
        assert!(
            random
                .as_bytes()
                .iter()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(b)),
            "{random:?}"
        );
    }

    #[test]
    fn every_byte_goes_through_hex_and_back() {
        let all: Vec<u8> = (0..=255).collect();
        let token = OwnerToken::from_bytes(all.clone()).unwrap();
        assert_eq!(token.as_bytes(), &all[..]);
        assert_eq!(token.as_ref(), &all[..]);
        let hex = token.to_string();
        assert_eq!(hex.len(), 512);
        assert!(
            hex.starts_with("000102030405060708090a0b0c0d0e0f10"),
            "{hex}"
        );
        assert!(hex.ends_with("f9fafbfcfdfeff"), "{hex}");
        assert_eq!(OwnerToken::from_hex(&hex).unwrap(), token);
        assert_eq!(OwnerToken::from_hex(&hex.to_uppercase()).unwrap(), token);
        assert_eq!(
            OwnerToken::from_hex("09aF").unwrap().as_bytes(),
            &[0x09, 0xaf]
        );
        assert_eq!(format!("{token:?}"), format!("OwnerToken({hex})"));
    }

    #[test]
    fn bad_hex_is_refused_with_its_reason() {
        let odd = OwnerToken::from_hex("abc").unwrap_err().to_string();
        assert!(odd.contains("even number of digits"), "{odd}");
        for bad in ["g0", "0G", "/0", ":0", "@0", "`0", "0 "] {
            let err = OwnerToken::from_hex(bad).unwrap_err().to_string();
            assert!(err.contains("only contain the digits"), "{bad}: {err}");
        }
        let empty = OwnerToken::from_hex("").unwrap_err().to_string();
        assert!(empty.contains("must not be empty"), "{empty}");
    }

    /// Tokens of one process never repeat, from one thread or several at once, and their
    /// digits look uniform (each of the 16 about as often as the others).
    #[test]
    fn generated_tokens_are_unique_and_look_uniform() {
        let threads: Vec<_> = (0..4)
            .map(|_| {
                std::thread::spawn(|| {
                    (0..25_000)
                        .map(|_| OwnerToken::random().unwrap())
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        let tokens: Vec<OwnerToken> = threads
            .into_iter()
            .flat_map(|t| t.join().unwrap())
            .collect();
        let distinct: HashSet<&OwnerToken> = tokens.iter().collect();
        assert_eq!(distinct.len(), tokens.len());
        let mut counts = [0u64; 16];
        for token in &tokens {
            for digit in token.as_bytes() {
                counts[usize::from(hex_value(*digit).unwrap())] += 1;
            }
        }
        // 100,000 tokens of 32 digits: 200,000 of each digit expected, a standard deviation
        // of about 433; 5,000 off would be more than 11 of them.
        for (digit, n) in counts.iter().enumerate() {
            assert!(n.abs_diff(200_000) < 5_000, "digit {digit:x}: {n} times");
        }
    }

    #[test]
    fn random_tokens_differ() {
        let a = OwnerToken::random().unwrap();
        let b = OwnerToken::random().unwrap();
        assert_ne!(a, b);
        assert_ne!(a.as_bytes(), [b'0'; 32]);
    }
}
