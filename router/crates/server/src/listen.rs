//! The accept loop: what `axum::serve` does here (HTTP/1 with upgrades for `/v1/ws`, graceful
//! shutdown; this build of axum has no HTTP/2), plus the connection limit it cannot set: a client must send its request headers
//! within `--header-read-timeout-s`, or its connection is closed.
//!
//! Without it a client that opens a connection and sends half a request line holds that
//! connection (a socket and a task) for as long as it likes; a few thousand such clients
//! exhaust the file descriptors (slowloris). hyper's HTTP/1 header read timeout needs a timer,
//! which `axum::serve` does not give it, so the connections are served here by hyper's
//! HTTP/1 builder. The same timeout closes a keep-alive connection that stays idle that
//! long between requests (hyper starts it whenever it waits for a request head); a response
//! being streamed (SSE) or an upgraded WebSocket is not affected. It is also the longest pause
//! allowed inside a request body ([`StallGuardBody`]): a client that sends its headers and part
//! of its body, then nothing, gets a 400 once it passes, and its connection closes.

use std::future::Future;
use std::time::Duration;

use std::pin::Pin;
use std::task::{Context, Poll};

use axum::extract::{Request, State};
use axum::{middleware, Router};
use hyper::body::{Body, Bytes, Frame, SizeHint};
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::watch;

/// `--header-read-timeout-s`'s default.
pub const DEFAULT_HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// Serves `app` on `listener` until `shutdown` resolves; then stops accepting, lets each
/// connection finish its request in flight, and returns once every connection closed.
/// `header_read_timeout`: how long a client may take to send a request's headers (`None`: no
/// limit).
pub async fn serve(
    listener: TcpListener,
    app: Router,
    header_read_timeout: Option<Duration>,
    shutdown: impl Future<Output = ()>,
) {
    let app = match header_read_timeout {
        Some(limit) => app.layer(middleware::map_request_with_state(limit, guard_body)),
        None => app,
    };
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(header_read_timeout);
    // `stop` tells every connection to finish; each holds a `closed` receiver until it ends.
    let (stop_tx, stop_rx) = watch::channel(());
    let (closed_tx, closed_rx) = watch::channel(());
    tokio::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => without_nagle(stream),
                Err(e) => {
                    on_accept_error(e).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let service = TowerToHyperService::new(app.clone());
        let conn = builder
            .serve_connection(TokioIo::new(stream), service)
            .with_upgrades();
        let mut stop = stop_rx.clone();
        let closed = closed_rx.clone();
        tokio::spawn(async move {
            tokio::pin!(conn);
            let ended = tokio::select! {
                ended = conn.as_mut() => ended,
                _ = stop.changed() => {
                    // Ends after the request in flight (an idle connection at once).
                    conn.as_mut().graceful_shutdown();
                    conn.await
                }
            };
            if let Err(e) = ended {
                // A client that went away, sent garbage, or was too slow with its headers.
                tracing::debug!("connection ended with an error: {e}");
            }
            drop(closed);
        });
    }
    drop(listener);
    let _ = stop_tx.send(());
    drop(closed_rx);
    closed_tx.closed().await;
}

/// Wraps the request's body in a [`StallGuardBody`].
async fn guard_body(State(limit): State<Duration>, req: Request) -> Request {
    req.map(|body| axum::body::Body::new(StallGuardBody::new(body, limit)))
}

/// A request body that fails once no data came for `limit` while it was being read (the reader
/// then answers 400 and hyper closes the connection, which cannot be reused mid-body).
pub struct StallGuardBody {
    inner: axum::body::Body,
    limit: Duration,
    /// Runs while the reader waits for data; reset by each frame.
    stalled: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl StallGuardBody {
    /// Guards `inner`: at most `limit` without data while it is read.
    pub fn new(inner: axum::body::Body, limit: Duration) -> Self {
        Self {
            inner,
            limit,
            stalled: None,
        }
    }
}

impl Body for StallGuardBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let this = self.get_mut();
        if let Poll::Ready(frame) = Pin::new(&mut this.inner).poll_frame(cx) {
            this.stalled = None;
            return Poll::Ready(frame);
        }
        let limit = this.limit;
        let stalled = this
            .stalled
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        if stalled.as_mut().poll(cx).is_ready() {
            let why = format!(
                "the request body stalled: no data for {} s (--header-read-timeout-s)",
                limit.as_secs_f64()
            );
            return Poll::Ready(Some(Err(axum::Error::new(why))));
        }
        Poll::Pending
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// `stream` with Nagle's algorithm off (`TCP_NODELAY`). Token events are small writes; with it
/// on, a write behind an unacknowledged one waits for the client's delayed ACK (40 ms on Linux).
/// Measured on an H200 (S-LoRA S2, 8 req/s over 4 WebSockets): of the first tokens the worker
/// sent within 35 ms of their request's send, 90-93 % reached the client 40-55 ms after it
/// (+12 ms of mean TTFT; a request's last token, 0.7 ms). A socket that refuses the option is
/// served as it is.
fn without_nagle(stream: tokio::net::TcpStream) -> tokio::net::TcpStream {
    if let Err(e) = stream.set_nodelay(true) {
        tracing::debug!("could not set TCP_NODELAY on a connection: {e}");
    }
    stream
}

/// An accept that failed: a connection reset before it was accepted is skipped; anything else
/// (out of file descriptors) is logged and retried a moment later, as `axum::serve` does.
async fn on_accept_error(e: std::io::Error) {
    use std::io::ErrorKind::{ConnectionAborted, ConnectionRefused, ConnectionReset};
    if matches!(
        e.kind(),
        ConnectionRefused | ConnectionAborted | ConnectionReset
    ) {
        return;
    }
    tracing::error!("accepting a connection failed: {e}; retrying in 1 s");
    tokio::time::sleep(Duration::from_secs(1)).await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::routing::{get, post};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    async fn server(timeout: Duration) -> (std::net::SocketAddr, tokio::sync::oneshot::Sender<()>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app = Router::new()
            .route("/health", get(|| async { "ok" }))
            .route("/echo", post(|body: String| async move { body }));
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(serve(listener, app, Some(timeout), async {
            let _ = stopped.await;
        }));
        (addr, stop)
    }

    /// Reads until the server closes the connection; the bytes read.
    async fn until_closed(conn: &mut TcpStream) -> Vec<u8> {
        let mut got = Vec::new();
        let _ = conn.read_to_end(&mut got).await;
        got
    }

    #[tokio::test]
    async fn accepted_connections_write_without_nagle() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap());
        let ((accepted, _), _client) =
            tokio::join!(async { listener.accept().await.unwrap() }, client);
        assert!(!accepted.nodelay().unwrap(), "the OS default: Nagle on");
        assert!(without_nagle(accepted).nodelay().unwrap());
    }

    #[tokio::test]
    async fn half_a_request_line_is_closed_after_the_header_timeout() {
        let (addr, _stop) = server(Duration::from_millis(300)).await;
        let mut conn = TcpStream::connect(addr).await.unwrap();
        conn.write_all(b"GET /hea").await.unwrap();
        let started = tokio::time::Instant::now();
        let got = tokio::time::timeout(Duration::from_secs(5), until_closed(&mut conn))
            .await
            .expect("the stalled connection should be closed by the server");
        assert!(started.elapsed() >= Duration::from_millis(250));
        // hyper answers 408 or just closes; either way nothing is served.
        assert!(!String::from_utf8_lossy(&got).contains("ok"), "{got:?}");
    }

    #[tokio::test]
    async fn a_body_that_stalls_is_refused_and_one_that_flows_is_read() {
        let (addr, _stop) = server(Duration::from_millis(300)).await;
        let mut slow = TcpStream::connect(addr).await.unwrap();
        let head =
            "POST /echo HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 6\r\n\r\n";
        slow.write_all(head.as_bytes()).await.unwrap();
        for part in [b"ab", b"cd", b"ef"] {
            tokio::time::sleep(Duration::from_millis(150)).await; // slow, never stalled
            slow.write_all(part).await.unwrap();
        }
        let got = String::from_utf8(until_closed(&mut slow).await).unwrap();
        assert!(
            got.starts_with("HTTP/1.1 200") && got.ends_with("abcdef"),
            "{got}"
        );

        let mut stalled = TcpStream::connect(addr).await.unwrap();
        stalled.write_all(head.as_bytes()).await.unwrap();
        stalled.write_all(b"ab").await.unwrap();
        let got = tokio::time::timeout(Duration::from_secs(5), until_closed(&mut stalled))
            .await
            .expect("a stalled body must not hold the connection");
        let got = String::from_utf8(got).unwrap();
        assert!(got.starts_with("HTTP/1.1 400"), "{got}");
    }

    #[tokio::test]
    async fn whole_requests_are_served_and_shutdown_waits_for_none_stalled() {
        let (addr, stop) = server(Duration::from_millis(300)).await;
        let mut conn = TcpStream::connect(addr).await.unwrap();
        conn.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let got = String::from_utf8(until_closed(&mut conn).await).unwrap();
        assert!(
            got.starts_with("HTTP/1.1 200") && got.ends_with("ok"),
            "{got}"
        );
        let mut stalled = TcpStream::connect(addr).await.unwrap();
        stalled
            .write_all(b"GET /health HTTP/1.1\r\nHo")
            .await
            .unwrap();
        let _ = stop.send(());
        tokio::time::timeout(Duration::from_secs(5), until_closed(&mut stalled))
            .await
            .expect("a stalled client must not hold the shutdown");
    }
}
