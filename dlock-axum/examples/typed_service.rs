//! A typed axum service: orders whose ids are `u64`s, paid behind `LockLayer` (the key made from
//! the handler's own `Path<u64>`, so `/orders/7/pay` and `/orders/007/pay` lock one key), and
//! refunded by a `#[distributed_lock]` handler on the same key.
//!
//! `cargo run -p dlock-axum --example typed_service`, then
//! `curl -X POST localhost:3000/orders/7/pay` and `curl -X POST localhost:3000/orders/7/refund`
//! (`/orders/abc/pay` answers a 400 problem). On another store:
//! `DLOCK_URL=redis://127.0.0.1:6379 cargo run -p dlock-axum --features dlock/redis --example
//! typed_service` (or `dlock/postgres`, `dlock/mysql`, `dlock/etcd` with their URLs).

use std::time::Duration;

use axum::extract::{Path, State};
use axum::routing::post;
use axum::{Router, middleware};
use dlock::{LockProvider, distributed_lock};
use dlock_axum::{HeldLock, LockLayer, LockRejection, Problem};

/// Behind the layer: the lock is held while this runs, and `lock` tells which.
async fn pay(Problem(Path(order)): Problem<Path<u64>>, lock: HeldLock) -> String {
    // Write with the fencing token, so that the store refuses a late write of a lost lock.
    format!(
        "paid order {order} under {} with token {:?}\n",
        lock.key(),
        lock.fencing_token()
    )
}

/// The same key, taken by the macro from the same parsed value; a lock that cannot be taken
/// within 5 s is answered as a problem (408, 409, ...) through `LockRejection`.
#[distributed_lock("order:{order}", timeout = "5s", provider = locks, guard = lock)]
async fn refund(
    State(locks): State<LockProvider>,
    Problem(Path(order)): Problem<Path<u64>>,
) -> Result<String, LockRejection> {
    Ok(format!(
        "refunded order {order} with token {:?}\n",
        lock.fencing_token()
    ))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Set-up mistakes (a layer on the wrong routes) are explained in this log only.
    tracing_subscriber::fmt::init();
    let url = std::env::var("DLOCK_URL").unwrap_or_else(|_| "sqlite://locks.db".to_owned());
    let locks = LockProvider::connect(&url).await?;
    let app = Router::new()
        .route("/orders/{order}/pay", post(pay))
        .route_layer(
            LockLayer::with_extractor(locks.clone(), |Problem(Path(order)): Problem<Path<u64>>| {
                format!("order:{order}")
            })
            .timeout(Duration::from_secs(5)),
        )
        // Added after `route_layer`: not behind the layer; it locks by itself.
        .route("/orders/{order}/refund", post(refund))
        // Problems returned by handlers get the request's path as `instance`.
        .layer(middleware::from_fn(dlock_axum::problem_instance))
        .with_state(locks);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
    println!("listening on http://{}", listener.local_addr()?);
    axum::serve(listener, app).await?;
    Ok(())
}
