//! [`SchedulerConfig`]: the scheduler's one typed config object (pool geometry, per-step
//! limits, adapter host tier, delta slots), with its defaults and validation.

use crate::error::SchedError;

/// Default for [`SchedulerConfig::max_num_seqs`].
pub const DEFAULT_MAX_NUM_SEQS: usize = 256;
/// Default for [`SchedulerConfig::max_num_batched_tokens`].
pub const DEFAULT_MAX_NUM_BATCHED_TOKENS: usize = 2048;
/// Default for [`SchedulerConfig::host_adapter_bytes`]: 4 GiB.
pub const DEFAULT_HOST_ADAPTER_BYTES: u64 = 4 << 30;
/// Default for [`SchedulerConfig::prefetch_window`].
pub const DEFAULT_PREFETCH_WINDOW: usize = 64;
/// Default for [`SchedulerConfig::max_deltas`]: DeltaZip's profiled number of deltas worth
/// batching at once.
pub const DEFAULT_MAX_DELTAS: usize = 3;
/// Largest accepted [`SchedulerConfig::prefetch_window`]: every step walks that many waiting
/// requests, so the window bounds the per-step cost of prefetching.
pub const MAX_PREFETCH_WINDOW: usize = 4096;

/// Limits the scheduler works within. The pool geometry comes from the worker's handshake
/// (`KvCapacity`), the per-step limits from the operator.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Tokens per KV page: page `i` of a request's block table holds its tokens
    /// `[i * block_size, (i + 1) * block_size)`.
    pub block_size: u32,
    /// Pages in the worker's KV pool; page ids are `0..num_blocks`.
    pub num_blocks: u32,
    /// Most requests that may be running (resident on the worker) at once; bounds the batch.
    pub max_num_seqs: usize,
    /// Token budget of one step: prefill chunks plus decode tokens, summed over the batch.
    pub max_num_batched_tokens: usize,
    /// Longest sequence (prompt + output) a request may reach; longer requests are refused.
    pub max_model_len: u32,
    /// Budget of the host tier: bytes of adapter host copies the worker may hold at once, LoRA
    /// adapters and deltas together (one budget for both kinds). The scheduler drops least
    /// recently used host copies to stay within it.
    pub host_adapter_bytes: u64,
    /// Waiting requests (in queue order) whose adapters are loaded into host memory ahead of
    /// their admission, so the disk read overlaps earlier steps; 0 turns prefetch off.
    pub prefetch_window: usize,
    /// Deltas (compressed full fine-tunes) that may be GPU-resident at once: the worker's delta
    /// slots (its `--max-deltas`). 0 turns delta serving off (deltas cannot be registered).
    pub max_deltas: usize,
    /// The worker reports when a `ToHost` has finished loading
    /// ([`crate::Scheduler::host_copies_ready`]). Then, in a step that computes running requests
    /// anyway, a waiting request whose adapter's host copy is still loading is not admitted (its
    /// `ToGpu` would make the whole step wait for the read): it keeps its place, and ready
    /// requests behind it in the prefetch window go first. Off: a host copy counts as ready once
    /// its `ToHost` is sent (the worker's `ToGpu` waits for the read).
    pub host_copy_reports: bool,
    /// The worker copies a delta's `ToGpu` beside the steps (on a side stream) and reports each
    /// finished copy ([`crate::Scheduler::gpu_copies_ready`]). Then, in a step that computes
    /// running requests anyway, a waiting request whose delta is not GPU-resident is not
    /// admitted with its `ToGpu` (the whole step would wait for the copy): the delta is loaded
    /// ahead (a slot taken, its `ToGpu` sent) and the request keeps its place until the copy is
    /// reported, while ready requests behind it in the prefetch window go first. Meant to go
    /// with `host_copy_reports` (as the router runs it), so that a delta is loaded ahead only once
    /// its host copy is read. Off: a delta's `ToGpu` goes out in the step that admits its
    /// request, which waits for the copy.
    pub gpu_load_reports: bool,
    /// Most tokens a step with compressed-delta rows may have and still replay from one of the
    /// worker's CUDA graphs (its Hello's `delta_graph_tokens`); 0: no such limit. A step with
    /// delta rows (or about to get one) then takes prompt chunks only up to it, so that it replays
    /// instead of launching its ~1,000 kernels one by one: the prompt's rest goes in the next
    /// step. Decode tokens are never held back by it, and when the step's decodes alone exceed it
    /// (the step runs eagerly whatever its prompts) prompts are not held back either.
    pub delta_graph_tokens: usize,
    /// Reuse the KV pages of a prompt prefix across requests of the same variant registration
    /// (`prefix.rs`): full pages are published as they are computed and kept, while no request
    /// holds them, until their pages are needed. Off: every request computes its whole prompt.
    pub enable_prefix_caching: bool,
}

impl SchedulerConfig {
    /// A config with the pool geometry and context limit given, and default per-step limits
    /// ([`DEFAULT_MAX_NUM_SEQS`], [`DEFAULT_MAX_NUM_BATCHED_TOKENS`]) and host tier
    /// ([`DEFAULT_HOST_ADAPTER_BYTES`], [`DEFAULT_PREFETCH_WINDOW`]) and delta slots
    /// ([`DEFAULT_MAX_DELTAS`]), without host copy reports, GPU load reports, a delta graph limit
    /// or prefix caching.
    pub fn new(block_size: u32, num_blocks: u32, max_model_len: u32) -> Self {
        Self {
            block_size,
            num_blocks,
            max_num_seqs: DEFAULT_MAX_NUM_SEQS,
            max_num_batched_tokens: DEFAULT_MAX_NUM_BATCHED_TOKENS,
            max_model_len,
            host_adapter_bytes: DEFAULT_HOST_ADAPTER_BYTES,
            prefetch_window: DEFAULT_PREFETCH_WINDOW,
            max_deltas: DEFAULT_MAX_DELTAS,
            host_copy_reports: false,
            gpu_load_reports: false,
            delta_graph_tokens: 0,
            enable_prefix_caching: false,
        }
    }

    /// Checks that every limit is usable: all of them non-zero (except `prefetch_window` and
    /// `max_deltas`, where 0 means off), token counts small enough for the `u32` fields of the wire plan, and the
    /// prefetch window at most [`MAX_PREFETCH_WINDOW`].
    pub fn validate(&self) -> Result<(), SchedError> {
        let bad = |field: &'static str, value: u64, why: &str| SchedError::InvalidConfig {
            field,
            value,
            reason: why.to_string(),
        };
        if self.block_size == 0 {
            return Err(bad("block_size", 0, "must be at least 1 token per page"));
        }
        if self.num_blocks == 0 {
            return Err(bad(
                "num_blocks",
                0,
                "the KV pool must hold at least one page",
            ));
        }
        if self.max_num_seqs == 0 {
            return Err(bad(
                "max_num_seqs",
                0,
                "must allow at least one running request",
            ));
        }
        if self.max_num_batched_tokens == 0 {
            return Err(bad(
                "max_num_batched_tokens",
                0,
                "each step needs a token budget of at least 1",
            ));
        }
        if self.max_num_batched_tokens > u32::MAX as usize {
            return Err(bad(
                "max_num_batched_tokens",
                self.max_num_batched_tokens as u64,
                "must fit in u32 (the wire's token counts)",
            ));
        }
        if self.max_model_len == 0 {
            return Err(bad("max_model_len", 0, "must allow at least one token"));
        }
        if self.host_adapter_bytes == 0 {
            return Err(bad(
                "host_adapter_bytes",
                0,
                "adapters reach the GPU through host memory: the budget must be at least 1 byte",
            ));
        }
        if self.prefetch_window > MAX_PREFETCH_WINDOW {
            return Err(bad(
                "prefetch_window",
                self.prefetch_window as u64,
                &format!("must be at most {MAX_PREFETCH_WINDOW} waiting requests (0 = off)"),
            ));
        }
        Ok(())
    }

    /// Pages needed to hold `tokens` tokens: `ceil(tokens / block_size)`.
    pub fn blocks_for(&self, tokens: u64) -> u64 {
        tokens.div_ceil(self.block_size as u64)
    }
}

/// The context-length rule, the one copy of it: a request's prompt plus its output budget must
/// fit the model's context, so a prompt of `prompt_tokens` leaves room for this many output tokens
/// (0: none). The scheduler refuses a request beyond it (`SchedError::TooLong`); the server's
/// request validation resolves and checks `max_tokens` with it before anything is queued; the
/// worker's plan check repeats the bound as a guard against a bad plan (`plan_check.py`).
pub fn context_room(prompt_tokens: u64, max_model_len: u32) -> u32 {
    (max_model_len as u64).saturating_sub(prompt_tokens) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_fields_are_rejected_by_name() {
        let ok = SchedulerConfig::new(16, 64, 512);
        assert!(ok.validate().is_ok());
        type Breaker = fn(&mut SchedulerConfig);
        let cases: [(&str, Breaker); 7] = [
            ("block_size", |c| c.block_size = 0),
            ("num_blocks", |c| c.num_blocks = 0),
            ("max_num_seqs", |c| c.max_num_seqs = 0),
            ("max_num_batched_tokens", |c| c.max_num_batched_tokens = 0),
            ("max_model_len", |c| c.max_model_len = 0),
            ("host_adapter_bytes", |c| c.host_adapter_bytes = 0),
            ("prefetch_window", |c| {
                c.prefetch_window = MAX_PREFETCH_WINDOW + 1
            }),
        ];
        for (name, breaker) in cases {
            let mut c = ok.clone();
            breaker(&mut c);
            let err = c.validate().unwrap_err();
            assert!(err.to_string().contains(name), "{name}: {err}");
            assert_eq!(err.error_type(), "invalid_config");
        }
    }

    #[test]
    fn defaults_and_zero_prefetch_window_and_max_deltas_are_valid() {
        let c = SchedulerConfig::new(16, 64, 512);
        assert_eq!(c.host_adapter_bytes, 4 * 1024 * 1024 * 1024);
        assert_eq!(c.prefetch_window, 64);
        assert_eq!(c.max_deltas, 3);
        assert!(!c.host_copy_reports && !c.gpu_load_reports);
        let off = SchedulerConfig {
            prefetch_window: 0,
            max_deltas: 0,
            ..c
        };
        assert!(off.validate().is_ok());
    }

    #[test]
    fn context_room_is_what_the_prompt_leaves() {
        assert_eq!(context_room(3, 8), 5);
        assert_eq!(context_room(8, 8), 0);
        assert_eq!(context_room(u64::MAX, 8), 0);
    }

    #[test]
    fn blocks_for_rounds_up() {
        let c = SchedulerConfig::new(16, 64, 512);
        assert_eq!(c.blocks_for(0), 0);
        assert_eq!(c.blocks_for(1), 1);
        assert_eq!(c.blocks_for(16), 1);
        assert_eq!(c.blocks_for(17), 2);
    }
}
