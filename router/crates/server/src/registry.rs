//! [`VariantRegistry`]: the served variants (LoRA adapters and compressed deltas, one id space)
//! by name, the one place a client's variant name becomes the internal id workers and
//! schedulers know it by (STYLE.md #15).
//!
//! An entry's life, driven by [`crate::engine::EngineHandle`]:
//!
//! ```text
//!  reserve(name) ──▶ Pending ──activate(info)──▶ Active ──begin_delete──▶ Deleting ──remove──▶ gone
//!                      └──────── cancel (inspection or registration failed) ────────▶ gone
//! ```
//!
//! Only `Active` entries resolve from a request's `model` field, so a request can never name an
//! adapter that is still being inspected or already being deleted. Names stay taken while
//! `Pending` or `Deleting`, so two registrations of one name cannot race. Ids count up from 1 and
//! are never reused in the life of the router (a worker may still hold a deleted id's pages until
//! the next step's drop ops).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, RwLock};

use deltaserve_ipc::wire::VariantKind;
use serde::{Serialize, Serializer};

use crate::roots::VariantRoots;
use crate::text::chat_template::ChatTemplate;
use crate::variant_sources::VariantSources;

/// Where an entry is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum VariantState {
    /// Being inspected by a worker and registered with the schedulers; not selectable yet.
    Pending,
    /// Selectable by requests.
    Active,
    /// Refusing new requests, waiting for its in-flight ones to finish before its memory is freed.
    Deleting,
}

/// What the worker's inspection reported about an adapter.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct VariantFootprint {
    /// `lora` (pool pages on the GPU) or `delta` (a worker delta slot on the GPU).
    #[serde(serialize_with = "kind_label")]
    pub kind: VariantKind,
    /// One line for people, e.g. `rank 16` or `4-bit 2:4, 2.6x smaller than fp16`.
    pub summary: String,
    /// GPU pool pages its weights take (0 for a delta).
    pub num_blocks: u32,
    /// Bytes of its host-memory copy.
    pub host_bytes: u64,
    /// Largest rank over its adapted projections (0 for a delta).
    pub max_rank: u32,
    /// Adapted projections (`q_proj`, ...).
    pub target_modules: Vec<String>,
}

/// Serializes a [`VariantKind`] as its wire label (`lora`, `delta`).
fn kind_label<S: Serializer>(kind: &VariantKind, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(kind.label())
}

/// One registered adapter.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct VariantEntry {
    /// The client-facing name: requests select it as `"<base>:<name>"` or `"<name>"`.
    pub name: String,
    /// The internal id (`NewRequest::adapter_id`), > 0.
    pub id: u32,
    /// The PEFT (LoRA) or `deltaserve compress` (delta) directory, absolute.
    pub path: PathBuf,
    /// Unix seconds of registration.
    pub created: u64,
    /// Where it is in its life.
    pub state: VariantState,
    /// Its footprint once inspected (`None` while pending).
    pub footprint: Option<VariantFootprint>,
}

/// Why the registry refused a name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RegistryError {
    /// The name cannot be used in a `model` field (or a URL path); the name is quoted only
    /// when it is printable and short.
    #[error("adapter name {} is invalid: use 1 to {MAX_NAME_LEN} letters, digits, '-', '_' or '.' (not `.` or `..`), or `org/repo` of two such parts", quote_name(.0))]
    BadName(String),
    /// The name is the base model's or another adapter's.
    #[error("the name `{0}` is already taken (by the base model or another adapter)")]
    Taken(String),
    /// No adapter of that name (or it is not active).
    #[error("The adapter `{0}` does not exist; GET /v1/adapters lists the registered adapters")]
    NotFound(String),
    /// The adapter is already being deleted.
    #[error("the adapter `{0}` is already being deleted")]
    Deleting(String),
}

/// Longest variant name.
pub const MAX_NAME_LEN: usize = 128;

/// Whether `name` may name a variant: URL-safe (ASCII letters, digits, `-`, `_`, `.`), not `.`
/// or `..`, at most [`MAX_NAME_LEN`] characters; or two such parts as `org/repo` (a hub repo id,
/// as request-time resolution from the hub cache registers it).
pub fn valid_name(name: &str) -> bool {
    let segment = |s: &str| {
        !s.is_empty()
            && s != "."
            && s != ".."
            && s.chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
    };
    name.len() <= MAX_NAME_LEN
        && match name.split_once('/') {
            Some((org, repo)) => segment(org) && segment(repo),
            None => segment(name),
        }
}

/// A refused name for an error message: quoted when printable and short, else described.
fn quote_name(name: &str) -> String {
    if name.len() <= MAX_NAME_LEN && name.chars().all(|c| !c.is_control()) {
        format!("`{name}`")
    } else {
        format!(
            "({} characters, some not printable or too many)",
            name.chars().count()
        )
    }
}

/// The registry: adapters by name, behind one lock (reads are per request, writes rare).
#[derive(Debug)]
pub struct VariantRegistry {
    /// The base model's served name, which no adapter may take.
    base_name: String,
    /// Where variant directories may live (`--adapter-root`).
    roots: VariantRoots,
    /// Where unregistered names are looked for at request time (`--lora-dir`, ...).
    sources: VariantSources,
    inner: RwLock<Inner>,
    /// Which zoo variants run a substitute under load (`--substitute-above`), and their counts.
    substitutions: crate::substitution::Substitutions,
}

#[derive(Debug, Default)]
struct Inner {
    by_name: BTreeMap<String, VariantEntry>,
    /// The chat templates of variants whose directories have their own, by id.
    templates: BTreeMap<u32, Arc<ChatTemplate>>,
    /// The last id handed out.
    last_id: u32,
}

impl VariantRegistry {
    /// An empty registry for a base model served as `base_name`.
    pub fn new(base_name: impl Into<String>) -> Self {
        Self::with_roots(base_name, VariantRoots::default())
    }

    /// An empty registry whose variants must live inside `roots`.
    pub fn with_roots(base_name: impl Into<String>, roots: VariantRoots) -> Self {
        Self {
            base_name: base_name.into(),
            roots,
            sources: VariantSources::default(),
            inner: RwLock::new(Inner::default()),
            substitutions: Default::default(),
        }
    }

    /// The zoo variants' substitution under load (`crate::substitution`).
    pub fn substitutions(&self) -> &crate::substitution::Substitutions {
        &self.substitutions
    }

    /// This registry, with unregistered names looked for in `sources` at request time.
    pub fn with_sources(mut self, sources: VariantSources) -> Self {
        self.sources = sources;
        self
    }

    /// Where unregistered names are looked for at request time.
    pub fn sources(&self) -> &VariantSources {
        &self.sources
    }

    /// Where variant directories may live.
    pub fn roots(&self) -> &VariantRoots {
        &self.roots
    }

    /// The base model's served name.
    pub fn base_name(&self) -> &str {
        &self.base_name
    }

    /// Takes `name` for a new adapter at `path` and hands out its id; the entry is `Pending`.
    pub fn reserve(&self, name: &str, path: PathBuf, created: u64) -> Result<u32, RegistryError> {
        if !valid_name(name) {
            return Err(RegistryError::BadName(name.to_string()));
        }
        let mut inner = self.inner.write().expect("registry lock");
        if name == self.base_name || inner.by_name.contains_key(name) {
            return Err(RegistryError::Taken(name.to_string()));
        }
        inner.last_id += 1;
        let id = inner.last_id;
        inner.by_name.insert(
            name.to_string(),
            VariantEntry {
                name: name.to_string(),
                id,
                path,
                created,
                state: VariantState::Pending,
                footprint: None,
            },
        );
        Ok(id)
    }

    /// Makes a pending entry selectable, with its inspected footprint; returns the entry.
    pub fn activate(&self, id: u32, footprint: VariantFootprint) -> Option<VariantEntry> {
        let mut inner = self.inner.write().expect("registry lock");
        let entry = inner.by_name.values_mut().find(|e| e.id == id)?;
        entry.state = VariantState::Active;
        entry.footprint = Some(footprint);
        Some(entry.clone())
    }

    /// Forgets an entry (a failed registration, or a finished deletion).
    pub fn remove(&self, id: u32) {
        let mut inner = self.inner.write().expect("registry lock");
        inner.by_name.retain(|_, e| e.id != id);
        inner.templates.remove(&id);
    }

    /// Gives a reserved entry its own chat template (its directory had one), used for chat
    /// requests to it instead of the served model's.
    pub fn set_chat_template(&self, id: u32, template: Arc<ChatTemplate>) {
        let mut inner = self.inner.write().expect("registry lock");
        if inner.by_name.values().any(|e| e.id == id) {
            inner.templates.insert(id, template);
        }
    }

    /// Variant `id`'s own chat template, if its directory had one.
    pub fn chat_template_of(&self, id: u32) -> Option<Arc<ChatTemplate>> {
        let inner = self.inner.read().expect("registry lock");
        inner.templates.get(&id).cloned()
    }

    /// Stops `name` from resolving and returns it; its memory is freed by the caller once its
    /// in-flight requests are done, then [`VariantRegistry::remove`] forgets it.
    pub fn begin_delete(&self, name: &str) -> Result<VariantEntry, RegistryError> {
        let mut inner = self.inner.write().expect("registry lock");
        let entry = inner
            .by_name
            .get_mut(name)
            .ok_or_else(|| RegistryError::NotFound(name.to_string()))?;
        match entry.state {
            VariantState::Active => {
                entry.state = VariantState::Deleting;
                Ok(entry.clone())
            }
            VariantState::Deleting => Err(RegistryError::Deleting(name.to_string())),
            VariantState::Pending => Err(RegistryError::NotFound(name.to_string())),
        }
    }

    /// The id of an active adapter.
    pub fn active_id(&self, name: &str) -> Option<u32> {
        let inner = self.inner.read().expect("registry lock");
        inner
            .by_name
            .get(name)
            .filter(|e| e.state == VariantState::Active)
            .map(|e| e.id)
    }

    /// The directory of adapter `id` (any state).
    pub fn path_of(&self, id: u32) -> Option<PathBuf> {
        let inner = self.inner.read().expect("registry lock");
        inner
            .by_name
            .values()
            .find(|e| e.id == id)
            .map(|e| e.path.clone())
    }

    /// The name of adapter `id` (any state).
    pub fn name_of(&self, id: u32) -> Option<String> {
        let inner = self.inner.read().expect("registry lock");
        inner
            .by_name
            .values()
            .find(|e| e.id == id)
            .map(|e| e.name.clone())
    }

    /// Every entry, in registration order.
    pub fn list(&self) -> Vec<VariantEntry> {
        let inner = self.inner.read().expect("registry lock");
        let mut all: Vec<VariantEntry> = inner.by_name.values().cloned().collect();
        all.sort_by_key(|e| e.id);
        all
    }

    /// Active adapters.
    pub fn num_active(&self) -> usize {
        let inner = self.inner.read().expect("registry lock");
        inner
            .by_name
            .values()
            .filter(|e| e.state == VariantState::Active)
            .count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fp() -> VariantFootprint {
        VariantFootprint {
            kind: VariantKind::Lora,
            summary: "rank 8".into(),
            num_blocks: 3,
            host_bytes: 1000,
            max_rank: 8,
            target_modules: vec!["q_proj".into()],
        }
    }

    #[test]
    fn names_are_checked_and_ids_never_reused() {
        let r = VariantRegistry::new("base");
        for bad in [
            "",
            "a:b",
            "a/b/c",
            "/b",
            "a/",
            "../b",
            "a/..",
            "a b",
            ".",
            "..",
            "%2e%2e",
            "a\0b",
            "é",
            &"x".repeat(129),
        ] {
            assert_eq!(
                r.reserve(bad, "/x".into(), 0),
                Err(RegistryError::BadName(bad.to_string()))
            );
        }
        assert_eq!(
            r.reserve("base", "/x".into(), 0),
            Err(RegistryError::Taken("base".into()))
        );
        let a = r.reserve("a", "/a".into(), 0).unwrap();
        assert_eq!(a, 1);
        assert!(valid_name("org/repo.v2"), "hub repo ids are names");
        assert_eq!(
            r.reserve("a", "/a2".into(), 0),
            Err(RegistryError::Taken("a".into())),
            "a pending name is taken"
        );
        assert_eq!(r.active_id("a"), None, "pending adapters do not resolve");
        r.activate(a, fp()).unwrap();
        assert_eq!(r.active_id("a"), Some(1));
        r.remove(a);
        assert_eq!(r.reserve("a", "/a".into(), 0), Ok(2), "ids are not reused");
    }

    #[test]
    fn deletion_stops_resolution_but_keeps_the_name() {
        let r = VariantRegistry::new("base");
        let id = r.reserve("a", "/a".into(), 0).unwrap();
        assert_eq!(
            r.begin_delete("a"),
            Err(RegistryError::NotFound("a".into())),
            "a pending adapter cannot be deleted yet"
        );
        r.activate(id, fp()).unwrap();
        let e = r.begin_delete("a").unwrap();
        assert_eq!(e.state, VariantState::Deleting);
        assert_eq!(r.active_id("a"), None);
        assert_eq!(
            r.begin_delete("a"),
            Err(RegistryError::Deleting("a".into()))
        );
        assert_eq!(
            r.reserve("a", "/a".into(), 0),
            Err(RegistryError::Taken("a".into()))
        );
        assert_eq!(r.name_of(id).as_deref(), Some("a"));
        r.remove(id);
        assert!(r.list().is_empty());
        assert_eq!(
            r.begin_delete("zzz"),
            Err(RegistryError::NotFound("zzz".into()))
        );
    }
}
