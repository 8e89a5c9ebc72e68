// Methods, generic functions, and axum-style handlers with destructured extractors.
use std::fmt::Display;

use dlock::{LockError, LockGuard, LockProvider, distributed_lock};

// Stand-ins for axum's extractors: tuple structs destructured in the parameter list.
pub struct Path<T>(pub T);
pub struct State<T>(pub T);

#[derive(Clone)]
pub struct AppState {
    pub locks: LockProvider,
}

#[distributed_lock("account:{account_id}:{owner}", provider = state.locks, timeout = 10)]
async fn handler(
    State(state): State<AppState>,
    Path((account_id, owner)): Path<(u64, String)>,
) -> Result<String, LockError> {
    Ok(format!("{account_id}{owner}"))
}

pub struct Service {
    locks: LockProvider,
    name: String,
}

impl Service {
    #[distributed_lock("svc:{self.name}:{id}", provider = self.locks, guard = lock)]
    pub async fn run(&self, id: u32) -> Result<Option<u64>, LockError> {
        let held: &LockGuard = lock;
        Ok(held.fencing_token())
    }

    #[distributed_lock("svc:{self.name}", provider = self.locks)]
    pub async fn consume(self) -> Result<String, LockError> {
        Ok(self.name)
    }
}

pub trait Job {
    fn run(&self, locks: &LockProvider) -> impl std::future::Future<Output = Result<(), LockError>>;
}

impl Job for Service {
    #[distributed_lock("job:{self.name}")]
    async fn run(&self, locks: &LockProvider) -> Result<(), LockError> {
        Ok(())
    }
}

#[distributed_lock("generic:{id}", timeout = 1)]
async fn generic<T, E>(locks: &LockProvider, id: T) -> Result<T, E>
where
    T: Display + Send,
    E: From<LockError>,
{
    Ok(id)
}

fn main() {
    let _ = handler;
    let _ = generic::<u64, LockError>;
}
