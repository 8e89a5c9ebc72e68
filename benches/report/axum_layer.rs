//! Section 6: requests/s through `dlock_axum::LockLayer` against the same route taking the
//! lock by hand in its handler. SQLite store, a distinct key per request, the server in
//! process on loopback, load from an in-process client with fixed concurrency.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::Path;
use axum::http::StatusCode;
use axum::routing::post;
use dlock::LockProvider;
use tokio::runtime::Runtime;

use crate::measure::{Contender, interleave, median, sized};
use crate::output::{Report, Row, Target};

pub const SECTION: &str = "6. axum layer, requests/s (layer / by hand)";

/// Client tasks; interleaved rounds; the length of a round.
fn concurrency() -> usize {
    sized(16, 4)
}
fn rounds() -> usize {
    sized(6, 2)
}
fn round() -> Duration {
    sized(Duration::from_millis(700), Duration::from_millis(100))
}

/// Runs a round of load on `path` with [`concurrency`] clients; requests per second.
async fn load(
    client: &reqwest::Client,
    base: &str,
    path: &str,
    next: &AtomicU64,
) -> Result<f64, String> {
    let deadline = Instant::now() + round();
    let started = Instant::now();
    let done = Arc::new(AtomicU64::new(0));
    let tasks: Vec<_> = (0..concurrency())
        .map(|_| {
            let (client, done) = (client.clone(), done.clone());
            let prefix = format!("{base}/{path}");
            let first = next.fetch_add(1_000_000, Ordering::Relaxed);
            tokio::spawn(async move {
                let mut id = first;
                while Instant::now() < deadline {
                    id += 1;
                    let response = client
                        .post(format!("{prefix}/{id}"))
                        .send()
                        .await
                        .map_err(|e| e.to_string())?;
                    if !response.status().is_success() {
                        return Err(format!("status {}", response.status()));
                    }
                    response.bytes().await.map_err(|e| e.to_string())?;
                    done.fetch_add(1, Ordering::Relaxed);
                }
                Ok::<(), String>(())
            })
        })
        .collect();
    for t in tasks {
        t.await.map_err(|e| e.to_string())??;
    }
    Ok(done.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64())
}

pub fn run(rt: &Runtime, report: &mut Report) {
    let name = "LockLayer on a route / the same route locking by hand (SQLite)";
    match measure(rt) {
        Ok((layer, manual)) => report.add(Row::rate_ratio(
            SECTION,
            name,
            format!(
                "{:.2}× (layer {layer:.0} req/s / by hand {manual:.0} req/s)",
                layer / manual
            ),
            layer / manual,
            Target::AtLeast(0.95),
        )),
        Err(e) => report.add(Row::not_measured(SECTION, name, &e, "≥ 0.95×")),
    }
}

fn measure(rt: &Runtime) -> Result<(f64, f64), String> {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let url = format!("sqlite://{}/axum.db", dir.path().display());
    let locks = rt
        .block_on(LockProvider::connect(&url))
        .map_err(|e| e.to_string())?;
    let router = Router::new()
        .route("/layer/{id}", post(|| async { "ok" }))
        .route_layer(dlock_axum::LockLayer::new(locks.clone(), "req:{id}"));
    let router = router.merge(app_manual(locks));
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .map_err(|e| e.to_string())?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    let server = rt.spawn(async move { axum::serve(listener, router).await });
    let base = format!("http://{addr}");
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(concurrency())
        .build()
        .map_err(|e| e.to_string())?;
    let next = AtomicU64::new(0);
    // Rates become times per request, so that the shared interleaving applies.
    let batch = |path: &'static str| {
        let (client, base, next) = (&client, &base, &next);
        move |n: u64| {
            rt.block_on(load(client, base, path, next))
                .map(|rate| Duration::from_secs_f64(n as f64 / rate))
        }
    };
    let mut layer = batch("layer");
    let mut manual = batch("manual");
    let results = interleave(
        &mut [
            Contender::new("layer", &mut layer),
            Contender::new("by hand", &mut manual),
        ],
        rounds(),
        round(),
    );
    server.abort();
    let mut rates = results.into_iter().map(|r| r.map(|v| 1e9 / median(&v)));
    let layer = rates.next().expect("layer")?;
    let manual = rates.next().expect("manual")?;
    Ok((layer, manual))
}

fn app_manual(locks: LockProvider) -> Router {
    Router::new().route(
        "/manual/{id}",
        post(move |Path(id): Path<u64>| {
            let locks = locks.clone();
            async move {
                let guard = locks
                    .try_acquire(&format!("req:{id}"))
                    .await
                    .map_err(|_| StatusCode::CONFLICT)?;
                guard
                    .release()
                    .await
                    .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
                Ok::<_, StatusCode>("ok")
            }
        }),
    )
}
