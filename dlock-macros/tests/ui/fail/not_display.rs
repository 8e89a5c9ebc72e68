#![allow(unused)]

use dlock::{LockError, LockProvider, distributed_lock};

struct AccountId(u64);

#[distributed_lock("account:{account_id}", timeout = 10)]
async fn debit(locks: &LockProvider, account_id: AccountId) -> Result<(), LockError> {
    Ok(())
}

fn main() {}
