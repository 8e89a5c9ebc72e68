// Provider parameters spelled every way, options in any order, escapes, fractional timeouts.
use std::sync::Arc;
use std::time::Duration;

use dlock::{LockError, LockedCommand, distributed_lock};

type AppResult<T> = Result<T, LockError>;

#[distributed_lock("a:{id}", timeout = 0)]
async fn owned(locks: dlock::LockProvider, id: u64) -> Result<(), LockError> {
    drop(locks);
    Ok(())
}

#[distributed_lock("a:{id}", timeout = 0.25)]
async fn full_path(id: u64, mut locks: &::dlock::LockProvider) -> std::result::Result<(), LockError> {
    locks = locks;
    let _ = locks;
    Ok(())
}

// A duration as in URL options: the same as `timeout = 0.25` and `timeout = 90`.
#[distributed_lock("a:{id}", timeout = "250ms")]
async fn duration_text(locks: &dlock::LockProvider, id: u64) -> AppResult<()> {
    Ok(())
}

#[distributed_lock("a:<id>", timeout = "1m 30s")]
struct DurationCommand {
    id: u64,
}

#[distributed_lock("a:{r#type}")]
async fn raw_ident(r#type: &str, locks: &&dlock::LockProvider) -> AppResult<()> {
    Ok(())
}

#[distributed_lock("a:{{literal}}:<<{id}>>", provider = shared, timeout = 1.5)]
async fn arc_provider(shared: Arc<dlock::LockProvider>, id: u64) -> AppResult<()> {
    Ok(())
}

#[distributed_lock("static-key", provider = locks.as_ref().unwrap(),)]
async fn expression(locks: Option<dlock::LockProvider>) -> AppResult<()> {
    Ok(())
}

// The macro's own variables are invisible to the template and the body.
#[distributed_lock("h:{__dlock_key}:{__dlock_key_builder}:{__dlock_guard}")]
async fn hygiene(
    locks: &dlock::LockProvider,
    __dlock_key: u64,
    __dlock_key_builder: u64,
    __dlock_guard: u64,
) -> AppResult<u64> {
    Ok(__dlock_key + __dlock_key_builder + __dlock_guard)
}

// Keywords as fields (raw identifiers), non-ASCII names, spaces around `.`.
struct Keywords {
    r#type: &'static str,
    r#match: u8,
}

#[distributed_lock("kw:{ cmd . r#type }:{cmd.match}:{ключ}")]
async fn keywords(locks: &dlock::LockProvider, cmd: Keywords, ключ: u8) -> AppResult<()> {
    Ok(())
}

#[distributed_lock("jobs:{0}:{1.name}", timeout = 3)]
struct Tuple(u64, Named);

struct Named {
    name: String,
}

#[distributed_lock("jobs:{id}")]
struct Generic<T: std::fmt::Display> {
    id: T,
}

#[distributed_lock("jobs:nightly", timeout = 10)]
struct Unit;

fn main() {
    let _ = (owned, full_path, raw_ident, arc_provider, expression, hygiene, keywords, duration_text);
    let command = DurationCommand { id: 4 };
    assert_eq!(command.lock_key(), "a:4");
    assert_eq!(command.lock_timeout(), Duration::from_secs(90));
    let tuple = Tuple(7, Named { name: "a:b".to_owned() });
    assert_eq!(tuple.lock_key(), "jobs:7:a%3Ab");
    assert_eq!(tuple.lock_timeout(), Duration::from_secs(3));
    let generic = Generic { id: "x" };
    assert_eq!(generic.lock_key(), "jobs:x");
    assert_eq!(generic.lock_timeout(), Duration::ZERO);
    assert_eq!(Unit.lock_key(), "jobs:nightly");
}
