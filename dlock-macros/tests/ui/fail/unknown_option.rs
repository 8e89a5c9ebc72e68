#![allow(unused)]

use dlock::{LockError, LockProvider, distributed_lock};

#[distributed_lock("account:{account_id}", timout = 10)]
async fn debit(locks: &LockProvider, account_id: u64) -> Result<(), LockError> {
    Ok(())
}

#[distributed_lock("account:{account_id}", timeout = 10, provider = locks)]
struct Debit {
    account_id: u64,
}

#[distributed_lock("account:{account_id}", guard = g)]
struct Credit {
    account_id: u64,
}

fn main() {
    let _ = debit;
}
