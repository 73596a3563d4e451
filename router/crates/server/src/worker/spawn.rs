//! Starting one worker process: the IPC directory, its configuration as the link's first frame,
//! the process, the handshake (Hello or the child's exit or the start timeout), and the
//! schema-hash check.
//!
//! ```text
//!  spawn():  IpcDir::create(tmp)  ──▶  send WorkerConfig (the ring holds it until the worker reads it)
//!            python -m deltaserve.worker --ipc-dir tmp        (the only argument)
//!            wait for Hello (or the child's exit, or the start timeout)
//!            refuse a schema-hash mismatch, naming both hashes
//! ```

use std::path::PathBuf;
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use deltaserve_ipc::channel::{IpcDir, Sender};
use deltaserve_ipc::codec::{encode, FromWorker};
use deltaserve_ipc::schema::schema_hash;
use deltaserve_ipc::wire::{Hello, WorkerConfig};
use tokio::process::{Child, Command};

use super::link::FrameReceiver;

/// Ring capacity per direction. Plans and outputs are small; prompts are the largest thing sent.
const RING_CAPACITY: usize = 8 << 20;

/// How to start one worker: the process, and the configuration it is sent
/// (`ServerConfig::worker_config` builds it, with every default).
#[derive(Debug, Clone)]
pub struct WorkerSpec {
    /// Python interpreter that has the `deltaserve` package installed.
    pub python: PathBuf,
    /// How long model loading may take before the start counts as failed.
    pub start_timeout: Duration,
    /// Everything the worker is configured with (its `schema_hash` is set when sent).
    pub config: WorkerConfig,
}

impl WorkerSpec {
    /// The worker's torch device (`cpu` or `cuda:N`).
    pub fn device(&self) -> &str {
        &self.config.device
    }
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
        let (mut to_worker, from_worker_raw) = ipc
            .router_side()
            .map_err(|e| WorkerStartError::Ipc(e.to_string()))?;

        let mut from_worker = FrameReceiver::new(from_worker_raw)
            .map_err(|e| WorkerStartError::Ipc(e.to_string()))?;
        send_config(&mut to_worker, &spec.config)?;

        let mut cmd = Command::new(&spec.python);
        cmd.arg("-m")
            .arg("deltaserve.worker")
            .arg("--ipc-dir")
            .arg(dir.path());
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

/// Writes `config` (with this router's schema hash) as the link's first frame. The ring is empty
/// and far larger than the frame, so this never waits.
fn send_config(to_worker: &mut Sender, config: &WorkerConfig) -> Result<(), WorkerStartError> {
    let frame = encode(&WorkerConfig {
        schema_hash: schema_hash(),
        ..config.clone()
    });
    match to_worker.try_send(&frame) {
        Ok(true) => Ok(()),
        Ok(false) => Err(WorkerStartError::Ipc(
            "the worker's ring has no room for its config".into(),
        )),
        Err(e) => Err(WorkerStartError::Ipc(e.to_string())),
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
