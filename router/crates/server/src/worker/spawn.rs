//! Starting one worker process: its argv, the IPC directory, the handshake (Hello or the
//! child's exit or the start timeout), and the schema-hash check.
//!
//! ```text
//!  spawn():  IpcDir::create(tmp)  ──▶  python -m deltaserve.worker --ipc-dir tmp ...
//!            wait for Hello (or the child's exit, or the start timeout)
//!            refuse a schema-hash mismatch, naming both hashes
//! ```

use std::path::PathBuf;
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use deltaserve_ipc::channel::{IpcDir, Sender};
use deltaserve_ipc::codec::FromWorker;
use deltaserve_ipc::schema::schema_hash;
use deltaserve_ipc::wire::Hello;
use tokio::process::{Child, Command};

use super::link::FrameReceiver;

/// Ring capacity per direction. Plans and outputs are small; prompts are the largest thing sent.
const RING_CAPACITY: usize = 8 << 20;

/// How to start one worker.
#[derive(Debug, Clone)]
pub struct WorkerSpec {
    /// Python interpreter that has the `deltaserve` package installed.
    pub python: PathBuf,
    /// HF model directory the worker loads.
    pub model_dir: PathBuf,
    /// Torch device: `cpu` or `cuda:N`.
    pub device: String,
    /// `auto`, `float32`, `float16` or `bfloat16`.
    pub dtype: String,
    /// Tokens per KV page.
    pub block_size: u32,
    /// KV-cache budget in bytes; 0 lets the worker choose.
    pub kv_cache_bytes: u64,
    /// Fraction of GPU memory the worker may use (CUDA only).
    pub gpu_memory_utilization: f64,
    /// Token budget per step (the worker profiles activation memory with it).
    pub max_num_batched_tokens: u32,
    /// Upper bound on prompt + output tokens, if the operator set one.
    pub max_model_len: Option<u32>,
    /// Largest decode batch the worker replays from a CUDA graph (0: eager only).
    pub cuda_graph_max_batch: u32,
    /// Largest LoRA rank the worker accepts (sizes its per-step adapter tables).
    pub max_lora_rank: u32,
    /// Most distinct adapters one step may use (the scheduler's max_num_seqs bounds it).
    pub max_loras_per_step: u32,
    /// GPU slots for compressed deltas (`--max-deltas`; the router keeps at most this many
    /// deltas on the GPU); 0 turns delta serving off.
    pub max_deltas: usize,
    /// Host memory the worker allocates (and pins) once for its host copies of LoRA adapters and
    /// deltas; 0: none.
    pub host_arena_bytes: u64,
    /// How long model loading may take before the start counts as failed.
    pub start_timeout: Duration,
    /// CPU threads of the worker's torch ops (`--num-threads`); `None`: the worker's default.
    pub num_threads: Option<usize>,
    /// Environment of the worker's process beyond the router's own: the CUDA-ops and profiling
    /// settings (`ServerConfig::worker_env`).
    pub env: Vec<(String, String)>,
}

/// Why a worker could not be started.
#[derive(Debug, thiserror::Error)]
pub enum WorkerStartError {
    #[error("could not create the worker's IPC directory: {0}")]
    Ipc(String),
    #[error("could not start `{python} -m deltaserve.worker`: {source}")]
    Spawn {
        python: String,
        source: std::io::Error,
    },
    #[error("worker (`{python} -m deltaserve.worker`) exited during start-up ({status}); its stderr above says why")]
    Exited { python: String, status: ExitStatus },
    #[error("worker did not finish loading within {0:?}")]
    Timeout(Duration),
    #[error(
        "wire schema mismatch: the worker's deltaserve.wire has schema hash {worker} but this \
         router's ipc crate has {router}; rebuild and reinstall the Python package (`make develop`)"
    )]
    SchemaMismatch { worker: String, router: String },
    #[error("worker sent {0} before its Hello")]
    Protocol(String),
    #[error("worker failed to start: {0}")]
    Reported(String),
}

/// A running, handshaken worker.
pub struct WorkerProcess {
    /// The child process (killed when dropped).
    pub child: Child,
    /// What the worker reported at start-up.
    pub hello: Hello,
    /// Frames to the worker.
    pub to_worker: Sender,
    /// Frames from the worker.
    pub from_worker: FrameReceiver,
    /// The rings and doorbells; removed when the worker is dropped.
    _dir: tempfile::TempDir,
}

fn ipc_tempdir(index: usize) -> std::io::Result<tempfile::TempDir> {
    super::stale_ipc::remove_stale_once();
    let prefix = format!("deltaserve-{}-w{}-", std::process::id(), index);
    let shm = std::path::Path::new("/dev/shm");
    if shm.is_dir() {
        if let Ok(dir) = tempfile::Builder::new().prefix(&prefix).tempdir_in(shm) {
            return Ok(dir);
        }
    }
    tempfile::Builder::new().prefix(&prefix).tempdir()
}

impl WorkerProcess {
    /// Starts worker `index` and waits for its Hello.
    pub async fn spawn(spec: &WorkerSpec, index: usize) -> Result<Self, WorkerStartError> {
        let dir = ipc_tempdir(index).map_err(|e| WorkerStartError::Ipc(e.to_string()))?;
        let ipc = IpcDir::create(dir.path(), RING_CAPACITY)
            .map_err(|e| WorkerStartError::Ipc(e.to_string()))?;
        let (to_worker, from_worker_raw) = ipc
            .router_side()
            .map_err(|e| WorkerStartError::Ipc(e.to_string()))?;

        let mut from_worker = FrameReceiver::new(from_worker_raw)
            .map_err(|e| WorkerStartError::Ipc(e.to_string()))?;

        let mut cmd = Command::new(&spec.python);
        cmd.arg("-m")
            .arg("deltaserve.worker")
            .arg("--model")
            .arg(&spec.model_dir)
            .arg("--ipc-dir")
            .arg(dir.path())
            .arg("--device")
            .arg(&spec.device)
            .arg("--dtype")
            .arg(&spec.dtype)
            .arg("--block-size")
            .arg(spec.block_size.to_string())
            .arg("--kv-cache-bytes")
            .arg(spec.kv_cache_bytes.to_string())
            .arg("--gpu-memory-utilization")
            .arg(spec.gpu_memory_utilization.to_string())
            .arg("--max-num-batched-tokens")
            .arg(spec.max_num_batched_tokens.to_string())
            .arg("--cuda-graph-max-batch")
            .arg(spec.cuda_graph_max_batch.to_string());
        cmd.arg("--max-lora-rank")
            .arg(spec.max_lora_rank.to_string())
            .arg("--max-loras-per-step")
            .arg(spec.max_loras_per_step.to_string())
            .arg("--max-deltas")
            .arg(spec.max_deltas.to_string())
            .arg("--host-arena-bytes")
            .arg(spec.host_arena_bytes.to_string());
        if let Some(len) = spec.max_model_len {
            cmd.arg("--max-model-len").arg(len.to_string());
        }
        if let Some(n) = spec.num_threads {
            cmd.arg("--num-threads").arg(n.to_string());
        }
        cmd.envs(spec.env.iter().map(|(k, v)| (k, v)));
        cmd.env("PYTHONUNBUFFERED", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::inherit())
            .stderr(Stdio::inherit())
            .kill_on_drop(true);
        let mut child = cmd.spawn().map_err(|source| WorkerStartError::Spawn {
            python: spec.python.display().to_string(),
            source,
        })?;

        let first = tokio::select! {
            msg = from_worker.recv(None) => msg,
            status = child.wait() => {
                return Err(match status {
                    Ok(status) => WorkerStartError::Exited {
                        python: spec.python.display().to_string(),
                        status,
                    },
                    Err(e) => WorkerStartError::Ipc(e.to_string()),
                });
            }
            _ = tokio::time::sleep(spec.start_timeout) => {
                let _ = child.start_kill();
                return Err(WorkerStartError::Timeout(spec.start_timeout));
            }
        };
        let hello = match first {
            Ok(FromWorker::Hello(h)) => h,
            Ok(FromWorker::WorkerError(e)) => {
                let _ = child.start_kill();
                return Err(WorkerStartError::Reported(e.message));
            }
            Ok(other) => {
                let _ = child.start_kill();
                return Err(WorkerStartError::Protocol(format!("{other:?}")));
            }
            Err(e) => {
                let _ = child.start_kill();
                return Err(WorkerStartError::Protocol(e));
            }
        };
        check_schema(&hello.schema_hash, &schema_hash()).inspect_err(|_| {
            let _ = child.start_kill();
        })?;
        Ok(Self {
            child,
            hello,
            to_worker,
            from_worker,
            _dir: dir,
        })
    }
}

/// The handshake's schema check: both hashes named when they differ.
pub fn check_schema(worker: &str, router: &str) -> Result<(), WorkerStartError> {
    if worker == router {
        Ok(())
    } else {
        Err(WorkerStartError::SchemaMismatch {
            worker: worker.to_string(),
            router: router.to_string(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schema_mismatch_names_both_hashes() {
        assert!(check_schema("abc", "abc").is_ok());
        let msg = check_schema("0123456789abcdef", "fedcba9876543210")
            .unwrap_err()
            .to_string();
        assert!(msg.contains("0123456789abcdef"), "{msg}");
        assert!(msg.contains("fedcba9876543210"), "{msg}");
    }
}
