// keys(...), permits = N and mode = read | write compile with the other options.
use dlock::{LockError, LockGuard, LockProvider, distributed_lock};

#[distributed_lock(keys("account:{from}", "account:{to}"), timeout = 10, guard = locks_held, on_lost = cancel)]
async fn transfer(locks: &LockProvider, from: u64, to: u64) -> Result<usize, LockError> {
    let guards: &[LockGuard] = locks_held;
    Ok(guards.len())
}

#[distributed_lock(keys("a:{x}", "b:{x}", "c:{y.0}"), provider = state, timeout = 0.5)]
async fn three(state: &LockProvider, x: &str, y: (u32,)) -> Result<(), LockError> {
    Ok(())
}

#[distributed_lock("exports:{tenant}", permits = 5, timeout = 10, guard = slot)]
async fn export(locks: &LockProvider, tenant: &str) -> Result<Option<u64>, LockError> {
    let slot: &LockGuard = slot;
    Ok(slot.fencing_token())
}

#[distributed_lock("prices:{region}", mode = read, timeout = 5, guard = share, on_lost = cancel)]
async fn quote(locks: &LockProvider, region: &str) -> Result<String, LockError> {
    let share: &LockGuard = share;
    Ok(share.key().to_owned())
}

#[distributed_lock("prices:{region}", mode = write)]
async fn reprice(locks: &LockProvider, region: &str) -> Result<(), LockError> {
    Ok(())
}

fn main() {
    let _ = (transfer, three, export, quote, reprice);
}
