//! The OpenAI wire types: request bodies (`null` means absent, union-typed fields stay
//! `serde_json::Value` so `validate` can say exactly what is wrong) and response bodies,
//! streaming chunks included.
//!
//! Nothing a client sends is silently ignored: an unknown field is a 400 naming it (serde's
//! `deny_unknown_fields`), and a known OpenAI / vLLM field this server does not implement is
//! declared as [`Unsupported`], a 400 whose `param` is the field, unless its value is a no-op
//! (`null`, `{}`, `[]`, `{"type": "text"}`, `"none"`). `response_format` and `tools` are
//! implemented (`validate/response_format.rs`, `api/tools.rs`). `user` is
//! accepted (it names the end user; nothing here depends on it); `max_completion_tokens` is the
//! newer name of `max_tokens` in both endpoints.
//!
//! Request fields are checked and turned into an engine request in `crate::validate`; the
//! response builders live in `completions.rs` / `chat.rs`.

use serde::de::Error as _;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::Value;

use crate::text::chat_template::ChatMessage;

/// `stream_options` of a streaming request.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct StreamOptions {
    /// Send a last chunk with `usage` (and empty `choices`) before `[DONE]`.
    pub include_usage: Option<bool>,
}

/// A request field this server does not implement (module docs): deserializing any value but a
/// no-op fails, and the error's path names the field.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Unsupported;

impl<'de> Deserialize<'de> for Unsupported {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let value = Value::deserialize(d)?;
        let no_op = match &value {
            Value::Null => true,
            Value::Object(m) => {
                m.is_empty() || (m.len() == 1 && m.get("type") == Some(&Value::from("text")))
            }
            Value::Array(a) => a.is_empty(),
            Value::String(s) => s == "none",
            _ => false,
        };
        if no_op {
            Ok(Unsupported)
        } else {
            Err(D::Error::custom(
                "this field is not supported by this server (refused rather than ignored)",
            ))
        }
    }
}

/// Body of `POST /v1/completions`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CompletionRequest {
    /// Served model name; absent means the served model.
    pub model: Option<String>,
    /// A string, an array of token ids, or a one-element array of either (one prompt only).
    pub prompt: Option<Value>,
    /// Most tokens to generate (default 16); `max_completion_tokens` is accepted as its name.
    #[serde(alias = "max_completion_tokens")]
    pub max_tokens: Option<i64>,
    /// Softmax temperature in [0, 2] (default 1; 0 is greedy).
    pub temperature: Option<f64>,
    /// Nucleus mass in (0, 1] (default 1).
    pub top_p: Option<f64>,
    /// Top-k cut-off; -1 or 0 disables it (extension, as in vLLM).
    pub top_k: Option<i64>,
    /// Seed for reproducible sampling.
    pub seed: Option<u64>,
    /// A stop string or up to 4 of them.
    pub stop: Option<Value>,
    /// Stream the answer as server-sent events.
    pub stream: Option<bool>,
    /// Streaming options.
    pub stream_options: Option<StreamOptions>,
    /// Return this many top alternatives per token (0..=5) with the sampled token's logprob.
    pub logprobs: Option<i64>,
    /// Put the prompt before each choice's text (with `logprobs`, the prompt tokens' logprobs
    /// before the generated ones', the first token's `null`).
    pub echo: Option<bool>,
    /// Choices per prompt, 1..=16 (default 1).
    pub n: Option<i64>,
    /// In [-2, 2] (default 0): subtracted from each token already generated (OpenAI).
    pub presence_penalty: Option<f64>,
    /// In [-2, 2] (default 0): subtracted once per time a token was generated (OpenAI).
    pub frequency_penalty: Option<f64>,
    /// Token id (a string) -> bias in [-100, 100] added to its logit; at most 300 entries.
    pub logit_bias: Option<Value>,
    /// Greater than 0 (default 1): divides (multiplies, if negative) the logits of the
    /// prompt's and the output's tokens (vLLM extension).
    pub repetition_penalty: Option<f64>,
    /// No EOS or `stop_token_ids` (and no stop string) before this many tokens (vLLM extension).
    pub min_tokens: Option<i64>,
    /// Token ids that end the request (finish reason `stop`; not in the text) (vLLM extension).
    pub stop_token_ids: Option<Value>,
    /// Keep generating past EOS (extension, for benchmarks).
    pub ignore_eos: Option<bool>,
    /// The end user's id: accepted, not used.
    pub user: Option<String>,
    /// Candidates generated, n..=16 (default `n`): the `n` with the highest cumulative logprob
    /// are returned. Not with `stream` when greater than `n`.
    pub best_of: Option<i64>,
    /// Not implemented (400 unless a no-op).
    pub suffix: Option<Unsupported>,
    /// `{"type": "text" | "json_object" | "json_schema", ...}`: output constrained by a grammar
    /// (vLLM extension here; `validate/response_format.rs`).
    pub response_format: Option<Value>,
    /// Not implemented (vLLM extension; 400 unless a no-op).
    pub min_p: Option<Unsupported>,
}

/// Body of `POST /v1/chat/completions`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ChatCompletionRequest {
    /// Served model name; absent means the served model.
    pub model: Option<String>,
    /// The conversation, rendered with the model's chat template.
    pub messages: Option<Vec<ChatMessage>>,
    /// Most tokens to generate (default: the rest of the context).
    pub max_tokens: Option<i64>,
    /// Newer name of `max_tokens`; wins when both are given.
    pub max_completion_tokens: Option<i64>,
    /// Softmax temperature in [0, 2] (default 1; 0 is greedy).
    pub temperature: Option<f64>,
    /// Nucleus mass in (0, 1] (default 1).
    pub top_p: Option<f64>,
    /// Top-k cut-off; -1 or 0 disables it (extension).
    pub top_k: Option<i64>,
    /// Seed for reproducible sampling.
    pub seed: Option<u64>,
    /// A stop string or up to 4 of them.
    pub stop: Option<Value>,
    /// Stream the answer as server-sent events.
    pub stream: Option<bool>,
    /// Streaming options.
    pub stream_options: Option<StreamOptions>,
    /// Return the sampled tokens' logprobs.
    pub logprobs: Option<bool>,
    /// With `logprobs`, this many alternatives per token (0..=20).
    pub top_logprobs: Option<i64>,
    /// Choices per request, 1..=16 (default 1).
    pub n: Option<i64>,
    /// In [-2, 2] (default 0): subtracted from each token already generated (OpenAI).
    pub presence_penalty: Option<f64>,
    /// In [-2, 2] (default 0): subtracted once per time a token was generated (OpenAI).
    pub frequency_penalty: Option<f64>,
    /// Token id (a string) -> bias in [-100, 100] added to its logit; at most 300 entries.
    pub logit_bias: Option<Value>,
    /// Greater than 0 (default 1): divides (multiplies, if negative) the logits of the
    /// prompt's and the output's tokens (vLLM extension).
    pub repetition_penalty: Option<f64>,
    /// No EOS or `stop_token_ids` (and no stop string) before this many tokens (vLLM extension).
    pub min_tokens: Option<i64>,
    /// Token ids that end the request (finish reason `stop`; not in the text) (vLLM extension).
    pub stop_token_ids: Option<Value>,
    /// Keep generating past EOS (extension, for benchmarks).
    pub ignore_eos: Option<bool>,
    /// The end user's id: accepted, not used.
    pub user: Option<String>,
    /// Extra variables for the chat template, e.g. `{"enable_thinking": false}` (vLLM
    /// extension); the template's own variables (`messages`, `tools`, ...) cannot be replaced.
    pub chat_template_kwargs: Option<serde_json::Map<String, Value>>,
    /// `{"type": "text" | "json_object" | "json_schema", ...}`: output constrained by a grammar
    /// (`validate/response_format.rs`).
    pub response_format: Option<Value>,
    /// Functions the model may call (`api/tools.rs`).
    pub tools: Option<Value>,
    /// `none` | `auto` | `required` | `{"type": "function", "function": {"name": ..}}`.
    pub tool_choice: Option<Value>,
    /// Whether `required` may produce more than one call (default true).
    pub parallel_tool_calls: Option<bool>,
    /// Not implemented (deprecated `tools`; 400 unless empty).
    pub functions: Option<Unsupported>,
    /// Not implemented (deprecated `tool_choice`; 400 unless `"none"`).
    pub function_call: Option<Unsupported>,
    /// Not implemented (vLLM extension; 400 unless a no-op).
    pub min_p: Option<Unsupported>,
}

/// Token counts of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    /// Tokens in the prompt (after the chat template).
    pub prompt_tokens: u32,
    /// Tokens generated.
    pub completion_tokens: u32,
    /// Their sum.
    pub total_tokens: u32,
}

impl Usage {
    /// Usage from the two counts.
    pub fn new(prompt_tokens: u32, completion_tokens: u32) -> Self {
        Self {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
        }
    }
}

/// A `text_completion` object: the whole answer, or (streaming) one chunk of it.
#[derive(Debug, Clone, Serialize)]
pub struct CompletionResponse {
    /// `cmpl-…`, the same for every chunk of a stream.
    pub id: String,
    /// Always `text_completion`.
    pub object: &'static str,
    /// Unix seconds when the request was accepted.
    pub created: u64,
    /// The served model's name.
    pub model: String,
    /// `n` choices; a streamed chunk carries one (none in the usage-only last chunk).
    pub choices: Vec<CompletionChoice>,
    /// Token counts (non-streaming, or the usage chunk of a stream).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

/// One completion choice.
#[derive(Debug, Clone, Serialize)]
pub struct CompletionChoice {
    /// Which choice, 0..n (best first, with `best_of`).
    pub index: u32,
    /// Generated text (of this chunk, when streaming).
    pub text: String,
    /// Per-token logprobs, when asked for.
    pub logprobs: Option<CompletionLogprobs>,
    /// `stop` | `length` | `abort`; `null` until the last chunk.
    pub finish_reason: Option<&'static str>,
}

/// Logprobs in the legacy completions format, one entry per token in every list.
#[derive(Debug, Clone, Default, Serialize)]
pub struct CompletionLogprobs {
    /// Each token's text.
    pub tokens: Vec<String>,
    /// Each sampled token's logprob.
    pub token_logprobs: Vec<Option<f64>>,
    /// Each position's most likely alternatives, token text → logprob (`null` for the first
    /// token of an echoed prompt).
    pub top_logprobs: Vec<Option<TopLogprobMap>>,
    /// Character offset of each token's text in the generated text.
    pub text_offset: Vec<usize>,
}

impl CompletionLogprobs {
    /// Appends `other`'s entries (an echoed prompt's, then the generated tokens').
    pub fn append(&mut self, mut other: CompletionLogprobs) {
        self.tokens.append(&mut other.tokens);
        self.token_logprobs.append(&mut other.token_logprobs);
        self.top_logprobs.append(&mut other.top_logprobs);
        self.text_offset.append(&mut other.text_offset);
    }
}

/// Alternatives at one position, serialized as a JSON object in likelihood order (first entry
/// wins when two tokens have the same text).
#[derive(Debug, Clone, Default)]
pub struct TopLogprobMap(pub Vec<(String, f64)>);

impl Serialize for TopLogprobMap {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut seen = std::collections::HashSet::new();
        s.collect_map(
            self.0
                .iter()
                .filter(|(t, _)| seen.insert(t.as_str()))
                .map(|(t, l)| (t, l)),
        )
    }
}

/// A `chat.completion` object.
#[derive(Debug, Clone, Serialize)]
pub struct ChatCompletionResponse {
    /// `chatcmpl-…`.
    pub id: String,
    /// Always `chat.completion`.
    pub object: &'static str,
    /// Unix seconds when the request was accepted.
    pub created: u64,
    /// The served model's name.
    pub model: String,
    /// `n` choices.
    pub choices: Vec<ChatChoice>,
    /// Token counts.
    pub usage: Usage,
}

/// One chat choice.
#[derive(Debug, Clone, Serialize)]
pub struct ChatChoice {
    /// Which choice, 0..n.
    pub index: u32,
    /// The assistant's answer.
    pub message: AssistantMessage,
    /// Per-token logprobs, when asked for.
    pub logprobs: Option<ChatLogprobs>,
    /// `stop` | `length` | `abort` | `tool_calls`.
    pub finish_reason: &'static str,
}

/// The generated message.
#[derive(Debug, Clone, Serialize)]
pub struct AssistantMessage {
    /// Always `assistant`.
    pub role: &'static str,
    /// The generated text (`null` when the answer is tool calls only).
    pub content: Option<String>,
    /// The functions the model called (`tools`), when it called any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCall>>,
}

/// One function call of an assistant message.
#[derive(Debug, Clone, Serialize)]
pub struct ToolCall {
    /// `call_…`, unique per response.
    pub id: String,
    /// Always `function`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// What is called.
    pub function: FunctionCall,
}

/// The function and its arguments (a JSON object, as text).
#[derive(Debug, Clone, Serialize)]
pub struct FunctionCall {
    /// The tool's name.
    pub name: String,
    /// Its arguments as JSON text.
    pub arguments: String,
}

/// A piece of a tool call in a streamed delta (OpenAI's shape: the first piece of a call has its
/// `id`, `type` and `function.name`; later pieces add to `function.arguments`).
#[derive(Debug, Clone, Serialize)]
pub struct ToolCallDelta {
    /// Which call of the message (0..).
    pub index: u32,
    /// The call's id (first piece only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// `function` (first piece only).
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<&'static str>,
    /// The name (first piece only) and a piece of the arguments.
    pub function: FunctionCallDelta,
}

/// The function part of a [`ToolCallDelta`].
#[derive(Debug, Clone, Serialize)]
pub struct FunctionCallDelta {
    /// The tool's name (first piece only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// The next piece of the arguments' JSON text.
    pub arguments: String,
}

/// Logprobs in the chat format.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ChatLogprobs {
    /// One entry per generated token.
    pub content: Vec<ChatTokenLogprob>,
}

/// One generated token with its alternatives (chat format).
#[derive(Debug, Clone, Serialize)]
pub struct ChatTokenLogprob {
    /// The token's text.
    pub token: String,
    /// Its logprob (`null` if the worker did not report one).
    pub logprob: Option<f64>,
    /// UTF-8 bytes of `token`.
    pub bytes: Vec<u8>,
    /// The most likely alternatives.
    pub top_logprobs: Vec<ChatTopLogprob>,
}

/// One alternative token (chat format).
#[derive(Debug, Clone, Serialize)]
pub struct ChatTopLogprob {
    /// The token's text.
    pub token: String,
    /// Its logprob.
    pub logprob: f64,
    /// UTF-8 bytes of `token`.
    pub bytes: Vec<u8>,
}

/// A `chat.completion.chunk` (streaming).
#[derive(Debug, Clone, Serialize)]
pub struct ChatCompletionChunk {
    /// `chatcmpl-…`, the same for every chunk.
    pub id: String,
    /// Always `chat.completion.chunk`.
    pub object: &'static str,
    /// Unix seconds when the request was accepted.
    pub created: u64,
    /// The served model's name.
    pub model: String,
    /// One choice (none in the usage-only last chunk).
    pub choices: Vec<ChatChunkChoice>,
    /// Token counts, in the usage chunk only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

/// The choice of one chat chunk.
#[derive(Debug, Clone, Serialize)]
pub struct ChatChunkChoice {
    /// Which choice, 0..n.
    pub index: u32,
    /// What this chunk adds.
    pub delta: ChatDelta,
    /// Logprobs of the tokens whose text this chunk carries, when asked for.
    pub logprobs: Option<ChatLogprobs>,
    /// Set in the last chunk.
    pub finish_reason: Option<&'static str>,
}

/// Incremental message content.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ChatDelta {
    /// `assistant` in the first chunk only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    /// Text added by this chunk.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    /// Tool call pieces added by this chunk.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallDelta>>,
}

/// `GET /v1/models`.
#[derive(Debug, Clone, Serialize)]
pub struct ModelList {
    /// Always `list`.
    pub object: &'static str,
    /// The served models.
    pub data: Vec<ModelCard>,
}

/// One served model.
#[derive(Debug, Clone, Serialize)]
pub struct ModelCard {
    /// The name to put in `model`.
    pub id: String,
    /// Always `model`.
    pub object: &'static str,
    /// Unix seconds the server started.
    pub created: u64,
    /// Always `deltaserve`.
    pub owned_by: &'static str,
    /// Longest prompt + output accepted (vLLM's extension, which clients use for budgeting).
    pub max_model_len: u32,
    /// For an adapter: the base model it applies to (vLLM's field for LoRA models).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parent: Option<String>,
    /// For a variant: `lora` or `delta` (a deltaserve extension; absent for the base model).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kind: Option<&'static str>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::error::{parse_json, ApiError};

    fn refused<T: serde::de::DeserializeOwned + std::fmt::Debug>(
        body: &str,
    ) -> (String, Option<String>) {
        match parse_json::<T>(body.as_bytes()).unwrap_err() {
            ApiError::InvalidRequest { message, param } => (message, param),
            other => panic!("{body}: {other:?}"),
        }
    }

    #[test]
    fn unimplemented_fields_are_400s_naming_them() {
        for (field, value) in [("suffix", r#""}""#), ("min_p", "0.1")] {
            let (message, param) =
                refused::<CompletionRequest>(&format!(r#"{{"prompt": "x", "{field}": {value}}}"#));
            assert_eq!(param.as_deref(), Some(field), "{message}");
            assert!(
                message.contains(field) && message.contains("not supported"),
                "{message}"
            );
        }
        for (field, value) in [
            ("functions", r#"[{"name": "f"}]"#),
            ("function_call", r#""auto""#),
            ("parallel_tool_calls", r#""yes""#),
        ] {
            let body = format!(
                r#"{{"messages": [{{"role": "user", "content": "x"}}], "{field}": {value}}}"#
            );
            let (message, param) = refused::<ChatCompletionRequest>(&body);
            assert_eq!(param.as_deref(), Some(field), "{message}");
        }
    }

    #[test]
    fn logit_shaping_and_stop_token_fields_are_accepted_in_both_endpoints() {
        let fields = r#""logit_bias": {"50256": -100}, "presence_penalty": 0.5,
            "frequency_penalty": -1, "repetition_penalty": 1.1, "min_tokens": 4,
            "stop_token_ids": [7]"#;
        let req: CompletionRequest =
            parse_json(format!(r#"{{"prompt": "x", {fields}}}"#).as_bytes()).unwrap();
        assert_eq!(
            (req.repetition_penalty, req.min_tokens, req.presence_penalty),
            (Some(1.1), Some(4), Some(0.5))
        );
        assert!(req.logit_bias.is_some() && req.stop_token_ids.is_some());
        let req: ChatCompletionRequest =
            parse_json(format!(r#"{{"messages": [], {fields}}}"#).as_bytes()).unwrap();
        assert_eq!(
            (req.frequency_penalty, req.min_tokens),
            (Some(-1.0), Some(4))
        );
        // Wrong JSON types are 400s naming the field (ranges and ids: `validate`).
        for (field, value) in [
            ("repetition_penalty", r#""high""#),
            ("min_tokens", "1.5"),
            ("presence_penalty", "[]"),
        ] {
            let (message, param) =
                refused::<CompletionRequest>(&format!(r#"{{"prompt": "x", "{field}": {value}}}"#));
            assert_eq!(param.as_deref(), Some(field), "{message}");
        }
    }

    #[test]
    fn unknown_fields_are_400s_naming_them() {
        let (message, _) = refused::<CompletionRequest>(r#"{"prompt": "x", "guided_json": {}}"#);
        assert!(message.contains("unknown field `guided_json`"), "{message}");
        let (message, _) =
            refused::<ChatCompletionRequest>(r#"{"messages": [], "temprature": 0.5}"#);
        assert!(message.contains("unknown field `temprature`"), "{message}");
    }

    #[test]
    fn no_op_values_user_and_max_completion_tokens_are_accepted() {
        let req: CompletionRequest = parse_json(
            br#"{"prompt": "x", "user": "u", "logit_bias": {}, "response_format": {"type": "text"},
                 "best_of": null, "n": 2, "max_completion_tokens": 7}"#,
        )
        .unwrap();
        assert_eq!((req.user.as_deref(), req.max_tokens), (Some("u"), Some(7)));
        let req: ChatCompletionRequest = parse_json(
            br#"{"messages": [], "tools": [], "tool_choice": "none", "user": "u",
                 "response_format": {"type": "text"}, "functions": null}"#,
        )
        .unwrap();
        assert_eq!(req.user.as_deref(), Some("u"));
    }
}
