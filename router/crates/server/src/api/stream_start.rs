//! When a streamed response's status is sent. Without a TTFT SLO, at once: the SSE stream opens
//! while the request is still queued, and a later failure is an `error` event in it. With
//! `--ttft-slo-ms` the engine answers a request that waits in the queue past the SLO with a 429
//! (S-LoRA's early abort, `engine/actor/expired.rs`), so a streamed request's status waits for
//! each choice's first piece: a request that expires gets that 429 status, `Retry-After`
//! included, like a non-streamed one, and a 200 stream is never cut by an expiry. The wait is
//! bounded: a request leaves the queue, or expires, within the SLO.

use super::error::ApiError;
use super::{Backend, Piece, Pieces};

/// Waits, when `backend` expires queued requests, for every choice's first piece; the first
/// choice that failed before producing anything fails the whole response (dropping the others
/// cancels them). The pieces taken are put back, so the stream starts with them.
pub(crate) async fn started<B: Backend>(
    backend: &B,
    mut choices: Vec<Pieces>,
) -> Result<Vec<Pieces>, ApiError> {
    if !backend.expires_queued_requests() {
        return Ok(choices);
    }
    for pieces in &mut choices {
        match pieces.next().await {
            Some(Piece::Failed(e)) => return Err(e),
            Some(piece) => pieces.put_back(piece),
            None => {}
        }
    }
    Ok(choices)
}

#[cfg(test)]
mod tests {
    use crate::engine::GenerateEvent;

    use crate::api::fake::FakeBackend;
    use crate::api::router_with;
    use crate::api::test_http::{error_fields, post_json, sse_data};
    use crate::engine::{FinishReason, SLO_EXPIRED};

    const STREAMED: &str = r#"{"prompt": "hi", "max_tokens": 3, "stream": true}"#;

    fn expiring(expires_queued: bool) -> FakeBackend {
        let message = format!("{SLO_EXPIRED}the request waited over --ttft-slo-ms (100 ms)");
        let mut fake = FakeBackend::new(super::super::fake::Script::Events(vec![
            GenerateEvent::Error { message },
        ]));
        fake.expires_queued = expires_queued;
        fake
    }

    #[tokio::test]
    async fn an_expired_stream_is_answered_429_when_the_engine_expires_queued_requests() {
        for path in ["/v1/completions", "/generate_stream"] {
            let body = if path == "/generate_stream" {
                r#"{"inputs": "hi", "parameters": {"max_new_tokens": 3}}"#
            } else {
                STREAMED
            };
            let (status, headers, body) = post_json(router_with(expiring(true)), path, body).await;
            assert_eq!(status, 429, "{path}: {body}");
            assert!(headers.get("retry-after").is_some(), "{path}: {headers:?}");
            let (kind, param, message) = error_fields(&body);
            assert_eq!(kind, "rate_limit_error", "{path}");
            assert_eq!(param.as_deref(), Some("ttft_slo_ms"), "{path}");
            assert!(message.starts_with(SLO_EXPIRED), "{path}: {message}");
        }
        let chat = r#"{"messages": [{"role": "user", "content": "hi"}], "stream": true, "n": 2}"#;
        let (status, _, body) =
            post_json(router_with(expiring(true)), "/v1/chat/completions", chat).await;
        assert_eq!(status, 429, "{body}");
        // A whole (non-streamed) answer waits anyway: its status is the expiry's, SLO or not.
        let whole = r#"{"prompt": "hi", "max_tokens": 3}"#;
        let (status, _, body) =
            post_json(router_with(expiring(false)), "/v1/completions", whole).await;
        assert_eq!(status, 429, "{body}");
    }

    #[tokio::test]
    async fn without_an_slo_the_stream_opens_at_once_and_carries_the_error() {
        let (status, _, body) =
            post_json(router_with(expiring(false)), "/v1/completions", STREAMED).await;
        assert_eq!(status, 200);
        let data = sse_data(&body);
        assert!(data[0].contains("slo_exceeded"), "{data:?}");
    }

    #[tokio::test]
    async fn a_held_stream_starts_with_the_piece_it_waited_for() {
        let mut fake = FakeBackend::new(FakeBackend::tokens(&["Hi", "!"], FinishReason::Length));
        fake.expires_queued = true;
        let (status, _, body) = post_json(router_with(fake), "/v1/completions", STREAMED).await;
        assert_eq!(status, 200);
        let texts: Vec<String> = sse_data(&body)
            .iter()
            .filter(|d| *d != "[DONE]")
            .map(|d| serde_json::from_str::<serde_json::Value>(d).unwrap())
            .map(|c| c["choices"][0]["text"].as_str().unwrap_or("").to_string())
            .collect();
        assert_eq!(texts.concat(), "Hi!");
        assert_eq!(texts[0], "Hi", "the first piece is not lost");
    }
}
