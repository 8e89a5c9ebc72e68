//! The ledger service as users run it: real `webapp` processes on loopback ports, sharing a
//! lock store and a balance file, driven by a real HTTP client.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use dlock::LockProvider;
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

/// A running `webapp` process, killed when dropped.
struct Instance {
    base: String,
    child: Child,
}

/// A temp dir with the balance file, and the lock store the instances share: a SQLite file
/// (a PostgreSQL or Redis URL works the same once those backends are built).
struct Setup {
    dir: tempfile::TempDir,
    lock_url: String,
}

impl Setup {
    fn new() -> Setup {
        let dir = tempfile::tempdir().expect("temp dir");
        let lock_url = format!("sqlite://{}", dir.path().join("locks.db").display());
        Setup { dir, lock_url }
    }

    /// Locks on another store; balances still in a file of the temp dir.
    #[cfg(any(feature = "postgres", feature = "redis"))]
    fn with_lock_url(lock_url: String) -> Setup {
        Setup {
            dir: tempfile::tempdir().expect("temp dir"),
            lock_url,
        }
    }

    fn lock_url(&self) -> String {
        self.lock_url.clone()
    }

    fn ledger(&self) -> PathBuf {
        self.dir.path().join("ledger.db")
    }

    /// Another replica's view of the lock store.
    async fn provider(&self) -> LockProvider {
        LockProvider::connect(&self.lock_url())
            .await
            .expect("lock store")
    }

    async fn start(&self, env: &[(&str, &str)]) -> Instance {
        start(&self.lock_url(), &self.ledger(), env).await
    }
}

async fn start(lock_url: &str, ledger: &Path, env: &[(&str, &str)]) -> Instance {
    start_with(lock_url, ledger, env, Stdio::inherit()).await
}

/// Starts an instance whose stderr (its log) goes to `stderr`.
async fn start_with(
    lock_url: &str,
    ledger: &Path,
    env: &[(&str, &str)],
    stderr: Stdio,
) -> Instance {
    let mut command = Command::new(env!("CARGO_BIN_EXE_webapp"));
    command
        .env("DLOCK_URL", lock_url)
        .env("LEDGER_DB", ledger)
        .env("PORT", "0")
        .env("LOCK_TIMEOUT", "60s")
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(stderr)
        .kill_on_drop(true);
    for (name, value) in env {
        command.env(name, value);
    }
    let mut child = command.spawn().expect("spawn webapp");
    let stdout = child.stdout.take().expect("stdout");
    let mut lines = BufReader::new(stdout).lines();
    let line = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
        .await
        .expect("webapp starts within 30 s")
        .expect("read stdout")
        .expect("webapp printed its address");
    let base = line
        .strip_prefix("listening on ")
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .to_owned();
    Instance { base, child }
}

impl Instance {
    fn pid(&self) -> u32 {
        self.child.id().expect("running")
    }
}

async fn post_json(client: &reqwest::Client, url: &str, body: Value) -> (u16, Value) {
    let response = client.post(url).json(&body).send().await.expect("request");
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
}

async fn balance(client: &reqwest::Client, instance: &Instance, id: &str) -> i64 {
    let body: Value = client
        .get(format!("{}/accounts/{id}", instance.base))
        .send()
        .await
        .expect("request")
        .json()
        .await
        .expect("json");
    body["balance"].as_i64().expect("balance")
}

struct Outcome {
    failures: Vec<(u16, Value)>,
    balance: i64,
    mismatches: usize,
}

/// Credits 1000, then sends 200 debits of 1 at once, alternating between two instances.
async fn two_hundred_concurrent_debits(setup: &Setup, env: &[(&str, &str)]) -> Outcome {
    let a = setup.start(env).await;
    let b = setup.start(env).await;
    let client = reqwest::Client::new();
    let (status, _) = post_json(
        &client,
        &format!("{}/accounts/acc-1/credit", a.base),
        json!({"amount": 1000}),
    )
    .await;
    assert_eq!(status, 200);

    let debits = (0..200).map(|i| {
        let base = if i % 2 == 0 { &a.base } else { &b.base };
        let url = format!("{base}/accounts/acc-1/debit");
        let client = client.clone();
        async move { post_json(&client, &url, json!({"amount": 1})).await }
    });
    let results = futures::future::join_all(debits).await;
    let failures = results.into_iter().filter(|(s, _)| *s != 200).collect();
    let balance = balance(&client, &b, "acc-1").await;
    let (status, report) =
        post_json(&client, &format!("{}/jobs/reconcile", a.base), json!({})).await;
    assert_eq!(status, 200, "{report}");
    Outcome {
        failures,
        balance,
        mismatches: report["mismatches"].as_array().map_or(0, Vec::len),
    }
}

/// Every debit answered 200, the balance is exact and reconcile finds nothing.
fn assert_no_debit_lost(outcome: Outcome) {
    assert_eq!(outcome.failures, Vec::<(u16, Value)>::new());
    assert_eq!(outcome.balance, 1000 - 200);
    assert_eq!(outcome.mismatches, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_lose_no_debit() {
    let setup = Setup::new();
    assert_no_debit_lost(two_hundred_concurrent_debits(&setup, &[]).await);
}

// The same 200 debits with the locks on a throwaway PostgreSQL or Redis server.
#[cfg(feature = "postgres")]
use dlock_testkit::postgres as pg_server;
#[cfg(feature = "redis")]
use dlock_testkit::redis as redis_server;

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_lose_no_debit_with_postgres_locks() {
    let server = pg_server::PgServer::start();
    let setup = Setup::with_lock_url(server.url(""));
    assert_no_debit_lost(two_hundred_concurrent_debits(&setup, &[]).await);
}

/// The lock store goes away: debits get a 503 problem promptly (nothing is debited), and once
/// the server is back the same instance serves them again.
#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_lock_store_is_a_503_problem_and_the_service_recovers() {
    let mut server = pg_server::PgServer::start();
    let setup = Setup::with_lock_url(server.url("connect_timeout=2s&keepalive=500ms"));
    let app = setup.start(&[("LOCK_TIMEOUT", "3s")]).await;
    let client = reqwest::Client::new();
    let credit = format!("{}/accounts/acc-s/credit", app.base);
    let debit = format!("{}/accounts/acc-s/debit", app.base);
    assert_eq!(
        post_json(&client, &credit, json!({"amount": 10})).await.0,
        200
    );

    let health = format!("{}/health", app.base);
    assert_eq!(
        client.get(&health).send().await.expect("health").status(),
        200
    );

    server.stop();
    // The health check asks the store: a 503 problem while it is down.
    let answer = client.get(&health).send().await.expect("health");
    assert_eq!(answer.status(), 503);
    assert_eq!(answer.headers()["content-type"], "application/problem+json");
    let body: Value = answer.json().await.expect("json");
    assert_eq!(body["code"], "DistributedLock.Unavailable", "{body}");
    assert_eq!(body["instance"], "/health", "{body}");
    let started = Instant::now();
    let (status, body) = post_json(&client, &debit, json!({"amount": 1})).await;
    let took = started.elapsed();
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["code"], "DistributedLock.Unavailable", "{body}");
    assert_eq!(body["instance"], "/accounts/acc-s/debit", "{body}");
    assert!(took < Duration::from_secs(6), "the 503 took {took:?}");
    assert_eq!(
        balance(&client, &app, "acc-s").await,
        10,
        "nothing was debited"
    );

    server.resume();
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let (status, body) = post_json(&client, &debit, json!({"amount": 1})).await;
        if status == 200 {
            assert_eq!(body["balance"], 9);
            let healthy = client.get(&health).send().await.expect("health");
            assert_eq!(healthy.status(), 200, "the store is back");
            break;
        }
        assert_eq!(status, 503, "{body}");
        assert!(
            Instant::now() < deadline,
            "the service did not recover: {body}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_lose_no_debit_with_redis_locks() {
    let Some(server) = redis_server::RedisServer::start(redis_server::Flavor::Redis7) else {
        return;
    };
    let setup = Setup::with_lock_url(server.url(""));
    assert_no_debit_lost(two_hundred_concurrent_debits(&setup, &[]).await);
}

/// The same run with the layer removed: every debit answers 200, yet updates are lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_lock_layer_the_same_debits_lose_updates() {
    let setup = Setup::new();
    let outcome = two_hundred_concurrent_debits(&setup, &[("DEBIT_LOCK", "off")]).await;
    assert_eq!(outcome.failures, Vec::<(u16, Value)>::new());
    assert!(
        outcome.balance > 1000 - 200,
        "expected lost updates, got the exact balance {}",
        outcome.balance
    );
    assert_eq!(outcome.mismatches, 1, "reconcile finds the damaged account");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contention_answers_409_problems_on_every_locked_route() {
    let setup = Setup::new();
    let app = setup.start(&[("LOCK_TIMEOUT", "0")]).await;
    let client = reqwest::Client::new();
    let other = setup.provider().await;
    let credit = format!("{}/accounts/acc-2/credit", app.base);
    assert_eq!(
        post_json(&client, &credit, json!({"amount": 10})).await.0,
        200
    );

    let held = other
        .acquire("account:acc-2", Duration::from_secs(5))
        .await
        .expect("hold");
    let response = client
        .post(format!("{}/accounts/acc-2/debit", app.base))
        .json(&json!({"amount": 1}))
        .send()
        .await
        .expect("request");
    assert_eq!(response.status(), 409);
    assert_eq!(
        response.headers()["content-type"],
        "application/problem+json"
    );
    assert_eq!(response.headers()["retry-after"], "1");
    let body: Value = response.json().await.expect("json");
    assert_eq!(
        body,
        json!({
            "type": "/problems/distributed-lock/already-held",
            "status": 409,
            "title": "Lock Already Held",
            "detail": "Another request holds the lock this request needs; retry later.",
            "instance": "/accounts/acc-2/debit",
            "code": "DistributedLock.AlreadyHeld",
        })
    );
    // The credit handler takes the same lock through #[distributed_lock] (timeout 10 s):
    // it waits while the lock is held elsewhere and completes once it is released.
    let pending_credit = tokio::spawn({
        let (client, credit) = (client.clone(), credit.clone());
        async move { post_json(&client, &credit, json!({"amount": 1})).await }
    });
    // The instance's provider is acquiring the account's key (nothing else there holds or
    // wants a lock now): the credit waits for it.
    let health = format!("{}/health", app.base);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let body: Value = client
            .get(&health)
            .send()
            .await
            .expect("health")
            .json()
            .await
            .expect("json");
        if body["lock_keys"] == 1 {
            break;
        }
        assert!(
            !pending_credit.is_finished(),
            "the credit finished without waiting for the lock"
        );
        assert!(
            Instant::now() < deadline,
            "the credit never started waiting for the lock: {body}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(!pending_credit.is_finished(), "credit ran without the lock");
    // Reads are not locked.
    assert_eq!(balance(&client, &app, "acc-2").await, 10);
    held.release().await.expect("release");
    let (status, body) = pending_credit.await.expect("credit task");
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["balance"], 11);

    let job = other.try_acquire("jobs:reconcile").await.expect("hold");
    let (status, body) =
        post_json(&client, &format!("{}/jobs/reconcile", app.base), json!({})).await;
    assert_eq!(status, 409);
    assert_eq!(body["instance"], "/jobs/reconcile");
    job.release().await.expect("release");
    let (status, body) =
        post_json(&client, &format!("{}/jobs/reconcile", app.base), json!({})).await;
    assert_eq!(
        (status, body),
        (200, json!({"accounts": 1, "mismatches": []}))
    );

    let health: Value = client
        .get(format!("{}/health", app.base))
        .send()
        .await
        .expect("request")
        .json()
        .await
        .expect("json");
    assert_eq!(health["status"], "ok");
    assert_eq!(health["lock_backend"], "sqlite");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_cancels_waiting_requests_and_exits_cleanly() {
    let setup = Setup::new();
    let mut app = setup.start(&[]).await;
    let client = reqwest::Client::new();
    let credit = format!("{}/accounts/acc-3/credit", app.base);
    assert_eq!(
        post_json(&client, &credit, json!({"amount": 10})).await.0,
        200
    );

    let held = setup
        .provider()
        .await
        .acquire("account:acc-3", Duration::from_secs(5))
        .await
        .expect("hold");
    let url = format!("{}/accounts/acc-3/debit", app.base);
    let waiting = tokio::spawn({
        let client = client.clone();
        async move { post_json(&client, &url, json!({"amount": 1})).await }
    });
    let health = format!("{}/health", app.base);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let body: Value = client
            .get(&health)
            .send()
            .await
            .expect("health")
            .json()
            .await
            .expect("json");
        if body["waiting_debits"] == 1 {
            break;
        }
        assert!(Instant::now() < deadline, "the debit never started waiting");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }

    let status = std::process::Command::new("kill")
        .args(["-TERM", &app.pid().to_string()])
        .status()
        .expect("kill");
    assert!(status.success());
    let (status, body) = waiting.await.expect("request task");
    assert_eq!(status, 499, "{body}");
    assert_eq!(body["code"], "DistributedLock.Canceled");
    assert_eq!(body["title"], "Lock Acquisition Canceled");
    assert_eq!(body["instance"], "/accounts/acc-3/debit");
    let exit = tokio::time::timeout(Duration::from_secs(10), app.child.wait())
        .await
        .expect("the service exits after the signal")
        .expect("wait");
    assert!(exit.success(), "{exit:?}");
    held.release().await.expect("release");
}

/// A stand-in OTLP/HTTP collector: answers every request 200 and keeps (path, body).
async fn collector() -> (
    String,
    std::sync::Arc<std::sync::Mutex<Vec<(String, Vec<u8>)>>>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let store = std::sync::Arc::clone(&seen);
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            let store = std::sync::Arc::clone(&store);
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                loop {
                    // Headers, then as many body bytes as content-length says.
                    let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
                        match socket.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                        continue;
                    };
                    let head = String::from_utf8_lossy(&buf[..end]).to_string();
                    let length: usize = head
                        .lines()
                        .find_map(|l| {
                            let (name, value) = l.split_once(':')?;
                            name.eq_ignore_ascii_case("content-length")
                                .then(|| value.trim().parse().ok())?
                        })
                        .unwrap_or(0);
                    while buf.len() < end + 4 + length {
                        match socket.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    }
                    let path = head.split(' ').nth(1).unwrap_or("").to_owned();
                    let body = buf[end + 4..end + 4 + length].to_vec();
                    buf.drain(..end + 4 + length);
                    store.lock().unwrap().push((path, body));
                    let ok = b"HTTP/1.1 200 OK\r\ncontent-type: application/x-protobuf\r\ncontent-length: 0\r\n\r\n";
                    if socket.write_all(ok).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (url, seen)
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

/// With OTEL_EXPORTER_OTLP_ENDPOINT set, dlock's metrics reach the collector over OTLP/HTTP.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_go_to_the_otlp_endpoint() {
    let (endpoint, seen) = collector().await;
    let setup = Setup::new();
    let app = setup
        .start(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
            ("OTEL_METRIC_EXPORT_INTERVAL", "200"),
        ])
        .await;
    let client = reqwest::Client::new();
    let credit = format!("{}/accounts/acc-m/credit", app.base);
    assert_eq!(
        post_json(&client, &credit, json!({"amount": 5})).await.0,
        200
    );
    let exported = |name: &[u8]| {
        seen.lock().unwrap().iter().any(|(path, body)| {
            path == "/v1/metrics" && contains(body, name) && contains(body, b"acquired")
        })
    };
    // The hold is recorded once the release has run, after the response: it may come in a
    // later export than the acquisition.
    let deadline = Instant::now() + Duration::from_secs(20);
    while !(exported(b"distributed_lock.acquisitions")
        && exported(b"distributed_lock.hold_duration"))
    {
        assert!(
            Instant::now() < deadline,
            "no OTLP export of dlock's acquisition and hold metrics arrived"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Without a collector, the metrics are logged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_are_logged_without_a_collector() {
    let setup = Setup::new();
    let mut app = start_with(
        &setup.lock_url(),
        &setup.ledger(),
        &[("RUST_LOG", "info"), ("OTEL_METRIC_EXPORT_INTERVAL", "200")],
        Stdio::piped(),
    )
    .await;
    let client = reqwest::Client::new();
    let credit = format!("{}/accounts/acc-l/credit", app.base);
    assert_eq!(
        post_json(&client, &credit, json!({"amount": 5})).await.0,
        200
    );
    let stderr = app.child.stderr.take().expect("stderr");
    let mut lines = BufReader::new(stderr).lines();
    let found = tokio::time::timeout(Duration::from_secs(20), async {
        while let Ok(Some(line)) = lines.next_line().await {
            if line.contains("distributed_lock.acquisitions") && line.contains("status=acquired") {
                return line;
            }
        }
        String::new()
    })
    .await
    .expect("the metrics are logged within 20 s");
    assert!(found.contains("lock_type=sqlite"), "{found}");
}

/// Account ids are strings, and clients may spell one id several ways (`a:b`, `a%3Ab`,
/// `a%3ab`). The debit's layer template and the credit's `#[distributed_lock]` both lock
/// `account:a%3Ab` for all of them, so a credit sent while a debit of the same account is in
/// its read-work-write section waits for it, and no update is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn debit_and_credit_exclude_each_other_however_the_id_is_spelled() {
    let setup = Setup::new();
    let app = setup.start(&[("DEBIT_WORK", "3s")]).await;
    let client = reqwest::Client::new();
    let url = |spelling: &str, op: &str| format!("{}/accounts/{spelling}/{op}", app.base);
    let (status, body) = post_json(&client, &url("a:b", "credit"), json!({"amount": 10})).await;
    assert_eq!((status, &body["id"]), (200, &json!("a:b")), "{body}");

    let other = setup.provider().await;
    let debit = tokio::spawn({
        let (client, url) = (client.clone(), url("a%3Ab", "debit"));
        async move {
            let answer = post_json(&client, &url, json!({"amount": 3})).await;
            (answer, Instant::now())
        }
    });
    // The debit holds the account's lock (the key the macro renders for the id `a:b`).
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match other.try_acquire("account:a%3Ab").await {
            Err(dlock::LockError::AlreadyHeld { .. }) => break,
            Ok(guard) => guard.release().await.expect("release"),
            Err(err) => panic!("probe failed: {err}"),
        }
        assert!(
            Instant::now() < deadline,
            "the debit never held account:a%3Ab, the key the credit locks"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let (credit, credited_at) = {
        let answer = post_json(&client, &url("a%3ab", "credit"), json!({"amount": 5})).await;
        (answer, Instant::now())
    };
    let (debit, debited_at) = debit.await.expect("debit task");
    assert_eq!(debit.0, 200, "{}", debit.1);
    assert_eq!(credit.0, 200, "{}", credit.1);
    assert!(
        debited_at <= credited_at,
        "the credit finished during the debit: {} then {}",
        credit.1,
        debit.1
    );
    assert_eq!(
        (&debit.1["id"], &debit.1["balance"]),
        (&json!("a:b"), &json!(7))
    );
    assert_eq!(
        (&credit.1["id"], &credit.1["balance"]),
        (&json!("a:b"), &json!(12))
    );
    let (status, report) =
        post_json(&client, &format!("{}/jobs/reconcile", app.base), json!({})).await;
    assert_eq!(
        (status, report),
        (200, json!({"accounts": 1, "mismatches": []}))
    );
}

/// A request's status, content type, `Allow` header and body (JSON when it parses).
async fn send(request: reqwest::RequestBuilder) -> (u16, Option<String>, Option<String>, Value) {
    let response = request.send().await.expect("request");
    let header = |name: &str| {
        response
            .headers()
            .get(name)
            .map(|v| v.to_str().expect("ascii").to_owned())
    };
    let (content_type, allow) = (header("content-type"), header("allow"));
    let status = response.status().as_u16();
    let text = response.text().await.expect("body");
    let body = serde_json::from_str(&text).unwrap_or(Value::String(text));
    (status, content_type, allow, body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_error_is_a_problem_including_axums_rejections() {
    let setup = Setup::new();
    let app = setup.start(&[]).await;
    let client = reqwest::Client::new();
    let url = |path: &str| format!("{}{path}", app.base);
    let json_post = |path: &str, body: &'static str| {
        client
            .post(url(path))
            .header("content-type", "application/json")
            .body(body)
    };
    let cases = [
        // axum's JSON rejections, on the layer's route and on the macro's.
        (
            "malformed JSON",
            json_post("/accounts/a/debit", "{not json"),
            400,
        ),
        (
            "malformed JSON",
            json_post("/accounts/a/credit", "{not json"),
            400,
        ),
        (
            "wrong shape",
            json_post("/accounts/a/credit", r#"{"amount":"x"}"#),
            422,
        ),
        (
            "no content type",
            client
                .post(url("/accounts/a/credit"))
                .body(r#"{"amount":1}"#),
            415,
        ),
        // axum's path rejection: not UTF-8 once percent-decoded.
        ("bad path parameter", client.get(url("/accounts/%FF")), 400),
        // The service's own errors.
        ("unknown account", client.get(url("/accounts/nobody")), 404),
        (
            "bad amount",
            json_post("/accounts/a/credit", r#"{"amount":-1}"#),
            422,
        ),
        // No route, wrong method.
        ("no route", client.get(url("/nowhere")), 404),
        ("wrong method", client.get(url("/accounts/a/debit")), 405),
    ];
    for (what, request, status) in cases {
        let (got, content_type, allow, body) = send(request).await;
        assert_eq!(got, status, "{what}: {body}");
        assert_eq!(
            content_type.as_deref(),
            Some("application/problem+json"),
            "{what}: {body}"
        );
        assert_eq!(body["status"], status, "{what}: {body}");
        assert!(body["title"].is_string(), "{what}: {body}");
        assert!(body["detail"].is_string(), "{what}: {body}");
        if status == 405 {
            assert_eq!(
                allow.as_deref(),
                Some("POST"),
                "{what}: the Allow header stays"
            );
        }
    }
    // axum's own text, as the detail.
    let (_, _, _, body) = send(json_post("/accounts/a/credit", "{not json")).await;
    assert!(
        body["detail"]
            .as_str()
            .is_some_and(|d| d.starts_with("Failed to parse the request body as JSON")),
        "{body}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_debit_whose_lock_was_lost_and_taken_over_is_refused_by_the_ledger() {
    let setup = Setup::new();
    // A one-second lease: a holder stopped for longer has lost its lock.
    let lock_url = format!("{}?lease=1s", setup.lock_url());
    let mut app = start(&lock_url, &setup.ledger(), &[("DEBIT_WORK", "2s")]).await;
    let client = reqwest::Client::new();
    let credit = format!("{}/accounts/alice/credit", app.base);
    assert_eq!(
        post_json(&client, &credit, json!({"amount": 100})).await.0,
        200
    );

    let debit = tokio::spawn({
        let (client, url) = (client.clone(), format!("{}/accounts/alice/debit", app.base));
        async move { send(client.post(url).json(&json!({"amount": 30}))).await }
    });
    // Once the debit holds the account's lock (it is then between its read and its write,
    // in its two seconds of work), the replica is stopped, as a long pause would stop it.
    let other = LockProvider::connect(&lock_url).await.expect("lock store");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match other.try_acquire("account:alice").await {
            Err(dlock::LockError::AlreadyHeld { .. }) => break,
            Ok(guard) => guard.release().await.expect("release"),
            Err(err) => panic!("{err}"),
        }
        assert!(Instant::now() < deadline, "the debit never took the lock");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let signal = |name: &str| {
        let status = std::process::Command::new("kill")
            .args([name, &app.pid().to_string()])
            .status()
            .expect("kill");
        assert!(status.success());
    };
    signal("-STOP");

    // Its lease runs out; another replica takes the lock (a higher fencing token) and debits.
    let newer = other
        .acquire("account:alice", Duration::from_secs(30))
        .await
        .expect("the stopped replica's lease runs out");
    let ledger = webapp::Ledger::open(&setup.ledger()).expect("ledger");
    let balance = ledger
        .balance("alice")
        .await
        .expect("read")
        .expect("account");
    ledger
        .write("alice", balance - 5, -5, newer.fencing_token())
        .await
        .expect("the newer holder writes");
    newer.release().await.expect("release");

    // The stale debit resumes, runs on (`OnLost::Continue`) and writes with its older token.
    signal("-CONT");
    let (status, content_type, _, body) = debit.await.expect("debit task");
    assert_eq!(status, 409, "{body}");
    assert_eq!(content_type.as_deref(), Some("application/problem+json"));
    assert_eq!(body["title"], "Stale Lock", "{body}");
    assert_eq!(balance, 100);
    assert_eq!(
        ledger.balance("alice").await.expect("read"),
        Some(95),
        "only the newer holder's debit landed"
    );
    let (_, mismatches) = ledger.reconcile().await.expect("reconcile");
    assert!(mismatches.is_empty(), "{mismatches:?}");
    let _ = app.child.kill().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_started_at_the_same_moment_on_a_new_ledger_all_start() {
    // Thirty rounds of three: without the wait in `Ledger::open`, some round fails.
    for _ in 0..30 {
        let setup = Setup::new();
        // `start` fails the test if an instance exits instead of listening ("cannot open the
        // ledger ...: database is locked").
        let (a, b, c) = tokio::join!(setup.start(&[]), setup.start(&[]), setup.start(&[]));
        let client = reqwest::Client::new();
        for (instance, amount) in [(&a, 1), (&b, 2), (&c, 3)] {
            let url = format!("{}/accounts/shared/credit", instance.base);
            let (status, body) = post_json(&client, &url, json!({"amount": amount})).await;
            assert_eq!(status, 200, "{body}");
        }
        assert_eq!(balance(&client, &a, "shared").await, 6);
    }
}

/// `GET /admin/locks` lists the locks the instance holds while a debit runs (key, fencing
/// token, lease left), and nothing once it is done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_route_lists_the_locks_held_now() {
    let setup = Setup::new();
    let app = setup.start(&[("DEBIT_WORK", "1s")]).await;
    let client = reqwest::Client::new();
    let admin = format!("{}/admin/locks", app.base);
    let credit = format!("{}/accounts/acc-l/credit", app.base);
    assert_eq!(
        post_json(&client, &credit, json!({"amount": 5})).await.0,
        200
    );
    let listed = |client: reqwest::Client, admin: String| async move {
        client
            .get(&admin)
            .send()
            .await
            .expect("admin")
            .json::<Value>()
            .await
            .expect("json")
    };
    assert_eq!(listed(client.clone(), admin.clone()).await, json!([]));
    let debit = tokio::spawn({
        let (client, url) = (client.clone(), format!("{}/accounts/acc-l/debit", app.base));
        async move { post_json(&client, &url, json!({"amount": 1})).await }
    });
    let mut seen = Value::Null;
    dlock_testkit::wait_until(
        "the debit's lock is listed",
        Duration::from_secs(10),
        async || {
            seen = listed(client.clone(), admin.clone()).await;
            seen.as_array().is_some_and(|held| !held.is_empty())
        },
    )
    .await;
    assert_eq!(seen[0]["key"], "account:acc-l", "{seen}");
    assert!(seen[0]["fencing_token"].as_u64().is_some(), "{seen}");
    assert!(seen[0]["remaining_lease_ms"].as_u64().is_some(), "{seen}");
    assert_eq!(seen[0]["lost"], false, "{seen}");
    assert_eq!(debit.await.expect("join").0, 200);
    assert_eq!(listed(client.clone(), admin.clone()).await, json!([]));
}

/// `GET /admin/store-locks` on one instance lists the lock another instance holds while its
/// debit runs (not held here), and nothing once it is done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_admin_route_lists_locks_held_by_other_instances() {
    let setup = Setup::new();
    let a = setup.start(&[("DEBIT_WORK", "1s")]).await;
    let b = setup.start(&[]).await;
    let client = reqwest::Client::new();
    let credit = format!("{}/accounts/acc-s/credit", a.base);
    assert_eq!(
        post_json(&client, &credit, json!({"amount": 5})).await.0,
        200
    );
    let admin = format!("{}/admin/store-locks", b.base);
    let listed = |client: reqwest::Client, admin: String| async move {
        client
            .get(&admin)
            .send()
            .await
            .expect("admin")
            .json::<Value>()
            .await
            .expect("json")
    };
    let debit = tokio::spawn({
        let (client, url) = (client.clone(), format!("{}/accounts/acc-s/debit", a.base));
        async move { post_json(&client, &url, json!({"amount": 1})).await }
    });
    let mut seen = Value::Null;
    dlock_testkit::wait_until(
        "the other instance's lock is listed",
        Duration::from_secs(10),
        async || {
            seen = listed(client.clone(), admin.clone()).await;
            seen.as_array()
                .is_some_and(|held| held.iter().any(|lock| lock["key"] == "account:acc-s"))
        },
    )
    .await;
    let lock = seen
        .as_array()
        .and_then(|all| all.iter().find(|lock| lock["key"] == "account:acc-s"))
        .expect("listed");
    assert_eq!(lock["held_here"], false, "{seen}");
    assert_eq!(lock["readers"], 0, "{seen}");
    assert!(lock["fencing_token"].as_u64().is_some(), "{seen}");
    // Who holds it: the other instance, by its default owner label `host:pid`.
    let owner = lock["owner"].as_str().expect("an owner");
    assert!(owner.ends_with(&format!(":{}", a.pid())), "{seen}");
    // Since when: SQLite records it, in the last minute.
    let since = lock["since_unix_ms"].as_u64().expect("since");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis();
    assert!(
        u128::from(since) <= now && now - u128::from(since) < 60_000,
        "{seen}"
    );
    assert_eq!(debit.await.expect("join").0, 200);
    let after = listed(client.clone(), admin.clone()).await;
    assert!(
        after
            .as_array()
            .is_some_and(|all| all.iter().all(|lock| lock["key"] != "account:acc-s")),
        "{after}"
    );
}
