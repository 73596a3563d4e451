//! [`Scheduler`], the facade: the one struct that holds the state (queues, block tables, the
//! adapter table, steps in flight, counters), the public API, and the step algorithm as one
//! call per phase ([`Scheduler::schedule`]; each phase's doc carries its pseudo-code). The
//! phases and the helpers they share live in their own modules, each an `impl Scheduler`
//! block over this one state:
//!
//! - `request.rs`: one request's state (`Seq`, `OrderKey`, `Phase`, its life cycle) and
//!   `add_request`'s checks;
//! - `queues.rs`: the waiting and running queues, `remove`, `preempt`, and phase 1 (the
//!   running requests, preempting for pages);
//! - `admission.rs`: phase 2 (FCFS admission, making room on the host and the GPU, the
//!   watermark, head-of-line blocking) and phase 3 (prefetch);
//! - `skip_line.rs`: DeltaZip's skip-the-line (phase 0 and the end of phase 2);
//! - `prefix.rs`: prefix caching (lookups at admission, pages published as they are computed,
//!   `n` choices waiting for the pages a sibling computes);
//! - `inflight.rs`: the outstanding steps, `schedule_ahead` and `update`;
//! - `invariants.rs`: `check_invariants`.

use std::collections::{BTreeMap, VecDeque};

use crate::block::BlockAllocator;
use crate::config::SchedulerConfig;
use crate::error::SchedError;
use crate::inflight::Chunk;
use crate::prefix::{PendingPages, PrefixKey};
use crate::queues::insert_sorted_deque;
use crate::request::{OrderKey, Seq};
use crate::skip_line::Skip;
use crate::step::{SchedStats, ScheduledRunning, ScheduledStep, SeqRequest};
use crate::variants::{StepOps, VariantOp, VariantResidency, VariantSpec, VariantTable};

/// The pure iteration-level scheduler: owns the queues, the page pool, every block table and
/// the adapter table. Deterministic: the same sequence of calls yields the same plans.
#[derive(Debug, Clone)]
pub struct Scheduler {
    /// Limits (validated).
    pub(crate) cfg: SchedulerConfig,
    /// The one page pool: KV pages of requests and weight pages of GPU-resident adapters.
    pub(crate) blocks: BlockAllocator,
    /// Registered adapters, their tiers, users and LRU stamps.
    pub(crate) adapters: VariantTable,
    /// Adapter ops formed outside a non-empty step (unregistering), in application order;
    /// only drops, so prepending them to a step keeps its drops before its loads.
    pub(crate) pending_ops: Vec<VariantOp>,
    /// Every live (waiting or running) request by id.
    pub(crate) seqs: BTreeMap<u64, Seq>,
    /// Requests not on the worker, sorted by `OrderKey`; admission takes the front.
    pub(crate) waiting: VecDeque<(OrderKey, u64)>,
    /// Requests on the worker, sorted by `OrderKey`; preemption victims come off the back.
    pub(crate) running: Vec<(OrderKey, u64)>,
    /// Ids to put in the next non-empty step's `released`.
    pub(crate) pending_released: Vec<u64>,
    /// What each outstanding step (sent, no `update` yet) scheduled, oldest first: one step
    /// after `schedule`, two after `schedule_ahead`.
    pub(crate) outstanding: VecDeque<Vec<Chunk>>,
    /// Next `OrderKey::seq_no`.
    pub(crate) next_seq_no: u64,
    /// Non-empty steps formed; the last one's `step_id`.
    pub(crate) steps: u64,
    /// Preemptions since start.
    pub(crate) num_preemptions: u64,
    /// Requests finished (length, EOS, or `finish`).
    pub(crate) num_finished: u64,
    /// Requests aborted.
    pub(crate) num_aborted: u64,
    /// Running requests that skipped the line (`Skip::Parent` or `Skip::Orphaned`).
    pub(crate) num_skippers: usize,
    /// Running requests in `Skip::Orphaned`, waiting for the next `schedule` to preempt them.
    pub(crate) num_orphans: usize,
    /// Requests admitted by skipping the line since start.
    pub(crate) delta_skips: u64,
    /// Orphaned skippers preempted since start.
    pub(crate) delta_skip_preemptions: u64,
    /// Times a waiting request was passed over because its adapter's host copy was loading.
    pub(crate) host_deferrals: u64,
    /// Times a waiting request was passed over because its delta was loading onto the GPU.
    pub(crate) gpu_load_deferrals: u64,
    /// Full pages running requests are computing and have not published yet (`prefix.rs`).
    pub(crate) pending: PendingPages,
    /// Tokens looked up in the prefix cache at admission.
    pub(crate) prefix_queried: u64,
    /// Tokens those lookups found cached.
    pub(crate) prefix_hits: u64,
    /// Waiting requests passed over for a page a running request was computing.
    pub(crate) prefix_deferrals: u64,
}

/// The step being formed, handed from phase to phase.
#[derive(Debug, Default)]
pub(crate) struct StepDraft {
    /// What goes to the worker.
    pub(crate) step: ScheduledStep,
    /// This step's adapter ops, drops apart from loads.
    pub(crate) ops: StepOps,
    /// Tokens this step may still schedule (starts at `max_num_batched_tokens`).
    pub(crate) budget: usize,
    /// Running requests whose next step needs at least one more page than they hold after
    /// this one; admission keeps that many pages free (the watermark, see `admission.rs`).
    pub(crate) watermark: u64,
    /// Adapter of each `step.running` entry, in the same order (for grouping).
    pub(crate) running_adapters: Vec<u32>,
    /// With a delta graph limit (`delta_graph_tokens`): whether the step has a row of a
    /// compressed delta, from the running requests before phase 1, then from each admission.
    pub(crate) delta_rows: bool,
    /// With a delta graph limit: the step's decode tokens (running requests with one token to
    /// compute), counted before phase 1, and how many of them phase 1 has still to schedule.
    pub(crate) decodes: usize,
    pub(crate) decodes_ahead: usize,
}

impl Scheduler {
    /// A scheduler over an empty queue and an all-free pool of `cfg.num_blocks` pages.
    pub fn new(cfg: SchedulerConfig) -> Result<Self, SchedError> {
        cfg.validate()?;
        Ok(Self {
            blocks: BlockAllocator::new(cfg.num_blocks),
            adapters: VariantTable::default(),
            pending_ops: Vec::new(),
            cfg,
            seqs: BTreeMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            pending_released: Vec::new(),
            outstanding: VecDeque::new(),
            next_seq_no: 0,
            steps: 0,
            num_preemptions: 0,
            num_finished: 0,
            num_aborted: 0,
            num_skippers: 0,
            num_orphans: 0,
            delta_skips: 0,
            delta_skip_preemptions: 0,
            host_deferrals: 0,
            gpu_load_deferrals: 0,
            pending: PendingPages::default(),
            prefix_queried: 0,
            prefix_hits: 0,
            prefix_deferrals: 0,
        })
    }

    /// The validated config.
    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    /// Caps the running batch at `max_num_seqs` from now on (admission control's TPOT bound):
    /// never below the requests running now (they are not preempted; the batch shrinks as they
    /// end) nor below 1.
    pub fn set_max_num_seqs(&mut self, max_num_seqs: usize) {
        self.cfg.max_num_seqs = max_num_seqs.max(self.running.len()).max(1);
    }

    /// Requests in the running batch (what [`Self::stats`] reports, without the rest).
    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// Registers a variant, a LoRA adapter or a delta (in the disk tier; it moves up when a
    /// request needs it). Refuses, changing nothing: id 0 (the base model), an id already
    /// registered, a LoRA adapter with `num_blocks == 0`, a delta with `num_blocks != 0`, a
    /// delta while `max_deltas` is 0 (`DeltasDisabled`), an empty path, `num_blocks` above the
    /// pool size and `host_bytes` above `host_adapter_bytes`.
    pub fn register_adapter(&mut self, id: u32, spec: VariantSpec) -> Result<(), SchedError> {
        self.adapters.register(id, spec, &self.cfg)
    }

    /// Forgets an adapter no live request names: its pages are free at once, and its
    /// `DropGpu` / `DropHost` go out with the next non-empty step. Refuses, changing nothing,
    /// an unknown id (`UnknownAdapter`) and one that waiting or running requests still name
    /// (`AdapterInUse`).
    pub fn unregister_adapter(&mut self, id: u32) -> Result<(), SchedError> {
        self.adapters
            .unregister(id, &mut self.blocks, &mut self.pending_ops)
    }

    /// Tokens of every live (waiting or running) request, prompt and outputs so far: the KV its
    /// decode steps attend over (the context term of a step's latency, for placement).
    pub fn live_context_tokens(&self) -> u64 {
        self.seqs.values().map(|s| s.tokens.len() as u64).sum()
    }

    /// Live (waiting + running) requests naming adapter `id`; 0 for an unknown id.
    pub fn adapter_users(&self, id: u32) -> usize {
        self.adapters.map.get(&id).map_or(0, |a| a.users)
    }

    /// The worker finished reading these adapters' host copies (`StepOutput::host_ready`):
    /// with `host_copy_reports`, requests waiting for them may be admitted now. Ids with no
    /// read pending (unknown, dropped since, already reported) are ignored. Returns how many
    /// reads this settled.
    pub fn host_copies_ready(&mut self, ids: &[u32]) -> usize {
        ids.iter()
            .filter(|&&id| self.adapters.host_loaded(id))
            .count()
    }

    /// The worker finished copying these deltas onto the GPU (`StepOutput::gpu_ready`): with
    /// `gpu_load_reports`, requests waiting for them may be admitted now. Ids with no copy
    /// pending (unknown, not loaded ahead, admitted or dropped since, already reported) are
    /// ignored. Returns how many loads this settled.
    pub fn gpu_copies_ready(&mut self, ids: &[u32]) -> usize {
        ids.iter()
            .filter(|&&id| self.adapters.gpu_loaded(id))
            .count()
    }

    /// Where a registered adapter's weights are (host copy, GPU pages); `None` if unknown.
    pub fn adapter_residency(&self, id: u32) -> Option<VariantResidency<'_>> {
        self.adapters.map.get(&id).map(|a| VariantResidency {
            on_host: a.on_host,
            gpu_blocks: a.gpu_blocks.as_deref(),
            delta_slot: a.delta_slot,
        })
    }

    /// Queues a request. Rejects, without changing any state: an id already waiting or running,
    /// an empty prompt, `max_tokens == 0`, `prompt + max_tokens > max_model_len`, an adapter id
    /// that is not registered, and a request whose cache (at most `prompt + max_tokens - 1`
    /// tokens) plus its adapter's pages could not fit even in an empty pool.
    pub fn add_request(&mut self, req: SeqRequest) -> Result<(), SchedError> {
        self.check_request(&req)?;
        let (id, adapter_id) = (req.id, req.adapter_id);
        let key = OrderKey {
            arrival: req.arrival,
            seq_no: self.next_seq_no,
        };
        self.next_seq_no += 1;
        let cache_key = self.cfg.enable_prefix_caching.then(|| PrefixKey {
            variant: adapter_id,
            generation: match adapter_id {
                0 => 0,
                a => self.adapters.get(a).generation,
            },
        });
        self.seqs.insert(id, Seq::waiting(key, req, cache_key));
        if adapter_id != 0 {
            self.adapters.add_user(adapter_id);
        }
        insert_sorted_deque(&mut self.waiting, key, id);
        Ok(())
    }

    /// next non-empty step's `released`. Returns whether the request existed.
    pub fn abort(&mut self, id: u64) -> bool {
        let existed = self.remove(id);
        if existed {
            self.num_aborted += 1;
        }
        existed
    }

    /// Ends a request for a reason the caller decided (a stop string matched, the client went
    /// away after its last token...). Same mechanics as [`Scheduler::abort`], counted as finished.
    pub fn finish(&mut self, id: u64) -> bool {
        let existed = self.remove(id);
        if existed {
            self.num_finished += 1;
        }
        existed
    }

    /// Whether `id` is waiting or running.
    pub fn contains(&self, id: u64) -> bool {
        self.seqs.contains_key(&id)
    }

    /// The parent of a running skipper (a request of a delta admitted past a blocked queue
    /// head, see `skip_line.rs`); `None` for any other request, and for a skipper orphaned
    /// since the last `schedule` (the next one preempts it).
    pub fn skip_parent(&self, id: u64) -> Option<u64> {
        match self.seqs.get(&id)?.skip {
            Skip::Parent(p) => Some(p),
            Skip::No | Skip::Orphaned => None,
        }
    }

    /// The output tokens generated so far for a live request.
    pub fn output_tokens(&self, id: u64) -> Option<&[u32]> {
        self.seqs
            .get(&id)
            .map(|s| &s.tokens[s.num_prompt_tokens as usize..])
    }

    /// Forms the next step (`form_step` below lists its phases). Returns an empty step
    /// (`is_empty()`, `step_id == 0`) when nothing can run; pending releases then wait for the
    /// next non-empty step. Calling it again before [`Scheduler::update`] abandons the
    /// outstanding step: its requests are rescheduled from where their last update left them.
    ///
    /// Refused (an empty step, nothing changed) while a step formed by
    /// [`Scheduler::schedule_ahead`] is outstanding: that step computed past tokens not known
    /// yet, on pages the worker already appended to its tables, which no later step can take
    /// back. `update` the outstanding steps first, or call [`Scheduler::reset_worker`] when the
    /// worker lost them. (The server's actor never asks: it schedules only with no step
    /// outstanding.)
    pub fn schedule(&mut self) -> ScheduledStep {
        if self.outstanding.len() > 1 {
            return ScheduledStep::default();
        }
        self.clear_in_flight();
        self.form_step(false)
    }

    /// Steps sent and not yet answered by [`Scheduler::update`] (0, 1, or 2 with a step formed
    /// ahead).
    pub fn outstanding_steps(&self) -> usize {
        self.outstanding.len()
    }

    /// The step algorithm, one call per phase (each phase's doc has its pseudo-code):
    ///
    /// ```text
    /// budget = max_num_batched_tokens   (a prompt chunk: also prompt_budget's delta graph limit)
    /// 0. preempt every orphaned skipper: pages freed, back into waiting   preempt_orphans
    /// 1. for r in running (arrival order): schedule r's next chunk within the budget,
    ///    evicting idle LoRA adapters, then preempting the newest running requests, for
    ///    its pages                                                         schedule_running
    /// 2. if phase 1 preempted nothing: admit waiting requests FCFS, making room for their
    ///    variants; when a head cannot be admitted, requests of running deltas behind it
    ///    may skip the line                                   admit_waiting, skip_the_line
    /// 3. prefetch host copies for the first prefetch_window waiting requests   prefetch
    /// 4. released, adapter_ops, new and running grouped by adapter              assemble
    /// ```
    ///
    /// `ahead`: another step is outstanding (`schedule_ahead` checked that it needs no
    /// preemption).
    pub(crate) fn form_step(&mut self, ahead: bool) -> ScheduledStep {
        self.adapters.begin_step();
        self.outstanding.push_back(Vec::new());
        let mut draft = StepDraft {
            budget: self.cfg.max_num_batched_tokens,
            ..StepDraft::default()
        };
        let skip_preempted = self.preempt_orphans();
        draft.step.preempted.extend_from_slice(&skip_preempted);
        if self.cfg.delta_graph_tokens > 0 {
            for &(_, id) in &self.running {
                let seq = &self.seqs[&id];
                draft.delta_rows |= self.adapters.is_delta(seq.adapter_id);
                draft.decodes += usize::from(seq.to_schedule() == 1);
            }
            draft.decodes_ahead = draft.decodes;
        }
        let memory_preempted = self.schedule_running(&mut draft, ahead);
        if !memory_preempted {
            self.admit_waiting(&mut draft, &skip_preempted);
        }
        if draft.step.is_empty() {
            return self.empty_step(draft);
        }
        self.prefetch(&mut draft.ops);
        self.assemble(draft)
    }

    /// The most tokens a prompt chunk (of a request of a delta when `delta`) may take in the
    /// step being formed: the budget, and with a delta graph limit (`delta_graph_tokens`), in a
    /// step with delta rows or getting its first, what keeps the step within the limit, its
    /// decodes still to come included (0: the prompt waits for a later step):
    ///
    /// ```text
    /// if limit and (step has delta rows or delta) and decodes < limit:
    ///     min(budget, limit - tokens scheduled - decodes still to schedule)
    /// else: budget         # no limit, no delta rows, or the decodes alone pass it (eager anyway)
    /// ```
    pub(crate) fn prompt_budget(&self, draft: &StepDraft, delta: bool) -> usize {
        let limit = self.cfg.delta_graph_tokens;
        if limit == 0 || !(draft.delta_rows || delta) || draft.decodes >= limit {
            return draft.budget;
        }
        let held = self.cfg.max_num_batched_tokens - draft.budget + draft.decodes_ahead;
        draft.budget.min(limit.saturating_sub(held))
    }

    /// Phase 4, for a step that schedules something:
    ///
    /// ```text
    /// released = everything finished / aborted / preempted since the last step
    /// adapter_ops = pending drops ++ this step's drops ++ this step's loads
    /// new, running: stably sorted by adapter id (phase 1 still went oldest first)
    /// ```
    ///
    /// Drops go out before loads, so the worker's real host and GPU usage never exceed what
    /// the router accounted. Ops formed outside a non-empty step (`unregister_adapter` of an
    /// idle adapter, which frees its pages at once) are drops; they go out first here.
    fn assemble(&mut self, draft: StepDraft) -> ScheduledStep {
        let StepDraft {
            mut step,
            mut ops,
            running_adapters,
            ..
        } = draft;
        group_by_adapter(&mut step, &running_adapters);
        self.steps += 1;
        step.step_id = self.steps;
        step.released = std::mem::take(&mut self.pending_released);
        let mut adapter_ops = std::mem::take(&mut self.pending_ops);
        adapter_ops.append(&mut ops.drops);
        adapter_ops.append(&mut ops.loads);
        step.adapter_ops = adapter_ops;
        step
    }

    /// A step that schedules nothing is empty (`is_empty()`, `step_id` 0) and drains nothing:
    /// pending releases and adapter ops go out with the next non-empty step.
    fn empty_step(&mut self, draft: StepDraft) -> ScheduledStep {
        let StepDraft {
            mut step, mut ops, ..
        } = draft;
        // Preempting for pages leaves the oldest running request scheduled, and preempting
        // skippers leaves either running requests for phase 1 or an idle GPU that admits the
        // queue's head, so this cannot happen with preemptions; if it ever did, their ids
        // still go out with the next step's releases.
        debug_assert!(
            step.preempted.is_empty(),
            "preempted {:?} yet scheduled nothing",
            step.preempted
        );
        step.preempted.clear();
        // Adapters only move for a scheduled request, so an empty step forms no op; were
        // one formed, it would wait, in order, for the next non-empty step.
        debug_assert!(ops.is_empty(), "an empty step formed adapter ops {ops:?}");
        self.pending_ops.append(&mut ops.drops);
        self.pending_ops.append(&mut ops.loads);
        self.outstanding.pop_back();
        step
    }

    /// The worker lost its state (crashed and restarted): forgets the outstanding step, the
    /// pending releases and adapter ops, moves every running request back to the waiting queue
    /// to be recomputed (sent in full again), and forgets every adapter's host copy and GPU
    /// placement (their pages are free; registrations stay, and adapters are loaded again when
    /// requests need them), and empties the prefix cache (the KV is gone). Returns the requeued
    /// ids, oldest first. Not counted as preemptions.
    pub fn reset_worker(&mut self) -> Vec<u64> {
        self.clear_in_flight();
        let mut requeued = Vec::with_capacity(self.running.len());
        while let Some(&(_, id)) = self.running.last() {
            self.preempt(id);
            requeued.push(id);
        }
        self.pending_released.clear();
        self.pending_ops.clear();
        self.adapters.forget_residency(&mut self.blocks);
        self.blocks.clear_cache();
        requeued.reverse();
        requeued
    }

    /// Counters for metrics and tests.
    pub fn stats(&self) -> SchedStats {
        SchedStats {
            waiting: self.waiting.len(),
            running: self.running.len(),
            free_blocks: self.blocks.num_free(),
            used_blocks: self.blocks.num_used() - self.adapters.gpu_blocks(),
            total_blocks: self.blocks.total(),
            num_preemptions: self.num_preemptions,
            steps: self.steps,
            pending_released: self.pending_released.len(),
            num_finished: self.num_finished,
            num_aborted: self.num_aborted,
            adapters_registered: self.adapters.len(),
            adapters_on_gpu: self.adapters.num_on_gpu(),
            adapters_on_host: self.adapters.num_on_host(),
            adapter_blocks: self.adapters.gpu_blocks(),
            host_adapter_bytes: self.adapters.host_bytes(),
            adapter_gpu_loads: self.adapters.gpu_loads,
            adapter_host_loads: self.adapters.host_loads,
            adapter_gpu_evictions: self.adapters.gpu_evictions,
            deltas_on_gpu: self.adapters.num_deltas_on_gpu(),
            delta_skips: self.delta_skips,
            delta_skip_preemptions: self.delta_skip_preemptions,
            host_deferrals: self.host_deferrals,
            gpu_load_deferrals: self.gpu_load_deferrals,
            prefix_queried_tokens: self.prefix_queried,
            prefix_hit_tokens: self.prefix_hits,
            prefix_cached_blocks: self.blocks.num_cached(),
            prefix_evicted_blocks: self.blocks.num_evicted(),
            prefix_deferrals: self.prefix_deferrals,
        }
    }

    /// Whether any request is waiting or running.
    pub fn has_unfinished(&self) -> bool {
        !self.seqs.is_empty()
    }
}

/// Orders the step's `new` and `running` lists by adapter id (stable, so arrival order within
/// one adapter), giving the worker one contiguous segment per adapter; `running_adapters[i]` is
/// the adapter of `step.running[i]`. Phase 1 still processed running requests oldest first;
/// only the emitted order changes.
fn group_by_adapter(step: &mut ScheduledStep, running_adapters: &[u32]) {
    if !step.new.is_sorted_by_key(|n| n.adapter_id) {
        step.new.sort_by_key(|n| n.adapter_id);
    }
    debug_assert_eq!(running_adapters.len(), step.running.len());
    if !running_adapters.is_sorted() {
        // (adapter, position) pairs are distinct, so an unstable sort keeps arrival order.
        let mut order: Vec<(u32, usize)> = running_adapters.iter().copied().zip(0..).collect();
        order.sort_unstable();
        let mut old: Vec<Option<ScheduledRunning>> = std::mem::take(&mut step.running)
            .into_iter()
            .map(Some)
            .collect();
        step.running = order
            .into_iter()
            .map(|(_, i)| old[i].take().expect("each position once"))
            .collect();
    }
}
