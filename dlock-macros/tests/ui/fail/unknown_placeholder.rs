#![allow(unused)]

use dlock::{LockError, LockProvider, distributed_lock};

#[distributed_lock("account:{acount_id}", timeout = 10)]
async fn debit(locks: &LockProvider, account_id: u64, amount: i64) -> Result<i64, LockError> {
    Ok(amount)
}

#[distributed_lock("transfer:<from>:<to.id>", timeout = 10)]
async fn transfer(locks: &LockProvider, from: u64) -> Result<(), LockError> {
    Ok(())
}

#[distributed_lock("account:{id}")]
struct Debit {
    account_id: u64,
    amount: i64,
}

fn main() {
    // The items are kept as written, so code using them still compiles.
    let _ = debit;
    let _ = transfer;
    let _ = Debit { account_id: 1, amount: 2 };
}
