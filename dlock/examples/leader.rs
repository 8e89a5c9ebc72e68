//! Leader election: two "replicas" contend for `leader:scheduler`; one leads, the other waits.
//! The leader steps down on shutdown, and the other takes over at once.
//!
//! Run with `cargo run -p dlock-rs --example leader` (the lock file goes to `target/`).
//! On another store: `DLOCK_URL=redis://127.0.0.1:6379 cargo run -p dlock-rs --features redis
//! --example leader` (or `postgres`, `mysql`, `etcd`, ... with their URLs).

use std::time::Duration;

use dlock::{CancellationToken, Leader, LockError, LockProvider};

#[tokio::main]
async fn main() -> Result<(), LockError> {
    let url =
        std::env::var("DLOCK_URL").unwrap_or_else(|_| "sqlite://target/leader-locks.db".to_owned());
    let (elected_tx, mut elected) = tokio::sync::mpsc::unbounded_channel();
    let mut replicas = Vec::new();
    for replica in 0..2 {
        let locks = LockProvider::connect(&url).await?;
        let shutdown = CancellationToken::new();
        let elected_tx = elected_tx.clone();
        let stop = shutdown.clone();
        let run = tokio::spawn(async move {
            Leader::new(&locks, "leader:scheduler")
                .run(&stop, |term| {
                    let elected_tx = elected_tx.clone();
                    async move {
                        println!(
                            "replica {replica} leads (term {}, fencing token {:?})",
                            term.number(),
                            term.fencing_token()
                        );
                        let _ = elected_tx.send(replica);
                        // The leader's work: here, a tick until the term ends.
                        let mut ticks = tokio::time::interval(Duration::from_millis(200));
                        while !term.has_ended() {
                            tokio::select! {
                                _ = ticks.tick() => println!("replica {replica}: leader's tick"),
                                () = term.ended() => {}
                            }
                        }
                        println!("replica {replica} steps down");
                    }
                })
                .await
        });
        replicas.push((shutdown, run));
    }
    let first = elected.recv().await.expect("a leader");
    tokio::time::sleep(Duration::from_millis(500)).await;
    // Shut the leader down: it steps down, and the other replica is elected.
    replicas[first].0.cancel();
    let second = elected.recv().await.expect("a second leader");
    println!("leadership moved from replica {first} to replica {second}");
    for (shutdown, run) in replicas {
        shutdown.cancel();
        run.await.expect("replica task")?;
    }
    Ok(())
}
