//! Mistakes a newcomer makes with the layer, and how loudly they are answered: a handler that
//! locks the key its layer holds, the layer added with `Router::layer` instead of
//! `Router::route_layer`, a template that names no parameter of its route, and extractor
//! rejections in plain text. Requests go through the router as a tower service, in the test's
//! task, so that a `tracing` subscriber set for the test sees what the layer logs.

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::{Path, State};
use axum::routing::{get, post};
use dlock::{LockError, LockProvider, distributed_lock};
use dlock_axum::{LockLayer, LockRejection, LockedRouter, Problem};
use http::{Request, StatusCode};
use serde_json::Value;
use tower::ServiceExt;

/// A provider on a lock file of its own.
async fn provider() -> (tempfile::TempDir, LockProvider) {
    let dir = tempfile::tempdir().expect("temp dir");
    let url = format!("sqlite://{}/locks.db", dir.path().display());
    let locks = LockProvider::connect(&url).await.expect("open lock file");
    (dir, locks)
}

/// What the router answered.
#[derive(Debug)]
struct Answer {
    status: StatusCode,
    content_type: String,
    body: String,
}

impl Answer {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body)
            .unwrap_or_else(|err| panic!("not JSON ({err}): {:?}", self.body))
    }

    fn is_problem(&self) -> bool {
        self.content_type == "application/problem+json"
    }
}

async fn call(app: &Router, method: &str, path: &str) -> Answer {
    let request = Request::builder()
        .method(method)
        .uri(path)
        .body(Body::empty())
        .expect("request");
    let response = app.clone().oneshot(request).await.expect("infallible");
    let status = response.status();
    let content_type = response
        .headers()
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    let body = axum::body::to_bytes(response.into_body(), 1 << 20)
        .await
        .expect("body");
    Answer {
        status,
        content_type,
        body: String::from_utf8_lossy(&body).into_owned(),
    }
}

/// A `tracing` subscriber for this thread that keeps what is logged.
#[derive(Clone, Default)]
struct Logs(Arc<Mutex<Vec<u8>>>);

impl Logs {
    fn install(&self) -> tracing::subscriber::DefaultGuard {
        let logs = self.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || logs.clone())
            .with_ansi(false)
            .finish();
        tracing::subscriber::set_default(subscriber)
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().expect("logs")).into_owned()
    }
}

impl Write for Logs {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().expect("logs").extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The credit of an account, locked by its own attribute on the key the debit's layer holds.
#[distributed_lock("account:{id}", timeout = 5, provider = locks)]
async fn credit(locks: &LockProvider, id: u64) -> Result<String, LockError> {
    Ok(format!("credited {id}"))
}

/// A handler behind the layer on `account:{id}` that calls a `#[distributed_lock]` function
/// on the same key is told at once that this request holds it, not after the function's
/// 5 s timeout as a 408 "held by another request".
#[tokio::test(flavor = "current_thread")]
async fn a_handler_locking_its_layers_key_again_is_told_at_once() {
    let (_dir, locks) = provider().await;
    async fn refund(
        State(locks): State<LockProvider>,
        Path(id): Path<u64>,
    ) -> Result<String, LockRejection> {
        Ok(credit(&locks, id).await?)
    }
    let app = Router::new()
        .route("/accounts/{id}/refund", post(refund))
        .route_layer(
            LockLayer::with_extractor(locks.clone(), |Path(id): Path<u64>| format!("account:{id}"))
                .timeout(Duration::from_secs(5)),
        )
        .with_state(locks.clone());
    let started = Instant::now();
    let answer = call(&app, "POST", "/accounts/42/refund").await;
    let took = started.elapsed();
    assert_eq!(
        answer.status,
        StatusCode::INTERNAL_SERVER_ERROR,
        "{answer:?}"
    );
    assert!(answer.is_problem(), "{answer:?}");
    let body = answer.json();
    assert_eq!(body["code"], "DistributedLock.Reentrant", "{body}");
    assert!(
        body["detail"]
            .as_str()
            .is_some_and(|d| d.contains("already held by this request (locks are not reentrant)")),
        "{body}"
    );
    // Not the function's 5 s wait (a bound far above any one SQLite try).
    assert!(took < Duration::from_secs(4), "answered after {took:?}");
    // The key is free once the request is done: nothing was left held.
    let again = locks.try_acquire("account:42").await.expect("free again");
    again.release().await.expect("release");
}

/// The same for a handler that locks by hand, and for read locks: a reader behind a read
/// layer may read the key again (readers share it), a writer may not.
#[tokio::test(flavor = "current_thread")]
async fn by_hand_and_read_locks_follow_the_same_rule() {
    let (_dir, locks) = provider().await;
    async fn by_hand(
        State(locks): State<LockProvider>,
        Path(id): Path<u64>,
    ) -> Result<&'static str, LockRejection> {
        let guard = locks
            .acquire(&format!("account:{id}"), Duration::from_secs(5))
            .await?;
        guard.release().await?;
        Ok("done")
    }
    async fn read_again(
        State(locks): State<LockProvider>,
        Path(id): Path<u64>,
    ) -> Result<&'static str, LockRejection> {
        let guard = locks
            .acquire_read(&format!("account:{id}"), Duration::from_secs(5))
            .await?;
        guard.release().await?;
        Ok("read")
    }
    let key = |Path(id): Path<u64>| format!("account:{id}");
    let app = Router::new()
        .route("/write/{id}", post(by_hand))
        .route_layer(LockLayer::with_extractor(locks.clone(), key))
        .merge(
            Router::new()
                .route("/write-in-read/{id}", post(by_hand))
                .route("/read-in-read/{id}", post(read_again))
                .route_layer(LockLayer::with_extractor(locks.clone(), key).read()),
        )
        .with_state(locks.clone());
    for path in ["/write/7", "/write-in-read/7"] {
        let answer = call(&app, "POST", path).await;
        assert_eq!(
            answer.json()["code"],
            "DistributedLock.Reentrant",
            "{path}: {answer:?}"
        );
    }
    let answer = call(&app, "POST", "/read-in-read/7").await;
    assert_eq!(answer.status, StatusCode::OK, "{answer:?}");
}

/// `Router::layer` instead of `Router::route_layer`: the layer also wraps `/health` and the
/// requests that match no route, where its `Path<u64>` extractor cannot run. Those are
/// answered with the configuration problem (not axum's plain-text 500), and the log says to
/// use `route_layer`.
#[tokio::test(flavor = "current_thread")]
async fn layer_instead_of_route_layer_is_answered_and_logged_with_the_fix() {
    let (_dir, locks) = provider().await;
    let logs = Logs::default();
    let _subscriber = logs.install();
    async fn debit(Path(id): Path<u64>) -> String {
        format!("debited {id}")
    }
    let app = Router::new()
        .route("/accounts/{id}/debit", post(debit))
        .route("/health", get(|| async { "ok" }))
        .layer(LockLayer::with_extractor(locks, |Path(id): Path<u64>| {
            format!("account:{id}")
        }));
    // The locked route itself works.
    let answer = call(&app, "POST", "/accounts/42/debit").await;
    assert_eq!(answer.status, StatusCode::OK, "{answer:?}");
    for path in ["/health", "/no/such/route"] {
        let answer = call(&app, "GET", path).await;
        assert_eq!(
            answer.status,
            StatusCode::INTERNAL_SERVER_ERROR,
            "{path}: {answer:?}"
        );
        assert!(answer.is_problem(), "{path}: {answer:?}");
        assert_eq!(
            answer.json()["code"],
            "DistributedLock.Configuration",
            "{path}: {answer:?}"
        );
    }
    let logged = logs.text();
    assert!(
        logged.contains("Router::route_layer") && logged.contains("/health"),
        "the log does not say what to do: {logged}"
    );
}

/// A template placeholder the route does not have: found when the router is built by
/// `locked_route`, and named (with the fix) in the log by a layer added by hand.
#[tokio::test(flavor = "current_thread")]
async fn templates_are_checked_against_their_route() {
    let (_dir, locks) = provider().await;
    async fn debit() -> &'static str {
        "debited"
    }
    // Right: built.
    let app: Router = Router::new().locked_route(
        "/accounts/{account_id}/debit",
        post(debit),
        LockLayer::new(locks.clone(), "account:{account_id}"),
    );
    assert_eq!(
        call(&app, "POST", "/accounts/9/debit").await.status,
        StatusCode::OK
    );
    // Wrong: refused when the router is built, naming both.
    let built = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _: Router = Router::new().locked_route(
            "/accounts/{id}/debit",
            post(debit),
            LockLayer::new(locks.clone(), "account:{account_id}"),
        );
    }));
    let message = built
        .expect_err("a template naming no parameter of its route is refused")
        .downcast::<String>()
        .map(|m| *m)
        .unwrap_or_default();
    assert!(
        message.contains("`account_id`") && message.contains("`/accounts/{id}/debit`"),
        "{message}"
    );
    // By hand: every request answers the configuration problem, and the log says why.
    let logs = Logs::default();
    let _subscriber = logs.install();
    let app: Router = Router::new()
        .route("/accounts/{id}/debit", post(debit))
        .route_layer(LockLayer::new(locks, "account:{account_id}"));
    let answer = call(&app, "POST", "/accounts/9/debit").await;
    assert_eq!(answer.json()["code"], "DistributedLock.Configuration");
    let logged = logs.text();
    assert!(
        logged.contains("`account_id`") && logged.contains("locked_route"),
        "{logged}"
    );
}

/// A key extractor wrapped in `Problem` answers a malformed path as problem details, as the
/// layer answers everything else; unwrapped, it answers as the extractor does.
#[tokio::test(flavor = "current_thread")]
async fn extractor_rejections_can_be_problems() {
    let (_dir, locks) = provider().await;
    async fn pay(Problem(Path(order)): Problem<Path<u64>>) -> String {
        format!("paid {order}")
    }
    let app: Router = Router::new()
        .route("/orders/{order}/pay", post(pay))
        .route_layer(LockLayer::with_extractor(
            locks.clone(),
            |Problem(Path(order)): Problem<Path<u64>>| format!("order:{order}"),
        ))
        .merge(
            Router::new()
                .route("/plain/{order}/pay", post(pay))
                .route_layer(LockLayer::with_extractor(
                    locks,
                    |Path(order): Path<u64>| format!("order:{order}"),
                )),
        );
    let answer = call(&app, "POST", "/orders/abc/pay").await;
    assert_eq!(answer.status, StatusCode::BAD_REQUEST, "{answer:?}");
    assert!(answer.is_problem(), "{answer:?}");
    let body = answer.json();
    assert_eq!(body["status"], 400);
    assert_eq!(body["instance"], "/orders/abc/pay");
    assert!(
        body["detail"]
            .as_str()
            .is_some_and(|d| d.contains("Cannot parse")),
        "{body}"
    );
    let answer = call(&app, "POST", "/orders/12/pay").await;
    assert_eq!(
        (answer.status, answer.body.as_str()),
        (StatusCode::OK, "paid 12")
    );
    // Without the wrapper: axum's own answer, as the handler would give it.
    let answer = call(&app, "POST", "/plain/abc/pay").await;
    assert_eq!(answer.status, StatusCode::BAD_REQUEST);
    assert!(!answer.is_problem(), "{answer:?}");
}
