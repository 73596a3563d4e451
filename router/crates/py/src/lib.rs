//! `deltaserve._native`: the private Python extension. Conversion only: every behaviour lives in
//! the `deltaserve-ipc`, `deltaserve-sched` and `deltaserve-tensorfile` crates, and this crate
//! turns their types and errors into Python ones.
//!
//! # Exports (typed in `pyworker/deltaserve/_native.pyi`)
//!
//! - `schema_hash()`, `schema_text()`: the Rust side of the wire schema, so Python tests can
//!   check the generated mirror against it.
//! - `WorkerLink(ipc_dir)`: the worker's half of a link ([`IpcDir::worker_side`]).
//! - `RouterLink(ipc_dir, create=True, capacity=DEFAULT_CAPACITY)`: the router's half
//!   ([`IpcDir::router_side`]), so Python tests and tools can play the router.
//! - `DEFAULT_CAPACITY`: the ring size the router uses unless told otherwise.
//! - `read_safetensors_into(path, copies, dst_dtype, dst_ptr=0, dst_len=0)`: tensors of a
//!   safetensors file into a host buffer ([`deltaserve_tensorfile::read_into`]), GIL released.
//! - `read_safetensors_header(path)`: `{name: (dtype, shape)}` of a safetensors file from its
//!   header alone ([`deltaserve_tensorfile::read_header`]), GIL released.
//! - `regex_match(pattern, texts, whole=False)`: `re.match` / `re.fullmatch` with a linear-time
//!   engine, for patterns from adapter configs (`linear_regex.rs`).
//! - `Scheduler(block_size, num_blocks, max_model_len, ...)` and its `SchedError`: the router's
//!   scheduler, plans out and worker outputs in as wire frames (`scheduler.rs`, translating
//!   through the scheduler crate's `wire` module, the router's own translation).
//! - `SchedulerConfig(block_size, num_blocks, max_model_len)`, `simulate(...)`, `SIM_FEATURES`
//!   and `PLACEMENTS`: the scheduler's config struct and the capacity-planning simulator, the
//!   real scheduler on a virtual clock (`sim.rs`; the loop in `sim_loop.rs`, step prices in
//!   `sim_latency.rs`, arrivals placed by the router's `--placement` in `sim_placement.rs`),
//!   behind `deltaserve.sim`.
//! - `run_cli(argv, python=None)` and `EmbeddedServer(flags, python=None, http=True)`: the
//!   `deltaserve` command line and the router in this process (`embedded.rs`, over
//!   `deltaserve_server::{cli, embedded}`), behind the console script, `deltaserve.Server` and
//!   `deltaserve.LLM`.
//!
//! Blocking calls release the GIL and wake at least every [`SIGNAL_CHECK`] to run Python signal
//! handlers, so Ctrl-C interrupts a worker blocked in `recv`.
//!
//! Errors: files and shared state (`IpcError::Io`, `BadRing`, `Corrupt`) raise `OSError` (with
//! errno where the OS gave one, so e.g. a missing ring is `FileNotFoundError`); bad arguments
//! (`FrameTooLarge`, `BadCapacity`) raise `ValueError`; a bounded `send` that found the ring full
//! for its whole timeout raises `TimeoutError`.

mod embedded;
mod linear_regex;
mod scheduler;
mod sim;
mod sim_latency;
mod sim_loop;
mod sim_pipeline;
mod sim_placement;

use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use deltaserve_ipc::channel::{IpcDir, Receiver, Sender, DEFAULT_CAPACITY};
use deltaserve_ipc::schema;
use deltaserve_ipc::IpcError;
use pyo3::exceptions::{PyOSError, PyTimeoutError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

/// Longest a blocking call stays without the GIL before checking for Python signals.
const SIGNAL_CHECK: Duration = Duration::from_millis(100);

/// Maps a transport error to the Python exception the stub documents.
fn py_err(e: IpcError) -> PyErr {
    let msg = e.to_string();
    match &e {
        IpcError::FrameTooLarge { .. } | IpcError::BadCapacity { .. } => PyValueError::new_err(msg),
        IpcError::Io { source, .. } => os_error(source, msg),
        IpcError::BadRing { .. } | IpcError::Corrupt { .. } => PyOSError::new_err(msg),
    }
}

/// `OSError(errno, msg)`, which picks the matching subclass (FileNotFoundError, ...), or a plain
/// `OSError(msg)` when the OS gave no errno.
fn os_error(source: &std::io::Error, msg: String) -> PyErr {
    match source.raw_os_error() {
        Some(errno) => PyOSError::new_err((errno, msg)),
        None => PyOSError::new_err(msg),
    }
}

/// `timeout_s` from Python: `None` waits forever; negative or NaN is refused.
fn timeout(timeout_s: Option<f64>) -> PyResult<Option<Duration>> {
    match timeout_s {
        None => Ok(None),
        Some(t) => Duration::try_from_secs_f64(t).map(Some).map_err(|_| {
            PyValueError::new_err(format!("timeout_s must be a finite number >= 0, got {t}"))
        }),
    }
}

/// Locks without caring about poisoning: a panic inside ring code is already reported as a
/// Python exception, and the ring state itself lives in shared memory, not behind the lock.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Both halves of one side of a link. Each half has its own lock so one Python thread may block
/// in `recv` while another sends.
struct Link {
    /// The outgoing direction.
    tx: Mutex<Sender>,
    /// The incoming direction.
    rx: Mutex<Receiver>,
    /// The link directory, for `repr` and the `ipc_dir` property.
    dir: String,
    /// Largest frame `send` accepts.
    max_frame_len: usize,
    /// How long `recv` polls the ring before sleeping on the doorbell (zero: not at all).
    spin: Duration,
}

impl Link {
    fn new(dir: String, tx: Sender, rx: Receiver, spin: Duration) -> Link {
        let max_frame_len = tx.max_frame_len();
        Link {
            tx: Mutex::new(tx),
            rx: Mutex::new(rx),
            dir,
            max_frame_len,
            spin,
        }
    }

    fn send(&self, py: Python<'_>, data: &[u8], timeout_s: Option<f64>) -> PyResult<()> {
        let deadline = timeout(timeout_s)?.map(|t| Instant::now() + t);
        // Fast path with the GIL held: room in the ring and nobody else sending.
        if let Ok(mut tx) = self.tx.try_lock() {
            if tx.try_send(data).map_err(py_err)? {
                return Ok(());
            }
        }
        loop {
            let slice = match deadline {
                None => SIGNAL_CHECK,
                Some(d) => d
                    .saturating_duration_since(Instant::now())
                    .min(SIGNAL_CHECK),
            };
            // The lock is taken without the GIL, so a thread blocked here never holds the GIL.
            let sent = py
                .detach(|| lock(&self.tx).send_timeout(data, Some(slice)))
                .map_err(py_err)?;
            if sent {
                return Ok(());
            }
            py.check_signals()?;
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(PyTimeoutError::new_err(format!(
                    "send: the ring in {} stayed full for {:.3}s: the peer is not reading",
                    self.dir,
                    timeout_s.unwrap_or_default()
                )));
            }
        }
    }

    fn recv<'py>(
        &self,
        py: Python<'py>,
        timeout_s: Option<f64>,
    ) -> PyResult<Option<Bound<'py, PyBytes>>> {
        let deadline = timeout(timeout_s)?.map(|t| Instant::now() + t);
        let mut buf = Vec::new();
        if let Ok(mut rx) = self.rx.try_lock() {
            if let Some(frame) = rx.try_recv().map_err(py_err)? {
                return Ok(Some(PyBytes::new(py, &frame)));
            }
        }
        if !self.spin.is_zero() {
            let spin = match deadline {
                None => self.spin,
                Some(d) => d.saturating_duration_since(Instant::now()).min(self.spin),
            };
            let got = py
                .detach(|| lock(&self.rx).spin_into(&mut buf, spin))
                .map_err(py_err)?;
            if got {
                return Ok(Some(PyBytes::new(py, &buf)));
            }
        }
        loop {
            let slice = match deadline {
                None => SIGNAL_CHECK,
                Some(d) => d
                    .saturating_duration_since(Instant::now())
                    .min(SIGNAL_CHECK),
            };
            let got = py
                .detach(|| lock(&self.rx).recv_into(&mut buf, Some(slice)))
                .map_err(py_err)?;
            if got {
                return Ok(Some(PyBytes::new(py, &buf)));
            }
            py.check_signals()?;
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Ok(None);
            }
        }
    }
}

/// The worker's half of a router↔worker link: receives `StepPlan`/`Shutdown` frames, sends
/// `Hello`/`StepOutput`/`WorkerError` frames.
#[pyclass(frozen, module = "deltaserve._native")]
struct WorkerLink {
    /// The opened half.
    link: Link,
}

#[pymethods]
impl WorkerLink {
    /// Opens the worker's half of the link in `ipc_dir` (created by the router). `recv` first
    /// polls the ring for `spin_us` microseconds (the worker expects the next plan right after it
    /// sends an output), then sleeps on the doorbell.
    #[new]
    #[pyo3(signature = (ipc_dir, spin_us=0))]
    fn new(ipc_dir: &str, spin_us: u64) -> PyResult<Self> {
        let (rx, tx) = IpcDir::at(ipc_dir).worker_side().map_err(py_err)?;
        Ok(WorkerLink {
            link: Link::new(ipc_dir.to_string(), tx, rx, Duration::from_micros(spin_us)),
        })
    }

    /// Sends one frame, waiting while the ring is full (`timeout_s=None`: as long as it takes).
    #[pyo3(signature = (data, timeout_s=None))]
    fn send(&self, py: Python<'_>, data: &[u8], timeout_s: Option<f64>) -> PyResult<()> {
        self.link.send(py, data, timeout_s)
    }

    /// The next frame, waiting at most `timeout_s` seconds (`None`: forever); `None` on timeout.
    #[pyo3(signature = (timeout_s=None))]
    fn recv<'py>(
        &self,
        py: Python<'py>,
        timeout_s: Option<f64>,
    ) -> PyResult<Option<Bound<'py, PyBytes>>> {
        self.link.recv(py, timeout_s)
    }

    /// The link directory this half was opened on.
    #[getter]
    fn ipc_dir(&self) -> &str {
        &self.link.dir
    }

    /// Largest frame `send` accepts.
    #[getter]
    fn max_frame_len(&self) -> usize {
        self.link.max_frame_len
    }

    fn __repr__(&self) -> String {
        format!("WorkerLink({:?})", self.link.dir)
    }
}

/// The router's half of a link, for tests and tools that play the router from Python.
#[pyclass(frozen, module = "deltaserve._native")]
struct RouterLink {
    /// The opened half.
    link: Link,
}

const _: () = assert!(
    DEFAULT_CAPACITY == 4194304,
    "update RouterLink's text_signature"
);

#[pymethods]
impl RouterLink {
    /// Opens the router's half; with `create`, first creates `ipc_dir` and its four files.
    #[new]
    #[pyo3(
        signature = (ipc_dir, create=true, capacity=DEFAULT_CAPACITY),
        // The default spelled out for `help()` and stubtest (`...` otherwise); the assert above
        // keeps it equal to the constant.
        text_signature = "(ipc_dir, create=True, capacity=4194304)"
    )]
    fn new(ipc_dir: &str, create: bool, capacity: usize) -> PyResult<Self> {
        let dir = if create {
            IpcDir::create(ipc_dir, capacity).map_err(py_err)?
        } else {
            IpcDir::at(ipc_dir)
        };
        let (tx, rx) = dir.router_side().map_err(py_err)?;
        Ok(RouterLink {
            link: Link::new(ipc_dir.to_string(), tx, rx, Duration::ZERO),
        })
    }

    /// Sends one frame, waiting while the ring is full (`timeout_s=None`: as long as it takes).
    #[pyo3(signature = (data, timeout_s=None))]
    fn send(&self, py: Python<'_>, data: &[u8], timeout_s: Option<f64>) -> PyResult<()> {
        self.link.send(py, data, timeout_s)
    }

    /// The next frame, waiting at most `timeout_s` seconds (`None`: forever); `None` on timeout.
    #[pyo3(signature = (timeout_s=None))]
    fn recv<'py>(
        &self,
        py: Python<'py>,
        timeout_s: Option<f64>,
    ) -> PyResult<Option<Bound<'py, PyBytes>>> {
        self.link.recv(py, timeout_s)
    }

    /// The link directory this half was opened on.
    #[getter]
    fn ipc_dir(&self) -> &str {
        &self.link.dir
    }

    /// Largest frame `send` accepts.
    #[getter]
    fn max_frame_len(&self) -> usize {
        self.link.max_frame_len
    }

    fn __repr__(&self) -> String {
        format!("RouterLink({:?})", self.link.dir)
    }
}

/// Copies `copies` (`(name, rows, cols, dst_offset, transpose)`) of the safetensors file at
/// `path` into the host buffer at `dst_ptr` (`dst_len` bytes of `dst_dtype` elements: `F16`,
/// `BF16` or `F32`), converting, transposing and checking finiteness as
/// [`deltaserve_tensorfile::read_into`] says; `dst_ptr == 0` only checks. Runs without the GIL.
///
/// The caller (`deltaserve.adapters.lora.LoraSpec.read_into`, the only one) passes the address of
/// a contiguous CPU tensor it keeps alive and does not touch during the call.
#[pyfunction]
#[pyo3(signature = (path, copies, dst_dtype, dst_ptr=0, dst_len=0))]
fn read_safetensors_into(
    py: Python<'_>,
    path: std::path::PathBuf,
    copies: Vec<(String, usize, usize, usize, bool)>,
    dst_dtype: &str,
    dst_ptr: usize,
    dst_len: usize,
) -> PyResult<()> {
    use deltaserve_tensorfile::{read_into, Dtype, TensorCopy};
    let out = Dtype::parse(dst_dtype).ok_or_else(|| {
        PyValueError::new_err(format!(
            "dst_dtype must be F16, BF16 or F32, got {dst_dtype:?}"
        ))
    })?;
    if dst_ptr & (out.size() - 1) != 0 {
        return Err(PyValueError::new_err(format!(
            "dst_ptr {dst_ptr:#x} is not aligned to {dst_dtype}"
        )));
    }
    let copies: Vec<TensorCopy> = copies
        .into_iter()
        .map(|(name, rows, cols, dst_offset, transpose)| TensorCopy {
            name,
            rows,
            cols,
            dst_offset,
            transpose,
        })
        .collect();
    let result = py.detach(|| {
        // SAFETY: the caller's contract above: `dst_len` writable bytes at `dst_ptr`, alive and
        // not otherwise accessed until this call returns.
        let dst = (dst_ptr != 0)
            .then(|| unsafe { std::slice::from_raw_parts_mut(dst_ptr as *mut u8, dst_len) });
        read_into(&path, &copies, dst, out)
    });
    result.map_err(tensorfile_err)
}

/// `{name: (dtype name, shape)}` of every tensor of a safetensors file, from its header (positioned
/// reads, no map), without the GIL; `OSError` / `ValueError` as for `read_safetensors_into`.
#[pyfunction]
fn read_safetensors_header(
    py: Python<'_>,
    path: std::path::PathBuf,
) -> PyResult<std::collections::BTreeMap<String, (String, Vec<usize>)>> {
    let header = py
        .detach(|| deltaserve_tensorfile::read_header(&path))
        .map_err(tensorfile_err)?;
    Ok(header
        .into_iter()
        .map(|(name, dtype, shape)| (name, (dtype, shape)))
        .collect())
}

/// A reader's error as the stub documents it: `OSError` for the file, `ValueError` for its contents.
fn tensorfile_err(e: deltaserve_tensorfile::Error) -> PyErr {
    match &e {
        deltaserve_tensorfile::Error::Io { source, .. } => os_error(source, e.to_string()),
        _ => PyValueError::new_err(e.to_string()),
    }
}

/// The schema hash as computed by the Rust `ipc` crate.
#[pyfunction]
fn schema_hash() -> String {
    schema::schema_hash()
}

/// The canonical schema text the hash is computed from.
#[pyfunction]
fn schema_text() -> String {
    schema::schema_text()
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(schema_hash, m)?)?;
    m.add_function(wrap_pyfunction!(schema_text, m)?)?;
    m.add_function(wrap_pyfunction!(read_safetensors_into, m)?)?;
    m.add_function(wrap_pyfunction!(read_safetensors_header, m)?)?;
    m.add_function(wrap_pyfunction!(linear_regex::regex_match, m)?)?;
    m.add_class::<WorkerLink>()?;
    m.add_class::<RouterLink>()?;
    m.add("DEFAULT_CAPACITY", DEFAULT_CAPACITY)?;
    embedded::register(m)?;
    m.add_class::<scheduler::Scheduler>()?;
    m.add("SchedError", m.py().get_type::<scheduler::SchedError>())?;
    m.add_class::<sim::PySchedulerConfig>()?;
    m.add_function(wrap_pyfunction!(sim::simulate, m)?)?;
    m.add("SIM_FEATURES", sim::SIM_FEATURES.to_vec())?;
    m.add("PLACEMENTS", sim_placement::placement_names())?;
    Ok(())
}
