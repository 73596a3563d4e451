//! Request ids: every response carries `x-request-id`, taken from the client's header when it is
//! sane (1 to 128 characters of letters, digits and `-_.:`), else made up (`req-` + 24 hex
//! digits). The id is a [`RequestId`] extension for the handlers, a field of the `request`
//! tracing span that every log line about the request is written in, and `error.request_id` in
//! every JSON error body (errors inside a stream travel on a response that has the header).

use axum::body::Body;
use axum::extract::Request;
use axum::http::{header, HeaderName, HeaderValue};
use axum::middleware::Next;
use axum::response::Response;
use tracing::Instrument;

use super::error::ErrorBody;
use super::response_id;

/// The header, both ways.
pub const REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// Longest client-given id kept.
pub const MAX_REQUEST_ID_LEN: usize = 128;

/// Error bodies larger than this are passed on untouched (they are never this large).
const MAX_ERROR_BODY: usize = 64 << 10;

/// A request's id, as handlers see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestId(pub String);

/// Whether a client's id can be used as is (safe in headers, logs and JSON).
pub fn is_sane(id: &str) -> bool {
    (1..=MAX_REQUEST_ID_LEN).contains(&id.len())
        && id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.:".contains(c))
}

/// The middleware (outermost, so even a 401 has an id).
pub async fn tag(mut req: Request, next: Next) -> Response {
    let id = req
        .headers()
        .get(&REQUEST_ID)
        .and_then(|v| v.to_str().ok())
        .filter(|id| is_sane(id))
        .map(str::to_string)
        .unwrap_or_else(|| response_id("req"));
    req.extensions_mut().insert(RequestId(id.clone()));
    let span = tracing::info_span!("request", request_id = %id);
    let response = next.run(req).instrument(span).await;
    let mut response = if response.status().is_client_error() || response.status().is_server_error()
    {
        with_id_in_error_body(response, &id).await
    } else {
        response
    };
    let value = HeaderValue::from_str(&id).expect("sane ids are valid header values");
    response.headers_mut().insert(REQUEST_ID, value);
    response
}

/// Puts `id` into a JSON error body (`error.request_id`); other bodies pass unchanged.
async fn with_id_in_error_body(response: Response, id: &str) -> Response {
    let is_json = response
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|ct| ct.as_bytes().starts_with(b"application/json"));
    if !is_json {
        return response;
    }
    let (mut parts, body) = response.into_parts();
    let Ok(bytes) = axum::body::to_bytes(body, MAX_ERROR_BODY).await else {
        // Only an error echoing a huge input gets here: answer its status with a short body.
        parts.headers.remove(header::CONTENT_LENGTH);
        let short = serde_json::json!({"error": {"message": "the error message was too long to send",
            "type": "server_error", "param": null, "code": null, "request_id": id}});
        return Response::from_parts(parts, Body::from(short.to_string()));
    };
    let bytes = match serde_json::from_slice::<ErrorBody>(&bytes) {
        Ok(mut e) => {
            e.error.request_id = Some(id.to_string());
            parts.headers.remove(header::CONTENT_LENGTH);
            serde_json::to_vec(&e).map(Into::into).unwrap_or(bytes)
        }
        Err(_) => bytes,
    };
    Response::from_parts(parts, Body::from(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sane_ids() {
        for ok in ["a", "req-123", "0f:ab.c_d", &"x".repeat(128)] {
            assert!(is_sane(ok), "{ok}");
        }
        for bad in ["", "a b", "a\nb", "é", "<script>", &"x".repeat(129)] {
            assert!(!is_sane(bad), "{bad}");
        }
    }
}
