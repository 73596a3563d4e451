//! Authentication and route permissions: the middleware that turns a request's
//! `Authorization: Bearer <key>` into a [`Caller`] (through [`AccessControl`]) and refuses what
//! that caller may not do, before any handler runs.
//!
//! ```text
//!  /health, /ready                      always open
//!  no valid key while keys are required 401 (OpenAI's `invalid_api_key`, `WWW-Authenticate: Bearer`)
//!  admin route without an admin key     401 without a key, 403 with another one
//!  GET /v1/ws without a key             upgraded; the socket's first message must be
//!                                       {"type": "auth", "key": "..."} (see ws.rs)
//!  state-changing route, body not JSON  415 (before anything is parsed)
//!  otherwise                            the handler runs with a [`Requester`] extension
//! ```
//!
//! Admin routes: every method but GET/HEAD on any path except the generation and tokenizer
//! endpoints ([`STATELESS_POSTS`]), and the reads that show server state:
//! `GET /v1/adapters` (server paths) and, when a key file is in force, `GET /metrics` (tenant
//! names). Which variants a tenant may use is checked where the `model` field is resolved
//! (`validate::check_model`), so a forbidden variant is a 404 like a missing one.

use std::sync::Arc;

use axum::extract::{FromRequestParts, Request, State};
use axum::http::request::Parts;
use axum::http::{header, HeaderMap, Method};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::error::ApiError;
use super::request_id::RequestId;
use super::tenants::{AccessControl, Caller};

/// Everything a handler knows about who sent the request (inserted by [`authenticate`]).
#[derive(Debug, Clone)]
pub struct Requester {
    /// Who it is.
    pub caller: Caller,
    /// The request's id (`x-request-id`).
    pub request_id: String,
    /// The keys, quotas and usage meter.
    pub access: Arc<AccessControl>,
    /// A WebSocket opened without a key: `caller` may use nothing until the socket's first
    /// message authenticates it.
    pub authenticate_in_band: bool,
}

impl<S: Send + Sync> FromRequestParts<S> for Requester {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, ApiError> {
        parts
            .extensions
            .get::<Requester>()
            .cloned()
            .ok_or_else(|| ApiError::Internal("the authentication layer did not run".into()))
    }
}

/// The middleware (see the module docs).
pub async fn authenticate(
    State(access): State<Arc<AccessControl>>,
    mut req: Request,
    next: Next,
) -> Response {
    let path = req.uri().path().to_string();
    if path == "/health" || path == "/ready" {
        return next.run(req).await;
    }
    let request_id = req
        .extensions()
        .get::<RequestId>()
        .map(|r| r.0.clone())
        .unwrap_or_default();
    let key = match presented_key(req.headers(), access.keys_required()) {
        Ok(key) => key,
        Err(e) => return e.into_response(),
    };
    let in_band = path == "/v1/ws" && key.is_none() && access.keys_required();
    let caller = if in_band {
        Caller::nobody()
    } else {
        match access.authenticate(key.as_deref()) {
            Ok(caller) => caller,
            Err(e) => {
                tracing::info!(path = %path, "refused: {e}");
                return ApiError::Unauthorized(e.to_string()).into_response();
            }
        }
    };
    let method = req.method().clone();
    if needs_admin(&method, &path, access.keys_required()) && !caller.admin {
        let what = format!("{method} {path} needs an admin key");
        return if key.is_none() && !in_band {
            ApiError::Unauthorized(format!("{what}: send `Authorization: Bearer <admin key>`"))
        } else {
            ApiError::Forbidden(format!("{what}; this key is not one"))
        }
        .into_response();
    }
    if changes_state(&method, &path) {
        if let Err(e) = json_body(req.headers(), &method) {
            return e.into_response();
        }
    }
    req.extensions_mut().insert(Requester {
        caller,
        request_id,
        access,
        authenticate_in_band: in_band,
    });
    next.run(req).await
}

/// The key of `Authorization: Bearer <key>` (`None` without the header); any other form of the
/// header is a 401 (it never quotes the header).
pub fn bearer_key(headers: &HeaderMap) -> Result<Option<String>, ApiError> {
    let Some(value) = headers.get(header::AUTHORIZATION) else {
        return Ok(None);
    };
    let refused =
        || ApiError::Unauthorized("the Authorization header must be `Bearer <key>`".to_string());
    let text = value.to_str().map_err(|_| refused())?;
    let (scheme, key) = text.trim().split_once(' ').ok_or_else(refused)?;
    let key = key.trim();
    if !scheme.eq_ignore_ascii_case("bearer") || key.is_empty() {
        return Err(refused());
    }
    Ok(Some(key.to_string()))
}

/// The key a request presents. Where no key is required, a header that is not `Bearer <key>`
/// counts as no key rather than a 401: clients that always send one send an empty key to an open
/// server (lm-eval-harness's `local-completions` sends `Authorization: Bearer `), and vLLM
/// without `--api-key` serves them. An admin route still needs a well-formed admin key.
pub fn presented_key(headers: &HeaderMap, keys_required: bool) -> Result<Option<String>, ApiError> {
    match bearer_key(headers) {
        Err(_) if !keys_required => Ok(None),
        other => other,
    }
}

/// Whether `method path` is an admin route (see the module docs).
pub fn needs_admin(method: &Method, path: &str, keys_required: bool) -> bool {
    let adapters = path == "/v1/adapters" || path.starts_with("/v1/adapters/");
    if method == Method::GET || method == Method::HEAD {
        return adapters || (keys_required && path == "/metrics");
    }
    changes_state(method, path)
}

/// POST routes that change no server state: generation, and the tokenizer as a service.
pub const STATELESS_POSTS: [&str; 6] = [
    "/v1/completions",
    "/v1/chat/completions",
    "/generate",
    "/generate_stream",
    "/tokenize",
    "/detokenize",
];

/// Whether `method path` may change server state: anything but GET/HEAD/OPTIONS, except the
/// [`STATELESS_POSTS`].
pub fn changes_state(method: &Method, path: &str) -> bool {
    let read_only = [Method::GET, Method::HEAD, Method::OPTIONS].contains(method);
    let stateless = method == Method::POST && STATELESS_POSTS.contains(&path);
    !read_only && !stateless
}

/// State-changing requests with a body must say it is JSON (`application/json`, or a `+json`
/// type): a cross-site form post (`text/plain`, `application/x-www-form-urlencoded`,
/// `multipart/form-data`) needs no CORS preflight, so it is refused here (415). A DELETE
/// without a body may omit the header.
fn json_body(headers: &HeaderMap, method: &Method) -> Result<(), ApiError> {
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .map(|v| v.to_str().unwrap_or("?").to_ascii_lowercase());
    let essence = content_type
        .as_deref()
        .map(|ct| ct.split(';').next().unwrap_or("").trim().to_string());
    match essence.as_deref() {
        Some("application/json") => Ok(()),
        Some(t) if t.starts_with("application/") && t.ends_with("+json") => Ok(()),
        None if method == Method::DELETE => Ok(()),
        None if headers
            .get(header::CONTENT_LENGTH)
            .is_some_and(|v| v.as_bytes() == b"0") =>
        {
            Ok(())
        }
        _ => Err(ApiError::UnsupportedMediaType(format!(
            "this route takes a JSON body: send `Content-Type: application/json`{}",
            match essence {
                Some(t) if t.len() <= 64 && t.chars().all(|c| c.is_ascii_graphic()) =>
                    format!(" (got `{t}`)"),
                Some(_) => " (got another type)".into(),
                None => " (got none)".into(),
            }
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn headers(pairs: &[(header::HeaderName, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(k.clone(), HeaderValue::from_str(v).unwrap());
        }
        h
    }

    #[test]
    fn bearer_keys() {
        let auth = header::AUTHORIZATION;
        assert_eq!(bearer_key(&headers(&[])).unwrap(), None);
        let key = bearer_key(&headers(&[(auth.clone(), "Bearer sk-1")])).unwrap();
        assert_eq!(key.as_deref(), Some("sk-1"));
        let key = bearer_key(&headers(&[(auth.clone(), "bearer  sk-2 ")])).unwrap();
        assert_eq!(key.as_deref(), Some("sk-2"));
        for bad in ["Basic abc", "Bearer", "Bearer ", "sk-1"] {
            let err = bearer_key(&headers(&[(auth.clone(), bad)])).unwrap_err();
            assert_eq!(err.status(), 401, "{bad}");
            assert!(!err.to_string().contains("abc"));
        }
    }

    #[test]
    fn an_open_server_ignores_a_malformed_key() {
        let auth = header::AUTHORIZATION;
        for bad in ["Bearer ", "Bearer", "Basic abc"] {
            let h = headers(&[(auth.clone(), bad)]);
            assert_eq!(presented_key(&h, false).unwrap(), None, "{bad}");
            assert_eq!(presented_key(&h, true).unwrap_err().status(), 401, "{bad}");
        }
        let h = headers(&[(auth.clone(), "Bearer sk-1")]);
        assert_eq!(presented_key(&h, false).unwrap().as_deref(), Some("sk-1"));
    }

    #[test]
    fn admin_routes() {
        let (get, post, delete) = (Method::GET, Method::POST, Method::DELETE);
        assert!(needs_admin(&post, "/v1/adapters", false));
        assert!(needs_admin(&delete, "/v1/adapters/x", false));
        assert!(needs_admin(&get, "/v1/adapters", false));
        assert!(needs_admin(&Method::PUT, "/anything", false));
        assert!(!needs_admin(&post, "/v1/completions", true));
        assert!(!needs_admin(&post, "/v1/chat/completions", true));
        assert!(!needs_admin(&get, "/v1/models", true));
        assert!(!needs_admin(&post, "/tokenize", true));
        assert!(!needs_admin(&post, "/detokenize", true));
        assert!(!needs_admin(&post, "/generate", true));
        assert!(needs_admin(&post, "/v1/load_lora_adapter", false));
        assert!(needs_admin(&post, "/v1/unload_lora_adapter", false));
        assert!(!needs_admin(&get, "/metrics", false));
        assert!(needs_admin(&get, "/metrics", true));
    }

    #[test]
    fn state_changing_bodies_must_be_json() {
        let ct = header::CONTENT_TYPE;
        let ok = |h: HeaderMap, m: &Method| json_body(&h, m).is_ok();
        assert!(ok(
            headers(&[(ct.clone(), "application/json")]),
            &Method::POST
        ));
        assert!(ok(
            headers(&[(ct.clone(), "Application/JSON; charset=utf-8")]),
            &Method::POST
        ));
        assert!(ok(
            headers(&[(ct.clone(), "application/merge-patch+json")]),
            &Method::POST
        ));
        assert!(ok(headers(&[]), &Method::DELETE));
        assert!(ok(headers(&[(header::CONTENT_LENGTH, "0")]), &Method::POST));
        for bad in [
            "text/plain",
            "application/x-www-form-urlencoded",
            "multipart/form-data; boundary=x",
        ] {
            let err = json_body(&headers(&[(ct.clone(), bad)]), &Method::POST).unwrap_err();
            assert_eq!(err.status(), 415, "{bad}");
        }
        assert_eq!(
            json_body(&headers(&[]), &Method::POST)
                .unwrap_err()
                .status(),
            415
        );
    }
}
