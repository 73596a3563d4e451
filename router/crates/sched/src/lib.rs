//! The pure scheduler: iteration-level continuous batching of prefill and decode over one
//! paged GPU pool that holds both the KV cache and LoRA adapter weights (S-LoRA unified
//! paging), whose accounting the router owns, plus the variants' tiers (disk -> host memory ->
//! GPU pages for LoRA adapters, GPU delta slots for compressed full fine-tunes, DeltaZip). No
//! IO, no clock, no async: time comes in as numbers, the same calls give the same plans, and
//! everything is unit-testable (and drivable from a Python simulator through the `py` crate).
//!
//! # Layout
//!
//! - [`config`]: [`SchedulerConfig`], pool geometry, per-step limits, host tier and delta
//!   slots, validated.
//! - [`error`]: [`SchedError`], why a config, request or adapter was refused.
//! - [`block`]: [`BlockAllocator`], the page free list with one owner ([`PageOwner`]: a
//!   request's KV or an adapter's weights) per page.
//! - [`adapters`]: [`AdapterSpec`] (with its [`VariantKind`]) in, [`AdapterOp`]s out, and the
//!   adapter table (tiers, pages or delta slots, users, LRU stamps).
//! - [`step`]: the API's data: [`SeqRequest`] in, [`ScheduledStep`] out, [`SeqUpdate`] back.
//! - [`scheduler`]: [`Scheduler`], queues + block tables + adapter table + the step algorithm.
//!
//! # Worker-side contract
//!
//! A request's tokens are `prompt ++ outputs`. A step computes tokens
//! `[num_computed, num_computed + num_scheduled)`; when that reaches the end of the known tokens
//! the worker samples one token, which the following [`Scheduler::update`] appends. So a decoding
//! request is scheduled 1 token per step (the one sampled last step). Page `i` of a block table
//! holds tokens `[i * block_size, (i + 1) * block_size)`; a request always owns exactly
//! `ceil(cached / block_size)` pages, where `cached` is how far its scheduled chunks reached.
//! `new` entries carry the whole block table, `running` entries only appended pages, and
//! `released` ids must be dropped by the worker before it runs the step. Then the worker applies
//! `adapter_ops` in order (all drops, then all loads), and only then runs the requests: every
//! scheduled request's adapter is GPU-resident by then. `new` and `running` are each grouped by
//! adapter id (ascending; arrival order within an adapter), so each adapter is one contiguous
//! segment.
//!
//! # Adapters and tiers
//!
//! An adapter is registered ([`Scheduler::register_adapter`]) with its page count, host bytes
//! and path, and lives in one of: disk only; host copy; host copy + GPU pages; GPU pages only
//! (host copy dropped). The router moves it with ops the worker applies: `ToHost{path}` (read
//! into host memory, possibly in the background), `ToGpu{pages}` (copy the host copy into pool
//! pages; always after a `ToHost` with no `DropHost` since), `DropGpu`, `DropHost`.
//!
//! - GPU: a running request pins its adapter (never evicted while a running request uses it).
//!   An adapter nobody runs with stays cached in its pages until they are needed: then idle
//!   adapters are evicted least recently used first (the LRU stamp is taken when a request using
//!   it is admitted, when its last running request leaves, and when its host copy is loaded).
//!   A preempted request only unpins its adapter.
//! - Host: the accounted host bytes never exceed `host_adapter_bytes`, one budget for the host
//!   copies of LoRA adapters and deltas together. Room is made by dropping
//!   least recently used host copies of adapters this step does not load (a drop goes out
//!   before every load of its step, so dropping those would undo the load). Host copies of
//!   GPU-resident adapters are fair game: the GPU copy stays. Admission drops copies outside
//!   the prefetch window before those inside it; prefetch never drops those inside it.
//! - Reads take time: a `ToHost` starts a read, and a `ToGpu` on the worker waits for it, with
//!   the whole step behind it. With `host_copy_reports` the worker reports finished reads
//!   ([`Scheduler::host_copies_ready`], sent with step outputs), and in a step that computes
//!   running requests anyway, a waiting request whose adapter's copy is still being read is
//!   passed over (its read started if need be) and keeps its place; see phase 2 below. A `ToGpu`
//!   counts its read as finished (the worker waited for it).
//! - Order: every step's ops go out drops first, loads second, so the worker's real host and
//!   GPU usage never exceed what the router accounted. Ops formed outside a non-empty step
//!   (`unregister_adapter` of an idle adapter, which frees its pages at once) are drops; they
//!   go out first in the next non-empty step.
//!
//! # Deltas (DeltaZip)
//!
//! A variant is registered with a [`VariantKind`]. A `Delta` (a compressed full fine-tune) has
//! no pool pages (`num_blocks` 0): on the GPU it sits in one of the worker's `max_deltas` delta
//! slots, so its `ToGpu` carries no page ids, and at most `max_deltas` deltas are GPU-resident
//! after every op of every step (`max_deltas` 0: deltas cannot be registered). Its host tier,
//! prefetch and LRU stamps are exactly a LoRA adapter's.
//!
//! - Slots: admitting a request whose delta is not resident takes a free slot, else evicts the
//!   least recently used *idle* resident delta (no running request), else the request cannot
//!   be admitted now. Deltas are never evicted for pages (they free none), LoRA adapters never
//!   for slots.
//! - Skip-the-line: FCFS admission picks at most `max_deltas` deltas; a delta with a running
//!   request admitted in FCFS order (a non-skipper) is *selected*. When FCFS admission stops
//!   because the head cannot be admitted (not on `max_num_seqs` or the token budget), the rest
//!   of the queue is scanned in order and every request of a selected delta is admitted if its
//!   first chunk fits the free pages (above the watermark), the budget and `max_num_seqs` (one
//!   that does not fit is passed over). Such a *skipper* rides on a *parent*, the oldest running
//!   non-skipper of its delta. Base and LoRA requests never skip.
//! - Parent-based preemption (no starvation): when a non-skipper leaves the running set
//!   (finished, aborted, preempted), its skippers move to the oldest running non-skipper of the
//!   same delta if one is left; otherwise they are orphaned, and the next `schedule` preempts
//!   every orphan first (pages freed, back into the queue at its arrival position, id in
//!   `released` and `preempted`, recomputed later) without stopping that step's admission; a
//!   request preempted so is not let skip again in that call. New non-skippers are admitted
//!   only in FCFS order, which the blocked head holds up, so the selected deltas' non-skippers
//!   only dwindle: they finish, their skippers are preempted, and the head gets its slot and
//!   its pages.
//!
//! # Overlapped steps (`schedule_ahead`)
//!
//! With one step outstanding (sent, no `update` yet), [`Scheduler::schedule_ahead`] forms the
//! next one so the worker can launch it behind the first. A request the outstanding step samples
//! for has one *pending* token: known to exist, not yet known. Phase 1 schedules it for that
//! token (the chunk starts where the outstanding one ends, `num_computed + in_flight`), unless
//! the pending token is its last (`outputs + pending == max_tokens`); the worker feeds the
//! token from its own copy of the sample. A request that the pending token ends (EOS) is thus
//! computed once more for nothing; `update` drops that chunk with the request, and its pages,
//! freed then, are handed out only in a later step, which the worker runs after. Refused (an
//! empty step, nothing changed) when it would have to preempt, for pages or for orphaned
//! skippers: preemption waits for the `update`. `update` always applies the oldest outstanding
//! step; a token that does not come although a later step computes past it preempts its
//! request (recomputed later).
//!
//! # One step (`schedule`)
//!
//! ```text
//! budget = max_num_batched_tokens
//! 0. preempt every orphaned skipper (see Deltas): pages freed, back into waiting
//! 1. for r in running (arrival order):
//!        n = min(len(r.tokens) - r.num_computed, budget)      # 1 in decode, a chunk in prefill
//!        while pages for r.num_computed + n are not free:
//!            if a LoRA adapter on the GPU has no running request: evict the LRU one (DropGpu)
//!            else preempt the most recently arrived running request v   # free pages,
//!            (v -> front of waiting, v -> released/preempted)  # computed = 0, recompute later
//!            if v is r: stop phase 1
//!        allocate, schedule r for n tokens, budget -= n
//! 2. if phase 1 preempted nothing: for w in waiting (queue order), while running <
//!    max_num_seqs and budget > 0:
//!        if host_copy_reports and phase 1 scheduled someone and w.adapter is not on the GPU
//!              and its host copy is missing or still being read:     # pass w over
//!              stop if w is past the prefetch window (the head never is)
//!              if it has no host copy: DropHost.. ToHost(w.adapter), with the room rule
//!                  below for the head and prefetch's for the others, else stop
//!              continue with the next waiting request; w keeps its place
//!        n = min(len(w.tokens), budget)                      # chunked prefill
//!        need = pages(n) + watermark (+ w.adapter's pages unless it is on the GPU)
//!        delta: if w.delta is not on the GPU and all max_deltas slots are taken, evict the
//!              LRU idle delta (DropGpu), else stop
//!        host: if w.adapter must go to the GPU and has no host copy, it needs host room:
//!              drop LRU host copies not loaded in this step (outside the prefetch window
//!              first) until it fits, else stop
//!        gpu:  evict LRU idle LoRA adapters (not w's) until need pages are free, else stop
//!        (nothing is dropped or evicted unless w is then admitted)   # FCFS
//!        ops: DropHost.., ToHost(w.adapter), DropGpu.., ToGpu(w.adapter, pages or a slot)
//!        admit w (sent in `new` with all its tokens), w.adapter pinned, budget -= n
//!    if the loop stopped because a w could not be admitted: skip-the-line (see Deltas) for the
//!        requests of selected deltas behind it, in queue order
//! 3. prefetch: for each distinct adapter of the first prefetch_window waiting requests, in
//!        queue order, with no host copy and not on the GPU: ToHost if it fits the host budget
//!        after dropping LRU host copies neither this step nor the window needs; the first that
//!        does not fit ends prefetching for this step
//! 4. released = everything finished / aborted / preempted since the last step
//!    adapter_ops = pending drops ++ this step's drops ++ this step's loads
//!    new, running: stably sorted by adapter id (phase 1 still went oldest first)
//! ```
//!
//! The watermark is the number of running requests whose next token will need a page they do
//! not hold yet (their table is full after this step). Admission keeps that many pages free, so
//! a new request never takes the page an older one needs for its next decode token. It is exact
//! rather than a fixed fraction of the pool, so a request that needs the whole pool can still be
//! admitted into an idle one, and add_request's "fits in the pool" check (KV plus adapter
//! pages) guarantees progress: the oldest running request alone always fits, since every other
//! adapter is evictable once the others are preempted, and with nothing running the head of the
//! queue always fits (every adapter is idle, every host copy droppable, and registration
//! refused adapters larger than the pool or the host budget).
//!
//! Head-of-line blocking is kept with LoRA adapters: a request whose adapter is cold waits at
//! the front even when requests behind it have theirs on the GPU. This keeps admission FCFS and
//! starvation-free; prefetch hides most of the cold start by loading the host copy while the
//! request is still queued. With host copy reports, the one request passed over is one whose
//! read is under way: ready requests behind it go first only until its read is reported, and
//! then it is ahead of them again; with nothing running it is admitted at once (the worker
//! waits for the read), so a report that never comes delays it but cannot strand it. Deltas relax it only through skip-the-line, whose parent-based
//! preemption keeps it starvation-free.
//!
//! A step that schedules nothing is empty (`is_empty()`, `step_id` 0) and drains nothing;
//! pending releases and adapter ops go out with the next non-empty step.
//!
//! # Update
//!
//! `update` advances `num_computed` by the scheduled chunk for each reported request, appends
//! the sampled token when the chunk reached the end, and finishes the request on an EOS id
//! (unless `ignore_eos`; checked first) or at `max_tokens`, freeing its pages at once (its
//! adapter stays cached).

pub mod adapters;
pub mod block;
pub mod config;
pub mod error;
pub mod scheduler;
pub mod step;

mod admission;
mod inflight;
mod invariants;
mod queues;
mod request;
mod skip_line;

pub use adapters::{AdapterOp, AdapterOpKind, AdapterResidency, AdapterSpec, VariantKind};
pub use block::{BlockAllocator, PageOwner};
pub use config::{
    SchedulerConfig, DEFAULT_HOST_ADAPTER_BYTES, DEFAULT_MAX_DELTAS,
    DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS, DEFAULT_PREFETCH_WINDOW,
    MAX_PREFETCH_WINDOW,
};
pub use error::SchedError;
pub use scheduler::Scheduler;
pub use step::{
    FinishReason, SchedStats, ScheduledNew, ScheduledRunning, ScheduledStep, SeqRequest, SeqUpdate,
};
