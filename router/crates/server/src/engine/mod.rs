//! The engine: what the API layer talks to. A cloneable [`EngineHandle`] in front of one
//! engine actor per worker process, each owning its own scheduler.
//!
//! ```text
//!  api ──generate()──▶ EngineHandle ──(--placement)──▶ actor[i] ──StepPlan──▶ worker[i]
//!   ▲                                                     │  ◀──StepOutput──
//!   └──────────── GenerateEvent (mpsc, per request) ◀─────┘
//! ```
//!
//! A request's events arrive on the receiver returned by [`EngineHandle::generate`]; dropping
//! that receiver is how a client cancels (the actor notices the closed channel at its next step,
//! STYLE.md #14).
//!
//! # Layout
//!
//! - this file: the handle, the request/event types;
//! - `placement.rs`: which worker a request goes to (`--placement`: CaraServe's rank-aware cost,
//!   least loaded, first fit, random) and the latency profile it prices with;
//!   `placement_load.rs`: each worker's load as its actor publishes it;
//! - `command.rs`: the actor protocol (`Command`, `ActorRef`, `RemoveOutcome`);
//! - `actor.rs`: one worker's actor: its loop, commands, steps and the worker's lifecycle;
//! - `plan.rs`: scheduler ⇄ wire translation (step plans, adapter ops, scheduler config);
//! - `streams.rs`: the live requests: detokenizing, stop strings, event fan-out, latencies;
//! - `admin.rs`: registering and deleting adapters (inspect, register with rollback, delete);
//! - `peft_config.rs`: a LoRA adapter's `adapter_config.json` type-checked and its regexes
//!   compiled (linear-time engine) before any worker reads it;
//! - [`metrics`]: the one table of engine metrics, its sum over workers and its Prometheus
//!   families, and the request latency histograms.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use deltaserve_ipc::wire::{PromptLogprob, SamplingParams, TokenLogprob};
use tokio::sync::{mpsc, oneshot};

use crate::registry::VariantRegistry;
use crate::text::chat_template::ChatTemplate;
use crate::text::tokenizer::TextTokenizer;
use command::{ActorRef, Command};

mod actor;
mod admin;
pub mod admission;
mod command;
pub mod metrics;
mod peft_config;
pub mod placement;
pub mod placement_load;
mod plan;
mod streams;

pub(crate) use actor::{Actor, SLO_EXPIRED};
pub use admin::{check_kind, variant_kind_of_dir, VariantError};
pub use admission::{Slo, SloRefusal};
pub use metrics::{EngineMetrics, RequestLatency};
pub use placement::{LatencyProfile, Placement, Placer};
pub use plan::SchedLimits;

/// One generation, already tokenized and validated by the API layer.
#[derive(Debug, Clone)]
pub struct GenerateRequest {
    /// The prompt, as token ids.
    pub prompt_token_ids: Vec<u32>,
    /// Most tokens to generate (≥ 1; prompt + max_tokens fits the context, checked upstream).
    pub max_tokens: u32,
    /// Sampling parameters, passed to the worker unchanged.
    pub sampling: SamplingParams,
    /// Stop strings: the request ends when one appears, and it is never emitted.
    pub stop: Vec<String>,
    /// Keep generating past EOS tokens (benchmarks force output lengths with this).
    pub ignore_eos: bool,
    /// The variant to apply, a LoRA adapter or a delta (its worker id from the registry), 0 for
    /// the base model.
    pub adapter_id: u32,
    /// Token ids that end the request like EOS (vLLM's `stop_token_ids`, even with
    /// `ignore_eos`): finish reason `stop`, and the token's text is not emitted.
    pub stop_token_ids: Vec<u32>,
}

impl GenerateRequest {
    /// Every token that ends this request: the model's `eos` ids unless `ignore_eos`, then its
    /// `stop_token_ids`.
    pub fn ending_token_ids(&self, eos: &[u32]) -> Vec<u32> {
        let mut ids = if self.ignore_eos {
            Vec::new()
        } else {
            eos.to_vec()
        };
        for &t in &self.stop_token_ids {
            if !ids.contains(&t) {
                ids.push(t);
            }
        }
        ids
    }
}

/// What a request's receiver gets, in order: `PromptLogprobs` when asked for, `Token`s, then
/// exactly one `Finished` or `Error`.
#[derive(Debug, Clone)]
pub enum GenerateEvent {
    /// The prompt tokens' logprobs (`SamplingParams::prompt_logprobs`, for `echo`), positions
    /// 1.. in order; sent once, just before the first `Token`.
    PromptLogprobs { logprobs: Vec<PromptLogprob> },
    /// One generated token and the text it made safe to emit (may be empty; held back while it
    /// could start a stop string).
    Token {
        token_id: u32,
        text: String,
        logprob: Option<f64>,
        top_logprobs: Vec<TokenLogprob>,
    },
    /// Last event: why it ended and the usage.
    Finished {
        reason: FinishReason,
        prompt_tokens: u32,
        completion_tokens: u32,
    },
    /// The request failed (worker error or restart); last event.
    Error { message: String },
}

/// Why a request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// An EOS token or a stop string.
    Stop,
    /// `max_tokens` reached.
    Length,
    /// Cancelled by the client.
    Abort,
}

impl FinishReason {
    /// The OpenAI spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
        }
    }
}

/// Why the engine could not take a request.
#[derive(Debug, Clone, thiserror::Error)]
pub enum EngineError {
    /// Too much queued work; the client should retry later (429).
    #[error("{0}")]
    Overloaded(String),
    /// No worker can take requests right now, e.g. while one restarts (503).
    #[error("{0}")]
    Unavailable(String),
    /// The request cannot be served as given (400).
    #[error("{0}")]
    InvalidRequest(String),
    /// Admission control predicts the request would miss its SLO: refused at once (429 with
    /// the predicted queue drain time as `Retry-After`).
    #[error("{0}")]
    OverSlo(SloRefusal),
}

/// The model as clients see it.
#[derive(Debug, Clone)]
pub struct ServedModel {
    /// Name clients put in the `model` field.
    pub name: String,
    /// Longest prompt + output accepted (the smallest over all workers).
    pub max_model_len: u32,
    /// Tokens the model knows; ids at or above are refused.
    pub vocab_size: u32,
    /// Unix time the server started, for `/v1/models`.
    pub created: u64,
    /// The variants (LoRA adapters and compressed deltas) served on top of the base, selectable
    /// as `"<name>:<adapter>"` or by adapter name while active.
    pub adapters: Arc<VariantRegistry>,
    /// Sampling defaults from the model's `generation_config.json` (`--generation-config`).
    pub sampling_defaults: crate::sampling_defaults::SamplingDefaults,
}

impl ServedModel {
    /// The name responses report for adapter `id` (what `/v1/models` lists): `<base>:<adapter>`,
    /// or the base name for 0.
    pub fn display_name(&self, id: u32) -> String {
        match self.adapters.name_of(id) {
            Some(a) if id != 0 => format!("{}:{a}", self.name),
            _ => self.name.clone(),
        }
    }

    /// The adapter id a `model` field selects: absent or the base name → 0 (base only);
    /// `"<base>:<adapter>"` or a bare adapter name of an active adapter → that adapter;
    /// anything else → `None`.
    pub fn resolve(&self, requested: Option<&str>) -> Option<u32> {
        let Some(name) = requested else {
            return Some(0);
        };
        if name == self.name {
            return Some(0);
        }
        let adapter = match name.split_once(':') {
            Some((base, adapter)) if base == self.name => adapter,
            Some(_) => return None,
            None => name,
        };
        self.adapters.active_id(adapter)
    }
}

/// Cloneable front of the engine.
#[derive(Clone)]
pub struct EngineHandle {
    inner: Arc<HandleInner>,
}

struct HandleInner {
    actors: Vec<ActorRef>,
    model: ServedModel,
    tokenizer: Arc<TextTokenizer>,
    chat_template: Option<Arc<ChatTemplate>>,
    /// Most requests queued or running per worker before new ones get 429.
    max_outstanding_per_worker: usize,
    /// Closed once every actor has ended (its worker stopped): see [`EngineHandle::stopped`].
    stopped: tokio::sync::watch::Receiver<()>,
    /// Which worker a request goes to (`placement.rs`).
    placer: Placer,
    /// Variant id -> (rank, host bytes), read from the registry on a miss (placement's input).
    ranks: Mutex<HashMap<u32, (u32, u64)>>,
    /// Requests placed so far: `random`'s draw.
    tickets: AtomicU64,
}

impl EngineHandle {
    pub(crate) fn new(
        actors: Vec<ActorRef>,
        model: ServedModel,
        tokenizer: Arc<TextTokenizer>,
        chat_template: Option<Arc<ChatTemplate>>,
        max_outstanding_per_worker: usize,
        stopped: tokio::sync::watch::Receiver<()>,
    ) -> Self {
        Self {
            inner: Arc::new(HandleInner {
                actors,
                model,
                tokenizer,
                chat_template,
                max_outstanding_per_worker,
                stopped,
                placer: Placer {
                    policy: Placement::Caraserve,
                    profile: LatencyProfile::default(),
                    tpot_slo_us: None,
                    max_num_seqs: max_outstanding_per_worker,
                },
                ranks: Mutex::new(HashMap::new()),
                tickets: AtomicU64::new(0),
            }),
        }
    }

    /// Sets how requests are placed across workers (`--placement`, its latency profile and the
    /// TPOT SLO); call right after [`Self::new`], before the handle is cloned. With more than
    /// one worker, the actors then publish their load after every step.
    pub fn with_placer(mut self, placer: Placer) -> Self {
        let inner = Arc::get_mut(&mut self.inner).expect("with_placer before the handle is cloned");
        inner.placer = placer;
        let wanted = inner.actors.len() > 1;
        for a in &inner.actors {
            a.load.wanted.store(wanted, Ordering::Relaxed);
        }
        self
    }

    /// The worker `req` goes to (`placement.rs`), counted in its load, and whether placement
    /// predicted a step over the TPOT SLO there; an error when none is ready.
    fn place(&self, req: &GenerateRequest) -> Result<(&ActorRef, bool), EngineError> {
        let inner = &self.inner;
        let unavailable =
            || EngineError::Unavailable("no worker is ready (starting or restarting)".into());
        if inner.actors.len() == 1 {
            let a = &inner.actors[0];
            if !a.ready.load(Ordering::Acquire) {
                return Err(unavailable());
            }
            a.load.placed(0, 0, false);
            return Ok((a, false));
        }
        let ranks = self.ranks_with(req.adapter_id);
        let views: Vec<_> = inner
            .actors
            .iter()
            .map(|a| {
                let outstanding = a.outstanding.load(Ordering::Relaxed);
                let room = outstanding < inner.max_outstanding_per_worker;
                a.load.view(
                    a.ready.load(Ordering::Acquire),
                    outstanding,
                    room,
                    req.adapter_id,
                    &ranks,
                )
            })
            .collect();
        let (rank, adapter_bytes) = ranks.get(&req.adapter_id).copied().unwrap_or((0, 0));
        let incoming = placement::Incoming {
            rank,
            prompt_tokens: req.prompt_token_ids.len() as u32,
            adapter_bytes,
        };
        let ticket = inner.tickets.fetch_add(1, Ordering::Relaxed);
        let choice = inner
            .placer
            .choose(&views, &incoming, ticket)
            .ok_or_else(unavailable)?;
        let actor = &inner.actors[choice.worker];
        actor
            .load
            .placed(req.adapter_id, req.prompt_token_ids.len(), choice.over_slo);
        Ok((actor, choice.over_slo))
    }

    /// The ranks and host bytes of the registered variants, refreshed from the registry when
    /// `adapter_id` is not known yet.
    fn ranks_with(&self, adapter_id: u32) -> HashMap<u32, (u32, u64)> {
        let mut ranks = self.inner.ranks.lock().expect("ranks lock");
        if adapter_id != 0 && !ranks.contains_key(&adapter_id) {
            ranks.clear();
            for e in self.inner.model.adapters.list() {
                if let Some(f) = e.footprint {
                    ranks.insert(e.id, (f.max_rank, f.host_bytes));
                }
            }
        }
        ranks.clone()
    }

    /// Resolves once every actor has ended and so stopped its worker (they end when the last
    /// handle is dropped; this future holds none). A process exiting before then would cut the
    /// actors' shutdown short: each worker SIGKILLed mid-exit, left dying under init.
    pub fn stopped(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut stopped = self.inner.stopped.clone();
        async move {
            // Nothing is ever sent: this returns when the last actor drops its sender.
            let _ = stopped.changed().await;
        }
    }

    /// Requests queued or running on every worker (the drain waits for 0).
    pub fn outstanding(&self) -> usize {
        self.inner
            .actors
            .iter()
            .map(|a| a.outstanding.load(Ordering::Relaxed))
            .sum()
    }

    /// Requests the workers take queued or running before new ones get 429
    /// (`--max-queued-per-worker` x workers): substitution's capacity (`crate::substitution`).
    pub fn capacity(&self) -> usize {
        self.inner.actors.len() * self.inner.max_outstanding_per_worker
    }

    /// Ends every live request with an `Error` event carrying `message` (the drain timeout).
    pub fn abort_all(&self, message: String) {
        for actor in &self.inner.actors {
            let _ = actor.tx.send(Command::AbortAll {
                message: message.clone(),
            });
        }
    }

    /// Why variant `id` is out of service, if a worker quarantined it (its files failed after
    /// registration); `None` for the base model and every healthy variant.
    fn failed_variant(&self, id: u32) -> Option<String> {
        if id == 0 {
            return None;
        }
        self.inner
            .actors
            .iter()
            .find_map(|a| a.failed_variants.lock().ok()?.get(&id).cloned())
    }

    /// Queues a request on the worker `--placement` picks; events arrive on the receiver.
    /// Dropping the receiver cancels the request at the next step. The context length is not
    /// checked here: request validation checks it (`validate.rs`), and the worker's scheduler
    /// refuses anything longer (`SchedError::TooLong`, the first event on the receiver); both
    /// apply the scheduler's one rule, `deltaserve_sched::context_room`.
    pub async fn generate(
        &self,
        req: GenerateRequest,
    ) -> Result<mpsc::UnboundedReceiver<GenerateEvent>, EngineError> {
        if let Some(why) = self.failed_variant(req.adapter_id) {
            return Err(EngineError::Unavailable(format!(
                "{why}; delete it and register it again"
            )));
        }
        let (actor, _) = self.place(&req)?;
        self.queue_on(actor, req)
    }

    /// Queues the choices of one request (`n` / `best_of`: one prompt, one variant) on one
    /// worker, which `--placement` picks for the first: there they share the prompt's KV pages
    /// (the scheduler prefills it once and the other choices reuse its cached pages,
    /// `deltaserve_sched`'s `prefix.rs`). Each is counted in the worker's load and admitted like
    /// one request; the receivers come back in choice order. On a refusal the choices already
    /// queued are cancelled (their receivers dropped) and the refusal is the answer.
    pub async fn generate_choices(
        &self,
        reqs: Vec<GenerateRequest>,
    ) -> Result<Vec<mpsc::UnboundedReceiver<GenerateEvent>>, EngineError> {
        let Some(first) = reqs.first() else {
            return Ok(Vec::new());
        };
        if let Some(why) = self.failed_variant(first.adapter_id) {
            return Err(EngineError::Unavailable(format!(
                "{why}; delete it and register it again"
            )));
        }
        let (actor, over_slo) = self.place(first)?;
        let mut receivers = Vec::with_capacity(reqs.len());
        for (i, req) in reqs.into_iter().enumerate() {
            if i > 0 {
                // Counted as `place` counts: every request, by variant and prompt with
                // several workers.
                let (variant, prompt) = if self.inner.actors.len() > 1 {
                    (req.adapter_id, req.prompt_token_ids.len())
                } else {
                    (0, 0)
                };
                actor.load.placed(variant, prompt, over_slo);
            }
            receivers.push(self.queue_on(actor, req)?);
        }
        Ok(receivers)
    }

    /// Queues `req` on `actor`'s worker: its per-worker queue limit and admission control
    /// first (a 429 naming the limit), then the actor's queue.
    fn queue_on(
        &self,
        actor: &ActorRef,
        req: GenerateRequest,
    ) -> Result<mpsc::UnboundedReceiver<GenerateEvent>, EngineError> {
        {
            let mut admission = actor.admission.lock().expect("admission lock");
            if actor.outstanding.load(Ordering::Relaxed) >= self.inner.max_outstanding_per_worker {
                admission.refused_queue_full += 1;
                return Err(EngineError::Overloaded(format!(
                    "{} requests already queued or running on every worker \
                     (--max-queued-per-worker)",
                    self.inner.max_outstanding_per_worker
                )));
            }
            let idle = actor.outstanding.load(Ordering::Relaxed) == 0;
            admission
                .admit(idle, req.prompt_token_ids.len() as u64, req.max_tokens)
                .map_err(EngineError::OverSlo)?;
        }
        let prompt_tokens = req.prompt_token_ids.len() as u64;
        let (tx, rx) = mpsc::unbounded_channel();
        actor.outstanding.fetch_add(1, Ordering::Relaxed);
        if actor
            .tx
            .send(Command::Generate {
                req,
                events: tx,
                arrived: Instant::now(),
            })
            .is_err()
        {
            actor.outstanding.fetch_sub(1, Ordering::Relaxed);
            if let Ok(mut admission) = actor.admission.lock() {
                admission.dequeued(1, prompt_tokens);
            }
            return Err(EngineError::Unavailable(
                "the engine is shutting down".into(),
            ));
        }
        Ok(rx)
    }

    /// The model as clients see it.
    pub fn model(&self) -> &ServedModel {
        &self.inner.model
    }

    /// The tokenizer of the served model.
    pub fn tokenizer(&self) -> &Arc<TextTokenizer> {
        &self.inner.tokenizer
    }

    /// The model's chat template, if it has one.
    pub fn chat_template(&self) -> Option<&Arc<ChatTemplate>> {
        self.inner.chat_template.as_ref()
    }

    /// Whether the workers answer a request still queued past the TTFT SLO with a 429
    /// (`--ttft-slo-ms` set: `actor/expired.rs`).
    pub fn expires_queued_requests(&self) -> bool {
        self.inner.actors.iter().any(|a| {
            a.admission
                .lock()
                .expect("admission lock")
                .ttft_slo_bound_us()
                .is_some()
        })
    }

    /// True when every worker is up.
    pub fn is_ready(&self) -> bool {
        self.inner
            .actors
            .iter()
            .all(|a| a.ready.load(Ordering::Acquire))
    }

    /// The engine's metrics: every worker's merged by the table's rules (counters and most
    /// gauges summed, step gap percentiles the slowest worker's), the registry's adapter count,
    /// and the shared latency histograms.
    pub async fn metrics(&self) -> EngineMetrics {
        let mut total = EngineMetrics {
            adapters_registered: self.inner.model.adapters.num_active() as u64,
            ..Default::default()
        };
        for actor in &self.inner.actors {
            let (reply, rx) = oneshot::channel();
            if actor.tx.send(Command::Metrics { reply }).is_err() {
                continue;
            }
            if let Ok(m) = rx.await {
                total.merge(&m);
            }
        }
        total
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use deltaserve_ipc::wire::VariantKind;

    fn served() -> ServedModel {
        let adapters = Arc::new(VariantRegistry::new("base"));
        for name in ["a", "b"] {
            let id = adapters.reserve(name, "/x".into(), 0).unwrap();
            adapters.activate(id, footprint()).unwrap();
        }
        adapters.reserve("pending", "/x".into(), 0).unwrap();
        ServedModel {
            name: "base".into(),
            max_model_len: 64,
            vocab_size: 100,
            created: 0,
            adapters,
            sampling_defaults: Default::default(),
        }
    }

    fn footprint() -> crate::registry::VariantFootprint {
        crate::registry::VariantFootprint {
            kind: VariantKind::Lora,
            summary: "rank 1".into(),
            num_blocks: 1,
            host_bytes: 1,
            max_rank: 1,
            target_modules: vec![],
        }
    }

    #[test]
    fn model_names_resolve_to_adapter_ids() {
        let m = served();
        assert_eq!(m.resolve(None), Some(0));
        assert_eq!(m.resolve(Some("base")), Some(0));
        assert_eq!(m.resolve(Some("base:a")), Some(1));
        assert_eq!(m.resolve(Some("b")), Some(2));
        assert_eq!(m.resolve(Some("base:c")), None);
        assert_eq!(m.resolve(Some("other:a")), None);
        assert_eq!(m.resolve(Some("c")), None);
        assert_eq!(m.resolve(Some("")), None);
        assert_eq!(m.resolve(Some("pending")), None, "not active yet");
        assert_eq!(m.display_name(0), "base");
        assert_eq!(m.display_name(2), "base:b");
    }
}
