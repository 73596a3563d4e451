//! [`SchedError`]: the one error type of the scheduler boundary (bad config, refused requests,
//! refused adapter registrations).

/// Why the scheduler refused a config or a request. Messages name the request and the numbers
/// involved; [`SchedError::error_type`] is a stable label for metrics and HTTP status mapping.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SchedError {
    /// A [`crate::SchedulerConfig`] field is out of range.
    #[error("invalid scheduler config: {field} = {value}: {reason}")]
    InvalidConfig {
        /// The offending field's name.
        field: &'static str,
        /// Its value.
        value: u64,
        /// What a valid value looks like.
        reason: String,
    },
    /// A request with this id is already waiting or running.
    #[error("request {id}: a request with this id is already waiting or running")]
    DuplicateId {
        /// The duplicated id.
        id: u64,
    },
    /// The prompt has no tokens, so there is nothing to condition generation on.
    #[error("request {id}: the prompt is empty (at least 1 token is needed)")]
    EmptyPrompt {
        /// The request's id.
        id: u64,
    },
    /// `max_tokens == 0` asks for no output at all.
    #[error("request {id}: max_tokens is 0 (at least 1 output token must be allowed)")]
    ZeroMaxTokens {
        /// The request's id.
        id: u64,
    },
    /// Prompt plus requested output exceeds the model's context.
    #[error(
        "request {id}: prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total} \
         exceeds max_model_len ({max_model_len})"
    )]
    TooLong {
        /// The request's id.
        id: u64,
        /// Prompt length in tokens.
        prompt_tokens: u64,
        /// Requested output tokens.
        max_tokens: u32,
        /// Their sum.
        total: u64,
        /// The context limit.
        max_model_len: u32,
    },
    /// Even alone, the request's KV cache (plus its adapter's pages) would not fit in the pool.
    #[error(
        "request {id}: needs up to {needed_blocks} KV pages of {block_size} tokens \
         ({max_cached_tokens} tokens) + {adapter_blocks} pages for its adapter \
         but the pool has only {num_blocks}"
    )]
    TooBigForPool {
        /// The request's id.
        id: u64,
        /// Most tokens it can ever hold in the cache (`prompt + max_tokens - 1`).
        max_cached_tokens: u64,
        /// Pages that takes.
        needed_blocks: u64,
        /// Pages its LoRA adapter occupies while the request runs (0 for the base model and
        /// for a delta, which takes a delta slot instead).
        adapter_blocks: u32,
        /// Tokens per page.
        block_size: u32,
        /// Pages in the pool.
        num_blocks: u32,
    },
    /// A request names an adapter id that is not registered, or `unregister_adapter` was asked
    /// for one.
    #[error("{}adapter {adapter_id} is not registered", request_prefix(*request))]
    UnknownAdapter {
        /// The request naming it (`None` for `unregister_adapter`).
        request: Option<u64>,
        /// The unknown adapter id.
        adapter_id: u32,
    },
    /// Adapter id 0 means "the base model" in requests, so no adapter can be registered as 0.
    #[error("adapter id 0 is reserved for the base model (register adapters as 1, 2, ...)")]
    ReservedAdapterId,
    /// `register_adapter` with an id that is already registered.
    #[error("adapter {adapter_id}: an adapter with this id is already registered")]
    DuplicateAdapter {
        /// The duplicated id.
        adapter_id: u32,
    },
    /// The adapter's spec is unusable (a LoRA adapter without pages, a delta with pages, no
    /// path).
    #[error("adapter {adapter_id}: {reason}")]
    InvalidAdapter {
        /// The adapter's id.
        adapter_id: u32,
        /// What is wrong with its spec.
        reason: String,
    },
    /// The adapter's weights need more pages than the whole pool has.
    #[error(
        "adapter {adapter_id}: needs {num_blocks} pages but the pool has only {pool_blocks} \
         (lower its rank or enlarge the pool)"
    )]
    AdapterTooBig {
        /// The adapter's id.
        adapter_id: u32,
        /// Pages its weights take.
        num_blocks: u32,
        /// Pages in the pool.
        pool_blocks: u32,
    },
    /// The adapter's host copy is larger than the whole host-tier budget.
    #[error(
        "adapter {adapter_id}: its host copy takes {host_bytes} bytes but the host adapter \
         budget is {host_budget} bytes (raise host_adapter_bytes)"
    )]
    AdapterTooBigForHost {
        /// The adapter's id.
        adapter_id: u32,
        /// Bytes its host copy takes.
        host_bytes: u64,
        /// `SchedulerConfig::host_adapter_bytes`.
        host_budget: u64,
    },
    /// A delta was registered while delta serving is off (`max_deltas` is 0).
    #[error(
        "adapter {adapter_id}: is a compressed delta but delta serving is off \
         (max_deltas is 0: the worker has no delta slots)"
    )]
    DeltasDisabled {
        /// The delta's id.
        adapter_id: u32,
    },
    /// `unregister_adapter` while live (waiting or running) requests still name the adapter.
    #[error(
        "adapter {adapter_id}: {users} live request(s) still use it; \
         unregister it once they end"
    )]
    AdapterInUse {
        /// The adapter's id.
        adapter_id: u32,
        /// Waiting + running requests naming it.
        users: usize,
    },
}

/// `"request N: "` when an error concerns a request, nothing otherwise.
fn request_prefix(request: Option<u64>) -> String {
    request.map_or_else(String::new, |id| format!("request {id}: "))
}

impl SchedError {
    /// Stable label for metrics and for the HTTP layer's status mapping.
    pub fn error_type(&self) -> &'static str {
        match self {
            SchedError::InvalidConfig { .. } => "invalid_config",
            SchedError::DuplicateId { .. } => "duplicate_id",
            SchedError::EmptyPrompt { .. } => "empty_prompt",
            SchedError::ZeroMaxTokens { .. } => "zero_max_tokens",
            SchedError::TooLong { .. } => "context_length_exceeded",
            SchedError::TooBigForPool { .. } => "kv_pool_too_small",
            SchedError::UnknownAdapter { .. } => "unknown_adapter",
            SchedError::ReservedAdapterId | SchedError::InvalidAdapter { .. } => "invalid_adapter",
            SchedError::DuplicateAdapter { .. } => "duplicate_adapter",
            SchedError::AdapterTooBig { .. } | SchedError::AdapterTooBigForHost { .. } => {
                "adapter_too_big"
            }
            SchedError::AdapterInUse { .. } => "adapter_in_use",
            SchedError::DeltasDisabled { .. } => "deltas_disabled",
        }
    }
}
