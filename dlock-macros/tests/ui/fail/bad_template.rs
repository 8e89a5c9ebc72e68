#![allow(unused)]

use dlock::{LockError, LockProvider, distributed_lock};

#[distributed_lock("account:{account_id", timeout = 10)]
async fn unclosed(locks: &LockProvider, account_id: u64) -> Result<(), LockError> {
    Ok(())
}

#[distributed_lock("account:account_id>", timeout = 10)]
async fn unmatched(locks: &LockProvider, account_id: u64) -> Result<(), LockError> {
    Ok(())
}

#[distributed_lock("account:{}", timeout = 10)]
async fn empty_placeholder(locks: &LockProvider, account_id: u64) -> Result<(), LockError> {
    Ok(())
}

#[distributed_lock("account:{account id}", timeout = 10)]
async fn invalid_placeholder(locks: &LockProvider, account_id: u64) -> Result<(), LockError> {
    Ok(())
}

#[distributed_lock("transfer:{from}-{to}", timeout = 10)]
async fn no_separator(locks: &LockProvider, from: u64, to: u64) -> Result<(), LockError> {
    Ok(())
}

#[distributed_lock("transfer:{from}{to}", timeout = 10)]
async fn adjacent(locks: &LockProvider, from: u64, to: u64) -> Result<(), LockError> {
    Ok(())
}

#[distributed_lock("", timeout = 10)]
async fn empty(locks: &LockProvider) -> Result<(), LockError> {
    Ok(())
}

#[distributed_lock(timeout = 10)]
async fn no_template(locks: &LockProvider) -> Result<(), LockError> {
    Ok(())
}

#[distributed_lock]
async fn no_arguments(locks: &LockProvider) -> Result<(), LockError> {
    Ok(())
}

fn main() {}
