//! An accounts ledger service whose balance updates are serialized by distributed locks, so
//! any number of replicas can serve the same accounts without losing an update.
//!
//! | route | locking |
//! |---|---|
//! | `POST /accounts/{id}/debit` `{"amount": n}` | [`LockLayer`] on `account:{id}`, waits up to the lock timeout; the handler writes with the [`HeldLock`]'s fencing token |
//! | `POST /accounts/{id}/credit` `{"amount": n}` | `#[distributed_lock("account:{id}", timeout = 10, guard = lock)]` on the handler; writes with the guard's fencing token |
//! | `GET /accounts/{id}` | none |
//! | `POST /jobs/reconcile` | [`LockLayer`] on `jobs:reconcile`, one try: 409 while a run is in progress |
//! | `GET /admin/locks` | none; the locks this instance holds now (`LockProvider::held_locks`), as JSON |
//! | `GET /admin/store-locks` | none; the locks held in the store now by any instance (`LockProvider::store_locks`), with who holds each (its owner label, `host:pid` by default) and since when (where the store records it), as JSON |
//! | `GET /health` | none; asks the lock store (`LockProvider::ping`), 503 problem when it is down |
//!
//! Account ids are strings: the handlers take `Path<String>`, which is the percent-decoded
//! text of the path. That text is exactly what the layer's template `account:{id}` locks, and
//! the credit's `#[distributed_lock("account:{id}")]` encodes the same `String` the same way,
//! so a debit and a credit of one account take one lock however a client spells the id
//! (`a:b`, `a%3Ab`, `a%3ab` are all the account `a:b`, locked as `account:a%3Ab`). A service
//! whose handlers parse the id (`Path<u64>`, `Path<Uuid>`) must not use the template: it locks
//! the text, so `/accounts/42` and `/accounts/042` would be one account under two locks. Such a
//! service makes the key from the parsed value with
//! `LockLayer::with_extractor(locks, |Path(id): Path<u64>| format!("account:{id}"))`.
//!
//! Every error is answered as `application/problem+json` (RFC 9457): lock failures by
//! dlock-axum, the service's own by [`AppError`], axum's rejections of a malformed path or
//! body through dlock-axum's [`Problem`] wrapper of the extractors, and anything else (an
//! unknown route, a method a route does not take) by the [`problem_errors`] middleware.
//!
//! Balance writes carry the fencing token of the account's lock, and the [`Ledger`] refuses
//! a write whose token is lower than one it has already seen for the account: the write of a
//! holder whose lock was lost, after a later holder's, is answered 409 "Stale Lock" and
//! changes nothing. Replicas started at the same moment on one ledger file wait for each
//! other while they open (and create) it.
//!
//! Configuration comes from the environment (see [`Config::from_env`]); metrics go to an
//! OTLP collector when `OTEL_EXPORTER_OTLP_ENDPOINT` is set, to the log otherwise (see
//! [`telemetry`]).
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod ledger;
pub mod telemetry;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use axum::extract::{Path, Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use dlock::{CancellationToken, LockProvider};
use dlock_axum::{HeldLock, LockLayer, LockRejection, OnLost, Problem};
use problem_details::ProblemDetails;
use serde::{Deserialize, Serialize};
use tokio::net::TcpListener;

pub use ledger::Ledger;

/// How the service is set up.
#[derive(Debug, Clone)]
pub struct Config {
    /// The lock store URL (`DLOCK_URL`, default `sqlite://locks.db`).
    pub lock_url: String,
    /// The balance database file (`LEDGER_DB`, default `ledger.db`).
    pub ledger_path: PathBuf,
    /// Where to listen (`PORT`, default 3000, on 127.0.0.1).
    pub addr: SocketAddr,
    /// How long a balance update waits for its account's lock (`LOCK_TIMEOUT`, default `10s`).
    pub lock_timeout: Duration,
    /// At most this many debits wait for locks at a time (`MAX_WAITING`, default 1024).
    pub max_waiting: usize,
    /// Simulated work between reading and writing a balance (`DEBIT_WORK`, default `2ms`): a
    /// real debit checks limits or calls a payment network there.
    pub debit_work: Duration,
    /// Whether debits take the account lock (`DEBIT_LOCK=off` removes the layer, to watch
    /// updates get lost; never do that in production).
    pub debit_lock: bool,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            lock_url: "sqlite://locks.db".to_owned(),
            ledger_path: PathBuf::from("ledger.db"),
            addr: SocketAddr::from(([127, 0, 0, 1], 3000)),
            lock_timeout: Duration::from_secs(10),
            max_waiting: 1024,
            debit_work: Duration::from_millis(2),
            debit_lock: true,
        }
    }
}

impl Config {
    /// Reads `DLOCK_URL`, `LEDGER_DB`, `PORT`, `LOCK_TIMEOUT`, `MAX_WAITING`, `DEBIT_WORK` and
    /// `DEBIT_LOCK`, with the defaults of [`Config::default`].
    pub fn from_env() -> Result<Config, String> {
        let mut config = Config::default();
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
        if let Some(url) = var("DLOCK_URL") {
            config.lock_url = url;
        }
        if let Some(path) = var("LEDGER_DB") {
            config.ledger_path = PathBuf::from(path);
        }
        if let Some(port) = var("PORT") {
            let port: u16 = port
                .parse()
                .map_err(|_| format!("PORT must be a port number, not {port:?}"))?;
            config.addr.set_port(port);
        }
        if let Some(t) = var("LOCK_TIMEOUT") {
            config.lock_timeout =
                dlock::parse_duration("LOCK_TIMEOUT", &t).map_err(|e| e.to_string())?;
        }
        if let Some(n) = var("MAX_WAITING") {
            config.max_waiting = n
                .parse()
                .map_err(|_| format!("MAX_WAITING must be a number, not {n:?}"))?;
        }
        if let Some(t) = var("DEBIT_WORK") {
            config.debit_work =
                dlock::parse_duration("DEBIT_WORK", &t).map_err(|e| e.to_string())?;
        }
        if let Some(v) = var("DEBIT_LOCK") {
            config.debit_lock = !matches!(v.as_str(), "off" | "0" | "false");
        }
        Ok(config)
    }
}

/// What the handlers share.
#[derive(Debug, Clone)]
pub struct AppState {
    /// The lock provider (built with the shutdown token, so shutdown cancels pending waits).
    pub locks: LockProvider,
    /// The balances.
    pub ledger: Ledger,
    /// How long balance updates wait for their account's lock.
    pub lock_timeout: Duration,
    /// Simulated work inside a debit.
    pub debit_work: Duration,
    /// See [`Config::max_waiting`].
    pub max_waiting: usize,
    /// See [`Config::debit_lock`].
    pub debit_lock: bool,
}

impl AppState {
    /// Connects to the lock store and opens the ledger. Acquisitions still pending when
    /// `shutdown` is cancelled end with 499.
    pub async fn connect(
        config: &Config,
        shutdown: &CancellationToken,
    ) -> Result<AppState, String> {
        let locks = LockProvider::connect(&config.lock_url)
            .await
            .map_err(|e| format!("cannot open the lock store: {e}"))?
            .with_shutdown(shutdown);
        // Waits for replicas that open or create the file at the same moment.
        let path = config.ledger_path.clone();
        let ledger = tokio::task::spawn_blocking(move || Ledger::open(&path))
            .await
            .map_err(|e| format!("cannot open the ledger: {e}"))?
            .map_err(|e| {
                format!(
                    "cannot open the ledger {}: {e}",
                    config.ledger_path.display()
                )
            })?;
        Ok(AppState {
            locks,
            ledger,
            lock_timeout: config.lock_timeout,
            debit_work: config.debit_work,
            max_waiting: config.max_waiting,
            debit_lock: config.debit_lock,
        })
    }
}

/// The service's router.
pub fn app(state: AppState) -> Router {
    // The template locks the path's text, which is the debit's `Path<String>` (see the
    // module docs: a handler that parsed the id would need `LockLayer::with_extractor`).
    //
    // `OnLost::Continue`: a debit whose lock is lost runs on to its write, and the ledger,
    // which gets the lock's fencing token with every write, refuses it if a later holder has
    // written since (409 "Stale Lock"); if none has, nothing conflicts and the write stands.
    // Dropping the handler instead (`OnLost::Cancel`, the default) could stop a debit between
    // its external work and its write; and a handler that was paused past its lease cannot
    // be stopped before it resumes anyway. The fencing check is what protects the balance.
    let debit_layer = LockLayer::new(state.locks.clone(), "account:{id}")
        .timeout(state.lock_timeout)
        .max_waiting(state.max_waiting)
        .on_lost(OnLost::Continue);
    let debits = Router::new().route("/accounts/{id}/debit", post(debit));
    let debits = if state.debit_lock {
        debits.route_layer(debit_layer.clone())
    } else {
        tracing::warn!("DEBIT_LOCK=off: debits run without the account lock and can lose updates");
        debits
    };
    let jobs = Router::new()
        .route("/jobs/reconcile", post(reconcile))
        .route_layer(LockLayer::new(state.locks.clone(), "jobs:reconcile"));
    Router::new()
        .merge(debits)
        .merge(jobs)
        .route("/accounts/{id}/credit", post(credit))
        .route("/accounts/{id}", get(account))
        .route("/admin/locks", get(held_locks))
        .route("/admin/store-locks", get(store_locks))
        .route(
            "/health",
            get(move |state: State<AppState>| health(state, debit_layer.waiting())),
        )
        // Lock problems returned by handlers (the credit's #[distributed_lock]) get the
        // request path as `instance`, like the layer's.
        .layer(axum::middleware::from_fn(dlock_axum::problem_instance))
        // Whatever error is left in another format (no such route, a method the route does
        // not take, a body too large) is answered as problem details too.
        .layer(axum::middleware::from_fn(problem_errors))
        .with_state(state)
}

/// Serves `app` on `listener` until `shutdown` is cancelled, then finishes the requests in
/// flight (pending lock waits end at once with 499: the provider is built on the same token).
pub async fn serve(
    listener: TcpListener,
    state: AppState,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    axum::serve(listener, app(state))
        .with_graceful_shutdown(async move { shutdown.cancelled().await })
        .await
}

/// A debit or credit.
#[derive(Debug, Deserialize)]
pub struct Amount {
    /// Positive, in the account's smallest unit.
    pub amount: i64,
}

/// An account as answered.
#[derive(Debug, Serialize, Deserialize)]
pub struct Account {
    /// The account's id.
    pub id: String,
    /// Its balance.
    pub balance: i64,
}

async fn debit(
    State(state): State<AppState>,
    Problem(Path(id)): Problem<Path<String>>,
    // The layer's lock: its fencing token goes with the write, so the ledger refuses the write
    // of a debit whose lock was lost and taken by another request that has written since.
    // (`None` only with `DEBIT_LOCK=off`, which removes the layer.)
    lock: Option<HeldLock>,
    Problem(Json(req)): Problem<Json<Amount>>,
) -> Result<Json<Account>, AppError> {
    check_amount(req.amount)?;
    // Read, work, write: three steps the account lock keeps together.
    let balance = state.ledger.balance(&id).await?.ok_or(AppError::NotFound)?;
    if balance < req.amount {
        return Err(AppError::InsufficientFunds { balance });
    }
    tokio::time::sleep(state.debit_work).await;
    let balance = balance - req.amount;
    let token = lock.as_ref().and_then(HeldLock::fencing_token);
    state.ledger.write(&id, balance, -req.amount, token).await?;
    Ok(Json(Account { id, balance }))
}

// The attribute renders `account:{id}` from the `Path` extractor's binding, the same `String`
// the debit's layer template sees, encoded the same way (so both lock one key per account);
// it takes the lock from `state.locks` before the body and releases it after the body; lock
// errors leave through `LockRejection`'s `From<LockError>`.
// `guard = lock` binds the guard, whose fencing token goes with the write, as the debit's.
#[dlock::distributed_lock("account:{id}", timeout = 10, provider = state.locks, guard = lock)]
async fn credit(
    State(state): State<AppState>,
    Problem(Path(id)): Problem<Path<String>>,
    Problem(Json(req)): Problem<Json<Amount>>,
) -> Result<Response, LockRejection> {
    Ok(apply_credit(&state, id, req.amount, lock.fencing_token())
        .await
        .into_response())
}

async fn apply_credit(
    state: &AppState,
    id: String,
    amount: i64,
    token: Option<u64>,
) -> Result<Json<Account>, AppError> {
    check_amount(amount)?;
    let balance = state.ledger.balance(&id).await?.unwrap_or(0);
    let balance = balance.checked_add(amount).ok_or(AppError::BadAmount)?;
    state.ledger.write(&id, balance, amount, token).await?;
    Ok(Json(Account { id, balance }))
}

async fn account(
    State(state): State<AppState>,
    Problem(Path(id)): Problem<Path<String>>,
) -> Result<Json<Account>, AppError> {
    let balance = state.ledger.balance(&id).await?.ok_or(AppError::NotFound)?;
    Ok(Json(Account { id, balance }))
}

#[derive(Serialize)]
struct Reconciliation {
    accounts: usize,
    mismatches: Vec<ledger::Mismatch>,
}

async fn reconcile(State(state): State<AppState>) -> Result<Json<Reconciliation>, AppError> {
    let (accounts, mismatches) = state.ledger.reconcile().await?;
    if !mismatches.is_empty() {
        tracing::error!(
            count = mismatches.len(),
            "balances disagree with their journal"
        );
    }
    Ok(Json(Reconciliation {
        accounts,
        mismatches,
    }))
}

/// One lock this instance holds, for `GET /admin/locks`.
#[derive(Serialize)]
struct HeldLockView {
    key: String,
    /// Milliseconds since the Unix epoch.
    since_ms: u128,
    fencing_token: Option<u64>,
    /// For leased locks, how long the lease can still be counted on.
    remaining_lease_ms: Option<u128>,
    lost: bool,
}

/// The locks this instance holds now (read-only, from memory).
async fn held_locks(State(state): State<AppState>) -> Json<Vec<HeldLockView>> {
    let held = state
        .locks
        .held_locks()
        .into_iter()
        .map(|info| HeldLockView {
            since_ms: info
                .since
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |since| since.as_millis()),
            remaining_lease_ms: info.remaining_lease.map(|left| left.as_millis()),
            fencing_token: info.fencing_token,
            lost: info.lost,
            key: info.key,
        });
    Json(held.collect())
}

/// One lock held in the store, for `GET /admin/store-locks`.
#[derive(Serialize)]
struct StoreLockView {
    /// The lock's key, where the store keeps it.
    key: Option<String>,
    /// What the store calls it.
    resource: String,
    /// Readers sharing it (0: exclusive).
    readers: u32,
    fencing_token: Option<u64>,
    remaining_lease_ms: Option<u128>,
    /// Whether this instance holds it.
    held_here: bool,
    /// Who holds it: the holder's owner label (`host:pid` unless set), where the store keeps
    /// one.
    owner: Option<String>,
    /// When its holder took it (Unix milliseconds), where the store records that (SQLite).
    since_unix_ms: Option<u128>,
}

/// The locks held in the store now, by any instance (read-only).
async fn store_locks(
    State(state): State<AppState>,
) -> Result<Json<Vec<StoreLockView>>, dlock_axum::LockRejection> {
    let locks = state.locks.store_locks().await?;
    Ok(Json(
        locks
            .into_iter()
            .map(|lock| StoreLockView {
                owner: lock.owner().map(str::to_owned),
                since_unix_ms: lock.since().and_then(|since| {
                    since
                        .duration_since(std::time::UNIX_EPOCH)
                        .ok()
                        .map(|at| at.as_millis())
                }),
                remaining_lease_ms: lock.remaining_lease.map(|left| left.as_millis()),
                key: lock.key,
                resource: lock.resource,
                readers: lock.readers,
                fencing_token: lock.fencing_token,
                held_here: lock.held_here,
            })
            .collect(),
    ))
}

#[derive(Serialize)]
struct Health {
    status: &'static str,
    lock_backend: &'static str,
    /// Debits waiting in the lock layer.
    waiting_debits: usize,
    /// Keys this instance holds or is acquiring (debits, credits and jobs alike).
    lock_keys: usize,
}

/// Asks the lock store (one round trip, `LockProvider::ping`): a store that cannot be reached
/// is a 503 problem, as the lock layer answers when it cannot lock.
async fn health(
    State(state): State<AppState>,
    waiting_debits: usize,
) -> Result<Json<Health>, LockRejection> {
    state.locks.ping().await?;
    Ok(Json(Health {
        status: "ok",
        lock_backend: state.locks.backend_name(),
        waiting_debits,
        lock_keys: state.locks.local_key_count(),
    }))
}

fn check_amount(amount: i64) -> Result<(), AppError> {
    if amount > 0 {
        Ok(())
    } else {
        Err(AppError::BadAmount)
    }
}

/// The service's own failures, answered as problem details.
#[derive(Debug, thiserror::Error)]
pub enum AppError {
    /// No such account.
    #[error("no such account")]
    NotFound,
    /// The amount is not positive (or overflows).
    #[error("the amount must be a positive integer")]
    BadAmount,
    /// The balance is too low.
    #[error("insufficient funds: the balance is {balance}")]
    InsufficientFunds {
        /// The balance.
        balance: i64,
    },
    /// The balance database failed.
    #[error(transparent)]
    Ledger(#[from] ledger::LedgerError),
}

/// The longest error body [`problem_errors`] reads to turn into a problem's `detail`.
const MAX_ERROR_BODY: usize = 4096;

/// Middleware: an error response that is not `application/problem+json` yet (axum's 404 for
/// an unknown route, 405 for a method the route does not take, 413 for a body over the limit)
/// becomes one. Client errors keep their text as `detail`; server errors get a generic one,
/// and their text goes to the log.
///
/// # Cancel safety
///
/// Dropping the future drops the inner service's future, as any middleware does.
pub async fn problem_errors(request: Request, next: Next) -> Response {
    let response = next.run(request).await;
    let status = response.status();
    let is_problem = response
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|ct| ct.as_bytes().starts_with(b"application/problem+json"));
    if !(status.is_client_error() || status.is_server_error()) || is_problem {
        return response;
    }
    let (parts, body) = response.into_parts();
    let text = axum::body::to_bytes(body, MAX_ERROR_BODY)
        .await
        .map(|bytes| String::from_utf8_lossy(&bytes).trim().to_owned())
        .unwrap_or_default();
    let detail = if status.is_server_error() {
        tracing::error!(%status, body = %text, "server error");
        "The server failed to answer; retry later.".to_owned()
    } else if text.is_empty() {
        status
            .canonical_reason()
            .unwrap_or("The request was refused.")
            .to_owned()
    } else {
        text
    };
    let mut problem = ProblemDetails::from_status_code(status)
        .with_detail(detail)
        .into_response();
    // Headers the answer relies on (`Allow` of a 405, `Retry-After`) stay.
    for name in [header::ALLOW, header::RETRY_AFTER] {
        if let Some(value) = parts.headers.get(&name) {
            problem.headers_mut().insert(name, value.clone());
        }
    }
    problem
}

impl IntoResponse for AppError {
    fn into_response(self) -> Response {
        let status = match &self {
            AppError::NotFound => StatusCode::NOT_FOUND,
            AppError::BadAmount | AppError::InsufficientFunds { .. } => {
                StatusCode::UNPROCESSABLE_ENTITY
            }
            AppError::Ledger(err @ ledger::LedgerError::StaleToken { .. }) => {
                // The fencing check did its job: this request's lock was lost and a later
                // holder of it has written. Nothing was written; the client may retry.
                tracing::warn!(error = %err, "refused the write of a stale lock holder");
                let mut response = ProblemDetails::from_status_code(StatusCode::CONFLICT)
                    .with_title("Stale Lock")
                    .with_detail(
                        "This request's lock on the account was lost, and a later request \
                         has updated the account since; nothing was written. Retry.",
                    )
                    .into_response();
                response
                    .headers_mut()
                    .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
                return response;
            }
            AppError::Ledger(err) => {
                tracing::error!(error = %err, "ledger failure");
                return ProblemDetails::from_status_code(StatusCode::INTERNAL_SERVER_ERROR)
                    .with_detail("The ledger failed; retry later.")
                    .into_response();
            }
        };
        ProblemDetails::from_status_code(status)
            .with_detail(self.to_string())
            .into_response()
    }
}
