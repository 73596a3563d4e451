//! The pure scheduler: iteration-level continuous batching of prefill and decode over one
//! paged GPU pool that holds both the KV cache and LoRA adapter weights (S-LoRA unified
//! paging), whose accounting the router owns, plus the variants' tiers (disk -> host memory ->
//! GPU pages for LoRA adapters, GPU delta slots for compressed full fine-tunes, DeltaZip). No
//! IO, no clock, no async: time comes in as numbers, the same calls give the same plans, and
//! everything is unit-testable (and drivable from a Python simulator through the `py` crate).
//!
//! # Layout
//!
//! The API:
//!
//! - [`config`]: [`SchedulerConfig`], pool geometry, per-step limits, host tier and delta
//!   slots, validated.
//! - [`error`]: [`SchedError`], why a config, request or adapter was refused.
//! - [`step`]: the API's data: [`SeqRequest`] in, [`ScheduledStep`] out, [`SeqUpdate`] back.
//! - [`scheduler`]: [`Scheduler`], the one state and the public calls; its `form_step` lists
//!   the phases of a step, one call each.
//!
//! The parts (each opens with what it owns; the step's phases carry their pseudo-code):
//!
//! - [`block`]: [`BlockAllocator`], the page free list with one owner ([`PageOwner`]: a
//!   request's KV, an adapter's weights, or the prefix cache) per page, and the prefix cache's
//!   pages (hash index, references, LRU of the pages no request holds).
//! - [`adapters`]: [`VariantSpec`] (with its [`VariantKind`]) in, [`VariantOp`]s out, and the
//!   adapter table (tiers, pages or delta slots, users, LRU stamps); its docs draw the tier
//!   state machine.
//! - `request`: one request's state and life cycle; `queues`: the waiting and running queues,
//!   preemption, and phase 1 (running requests); `admission`: phases 2 and 3 (FCFS admission
//!   with room on the host and the GPU, the watermark, prefetch); `skip_line`: DeltaZip's
//!   skip-the-line and parent-based preemption; `prefix`: prefix caching per variant
//!   registration (lookups, publishing computed pages, `n` choices sharing one prefill);
//!   `inflight`: outstanding steps,
//!   [`Scheduler::schedule_ahead`] and [`Scheduler::update`]; `invariants`:
//!   [`Scheduler::check_invariants`].
//!
//! # Worker-side contract
//!
//! A request's tokens are `prompt ++ outputs`. A step computes tokens
//! `[num_computed, num_computed + num_scheduled)`; when that reaches the end of the known tokens
//! the worker samples one token, which the following [`Scheduler::update`] appends. So a decoding
//! request is scheduled 1 token per step (the one sampled last step). Page `i` of a block table
//! holds tokens `[i * block_size, (i + 1) * block_size)`; a request always owns exactly
//! `ceil(cached / block_size)` pages, where `cached` is how far its scheduled chunks reached.
//! With prefix caching, a `new` entry's `num_computed_tokens` may be a whole number of pages
//! whose KV is already in the first pages of its table (shared with other requests, never
//! written again); the worker computes from there.
//! `new` entries carry the whole block table, `running` entries only appended pages, and
//! `released` ids must be dropped by the worker before it runs the step. Then the worker applies
//! `adapter_ops` in order (all drops, then all loads), and only then runs the requests: every
//! scheduled request's adapter is GPU-resident by then. `new` and `running` are each grouped by
//! adapter id (ascending; arrival order within an adapter), so each adapter is one contiguous
//! segment.
//!
//! The adapter ops are the tier moves drawn in [`adapters`]: `ToHost{path}` (read into host
//! memory, possibly in the background), `ToGpu{pages}` (copy the host copy into pool pages, or
//! into a delta slot with no pages; always after a `ToHost` with no `DropHost` since),
//! `DropGpu`, `DropHost`. With `host_copy_reports` the worker reports finished host reads
//! ([`Scheduler::host_copies_ready`], sent with step outputs). With `gpu_load_reports` it copies a
//! delta's `ToGpu` beside the steps (a step waits for the copy only when it runs a request of that
//! delta) and reports finished copies ([`Scheduler::gpu_copies_ready`]); the scheduler sends such a
//! `ToGpu` ahead of the request's admission while other requests run. A `DropGpu` (or `DropHost`)
//! of a delta whose copy is still under way is the worker's to order after the copy. With one
//! step outstanding, [`Scheduler::schedule_ahead`] may form the next one before the first's
//! `update`; the worker feeds a request the token it sampled in the step before.

pub mod block;
pub mod config;
pub mod error;
pub mod scheduler;
pub mod step;
pub mod variants;
#[cfg(feature = "wire")]
pub mod wire;

mod admission;
mod inflight;
mod invariants;
mod prefix;
mod queues;
mod request;
mod skip_line;

pub use block::{BlockAllocator, PageOwner};
pub use config::{
    context_room, SchedulerConfig, DEFAULT_HOST_ADAPTER_BYTES, DEFAULT_MAX_DELTAS,
    DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS, DEFAULT_PREFETCH_WINDOW,
    MAX_PREFETCH_WINDOW,
};
pub use error::SchedError;
pub use scheduler::Scheduler;
pub use step::{
    FinishReason, SchedStats, ScheduledNew, ScheduledRunning, ScheduledStep, SeqRequest, SeqUpdate,
};
pub use variants::{VariantKind, VariantOp, VariantOpKind, VariantResidency, VariantSpec};
