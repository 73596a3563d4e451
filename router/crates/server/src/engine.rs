//! The engine: what the API layer talks to. A cloneable [`EngineHandle`] in front of one
//! engine actor per worker process (see `actor.rs`), each owning its own scheduler.
//!
//! ```text
//!  api ──generate()──▶ EngineHandle ──(least loaded)──▶ actor[i] ──StepPlan──▶ worker[i]
//!   ▲                                                     │  ◀──StepOutput──
//!   └──────────── GenerateEvent (mpsc, per request) ◀─────┘
//! ```
//!
//! A request's events arrive on the receiver returned by [`EngineHandle::generate`]; dropping
//! that receiver is how a client cancels (the actor notices the closed channel at its next step,
//! STYLE.md #14).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use deltaserve_ipc::wire::{AdapterInfo, SamplingParams, TokenLogprob};
use deltaserve_sched::{AdapterSpec, VariantKind};
use tokio::sync::{mpsc, oneshot};

use crate::registry::{AdapterEntry, AdapterFootprint, AdapterRegistry, RegistryError};
use crate::text::chat_template::ChatTemplate;
use crate::text::tokenizer::TextTokenizer;

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
}

/// What a request's receiver gets, in order: `Token`s, then exactly one `Finished` or `Error`.
#[derive(Debug, Clone)]
pub enum GenerateEvent {
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
    pub adapters: Arc<AdapterRegistry>,
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

/// A snapshot of the engine's counters, summed over workers.
#[derive(Debug, Clone, Default)]
pub struct EngineMetrics {
    pub requests_waiting: u64,
    pub requests_running: u64,
    pub kv_blocks_total: u64,
    pub kv_blocks_free: u64,
    pub steps_total: u64,
    /// Steps sent before the previous step's output was back (overlapped steps).
    pub steps_ahead_total: u64,
    pub preemptions_total: u64,
    pub requests_finished_total: u64,
    pub requests_aborted_total: u64,
    pub tokens_generated_total: u64,
    /// Median router + IPC gap between a worker's step N output and step N+1 plan, over the
    /// recent window (largest over workers).
    pub step_gap_us_p50: u64,
    /// 99th percentile of the same gap.
    pub step_gap_us_p99: u64,
    /// Median of the router's share of that gap: from a step's output being decoded to the next
    /// plan being sent (largest over workers).
    pub step_router_us_p50: u64,
    /// 99th percentile of the router's share.
    pub step_router_us_p99: u64,
    /// Worker restarts since start.
    pub worker_restarts_total: u64,
    /// Active variants (LoRA adapters and deltas) in the registry.
    pub adapters_registered: u64,
    /// LoRA adapters whose weights are in a GPU pool (summed over workers).
    pub adapters_on_gpu: u64,
    /// Deltas in the workers' delta slots (summed over workers).
    pub deltas_on_gpu: u64,
    /// Requests admitted past a blocked queue head because their delta was running
    /// (DeltaZip's skip-the-line) since start.
    pub delta_skips_total: u64,
    /// Such requests preempted (recomputed later) because their delta's last FCFS-admitted
    /// request left, since start.
    pub delta_skip_preemptions_total: u64,
    /// Pool pages holding adapter weights (the rest of the used pages hold KV).
    pub adapter_blocks: u64,
    /// Host-memory bytes of adapter copies (LoRA and delta), as the schedulers account them.
    pub adapter_host_bytes: u64,
    /// Host-memory bytes of adapter copies, as the workers measured them after their last step.
    pub adapter_host_bytes_measured: u64,
    /// Adapter copies host -> GPU pool since start.
    pub adapter_gpu_loads_total: u64,
    /// Adapter reads disk -> host since start.
    pub adapter_host_loads_total: u64,
    /// Adapters evicted from a GPU pool since start.
    pub adapter_gpu_evictions_total: u64,
    /// Times a waiting request was passed over in a step because its variant's host read was
    /// still running (it keeps its place; the step does not wait for the read), since start.
    pub adapter_host_deferrals_total: u64,
    /// Sum of the workers' step times (plan decoded → output encoded, `StepTiming::total_us`)
    /// since start, microseconds: over `steps_total`, the mean worker time of a step.
    pub worker_step_us_total: u64,
    /// The forward-and-sampling part of those step times (`StepTiming::forward_us`); the rest
    /// is the step's adapter ops (waiting for loads included) and batch building.
    pub worker_forward_us_total: u64,
}

/// Why registering or deleting an adapter failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum AdapterError {
    /// The adapter cannot be served as given (400); `param` is the request field at fault.
    #[error("{message}")]
    Invalid {
        /// What is wrong, naming the file or field.
        message: String,
        /// The request field at fault (`name`, `path` or `kind`).
        param: &'static str,
    },
    /// The registry refused the name (bad: 400, taken or being deleted: 409, unknown: 404).
    #[error(transparent)]
    Registry(#[from] RegistryError),
    /// No worker can inspect it right now (503).
    #[error("{0}")]
    Unavailable(String),
}

/// How an actor answered a request to forget an adapter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum RemoveOutcome {
    /// Forgotten: its pages are free and the worker drops it with the next step.
    Removed,
    /// Live requests still use it; ask again later.
    InUse(usize),
}

/// Commands an actor accepts (STYLE.md #7).
#[derive(Debug)]
pub(crate) enum Command {
    Generate {
        req: GenerateRequest,
        events: mpsc::UnboundedSender<GenerateEvent>,
    },
    Metrics {
        reply: oneshot::Sender<EngineMetrics>,
    },
    /// Ask the worker to validate an adapter directory (changes nothing).
    Inspect {
        path: String,
        reply: oneshot::Sender<Result<AdapterInfo, String>>,
    },
    /// Register an inspected adapter with the actor's scheduler.
    AddAdapter {
        id: u32,
        spec: AdapterSpec,
        reply: oneshot::Sender<Result<(), String>>,
    },
    /// Forget an adapter once no live request uses it.
    RemoveAdapter {
        id: u32,
        reply: oneshot::Sender<RemoveOutcome>,
    },
}

/// One worker's actor, as the handle sees it.
#[derive(Debug)]
pub(crate) struct ActorRef {
    /// Commands into the actor.
    pub tx: mpsc::UnboundedSender<Command>,
    /// Requests handed to this actor and not yet ended: the load-balancing signal.
    pub outstanding: Arc<AtomicUsize>,
    /// True while the actor's worker is up and handshaken.
    pub ready: Arc<AtomicBool>,
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
}

impl EngineHandle {
    pub(crate) fn new(
        actors: Vec<ActorRef>,
        model: ServedModel,
        tokenizer: Arc<TextTokenizer>,
        chat_template: Option<Arc<ChatTemplate>>,
        max_outstanding_per_worker: usize,
    ) -> Self {
        Self {
            inner: Arc::new(HandleInner {
                actors,
                model,
                tokenizer,
                chat_template,
                max_outstanding_per_worker,
            }),
        }
    }

    /// Queues a request on the least loaded ready worker; events arrive on the receiver.
    /// Dropping the receiver cancels the request at the next step.
    pub async fn generate(
        &self,
        req: GenerateRequest,
    ) -> Result<mpsc::UnboundedReceiver<GenerateEvent>, EngineError> {
        let len = req.prompt_token_ids.len() as u64 + req.max_tokens as u64;
        if len > self.inner.model.max_model_len as u64 {
            return Err(EngineError::InvalidRequest(format!(
                "prompt ({} tokens) + max_tokens ({}) exceeds the context of {} tokens",
                req.prompt_token_ids.len(),
                req.max_tokens,
                self.inner.model.max_model_len
            )));
        }
        let actor = self
            .inner
            .actors
            .iter()
            .filter(|a| a.ready.load(Ordering::Acquire))
            .min_by_key(|a| a.outstanding.load(Ordering::Relaxed))
            .ok_or_else(|| {
                EngineError::Unavailable("no worker is ready (starting or restarting)".into())
            })?;
        if actor.outstanding.load(Ordering::Relaxed) >= self.inner.max_outstanding_per_worker {
            return Err(EngineError::Overloaded(format!(
                "{} requests already queued or running on the least loaded worker",
                self.inner.max_outstanding_per_worker
            )));
        }
        let (tx, rx) = mpsc::unbounded_channel();
        actor.outstanding.fetch_add(1, Ordering::Relaxed);
        if actor
            .tx
            .send(Command::Generate { req, events: tx })
            .is_err()
        {
            actor.outstanding.fetch_sub(1, Ordering::Relaxed);
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

    /// True when every worker is up.
    pub fn is_ready(&self) -> bool {
        self.inner
            .actors
            .iter()
            .all(|a| a.ready.load(Ordering::Acquire))
    }

    /// Registers the variant in `dir` as `name`: a PEFT LoRA adapter (`adapter_config.json`) or
    /// a compressed delta (`manifest.json`, written by `deltaserve compress`); with `want`, only
    /// that kind is accepted. A worker validates it against the model and reports its footprint,
    /// then every worker's scheduler learns it (nothing is loaded until a request needs it).
    /// Nothing changes when any step fails.
    pub async fn register_adapter(
        &self,
        name: &str,
        dir: &Path,
        want: Option<VariantKind>,
    ) -> Result<AdapterEntry, AdapterError> {
        let invalid = |message: String| AdapterError::Invalid {
            message,
            param: "path",
        };
        let dir = std::fs::canonicalize(dir)
            .map_err(|e| invalid(format!("adapter path {}: {e}", dir.display())))?;
        let found = variant_kind_of_dir(&dir).map_err(invalid)?;
        check_kind(found, want, &dir)?;
        let path = dir
            .to_str()
            .ok_or_else(|| invalid(format!("adapter path {} is not UTF-8", dir.display())))?
            .to_string();
        let registry = &self.inner.model.adapters;
        let created = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let id = registry.reserve(name, dir.clone(), created)?;
        match self.register_reserved(id, path, found).await {
            Ok(footprint) => Ok(registry
                .activate(id, footprint)
                .expect("a reserved entry stays until activated or removed")),
            Err(e) => {
                registry.remove(id);
                Err(e)
            }
        }
    }

    /// Inspects on one ready worker (which must agree that the directory holds a `found`), then
    /// registers with every actor (rolling back on failure).
    async fn register_reserved(
        &self,
        id: u32,
        path: String,
        found: VariantKind,
    ) -> Result<AdapterFootprint, AdapterError> {
        let actor = self
            .inner
            .actors
            .iter()
            .find(|a| a.ready.load(Ordering::Acquire))
            .ok_or_else(|| {
                AdapterError::Unavailable(
                    "no worker is ready to inspect the adapter; retry shortly".into(),
                )
            })?;
        let gone = || AdapterError::Unavailable("the engine is shutting down".into());
        let (reply, rx) = oneshot::channel();
        actor
            .tx
            .send(Command::Inspect {
                path: path.clone(),
                reply,
            })
            .map_err(|_| gone())?;
        let info = rx
            .await
            .map_err(|_| gone())?
            .map_err(AdapterError::Unavailable)?;
        if let Some(message) = info.error {
            return Err(AdapterError::Invalid {
                message,
                param: "path",
            });
        }
        let kind = VariantKind::from_label(&info.kind).ok_or_else(|| AdapterError::Invalid {
            message: format!(
                "the worker inspected {path} as kind `{}`; expected `lora` or `delta`",
                info.kind
            ),
            param: "path",
        })?;
        if kind != found {
            return Err(AdapterError::Invalid {
                message: format!(
                    "the worker inspected {path} as a {} but its files make it a {}",
                    describe(kind),
                    describe(found)
                ),
                param: "path",
            });
        }
        let spec = AdapterSpec {
            kind,
            num_blocks: info.num_blocks,
            host_bytes: info.host_bytes,
            path,
        };
        let mut added = Vec::new();
        for actor in &self.inner.actors {
            let (reply, rx) = oneshot::channel();
            let sent = actor.tx.send(Command::AddAdapter {
                id,
                spec: spec.clone(),
                reply,
            });
            let outcome = match sent {
                Ok(()) => rx
                    .await
                    .unwrap_or_else(|_| Err("the engine is shutting down".into())),
                Err(_) => Err("the engine is shutting down".into()),
            };
            if let Err(message) = outcome {
                for done in added {
                    let _ = self.remove_from(done, id).await;
                }
                return Err(AdapterError::Invalid {
                    message,
                    param: "path",
                });
            }
            added.push(actor);
        }
        Ok(AdapterFootprint {
            kind,
            summary: info.summary,
            num_blocks: info.num_blocks,
            host_bytes: info.host_bytes,
            max_rank: info.max_rank,
            target_modules: info.target_modules,
        })
    }

    /// Deletes adapter `name`: it stops resolving at once; this waits until no live request uses
    /// it on any worker, then frees its memory and forgets it. The wait runs in its own task, so
    /// a client that goes away does not leave the adapter half deleted.
    pub async fn delete_adapter(&self, name: &str) -> Result<AdapterEntry, AdapterError> {
        let entry = self.inner.model.adapters.begin_delete(name)?;
        let this = self.clone();
        let id = entry.id;
        let task = tokio::spawn(async move {
            for actor in &this.inner.actors {
                this.remove_from(actor, id).await;
            }
            this.inner.model.adapters.remove(id);
        });
        task.await
            .map_err(|e| AdapterError::Unavailable(format!("deleting the adapter failed: {e}")))?;
        Ok(entry)
    }

    /// Asks `actor` to forget adapter `id` until it has (polling while requests still use it).
    async fn remove_from(&self, actor: &ActorRef, id: u32) {
        loop {
            let (reply, rx) = oneshot::channel();
            if actor.tx.send(Command::RemoveAdapter { id, reply }).is_err() {
                return;
            }
            match rx.await {
                Ok(RemoveOutcome::InUse(_)) => tokio::time::sleep(Duration::from_millis(20)).await,
                Ok(RemoveOutcome::Removed) | Err(_) => return,
            }
        }
    }

    /// Counters summed over workers (gap percentiles: the largest over workers).
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
                total.requests_waiting += m.requests_waiting;
                total.requests_running += m.requests_running;
                total.kv_blocks_total += m.kv_blocks_total;
                total.kv_blocks_free += m.kv_blocks_free;
                total.steps_total += m.steps_total;
                total.steps_ahead_total += m.steps_ahead_total;
                total.preemptions_total += m.preemptions_total;
                total.requests_finished_total += m.requests_finished_total;
                total.requests_aborted_total += m.requests_aborted_total;
                total.tokens_generated_total += m.tokens_generated_total;
                total.worker_restarts_total += m.worker_restarts_total;
                total.adapters_on_gpu += m.adapters_on_gpu;
                total.deltas_on_gpu += m.deltas_on_gpu;
                total.delta_skips_total += m.delta_skips_total;
                total.delta_skip_preemptions_total += m.delta_skip_preemptions_total;
                total.adapter_blocks += m.adapter_blocks;
                total.adapter_host_bytes += m.adapter_host_bytes;
                total.adapter_host_bytes_measured += m.adapter_host_bytes_measured;
                total.adapter_gpu_loads_total += m.adapter_gpu_loads_total;
                total.adapter_host_loads_total += m.adapter_host_loads_total;
                total.adapter_gpu_evictions_total += m.adapter_gpu_evictions_total;
                total.adapter_host_deferrals_total += m.adapter_host_deferrals_total;
                total.worker_step_us_total += m.worker_step_us_total;
                total.worker_forward_us_total += m.worker_forward_us_total;
                total.step_gap_us_p50 = total.step_gap_us_p50.max(m.step_gap_us_p50);
                total.step_gap_us_p99 = total.step_gap_us_p99.max(m.step_gap_us_p99);
                total.step_router_us_p50 = total.step_router_us_p50.max(m.step_router_us_p50);
                total.step_router_us_p99 = total.step_router_us_p99.max(m.step_router_us_p99);
            }
        }
        total
    }
}

/// The kind of variant in `dir`, from its marker file: `adapter_config.json` (a PEFT LoRA
/// adapter) or `manifest.json` (a compressed delta written by `deltaserve compress`). The error
/// names both files.
pub fn variant_kind_of_dir(dir: &Path) -> Result<VariantKind, String> {
    let lora = dir.join("adapter_config.json").is_file();
    let delta = dir.join("manifest.json").is_file();
    match (lora, delta) {
        (true, false) => Ok(VariantKind::Lora),
        (false, true) => Ok(VariantKind::Delta),
        (false, false) => Err(format!(
            "no adapter_config.json (a PEFT LoRA adapter) or manifest.json (a compressed delta \
             from `deltaserve compress`) in {}",
            dir.display()
        )),
        (true, true) => Err(format!(
            "{} holds both adapter_config.json (a PEFT LoRA adapter) and manifest.json (a \
             compressed delta): it must be one or the other",
            dir.display()
        )),
    }
}

/// Refuses the `found` variant in `dir` when the caller asked for another kind (`want`); the
/// message names both kinds and their marker files (400, `param` = `kind`).
pub fn check_kind(
    found: VariantKind,
    want: Option<VariantKind>,
    dir: &Path,
) -> Result<(), AdapterError> {
    match want {
        Some(want) if want != found => Err(AdapterError::Invalid {
            message: format!(
                "{} holds a {}, not a {}",
                dir.display(),
                describe(found),
                describe(want)
            ),
            param: "kind",
        }),
        _ => Ok(()),
    }
}

/// A kind as people know it, with the file that marks it.
fn describe(kind: VariantKind) -> &'static str {
    match kind {
        VariantKind::Lora => "LoRA adapter (adapter_config.json)",
        VariantKind::Delta => "compressed delta (manifest.json, from `deltaserve compress`)",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn served() -> ServedModel {
        let adapters = Arc::new(AdapterRegistry::new("base"));
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
        }
    }

    fn footprint() -> crate::registry::AdapterFootprint {
        crate::registry::AdapterFootprint {
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

    #[test]
    fn directories_are_told_apart_by_their_marker_file() {
        let root = tempfile::tempdir().unwrap();
        let make = |name: &str, files: &[&str]| {
            let dir = root.path().join(name);
            std::fs::create_dir(&dir).unwrap();
            for f in files {
                std::fs::write(dir.join(f), "{}").unwrap();
            }
            dir
        };
        let lora = make("lora", &["adapter_config.json"]);
        let delta = make("delta", &["manifest.json"]);
        let empty = make("empty", &[]);
        let both = make("both", &["adapter_config.json", "manifest.json"]);
        assert_eq!(variant_kind_of_dir(&lora), Ok(VariantKind::Lora));
        assert_eq!(variant_kind_of_dir(&delta), Ok(VariantKind::Delta));
        let err = variant_kind_of_dir(&empty).unwrap_err();
        assert!(
            err.contains("adapter_config.json") && err.contains("manifest.json"),
            "{err}"
        );
        assert!(variant_kind_of_dir(&both).unwrap_err().contains("both"));

        assert!(check_kind(VariantKind::Lora, None, &lora).is_ok());
        assert!(check_kind(VariantKind::Delta, Some(VariantKind::Delta), &delta).is_ok());
        let AdapterError::Invalid { message, param } =
            check_kind(VariantKind::Lora, Some(VariantKind::Delta), &lora).unwrap_err()
        else {
            panic!("a kind mismatch is invalid input");
        };
        assert_eq!(param, "kind");
        assert!(
            message.contains("holds a LoRA adapter") && message.contains("not a compressed delta"),
            "{message}"
        );
        let AdapterError::Invalid { message, .. } =
            check_kind(VariantKind::Delta, Some(VariantKind::Lora), &delta).unwrap_err()
        else {
            panic!("a kind mismatch is invalid input");
        };
        assert!(
            message.contains("holds a compressed delta") && message.contains("not a LoRA"),
            "{message}"
        );
    }
}
