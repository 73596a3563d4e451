//! Fixed example messages, one per frame kind: the source of the golden frames in
//! `tests/golden/` and of codec tests here and in other crates.
//!
//! The values are chosen to exercise every msgpack form both encoders must agree on: integers in
//! each width (fixint, uint8/16/32/64), floats that are not exact in binary (0.7), `Some` and
//! `None` options, empty and non-empty vectors (including arrays of more than 15 elements, which
//! need the array16 form), and unicode strings long enough to need str8 and str16.
//! Changing a value changes the golden bytes; regenerate them with `DELTASERVE_BLESS=1`.

use crate::schema::schema_hash;
use crate::wire::{
    Hello, InspectVariant, KernelBackend, KvCapacity, LogitBias, ModelInfo, NewRequest, Penalties,
    PromptLogprob, RequestOutput, RunningRequest, SamplingParams, Shutdown, StepOutput, StepPlan,
    StepTiming, TierOp, TokenLogprob, VariantInfo, VariantKind, VariantOp, WorkerConfig,
    WorkerError,
};

/// A plan with one sampled and one greedy new request, two running requests, two releases, and
/// variant ops of both kinds (a LoRA adapter's pages, a delta's slot).
pub fn step_plan() -> StepPlan {
    StepPlan {
        step_id: 12_345_678_901,
        new_requests: vec![
            NewRequest {
                req_id: 1 << 40,
                token_ids: vec![1, 127, 128, 255, 256, 65_535, 65_536, 151_643],
                num_prompt_tokens: 6,
                num_computed_tokens: 0,
                num_scheduled_tokens: 8,
                block_ids: (0..20).map(|i| i * 977).collect(),
                sampling: SamplingParams {
                    temperature: 0.7,
                    top_p: 0.95,
                    top_k: 50,
                    seed: Some((1 << 63) + 5),
                    logprobs: Some(5),
                    logit_bias: vec![LogitBias {
                        token_id: 50256,
                        bias: -100.0,
                    }],
                    penalties: Some(Penalties {
                        presence: 0.5,
                        frequency: -0.25,
                        repetition: 1.1,
                    }),
                    min_tokens: 4,
                    min_tokens_banned: vec![2, 50256],
                    prompt_logprobs: Some(2),
                    grammar: Some(r#"{"grammars": [{"json_schema": {"type": "object"}}]}"#.into()),
                },
                adapter_id: 1000,
            },
            NewRequest {
                req_id: 7,
                token_ids: vec![42],
                num_prompt_tokens: 1,
                num_computed_tokens: 0,
                num_scheduled_tokens: 1,
                block_ids: vec![3],
                sampling: SamplingParams {
                    temperature: 0.0,
                    top_p: 1.0,
                    top_k: 0,
                    seed: None,
                    logprobs: None,
                    ..Default::default()
                },
                adapter_id: 0,
            },
        ],
        running: vec![
            RunningRequest {
                req_id: 3,
                num_scheduled_tokens: 1,
                new_block_ids: vec![],
            },
            RunningRequest {
                req_id: u64::MAX,
                num_scheduled_tokens: 512,
                new_block_ids: vec![70_000, 70_001],
            },
        ],
        released: vec![2, 1 << 33],
        adapter_ops: vec![
            VariantOp {
                adapter_id: 9,
                op: TierOp::DropGpu,
                path: String::new(),
                block_ids: vec![],
                kind: VariantKind::Lora,
                slot: None,
            },
            VariantOp {
                adapter_id: 1000,
                op: TierOp::ToHost,
                path: "/srv/adapters/sql-助手".into(),
                block_ids: vec![],
                kind: VariantKind::Lora,
                slot: None,
            },
            VariantOp {
                adapter_id: 1000,
                op: TierOp::ToGpu,
                path: String::new(),
                block_ids: vec![65_535, 12, 70_002],
                kind: VariantKind::Lora,
                slot: None,
            },
            VariantOp {
                adapter_id: 4_000_000_000,
                op: TierOp::ToGpu,
                path: String::new(),
                block_ids: vec![],
                kind: VariantKind::Delta,
                slot: Some(63),
            },
            VariantOp {
                adapter_id: 31,
                op: TierOp::DropHost,
                path: String::new(),
                block_ids: vec![],
                kind: VariantKind::Delta,
                slot: None,
            },
        ],
    }
}

/// An output with a sampled token plus logprobs, a plain token, and an unfinished prefill chunk.
pub fn step_output() -> StepOutput {
    StepOutput {
        step_id: 12_345_678_901,
        outputs: vec![
            RequestOutput {
                req_id: 1 << 40,
                token_id: Some(151_643),
                logprob: Some(-0.25),
                top_logprobs: vec![
                    TokenLogprob {
                        token_id: 151_643,
                        logprob: -0.25,
                    },
                    TokenLogprob {
                        token_id: 13,
                        logprob: -1.7,
                    },
                ],
                prompt_logprobs: vec![PromptLogprob {
                    position: 1,
                    logprob: -3.5,
                    top_logprobs: vec![TokenLogprob {
                        token_id: 9,
                        logprob: -0.5,
                    }],
                }],
            },
            RequestOutput {
                req_id: 7,
                token_id: Some(0),
                logprob: None,
                top_logprobs: vec![],
                prompt_logprobs: vec![],
            },
            RequestOutput {
                req_id: 3,
                token_id: None,
                logprob: None,
                top_logprobs: vec![],
                prompt_logprobs: vec![],
            },
        ],
        timing: StepTiming {
            gap_us: 87,
            forward_us: 12_345,
            total_us: 70_000,
            floor_us: 9_876,
            busy_us: 52_000,
        },
        adapter_host_bytes: 3 << 30,
        host_ready: vec![7, 4_000_000_000],
        cpu_assisted_prefills: 2,
        cpu_assist_fallbacks: 1,
        cpu_assist_declined: 3,
        speculated_prefills: 2,
        speculation_accepted: 1,
        speculation_recomputed_layers: 6,
        failed_variants: vec![crate::wire::FailedVariant {
            variant_id: 9,
            message: "its files could not be loaded (AdapterLoadError)".into(),
        }],
        refused_requests: vec![crate::wire::RefusedRequest {
            req_id: 11,
            message: "response_format: Pointer '/nope' does not exist".into(),
        }],
        gpu_ready: vec![12, 3_000_000_000],
    }
}

/// The handshake of a worker serving a SmolLM2-sized model on a GPU.
pub fn hello() -> Hello {
    Hello {
        schema_hash: schema_hash(),
        pid: 4_242_424,
        model: ModelInfo {
            architecture: "LlamaForCausalLM".into(),
            vocab_size: 49_152,
            max_model_len: 8_192,
            num_layers: 30,
            hidden_size: 576,
            eos_token_ids: vec![0, 2],
            dtype: "bfloat16".into(),
            device: "cuda:0".into(),
            num_params: 134_515_008,
        },
        kv: KvCapacity {
            block_size: 16,
            num_blocks: 70_000,
            bytes_per_block: 5_000_000_000,
        },
        delta_graph_tokens: 512,
    }
}

/// A request to inspect an adapter directory with a non-ASCII path.
pub fn inspect_adapter() -> InspectVariant {
    InspectVariant {
        inspect_id: 77,
        path: "/srv/adapters/sql-助手".into(),
        kind: VariantKind::Lora,
    }
}

/// A valid adapter's footprint (`error: None`).
pub fn adapter_info() -> VariantInfo {
    VariantInfo {
        inspect_id: 77,
        error: None,
        num_blocks: 300,
        host_bytes: 80 << 20,
        max_rank: 16,
        target_modules: vec!["q_proj".into(), "v_proj".into()],
        kind: VariantKind::Lora,
        summary: "rank 16".into(),
    }
}

/// A GPU worker's configuration with every optional setting given (a non-ASCII cache path, a
/// host arena beyond u32, a fraction that is not exact in binary).
pub fn worker_config() -> WorkerConfig {
    WorkerConfig {
        schema_hash: schema_hash(),
        model_dir: "/models/SmolLM2-135M".into(),
        device: "cuda:1".into(),
        dtype: "bfloat16".into(),
        block_size: 16,
        kv_cache_bytes: 0,
        gpu_memory_utilization: 0.9,
        max_num_batched_tokens: 2048,
        max_model_len: Some(4096),
        seed: 1 << 40,
        kernels: KernelBackend::Triton,
        cuda_graph_max_batch: 256,
        recv_spin_us: 2000,
        num_threads: 0,
        log_level: "INFO".into(),
        max_lora_rank: 256,
        max_loras_per_step: 256,
        host_arena_bytes: 4 << 30,
        max_deltas: 3,
        cuda_ops: true,
        cache_dir: Some("/var/cache/deltaserve-缓存".into()),
        profile_path: None,
        profile_every_s: 10.0,
        cpu_lora_helpers: 4,
        cpu_lora_policy: "adaptive".into(),
    }
}

/// A shutdown with a short unicode reason.
pub fn shutdown() -> Shutdown {
    Shutdown {
        reason: "router stopping — 再见 👋".into(),
    }
}

/// A recoverable error naming 20 requests (array16) with a message longer than 255 bytes (str16).
pub fn worker_error() -> WorkerError {
    WorkerError {
        step_id: 255,
        message: format!(
            "CUDA out of memory while loading adapter «zh-助手»: {}",
            "Δ".repeat(120)
        ),
        fatal: false,
        req_ids: (0..20).map(|i| 1_000_000_007 * i).collect(),
    }
}
