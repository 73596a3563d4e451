//! `POST /tokenize` and `POST /detokenize`: the served model's tokenizer (and chat template) as
//! a service, in vLLM's request and response shapes, so clients written for vLLM (prompt
//! budgeting, evaluation harnesses) work unchanged.
//!
//! ```text
//!  POST /tokenize    {"prompt": "Hi"}                       -> {"count": 2, "max_model_len": M,
//!                    {"messages": [...]}                        "tokens": [..], "token_strs": null}
//!                    + "add_special_tokens" (default: true for a prompt, false for messages:
//!                      the template writes BOS itself), "add_generation_prompt" (messages,
//!                      default true), "chat_template_kwargs", "return_token_strs", "model"
//!  POST /detokenize  {"tokens": [..]}                        -> {"prompt": "Hi"}
//! ```
//!
//! `model` is optional; when given it must be a model the caller may use (404 otherwise, as for
//! generation). Every variant shares the base model's tokenizer. Tokenizing is CPU work that
//! grows with the body (up to 8 MiB), so it runs on the blocking pool, never on the threads
//! that answer `/health`.

use axum::extract::State;
use axum::Json;
use serde::{Deserialize, Serialize};

use super::auth::Requester;
use super::error::{ApiError, ApiJson};
use super::{model_context, Backend};
use crate::text::chat_template::{ChatMessage, RenderOptions};
use crate::text::TextError;
use crate::validate::{check_model, render_chat};

/// `POST /tokenize` body: exactly one of `prompt` and `messages`.
#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TokenizeRequest {
    /// A served model name (checked; all variants share one tokenizer, but `messages` are
    /// rendered with a variant's own chat template when it has one).
    pub model: Option<String>,
    /// Text to tokenize.
    pub prompt: Option<String>,
    /// A conversation, rendered with the chat template first.
    pub messages: Option<Vec<ChatMessage>>,
    /// Run the tokenizer's post-processor (BOS and the like).
    pub add_special_tokens: Option<bool>,
    /// With `messages`: end with the assistant's turn header (default true).
    pub add_generation_prompt: Option<bool>,
    /// With `messages`: extra chat template variables, as for chat completions.
    pub chat_template_kwargs: Option<serde_json::Map<String, serde_json::Value>>,
    /// Also return each token's vocabulary spelling.
    pub return_token_strs: Option<bool>,
}

/// `POST /tokenize` answer.
#[derive(Debug, Serialize)]
pub struct TokenizeResponse {
    /// Number of tokens.
    pub count: usize,
    /// The longest prompt + output the server accepts.
    pub max_model_len: u32,
    /// The token ids.
    pub tokens: Vec<u32>,
    /// Each token's text, when `return_token_strs` asked for it.
    pub token_strs: Option<Vec<String>>,
}

/// `POST /detokenize` body.
#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DetokenizeRequest {
    /// A served model name (checked, as for `/tokenize`).
    pub model: Option<String>,
    /// Token ids, each below the vocabulary size.
    pub tokens: Option<Vec<u64>>,
}

/// `POST /detokenize` answer.
#[derive(Debug, Serialize)]
pub struct DetokenizeResponse {
    /// The text of the tokens, special tokens left out.
    pub prompt: String,
}

/// `POST /tokenize`.
pub async fn tokenize<B: Backend>(
    State(backend): State<B>,
    who: Requester,
    ApiJson(req): ApiJson<TokenizeRequest>,
) -> Result<Json<TokenizeResponse>, ApiError> {
    let adapter_id = check_model(req.model.as_deref(), backend.model(), Some(&who.caller))?;
    let text = match (&req.prompt, &req.messages) {
        (Some(prompt), None) => prompt.clone(),
        (None, Some(messages)) => {
            let options = RenderOptions {
                add_generation_prompt: req.add_generation_prompt.unwrap_or(true),
                tools: None,
                kwargs: req.chat_template_kwargs.as_ref(),
            };
            let ctx = model_context(&backend, &who.caller);
            render_chat(&ctx, adapter_id, messages, &options, "send a `prompt`")?
        }
        _ => {
            return Err(ApiError::invalid_body(
                "give exactly one of `prompt` (text) and `messages` (a conversation)",
            ))
        }
    };
    if req.messages.is_none() {
        for (given, name) in [
            (req.add_generation_prompt.is_some(), "add_generation_prompt"),
            (req.chat_template_kwargs.is_some(), "chat_template_kwargs"),
        ] {
            if given {
                return Err(ApiError::invalid(
                    name,
                    format!("`{name}` applies to `messages` only"),
                ));
            }
        }
    }
    let special = req.add_special_tokens.unwrap_or(req.messages.is_none());
    let with_strs = req.return_token_strs.unwrap_or(false);
    let tokenizer = backend.tokenizer().clone();
    let (tokens, token_strs) = tokio::task::spawn_blocking(move || {
        let ids = tokenizer.encode(&text, special)?;
        let strs = with_strs.then(|| ids.iter().map(|&id| tokenizer.token_text(id)).collect());
        Ok::<_, TextError>((ids, strs))
    })
    .await
    .map_err(|e| ApiError::Internal(format!("tokenizing failed: {e}")))?
    .map_err(|e| ApiError::Internal(e.to_string()))?;
    Ok(Json(TokenizeResponse {
        count: tokens.len(),
        max_model_len: backend.model().max_model_len,
        tokens,
        token_strs,
    }))
}

/// `POST /detokenize`.
pub async fn detokenize<B: Backend>(
    State(backend): State<B>,
    who: Requester,
    ApiJson(req): ApiJson<DetokenizeRequest>,
) -> Result<Json<DetokenizeResponse>, ApiError> {
    check_model(req.model.as_deref(), backend.model(), Some(&who.caller))?;
    let given = req
        .tokens
        .ok_or_else(|| ApiError::invalid("tokens", "`tokens` (a list of token ids) is required"))?;
    let vocab = backend.model().vocab_size;
    let ids = given
        .iter()
        .enumerate()
        .map(|(i, &id)| {
            u32::try_from(id)
                .ok()
                .filter(|&id| id < vocab)
                .ok_or_else(|| {
                    ApiError::invalid(
                        "tokens",
                        format!(
                            "tokens[{i}] = {id} is not a token id (0 to {})",
                            vocab.saturating_sub(1)
                        ),
                    )
                })
        })
        .collect::<Result<Vec<u32>, ApiError>>()?;
    let tokenizer = backend.tokenizer().clone();
    let prompt = tokio::task::spawn_blocking(move || tokenizer.decode(&ids))
        .await
        .map_err(|e| ApiError::Internal(format!("detokenizing failed: {e}")))?
        .map_err(|e| ApiError::Internal(e.to_string()))?;
    Ok(Json(DetokenizeResponse { prompt }))
}

#[cfg(test)]
mod tests {
    use serde_json::{json, Value};

    use crate::api::fake::FakeBackend;
    use crate::api::router_with;
    use crate::api::test_http::post_json;
    use crate::engine::FinishReason;

    async fn post(path: &str, body: Value) -> (u16, Value) {
        let app = router_with(FakeBackend::new(FakeBackend::tokens(
            &[],
            FinishReason::Stop,
        )));
        let (status, _, text) = post_json(app, path, body.to_string()).await;
        (status.as_u16(), serde_json::from_str(&text).unwrap())
    }

    #[tokio::test]
    async fn tokenize_and_detokenize_round_trip() {
        let (status, v) = post(
            "/tokenize",
            json!({"prompt": "hello", "return_token_strs": true}),
        )
        .await;
        assert_eq!(status, 200, "{v}");
        let tokens = v["tokens"].as_array().unwrap().clone();
        assert_eq!(v["count"], tokens.len());
        assert_eq!(v["max_model_len"], 64);
        assert_eq!(v["token_strs"].as_array().unwrap().len(), tokens.len());
        let (status, back) = post("/detokenize", json!({"tokens": tokens})).await;
        assert_eq!(status, 200, "{back}");
        assert_eq!(back["prompt"], "hello");
    }

    #[tokio::test]
    async fn tokenize_messages_uses_the_chat_template() {
        let msgs = json!([{"role": "user", "content": "hi"}]);
        let (_, with) = post("/tokenize", json!({"messages": msgs})).await;
        let (_, without) = post(
            "/tokenize",
            json!({"messages": msgs, "add_generation_prompt": false}),
        )
        .await;
        let (_, plain) = post("/tokenize", json!({"prompt": "hi"})).await;
        let n = |v: &Value| v["count"].as_u64().unwrap();
        assert!(n(&with) > n(&without), "{with} vs {without}");
        assert!(n(&without) > n(&plain));
        assert_eq!(with["token_strs"], Value::Null);
    }

    #[tokio::test]
    async fn bad_bodies_are_400_naming_the_field() {
        for (path, body, param) in [
            ("/tokenize", json!({}), Value::Null),
            (
                "/tokenize",
                json!({"prompt": "a", "messages": []}),
                Value::Null,
            ),
            (
                "/tokenize",
                json!({"prompt": "a", "add_generation_prompt": true}),
                json!("add_generation_prompt"),
            ),
            ("/tokenize", json!({"prompt": 5}), json!("prompt")),
            (
                "/tokenize",
                json!({"prompt": "a", "bogus": 1}),
                json!("bogus"),
            ),
            ("/detokenize", json!({}), json!("tokens")),
            ("/detokenize", json!({"tokens": [1, 300]}), json!("tokens")),
            ("/detokenize", json!({"tokens": [-1]}), json!("tokens[0]")),
        ] {
            let (status, v) = post(path, body.clone()).await;
            assert_eq!(status, 400, "{path} {body}: {v}");
            assert_eq!(v["error"]["param"], param, "{path} {body}: {v}");
        }
        let (status, v) = post("/tokenize", json!({"prompt": "a", "model": "nope"})).await;
        assert_eq!(status, 404, "{v}");
    }
}
