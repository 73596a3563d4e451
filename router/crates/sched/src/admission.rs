//! Admission: phase 2 of a step, which moves waiting requests to running in FCFS order
//! ([`Scheduler::admit_waiting`]) after making room for their variants on the host and the GPU
//! ([`AdmissionPlan`]), and phase 3, which prefetches host copies for the front of the queue
//! ([`Scheduler::prefetch`]). The tiers themselves (disk -> host -> GPU, and the ops that move
//! a variant between them) are drawn in `adapters.rs`; this module decides when to move.
//!
//! - GPU: a running request pins its adapter (never evicted while a running request uses it).
//!   An adapter nobody runs with stays cached in its pages until they are needed: then idle
//!   adapters are evicted least recently used first (the LRU stamp is taken when a request
//!   using it is admitted, when its last running request leaves, and when its host copy is
//!   loaded). A preempted request only unpins its adapter.
//! - Delta slots: a delta holds no pool pages; at most `max_deltas` deltas are GPU-resident
//!   after every op of every step, each in a worker slot (its host tier, prefetch and LRU
//!   stamps are exactly a LoRA adapter's). Admitting a request whose delta is not resident
//!   takes a free slot, else evicts the least recently used *idle* resident delta (no running
//!   request), else the request cannot be admitted now. Deltas are never evicted for pages
//!   (they free none), LoRA adapters never for slots.
//! - Host: the accounted host bytes never exceed `host_adapter_bytes`, one budget for the host
//!   copies of LoRA adapters and deltas together. Room is made by dropping least recently used
//!   host copies of adapters this step does not load (a drop goes out before every load of its
//!   step, so dropping those would undo the load). Host copies of GPU-resident adapters are
//!   fair game: the GPU copy stays. Admission drops copies outside the prefetch window before
//!   those inside it; prefetch never drops those inside it.
//! - Reads take time: a `ToHost` starts a read, and a `ToGpu` on the worker waits for it, with
//!   the whole step behind it. With `host_copy_reports` the worker reports finished reads
//!   ([`Scheduler::host_copies_ready`], sent with step outputs), and in a step that computes
//!   running requests anyway, a waiting request whose adapter's copy is still being read is
//!   passed over (its read started if need be) and keeps its place. A `ToGpu` counts its read
//!   as finished (the worker waited for it).
//! - So do GPU copies of deltas (a few GB each): with `gpu_load_reports` the worker copies a
//!   delta's `ToGpu` beside the steps and reports it finished ([`Scheduler::gpu_copies_ready`]).
//!   In a step that computes running requests anyway, a waiting request whose delta is not
//!   GPU-resident gets it loaded ahead (a slot taken, its `ToGpu` sent in this step, the delta
//!   marked `gpu_loading`) and is passed over, as is one whose delta is still loading; it keeps
//!   its place, under the prefetch-window rule of host reads. A loading delta is not evicted
//!   while requests run, so the load is not undone before its request runs. With nothing else
//!   to run, a request is admitted with its delta's `ToGpu` (or while its delta is loading) and
//!   the step waits for the copy, as without reports: admission counts the copy as finished, and
//!   a loading delta may then be evicted, last, for the slot the head needs (no report could
//!   come back before a step is sent, so holding the slot could stall the queue).
//!
//! - Prefix cache (`prefix.rs`): a request's cached prefix pages are reused, not allocated; those
//!   no request holds count as free pages until then, so taking them counts against the free
//!   pages like new ones. A request whose next prefix page a running request is computing is
//!   passed over (it keeps its place) until that page is published; at most
//!   `MAX_PREFIX_DEFERRALS` a step.
//!
//! The watermark is the number of running requests whose next token will need a page they do
//! not hold yet (their table is full after this step). Admission keeps that many pages free, so
//! a new request never takes the page an older one needs for its next decode token. It is
//! exact rather than a fixed fraction of the pool, so a request that needs the whole pool can
//! still be admitted into an idle one, and add_request's "fits in the pool" check (KV plus
//! adapter pages) guarantees progress: the oldest running request alone always fits, since
//! every other adapter is evictable once the others are preempted, and with nothing running
//! the head of the queue always fits (every adapter is idle, every host copy droppable, and
//! registration refused adapters larger than the pool or the host budget).
//!
//! Head-of-line blocking is kept with LoRA adapters: a request whose adapter is cold waits at
//! the front even when requests behind it have theirs on the GPU. This keeps admission FCFS
//! and starvation-free; prefetch hides most of the cold start by loading the host copy while
//! the request is still queued. With host copy or GPU load reports, the one request passed
//! over is one whose read (or its delta's GPU copy) is under way: ready requests behind it go first only
//! until its read (copy) is reported, and then it is ahead of them again; with nothing running
//! it is admitted at once (the worker waits for the read or the copy), so a report that never
//! comes delays it but cannot strand it. Deltas relax it only through skip-the-line
//! (`skip_line.rs`), whose parent-based preemption keeps it starvation-free. Skip-the-line only
//! admits requests of deltas that run, and a delta that runs is never loading (admission
//! cleared the mark, and a resident delta is not loaded again), so it never admits a request
//! whose step would wait for a copy.

use crate::block::PageOwner;
use crate::inflight::{record_chunk, Chunk};
use crate::prefix::MAX_PREFIX_DEFERRALS;
use crate::queues::insert_sorted_vec;
use crate::request::{OrderKey, Phase};
use crate::scheduler::{Scheduler, StepDraft};
use crate::step::{ScheduledNew, ScheduledStep};
use crate::variants::{StepOps, VariantKind};

/// What admitting one waiting request takes besides its KV pages, decided before anything
/// changes so that a refused admission changes nothing.
#[derive(Debug, Default)]
pub(crate) struct AdmissionPlan {
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

impl Scheduler {
    /// Phase 2: admit waiting requests FCFS (run only when phase 1 preempted nothing for
    /// pages; admitting then would only thrash).
    ///
    /// ```text
    /// for w in waiting (queue order), while running < max_num_seqs and budget > 0:
    ///     if host_copy_reports and phase 1 scheduled someone and w.adapter is not on the GPU
    ///           and its host copy is missing or still being read:     # pass w over
    ///           stop if w is past the prefetch window (the head never is)
    ///           if it has no host copy: DropHost.. ToHost(w.adapter), with the room rule
    ///               below for the head and prefetch's for the others, else stop
    ///           continue with the next waiting request; w keeps its place
    ///     if gpu_load_reports and phase 1 scheduled someone and w.adapter is a delta that is
    ///           not on the GPU or still loading (its copy not reported):   # pass w over
    ///           stop if w is past the prefetch window (the head never is)
    ///           if it is not on the GPU: take a slot (a free one, else evict the LRU idle
    ///               delta that is not loading, DropGpu; with no host copy, DropHost..
    ///               ToHost as for reads), else stop; ToGpu(w.adapter, slot), mark it loading
    ///           continue with the next waiting request; w keeps its place
    ///     hits = w's cached prefix pages (`prefix.rs`); if a running request is computing
    ///           w's next prefix page: pass w over (it keeps its place; at most
    ///           MAX_PREFIX_DEFERRALS a step) and continue
    ///     n = min(len(w.tokens) - hits * block_size, prompt_budget)   # chunked prefill
    ///     (prompt_budget 0: the step is as long as the worker's delta graphs: stop)
    ///     need = pages(hits * block_size + n) - hits + hits no request holds + watermark
    ///            (+ w.adapter's pages unless it is on the GPU)
    ///     delta: if w.delta is not on the GPU and all max_deltas slots are taken, evict the
    ///           LRU idle delta (DropGpu; one loading ahead last), else stop
    ///     host: if w.adapter must go to the GPU and has no host copy, it needs host room:
    ///           drop LRU host copies not loaded in this step (outside the prefetch window
    ///           first) until it fits, else stop
    ///     gpu:  evict LRU idle LoRA adapters (not w's) until need pages are free, else stop
    ///     (nothing is dropped or evicted unless w is then admitted)   # FCFS
    ///     ops: DropHost.., ToHost(w.adapter), DropGpu.., ToGpu(w.adapter, pages or a slot)
    ///     admit w (sent in `new` with all its tokens and num_computed = hits * block_size),
    ///     hits held, w.adapter pinned (no longer loading: the step waits for a copy under
    ///     way), budget -= n
    /// if the loop stopped because a w could not be admitted: skip-the-line (`skip_line.rs`)
    ///     for the requests of selected deltas behind it, in queue order
    /// ```
    ///
    /// Head-of-line blocking is deliberate (see the module docs): no request jumps the queue,
    /// not even one whose adapter is already on the GPU while the head's must be loaded, but
    /// for the two bounded exceptions above. `skip_preempted`: the skippers phase 0 preempted,
    /// which may not skip again in this call.
    pub(crate) fn admit_waiting(&mut self, draft: &mut StepDraft, skip_preempted: &[u64]) {
        let (_, window) = self.window_adapters();
        let defer_reads = self.cfg.host_copy_reports && !draft.step.running.is_empty();
        let defer_loads = self.cfg.gpu_load_reports && !draft.step.running.is_empty();
        let mut head_blocked = false;
        let mut deferred = 0;
        let mut pos = 0;
        while let Some(&(key, id)) = self.waiting.get(pos) {
            if self.running.len() >= self.cfg.max_num_seqs || draft.budget == 0 {
                break;
            }
            let adapter_id = self.seqs[&id].adapter_id;
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
                    self.adapters
                        .load_host_after(drops, adapter_id, &mut draft.ops);
                }
                self.host_deferrals += 1;
                pos += 1;
                continue;
            }
            if defer_loads && self.adapters.gpu_load_pending(adapter_id) {
                // The delta is loaded ahead and w passed over (it keeps its place) while the
                // copy runs beside the steps; only inside the prefetch window (the head always).
                if pos > 0 && pos >= self.cfg.prefetch_window {
                    break;
                }
                if self.adapters.get(adapter_id).gpu_blocks.is_none() {
                    let Some(plan) = self.load_ahead_plan(adapter_id, &window, pos == 0) else {
                        head_blocked = true;
                        break;
                    };
                    self.apply_admission(adapter_id, plan, &mut draft.ops);
                    self.adapters.start_gpu_load(adapter_id);
                }
                self.gpu_load_deferrals += 1;
                pos += 1;
                continue;
            }
            let delta = self.adapters.is_delta(adapter_id);
            let budget = self.prompt_budget(draft, delta);
            if budget == 0 {
                break; // the step is as long as the worker's delta graphs: the rest waits
            }
            let Some(prefix) = self.plan_prefix(id, budget) else {
                // A running request is computing its next prefix page: take it once published.
                self.prefix_deferrals += 1;
                deferred += 1;
                if deferred >= MAX_PREFIX_DEFERRALS {
                    break;
                }
                pos += 1;
                continue;
            };
            let Some(plan) = self.admission_plan(
                adapter_id,
                prefix.pages + draft.watermark,
                &window,
                !defer_loads,
            ) else {
                head_blocked = true;
                break;
            };
            self.waiting.remove(pos);
            let computed = self.take_prefix(id, &prefix.hits);
            self.apply_admission(adapter_id, plan, &mut draft.ops);
            draft.watermark += self.admit(key, id, prefix.hits, prefix.n, &mut draft.step);
            draft.budget -= prefix.n as usize;
            draft.delta_rows |= delta;
            debug_assert_eq!(computed, self.seqs[&id].num_computed);
        }
        if head_blocked {
            self.skip_the_line(draft, skip_preempted);
        }
    }

    /// Phase 3, host prefetch for the step just formed:
    ///
    /// ```text
    /// for each distinct adapter of the first prefetch_window waiting requests, in queue
    ///     order, with no host copy and not on the GPU:
    ///     ToHost if it fits the host budget after dropping LRU host copies neither this step
    ///     nor the window needs, else stop prefetching for this step
    /// ```
    ///
    /// The first one that cannot fit ends the prefetch (later requests must not take the room
    /// an earlier one waits for).
    pub(crate) fn prefetch(&mut self, ops: &mut StepOps) {
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
    /// delta slot (evicting the LRU idle delta when all `max_deltas` are taken; one loading
    /// ahead only if `take_loading`, and last). `None`, changing nothing, when that cannot be
    /// had.
    fn admission_plan(
        &self,
        adapter_id: u32,
        kv_pages: u64,
        window: &[u32],
        take_loading: bool,
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
                            plan.delta_eviction =
                                Some(self.adapters.lru_idle_delta(adapter_id, take_loading)?);
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

    /// What loading delta `adapter_id` (not GPU-resident) ahead of its request takes
    /// (`gpu_load_reports`, in a step with running requests): a delta slot (a free one, else the
    /// LRU idle delta's, never one still loading ahead) and, should it have no host copy, host
    /// room (the head's rule when `head`, else prefetch's). It takes no pages, and the step does
    /// not wait for the `ToGpu`: the worker copies beside it. `None`, changing nothing, when that
    /// cannot be had.
    fn load_ahead_plan(
        &self,
        adapter_id: u32,
        window: &[u32],
        head: bool,
    ) -> Option<AdmissionPlan> {
        let mut plan = AdmissionPlan {
            to_gpu: true,
            ..AdmissionPlan::default()
        };
        if !self.adapters.delta_slot_free(self.cfg.max_deltas) {
            plan.delta_eviction = Some(self.adapters.lru_idle_delta(adapter_id, false)?);
        }
        if !self.adapters.get(adapter_id).on_host {
            plan.to_host = true;
            plan.host_drops = self.host_room(adapter_id, window, head)?;
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

    /// Carries out an [`AdmissionPlan`] for `adapter_id` (or a [`Self::load_ahead_plan`]): host
    /// drops, `ToHost`, GPU evictions (LoRA pages, a delta slot), `ToGpu` (the ops sort drops
    /// before loads).
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

    /// Moves waiting request `id` (already out of `waiting`, its adapter GPU-resident, its
    /// prefix-cache `hits` held (`take_prefix`) and enough pages free) to running with a first
    /// chunk of `n` tokens after its hits: allocates its own pages, pins its adapter and sends
    /// it in full. Returns 1 when its next token will need a page it does not hold (its share
    /// of the watermark), else 0.
    pub(crate) fn admit(
        &mut self,
        key: OrderKey,
        id: u64,
        hits: Vec<u32>,
        n: u32,
        step: &mut ScheduledStep,
    ) -> u64 {
        let bs = self.cfg.block_size as u64;
        let computed = hits.len() as u32 * self.cfg.block_size;
        let need = self.cfg.blocks_for(u64::from(computed + n)) - hits.len() as u64;
        let seq = self.seqs.get_mut(&id).expect("waiting ids are live");
        let mut block_ids = hits;
        let ok = self
            .blocks
            .allocate(PageOwner::Request(id), need as u32, &mut block_ids);
        debug_assert!(ok, "free pages were checked by the caller");
        seq.blocks.clone_from(&block_ids);
        seq.phase = Phase::Running;
        seq.num_computed = computed;
        seq.num_cached = computed + n;
        seq.in_flight = n;
        let samples = (computed + n) as usize == seq.tokens.len();
        seq.pending = u32::from(samples);
        let table_full = (block_ids.len() as u64) * bs < u64::from(computed + n) + 1;
        let adapter_id = seq.adapter_id;
        step.new.push(ScheduledNew {
            id,
            token_ids: seq.tokens.clone(),
            num_prompt_tokens: seq.num_prompt_tokens,
            num_computed_tokens: computed,
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
}
