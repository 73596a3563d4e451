//! One Python worker process as the router sees it: spawning it, the shared-memory link to it,
//! the handshake, and noticing when it dies.
//!
//! ```text
//!  spawn():  IpcDir::create(tmp)  ──▶  python -m deltaserve.worker --ipc-dir tmp ...
//!            reader thread: Receiver::recv (blocks on the doorbell) ─▶ decode ─▶ tokio mpsc
//!            wait for Hello (or the child's exit, or the start timeout)
//!            refuse a schema-hash mismatch, naming both hashes
//! ```
//!
//! The reader is a plain OS thread because waiting on a pipe doorbell is a blocking call; it
//! hands decoded frames to the actor through an unbounded channel and stops when the actor drops
//! the link.

use std::path::PathBuf;
use std::process::{ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use deltaserve_ipc::channel::{IpcDir, Sender};
use deltaserve_ipc::codec::{self, FromWorker};
use deltaserve_ipc::schema::schema_hash;
use deltaserve_ipc::wire::Hello;
use tokio::process::{Child, Command};
use tokio::sync::mpsc;

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
    /// How long model loading may take before the start counts as failed.
    pub start_timeout: Duration,
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
    #[error("worker exited during start-up ({0}); its stderr above says why")]
    Exited(ExitStatus),
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
    /// Decoded frames from the worker; `Err` carries a decode or ring error, after which the
    /// reader has stopped.
    pub from_worker: mpsc::UnboundedReceiver<Result<FromWorker, String>>,
    /// Tells the reader thread to stop.
    reader_stop: Arc<AtomicBool>,
    /// The rings and doorbells; removed when the worker is dropped.
    _dir: tempfile::TempDir,
}

impl Drop for WorkerProcess {
    fn drop(&mut self) {
        self.reader_stop.store(true, Ordering::Release);
    }
}

fn ipc_tempdir(index: usize) -> std::io::Result<tempfile::TempDir> {
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

        let reader_stop = Arc::new(AtomicBool::new(false));
        let (tx, mut from_worker) = mpsc::unbounded_channel();
        {
            let stop = reader_stop.clone();
            std::thread::Builder::new()
                .name(format!("worker{index}-reader"))
                .spawn(move || {
                    let mut rx = from_worker_raw;
                    loop {
                        match rx.recv(Some(Duration::from_millis(200))) {
                            Ok(Some(frame)) => {
                                let msg = codec::decode_from_worker(&frame).map_err(|e| e.to_string());
                                let failed = msg.is_err();
                                if tx.send(msg).is_err() || failed {
                                    return;
                                }
                            }
                            Ok(None) => {
                                if stop.load(Ordering::Acquire) || tx.is_closed() {
                                    return;
                                }
                            }
                            Err(e) => {
                                let _ = tx.send(Err(e.to_string()));
                                return;
                            }
                        }
                    }
                })
                .map_err(|e| WorkerStartError::Ipc(e.to_string()))?;
        }

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
            .arg(spec.max_num_batched_tokens.to_string());
        if let Some(len) = spec.max_model_len {
            cmd.arg("--max-model-len").arg(len.to_string());
        }
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
            msg = from_worker.recv() => msg,
            status = child.wait() => {
                return Err(match status {
                    Ok(s) => WorkerStartError::Exited(s),
                    Err(e) => WorkerStartError::Ipc(e.to_string()),
                });
            }
            _ = tokio::time::sleep(spec.start_timeout) => {
                let _ = child.start_kill();
                return Err(WorkerStartError::Timeout(spec.start_timeout));
            }
        };
        let hello = match first {
            Some(Ok(FromWorker::Hello(h))) => h,
            Some(Ok(FromWorker::WorkerError(e))) => {
                let _ = child.start_kill();
                return Err(WorkerStartError::Reported(e.message));
            }
            Some(Ok(other)) => {
                let _ = child.start_kill();
                return Err(WorkerStartError::Protocol(format!("{other:?}")));
            }
            Some(Err(e)) => {
                let _ = child.start_kill();
                return Err(WorkerStartError::Protocol(e));
            }
            None => {
                let status = child.wait().await.map_err(|e| WorkerStartError::Ipc(e.to_string()))?;
                return Err(WorkerStartError::Exited(status));
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
            reader_stop,
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
