//! Bounded fencing counters: the option `fencing_counters=N` (see [`fencing_counter`]).

use crate::LockError;
use crate::options::bad_value;

/// The largest `fencing_counters` accepted.
pub(crate) const MAX_COUNTERS: u32 = 65_536;

/// The bit where the epoch starts in a token issued under `fencing_counters`.
pub(crate) const EPOCH_SHIFT: u32 = 48;

/// The largest count a counter may reach under `fencing_counters` (2^48 - 1).
pub(crate) const MAX_COUNT: u64 = (1 << EPOCH_SHIFT) - 1;

/// The largest epoch: switches beyond it are refused (the tokens stay below 2^63, so they
/// fit a signed 64-bit column).
pub(crate) const MAX_EPOCH: u64 = (1 << (63 - EPOCH_SHIFT)) - 1;

/// The counter number (below `counters`) whose sequence the key `key` takes its fencing
/// tokens from under `fencing_counters=counters`: [`lock_id`](crate::lock_id)`(key)`, read as
/// an unsigned 64-bit number, modulo `counters` (`0` when `counters` is `0`).
///
/// It is a fixed function of the key's bytes (the first 8 bytes of their SHA-256), the same
/// in every process, version and platform, and never changes:
///
/// ```
/// assert_eq!(dlock::fencing_counter("account:42", 16), 8);
/// assert_eq!(dlock::fencing_counter("jobs:recurring-monthly-billing", 16), 5);
/// assert_eq!(dlock::fencing_counter("account:42", 1), 0);
/// ```
///
/// # Bounded fencing counters
///
/// By default a backend keeps one fencing counter per key ever locked, so a service that
/// locks per request or per idempotency key grows its store without bound. With
/// `fencing_counters=N` the store holds at most `N` counters (plus one record of the mode),
/// and the token of a key comes from counter number [`fencing_counter`]`(key, N)`: each key
/// always maps to the same counter, which only grows, so the tokens of one key still
/// increase strictly. Keys that share a counter share its sequence (their tokens skip the
/// numbers the other keys took); a counter is shared by roughly `1 / N` of the keys, so `N`
/// bounds both the store and how many acquisitions contend on one counter.
///
/// # Switching safely: epochs
///
/// A token issued under `fencing_counters` is `epoch × 2^48 + count`: `count` is the
/// counter's value (below 2^48) and `epoch` (1 to 32,767) numbers the
/// configurations the store has had. The store records its mode, `N` and `epoch`, next to
/// the counters. A backend joins the store when it opens (SQLite, PostgreSQL) or at its first
/// fenced acquisition (Redis): when the
/// record names its `N`, it uses the record's epoch; when there is no record (the store had
/// per-key counters, or nothing) or the record names another `N`, it **switches** the store:
/// it writes its `N` with the next epoch. Every token issued after a switch is then above
/// every token issued before it, for every key (the epoch part is higher, and a per-key
/// counter would need 2^48 acquisitions of one key to reach it), whatever counter the key
/// used before. Every fenced
/// acquisition checks the record in the same atomic step that increments the counter, so a
/// backend whose `N` was switched away issues no further token: its acquisitions fail with
/// [`LockError::Config`] (the lock is given back) until the process is restarted with the
/// store's `N`. A rolling change of `N` is therefore safe: the old processes refuse fenced
/// acquisitions from the first start of a new one on, and never hand out a token lower than
/// one issued already. It also means that every process sharing a store must be given the
/// same `N`: a process started with another `N` takes the store over (its tokens are safe),
/// and all the others refuse fenced acquisitions until they are restarted with its `N`.
///
/// What no check can see is a process of an earlier version, or one with per-key counters
/// (the default), still running while another switches the store to `fencing_counters`:
/// such a process keeps incrementing its key's own counter, whose tokens are below the
/// switched ones. Stop every per-key process before starting the first one with
/// `fencing_counters` (as for any change of a store's layout); going back from
/// `fencing_counters` to per-key counters is refused: SQLite and PostgreSQL backends with
/// per-key counters refuse to open a store that has the record, Redis ones refuse their fenced
/// acquisitions from their first on (they look once, at the first).
pub fn fencing_counter(key: &str, counters: u32) -> u32 {
    if counters == 0 {
        return 0;
    }
    let id = crate::lock_id(key) as u64;
    // The remainder is below `counters`, a u32.
    u32::try_from(id % u64::from(counters)).unwrap_or(0)
}

/// Parses the URL option `fencing_counters`: a whole number from 1 to [`MAX_COUNTERS`].
pub(crate) fn parse(option: &str, value: &str) -> Result<u32, LockError> {
    let n: u64 = value
        .trim()
        .parse()
        .map_err(|_| bad_value(option, value, "a whole number of counters (1 to 65536)"))?;
    let n = u32::try_from(n).unwrap_or(u32::MAX);
    check(n)
}

/// Checks a `fencing_counters` setting: 1 to [`MAX_COUNTERS`].
pub(crate) fn check(n: u32) -> Result<u32, LockError> {
    if (1..=MAX_COUNTERS).contains(&n) {
        Ok(n)
    } else {
        Err(LockError::config(format!(
            "fencing_counters is {n}, but it must be between 1 and {MAX_COUNTERS}"
        )))
    }
}

/// The token of count `count` in epoch `epoch`, or a [`LockError::Config`] when the counter
/// ran past [`MAX_COUNT`].
pub(crate) fn token(epoch: u64, count: u64) -> Result<u64, LockError> {
    if count > MAX_COUNT || epoch == 0 || epoch > MAX_EPOCH {
        return Err(LockError::config(format!(
            "fencing_counters: a counter reached {count} in epoch {epoch}, past the limit of \
             {MAX_COUNT} counts per epoch: change fencing_counters (a switch starts a new \
             epoch)"
        )));
    }
    Ok((epoch << EPOCH_SHIFT) | count)
}

/// The error of a backend whose `fencing_counters` is not the store's any more.
pub(crate) fn switched_away(backend: &str, ours: u32, epoch: u64, store: &str) -> LockError {
    LockError::config(format!(
        "{backend}: this backend has fencing_counters={ours} (epoch {epoch}), but the store's \
         fencing counters were switched since by another process (now {store}); it issues no \
         more fencing tokens, so that no token lower than one issued already is handed out. \
         Restart it with the store's fencing_counters (see dlock's fencing_counters docs)"
    ))
}

/// The error of a backend with per-key counters on a store switched to `fencing_counters`.
#[cfg(any(feature = "postgres", feature = "sqlite", feature = "redis"))]
pub(crate) fn per_key_refused(backend: &str, store: &str) -> LockError {
    LockError::config(format!(
        "{backend}: this backend keeps one fencing counter per key, but the store was switched \
         to bounded counters (fencing_counters, now {store}); going back to per-key counters \
         could hand out tokens lower than ones already issued. Set the store's \
         fencing_counters on this backend too"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_values_are_config_errors() {
        for bad in ["0", "-1", "65537", "99999999999999999999", "x", "", "1.5"] {
            let err = parse("fencing_counters", bad).unwrap_err();
            assert!(matches!(err, LockError::Config { .. }), "{bad}: {err:?}");
        }
        assert_eq!(parse("fencing_counters", " 16 ").unwrap(), 16);
        assert_eq!(parse("fencing_counters", "65536").unwrap(), 65_536);
    }

    #[test]
    fn tokens_put_the_epoch_above_every_count() {
        assert_eq!(token(1, 1).unwrap(), (1 << 48) + 1);
        assert!(token(2, 0).unwrap() > token(1, MAX_COUNT).unwrap());
        assert!(token(1, MAX_COUNT + 1).is_err());
        assert!(token(MAX_EPOCH, MAX_COUNT).unwrap() <= i64::MAX as u64);
        assert!(token(MAX_EPOCH + 1, 1).is_err());
    }

    #[test]
    fn every_key_maps_to_one_counter_below_n() {
        for n in [1, 2, 16, 1000, MAX_COUNTERS] {
            for i in 0..200 {
                let key = format!("k{i}");
                let c = fencing_counter(&key, n);
                assert!(c < n);
                assert_eq!(c, fencing_counter(&key, n));
            }
        }
    }
}
