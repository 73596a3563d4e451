//! LoRAX's (and TGI's) native generation routes, so `lorax-client` users keep working: the
//! request is translated into a `/v1/completions` request and validated by the same code.
//!
//! ```text
//!  POST /generate         {"inputs": "...", "parameters": {"adapter_id": "sql", "max_new_tokens": 64, ...}}
//!                         -> {"generated_text": "...", "details": {...}}   (details when asked)
//!  POST /generate_stream  the same -> SSE: {"token": {"id","text","logprob","special"},
//!                         "generated_text": null, "details": null} per token; the last event has
//!                         the whole "generated_text" and "details" {"finish_reason", ...}
//! ```
//!
//! `adapter_id` selects the variant (`<base>:<adapter_id>`, resolved at request time like any
//! `model`); `do_sample: false` (the default) is greedy unless `temperature`, `top_p` or `top_k`
//! asks for sampling; finish reasons are TGI's (`length`, `eos_token`, `stop_sequence`). A
//! parameter this server does not implement (`best_of` > 1, `watermark`, `typical_p`,
//! `truncate`, `decoder_input_details`, an `adapter_source` other than `hub` or `local`) is a
//! 400 naming it, never ignored.

use std::convert::Infallible;

use axum::extract::State;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream::{self, StreamExt};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::auth::Requester;
use super::blocking::off_runtime;
use super::error::{ApiError, ApiJson};
use super::on_demand::resolve_variant;
use super::openai::CompletionRequest;
use super::{model_context, sse_json, usage, Backend, Piece, Pieces, TokenRecord};
use crate::engine::FinishReason;
use crate::validate::validate_completion;

/// `POST /generate` body.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GenerateBody {
    /// The prompt.
    pub inputs: String,
    /// Generation parameters.
    #[serde(default)]
    pub parameters: Parameters,
    /// TGI's flag on `/generate` (`/generate_stream` streams regardless).
    #[serde(default)]
    pub stream: Option<bool>,
}

/// LoRAX's `parameters`.
#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Parameters {
    pub adapter_id: Option<String>,
    pub adapter_source: Option<String>,
    pub api_token: Option<String>,
    pub max_new_tokens: Option<i64>,
    pub do_sample: Option<bool>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub seed: Option<u64>,
    pub stop: Option<Vec<String>>,
    pub repetition_penalty: Option<f64>,
    pub return_full_text: Option<bool>,
    pub details: Option<bool>,
    pub ignore_eos_token: Option<bool>,
    pub best_of: Option<i64>,
    pub watermark: Option<bool>,
    pub typical_p: Option<f64>,
    pub truncate: Option<i64>,
    pub decoder_input_details: Option<bool>,
}

/// Default `max_new_tokens` (TGI's).
const DEFAULT_MAX_NEW_TOKENS: i64 = 20;

/// One generated token as TGI reports it.
#[derive(Debug, Serialize)]
pub struct TgiToken {
    pub id: u32,
    pub text: String,
    pub logprob: Option<f64>,
    pub special: bool,
}

/// `details` of an answer.
#[derive(Debug, Serialize)]
pub struct Details {
    pub finish_reason: &'static str,
    pub generated_tokens: u32,
    pub prompt_tokens: u32,
    pub seed: Option<u64>,
}

/// `POST /generate` answer.
#[derive(Debug, Serialize)]
pub struct Generated {
    pub generated_text: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub details: Option<Details>,
}

/// One `/generate_stream` event.
#[derive(Debug, Serialize)]
pub struct StreamEvent {
    pub token: TgiToken,
    pub generated_text: Option<String>,
    pub details: Option<Details>,
}

/// The `/v1/completions` request `body` asks for, or a 400 naming the first parameter this
/// server does not implement.
fn as_completion(body: &GenerateBody, base: &str) -> Result<CompletionRequest, ApiError> {
    let p = &body.parameters;
    let refused = |name: &str, why: &str| {
        Err(ApiError::invalid(
            format!("parameters.{name}"),
            format!("`{name}` {why} (refused rather than ignored)"),
        ))
    };
    if p.best_of.is_some_and(|b| b > 1) {
        return refused("best_of", "above 1 is not supported on /generate");
    }
    if p.watermark == Some(true) {
        return refused("watermark", "is not supported");
    }
    if p.typical_p.is_some() {
        return refused("typical_p", "is not supported");
    }
    if p.truncate.is_some() {
        return refused("truncate", "is not supported");
    }
    if p.decoder_input_details == Some(true) {
        return refused("decoder_input_details", "is not supported");
    }
    if let Some(source) = p.adapter_source.as_deref() {
        if !matches!(source, "hub" | "local") {
            return refused(
                "adapter_source",
                "must be `hub` or `local` here (nothing is downloaded)",
            );
        }
    }
    let sampling = p.do_sample == Some(true)
        || p.temperature.is_some()
        || p.top_p.is_some()
        || p.top_k.is_some();
    let temperature = if sampling {
        Some(p.temperature.unwrap_or(1.0))
    } else {
        Some(0.0)
    };
    Ok(CompletionRequest {
        model: p.adapter_id.as_ref().map(|a| format!("{base}:{a}")),
        prompt: Some(Value::String(body.inputs.clone())),
        max_tokens: Some(p.max_new_tokens.unwrap_or(DEFAULT_MAX_NEW_TOKENS)),
        temperature,
        top_p: p.top_p,
        top_k: p.top_k,
        seed: p.seed,
        stop: p.stop.as_ref().map(|s| Value::from(s.clone())),
        repetition_penalty: p.repetition_penalty,
        ignore_eos: p.ignore_eos_token,
        logprobs: p.details.filter(|d| *d).map(|_| 0),
        ..Default::default()
    })
}

/// TGI's name of a finish reason: a stop ends on EOS (or another end token, which the engine
/// also reports as a stop) or on a stop string; `last` is the last generated token.
fn tgi_reason(reason: FinishReason, last: Option<u32>, eos: Option<u32>) -> &'static str {
    match reason {
        FinishReason::Length => "length",
        FinishReason::Stop if last.is_some() && last == eos => "eos_token",
        FinishReason::Stop => "stop_sequence",
        FinishReason::Abort => "length",
    }
}

/// `POST /generate`.
pub async fn generate<B: Backend>(
    State(backend): State<B>,
    who: Requester,
    ApiJson(body): ApiJson<GenerateBody>,
) -> Result<Response, ApiError> {
    if body.stream == Some(true) {
        return generate_stream(State(backend), who, ApiJson(body)).await;
    }
    let (pieces, seed, prompt, with_details, full_text) = start(&backend, &who, &body).await?;
    let answer = pieces.collect().await?;
    let last = answer.tokens.last().map(|t| t.token_id);
    let eos = backend.tokenizer().eos_token_id();
    let details = with_details.then(|| Details {
        finish_reason: tgi_reason(answer.reason, last, eos),
        generated_tokens: answer.usage.completion_tokens,
        prompt_tokens: answer.usage.prompt_tokens,
        seed,
    });
    let generated_text = if full_text {
        prompt + &answer.text
    } else {
        answer.text
    };
    Ok(Json(Generated {
        generated_text,
        details,
    })
    .into_response())
}

/// `POST /generate_stream`.
pub async fn generate_stream<B: Backend>(
    State(backend): State<B>,
    who: Requester,
    ApiJson(body): ApiJson<GenerateBody>,
) -> Result<Response, ApiError> {
    let (pieces, seed, prompt, _, full_text) = start(&backend, &who, &body).await?;
    let pieces = super::stream_start::started(&backend, vec![pieces])
        .await?
        .pop()
        .expect("one choice");
    let eos = backend.tokenizer().eos_token_id();
    let text = if full_text { prompt } else { String::new() };
    // Each token's event waits for the next one: the last token rides in the final event, with
    // the whole text and the details, as TGI sends it.
    let events = stream::unfold(
        (pieces, text, false, None::<TgiToken>),
        move |(mut pieces, mut text, ended, mut pending)| async move {
            if ended {
                return None;
            }
            let mut out = Vec::new();
            let mut push = |t: TokenRecord, text: &mut String, pending: &mut Option<TgiToken>| {
                text.push_str(&t.text);
                let token = TgiToken {
                    id: t.token_id,
                    text: t.text,
                    logprob: t.logprob,
                    special: false,
                };
                if let Some(previous) = pending.replace(token) {
                    out.push(sse_json(&StreamEvent {
                        token: previous,
                        generated_text: None,
                        details: None,
                    }));
                }
            };
            match pieces.next().await? {
                Piece::Text { tokens, .. } => {
                    for t in tokens {
                        push(t, &mut text, &mut pending);
                    }
                }
                Piece::Finished {
                    reason,
                    prompt_tokens,
                    completion_tokens,
                    tokens,
                } => {
                    for t in tokens {
                        push(t, &mut text, &mut pending);
                    }
                    let token = pending.take().unwrap_or(TgiToken {
                        id: 0,
                        text: String::new(),
                        logprob: None,
                        special: true,
                    });
                    let last_id = (!token.special).then_some(token.id);
                    let done = StreamEvent {
                        token,
                        generated_text: Some(std::mem::take(&mut text)),
                        details: Some(Details {
                            finish_reason: tgi_reason(reason, last_id, eos),
                            generated_tokens: completion_tokens,
                            prompt_tokens,
                            seed,
                        }),
                    };
                    out.push(sse_json(&done));
                    return Some((out, (pieces, text, true, None)));
                }
                Piece::Failed(e) => {
                    out.push(sse_json(&e.to_body()));
                    return Some((out, (pieces, text, true, None)));
                }
                Piece::Prompt(_) => {}
            }
            Some((out, (pieces, text, false, pending)))
        },
    )
    .flat_map(|events| stream::iter(events.into_iter().map(Ok::<Event, Infallible>)));
    Ok(Sse::new(events)
        .keep_alive(KeepAlive::default())
        .into_response())
}

/// Validates `body` as a completion and queues it: its pieces, seed, prompt text, whether
/// `details` were asked for and whether the prompt leads the text.
async fn start<B: Backend>(
    backend: &B,
    who: &Requester,
    body: &GenerateBody,
) -> Result<(Pieces, Option<u64>, String, bool, bool), ApiError> {
    let req = as_completion(body, &backend.model().name)?;
    resolve_variant(backend, req.model.as_deref(), &who.caller).await?;
    let ctx = model_context(backend, &who.caller);
    let v = off_runtime(|| validate_completion(&req, &ctx))?;
    let seed = v.request.sampling.seed;
    let rx = usage::start(backend, who, v.request).await?;
    let p = &body.parameters;
    Ok((
        Pieces::new(rx),
        seed,
        body.inputs.clone(),
        p.details == Some(true),
        p.return_full_text == Some(true),
    ))
}

#[cfg(test)]
mod tests {
    use serde_json::{json, Value};

    use crate::api::fake::FakeBackend;
    use crate::api::router_with;
    use crate::api::test_http::post_json;
    use crate::engine::FinishReason;

    fn fake() -> FakeBackend {
        FakeBackend::new(FakeBackend::tokens(&["Hel", "lo"], FinishReason::Length))
    }

    async fn post(fake: &FakeBackend, path: &str, body: Value) -> (u16, String) {
        let app = router_with(fake.clone());
        let (status, _, text) = post_json(app, path, body.to_string()).await;
        (status.as_u16(), text)
    }

    #[tokio::test]
    async fn generate_translates_parameters_and_answers_like_tgi() {
        let f = fake();
        let body = json!({"inputs": "Hi", "parameters": {"max_new_tokens": 2, "details": true,
                          "return_full_text": true, "seed": 7, "stop": ["x"]}});
        let (status, text) = post(&f, "/generate", body).await;
        assert_eq!(status, 200, "{text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["generated_text"], "HiHello");
        assert_eq!(v["details"]["finish_reason"], "length");
        assert_eq!(v["details"]["generated_tokens"], 2);
        assert_eq!(v["details"]["seed"], 7);
        let req = f.requests.lock().unwrap().pop().unwrap();
        assert_eq!(req.max_tokens, 2);
        assert_eq!(req.sampling.temperature, 0.0, "do_sample false: greedy");
        assert_eq!(req.stop, vec!["x".to_string()]);

        let body = json!({"inputs": "Hi", "parameters": {"temperature": 0.5, "top_k": 3}});
        let (status, text) = post(&f, "/generate", body).await;
        assert_eq!(status, 200, "{text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(
            v,
            json!({"generated_text": "Hello"}),
            "no details unless asked"
        );
        let req = f.requests.lock().unwrap().pop().unwrap();
        assert_eq!((req.sampling.temperature, req.sampling.top_k), (0.5, 3));
    }

    #[tokio::test]
    async fn generate_stream_sends_tokens_then_the_whole_text() {
        let f = fake();
        let (status, text) = post(&f, "/generate_stream", json!({"inputs": "Hi"})).await;
        assert_eq!(status, 200, "{text}");
        let events: Vec<Value> = text
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .map(|d| serde_json::from_str(d).unwrap())
            .collect();
        assert_eq!(
            events.len(),
            2,
            "one event a token, the last with the text: {text}"
        );
        assert_eq!(events[0]["token"]["text"], "Hel");
        assert_eq!(events[0]["generated_text"], Value::Null);
        assert_eq!(events[1]["token"]["text"], "lo");
        assert_eq!(events[1]["generated_text"], "Hello");
        assert_eq!(events[1]["details"]["finish_reason"], "length");
    }

    #[tokio::test]
    async fn unknown_adapters_and_unsupported_parameters_are_refused() {
        let f = fake();
        for (body, status, param) in [
            (
                json!({"inputs": "Hi", "parameters": {"adapter_id": "nope"}}),
                404,
                json!("model"),
            ),
            (
                json!({"inputs": "Hi", "parameters": {"best_of": 2}}),
                400,
                json!("parameters.best_of"),
            ),
            (
                json!({"inputs": "Hi", "parameters": {"watermark": true}}),
                400,
                json!("parameters.watermark"),
            ),
            (
                json!({"inputs": "Hi", "parameters": {"typical_p": 0.5}}),
                400,
                json!("parameters.typical_p"),
            ),
            (
                json!({"inputs": "Hi", "parameters": {"adapter_source": "s3"}}),
                400,
                json!("parameters.adapter_source"),
            ),
            (
                json!({"inputs": "Hi", "parameters": {"bogus": 1}}),
                400,
                json!("parameters.bogus"),
            ),
            (json!({"parameters": {}}), 400, Value::Null),
        ] {
            let (got, text) = post(&f, "/generate", body.clone()).await;
            assert_eq!(got, status, "{body}: {text}");
            let v: Value = serde_json::from_str(&text).unwrap();
            if !param.is_null() {
                assert_eq!(v["error"]["param"], param, "{body}: {text}");
            }
        }
    }
}
