//! The ledger service: `cargo run -p webapp`, then see the README for `curl` lines.

use dlock::CancellationToken;
use tracing_subscriber::EnvFilter;
use webapp::{AppState, Config};

#[tokio::main]
async fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    match run().await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(message) => {
            tracing::error!("{message}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run() -> Result<(), String> {
    let config = Config::from_env()?;
    // Before the lock provider, so that dlock's instruments are made on this meter provider;
    // dropped last, which exports what is left.
    let telemetry = webapp::telemetry::Telemetry::init()?;
    tracing::info!(to = %telemetry.destination, "metrics export");
    let shutdown = CancellationToken::new();
    let state = AppState::connect(&config, &shutdown).await?;
    let listener = tokio::net::TcpListener::bind(config.addr)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", config.addr))?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    tracing::info!(%addr, backend = state.locks.backend_name(), "ledger service listening");
    // The one line on stdout, for scripts and tests that start the service on port 0.
    println!("listening on http://{addr}");

    tokio::spawn({
        let shutdown = shutdown.clone();
        async move {
            wait_for_signal().await;
            tracing::info!("shutting down: pending lock waits are canceled");
            shutdown.cancel();
        }
    });
    webapp::serve(listener, state, shutdown)
        .await
        .map_err(|e| format!("server error: {e}"))?;
    tracing::info!("stopped");
    Ok(())
}

async fn wait_for_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = ctrl_c => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = ctrl_c.await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}
