//! Filling in `instance` for lock problems that handlers return.

use axum::extract::Request;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http::{Uri, header};
use problem_details::ProblemDetails;

use crate::rejection::ProblemCode;

/// Marks a problem response whose `instance` was not known when it was made, and keeps the
/// problem, so that [`problem_instance`] can answer it again with its `instance` set (rather
/// than parse the JSON it was just written as).
#[derive(Debug, Clone)]
pub(crate) struct InstanceMissing(pub(crate) Box<ProblemDetails<ProblemCode>>);

/// Middleware that sets `instance` (the request path, without its query) on lock problems
/// returned by handlers.
///
/// The [`LockLayer`](crate::LockLayer) knows the request and fills `instance` itself. A handler
/// that locks by hand or through `#[distributed_lock]` returns a
/// [`LockRejection`](crate::LockRejection) made from a [`LockError`](dlock::LockError) with `?`,
/// which cannot know the path; add this middleware to the router and such problems get it too.
/// Other responses pass through untouched (a response extension marks the ones to fill).
///
/// ```
/// use axum::{Router, middleware, routing::post};
///
/// # async fn close_books() -> &'static str { "ok" }
/// let app: Router = Router::new()
///     .route("/books/close", post(close_books))
///     .layer(middleware::from_fn(dlock_axum::problem_instance));
/// ```
///
/// # Cancel safety
///
/// Dropping the future drops the inner service's future, as any middleware does.
pub async fn problem_instance(request: Request, next: Next) -> Response {
    let path = request.uri().path().to_owned();
    let mut response = next.run(request).await;
    let Some(InstanceMissing(problem)) = response.extensions_mut().remove::<InstanceMissing>()
    else {
        return response;
    };
    // A path is a valid URI reference; if it were not, the problem stays without `instance`.
    let Ok(instance) = Uri::try_from(path) else {
        return response;
    };
    let (parts, _) = response.into_parts();
    let mut filled = problem.with_instance(instance).into_response();
    // The rejection's own headers (`Retry-After`, say) and extensions stay; the body's length
    // and type are the new body's.
    for (name, value) in &parts.headers {
        if name != header::CONTENT_LENGTH && name != header::CONTENT_TYPE {
            filled.headers_mut().insert(name.clone(), value.clone());
        }
    }
    *filled.status_mut() = parts.status;
    filled.extensions_mut().extend(parts.extensions);
    filled
}
