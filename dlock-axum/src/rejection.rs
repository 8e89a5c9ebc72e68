//! Lock errors as RFC 9457 problem details.

use std::fmt;
use std::time::Duration;

use axum::response::{IntoResponse, Response};
use dlock::LockError;
use http::{HeaderValue, StatusCode, Uri, header};
use problem_details::ProblemDetails;

/// The `code` of the answer given when too many requests already wait for locks of one
/// layer (see [`LockLayer::max_waiting`](crate::LockLayer::max_waiting)).
pub const TOO_MANY_WAITERS_CODE: &str = "DistributedLock.TooManyWaiters";

/// The prefix of every problem `type` this crate answers with: `type` is this prefix followed
/// by a slug (`already-held`, `timeout`, `lost`, `canceled`, `reentrant`, `invalid-key`, `unavailable`,
/// `too-many-waiters`, `configuration`, `unsupported`, `backend-error`, `error`).
///
/// The `type` is a relative URI reference (RFC 9457 §3.1.1 allows them; they resolve against the
/// request's URL). It identifies the problem without naming a host the service does not
/// control, and it is never meant to be dereferenced; clients branch on it or on the `code`
/// extension. A service that documents its problems can serve a page at these paths.
pub const PROBLEM_TYPE_PREFIX: &str = "/problems/distributed-lock/";

/// A lock failure, answered as `application/problem+json` (RFC 9457).
///
/// The layer answers with it; handlers that take locks themselves (by hand or with
/// `#[distributed_lock]`) return `Result<_, LockRejection>` and use `?` on [`LockError`]s:
///
/// ```
/// use axum::extract::State;
/// use dlock::LockProvider;
/// use dlock_axum::LockRejection;
///
/// async fn close_books(State(locks): State<LockProvider>) -> Result<&'static str, LockRejection> {
///     let guard = locks.try_acquire("books:close").await?;
///     // ... close the books ...
///     guard.release().await?;
///     Ok("closed")
/// }
/// # let _ = axum::Router::<LockProvider>::new().route("/close", axum::routing::post(close_books));
/// ```
///
/// The body has `type`, `title`, `status`, `detail`, `instance` (the request path, when known:
/// the layer sets it, a handler can with [`with_instance`](LockRejection::with_instance), and
/// the [`problem_instance`](crate::problem_instance) middleware fills it in otherwise) and
/// the extension `code` ([`LockError::code`]):
///
/// | error | status | title | `Retry-After` |
/// |---|---|---|---|
/// | [`AlreadyHeld`](LockError::AlreadyHeld) | 409 | Lock Already Held | yes |
/// | [`Timeout`](LockError::Timeout) | 408 | Lock Acquisition Timeout | yes |
/// | [`Lost`](LockError::Lost) | 500 | Distributed Lock Lost | |
/// | [`Canceled`](LockError::Canceled) | 499 | Lock Acquisition Canceled | |
/// | [`Reentrant`](LockError::Reentrant) | 500 | Lock Already Held By This Request | |
/// | [`InvalidKey`](LockError::InvalidKey) | 400 | Invalid Lock Key | |
/// | [`Unavailable`](LockError::Unavailable) | 503 | Lock Store Unavailable | yes |
/// | too many waiters (layer) | 503 | Too Many Lock Waiters | yes |
/// | configuration, backend, other | 500 (501 unsupported) | Lock Configuration Error, ... | |
///
/// Details of store failures (driver messages, SQL, host names) never reach the body: the
/// response says what happened in general terms, and the error itself is logged with `tracing`
/// (`error` level for store and configuration failures, `warn` for a lost lock, `debug` for
/// contention).
pub struct LockRejection {
    kind: Kind,
    instance: Option<String>,
    retry_after: Duration,
}

enum Kind {
    Lock(LockError),
    TooManyWaiters,
}

impl LockRejection {
    /// The default `Retry-After`: one second.
    pub const DEFAULT_RETRY_AFTER: Duration = Duration::from_secs(1);

    pub(crate) fn too_many_waiters() -> Self {
        LockRejection {
            kind: Kind::TooManyWaiters,
            instance: None,
            retry_after: Self::DEFAULT_RETRY_AFTER,
        }
    }

    /// Sets `instance`, normally the request's path (without its query, which may carry
    /// secrets).
    pub fn with_instance(mut self, path: impl Into<String>) -> Self {
        self.instance = Some(path.into());
        self
    }

    /// Sets the `Retry-After` of 409, 408 and 503 answers (whole seconds, rounded up, at least 1).
    pub fn with_retry_after(mut self, retry_after: Duration) -> Self {
        self.retry_after = retry_after;
        self
    }

    /// The lock error, unless this is the layer's "too many waiters" answer.
    pub fn error(&self) -> Option<&LockError> {
        match &self.kind {
            Kind::Lock(err) => Some(err),
            Kind::TooManyWaiters => None,
        }
    }

    /// The HTTP status of the answer.
    pub fn status(&self) -> StatusCode {
        match &self.kind {
            Kind::Lock(err) => {
                StatusCode::from_u16(err.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
            }
            Kind::TooManyWaiters => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    /// The `code` extension of the answer, such as `"DistributedLock.AlreadyHeld"`.
    pub fn code(&self) -> &'static str {
        match &self.kind {
            Kind::Lock(err) => err.code(),
            Kind::TooManyWaiters => TOO_MANY_WAITERS_CODE,
        }
    }

    /// Builds the problem details object of the answer.
    pub fn to_problem(&self) -> ProblemDetails<ProblemCode> {
        let (slug, title, detail) = self.describe();
        let type_uri = Uri::try_from(format!("{PROBLEM_TYPE_PREFIX}{slug}"))
            .unwrap_or_else(|_| Uri::from_static("about:blank"));
        let mut problem = ProblemDetails::new()
            .with_type(type_uri)
            .with_status(self.status())
            .with_title(title)
            .with_detail(detail);
        if let Some(instance) = self
            .instance
            .as_deref()
            .and_then(|path| Uri::try_from(path).ok())
        {
            problem = problem.with_instance(instance);
        }
        problem.with_extensions(ProblemCode { code: self.code() })
    }

    fn retry_after_header(&self) -> Option<HeaderValue> {
        let wanted = match &self.kind {
            Kind::Lock(err) => matches!(
                err,
                LockError::AlreadyHeld { .. }
                    | LockError::Timeout { .. }
                    | LockError::Unavailable { .. }
            ),
            Kind::TooManyWaiters => true,
        };
        if !wanted {
            return None;
        }
        let mut secs = self.retry_after.as_secs();
        if self.retry_after.subsec_nanos() > 0 {
            secs = secs.saturating_add(1);
        }
        Some(HeaderValue::from(secs.max(1)))
    }

    /// (type slug, title, detail). Details never carry driver messages, URLs or SQL.
    fn describe(&self) -> (&'static str, &'static str, String) {
        let err = match &self.kind {
            Kind::TooManyWaiters => {
                return (
                    "too-many-waiters",
                    "Too Many Lock Waiters",
                    "Too many requests are already waiting for locks here; retry later.".to_owned(),
                );
            }
            Kind::Lock(err) => err,
        };
        match err {
            LockError::AlreadyHeld { .. } => (
                "already-held",
                "Lock Already Held",
                "Another request holds the lock this request needs; retry later.".to_owned(),
            ),
            LockError::Timeout { timeout, .. } => (
                "timeout",
                "Lock Acquisition Timeout",
                format!(
                    "The lock this request needs stayed held by another request for the whole \
                     {} ms the server waits; retry later.",
                    timeout.as_millis()
                ),
            ),
            LockError::Lost { .. } => (
                "lost",
                "Distributed Lock Lost",
                "The lock protecting this request was lost before the response was ready; the \
                 request may have been carried out partly, or alongside another one."
                    .to_owned(),
            ),
            LockError::Reentrant { .. } => (
                "reentrant",
                "Lock Already Held By This Request",
                "The lock this request asked for is already held by this request (locks are not \
                 reentrant): the server takes it twice."
                    .to_owned(),
            ),
            LockError::Canceled { .. } => (
                "canceled",
                "Lock Acquisition Canceled",
                "The server stopped waiting for the lock this request needs (it is shutting \
                 down); retry later."
                    .to_owned(),
            ),
            LockError::InvalidKey { reason } => (
                "invalid-key",
                "Invalid Lock Key",
                format!("This request does not name a usable lock: {reason}."),
            ),
            LockError::Unavailable { .. } => (
                "unavailable",
                "Lock Store Unavailable",
                "The lock store cannot be reached right now; retry later.".to_owned(),
            ),
            LockError::Config { .. } => (
                "configuration",
                "Lock Configuration Error",
                "The server's distributed locking is misconfigured.".to_owned(),
            ),
            LockError::Unsupported { .. } => (
                "unsupported",
                "Lock Operation Unsupported",
                "The server's lock store does not support the locking this request needs."
                    .to_owned(),
            ),
            LockError::Backend { .. } => (
                "backend-error",
                "Lock Store Error",
                "The lock store failed to answer; retry later.".to_owned(),
            ),
            _ => (
                "error",
                "Distributed Lock Error",
                "Distributed locking failed for this request.".to_owned(),
            ),
        }
    }

    fn log(&self) {
        let instance = self.instance.as_deref().unwrap_or("");
        match &self.kind {
            Kind::TooManyWaiters => {
                tracing::warn!(
                    instance,
                    "too many requests waiting for locks; answering 503"
                );
            }
            Kind::Lock(err) => match err {
                LockError::AlreadyHeld { .. }
                | LockError::Timeout { .. }
                | LockError::InvalidKey { .. } => {
                    tracing::debug!(instance, error = %err, code = err.code(), "lock not taken");
                }
                LockError::Canceled { .. } => {
                    tracing::info!(instance, error = %err, "lock acquisition canceled");
                }
                LockError::Lost { .. } => {
                    tracing::warn!(instance, error = %err, "lock lost while handling a request");
                }
                _ => tracing::error!(
                    instance,
                    error = err as &(dyn std::error::Error + 'static),
                    code = err.code(),
                    "distributed lock failure"
                ),
            },
        }
    }
}

impl From<LockError> for LockRejection {
    fn from(err: LockError) -> Self {
        LockRejection {
            kind: Kind::Lock(err),
            instance: None,
            retry_after: Self::DEFAULT_RETRY_AFTER,
        }
    }
}

impl IntoResponse for LockRejection {
    fn into_response(self) -> Response {
        self.log();
        let retry_after = self.retry_after_header();
        let problem = self.to_problem();
        let missing = self.instance.is_none().then(|| problem.clone());
        let mut response = problem.into_response();
        if let Some(problem) = missing {
            // For the problem_instance middleware, if the application uses it.
            response
                .extensions_mut()
                .insert(crate::instance::InstanceMissing(Box::new(problem)));
        }
        if let Some(value) = retry_after {
            response.headers_mut().insert(header::RETRY_AFTER, value);
        }
        response
    }
}

impl fmt::Debug for LockRejection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut s = f.debug_struct("LockRejection");
        match &self.kind {
            Kind::Lock(err) => s.field("error", err),
            Kind::TooManyWaiters => s.field("error", &"too many waiters"),
        };
        s.field("instance", &self.instance)
            .field("retry_after", &self.retry_after)
            .finish()
    }
}

impl fmt::Display for LockRejection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.kind {
            Kind::Lock(err) => fmt::Display::fmt(err, f),
            Kind::TooManyWaiters => f.write_str("too many requests are waiting for locks"),
        }
    }
}

impl std::error::Error for LockRejection {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match &self.kind {
            Kind::Lock(err) => Some(err),
            Kind::TooManyWaiters => None,
        }
    }
}

/// The extension members of the problems this crate answers with: `code`, the stable
/// machine-readable code of the error.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct ProblemCode {
    /// Such as `"DistributedLock.AlreadyHeld"`.
    pub code: &'static str,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(rejection: LockRejection) -> (u16, Option<String>, ProblemDetails<ProblemCode>) {
        let problem = rejection.to_problem();
        let response = rejection.into_response();
        let retry = response
            .headers()
            .get(header::RETRY_AFTER)
            .map(|v| v.to_str().unwrap_or_default().to_owned());
        (response.status().as_u16(), retry, problem)
    }

    #[test]
    fn every_error_has_its_status_title_and_code() {
        let key: std::sync::Arc<str> = "k".into();
        let cases = [
            (
                LockError::AlreadyHeld { key: key.clone() },
                409,
                "Lock Already Held",
                true,
            ),
            (
                LockError::Timeout {
                    key: key.clone(),
                    timeout: Duration::from_secs(1),
                },
                408,
                "Lock Acquisition Timeout",
                true,
            ),
            (
                LockError::Lost {
                    key: key.clone(),
                    reason: "r".into(),
                },
                500,
                "Distributed Lock Lost",
                false,
            ),
            (
                LockError::Canceled { key },
                499,
                "Lock Acquisition Canceled",
                false,
            ),
            (
                LockError::InvalidKey { reason: "r".into() },
                400,
                "Invalid Lock Key",
                false,
            ),
            (
                LockError::Reentrant { key: "k".into() },
                500,
                "Lock Already Held By This Request",
                false,
            ),
            (
                LockError::unavailable("x", "m", None),
                503,
                "Lock Store Unavailable",
                true,
            ),
            (
                LockError::config("m"),
                500,
                "Lock Configuration Error",
                false,
            ),
            (
                LockError::backend("x", "m", None, None),
                500,
                "Lock Store Error",
                false,
            ),
            (
                LockError::unsupported("x", "op", "m"),
                501,
                "Lock Operation Unsupported",
                false,
            ),
        ];
        for (err, status, title, retry) in cases {
            let code = err.code();
            let (got_status, got_retry, problem) = answer(err.into());
            assert_eq!(got_status, status, "{title}");
            assert_eq!(problem.title.as_deref(), Some(title));
            assert_eq!(problem.extensions.code, code);
            assert_eq!(got_retry.is_some(), retry, "{title}");
            let ty = problem
                .r#type
                .map(|t| Uri::from(t).to_string())
                .unwrap_or_default();
            assert!(ty.starts_with(PROBLEM_TYPE_PREFIX), "{ty}");
        }
        let (status, retry, problem) = answer(LockRejection::too_many_waiters());
        assert_eq!((status, retry.as_deref()), (503, Some("1")));
        assert_eq!(problem.extensions.code, TOO_MANY_WAITERS_CODE);
    }

    #[test]
    fn retry_after_is_whole_seconds_rounded_up_and_at_least_one() {
        let held = || LockRejection::from(LockError::AlreadyHeld { key: "k".into() });
        for (given, sent) in [
            (0, "1"),
            (1, "1"),
            (999, "1"),
            (1000, "1"),
            (1001, "2"),
            (2500, "3"),
        ] {
            let (_, retry, _) = answer(held().with_retry_after(Duration::from_millis(given)));
            assert_eq!(retry.as_deref(), Some(sent), "{given} ms");
        }
    }

    #[test]
    fn store_failures_keep_their_messages_out_of_the_body() {
        let err = LockError::backend(
            "postgres",
            "SELECT pg_advisory_lock($1) failed on postgres://u:secret@h/db",
            Some("42P01".into()),
            None,
        );
        let (_, _, problem) = answer(LockRejection::from(err).with_instance("/a"));
        let body = format!("{:?} {:?}", problem.detail, problem.title);
        assert!(
            !body.contains("secret") && !body.contains("SELECT"),
            "{body}"
        );
        assert_eq!(
            problem.instance.map(|u| u.to_string()).as_deref(),
            Some("/a")
        );
    }
}
