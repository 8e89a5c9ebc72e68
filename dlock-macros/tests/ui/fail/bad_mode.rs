#![allow(unused)]

use dlock::{LockError, LockProvider, distributed_lock};

#[distributed_lock("prices:{region}", mode = shared)]
async fn unknown(locks: &LockProvider, region: &str) -> Result<(), LockError> {
    Ok(())
}

#[distributed_lock("prices:{region}", mode = "read")]
async fn string(locks: &LockProvider, region: &str) -> Result<(), LockError> {
    Ok(())
}

#[distributed_lock("prices:{region}", mode = read, mode = write)]
async fn twice(locks: &LockProvider, region: &str) -> Result<(), LockError> {
    Ok(())
}

#[distributed_lock("prices:{region}", mode = read, permits = 3)]
async fn with_permits(locks: &LockProvider, region: &str) -> Result<(), LockError> {
    Ok(())
}

#[distributed_lock(keys("account:{from}", "account:{to}"), mode = read)]
async fn with_keys(locks: &LockProvider, from: u64, to: u64) -> Result<(), LockError> {
    Ok(())
}

#[distributed_lock("prices:{region}", mode = read)]
struct Quote {
    region: String,
}

fn main() {
    let _ = (unknown, string, twice, with_permits, with_keys);
    let _ = Quote { region: String::new() };
}
