//! Two "replicas" of a service race for the same jobs on one SQLite lock file; each job runs
//! on exactly one of them at a time.
//!
//! Run with `cargo run -p dlock-rs --example quickstart` (the lock file goes to `target/`).

use std::time::Duration;

use dlock::{LockError, LockProvider};

#[tokio::main]
async fn main() -> Result<(), LockError> {
    let url = std::env::var("DLOCK_URL")
        .unwrap_or_else(|_| "sqlite://target/quickstart-locks.db".to_owned());
    // Two providers stand for two replicas; in production each process has one.
    let replica_a = LockProvider::connect(&url).await?;
    let replica_b = LockProvider::connect(&url).await?;

    let billing = replica_a.try_acquire("jobs:monthly-billing").await?;
    println!(
        "replica A runs monthly billing (fencing token {:?})",
        billing.fencing_token()
    );
    match replica_b.try_acquire("jobs:monthly-billing").await {
        Err(LockError::AlreadyHeld { key }) => {
            println!("replica B skips `{key}`: another replica holds it")
        }
        other => println!("unexpected: {other:?}"),
    }

    let waiter = {
        let replica_b = replica_b.clone();
        tokio::spawn(async move {
            replica_b
                .with_lock(
                    "jobs:monthly-billing",
                    Duration::from_secs(10),
                    |_lost| async {
                        println!("replica B got the lock once A let go");
                    },
                )
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    billing.release().await?;
    waiter
        .await
        .map_err(|e| LockError::config(e.to_string()))??;

    let timeout = replica_b
        .acquire("jobs:never-free", Duration::ZERO)
        .await
        .map(|guard| guard.fencing_token());
    println!("one try on a free key: {timeout:?}");
    Ok(())
}
