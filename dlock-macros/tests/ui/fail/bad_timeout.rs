#![allow(unused)]

use dlock::{LockError, LockProvider, distributed_lock};

#[distributed_lock("a:{id}", timeout = -1)]
async fn negative(locks: &LockProvider, id: u64) -> Result<(), LockError> {
    Ok(())
}

#[distributed_lock("a:{id}", timeout = "10 parsecs")]
async fn string(locks: &LockProvider, id: u64) -> Result<(), LockError> {
    Ok(())
}

#[distributed_lock("a:{id}", timeout = "2d")]
async fn days(locks: &LockProvider, id: u64) -> Result<(), LockError> {
    Ok(())
}

#[distributed_lock("a:{id}", timeout = 500ms)]
async fn suffix(locks: &LockProvider, id: u64) -> Result<(), LockError> {
    Ok(())
}

#[distributed_lock("a:{id}", timeout = 1e30)]
async fn huge(locks: &LockProvider, id: u64) -> Result<(), LockError> {
    Ok(())
}

#[distributed_lock("a:{id}", timeout = SECONDS)]
struct Command {
    id: u64,
}

fn main() {}
