#![allow(unused)]

use dlock::{LockError, LockProvider, distributed_lock};

// A template and keys(...) together.
#[distributed_lock("account:{from}", keys("account:{from}", "account:{to}"))]
async fn both(locks: &LockProvider, from: u64, to: u64) -> Result<(), LockError> {
    Ok(())
}

// A second template outside keys(...).
#[distributed_lock("account:{from}", "account:{to}")]
async fn two_templates(locks: &LockProvider, from: u64, to: u64) -> Result<(), LockError> {
    Ok(())
}

// Empty keys().
#[distributed_lock(keys(), timeout = 10)]
async fn empty(locks: &LockProvider, from: u64) -> Result<(), LockError> {
    Ok(())
}

// One key in keys(...).
#[distributed_lock(keys("account:{from}"))]
async fn one(locks: &LockProvider, from: u64) -> Result<(), LockError> {
    Ok(())
}

// The same template twice, and a malformed one.
#[distributed_lock(keys("account:{from}", "account:{from}", "account:{to"))]
async fn repeated(locks: &LockProvider, from: u64, to: u64) -> Result<(), LockError> {
    Ok(())
}

// A placeholder that is not a parameter, in the second template.
#[distributed_lock(keys("account:{from}", "account:{too}"), timeout = 10)]
async fn unknown(locks: &LockProvider, from: u64, to: u64) -> Result<(), LockError> {
    Ok(())
}

// Not a string literal.
#[distributed_lock(keys(from, to))]
async fn not_literals(locks: &LockProvider, from: u64, to: u64) -> Result<(), LockError> {
    Ok(())
}

// On a struct: a command names one key.
#[distributed_lock(keys("account:{from}", "account:{to}"))]
struct Transfer {
    from: u64,
    to: u64,
}

fn main() {
    let _ = (both, two_templates, empty, one, repeated, unknown, not_literals);
    let _ = Transfer { from: 1, to: 2 };
}
