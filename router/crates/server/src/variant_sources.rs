//! [`VariantSources`]: where a variant that is not registered is looked for when a request names
//! it (LoRAX-style dynamic loading), and the lock that makes concurrent first requests load it
//! once.
//!
//! ```text
//!  request model "<base>:NAME" (or bare "NAME"), NAME not registered
//!    NAME = letters, digits, - _ .     --lora-dir D  (each, in order)  -> D/NAME   (a LoRA)
//!                                      --delta-dir D (each, in order)  -> D/NAME   (a delta)
//!    NAME = org/repo                   --adapters-from-hub-cache       -> the hub cache's
//!                                        models--org--repo snapshot (either kind)
//!  found: registered under NAME exactly as POST /v1/adapters would (roots, config checks,
//!         a worker's inspection), then the request is served; nothing else waits for it
//!  not found: 404 naming where it looked     a bad directory: the registration's 400
//! ```
//!
//! The name is checked before it touches the file system (the registry's name rule: no `/` but
//! the one of `org/repo`, no `..`), so a request cannot reach outside the configured directories;
//! with `--adapter-root`, the found directory must also be inside a root, as for any
//! registration. Once registered, a variant stays until deleted.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use deltaserve_ipc::wire::VariantKind;

use crate::hub_cache;
use crate::registry::valid_name;

/// The configured sources, and one lock per name being loaded.
#[derive(Debug, Default)]
pub struct VariantSources {
    /// `--lora-dir`: directories whose subdirectories are LoRA adapters, by name.
    lora_dirs: Vec<PathBuf>,
    /// `--delta-dir`: directories whose subdirectories are compressed deltas, by name.
    delta_dirs: Vec<PathBuf>,
    /// The hub cache to look `org/repo` names up in (`--adapters-from-hub-cache`).
    hub_cache: Option<PathBuf>,
    /// Names some request is loading now: later requests for the same name wait on its lock.
    loading: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

/// A variant found in a source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FoundVariant {
    /// Its directory.
    pub dir: PathBuf,
    /// The kind its source holds (`None`: the hub cache, which holds either).
    pub kind: Option<VariantKind>,
}

impl VariantSources {
    /// Sources from the flags; `hub_cache` is the cache directory when hub lookups are on.
    pub fn new(
        lora_dirs: Vec<PathBuf>,
        delta_dirs: Vec<PathBuf>,
        hub_cache: Option<PathBuf>,
    ) -> Self {
        Self {
            lora_dirs,
            delta_dirs,
            hub_cache,
            loading: Mutex::default(),
        }
    }

    /// Whether no source is configured (request-time resolution off).
    pub fn is_empty(&self) -> bool {
        self.lora_dirs.is_empty() && self.delta_dirs.is_empty() && self.hub_cache.is_none()
    }

    /// Whether `name` could come from a source at all: a plain variant name for the directories,
    /// `org/repo` for the hub cache.
    pub fn may_hold(&self, name: &str) -> bool {
        match name.split_once('/') {
            Some(_) => self.hub_cache.is_some() && valid_name(name),
            None => !(self.lora_dirs.is_empty() && self.delta_dirs.is_empty()) && valid_name(name),
        }
    }

    /// Where `name` lives, or a sentence saying where it was looked for.
    pub fn find(&self, name: &str) -> Result<FoundVariant, String> {
        if !self.may_hold(name) {
            return Err("no variant source holds names like it".into());
        }
        if name.contains('/') {
            let cache = self.hub_cache.as_deref();
            return hub_cache::resolve_repo_id(name, cache)
                .map(|dir| FoundVariant { dir, kind: None })
                .map_err(|_| {
                    let cache = cache.map(|c| c.display().to_string()).unwrap_or_default();
                    format!("it is not in the hub cache ({cache}; nothing is downloaded)")
                });
        }
        let lora = self.lora_dirs.iter().map(|d| (d, VariantKind::Lora));
        let delta = self.delta_dirs.iter().map(|d| (d, VariantKind::Delta));
        for (dir, kind) in lora.chain(delta) {
            let candidate = dir.join(name);
            if candidate.is_dir() {
                return Ok(FoundVariant {
                    dir: candidate,
                    kind: Some(kind),
                });
            }
        }
        let looked: Vec<String> = (self
            .lora_dirs
            .iter()
            .map(|d| format!("--lora-dir {}", d.display())))
        .chain(
            self.delta_dirs
                .iter()
                .map(|d| format!("--delta-dir {}", d.display())),
        )
        .collect();
        Err(format!("no directory `{name}` in {}", looked.join(", ")))
    }

    /// The lock for loading `name`: held while one request registers it, so concurrent first
    /// requests register it once (the others find it registered when they get the lock).
    pub fn loading_lock(&self, name: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut loading = self.loading.lock().expect("variant sources lock");
        // Forget locks nobody holds or waits for, so the map stays as small as the loads in flight.
        loading.retain(|_, lock| Arc::strong_count(lock) > 1);
        loading.entry(name.to_string()).or_default().clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_by_name_in_flag_order_and_says_where_it_looked() {
        let a = tempfile::tempdir().unwrap();
        let b = tempfile::tempdir().unwrap();
        std::fs::create_dir(a.path().join("sql")).unwrap();
        std::fs::create_dir(b.path().join("sql")).unwrap();
        std::fs::create_dir(b.path().join("chat")).unwrap();
        let s = VariantSources::new(vec![a.path().into()], vec![b.path().into()], None);
        assert!(!s.is_empty());
        assert_eq!(
            s.find("sql").unwrap(),
            FoundVariant {
                dir: a.path().join("sql"),
                kind: Some(VariantKind::Lora)
            }
        );
        assert_eq!(s.find("chat").unwrap().kind, Some(VariantKind::Delta));
        let err = s.find("nope").unwrap_err();
        assert!(
            err.contains("--lora-dir") && err.contains("--delta-dir"),
            "{err}"
        );
        // Names that could leave the directories never reach the file system.
        for bad in ["..", ".", "a/../b", "../sql", "x\0", "", "org/repo"] {
            assert!(!s.may_hold(bad), "{bad:?}");
            assert!(s.find(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn hub_cache_names_are_org_slash_repo() {
        let cache = tempfile::tempdir().unwrap();
        let snap = cache.path().join("models--org--ad/snapshots/abc");
        std::fs::create_dir_all(&snap).unwrap();
        let s = VariantSources::new(vec![], vec![], Some(cache.path().into()));
        assert!(s.may_hold("org/ad"));
        assert!(
            !s.may_hold("ad"),
            "plain names need --lora-dir or --delta-dir"
        );
        assert_eq!(
            s.find("org/ad").unwrap(),
            FoundVariant {
                dir: snap,
                kind: None
            }
        );
        assert!(s.find("org/missing").unwrap_err().contains("hub cache"));
        for bad in ["org/..", "../x", "a/b/c", "/abs"] {
            assert!(!s.may_hold(bad), "{bad:?}");
        }
        // A directory that the name also spells relative to the working directory is not the
        // hub cache's: only the cache is looked in.
        // (cargo runs tests in the package directory, where `src/api` is a directory.)
        assert!(std::path::Path::new("src/api").is_dir());
        assert!(s.find("src/api").is_err());
        assert!(VariantSources::default().is_empty());
    }

    #[tokio::test]
    async fn one_lock_per_name_while_in_use() {
        let s = VariantSources::default();
        let first = s.loading_lock("a");
        let again = s.loading_lock("a");
        assert!(Arc::ptr_eq(&first, &again));
        let guard = first.lock().await;
        assert!(again.try_lock().is_err());
        drop(guard);
        drop((first, again));
        assert_eq!(s.loading.lock().unwrap().len(), 1);
        let _other = s.loading_lock("b");
        assert_eq!(
            s.loading.lock().unwrap().len(),
            1,
            "the unused lock of `a` was forgotten"
        );
    }
}
