//! The `deltaserve` command line: argument parsing ([`Args`], which flattens the one
//! [`ServerConfig`]), the offline tools, the demo-model fallback, and serving until Ctrl-C or
//! SIGTERM. Two front doors run it: the standalone daemon binary (`router/crates/daemon`) and
//! the Python wheel's `deltaserve` console script (`_native.run_cli`), so both behave alike.
//!
//! Every flag is also an environment variable, and there are no other environment knobs
//! (`RUST_LOG` aside, for log filtering).

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Stdio;

use anyhow::{bail, Context};
use clap::Parser;
use tokio::io::{AsyncBufReadExt, BufReader};

use crate::config::{parse_lora, ServerConfig};
use crate::interpreter;

/// Serve a base model and its fine-tuned variants (LoRA adapters, compressed deltas) over an
/// OpenAI-compatible API.
#[derive(Debug, Parser)]
#[command(
    name = "deltaserve",
    version,
    about,
    args_conflicts_with_subcommands = true
)]
pub struct Args {
    /// Offline tools; without one, the daemon serves.
    #[command(subcommand)]
    pub tool: Option<Tool>,
    /// Address to listen on.
    #[arg(long, env = "DELTASERVE_HOST", default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0 picks a free one; the chosen address is logged).
    #[arg(long, env = "DELTASERVE_PORT", default_value_t = 8000)]
    pub port: u16,
    /// Everything else: the server's one config (`deltaserve_server::config::ServerConfig`).
    #[command(flatten)]
    pub server: ServerConfig,
}

/// Offline tools, run by the Python package with `--python`'s interpreter.
#[derive(Debug, clap::Subcommand)]
pub enum Tool {
    /// Compress a full fine-tune into a 2:4-sparse 2/4-bit delta against its base (DeltaZip's
    /// ΔCompress); `deltaserve compress --help` lists its options.
    #[command(disable_help_flag = true)]
    Compress {
        /// Passed to `python -m deltaserve.compress` unchanged.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// The block zoo (BlockLLM): `zoo add` partitions a fine-tune into shared and own blocks,
    /// `zoo ls` shows chains and savings, `zoo rm` removes a variant; `deltaserve zoo --help`.
    #[command(disable_help_flag = true)]
    Zoo {
        /// Passed to `python -m deltaserve.zoo` unchanged.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// The capacity-planning simulator (the real scheduler over a fitted latency model):
    /// `sim replay`, `sim plan`, `sim fit`; `deltaserve sim --help`.
    #[command(disable_help_flag = true)]
    Sim {
        /// Passed to `python -m deltaserve.sim` unchanged.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Measure this device's decode and prefill step latencies over batch sizes, Σ LoRA rank and
    /// prompt lengths, and fit the rank-aware latency model that `--latency-profile` reads
    /// (`--placement caraserve`) and `deltaserve sim` replays with; `deltaserve profile --help`.
    #[command(disable_help_flag = true)]
    Profile {
        /// Passed to `python -m deltaserve.profile` unchanged.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
}

impl Tool {
    /// The Python module that implements the tool, and its arguments.
    fn module_and_args(&self) -> (&'static str, &[String]) {
        match self {
            Tool::Compress { args } => ("deltaserve.compress", args),
            Tool::Zoo { args } => ("deltaserve.zoo", args),
            Tool::Sim { args } => ("deltaserve.sim", args),
            Tool::Profile { args } => ("deltaserve.profile", args),
        }
    }
}

/// `deltaserve compress --help`: the Python command line's own help, written out by
/// `python -m deltaserve.compress --write-help` (tests/e2e/test_cli.py keeps it current).
const COMPRESS_HELP: &str = include_str!("../../../../pyworker/deltaserve/compress/help.txt");

/// Runs the command line `argv` (program name first) and returns the process exit code: 0
/// after a clean shutdown or `--help`, 2 for bad arguments (clap's), 1 for any other error
/// (printed as `Error: ...`), or the offline tool's own code.
///
/// `host_python` is the interpreter this runs inside, when it runs inside one (the wheel's
/// console script): it runs the workers and tools unless `--python` names another
/// ([`interpreter::find_from`]).
pub fn run<I, T>(argv: I, host_python: Option<&Path>) -> i32
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let args = match Args::try_parse_from(argv) {
        Ok(args) => args,
        Err(e) => {
            let _ = e.print();
            return e.exit_code();
        }
    };
    crate::logging::init(&args.server.log_format);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("Error: starting the async runtime: {e}");
            return 1;
        }
    };
    match runtime.block_on(serve_or_tool(args, host_python)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("Error: {e:?}");
            1
        }
    }
}

/// Logs to stderr as text ([`crate::logging::init`]).
pub fn init_logging() {
    crate::logging::init("text");
}

async fn serve_or_tool(args: Args, host_python: Option<&Path>) -> anyhow::Result<i32> {
    if let Some(tool) = &args.tool {
        let (module, tool_args) = tool.module_and_args();
        if matches!(tool, Tool::Compress { .. })
            && tool_args.iter().any(|a| a == "-h" || a == "--help")
        {
            print!("{COMPRESS_HELP}"); // needs no Python
            return Ok(0);
        }
        let python = interpreter::find_from(args.server.python.as_deref(), host_python);
        return run_python_tool(&python.path, module, tool_args);
    }
    let cfg = prepare(args.server, host_python).await?;
    let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port))
        .await
        .with_context(|| format!("binding {}:{}", args.host, args.port))?;
    crate::run(cfg, listener, shutdown_signal()).await?;
    Ok(0)
}

/// Completes a parsed config the way the daemon serves it: picks the Python interpreter (and
/// logs why), warns about deprecated flags, falls back to the bundled demo model (with its demo
/// LoRA adapters unless adapters are named) when no `--model` is given, and validates.
pub async fn prepare(
    mut cfg: ServerConfig,
    host_python: Option<&Path>,
) -> anyhow::Result<ServerConfig> {
    let python = interpreter::find_from(cfg.python.as_deref(), host_python);
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
    if cfg.model_dir.is_none() {
        let (dir, demo_loras) = demo_model(&python.path).await?;
        if cfg.loras.is_empty() && cfg.lora_dirs.is_empty() {
            cfg.loras = demo_loras;
        }
        cfg.model_dir = Some(dir);
    } else if let Some(spec) = &cfg.model_dir {
        // A hub repo id or cache folder becomes its snapshot directory (hub_cache.rs), offline.
        let dir =
            crate::hub_cache::resolve_model_dir(spec, crate::hub_cache::cache_dir().as_deref())
                .map_err(|e| anyhow::anyhow!("--model {e}"))?;
        if cfg.served_model_name.is_none() {
            cfg.served_model_name = crate::hub_cache::repo_id_of(&dir);
        }
        cfg.model_dir = Some(dir);
    }
    cfg.python = Some(python.path);
    cfg.validate().map_err(anyhow::Error::msg)?;
    Ok(cfg)
}

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
        .kill_on_drop(true)
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

/// Resolves on Ctrl-C (SIGINT) or SIGTERM.
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn help_and_version_exit_zero_bad_flags_two() {
        assert_eq!(run(["deltaserve", "--version"], None), 0);
        assert_eq!(run(["deltaserve", "--no-such-flag"], None), 2);
        assert_eq!(run(["deltaserve", "compress", "--help"], None), 0);
    }

    #[test]
    fn a_bad_config_is_an_error_before_anything_starts() {
        let missing = "/nonexistent/deltaserve-model";
        assert_eq!(
            run(
                ["deltaserve", "--model", missing, "--python", "/bin/false"],
                None
            ),
            1
        );
    }
}
