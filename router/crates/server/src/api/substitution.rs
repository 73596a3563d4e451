//! Substitution under load at the API (`crate::substitution` says when): a generation whose
//! variant runs its substitute is marked, and its HTTP response carries
//! `x-deltaserve-substituted: true`.
//!
//! ```text
//!  mark (middleware) ── scope: SUBSTITUTED = false ── handler ── usage::start_choices
//!        │                                                        └─ Backend::substitute → Some:
//!        │                                                           the requests run the substitute,
//!        ◀── response (headers not sent yet) ◀─────────────────────── SUBSTITUTED = true
//!  header added when true
//! ```
//!
//! The flag is a task-local the middleware scopes around the handler, so it needs no change to
//! the handlers; a WebSocket's generations run outside it (their messages have no headers).

use std::cell::Cell;

use axum::extract::Request;
use axum::http::{HeaderName, HeaderValue};
use axum::middleware::Next;
use axum::response::Response;

/// The response header.
pub const SUBSTITUTED: HeaderName = HeaderName::from_static("x-deltaserve-substituted");

tokio::task_local! {
    static MARK: Cell<bool>;
}

/// Marks the current request substituted (a no-op outside the middleware's scope).
pub fn mark() {
    let _ = MARK.try_with(|m| m.set(true));
}

/// The middleware (see the module docs).
pub async fn header(req: Request, next: Next) -> Response {
    let (mut response, substituted) = MARK
        .scope(Cell::new(false), async {
            let response = next.run(req).await;
            (response, MARK.with(Cell::get))
        })
        .await;
    if substituted {
        response
            .headers_mut()
            .insert(SUBSTITUTED, HeaderValue::from_static("true"));
    }
    response
}
