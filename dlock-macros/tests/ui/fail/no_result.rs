#![allow(unused)]

use dlock::{LockProvider, distributed_lock};

#[distributed_lock("account:{account_id}", timeout = 10)]
async fn debit(locks: &LockProvider, account_id: u64) -> u64 {
    account_id
}

#[distributed_lock("account:{account_id}", timeout = 10)]
async fn credit(locks: &LockProvider, account_id: u64) {}

#[distributed_lock("account:{account_id}", timeout = 10)]
async fn option(locks: &LockProvider, account_id: u64) -> Option<u64> {
    None
}

fn main() {
    let _ = debit;
    let _ = credit;
    let _ = option;
}
