#![allow(unused)]

use dlock::{LockError, LockProvider, distributed_lock};

#[distributed_lock("account:{account_id}", timeout = 10)]
async fn debit(account_id: u64) -> Result<(), LockError> {
    Ok(())
}

#[distributed_lock("account:{account_id}", timeout = 10)]
async fn twice(a: &LockProvider, b: LockProvider, account_id: u64) -> Result<(), LockError> {
    Ok(())
}

#[distributed_lock("account:{account_id}", timeout = 10)]
async fn unnamed(_: &LockProvider, account_id: u64) -> Result<(), LockError> {
    Ok(())
}

fn main() {
    let _ = debit;
    let _ = twice;
    let _ = unnamed;
}
