//! Request validation: from an OpenAI request body to an engine [`GenerateRequest`], or an
//! [`ApiError`] that says which field is wrong and why.
//!
//! ```text
//!  CompletionRequest ─┐  check_model → sampling fields → prompt (tokenize | token ids)  ┐
//!                     ├─────────────────────────────────────────────────────────────────┼─▶ Validated
//!  ChatCompletionReq ─┘  check_model → sampling fields → messages → template → tokenize ┘   (lengths vs context)
//! ```
//!
//! All checks run before the engine sees the request, so every refusal is a 4xx with `param`.
//! The fields that reshape the logits or stop on token ids are checked in [`token_fields`].

mod chat_render;
mod choices;
pub mod response_format;
mod token_fields;

use deltaserve_ipc::wire::SamplingParams;
use serde_json::Value;

use crate::api::error::ApiError;
use crate::api::openai::{ChatCompletionRequest, CompletionRequest, StreamOptions};
use crate::api::tenants::Caller;
use crate::api::tools::{self, Tools};
use crate::engine::{GenerateRequest, ServedModel};
use crate::text::chat_template::{json_kind, ChatTemplate, RenderOptions};
use crate::text::tokenizer::TextTokenizer;
pub use chat_render::render_chat;
pub use choices::MAX_CHOICES;
use token_fields::{check_min_tokens, TokenFields};

/// Default `max_tokens` of `/v1/completions` (OpenAI's).
pub const DEFAULT_COMPLETION_MAX_TOKENS: u32 = 16;
/// Most stop strings per request (OpenAI's limit).
pub const MAX_STOP_STRINGS: usize = 4;
/// Most `logprobs` alternatives on `/v1/completions`.
pub const MAX_COMPLETION_LOGPROBS: i64 = 5;
/// Most `top_logprobs` on `/v1/chat/completions`.
pub const MAX_CHAT_TOP_LOGPROBS: i64 = 20;

/// A request ready for the engine, plus how to answer it.
#[derive(Debug, Clone)]
pub struct Validated {
    /// What the engine runs.
    pub request: GenerateRequest,
    /// Answer as server-sent events.
    pub stream: bool,
    /// Streaming: send a usage chunk before `[DONE]`.
    pub include_usage: bool,
    /// Choices to return (`n`, 1..=[`MAX_CHOICES`]).
    pub n: u32,
    /// Candidates to generate (`best_of`, ≥ `n`); the `n` with the highest cumulative logprob
    /// are returned.
    pub best_of: u32,
    /// `echo`: the prompt's text, put before each choice's text (with `logprobs`, the engine
    /// request asks for the prompt tokens' logprobs too).
    pub echo: Option<String>,
    /// `echo` with `max_tokens: 0`: the engine generates one token, the response has none.
    pub score_only: bool,
    /// Chat `tools` and `tool_choice` (`api/tools.rs`): how the answer becomes `tool_calls`.
    pub tools: Option<Tools>,
}

/// The served model's limits and text tools, as validation needs them.
pub struct ModelContext<'a> {
    /// Name, context length and vocabulary size.
    pub model: &'a ServedModel,
    /// To tokenize prompts.
    pub tokenizer: &'a TextTokenizer,
    /// To render chat messages; `None` when the model has no chat template.
    pub chat_template: Option<&'a ChatTemplate>,
    /// Who asks: a tenant sees only the models it may use (`None`: every model).
    pub caller: Option<&'a Caller>,
}

/// Sampling-related fields common to both endpoints.
struct CommonFields<'a> {
    model: Option<&'a str>,
    temperature: Option<f64>,
    top_p: Option<f64>,
    top_k: Option<i64>,
    seed: Option<u64>,
    stop: Option<&'a Value>,
    n: Option<i64>,
    tokens: TokenFields<'a>,
    stream: Option<bool>,
    stream_options: Option<&'a StreamOptions>,
    ignore_eos: Option<bool>,
}

/// The adapter a `model` field selects (0: the base model); an unknown name is a 404, and so is
/// one the caller may not use, with the same message (no existence leak), checked before any
/// other field so nothing else tells the two apart.
pub fn check_model(
    requested: Option<&str>,
    served: &ServedModel,
    caller: Option<&Caller>,
) -> Result<u32, ApiError> {
    let not_found = || ApiError::ModelNotFound(requested.unwrap_or_default().to_string());
    let id = served.resolve(requested).ok_or_else(not_found)?;
    match caller {
        Some(c) if !c.may_use(&served.display_name(id)) => Err(not_found()),
        _ => Ok(id),
    }
}

/// Quoted values a worker's variant inspection may echo: the literals the variant files' fields
/// accept (field and module names are kept by [`sanitize_file_message`]'s snake_case rule).
const FILE_LITERALS: &[&str] = &[
    "LORA",
    "none",
    "all",
    "lora_only",
    "CAUSAL_LM",
    "model.layers.<i>",
    "r",
    "bias",
    "layers",
];

/// A worker's message about a variant's files, safe to send to a client: every quoted value
/// (`'...'`, `"..."`, `b'...'`) that is not a lowercase snake_case or dotted name (a field,
/// module or tensor name) or one of [`FILE_LITERALS`] becomes a type description (`<a string of 12
/// characters>`), so a file's contents (a symlinked secret, a header's bytes) never reach the
/// client; control characters become `?`, and the whole is cut to 1,000 characters.
pub fn sanitize_file_message(message: &str) -> String {
    let chars: Vec<char> = message.chars().collect();
    let mut out = String::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        let prev = if i > 0 { Some(chars[i - 1]) } else { None };
        // An opening quote is not inside a word (`base's` is an apostrophe); `b'` opens bytes.
        let bytes_prefix = prev == Some('b') && (i < 2 || !chars[i - 2].is_alphanumeric());
        let opens =
            (c == '\'' || c == '"') && (bytes_prefix || prev.is_none_or(|p| !p.is_alphanumeric()));
        let close = opens
            .then(|| chars[i + 1..].iter().position(|&q| q == c))
            .flatten();
        match close {
            Some(len) => {
                let inner: String = chars[i + 1..i + 1 + len].iter().collect();
                if bytes_prefix {
                    out.pop();
                }
                if !bytes_prefix && is_name_or_literal(&inner) {
                    out.push(c);
                    out.push_str(&inner);
                    out.push(c);
                } else {
                    let what = if bytes_prefix { "bytes" } else { "a string" };
                    out.push_str(&format!("<{what} of {len} characters>"));
                }
                i += len + 2;
            }
            None => {
                out.push(if c.is_control() { '?' } else { c });
                i += 1;
            }
        }
    }
    if out.chars().count() > 1000 {
        out = out.chars().take(1000).collect::<String>() + "…";
    }
    out
}

/// A lowercase snake_case or dotted name (a field, module or tensor name: `q_proj`,
/// `model.layers.0.self_attn.q_proj.lora_A.weight`) of at most 160 characters, or a known literal.
fn is_name_or_literal(s: &str) -> bool {
    let lower = s.replace("lora_A", "lora_a").replace("lora_B", "lora_b");
    let name = lower.len() <= 160
        && (lower.contains('_') || lower.contains('.'))
        && lower.starts_with(|c: char| c.is_ascii_lowercase())
        && lower
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == '.');
    name || FILE_LITERALS.contains(&s)
}

/// Validates a `/v1/completions` body.
pub fn validate_completion(
    req: &CompletionRequest,
    ctx: &ModelContext<'_>,
) -> Result<Validated, ApiError> {
    let common = CommonFields {
        model: req.model.as_deref(),
        temperature: req.temperature,
        top_p: req.top_p,
        top_k: req.top_k,
        seed: req.seed,
        stop: req.stop.as_ref(),
        n: req.n,
        tokens: TokenFields {
            logit_bias: req.logit_bias.as_ref(),
            presence_penalty: req.presence_penalty,
            frequency_penalty: req.frequency_penalty,
            repetition_penalty: req.repetition_penalty,
            min_tokens: req.min_tokens,
            stop_token_ids: req.stop_token_ids.as_ref(),
        },
        stream: req.stream,
        stream_options: req.stream_options.as_ref(),
        ignore_eos: req.ignore_eos,
    };
    let adapter_id = check_model(common.model, ctx.model, ctx.caller)?;
    let n = choices::check_n(req.n)?;
    let best_of = choices::check_best_of(req.best_of, n, req.stream.unwrap_or(false))?;
    let logprobs = match req.logprobs {
        None => None,
        Some(k) if (0..=MAX_COMPLETION_LOGPROBS).contains(&k) => Some(k as u32),
        Some(k) => {
            return Err(ApiError::invalid(
                "logprobs",
                format!("`logprobs` must be between 0 and {MAX_COMPLETION_LOGPROBS}, got {k}"),
            ))
        }
    };
    let mut partial = common_fields(&common, logprobs, ctx.model)?;
    partial.request.adapter_id = adapter_id;
    partial.best_of = best_of;
    response_format::apply(req.response_format.as_ref(), &mut partial.request.sampling)?;
    let prompt = req
        .prompt
        .as_ref()
        .ok_or_else(|| ApiError::invalid("prompt", "`prompt` is required"))?;
    let prompt_ids = completion_prompt(prompt, ctx)?;
    // `echo` with `max_tokens: 0` scores the prompt (vLLM's form): one token is generated, and
    // the response leaves it out.
    partial.score_only = req.echo == Some(true) && req.max_tokens == Some(0);
    let max_tokens = max_tokens(
        if partial.score_only {
            Some(1)
        } else {
            req.max_tokens
        },
        "max_tokens",
        Some(DEFAULT_COMPLETION_MAX_TOKENS),
        prompt_ids.len(),
        "prompt",
        ctx,
    )?;
    check_min_tokens(
        partial.request.sampling.min_tokens,
        max_tokens,
        "max_tokens",
    )?;
    if req.echo == Some(true) {
        partial.echo = Some(echo_text(prompt, &prompt_ids, ctx)?);
        partial.request.sampling.prompt_logprobs = partial.request.sampling.logprobs;
    }
    partial.request.prompt_token_ids = prompt_ids;
    partial.request.max_tokens = max_tokens;
    Ok(partial)
}

/// The text `echo` puts before each choice: the prompt as sent when it is text, else its
/// tokens decoded.
fn echo_text(prompt: &Value, ids: &[u32], ctx: &ModelContext<'_>) -> Result<String, ApiError> {
    match prompt {
        Value::String(text) => Ok(text.clone()),
        Value::Array(items) if items.len() == 1 && items[0].is_string() => {
            Ok(items[0].as_str().unwrap_or_default().to_string())
        }
        _ => ctx
            .tokenizer
            .decode(ids)
            .map_err(|e| ApiError::Internal(e.to_string())),
    }
}

/// Validates a `/v1/chat/completions` body (renders and tokenizes the conversation).
pub fn validate_chat(
    req: &ChatCompletionRequest,
    ctx: &ModelContext<'_>,
) -> Result<Validated, ApiError> {
    let common = CommonFields {
        model: req.model.as_deref(),
        temperature: req.temperature,
        top_p: req.top_p,
        top_k: req.top_k,
        seed: req.seed,
        stop: req.stop.as_ref(),
        n: req.n,
        tokens: TokenFields {
            logit_bias: req.logit_bias.as_ref(),
            presence_penalty: req.presence_penalty,
            frequency_penalty: req.frequency_penalty,
            repetition_penalty: req.repetition_penalty,
            min_tokens: req.min_tokens,
            stop_token_ids: req.stop_token_ids.as_ref(),
        },
        stream: req.stream,
        stream_options: req.stream_options.as_ref(),
        ignore_eos: req.ignore_eos,
    };
    let adapter_id = check_model(common.model, ctx.model, ctx.caller)?;
    let logprobs = match (req.logprobs, req.top_logprobs) {
        (Some(true), k) => match k.unwrap_or(0) {
            k @ 0..=MAX_CHAT_TOP_LOGPROBS => Some(k as u32),
            k => {
                return Err(ApiError::invalid(
                    "top_logprobs",
                    format!(
                        "`top_logprobs` must be between 0 and {MAX_CHAT_TOP_LOGPROBS}, got {k}"
                    ),
                ))
            }
        },
        (_, Some(_)) => {
            return Err(ApiError::invalid(
                "top_logprobs",
                "`top_logprobs` requires `logprobs: true`",
            ))
        }
        (_, None) => None,
    };
    let mut partial = common_fields(&common, logprobs, ctx.model)?;
    partial.request.adapter_id = adapter_id;
    response_format::apply(req.response_format.as_ref(), &mut partial.request.sampling)?;
    let messages = req
        .messages
        .as_deref()
        .ok_or_else(|| ApiError::invalid("messages", "`messages` is required"))?;
    if messages.is_empty() {
        return Err(ApiError::invalid(
            "messages",
            "`messages` must not be empty",
        ));
    }
    partial.tools = tools::check_into(req, &mut partial.request.sampling)?;
    let options = RenderOptions {
        add_generation_prompt: true,
        tools: tools::for_template(req),
        kwargs: req.chat_template_kwargs.as_ref(),
    };
    let text = render_chat(
        ctx,
        adapter_id,
        messages,
        &options,
        "use /v1/completions with a `prompt`",
    )?;
    // The template already wrote BOS and the like as text: no extra special tokens.
    let prompt_ids = ctx
        .tokenizer
        .encode(&text, false)
        .map_err(|e| ApiError::Internal(e.to_string()))?;
    if prompt_ids.is_empty() {
        return Err(ApiError::invalid(
            "messages",
            "the rendered conversation is empty",
        ));
    }
    let (value, param) = match (req.max_completion_tokens, req.max_tokens) {
        (Some(v), _) => (Some(v), "max_completion_tokens"),
        (None, v) => (v, "max_tokens"),
    };
    let max_tokens = max_tokens(value, param, None, prompt_ids.len(), "messages", ctx)?;
    check_min_tokens(partial.request.sampling.min_tokens, max_tokens, param)?;
    partial.request.prompt_token_ids = prompt_ids;
    partial.request.max_tokens = max_tokens;
    Ok(partial)
}

/// Checks the shared fields; the prompt and `max_tokens` are filled in by the caller.
fn common_fields(
    f: &CommonFields<'_>,
    logprobs: Option<u32>,
    model: &ServedModel,
) -> Result<Validated, ApiError> {
    // The model's generation_config.json values for what the request leaves out.
    let defaults = &model.sampling_defaults;
    let temperature = f.temperature.or(defaults.temperature).unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(ApiError::invalid(
            "temperature",
            format!("`temperature` must be between 0 and 2, got {temperature}"),
        ));
    }
    let top_p = f.top_p.or(defaults.top_p).unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::invalid(
            "top_p",
            format!("`top_p` must be in (0, 1], got {top_p}"),
        ));
    }
    let top_k = match f.top_k.or(defaults.top_k) {
        None | Some(-1) | Some(0) => 0,
        Some(k) if k >= 1 => u32::try_from(k).unwrap_or(u32::MAX),
        Some(k) => {
            return Err(ApiError::invalid(
                "top_k",
                format!("`top_k` must be -1 or 0 (off) or at least 1, got {k}"),
            ))
        }
    };
    let n = choices::check_n(f.n)?;
    let token_fields = TokenFields {
        repetition_penalty: f.tokens.repetition_penalty.or(defaults.repetition_penalty),
        ..f.tokens
    };
    let tokens = token_fields::check(&token_fields, model.vocab_size)?;
    let stop = stop_strings(f.stop)?;
    let stream = f.stream.unwrap_or(false);
    Ok(Validated {
        request: GenerateRequest {
            prompt_token_ids: Vec::new(),
            max_tokens: 0,
            sampling: SamplingParams {
                temperature,
                top_p,
                top_k,
                seed: f.seed,
                logprobs,
                logit_bias: tokens.logit_bias,
                penalties: tokens.penalties,
                min_tokens: tokens.min_tokens,
                // The engine fills it in (it knows the model's EOS ids).
                min_tokens_banned: Vec::new(),
                prompt_logprobs: None,
                grammar: None,
            },
            stop,
            stop_token_ids: tokens.stop_token_ids,
            ignore_eos: f.ignore_eos.unwrap_or(false),
            adapter_id: 0,
        },
        stream,
        include_usage: stream
            && f.stream_options
                .and_then(|o| o.include_usage)
                .unwrap_or(false),
        n,
        best_of: n,
        echo: None,
        score_only: false,
        tools: None,
    })
}

/// `stop`: null, a string, or an array of up to [`MAX_STOP_STRINGS`] non-empty strings.
fn stop_strings(stop: Option<&Value>) -> Result<Vec<String>, ApiError> {
    let strings = match stop {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => {
            if items.len() > MAX_STOP_STRINGS {
                return Err(ApiError::invalid(
                    "stop",
                    format!(
                        "at most {MAX_STOP_STRINGS} stop strings are allowed, got {}",
                        items.len()
                    ),
                ));
            }
            items
                .iter()
                .enumerate()
                .map(|(i, v)| match v {
                    Value::String(s) => Ok(s.clone()),
                    other => Err(ApiError::invalid(
                        "stop",
                        format!("stop[{i}] must be a string, got {}", json_kind(other)),
                    )),
                })
                .collect::<Result<Vec<_>, _>>()?
        }
        Some(other) => {
            return Err(ApiError::invalid(
                "stop",
                format!(
                    "`stop` must be a string or an array of strings, got {}",
                    json_kind(other)
                ),
            ))
        }
    };
    if strings.iter().any(String::is_empty) {
        return Err(ApiError::invalid("stop", "stop strings must not be empty"));
    }
    Ok(strings)
}

/// The prompt of `/v1/completions` as token ids.
fn completion_prompt(prompt: &Value, ctx: &ModelContext<'_>) -> Result<Vec<u32>, ApiError> {
    let ids = match prompt {
        Value::String(text) => encode_prompt(text, ctx)?,
        Value::Array(items) if items.is_empty() => {
            return Err(ApiError::invalid("prompt", "`prompt` must not be empty"))
        }
        Value::Array(items) if items.iter().all(Value::is_number) => {
            token_ids(items, "prompt", ctx.model.vocab_size)?
        }
        Value::Array(items) if items.len() == 1 => match &items[0] {
            Value::String(text) => encode_prompt(text, ctx)?,
            Value::Array(ids) => token_ids(ids, "prompt[0]", ctx.model.vocab_size)?,
            other => return Err(prompt_type_error(other)),
        },
        Value::Array(items) if items.iter().all(|v| v.is_string() || v.is_array()) => {
            return Err(ApiError::invalid(
                "prompt",
                "batched prompts are not supported; send one prompt per request",
            ))
        }
        other => return Err(prompt_type_error(other)),
    };
    if ids.is_empty() {
        return Err(ApiError::invalid("prompt", "`prompt` must not be empty"));
    }
    Ok(ids)
}

fn prompt_type_error(v: &Value) -> ApiError {
    ApiError::invalid(
        "prompt",
        format!(
            "`prompt` must be a string or an array of token ids, got {}",
            match v {
                Value::Array(_) => "an array mixing types",
                other => json_kind(other),
            }
        ),
    )
}

fn encode_prompt(text: &str, ctx: &ModelContext<'_>) -> Result<Vec<u32>, ApiError> {
    if text.is_empty() {
        return Err(ApiError::invalid("prompt", "`prompt` must not be empty"));
    }
    ctx.tokenizer
        .encode(text, true)
        .map_err(|e| ApiError::Internal(e.to_string()))
}

/// Token ids given by the client: integers below the vocabulary size.
fn token_ids(items: &[Value], param: &str, vocab_size: u32) -> Result<Vec<u32>, ApiError> {
    if items.is_empty() {
        return Err(ApiError::invalid("prompt", "`prompt` must not be empty"));
    }
    items
        .iter()
        .enumerate()
        .map(|(i, v)| match v.as_u64() {
            Some(id) if id < vocab_size as u64 => Ok(id as u32),
            _ => Err(ApiError::invalid(
                "prompt",
                format!(
                    "{param}[{i}] = {v} is not a valid token id (integers from 0 to {})",
                    vocab_size.saturating_sub(1)
                ),
            )),
        })
        .collect()
}

/// Resolves `max_tokens` against the context: an explicit value must be ≥ 1 and fit; the
/// default (`None` = the rest of the context) is cut to what fits.
fn max_tokens(
    requested: Option<i64>,
    param: &str,
    default: Option<u32>,
    prompt_len: usize,
    prompt_param: &str,
    ctx: &ModelContext<'_>,
) -> Result<u32, ApiError> {
    let context = ctx.model.max_model_len as usize;
    // The rule is the scheduler's (`context_room`); here it also names the parameter and fills
    // in the default.
    let room = deltaserve_sched::context_room(prompt_len as u64, ctx.model.max_model_len);
    if room == 0 {
        return Err(ApiError::invalid(
            prompt_param,
            format!(
                "the prompt has {prompt_len} tokens, but the model's context is {context} tokens, which leaves no room to generate"
            ),
        ));
    }
    match requested {
        None => Ok(default.map_or(room, |d| d.min(room))),
        Some(m) if m < 1 => Err(ApiError::invalid(param, format!("`{param}` must be at least 1, got {m}"))),
        Some(m) if m as u64 > room as u64 => Err(ApiError::invalid(
            param,
            format!(
                "the prompt ({prompt_len} tokens) + `{param}` ({m}) = {} tokens exceeds the model's context of {context} tokens; \
                 `{param}` can be at most {room}",
                prompt_len as u64 + m as u64
            ),
        )),
        Some(m) => Ok(m as u32),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::error::parse_json;
    use crate::text::test_support::tiny_tokenizer;

    fn served() -> ServedModel {
        ServedModel {
            name: "tiny".into(),
            max_model_len: 64,
            vocab_size: 300,
            created: 1,
            adapters: std::sync::Arc::new(crate::registry::VariantRegistry::new("tiny")),
            sampling_defaults: Default::default(),
        }
    }

    const CHATML: &str = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

    fn completion(body: &str) -> Result<Validated, ApiError> {
        let tok = tiny_tokenizer();
        let model = served();
        let req: CompletionRequest = parse_json(body.as_bytes())?;
        validate_completion(
            &req,
            &ModelContext {
                model: &model,
                tokenizer: &tok,
                chat_template: None,
                caller: None,
            },
        )
    }

    #[test]
    fn the_models_generation_config_fills_what_the_request_leaves_out() {
        let tok = tiny_tokenizer();
        let model = ServedModel {
            sampling_defaults: crate::sampling_defaults::SamplingDefaults {
                temperature: Some(0.6),
                top_p: Some(0.9),
                top_k: Some(20),
                repetition_penalty: Some(1.1),
            },
            ..served()
        };
        let ctx = ModelContext {
            model: &model,
            tokenizer: &tok,
            chat_template: None,
            caller: None,
        };
        let run = |body: &str| {
            let req: CompletionRequest = parse_json(body.as_bytes()).unwrap();
            validate_completion(&req, &ctx).unwrap().request.sampling
        };
        let s = run(r#"{"prompt": "hi", "max_tokens": 2}"#);
        assert_eq!((s.temperature, s.top_p, s.top_k), (0.6, 0.9, 20));
        assert_eq!(s.penalties.map(|p| p.repetition), Some(1.1));
        // The request's own values win, greedy included.
        let s = run(
            r#"{"prompt": "hi", "max_tokens": 2, "temperature": 0, "top_p": 1, "top_k": -1,
                "repetition_penalty": 1}"#,
        );
        assert_eq!((s.temperature, s.top_p, s.top_k), (0.0, 1.0, 0));
        // Without defaults (`--generation-config none`, or none shipped): OpenAI's.
        let s = completion(r#"{"prompt": "hi", "max_tokens": 2}"#)
            .unwrap()
            .request
            .sampling;
        assert_eq!((s.temperature, s.top_p, s.top_k), (1.0, 1.0, 0));
    }

    fn chat(body: &str, with_template: bool) -> Result<Validated, ApiError> {
        let tok = tiny_tokenizer();
        let model = served();
        let template = ChatTemplate::new(CHATML.into(), None, None).unwrap();
        let req: ChatCompletionRequest = parse_json(body.as_bytes())?;
        let ctx = ModelContext {
            model: &model,
            tokenizer: &tok,
            chat_template: with_template.then_some(&template),
            caller: None,
        };
        validate_chat(&req, &ctx)
    }

    /// Asserts a 400 on `param` whose message contains every one of `needles`.
    #[track_caller]
    fn assert_invalid(result: Result<Validated, ApiError>, param: &str, needles: &[&str]) {
        let err = result.expect_err("expected a validation error");
        assert_eq!(err.status().as_u16(), 400, "{err:?}");
        assert_eq!(err.error_type(), "invalid_request_error");
        let ApiError::InvalidRequest { message, param: p } = &err else {
            panic!("{err:?}")
        };
        assert_eq!(p.as_deref(), Some(param), "{message}");
        for n in needles {
            assert!(message.contains(n), "{message:?} lacks {n:?}");
        }
    }

    #[test]
    fn file_messages_never_quote_values() {
        let cases = [
            (
                "adapter_config.json: field 'peft_type' is 'sk-SECRET-123'; only 'LORA' adapters are supported",
                "adapter_config.json: field 'peft_type' is <a string of 13 characters>; only 'LORA' adapters are supported",
            ),
            (
                "field 'target_modules' entry 'root:x:0:0' names none of the base's adaptable linears",
                "field 'target_modules' entry <a string of 10 characters> names none of the base's adaptable linears",
            ),
            (
                r#"field 'use_dora' is set ("hunter2"): not supported"#,
                "field 'use_dora' is set (<a string of 7 characters>): not supported",
            ),
            (
                r"header starts with b'\x89PNG' and is 3 bytes",
                "header starts with <bytes of 7 characters> and is 3 bytes",
            ),
            ("matches 'q_proj'", "matches 'q_proj'"),
            (
                "tensor 'model.layers.0.q_proj.lora_A.weight' has shape",
                "tensor 'model.layers.0.q_proj.lora_A.weight' has shape",
            ),
            ("unterminated 'quote\u{7} here", "unterminated 'quote? here"),
        ];
        for (given, want) in cases {
            assert_eq!(sanitize_file_message(given), want);
        }
        assert!(sanitize_file_message(&"x".repeat(5000)).chars().count() <= 1001);
    }

    #[test]
    fn completion_defaults() {
        let v = completion(
            r#"{"model": "tiny", "prompt": "the", "stop": null, "n": null, "max_tokens": null}"#,
        )
        .unwrap();
        assert_eq!(v.request.max_tokens, 16);
        assert_eq!(
            v.request.sampling,
            SamplingParams {
                temperature: 1.0,
                top_p: 1.0,
                top_k: 0,
                seed: None,
                logprobs: None,
                ..SamplingParams::default()
            }
        );
        assert_eq!(
            v.request.prompt_token_ids[0],
            tiny_tokenizer().token_to_id("<s>").unwrap(),
            "BOS added"
        );
        assert!(
            v.request.stop.is_empty() && !v.request.ignore_eos && !v.stream && !v.include_usage
        );
        // Extra fields, nulls and the `user` field are ignored.
        let v = completion(
            r#"{"prompt": "x", "user": "u", "temperature": null, "logit_bias": {}, "stream": true,
                "stream_options": {"include_usage": true}, "top_k": -1, "seed": 7, "logprobs": 2, "stop": ["a", "b"], "ignore_eos": true}"#,
        )
        .unwrap();
        assert!(v.stream && v.include_usage && v.request.ignore_eos);
        assert_eq!(v.request.sampling.seed, Some(7));
        assert_eq!(v.request.sampling.logprobs, Some(2));
        assert_eq!(v.request.stop, vec!["a", "b"]);
    }

    #[test]
    fn completion_prompt_forms() {
        let v = completion(r#"{"prompt": [1, 2, 299]}"#).unwrap();
        assert_eq!(v.request.prompt_token_ids, vec![1, 2, 299]);
        let v = completion(r#"{"prompt": [[5, 6]]}"#).unwrap();
        assert_eq!(v.request.prompt_token_ids, vec![5, 6]);
        let v = completion(r#"{"prompt": ["the"]}"#).unwrap();
        assert_eq!(
            v.request.prompt_token_ids,
            tiny_tokenizer().encode("the", true).unwrap()
        );
        assert_invalid(
            completion(r#"{"prompt": ["a", "b"]}"#),
            "prompt",
            &["batched prompts are not supported"],
        );
        assert_invalid(
            completion(r#"{"prompt": [[1], [2]]}"#),
            "prompt",
            &["batched"],
        );
        assert_invalid(
            completion(r#"{"prompt": ""}"#),
            "prompt",
            &["must not be empty"],
        );
        assert_invalid(
            completion(r#"{"prompt": []}"#),
            "prompt",
            &["must not be empty"],
        );
        assert_invalid(
            completion(r#"{"prompt": [1, 300]}"#),
            "prompt",
            &["prompt[1] = 300", "0 to 299"],
        );
        assert_invalid(
            completion(r#"{"prompt": [1, -2]}"#),
            "prompt",
            &["prompt[1] = -2"],
        );
        assert_invalid(completion(r#"{"prompt": 5}"#), "prompt", &["a number"]);
        assert_invalid(completion(r#"{"prompt": [1, "a"]}"#), "prompt", &["mixing"]);
        assert_invalid(completion(r#"{"model": "tiny"}"#), "prompt", &["required"]);
    }

    #[test]
    fn sampling_field_rejections() {
        let cases: &[(&str, &str, &[&str])] = &[
            (
                r#""temperature": 2.5"#,
                "temperature",
                &["between 0 and 2", "2.5"],
            ),
            (
                r#""temperature": -0.1"#,
                "temperature",
                &["between 0 and 2"],
            ),
            (r#""top_p": 0"#, "top_p", &["(0, 1]"]),
            (r#""top_p": 1.5"#, "top_p", &["(0, 1]"]),
            (r#""top_k": -2"#, "top_k", &["-2"]),
            (r#""n": 17"#, "n", &["between 1 and 16", "17"]),
            (r#""n": 0"#, "n", &["between 1 and 16"]),
            (r#""best_of": 2, "n": 3"#, "best_of", &["at least `n` (3)"]),
            (r#""best_of": 3, "stream": true"#, "best_of", &["`stream`"]),
            (
                r#""presence_penalty": 2.5"#,
                "presence_penalty",
                &["between -2 and 2"],
            ),
            (
                r#""repetition_penalty": 0"#,
                "repetition_penalty",
                &["greater than 0"],
            ),
            (
                r#""logit_bias": {"300": 1}"#,
                "logit_bias",
                &["\"300\"", "0 to 299"],
            ),
            (
                r#""stop_token_ids": [300]"#,
                "stop_token_ids",
                &["0 to 299"],
            ),
            (r#""min_tokens": 17"#, "min_tokens", &["`max_tokens` (16)"]),
            (r#""logprobs": 6"#, "logprobs", &["between 0 and 5", "6"]),
            (
                r#""stop": ["a", "b", "c", "d", "e"]"#,
                "stop",
                &["at most 4", "5"],
            ),
            (
                r#""stop": ["a", 3]"#,
                "stop",
                &["stop[1] must be a string", "a number"],
            ),
            (r##""stop": """##, "stop", &["must not be empty"]),
            (r#""stop": {}"#, "stop", &["an object"]),
            (r#""max_tokens": 0"#, "max_tokens", &["at least 1", "0"]),
            (r#""max_tokens": -5"#, "max_tokens", &["at least 1"]),
        ];
        for (field, param, needles) in cases {
            assert_invalid(
                completion(&format!(r#"{{"prompt": "x", {field}}}"#)),
                param,
                needles,
            );
        }
        // Wrong JSON types are 400s naming the field, before validation.
        let err = completion(r#"{"prompt": "x", "seed": -1}"#).unwrap_err();
        let ApiError::InvalidRequest { param, message } = err else {
            panic!()
        };
        assert_eq!(param.as_deref(), Some("seed"), "{message}");
        let err = completion(r#"{"prompt": "x", "stream": "yes"}"#).unwrap_err();
        assert!(err.to_string().contains("stream"), "{err}");
    }

    #[test]
    fn echo_carries_the_prompt_text_and_asks_prompt_logprobs_with_logprobs() {
        let v = completion(r#"{"prompt": "the", "echo": true}"#).unwrap();
        assert_eq!(v.echo.as_deref(), Some("the"));
        assert_eq!(v.request.sampling.prompt_logprobs, None);
        let v = completion(r#"{"prompt": ["the"], "echo": true, "logprobs": 2}"#).unwrap();
        assert_eq!(
            (v.echo.as_deref(), v.request.sampling.prompt_logprobs),
            (Some("the"), Some(2))
        );
        let ids = tiny_tokenizer().encode("hi", false).unwrap();
        let v = completion(&format!(r#"{{"prompt": {ids:?}, "echo": true}}"#)).unwrap();
        assert_eq!(v.echo.as_deref(), Some("hi"), "token ids decoded");
        assert_eq!(
            completion(r#"{"prompt": "x", "echo": false}"#)
                .unwrap()
                .echo,
            None
        );
        // Scoring a prompt: max_tokens 0 with echo runs one token (and only then).
        let v = completion(r#"{"prompt": "x", "echo": true, "max_tokens": 0}"#).unwrap();
        assert!(v.score_only && v.request.max_tokens == 1);
        assert_invalid(
            completion(r#"{"prompt": "x", "max_tokens": 0}"#),
            "max_tokens",
            &["at least 1"],
        );
    }

    #[test]
    fn logit_shaping_and_stop_token_fields_reach_the_engine_request() {
        let fields = r#""logit_bias": {"7": 100}, "presence_penalty": 0.5,
            "repetition_penalty": 1.2, "min_tokens": 3, "stop_token_ids": [9, 4]"#;
        let chat_body =
            format!(r#"{{"messages": [{{"role": "user", "content": "x"}}], {fields}}}"#);
        for v in [
            completion(&format!(r#"{{"prompt": "x", {fields}}}"#)).unwrap(),
            chat(&chat_body, true).unwrap(),
        ] {
            let s = &v.request.sampling;
            assert_eq!(
                s.logit_bias,
                vec![deltaserve_ipc::wire::LogitBias {
                    token_id: 7,
                    bias: 100.0
                }]
            );
            let p = s.penalties.clone().unwrap();
            assert_eq!((p.presence, p.frequency, p.repetition), (0.5, 0.0, 1.2));
            assert_eq!((s.min_tokens, s.min_tokens_banned.len()), (3, 0));
            assert_eq!(v.request.stop_token_ids, vec![9, 4]);
        }
        // The chat endpoint names the field that set max_tokens.
        let body = r#"{"messages": [{"role": "user", "content": "x"}], "min_tokens": 5,
            "max_completion_tokens": 4}"#;
        assert_invalid(
            chat(body, true),
            "min_tokens",
            &["`max_completion_tokens` (4)"],
        );
    }

    #[test]
    fn context_length_checks() {
        // 64-token context, 2-token prompt.
        assert_eq!(
            completion(r#"{"prompt": [7, 8], "max_tokens": 62}"#)
                .unwrap()
                .request
                .max_tokens,
            62
        );
        assert_invalid(
            completion(r#"{"prompt": [7, 8], "max_tokens": 63}"#),
            "max_tokens",
            &["2 tokens", "63", "65", "context of 64", "at most 62"],
        );
        let long: Vec<u32> = (0..64).collect();
        assert_invalid(
            completion(&format!(r#"{{"prompt": {long:?}}}"#)),
            "prompt",
            &["64 tokens", "context is 64"],
        );
        // The default 16 is cut to what fits.
        let near: Vec<u32> = (0..60).collect();
        assert_eq!(
            completion(&format!(r#"{{"prompt": {near:?}}}"#))
                .unwrap()
                .request
                .max_tokens,
            4
        );
    }

    #[test]
    fn unknown_model_is_404() {
        let err = completion(r#"{"model": "other", "prompt": "x"}"#).unwrap_err();
        assert_eq!(err.status().as_u16(), 404);
        assert!(err.to_string().contains("`other`") && err.to_string().contains("GET /v1/models"));
        let err = chat(
            r#"{"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]}"#,
            true,
        )
        .unwrap_err();
        assert_eq!(err.status().as_u16(), 404);
    }

    #[test]
    fn chat_renders_and_limits() {
        let tok = tiny_tokenizer();
        let v = chat(r#"{"messages": [{"role": "user", "content": "hi"}], "logprobs": true, "top_logprobs": 3}"#, true).unwrap();
        assert_eq!(
            tok.decode(&v.request.prompt_token_ids).unwrap(),
            "<|im_start|>user\nhi\n<|im_start|>assistant\n"
        );
        assert_eq!(
            v.request.prompt_token_ids.len() + v.request.max_tokens as usize,
            64,
            "default: rest of context"
        );
        assert_eq!(v.request.sampling.logprobs, Some(3));
        let v = chat(r#"{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 9, "max_completion_tokens": 5}"#, true).unwrap();
        assert_eq!(v.request.max_tokens, 5);
        assert_invalid(
            chat(
                r#"{"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}"#,
                true,
            ),
            "max_completion_tokens",
            &["at least 1"],
        );
        assert_invalid(
            chat(
                r#"{"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}"#,
                true,
            ),
            "top_logprobs",
            &["requires `logprobs: true`"],
        );
        assert_invalid(
            chat(
                r#"{"messages": [{"role": "user", "content": "x"}], "logprobs": true, "top_logprobs": 21}"#,
                true,
            ),
            "top_logprobs",
            &["between 0 and 20"],
        );
        assert_invalid(
            chat(r#"{"messages": []}"#, true),
            "messages",
            &["must not be empty"],
        );
        assert_invalid(
            chat(r#"{"model": "tiny"}"#, true),
            "messages",
            &["required"],
        );
        assert_invalid(
            chat(r#"{"messages": [{"role": "user", "content": "x"}]}"#, false),
            "messages",
            &["no chat template", "/v1/completions"],
        );
        assert_invalid(
            chat(
                r#"{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}"#,
                true,
            ),
            "messages",
            &["messages[0].content", "image_url"],
        );
        let big = "x".repeat(70);
        assert_invalid(
            chat(
                &format!(r#"{{"messages": [{{"role": "user", "content": "{big}"}}]}}"#),
                true,
            ),
            "messages",
            &["context is 64"],
        );
        // A message without a role is a JSON-shape error naming the path.
        let err = chat(r#"{"messages": [{"content": "x"}]}"#, true).unwrap_err();
        let ApiError::InvalidRequest { param, message } = err else {
            panic!()
        };
        assert_eq!(param.as_deref(), Some("messages[0]"));
        assert!(message.contains("missing field `role`"), "{message}");
    }
}
