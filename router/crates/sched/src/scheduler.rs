//! [`Scheduler`]: request queues, per-request KV block tables, the adapter table, and the step
//! algorithm (see the crate docs for the algorithm, the tiers and the worker-side contract).
//!
//! Request life cycle (`Seq::phase`):
//!
//! ```text
//!  add_request ──▶ Waiting ──admit (phase 2)──▶ Running ──EOS / max_tokens / finish / abort──▶ gone
//!                     ▲                            │           (pages freed, id -> released)
//!                     └────── preempt ─────────────┘
//!                        pages freed, num_computed = 0, id -> released; resent in full later
//! ```
//!
//! A running request of a delta is also in one skip state (`Seq::skip`, DeltaZip's
//! skip-the-line; waiting requests are always `No`):
//!
//! ```text
//!  admitted FCFS ──▶ No (may be a parent)
//!  admitted past a blocked head ──▶ Parent(p) ──p leaves, another No of the delta runs──▶ Parent(q)
//!                                      │
//!                                      └──p leaves, none left──▶ Orphaned ──next schedule()──▶ preempted
//! ```

use std::collections::{BTreeMap, VecDeque};

use crate::adapters::{
    AdapterOp, AdapterResidency, AdapterSpec, AdapterTable, StepOps, VariantKind,
};
use crate::block::{BlockAllocator, PageOwner};
use crate::config::SchedulerConfig;
use crate::error::SchedError;
use crate::step::{
    FinishReason, SchedStats, ScheduledNew, ScheduledRunning, ScheduledStep, SeqRequest, SeqUpdate,
};

/// Position of a request in every queue: earlier arrival first, ties by `add_request` order.
/// Unique per request, so queues sorted by it have one well-defined order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct OrderKey {
    /// The caller's arrival stamp.
    arrival: u64,
    /// Counter of `add_request` calls, to break ties deterministically.
    seq_no: u64,
}

/// Where a live request is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// In `waiting`: owns no pages, not on the worker.
    Waiting,
    /// In `running`: on the worker, owns the pages of its block table.
    Running,
}

/// How a running request was admitted, for DeltaZip's skip-the-line (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Skip {
    /// Admitted in FCFS order (every waiting request is `No`). A running `No` request of a delta
    /// "selects" that delta: queued requests of it may skip the line, and it can be their parent.
    No,
    /// Admitted past a blocked queue head because its delta was selected; it rides on this
    /// parent, the oldest running `No` request of the same delta when it was (re)assigned.
    Parent(u64),
    /// Its parent left and no running `No` request of its delta remains: it is preempted at the
    /// start of the next `schedule`, so the skipped requests get their turn.
    Orphaned,
}

/// Everything the scheduler tracks about one live request.
#[derive(Debug, Clone)]
struct Seq {
    /// Its place in the queues.
    key: OrderKey,
    /// `prompt ++ outputs`: what a resumed request recomputes, and what `new` entries carry.
    tokens: Vec<u32>,
    /// Length of the prompt at the front of `tokens`.
    num_prompt_tokens: u32,
    /// Output limit (finish with `Length`).
    max_tokens: u32,
    /// Ids that finish the request with `Eos`.
    eos_token_ids: Vec<u32>,
    /// Ignore `eos_token_ids` (always run to `max_tokens`).
    ignore_eos: bool,
    /// Leading tokens whose KV the worker has computed (confirmed by an `update`).
    num_computed: u32,
    /// Token positions the block table covers: the furthest any scheduled chunk reached since
    /// the request was (re)admitted. Pages owned == ceil(num_cached / block_size).
    num_cached: u32,
    /// Page ids, in order: page i holds tokens `[i * block_size, (i + 1) * block_size)`.
    blocks: Vec<u32>,
    /// Which queue it is in.
    phase: Phase,
    /// Tokens scheduled in the outstanding steps (0 when in none); each `update` applies its
    /// step's share.
    in_flight: u32,
    /// Output tokens the outstanding steps will sample and no `update` has delivered yet: a
    /// step scheduled ahead (`schedule_ahead`) computes them before they are known.
    pending: u32,
    /// Its variant, a LoRA adapter or a delta (0 = base): GPU-resident whenever the request is
    /// running.
    adapter_id: u32,
    /// Whether it skipped the line, and on whom it rides (always `No` while waiting).
    skip: Skip,
}

impl Seq {
    /// Output tokens generated so far.
    fn num_outputs(&self) -> u32 {
        self.tokens.len() as u32 - self.num_prompt_tokens
    }

    /// Where the next chunk starts: computed, or scheduled in an outstanding step.
    fn scheduled_to(&self) -> u32 {
        self.num_computed + self.in_flight
    }

    /// Tokens a next chunk could compute: the known ones plus those the outstanding steps
    /// sample, past `scheduled_to`; 0 when the outstanding steps' tokens reach `max_tokens`.
    fn to_schedule(&self) -> u32 {
        if self.num_outputs() + self.pending >= self.max_tokens {
            return 0;
        }
        self.tokens.len() as u32 + self.pending - self.scheduled_to()
    }
}

/// One request's part of an outstanding step.
#[derive(Debug, Clone, Copy)]
struct Chunk {
    /// The request.
    id: u64,
    /// Tokens scheduled.
    n: u32,
    /// Whether the chunk reaches the end of the known tokens, so the worker samples one.
    samples: bool,
}

/// What admitting one waiting request takes besides its KV pages, decided before anything
/// changes so that a refused admission changes nothing.
#[derive(Debug, Default)]
struct AdmissionPlan {
    /// Host copies to drop first (LRU) so the adapter's host copy fits the budget.
    host_drops: Vec<u32>,
    /// The adapter needs a `ToHost` (it has no host copy).
    to_host: bool,
    /// Idle GPU-resident LoRA adapters to evict (LRU) so the pages fit.
    gpu_evictions: Vec<u32>,
    /// The idle GPU-resident delta to evict (LRU) so the request's delta gets a slot.
    delta_eviction: Option<u32>,
    /// The adapter needs a `ToGpu` (it is not GPU-resident).
    to_gpu: bool,
}

/// The pure iteration-level scheduler: owns the queues, the page pool, every block table and
/// the adapter table. Deterministic: the same sequence of calls yields the same plans.
#[derive(Debug, Clone)]
pub struct Scheduler {
    /// Limits (validated).
    cfg: SchedulerConfig,
    /// The one page pool: KV pages of requests and weight pages of GPU-resident adapters.
    blocks: BlockAllocator,
    /// Registered adapters, their tiers, users and LRU stamps.
    adapters: AdapterTable,
    /// Adapter ops formed outside a non-empty step (unregistering), in application order;
    /// only drops, so prepending them to a step keeps its drops before its loads.
    pending_ops: Vec<AdapterOp>,
    /// Every live (waiting or running) request by id.
    seqs: BTreeMap<u64, Seq>,
    /// Requests not on the worker, sorted by `OrderKey`; admission takes the front.
    waiting: VecDeque<(OrderKey, u64)>,
    /// Requests on the worker, sorted by `OrderKey`; preemption victims come off the back.
    running: Vec<(OrderKey, u64)>,
    /// Ids to put in the next non-empty step's `released`.
    pending_released: Vec<u64>,
    /// What each outstanding step (sent, no `update` yet) scheduled, oldest first: one step
    /// after `schedule`, two after `schedule_ahead`.
    outstanding: VecDeque<Vec<Chunk>>,
    /// Next `OrderKey::seq_no`.
    next_seq_no: u64,
    /// Non-empty steps formed; the last one's `step_id`.
    steps: u64,
    /// Preemptions since start.
    num_preemptions: u64,
    /// Requests finished (length, EOS, or `finish`).
    num_finished: u64,
    /// Requests aborted.
    num_aborted: u64,
    /// Running requests that skipped the line (`Skip::Parent` or `Skip::Orphaned`).
    num_skippers: usize,
    /// Running requests in `Skip::Orphaned`, waiting for the next `schedule` to preempt them.
    num_orphans: usize,
    /// Requests admitted by skipping the line since start.
    delta_skips: u64,
    /// Orphaned skippers preempted since start.
    delta_skip_preemptions: u64,
    /// Times a waiting request was passed over because its adapter's host copy was loading.
    host_deferrals: u64,
}

impl Scheduler {
    /// A scheduler over an empty queue and an all-free pool of `cfg.num_blocks` pages.
    pub fn new(cfg: SchedulerConfig) -> Result<Self, SchedError> {
        cfg.validate()?;
        Ok(Self {
            blocks: BlockAllocator::new(cfg.num_blocks),
            adapters: AdapterTable::default(),
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
        })
    }

    /// The validated config.
    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    /// Registers a variant, a LoRA adapter or a delta (in the disk tier; it moves up when a
    /// request needs it). Refuses, changing nothing: id 0 (the base model), an id already
    /// registered, a LoRA adapter with `num_blocks == 0`, a delta with `num_blocks != 0`, a
    /// delta while `max_deltas` is 0 (`DeltasDisabled`), an empty path, `num_blocks` above the
    /// pool size and `host_bytes` above `host_adapter_bytes`.
    pub fn register_adapter(&mut self, id: u32, spec: AdapterSpec) -> Result<(), SchedError> {
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

    /// Where a registered adapter's weights are (host copy, GPU pages); `None` if unknown.
    pub fn adapter_residency(&self, id: u32) -> Option<AdapterResidency<'_>> {
        self.adapters.map.get(&id).map(|a| AdapterResidency {
            on_host: a.on_host,
            gpu_blocks: a.gpu_blocks.as_deref(),
        })
    }

    /// Queues a request. Rejects, without changing any state: an id already waiting or running,
    /// an empty prompt, `max_tokens == 0`, `prompt + max_tokens > max_model_len`, an adapter id
    /// that is not registered, and a request whose cache (at most `prompt + max_tokens - 1`
    /// tokens) plus its adapter's pages could not fit even in an empty pool.
    pub fn add_request(&mut self, req: SeqRequest) -> Result<(), SchedError> {
        let id = req.id;
        if self.seqs.contains_key(&id) {
            return Err(SchedError::DuplicateId { id });
        }
        if req.prompt.is_empty() {
            return Err(SchedError::EmptyPrompt { id });
        }
        if req.max_tokens == 0 {
            return Err(SchedError::ZeroMaxTokens { id });
        }
        let prompt_tokens = req.prompt.len() as u64;
        let total = prompt_tokens + req.max_tokens as u64;
        if total > self.cfg.max_model_len as u64 {
            return Err(SchedError::TooLong {
                id,
                prompt_tokens,
                max_tokens: req.max_tokens,
                total,
                max_model_len: self.cfg.max_model_len,
            });
        }
        let adapter_blocks = match req.adapter_id {
            0 => 0,
            a => match self.adapters.map.get(&a) {
                Some(entry) => entry.spec.num_blocks,
                None => {
                    return Err(SchedError::UnknownAdapter {
                        request: Some(id),
                        adapter_id: a,
                    })
                }
            },
        };
        // The last sampled token is never fed back, so at most total - 1 tokens are cached.
        // The adapter is pinned on the GPU while the request runs, so both must fit together.
        let max_cached_tokens = total - 1;
        let needed_blocks = self.cfg.blocks_for(max_cached_tokens);
        if needed_blocks + adapter_blocks as u64 > self.cfg.num_blocks as u64 {
            return Err(SchedError::TooBigForPool {
                id,
                max_cached_tokens,
                needed_blocks,
                adapter_blocks,
                block_size: self.cfg.block_size,
                num_blocks: self.cfg.num_blocks,
            });
        }
        let key = OrderKey {
            arrival: req.arrival,
            seq_no: self.next_seq_no,
        };
        self.next_seq_no += 1;
        let num_prompt_tokens = req.prompt.len() as u32;
        self.seqs.insert(
            id,
            Seq {
                key,
                tokens: req.prompt,
                num_prompt_tokens,
                max_tokens: req.max_tokens,
                eos_token_ids: req.eos_token_ids,
                ignore_eos: req.ignore_eos,
                num_computed: 0,
                num_cached: 0,
                blocks: Vec::new(),
                phase: Phase::Waiting,
                in_flight: 0,
                pending: 0,
                adapter_id: req.adapter_id,
                skip: Skip::No,
            },
        );
        if req.adapter_id != 0 {
            self.adapters.add_user(req.adapter_id);
        }
        insert_sorted_deque(&mut self.waiting, key, id);
        Ok(())
    }

    /// Removes a waiting or running request and frees its pages; a running one is listed in the
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
    /// head, see the crate docs); `None` for any other request, and for a skipper orphaned
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

    /// Forms the next step (see the crate docs for the algorithm). Returns an empty step
    /// (`is_empty()`, `step_id == 0`) when nothing can run; pending releases then wait for the
    /// next non-empty step. Calling it again before [`Scheduler::update`] abandons the
    /// outstanding steps: their requests are rescheduled from where their last update left them.
    pub fn schedule(&mut self) -> ScheduledStep {
        self.clear_in_flight();
        self.form_step(false)
    }

    /// Forms the step after the one outstanding step, before its `update` (see "Overlapped
    /// steps" in the crate docs): every request that step samples for is scheduled for that
    /// token, unknown yet, unless it has reached `max_tokens` with it. Returns an empty step,
    /// changing nothing, unless exactly one step is outstanding, and when the step would have to
    /// preempt: for pages (phase 1 needs more than the free pages) or orphaned skippers; the
    /// caller then waits for the `update` and calls [`Scheduler::schedule`].
    pub fn schedule_ahead(&mut self) -> ScheduledStep {
        if self.outstanding.len() != 1 || self.num_orphans > 0 || !self.running_fit_free_pages() {
            return ScheduledStep::default();
        }
        self.form_step(true)
    }

    /// Whether phase 1 of the next step finds every page it needs free (no eviction, no
    /// preemption).
    fn running_fit_free_pages(&self) -> bool {
        let mut budget = self.cfg.max_num_batched_tokens;
        let mut need: u64 = 0;
        for &(_, id) in &self.running {
            let (n, pages) = self.next_chunk(&self.seqs[&id], budget);
            budget -= n as usize;
            need += u64::from(pages);
        }
        need <= self.blocks.num_free() as u64
    }

    /// Running request `seq`'s next chunk within `budget` tokens: its length (0 when it has
    /// nothing to compute or the budget is spent) and the pages it needs beyond those it holds.
    fn next_chunk(&self, seq: &Seq, budget: usize) -> (u32, u32) {
        let n = (seq.to_schedule() as usize).min(budget) as u32;
        let need = self
            .cfg
            .blocks_for((seq.scheduled_to() + n) as u64)
            .saturating_sub(seq.blocks.len() as u64) as u32;
        (n, need)
    }

    /// The step algorithm; `ahead`: another step is outstanding (`schedule_ahead` checked that
    /// it needs no preemption).
    fn form_step(&mut self, ahead: bool) -> ScheduledStep {
        self.adapters.begin_step();
        self.outstanding.push_back(Vec::new());
        let mut ops = StepOps::default();
        let bs = self.cfg.block_size;
        let mut step = ScheduledStep::default();
        let mut budget = self.cfg.max_num_batched_tokens;
        // Running requests whose next step needs at least one more page than they hold after
        // this one; admission keeps that many pages free (the watermark).
        let mut watermark: u64 = 0;
        // Adapter of each `step.running` entry, in the same order (for grouping).
        let mut running_adapters: Vec<u32> = Vec::new();

        // Phase 0: DeltaZip's parent-based preemption. Skippers whose delta lost its last
        // running non-skipper go back to the queue (at their arrival position) to be recomputed,
        // so the requests they skipped get their turn. Not a sign of memory pressure: phase 2
        // still runs, but does not let them skip the line again in this call.
        let skip_preempted = self.preempt_orphans();
        step.preempted.extend_from_slice(&skip_preempted);
        // Set when phase 1 preempts for pages; then phase 2 admits nothing.
        let mut memory_preempted = false;

        // Phase 1: requests already on the worker, oldest first.
        let mut i = 0;
        while i < self.running.len() {
            let id = self.running[i].1;
            let seq = &self.seqs[&id];
            debug_assert!(
                seq.to_schedule() >= 1 || ahead,
                "running request {id} has nothing left to compute"
            );
            let (n, need) = self.next_chunk(seq, budget);
            if n == 0 {
                // Out of budget, or (ahead) done unless its outstanding token ends it: it stays
                // on the worker, unscheduled, and keeps its pages.
                let seq = &self.seqs[&id];
                watermark += u64::from(
                    (seq.blocks.len() as u64) * (bs as u64) < seq.scheduled_to() as u64 + 1,
                );
                i += 1;
                continue;
            }
            debug_assert!(
                !ahead || self.blocks.num_free() >= need,
                "schedule_ahead checked that phase 1 needs no preemption"
            );
            let mut preempted_self = false;
            while self.blocks.num_free() < need {
                // Cached adapters nobody runs with go before any request is preempted.
                if let Some(idle) = self.adapters.lru_idle_gpu(0) {
                    self.adapters.evict_gpu(idle, &mut self.blocks, &mut ops);
                    continue;
                }
                let victim = self
                    .running
                    .last()
                    .expect("request `id` itself is running")
                    .1;
                self.preempt(victim);
                self.num_preemptions += 1;
                step.preempted.push(victim);
                memory_preempted = true;
                if victim == id {
                    preempted_self = true;
                    break;
                }
            }
            if preempted_self {
                // It was the last running request, so phase 1 is over.
                break;
            }
            let seq = self.seqs.get_mut(&id).expect("running ids are live");
            let mut new_block_ids = Vec::new();
            let ok = self
                .blocks
                .allocate(PageOwner::Request(id), need, &mut new_block_ids);
            debug_assert!(ok, "enough pages were freed above");
            seq.blocks.extend_from_slice(&new_block_ids);
            let target = seq.scheduled_to() + n;
            let samples = target == seq.tokens.len() as u32 + seq.pending;
            seq.num_cached = seq.num_cached.max(target);
            seq.in_flight += n;
            seq.pending += u32::from(samples);
            watermark += u64::from((seq.blocks.len() as u64) * (bs as u64) < target as u64 + 1);
            budget -= n as usize;
            record_chunk(&mut self.outstanding, Chunk { id, n, samples });
            running_adapters.push(seq.adapter_id);
            step.running.push(ScheduledRunning {
                id,
                num_scheduled_tokens: n,
                new_block_ids,
            });
            i += 1;
        }

        // Phase 2: admit waiting requests FCFS, unless this step had to preempt for pages
        // (admitting now would only thrash). Head-of-line blocking is deliberate: no request
        // jumps the queue, not even one whose adapter is already on the GPU while the head's
        // must be loaded. Two exceptions, both bounded: with host copy reports, a request whose
        // adapter's host copy is still being read is passed over (its read under way) while
        // this step computes running requests anyway, and keeps its place; and DeltaZip's
        // skip-the-line for requests of deltas that already run (`skip_the_line`), tried only
        // when a request cannot be admitted.
        if !memory_preempted {
            let (_, window) = self.window_adapters();
            let defer_reads = self.cfg.host_copy_reports && !step.running.is_empty();
            let mut head_blocked = false;
            let mut pos = 0;
            while let Some(&(key, id)) = self.waiting.get(pos) {
                if self.running.len() >= self.cfg.max_num_seqs || budget == 0 {
                    break;
                }
                let (len, adapter_id) = {
                    let seq = &self.seqs[&id];
                    (seq.tokens.len(), seq.adapter_id)
                };
                if defer_reads && self.adapters.host_copy_pending(adapter_id, true) {
                    // Passed over only inside the prefetch window (the head always), and only
                    // once its read is under way; else FCFS stops here.
                    if pos > 0 && pos >= self.cfg.prefetch_window {
                        break;
                    }
                    if !self.adapters.get(adapter_id).on_host {
                        let Some(drops) = self.host_room(adapter_id, &window, pos == 0) else {
                            head_blocked = true;
                            break;
                        };
                        self.adapters.load_host_after(drops, adapter_id, &mut ops);
                    }
                    self.host_deferrals += 1;
                    pos += 1;
                    continue;
                }
                let n = len.min(budget) as u32;
                let need = self.cfg.blocks_for(n as u64);
                let Some(plan) = self.admission_plan(adapter_id, need + watermark, &window) else {
                    head_blocked = true;
                    break;
                };
                self.waiting.remove(pos);
                self.apply_admission(adapter_id, plan, &mut ops);
                watermark += self.admit(key, id, n, &mut step);
                budget -= n as usize;
            }
            if head_blocked {
                self.skip_the_line(&mut step, &mut budget, &mut watermark, &skip_preempted);
            }
        }

        if step.is_empty() {
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
            return step;
        }
        self.prefetch(&mut ops);
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

    /// The adapters of the first `prefetch_window` waiting requests: distinct ids in queue
    /// order, and the same ids sorted (for lookups). Empty when no adapter is registered or
    /// prefetch is off.
    fn window_adapters(&self) -> (Vec<u32>, Vec<u32>) {
        let (mut order, mut sorted) = (Vec::new(), Vec::new());
        if self.adapters.is_empty() {
            return (order, sorted);
        }
        for &(_, id) in self.waiting.iter().take(self.cfg.prefetch_window) {
            let a = self.seqs[&id].adapter_id;
            if a == 0 {
                continue;
            }
            if let Err(pos) = sorted.binary_search(&a) {
                sorted.insert(pos, a);
                order.push(a);
            }
        }
        (order, sorted)
    }

    /// What admitting a request with adapter `adapter_id` (0 = base) takes, when `kv_pages`
    /// pages (its KV plus the watermark) must be free after its adapter is placed: a host copy
    /// (dropping LRU host copies this step does not load, those outside the prefetch `window`
    /// first) and the adapter's pages (evicting LRU idle LoRA adapters) or, for a delta, a
    /// delta slot (evicting the LRU idle delta when all `max_deltas` are taken).
    /// `None`, changing nothing, when that cannot be had.
    fn admission_plan(
        &self,
        adapter_id: u32,
        kv_pages: u64,
        window: &[u32],
    ) -> Option<AdmissionPlan> {
        let mut plan = AdmissionPlan::default();
        let mut pages = kv_pages;
        if adapter_id != 0 {
            let a = self.adapters.get(adapter_id);
            if a.gpu_blocks.is_none() {
                plan.to_gpu = true;
                match a.spec.kind {
                    VariantKind::Lora => pages += a.spec.num_blocks as u64,
                    VariantKind::Delta => {
                        if !self.adapters.delta_slot_free(self.cfg.max_deltas) {
                            plan.delta_eviction = Some(self.adapters.lru_idle_delta(adapter_id)?);
                        }
                    }
                }
                if !a.on_host {
                    plan.to_host = true;
                    plan.host_drops = self.host_room(adapter_id, window, true)?;
                }
            }
        }
        let free = self.blocks.num_free() as u64;
        if pages > free {
            plan.gpu_evictions = self.adapters.gpu_eviction_plan(pages - free, adapter_id)?;
        }
        Some(plan)
    }

    /// The host copies to drop (LRU first) so that `adapter_id`'s fits the host budget: never
    /// one the step being formed loads, nor, unless `may_drop_window`, one an adapter of the
    /// prefetch `window` (sorted ids) needs; those go last when allowed. `None` when that does
    /// not free enough.
    fn host_room(
        &self,
        adapter_id: u32,
        window: &[u32],
        may_drop_window: bool,
    ) -> Option<Vec<u32>> {
        let bytes = self.adapters.get(adapter_id).spec.host_bytes;
        let deficit = self
            .adapters
            .host_deficit(bytes, self.cfg.host_adapter_bytes);
        if deficit == 0 {
            return Some(Vec::new());
        }
        self.adapters.host_drop_plan(deficit, |other| {
            let in_window = window.binary_search(&other).is_ok();
            (!self.adapters.needed_by_step(other) && (may_drop_window || !in_window))
                .then_some(u8::from(in_window))
        })
    }

    /// Carries out an [`AdmissionPlan`] for `adapter_id`: host drops, `ToHost`, GPU evictions
    /// (LoRA pages, a delta slot), `ToGpu` (the ops sort drops before loads).
    fn apply_admission(&mut self, adapter_id: u32, plan: AdmissionPlan, ops: &mut StepOps) {
        if plan.to_host {
            self.adapters
                .load_host_after(plan.host_drops, adapter_id, ops);
        }
        for a in plan.gpu_evictions {
            self.adapters.evict_gpu(a, &mut self.blocks, ops);
        }
        if let Some(d) = plan.delta_eviction {
            self.adapters.evict_gpu(d, &mut self.blocks, ops);
        }
        if plan.to_gpu {
            self.adapters.load_gpu(adapter_id, &mut self.blocks, ops);
        }
    }

    /// Moves waiting request `id` (already out of `waiting`, its adapter GPU-resident and
    /// enough pages free) to running with a first chunk of `n` tokens: allocates its pages,
    /// pins its adapter and sends it in full. Returns 1 when its next token will need a page it
    /// does not hold (its share of the watermark), else 0.
    fn admit(&mut self, key: OrderKey, id: u64, n: u32, step: &mut ScheduledStep) -> u64 {
        let bs = self.cfg.block_size as u64;
        let need = self.cfg.blocks_for(n as u64);
        let seq = self.seqs.get_mut(&id).expect("waiting ids are live");
        let mut block_ids = Vec::with_capacity(need as usize);
        let ok = self
            .blocks
            .allocate(PageOwner::Request(id), need as u32, &mut block_ids);
        debug_assert!(ok, "free pages were checked by the caller");
        seq.blocks.clone_from(&block_ids);
        seq.phase = Phase::Running;
        seq.num_cached = n;
        seq.in_flight = n;
        let samples = n as usize == seq.tokens.len();
        seq.pending = u32::from(samples);
        let table_full = (block_ids.len() as u64) * bs < n as u64 + 1;
        let adapter_id = seq.adapter_id;
        step.new.push(ScheduledNew {
            id,
            token_ids: seq.tokens.clone(),
            num_prompt_tokens: seq.num_prompt_tokens,
            num_computed_tokens: 0,
            num_scheduled_tokens: n,
            block_ids,
            adapter_id,
        });
        if adapter_id != 0 {
            self.adapters.start_running(adapter_id);
        }
        record_chunk(&mut self.outstanding, Chunk { id, n, samples });
        insert_sorted_vec(&mut self.running, key, id);
        u64::from(table_full)
    }

    /// DeltaZip's skip-the-line, after FCFS admission stopped at a head it cannot admit. The
    /// deltas with a running non-skipper are "selected" (FCFS picked them); every waiting
    /// request of a selected delta, in queue order, is admitted if its first chunk fits the
    /// free pages above the watermark, the token budget and `max_num_seqs` (one that does not
    /// fit is passed over, and the scan goes on). Such a skipper rides on the oldest running
    /// non-skipper of its delta, its parent. Its delta is already resident, so it needs no
    /// adapter op; base and LoRA requests never skip. `not_again` (skippers preempted in this
    /// call) are left for FCFS admission.
    fn skip_the_line(
        &mut self,
        step: &mut ScheduledStep,
        budget: &mut usize,
        watermark: &mut u64,
        not_again: &[u64],
    ) {
        if self.adapters.num_deltas_on_gpu() == 0 {
            return; // no delta runs (the common LoRA-only case costs nothing)
        }
        // Selected deltas, each with the oldest running non-skipper (its skippers' parent).
        let mut parents: BTreeMap<u32, u64> = BTreeMap::new();
        for &(_, id) in &self.running {
            let seq = &self.seqs[&id];
            if seq.skip == Skip::No && self.adapters.is_delta(seq.adapter_id) {
                parents.entry(seq.adapter_id).or_insert(id);
            }
        }
        if parents.is_empty() {
            return;
        }
        // The waiting requests of the selected deltas, in queue order; the scan ends once it has
        // seen all of them (their adapters count them), so it rarely walks the whole queue.
        let mut unseen: usize = parents
            .keys()
            .map(|&d| {
                let a = self.adapters.get(d);
                a.users - a.running
            })
            .sum();
        let mut candidates = Vec::new();
        for (pos, &(key, id)) in self.waiting.iter().enumerate() {
            if unseen == 0 {
                break;
            }
            if !parents.contains_key(&self.seqs[&id].adapter_id) {
                continue;
            }
            unseen -= 1;
            // The head is the request FCFS could not admit.
            if pos > 0 && !not_again.contains(&id) {
                candidates.push((key, id));
            }
        }
        let mut admitted = false;
        for (key, id) in candidates {
            if self.running.len() >= self.cfg.max_num_seqs || *budget == 0 {
                break;
            }
            let (len, delta) = {
                let seq = &self.seqs[&id];
                (seq.tokens.len(), seq.adapter_id)
            };
            let n = len.min(*budget) as u32;
            let need = self.cfg.blocks_for(n as u64);
            if need + *watermark > self.blocks.num_free() as u64 {
                continue;
            }
            *watermark += self.admit(key, id, n, step);
            *budget -= n as usize;
            self.seqs.get_mut(&id).expect("admitted ids are live").skip =
                Skip::Parent(parents[&delta]);
            self.num_skippers += 1;
            self.delta_skips += 1;
            admitted = true;
        }
        if admitted {
            let seqs = &self.seqs;
            self.waiting
                .retain(|(_, id)| seqs[id].phase == Phase::Waiting);
        }
    }

    /// Preempts every orphaned skipper (its delta has no running non-skipper left): back into
    /// the queue at its arrival position, recomputed later. Returns their ids, oldest first.
    fn preempt_orphans(&mut self) -> Vec<u64> {
        if self.num_orphans == 0 {
            return Vec::new();
        }
        let orphans: Vec<u64> = self
            .running
            .iter()
            .map(|&(_, id)| id)
            .filter(|id| self.seqs[id].skip == Skip::Orphaned)
            .collect();
        for &id in &orphans {
            self.preempt(id);
        }
        self.num_preemptions += orphans.len() as u64;
        self.delta_skip_preemptions += orphans.len() as u64;
        debug_assert_eq!(self.num_orphans, 0, "every orphan was preempted");
        orphans
    }

    /// Host prefetch for the step just formed: each distinct adapter of the first
    /// `prefetch_window` waiting requests, in queue order, that has no host copy and is not on
    /// the GPU gets a `ToHost` if it fits the host budget after dropping LRU host copies that
    /// neither this step nor the window needs. The first one that cannot fit ends the prefetch
    /// (later requests must not take the room an earlier one waits for).
    fn prefetch(&mut self, ops: &mut StepOps) {
        if self.cfg.prefetch_window == 0 {
            return;
        }
        let (order, window) = self.window_adapters();
        for a in order {
            if !self.adapters.host_copy_pending(a, false) {
                continue;
            }
            let Some(drops) = self.host_room(a, &window, false) else {
                break;
            };
            self.adapters.load_host_after(drops, a, ops);
        }
    }

    /// Applies the worker's results for the oldest outstanding step (the one [`Scheduler::schedule`]
    /// returned, then the one [`Scheduler::schedule_ahead`] returned): `(id, Some(token))` when
    /// the step computed a request to the end of its known tokens (the token is appended; the
    /// request finishes on an EOS id unless `ignore_eos`, or at `max_tokens`), `(id, None)` for
    /// a partial prefill chunk (its computed count advances).
    ///
    /// Tolerated, for robustness: ids not in that step (aborted or finished since, or unknown)
    /// and repeated ids are ignored; a token for a partial chunk is ignored; a scheduled request
    /// with no output, or with `None` where a token was due, is not advanced and is scheduled
    /// again from the same point (the worker overwrites those cache slots), or, when a later
    /// outstanding step already computes past it, preempted (recomputed later). An update with
    /// no step outstanding changes nothing.
    pub fn update(&mut self, outputs: &[(u64, Option<u32>)]) -> Vec<SeqUpdate> {
        let Some(chunks) = self.outstanding.pop_front() else {
            return Vec::new();
        };
        let mut unanswered: BTreeMap<u64, Chunk> = chunks.into_iter().map(|c| (c.id, c)).collect();
        let mut updates = Vec::with_capacity(outputs.len());
        // Finished requests: (id, adapter, skip state), for their skippers once all are gone.
        let mut finished_ids: Vec<(u64, u32, Skip)> = Vec::new();
        // Requests whose token never came although a later outstanding step builds on it.
        let mut lost: Vec<u64> = Vec::new();
        // In the worker's order; then the step's requests it did not answer, with no token.
        let answers = outputs
            .iter()
            .copied()
            .map(Some)
            .chain(std::iter::repeat(None));
        for answer in answers {
            let (chunk, token) = match answer {
                Some((id, token)) => match unanswered.remove(&id) {
                    Some(chunk) => (chunk, token),
                    None => continue, // not in this step, or repeated
                },
                None => match unanswered.pop_first() {
                    Some((_, chunk)) => (chunk, None),
                    None => break,
                },
            };
            let Some(seq) = self.seqs.get_mut(&chunk.id) else {
                continue;
            };
            seq.in_flight -= chunk.n;
            seq.pending -= u32::from(chunk.samples);
            let answered = answer.is_some();
            if !chunk.samples && answered {
                seq.num_computed += chunk.n; // a partial chunk: any token is ignored
                continue;
            }
            let Some(token) = token.filter(|_| chunk.samples) else {
                if seq.in_flight > 0 {
                    lost.push(chunk.id);
                }
                continue;
            };
            seq.num_computed += chunk.n;
            seq.tokens.push(token);
            let finished = if !seq.ignore_eos && seq.eos_token_ids.contains(&token) {
                Some(FinishReason::Eos)
            } else if seq.num_outputs() >= seq.max_tokens {
                Some(FinishReason::Length)
            } else {
                None
            };
            if finished.is_some() {
                self.blocks
                    .release(PageOwner::Request(chunk.id), &seq.blocks);
                if seq.adapter_id != 0 {
                    self.adapters.stop_running(seq.adapter_id);
                    self.adapters.remove_user(seq.adapter_id);
                }
                finished_ids.push((chunk.id, seq.adapter_id, seq.skip));
                self.seqs.remove(&chunk.id);
                self.pending_released.push(chunk.id);
                self.num_finished += 1;
            }
            updates.push(SeqUpdate {
                id: chunk.id,
                token,
                finished,
            });
        }
        if !finished_ids.is_empty() {
            let seqs = &self.seqs;
            self.running.retain(|(_, id)| seqs.contains_key(id));
            for (id, adapter_id, skip) in finished_ids {
                self.left_running(id, adapter_id, skip);
                self.forget_outstanding(id);
            }
        }
        for id in lost {
            self.preempt(id);
            self.num_preemptions += 1;
        }
        updates
    }

    /// The worker lost its state (crashed and restarted): forgets the outstanding step, the
    /// pending releases and adapter ops, moves every running request back to the waiting queue
    /// to be recomputed (sent in full again), and forgets every adapter's host copy and GPU
    /// placement (their pages are free; registrations stay, and adapters are loaded again when
    /// requests need them). Returns the requeued ids, oldest first. Not counted as preemptions.
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
        }
    }

    /// Whether any request is waiting or running.
    pub fn has_unfinished(&self) -> bool {
        !self.seqs.is_empty()
    }

    /// Checks every structural invariant; `Err` says which one broke and for what. O(pages +
    /// requests): for tests and debugging, not for the hot path.
    ///
    /// - the pool: no page free and owned, none listed twice, free + owned == total;
    /// - every page in a block table is owned by that request, every page of a GPU-resident
    ///   adapter by that adapter, and tables plus adapter pages sum to the used pages;
    /// - adapters: totals match, host bytes within budget, at most `max_deltas` deltas on the
    ///   GPU, every live request's adapter is registered and counts it as a user (a running one
    ///   also as running, and is on the GPU: pages for LoRA, a slot for a delta); pending
    ///   adapter ops are drops only;
    /// - skip-the-line: only running requests of deltas are skippers; every skipper's parent is
    ///   a running non-skipper of the same delta; an orphaned skipper's delta has no running
    ///   non-skipper; the skipper and orphan counts match;
    /// - a running request owns exactly ceil(num_cached / block_size) pages and
    ///   num_computed <= num_cached <= len(tokens) + pending, num_computed < len(tokens);
    /// - at most two steps are outstanding, and each request's in-flight tokens and pending
    ///   samples are the sums of its chunks in them;
    /// - a waiting request owns no pages and has nothing computed or in flight;
    /// - queues hold each live request once, in their phase, sorted by arrival order;
    /// - nobody has reached max_tokens or max_model_len without being finished.
    pub fn check_invariants(&self) -> Result<(), String> {
        self.blocks.check()?;
        if self.outstanding.len() > 2 {
            return Err(format!("{} steps outstanding", self.outstanding.len()));
        }
        let mut chunked: BTreeMap<u64, (u32, u32)> = BTreeMap::new();
        for chunk in self.outstanding.iter().flatten() {
            if self.seqs.contains_key(&chunk.id) {
                let sums = chunked.entry(chunk.id).or_default();
                sums.0 += chunk.n;
                sums.1 += u32::from(chunk.samples);
            }
        }
        for (&id, seq) in &self.seqs {
            let (n, samples) = chunked.get(&id).copied().unwrap_or_default();
            if (seq.in_flight, seq.pending) != (n, samples) {
                return Err(format!(
                    "request {id}: in flight {} / pending {} but its outstanding chunks hold {n} / {samples}",
                    seq.in_flight, seq.pending
                ));
            }
        }
        let adapter_pages = self.adapters.check(&self.blocks, &self.cfg)?;
        let mut owned = adapter_pages;
        // adapter id -> (live users, running users), recounted from the requests.
        let mut users: BTreeMap<u32, (usize, usize)> = BTreeMap::new();
        for (&id, seq) in &self.seqs {
            let len = seq.tokens.len() as u64;
            if seq.num_outputs() >= seq.max_tokens {
                return Err(format!(
                    "request {id} has {} outputs, max_tokens {}",
                    seq.num_outputs(),
                    seq.max_tokens
                ));
            }
            if len > self.cfg.max_model_len as u64 {
                return Err(format!("request {id} holds {len} tokens > max_model_len"));
            }
            if seq.num_computed as u64 >= len {
                return Err(format!(
                    "request {id}: num_computed {} >= {len} tokens",
                    seq.num_computed
                ));
            }
            match seq.phase {
                Phase::Waiting => {
                    if !seq.blocks.is_empty()
                        || seq.num_computed != 0
                        || seq.num_cached != 0
                        || seq.in_flight != 0
                        || seq.pending != 0
                    {
                        return Err(format!(
                            "waiting request {id} holds {} pages, computed {}, cached {}, in flight {}",
                            seq.blocks.len(),
                            seq.num_computed,
                            seq.num_cached,
                            seq.in_flight
                        ));
                    }
                }
                Phase::Running => {
                    let want = self.cfg.blocks_for(seq.num_cached as u64);
                    if seq.blocks.len() as u64 != want {
                        return Err(format!(
                            "request {id} owns {} pages for {} cached tokens (want {want})",
                            seq.blocks.len(),
                            seq.num_cached
                        ));
                    }
                    if seq.num_computed > seq.num_cached
                        || seq.num_cached as u64 > len + seq.pending as u64
                    {
                        return Err(format!(
                            "request {id}: computed {} <= cached {} <= tokens {len} + pending {} broken",
                            seq.num_computed, seq.num_cached, seq.pending
                        ));
                    }
                    if seq.in_flight > 0 && seq.num_computed + seq.in_flight > seq.num_cached {
                        return Err(format!("request {id}: in-flight chunk runs past its pages"));
                    }
                }
            }
            if seq.adapter_id != 0 {
                let count = users.entry(seq.adapter_id).or_default();
                count.0 += 1;
                count.1 += usize::from(seq.phase == Phase::Running);
            }
            for &page in &seq.blocks {
                if self.blocks.owner_of(page) != Some(PageOwner::Request(id)) {
                    return Err(format!(
                        "page {page} is in request {id}'s table but owned by {:?}",
                        self.blocks.owner_of(page)
                    ));
                }
            }
            owned += seq.blocks.len() as u64;
        }
        if owned != self.blocks.num_used() as u64 {
            return Err(format!(
                "block tables and adapters hold {owned} pages, pool has {} used",
                self.blocks.num_used()
            ));
        }
        if let Some((a, (live, _))) = users
            .iter()
            .find(|(a, _)| !self.adapters.map.contains_key(a))
        {
            return Err(format!(
                "{live} live request(s) name unregistered adapter {a}"
            ));
        }
        for (&a, entry) in &self.adapters.map {
            let (live, running) = users.get(&a).copied().unwrap_or_default();
            if (entry.users, entry.running) != (live, running) {
                return Err(format!(
                    "adapter {a} counts {} users / {} running, the requests say {live} / {running}",
                    entry.users, entry.running
                ));
            }
        }
        if let Some(op) = self.pending_ops.iter().find(|op| !op.is_drop()) {
            return Err(format!("pending adapter ops hold a load: {op:?}"));
        }
        if self.waiting.len() + self.running.len() != self.seqs.len() {
            return Err(format!(
                "{} waiting + {} running != {} live requests",
                self.waiting.len(),
                self.running.len(),
                self.seqs.len()
            ));
        }
        let queues = [
            (
                Phase::Waiting,
                self.waiting.iter().copied().collect::<Vec<_>>(),
            ),
            (Phase::Running, self.running.clone()),
        ];
        for (phase, queue) in queues {
            for (j, &(key, id)) in queue.iter().enumerate() {
                let seq = self
                    .seqs
                    .get(&id)
                    .ok_or_else(|| format!("{phase:?} queue holds dead request {id}"))?;
                if seq.phase != phase || seq.key != key {
                    return Err(format!(
                        "request {id} is in the {phase:?} queue as {:?} with key {key:?}",
                        seq.phase
                    ));
                }
                if j > 0 && queue[j - 1].0 >= key {
                    return Err(format!(
                        "{phase:?} queue is out of arrival order at request {id}"
                    ));
                }
            }
        }
        if self.running.len() > self.cfg.max_num_seqs {
            return Err(format!(
                "{} running > max_num_seqs {}",
                self.running.len(),
                self.cfg.max_num_seqs
            ));
        }
        self.check_skippers()
    }

    /// The skip-the-line part of [`Scheduler::check_invariants`].
    fn check_skippers(&self) -> Result<(), String> {
        let (mut skippers, mut orphans) = (0usize, 0usize);
        // Deltas with a running non-skipper.
        let selected: std::collections::BTreeSet<u32> = self
            .seqs
            .values()
            .filter(|s| s.phase == Phase::Running && s.skip == Skip::No)
            .map(|s| s.adapter_id)
            .filter(|&a| self.adapters.is_delta(a))
            .collect();
        for (&id, seq) in &self.seqs {
            if seq.skip == Skip::No {
                continue;
            }
            if seq.phase != Phase::Running {
                return Err(format!(
                    "waiting request {id} is marked as a skipper ({:?})",
                    seq.skip
                ));
            }
            if !self.adapters.is_delta(seq.adapter_id) {
                return Err(format!(
                    "request {id} skipped the line but its variant {} is not a delta",
                    seq.adapter_id
                ));
            }
            skippers += 1;
            match seq.skip {
                Skip::Parent(p) => {
                    let parent = self.seqs.get(&p).ok_or_else(|| {
                        format!("skipper {id}'s parent {p} is not a live request")
                    })?;
                    if parent.phase != Phase::Running
                        || parent.skip != Skip::No
                        || parent.adapter_id != seq.adapter_id
                    {
                        return Err(format!(
                            "skipper {id} (delta {}) has parent {p}, which is {:?}, {:?}, \
                             delta {}: not a running non-skipper of the same delta",
                            seq.adapter_id, parent.phase, parent.skip, parent.adapter_id
                        ));
                    }
                }
                Skip::Orphaned => {
                    orphans += 1;
                    if selected.contains(&seq.adapter_id) {
                        return Err(format!(
                            "skipper {id} is orphaned while delta {} has a running non-skipper",
                            seq.adapter_id
                        ));
                    }
                }
                Skip::No => unreachable!("skipped above"),
            }
        }
        if (skippers, orphans) != (self.num_skippers, self.num_orphans) {
            return Err(format!(
                "{} skippers / {} orphans counted, the requests say {skippers} / {orphans}",
                self.num_skippers, self.num_orphans
            ));
        }
        Ok(())
    }

    /// Takes a request out of the queues and frees its pages; a running one is queued for
    /// release. Returns whether it existed.
    fn remove(&mut self, id: u64) -> bool {
        let Some(seq) = self.seqs.remove(&id) else {
            return false;
        };
        match seq.phase {
            Phase::Waiting => {
                let pos = self
                    .waiting
                    .binary_search_by_key(&seq.key, |&(k, _)| k)
                    .expect("waiting request is queued");
                self.waiting.remove(pos);
            }
            Phase::Running => {
                let pos = self
                    .running
                    .binary_search_by_key(&seq.key, |&(k, _)| k)
                    .expect("running request is queued");
                self.running.remove(pos);
                self.blocks.release(PageOwner::Request(id), &seq.blocks);
                self.pending_released.push(id);
                if seq.adapter_id != 0 {
                    self.adapters.stop_running(seq.adapter_id);
                }
                self.left_running(id, seq.adapter_id, seq.skip);
                self.forget_outstanding(id);
            }
        }
        if seq.adapter_id != 0 {
            self.adapters.remove_user(seq.adapter_id);
        }
        true
    }

    /// Skip-the-line bookkeeping once running request `id` (of `adapter_id`, in `skip`) has left
    /// `running` (finished, aborted or preempted). A skipper only leaves the counts. A
    /// non-skipper's skippers move to the oldest running non-skipper of the same delta, or,
    /// when none is left, are orphaned: the next `schedule` preempts them.
    fn left_running(&mut self, id: u64, adapter_id: u32, skip: Skip) {
        match skip {
            Skip::Parent(_) => self.num_skippers -= 1,
            Skip::Orphaned => {
                self.num_skippers -= 1;
                self.num_orphans -= 1;
            }
            Skip::No => {
                if self.num_skippers == 0 || adapter_id == 0 {
                    return;
                }
                let children: Vec<u64> = self
                    .running
                    .iter()
                    .map(|&(_, r)| r)
                    .filter(|r| self.seqs[r].skip == Skip::Parent(id))
                    .collect();
                if children.is_empty() {
                    return;
                }
                let heir = self.running.iter().map(|&(_, r)| r).find(|r| {
                    let seq = &self.seqs[r];
                    seq.adapter_id == adapter_id && seq.skip == Skip::No
                });
                let next = match heir {
                    Some(h) => Skip::Parent(h),
                    None => {
                        self.num_orphans += children.len();
                        Skip::Orphaned
                    }
                };
                for c in children {
                    self.seqs.get_mut(&c).expect("running ids are live").skip = next;
                }
            }
        }
    }

    /// Preempts running request `id` (the last one for recompute preemption, any one for an
    /// orphaned skipper): frees its pages, resets it for recomputation and puts it back in the
    /// waiting queue at its arrival position (the front, unless a request with an earlier
    /// arrival stamp was added since), no longer a skipper. Its adapter loses a running user
    /// but stays cached until evicted; its skippers, if any, are re-parented or orphaned.
    fn preempt(&mut self, id: u64) {
        let seq = self.seqs.get_mut(&id).expect("running ids are live");
        debug_assert_eq!(seq.phase, Phase::Running, "preempt of waiting request {id}");
        let key = seq.key;
        let pos = if self.running.last().is_some_and(|&(_, last)| last == id) {
            self.running.len() - 1
        } else {
            self.running
                .binary_search_by_key(&key, |&(k, _)| k)
                .expect("running request is queued")
        };
        self.running.remove(pos);
        self.blocks.release(PageOwner::Request(id), &seq.blocks);
        if seq.adapter_id != 0 {
            self.adapters.stop_running(seq.adapter_id);
        }
        seq.blocks.clear();
        seq.num_computed = 0;
        seq.num_cached = 0;
        seq.in_flight = 0;
        seq.pending = 0;
        seq.phase = Phase::Waiting;
        let (adapter_id, skip) = (seq.adapter_id, std::mem::replace(&mut seq.skip, Skip::No));
        insert_sorted_deque(&mut self.waiting, key, id);
        self.pending_released.push(id);
        self.left_running(id, adapter_id, skip);
        self.forget_outstanding(id);
    }

    /// Drops `id`'s chunks from the outstanding steps: it left the running set (preempted,
    /// finished, aborted), so their outputs mean nothing now, even if the id comes back.
    fn forget_outstanding(&mut self, id: u64) {
        for chunks in &mut self.outstanding {
            chunks.retain(|c| c.id != id);
        }
    }

    /// Forgets what the outstanding steps scheduled.
    fn clear_in_flight(&mut self) {
        for chunk in self.outstanding.drain(..).flatten() {
            if let Some(seq) = self.seqs.get_mut(&chunk.id) {
                seq.in_flight = 0;
                seq.pending = 0;
            }
        }
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

/// Inserts into a deque sorted by key (O(1) at either end, the common cases).
fn insert_sorted_deque(q: &mut VecDeque<(OrderKey, u64)>, key: OrderKey, id: u64) {
    let pos = q.partition_point(|&(k, _)| k < key);
    q.insert(pos, (key, id));
}

/// Adds `chunk` to the step being formed (the newest of the `outstanding` steps; a field, not
/// `&mut Scheduler`, so phase 1 can call it while it holds a request).
fn record_chunk(outstanding: &mut VecDeque<Vec<Chunk>>, chunk: Chunk) {
    outstanding
        .back_mut()
        .expect("form_step pushed this step's chunks")
        .push(chunk);
}

/// Inserts into a vec sorted by key (O(1) when appending, the common case).
fn insert_sorted_vec(v: &mut Vec<(OrderKey, u64)>, key: OrderKey, id: u64) {
    if v.last().is_none_or(|&(k, _)| k < key) {
        v.push((key, id));
    } else {
        let pos = v.partition_point(|&(k, _)| k < key);
        v.insert(pos, (key, id));
    }
}
