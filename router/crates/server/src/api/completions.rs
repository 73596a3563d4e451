//! `POST /v1/completions`: one prompt in, a `text_completion` with `n` choices out, whole or as
//! SSE chunks (`best_of` candidates: whole only, the `n` best returned; see `choices.rs`).
//!
//! ```text
//!  stream: data: {"choices":[{"index":i,"text":"Hel",...,"finish_reason":null}]}  one per piece of
//!                                                        a choice's text, choices interleaved
//!          data: {"choices":[{"index":i,"text":"","finish_reason":"stop"}]}       each choice's last
//!          data: {"choices":[],"usage":{...}}         after every choice's last, if include_usage
//!          data: [DONE]
//!  worker error mid-stream: data: {"error":{...}} and the stream ends (every choice cancelled).
//! ```

use std::convert::Infallible;
use std::sync::Arc;

use axum::extract::State;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream::{self, StreamExt};

use super::auth::Requester;
use super::blocking::off_runtime;
use super::choices::{best, collect_all, fan_out, merged, total_usage, ChoiceTally};
use super::error::{ApiError, ApiJson};
use super::on_demand::resolve_variant;
use super::openai::{
    CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse, TopLogprobMap,
    Usage,
};
use super::{
    model_context, response_id, sse_done, sse_json, unix_now, usage, Backend, Piece, Pieces,
    TokenRecord,
};
use crate::engine::FinishReason;
use crate::text::tokenizer::TextTokenizer;
use crate::validate::validate_completion;
use deltaserve_ipc::wire::{PromptLogprob, TokenLogprob};

/// The handler.
pub async fn completions<B: Backend>(
    State(backend): State<B>,
    who: Requester,
    ApiJson(req): ApiJson<CompletionRequest>,
) -> Result<Response, ApiError> {
    resolve_variant(&backend, req.model.as_deref(), &who.caller).await?;
    let ctx = model_context(&backend, &who.caller);
    let v = off_runtime(|| validate_completion(&req, &ctx))?;
    let with_logprobs = v.request.sampling.logprobs.is_some();
    let model = backend.model().display_name(v.request.adapter_id);
    let (n, best_of) = (v.n, v.best_of);
    let ranked = best_of > n;
    let echo = v
        .echo
        .map(|text| (text, v.request.prompt_token_ids.clone()));
    let echo_at_start = echo.is_some() && !with_logprobs;
    let score_only = v.score_only;
    let receivers =
        usage::start_choices(&backend, &who, fan_out(v.request, best_of, ranked)).await?;
    let mut writer = CompletionWriter {
        id: response_id("cmpl"),
        created: unix_now(),
        model,
        logprobs: (0..if with_logprobs { n } else { 0 })
            .map(|_| LogprobWriter {
                tokenizer: backend.tokenizer().clone(),
                offset: 0,
            })
            .collect(),
        echo,
    };
    let choices: Vec<Pieces> = receivers.into_iter().map(Pieces::new).collect();
    if !v.stream {
        let mut answers = collect_all(choices).await?;
        if score_only {
            for a in &mut answers {
                a.text.clear();
                a.tokens.clear();
                a.usage = Usage::new(a.usage.prompt_tokens, 0);
                a.reason = FinishReason::Length;
            }
        }
        let usage = total_usage(&answers);
        if ranked {
            answers = best(answers, n as usize);
        }
        let mut body = writer.response(Vec::new());
        for (index, answer) in answers.into_iter().enumerate() {
            let index = index as u32;
            let echoed = writer.echo_choice(index, &answer.prompt_logprobs);
            let mut choice = writer.choice(
                index,
                answer.text,
                &answer.tokens,
                Some(answer.reason.as_str()),
            );
            if let Some(mut echoed) = echoed {
                echoed.text.push_str(&choice.text);
                choice.text = echoed.text;
                if let (Some(mut lp), Some(rest)) = (echoed.logprobs, choice.logprobs.take()) {
                    lp.append(rest);
                    choice.logprobs = Some(lp);
                }
            }
            body.choices.push(choice);
        }
        body.usage = Some(usage);
        return Ok(Json(body).into_response());
    }
    let choices = super::stream_start::started(&backend, choices).await?;
    let include_usage = v.include_usage;
    // `echo` without logprobs: each choice's prompt text first; with them, when they come.
    let mut first = Vec::new();
    for index in 0..n {
        if let Some(choice) = echo_at_start
            .then(|| writer.echo_choice(index, &[]))
            .flatten()
        {
            first.push(sse_json(&writer.response(vec![choice])));
        }
    }
    let state = (merged(choices).boxed(), writer, ChoiceTally::new(n), false);
    let events = stream::unfold(
        state,
        move |(mut merged, mut writer, mut tally, ended)| async move {
            if ended {
                return None;
            }
            let (index, piece) = merged.next().await?;
            let mut ended = false;
            let events: Vec<Event> = match piece {
                Piece::Prompt(_) if echo_at_start => Vec::new(),
                Piece::Prompt(logprobs) => writer
                    .echo_choice(index, &logprobs)
                    .map(|choice| sse_json(&writer.response(vec![choice])))
                    .into_iter()
                    .collect(),
                Piece::Text { .. } if score_only => Vec::new(),
                Piece::Text { text, tokens } => {
                    let choice = writer.choice(index, text, &tokens, None);
                    vec![sse_json(&writer.response(vec![choice]))]
                }
                Piece::Finished {
                    mut reason,
                    prompt_tokens,
                    mut completion_tokens,
                    mut tokens,
                } => {
                    if score_only {
                        tokens.clear();
                        completion_tokens = 0;
                        reason = FinishReason::Length;
                    }
                    let choice =
                        writer.choice(index, String::new(), &tokens, Some(reason.as_str()));
                    let mut out = vec![sse_json(&writer.response(vec![choice]))];
                    if let Some(usage) = tally.finished(prompt_tokens, completion_tokens) {
                        if include_usage {
                            let mut last = writer.response(Vec::new());
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
            Some((events, (merged, writer, tally, ended)))
        },
    );
    Ok(sse_response(stream::iter([first]).chain(events)))
}

/// Wraps a stream of event batches as an SSE response.
pub(crate) fn sse_response<S>(batches: S) -> Response
where
    S: futures_util::Stream<Item = Vec<Event>> + Send + 'static,
{
    let events = batches.flat_map(|batch| stream::iter(batch.into_iter().map(Ok::<_, Infallible>)));
    Sse::new(events)
        .keep_alive(KeepAlive::default())
        .into_response()
}

/// Builds the `text_completion` objects of one response.
struct CompletionWriter {
    /// The response id.
    id: String,
    /// When the request was accepted.
    created: u64,
    /// The served model's name.
    model: String,
    /// One per returned choice when the request asked for logprobs, else none.
    logprobs: Vec<LogprobWriter>,
    /// With `echo`: the prompt's text and token ids.
    echo: Option<(String, Vec<u32>)>,
}

impl CompletionWriter {
    /// A `text_completion` object with `choices` (no usage).
    fn response(&self, choices: Vec<CompletionChoice>) -> CompletionResponse {
        CompletionResponse {
            id: self.id.clone(),
            object: "text_completion",
            created: self.created,
            model: self.model.clone(),
            choices,
            usage: None,
        }
    }

    /// With `echo`: choice `index`'s prompt text, and with logprobs, the prompt tokens' (the
    /// first token's `null`); the choice's later text offsets count from the prompt's end.
    fn echo_choice(
        &mut self,
        index: u32,
        prompt_logprobs: &[PromptLogprob],
    ) -> Option<CompletionChoice> {
        let (text, ids) = self.echo.as_ref()?;
        let logprobs = self.logprobs.get_mut(index as usize).map(|w| {
            let listed = w.write_prompt(ids, prompt_logprobs);
            w.offset = text.chars().count();
            listed
        });
        Some(CompletionChoice {
            index,
            text: text.clone(),
            logprobs,
            finish_reason: None,
        })
    }

    /// Choice `index` with `text` (logprobs of `tokens` when asked for).
    fn choice(
        &mut self,
        index: u32,
        text: String,
        tokens: &[TokenRecord],
        finish_reason: Option<&'static str>,
    ) -> CompletionChoice {
        let logprobs = self
            .logprobs
            .get_mut(index as usize)
            .map(|w| w.write(tokens));
        CompletionChoice {
            index,
            text,
            logprobs,
            finish_reason,
        }
    }
}

/// Writes logprobs in the completions format, keeping the running text offset across chunks.
pub(crate) struct LogprobWriter {
    /// To spell tokens.
    pub tokenizer: Arc<TextTokenizer>,
    /// Characters of generated text before the next token.
    pub offset: usize,
}

impl LogprobWriter {
    pub(crate) fn write(&mut self, tokens: &[TokenRecord]) -> CompletionLogprobs {
        let mut out = CompletionLogprobs::default();
        for t in tokens {
            out.tokens.push(self.tokenizer.token_text(t.token_id));
            out.token_logprobs.push(t.logprob);
            out.top_logprobs
                .push(Some(self.alternatives(&t.top_logprobs)));
            out.text_offset.push(self.offset);
            self.offset += t.text.chars().count();
        }
        out
    }

    /// The prompt tokens `ids` with their logprobs (`logprobs[i]` is position `i + 1`'s; the
    /// first token has none), offsets counted over the tokens' own texts.
    fn write_prompt(&mut self, ids: &[u32], logprobs: &[PromptLogprob]) -> CompletionLogprobs {
        let mut out = CompletionLogprobs::default();
        for (i, &id) in ids.iter().enumerate() {
            let text = self.tokenizer.token_text(id);
            let entry = i
                .checked_sub(1)
                .and_then(|j| logprobs.get(j))
                .filter(|p| p.position as usize == i);
            out.token_logprobs.push(entry.map(|p| p.logprob));
            out.top_logprobs
                .push(entry.map(|p| self.alternatives(&p.top_logprobs)));
            out.text_offset.push(self.offset);
            self.offset += text.chars().count();
            out.tokens.push(text);
        }
        out
    }

    fn alternatives(&self, top: &[TokenLogprob]) -> TopLogprobMap {
        TopLogprobMap(
            top.iter()
                .map(|a| (self.tokenizer.token_text(a.token_id), a.logprob))
                .collect(),
        )
    }
}

#[cfg(test)]
mod tests {
    use serde_json::{json, Value};

    use crate::api::fake::{FakeBackend, Script};
    use crate::api::router_with;
    use crate::api::test_http::*;
    use crate::engine::{EngineError, FinishReason, GenerateEvent};
    use deltaserve_ipc::wire::{PromptLogprob, TokenLogprob};

    #[tokio::test]
    async fn non_streaming_response_shape_and_usage() {
        let fake = FakeBackend::new(FakeBackend::tokens(
            &["Hel", "", "lo"],
            FinishReason::Length,
        ));
        let (status, _, body) = post_json(
            router_with(fake.clone()),
            "/v1/completions",
            r#"{"model": "tiny", "prompt": "the", "max_tokens": 3}"#,
        )
        .await;
        assert_eq!(status, 200, "{body}");
        let v: Value = serde_json::from_str(&body).unwrap();
        assert!(v["id"].as_str().unwrap().starts_with("cmpl-"));
        assert_eq!(v["object"], "text_completion");
        assert_eq!(v["model"], "tiny");
        assert!(v["created"].as_u64().unwrap() > 1_600_000_000);
        assert_eq!(
            v["choices"],
            json!([{"index": 0, "text": "Hello", "logprobs": null, "finish_reason": "length"}])
        );
        assert_eq!(
            v["usage"],
            json!({"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6})
        );
        let sent = fake.requests.lock().unwrap()[0].clone();
        assert_eq!(sent.max_tokens, 3);
        assert_eq!(
            sent.prompt_token_ids,
            fake.tokenizer.encode("the", true).unwrap()
        );
    }

    #[tokio::test]
    async fn logprobs_in_completions_format() {
        let fake = FakeBackend::new(FakeBackend::tokens(&["ab", "c"], FinishReason::Stop));
        let (status, _, body) = post_json(
            router_with(fake.clone()),
            "/v1/completions",
            r#"{"prompt": "x", "logprobs": 2}"#,
        )
        .await;
        assert_eq!(status, 200, "{body}");
        let v: Value = serde_json::from_str(&body).unwrap();
        let lp = &v["choices"][0]["logprobs"];
        let tok = &fake.tokenizer;
        assert_eq!(
            lp["tokens"],
            json!([tok.token_text(10), tok.token_text(11)])
        );
        assert_eq!(lp["token_logprobs"], json!([-0.0, -0.5]));
        assert_eq!(lp["text_offset"], json!([0, 2]));
        assert_eq!(lp["top_logprobs"][1][tok.token_text(100)], json!(-3.0));
        assert_eq!(fake.requests.lock().unwrap()[0].sampling.logprobs, Some(2));
    }

    #[tokio::test]
    async fn streaming_chunks_usage_and_done() {
        let fake = FakeBackend::new(FakeBackend::tokens(&["Hel", "", "lo"], FinishReason::Stop));
        let (status, headers, body) = post_json(
            router_with(fake),
            "/v1/completions",
            r#"{"prompt": "x", "stream": true, "stream_options": {"include_usage": true}}"#,
        )
        .await;
        assert_eq!(status, 200);
        assert_eq!(headers["content-type"], "text/event-stream");
        let data = sse_data(&body);
        assert_eq!(data.len(), 5, "{data:?}");
        let chunks: Vec<Value> = data[..4]
            .iter()
            .map(|d| serde_json::from_str(d).unwrap())
            .collect();
        let texts: Vec<_> = chunks[..3]
            .iter()
            .map(|c| c["choices"][0]["text"].clone())
            .collect();
        assert_eq!(texts, vec![json!("Hel"), json!("lo"), json!("")]);
        assert_eq!(chunks[0]["choices"][0]["finish_reason"], Value::Null);
        assert_eq!(chunks[2]["choices"][0]["finish_reason"], "stop");
        assert!(chunks[..3]
            .iter()
            .all(|c| c.get("usage").is_none() && c["object"] == "text_completion"));
        assert_eq!(chunks[3]["choices"], json!([]));
        assert_eq!(chunks[3]["usage"]["total_tokens"], 6);
        assert!(chunks.iter().all(|c| c["id"] == chunks[0]["id"]));
        assert_eq!(data[4], "[DONE]");
    }

    #[tokio::test]
    async fn n_choices_share_usage_and_get_their_own_seeds() {
        let fake = FakeBackend::new(FakeBackend::tokens(&["Hel", "lo"], FinishReason::Stop));
        let (status, _, body) = post_json(
            router_with(fake.clone()),
            "/v1/completions",
            r#"{"prompt": "the", "n": 3, "seed": 11, "logprobs": 1}"#,
        )
        .await;
        assert_eq!(status, 200, "{body}");
        let v: Value = serde_json::from_str(&body).unwrap();
        let choices = v["choices"].as_array().unwrap();
        assert_eq!(choices.len(), 3);
        for (i, c) in choices.iter().enumerate() {
            assert_eq!(
                (c["index"].as_u64(), c["text"].as_str()),
                (Some(i as u64), Some("Hello"))
            );
            assert_eq!(
                c["logprobs"]["text_offset"],
                json!([0, 3]),
                "offsets per choice"
            );
        }
        assert_eq!(
            v["usage"],
            json!({"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9})
        );
        let seeds: Vec<_> = fake
            .requests
            .lock()
            .unwrap()
            .iter()
            .map(|r| r.sampling.seed)
            .collect();
        let want: Vec<_> = (0..3)
            .map(|i| Some(crate::api::choices::choice_seed(11, i)))
            .collect();
        assert_eq!(seeds, want);
    }

    #[tokio::test]
    async fn best_of_generates_every_candidate_and_returns_n_without_unasked_logprobs() {
        let fake = FakeBackend::new(FakeBackend::tokens(&["a", "b"], FinishReason::Length));
        let (status, _, body) = post_json(
            router_with(fake.clone()),
            "/v1/completions",
            r#"{"prompt": "the", "best_of": 3, "temperature": 0.5}"#,
        )
        .await;
        assert_eq!(status, 200, "{body}");
        let v: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(
            v["choices"],
            json!([{"index": 0, "text": "ab", "logprobs": null, "finish_reason": "length"}])
        );
        assert_eq!(
            v["usage"]["completion_tokens"], 6,
            "every candidate's tokens"
        );
        let sent = fake.requests.lock().unwrap().clone();
        assert_eq!(sent.len(), 3);
        assert!(
            sent.iter().all(|r| r.sampling.logprobs == Some(0)),
            "asked internally"
        );
    }

    #[tokio::test]
    async fn streamed_choices_carry_their_index_and_end_each_with_a_finish_reason() {
        let fake = FakeBackend::new(FakeBackend::tokens(&["Hel", "lo"], FinishReason::Stop));
        let (status, _, body) = post_json(
            router_with(fake),
            "/v1/completions",
            r#"{"prompt": "x", "n": 2, "stream": true, "stream_options": {"include_usage": true}}"#,
        )
        .await;
        assert_eq!(status, 200);
        let data = sse_data(&body);
        assert_eq!(data.last().unwrap(), "[DONE]");
        let chunks: Vec<Value> = data[..data.len() - 1]
            .iter()
            .map(|d| serde_json::from_str(d).unwrap())
            .collect();
        let (usage, choice_chunks) = chunks.split_last().unwrap();
        assert_eq!(
            (
                usage["choices"].clone(),
                usage["usage"]["completion_tokens"].clone()
            ),
            (json!([]), json!(4))
        );
        for i in 0..2 {
            let mine: Vec<_> = choice_chunks
                .iter()
                .map(|c| &c["choices"][0])
                .filter(|c| c["index"] == i)
                .collect();
            let texts: Vec<_> = mine.iter().map(|c| c["text"].as_str().unwrap()).collect();
            assert_eq!(texts, ["Hel", "lo", ""], "choice {i}");
            let reasons: Vec<_> = mine.iter().map(|c| c["finish_reason"].clone()).collect();
            assert_eq!(reasons, [Value::Null, Value::Null, json!("stop")]);
        }
        assert_eq!(choice_chunks.len(), 6);
    }

    /// A script whose request first gets the prompt's logprobs (positions 1 and 2), then `texts`.
    fn echo_script(texts: &[&str]) -> Script {
        let Script::Events(mut events) = FakeBackend::tokens(texts, FinishReason::Stop) else {
            unreachable!()
        };
        let entry = |position, logprob| PromptLogprob {
            position,
            logprob,
            top_logprobs: vec![TokenLogprob {
                token_id: 100,
                logprob: -0.25,
            }],
        };
        events.insert(
            0,
            GenerateEvent::PromptLogprobs {
                logprobs: vec![entry(1, -2.0), entry(2, -1.5)],
            },
        );
        Script::Events(events)
    }

    #[tokio::test]
    async fn echo_puts_the_prompt_and_its_logprobs_first() {
        let fake = FakeBackend::new(echo_script(&["ab", "c"]));
        let (status, _, body) = post_json(
            router_with(fake.clone()),
            "/v1/completions",
            r#"{"prompt": [104, 105, 106], "echo": true, "logprobs": 1}"#,
        )
        .await;
        assert_eq!(status, 200, "{body}");
        let v: Value = serde_json::from_str(&body).unwrap();
        let tok = &fake.tokenizer;
        let prompt = tok.decode(&[104, 105, 106]).unwrap();
        let choice = &v["choices"][0];
        assert_eq!(choice["text"], json!(format!("{prompt}abc")));
        let lp = &choice["logprobs"];
        assert_eq!(lp["token_logprobs"], json!([null, -2.0, -1.5, -0.0, -0.5]));
        assert_eq!(lp["top_logprobs"][0], Value::Null);
        assert_eq!(lp["top_logprobs"][1][tok.token_text(100)], json!(-0.25));
        assert_eq!(lp["tokens"][0], json!(tok.token_text(104)));
        let offsets = lp["text_offset"].as_array().unwrap();
        assert_eq!(
            offsets[3],
            json!(prompt.chars().count()),
            "output after the prompt"
        );
        assert_eq!(
            fake.requests.lock().unwrap()[0].sampling.prompt_logprobs,
            Some(1)
        );
        // Scoring alone (`max_tokens: 0`): the prompt and its logprobs, nothing generated.
        let (_, _, body) = post_json(
            router_with(fake.clone()),
            "/v1/completions",
            r#"{"prompt": [104, 105, 106], "echo": true, "logprobs": 1, "max_tokens": 0}"#,
        )
        .await;
        let v: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["choices"][0]["text"], json!(prompt));
        assert_eq!(v["choices"][0]["finish_reason"], "length");
        assert_eq!(
            v["choices"][0]["logprobs"]["token_logprobs"],
            json!([null, -2.0, -1.5])
        );
        assert_eq!(v["usage"]["completion_tokens"], 0);
        let (_, _, text) = post_json(
            router_with(fake.clone()),
            "/v1/completions",
            r#"{"prompt": [104, 105, 106], "echo": true, "max_tokens": 0, "stream": true}"#,
        )
        .await;
        let texts: Vec<String> = sse_data(&text)
            .iter()
            .filter(|d| *d != "[DONE]")
            .map(|d| serde_json::from_str::<Value>(d).unwrap()["choices"][0]["text"].to_string())
            .collect();
        assert_eq!(texts, [json!(prompt).to_string(), "\"\"".to_string()]);
        // Streamed: the echo chunk comes when the prompt's logprobs do; without logprobs, first.
        for body in [
            r#"{"prompt": [104, 105, 106], "echo": true, "logprobs": 1, "stream": true}"#,
            r#"{"prompt": [104, 105, 106], "echo": true, "stream": true}"#,
        ] {
            let (_, _, text) = post_json(router_with(fake.clone()), "/v1/completions", body).await;
            let first: Value = serde_json::from_str(&sse_data(&text)[0]).unwrap();
            assert_eq!(first["choices"][0]["text"], json!(prompt), "{body}");
        }
    }

    #[tokio::test]
    async fn worker_error_mid_stream_and_non_streaming() {
        let script = Script::Events(vec![
            GenerateEvent::Token {
                token_id: 1,
                text: "a".into(),
                logprob: None,
                top_logprobs: vec![],
            },
            GenerateEvent::Error {
                message: "worker 0 crashed".into(),
            },
        ]);
        let fake = FakeBackend::new(script);
        let (status, _, body) = post_json(
            router_with(fake.clone()),
            "/v1/completions",
            r#"{"prompt": "x", "stream": true}"#,
        )
        .await;
        assert_eq!(status, 200);
        let data = sse_data(&body);
        assert_eq!(data.len(), 2, "{data:?}");
        let (kind, _, message) = error_fields(&data[1]);
        assert_eq!(
            (kind.as_str(), message.as_str()),
            ("server_error", "worker 0 crashed")
        );
        let (status, _, body) =
            post_json(router_with(fake), "/v1/completions", r#"{"prompt": "x"}"#).await;
        assert_eq!(status, 500);
        assert_eq!(error_fields(&body).2, "worker 0 crashed");
    }

    #[tokio::test]
    async fn engine_refusals_map_to_429_and_503_with_retry_after() {
        for (err, status) in [
            (EngineError::Overloaded("queue full".into()), 429),
            (EngineError::Unavailable("worker restarting".into()), 503),
            (EngineError::InvalidRequest("bad".into()), 400),
        ] {
            let fake = FakeBackend::new(Script::Refuse(err));
            let (s, headers, body) =
                post_json(router_with(fake), "/v1/completions", r#"{"prompt": "x"}"#).await;
            assert_eq!(s, status, "{body}");
            assert_eq!(headers.get("retry-after").is_some(), status != 400);
            error_fields(&body);
        }
    }

    #[tokio::test]
    async fn malformed_bodies_are_openai_json_400s() {
        let app = router_with(FakeBackend::new(FakeBackend::tokens(
            &["a"],
            FinishReason::Stop,
        )));
        let cases: &[(Option<&str>, &str, Option<&str>, &str)] = &[
            (
                Some("application/json"),
                "{not json",
                None,
                "not valid JSON",
            ),
            (
                Some("application/json"),
                r#"{"prompt": "x", "max_tokens": "many"}"#,
                Some("max_tokens"),
                "invalid type",
            ),
            (
                Some("application/json"),
                r#"{"prompt": "x", "temperature": [1]}"#,
                Some("temperature"),
                "invalid type",
            ),
            (Some("application/json"), "", None, "empty"),
            (
                Some("application/json"),
                "[1, 2]",
                None,
                "must be a JSON object, got an array",
            ),
            (
                Some("application/json"),
                r#"{"prompt": ["a", "b"]}"#,
                Some("prompt"),
                "batched prompts are not supported",
            ),
        ];
        for (ct, body, param, needle) in cases {
            let (status, _, text) = send(
                app.clone(),
                "POST",
                "/v1/completions",
                *ct,
                body.to_string(),
            )
            .await;
            assert_eq!(status, 400, "{body}: {text}");
            let (kind, p, message) = error_fields(&text);
            assert_eq!(kind, "invalid_request_error");
            assert_eq!(p.as_deref(), *param, "{message}");
            assert!(message.contains(needle), "{message:?} lacks {needle:?}");
        }
        // A body typed as anything but JSON is refused before it is read (hygiene.rs).
        let (status, _, text) = send(
            app.clone(),
            "POST",
            "/v1/completions",
            Some("text/plain"),
            "{oops".to_string(),
        )
        .await;
        assert_eq!(status, 415, "{text}");
        let (kind, _, message) = error_fields(&text);
        assert_eq!(kind, "unsupported_media_type");
        assert!(message.contains("`text/plain`"), "{message}");
        // No content type at all is accepted (curl without -H).
        let (status, _, text) = send(
            app,
            "POST",
            "/v1/completions",
            None,
            r#"{"prompt": "x"}"#.to_string(),
        )
        .await;
        assert_eq!(status, 200, "{text}");
    }

    #[tokio::test]
    async fn unknown_model_is_404_naming_the_models_endpoint() {
        let app = router_with(FakeBackend::new(FakeBackend::tokens(
            &["a"],
            FinishReason::Stop,
        )));
        let (status, _, body) = post_json(
            app,
            "/v1/completions",
            r#"{"model": "gpt-3.5", "prompt": "x"}"#,
        )
        .await;
        assert_eq!(status, 404);
        let (kind, param, message) = error_fields(&body);
        assert_eq!(
            (kind.as_str(), param.as_deref()),
            ("not_found_error", Some("model"))
        );
        assert!(message.contains("GET /v1/models"));
    }

    #[tokio::test]
    async fn dropping_the_stream_cancels_the_request() {
        use axum::body::Body;
        use axum::http::Request;
        use tower::ServiceExt;
        // A request that never finishes on its own.
        let script = Script::Events(vec![GenerateEvent::Token {
            token_id: 1,
            text: "a".into(),
            logprob: None,
            top_logprobs: vec![],
        }]);
        let fake = FakeBackend::new(script);
        let req = Request::post("/v1/completions")
            .header("content-type", "application/json")
            .body(Body::from(r#"{"prompt": "x", "stream": true}"#))
            .unwrap();
        let response = router_with(fake.clone()).oneshot(req).await.unwrap();
        assert_eq!(response.status(), 200);
        assert!(!fake.all_cancelled(), "the stream holds the receiver");
        drop(response);
        // The receiver is usage.rs's forwarding task's, which sees the client's end closed at its
        // next turn and drops it.
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        assert!(
            fake.all_cancelled(),
            "dropping the response drops the receiver"
        );
    }

    #[tokio::test]
    async fn dropping_a_stream_of_several_choices_cancels_every_one() {
        use axum::body::Body;
        use axum::http::Request;
        use tower::ServiceExt;
        let script = Script::Events(vec![GenerateEvent::Token {
            token_id: 1,
            text: "a".into(),
            logprob: None,
            top_logprobs: vec![],
        }]);
        let fake = FakeBackend::new(script);
        let req = Request::post("/v1/completions")
            .header("content-type", "application/json")
            .body(Body::from(r#"{"prompt": "x", "n": 3, "stream": true}"#))
            .unwrap();
        let response = router_with(fake.clone()).oneshot(req).await.unwrap();
        assert_eq!(response.status(), 200);
        assert_eq!(fake.senders.lock().unwrap().len(), 3);
        assert!(!fake.all_cancelled());
        drop(response);
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        assert!(fake.all_cancelled(), "all three choices cancelled");
    }
}
