//! The local Hugging Face hub cache, read offline: where `--model` (and any model directory the
//! daemon is given) may also be a repo id (`org/name`, `org/name@revision`) or a cache folder
//! (`models--org--name`), resolved to the `snapshots/<commit>` directory that holds the files.
//!
//! ```text
//!  <cache>/models--<org>--<name>/refs/<branch or tag>      the commit hash it points at
//!  <cache>/models--<org>--<name>/snapshots/<commit>/...    the files (symlinks into blobs/)
//!  <cache> = $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub
//! ```
//!
//! Nothing is ever downloaded: a repo id that is not in the cache is an error naming where it
//! looked. A path that exists as a directory is used as it is (the cache layout is only read
//! when the directory is a `models--*` folder). The workers get the resolved directory, so this
//! is the one place the layout is known.

use std::path::{Path, PathBuf};

/// The hub cache directory from the environment (`HF_HUB_CACHE`, `HF_HOME`, `HOME`).
pub fn cache_dir() -> Option<PathBuf> {
    cache_dir_from(|key| std::env::var_os(key).map(PathBuf::from))
}

fn cache_dir_from(env: impl Fn(&str) -> Option<PathBuf>) -> Option<PathBuf> {
    env("HF_HUB_CACHE")
        .or_else(|| env("HF_HOME").map(|h| h.join("hub")))
        .or_else(|| env("HOME").map(|h| h.join(".cache/huggingface/hub")))
}

/// `spec` as a model directory: itself when it is a directory (a `models--*` cache folder is
/// resolved to its snapshot), else a repo id looked up in `cache` (module docstring).
pub fn resolve_model_dir(spec: &Path, cache: Option<&Path>) -> Result<PathBuf, String> {
    if spec.is_dir() {
        let is_repo_folder = spec
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with("models--"));
        return if is_repo_folder && spec.join("snapshots").is_dir() {
            snapshot(spec, "main")
        } else {
            Ok(spec.to_path_buf())
        };
    }
    resolve_repo_id(spec.to_str().unwrap_or_default(), cache)
}

/// A repo id (`org/name`, `org/name@revision`) looked up in `cache` only: never a directory of
/// the working directory, whatever the id spells (request-time resolution of variants).
pub fn resolve_repo_id(text: &str, cache: Option<&Path>) -> Result<PathBuf, String> {
    let (repo, revision) = text.split_once('@').unwrap_or((text, "main"));
    let parts: Vec<&str> = repo.split('/').collect();
    let looks_like_id = parts.len() == 2
        && parts.iter().all(|p| {
            !p.is_empty()
                && *p != "."
                && *p != ".."
                && p.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        });
    if !looks_like_id || revision.is_empty() {
        return Err(format!(
            "{text}: not a directory (nor an `org/name[@revision]` hub repo id)"
        ));
    }
    let Some(cache) = cache else {
        return Err(format!(
            "{text}: not a directory, and no hub cache to look it up in (set HF_HUB_CACHE or HF_HOME)"
        ));
    };
    let folder = cache.join(format!("models--{}--{}", parts[0], parts[1]));
    if !folder.is_dir() {
        return Err(format!(
            "{text}: not a directory, and not in the hub cache ({} does not exist; deltaserve never downloads: \
             fetch it first, e.g. `huggingface-cli download {repo}`)",
            folder.display()
        ));
    }
    snapshot(&folder, revision)
}

/// The snapshot of `revision` (a ref name under `refs/`, or a commit hash) in a repo folder.
fn snapshot(folder: &Path, revision: &str) -> Result<PathBuf, String> {
    let snapshots = folder.join("snapshots");
    let valid = |s: &str| !s.is_empty() && !s.contains(['/', '\\']) && s != "." && s != "..";
    let from_ref = valid(revision)
        .then(|| std::fs::read_to_string(folder.join("refs").join(revision)).ok())
        .flatten();
    let commit = from_ref.map_or_else(|| revision.to_string(), |hash| hash.trim().to_string());
    if valid(&commit) && snapshots.join(&commit).is_dir() {
        return Ok(snapshots.join(commit));
    }
    // No such ref: a folder with exactly one snapshot (as `huggingface-cli download` leaves it
    // with `--revision` of a commit) is that snapshot when `main` was asked for.
    let entries: Vec<PathBuf> = std::fs::read_dir(&snapshots)
        .map(|rd| {
            rd.filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.is_dir())
                .collect()
        })
        .unwrap_or_default();
    if revision == "main" && entries.len() == 1 {
        return Ok(entries[0].clone());
    }
    Err(format!(
        "{}: no snapshot for revision `{revision}` ({} snapshot(s) there; name one as `org/name@<commit>`)",
        folder.display(),
        entries.len()
    ))
}

/// The repo id (`org/name`) of a snapshot directory inside the cache layout, if it is one.
pub fn repo_id_of(dir: &Path) -> Option<String> {
    let snapshots = dir.parent()?;
    if snapshots.file_name()? != "snapshots" {
        return None;
    }
    let folder = snapshots.parent()?.file_name()?.to_str()?;
    let rest = folder.strip_prefix("models--")?;
    let (org, name) = rest.split_once("--")?;
    Some(format!("{org}/{name}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn repo(cache: &Path, id: &str, commits: &[&str], main: Option<&str>) -> PathBuf {
        let folder = cache.join(format!("models--{}", id.replace('/', "--")));
        for c in commits {
            std::fs::create_dir_all(folder.join("snapshots").join(c)).unwrap();
            std::fs::write(folder.join("snapshots").join(c).join("config.json"), "{}").unwrap();
        }
        if let Some(m) = main {
            std::fs::create_dir_all(folder.join("refs")).unwrap();
            std::fs::write(folder.join("refs/main"), format!("{m}\n")).unwrap();
        }
        folder
    }

    #[test]
    fn repo_ids_revisions_and_folders_resolve_to_snapshots() {
        let cache = tempfile::tempdir().unwrap();
        let c = cache.path();
        let folder = repo(c, "Qwen/Qwen3-0.6B", &["aaa", "bbb"], Some("bbb"));
        let snap = |commit: &str| folder.join("snapshots").join(commit);
        let id = |s: &str| resolve_model_dir(Path::new(s), Some(c));
        assert_eq!(id("Qwen/Qwen3-0.6B").unwrap(), snap("bbb"));
        assert_eq!(id("Qwen/Qwen3-0.6B@aaa").unwrap(), snap("aaa"));
        assert_eq!(resolve_model_dir(&folder, None).unwrap(), snap("bbb"));
        assert_eq!(resolve_model_dir(&snap("aaa"), None).unwrap(), snap("aaa"));
        assert_eq!(repo_id_of(&snap("aaa")).as_deref(), Some("Qwen/Qwen3-0.6B"));
        assert_eq!(repo_id_of(c), None);
        // One snapshot and no refs: that one.
        let only = repo(c, "google/gemma-2-2b", &["ccc"], None);
        assert_eq!(id("google/gemma-2-2b").unwrap(), only.join("snapshots/ccc"));
    }

    #[test]
    fn misses_name_where_they_looked() {
        let cache = tempfile::tempdir().unwrap();
        let c = cache.path();
        repo(c, "a/b", &["x", "y"], None);
        let err =
            |s: &str, cache: Option<&Path>| resolve_model_dir(Path::new(s), cache).unwrap_err();
        assert!(err("org/missing", Some(c)).contains("models--org--missing does not exist"));
        assert!(err("org/missing", Some(c)).contains("never downloads"));
        assert!(err("a/b", Some(c)).contains("no snapshot for revision `main` (2 snapshot(s)"));
        assert!(err("a/b@../x", Some(c)).contains("no snapshot for revision"));
        assert!(err("/no/such/dir", Some(c)).contains("not a directory"));
        assert!(err("../b", Some(c)).contains("not a directory"));
        assert!(err("org/name", None).contains("no hub cache"));
    }

    #[test]
    fn cache_dir_prefers_hf_hub_cache_then_hf_home_then_home() {
        let env = |vars: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                vars.iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| PathBuf::from(v))
            }
        };
        let all = env(&[("HF_HUB_CACHE", "/c"), ("HF_HOME", "/h"), ("HOME", "/u")]);
        assert_eq!(cache_dir_from(all), Some(PathBuf::from("/c")));
        let home = env(&[("HF_HOME", "/h"), ("HOME", "/u")]);
        assert_eq!(cache_dir_from(home), Some(PathBuf::from("/h/hub")));
        let user = env(&[("HOME", "/u")]);
        assert_eq!(
            cache_dir_from(user),
            Some(PathBuf::from("/u/.cache/huggingface/hub"))
        );
    }
}
