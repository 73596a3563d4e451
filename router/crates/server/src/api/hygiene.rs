//! Request hygiene against browsers: the middleware that refuses, before authentication runs,
//! what a web page could make a visitor's browser send to the daemon.
//!
//! ```text
//!  POST generation route, body typed but not JSON   415 (a cross-site form post needs no preflight)
//!  Origin on a state-changing request or /v1/ws    403 unless same-origin (Origin = Host) or
//!                                                   listed in --allowed-origins
//!  Host not an IP literal, localhost or a name of   403 while the API is open (no --api-keys):
//!  --allowed-origins                                DNS rebinding cannot reach it
//! ```
//!
//! Requests without `Origin` (curl, the SDKs, other servers) pass the origin check; a browser
//! always sends it on a cross-origin POST, DELETE or WebSocket upgrade. Without `--api-keys` any
//! page could rebind its own name to the daemon's address and then talk to it as same-origin;
//! such a request carries the page's name in `Host`, so the open daemon answers only requests
//! addressed to an IP (`127.0.0.1:PORT`, `[::1]:PORT`, the machine's address), `localhost`, or a
//! name of an allowed origin. The state-changing admin routes' JSON rule is `auth.rs`'s.

use std::net::IpAddr;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, Method};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::auth::{changes_state, STATELESS_POSTS};
use super::error::ApiError;
use super::tenants::AccessControl;

/// The origins browsers may call the state-changing routes from (`--allowed-origins`).
#[derive(Debug, Clone, Default)]
pub struct AllowedOrigins {
    /// Normalized `scheme://host[:port]`, lowercase, no trailing slash.
    origins: Vec<String>,
    /// `*`: any origin.
    any: bool,
}

impl AllowedOrigins {
    /// From the flag's entries (`https://app.example.com`, `http://localhost:3000`, or `*`).
    /// Refuses an entry that is not an origin, naming it.
    pub fn parse(entries: &[String]) -> Result<Self, String> {
        let mut out = Self::default();
        for entry in entries.iter().map(|e| e.trim()).filter(|e| !e.is_empty()) {
            if entry == "*" {
                out.any = true;
                continue;
            }
            let normalized = entry.trim_end_matches('/').to_ascii_lowercase();
            let valid = ["http://", "https://"].iter().any(|s| {
                normalized
                    .strip_prefix(s)
                    .is_some_and(|rest| origin_host(rest).is_some())
            });
            if !valid {
                return Err(format!(
                    "--allowed-origins: `{entry}` is not an origin (expected scheme://host[:port], \
                     e.g. https://app.example.com, or *)"
                ));
            }
            out.origins.push(normalized);
        }
        Ok(out)
    }

    fn allows(&self, origin: &str) -> bool {
        self.any || self.origins.iter().any(|o| o == origin)
    }

    /// Whether `host` (no port) is the host of an allowed origin.
    fn names(&self, host: &str) -> bool {
        self.origins.iter().any(|o| {
            o.split_once("://")
                .and_then(|(_, rest)| origin_host(rest))
                .is_some_and(|h| h == host)
        })
    }
}

/// The host of `host[:port]` (brackets of an IPv6 literal kept), or `None` when it has a path,
/// user info or nothing.
fn origin_host(authority: &str) -> Option<&str> {
    if authority.is_empty() || authority.contains(['/', '@', '?', '#', ' ']) {
        return None;
    }
    let host = if authority.starts_with('[') {
        &authority[..=authority.find(']')?]
    } else {
        authority.rsplit_once(':').map_or(authority, |(h, _)| h)
    };
    (!host.is_empty()).then_some(host)
}

/// Whether an open daemon answers a request addressed to `host` (the `Host` header, port
/// stripped, lowercase): an IP literal, `localhost` (or a name under it), or an allowed name.
fn host_allowed(host: &str, allowed: &AllowedOrigins) -> bool {
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    bare.parse::<IpAddr>().is_ok()
        || host == "localhost"
        || host.ends_with(".localhost")
        || allowed.names(host)
}

/// What the middleware needs: the allowed origins, and the key file (the `Host` rule applies
/// while no keys are required, which a SIGHUP may change).
#[derive(Debug, Clone)]
pub struct Hygiene {
    pub allowed_origins: Arc<AllowedOrigins>,
    pub access: Arc<AccessControl>,
}

/// The middleware (see the module docs).
pub async fn check(State(h): State<Hygiene>, req: Request, next: Next) -> Response {
    match refusal(req.method(), req.uri().path(), req.headers(), &h) {
        Some(e) => {
            tracing::info!(path = %req.uri().path(), "refused: {e}");
            e.into_response()
        }
        None => next.run(req).await,
    }
}

/// Why a request is refused, if it is.
fn refusal(method: &Method, path: &str, headers: &HeaderMap, h: &Hygiene) -> Option<ApiError> {
    let text = |name: header::HeaderName| {
        headers
            .get(name)
            .map(|v| v.to_str().map(|s| s.trim().to_ascii_lowercase()).ok())
    };
    let host = text(header::HOST);
    if path == "/health" || path == "/ready" {
        return None;
    }
    if !h.access.keys_required() {
        match &host {
            Some(None) => return Some(ApiError::Forbidden("the Host header is not text".into())),
            Some(Some(host)) => {
                let name = origin_host(host).unwrap_or("");
                if !host_allowed(name, &h.allowed_origins) {
                    return Some(ApiError::Forbidden(format!(
                        "this server answers requests addressed to an IP address or localhost, \
                         not to `{}` (DNS-rebinding protection while no --api-keys are set; \
                         add the name's origin to --allowed-origins or set --api-keys)",
                        printable(name)
                    )));
                }
            }
            None => {}
        }
    }
    // Generation and the tokenizer change nothing but are checked like state changes (JSON
    // only, same origin): a cross-site page must not spend this server's compute.
    let generation = method == Method::POST && STATELESS_POSTS.contains(&path);
    if generation {
        if let Some(ct) = text(header::CONTENT_TYPE) {
            let essence = ct
                .as_deref()
                .and_then(|c| c.split(';').next())
                .map(str::trim);
            let json = essence.is_some_and(|t| {
                t == "application/json" || (t.starts_with("application/") && t.ends_with("+json"))
            });
            if !json {
                return Some(ApiError::UnsupportedMediaType(format!(
                    "{path} takes a JSON body: send `Content-Type: application/json` (got `{}`)",
                    printable(essence.unwrap_or("?"))
                )));
            }
        }
    }
    let guarded = changes_state(method, path) || generation || path == "/v1/ws";
    if let (true, Some(origin)) = (guarded, text(header::ORIGIN)) {
        let origin = origin.unwrap_or_default();
        let same_origin = match (&host, origin.split_once("://")) {
            (Some(Some(host)), Some((_, authority))) => authority == host,
            _ => false,
        };
        if !same_origin && !h.allowed_origins.allows(&origin) {
            return Some(ApiError::Forbidden(format!(
                "cross-origin {method} {path} from `{}` refused: the origin is not in \
                 --allowed-origins",
                printable(&origin)
            )));
        }
    }
    None
}

/// `s` for an error message: at most 64 printable ASCII characters.
fn printable(s: &str) -> String {
    if s.len() <= 64 && s.chars().all(|c| c.is_ascii_graphic()) {
        s.to_string()
    } else {
        "<unprintable>".to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn hygiene(origins: &[&str], keys: bool) -> Hygiene {
        let access = if keys {
            let dir = std::env::temp_dir().join(format!("hygiene-keys-{}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            let file = dir.join("keys.json");
            std::fs::write(
                &file,
                r#"{"tenants": [{"name": "a", "keys": ["sk-a-1234567"], "variants": ["*"]}]}"#,
            )
            .unwrap();
            AccessControl::new(Some(&file), &[]).unwrap()
        } else {
            AccessControl::open()
        };
        Hygiene {
            allowed_origins: Arc::new(
                AllowedOrigins::parse(&origins.iter().map(|s| s.to_string()).collect::<Vec<_>>())
                    .unwrap(),
            ),
            access: Arc::new(access),
        }
    }

    fn headers(pairs: &[(header::HeaderName, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(k.clone(), HeaderValue::from_str(v).unwrap());
        }
        h
    }

    fn status(
        method: Method,
        path: &str,
        pairs: &[(header::HeaderName, &str)],
        h: &Hygiene,
    ) -> u16 {
        refusal(&method, path, &headers(pairs), h).map_or(200, |e| e.status().as_u16())
    }

    #[test]
    fn origins_parse_or_are_refused_by_name() {
        let o = AllowedOrigins::parse(&[
            "https://App.example.com/".into(),
            " http://[::1]:3000".into(),
        ])
        .unwrap();
        assert!(o.allows("https://app.example.com") && o.allows("http://[::1]:3000"));
        assert!(!o.allows("https://evil.example"));
        assert!(o.names("app.example.com") && !o.names("example.com"));
        assert!(AllowedOrigins::parse(&["*".into()])
            .unwrap()
            .allows("https://any"));
        for bad in [
            "app.example.com",
            "ftp://x",
            "https://",
            "https://a/b",
            "https://u@h",
        ] {
            let e = AllowedOrigins::parse(&[bad.into()]).unwrap_err();
            assert!(e.contains(bad) && e.contains("--allowed-origins"), "{e}");
        }
    }

    #[test]
    fn hosts_of_an_open_daemon_are_addresses_localhost_or_allowed_names() {
        let h = hygiene(&["https://gw.example.com"], false);
        let ok = |host: &str| status(Method::GET, "/v1/models", &[(header::HOST, host)], &h);
        for host in [
            "127.0.0.1:8000",
            "localhost:8000",
            "LOCALHOST",
            "[::1]:9",
            "10.0.0.7",
            "gw.example.com:8000",
            "a.localhost",
        ] {
            assert_eq!(ok(host), 200, "{host}");
        }
        assert_eq!(ok("evil.example:8000"), 403);
        assert_eq!(ok("127.0.0.1.evil.example"), 403);
        let e = refusal(
            &Method::GET,
            "/v1/models",
            &headers(&[(header::HOST, "evil.example:80")]),
            &h,
        )
        .unwrap();
        assert!(
            e.to_string().contains("`evil.example`") && e.to_string().contains("--api-keys"),
            "{e}"
        );
        assert_eq!(
            status(Method::GET, "/v1/models", &[], &h),
            200,
            "no Host: not a browser"
        );
        assert_eq!(
            status(
                Method::GET,
                "/health",
                &[(header::HOST, "evil.example")],
                &h
            ),
            200
        );
        let keyed = hygiene(&[], true);
        assert_eq!(
            status(
                Method::GET,
                "/v1/models",
                &[(header::HOST, "api.example.com")],
                &keyed
            ),
            200,
            "with --api-keys any name may reach the daemon"
        );
    }

    #[test]
    fn cross_origin_state_changes_need_an_allowed_origin() {
        let h = hygiene(&["https://ui.example.com"], false);
        let host = (header::HOST, "127.0.0.1:8000");
        let json = (header::CONTENT_TYPE, "application/json");
        let post = |path: &str, origin: &str| {
            status(
                Method::POST,
                path,
                &[host.clone(), json.clone(), (header::ORIGIN, origin)],
                &h,
            )
        };
        assert_eq!(post("/v1/adapters", "https://evil.example"), 403);
        assert_eq!(post("/v1/completions", "https://evil.example"), 403);
        assert_eq!(post("/v1/adapters", "null"), 403);
        assert_eq!(post("/v1/adapters", "https://ui.example.com"), 200);
        assert_eq!(
            post("/v1/adapters", "http://127.0.0.1:8000"),
            200,
            "same origin"
        );
        assert_eq!(
            status(
                Method::DELETE,
                "/v1/adapters/x",
                &[host.clone(), (header::ORIGIN, "https://evil.example")],
                &h
            ),
            403
        );
        assert_eq!(
            status(
                Method::GET,
                "/v1/ws",
                &[host.clone(), (header::ORIGIN, "https://evil.example")],
                &h
            ),
            403,
            "cross-site WebSocket hijacking"
        );
        assert_eq!(
            status(
                Method::GET,
                "/v1/models",
                &[host.clone(), (header::ORIGIN, "https://evil.example")],
                &h
            ),
            200,
            "reads are the browser's same-origin policy's"
        );
        assert_eq!(
            status(
                Method::POST,
                "/v1/adapters",
                &[host.clone(), json.clone()],
                &h
            ),
            200,
            "no Origin: curl"
        );
        let e = refusal(
            &Method::POST,
            "/v1/adapters",
            &headers(&[host, (header::ORIGIN, "https://evil.example")]),
            &h,
        )
        .unwrap();
        assert!(
            e.to_string().contains("https://evil.example")
                && e.to_string().contains("--allowed-origins")
        );
    }

    #[tokio::test]
    async fn the_router_answers_refusals_as_openai_errors_with_the_request_id() {
        use crate::api::fake::FakeBackend;
        use crate::engine::FinishReason;
        use http_body_util::BodyExt;
        use tower::ServiceExt;

        let fake = FakeBackend::new(FakeBackend::tokens(&["x"], FinishReason::Stop));
        let app = super::super::router_with(fake);
        let send = |host: &str, origin: Option<&str>| {
            let mut req = axum::http::Request::builder()
                .method("POST")
                .uri("/v1/completions")
                .header("host", host)
                .header("content-type", "application/json");
            if let Some(o) = origin {
                req = req.header("origin", o);
            }
            let req = req
                .body(axum::body::Body::from(r#"{"prompt": "a"}"#))
                .unwrap();
            app.clone().oneshot(req)
        };
        let response = send("127.0.0.1:8000", Some("https://evil.example"))
            .await
            .unwrap();
        assert_eq!(response.status(), 403);
        let id = response.headers()["x-request-id"]
            .to_str()
            .unwrap()
            .to_string();
        let body = response.into_body().collect().await.unwrap().to_bytes();
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["error"]["type"], "permission_error", "{v}");
        assert_eq!(v["error"]["request_id"], id.as_str(), "{v}");
        let rebound = send("evil.example:8000", None).await.unwrap();
        assert_eq!(rebound.status(), 403);
        for host in ["127.0.0.1:8000", "localhost:8000"] {
            let ok = send(host, None).await.unwrap();
            assert_eq!(ok.status(), 200, "{host}");
        }
    }

    #[test]
    fn generation_bodies_typed_as_anything_but_json_are_415() {
        let h = hygiene(&[], false);
        let post = |ct: &str| {
            status(
                Method::POST,
                "/v1/chat/completions",
                &[(header::CONTENT_TYPE, ct)],
                &h,
            )
        };
        assert_eq!(post("text/plain"), 415);
        assert_eq!(post("application/x-www-form-urlencoded"), 415);
        assert_eq!(post("multipart/form-data; boundary=x"), 415);
        assert_eq!(post("application/json; charset=utf-8"), 200);
        assert_eq!(post("application/vnd.api+json"), 200);
        assert_eq!(
            status(Method::POST, "/v1/completions", &[], &h),
            200,
            "untyped: parsed as JSON"
        );
    }
}
