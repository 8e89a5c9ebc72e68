#![allow(unused)]

use dlock::{LockError, LockProvider, distributed_lock};

#[distributed_lock("account:{account_id}", timeout = 10, timeout = 5)]
async fn debit(locks: &LockProvider, account_id: u64) -> Result<(), LockError> {
    Ok(())
}

#[distributed_lock("account:{account_id}", guard = a, provider = locks, guard = b)]
async fn credit(locks: &LockProvider, account_id: u64) -> Result<(), LockError> {
    Ok(())
}

fn main() {
    let _ = debit;
    let _ = credit;
}
