#![allow(unused)]

use dlock::{LockError, LockProvider, distributed_lock};

#[distributed_lock("job:{name}", on_lost = stop)]
async fn unknown_value(locks: &LockProvider, name: &str) -> Result<(), LockError> {
    Ok(())
}

#[distributed_lock("job:{name}", on_lost = "cancel")]
async fn not_a_name(locks: &LockProvider, name: &str) -> Result<(), LockError> {
    Ok(())
}

#[distributed_lock("job:{name}", on_lost = cancel, on_lost = finish)]
async fn twice(locks: &LockProvider, name: &str) -> Result<(), LockError> {
    Ok(())
}

#[distributed_lock("job:{name}", on_lost = cancel)]
struct Job {
    name: String,
}

fn main() {}
