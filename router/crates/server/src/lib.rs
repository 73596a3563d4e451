//! The router's server: everything between a client's request and the worker processes.
//!
//! # Layout (the request path, in order)
//!
//! - [`api`]: axum routes: OpenAI completions and chat (JSON and SSE), WebSocket streaming,
//!   models, health, readiness, metrics; OpenAI-style errors; request ids, API keys, tenants
//!   and their quotas.
//! - [`validate`]: request checks and defaults, before anything is queued.
//! - [`text`]: tokenizer, incremental detokenizer with stop strings, chat templates.
//! - [`engine`]: the handle the API calls; one actor per worker behind it, which owns that
//!   worker's scheduler (`deltaserve-sched`) and drives its steps.
//! - [`registry`]: the served variants (LoRA adapters, compressed deltas) by name (client
//!   name -> internal id); [`roots`]: where their directories may live (`--adapter-root`);
//!   [`variant_sources`]: where unregistered names are found at request time (`--lora-dir`).
//! - [`worker`]: spawns a Python worker, links to it over shared-memory rings
//!   (`deltaserve-ipc`), handshakes.
//! - [`config`]: the one typed configuration.
//! - [`interpreter`]: finds the Python interpreter that has the `deltaserve` package.
//!
//! - [`cli`]: the `deltaserve` command line (flags, tools, the demo model), shared by the
//!   daemon binary and the Python wheel's console script.
//! - [`embedded`]: the server inside a Python process (`deltaserve.Server`, `deltaserve.LLM`).
//!
//! Entry point: [`run`] (STYLE.md #9); the `deltaserve` binary only calls [`cli::run`].

pub mod api;
pub mod cli;
pub mod config;
pub mod drain;
pub mod embedded;
pub mod engine;
pub mod hub_cache;
pub mod interpreter;
pub mod listen;
pub mod logging;
pub mod registry;
pub mod roots;
pub mod sampling_defaults;
pub mod substitution;
pub mod text;
pub mod validate;
pub mod variant_sources;
pub mod worker;

use std::future::Future;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::Context;
use deltaserve_ipc::wire::VariantKind;
use tokio::net::TcpListener;

use crate::api::tenants::AccessControl;
use crate::config::ServerConfig;
use crate::engine::{Actor, EngineHandle, RequestLatency, SchedLimits, ServedModel};
use crate::registry::VariantRegistry;
use crate::roots::VariantRoots;
use crate::text::chat_template::ChatTemplate;
use crate::text::tokenizer::TextTokenizer;
use crate::worker::{WorkerProcess, WorkerSpec};

/// Starts every worker (concurrently), waits for their handshakes, and returns the engine.
pub async fn start_engine(cfg: &ServerConfig) -> anyhow::Result<EngineHandle> {
    cfg.validate().map_err(anyhow::Error::msg)?;
    let model_dir = cfg.model();
    let tokenizer = Arc::new(
        TextTokenizer::from_model_dir(model_dir)
            .with_context(|| format!("loading the tokenizer of {}", model_dir.display()))?,
    );
    let chat_template = match &cfg.chat_template {
        Some(file) => Some(
            ChatTemplate::from_file(file, tokenizer.config())
                .with_context(|| format!("loading --chat-template {}", file.display()))?,
        ),
        None => ChatTemplate::from_model_dir(model_dir)
            .with_context(|| format!("loading the chat template of {}", model_dir.display()))?,
    }
    .map(Arc::new);
    let sampling_defaults = cfg.sampling_defaults().map_err(anyhow::Error::msg)?;
    if !sampling_defaults.is_empty() {
        tracing::info!("sampling defaults from generation_config.json: {sampling_defaults:?}");
    }
    let python = cfg.python();

    let specs: Vec<WorkerSpec> = cfg
        .devices
        .iter()
        .map(|device| WorkerSpec {
            python: python.clone(),
            start_timeout: cfg.worker_start_timeout,
            config: cfg.worker_config(device),
        })
        .collect();
    let started = futures_util::future::join_all(
        specs
            .iter()
            .enumerate()
            .map(|(i, spec)| WorkerProcess::spawn(spec, i)),
    )
    .await;
    let mut workers = Vec::new();
    for (i, w) in started.into_iter().enumerate() {
        workers.push(w.with_context(|| format!("starting worker {i} on {}", specs[i].device()))?);
    }
    for (i, w) in workers.iter().enumerate() {
        let m = &w.hello.model;
        tracing::info!(
            worker = i,
            device = %m.device,
            dtype = %m.dtype,
            kv_blocks = w.hello.kv.num_blocks,
            block_size = w.hello.kv.block_size,
            max_model_len = m.max_model_len,
            "worker ready: {} ({} params)",
            m.architecture,
            m.num_params
        );
    }
    let model = ServedModel {
        name: cfg.model_name(),
        max_model_len: workers
            .iter()
            .map(|w| w.hello.model.max_model_len)
            .min()
            .unwrap_or(0),
        vocab_size: workers[0].hello.model.vocab_size,
        created: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        adapters: Arc::new(
            VariantRegistry::with_roots(
                cfg.model_name(),
                VariantRoots::new(&cfg.adapter_roots).map_err(anyhow::Error::msg)?,
            )
            .with_sources(cfg.variant_sources()),
        ),
        sampling_defaults,
    };
    let limits = SchedLimits {
        max_num_seqs: cfg.max_num_seqs,
        max_num_batched_tokens: cfg.max_num_batched_tokens,
        host_adapter_bytes: cfg.host_bytes(),
        max_deltas: cfg.max_deltas,
        overlap_steps: cfg.overlap_steps,
        slo: crate::engine::Slo::from_ms(cfg.ttft_slo_ms, cfg.tpot_slo_ms),
        enable_prefix_caching: cfg.prefix_caching(),
    };
    let latency = RequestLatency::default();
    // Each actor's task holds a sender until it ends (EngineHandle::stopped).
    let (alive, stopped) = tokio::sync::watch::channel(());
    let mut actors = Vec::new();
    for (i, (worker, spec)) in workers.into_iter().zip(specs).enumerate() {
        let (actor, handle) = Actor::new(
            i,
            spec,
            limits.clone(),
            tokenizer.clone(),
            worker,
            latency.clone(),
        )?;
        let alive = alive.clone();
        tokio::spawn(async move {
            actor.run().await;
            drop(alive);
        });
        actors.push(handle);
    }
    drop(alive);
    let engine = EngineHandle::new(
        actors,
        model,
        tokenizer,
        chat_template,
        cfg.max_queued_per_worker,
        stopped,
    )
    .with_placer(cfg.placer().map_err(anyhow::Error::msg)?);
    let startup = cfg.startup_adapters().map_err(anyhow::Error::msg)?;
    for (name, dir, kind) in startup {
        let what = match kind {
            VariantKind::Lora => "LoRA adapter",
            VariantKind::Delta => "delta",
        };
        let entry = match engine.register_adapter(&name, &dir, Some(kind)).await {
            Ok(entry) => entry,
            Err(e) if cfg.is_in_zoo(&dir) => {
                // One bad zoo entry leaves out that variant; the others are served.
                tracing::error!(adapter = %name, path = %dir.display(), "zoo variant not served: {e}");
                continue;
            }
            Err(e) => {
                return Err(anyhow::Error::new(e)
                    .context(format!("registering {what} {name} ({})", dir.display())))
            }
        };
        let summary = entry
            .footprint
            .as_ref()
            .map(|f| f.summary.as_str())
            .unwrap_or_default();
        tracing::info!(
            adapter = %entry.name,
            id = entry.id,
            path = %entry.path.display(),
            "{what} registered: {summary}"
        );
    }
    substitution::configure_from_zoos(cfg, &engine.model().adapters);
    Ok(engine)
}

/// Serves the API on `listener` until `shutdown` resolves, then stops the workers. The key file
/// (`--api-keys`) is reread on SIGHUP.
pub async fn run(
    cfg: ServerConfig,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let access = access_control(&cfg)?;
    reload_keys_on_sighup(access.clone());
    let engine = start_engine(&cfg).await?;
    let stopped = engine.stopped();
    let origins =
        api::hygiene::AllowedOrigins::parse(&cfg.allowed_origins).map_err(anyhow::Error::msg)?;
    serve_guarded(
        engine,
        access,
        listener,
        shutdown,
        cfg.drain_timeout,
        Arc::new(origins),
        cfg.header_read_timeout(),
    )
    .await?;
    // The engine's last handle is gone: wait for the actors to stop their workers (each gives
    // its worker 10 s to exit, then kills it) rather than leave them dying under init.
    if tokio::time::timeout(WORKERS_STOP_TIMEOUT, stopped)
        .await
        .is_err()
    {
        tracing::warn!("workers still stopping after {WORKERS_STOP_TIMEOUT:?}; exiting anyway");
    }
    Ok(())
}

/// How long [`run`] waits at exit for the workers to stop (each actor's own deadline is 10 s).
const WORKERS_STOP_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(12);

/// Who may call the API: `--api-keys` and `--admin-key` (open to anyone without either).
pub fn access_control(cfg: &ServerConfig) -> anyhow::Result<Arc<AccessControl>> {
    let access =
        AccessControl::new(cfg.api_keys.as_deref(), &cfg.admin_keys).map_err(anyhow::Error::msg)?;
    Ok(Arc::new(access))
}

/// Says at start-up who may use the server.
fn log_access(access: &AccessControl, addr: std::net::SocketAddr) {
    if access.keys_required() {
        let tenants = access.tenants().len();
        tracing::info!(
            tenants,
            "API keys required (--api-keys); SIGHUP rereads the key file"
        );
    } else if access.has_admin_keys() {
        tracing::warn!("no --api-keys: inference on http://{addr} is open to anyone who can reach it; the admin routes need an admin key");
    } else {
        tracing::warn!("no API keys configured (no --api-keys, no --admin-key): every route on http://{addr}, variant registration included, is open to anyone who can reach it");
    }
}

/// Rereads the key file on every SIGHUP; a bad file keeps the keys in force (and is logged).
fn reload_keys_on_sighup(access: Arc<AccessControl>) {
    use tokio::signal::unix::{signal, SignalKind};
    let Ok(mut hangups) = signal(SignalKind::hangup()) else {
        tracing::warn!("SIGHUP cannot be caught: the key file is read once");
        return;
    };
    tokio::spawn(async move {
        while hangups.recv().await.is_some() {
            match access.reload() {
                Ok(()) => tracing::info!("SIGHUP: key file reread"),
                Err(e) => tracing::error!("SIGHUP: the key file was not reread: {e}"),
            }
        }
    });
}

/// Serves the API of a started `engine` on `listener` to the callers `access` admits, until
/// `shutdown` resolves, then drains for up to [`drain::DEFAULT_DRAIN_TIMEOUT`]. The workers
/// stop once the last clone of `engine` is dropped (here, unless the caller keeps one).
pub async fn serve(
    engine: EngineHandle,
    access: Arc<AccessControl>,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    serve_draining(
        engine,
        access,
        listener,
        shutdown,
        drain::DEFAULT_DRAIN_TIMEOUT,
    )
    .await
}

/// [`serve`] with the drain's deadline (`--drain-timeout`): once `shutdown` resolves, new
/// requests get 503 and in-flight ones have `drain_timeout` to finish ([`drain`]).
pub async fn serve_draining(
    engine: EngineHandle,
    access: Arc<AccessControl>,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
    drain_timeout: std::time::Duration,
) -> anyhow::Result<()> {
    let origins = Arc::new(api::hygiene::AllowedOrigins::default());
    let headers = Some(listen::DEFAULT_HEADER_READ_TIMEOUT);
    serve_guarded(
        engine,
        access,
        listener,
        shutdown,
        drain_timeout,
        origins,
        headers,
    )
    .await
}

/// [`serve_draining`] where browsers on `allowed_origins` (`--allowed-origins`) may call the
/// state-changing routes (`api/hygiene.rs`), and clients must send their request headers within
/// `header_read_timeout` (`--header-read-timeout-s`, [`listen`]).
pub async fn serve_guarded(
    engine: EngineHandle,
    access: Arc<AccessControl>,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
    drain_timeout: std::time::Duration,
    allowed_origins: Arc<api::hygiene::AllowedOrigins>,
    header_read_timeout: Option<std::time::Duration>,
) -> anyhow::Result<()> {
    let addr = listener.local_addr()?;
    tracing::info!("serving {} on http://{addr}", engine.model().name);
    log_access(&access, addr);
    let app = api::guarded_router(engine.clone(), access, allowed_origins);
    drain::serve_until_drained(
        app,
        engine,
        listener,
        shutdown,
        drain_timeout,
        header_read_timeout,
    )
    .await?;
    // Dropping the last handle (held by the router) ends the actors, which stop their workers;
    // give them a moment to do it cleanly.
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    Ok(())
}
