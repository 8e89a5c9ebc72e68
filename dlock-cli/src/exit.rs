//! The exit statuses of `dlock` (listed for users in `--help`, see `cli.rs`).

use dlock::LockError;

/// The lock is held elsewhere, or stayed held for the whole timeout (`EX_TEMPFAIL`).
pub const CONFLICT: u8 = 75;
/// The lock was lost while CMD ran, or its release found it lost.
pub const LOST: u8 = 79;
/// A usage error (`EX_USAGE`).
pub const USAGE: u8 = 64;
/// The store could not be reached, or failed (`EX_UNAVAILABLE`).
pub const UNAVAILABLE: u8 = 69;
/// The store or this build cannot do what was asked (`EX_CONFIG`).
pub const CONFIG: u8 = 78;
/// CMD could not be run.
pub const CANNOT_RUN: u8 = 126;
/// CMD was not found.
pub const NOT_FOUND: u8 = 127;
/// `dlock ping` and `dlock release`: the store did not answer, or there was nothing to do.
pub const FAILURE: u8 = 1;

/// The status for an error of the library that ends a subcommand (other than contention,
/// which `run` answers with its conflict status).
pub fn of(err: &LockError) -> u8 {
    match err {
        LockError::InvalidKey { .. } => USAGE,
        LockError::Config { .. } | LockError::Unsupported { .. } => CONFIG,
        _ => UNAVAILABLE,
    }
}

/// The status of a command that ended with `status`: its code, or 128 + the signal that ended
/// it, as shells report it.
pub fn of_status(status: std::process::ExitStatus) -> u8 {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        // Codes are 0-255 on Unix.
        (Some(code), _) => u8::try_from(code & 0xff).unwrap_or(u8::MAX),
        (None, Some(signal)) => u8::try_from(128 + (signal & 0x7f)).unwrap_or(u8::MAX),
        (None, None) => UNAVAILABLE,
    }
}
