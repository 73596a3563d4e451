//! Liveness, readiness and Prometheus metrics.
//!
//! - `GET /health`: 200 `{"status":"ok"}` while the process serves HTTP at all.
//! - `GET /ready`: 200 when the engine can take requests, else 503 with `Retry-After`.
//! - `GET /metrics`: Prometheus text format: engine gauges and counters (`deltaserve_*`) and
//!   the API's error counts per error type.

use std::fmt::Write;

use axum::extract::State;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use super::error::{error_counts, RETRY_AFTER_SECS};
use super::Backend;

/// `GET /health`.
pub async fn health() -> Json<serde_json::Value> {
    Json(json!({"status": "ok"}))
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

/// `GET /metrics`.
pub async fn metrics<B: Backend>(State(backend): State<B>) -> Response {
    let m = backend.metrics().await;
    let mut out = String::new();
    let mut metric = |name: &str, kind: &str, help: &str, value: u64| {
        let _ = writeln!(out, "# HELP deltaserve_{name} {help}\n# TYPE deltaserve_{name} {kind}\ndeltaserve_{name} {value}");
    };
    metric(
        "requests_waiting",
        "gauge",
        "Requests queued, not yet running.",
        m.requests_waiting,
    );
    metric(
        "requests_running",
        "gauge",
        "Requests in the running batch.",
        m.requests_running,
    );
    metric(
        "kv_blocks_total",
        "gauge",
        "KV cache pages in the pool.",
        m.kv_blocks_total,
    );
    metric(
        "kv_blocks_free",
        "gauge",
        "KV cache pages free.",
        m.kv_blocks_free,
    );
    metric("steps_total", "counter", "Engine steps run.", m.steps_total);
    metric(
        "steps_ahead_total",
        "counter",
        "Steps sent before the previous step's output was back (overlapped steps).",
        m.steps_ahead_total,
    );
    metric(
        "preemptions_total",
        "counter",
        "Requests preempted to free KV pages.",
        m.preemptions_total,
    );
    metric(
        "requests_finished_total",
        "counter",
        "Requests that ended (stop or length).",
        m.requests_finished_total,
    );
    metric(
        "requests_aborted_total",
        "counter",
        "Requests cancelled by their client.",
        m.requests_aborted_total,
    );
    metric(
        "tokens_generated_total",
        "counter",
        "Output tokens generated.",
        m.tokens_generated_total,
    );
    metric(
        "step_gap_us_p50",
        "gauge",
        "Median router + IPC gap between worker steps, microseconds.",
        m.step_gap_us_p50,
    );
    metric(
        "step_gap_us_p99",
        "gauge",
        "99th percentile router + IPC gap between worker steps, microseconds.",
        m.step_gap_us_p99,
    );
    metric("step_router_us_p50", "gauge", "Median time from a worker's step output to the router sending the next plan, microseconds (the router's share of the gap).", m.step_router_us_p50);
    metric(
        "step_router_us_p99",
        "gauge",
        "99th percentile of the router's share of the step gap, microseconds.",
        m.step_router_us_p99,
    );
    metric(
        "worker_restarts_total",
        "counter",
        "Worker processes restarted.",
        m.worker_restarts_total,
    );
    metric(
        "adapters_registered",
        "gauge",
        "Variants (LoRA adapters and compressed deltas) registered and selectable.",
        m.adapters_registered,
    );
    metric(
        "adapters_on_gpu",
        "gauge",
        "LoRA adapters whose weights are in a GPU pool.",
        m.adapters_on_gpu,
    );
    metric(
        "adapter_blocks",
        "gauge",
        "Pool pages holding adapter weights (the other used pages hold KV).",
        m.adapter_blocks,
    );
    metric(
        "adapter_host_bytes",
        "gauge",
        "Host-memory bytes of adapter copies, as the schedulers account them.",
        m.adapter_host_bytes,
    );
    metric(
        "adapter_host_bytes_measured",
        "gauge",
        "Host-memory bytes of adapter copies, as the workers measured them after their last step.",
        m.adapter_host_bytes_measured,
    );
    metric(
        "adapter_gpu_loads_total",
        "counter",
        "Adapter copies from host memory onto the GPU (LoRA pool pages or delta slots).",
        m.adapter_gpu_loads_total,
    );
    metric(
        "adapter_host_loads_total",
        "counter",
        "Adapter reads (LoRA and delta) from disk into host memory.",
        m.adapter_host_loads_total,
    );
    metric(
        "adapter_gpu_evictions_total",
        "counter",
        "Adapters evicted from the GPU to make room (LoRA pool pages or delta slots).",
        m.adapter_gpu_evictions_total,
    );
    metric(
        "adapter_host_deferrals_total",
        "counter",
        "Times a waiting request was passed over for a step because its adapter's host read was still running (it keeps its place).",
        m.adapter_host_deferrals_total,
    );
    metric(
        "worker_step_us_total",
        "counter",
        "Worker time of the steps run (plan decoded to output encoded), microseconds.",
        m.worker_step_us_total,
    );
    metric(
        "worker_forward_us_total",
        "counter",
        "The forward-and-sampling part of that worker time, microseconds (the rest: adapter ops, waits for adapter loads included, and batch building).",
        m.worker_forward_us_total,
    );
    metric(
        "deltas_on_gpu",
        "gauge",
        "Compressed deltas in the workers' delta slots (at most --max-deltas per worker).",
        m.deltas_on_gpu,
    );
    metric(
        "delta_skips_total",
        "counter",
        "Requests admitted past a blocked queue head because their delta was already running (DeltaZip's skip-the-line).",
        m.delta_skips_total,
    );
    metric(
        "delta_skip_preemptions_total",
        "counter",
        "Skip-the-line requests preempted (recomputed later) because their delta's last in-order request left.",
        m.delta_skip_preemptions_total,
    );
    let _ = writeln!(out, "# HELP deltaserve_api_errors_total Error responses by error type.\n# TYPE deltaserve_api_errors_total counter");
    for (kind, count) in error_counts() {
        let _ = writeln!(
            out,
            "deltaserve_api_errors_total{{type=\"{kind}\"}} {count}"
        );
    }
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        out,
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
}
