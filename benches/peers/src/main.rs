//! The peers of the report bench: other crates' uncontended acquire + release, on demand.
//!
//! Reads commands from stdin, one a line, and answers each with one JSON line on stdout:
//!
//! - `setup <peer> <url>`: connects; answers `{"ok":true}` or `{"error":"..."}`;
//! - `run <peer> <iterations>`: runs that many acquire + release pairs on one key; answers
//!   `{"ns_per_op":N}` or `{"error":"..."}`.
//!
//! Peers: `distributed-lock-postgres`, `distributed-lock-mysql`, `distributed-lock-redis`,
//! `rslock`. The report bench interleaves these batches with its own, so that the machine's
//! noise hits both alike.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use distributed_lock_core::prelude::*;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

const KEY: &str = "bench:peer";

enum Peer {
    Postgres(distributed_lock_postgres::PostgresLockProvider),
    MySql(distributed_lock_mysql::MySqlLockProvider),
    Redis(distributed_lock_redis::RedisLockProvider),
    Rslock(rslock::LockManager),
}

async fn setup(peer: &str, url: &str) -> Result<Peer, String> {
    let e = |e: &dyn std::fmt::Display| e.to_string();
    Ok(match peer {
        "distributed-lock-postgres" => Peer::Postgres(
            distributed_lock_postgres::PostgresLockProvider::builder()
                .connection_string(url)
                .build()
                .await
                .map_err(|x| e(&x))?,
        ),
        "distributed-lock-mysql" => Peer::MySql(
            distributed_lock_mysql::MySqlLockProvider::builder()
                .connection_string(url)
                .build()
                .await
                .map_err(|x| e(&x))?,
        ),
        "distributed-lock-redis" => Peer::Redis(
            distributed_lock_redis::RedisLockProvider::builder()
                .url(url)
                .build()
                .await
                .map_err(|x| e(&x))?,
        ),
        // One URL, or several separated by commas: the Redlock nodes.
        "rslock" => Peer::Rslock(rslock::LockManager::new(
            url.split(',').map(str::to_owned).collect(),
        )),
        other => return Err(format!("unknown peer {other}")),
    })
}

async fn generic<P: LockProvider>(provider: &P) -> Result<(), String> {
    let lock = provider.create_lock(KEY);
    let handle = lock
        .try_acquire()
        .await
        .map_err(|e| e.to_string())?
        .ok_or("the key was not free")?;
    handle.release().await.map_err(|e| e.to_string())
}

async fn once(peer: &Peer) -> Result<(), String> {
    match peer {
        Peer::Postgres(p) => generic(p).await,
        Peer::MySql(p) => generic(p).await,
        Peer::Redis(p) => generic(p).await,
        Peer::Rslock(m) => {
            let lock = m
                .lock(KEY.as_bytes(), Duration::from_secs(30))
                .await
                .map_err(|e| format!("{e:?}"))?;
            m.unlock(&lock).await;
            Ok(())
        }
    }
}

fn quote(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if c.is_control() => out.push(' '),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

async fn answer(peers: &mut HashMap<String, Peer>, line: &str) -> String {
    let words: Vec<&str> = line.split_whitespace().collect();
    match words.as_slice() {
        ["setup", peer, url] => match setup(peer, url).await {
            Ok(p) => {
                // One warm-up pair: connections open, statements prepared.
                if let Err(e) = once(&p).await {
                    return format!("{{\"error\":{}}}", quote(&e));
                }
                peers.insert((*peer).to_owned(), p);
                "{\"ok\":true}".to_owned()
            }
            Err(e) => format!("{{\"error\":{}}}", quote(&e)),
        },
        ["run", peer, n] => {
            let Some(p) = peers.get(*peer) else {
                return format!("{{\"error\":{}}}", quote(&format!("{peer} is not set up")));
            };
            let Ok(n) = n.parse::<u32>() else {
                return "{\"error\":\"bad count\"}".to_owned();
            };
            let started = Instant::now();
            for _ in 0..n {
                if let Err(e) = once(p).await {
                    return format!("{{\"error\":{}}}", quote(&e));
                }
            }
            let ns = started.elapsed().as_nanos() / u128::from(n.max(1));
            format!("{{\"ns_per_op\":{ns}}}")
        }
        _ => format!("{{\"error\":{}}}", quote(&format!("bad command: {line}"))),
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    // On a worker thread, where a service's code runs (as the report runs dlock and the raw
    // baselines), not on the thread that blocks on the runtime.
    let _ = tokio::spawn(serve()).await;
}

async fn serve() {
    let mut peers = HashMap::new();
    let mut lines = BufReader::new(tokio::io::stdin()).lines();
    let mut out = tokio::io::stdout();
    while let Ok(Some(line)) = lines.next_line().await {
        let reply = answer(&mut peers, line.trim()).await;
        if out
            .write_all(format!("{reply}\n").as_bytes())
            .await
            .is_err()
            || out.flush().await.is_err()
        {
            break;
        }
    }
}
