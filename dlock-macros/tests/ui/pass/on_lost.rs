//! `on_lost` with every other option, on functions and methods.

use dlock::{LockError, LockProvider, distributed_lock};

#[distributed_lock("job:{name}", timeout = 1, on_lost = cancel, guard = lock)]
async fn cancel_with_guard(locks: &LockProvider, name: &str) -> Result<Option<u64>, LockError> {
    Ok(lock.fencing_token())
}

#[distributed_lock("job:{name}", on_lost = finish)]
async fn finish(locks: &LockProvider, name: String) -> Result<(), LockError> {
    Ok(())
}

struct Jobs {
    locks: LockProvider,
}

impl Jobs {
    #[distributed_lock("job:{id}", provider = self.locks, on_lost = cancel)]
    async fn run(&self, id: u32) -> Result<u32, JobsError> {
        if id == 0 {
            return Err(JobsError);
        }
        Ok(id)
    }
}

impl From<LockError> for JobsError {
    fn from(_: LockError) -> Self {
        JobsError
    }
}

struct JobsError;

#[distributed_lock("job:{id}", on_lost = cancel)]
async fn early_return(locks: &LockProvider, id: u32) -> Result<u32, JobsError> {
    if id > 10 {
        return Err(JobsError);
    }
    Ok(id)
}

fn main() {}
