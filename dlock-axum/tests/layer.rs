//! The layer over real HTTP: servers on loopback ports, a real client, a SQLite lock file
//! shared with a second provider that plays "another replica".

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::Path;
use axum::routing::{get, post};
use dlock::sqlite::SqliteBackend;
use dlock::{Backoff, CancellationToken, LockError, LockProvider};
use dlock_axum::{HeldLock, LockLayer, LockRejection, OnLost};
use http::request::Parts;
use serde_json::{Value, json};
use tokio::io::AsyncWriteExt;
use tokio::sync::Notify;

/// A lock file and providers on it.
struct Store {
    dir: tempfile::TempDir,
}

impl Store {
    fn new() -> Store {
        Store {
            dir: tempfile::tempdir().expect("temp dir"),
        }
    }

    fn path(&self) -> std::path::PathBuf {
        self.dir.path().join("locks.db")
    }

    /// Takes `key` from another provider (another replica) and keeps it until the guard
    /// is released.
    async fn hold(&self, key: &str) -> dlock::LockGuard {
        self.provider().await.try_acquire(key).await.expect("hold")
    }

    /// A provider that polls quickly, as another replica would.
    async fn provider(&self) -> LockProvider {
        let backend = SqliteBackend::builder(self.path())
            .lease(Duration::from_millis(900))
            .open()
            .await
            .expect("open lock file");
        LockProvider::builder(backend)
            .backoff(
                Backoff::new(Duration::from_millis(1), Duration::from_millis(5), 0.5)
                    .expect("backoff"),
            )
            .build()
    }
}

struct Server {
    base: String,
    _task: tokio::task::JoinHandle<()>,
}

async fn serve(app: Router) -> Server {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let task = tokio::spawn(async move {
        axum::serve(listener, app).await.expect("serve");
    });
    Server {
        base: format!("http://{addr}"),
        _task: task,
    }
}

struct Answer {
    status: u16,
    content_type: Option<String>,
    retry_after: Option<String>,
    body: Value,
}

async fn post_to(url: &str) -> Answer {
    let response = reqwest::Client::new()
        .post(url)
        .send()
        .await
        .expect("request");
    let header = |name: &str| {
        response
            .headers()
            .get(name)
            .map(|v| v.to_str().expect("ascii header").to_owned())
    };
    let content_type = header("content-type");
    let retry_after = header("retry-after");
    let status = response.status().as_u16();
    let text = response.text().await.expect("body");
    let body = serde_json::from_str(&text).unwrap_or(Value::String(text));
    Answer {
        status,
        content_type,
        retry_after,
        body,
    }
}

fn problem(
    slug: &str,
    status: u16,
    title: &str,
    detail: &str,
    instance: &str,
    code: &str,
) -> Value {
    json!({
        "type": format!("/problems/distributed-lock/{slug}"),
        "status": status,
        "title": title,
        "detail": detail,
        "instance": instance,
        "code": code,
    })
}

/// Why the layer refuses the key made from a 10 KB path parameter.
const KEY_OF_10248_BYTES: &str =
    "the lock key would be 10248 bytes long, more than the 1024 this route accepts";

/// The 400 problem of a key the layer refuses for `reason`.
fn invalid_key(reason: &str, instance: &str) -> Value {
    problem(
        "invalid-key",
        400,
        "Invalid Lock Key",
        &format!("This request does not name a usable lock: {reason}."),
        instance,
        "DistributedLock.InvalidKey",
    )
}

fn assert_problem(answer: &Answer, expected: Value, retry_after: Option<&str>) {
    assert_eq!(answer.body, expected);
    assert_eq!(
        Some(answer.status),
        expected["status"].as_u64().map(|s| s as u16)
    );
    assert_eq!(
        answer.content_type.as_deref(),
        Some("application/problem+json")
    );
    assert_eq!(answer.retry_after.as_deref(), retry_after);
}

/// A route on `/accounts/{account_id}/debit` that counts its calls.
fn counting_app(layer: LockLayer) -> (Router, Arc<AtomicUsize>) {
    let calls = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&calls);
    let app = Router::new()
        .route(
            "/accounts/{account_id}/debit",
            post(move |Path(id): Path<String>| {
                let counter = Arc::clone(&counter);
                async move {
                    counter.fetch_add(1, Ordering::SeqCst);
                    format!("debited {id}")
                }
            }),
        )
        .route_layer(layer);
    (app, calls)
}

/// The status of a POST to `url` while another replica holds `key`.
async fn status_while_held(store: &Store, key: &str, url: &str) -> u16 {
    let held = store.hold(key).await;
    let status = post_to(url).await.status;
    held.release().await.expect("release");
    status
}

async fn eventually(what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !condition() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contention_is_a_409_problem_and_the_handler_is_not_called() {
    let store = Store::new();
    let (app, calls) = counting_app(LockLayer::new(
        store.provider().await,
        "account:{account_id}",
    ));
    let server = serve(app).await;
    let other = store.provider().await;

    let held = other.try_acquire("account:42").await.expect("hold");
    let answer = post_to(&format!("{}/accounts/42/debit", server.base)).await;
    assert_problem(
        &answer,
        problem(
            "already-held",
            409,
            "Lock Already Held",
            "Another request holds the lock this request needs; retry later.",
            "/accounts/42/debit",
            "DistributedLock.AlreadyHeld",
        ),
        Some("1"),
    );
    assert_eq!(calls.load(Ordering::SeqCst), 0);

    held.release().await.expect("release");
    let answer = post_to(&format!("{}/accounts/42/debit", server.base)).await;
    assert_eq!((answer.status, answer.body), (200, json!("debited 42")));
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_that_runs_out_is_a_408_problem() {
    let store = Store::new();
    let layer = LockLayer::new(store.provider().await, "account:{account_id}")
        .timeout(Duration::from_millis(150))
        .retry_after(Duration::from_millis(2500));
    let (app, calls) = counting_app(layer);
    let server = serve(app).await;
    let _held = store.hold("account:7").await;

    let started = Instant::now();
    let answer = post_to(&format!("{}/accounts/7/debit", server.base)).await;
    assert!(started.elapsed() >= Duration::from_millis(150));
    assert_problem(
        &answer,
        problem(
            "timeout",
            408,
            "Lock Acquisition Timeout",
            "The lock this request needs stayed held by another request for the whole 150 ms \
             the server waits; retry later.",
            "/accounts/7/debit",
            "DistributedLock.Timeout",
        ),
        Some("3"),
    );
    assert_eq!(calls.load(Ordering::SeqCst), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_lost_mid_handler_drops_the_handler_and_answers_500() {
    let store = Store::new();
    let started = Arc::new(Notify::new());
    let dropped = Arc::new(AtomicUsize::new(0));
    struct OnDrop(Arc<AtomicUsize>);
    impl Drop for OnDrop {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }
    let (s, d) = (Arc::clone(&started), Arc::clone(&dropped));
    let app = Router::new()
        .route(
            "/jobs/{name}",
            post(move || {
                let (s, d) = (Arc::clone(&s), Arc::clone(&d));
                async move {
                    let _on_drop = OnDrop(d);
                    s.notify_one();
                    std::future::pending::<()>().await;
                    "never"
                }
            }),
        )
        .route_layer(LockLayer::new(store.provider().await, "job:{name}"));
    let server = serve(app).await;

    let request =
        tokio::spawn(async move { post_to(&format!("{}/jobs/nightly", server.base)).await });
    started.notified().await;
    // Another owner takes the row over, as if the lease had run out and been taken.
    let conn = rusqlite::Connection::open(store.path()).expect("open");
    let changed = conn
        .execute(
            "UPDATE __distributed_locks SET owner = X'00' WHERE name = ?1",
            [b"job:nightly".as_slice()],
        )
        .expect("steal row");
    assert_eq!(changed, 1);

    let answer = request.await.expect("request task");
    assert_problem(
        &answer,
        problem(
            "lost",
            500,
            "Distributed Lock Lost",
            "The lock protecting this request was lost before the response was ready; the \
             request may have been carried out partly, or alongside another one.",
            "/jobs/nightly",
            "DistributedLock.Lost",
        ),
        None,
    );
    assert_eq!(
        dropped.load(Ordering::SeqCst),
        1,
        "the handler future was dropped"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancellation_ends_waits_with_499() {
    let store = Store::new();
    let shutdown = CancellationToken::new();
    let layer = LockLayer::new(store.provider().await, "account:{account_id}")
        .timeout(Duration::from_secs(60))
        .max_waiting(8)
        .cancel_on(&shutdown);
    let (app, calls) = counting_app(layer.clone());
    let server = serve(app).await;
    let _held = store.hold("account:9").await;

    let url = format!("{}/accounts/9/debit", server.base);
    let waiting = tokio::spawn(async move { post_to(&url).await });
    eventually("the request waits", || layer.waiting() == 1).await;
    shutdown.cancel();
    let answer = waiting.await.expect("request task");
    assert_problem(
        &answer,
        problem(
            "canceled",
            499,
            "Lock Acquisition Canceled",
            "The server stopped waiting for the lock this request needs (it is shutting down); \
             retry later.",
            "/accounts/9/debit",
            "DistributedLock.Canceled",
        ),
        None,
    );
    assert_eq!(calls.load(Ordering::SeqCst), 0);
    assert_eq!(layer.waiting(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn beyond_the_waiter_limit_requests_get_503() {
    let store = Store::new();
    let layer = LockLayer::new(store.provider().await, "account:{account_id}")
        .timeout(Duration::from_secs(60))
        .max_waiting(2);
    let (app, calls) = counting_app(layer.clone());
    let server = serve(app).await;
    let held = store.hold("account:5").await;

    let url = format!("{}/accounts/5/debit", server.base);
    let waiters: Vec<_> = (0..2)
        .map(|_| {
            let url = url.clone();
            tokio::spawn(async move { post_to(&url).await })
        })
        .collect();
    eventually("two requests wait", || layer.waiting() == 2).await;

    let answer = post_to(&url).await;
    assert_problem(
        &answer,
        problem(
            "too-many-waiters",
            503,
            "Too Many Lock Waiters",
            "Too many requests are already waiting for locks here; retry later.",
            "/accounts/5/debit",
            "DistributedLock.TooManyWaiters",
        ),
        Some("1"),
    );
    // A request over the limit whose lock is free is still served.
    let free = post_to(&format!("{}/accounts/6/debit", server.base)).await;
    assert_eq!(free.status, 200);

    held.release().await.expect("release");
    for waiter in waiters {
        assert_eq!(waiter.await.expect("task").status, 200);
    }
    assert_eq!(calls.load(Ordering::SeqCst), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_keys_are_400_and_long_path_parameters_are_bounded() {
    let store = Store::new();
    let (app, calls) = counting_app(LockLayer::new(
        store.provider().await,
        "account:{account_id}",
    ));
    let server = serve(app).await;

    let long = "x".repeat(10 * 1024);
    let answer = post_to(&format!("{}/accounts/{long}/debit", server.base)).await;
    assert_problem(
        &answer,
        invalid_key(KEY_OF_10248_BYTES, &format!("/accounts/{long}/debit")),
        None,
    );
    // Up to the limit is fine: "account:" is 8 bytes.
    let fits = "y".repeat(1024 - 8);
    let answer = post_to(&format!("{}/accounts/{fits}/debit", server.base)).await;
    assert_eq!(answer.status, 200);
    assert_eq!(calls.load(Ordering::SeqCst), 1);

    // A key function that makes an empty key.
    let app = Router::new()
        .route("/x", post(|| async { "ran" }))
        .route_layer(LockLayer::with_key_fn(
            store.provider().await,
            |_: &Parts| Some(String::new()),
        ));
    let server = serve(app).await;
    let answer = post_to(&format!("{}/x", server.base)).await;
    assert_eq!(answer.status, 400);
    assert_eq!(answer.body["code"], "DistributedLock.InvalidKey");
    assert_eq!(answer.body["instance"], "/x");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn path_values_are_encoded_as_the_macro_encodes_them() {
    let store = Store::new();
    let (app, _calls) = counting_app(LockLayer::new(
        store.provider().await,
        "account:{account_id}",
    ));
    let server = serve(app).await;
    let other = store.provider().await;

    // `a%3Ab` in the URL is the value `a:b`, locked as `account:a%3Ab`.
    let encoded = other.try_acquire("account:a%3Ab").await.expect("hold");
    let answer = post_to(&format!("{}/accounts/a%3Ab/debit", server.base)).await;
    assert_eq!(answer.status, 409);
    encoded.release().await.expect("release");

    let raw = other.try_acquire("account:a:b").await.expect("hold");
    let answer = post_to(&format!("{}/accounts/a%3Ab/debit", server.base)).await;
    assert_eq!((answer.status, answer.body), (200, json!("debited a:b")));
    raw.release().await.expect("release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lock_is_held_while_the_handler_runs_and_free_when_the_response_arrives() {
    let store = Store::new();
    let other = store.provider().await;
    let probe = other.clone();
    let app = Router::new()
        .route(
            "/accounts/{account_id}/debit",
            post(move || {
                let probe = probe.clone();
                async move {
                    match probe.try_acquire("account:1").await {
                        Err(LockError::AlreadyHeld { .. }) => "held",
                        Ok(_) => "free",
                        Err(_) => "error",
                    }
                }
            }),
        )
        .route_layer(LockLayer::new(
            store.provider().await,
            "account:{account_id}",
        ));
    let server = serve(app).await;

    for _ in 0..3 {
        let answer = post_to(&format!("{}/accounts/1/debit", server.base)).await;
        assert_eq!((answer.status, answer.body), (200, json!("held")));
        // Released before the response was sent.
        let guard = other
            .try_acquire("account:1")
            .await
            .expect("free after the response");
        guard.release().await.expect("release");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_disconnects_frees_the_lock_promptly() {
    let store = Store::new();
    let started = Arc::new(Notify::new());
    let s = Arc::clone(&started);
    let app = Router::new()
        .route(
            "/accounts/{account_id}/debit",
            post(move || {
                let s = Arc::clone(&s);
                async move {
                    s.notify_one();
                    std::future::pending::<()>().await;
                    "never"
                }
            }),
        )
        .route_layer(LockLayer::new(
            store.provider().await,
            "account:{account_id}",
        ));
    let server = serve(app).await;
    let other = store.provider().await;

    let addr = server.base.trim_start_matches("http://");
    let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    stream
        .write_all(b"POST /accounts/3/debit HTTP/1.1\r\nhost: test\r\ncontent-length: 0\r\n\r\n")
        .await
        .expect("write");
    started.notified().await;
    assert!(matches!(
        other.try_acquire("account:3").await,
        Err(LockError::AlreadyHeld { .. })
    ));

    drop(stream);
    let guard = other
        .acquire("account:3", Duration::from_millis(100))
        .await
        .expect("the lock is free within 100 ms of the disconnect");
    guard.release().await.expect("release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routes_without_the_layer_are_untouched() {
    let store = Store::new();
    let app = Router::new()
        .route("/locked/{id}", post(|| async { "locked route" }))
        .route_layer(LockLayer::new(store.provider().await, "item:{id}"))
        .route("/open/{id}", post(|| async { "open route" }))
        .route("/get/{id}", get(|| async { "get route" }));
    let server = serve(app).await;
    let _held = store.hold("item:1").await;

    assert_eq!(
        post_to(&format!("{}/locked/1", server.base)).await.status,
        409
    );
    let open = post_to(&format!("{}/open/1", server.base)).await;
    assert_eq!((open.status, open.body), (200, json!("open route")));
    assert_eq!(
        open.content_type.as_deref(),
        Some("text/plain; charset=utf-8")
    );
    assert_eq!(open.retry_after, None);
    let got = reqwest::get(format!("{}/get/1", server.base))
        .await
        .expect("get");
    assert_eq!(got.status(), 200);
    let missing = post_to(&format!("{}/nowhere", server.base)).await;
    assert_eq!(missing.status, 404);

    // A key function that answers `None` lets the request through without a lock.
    let app = Router::new()
        .route("/tenants", post(|| async { "ran" }))
        .route_layer(LockLayer::with_key_fn(
            store.provider().await,
            |parts: &Parts| {
                let tenant = parts.headers.get("x-tenant")?.to_str().ok()?;
                Some(format!("item:{tenant}"))
            },
        ));
    let server = serve(app).await;
    let client = reqwest::Client::new();
    let url = format!("{}/tenants", server.base);
    let with = client
        .post(&url)
        .header("x-tenant", "1")
        .send()
        .await
        .expect("send");
    assert_eq!(with.status(), 409);
    let without = client.post(&url).send().await.expect("send");
    assert_eq!(without.status(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handlers_return_lock_rejections_and_failures_do_not_leak() {
    let store = Store::new();
    let locks = store.provider().await;
    let app =
        Router::new()
            .route(
                "/close",
                post(move || {
                    let locks = locks.clone();
                    async move {
                        let guard = locks.try_acquire("books:close").await?;
                        guard.release().await?;
                        Ok::<_, LockRejection>("closed")
                    }
                }),
            )
            .route(
                "/down",
                post(|| async {
                    let source: dlock::BoxError =
                        "connect to postgres://ledger:s3cret@db.internal:5432 failed".into();
                    Err::<(), _>(LockRejection::from(LockError::unavailable(
                    "postgres",
                    "SELECT pg_try_advisory_lock($1) on postgres://ledger:s3cret@db.internal",
                    Some(source),
                ))
                .with_instance("/down"))
                }),
            );
    let server = serve(app).await;

    let held = store.hold("books:close").await;
    let answer = post_to(&format!("{}/close", server.base)).await;
    assert_eq!(answer.status, 409);
    assert_eq!(answer.body["code"], "DistributedLock.AlreadyHeld");
    assert_eq!(answer.body["title"], "Lock Already Held");
    assert_eq!(answer.retry_after.as_deref(), Some("1"));
    held.release().await.expect("release");
    assert_eq!(post_to(&format!("{}/close", server.base)).await.status, 200);

    let answer = post_to(&format!("{}/down", server.base)).await;
    assert_problem(
        &answer,
        problem(
            "unavailable",
            503,
            "Lock Store Unavailable",
            "The lock store cannot be reached right now; retry later.",
            "/down",
            "DistributedLock.Unavailable",
        ),
        Some("1"),
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn layer_mistakes_are_500_problems_that_do_not_show_the_configuration() {
    let store = Store::new();
    // A placeholder that names no path parameter of the route.
    let app = Router::new()
        .route("/orders/{order_id}", post(|| async { "ran" }))
        .route_layer(LockLayer::new(store.provider().await, "order:{id}"));
    let server = serve(app).await;
    let answer = post_to(&format!("{}/orders/1", server.base)).await;
    assert_problem(
        &answer,
        problem(
            "configuration",
            500,
            "Lock Configuration Error",
            "The server's distributed locking is misconfigured.",
            "/orders/1",
            "DistributedLock.Configuration",
        ),
        None,
    );

    // With `Router::layer` instead of `route_layer`, matched routes are locked the same, but
    // requests that match no route reach the layer without path parameters: a loud 500, not
    // a silently unlocked request.
    let app = Router::new()
        .route("/orders/{id}", post(|| async { "ran" }))
        .layer(LockLayer::new(store.provider().await, "order:{id}"));
    let server = serve(app).await;
    let held = store.hold("order:1").await;
    assert_eq!(
        post_to(&format!("{}/orders/1", server.base)).await.status,
        409
    );
    held.release().await.expect("release");
    let answer = post_to(&format!("{}/elsewhere", server.base)).await;
    assert_eq!(answer.status, 500);
    assert_eq!(answer.body["code"], "DistributedLock.Configuration");

    // A template without placeholders locks one key for every request of the route.
    let app = Router::new()
        .route("/jobs/run", post(|| async { "ran" }))
        .route_layer(LockLayer::new(store.provider().await, "jobs:run"));
    let server = serve(app).await;
    let held = store.hold("jobs:run").await;
    assert_eq!(
        post_to(&format!("{}/jobs/run", server.base)).await.status,
        409
    );
    held.release().await.expect("release");
    assert_eq!(
        post_to(&format!("{}/jobs/run", server.base)).await.status,
        200
    );
}

#[test]
fn bad_templates_are_reported_at_construction() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let store = Store::new();
    let locks = runtime.block_on(store.provider());
    let err = LockLayer::try_new(locks.clone(), "account:{id").expect_err("unclosed");
    assert!(err.to_string().contains("not closed"), "{err}");
    let panic = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        LockLayer::new(locks, "account:}")
    }))
    .expect_err("panics");
    let message = panic.downcast_ref::<String>().expect("message");
    assert!(message.contains("invalid lock key template"), "{message}");
}

/// 1,000 requests at once on one key: one handler at a time, every other request answered
/// promptly (200 after its turn, 408 when its wait ran out, 503 beyond the waiter limit),
/// another key served meanwhile, and the key free at the end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_concurrent_requests_on_one_key() {
    const REQUESTS: usize = 1_000;
    const TIMEOUT: Duration = Duration::from_millis(500);
    let store = Store::new();
    let provider = store.provider().await;
    let layer = LockLayer::new(provider, "item:{id}")
        .timeout(TIMEOUT)
        .max_waiting(200);
    let inside = Arc::new(AtomicUsize::new(0));
    let most_inside = Arc::new(AtomicUsize::new(0));
    let longest_in_layer = Arc::new(AtomicU64::new(0));
    let (now_inside, most) = (Arc::clone(&inside), Arc::clone(&most_inside));
    let app = Router::new()
        .route(
            "/items/{id}",
            post(move |Path(id): Path<String>| {
                let (inside, most) = (Arc::clone(&now_inside), Arc::clone(&most));
                async move {
                    // Only the hot key's handlers are counted; another key runs beside them.
                    let hot = id == "hot";
                    if hot {
                        let now = inside.fetch_add(1, Ordering::SeqCst) + 1;
                        most.fetch_max(now, Ordering::SeqCst);
                    }
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    if hot {
                        inside.fetch_sub(1, Ordering::SeqCst);
                    }
                    id
                }
            }),
        )
        .route_layer(layer)
        // Around the lock layer and the handler: how long each request spent there, from its
        // routing to its response (the lock's wait, the handler's turn, or a refusal).
        .layer(axum::middleware::from_fn({
            let longest = Arc::clone(&longest_in_layer);
            move |request: axum::extract::Request, next: axum::middleware::Next| {
                let longest = Arc::clone(&longest);
                async move {
                    let started = Instant::now();
                    let response = next.run(request).await;
                    let took = u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX);
                    longest.fetch_max(took, Ordering::SeqCst);
                    response
                }
            }
        }));
    let server = serve(app).await;
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .expect("client");

    let url = format!("{}/items/hot", server.base);
    let started = Instant::now();
    let storm: Vec<_> = (0..REQUESTS)
        .map(|_| {
            let (client, url) = (client.clone(), url.clone());
            tokio::spawn(async move {
                let sent = Instant::now();
                let status = client
                    .post(&url)
                    .send()
                    .await
                    .expect("request")
                    .status()
                    .as_u16();
                (status, sent.elapsed())
            })
        })
        .collect();

    // Another key is served while the storm runs.
    let other = Instant::now();
    let answer = post_to(&format!("{}/items/cold", server.base)).await;
    assert_eq!(answer.status, 200);
    let other = other.elapsed();

    let mut counts = std::collections::BTreeMap::new();
    let mut slowest = Duration::ZERO;
    for request in storm {
        let (status, took) = request.await.expect("task");
        *counts.entry(status).or_insert(0usize) += 1;
        slowest = slowest.max(took);
    }
    let longest_in_layer = Duration::from_micros(longest_in_layer.load(Ordering::SeqCst));
    eprintln!(
        "{REQUESTS} requests in {:?}: {counts:?}; slowest answer {slowest:?} (longest in the \
         layer {longest_in_layer:?}); other key {other:?}",
        started.elapsed()
    );
    assert_eq!(
        most_inside.load(Ordering::SeqCst),
        1,
        "one holder at a time"
    );
    assert_eq!(counts.values().sum::<usize>(), REQUESTS);
    assert!(
        counts.keys().all(|s| [200, 408, 503].contains(s)),
        "only 200, 408 and 503: {counts:?}"
    );
    assert!(counts.get(&200).copied().unwrap_or(0) >= 1, "{counts:?}");
    // Every request is answered within the layer's timeout: a wait that runs out is a 408, one
    // served in its turn is a 200 (a wait of at most the timeout and a 2 ms handler), one beyond
    // the waiter limit a 503 at once. Bound: 3 × the timeout, the margin (2 × the timeout, 1 s)
    // for the scheduler of 2 worker threads polling 1,000 tasks late. The client's own time
    // (`slowest`) also counts setting up 1,000 connections at once, so it is only reported.
    assert!(
        longest_in_layer <= 3 * TIMEOUT,
        "a request spent {longest_in_layer:?} in the layer, whose timeout is {TIMEOUT:?}"
    );
    assert!(
        other < Duration::from_secs(5),
        "another key waited {other:?}"
    );
    let free = store.provider().await;
    free.try_acquire("item:hot")
        .await
        .expect("the key is free after the storm")
        .release()
        .await
        .expect("release");
}

/// With the problem_instance middleware, a lock problem returned by a handler through `?`
/// carries the request path (never the query); other responses pass through untouched, and
/// without the middleware the problem simply has no instance.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn problem_instance_fills_in_the_path_of_handler_problems() {
    let store = Store::new();
    let locks = store.provider().await;
    let routes = |locks: LockProvider| {
        Router::new()
            .route(
                "/books/{year}/close",
                post(move || {
                    let locks = locks.clone();
                    async move {
                        let guard = locks.try_acquire("books:close").await?;
                        guard.release().await?;
                        Ok::<_, LockRejection>("closed")
                    }
                }),
            )
            .route(
                "/plain",
                post(|| async { (http::StatusCode::CONFLICT, "not a problem") }),
            )
    };
    let with =
        serve(routes(locks.clone()).layer(axum::middleware::from_fn(dlock_axum::problem_instance)))
            .await;
    let without = serve(routes(locks)).await;
    let held = store.hold("books:close").await;

    let answer = post_to(&format!("{}/books/2026/close?token=secret", with.base)).await;
    assert_problem(
        &answer,
        problem(
            "already-held",
            409,
            "Lock Already Held",
            "Another request holds the lock this request needs; retry later.",
            "/books/2026/close",
            "DistributedLock.AlreadyHeld",
        ),
        Some("1"),
    );
    let answer = post_to(&format!("{}/books/2026/close", without.base)).await;
    assert_eq!(answer.status, 409);
    assert!(answer.body.get("instance").is_none(), "{}", answer.body);

    let plain = post_to(&format!("{}/plain", with.base)).await;
    assert_eq!(plain.status, 409);
    assert_eq!(plain.body, Value::String("not a problem".to_owned()));
    held.release().await.expect("release");
}

// Typed keys: the key must come from the value the handler acts on.

/// Spellings of account 42 that a `Path<u64>` handler accepts: leading zeros, a sign, and
/// percent-encoded forms of both (the router decodes `%2B` to `+` and `%34%32` to `42`).
const SPELLINGS_OF_42: [&str; 6] = ["42", "042", "0042", "+42", "%2B042", "%34%32"];

/// How long a debit stays in its critical section unless another one comes in.
const SECTION: Duration = Duration::from_millis(400);

struct SpellingRun {
    /// The most debits of account 42 that were inside their critical section at once.
    most_inside: usize,
    took: Duration,
}

/// Debits account 42 once per spelling, all at once, through `layer` on a `Path<u64>` handler
/// that stays in its critical section for `SECTION` and counts who else is in. The requests
/// pass a barrier outside the layer together, so they all contend for the lock at once.
async fn debit_every_spelling_at_once<K: dlock_axum::MakeLockKey>(
    strategy: &str,
    layer: LockLayer<K>,
) -> SpellingRun {
    let inside = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let ids = Arc::new(std::sync::Mutex::new(Vec::new()));
    let barrier = Arc::new(tokio::sync::Barrier::new(SPELLINGS_OF_42.len()));
    let (now_inside, most_seen, seen_ids) =
        (Arc::clone(&inside), Arc::clone(&most), Arc::clone(&ids));
    let app = Router::new()
        .route(
            "/acct/{id}/debit",
            post(move |Path(id): Path<u64>| {
                let (inside, most, ids) = (
                    Arc::clone(&now_inside),
                    Arc::clone(&most_seen),
                    Arc::clone(&seen_ids),
                );
                async move {
                    let now = inside.fetch_add(1, Ordering::SeqCst) + 1;
                    most.fetch_max(now, Ordering::SeqCst);
                    // The debit's work: long enough for the others to come in if they can.
                    tokio::time::sleep(SECTION).await;
                    inside.fetch_sub(1, Ordering::SeqCst);
                    ids.lock().expect("ids").push(id);
                    id.to_string()
                }
            }),
        )
        .route_layer(layer)
        .layer(axum::middleware::from_fn(
            move |request: axum::extract::Request, next: axum::middleware::Next| {
                let barrier = Arc::clone(&barrier);
                async move {
                    barrier.wait().await;
                    next.run(request).await
                }
            },
        ));
    let server = serve(app).await;
    let started = Instant::now();
    let requests: Vec<_> = SPELLINGS_OF_42
        .iter()
        .map(|spelling| {
            let url = format!("{}/acct/{spelling}/debit", server.base);
            tokio::spawn(async move { post_to(&url).await.status })
        })
        .collect();
    let mut statuses = Vec::new();
    for request in requests {
        statuses.push(request.await.expect("request task"));
    }
    let run = SpellingRun {
        most_inside: most.load(Ordering::SeqCst),
        took: started.elapsed(),
    };
    eprintln!(
        "{strategy}: {} debits of account 42 in {:?}, at most {} at once",
        SPELLINGS_OF_42.len(),
        run.took,
        run.most_inside
    );
    assert_eq!(statuses, vec![200; SPELLINGS_OF_42.len()]);
    let ids = ids.lock().expect("ids").clone();
    assert_eq!(
        ids,
        vec![42; SPELLINGS_OF_42.len()],
        "every spelling is account 42 to the handler"
    );
    run
}

/// `/acct/42`, `/acct/042`, `/acct/+42`, ... are one account to a `Path<u64>` handler; with the
/// key made from the handler's extractor they are one lock, and the debits run one at a time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn extractor_keys_serialize_every_spelling_of_one_account() {
    let store = Store::new();
    let layer = LockLayer::with_extractor(store.provider().await, |Path(id): Path<u64>| {
        format!("acct:{id}")
    })
    .timeout(Duration::from_secs(60));
    let run = debit_every_spelling_at_once("with_extractor", layer).await;
    assert_eq!(run.most_inside, 1, "debits of account 42 ran at once");
    // One after the other, each for its whole section.
    let serial = SECTION * u32::try_from(SPELLINGS_OF_42.len()).expect("count");
    assert!(run.took >= serial, "{:?} < {serial:?}", run.took);
    assert!(
        run.took < serial + Duration::from_secs(20),
        "{:?}",
        run.took
    );
}

/// The documented limit of the text template: it locks the (percent-decoded) text of the path,
/// so the spellings of account 42 take different locks and their debits run at the same time.
/// This is why typed parameters need `with_extractor`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_text_template_locks_each_spelling_of_a_typed_value_apart() {
    let store = Store::new();
    let layer =
        LockLayer::new(store.provider().await, "acct:{id}").timeout(Duration::from_secs(60));
    let run = debit_every_spelling_at_once("template", layer).await;
    assert!(
        run.most_inside >= 2,
        "the spellings did not overlap under the template (at most {} at once)",
        run.most_inside
    );
}

/// Which keys each strategy takes for spellings of one typed value, against a lock held
/// elsewhere: the extractor and `#[distributed_lock]` on the handler's `u64` lock
/// `acct:42` for every spelling; the template locks the text (`acct:042` for `/042`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn extractor_and_macro_keys_agree_and_the_template_locks_text() {
    #[dlock::distributed_lock("acct:{id}", provider = locks)]
    async fn macro_debit(
        axum::extract::State(locks): axum::extract::State<LockProvider>,
        Path(id): Path<u64>,
    ) -> Result<String, LockRejection> {
        Ok(format!("macro {id}"))
    }

    let store = Store::new();
    let locks = store.provider().await;
    let handler = |Path(id): Path<u64>| async move { id.to_string() };
    // One router per route: `route_layer` applies to every route added before it.
    let app = Router::new()
        .merge(
            Router::new()
                .route("/extractor/{id}", post(handler))
                .route_layer(LockLayer::with_extractor(
                    locks.clone(),
                    |Path(id): Path<u64>| format!("acct:{id}"),
                )),
        )
        .merge(
            Router::new()
                .route("/template/{id}", post(handler))
                .route_layer(LockLayer::new(locks.clone(), "acct:{id}")),
        )
        .route("/macro/{id}", post(macro_debit))
        .with_state(locks);
    let server = serve(app).await;
    let status = |path: String| {
        let url = format!("{}{path}", server.base);
        async move { post_to(&url).await.status }
    };

    let canonical = store.hold("acct:42").await;
    for spelling in SPELLINGS_OF_42 {
        assert_eq!(
            status(format!("/extractor/{spelling}")).await,
            409,
            "{spelling}"
        );
        assert_eq!(
            status(format!("/macro/{spelling}")).await,
            409,
            "{spelling}"
        );
    }
    // The template sees `acct:42` only where the decoded text is `42`.
    for (spelling, expected) in [("42", 409), ("%34%32", 409), ("042", 200), ("+42", 200)] {
        assert_eq!(
            status(format!("/template/{spelling}")).await,
            expected,
            "{spelling}"
        );
    }
    canonical.release().await.expect("release");

    let text = store.hold("acct:042").await;
    assert_eq!(status("/template/042".to_owned()).await, 409);
    assert_eq!(status("/extractor/042".to_owned()).await, 200);
    assert_eq!(status("/macro/042".to_owned()).await, 200);
    text.release().await.expect("release");
}

/// An extractor that fails answers what the handler would answer for the same extractor, and
/// the layer takes no lock for it (here every lock attempt would be a 499: the layer's
/// cancellation token is already cancelled).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rejecting_extractor_answers_as_the_handler_would_and_takes_no_lock() {
    #[derive(serde::Deserialize)]
    struct Memo {
        #[allow(dead_code)]
        memo: String,
    }
    async fn debit(Path(id): Path<u64>, Query(_): Query<Memo>) -> String {
        id.to_string()
    }
    use axum::extract::Query;

    let store = Store::new();
    let cancelled = CancellationToken::new();
    cancelled.cancel();
    let layer = LockLayer::with_extractor(
        store.provider().await,
        |(Path(id), Query(_)): (Path<u64>, Query<Memo>)| format!("acct:{id}"),
    )
    .timeout(Duration::from_secs(5))
    .cancel_on(&cancelled);
    let app = Router::new()
        .route("/locked/{id}", post(debit))
        .route_layer(layer)
        .route("/bare/{id}", post(debit));
    let server = serve(app).await;

    // Extraction succeeds: the layer goes on to lock, and the cancelled token answers.
    let answer = post_to(&format!("{}/locked/42?memo=x", server.base)).await;
    assert_eq!(answer.status, 499, "{}", answer.body);
    assert_eq!(answer.body["code"], "DistributedLock.Canceled");

    for request in [
        "abc?memo=x",                  // not a number
        "99999999999999999999?memo=x", // beyond u64
        "-1?memo=x",                   // a sign u64 does not take
        "42",                          // the tuple's second extractor fails
    ] {
        let locked = post_to(&format!("{}/locked/{request}", server.base)).await;
        let bare = post_to(&format!("{}/bare/{request}", server.base)).await;
        assert!(
            (400..500).contains(&bare.status) && bare.status != 499,
            "{request}: the bare handler answered {}",
            bare.status
        );
        assert_eq!(
            (
                locked.status,
                &locked.content_type,
                &locked.retry_after,
                &locked.body
            ),
            (
                bare.status,
                &bare.content_type,
                &bare.retry_after,
                &bare.body
            ),
            "{request}"
        );
    }
}

/// Keys from an extractor go through the same checks as the template's: an empty key and an
/// over-long key are the same 400 problems, before the store is asked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn extractor_keys_are_checked_like_template_keys() {
    use dlock::key_template::encode_component;
    let store = Store::new();
    let locks = store.provider().await;
    // One router per route: `route_layer` applies to every route added before it.
    let app = Router::new()
        .merge(
            Router::new()
                .route("/template/{account_id}/debit", post(|| async { "ran" }))
                .route_layer(LockLayer::new(locks.clone(), "account:{account_id}")),
        )
        .merge(
            Router::new()
                .route("/extractor/{account_id}/debit", post(|| async { "ran" }))
                .route_layer(LockLayer::with_extractor(
                    locks.clone(),
                    |Path(id): Path<String>| format!("account:{}", encode_component(&id)),
                )),
        )
        .merge(
            Router::new()
                .route("/empty/{id}", post(|| async { "ran" }))
                .route_layer(LockLayer::with_extractor(locks, |Path(_): Path<u64>| {
                    String::new()
                })),
        );
    let server = serve(app).await;

    let long = "x".repeat(10 * 1024);
    let template = post_to(&format!("{}/template/{long}/debit", server.base)).await;
    let extractor = post_to(&format!("{}/extractor/{long}/debit", server.base)).await;
    assert_problem(
        &template,
        invalid_key(KEY_OF_10248_BYTES, &format!("/template/{long}/debit")),
        None,
    );
    assert_problem(
        &extractor,
        invalid_key(KEY_OF_10248_BYTES, &format!("/extractor/{long}/debit")),
        None,
    );

    // Encoded as the template encodes: `a%3Ab` in the URL is `a:b`, locked as `account:a%3Ab`
    // by both.
    let held = store.hold("account:a%3Ab").await;
    for route in ["template", "extractor"] {
        let answer = post_to(&format!("{}/{route}/a%3Ab/debit", server.base)).await;
        assert_eq!(answer.status, 409, "{route}");
    }
    held.release().await.expect("release");

    let answer = post_to(&format!("{}/empty/7", server.base)).await;
    assert_problem(
        &answer,
        invalid_key(
            "the key is empty; a lock key must be a non-empty string such as \"jobs:billing\"",
            "/empty/7",
        ),
        None,
    );
}

/// The key extractor runs on a copy of the request head: an extractor that takes something
/// out of the request (as `WebSocketUpgrade` takes the connection upgrade) leaves the handler
/// its request whole: extensions, path parameters, headers and body.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_handler_gets_the_request_whole() {
    use axum::extract::{Extension, FromRequestParts, MatchedPath};

    #[derive(Clone)]
    struct Ticket(&'static str);

    /// Takes the ticket out of the request's extensions.
    struct TakeTicket(&'static str);
    impl<S: Send + Sync> FromRequestParts<S> for TakeTicket {
        type Rejection = (http::StatusCode, &'static str);
        async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
            match parts.extensions.remove::<Ticket>() {
                Some(Ticket(name)) => Ok(TakeTicket(name)),
                None => Err((http::StatusCode::IM_A_TEAPOT, "no ticket")),
            }
        }
    }

    let store = Store::new();
    let app = Router::new()
        .route(
            "/acct/{id}/debit",
            post(
                |Path(id): Path<u64>,
                 matched: MatchedPath,
                 Extension(Ticket(ticket)): Extension<Ticket>,
                 headers: http::HeaderMap,
                 body: String| async move {
                    let memo = headers.get("x-memo").and_then(|v| v.to_str().ok());
                    format!("{id} {} {ticket} {memo:?} {body}", matched.as_str())
                },
            ),
        )
        .route_layer(LockLayer::with_extractor(
            store.provider().await,
            |(TakeTicket(ticket), Path(id)): (TakeTicket, Path<u64>)| format!("{ticket}:{id}"),
        ))
        .layer(Extension(Ticket("t1")));
    let server = serve(app).await;

    let url = format!("{}/acct/007/debit", server.base);
    assert_eq!(status_while_held(&store, "t1:7", &url).await, 409);

    let response = reqwest::Client::new()
        .post(&url)
        .header("x-memo", "rent")
        .body("50 cents")
        .send()
        .await
        .expect("request");
    assert_eq!(response.status(), 200);
    assert_eq!(
        response.text().await.expect("body"),
        "7 /acct/{id}/debit t1 Some(\"rent\") 50 cents"
    );
}

/// Extractors that need the router state get it from `with_extractor_and_state`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn extractors_that_need_state_get_the_layers_state() {
    use axum::extract::State;

    #[derive(Clone)]
    struct AppState {
        region: &'static str,
    }

    let store = Store::new();
    let state = AppState { region: "eu" };
    let app = Router::new()
        .route(
            "/acct/{id}/debit",
            post(
                |State(s): State<AppState>, Path(id): Path<u64>| async move {
                    format!("{} {id}", s.region)
                },
            ),
        )
        .route_layer(LockLayer::with_extractor_and_state(
            store.provider().await,
            state.clone(),
            |(State(s), Path(id)): (State<AppState>, Path<u64>)| format!("{}:acct:{id}", s.region),
        ))
        .with_state(state);
    let server = serve(app).await;

    let url = format!("{}/acct/042/debit", server.base);
    assert_eq!(status_while_held(&store, "eu:acct:42", &url).await, 409);
    let answer = post_to(&url).await;
    assert_eq!((answer.status, answer.body), (200, json!("eu 42")));
}

/// Steals `key`'s row in the lock file, as another owner taking it over after its lease ran
/// out would: the holder's next renewal finds the lock gone.
fn steal_row(store: &Store, key: &str) {
    let conn = rusqlite::Connection::open(store.path()).expect("open");
    let changed = conn
        .execute(
            "UPDATE __distributed_locks SET owner = X'00' WHERE name = ?1",
            [key.as_bytes()],
        )
        .expect("steal row");
    assert_eq!(changed, 1, "the row of {key} is in the lock file");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_handler_gets_the_key_and_fencing_token_of_the_layers_lock() {
    let store = Store::new();
    let other = store.provider().await;
    let (seen_tx, mut seen_rx) = tokio::sync::mpsc::unbounded_channel();
    let go_on = Arc::new(Notify::new());
    let g = Arc::clone(&go_on);
    let app = Router::new()
        .route(
            "/accounts/{id}/debit",
            post(move |Path(id): Path<u64>, lock: HeldLock| {
                let (seen_tx, g) = (seen_tx.clone(), Arc::clone(&g));
                async move {
                    let _ = seen_tx.send((lock.key().to_owned(), lock.fencing_token()));
                    g.notified().await;
                    format!("debited {id} with {:?}", lock.fencing_token())
                }
            }),
        )
        .route_layer(LockLayer::with_extractor(
            store.provider().await,
            |Path(id): Path<u64>| format!("account:{id}"),
        ));
    let server = serve(app).await;

    let before = other.try_acquire("account:42").await.expect("before");
    let token_before = before
        .fencing_token()
        .expect("SQLite issues fencing tokens");
    before.release().await.expect("release");

    let url = format!("{}/accounts/042/debit", server.base);
    let request = tokio::spawn(async move { post_to(&url).await });
    let (key, token) = seen_rx.recv().await.expect("the handler ran");
    assert_eq!(key, "account:42");
    let token = token.expect("the handler sees the fencing token");
    // The handler runs under the lock its token belongs to.
    assert!(matches!(
        other.try_acquire("account:42").await,
        Err(LockError::AlreadyHeld { .. })
    ));
    go_on.notify_one();
    let answer = request.await.expect("request task");
    assert_eq!(
        (answer.status, answer.body),
        (200, json!(format!("debited 42 with Some({token})")))
    );

    let after = other.try_acquire("account:42").await.expect("after");
    let token_after = after.fencing_token().expect("token");
    after.release().await.expect("release");
    // The only acquisition between `before` and `after` is the layer's: the handler's token
    // is that one's.
    assert!(
        token_before < token && token < token_after,
        "{token_before} < {token} < {token_after}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_on_lost_continue_the_handler_sees_the_loss_and_answers_itself() {
    let store = Store::new();
    let started = Arc::new(Notify::new());
    let finished = Arc::new(AtomicUsize::new(0));
    let (s, f) = (Arc::clone(&started), Arc::clone(&finished));
    let app = Router::new()
        .route(
            "/jobs/{name}",
            post(move |lock: HeldLock| {
                let (s, f) = (Arc::clone(&s), Arc::clone(&f));
                async move {
                    assert!(!lock.is_lost());
                    s.notify_one();
                    // Until the lock is broken below; nothing else ends this wait.
                    lock.lost_token().cancelled().await;
                    f.fetch_add(1, Ordering::SeqCst);
                    (
                        http::StatusCode::CONFLICT,
                        axum::Json(json!({ "lost": lock.is_lost(), "key": lock.key() })),
                    )
                }
            }),
        )
        .route_layer(
            LockLayer::new(store.provider().await, "job:{name}").on_lost(OnLost::Continue),
        );
    let server = serve(app).await;

    let request =
        tokio::spawn(async move { post_to(&format!("{}/jobs/nightly", server.base)).await });
    started.notified().await;
    steal_row(&store, "job:nightly");

    let answer = request.await.expect("request task");
    // The handler's own answer, not the layer's 500.
    assert_eq!(
        (answer.status, answer.body),
        (409, json!({ "lost": true, "key": "job:nightly" }))
    );
    assert_eq!(
        finished.load(Ordering::SeqCst),
        1,
        "the handler ran to its end"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_on_lost_cancel_the_handler_reading_its_lock_is_dropped() {
    let store = Store::new();
    let started = Arc::new(Notify::new());
    let finished = Arc::new(AtomicUsize::new(0));
    let (s, f) = (Arc::clone(&started), Arc::clone(&finished));
    let app = Router::new()
        .route(
            "/jobs/{name}",
            post(move |lock: HeldLock| {
                let (s, f) = (Arc::clone(&s), Arc::clone(&f));
                async move {
                    s.notify_one();
                    lock.lost_token().cancelled().await;
                    // Never reached: the layer drops the handler first.
                    f.fetch_add(1, Ordering::SeqCst);
                    "finished"
                }
            }),
        )
        .route_layer(LockLayer::new(store.provider().await, "job:{name}").on_lost(OnLost::Cancel));
    let server = serve(app).await;

    let request =
        tokio::spawn(async move { post_to(&format!("{}/jobs/nightly", server.base)).await });
    started.notified().await;
    steal_row(&store, "job:nightly");

    let answer = request.await.expect("request task");
    assert_eq!(answer.status, 500);
    assert_eq!(answer.body["code"], json!("DistributedLock.Lost"));
    assert_eq!(finished.load(Ordering::SeqCst), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_lock_without_a_layer_is_a_500_problem_and_optional_where_asked() {
    let store = Store::new();
    let locked = Router::new()
        .route(
            "/maybe/{name}",
            post(|lock: Option<HeldLock>| async move {
                lock.map_or("none".to_owned(), |l| l.key().to_owned())
            }),
        )
        .route_layer(LockLayer::with_key_fn(
            store.provider().await,
            |parts: &Parts| {
                let name = parts.uri.path().strip_prefix("/maybe/")?;
                (name != "free").then(|| format!("maybe:{name}"))
            },
        ));
    let app = Router::new()
        .route(
            "/unlocked",
            post(|lock: HeldLock| async move { lock.key().to_owned() }),
        )
        .merge(locked);
    let server = serve(app).await;

    let answer = post_to(&format!("{}/unlocked", server.base)).await;
    assert_problem(
        &answer,
        problem(
            "no-lock-layer",
            500,
            "Lock Configuration Error",
            "The server's distributed locking is misconfigured.",
            "/unlocked",
            "DistributedLock.NoLockLayer",
        ),
        None,
    );

    let answer = post_to(&format!("{}/maybe/free", server.base)).await;
    assert_eq!((answer.status, answer.body), (200, json!("none")));
    let answer = post_to(&format!("{}/maybe/x", server.base)).await;
    assert_eq!((answer.status, answer.body), (200, json!("maybe:x")));
}

/// An app whose handler counts itself in `inside`, then stays until `go` turns true.
fn holding_app(
    layer: LockLayer,
    inside: Arc<AtomicUsize>,
    go: tokio::sync::watch::Receiver<bool>,
) -> Router {
    Router::new()
        .route(
            "/accounts/{account_id}/debit",
            post(move || {
                let (inside, mut go) = (Arc::clone(&inside), go.clone());
                async move {
                    inside.fetch_add(1, Ordering::SeqCst);
                    let released =
                        tokio::time::timeout(Duration::from_secs(20), go.wait_for(|go| *go)).await;
                    inside.fetch_sub(1, Ordering::SeqCst);
                    if released.is_ok() { "done" } else { "stalled" }
                }
            }),
        )
        .route_layer(layer)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_mode_lets_requests_share_a_key_and_excludes_writers() {
    let store = Store::new();
    let inside = Arc::new(AtomicUsize::new(0));
    let (go, wait) = tokio::sync::watch::channel(false);
    let layer = LockLayer::new(store.provider().await, "account:{account_id}")
        .read()
        .timeout(Duration::from_secs(10));
    let server = serve(holding_app(layer, Arc::clone(&inside), wait)).await;
    let url = format!("{}/accounts/9/debit", server.base);
    // Another replica's reader does not keep them out.
    let reader = store
        .provider()
        .await
        .try_acquire_read("account:9")
        .await
        .expect("read");
    let requests: Vec<_> = (0..3)
        .map(|_| {
            let url = url.clone();
            tokio::spawn(async move { post_to(&url).await })
        })
        .collect();
    eventually("three readers are in the handler together", || {
        inside.load(Ordering::SeqCst) == 3
    })
    .await;
    // A writer of the key is refused meanwhile.
    let writer = store.provider().await;
    assert!(matches!(
        writer.try_acquire("account:9").await,
        Err(LockError::AlreadyHeld { .. })
    ));
    go.send(true).expect("handlers wait");
    for request in requests {
        let answer = request.await.expect("request");
        assert_eq!((answer.status, answer.body), (200, json!("done")));
    }
    reader.release().await.expect("release");
    // And another replica's writer keeps the readers out (a layer without a timeout: 409).
    let trying = serve(holding_app(
        LockLayer::new(store.provider().await, "account:{account_id}").read(),
        Arc::new(AtomicUsize::new(0)),
        go.subscribe(),
    ))
    .await;
    let url = format!("{}/accounts/9/debit", trying.base);
    assert_eq!(status_while_held(&store, "account:9", &url).await, 409);
    assert_eq!(post_to(&url).await.status, 200);
    let free = writer
        .try_acquire("account:9")
        .await
        .expect("free once the readers left");
    free.release().await.expect("release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permits_mode_lets_n_requests_in_and_answers_the_next_with_409() {
    let store = Store::new();
    let inside = Arc::new(AtomicUsize::new(0));
    let (go, wait) = tokio::sync::watch::channel(false);
    let layer = LockLayer::new(store.provider().await, "account:{account_id}").permits(2);
    let server = serve(holding_app(layer, Arc::clone(&inside), wait)).await;
    let url = format!("{}/accounts/5/debit", server.base);
    let requests: Vec<_> = (0..2)
        .map(|_| {
            let url = url.clone();
            tokio::spawn(async move { post_to(&url).await })
        })
        .collect();
    eventually("both requests are in the handler", || {
        inside.load(Ordering::SeqCst) == 2
    })
    .await;
    // A third request of the key finds both slots held, and so does another replica.
    let third = post_to(&url).await;
    assert_eq!(third.status, 409);
    let other = store.provider().await;
    let full = other.try_acquire_semaphore("account:5", 2).await;
    assert!(
        matches!(full, Err(LockError::AlreadyHeld { .. })),
        "{full:?}"
    );
    go.send(true).expect("handlers wait");
    for request in requests {
        let answer = request.await.expect("request");
        assert_eq!((answer.status, answer.body), (200, json!("done")));
    }
    // Semaphore keys are their own namespace: an exclusive lock of the key does not block it.
    assert_eq!(status_while_held(&store, "account:5", &url).await, 200);
    let zero = serve(
        counting_app(LockLayer::new(store.provider().await, "account:{account_id}").permits(0)).0,
    )
    .await;
    assert_eq!(
        post_to(&format!("{}/accounts/5/debit", zero.base))
            .await
            .status,
        500
    );
}

/// The layer of the transfer routes: two account keys from the path.
type TransferLayer =
    LockLayer<dlock_axum::ExtractorKeys<fn(Path<(u64, u64)>) -> Vec<String>, Path<(u64, u64)>>>;

fn transfer_app(layer: TransferLayer) -> Router {
    Router::new()
        .route(
            "/transfers/{from}/{to}",
            post(|lock: HeldLock| async move {
                let keys: Vec<&str> = lock.keys().collect();
                let fenced = lock.fencing_tokens().all(|token| token.is_some());
                format!("{} {fenced}", keys.join(","))
            }),
        )
        .route_layer(layer)
}

fn transfer_keys(Path((from, to)): Path<(u64, u64)>) -> Vec<String> {
    vec![format!("account:{from}"), format!("account:{to}")]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_keys_are_taken_all_or_none_and_listed_for_the_handler() {
    let store = Store::new();
    let layer = LockLayer::with_extractor_many(
        store.provider().await,
        transfer_keys as fn(Path<(u64, u64)>) -> Vec<String>,
    );
    let server = serve(transfer_app(layer)).await;
    // Both keys, in canonical order whatever the direction.
    for (from, to) in [(1, 2), (2, 1)] {
        let answer = post_to(&format!("{}/transfers/{from}/{to}", server.base)).await;
        assert_eq!(
            (answer.status, answer.body),
            (200, json!("account:1,account:2 true"))
        );
    }
    // The same account twice is one key.
    let answer = post_to(&format!("{}/transfers/3/3", server.base)).await;
    assert_eq!((answer.status, answer.body), (200, json!("account:3 true")));
    // Another replica holds one of the two: 409, and the other key is not left held.
    let other = store.provider().await;
    let held = other.try_acquire("account:2").await.expect("hold");
    let answer = post_to(&format!("{}/transfers/1/2", server.base)).await;
    assert_eq!(answer.status, 409);
    other
        .try_acquire("account:1")
        .await
        .expect("the free key was not kept")
        .release()
        .await
        .expect("release");
    held.release().await.expect("release");
}

/// A multi-key route whose wait runs out answers 408, as a one-key route does: here the
/// timeout is shorter than any round trip, so it has passed once the free key is taken, and
/// the other key is held by another replica. Not 409: the client asked to wait, and did.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_multi_key_wait_that_runs_out_is_a_408_problem() {
    let store = Store::new();
    let layer = LockLayer::with_extractor_many(
        store.provider().await,
        transfer_keys as fn(Path<(u64, u64)>) -> Vec<String>,
    )
    .timeout(Duration::from_nanos(1));
    let server = serve(transfer_app(layer)).await;
    let held = store.hold("account:2").await;
    for (from, to) in [(1, 2), (2, 1)] {
        let answer = post_to(&format!("{}/transfers/{from}/{to}", server.base)).await;
        assert_eq!(answer.status, 408, "{:?}", answer.body);
        assert_eq!(answer.body["code"], json!("DistributedLock.Timeout"));
        assert!(answer.retry_after.is_some());
    }
    store
        .hold("account:1")
        .await
        .release()
        .await
        .expect("the free key was given back");
    held.release().await.expect("release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opposite_transfers_at_once_never_deadlock() {
    let store = Store::new();
    let layer = LockLayer::with_extractor_many(
        store.provider().await,
        transfer_keys as fn(Path<(u64, u64)>) -> Vec<String>,
    )
    .timeout(Duration::from_secs(30));
    let server = serve(transfer_app(layer)).await;
    let requests: Vec<_> = (0..40)
        .map(|n| {
            let url = if n % 2 == 0 {
                format!("{}/transfers/7/8", server.base)
            } else {
                format!("{}/transfers/8/7", server.base)
            };
            tokio::spawn(async move { post_to(&url).await.status })
        })
        .collect();
    for request in requests {
        assert_eq!(request.await.expect("request"), 200);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_keys_in_read_or_permits_mode_are_a_configuration_problem() {
    let store = Store::new();
    for layer in [
        LockLayer::with_extractor_many(
            store.provider().await,
            transfer_keys as fn(Path<(u64, u64)>) -> Vec<String>,
        )
        .permits(2),
        LockLayer::with_extractor_many(
            store.provider().await,
            transfer_keys as fn(Path<(u64, u64)>) -> Vec<String>,
        )
        .read(),
    ] {
        let server = serve(transfer_app(layer)).await;
        let answer = post_to(&format!("{}/transfers/1/2", server.base)).await;
        assert_eq!(answer.status, 500);
        assert_eq!(answer.body["code"], json!("DistributedLock.Configuration"));
    }
}
