//! The clock that SQLite leases are measured on.
//!
//! Every process that shares a lock file reads this clock, and compares its reading with the
//! lease ends other processes wrote. It must therefore be one clock for all processes of the
//! machine, and it must not step: a step forward would make live holders' leases look run
//! out, a step backward would keep a dead holder's lease for the length of the step.
//!
//! On Linux (and Android) it is `CLOCK_MONOTONIC`, read through the vDSO: the kernel's
//! monotonic clock, shared by every process, slewed but never stepped by time
//! synchronisation, and the clock that [`std::time::Instant`] and Tokio's timers run on, so
//! a holder's own deadlines and the lease ends in the file agree. Two corrections make it
//! comparable between processes:
//!
//! - It restarts at boot, so every row carries the kernel's boot id
//!   (`/proc/sys/kernel/random/boot_id`) and a row written during another boot counts as
//!   expired.
//! - A process in a time namespace reads the clock shifted by its namespace's offset; the
//!   offset (`/proc/self/timens_offsets`) is taken off, so every process reads the host's
//!   clock.
//!
//! `CLOCK_BOOTTIME` would also be a choice; it differs from `CLOCK_MONOTONIC` only in counting
//! the time the machine spends suspended. All processes of the machine are suspended
//! together, so that time holds nothing to measure; counting it would make leases run out
//! across a suspend while holders' renewal deadlines (on the monotonic clock) have not, and a
//! peer waking first could take a lock whose holder still believes it holds it.
//!
//! Elsewhere the clock is the wall clock (Unix milliseconds), with an empty boot id: a step of
//! the system clock moves every lease by the step (see the module docs of the backend).

use std::sync::OnceLock;

use crate::LockError;

/// The lease clock of this process: a reading in milliseconds and the boot it belongs to.
#[derive(Debug)]
pub(crate) struct LeaseClock {
    /// The kernel's boot id (16 bytes) on Linux; empty where the clock is the wall clock.
    boot: Vec<u8>,
    /// Milliseconds to take off a reading: the monotonic offset of this process's time
    /// namespace.
    #[cfg_attr(not(any(target_os = "linux", target_os = "android")), allow(dead_code))]
    offset_ms: i64,
}

impl LeaseClock {
    /// The clock, read from the system once per process.
    pub(crate) fn get() -> Result<&'static LeaseClock, LockError> {
        static CLOCK: OnceLock<Result<LeaseClock, String>> = OnceLock::new();
        CLOCK
            .get_or_init(LeaseClock::from_system)
            .as_ref()
            .map_err(|message| LockError::config(message.clone()))
    }

    /// The boot id that rows written now carry.
    pub(crate) fn boot(&self) -> &[u8] {
        &self.boot
    }

    #[cfg(any(target_os = "linux", target_os = "android"))]
    fn from_system() -> Result<LeaseClock, String> {
        const BOOT_ID: &str = "/proc/sys/kernel/random/boot_id";
        let text = std::fs::read_to_string(BOOT_ID).map_err(|err| {
            format!(
                "SQLite leases need the kernel's boot id from {BOOT_ID} (to tell the lease ends \
                 of an earlier boot), and it cannot be read: {err}; mount /proc in this process's \
                 environment"
            )
        })?;
        let boot = parse_boot_id(&text)
            .ok_or_else(|| format!("{BOOT_ID} holds `{}`, not a boot id", text.trim()))?;
        let offset_ms = std::fs::read_to_string("/proc/self/timens_offsets")
            .map_or(0, |text| monotonic_offset_ms(&text));
        Ok(LeaseClock {
            boot: boot.to_vec(),
            offset_ms,
        })
    }

    #[cfg(not(any(target_os = "linux", target_os = "android")))]
    fn from_system() -> Result<LeaseClock, String> {
        Ok(LeaseClock {
            boot: Vec::new(),
            offset_ms: 0,
        })
    }

    /// Now, in milliseconds on the lease clock.
    #[cfg(any(target_os = "linux", target_os = "android"))]
    pub(crate) fn now_ms(&self) -> i64 {
        let now = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
        now.tv_sec
            .saturating_mul(1000)
            .saturating_add(now.tv_nsec / 1_000_000)
            .saturating_sub(self.offset_ms)
    }

    /// Now, in milliseconds on the lease clock.
    #[cfg(not(any(target_os = "linux", target_os = "android")))]
    pub(crate) fn now_ms(&self) -> i64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
    }
}

/// The 16 bytes of a boot id written as a UUID (`8-4-4-4-12` hex digits).
#[cfg_attr(not(any(target_os = "linux", target_os = "android")), allow(dead_code))]
fn parse_boot_id(text: &str) -> Option<[u8; 16]> {
    let digits: Vec<u8> = text.trim().bytes().filter(|b| *b != b'-').collect();
    if digits.len() != 32 {
        return None;
    }
    let mut out = [0u8; 16];
    for (byte, pair) in out.iter_mut().zip(digits.chunks(2)) {
        let pair = std::str::from_utf8(pair).ok()?;
        *byte = u8::from_str_radix(pair, 16).ok()?;
    }
    Some(out)
}

/// The monotonic clock's offset in a `/proc/self/timens_offsets` text, in milliseconds (lines
/// of `CLOCK SECONDS NANOSECONDS`; the clock by name or by id, 1 being `CLOCK_MONOTONIC`).
#[cfg_attr(not(any(target_os = "linux", target_os = "android")), allow(dead_code))]
fn monotonic_offset_ms(text: &str) -> i64 {
    for line in text.lines() {
        let mut fields = line.split_whitespace();
        if !matches!(fields.next(), Some("monotonic" | "1")) {
            continue;
        }
        let secs = fields.next().and_then(|s| s.parse::<i64>().ok());
        let nanos = fields.next().and_then(|s| s.parse::<i64>().ok());
        if let (Some(secs), Some(nanos)) = (secs, nanos) {
            return secs.saturating_mul(1000).saturating_add(nanos / 1_000_000);
        }
    }
    0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn boot_ids_parse() {
        assert_eq!(
            parse_boot_id("0123abcd-4567-89ef-0011-223344556677\n"),
            Some([
                0x01, 0x23, 0xab, 0xcd, 0x45, 0x67, 0x89, 0xef, 0x00, 0x11, 0x22, 0x33, 0x44, 0x55,
                0x66, 0x77
            ])
        );
        assert_eq!(parse_boot_id("0123"), None);
        assert_eq!(parse_boot_id("zz23abcd-4567-89ef-0011-223344556677"), None);
    }

    #[test]
    fn namespace_offsets_parse() {
        assert_eq!(monotonic_offset_ms("monotonic 0 0\nboottime 0 0\n"), 0);
        assert_eq!(
            monotonic_offset_ms("monotonic   -5    250000000\nboottime 7 0\n"),
            -4750
        );
        assert_eq!(monotonic_offset_ms("boottime 7 0\n1 3 0\n"), 3000);
        assert_eq!(monotonic_offset_ms(""), 0);
    }

    #[test]
    fn the_clock_advances_with_instant() {
        let clock = LeaseClock::get().unwrap();
        let (t0, i0) = (clock.now_ms(), std::time::Instant::now());
        std::thread::sleep(std::time::Duration::from_millis(30));
        let (t1, i1) = (clock.now_ms(), std::time::Instant::now());
        let clock_ms = t1 - t0;
        let instant_ms = i64::try_from((i1 - i0).as_millis()).unwrap();
        assert!(clock_ms >= 30, "{clock_ms}");
        assert!(
            (clock_ms - instant_ms).abs() <= 2,
            "{clock_ms} vs {instant_ms}"
        );
    }

    #[cfg(any(target_os = "linux", target_os = "android"))]
    #[test]
    fn the_clock_is_the_kernels_monotonic_clock_of_this_boot() {
        let clock = LeaseClock::get().unwrap();
        let text = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap();
        assert_eq!(clock.boot(), &parse_boot_id(&text).unwrap()[..]);
        let offset = std::fs::read_to_string("/proc/self/timens_offsets")
            .map_or(0, |text| monotonic_offset_ms(&text));
        let read = || {
            let now = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
            now.tv_sec * 1000 + now.tv_nsec / 1_000_000 - offset
        };
        let before = read();
        let ms = clock.now_ms();
        let after = read();
        assert!(before <= ms && ms <= after, "{before} <= {ms} <= {after}");
    }
}
