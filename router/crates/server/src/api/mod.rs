//! The client-facing HTTP layer: OpenAI-compatible endpoints (JSON and SSE), the WebSocket
//! streaming endpoint, health and metrics.
//!
//! # Layout
//!
//! ```text
//!  router() ─┬─ POST /v1/completions       completions.rs ─┐
//!            ├─ POST /v1/chat/completions  chat.rs ────────┤  ApiJson body → validate → Backend::generate
//!            ├─ GET  /v1/ws                ws.rs ──────────┘  → events → JSON | SSE chunks | WS messages
//!            ├─ GET  /v1/models, /v1/models/{id}   models.rs
//!            ├─ POST /tokenize, /detokenize        tokenize.rs
//!            ├─ POST/GET /v1/adapters, DELETE /v1/adapters/{name}   variants.rs (admin)
//!            ├─ POST /v1/load_lora_adapter, /v1/unload_lora_adapter  compat.rs (admin, vLLM's)
//!            ├─ POST /generate, /generate_stream   lorax.rs (LoRAX's / TGI's, `adapter_id`)
//!            └─ GET  /health /ready /metrics /version   health.rs
//!  openai.rs: request/response types      error.rs: ApiError (every failure), ApiJson extractor
//!  on_demand.rs: a generation's unregistered variant found in --lora-dir & co and registered
//!  choices.rs: `n` / `best_of`: one request fanned out into several engine requests, merged
//!
//!  layers, outermost first: request_id.rs (x-request-id, log span) → substitution.rs
//!  (x-deltaserve-substituted when a zoo variant ran its substitute under load) → auth.rs (key → Caller,
//!  admin routes, JSON-only state changes) → the route; tenants.rs (key file, ACL) and
//!  quotas.rs (token buckets) behind auth; usage.rs: every generation's quota hold, metering
//!  and finished-request log line
//! ```
//!
//! Handlers are generic over [`Backend`], the engine interface they use; [`router`] serves the
//! real [`EngineHandle`], tests serve a scripted fake. Cancellation is by ownership: a response
//! stream owns its request's event receiver, so a client that goes away drops the stream, which
//! drops the receiver, which the engine notices (STYLE.md #14).

pub mod auth;
mod blocking;
pub mod chat;
pub mod choices;
pub mod compat;
pub mod completions;
pub mod error;
pub mod health;
pub mod hygiene;
pub mod lorax;
pub mod models;
pub mod on_demand;
pub mod openai;
pub mod quotas;
pub mod request_id;
mod stream_start;
pub mod substitution;
pub mod tenants;
pub mod tokenize;
pub mod tools;
pub mod usage;
pub mod variants;
pub mod ws;

use std::future::Future;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::extract::DefaultBodyLimit;
use axum::http::{Method, Uri};
use axum::response::sse::Event;
use axum::routing::{get, post};
use axum::Router;
use deltaserve_ipc::wire::VariantKind;
use deltaserve_ipc::wire::{PromptLogprob, TokenLogprob};
use tokio::sync::mpsc::UnboundedReceiver;

use crate::api::openai::Usage;
use crate::engine::{
    EngineError, EngineHandle, EngineMetrics, FinishReason, GenerateEvent, GenerateRequest,
    ServedModel, VariantError,
};
use crate::registry::VariantEntry;
use crate::text::chat_template::ChatTemplate;
use crate::text::tokenizer::TextTokenizer;
use crate::validate::ModelContext;
use error::ApiError;
use tenants::{AccessControl, Caller};

/// Largest request body (and WebSocket message) accepted; larger ones get a 413 JSON error.
pub const MAX_BODY_BYTES: usize = 8 << 20;

/// What the API needs from the engine. [`EngineHandle`] is the implementation that serves.
pub trait Backend: Clone + Send + Sync + 'static {
    /// Queues a request; its events arrive on the receiver, and dropping it cancels.
    fn generate(
        &self,
        req: GenerateRequest,
    ) -> impl Future<Output = Result<UnboundedReceiver<GenerateEvent>, EngineError>> + Send;
    /// Queues the choices of one request (`n` / `best_of`) together, so they can share the
    /// prompt's KV pages; receivers in choice order. On a refusal, those already queued are
    /// cancelled (dropped). By default one [`Backend::generate`] each.
    fn generate_choices(
        &self,
        reqs: Vec<GenerateRequest>,
    ) -> impl Future<Output = Result<Vec<UnboundedReceiver<GenerateEvent>>, EngineError>> + Send
    {
        async move {
            let mut receivers = Vec::with_capacity(reqs.len());
            for req in reqs {
                receivers.push(self.generate(req).await?);
            }
            Ok(receivers)
        }
    }
    /// The served model.
    fn model(&self) -> &ServedModel;
    /// Its tokenizer.
    fn tokenizer(&self) -> &Arc<TextTokenizer>;
    /// Its chat template, if any.
    fn chat_template(&self) -> Option<&Arc<ChatTemplate>>;
    /// Whether requests can be served now.
    fn is_ready(&self) -> bool;
    /// Engine counters for `/metrics`.
    fn metrics(&self) -> impl Future<Output = EngineMetrics> + Send;
    /// Registers a variant directory (LoRA or delta, told apart by its files) under `name`,
    /// validated by a worker first; with `kind`, only that kind is accepted.
    fn register_adapter(
        &self,
        name: String,
        path: PathBuf,
        kind: Option<VariantKind>,
    ) -> impl Future<Output = Result<VariantEntry, VariantError>> + Send;
    /// Deletes adapter `name` once its in-flight requests are done.
    fn delete_adapter(
        &self,
        name: String,
    ) -> impl Future<Output = Result<VariantEntry, VariantError>> + Send;
    /// The variant id a request for `adapter_id` runs instead right now (its substitute under
    /// load, `crate::substitution`; 0: the base), or `None` to run it as asked.
    fn substitute(&self, adapter_id: u32) -> Option<u32> {
        let _ = adapter_id;
        None
    }
    /// Whether a request still queued past the TTFT SLO is answered with a 429 instead of
    /// running (`--ttft-slo-ms`): streamed responses then hold their status until each choice
    /// has started (`stream_start.rs`).
    fn expires_queued_requests(&self) -> bool {
        false
    }
}

impl Backend for EngineHandle {
    fn generate(
        &self,
        req: GenerateRequest,
    ) -> impl Future<Output = Result<UnboundedReceiver<GenerateEvent>, EngineError>> + Send {
        EngineHandle::generate(self, req)
    }
    fn generate_choices(
        &self,
        reqs: Vec<GenerateRequest>,
    ) -> impl Future<Output = Result<Vec<UnboundedReceiver<GenerateEvent>>, EngineError>> + Send
    {
        EngineHandle::generate_choices(self, reqs)
    }
    fn model(&self) -> &ServedModel {
        EngineHandle::model(self)
    }
    fn tokenizer(&self) -> &Arc<TextTokenizer> {
        EngineHandle::tokenizer(self)
    }
    fn chat_template(&self) -> Option<&Arc<ChatTemplate>> {
        EngineHandle::chat_template(self)
    }
    fn is_ready(&self) -> bool {
        EngineHandle::is_ready(self)
    }
    fn metrics(&self) -> impl Future<Output = EngineMetrics> + Send {
        EngineHandle::metrics(self)
    }
    async fn register_adapter(
        &self,
        name: String,
        path: PathBuf,
        kind: Option<VariantKind>,
    ) -> Result<VariantEntry, VariantError> {
        EngineHandle::register_adapter(self, &name, &path, kind).await
    }
    fn substitute(&self, adapter_id: u32) -> Option<u32> {
        let registry = &self.model().adapters;
        let name = registry.name_of(adapter_id).filter(|_| adapter_id != 0)?;
        match registry
            .substitutions()
            .pick(&name, self.outstanding(), self.capacity())?
        {
            crate::substitution::Substitute::Base => Some(0),
            crate::substitution::Substitute::Variant(sub) => registry.active_id(&sub),
        }
    }
    async fn delete_adapter(&self, name: String) -> Result<VariantEntry, VariantError> {
        EngineHandle::delete_adapter(self, &name).await
    }
    fn expires_queued_requests(&self) -> bool {
        EngineHandle::expires_queued_requests(self)
    }
}

/// Every route, serving `engine`, open to anyone (no keys).
pub fn router(engine: EngineHandle) -> Router {
    router_with(engine)
}

/// Every route, serving any [`Backend`] (tests use a scripted one), open to anyone.
pub fn router_with<B: Backend>(backend: B) -> Router {
    secured_router(backend, Arc::new(AccessControl::open()))
}

/// Every route, serving `backend` to the callers `access` admits (see `auth.rs`), with no
/// cross-origin browser requests allowed (see `hygiene.rs`).
pub fn secured_router<B: Backend>(backend: B, access: Arc<AccessControl>) -> Router {
    guarded_router(backend, access, Default::default())
}

/// [`secured_router`] where browsers on `allowed_origins` (`--allowed-origins`) may call the
/// state-changing routes too.
pub fn guarded_router<B: Backend>(
    backend: B,
    access: Arc<AccessControl>,
    allowed_origins: Arc<hygiene::AllowedOrigins>,
) -> Router {
    let hygiene = hygiene::Hygiene {
        allowed_origins,
        access: access.clone(),
    };
    Router::new()
        .route("/v1/completions", post(completions::completions::<B>))
        .route("/v1/chat/completions", post(chat::chat_completions::<B>))
        .route("/v1/models", get(models::list_models::<B>))
        .route("/v1/models/{id}", get(models::get_model::<B>))
        .route("/tokenize", post(tokenize::tokenize::<B>))
        .route("/detokenize", post(tokenize::detokenize::<B>))
        .route(
            "/v1/adapters",
            get(variants::list_adapters::<B>).post(variants::create_adapter::<B>),
        )
        .route(
            "/v1/adapters/{name}",
            axum::routing::delete(variants::delete_adapter::<B>),
        )
        .route(
            "/v1/load_lora_adapter",
            post(compat::load_lora_adapter::<B>),
        )
        .route(
            "/v1/unload_lora_adapter",
            post(compat::unload_lora_adapter::<B>),
        )
        .route("/generate", post(lorax::generate::<B>))
        .route("/generate_stream", post(lorax::generate_stream::<B>))
        .route("/v1/ws", get(ws::ws_upgrade::<B>))
        .route("/health", get(health::health))
        .route("/version", get(health::version))
        .route("/ready", get(health::ready::<B>))
        .route("/metrics", get(health::metrics::<B>))
        .fallback(|uri: Uri| async move { ApiError::RouteNotFound(uri.path().to_string()) })
        .method_not_allowed_fallback(|method: Method, uri: Uri| async move {
            ApiError::MethodNotAllowed(format!("{method} {}", uri.path()))
        })
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(axum::middleware::from_fn_with_state(
            access,
            auth::authenticate,
        ))
        .layer(axum::middleware::from_fn_with_state(
            hygiene,
            hygiene::check,
        ))
        .layer(axum::middleware::from_fn(substitution::header))
        .layer(axum::middleware::from_fn(request_id::tag))
        .with_state(backend)
}

/// Validation's view of a backend, for `caller`.
pub(crate) fn model_context<'a, B: Backend>(b: &'a B, caller: &'a Caller) -> ModelContext<'a> {
    ModelContext {
        model: b.model(),
        tokenizer: b.tokenizer(),
        chat_template: b.chat_template().map(|t| &**t),
        caller: Some(caller),
    }
}

/// A response id: `prefix-` + 24 hex digits, unique within the process and across restarts.
pub(crate) fn response_id(prefix: &str) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    format!("{prefix}-{nanos:016x}{:08x}", n as u32)
}

/// Unix seconds now.
pub(crate) fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// One generated token as the response builders see it.
#[derive(Debug, Clone)]
pub(crate) struct TokenRecord {
    /// The token id.
    pub token_id: u32,
    /// The text this token released (may be empty).
    pub text: String,
    /// Its logprob, when asked for.
    pub logprob: Option<f64>,
    /// Alternatives, when asked for.
    pub top_logprobs: Vec<TokenLogprob>,
}

/// A unit of output for a response: text with the tokens that produced it, or the end.
#[derive(Debug)]
pub(crate) enum Piece {
    /// The prompt tokens' logprobs (`echo` with logprobs), before any text.
    Prompt(Vec<PromptLogprob>),
    /// Non-empty text, and every token since the previous piece (tokens that released no text
    /// ride along with the next one that does).
    Text {
        text: String,
        tokens: Vec<TokenRecord>,
    },
    /// The request ended; `tokens` are those that released no text since the last piece.
    Finished {
        reason: FinishReason,
        prompt_tokens: u32,
        completion_tokens: u32,
        tokens: Vec<TokenRecord>,
    },
    /// The request failed.
    Failed(ApiError),
}

/// A whole non-streamed answer.
pub(crate) struct Collected {
    /// All generated text.
    pub text: String,
    /// Every generated token, for logprobs.
    pub tokens: Vec<TokenRecord>,
    /// Why it ended.
    pub reason: FinishReason,
    /// Prompt and completion token counts.
    pub usage: Usage,
    /// The prompt tokens' logprobs, when asked for (`echo`).
    pub prompt_logprobs: Vec<PromptLogprob>,
}

/// Groups a request's events into [`Piece`]s. Owns the receiver: dropping this cancels.
pub(crate) struct Pieces {
    /// The request's events.
    rx: UnboundedReceiver<GenerateEvent>,
    /// Tokens whose text was empty, waiting for the next piece.
    pending: Vec<TokenRecord>,
    /// A `Finished` or `Failed` piece was returned.
    ended: bool,
    /// A piece already taken that `next` returns first (`stream_start.rs`).
    held: Option<Piece>,
}

impl Pieces {
    pub(crate) fn new(rx: UnboundedReceiver<GenerateEvent>) -> Self {
        Self {
            rx,
            pending: Vec::new(),
            ended: false,
            held: None,
        }
    }

    /// Makes `piece`, taken with [`Pieces::next`], the next piece again.
    pub(crate) fn put_back(&mut self, piece: Piece) {
        debug_assert!(self.held.is_none(), "one piece is put back at a time");
        self.held = Some(piece);
    }

    /// Waits for the whole answer (non-streaming responses): all text and tokens, and how it ended.
    pub(crate) async fn collect(mut self) -> Result<Collected, ApiError> {
        let mut text = String::new();
        let mut tokens = Vec::new();
        let mut prompt_logprobs = Vec::new();
        loop {
            match self.next().await {
                Some(Piece::Prompt(logprobs)) => prompt_logprobs = logprobs,
                Some(Piece::Text {
                    text: t,
                    tokens: mut ts,
                }) => {
                    text.push_str(&t);
                    tokens.append(&mut ts);
                }
                Some(Piece::Finished {
                    reason,
                    prompt_tokens,
                    completion_tokens,
                    tokens: mut ts,
                }) => {
                    tokens.append(&mut ts);
                    return Ok(Collected {
                        text,
                        tokens,
                        reason,
                        usage: Usage::new(prompt_tokens, completion_tokens),
                        prompt_logprobs,
                    });
                }
                Some(Piece::Failed(e)) => return Err(e),
                None => unreachable!("Pieces ends with Finished or Failed"),
            }
        }
    }

    /// The next piece; `None` after the last.
    pub(crate) async fn next(&mut self) -> Option<Piece> {
        if let Some(piece) = self.held.take() {
            return Some(piece);
        }
        if self.ended {
            return None;
        }
        loop {
            let piece = match self.rx.recv().await {
                Some(GenerateEvent::PromptLogprobs { logprobs }) => {
                    return Some(Piece::Prompt(logprobs));
                }
                Some(GenerateEvent::Token {
                    token_id,
                    text,
                    logprob,
                    top_logprobs,
                }) => {
                    let empty = text.is_empty();
                    self.pending.push(TokenRecord {
                        token_id,
                        text,
                        logprob,
                        top_logprobs,
                    });
                    if empty {
                        continue;
                    }
                    let tokens = std::mem::take(&mut self.pending);
                    let text = tokens.iter().map(|t| t.text.as_str()).collect();
                    return Some(Piece::Text { text, tokens });
                }
                Some(GenerateEvent::Finished {
                    reason,
                    prompt_tokens,
                    completion_tokens,
                }) => Piece::Finished {
                    reason,
                    prompt_tokens,
                    completion_tokens,
                    tokens: std::mem::take(&mut self.pending),
                },
                Some(GenerateEvent::Error { message }) => {
                    // The worker could not compile the request's grammar: the client's error.
                    if message.starts_with(crate::validate::response_format::GRAMMAR_REFUSED) {
                        Piece::Failed(ApiError::invalid("response_format", message))
                    } else if message.starts_with(crate::engine::SLO_EXPIRED) {
                        Piece::Failed(ApiError::OverSlo(crate::engine::SloRefusal {
                            bound: "ttft_slo_ms",
                            retry_after_secs: 1,
                            message,
                        }))
                    } else {
                        Piece::Failed(ApiError::Internal(message))
                    }
                }
                None => Piece::Failed(ApiError::Internal(
                    "the engine ended the request without a result".into(),
                )),
            };
            self.ended = true;
            return Some(piece);
        }
    }
}

/// An SSE event carrying `value` as JSON.
pub(crate) fn sse_json<T: serde::Serialize>(value: &T) -> Event {
    Event::default()
        .data(serde_json::to_string(value).unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}")))
}

/// The `data: [DONE]` terminator of OpenAI streams.
pub(crate) fn sse_done() -> Event {
    Event::default().data("[DONE]")
}

/// Test doubles shared by the API tests.
#[cfg(test)]
pub(crate) mod fake {
    use std::sync::Mutex;

    use tokio::sync::mpsc;

    use super::*;
    use crate::registry::{VariantFootprint, VariantRegistry};
    use crate::text::test_support::tiny_tokenizer;

    /// What the fake engine does with one request.
    #[derive(Clone)]
    pub enum Script {
        /// Send these events, then keep the sender (so the request stays open unless they end it).
        Events(Vec<GenerateEvent>),
        /// Refuse the request.
        Refuse(EngineError),
    }

    /// A scripted engine: replies to every `generate` with its script, records the requests,
    /// and keeps the senders so tests can see when a client's receiver was dropped.
    #[derive(Clone)]
    pub struct FakeBackend {
        pub model: Arc<ServedModel>,
        pub tokenizer: Arc<TextTokenizer>,
        pub template: Option<Arc<ChatTemplate>>,
        pub ready: bool,
        /// What [`Backend::expires_queued_requests`] answers (as if `--ttft-slo-ms` were set).
        pub expires_queued: bool,
        pub script: Arc<Mutex<Script>>,
        pub requests: Arc<Mutex<Vec<GenerateRequest>>>,
        pub senders: Arc<Mutex<Vec<mpsc::UnboundedSender<GenerateEvent>>>>,
    }

    /// The ChatML template used by the API tests.
    pub const CHATML: &str = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

    impl FakeBackend {
        pub fn new(script: Script) -> Self {
            Self {
                model: Arc::new(ServedModel {
                    name: "tiny".into(),
                    max_model_len: 64,
                    vocab_size: 300,
                    created: 1_700_000_000,
                    adapters: Arc::new(VariantRegistry::new("tiny")),
                    sampling_defaults: Default::default(),
                }),
                tokenizer: tiny_tokenizer(),
                template: Some(Arc::new(
                    ChatTemplate::new(CHATML.into(), None, None).unwrap(),
                )),
                ready: true,
                expires_queued: false,
                script: Arc::new(Mutex::new(script)),
                requests: Arc::default(),
                senders: Arc::default(),
            }
        }

        /// A script producing `texts` as tokens (ids 10, 11, ...) then `Finished`.
        pub fn tokens(texts: &[&str], reason: FinishReason) -> Script {
            let mut events: Vec<GenerateEvent> = texts
                .iter()
                .enumerate()
                .map(|(i, t)| GenerateEvent::Token {
                    token_id: 10 + i as u32,
                    text: t.to_string(),
                    logprob: Some(-0.5 * i as f64),
                    top_logprobs: vec![
                        TokenLogprob {
                            token_id: 10 + i as u32,
                            logprob: -0.5 * i as f64,
                        },
                        TokenLogprob {
                            token_id: 100,
                            logprob: -3.0,
                        },
                    ],
                })
                .collect();
            events.push(GenerateEvent::Finished {
                reason,
                prompt_tokens: 3,
                completion_tokens: texts.len() as u32,
            });
            Script::Events(events)
        }

        /// True when every request's receiver has been dropped (the client went away).
        pub fn all_cancelled(&self) -> bool {
            self.senders.lock().unwrap().iter().all(|s| s.is_closed())
        }
    }

    impl Backend for FakeBackend {
        fn generate(
            &self,
            req: GenerateRequest,
        ) -> impl Future<Output = Result<UnboundedReceiver<GenerateEvent>, EngineError>> + Send
        {
            let script = self.script.lock().unwrap().clone();
            self.requests.lock().unwrap().push(req);
            let senders = self.senders.clone();
            async move {
                match script {
                    Script::Refuse(e) => Err(e),
                    Script::Events(events) => {
                        let (tx, rx) = mpsc::unbounded_channel();
                        for e in events {
                            let _ = tx.send(e);
                        }
                        senders.lock().unwrap().push(tx);
                        Ok(rx)
                    }
                }
            }
        }
        fn model(&self) -> &ServedModel {
            &self.model
        }
        fn tokenizer(&self) -> &Arc<TextTokenizer> {
            &self.tokenizer
        }
        fn chat_template(&self) -> Option<&Arc<ChatTemplate>> {
            self.template.as_ref()
        }
        fn is_ready(&self) -> bool {
            self.ready
        }
        fn expires_queued_requests(&self) -> bool {
            self.expires_queued
        }
        async fn metrics(&self) -> EngineMetrics {
            EngineMetrics {
                requests_running: 2,
                kv_blocks_free: 7,
                kv_blocks_total: 10,
                deltas_on_gpu: 1,
                delta_skips_total: 5,
                delta_skip_preemptions_total: 2,
                adapter_host_deferrals_total: 3,
                adapter_gpu_load_deferrals_total: 4,
                worker_step_us_total: 900,
                worker_forward_us_total: 800,
                ..Default::default()
            }
        }
        /// Accepts any path except one containing `bad-dora`, which it refuses as a worker would;
        /// a path containing `delta` holds a delta, any other a LoRA adapter.
        async fn register_adapter(
            &self,
            name: String,
            path: PathBuf,
            kind: Option<VariantKind>,
        ) -> Result<VariantEntry, VariantError> {
            let found = if path.to_string_lossy().contains("delta") {
                VariantKind::Delta
            } else {
                VariantKind::Lora
            };
            crate::engine::check_kind(found, kind, &path)?;
            let registry = &self.model.adapters;
            let id = registry.reserve(&name, path.clone(), 1_700_000_001)?;
            if path.to_string_lossy().contains("bad-dora") {
                registry.remove(id);
                return Err(VariantError::Invalid {
                    message: format!(
                        "{}: adapter_config.json: use_dora is not supported",
                        path.display()
                    ),
                    param: "path",
                });
            }
            let footprint = match found {
                VariantKind::Lora => VariantFootprint {
                    kind: found,
                    summary: "rank 8".into(),
                    num_blocks: 2,
                    host_bytes: 4096,
                    max_rank: 8,
                    target_modules: vec!["q_proj".into(), "v_proj".into()],
                },
                VariantKind::Delta => VariantFootprint {
                    kind: found,
                    summary: "4-bit 2:4, 2.6x smaller than fp16".into(),
                    num_blocks: 0,
                    host_bytes: 1 << 20,
                    max_rank: 0,
                    target_modules: vec!["q_proj".into(), "down_proj".into()],
                },
            };
            Ok(registry.activate(id, footprint).unwrap())
        }
        async fn delete_adapter(&self, name: String) -> Result<VariantEntry, VariantError> {
            let entry = self.model.adapters.begin_delete(&name)?;
            self.model.adapters.remove(entry.id);
            Ok(entry)
        }
    }
}

#[cfg(test)]
pub(crate) mod test_http {
    //! Drives the router in memory.
    use axum::body::Body;
    use axum::http::{Request, StatusCode};
    use http_body_util::BodyExt;
    use tower::ServiceExt;

    /// Sends a request; returns the status, headers and body text.
    pub async fn send(
        router: axum::Router,
        method: &str,
        path: &str,
        content_type: Option<&str>,
        body: impl Into<Body>,
    ) -> (StatusCode, axum::http::HeaderMap, String) {
        let mut req = Request::builder().method(method).uri(path);
        if let Some(ct) = content_type {
            req = req.header("content-type", ct);
        }
        let response = router
            .oneshot(req.body(body.into()).unwrap())
            .await
            .unwrap();
        let status = response.status();
        let headers = response.headers().clone();
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        (status, headers, String::from_utf8(bytes.to_vec()).unwrap())
    }

    /// POSTs a JSON body.
    pub async fn post_json(
        router: axum::Router,
        path: &str,
        body: impl Into<String>,
    ) -> (StatusCode, axum::http::HeaderMap, String) {
        send(router, "POST", path, Some("application/json"), body.into()).await
    }

    /// Parses `body` as OpenAI's error JSON; returns (type, param, message).
    pub fn error_fields(body: &str) -> (String, Option<String>, String) {
        let v: serde_json::Value =
            serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {body}"));
        let e = &v["error"];
        (
            e["type"].as_str().unwrap().to_string(),
            e["param"].as_str().map(str::to_string),
            e["message"].as_str().unwrap().to_string(),
        )
    }

    /// The `data:` payloads of an SSE body, checking the framing.
    pub fn sse_data(body: &str) -> Vec<String> {
        assert!(body.ends_with("\n\n"), "{body:?}");
        body.split("\n\n")
            .filter(|e| !e.is_empty())
            .map(|e| {
                e.strip_prefix("data: ")
                    .unwrap_or_else(|| panic!("bad SSE event {e:?}"))
                    .to_string()
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::fake::FakeBackend;
    use super::test_http::*;
    use super::*;

    #[tokio::test]
    async fn unknown_route_method_and_huge_body_are_json_errors() {
        let app = router_with(FakeBackend::new(FakeBackend::tokens(
            &["a"],
            FinishReason::Stop,
        )));
        let (status, _, body) = send(app.clone(), "GET", "/v2/nothing", None, "").await;
        assert_eq!(status, 404);
        assert_eq!(error_fields(&body).0, "not_found_error");
        let (status, _, body) = send(app.clone(), "GET", "/v1/completions", None, "").await;
        assert_eq!(status, 405);
        assert!(error_fields(&body).2.contains("GET /v1/completions"));
        let huge = format!(r#"{{"prompt": "{}"}}"#, "a".repeat(MAX_BODY_BYTES + 1));
        let (status, _, body) = post_json(app, "/v1/completions", &huge).await;
        assert_eq!(status, 413);
        assert_eq!(error_fields(&body).0, "request_too_large");
    }

    #[tokio::test]
    async fn pieces_attach_textless_tokens_to_the_next_text() {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        for (id, text) in [(1, ""), (2, "ab"), (3, ""), (4, "")] {
            tx.send(GenerateEvent::Token {
                token_id: id,
                text: text.into(),
                logprob: None,
                top_logprobs: vec![],
            })
            .unwrap();
        }
        tx.send(GenerateEvent::Finished {
            reason: FinishReason::Length,
            prompt_tokens: 1,
            completion_tokens: 4,
        })
        .unwrap();
        let mut pieces = Pieces::new(rx);
        let Some(Piece::Text { text, tokens }) = pieces.next().await else {
            panic!()
        };
        assert_eq!((text.as_str(), tokens.len()), ("ab", 2));
        let Some(Piece::Finished { reason, tokens, .. }) = pieces.next().await else {
            panic!()
        };
        assert_eq!((reason, tokens.len()), (FinishReason::Length, 2));
        assert!(pieces.next().await.is_none());
        // A sender dropped without a last event is a failure, not a hang.
        drop(tx);
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<GenerateEvent>();
        drop(tx);
        let Some(Piece::Failed(e)) = Pieces::new(rx).next().await else {
            panic!()
        };
        assert_eq!(e.status(), 500);
    }
}
