#![allow(unused)]

use dlock::{LockError, distributed_lock};

#[distributed_lock("account:{account_id}", timeout = 10, provider = "not a provider")]
async fn credit(account_id: u64) -> Result<(), LockError> {
    Ok(())
}

fn main() {}
