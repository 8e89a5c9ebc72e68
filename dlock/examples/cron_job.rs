//! A cron schedule (`tokio-cron-scheduler`) on every replica, with the job run by one of them
//! per firing: the scheduler decides *when*, `run_exclusive` decides *who*.
//!
//! Two "replicas" (providers on one SQLite lock file) each schedule the job every two seconds;
//! the program stops after three firings.
//!
//! Run with `cargo run -p dlock-rs --example cron_job` (the lock file goes to `target/`).
//! On another store: `DLOCK_URL=redis://127.0.0.1:6379 cargo run -p dlock-rs --features redis
//! --example cron_job` (or `postgres`, `mysql`, `etcd`, ... with their URLs).

use std::sync::Arc;
use std::time::Duration;

use dlock::LockProvider;
use tokio::sync::mpsc;
use tokio_cron_scheduler::{Job, JobScheduler};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("DLOCK_URL")
        .unwrap_or_else(|_| "sqlite://target/cron-job-locks.db".to_owned());
    let (ran_tx, mut ran) = mpsc::unbounded_channel();
    let mut schedulers = Vec::new();
    for replica in 0..2 {
        let locks = Arc::new(LockProvider::connect(&url).await?);
        let scheduler = JobScheduler::new().await?;
        let ran_tx = ran_tx.clone();
        scheduler
            .add(Job::new_async("*/2 * * * * *", move |_id, _scheduler| {
                let (locks, ran_tx) = (Arc::clone(&locks), ran_tx.clone());
                Box::pin(async move {
                    let outcome = locks
                        .run_exclusive(
                            "jobs:rebuild-search-index",
                            Duration::from_secs(300),
                            Duration::from_secs(1),
                            |_lost| async { "rebuilt" },
                        )
                        .await;
                    match outcome {
                        Ok(Some(done)) => {
                            println!("replica {replica}: {done}");
                            let _ = ran_tx.send(replica);
                        }
                        Ok(None) => println!("replica {replica}: skipped"),
                        Err(err) => eprintln!("replica {replica}: {err}"),
                    }
                })
            })?)
            .await?;
        scheduler.start().await?;
        schedulers.push(scheduler);
    }
    for _ in 0..3 {
        let replica = ran.recv().await.expect("a firing");
        println!("firing handled by replica {replica}");
    }
    for mut scheduler in schedulers {
        scheduler.shutdown().await?;
    }
    Ok(())
}
