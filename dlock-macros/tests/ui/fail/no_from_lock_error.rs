#![allow(unused)]

use dlock::{LockProvider, distributed_lock};

#[derive(Debug)]
struct AppError;

#[distributed_lock("account:{account_id}", timeout = 10)]
async fn debit(locks: &LockProvider, account_id: u64) -> Result<(), AppError> {
    Ok(())
}

fn main() {}
