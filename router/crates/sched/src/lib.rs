//! The pure scheduler: iteration-level continuous batching of prefill and decode over a paged
//! KV cache whose accounting the router owns. No IO, no clock, no async: time comes in as
//! numbers, the same calls give the same plans, and everything is unit-testable (and drivable
//! from a Python simulator through the `py` crate).
//!
//! # Layout
//!
//! - [`config`]: [`SchedulerConfig`], pool geometry and per-step limits, validated.
//! - [`error`]: [`SchedError`], why a config or request was refused.
//! - [`block`]: [`BlockAllocator`], the KV page free list with one owner per page.
//! - [`step`]: the API's data: [`SeqRequest`] in, [`ScheduledStep`] out, [`SeqUpdate`] back.
//! - [`scheduler`]: [`Scheduler`], queues + block tables + the step algorithm.
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
//! `released` ids must be dropped by the worker before it runs the step.
//!
//! # One step (`schedule`)
//!
//! ```text
//! budget = max_num_batched_tokens
//! 1. for r in running (arrival order):
//!        n = min(len(r.tokens) - r.num_computed, budget)      # 1 in decode, a chunk in prefill
//!        while pages for r.num_computed + n are not free:
//!            preempt the most recently arrived running request v   # free pages, computed = 0,
//!            (v -> front of waiting, v -> released/preempted)      # recompute prompt ++ outputs
//!            if v is r: stop phase 1
//!        allocate, schedule r for n tokens, budget -= n
//! 2. if nothing was preempted: while waiting is non-empty, running < max_num_seqs, budget > 0:
//!        w = waiting.front(); n = min(len(w.tokens), budget)  # chunked prefill
//!        stop unless free pages >= pages(n) + watermark      # FCFS, no skipping ahead
//!        admit w (sent in `new` with all its tokens), budget -= n
//! 3. released = everything finished / aborted / preempted since the last step
//! ```
//!
//! The watermark is the number of running requests whose next token will need a page they do
//! not hold yet (their table is full after this step). Admission keeps that many pages free, so
//! a new request never takes the page an older one needs for its next decode token. It is exact
//! rather than a fixed fraction of the pool, so a request that needs the whole pool can still be
//! admitted into an idle one, and add_request's "fits in the pool" check guarantees progress:
//! the oldest running request alone always fits.
//!
//! A step that schedules nothing is empty (`is_empty()`, `step_id` 0) and drains nothing;
//! pending releases go out with the next non-empty step.
//!
//! # Update
//!
//! `update` advances `num_computed` by the scheduled chunk for each reported request, appends
//! the sampled token when the chunk reached the end, and finishes the request on an EOS id
//! (unless `ignore_eos`; checked first) or at `max_tokens`, freeing its pages at once.

pub mod block;
pub mod config;
pub mod error;
pub mod scheduler;
pub mod step;

pub use block::BlockAllocator;
pub use config::{SchedulerConfig, DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS};
pub use error::SchedError;
pub use scheduler::Scheduler;
pub use step::{
    FinishReason, SchedStats, ScheduledNew, ScheduledRunning, ScheduledStep, SeqRequest, SeqUpdate,
};
