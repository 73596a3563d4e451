//! [`SchedError`]: the one error type of the scheduler boundary (bad config, refused requests).

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
    /// Even alone, the request's KV cache would not fit in the page pool.
    #[error(
        "request {id}: needs up to {needed_blocks} KV pages of {block_size} tokens \
         ({max_cached_tokens} tokens) but the pool has only {num_blocks}"
    )]
    TooBigForPool {
        /// The request's id.
        id: u64,
        /// Most tokens it can ever hold in the cache (`prompt + max_tokens - 1`).
        max_cached_tokens: u64,
        /// Pages that takes.
        needed_blocks: u64,
        /// Tokens per page.
        block_size: u32,
        /// Pages in the pool.
        num_blocks: u32,
    },
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
        }
    }
}
