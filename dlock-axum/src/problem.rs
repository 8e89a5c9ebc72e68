//! Extractor rejections as problem details.

use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::response::{IntoResponse, Response};
use http::Uri;
use http::request::Parts;
use problem_details::ProblemDetails;

/// The longest rejection text read into a problem's `detail`.
const MAX_DETAIL: usize = 4096;

/// Any axum extractor, whose rejection is answered as `application/problem+json` (RFC 9457)
/// instead of axum's plain text: the rejection's status, its text as `detail` (for client
/// errors; a server error gets a generic `detail`, and its text goes to the log at `error`
/// level), and the request's path as `instance`.
///
/// Wrap the key extractor of [`LockLayer::with_extractor`](crate::LockLayer::with_extractor)
/// in it, so that the layer answers a malformed path (`/orders/abc/pay` for a `Path<u64>`) as
/// it answers everything else, and the handler's own extractors (`Problem<Json<T>>` for the
/// body), so that the handler does too:
///
/// ```
/// use axum::{Json, Router, extract::Path, routing::post};
/// use dlock_axum::{LockLayer, Problem};
///
/// #[derive(serde::Deserialize)]
/// struct Payment { amount: u64 }
///
/// async fn pay(
///     Problem(Path(order)): Problem<Path<u64>>,
///     Problem(Json(payment)): Problem<Json<Payment>>,
/// ) -> String {
///     format!("paid {} on order {order}", payment.amount)
/// }
///
/// # fn demo(locks: dlock::LockProvider) {
/// let app: Router = Router::new()
///     .route("/orders/{order}/pay", post(pay))
///     .route_layer(LockLayer::with_extractor(
///         locks,
///         |Problem(Path(order)): Problem<Path<u64>>| format!("order:{order}"),
///     ));
/// // POST /orders/abc/pay: 400, content-type application/problem+json,
/// // {"type":"about:blank","status":400,"title":"Bad Request",
/// //  "detail":"Invalid URL: Cannot parse `abc` to a `u64`","instance":"/orders/abc/pay"}
/// # let _ = app; }
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct Problem<E>(pub E);

/// Turns a rejection into a problem: see [`Problem`].
async fn problem(path: &str, rejection: Response) -> Response {
    let status = rejection.status();
    let (parts, body) = rejection.into_parts();
    let text = axum::body::to_bytes(body, MAX_DETAIL)
        .await
        .map(|bytes| String::from_utf8_lossy(&bytes).trim().to_owned())
        .unwrap_or_default();
    let detail = if status.is_server_error() {
        tracing::error!(%status, rejection = %text, instance = path, "an extractor failed");
        "The server failed to read this request.".to_owned()
    } else if text.is_empty() {
        status
            .canonical_reason()
            .unwrap_or("The request was refused.")
            .to_owned()
    } else {
        text
    };
    let mut problem = ProblemDetails::from_status_code(status).with_detail(detail);
    if let Ok(instance) = Uri::try_from(path) {
        problem = problem.with_instance(instance);
    }
    let mut response = problem.into_response();
    // Headers the answer relies on (`Allow`, `Retry-After`, `WWW-Authenticate`) stay.
    for (name, value) in &parts.headers {
        if name != http::header::CONTENT_TYPE && name != http::header::CONTENT_LENGTH {
            response.headers_mut().insert(name.clone(), value.clone());
        }
    }
    response
}

impl<E, S> FromRequestParts<S> for Problem<E>
where
    E: FromRequestParts<S>,
    S: Send + Sync,
{
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Response> {
        let rejection = match E::from_request_parts(parts, state).await {
            Ok(value) => return Ok(Problem(value)),
            Err(rejection) => rejection.into_response(),
        };
        Err(problem(parts.uri.path(), rejection).await)
    }
}

impl<E, S> FromRequest<S> for Problem<E>
where
    E: FromRequest<S>,
    S: Send + Sync,
{
    type Rejection = Response;

    async fn from_request(request: Request, state: &S) -> Result<Self, Response> {
        let path = request.uri().path().to_owned();
        let rejection = match E::from_request(request, state).await {
            Ok(value) => return Ok(Problem(value)),
            Err(rejection) => rejection.into_response(),
        };
        Err(problem(&path, rejection).await)
    }
}
