//! One live request as the scheduler tracks it ([`Seq`]), its place in the queues
//! ([`OrderKey`]) and which queue it is in ([`Phase`]), plus the checks a request passes before
//! it is queued ([`Scheduler::check_request`]).
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
//! Admitted with a prefix-cache hit, a request starts with `num_computed` at the end of its hit
//! pages (shared, held by reference); it publishes each page it fills (`prefix.rs`).
//!
//! A running request of a delta is also in one skip state (`Seq::skip`, drawn in
//! `skip_line.rs`); a waiting one is always `Skip::No`.

use crate::config::context_room;
use crate::error::SchedError;
use crate::prefix::PrefixKey;
use crate::scheduler::Scheduler;
use crate::skip_line::Skip;
use crate::step::SeqRequest;

/// Position of a request in every queue: earlier arrival first, ties by `add_request` order.
/// Unique per request, so queues sorted by it have one well-defined order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct OrderKey {
    /// The caller's arrival stamp.
    pub(crate) arrival: u64,
    /// Counter of `add_request` calls, to break ties deterministically.
    pub(crate) seq_no: u64,
}

/// Where a live request is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// In `waiting`: owns no pages, not on the worker.
    Waiting,
    /// In `running`: on the worker, owns the pages of its block table.
    Running,
}

/// Everything the scheduler tracks about one live request.
#[derive(Debug, Clone)]
pub(crate) struct Seq {
    /// Its place in the queues.
    pub(crate) key: OrderKey,
    /// `prompt ++ outputs`: what a resumed request recomputes, and what `new` entries carry.
    pub(crate) tokens: Vec<u32>,
    /// Length of the prompt at the front of `tokens`.
    pub(crate) num_prompt_tokens: u32,
    /// Output limit (finish with `Length`).
    pub(crate) max_tokens: u32,
    /// Ids that finish the request with `Eos`.
    pub(crate) eos_token_ids: Vec<u32>,
    /// Ignore `eos_token_ids` (always run to `max_tokens`).
    pub(crate) ignore_eos: bool,
    /// Leading tokens whose KV the worker has computed (confirmed by an `update`).
    pub(crate) num_computed: u32,
    /// Token positions the block table covers: the furthest any scheduled chunk reached since
    /// the request was (re)admitted. Pages owned == ceil(num_cached / block_size).
    pub(crate) num_cached: u32,
    /// Page ids, in order: page i holds tokens `[i * block_size, (i + 1) * block_size)`.
    pub(crate) blocks: Vec<u32>,
    /// Which queue it is in.
    pub(crate) phase: Phase,
    /// Tokens scheduled in the outstanding steps (0 when in none); each `update` applies its
    /// step's share.
    pub(crate) in_flight: u32,
    /// Output tokens the outstanding steps will sample and no `update` has delivered yet: a
    /// step scheduled ahead (`schedule_ahead`) computes them before they are known.
    pub(crate) pending: u32,
    /// Its variant, a LoRA adapter or a delta (0 = base): GPU-resident whenever the request is
    /// running.
    pub(crate) adapter_id: u32,
    /// Whether it skipped the line, and on whom it rides (always `No` while waiting).
    pub(crate) skip: Skip,
    /// The prefix cache's key of its variant registration; `None` with prefix caching off.
    pub(crate) cache_key: Option<PrefixKey>,
    /// Compute the whole prompt even where a cached prefix matches (it wants every prompt
    /// position's logits); its pages are still published for others.
    pub(crate) skip_prefix_cache: bool,
    /// Chain hashes of its first full pages of `tokens`, computed as far as needed so far
    /// (`prefix.rs`); tokens only grow, so they stay valid.
    pub(crate) page_hashes: Vec<u64>,
    /// Leading pages of its block table offered to the prefix cache (its hits, then the pages
    /// it published or found published by another); its pages past them are its own. 0 while
    /// waiting.
    pub(crate) num_published: u32,
    /// While running: its pages `[num_published, pending_to)` are counted in the scheduler's
    /// pending pages (full pages of its known tokens it has still to compute). 0 while waiting.
    pub(crate) pending_to: u32,
}

impl Seq {
    /// A request just queued at `key`: nothing computed, no pages, not a skipper; `cache_key`
    /// its variant's prefix-cache key (`None`: prefix caching off).
    pub(crate) fn waiting(key: OrderKey, req: SeqRequest, cache_key: Option<PrefixKey>) -> Self {
        let num_prompt_tokens = req.prompt.len() as u32;
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
            cache_key,
            skip_prefix_cache: req.skip_prefix_cache,
            page_hashes: Vec::new(),
            num_published: 0,
            pending_to: 0,
        }
    }

    /// Output tokens generated so far.
    pub(crate) fn num_outputs(&self) -> u32 {
        self.tokens.len() as u32 - self.num_prompt_tokens
    }

    /// Where the next chunk starts: computed, or scheduled in an outstanding step.
    pub(crate) fn scheduled_to(&self) -> u32 {
        self.num_computed + self.in_flight
    }

    /// Tokens a next chunk could compute: the known ones plus those the outstanding steps
    /// sample, past `scheduled_to`; 0 when the outstanding steps' tokens reach `max_tokens`.
    pub(crate) fn to_schedule(&self) -> u32 {
        if self.num_outputs() + self.pending >= self.max_tokens {
            return 0;
        }
        self.tokens.len() as u32 + self.pending - self.scheduled_to()
    }
}

impl Scheduler {
    /// Why `req` may not be queued, if it may not (see [`Scheduler::add_request`]), in this
    /// order: a live id, an empty prompt, `max_tokens == 0`, too long for `max_model_len`, an
    /// unregistered adapter, a cache plus adapter pages larger than the pool.
    pub(crate) fn check_request(&self, req: &SeqRequest) -> Result<(), SchedError> {
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
        if req.max_tokens > context_room(prompt_tokens, self.cfg.max_model_len) {
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
        Ok(())
    }
}
