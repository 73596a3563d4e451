//! [`ApiError`]: every way a client request fails, rendered as OpenAI's error JSON
//! (`{"error": {"message", "type", "param", "code"}}`), plus [`ApiJson`], the body extractor
//! whose rejections (malformed JSON, wrong field types, body too large) use the same shape
//! instead of axum's plain-text 4xx.
//!
//! Each variant has one HTTP status and one stable [`ApiError::error_type`] label; the label is
//! the JSON `type` and keys the `deltaserve_api_errors_total` counter (STYLE.md #12).

use std::sync::atomic::{AtomicU64, Ordering};

use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::de::DeserializeOwned;
use serde::Serialize;

use super::quotas::QuotaExceeded;
use crate::engine::{EngineError, SloRefusal, VariantError};
use crate::registry::RegistryError;

/// Seconds a client should wait before retrying after a 429 or 503.
pub const RETRY_AFTER_SECS: u64 = 1;

/// Why an API request failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ApiError {
    /// The request is malformed or asks for something unsupported (400).
    #[error("{message}")]
    InvalidRequest {
        /// What is wrong, and where.
        message: String,
        /// The offending field (dotted path), when there is one.
        param: Option<String>,
    },
    /// The `model` field names no served model (404).
    #[error("The model `{0}` does not exist; GET /v1/models lists the served models")]
    ModelNotFound(String),
    /// The `model` field names a variant that is neither registered nor in any configured
    /// variant source (404, `model_not_found`); `.1` says where it was looked for.
    #[error("The model `{0}` does not exist: it is not registered, and {1}")]
    VariantNotFound(String, String),
    /// No registered adapter of that name (404); the message says where the list is.
    #[error("{0}")]
    AdapterNotFound(String),
    /// The request conflicts with the current state, e.g. a name already taken (409).
    #[error("{0}")]
    Conflict(String),
    /// No route at this path (404).
    #[error("no route for {0}")]
    RouteNotFound(String),
    /// The route exists but not for this method (405).
    #[error("method not allowed for {0}")]
    MethodNotAllowed(String),
    /// The request body exceeds the server's limit (413).
    #[error("{0}")]
    PayloadTooLarge(String),
    /// Too much queued work (429, with `Retry-After`).
    #[error("{0}")]
    Overloaded(String),
    /// The engine cannot take requests now, e.g. a worker restarts (503, with `Retry-After`).
    #[error("{0}")]
    Unavailable(String),
    /// The request failed inside the engine or a worker (500).
    #[error("{0}")]
    Internal(String),
    /// No valid API key (401, with `WWW-Authenticate: Bearer`).
    #[error("{0}")]
    Unauthorized(String),
    /// A valid key that may not use this route (403).
    #[error("{0}")]
    Forbidden(String),
    /// The tenant's quota refuses the request (429, with the quota's `Retry-After`); `param`
    /// names the limit.
    #[error("{}", .0.message)]
    QuotaExceeded(QuotaExceeded),
    /// A state-changing request whose body is not `application/json` (415).
    #[error("{0}")]
    UnsupportedMediaType(String),
    /// Admission control refused the request: it would miss its SLO (429, with the predicted
    /// queue drain time as `Retry-After`; `param` names the bound).
    #[error("{0}")]
    OverSlo(SloRefusal),
}

/// Every [`ApiError::error_type`], in the order of [`ERROR_COUNTS`].
pub const ERROR_TYPES: [&str; 11] = [
    "invalid_request_error",
    "not_found_error",
    "method_not_allowed_error",
    "request_too_large",
    "rate_limit_error",
    "service_unavailable_error",
    "server_error",
    "conflict_error",
    "authentication_error",
    "permission_error",
    "unsupported_media_type",
];

/// Errors answered since start, per [`ERROR_TYPES`] entry (process-wide, exported by `/metrics`).
static ERROR_COUNTS: [AtomicU64; ERROR_TYPES.len()] =
    [const { AtomicU64::new(0) }; ERROR_TYPES.len()];

/// `(error_type, count)` for every error type, for `/metrics`.
pub fn error_counts() -> Vec<(&'static str, u64)> {
    ERROR_TYPES
        .iter()
        .zip(&ERROR_COUNTS)
        .map(|(t, c)| (*t, c.load(Ordering::Relaxed)))
        .collect()
}

/// The OpenAI error object (inside `{"error": ...}`); also sent on SSE and WebSocket streams.
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize)]
pub struct ErrorObject {
    /// Human-readable: what went wrong and where.
    pub message: String,
    /// The stable label ([`ApiError::error_type`]).
    #[serde(rename = "type")]
    pub kind: String,
    /// The offending request field, if any.
    pub param: Option<String>,
    /// A machine-readable code for the few cases clients branch on (`model_not_found`).
    pub code: Option<String>,
    /// The request's `x-request-id`, to quote when reporting it (set by the request-id layer).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_id: Option<String>,
}

/// The top-level error body.
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize)]
pub struct ErrorBody {
    /// The error.
    pub error: ErrorObject,
}

impl ApiError {
    /// A 400 about `param`.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        ApiError::InvalidRequest {
            message: message.into(),
            param: Some(param.into()),
        }
    }

    /// A 400 not tied to one field.
    pub fn invalid_body(message: impl Into<String>) -> Self {
        ApiError::InvalidRequest {
            message: message.into(),
            param: None,
        }
    }

    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::InvalidRequest { .. } => StatusCode::BAD_REQUEST,
            ApiError::ModelNotFound(_)
            | ApiError::VariantNotFound(..)
            | ApiError::AdapterNotFound(_)
            | ApiError::RouteNotFound(_) => StatusCode::NOT_FOUND,
            ApiError::Conflict(_) => StatusCode::CONFLICT,
            ApiError::MethodNotAllowed(_) => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::PayloadTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::Overloaded(_) => StatusCode::TOO_MANY_REQUESTS,
            ApiError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
            ApiError::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            ApiError::Forbidden(_) => StatusCode::FORBIDDEN,
            ApiError::QuotaExceeded(_) | ApiError::OverSlo(_) => StatusCode::TOO_MANY_REQUESTS,
            ApiError::UnsupportedMediaType(_) => StatusCode::UNSUPPORTED_MEDIA_TYPE,
        }
    }

    /// The stable label: the JSON `type` and the metrics key.
    pub fn error_type(&self) -> &'static str {
        ERROR_TYPES[self.type_index()]
    }

    fn type_index(&self) -> usize {
        match self {
            ApiError::InvalidRequest { .. } => 0,
            ApiError::ModelNotFound(_)
            | ApiError::VariantNotFound(..)
            | ApiError::AdapterNotFound(_)
            | ApiError::RouteNotFound(_) => 1,
            ApiError::MethodNotAllowed(_) => 2,
            ApiError::PayloadTooLarge(_) => 3,
            ApiError::Overloaded(_) | ApiError::QuotaExceeded(_) | ApiError::OverSlo(_) => 4,
            ApiError::Unavailable(_) => 5,
            ApiError::Internal(_) => 6,
            ApiError::Conflict(_) => 7,
            ApiError::Unauthorized(_) => 8,
            ApiError::Forbidden(_) => 9,
            ApiError::UnsupportedMediaType(_) => 10,
        }
    }

    /// The error as OpenAI's JSON body. Counts it in `/metrics`: call once per answered error.
    pub fn to_body(&self) -> ErrorBody {
        ERROR_COUNTS[self.type_index()].fetch_add(1, Ordering::Relaxed);
        let (param, code) = match self {
            ApiError::InvalidRequest { param, .. } => (param.clone(), None),
            ApiError::ModelNotFound(_) | ApiError::VariantNotFound(..) => (
                Some("model".to_string()),
                Some("model_not_found".to_string()),
            ),
            ApiError::AdapterNotFound(_) => (
                Some("name".to_string()),
                Some("adapter_not_found".to_string()),
            ),
            ApiError::Unauthorized(_) => (None, Some("invalid_api_key".to_string())),
            ApiError::QuotaExceeded(q) => (
                Some(q.limit.to_string()),
                Some("quota_exceeded".to_string()),
            ),
            ApiError::OverSlo(r) => (Some(r.bound.to_string()), Some("slo_exceeded".to_string())),
            _ => (None, None),
        };
        ErrorBody {
            error: ErrorObject {
                message: self.to_string(),
                kind: self.error_type().to_string(),
                param,
                code,
                request_id: None,
            },
        }
    }
}

impl From<EngineError> for ApiError {
    fn from(e: EngineError) -> Self {
        match e {
            EngineError::Overloaded(m) => ApiError::Overloaded(m),
            EngineError::Unavailable(m) => ApiError::Unavailable(m),
            EngineError::OverSlo(r) => ApiError::OverSlo(r),
            EngineError::InvalidRequest(m) => ApiError::InvalidRequest {
                message: m,
                param: None,
            },
        }
    }
}

impl From<VariantError> for ApiError {
    fn from(e: VariantError) -> Self {
        match e {
            VariantError::Invalid { message, param } => ApiError::invalid(param, message),
            VariantError::Registry(r @ RegistryError::BadName(_)) => {
                ApiError::invalid("name", r.to_string())
            }
            VariantError::Registry(r @ RegistryError::NotFound(_)) => {
                ApiError::AdapterNotFound(r.to_string())
            }
            VariantError::Registry(r) => ApiError::Conflict(r.to_string()),
            VariantError::Unavailable(m) => ApiError::Unavailable(m),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status();
        if status.is_server_error() {
            tracing::warn!(error_type = self.error_type(), "{self}");
        } else {
            tracing::debug!(error_type = self.error_type(), "{self}");
        }
        let mut response = (status, Json(self.to_body())).into_response();
        let headers = response.headers_mut();
        match &self {
            ApiError::Overloaded(_) | ApiError::Unavailable(_) => {
                headers.insert(header::RETRY_AFTER, HeaderValue::from(RETRY_AFTER_SECS));
            }
            ApiError::QuotaExceeded(q) => {
                headers.insert(header::RETRY_AFTER, HeaderValue::from(q.retry_after_secs));
            }
            ApiError::OverSlo(r) => {
                headers.insert(header::RETRY_AFTER, HeaderValue::from(r.retry_after_secs));
            }
            ApiError::Unauthorized(_) => {
                headers.insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            }
            _ => {}
        }
        response
    }
}

/// A JSON body extractor whose every rejection is an [`ApiError`].
///
/// Unlike axum's `Json`, it does not insist on `Content-Type: application/json` (curl's `-d`
/// sends `application/x-www-form-urlencoded`); the body is parsed as JSON whatever the header
/// says, and the header is mentioned only when parsing fails.
#[derive(Debug, Clone)]
pub struct ApiJson<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        let content_type = req
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let bytes = Bytes::from_request(req, state).await.map_err(|e| {
            if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::PayloadTooLarge(format!("request body too large: {}", e.body_text()))
            } else {
                ApiError::invalid_body(format!("cannot read the request body: {}", e.body_text()))
            }
        })?;
        parse_json_object(&bytes).map(ApiJson).map_err(|e| match (e, content_type) {
            (ApiError::InvalidRequest { message, param }, Some(ct))
                if !ct.starts_with("application/json") && !ct.contains("+json") =>
            {
                ApiError::InvalidRequest {
                    message: format!("{message} (the body was sent as `{ct}`; send JSON with `Content-Type: application/json`)"),
                    param,
                }
            }
            (e, _) => e,
        })
    }
}

/// Parses a request body that must be a JSON object (serde would otherwise read an array
/// positionally into a struct's fields).
pub fn parse_json_object<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    let first = bytes.iter().find(|b| !b.is_ascii_whitespace());
    if first.is_some_and(|&b| b != b'{') {
        let value: serde_json::Value = parse_json(bytes)?;
        return Err(ApiError::invalid_body(format!(
            "the request body must be a JSON object, got {}",
            crate::text::chat_template::json_kind(&value)
        )));
    }
    parse_json(bytes)
}

/// Parses a JSON document into `T`; errors say what was wrong and at which field path
/// (`param` is that path, e.g. `messages[0].role`).
pub fn parse_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    use axum::extract::rejection::JsonRejection;
    use std::error::Error as _;
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Err(ApiError::invalid_body(
            "the request body is empty; expected a JSON object",
        ));
    }
    match Json::<T>::from_bytes(bytes) {
        Ok(Json(value)) => Ok(value),
        Err(JsonRejection::JsonDataError(e)) => {
            // The source is serde_path_to_error's "path: message" (no path at the top level).
            let detail = e
                .source()
                .map(|s| s.to_string())
                .unwrap_or_else(|| e.body_text());
            Err(ApiError::InvalidRequest {
                message: format!("invalid request body: {detail}"),
                param: error_path(&detail).map(str::to_string),
            })
        }
        Err(JsonRejection::JsonSyntaxError(e)) => {
            let detail = e
                .source()
                .map(|s| s.to_string())
                .unwrap_or_else(|| e.body_text());
            Err(ApiError::invalid_body(format!(
                "the request body is not valid JSON: {detail}"
            )))
        }
        Err(other) => Err(ApiError::invalid_body(other.body_text())),
    }
}

/// The path of serde_path_to_error's `"a.b[0]: message"`; `None` when the error is at the top
/// level (no path prefix).
fn error_path(detail: &str) -> Option<&str> {
    let (path, _) = detail.split_once(": ")?;
    let is_path = !path.is_empty()
        && path != "."
        && path
            .chars()
            .all(|c| c.is_alphanumeric() || "_.[]?".contains(c));
    is_path.then_some(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, serde::Deserialize)]
    #[allow(dead_code)]
    struct Body {
        model: String,
        max_tokens: Option<u32>,
        messages: Option<Vec<Msg>>,
    }
    #[derive(Debug, serde::Deserialize)]
    #[allow(dead_code)]
    struct Msg {
        role: String,
    }

    #[test]
    fn statuses_types_and_retry_after() {
        let cases: [(ApiError, u16, &str); 6] = [
            (
                ApiError::invalid("max_tokens", "x"),
                400,
                "invalid_request_error",
            ),
            (ApiError::ModelNotFound("m".into()), 404, "not_found_error"),
            (
                ApiError::PayloadTooLarge("x".into()),
                413,
                "request_too_large",
            ),
            (
                EngineError::Overloaded("busy".into()).into(),
                429,
                "rate_limit_error",
            ),
            (
                EngineError::Unavailable("restarting".into()).into(),
                503,
                "service_unavailable_error",
            ),
            (ApiError::Internal("boom".into()), 500, "server_error"),
        ];
        for (err, status, kind) in cases {
            assert_eq!(err.status().as_u16(), status);
            assert_eq!(err.error_type(), kind);
            let response = err.clone().into_response();
            let retry = response
                .headers()
                .get(header::RETRY_AFTER)
                .map(|v| v.to_str().unwrap().to_string());
            assert_eq!(retry.is_some(), status == 429 || status == 503, "{err:?}");
        }
        let body = ApiError::ModelNotFound("nope".into()).to_body();
        assert!(
            body.error.message.contains("`nope`") && body.error.message.contains("GET /v1/models")
        );
        assert_eq!(body.error.code.as_deref(), Some("model_not_found"));
        let json = serde_json::to_value(ApiError::invalid("prompt", "empty").to_body()).unwrap();
        assert_eq!(
            json,
            serde_json::json!({"error": {"message": "empty", "type": "invalid_request_error", "param": "prompt", "code": null}})
        );
        let quota = ApiError::QuotaExceeded(QuotaExceeded {
            limit: "tokens_per_minute",
            retry_after_secs: 7,
            message: "over".into(),
        });
        let response = quota.clone().into_response();
        assert_eq!(response.status(), 429);
        assert_eq!(response.headers()[header::RETRY_AFTER], "7");
        let body = quota.to_body().error;
        assert_eq!(body.param.as_deref(), Some("tokens_per_minute"));
        assert_eq!(
            (body.kind.as_str(), body.code.as_deref()),
            ("rate_limit_error", Some("quota_exceeded"))
        );
        let response = ApiError::Unauthorized("no key".into()).into_response();
        assert_eq!(response.status(), 401);
        assert_eq!(response.headers()[header::WWW_AUTHENTICATE], "Bearer");
        assert_eq!(ApiError::Forbidden("x".into()).status(), 403);
    }

    #[test]
    fn parse_errors_name_the_field() {
        let err = parse_json::<Body>(br#"{"model": "m", "max_tokens": "ten"}"#).unwrap_err();
        let ApiError::InvalidRequest { message, param } = err else {
            panic!()
        };
        assert_eq!(param.as_deref(), Some("max_tokens"));
        assert!(
            message.contains("invalid type") && message.contains("max_tokens"),
            "{message}"
        );

        let err =
            parse_json::<Body>(br#"{"model": "m", "messages": [{"content": "x"}]}"#).unwrap_err();
        let ApiError::InvalidRequest { message, param } = err else {
            panic!()
        };
        assert_eq!(param.as_deref(), Some("messages[0]"));
        assert!(message.contains("missing field `role`"), "{message}");

        let err = parse_json::<Body>(br#"{"max_tokens": 3}"#).unwrap_err();
        assert!(err.to_string().contains("missing field `model`"), "{err}");

        let err = parse_json::<Body>(br#"{"model": "m",,}"#).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("the request body is not valid JSON"),
            "{err}"
        );
        assert_eq!(err.status(), StatusCode::BAD_REQUEST);

        let err = parse_json::<Body>(b"  ").unwrap_err();
        assert!(err.to_string().contains("empty"), "{err}");
        assert!(parse_json::<Body>(br#"{"model": "m", "unknown": [1, 2]}"#).is_ok());
    }
}
