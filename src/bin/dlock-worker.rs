//! A child process for the multi-process tests.
//!
//! `dlock-worker cycle URL KEY ITERATIONS LOG` takes the lock ITERATIONS times and, inside each
//! critical section, appends `enter PID TOKEN` and then `exit PID` to LOG (opened in append
//! mode, so every line lands whole and in the order the writes happened). A checker then reads
//! the interleaving: any `enter` that follows an `enter` without its `exit` is an overlap.
//!
//! `dlock-worker hold URL KEY` takes the lock, prints `held TOKEN` on stdout and sleeps until
//! it is killed; if the lock's lost token fires meanwhile, it prints `lost UNIX_MS` (the wall
//! clock when it fired).

use std::io::Write;
use std::process::ExitCode;
use std::time::Duration;

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let outcome = match args
        .iter()
        .map(String::as_str)
        .collect::<Vec<_>>()
        .as_slice()
    {
        ["cycle", url, key, iterations, log] => cycle(url, key, iterations, log).await,
        ["hold", url, key] => hold(url, key).await,
        _ => Err("usage: dlock-worker cycle URL KEY ITERATIONS LOG | hold URL KEY".to_owned()),
    };
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("dlock-worker: {message}");
            ExitCode::FAILURE
        }
    }
}

async fn cycle(url: &str, key: &str, iterations: &str, log: &str) -> Result<(), String> {
    let iterations: u32 = iterations.parse().map_err(|e| format!("iterations: {e}"))?;
    let locks = dlock::LockProvider::connect(url)
        .await
        .map_err(|e| e.to_string())?;
    let mut file = std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .open(log)
        .map_err(|e| format!("{log}: {e}"))?;
    let pid = std::process::id();
    for _ in 0..iterations {
        let guard = locks
            .acquire(key, Duration::from_secs(120))
            .await
            .map_err(|e| e.to_string())?;
        let token = guard
            .fencing_token()
            .map_or_else(|| "-".to_owned(), |t| t.to_string());
        file.write_all(format!("enter {pid} {token}\n").as_bytes())
            .map_err(|e| e.to_string())?;
        // Give another process every chance to overlap if exclusion were broken.
        tokio::task::yield_now().await;
        std::thread::sleep(Duration::from_micros(200));
        file.write_all(format!("exit {pid}\n").as_bytes())
            .map_err(|e| e.to_string())?;
        guard.release().await.map_err(|e| e.to_string())?;
    }
    Ok(())
}

async fn hold(url: &str, key: &str) -> Result<(), String> {
    let locks = dlock::LockProvider::connect(url)
        .await
        .map_err(|e| e.to_string())?;
    let guard = locks
        .acquire(key, Duration::from_secs(120))
        .await
        .map_err(|e| e.to_string())?;
    println!(
        "held {}",
        guard
            .fencing_token()
            .map_or_else(|| "-".to_owned(), |t| t.to_string())
    );
    std::io::stdout().flush().map_err(|e| e.to_string())?;
    guard.lost_token().cancelled().await;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
    println!("lost {now}");
    std::io::stdout().flush().map_err(|e| e.to_string())?;
    std::future::pending::<()>().await;
    drop(guard);
    Ok(())
}
