//! The server inside another program (the Python package's `deltaserve.Server` and
//! `deltaserve.LLM`, through `deltaserve._native`): its own tokio runtime on Rust threads, the
//! engine with its worker processes, optionally the HTTP API on a listener, and a stop that
//! leaves no worker behind.
//!
//! ```text
//!  Embedded::start(argv) ── cli::Args (the daemon's flags) ── cli::prepare ── start_engine
//!        │                                                              └── serve (with http)
//!        ├─ register / unregister / metrics_text   the engine's admin path, no HTTP
//!        ├─ generate (offline.rs)                  requests straight into the engine
//!        └─ stop (also on drop)                    HTTP down, last engine handle dropped,
//!                                                  actors shut their workers down, awaited
//! ```
//!
//! Every blocking call takes an `interrupted` check, polled every [`POLL`], so the embedding
//! program can abandon a wait (Python's Ctrl-C): what was in flight is dropped, which cancels
//! its requests or kills the workers that were starting.

mod offline;

use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context};
use clap::Parser;
use deltaserve_ipc::wire::VariantKind;
use tokio::runtime::Runtime;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::cli::{self, Args};
use crate::engine::{metrics as engine_metrics, EngineHandle, VariantError};
use crate::registry::VariantEntry;

pub use offline::{Completion, PromptKind};

/// How often a blocking call checks `interrupted`.
pub const POLL: Duration = Duration::from_millis(100);
/// Longest the HTTP server may take to finish its open requests at stop before it is aborted
/// (a client holding a WebSocket open must not keep the workers alive).
const HTTP_DRAIN: Duration = Duration::from_secs(5);
/// Longest the actors may take to shut their workers down at stop (each gives its worker 10 s
/// to exit before killing it); past it the runtime's shutdown drops them, which kills the
/// worker processes.
const WORKERS_DRAIN: Duration = Duration::from_secs(15);

/// Why a blocking call returned early.
#[derive(Debug, thiserror::Error)]
pub enum EmbeddedError {
    /// `interrupted` said so; what was in flight was dropped.
    #[error("interrupted")]
    Interrupted,
    /// Bad input, nothing changed: flags that do not parse (clap's message, with usage), a
    /// request that fails validation, a variant that cannot be registered or deleted as asked.
    #[error("{0}")]
    Invalid(String),
    /// Anything else, with its context chain.
    #[error("{0:#}")]
    Failed(#[from] anyhow::Error),
}

/// The HTTP API of an embedded server.
struct Http {
    /// `http://host:port` with the port actually bound.
    url: String,
    /// Starts the graceful shutdown.
    stop: oneshot::Sender<()>,
    /// The `serve` task.
    task: JoinHandle<anyhow::Result<()>>,
}

/// A running embedded server (see the module docs). Dropping it stops it.
pub struct Embedded {
    /// `None` once stopped.
    runtime: Option<Runtime>,
    engine: Option<EngineHandle>,
    http: Option<Http>,
}

impl Embedded {
    /// Parses `flags` (the daemon's flags, no program name; `--host`/`--port` matter only with
    /// `http`), prepares the config as the daemon does (`host_python` runs the workers unless
    /// `--python` is given), starts the workers and, with `http`, serves the API.
    pub fn start(
        flags: &[String],
        host_python: Option<&Path>,
        http: bool,
        interrupted: impl FnMut() -> bool,
    ) -> Result<Embedded, EmbeddedError> {
        let args = Args::try_parse_from(
            std::iter::once("deltaserve".to_string()).chain(flags.iter().cloned()),
        )
        .map_err(|e| EmbeddedError::Invalid(e.render().to_string()))?;
        crate::logging::init(&args.server.log_format);
        if args.tool.is_some() {
            return Err(EmbeddedError::Invalid(
                "an embedded server takes serving flags only, not a tool".into(),
            ));
        }
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .thread_name("deltaserve")
            .enable_all()
            .build()
            .context("starting the async runtime")?;
        let mut me = Embedded {
            runtime: Some(runtime),
            engine: None,
            http: None,
        };
        let host_python = host_python.map(Path::to_path_buf);
        let (engine, served) = me.block_on(start(args, host_python, http), interrupted)??;
        me.engine = Some(engine);
        me.http = served;
        Ok(me)
    }

    /// `http://host:port` of the API, when started with `http`.
    pub fn url(&self) -> Option<&str> {
        self.http.as_ref().map(|h| h.url.as_str())
    }

    /// The engine; an error once stopped.
    pub fn engine(&self) -> Result<&EngineHandle, EmbeddedError> {
        self.engine
            .as_ref()
            .ok_or_else(|| anyhow!("the server is stopped").into())
    }

    /// Runs `fut` on the runtime until it completes or `interrupted()` (polled every
    /// [`POLL`]) is true; then `fut` is dropped.
    pub fn block_on<F: Future>(
        &self,
        fut: F,
        mut interrupted: impl FnMut() -> bool,
    ) -> Result<F::Output, EmbeddedError> {
        let runtime = self
            .runtime
            .as_ref()
            .ok_or_else(|| anyhow!("the server is stopped"))?;
        runtime.block_on(async {
            tokio::pin!(fut);
            loop {
                tokio::select! {
                    out = &mut fut => return Ok(out),
                    _ = tokio::time::sleep(POLL) => {
                        if interrupted() {
                            return Err(EmbeddedError::Interrupted);
                        }
                    }
                }
            }
        })
    }

    /// Registers the variant in `dir` as `name` (`kind`: `lora`, `delta`, or `None` to tell
    /// from the directory), as `POST /v1/adapters` does.
    pub fn register(
        &self,
        name: &str,
        dir: &Path,
        kind: Option<&str>,
        interrupted: impl FnMut() -> bool,
    ) -> Result<VariantEntry, EmbeddedError> {
        let want = match kind {
            None => None,
            Some("lora") => Some(VariantKind::Lora),
            Some("delta") => Some(VariantKind::Delta),
            Some(other) => {
                return Err(EmbeddedError::Invalid(format!(
                    "kind must be \"lora\" or \"delta\", got {other:?}"
                )))
            }
        };
        let engine = self.engine()?;
        self.block_on(engine.register_adapter(name, dir, want), interrupted)?
            .map_err(|e| variant_error(format!("registering {name} ({})", dir.display()), e))
    }

    /// Deletes the variant `name`, as `DELETE /v1/adapters/{name}` does.
    pub fn unregister(
        &self,
        name: &str,
        interrupted: impl FnMut() -> bool,
    ) -> Result<VariantEntry, EmbeddedError> {
        let engine = self.engine()?;
        self.block_on(engine.delete_adapter(name), interrupted)?
            .map_err(|e| variant_error(format!("deleting {name}"), e))
    }

    /// The engine's metrics in the Prometheus text format (the engine's families of
    /// `GET /metrics`).
    pub fn metrics_text(&self, interrupted: impl FnMut() -> bool) -> Result<String, EmbeddedError> {
        let engine = self.engine()?;
        let m = self.block_on(engine.metrics(), interrupted)?;
        Ok(engine_metrics::text(&engine_metrics::families(&m)))
    }

    /// Stops the HTTP API (open requests get [`HTTP_DRAIN`]), drops the engine so the actors
    /// shut their workers down, waits for them (at most [`WORKERS_DRAIN`]) and ends the
    /// runtime. Idempotent; also run on drop.
    pub fn stop(&mut self) {
        let Some(runtime) = self.runtime.take() else {
            return;
        };
        let http = self.http.take();
        let engine = self.engine.take();
        runtime.block_on(async {
            if let Some(Http { stop, mut task, .. }) = http {
                let _ = stop.send(());
                if tokio::time::timeout(HTTP_DRAIN, &mut task).await.is_err() {
                    tracing::warn!(
                        "the HTTP server did not drain in time; closing its connections"
                    );
                    task.abort();
                }
            }
            drop(engine);
            // The actors end once the last handle is gone, each shutting its worker down.
            let deadline = Instant::now() + WORKERS_DRAIN;
            let metrics = tokio::runtime::Handle::current().metrics();
            while metrics.num_alive_tasks() > 0 && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        });
        runtime.shutdown_timeout(Duration::from_secs(1));
    }
}

impl Drop for Embedded {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A refused registration or deletion is bad input; a busy engine is not.
fn variant_error(what: String, e: VariantError) -> EmbeddedError {
    match e {
        VariantError::Unavailable(_) => anyhow!("{what}: {e}").into(),
        VariantError::Invalid { .. } | VariantError::Registry(_) => {
            EmbeddedError::Invalid(format!("{what}: {e}"))
        }
    }
}

/// Prepares the config, starts the engine and, with `http`, binds and serves the API.
async fn start(
    args: Args,
    host_python: Option<PathBuf>,
    http: bool,
) -> anyhow::Result<(EngineHandle, Option<Http>)> {
    let cfg = cli::prepare(args.server, host_python.as_deref()).await?;
    let access = crate::access_control(&cfg)?;
    let engine = crate::start_engine(&cfg).await?;
    if !http {
        return Ok((engine, None));
    }
    let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port))
        .await
        .with_context(|| format!("binding {}:{}", args.host, args.port))?;
    let mut addr = listener.local_addr()?;
    if addr.ip().is_unspecified() {
        // Listening on every address: the URL names this host's loopback.
        addr.set_ip(match addr.ip() {
            std::net::IpAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
            std::net::IpAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
        });
    }
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(crate::serve(engine.clone(), access, listener, async {
        let _ = stopped.await;
    }));
    Ok((
        engine,
        Some(Http {
            url: format!("http://{addr}"),
            stop,
            task,
        }),
    ))
}
