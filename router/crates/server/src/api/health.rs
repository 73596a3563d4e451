//! Liveness, readiness and Prometheus metrics.
//!
//! - `GET /health`: 200 `{"status":"ok"}` while the process serves HTTP at all.
//! - `GET /ready`: 200 when the engine can take requests, else 503 with `Retry-After`.
//! - `GET /version`: `{"version": "0.1.0"}`, the server's release (vLLM's route, for clients
//!   that check what they talk to).
//! - `GET /metrics`: Prometheus text format: engine gauges, counters and latency histograms
//!   (`deltaserve_*`, declared in `engine::metrics`) and the API's error counts per error type.

use axum::extract::State;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use super::auth::Requester;
use super::error::{error_counts, RETRY_AFTER_SECS};
use super::Backend;
use crate::engine::metrics as engine_metrics;

/// `GET /health`.
pub async fn health() -> Json<serde_json::Value> {
    Json(json!({"status": "ok"}))
}

/// `GET /version`.
pub async fn version() -> Json<serde_json::Value> {
    Json(json!({"version": env!("CARGO_PKG_VERSION")}))
}

/// `GET /ready`.
pub async fn ready<B: Backend>(State(backend): State<B>) -> Response {
    if backend.is_ready() {
        (StatusCode::OK, Json(json!({"status": "ready"}))).into_response()
    } else {
        let mut r = (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "not_ready"})),
        )
            .into_response();
        r.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from(RETRY_AFTER_SECS));
        r
    }
}

/// `GET /metrics`: the engine's table (`engine::metrics`), its latency histograms, then the API's
/// error counts.
pub async fn metrics<B: Backend>(State(backend): State<B>, who: Requester) -> Response {
    let m = backend.metrics().await;
    let mut families = engine_metrics::families(&m);
    families.push(engine_metrics::labeled_counter(
        "deltaserve_api_errors_total",
        "Error responses by error type.",
        "type",
        &error_counts(),
    ));
    let substituted = backend.model().adapters.substitutions().counts();
    if !substituted.is_empty() {
        // A family without samples is not written (the text encoder refuses one).
        let counts: Vec<(&str, u64)> = substituted.iter().map(|(v, n)| (v.as_str(), *n)).collect();
        families.push(engine_metrics::labeled_counter(
            "deltaserve_zoo_substituted_tokens_total",
            "Tokens (prompt and completion, per choice) zoo variants served with their substitute under load (--substitute-above), by variant.",
            "variant",
            &counts,
        ));
    }
    families.extend(who.access.usage.families());
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        engine_metrics::text(&families),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use crate::api::fake::FakeBackend;
    use crate::api::router_with;
    use crate::api::test_http::send;
    use crate::engine::FinishReason;

    #[tokio::test]
    async fn health_ready_and_metrics() {
        let mut fake = FakeBackend::new(FakeBackend::tokens(&[], FinishReason::Stop));
        let (status, _, body) = send(router_with(fake.clone()), "GET", "/health", None, "").await;
        assert_eq!(
            (status.as_u16(), body.as_str()),
            (200, r#"{"status":"ok"}"#)
        );
        let (status, _, _) = send(router_with(fake.clone()), "GET", "/ready", None, "").await;
        assert_eq!(status, 200);
        let (status, _, body) = send(router_with(fake.clone()), "GET", "/metrics", None, "").await;
        assert_eq!(status, 200);
        for line in [
            "deltaserve_requests_running 2",
            "deltaserve_kv_blocks_free 7",
            "deltaserve_kv_blocks_total 10",
            "deltaserve_deltas_on_gpu 1",
            "# TYPE deltaserve_delta_skips_total counter",
            "deltaserve_delta_skips_total 5",
            "deltaserve_delta_skip_preemptions_total 2",
            "deltaserve_adapter_host_deferrals_total 3",
            "# TYPE deltaserve_adapter_gpu_load_deferrals_total counter",
            "deltaserve_adapter_gpu_load_deferrals_total 4",
            "# TYPE deltaserve_worker_step_us_total counter",
            "deltaserve_worker_step_us_total 900",
            "deltaserve_worker_forward_us_total 800",
            "# TYPE deltaserve_steps_total counter",
            "deltaserve_api_errors_total{type=\"invalid_request_error\"}",
        ] {
            assert!(body.contains(line), "{line:?} missing from\n{body}");
        }
        fake.ready = false;
        let (status, headers, _) = send(router_with(fake), "GET", "/ready", None, "").await;
        assert_eq!(status, 503);
        assert!(headers.contains_key("retry-after"));
    }

    #[tokio::test]
    async fn metrics_has_the_latency_histograms() {
        let fake = FakeBackend::new(FakeBackend::tokens(&[], FinishReason::Stop));
        let (_, _, body) = send(router_with(fake), "GET", "/metrics", None, "").await;
        for name in [
            "time_to_first_token_seconds",
            "time_per_output_token_seconds",
            "e2e_request_latency_seconds",
            "request_queue_time_seconds",
        ] {
            for line in [
                format!("# TYPE deltaserve_{name} histogram\n"),
                format!("deltaserve_{name}_bucket{{le=\"+Inf\"}} 0\n"),
                format!("deltaserve_{name}_count 0\n"),
            ] {
                assert!(body.contains(&line), "{line:?} missing from\n{body}");
            }
        }
    }
}
