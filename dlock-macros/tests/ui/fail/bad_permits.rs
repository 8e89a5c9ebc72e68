#![allow(unused)]

use dlock::{LockError, LockProvider, distributed_lock};

#[distributed_lock("exports:{tenant}", permits = 0)]
async fn zero(locks: &LockProvider, tenant: &str) -> Result<(), LockError> {
    Ok(())
}

#[distributed_lock("exports:{tenant}", permits = 2.5)]
async fn decimal(locks: &LockProvider, tenant: &str) -> Result<(), LockError> {
    Ok(())
}

#[distributed_lock("exports:{tenant}", permits = "5")]
async fn string(locks: &LockProvider, tenant: &str) -> Result<(), LockError> {
    Ok(())
}

#[distributed_lock("exports:{tenant}", permits = -1)]
async fn negative(locks: &LockProvider, tenant: &str) -> Result<(), LockError> {
    Ok(())
}

#[distributed_lock("exports:{tenant}", permits = 5_000_000_000)]
async fn huge(locks: &LockProvider, tenant: &str) -> Result<(), LockError> {
    Ok(())
}

#[distributed_lock("exports:{tenant}", permits = 2, permits = 3)]
async fn twice(locks: &LockProvider, tenant: &str) -> Result<(), LockError> {
    Ok(())
}

#[distributed_lock(keys("account:{from}", "account:{to}"), permits = 2)]
async fn with_keys(locks: &LockProvider, from: u64, to: u64) -> Result<(), LockError> {
    Ok(())
}

#[distributed_lock("exports:{tenant}", permits = 5)]
struct Export {
    tenant: String,
}

fn main() {
    let _ = (zero, decimal, string, negative, huge, twice, with_keys);
    let _ = Export { tenant: String::new() };
}
