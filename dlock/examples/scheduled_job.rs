//! A job every replica schedules on a `tokio::time::interval`, run by one replica per tick.
//!
//! Three "replicas" (providers on one SQLite lock file) tick every second; `run_exclusive`
//! lets one of them run the job and the others skip it. `at_least_for` keeps the lock for
//! 500 ms after a quick run, so a replica whose tick comes a little late does not run the job
//! again for the same tick.
//!
//! Run with `cargo run -p dlock-rs --example scheduled_job` (the lock file goes to `target/`).
//! On another store: `DLOCK_URL=redis://127.0.0.1:6379 cargo run -p dlock-rs --features redis
//! --example scheduled_job` (or `postgres`, `mysql`, `etcd`, ... with their URLs).

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use dlock::{LockError, LockProvider};

#[tokio::main]
async fn main() -> Result<(), LockError> {
    let url = std::env::var("DLOCK_URL")
        .unwrap_or_else(|_| "sqlite://target/scheduled-job-locks.db".to_owned());
    let runs = Arc::new(AtomicU32::new(0));
    let mut replicas = Vec::new();
    for replica in 0..3 {
        let locks = LockProvider::connect(&url).await?;
        let runs = Arc::clone(&runs);
        replicas.push(tokio::spawn(async move {
            let mut ticks = tokio::time::interval(Duration::from_secs(1));
            for _ in 0..3 {
                ticks.tick().await;
                let ran = locks
                    .run_exclusive(
                        "jobs:send-digests",
                        Duration::from_secs(60), // at most: a replica that dies frees it
                        Duration::from_millis(500), // at least: one run per tick
                        |_lost| async {
                            runs.fetch_add(1, Ordering::SeqCst);
                            "sent"
                        },
                    )
                    .await?;
                match ran {
                    Some(outcome) => println!("replica {replica}: ran the job ({outcome})"),
                    None => println!("replica {replica}: skipped, another replica has it"),
                }
            }
            Ok::<_, LockError>(())
        }));
    }
    for replica in replicas {
        replica.await.expect("replica task")?;
    }
    println!(
        "{} runs for 3 ticks of 3 replicas",
        runs.load(Ordering::SeqCst)
    );
    Ok(())
}
