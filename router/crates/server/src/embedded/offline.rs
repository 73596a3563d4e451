//! Offline generation (`deltaserve.LLM`): request bodies in the OpenAI shapes, validated by the
//! API's own `validate` (one owner of the sampling fields and their limits), submitted to the
//! engine together so they batch, and each one's events gathered into a [`Completion`].

use deltaserve_ipc::wire::TokenLogprob;
use serde_json::Value;

use super::{Embedded, EmbeddedError};
use crate::api::openai::{ChatCompletionRequest, CompletionRequest};
use crate::engine::{EngineHandle, GenerateEvent, GenerateRequest};
use crate::validate::{validate_chat, validate_completion, ModelContext};

/// Which endpoint's body a request is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PromptKind {
    /// A `/v1/completions` body (`prompt`: text or token ids).
    Completion,
    /// A `/v1/chat/completions` body (`messages`, rendered with the chat template).
    Chat,
}

/// One finished request.
#[derive(Debug, Clone, Default)]
pub struct Completion {
    /// The prompt as the model saw it (after tokenizing and the chat template).
    pub prompt_token_ids: Vec<u32>,
    /// The generated tokens (a stop string's tokens included; its text is not).
    pub token_ids: Vec<u32>,
    /// The generated text, without the stop string that ended it.
    pub text: String,
    /// Each generated token's logprob, when the request asked for logprobs (else empty).
    pub logprobs: Vec<f64>,
    /// Each generated token's top alternatives, when asked (else empty).
    pub top_logprobs: Vec<Vec<TokenLogprob>>,
    /// `stop` (EOS or a stop string), `length` or `abort`.
    pub finish_reason: &'static str,
}

impl Embedded {
    /// Runs every request in `bodies` (JSON objects of `kind`'s endpoint; `stream` is ignored)
    /// at once and returns their completions in order. Every body is validated before any is
    /// submitted, so a bad one (named by its index) changes nothing
    /// ([`EmbeddedError::Invalid`]); a request the engine refuses or fails fails the call, and
    /// the others are cancelled.
    pub fn generate(
        &self,
        bodies: &[Value],
        kind: PromptKind,
        interrupted: impl FnMut() -> bool,
    ) -> Result<Vec<Completion>, EmbeddedError> {
        let engine = self.engine()?;
        let requests = bodies
            .iter()
            .enumerate()
            .map(|(i, body)| validate(engine, body, kind).map_err(|e| format!("request {i}: {e}")))
            .collect::<Result<Vec<_>, _>>()
            .map_err(EmbeddedError::Invalid)?;
        let out = self.block_on(run_all(engine.clone(), requests), interrupted)?;
        Ok(out.map_err(anyhow::Error::msg)?)
    }
}

/// The engine request of one body, by the API's own validation.
fn validate(
    engine: &EngineHandle,
    body: &Value,
    kind: PromptKind,
) -> Result<GenerateRequest, String> {
    let ctx = ModelContext {
        model: engine.model(),
        tokenizer: engine.tokenizer(),
        chat_template: engine.chat_template().map(|t| &**t),
        caller: None,
    };
    let validated = match kind {
        PromptKind::Completion => {
            let req: CompletionRequest =
                serde_json::from_value(body.clone()).map_err(|e| e.to_string())?;
            validate_completion(&req, &ctx)
        }
        PromptKind::Chat => {
            let req: ChatCompletionRequest =
                serde_json::from_value(body.clone()).map_err(|e| e.to_string())?;
            validate_chat(&req, &ctx)
        }
    };
    validated.map(|v| v.request).map_err(|e| e.to_string())
}

/// Submits every request (in order, before awaiting any, so they share steps) and gathers each
/// one's events.
async fn run_all(
    engine: EngineHandle,
    requests: Vec<GenerateRequest>,
) -> Result<Vec<Completion>, String> {
    let mut streams = Vec::with_capacity(requests.len());
    for (i, req) in requests.into_iter().enumerate() {
        let prompt = req.prompt_token_ids.clone();
        let rx = engine
            .generate(req)
            .await
            .map_err(|e| format!("request {i}: {e}"))?;
        streams.push((prompt, rx));
    }
    // The first failure returns at once, dropping (so cancelling) the others.
    futures_util::future::try_join_all(streams.into_iter().enumerate().map(
        |(i, (prompt, mut rx))| async move {
            let mut out = Completion {
                prompt_token_ids: prompt,
                ..Completion::default()
            };
            while let Some(event) = rx.recv().await {
                match event {
                    GenerateEvent::PromptLogprobs { .. } => {}
                    GenerateEvent::Token {
                        token_id,
                        text,
                        logprob,
                        top_logprobs,
                    } => {
                        out.token_ids.push(token_id);
                        out.text.push_str(&text);
                        if let Some(lp) = logprob {
                            out.logprobs.push(lp);
                            out.top_logprobs.push(top_logprobs);
                        }
                    }
                    GenerateEvent::Finished { reason, .. } => {
                        out.finish_reason = reason.as_str();
                        return Ok(out);
                    }
                    GenerateEvent::Error { message } => {
                        return Err(format!("request {i}: {message}"))
                    }
                }
            }
            Err(format!("request {i}: the engine dropped it unfinished"))
        },
    ))
    .await
}
