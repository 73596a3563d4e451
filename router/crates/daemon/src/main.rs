//! `deltaserve`: the daemon binary. Argument parsing only (STYLE.md #9); the server lives in the
//! `deltaserve-server` crate. Every flag is also an environment variable, and there are no other
//! environment knobs (RUST_LOG aside, for log filtering).

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::Stdio;

use anyhow::{bail, Context};
use clap::Parser;
use deltaserve_server::config::{parse_lora, ServerConfig};
use deltaserve_server::interpreter;
use tokio::io::{AsyncBufReadExt, BufReader};

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
    /// Address to listen on.
    #[arg(long, env = "DELTASERVE_HOST", default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on (0 picks a free one; the chosen address is logged).
    #[arg(long, env = "DELTASERVE_PORT", default_value_t = 8000)]
    port: u16,
    /// Everything else: the server's one config (`deltaserve_server::config::ServerConfig`).
    #[command(flatten)]
    server: ServerConfig,
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

/// `deltaserve compress --help`: the Python command line's own help, written out by
/// `python -m deltaserve.compress --write-help` (tests/e2e/test_cli.py keeps it current).
const COMPRESS_HELP: &str = include_str!("../../../../pyworker/deltaserve/compress/help.txt");

/// Runs `python -m deltaserve.<module> args...` with inherited stdio; returns its exit code.
fn run_python_tool(python: &Path, module: &str, args: &[String]) -> anyhow::Result<i32> {
    let status = std::process::Command::new(python)
        .arg("-m")
        .arg(module)
        .args(args)
        .status()
        .with_context(|| format!("running {} -m {module}", python.display()))?;
    Ok(status.code().unwrap_or(1))
}

/// Finds (converting on first use) the bundled demo model through the Python package, with the
/// demo LoRA adapters committed next to it (`NAME=DIR` lines after the path). The child's
/// stderr is shown as it runs and its last lines are quoted in the error when it fails.
async fn demo_model(python: &Path) -> anyhow::Result<(PathBuf, Vec<(String, PathBuf)>)> {
    tracing::info!("no --model given: serving the bundled demo model (SmolLM2-135M-Instruct)");
    let run = || format!("running `{} -m deltaserve.demo_model`", python.display());
    let mut child = tokio::process::Command::new(python)
        .args([
            "-m",
            "deltaserve.demo_model",
            "--print-path",
            "--print-adapters",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(run)?;
    // Tee the child's stderr: shown line by line as the conversion runs, kept for the error.
    let mut said = String::new();
    if let Some(stderr) = child.stderr.take() {
        let mut lines = BufReader::new(stderr).lines();
        while let Some(line) = lines.next_line().await.with_context(run)? {
            eprintln!("{line}");
            said.push_str(&line);
            said.push('\n');
        }
    }
    let mut out = child.wait_with_output().await.with_context(run)?;
    out.stderr = said.into_bytes();
    if !out.status.success() {
        bail!(
            "{}; or pass --model DIR",
            interpreter::child_error(python, "preparing the demo model", &out)
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
        .with_ansi(std::io::stderr().is_terminal()) // no colour codes in log files
        .init();
    let args = Args::parse();
    let mut cfg = args.server;
    let python = interpreter::find(cfg.python.as_deref());
    if let Some(Tool::Compress { args: tool_args }) = &args.tool {
        if tool_args.iter().any(|a| a == "-h" || a == "--help") {
            print!("{COMPRESS_HELP}"); // needs no Python
            return Ok(());
        }
        std::process::exit(run_python_tool(
            &python.path,
            "deltaserve.compress",
            tool_args,
        )?);
    }
    tracing::info!(
        "python: {} ({}{})",
        python.path.display(),
        python.source,
        if python.has_package {
            ""
        } else {
            "; it lacks the deltaserve package"
        }
    );
    if cfg.lora_host_bytes.is_some() {
        tracing::warn!("--lora-host-bytes (DELTASERVE_LORA_HOST_BYTES) is deprecated: it budgets every variant kind; use --variant-host-bytes");
    }
    // The demo model comes with its demo adapters unless the operator names adapters.
    if cfg.model_dir.is_none() {
        let (dir, demo_loras) = demo_model(&python.path).await?;
        if cfg.loras.is_empty() && cfg.lora_dirs.is_empty() {
            cfg.loras = demo_loras;
        }
        cfg.model_dir = Some(dir);
    } else if let Some(spec) = &cfg.model_dir {
        // A hub repo id or cache folder becomes its snapshot directory (hub_cache.rs), offline.
        let dir = deltaserve_server::hub_cache::resolve_model_dir(
            spec,
            deltaserve_server::hub_cache::cache_dir().as_deref(),
        )
        .map_err(|e| anyhow::anyhow!("--model {e}"))?;
        if cfg.served_model_name.is_none() {
            cfg.served_model_name = deltaserve_server::hub_cache::repo_id_of(&dir);
        }
        cfg.model_dir = Some(dir);
    }
    cfg.python = Some(python.path);
    cfg.validate().map_err(anyhow::Error::msg)?;
    let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port))
        .await
        .with_context(|| format!("binding {}:{}", args.host, args.port))?;
    deltaserve_server::run(cfg, listener, shutdown_signal()).await
}
