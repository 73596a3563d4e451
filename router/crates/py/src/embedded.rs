//! The router for Python: `run_cli(argv, python)` (the wheel's `deltaserve` console script) and
//! `EmbeddedServer(flags, python, http)` (behind `deltaserve.Server` and `deltaserve.LLM`), both
//! thin over `deltaserve_server::{cli, embedded}`. Everything runs without the GIL; waits wake
//! every `embedded::POLL` to run Python's signal handlers, so Ctrl-C raises `KeyboardInterrupt`
//! and drops what was in flight.
//!
//! Errors: bad input (flags, a request that fails validation, a variant refused at registration
//! or deletion) raises `ValueError`, changing nothing; a failed start or request raises
//! `RuntimeError` with the server's message, and so does any call after `stop()`.

use std::path::PathBuf;
use std::sync::{RwLock, RwLockReadGuard};

use deltaserve_server::cli;
use deltaserve_server::embedded::{Completion, Embedded, EmbeddedError, PromptKind};
use pyo3::exceptions::{PyKeyboardInterrupt, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// Runs the `deltaserve` command line (`argv[0]` is the program name) and returns its exit code,
/// as the daemon binary would exit. `python` (the caller's `sys.executable`) runs the workers
/// and tools unless `--python` names another. Runs without the GIL until it returns; the
/// caller should leave SIGINT and SIGTERM at their defaults so they act as in the binary.
#[pyfunction]
#[pyo3(signature = (argv, python=None))]
fn run_cli(py: Python<'_>, argv: Vec<String>, python: Option<PathBuf>) -> i32 {
    py.detach(|| cli::run(argv, python.as_deref()))
}

/// Runs `f` without the GIL, giving it a check that runs Python's signal handlers; an exception
/// they raise (Ctrl-C's `KeyboardInterrupt`) is the result.
fn interruptible<T: Send>(
    py: Python<'_>,
    f: impl FnOnce(&mut dyn FnMut() -> bool) -> Result<T, EmbeddedError> + Send,
) -> PyResult<T> {
    let mut caught: Option<PyErr> = None;
    let result = py.detach(|| {
        let mut check = || {
            Python::attach(|py| match py.check_signals() {
                Ok(()) => false,
                Err(e) => {
                    caught = Some(e);
                    true
                }
            })
        };
        f(&mut check)
    });
    result.map_err(|e| match e {
        EmbeddedError::Interrupted => caught
            .take()
            .unwrap_or_else(|| PyKeyboardInterrupt::new_err("interrupted")),
        EmbeddedError::Invalid(m) => PyValueError::new_err(m),
        EmbeddedError::Failed(e) => PyRuntimeError::new_err(format!("{e:#}")),
    })
}

/// The router in this process: its tokio runtime on Rust threads, the workers as child
/// processes, the HTTP API too with `http`. `flags` are the daemon's command-line flags
/// (`deltaserve --help`), without the program name.
#[pyclass(frozen, module = "deltaserve._native")]
struct EmbeddedServer {
    /// `None` once stopped; read-locked by every call, write-locked by `stop`.
    inner: RwLock<Option<Embedded>>,
    /// `http://host:port`, when serving HTTP.
    url: Option<String>,
}

impl EmbeddedServer {
    fn live(&self) -> PyResult<RwLockReadGuard<'_, Option<Embedded>>> {
        let guard = self.inner.read().unwrap_or_else(|e| e.into_inner());
        if guard.is_none() {
            return Err(PyRuntimeError::new_err("the server is stopped"));
        }
        Ok(guard)
    }
}

#[pymethods]
impl EmbeddedServer {
    /// Starts the workers (and with `http` the API on `--host`/`--port`); returns once every
    /// worker is ready and the variants of the flags are registered.
    #[new]
    #[pyo3(signature = (flags, python=None, http=true))]
    fn new(
        py: Python<'_>,
        flags: Vec<String>,
        python: Option<PathBuf>,
        http: bool,
    ) -> PyResult<Self> {
        let embedded = interruptible(py, |interrupted| {
            Embedded::start(&flags, python.as_deref(), http, interrupted)
        })?;
        Ok(EmbeddedServer {
            url: embedded.url().map(str::to_string),
            inner: RwLock::new(Some(embedded)),
        })
    }

    /// `http://host:port` of the API (the bound port), or `None` without `http`.
    #[getter]
    fn url(&self) -> Option<String> {
        self.url.clone()
    }

    /// Whether the server runs (not yet stopped).
    #[getter]
    fn running(&self) -> bool {
        self.inner.read().map(|g| g.is_some()).unwrap_or(false)
    }

    /// Registers the variant in `path` as `name` (`kind`: `"lora"`, `"delta"`, or `None` to
    /// tell from the directory); returns its registry entry as JSON.
    #[pyo3(signature = (name, path, kind=None))]
    fn register(
        &self,
        py: Python<'_>,
        name: &str,
        path: PathBuf,
        kind: Option<&str>,
    ) -> PyResult<String> {
        let guard = self.live()?;
        let server = guard.as_ref().expect("checked live");
        let entry = interruptible(py, |i| server.register(name, &path, kind, i))?;
        Ok(serde_json::to_string(&entry).expect("entries serialize"))
    }

    /// Deletes the variant `name`; returns its last registry entry as JSON.
    fn unregister(&self, py: Python<'_>, name: &str) -> PyResult<String> {
        let guard = self.live()?;
        let server = guard.as_ref().expect("checked live");
        let entry = interruptible(py, |i| server.unregister(name, i))?;
        Ok(serde_json::to_string(&entry).expect("entries serialize"))
    }

    /// The engine's metrics in the Prometheus text format.
    fn metrics_text(&self, py: Python<'_>) -> PyResult<String> {
        let guard = self.live()?;
        let server = guard.as_ref().expect("checked live");
        interruptible(py, |i| server.metrics_text(i))
    }

    /// Runs the requests `bodies` (JSON texts of `/v1/completions` bodies, or of
    /// `/v1/chat/completions` bodies with `chat`) together and returns one dict per request, in
    /// order: `prompt_token_ids`, `token_ids`, `text`, `logprobs` (list of float, empty unless
    /// asked), `top_logprobs` (list of `[(token_id, logprob), ...]`), `finish_reason`.
    #[pyo3(signature = (bodies, chat=false))]
    fn generate<'py>(
        &self,
        py: Python<'py>,
        bodies: Vec<String>,
        chat: bool,
    ) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let parsed = bodies
            .iter()
            .enumerate()
            .map(|(i, b)| {
                serde_json::from_str(b)
                    .map_err(|e| PyValueError::new_err(format!("request {i}: not JSON: {e}")))
            })
            .collect::<PyResult<Vec<serde_json::Value>>>()?;
        let kind = if chat {
            PromptKind::Chat
        } else {
            PromptKind::Completion
        };
        let guard = self.live()?;
        let server = guard.as_ref().expect("checked live");
        let done = interruptible(py, |i| server.generate(&parsed, kind, i))?;
        drop(guard);
        done.into_iter().map(|c| completion_dict(py, c)).collect()
    }

    /// Stops the API, then the workers (waiting until they exited); idempotent.
    fn stop(&self, py: Python<'_>) {
        py.detach(|| {
            let taken = self.inner.write().unwrap_or_else(|e| e.into_inner()).take();
            if let Some(mut server) = taken {
                server.stop();
            }
        });
    }

    fn __repr__(&self) -> String {
        match &self.url {
            Some(url) => format!("EmbeddedServer({url:?})"),
            None => "EmbeddedServer(http=False)".into(),
        }
    }
}

fn completion_dict(py: Python<'_>, c: Completion) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("prompt_token_ids", c.prompt_token_ids)?;
    d.set_item("token_ids", c.token_ids)?;
    d.set_item("text", c.text)?;
    d.set_item("logprobs", c.logprobs)?;
    let top: Vec<Vec<(u32, f64)>> = c
        .top_logprobs
        .into_iter()
        .map(|alts| alts.into_iter().map(|t| (t.token_id, t.logprob)).collect())
        .collect();
    d.set_item("top_logprobs", top)?;
    d.set_item("finish_reason", c.finish_reason)?;
    Ok(d)
}

/// Adds this file's exports to the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(run_cli, m)?)?;
    m.add_class::<EmbeddedServer>()?;
    Ok(())
}
