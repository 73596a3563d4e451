//! Graceful shutdown with a deadline (SIGTERM / Ctrl-C: the `shutdown` future of [`crate::run`]).
//!
//! ```text
//!  shutdown resolves ─▶ draining: every route but /health and /metrics answers 503 +
//!                       Retry-After (so /ready is 503: load balancers stop sending)
//!                     ─▶ in-flight requests finish, up to --drain-timeout; then the engine ends
//!                        the rest with an error event
//!                     ─▶ the HTTP server stops: idle keep-alive connections close; connections
//!                        still open CLOSE_GRACE later (a client stalled mid-headers, a reader
//!                        that never reads) are dropped
//!                     ─▶ the engine's last handle goes: the workers stop, their IPC files go
//! ```

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::Router;
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::engine::EngineHandle;

/// `--drain-timeout`'s default.
pub const DEFAULT_DRAIN_TIMEOUT: Duration = Duration::from_secs(30);
/// How long connections may stay open once the drain is over.
pub const CLOSE_GRACE: Duration = Duration::from_secs(2);
/// `Retry-After` of the 503s while draining (another replica, or this one restarted).
pub const RETRY_AFTER_S: u64 = 5;
/// How often the drain checks for requests still in flight.
const POLL: Duration = Duration::from_millis(20);

/// Whether the server is draining, shared by the guard layer and the shutdown sequence.
#[derive(Debug, Clone, Default)]
pub struct Drain {
    draining: Arc<AtomicBool>,
}

impl Drain {
    /// True once shutdown began.
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }

    /// Starts draining: new requests are refused from now on.
    pub fn begin(&self) {
        self.draining.store(true, Ordering::Release);
    }

    /// `app` behind the guard that refuses requests while draining.
    pub fn guard(&self, app: Router) -> Router {
        app.layer(middleware::from_fn_with_state(
            self.clone(),
            refuse_while_draining,
        ))
    }

    /// Waits for `shutdown`, then drains `engine`: returns once no request is in flight, or
    /// after `timeout` once the engine ended the rest with an error event.
    pub async fn drain_after(
        &self,
        shutdown: impl Future<Output = ()>,
        engine: EngineHandle,
        timeout: Duration,
    ) {
        shutdown.await;
        self.begin();
        let in_flight = engine.outstanding();
        tracing::info!(
            in_flight,
            "draining: new requests get 503; waiting up to {timeout:?} for the rest"
        );
        if !wait_idle(&engine, timeout).await {
            let left = engine.outstanding();
            tracing::warn!(left, "drain timeout: ending the requests still in flight");
            engine.abort_all(format!(
                "the server is shutting down and this request did not finish within the drain \
                 timeout ({}s)",
                timeout.as_secs_f64()
            ));
            wait_idle(&engine, Duration::from_secs(1)).await;
        }
    }
}

/// Polls until `engine` has no request in flight (true) or `timeout` passed (false).
async fn wait_idle(engine: &EngineHandle, timeout: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + timeout;
    while engine.outstanding() > 0 {
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(POLL).await;
    }
    true
}

/// 503 + `Retry-After` for everything but `/health` and `/metrics` while draining.
async fn refuse_while_draining(State(drain): State<Drain>, req: Request, next: Next) -> Response {
    let path = req.uri().path();
    if !drain.is_draining() || path == "/health" || path == "/metrics" {
        return next.run(req).await;
    }
    let body = serde_json::json!({"error": {
        "message": "the server is shutting down; retry on another replica or shortly",
        "type": "service_unavailable",
        "param": null,
        "code": "shutting_down",
    }});
    (
        StatusCode::SERVICE_UNAVAILABLE,
        [
            (header::RETRY_AFTER, RETRY_AFTER_S.to_string()),
            (header::CONNECTION, "close".to_string()),
        ],
        axum::Json(body),
    )
        .into_response()
}

/// Serves `app` (already holding `engine`) on `listener` until `shutdown`, then drains as the
/// module says; returns once the server stopped and every connection is closed or dropped.
/// `header_read_timeout`: `--header-read-timeout-s` ([`crate::listen`]).
pub async fn serve_until_drained(
    app: Router,
    engine: EngineHandle,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
    timeout: Duration,
    header_read_timeout: Option<Duration>,
) -> std::io::Result<()> {
    let drain = Drain::default();
    let app = drain.guard(app);
    let (drained_tx, mut drained) = watch::channel(false);
    let stop = async move {
        drain.drain_after(shutdown, engine, timeout).await;
        let _ = drained_tx.send(true);
    };
    let server = crate::listen::serve(listener, app, header_read_timeout, stop);
    tokio::pin!(server);
    tokio::select! {
        () = &mut server => Ok(()),
        _ = async {
            let _ = drained.wait_for(|done| *done).await;
            tokio::time::sleep(CLOSE_GRACE).await;
        } => {
            tracing::warn!("connections still open {CLOSE_GRACE:?} after the drain: closing them");
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use axum::routing::get;
    use tower::ServiceExt;

    async fn status_of(app: Router, path: &str) -> (u16, Option<String>) {
        let res = app
            .oneshot(axum::http::Request::get(path).body(Body::empty()).unwrap())
            .await
            .unwrap();
        let retry = res
            .headers()
            .get(header::RETRY_AFTER)
            .map(|v| v.to_str().unwrap().to_string());
        (res.status().as_u16(), retry)
    }

    #[tokio::test]
    async fn draining_refuses_all_but_health_and_metrics() {
        let drain = Drain::default();
        let app = drain.guard(
            Router::new()
                .route("/ready", get(|| async { "ok" }))
                .route("/health", get(|| async { "ok" }))
                .route("/metrics", get(|| async { "ok" }))
                .route("/v1/models", get(|| async { "ok" })),
        );
        assert_eq!(status_of(app.clone(), "/ready").await, (200, None));
        drain.begin();
        let five = Some(RETRY_AFTER_S.to_string());
        assert_eq!(status_of(app.clone(), "/ready").await, (503, five.clone()));
        assert_eq!(status_of(app.clone(), "/v1/models").await, (503, five));
        assert_eq!(status_of(app.clone(), "/health").await.0, 200);
        assert_eq!(status_of(app, "/metrics").await.0, 200);
    }
}
