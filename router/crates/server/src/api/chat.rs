//! `POST /v1/chat/completions`: messages rendered with the model's chat template, answered as a
//! `chat.completion` with `n` choices (`choices.rs`), or streamed as `chat.completion.chunk`s,
//! each carrying one choice's `index` (choices interleaved as their tokens come):
//!
//! ```text
//!  data: {"choices":[{"index":i,"delta":{"role":"assistant","content":""},...}]}  each choice's first
//!  data: {"choices":[{"index":i,"delta":{"content":"Hel"},"finish_reason":null}]} one per piece of text
//!  data: {"choices":[{"index":i,"delta":{},"finish_reason":"stop"}]}              each choice's last
//!  data: {"choices":[],"usage":{...}}             after every choice's last, if include_usage
//!  data: [DONE]
//! ```
//!
//! With `tools`, the answer's text may become `tool_calls` (in the message, or as `tool_calls`
//! deltas; finish reason `tool_calls`): `tools.rs` says how for each `tool_choice`.

use std::sync::Arc;

use axum::extract::State;
use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream::{self, StreamExt};

use super::auth::Requester;
use super::blocking::off_runtime;
use super::choices::{collect_all, fan_out, merged, total_usage, ChoiceTally};
use super::completions::sse_response;
use super::error::{ApiError, ApiJson};
use super::on_demand::resolve_variant;
use super::openai::{
    AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest,
    ChatCompletionResponse, ChatDelta, ChatLogprobs, ChatTokenLogprob, ChatTopLogprob,
};
use super::tools::{self, ToolStream};
use super::{
    model_context, response_id, sse_done, sse_json, unix_now, usage, Backend, Piece, Pieces,
    TokenRecord,
};
use crate::text::tokenizer::TextTokenizer;
use crate::validate::validate_chat;

/// The handler.
pub async fn chat_completions<B: Backend>(
    State(backend): State<B>,
    who: Requester,
    ApiJson(req): ApiJson<ChatCompletionRequest>,
) -> Result<Response, ApiError> {
    resolve_variant(&backend, req.model.as_deref(), &who.caller).await?;
    let ctx = model_context(&backend, &who.caller);
    let mut v = off_runtime(|| validate_chat(&req, &ctx))?;
    let tools = v.tools.take();
    let tools = tools.map(Arc::new);
    let with_logprobs = v.request.sampling.logprobs.is_some();
    let model = backend.model().display_name(v.request.adapter_id);
    let n = v.n;
    let receivers = usage::start_choices(&backend, &who, fan_out(v.request, n, false)).await?;
    let writer = ChatWriter {
        id: response_id("chatcmpl"),
        created: unix_now(),
        model,
        tokenizer: with_logprobs.then(|| backend.tokenizer().clone()),
    };
    let choices: Vec<Pieces> = receivers.into_iter().map(Pieces::new).collect();
    if !v.stream {
        let answers = collect_all(choices).await?;
        let usage = total_usage(&answers);
        let choices = answers
            .into_iter()
            .enumerate()
            .map(|(index, answer)| {
                let (calls, content) = match &tools {
                    Some(t) => t.parse(&answer.text),
                    None => (Vec::new(), Some(answer.text)),
                };
                let finish_reason = tools::finish_reason(!calls.is_empty(), answer.reason.as_str());
                ChatChoice {
                    index: index as u32,
                    message: AssistantMessage {
                        role: "assistant",
                        content,
                        tool_calls: (!calls.is_empty()).then(|| tools::with_ids(calls)),
                    },
                    logprobs: writer.logprobs(&answer.tokens),
                    finish_reason,
                }
            })
            .collect();
        return Ok(Json(ChatCompletionResponse {
            id: writer.id.clone(),
            object: "chat.completion",
            created: writer.created,
            model: writer.model.clone(),
            choices,
            usage,
        })
        .into_response());
    }
    let choices = super::stream_start::started(&backend, choices).await?;
    let include_usage = v.include_usage;
    let first: Vec<Event> = (0..n)
        .map(|index| {
            let delta = ChatDelta {
                role: Some("assistant"),
                content: Some(String::new()),
                ..ChatDelta::default()
            };
            sse_json(&writer.chunk(index, delta, None, None))
        })
        .collect();
    let calls: Vec<ToolStream> = (0..n).map(|_| ToolStream::default()).collect();
    let state = (
        merged(choices).boxed(),
        writer,
        ChoiceTally::new(n),
        false,
        calls,
    );
    let rest = stream::unfold(
        state,
        move |(mut merged, writer, mut tally, ended, mut calls)| {
            let tools = tools.clone();
            async move {
                if ended {
                    return None;
                }
                let (index, piece) = merged.next().await?;
                let mut ended = false;
                let events: Vec<Event> = match piece {
                    Piece::Prompt(_) => Vec::new(), // only `echo` asks for them
                    Piece::Text { text, tokens } => {
                        let logprobs = writer.logprobs(&tokens);
                        match &tools {
                            None => {
                                let delta = ChatDelta {
                                    content: Some(text),
                                    ..ChatDelta::default()
                                };
                                vec![sse_json(&writer.chunk(index, delta, logprobs, None))]
                            }
                            Some(t) => {
                                let mut deltas = calls[index as usize].text(t, text);
                                if deltas.is_empty() && logprobs.is_some() {
                                    deltas.push(ChatDelta::default()); // buffered text: its logprobs now
                                }
                                let mut logprobs = logprobs;
                                deltas
                                    .into_iter()
                                    .map(|d| {
                                        sse_json(&writer.chunk(index, d, logprobs.take(), None))
                                    })
                                    .collect()
                            }
                        }
                    }
                    Piece::Finished {
                        reason,
                        prompt_tokens,
                        completion_tokens,
                        tokens,
                    } => {
                        let logprobs = writer.logprobs(&tokens);
                        let (deltas, reason) = match &tools {
                            Some(t) => calls[index as usize].finish(t, reason.as_str()),
                            None => (Vec::new(), reason.as_str()),
                        };
                        let mut out: Vec<Event> = deltas
                            .into_iter()
                            .map(|d| sse_json(&writer.chunk(index, d, None, None)))
                            .collect();
                        out.push(sse_json(&writer.chunk(
                            index,
                            ChatDelta::default(),
                            logprobs,
                            Some(reason),
                        )));
                        if let Some(usage) = tally.finished(prompt_tokens, completion_tokens) {
                            if include_usage {
                                let mut last = writer.chunk(0, ChatDelta::default(), None, None);
                                last.choices.clear();
                                last.usage = Some(usage);
                                out.push(sse_json(&last));
                            }
                            out.push(sse_done());
                            ended = true;
                        }
                        out
                    }
                    Piece::Failed(e) => {
                        ended = true;
                        vec![sse_json(&e.to_body())]
                    }
                };
                Some((events, (merged, writer, tally, ended, calls)))
            }
        },
    );
    Ok(sse_response(stream::iter([first]).chain(rest)))
}

/// Builds the chat objects of one response.
struct ChatWriter {
    /// The response id.
    id: String,
    /// When the request was accepted.
    created: u64,
    /// The served model's name.
    model: String,
    /// Present when the request asked for logprobs (to spell tokens).
    tokenizer: Option<Arc<TextTokenizer>>,
}

impl ChatWriter {
    fn chunk(
        &self,
        index: u32,
        delta: ChatDelta,
        logprobs: Option<ChatLogprobs>,
        finish_reason: Option<&'static str>,
    ) -> ChatCompletionChunk {
        ChatCompletionChunk {
            id: self.id.clone(),
            object: "chat.completion.chunk",
            created: self.created,
            model: self.model.clone(),
            choices: vec![ChatChunkChoice {
                index,
                delta,
                logprobs,
                finish_reason,
            }],
            usage: None,
        }
    }

    /// Logprobs of `tokens` in the chat format, when asked for.
    fn logprobs(&self, tokens: &[TokenRecord]) -> Option<ChatLogprobs> {
        let tok = self.tokenizer.as_ref()?;
        let content = tokens
            .iter()
            .map(|t| {
                let token = tok.token_text(t.token_id);
                ChatTokenLogprob {
                    bytes: token.as_bytes().to_vec(),
                    token,
                    logprob: t.logprob,
                    top_logprobs: t
                        .top_logprobs
                        .iter()
                        .map(|a| {
                            let token = tok.token_text(a.token_id);
                            ChatTopLogprob {
                                bytes: token.as_bytes().to_vec(),
                                token,
                                logprob: a.logprob,
                            }
                        })
                        .collect(),
                }
            })
            .collect();
        Some(ChatLogprobs { content })
    }
}

#[cfg(test)]
mod tests {
    use serde_json::{json, Value};

    use crate::api::fake::FakeBackend;
    use crate::api::router_with;
    use crate::api::test_http::*;
    use crate::engine::FinishReason;

    const HELLO: &str = r#"{"model": "tiny", "messages": [{"role": "user", "content": "hi"}]"#;

    #[tokio::test]
    async fn non_streaming_chat_response() {
        let fake = FakeBackend::new(FakeBackend::tokens(&["Hi", " there"], FinishReason::Stop));
        let (status, _, body) = post_json(
            router_with(fake.clone()),
            "/v1/chat/completions",
            &format!("{HELLO}}}"),
        )
        .await;
        assert_eq!(status, 200, "{body}");
        let v: Value = serde_json::from_str(&body).unwrap();
        assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
        assert_eq!(v["object"], "chat.completion");
        assert_eq!(
            v["choices"],
            json!([{"index": 0, "message": {"role": "assistant", "content": "Hi there"}, "logprobs": null, "finish_reason": "stop"}])
        );
        assert_eq!(
            v["usage"],
            json!({"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5})
        );
        let prompt = fake.requests.lock().unwrap()[0].prompt_token_ids.clone();
        assert_eq!(
            fake.tokenizer.decode(&prompt).unwrap(),
            "<|im_start|>user\nhi\n<|im_start|>assistant\n"
        );
    }

    #[tokio::test]
    async fn chat_logprobs_format() {
        let fake = FakeBackend::new(FakeBackend::tokens(&["Hi"], FinishReason::Stop));
        let body = format!(r#"{HELLO}, "logprobs": true, "top_logprobs": 1}}"#);
        let (status, _, body) =
            post_json(router_with(fake.clone()), "/v1/chat/completions", &body).await;
        assert_eq!(status, 200, "{body}");
        let v: Value = serde_json::from_str(&body).unwrap();
        let entry = &v["choices"][0]["logprobs"]["content"][0];
        let token = fake.tokenizer.token_text(10);
        assert_eq!(entry["token"], json!(token));
        assert_eq!(entry["bytes"], json!(token.as_bytes()));
        assert_eq!(entry["logprob"], json!(-0.0));
        assert_eq!(
            entry["top_logprobs"][1]["token"],
            json!(fake.tokenizer.token_text(100))
        );
        assert_eq!(entry["top_logprobs"][1]["logprob"], json!(-3.0));
    }

    #[tokio::test]
    async fn streaming_chat_chunks() {
        let fake = FakeBackend::new(FakeBackend::tokens(&["Hi", "", "!"], FinishReason::Length));
        let body =
            format!(r#"{HELLO}, "stream": true, "stream_options": {{"include_usage": true}}}}"#);
        let (status, _, body) = post_json(router_with(fake), "/v1/chat/completions", &body).await;
        assert_eq!(status, 200);
        let data = sse_data(&body);
        assert_eq!(data.last().unwrap(), "[DONE]");
        let chunks: Vec<Value> = data[..data.len() - 1]
            .iter()
            .map(|d| serde_json::from_str(d).unwrap())
            .collect();
        let deltas: Vec<_> = chunks
            .iter()
            .map(|c| c["choices"][0]["delta"].clone())
            .collect();
        assert_eq!(
            deltas,
            vec![
                json!({"role": "assistant", "content": ""}),
                json!({"content": "Hi"}),
                json!({"content": "!"}),
                json!({}),
                Value::Null
            ]
        );
        assert_eq!(chunks[3]["choices"][0]["finish_reason"], "length");
        assert!(chunks[..3]
            .iter()
            .all(|c| c["choices"][0]["finish_reason"].is_null()));
        assert!(chunks
            .iter()
            .all(|c| c["object"] == "chat.completion.chunk"));
        assert_eq!(
            chunks[4]["usage"],
            json!({"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6})
        );
        assert_eq!(chunks[4]["choices"], json!([]));
    }

    #[tokio::test]
    async fn chat_n_choices_whole_and_streamed() {
        let fake = FakeBackend::new(FakeBackend::tokens(&["Hi", "!"], FinishReason::Stop));
        let body = format!(r#"{HELLO}, "n": 2}}"#);
        let (status, _, body) =
            post_json(router_with(fake.clone()), "/v1/chat/completions", &body).await;
        assert_eq!(status, 200, "{body}");
        let v: Value = serde_json::from_str(&body).unwrap();
        let contents: Vec<_> = v["choices"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| (c["index"].clone(), c["message"]["content"].clone()))
            .collect();
        assert_eq!(
            contents,
            [(json!(0), json!("Hi!")), (json!(1), json!("Hi!"))]
        );
        assert_eq!(v["usage"]["completion_tokens"], 4);
        let body = format!(r#"{HELLO}, "n": 2, "stream": true}}"#);
        let (_, _, body) = post_json(router_with(fake), "/v1/chat/completions", &body).await;
        let data = sse_data(&body);
        assert_eq!(data.last().unwrap(), "[DONE]");
        let chunks: Vec<Value> = data[..data.len() - 1]
            .iter()
            .map(|d| serde_json::from_str(d).unwrap())
            .collect();
        for i in 0..2 {
            let mine: Vec<_> = chunks
                .iter()
                .map(|c| &c["choices"][0])
                .filter(|c| c["index"] == i)
                .collect();
            assert_eq!(mine.len(), 4, "role, two texts, finish: {mine:?}");
            assert_eq!(mine[0]["delta"]["role"], "assistant");
            assert_eq!(mine[3]["finish_reason"], "stop");
        }
    }

    #[tokio::test]
    async fn chat_validation_errors() {
        let app = router_with(FakeBackend::new(FakeBackend::tokens(
            &["a"],
            FinishReason::Stop,
        )));
        let cases = [
            (
                r#"{"messages": [{"content": "x"}]}"#,
                Some("messages[0]"),
                "missing field `role`",
            ),
            (r#"{"messages": "hi"}"#, Some("messages"), "invalid type"),
            (
                r#"{"messages": [{"role": "user", "content": 3}]}"#,
                Some("messages[0].content"),
                "content parts",
            ),
            (
                r#"{"messages": [{"role": "user", "content": "x"}], "max_tokens": 100}"#,
                Some("max_tokens"),
                "context of 64",
            ),
            (
                r#"{"messages": [{"role": "user", "content": "x"}], "n": 17}"#,
                Some("n"),
                "between 1 and 16",
            ),
        ];
        for (body, param, needle) in cases {
            let (status, _, text) = post_json(app.clone(), "/v1/chat/completions", body).await;
            assert_eq!(status, 400, "{body}: {text}");
            let (kind, p, message) = error_fields(&text);
            assert_eq!(kind, "invalid_request_error");
            assert_eq!(p.as_deref(), param, "{message}");
            assert!(message.contains(needle), "{message:?} lacks {needle:?}");
        }
    }
}
