#![allow(unused)]

use dlock::{LockError, LockProvider, distributed_lock};

#[distributed_lock("account:{account_id}", timeout = 10)]
fn debit(locks: &LockProvider, account_id: u64) -> Result<(), LockError> {
    Ok(())
}

fn main() {
    let _ = debit;
}
