// The spellings of the issue and the design, verbatim.
use dlock::{LockError, LockProvider, LockedCommand, distributed_lock};

#[derive(Debug)]
pub enum AppError {
    Lock(LockError),
}

impl From<LockError> for AppError {
    fn from(err: LockError) -> Self {
        AppError::Lock(err)
    }
}

#[distributed_lock("account:<account_id>", timeout = 10)]
async fn debit(locks: &LockProvider, account_id: u64, amount: i64) -> Result<u64, AppError> {
    Ok(account_id + amount.unsigned_abs())
}

#[dlock::distributed_lock("account:{account_id}", timeout = 10)]
async fn credit(locks: &LockProvider, account_id: u64, amount: i64) -> Result<u64, AppError> {
    Ok(account_id + amount.unsigned_abs())
}

#[dlock::distributed_lock("account:<account_id>", timeout = 10)]
struct DebitAccount {
    account_id: u64,
    amount: i64,
}

fn main() {
    let _ = (debit, credit);
    let command = DebitAccount { account_id: 42, amount: 1 };
    assert_eq!(command.lock_key(), "account:42");
    assert_eq!(command.amount, 1);
}
