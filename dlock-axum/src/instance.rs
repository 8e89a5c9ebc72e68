//! Filling in `instance` for lock problems that handlers return.

use axum::body::Body;
use axum::extract::Request;
use axum::middleware::Next;
use axum::response::Response;
use http::header;

/// Marks a problem response whose `instance` was not known when it was made.
#[derive(Debug, Clone, Copy)]
pub(crate) struct InstanceMissing;

/// The largest problem body [`problem_instance`] rewrites (they are a few hundred bytes).
const MAX_PROBLEM_BODY: usize = 16 * 1024;

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
    let response = next.run(request).await;
    if response.extensions().get::<InstanceMissing>().is_none() {
        return response;
    }
    let (mut parts, body) = response.into_parts();
    parts.extensions.remove::<InstanceMissing>();
    // The body is the problem JSON the rejection just wrote, in memory.
    let Ok(bytes) = axum::body::to_bytes(body, MAX_PROBLEM_BODY).await else {
        return Response::from_parts(parts, Body::empty());
    };
    let filled = match serde_json::from_slice::<serde_json::Value>(&bytes) {
        Ok(serde_json::Value::Object(mut problem)) => {
            problem.insert("instance".to_owned(), serde_json::Value::String(path));
            serde_json::to_vec(&problem).ok()
        }
        _ => None,
    };
    match filled {
        Some(body) => {
            parts.headers.remove(header::CONTENT_LENGTH);
            Response::from_parts(parts, Body::from(body))
        }
        None => Response::from_parts(parts, Body::from(bytes)),
    }
}
