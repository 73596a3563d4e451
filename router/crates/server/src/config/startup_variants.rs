//! The variants a daemon serves from start-up (`--lora`, `--lora-dir`, `--delta`, `--delta-dir`,
//! `--zoo`) and where unregistered ones are looked for at request time (`--lora-dir`,
//! `--delta-dir`, `--adapters-from-hub-cache`): [`ServerConfig`]'s view of variant directories.

use std::path::PathBuf;

use deltaserve_ipc::wire::VariantKind;

use super::ServerConfig;
use crate::substitution::SUBSTITUTE_SUFFIX;
use crate::variant_sources::VariantSources;

impl ServerConfig {
    /// The variants to register at start-up, `(name, dir, kind)`: every `--lora`, then each
    /// `--lora-dir`'s adapter subdirectories sorted by name, then every `--delta`, then each
    /// `--delta-dir`'s delta subdirectories, then each `--zoo`'s variants stored as deltas
    /// (`zoo_variants`), sorted by name, and with `--substitute-above` the substitutes of the zoo
    /// variants that opted in (`<name>.substitute`, `zoo_substitutions`). Names are checked at
    /// registration, and so is each directory's kind.
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
        if self.substitute_above.is_some() {
            for sub in self.zoo_substitutions().into_iter().flatten() {
                if let Some(dir) = sub.dir {
                    out.push((
                        format!("{}{SUBSTITUTE_SUFFIX}", sub.variant),
                        dir,
                        VariantKind::Delta,
                    ));
                }
            }
        }
        Ok(out)
    }

    /// Every `--zoo`'s opt-in substitutions (`zoo_substitutions`), zoo after zoo.
    pub fn zoo_substitutions(&self) -> Vec<Result<ZooSubstitution, String>> {
        self.zoos
            .iter()
            .flat_map(|z| zoo_substitutions(z))
            .collect()
    }

    /// Whether `dir` is inside one of the `--zoo` directories: a zoo variant or substitute the
    /// worker refuses at start-up is left out (the refusal logged), the rest still served.
    pub fn is_in_zoo(&self, dir: &std::path::Path) -> bool {
        self.zoos.iter().any(|z| dir.starts_with(z))
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

/// A zoo variant's opt-in substitution under load (`variants.<name>.substitution` in the zoo's
/// manifest, written by `zoo add --substitute-min-similarity`; `crate::substitution`).
#[derive(Debug, Clone, PartialEq)]
pub struct ZooSubstitution {
    /// The variant (served as `<base>:<variant>`).
    pub variant: String,
    /// Its substitute's delta directory; `None`: the base model.
    pub dir: Option<PathBuf>,
}

/// The substitutions `zoo`'s manifest records, by variant name: one per variant served as a
/// delta that opted in and has something to substitute. An entry that cannot be used is an
/// `Err` naming the file and field (the caller logs it; the variant is served unsubstituted).
pub fn zoo_substitutions(zoo: &std::path::Path) -> Vec<Result<ZooSubstitution, String>> {
    let path = zoo.join("manifest.json");
    let manifest: serde_json::Value = match std::fs::read(&path)
        .map_err(|e| e.to_string())
        .and_then(|b| serde_json::from_slice(&b).map_err(|e| e.to_string()))
    {
        Ok(m) => m,
        Err(e) => return vec![Err(format!("{}: {e}", path.display()))],
    };
    let Some(variants) = manifest.get("variants").and_then(|v| v.as_object()) else {
        return vec![Err(format!(
            "{}: field 'variants' is missing or not an object",
            path.display()
        ))];
    };
    let mut out = Vec::new();
    for (name, v) in variants {
        let Some(sub) = v.get("substitution") else {
            continue;
        };
        let field = |f: &str, what: &str| {
            Err(format!(
                "{}: field 'variants.{name}.substitution{f}' {what}",
                path.display()
            ))
        };
        if v.get("delta_dir").and_then(|d| d.as_str()).is_none() {
            continue; // dense blocks: not served
        }
        let Some(sub) = sub.as_object() else {
            out.push(field("", "is not an object"));
            continue;
        };
        match sub.get("min_similarity").and_then(|x| x.as_f64()) {
            Some(x) if x > 0.0 && x <= 1.0 => {}
            _ => {
                out.push(field(".min_similarity", "must be a number in (0, 1]"));
                continue;
            }
        }
        match sub.get("components").and_then(|c| c.as_array()) {
            Some(c) if c.is_empty() => continue, // nothing to substitute
            Some(_) => {}
            None => {
                out.push(field(".components", "is missing or not a list"));
                continue;
            }
        }
        let dir = match sub.get("delta_dir") {
            None | Some(serde_json::Value::Null) => None,
            Some(serde_json::Value::String(d)) if zoo.join(d).join("manifest.json").is_file() => {
                Some(zoo.join(d))
            }
            Some(d) => {
                out.push(field(
                    ".delta_dir",
                    &format!("is {d}: not null or a delta directory of the zoo"),
                ));
                continue;
            }
        };
        out.push(Ok(ZooSubstitution {
            variant: name.clone(),
            dir,
        }));
    }
    out
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zoo_substitutions_take_opted_in_entries_and_name_bad_fields() {
        let zoo = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(zoo.path().join("substitutes/b")).unwrap();
        std::fs::write(zoo.path().join("substitutes/b/manifest.json"), "{}").unwrap();
        let manifest = serde_json::json!({"variants": {
            "plain": {"delta_dir": "variants/plain"},
            "a": {"delta_dir": "variants/a", "substitution":
                {"min_similarity": 0.98, "components": ["layers.1.mlp"], "delta_dir": null}},
            "b": {"delta_dir": "variants/b", "substitution":
                {"min_similarity": 0.95, "components": ["layers.1.mlp"], "delta_dir": "substitutes/b"}},
            "nothing": {"delta_dir": "variants/n", "substitution":
                {"min_similarity": 0.95, "components": [], "delta_dir": null}},
            "dense": {"substitution": {"min_similarity": 0.95, "components": ["x"], "delta_dir": null}},
            "bad": {"delta_dir": "variants/bad", "substitution":
                {"min_similarity": 0.98, "components": ["x"], "delta_dir": "substitutes/gone"}},
        }});
        std::fs::write(zoo.path().join("manifest.json"), manifest.to_string()).unwrap();
        let got = zoo_substitutions(zoo.path());
        assert_eq!(got.len(), 3, "{got:?}");
        assert_eq!(
            got[0],
            Ok(ZooSubstitution {
                variant: "a".into(),
                dir: None
            })
        );
        let err = got[2].as_ref().unwrap_err(); // by name: a, b, bad
        assert!(
            err.contains("manifest.json: field 'variants.bad.substitution.delta_dir'"),
            "{err}"
        );
        assert_eq!(
            got[1].as_ref().unwrap().dir,
            Some(zoo.path().join("substitutes/b"))
        );
        std::fs::write(zoo.path().join("manifest.json"), "{").unwrap();
        assert!(zoo_substitutions(zoo.path())[0].is_err());
    }
}
