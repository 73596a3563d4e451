//! The variants a daemon serves from start-up (`--lora`, `--lora-dir`, `--delta`, `--delta-dir`,
//! `--zoo`) and where unregistered ones are looked for at request time (`--lora-dir`,
//! `--delta-dir`, `--adapters-from-hub-cache`): [`ServerConfig`]'s view of variant directories.

use std::path::PathBuf;

use deltaserve_ipc::wire::VariantKind;

use super::ServerConfig;
use crate::variant_sources::VariantSources;

impl ServerConfig {
    /// The variants to register at start-up, `(name, dir, kind)`: every `--lora`, then each
    /// `--lora-dir`'s adapter subdirectories sorted by name, then every `--delta`, then each
    /// `--delta-dir`'s delta subdirectories, then each `--zoo`'s variants stored as deltas
    /// (`zoo_variants`), sorted by name. Names are checked at registration, and so is each
    /// directory's kind.
    pub fn startup_adapters(&self) -> Result<Vec<(String, PathBuf, VariantKind)>, String> {
        let lora = |(name, dir): (String, PathBuf)| (name, dir, VariantKind::Lora);
        let delta = |(name, dir): (String, PathBuf)| (name, dir, VariantKind::Delta);
        let mut out: Vec<_> = self.loras.iter().cloned().map(lora).collect();
        for dir in &self.lora_dirs {
            out.extend(
                subdirs_with(dir, "adapter_config.json", "--lora-dir")?
                    .into_iter()
                    .map(lora),
            );
        }
        out.extend(self.deltas.iter().cloned().map(delta));
        for dir in &self.delta_dirs {
            out.extend(
                subdirs_with(dir, "manifest.json", "--delta-dir")?
                    .into_iter()
                    .map(delta),
            );
        }
        for zoo in &self.zoos {
            out.extend(zoo_variants(zoo)?.into_iter().map(delta));
        }
        Ok(out)
    }

    /// Where unregistered names are looked for at request time: `--lora-dir`, `--delta-dir`,
    /// and the hub cache with `--adapters-from-hub-cache`.
    pub fn variant_sources(&self) -> VariantSources {
        let hub = self
            .adapters_from_hub_cache
            .then(crate::hub_cache::cache_dir)
            .flatten();
        VariantSources::new(self.lora_dirs.clone(), self.delta_dirs.clone(), hub)
    }
}

/// A block zoo's variants served as deltas, `(name, dir)` sorted by name: the subdirectories of
/// `<zoo>/variants` holding a delta `manifest.json` (the zoo's layout: `deltaserve.zoo.manifest`).
pub fn zoo_variants(zoo: &std::path::Path) -> Result<Vec<(String, PathBuf)>, String> {
    if !zoo.join("manifest.json").is_file() {
        return Err(format!(
            "--zoo {}: no manifest.json (not a block zoo; `python -m deltaserve.zoo add` makes one)",
            zoo.display()
        ));
    }
    let dir = zoo.join("variants");
    if !dir.is_dir() {
        return Ok(Vec::new());
    }
    subdirs_with(&dir, "manifest.json", "--zoo")
}

/// The subdirectories of `dir` that hold a file `marker`, as `(name, path)` sorted by name;
/// errors name `flag`.
fn subdirs_with(
    dir: &std::path::Path,
    marker: &str,
    flag: &str,
) -> Result<Vec<(String, PathBuf)>, String> {
    let entries = std::fs::read_dir(dir).map_err(|e| format!("{flag} {}: {e}", dir.display()))?;
    let mut found = Vec::new();
    for entry in entries {
        let path = entry
            .map_err(|e| format!("{flag} {}: {e}", dir.display()))?
            .path();
        if path.join(marker).is_file() {
            let name = path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            found.push((name, path));
        }
    }
    found.sort();
    Ok(found)
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
