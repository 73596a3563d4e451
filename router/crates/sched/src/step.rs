//! What crosses the scheduler's API: [`SeqRequest`] in, [`ScheduledStep`] out, worker results
//! back in as `(id, Option<token>)` pairs, [`SeqUpdate`]s out, plus [`SchedStats`]. These map
//! one-to-one onto the ipc crate's `StepPlan` / `StepOutput`, which the engine converts; this
//! crate does not depend on the wire.

use crate::variants::VariantOp;

/// A request as the scheduler needs it: tokens and stopping rules, nothing about sampling.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeqRequest {
    /// Caller-assigned id, unique among live requests (the router's request id).
    pub id: u64,
    /// Prompt token ids; must be non-empty.
    pub prompt: Vec<u32>,
    /// Most output tokens to generate; the request finishes with [`FinishReason::Length`] there.
    pub max_tokens: u32,
    /// Sampling one of these ends the request with [`FinishReason::Eos`] (unless `ignore_eos`).
    pub eos_token_ids: Vec<u32>,
    /// Generate exactly `max_tokens` tokens even when an EOS id is sampled (benchmarks).
    pub ignore_eos: bool,
    /// The caller's clock at arrival. Orders requests (FCFS admission, preemption victims);
    /// ties are broken by the order of `add_request` calls. Never read as wall time.
    pub arrival: u64,
    /// The variant (LoRA adapter or compressed delta) that applies to this request (registered
    /// with [`crate::Scheduler::register_adapter`]); 0 = the base model alone.
    pub adapter_id: u32,
    /// Compute every prompt token even where a cached prefix matches (prompt logprobs need each
    /// position's logits). Its pages are still cached for other requests.
    pub skip_prefix_cache: bool,
}

/// A request sent to the worker in full: its first step there, or its first after preemption.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScheduledNew {
    /// The request's id.
    pub id: u64,
    /// Every token known so far: the prompt followed by the tokens generated before any
    /// preemption (those are recomputed, not regenerated).
    pub token_ids: Vec<u32>,
    /// Length of the original prompt at the front of `token_ids`.
    pub num_prompt_tokens: u32,
    /// Leading tokens whose KV is already in the first pages of `block_ids`: a prefix-cache hit
    /// (whole pages, at most `len(token_ids) - 1`); the step computes from here.
    pub num_computed_tokens: u32,
    /// Tokens to compute this step, from `num_computed_tokens` (the first prefill chunk).
    pub num_scheduled_tokens: u32,
    /// The request's whole block table for now: enough pages for the scheduled tokens.
    pub block_ids: Vec<u32>,
    /// Its variant (LoRA adapter or delta; 0 = base); GPU-resident on the worker once this
    /// step's `adapter_ops` are applied.
    pub adapter_id: u32,
}

/// A request already on the worker: only what changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScheduledRunning {
    /// The request's id.
    pub id: u64,
    /// Tokens to compute this step: 1 in decode (last step's sample), more for a prefill chunk.
    pub num_scheduled_tokens: u32,
    /// Pages appended to its block table this step (often none).
    pub new_block_ids: Vec<u32>,
}

/// One step of continuous batching, as [`crate::Scheduler::schedule`] formed it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ScheduledStep {
    /// Number of this step, counting from 1; 0 for an empty step (nothing was formed).
    pub step_id: u64,
    /// Requests sent in full (first time on the worker, or resumed after preemption), grouped
    /// by adapter id (ascending), in arrival order within one adapter.
    pub new: Vec<ScheduledNew>,
    /// Diffs for requests already on the worker, grouped by adapter id (ascending), in arrival
    /// order within one adapter.
    pub running: Vec<ScheduledRunning>,
    /// Ids whose worker-side state must be dropped before this step runs: finished, aborted or
    /// preempted since the previous non-empty step. Their pages are already free again.
    pub released: Vec<u64>,
    /// Ids preempted while forming this step (a subset of `released`), for logs and metrics:
    /// recompute preemptions (pages ran out) and skippers whose delta lost its last running
    /// non-skipper (DeltaZip's parent-based preemption).
    pub preempted: Vec<u64>,
    /// Adapter tier moves, in application order (after `released`, before the requests run):
    /// every drop (`DropGpu`, `DropHost`) before every load (`ToHost`, `ToGpu`). Includes the
    /// drops queued since the previous non-empty step (`unregister_adapter`).
    pub adapter_ops: Vec<VariantOp>,
}

impl ScheduledStep {
    /// True when no request is scheduled, so there is nothing to send to the worker. Pending
    /// releases and adapter ops are then kept for the next non-empty step.
    pub fn is_empty(&self) -> bool {
        self.new.is_empty() && self.running.is_empty()
    }

    /// Tokens this step computes, over all scheduled requests (never above the budget).
    pub fn num_scheduled_tokens(&self) -> usize {
        self.new
            .iter()
            .map(|n| n.num_scheduled_tokens as usize)
            .sum::<usize>()
            + self
                .running
                .iter()
                .map(|r| r.num_scheduled_tokens as usize)
                .sum::<usize>()
    }

    /// Requests this step schedules.
    pub fn num_requests(&self) -> usize {
        self.new.len() + self.running.len()
    }
}

/// Why the scheduler ended a request. Stop strings and aborts are the caller's decisions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FinishReason {
    /// Generated `max_tokens` tokens.
    Length,
    /// Sampled one of its EOS ids (checked before the length limit).
    Eos,
}

impl FinishReason {
    /// Stable lower-case label (`"length"`, `"eos"`).
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Length => "length",
            FinishReason::Eos => "eos",
        }
    }
}

/// One sampled token appended to a request by [`crate::Scheduler::update`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeqUpdate {
    /// The request's id.
    pub id: u64,
    /// The token appended to its output.
    pub token: u32,
    /// Set when this token ended the request; its pages are already free and its id will be in
    /// the next step's `released`.
    pub finished: Option<FinishReason>,
}

/// Counters for metrics and tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SchedStats {
    /// Requests waiting for admission (new or preempted).
    pub waiting: usize,
    /// Requests resident on the worker.
    pub running: usize,
    /// Pool pages free, counting cached pages no request holds (evicted when needed).
    pub free_blocks: u32,
    /// Pool pages holding running requests' KV cache (shared cached pages once).
    pub used_blocks: u32,
    /// Pages in the pool (`free_blocks + used_blocks + adapter_blocks`).
    pub total_blocks: u32,
    /// Preemptions since start (cumulative), skipper preemptions included.
    pub num_preemptions: u64,
    /// Non-empty steps formed since start.
    pub steps: u64,
    /// Ids waiting to be sent in a step's `released`.
    pub pending_released: usize,
    /// Requests ended by the scheduler (length / EOS) or by [`crate::Scheduler::finish`].
    pub num_finished: u64,
    /// Requests ended by [`crate::Scheduler::abort`].
    pub num_aborted: u64,
    /// Adapters registered (any tier, both kinds).
    pub adapters_registered: usize,
    /// LoRA adapters whose weights sit in pool pages.
    pub adapters_on_gpu: usize,
    /// Deltas in the worker's delta slots (at most `max_deltas`).
    pub deltas_on_gpu: usize,
    /// Adapters (both kinds) with a host copy on the worker.
    pub adapters_on_host: usize,
    /// Pool pages holding adapter weights.
    pub adapter_blocks: u32,
    /// Bytes of adapter host copies the worker holds (as accounted; at most the host budget).
    pub host_adapter_bytes: u64,
    /// `ToGpu` ops emitted since start, both kinds (cumulative).
    pub adapter_gpu_loads: u64,
    /// `ToHost` ops emitted since start, prefetches included, both kinds (cumulative).
    pub adapter_host_loads: u64,
    /// Adapters evicted from the GPU to make room, LoRA adapters for pages and deltas for
    /// slots (cumulative; unregistering is not counted).
    pub adapter_gpu_evictions: u64,
    /// Requests admitted past a blocked queue head because their delta was already running
    /// (DeltaZip's skip-the-line; cumulative).
    pub delta_skips: u64,
    /// Skippers preempted because their delta had no running non-skipper left (cumulative;
    /// also counted in `num_preemptions`).
    pub delta_skip_preemptions: u64,
    /// Times a waiting request was passed over in a step because its adapter's host copy was
    /// still being read (`host_copy_reports`; cumulative, one per request per step).
    pub host_deferrals: u64,
    /// Times a waiting request was passed over in a step because its delta was being copied
    /// onto the GPU beside the steps (`gpu_load_reports`; cumulative, one per request per step;
    /// the step that sends the delta's `ToGpu` counts too).
    pub gpu_load_deferrals: u64,
    /// Prompt (and recomputed) tokens of admitted requests looked up in the prefix cache
    /// (cumulative; with prefix caching on).
    pub prefix_queried_tokens: u64,
    /// Of those, tokens found cached, so not computed (cumulative).
    pub prefix_hit_tokens: u64,
    /// Pool pages in the prefix cache now, held by requests or not (those no request holds
    /// are also counted in `free_blocks`).
    pub prefix_cached_blocks: u32,
    /// Cached pages evicted to be handed out again (cumulative).
    pub prefix_evicted_blocks: u64,
    /// Times a waiting request was passed over in a step because a running request was
    /// computing the next page of its prefix, which it then reuses (`n` choices; cumulative).
    pub prefix_deferrals: u64,
}

impl SchedStats {
    /// Share of the looked-up tokens found in the prefix cache (0 before any lookup).
    pub fn prefix_hit_rate(&self) -> f64 {
        if self.prefix_queried_tokens == 0 {
            return 0.0;
        }
        self.prefix_hit_tokens as f64 / self.prefix_queried_tokens as f64
    }
}
