//! The wire schema between the router and its Python workers: the one owner of every type that
//! crosses a process boundary.
//!
//! # Framing
//!
//! Every message is one msgpack value: a 2-array `[kind, body]`, where `kind` is a positive fixint
//! (the message's [`WireStruct::KIND`]) and `body` is the struct encoded as a msgpack *array* of its
//! fields in declaration order (rmp-serde's compact form). So every frame starts with the bytes
//! `0x92 <kind>`, and the body is the rest:
//!
//! ```text
//!  0x92 | kind (1 byte) | body: [field0, field1, ...]   (nested structs are nested arrays)
//! ```
//!
//! # Evolution
//!
//! Append-only: a new field goes last and has a default, so a frame from an older peer still
//! decodes (every struct is `#[serde(default)]`). Renaming, reordering or retyping a field changes
//! [`schema_hash`](crate::schema::schema_hash), and the worker handshake refuses a peer whose hash differs.
//!
//! # The Python mirror
//!
//! `pyworker/deltaserve/wire.py` is generated from [`SCHEMA`] by `ipc-schema gen-py` (see
//! `src/bin/ipc-schema.rs`); a test fails when the checked-in file is stale. Golden frames written
//! by this crate's tests are decoded and re-encoded byte-identically by `tests/test_wire_golden.py`.
//!
//! Only unsigned integers, `f64`, `bool`, `String`, `Vec`, `Option`, wire enums and other wire
//! structs appear here, so both encoders produce the same bytes (smallest int form, float64,
//! str8/16/32).
//!
//! # Enums
//!
//! A wire enum ([`VariantKind`], [`TierOp`]) is one small unsigned integer on the wire (a positive
//! fixint), defined with its lower-case label (`lora`, `to_gpu`: what logs, errors and the HTTP
//! API show). Both are generated into the Python mirror (an `IntEnum` per enum, members named by
//! the upper-cased label), so neither side spells a value or a label by hand. Evolution: a new
//! variant gets a new value; values and labels never change meaning. A value the decoder does not
//! know is a decode error (the schema hash has already refused a peer with other enums).

use serde::de::Error as _;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Defines the wire enums and, from the same token trees, the [`ENUMS`] table the schema hash and
/// the Python generator read (as [`wire_structs!`] does for structs). The first variant has value
/// 0 and is the default (a field's value when a frame leaves it out).
macro_rules! wire_enums {
    ($(
        $(#[doc = $doc:literal])*
        enum $name:ident {
            $( $(#[doc = $vdoc:literal])* $variant:ident = $value:literal $label:literal ),+ $(,)?
        }
    )*) => {
        $(
            $(#[doc = $doc])*
            #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
            #[repr(u8)]
            pub enum $name {
                $( $(#[doc = $vdoc])* $variant = $value, )+
            }

            impl $name {
                /// Every variant, in declaration order.
                pub const ALL: &'static [$name] = &[$($name::$variant),+];

                /// The lower-case label logs, errors and the HTTP API show.
                pub fn label(self) -> &'static str {
                    match self {
                        $($name::$variant => $label,)+
                    }
                }

                /// The variant `label` names; `None` for anything else.
                pub fn from_label(label: &str) -> Option<Self> {
                    match label {
                        $($label => Some($name::$variant),)+
                        _ => None,
                    }
                }

                /// The variant the wire value `value` encodes; `None` for a value no variant has.
                pub fn from_u8(value: u8) -> Option<Self> {
                    match value {
                        $($value => Some($name::$variant),)+
                        _ => None,
                    }
                }
            }

            impl Default for $name {
                fn default() -> Self {
                    Self::ALL[0]
                }
            }

            impl std::fmt::Display for $name {
                fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                    f.write_str(self.label())
                }
            }

            impl Serialize for $name {
                fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                    s.serialize_u8(*self as u8)
                }
            }

            impl<'de> Deserialize<'de> for $name {
                fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                    let value = u8::deserialize(d)?;
                    Self::from_u8(value).ok_or_else(|| {
                        D::Error::custom(format!(
                            concat!("unknown ", stringify!($name), " {} (expected one of {})"),
                            value,
                            [$(concat!($label, "=", $value)),+].join(", ")
                        ))
                    })
                }
            }
        )*

        /// Every wire enum in declaration order: `(name, [(variant, value, label)])`.
        pub const ENUMS: &[(&str, &[(&str, u8, &str)])] = &[
            $( (stringify!($name), &[ $( (stringify!($variant), $value, $label) ),+ ]), )*
        ];

        /// The `///` docs of every wire enum, parallel to [`ENUMS`]: `(name, enum doc,
        /// [(variant, variant doc)])`. Not part of the schema hash.
        pub const ENUM_DOCS: &[(&str, &str, &[(&str, &str)])] = &[
            $( (
                stringify!($name),
                concat!($($doc, "\n",)*),
                &[ $( (stringify!($variant), concat!($($vdoc, "\n",)*)) ),+ ],
            ), )*
        ];
    };
}

/// Defines the wire structs and, from the same token trees, the [`SCHEMA`] table that the schema
/// hash and the Python generator read. One definition, so the two can never disagree.
macro_rules! wire_structs {
    ($(
        $(#[doc = $doc:literal])*
        struct $name:ident = $kind:literal {
            $( $(#[doc = $fdoc:literal])* $field:ident : $ty:ty ),* $(,)?
        }
    )*) => {
        $(
            $(#[doc = $doc])*
            #[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
            #[serde(default)]
            pub struct $name {
                $( $(#[doc = $fdoc])* pub $field: $ty, )*
            }

            impl WireStruct for $name {
                const NAME: &'static str = stringify!($name);
                const KIND: u8 = $kind;
            }
        )*

        /// Every wire struct in declaration order: `(name, kind, [(field, type)])`.
        /// `kind` is 0 for structs that are only ever nested inside a message.
        pub const SCHEMA: &[(&str, u8, &[(&str, &str)])] = &[
            $( (stringify!($name), $kind, &[ $( (stringify!($field), stringify!($ty)) ),* ]), )*
        ];

        /// The `///` docs of every wire struct, parallel to [`SCHEMA`]:
        /// `(name, struct doc, [(field, field doc)])`, each doc one line per `///` line (empty when
        /// undocumented). Not part of the schema hash; the Python generator copies them so the
        /// mirror explains its fields too.
        pub const SCHEMA_DOCS: &[(&str, &str, &[(&str, &str)])] = &[
            $( (
                stringify!($name),
                concat!($($doc, "\n",)*),
                &[ $( (stringify!($field), concat!($($fdoc, "\n",)*)) ),* ],
            ), )*
        ];
    };
}

/// Implemented by every wire struct. `KIND` is non-zero for top-level messages.
pub trait WireStruct: Serialize + for<'de> Deserialize<'de> {
    /// The struct's name in the schema.
    const NAME: &'static str;
    /// Frame kind for top-level messages, 0 for nested-only structs.
    const KIND: u8;
}

wire_enums! {
    /// The kinds of variant a request may run with besides the base model. They share the adapter
    /// id space and the tier ops; they differ in where a GPU copy lives.
    enum VariantKind {
        /// A PEFT LoRA adapter: `num_blocks` pages of the KV pool while GPU-resident (S-LoRA).
        Lora = 0 "lora",
        /// A compressed full fine-tune (DeltaZip, `deltaserve compress`): one of the worker's
        /// `--max-deltas` delta slots while GPU-resident, no pool pages.
        Delta = 1 "delta",
    }

    /// One move of a variant between tiers (S-LoRA's tiers: disk -> host memory -> GPU). The
    /// state machine is the scheduler's (`router/crates/sched/src/variants.rs` draws it).
    enum TierOp {
        /// Read and validate `VariantOp::path` into host memory (the worker may do it in the
        /// background; a later `to_gpu` waits for it).
        ToHost = 0 "to_host",
        /// Copy the host copy to the GPU: into `block_ids` of the pool (a LoRA adapter), or into
        /// delta slot `slot` (a delta).
        ToGpu = 1 "to_gpu",
        /// Forget the GPU placement (a LoRA adapter's pages already belong to the router again;
        /// a delta's slot is free).
        DropGpu = 2 "drop_gpu",
        /// Free the host copy (a GPU copy stays valid without it).
        DropHost = 3 "drop_host",
    }

    /// Which implementation of the worker's kernels runs (`WorkerConfig::kernels`).
    enum KernelBackend {
        /// Triton on CUDA, the torch references on the CPU.
        Auto = 0 "auto",
        /// The torch references everywhere (A/B runs).
        Torch = 1 "torch",
        /// Triton everywhere (on the CPU under `TRITON_INTERPRET=1`).
        Triton = 2 "triton",
    }
}

wire_structs! {
    /// One entry of `SamplingParams::logit_bias`.
    struct LogitBias = 0 {
        token_id: u32,
        /// Added to the token's logit, in [-100, 100].
        bias: f64,
    }

    /// Penalties over a request's tokens (`SamplingParams::penalties`); each is off at its
    /// neutral value.
    struct Penalties = 0 {
        /// OpenAI's `presence_penalty` in [-2, 2]: subtracted from the logit of every token
        /// generated at least once so far (0: off).
        presence: f64,
        /// OpenAI's `frequency_penalty` in [-2, 2]: subtracted once per time the token was
        /// generated so far (0: off).
        frequency: f64,
        /// vLLM / transformers' `repetition_penalty` (> 0): a token of the prompt or the output so
        /// far has its logit divided by it when positive, multiplied when not (1: off).
        repetition: f64,
    }

    /// How to pick the next token of one request. `temperature == 0` means greedy.
    struct SamplingParams = 0 {
        /// Softmax temperature; 0 selects the arg-max token (greedy).
        temperature: f64,
        /// Nucleus sampling mass in (0, 1]; 1 disables it.
        top_p: f64,
        /// Keep only the k most likely tokens; 0 disables it.
        top_k: u32,
        /// Per-request seed: the draw for output token i uses a generator seeded from (seed, i),
        /// so a seeded request samples the same tokens whatever else is in its batch.
        seed: Option<u64>,
        /// Return the sampled token's logprob plus this many top alternatives; `None` for none.
        logprobs: Option<u32>,
        /// Added to the logits before sampling, greedy included (OpenAI's `logit_bias`); empty
        /// for none. Token ids are below the vocabulary size (checked by the router).
        logit_bias: Vec<LogitBias>,
        /// Presence, frequency and repetition penalties; `None` when all are off (the common
        /// case costs one byte).
        penalties: Option<Penalties>,
        /// vLLM's `min_tokens`: while fewer output tokens than this exist, none of
        /// `min_tokens_banned` can be sampled.
        min_tokens: u32,
        /// The tokens that would end the request (its EOS ids unless `ignore_eos`, plus its
        /// `stop_token_ids`), banned for output tokens below `min_tokens`; empty when
        /// `min_tokens` is 0.
        min_tokens_banned: Vec<u32>,
        /// `echo` with logprobs: the prompt tokens' logprobs (each given the tokens before it),
        /// plus this many top alternatives, in `RequestOutput::prompt_logprobs`; `None` for none
        /// (the worker then computes logits only where it samples).
        prompt_logprobs: Option<u32>,
        /// Structured output (`response_format`, `tools`): an llguidance grammar (its JSON form,
        /// e.g. `{"grammars": [{"json_schema": {...}}]}`) every output token must follow; the
        /// worker masks the logits with it and, once it is complete, allows only EOS. `None` for
        /// unconstrained requests. A grammar the worker cannot compile refuses the request
        /// (`StepOutput::refused_requests`).
        grammar: Option<String>,
    }

    /// A request the worker has not seen (or has released, e.g. after preemption): sent in full.
    struct NewRequest = 0 {
        /// Router-assigned id, unique for the life of the router.
        req_id: u64,
        /// Every token known so far: the prompt, plus tokens generated before a preemption.
        token_ids: Vec<u32>,
        /// Number of the original prompt's tokens at the front of `token_ids`; output token i is
        /// `token_ids[num_prompt_tokens + i]`, which seeds the sampler deterministically.
        num_prompt_tokens: u32,
        /// Leading tokens whose KV is already in the cache (0 unless a prefix was shared).
        num_computed_tokens: u32,
        /// Tokens to compute this step, starting at `num_computed_tokens` (a prefill chunk).
        num_scheduled_tokens: u32,
        /// KV pages, in order, that hold this request's tokens.
        block_ids: Vec<u32>,
        /// How to sample once the whole sequence is computed.
        sampling: SamplingParams,
        /// The variant (LoRA adapter or delta) this request's tokens run with: one GPU-resident
        /// once this step's `adapter_ops` are applied (see `VariantOp`), 0 for the base model alone.
        adapter_id: u32,
    }

    /// A request already on the worker: only what changed since the last step.
    struct RunningRequest = 0 {
        /// The request's id.
        req_id: u64,
        /// Tokens to compute this step: 1 in decode (the token sampled last step), more while a
        /// chunked prefill continues.
        num_scheduled_tokens: u32,
        /// KV pages appended to the request's block table this step.
        new_block_ids: Vec<u32>,
    }

    /// One change to where a variant's weights live (`TierOp`). The router decides every one,
    /// including where on the GPU; the worker applies a plan's ops in order, after `released` and
    /// before the plan's requests run, each with the pool of its `kind`.
    struct VariantOp = 0 {
        /// The variant (router-assigned, > 0; requests name it in `NewRequest::adapter_id`).
        adapter_id: u32,
        /// The move.
        op: TierOp,
        /// The PEFT or delta directory (`to_host`).
        path: String,
        /// Pool pages that hold a LoRA adapter, in order (`to_gpu` of a LoRA adapter); the same
        /// page ids as KV pages. Empty for a delta.
        block_ids: Vec<u32>,
        /// The variant's kind: which of the worker's pools applies the op (the router knows it
        /// from registration; the worker never guesses it from the files).
        kind: VariantKind,
        /// The delta slot, in `0..max_deltas`, a delta's `to_gpu` fills (the router picks it; a
        /// slot taken on the worker is refused). `None` for every other op.
        slot: Option<u32>,
    }

    /// One iteration of continuous batching, decided by the router's scheduler.
    struct StepPlan = 2 {
        /// Monotonic step number; the worker echoes it in its `StepOutput`.
        step_id: u64,
        /// Requests sent in full (first time on the worker, or resumed after preemption).
        new_requests: Vec<NewRequest>,
        /// Requests continuing from an earlier step, as diffs.
        running: Vec<RunningRequest>,
        /// Requests whose worker-side state must be dropped before this step (finished, aborted or
        /// preempted); their KV pages already belong to the router again.
        released: Vec<u64>,
        /// Adapter tier changes, applied in order after `released` and before the requests.
        adapter_ops: Vec<VariantOp>,
    }

    /// One alternative token with its log-probability.
    struct TokenLogprob = 0 {
        token_id: u32,
        logprob: f64,
    }

    /// The logprob of one prompt token given the tokens before it (`echo` with logprobs).
    struct PromptLogprob = 0 {
        /// The token's position in the prompt (at least 1: the first token has none).
        position: u32,
        /// Its log-probability under the model's unmodified distribution.
        logprob: f64,
        /// The most likely tokens at that position, most likely first.
        top_logprobs: Vec<TokenLogprob>,
    }

    /// What one scheduled request produced in a step.
    struct RequestOutput = 0 {
        /// The request's id.
        req_id: u64,
        /// The sampled token; `None` when the step computed only part of a chunked prefill.
        token_id: Option<u32>,
        /// Log-probability of `token_id` (only when the request asked for logprobs).
        logprob: Option<f64>,
        /// The most likely alternatives, most likely first (only when asked for).
        top_logprobs: Vec<TokenLogprob>,
        /// With `SamplingParams::prompt_logprobs`: the prompt tokens this step's chunk gave
        /// logits for (positions `computed + 1 ..= computed + chunk`, within the prompt); a
        /// preempted request recomputed from the start sends them again (the router keeps the
        /// first).
        prompt_logprobs: Vec<PromptLogprob>,
    }

    /// Where a step's time went, measured on the worker's monotonic clock.
    struct StepTiming = 0 {
        /// From the previous `StepOutput` being written to this plan being decoded: the router's
        /// scheduling plus both IPC hops. This is the overhead the router is judged on.
        gap_us: u64,
        /// The model forward pass and sampling.
        forward_us: u64,
        /// From this plan being decoded to its output being encoded.
        total_us: u64,
        /// The step's floor: the least time the device could take for what it ran, the larger of
        /// (bytes read: base weights once, the KV its requests attend over, its variants' weights)
        /// ÷ measured copy bandwidth and its FLOPs ÷ measured matmul peak (the worker's
        /// `step_floor.py`); 0 for an empty step.
        floor_us: u64,
        /// The worker's time on this step alone: from the later of this plan being decoded and
        /// the previous step's output being encoded, to this output being encoded. A step launched
        /// behind the one in flight counts that wait in `total_us` but not here, so summed over
        /// steps this is the worker's busy time, overlapped or not; `busy_us / floor_us` summed is
        /// the served-step efficiency.
        busy_us: u64,
    }

    /// A variant whose files failed after registration (its host read failed at the `to_gpu`
    /// that needed it): the worker quarantined it, dropped its requests from its steps and
    /// skips its ops; the router fails its requests and marks it unavailable.
    struct FailedVariant = 0 {
        /// The variant (`VariantOp::adapter_id`).
        variant_id: u32,
        /// What failed, for the requests' error events (no traceback, no server path).
        message: String,
    }

    /// A new request the worker refused at admission (its grammar does not compile): it left
    /// the step with no output; the router fails it with the message (a client error).
    struct RefusedRequest = 0 {
        /// The request (`NewRequest::req_id`).
        req_id: u64,
        /// Why, for the client (e.g. the JSON schema's error; no traceback, no server path).
        message: String,
    }

    /// The worker's answer to one `StepPlan`.
    struct StepOutput = 3 {
        /// The plan's `step_id`.
        step_id: u64,
        /// One entry per scheduled request, in no particular order.
        outputs: Vec<RequestOutput>,
        /// Timing of this step.
        timing: StepTiming,
        /// Bytes of adapter weights the worker holds in host memory after this step (its measured
        /// host tier, which the router's accounting keeps under the configured budget).
        adapter_host_bytes: u64,
        /// Variants (LoRA adapters and deltas) whose `to_host` read finished since the previous
        /// `StepOutput`, well or not (a failed read is reported by the `to_gpu` that needs it).
        /// The router admits requests for a variant whose read is still running only when
        /// nothing else would run, since that step would wait for the read.
        host_ready: Vec<u32>,
        /// Cold prefills (requests) whose LoRA the worker's CPU helpers computed this step while
        /// their adapter's pages loaded (CaraServe's CPU-assisted cold start).
        cpu_assisted_prefills: u32,
        /// Of those, prefills where a helper failed or stalled: the worker computed its rows
        /// itself (same tokens) and restarts the helper.
        cpu_assist_fallbacks: u32,
        /// Cold prefills this step the helpers did not take: none free, predicted no faster than
        /// the load, or a one-token prefill.
        cpu_assist_declined: u32,
        /// Cold delta prefills that ran a surrogate block while the delta loaded (BlockLLM's
        /// speculative execution, `DELTASERVE_BLOCK_SPECULATION`; their tokens stay exact).
        speculated_prefills: u32,
        /// Of those, the ones whose real block's output had cosine >= 0.95 with the surrogate's.
        speculation_accepted: u32,
        /// Layers rerun after the speculated blocks, their KV rewritten (summed over prefills).
        speculation_recomputed_layers: u32,
        /// Variants quarantined since the previous `StepOutput` (each reported once); their
        /// requests in this step have no output.
        failed_variants: Vec<FailedVariant>,
        /// New requests refused at admission in this step (each reported once); they have no
        /// output and the worker holds no state for them.
        refused_requests: Vec<RefusedRequest>,
        /// Deltas whose `to_gpu` copy finished on the device since the previous `StepOutput`
        /// (the worker copies a delta beside the steps; a failed load is reported too: the
        /// step that needs it says why). With `gpu_load_reports` the router admits requests for
        /// a delta still being copied only when nothing else would run, since that step would
        /// wait for the copy.
        gpu_ready: Vec<u32>,
    }

    /// What the router needs to know about the loaded model.
    struct ModelInfo = 0 {
        /// HF architecture name, e.g. `LlamaForCausalLM`.
        architecture: String,
        vocab_size: u32,
        /// Longest sequence (prompt + output) the model accepts.
        max_model_len: u32,
        num_layers: u32,
        hidden_size: u32,
        /// Tokens that end generation (from `generation_config.json` / `config.json`).
        eos_token_ids: Vec<u32>,
        /// Compute dtype actually used, e.g. `float32`, `bfloat16`.
        dtype: String,
        /// Torch device, e.g. `cpu` or `cuda:0`.
        device: String,
        num_params: u64,
    }

    /// The paged KV cache the worker allocated; the router does the accounting over it.
    struct KvCapacity = 0 {
        /// Tokens per page.
        block_size: u32,
        /// Pages in the pool.
        num_blocks: u32,
        /// Bytes of one page across all layers (K and V).
        bytes_per_block: u64,
    }

    /// First frame a worker sends, once its model and KV cache are ready.
    struct Hello = 1 {
        /// `schema_hash()` as computed by the worker's copy of the schema.
        schema_hash: String,
        /// The worker's process id.
        pid: u32,
        model: ModelInfo,
        kv: KvCapacity,
        /// Most tokens a step with compressed-delta rows may have and still replay from one of
        /// the worker's CUDA graphs (its largest delta token bucket); a longer one runs eagerly,
        /// launching each kernel from Python. 0: the worker captures no such steps. The router
        /// keeps the prompt chunks of such steps within it.
        delta_graph_tokens: u32,
    }

    /// Asks the worker to validate a variant directory against its model and report its
    /// footprint. Changes no worker state; answered by an `VariantInfo` with the same id, in order
    /// with the step outputs.
    struct InspectVariant = 6 {
        /// Router-chosen id, echoed in the answer.
        inspect_id: u64,
        /// The PEFT directory (LoRA) or `deltaserve compress` output directory (delta).
        path: String,
        /// What the directory holds, as the router found it (its marker file): the worker
        /// inspects it as that kind.
        kind: VariantKind,
    }

    /// The worker's answer to `InspectVariant`.
    struct VariantInfo = 7 {
        /// The `InspectVariant`'s id.
        inspect_id: u64,
        /// Why the adapter cannot be served (names the file or field); `None` when it is valid.
        error: Option<String>,
        /// Pool pages the adapter's weights take on the GPU (`KvCapacity::bytes_per_block` each).
        num_blocks: u32,
        /// Bytes of its host-memory copy.
        host_bytes: u64,
        /// Largest rank over its adapted projections.
        max_rank: u32,
        /// Adapted projections, e.g. `q_proj`, `v_proj`.
        target_modules: Vec<String>,
        /// The kind inspected (`InspectVariant::kind`): a LoRA adapter takes `num_blocks` pool
        /// pages on the GPU, a delta one of the worker's delta slots (`num_blocks` 0).
        kind: VariantKind,
        /// One line for people, e.g. `rank 8` or `4-bit 2:4, 2.6x smaller than fp16`.
        summary: String,
    }

    /// The worker's whole configuration: the router's first frame on a new link, written before
    /// the worker process starts (its argv names only the link's directory). The router's
    /// `ServerConfig` owns every default; the worker validates the values and answers with its
    /// `Hello` (or a fatal `WorkerError` naming the bad setting).
    struct WorkerConfig = 8 {
        /// The router's `schema_hash()`. First, so that a worker of another schema can still
        /// read it and answer with its own hash in a `Hello` the router then refuses.
        schema_hash: String,
        /// HF model directory (config.json, *.safetensors).
        model_dir: String,
        /// Torch device: `cpu` or `cuda:N`.
        device: String,
        /// `auto` (float32 on the CPU; the checkpoint's half type, else bfloat16, on CUDA),
        /// `float32`, `float16` or `bfloat16`.
        dtype: String,
        /// Tokens per KV page (the router's accounting unit).
        block_size: u32,
        /// KV pool bytes; 0: 256 MiB on the CPU, on CUDA what `gpu_memory_utilization` leaves
        /// after the weights and a profiled activation reserve.
        kv_cache_bytes: u64,
        /// Fraction of the GPU's memory the worker may use in total (CUDA only).
        gpu_memory_utilization: f64,
        /// Most tokens one step computes (sizes the activation-reserve profiling run).
        max_num_batched_tokens: u32,
        /// Cap on prompt + output tokens; `None`: the model's limit, bounded by the KV pool.
        max_model_len: Option<u32>,
        /// Seed of the worker-global generator that unseeded requests sample from.
        seed: u64,
        /// Kernel implementations.
        kernels: KernelBackend,
        /// Largest decode batch replayed from a captured CUDA graph; 0: every step eager.
        cuda_graph_max_batch: u32,
        /// Microseconds `recv` polls the ring before sleeping on the doorbell.
        recv_spin_us: u32,
        /// CPU threads of torch's ops; 0: the CPUs the process may run on (CPU) or torch's
        /// default (CUDA).
        num_threads: u32,
        /// Level of the `deltaserve.worker` logger: DEBUG, INFO, WARNING or ERROR.
        log_level: String,
        /// Largest LoRA rank served (sizes the per-step adapter tables); 0 turns LoRA off.
        max_lora_rank: u32,
        /// Most distinct LoRA adapters one step may use (the router's max_num_seqs).
        max_loras_per_step: u32,
        /// Host memory allocated (and pinned on CUDA) once for variant host copies; 0: none.
        host_arena_bytes: u64,
        /// GPU slots for compressed deltas; 0 turns delta serving off.
        max_deltas: u32,
        /// Whether the CUDA C++ ops of csrc/ are built and used where nvcc is found.
        cuda_ops: bool,
        /// Where the CUDA C++ ops are built; `None`: ~/.cache/deltaserve.
        cache_dir: Option<String>,
        /// Run under cProfile, writing stats to `<profile_path>.<pid>`; `None`: no profiling.
        profile_path: Option<String>,
        /// Seconds between a profiled worker's stats files.
        profile_every_s: f64,
        /// CPU LoRA helper processes, each pinned to one CPU: a cold adapter's prefill starts at
        /// once with its LoRA computed by them; 0 turns them off.
        cpu_lora_helpers: u32,
        /// When the helpers take a cold prefill: `adaptive` (the profiled model predicts their
        /// compute ends before the load) or `always` (whenever one is free).
        cpu_lora_policy: String,
    }

    /// Asks the worker to exit cleanly.
    struct Shutdown = 4 {
        reason: String,
    }

    /// A failure the worker reports instead of a `StepOutput`.
    struct WorkerError = 5 {
        /// The step that failed (0 when outside a step).
        step_id: u64,
        message: String,
        /// Fatal: the worker exits after sending this and must be restarted. Recoverable: only
        /// the listed requests failed; the worker keeps serving.
        fatal: bool,
        /// Requests that failed (all of the step's requests when the whole step failed).
        req_ids: Vec<u64>,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kind_labels_are_the_wire_and_api_labels() {
        assert_eq!(VariantKind::from_label("delta"), Some(VariantKind::Delta));
        assert_eq!(VariantKind::from_label("lora"), Some(VariantKind::Lora));
        assert_eq!(VariantKind::from_label("LoRA"), None);
        assert_eq!(VariantKind::Delta.to_string(), "delta");
        let ops: Vec<&str> = TierOp::ALL.iter().map(|op| op.label()).collect();
        assert_eq!(ops, ["to_host", "to_gpu", "drop_gpu", "drop_host"]);
        for op in TierOp::ALL {
            assert_eq!(TierOp::from_label(op.label()), Some(*op));
            assert_eq!(TierOp::from_u8(*op as u8), Some(*op));
        }
        assert_eq!(
            (VariantKind::default(), TierOp::default()),
            (VariantKind::Lora, TierOp::ToHost)
        );
    }

    #[test]
    fn enums_are_one_small_int_and_unknown_values_do_not_decode() {
        let bytes = rmp_serde::to_vec(&(TierOp::DropHost, VariantKind::Delta)).unwrap();
        assert_eq!(bytes, [0x92, 0x03, 0x01]);
        let err = rmp_serde::from_slice::<TierOp>(&[0x07])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("unknown TierOp 7") && err.contains("to_gpu=1"),
            "{err}"
        );
        assert!(rmp_serde::from_slice::<VariantKind>(&[0xa4, b'l', b'o', b'r', b'a']).is_err());
    }
}
