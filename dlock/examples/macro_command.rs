//! `#[distributed_lock]` on a function and on a command struct: keys made from arguments and
//! fields, lock errors returned as the function's own error, and what a held lock answers.
//!
//! Run with `cargo run -p dlock-rs --example macro_command` (the lock file `locks.db` goes to
//! the current directory). On another store: `DLOCK_URL=redis://127.0.0.1:6379 cargo run -p
//! dlock-rs --features redis --example macro_command` (or `postgres`, `mysql`, `etcd`, ... with
//! their URLs).

use dlock::{LockError, LockProvider, LockedCommand, distributed_lock};

#[derive(Debug)]
enum ShipError {
    Lock(LockError),
}

impl From<LockError> for ShipError {
    fn from(err: LockError) -> Self {
        ShipError::Lock(err)
    }
}

/// One shipment of an order at a time, in every process: the key is "order:42" for order 42.
#[distributed_lock("order:{order_id}", timeout = "5s", guard = lock)]
async fn ship(locks: &LockProvider, order_id: u64, carrier: &str) -> Result<String, ShipError> {
    Ok(format!(
        "order {order_id} shipped by {carrier} (fencing token {:?})",
        lock.fencing_token()
    ))
}

/// A command that names its own lock: `lock_key()` is "warehouse:north:restock".
#[distributed_lock("warehouse:<warehouse>:restock", timeout = 0.5)]
struct Restock {
    warehouse: String,
    items: u32,
}

#[tokio::main]
async fn main() -> Result<(), LockError> {
    let url = std::env::var("DLOCK_URL").unwrap_or_else(|_| "sqlite://locks.db".to_owned());
    let locks = LockProvider::connect(&url).await?;
    match ship(&locks, 42, "post").await {
        Ok(shipped) => println!("{shipped}"),
        Err(ShipError::Lock(err)) => println!("not shipped: {err}"),
    }

    let restock = Restock {
        warehouse: "north".to_owned(),
        items: 12,
    };
    let guard = locks.acquire_for(&restock).await?;
    println!("restocking {} items under {}", restock.items, guard.key());
    // While the command's lock is held, a second one waits its 0.5 s, then times out.
    let second = Restock {
        warehouse: "north".to_owned(),
        items: 3,
    };
    match locks.acquire_for(&second).await {
        Err(err @ LockError::Timeout { .. }) => println!("second restock: {err}"),
        other => println!("second restock: unexpected {other:?}"),
    }
    guard.release().await?;
    println!("lock key of the command: {}", second.lock_key());
    Ok(())
}
