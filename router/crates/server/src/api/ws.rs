//! `GET /v1/ws`: a WebSocket carrying many concurrent generations, each named by a client id.
//!
//! ```text
//!  client → server   {"type":"generate","id":"a","request":{<completions body, or chat body with "messages">}}
//!                    {"type":"cancel","id":"a"}
//!                    {"type":"auth","key":"sk-..."}   first message, when keys are required and the
//!                                                     upgrade request had no Authorization header
//!  server → client   {"type":"token","id":"a","text":"Hel","token_id":42,"logprob":-0.1?,"top_logprobs":[..]?}
//!                    {"type":"done","id":"a","finish_reason":"stop"|"length"|"abort","usage":{..}}
//!                    {"type":"error","id":"a"?,"error":{"message","type","param","code"}}
//!                    {"type":"authenticated","tenant":"acme"}   the answer to `auth` (a refused key:
//!                                                     an error without id, then the socket closes)
//!                    a message over the size limit or a frame that cannot be read: an error without
//!                    id, then the socket closes (1009 message too big, 1002 protocol error)
//! ```
//!
//! # Tasks
//!
//! ```text
//!   socket reader loop ──spawn──▶ generation task (one per id) ──┐
//!        │  ▲ ended ids (mpsc)          │ owns the event receiver │ messages (mpsc)
//!        │  └───────────────────────────┘                         ▼
//!        └──────────────── errors ──────────────────────────▶ writer task ──▶ socket sink
//! ```
//!
//! The reader loop owns the table of live ids. `cancel` fires that generation's oneshot: the task
//! drops its receiver (the engine cancels) and sends `done` with `abort`. A task reports its id
//! as ended *before* sending its last message, and the loop drains those reports first, so a
//! client may reuse an id as soon as it sees `done`. When the socket closes, the loop aborts every
//! task, dropping their receivers (STYLE.md #14). Errors about one message never close the socket.

use std::collections::HashMap;

use axum::extract::ws::{close_code, CloseFrame, Message, WebSocket, WebSocketUpgrade};
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use futures_util::{SinkExt, StreamExt};
use serde::Serialize;
use serde_json::Value;
use tokio::sync::{mpsc, oneshot};
use tokio::task::AbortHandle;

use super::auth::Requester;
use super::blocking::off_runtime;
use super::error::{parse_json, ApiError, ErrorObject};
use super::on_demand::resolve_variant;
use super::openai::{ChatCompletionRequest, CompletionRequest, Usage};
use super::tenants::Caller;
use super::{model_context, usage, Backend, MAX_BODY_BYTES};
use crate::engine::{GenerateEvent, GenerateRequest};
use crate::validate::{validate_chat, validate_completion};

/// A message to the client.
#[derive(Debug, Clone, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ServerMessage {
    /// One generated token (sent for every token; `text` may be empty while held back).
    Token {
        id: String,
        text: String,
        token_id: u32,
        #[serde(skip_serializing_if = "Option::is_none")]
        logprob: Option<f64>,
        #[serde(skip_serializing_if = "Option::is_none")]
        top_logprobs: Option<Vec<WsTopLogprob>>,
    },
    /// The generation ended.
    Done {
        id: String,
        finish_reason: &'static str,
        usage: Usage,
    },
    /// A message could not be served; `id` when it concerns one generation.
    Error {
        #[serde(skip_serializing_if = "Option::is_none")]
        id: Option<String>,
        error: ErrorObject,
    },
    /// The socket's `auth` message was accepted.
    Authenticated { tenant: String },
}

/// One alternative token in a `token` message.
#[derive(Debug, Clone, Serialize)]
pub struct WsTopLogprob {
    /// The token id.
    pub token_id: u32,
    /// Its text.
    pub token: String,
    /// Its logprob.
    pub logprob: f64,
}

impl ServerMessage {
    fn error(id: Option<String>, e: &ApiError) -> Self {
        ServerMessage::Error {
            id,
            error: e.to_body().error,
        }
    }
}

/// A generation in flight on this socket.
struct Live {
    /// Fired by a `cancel` message.
    cancel: oneshot::Sender<()>,
    /// Aborts the task when the socket closes.
    task: AbortHandle,
}

/// The upgrade handler.
pub async fn ws_upgrade<B: Backend>(
    State(backend): State<B>,
    who: Requester,
    ws: Result<WebSocketUpgrade, axum::extract::ws::rejection::WebSocketUpgradeRejection>,
) -> Response {
    match ws {
        Ok(ws) => ws
            .max_message_size(MAX_BODY_BYTES)
            .on_upgrade(move |socket| serve(backend, who, socket)),
        Err(e) => ApiError::invalid_body(format!(
            "/v1/ws needs a WebSocket upgrade: {}",
            e.body_text()
        ))
        .into_response(),
    }
}

/// Runs one socket until it closes.
async fn serve<B: Backend>(backend: B, mut who: Requester, socket: WebSocket) {
    let (mut sink, mut incoming) = socket.split();
    let (out_tx, mut out_rx) = mpsc::unbounded_channel::<ServerMessage>();
    let writer = tokio::spawn(async move {
        while let Some(msg) = out_rx.recv().await {
            let text = serde_json::to_string(&msg).expect("server messages serialize");
            if sink.send(Message::Text(text.into())).await.is_err() {
                break;
            }
        }
        sink
    });
    let (ended_tx, mut ended_rx) = mpsc::unbounded_channel::<String>();
    let mut live: HashMap<String, Live> = HashMap::new();
    // Set when the server ends the socket: the close frame, sent after the last messages.
    let mut closing: Option<CloseFrame> = None;
    loop {
        tokio::select! {
            biased;
            Some(id) = ended_rx.recv() => {
                live.remove(&id);
            }
            msg = incoming.next() => match msg {
                Some(Ok(Message::Text(text))) if who.authenticate_in_band => {
                    match authenticate_in_band(&who, text.as_str()) {
                        Ok(caller) => {
                            who.caller = caller;
                            who.authenticate_in_band = false;
                            let tenant = who.caller.label().to_string();
                            let _ = out_tx.send(ServerMessage::Authenticated { tenant });
                        }
                        Err(e) => {
                            let _ = out_tx.send(ServerMessage::error(None, &e));
                            closing = Some(close_frame(close_code::POLICY, "unauthorized"));
                            break;
                        }
                    }
                }
                Some(Ok(Message::Text(text))) => {
                    on_text(&backend, &who, text.as_str(), &mut live, &out_tx, &ended_tx);
                }
                Some(Ok(Message::Binary(_))) => {
                    let e = ApiError::invalid_body("binary messages are not supported; send JSON text");
                    let _ = out_tx.send(ServerMessage::error(None, &e));
                }
                Some(Ok(Message::Ping(_) | Message::Pong(_))) => {}
                Some(Err(e)) => {
                    // A frame that cannot be read (over the message limit, broken framing): the
                    // socket cannot go on past it; say why, then close.
                    let (code, why) = if e.to_string().contains("Space limit exceeded") {
                        (close_code::SIZE, "message too big")
                    } else {
                        (close_code::PROTOCOL, "unreadable frame")
                    };
                    let e = ApiError::invalid_body(format!(
                        "the socket is closed: its last message could not be read ({e}); \
                         a message may have at most {} MiB", MAX_BODY_BYTES >> 20
                    ));
                    let _ = out_tx.send(ServerMessage::error(None, &e));
                    closing = Some(close_frame(code, why));
                    break;
                }
                Some(Ok(Message::Close(_))) | None => break,
            },
        }
    }
    for (_, g) in live.drain() {
        g.task.abort();
    }
    if let Some(frame) = closing {
        // Let the last error reach the client, then close with the reason.
        drop(out_tx);
        let two_s = std::time::Duration::from_secs(2);
        if let Ok(Ok(mut sink)) = tokio::time::timeout(two_s, writer).await {
            let _ = tokio::time::timeout(two_s, sink.send(Message::Close(Some(frame)))).await;
        }
    } else {
        writer.abort();
    }
}

fn close_frame(code: u16, reason: &'static str) -> CloseFrame {
    CloseFrame {
        code,
        reason: reason.into(),
    }
}

/// The first message of a socket opened without a key: `{"type": "auth", "key": "..."}`.
fn authenticate_in_band(who: &Requester, text: &str) -> Result<Caller, ApiError> {
    let msg: Value = parse_json(text.as_bytes()).unwrap_or(Value::Null);
    let key = match (msg.get("type").and_then(Value::as_str), msg.get("key")) {
        (Some("auth"), Some(Value::String(key))) => key,
        _ => {
            return Err(ApiError::Unauthorized(
                "this server requires an API key: send it in the upgrade request's \
                 `Authorization: Bearer <key>` header, or as the first message \
                 {\"type\": \"auth\", \"key\": \"<key>\"}"
                    .into(),
            ))
        }
    };
    who.access
        .authenticate(Some(key))
        .map_err(|e| ApiError::Unauthorized(e.to_string()))
}

/// Handles one client text message.
fn on_text<B: Backend>(
    backend: &B,
    who: &Requester,
    text: &str,
    live: &mut HashMap<String, Live>,
    out: &mpsc::UnboundedSender<ServerMessage>,
    ended: &mpsc::UnboundedSender<String>,
) {
    let reply_error = |id: Option<String>, e: ApiError| {
        let _ = out.send(ServerMessage::error(id, &e));
    };
    let msg: Value = match parse_json(text.as_bytes()) {
        Ok(Value::Object(m)) => Value::Object(m),
        Ok(_) => {
            return reply_error(
                None,
                ApiError::invalid_body("a message must be a JSON object"),
            )
        }
        Err(e) => return reply_error(None, e),
    };
    let id = match msg.get("id") {
        Some(Value::String(id)) if !id.is_empty() => id.clone(),
        _ => {
            return reply_error(
                None,
                ApiError::invalid("id", "every message needs a non-empty string `id`"),
            )
        }
    };
    match msg.get("type").and_then(Value::as_str) {
        Some("generate") => {
            if live.contains_key(&id) {
                let e = ApiError::invalid(
                    "id",
                    format!("a generation with id `{id}` is already running"),
                );
                return reply_error(Some(id), e);
            }
            let request = msg.get("request").cloned();
            let (cancel, cancelled) = oneshot::channel();
            let task = tokio::spawn(generate(
                backend.clone(),
                who.clone(),
                id.clone(),
                request,
                cancelled,
                out.clone(),
                ended.clone(),
            ));
            live.insert(
                id,
                Live {
                    cancel,
                    task: task.abort_handle(),
                },
            );
        }
        Some("cancel") => match live.remove(&id) {
            // The task sends `done` with `abort`; if it just finished, the send finds nobody.
            Some(g) => {
                let _ = g.cancel.send(());
            }
            None => reply_error(
                Some(id.clone()),
                ApiError::invalid("id", format!("no generation with id `{id}` is running")),
            ),
        },
        Some(other) => reply_error(
            Some(id),
            ApiError::invalid(
                "type",
                format!("unknown message type `{other}`; expected `generate` or `cancel`"),
            ),
        ),
        None => reply_error(
            Some(id),
            ApiError::invalid("type", "the message needs a string `type`"),
        ),
    }
}

/// A `request` with `messages` is a chat request; otherwise a completions request.
fn validate_ws_request<B: Backend>(
    backend: &B,
    caller: &Caller,
    request: Option<&Value>,
) -> Result<GenerateRequest, ApiError> {
    let request = match request {
        Some(r @ Value::Object(_)) => r,
        _ => {
            return Err(ApiError::invalid(
                "request",
                "`request` must be an object with `prompt` or `messages`",
            ))
        }
    };
    let bytes = serde_json::to_vec(request).expect("a JSON value serializes");
    let ctx = model_context(backend, caller);
    let prefixed = |e: ApiError| match e {
        ApiError::InvalidRequest { message, param } => ApiError::InvalidRequest {
            message,
            param: Some(param.map_or("request".to_string(), |p| format!("request.{p}"))),
        },
        other => other,
    };
    let validated = if request.get("messages").is_some() {
        validate_chat(
            &parse_json::<ChatCompletionRequest>(&bytes).map_err(prefixed)?,
            &ctx,
        )
    } else {
        validate_completion(
            &parse_json::<CompletionRequest>(&bytes).map_err(prefixed)?,
            &ctx,
        )
    };
    let validated = validated.map_err(prefixed)?;
    if validated.echo.is_some() {
        return Err(ApiError::invalid(
            "request.echo",
            "`echo` is not supported over /v1/ws (its messages carry tokens); use /v1/completions",
        ));
    }
    if validated.tools.is_some() {
        return Err(ApiError::invalid(
            "request.tools",
            "`tools` are not supported over /v1/ws (its messages carry tokens, not tool calls); use /v1/chat/completions",
        ));
    }
    // `best_of` is at least `n`, so this refuses both.
    if validated.best_of > 1 {
        let field = if validated.n > 1 { "n" } else { "best_of" };
        return Err(ApiError::invalid(
            format!("request.{field}"),
            format!(
                "`{field}` greater than 1 is not supported over /v1/ws (its messages carry no choice \
                 index); send one generation per choice, each with its own id"
            ),
        ));
    }
    Ok(validated.request)
}

/// One generation: forwards its events to the socket until it ends, is cancelled, or aborted.
async fn generate<B: Backend>(
    backend: B,
    who: Requester,
    id: String,
    request: Option<Value>,
    mut cancelled: oneshot::Receiver<()>,
    out: mpsc::UnboundedSender<ServerMessage>,
    ended: mpsc::UnboundedSender<String>,
) {
    // Validated here, not in the reader loop, because a variant named for the first time may
    // be registered first (`on_demand`), which waits for a worker.
    let model_field = request
        .as_ref()
        .and_then(|r| r.get("model"))
        .and_then(Value::as_str);
    let validated = match resolve_variant(&backend, model_field, &who.caller).await {
        Ok(()) => off_runtime(|| validate_ws_request(&backend, &who.caller, request.as_ref())),
        Err(e) => Err(e),
    };
    let request = match validated {
        Ok(r) => r,
        Err(e) => {
            let _ = ended.send(id.clone());
            let _ = out.send(ServerMessage::error(Some(id), &e));
            return;
        }
    };
    let prompt_tokens = request.prompt_token_ids.len() as u32;
    let with_logprobs = request.sampling.logprobs.is_some();
    // Report the end to the reader loop before the last message (see the module docs).
    let finish = |msg: ServerMessage| {
        let _ = ended.send(id.clone());
        let _ = out.send(msg);
    };
    let mut rx = match usage::start(&backend, &who, request).await {
        Ok(rx) => rx,
        Err(e) => return finish(ServerMessage::error(Some(id.clone()), &e)),
    };
    let mut completion_tokens = 0u32;
    loop {
        tokio::select! {
            biased;
            _ = &mut cancelled => {
                drop(rx);
                return finish(ServerMessage::Done {
                    id: id.clone(),
                    finish_reason: "abort",
                    usage: Usage::new(prompt_tokens, completion_tokens),
                });
            }
            event = rx.recv() => match event {
                Some(GenerateEvent::PromptLogprobs { .. }) => {}
                Some(GenerateEvent::Token { token_id, text, logprob, top_logprobs }) => {
                    completion_tokens += 1;
                    let top_logprobs = with_logprobs.then(|| {
                        top_logprobs
                            .iter()
                            .map(|a| WsTopLogprob {
                                token_id: a.token_id,
                                token: backend.tokenizer().token_text(a.token_id),
                                logprob: a.logprob,
                            })
                            .collect()
                    });
                    let _ = out.send(ServerMessage::Token { id: id.clone(), text, token_id, logprob, top_logprobs });
                }
                Some(GenerateEvent::Finished { reason, prompt_tokens, completion_tokens }) => {
                    return finish(ServerMessage::Done {
                        id: id.clone(),
                        finish_reason: reason.as_str(),
                        usage: Usage::new(prompt_tokens, completion_tokens),
                    });
                }
                Some(GenerateEvent::Error { message }) => {
                    return finish(ServerMessage::error(Some(id.clone()), &ApiError::Internal(message)));
                }
                None => {
                    let e = ApiError::Internal("the engine ended the request without a result".into());
                    return finish(ServerMessage::error(Some(id.clone()), &e));
                }
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use futures_util::{SinkExt, StreamExt};
    use serde_json::{json, Value};
    use tokio_tungstenite::tungstenite::Message as WsMsg;

    use crate::api::fake::{FakeBackend, Script};
    use crate::api::router_with;
    use crate::engine::{FinishReason, GenerateEvent};

    type Client = tokio_tungstenite::WebSocketStream<
        tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>,
    >;

    /// Serves the fake on a local port and connects a client.
    async fn connect(fake: FakeBackend) -> Client {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, router_with(fake)).await.unwrap() });
        let (client, _) = tokio_tungstenite::connect_async(format!("ws://{addr}/v1/ws"))
            .await
            .unwrap();
        client
    }

    async fn send(c: &mut Client, v: Value) {
        c.send(WsMsg::Text(v.to_string().into())).await.unwrap();
    }

    async fn recv(c: &mut Client) -> Value {
        let msg = tokio::time::timeout(Duration::from_secs(5), c.next())
            .await
            .expect("timed out")
            .unwrap()
            .unwrap();
        serde_json::from_str(msg.to_text().unwrap()).unwrap()
    }

    #[tokio::test]
    async fn generate_streams_every_token_then_done() {
        let fake = FakeBackend::new(FakeBackend::tokens(&["Hel", "", "lo"], FinishReason::Stop));
        let mut c = connect(fake.clone()).await;
        send(&mut c, json!({"type": "generate", "id": "a", "request": {"prompt": "the", "max_tokens": 3, "logprobs": 1}})).await;
        let mut got = Vec::new();
        for _ in 0..4 {
            got.push(recv(&mut c).await);
        }
        let texts: Vec<_> = got[..3].iter().map(|m| m["text"].clone()).collect();
        assert_eq!(texts, vec![json!("Hel"), json!(""), json!("lo")]);
        assert!(got[..3]
            .iter()
            .all(|m| m["type"] == "token" && m["id"] == "a" && m["logprob"].is_number()));
        assert_eq!(got[0]["token_id"], 10);
        assert_eq!(got[0]["top_logprobs"][1]["token_id"], 100);
        assert_eq!(
            got[3],
            json!({"type": "done", "id": "a", "finish_reason": "stop",
                                   "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}})
        );
        assert_eq!(fake.requests.lock().unwrap()[0].max_tokens, 3);
        // The id is free again once `done` arrived; a chat request this time.
        send(&mut c, json!({"type": "generate", "id": "a", "request": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}})).await;
        assert_eq!(recv(&mut c).await["type"], "token");
        let prompt = fake.requests.lock().unwrap()[1].prompt_token_ids.clone();
        assert!(fake
            .tokenizer
            .decode(&prompt)
            .unwrap()
            .ends_with("<|im_start|>assistant\n"));
    }

    #[tokio::test]
    async fn errors_keep_the_socket_open() {
        // Requests never finish on their own here.
        let script = Script::Events(vec![GenerateEvent::Token {
            token_id: 1,
            text: "x".into(),
            logprob: None,
            top_logprobs: vec![],
        }]);
        let mut c = connect(FakeBackend::new(script)).await;
        send(
            &mut c,
            json!({"type": "generate", "id": "g", "request": {"prompt": "x"}}),
        )
        .await;
        assert_eq!(recv(&mut c).await["type"], "token");
        let cases = [
            (
                json!({"type": "generate", "id": "g", "request": {"prompt": "y"}}),
                Some("g"),
                "id",
                "already running",
            ),
            (
                json!({"type": "generate", "id": "h", "request": {"prompt": "y", "temperature": 9}}),
                Some("h"),
                "request.temperature",
                "between 0 and 2",
            ),
            (
                json!({"type": "generate", "id": "h", "request": {"prompt": "y", "n": 2}}),
                Some("h"),
                "request.n",
                "not supported over /v1/ws",
            ),
            (
                json!({"type": "generate", "id": "h", "request": {"prompt": "y", "echo": true}}),
                Some("h"),
                "request.echo",
                "not supported over /v1/ws",
            ),
            (
                json!({"type": "generate", "id": "h", "request": {"prompt": "y", "best_of": 2}}),
                Some("h"),
                "request.best_of",
                "not supported over /v1/ws",
            ),
            (
                json!({"type": "generate", "id": "h", "request": {"prompt": "y", "max_tokens": "x"}}),
                Some("h"),
                "request.max_tokens",
                "invalid type",
            ),
            (
                json!({"type": "generate", "id": "h", "request": {"model": "nope", "prompt": "y"}}),
                Some("h"),
                "model",
                "GET /v1/models",
            ),
            (
                json!({"type": "generate", "id": "h"}),
                Some("h"),
                "request",
                "must be an object",
            ),
            (
                json!({"type": "jump", "id": "h"}),
                Some("h"),
                "type",
                "unknown message type",
            ),
            (
                json!({"type": "cancel", "id": "zzz"}),
                Some("zzz"),
                "id",
                "no generation",
            ),
            (
                json!({"type": "cancel"}),
                None,
                "id",
                "non-empty string `id`",
            ),
            (json!([1]), None, "", "JSON object"),
        ];
        for (msg, id, param, needle) in cases {
            send(&mut c, msg.clone()).await;
            let reply = recv(&mut c).await;
            assert_eq!(reply["type"], "error", "{msg}: {reply}");
            assert_eq!(reply.get("id").and_then(Value::as_str), id, "{reply}");
            assert_eq!(
                reply["error"]["param"].as_str().unwrap_or(""),
                param,
                "{reply}"
            );
            assert!(
                reply["error"]["message"].as_str().unwrap().contains(needle),
                "{reply}"
            );
        }
        c.send(WsMsg::Text("{bad".into())).await.unwrap();
        assert!(recv(&mut c).await["error"]["message"]
            .as_str()
            .unwrap()
            .contains("not valid JSON"));
        c.send(WsMsg::Binary(vec![1u8, 2].into())).await.unwrap();
        assert_eq!(recv(&mut c).await["type"], "error");
    }

    #[tokio::test]
    async fn cancel_aborts_one_generation_and_close_aborts_all() {
        let script = Script::Events(vec![GenerateEvent::Token {
            token_id: 1,
            text: "x".into(),
            logprob: None,
            top_logprobs: vec![],
        }]);
        let fake = FakeBackend::new(script);
        let mut c = connect(fake.clone()).await;
        for id in ["a", "b", "c"] {
            send(
                &mut c,
                json!({"type": "generate", "id": id, "request": {"prompt": [1, 2]}}),
            )
            .await;
            assert_eq!(recv(&mut c).await["id"], id);
        }
        send(&mut c, json!({"type": "cancel", "id": "b"})).await;
        let done = recv(&mut c).await;
        assert_eq!(
            done,
            json!({"type": "done", "id": "b", "finish_reason": "abort",
                                "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}})
        );
        let closed: Vec<bool> = fake
            .senders
            .lock()
            .unwrap()
            .iter()
            .map(|s| s.is_closed())
            .collect();
        assert_eq!(closed, vec![false, true, false]);
        c.close(None).await.unwrap();
        for _ in 0..100 {
            if fake.all_cancelled() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("closing the socket did not cancel its generations");
    }

    #[tokio::test]
    async fn a_message_over_the_limit_gets_an_error_then_close_1009() {
        let mut c = connect(FakeBackend::new(Script::Events(vec![]))).await;
        let huge = "a".repeat(crate::api::MAX_BODY_BYTES + 1);
        let _ = c.send(WsMsg::Text(huge.into())).await;
        let reply = recv(&mut c).await;
        assert_eq!(reply["type"], "error", "{reply}");
        assert!(reply.get("id").is_none(), "{reply}");
        let message = reply["error"]["message"].as_str().unwrap();
        assert!(message.contains("at most 8 MiB"), "{message}");
        let close = tokio::time::timeout(Duration::from_secs(5), c.next())
            .await
            .expect("timed out")
            .unwrap()
            .unwrap();
        let WsMsg::Close(Some(frame)) = close else {
            panic!("expected a close frame, got {close:?}");
        };
        assert_eq!(u16::from(frame.code), 1009);
    }

    #[tokio::test]
    async fn engine_refusal_is_an_error_message() {
        let fake = FakeBackend::new(Script::Refuse(crate::engine::EngineError::Overloaded(
            "queue full".into(),
        )));
        let mut c = connect(fake).await;
        send(
            &mut c,
            json!({"type": "generate", "id": "a", "request": {"prompt": "x"}}),
        )
        .await;
        let reply = recv(&mut c).await;
        assert_eq!(reply["error"]["type"], "rate_limit_error");
        assert_eq!(reply["id"], "a");
    }
}
