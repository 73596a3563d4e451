//! The server's one typed configuration (STYLE.md #24): every field documented, defaulted by the
//! daemon's flags, validated here before anything starts.

use std::path::PathBuf;
use std::time::Duration;

use deltaserve_sched::VariantKind;

/// Default for [`ServerConfig::max_deltas`] (DeltaZip's profiled number of deltas worth
/// batching at once).
pub const DEFAULT_MAX_DELTAS: usize = deltaserve_sched::DEFAULT_MAX_DELTAS;
/// Largest [`ServerConfig::max_deltas`] the worker accepts (each slot reserves one delta's GPU
/// memory); checked here so a bad value is refused before any worker starts.
pub const MAX_DELTAS: usize = 64;

/// Everything `run` needs to serve one model.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// HF model directory (config.json, *.safetensors, tokenizer.json).
    pub model_dir: PathBuf,
    /// Name clients use in the `model` field; defaults to the directory's name.
    pub served_model_name: Option<String>,
    /// One worker per entry: `cpu` or `cuda:N`.
    pub devices: Vec<String>,
    /// Python interpreter with the `deltaserve` package installed.
    pub python: PathBuf,
    /// Worker compute dtype: `auto`, `float32`, `float16`, `bfloat16`.
    pub dtype: String,
    /// Tokens per KV page.
    pub block_size: u32,
    /// KV-cache bytes per worker; 0 lets the worker size it.
    pub kv_cache_bytes: u64,
    /// Fraction of GPU memory a CUDA worker may use.
    pub gpu_memory_utilization: f64,
    /// Most requests running in one step.
    pub max_num_seqs: usize,
    /// Token budget of one step (prefill chunks + decode tokens).
    pub max_num_batched_tokens: usize,
    /// Cap on prompt + output tokens; the model's own limit when unset.
    pub max_model_len: Option<u32>,
    /// Largest decode batch a CUDA worker replays from a captured graph (0: always eager).
    pub cuda_graph_max_batch: u32,
    /// Send each worker step N+1 before step N's output is back, so its host work overlaps
    /// the device's (the actor's "Overlapped steps").
    pub overlap_steps: bool,
    /// LoRA adapters registered at start-up: `(name, PEFT directory)`, in flag order.
    pub loras: Vec<(String, PathBuf)>,
    /// Directories whose every subdirectory holding an `adapter_config.json` is registered at
    /// start-up, named after the subdirectory (after `loras`, sorted by name).
    pub lora_dirs: Vec<PathBuf>,
    /// Compressed deltas registered at start-up (after every LoRA adapter): `(name, directory
    /// written by deltaserve compress)`, in flag order.
    pub deltas: Vec<(String, PathBuf)>,
    /// Host-memory budget per worker for variant copies, LoRA adapters and deltas together (the
    /// middle tier: disk -> host -> GPU).
    pub lora_host_bytes: u64,
    /// Deltas a worker keeps on the GPU at once (its delta slots); 0 turns delta serving off.
    pub max_deltas: usize,
    /// Largest LoRA rank a worker accepts (sizes its per-step adapter tables).
    pub max_lora_rank: u32,
    /// Most requests queued or running per worker before new ones get 429.
    pub max_queued_per_worker: usize,
    /// How long a worker may take to load its model.
    pub worker_start_timeout: Duration,
}

impl ServerConfig {
    /// Checks the values that would otherwise fail later and less clearly.
    pub fn validate(&self) -> Result<(), String> {
        if !self.model_dir.join("config.json").is_file() {
            return Err(format!(
                "--model {}: no config.json there (expected an HF model directory)",
                self.model_dir.display()
            ));
        }
        if !self.model_dir.join("tokenizer.json").is_file() {
            return Err(format!(
                "--model {}: no tokenizer.json there",
                self.model_dir.display()
            ));
        }
        if self.devices.is_empty() {
            return Err("--devices: give `cpu` or CUDA device ids like `0,1`".into());
        }
        if self.block_size == 0 || !self.block_size.is_power_of_two() || self.block_size > 256 {
            return Err(format!(
                "--block-size {}: must be a power of two in 1..=256",
                self.block_size
            ));
        }
        if !(self.gpu_memory_utilization > 0.0 && self.gpu_memory_utilization <= 1.0) {
            return Err(format!(
                "--gpu-memory-utilization {}: must be in (0, 1]",
                self.gpu_memory_utilization
            ));
        }
        if self.max_num_seqs == 0 || self.max_num_batched_tokens == 0 {
            return Err("--max-num-seqs and --max-num-batched-tokens must be at least 1".into());
        }
        for dir in &self.lora_dirs {
            if !dir.is_dir() {
                return Err(format!("--lora-dir {}: not a directory", dir.display()));
            }
        }
        if self.max_deltas > MAX_DELTAS {
            return Err(format!(
                "--max-deltas {}: must be at most {MAX_DELTAS} (0 turns delta serving off)",
                self.max_deltas
            ));
        }
        if self.max_deltas == 0 {
            if let Some((name, _)) = self.deltas.first() {
                return Err(format!(
                    "--delta {name}: delta serving is off (--max-deltas 0); raise --max-deltas"
                ));
            }
        }
        if self.max_lora_rank == 0 {
            return Err("--max-lora-rank must be at least 1".into());
        }
        if self.max_queued_per_worker == 0 {
            return Err("--max-queued-per-worker must be at least 1".into());
        }
        Ok(())
    }

    /// The variants to register at start-up, `(name, dir, kind)`: every `--lora`, then each
    /// `--lora-dir`'s adapter subdirectories sorted by name, then every `--delta`. Names are
    /// checked at registration, and so is each directory's kind.
    pub fn startup_adapters(&self) -> Result<Vec<(String, PathBuf, VariantKind)>, String> {
        let lora = |(name, dir): (String, PathBuf)| (name, dir, VariantKind::Lora);
        let mut out: Vec<_> = self.loras.iter().cloned().map(lora).collect();
        for dir in &self.lora_dirs {
            let entries =
                std::fs::read_dir(dir).map_err(|e| format!("--lora-dir {}: {e}", dir.display()))?;
            let mut found = Vec::new();
            for entry in entries {
                let path = entry
                    .map_err(|e| format!("--lora-dir {}: {e}", dir.display()))?
                    .path();
                if path.join("adapter_config.json").is_file() {
                    let name = path
                        .file_name()
                        .map(|n| n.to_string_lossy().into_owned())
                        .unwrap_or_default();
                    found.push((name, path));
                }
            }
            found.sort();
            out.extend(found.into_iter().map(lora));
        }
        out.extend(
            self.deltas
                .iter()
                .cloned()
                .map(|(name, dir)| (name, dir, VariantKind::Delta)),
        );
        Ok(out)
    }

    /// The name clients use for the model.
    pub fn model_name(&self) -> String {
        self.served_model_name.clone().unwrap_or_else(|| {
            self.model_dir
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| "model".into())
        })
    }
}

/// Parses one `--lora NAME=DIR`.
pub fn parse_lora(spec: &str) -> Result<(String, PathBuf), String> {
    parse_named_dir("--lora", spec)
}

/// Parses one `--delta NAME=DIR`.
pub fn parse_delta(spec: &str) -> Result<(String, PathBuf), String> {
    parse_named_dir("--delta", spec)
}

/// Parses `NAME=DIR` given to `flag`.
fn parse_named_dir(flag: &str, spec: &str) -> Result<(String, PathBuf), String> {
    match spec.split_once('=') {
        Some((name, dir)) if !name.is_empty() && !dir.is_empty() => {
            Ok((name.to_string(), PathBuf::from(dir)))
        }
        _ => Err(format!("{flag} {spec}: expected NAME=DIR")),
    }
}

/// Parses `--devices`: `cpu`, or comma-separated CUDA ids (`0,1` or `cuda:0,cuda:1`).
pub fn parse_devices(spec: &str) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        if part == "cpu" {
            out.push("cpu".to_string());
        } else {
            let id = part.strip_prefix("cuda:").unwrap_or(part);
            let n: u32 = id.parse().map_err(|_| {
                format!("--devices: `{part}` is neither `cpu` nor a CUDA device id")
            })?;
            out.push(format!("cuda:{n}"));
        }
    }
    if out.is_empty() {
        return Err("--devices is empty".into());
    }
    let mut seen = std::collections::HashSet::new();
    if let Some(dup) = out
        .iter()
        .find(|d| d.as_str() != "cpu" && !seen.insert(d.as_str()))
    {
        return Err(format!("--devices: {dup} is listed twice"));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lora_flags_parse_and_collect() {
        assert_eq!(
            parse_lora("a=/x").unwrap(),
            ("a".to_string(), PathBuf::from("/x"))
        );
        assert!(parse_lora("a").unwrap_err().contains("NAME=DIR"));
        assert!(parse_lora("=/x").is_err());
        assert_eq!(
            parse_delta("ft=/d").unwrap(),
            ("ft".to_string(), PathBuf::from("/d"))
        );
        assert_eq!(
            parse_delta("ft=").unwrap_err(),
            "--delta ft=: expected NAME=DIR"
        );
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("config.json"), "{}").unwrap();
        std::fs::write(dir.path().join("tokenizer.json"), "{}").unwrap();
        let zoo = tempfile::tempdir().unwrap();
        for name in ["zeta", "alpha", "not-an-adapter"] {
            std::fs::create_dir(zoo.path().join(name)).unwrap();
            if name != "not-an-adapter" {
                std::fs::write(zoo.path().join(name).join("adapter_config.json"), "{}").unwrap();
            }
        }
        let cfg = |lora_dirs: Vec<PathBuf>| ServerConfig {
            model_dir: dir.path().to_path_buf(),
            served_model_name: Some("base".into()),
            devices: vec!["cpu".into()],
            python: "python3".into(),
            dtype: "auto".into(),
            block_size: 16,
            kv_cache_bytes: 0,
            gpu_memory_utilization: 0.9,
            max_num_seqs: 8,
            max_num_batched_tokens: 64,
            max_model_len: None,
            cuda_graph_max_batch: 0,
            overlap_steps: true,
            loras: vec![("first".into(), "/somewhere".into())],
            lora_dirs,
            deltas: vec![("ft".into(), "/deltas/ft".into())],
            lora_host_bytes: 1 << 30,
            max_deltas: DEFAULT_MAX_DELTAS,
            max_lora_rank: 64,
            max_queued_per_worker: 8,
            worker_start_timeout: Duration::from_secs(1),
        };
        let ok = cfg(vec![zoo.path().to_path_buf()]);
        assert!(ok.validate().is_ok());
        let names: Vec<(String, VariantKind)> = ok
            .startup_adapters()
            .unwrap()
            .into_iter()
            .map(|(n, _, k)| (n, k))
            .collect();
        let lora = VariantKind::Lora;
        assert_eq!(
            names,
            [
                ("first".into(), lora),
                ("alpha".into(), lora),
                ("zeta".into(), lora),
                ("ft".into(), VariantKind::Delta)
            ],
            "LoRA flags first, then each dir sorted, then the deltas"
        );
        let too_many = ServerConfig {
            max_deltas: MAX_DELTAS + 1,
            ..ok.clone()
        };
        assert!(too_many.validate().unwrap_err().contains("--max-deltas 65"));
        let off = ServerConfig {
            max_deltas: 0,
            ..ok.clone()
        };
        let err = off.validate().unwrap_err();
        assert!(
            err.contains("--delta ft") && err.contains("--max-deltas 0"),
            "{err}"
        );
        let off_without_deltas = ServerConfig {
            deltas: Vec::new(),
            ..off
        };
        assert!(off_without_deltas.validate().is_ok());
        let err = cfg(vec![dir.path().join("missing")])
            .validate()
            .unwrap_err();
        assert!(
            err.contains("--lora-dir") && err.contains("not a directory"),
            "{err}"
        );
    }

    #[test]
    fn devices_parse() {
        assert_eq!(parse_devices("cpu").unwrap(), vec!["cpu"]);
        assert_eq!(parse_devices("0,1").unwrap(), vec!["cuda:0", "cuda:1"]);
        assert_eq!(parse_devices("cuda:3").unwrap(), vec!["cuda:3"]);
        assert!(parse_devices("gpu").unwrap_err().contains("gpu"));
        assert!(parse_devices("0,0").unwrap_err().contains("twice"));
        assert!(parse_devices("").is_err());
    }
}
