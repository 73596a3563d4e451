//! The adapter admin workflow, on the engine handle: registering a variant directory
//! (inspected by one worker, then added to every actor's scheduler, rolled back on any
//! failure) and deleting one (it stops resolving at once; its memory is freed once no live
//! request uses it). Also the file-system check that tells a LoRA adapter from a delta: the one
//! place a variant's kind is found (the worker is told it, in `InspectVariant` and every op).

use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use deltaserve_ipc::wire::VariantKind;
use deltaserve_sched::VariantSpec;
use tokio::sync::oneshot;

use super::command::{ActorRef, Command, RemoveOutcome};
use super::plan::sched_kind;
use super::EngineHandle;
use crate::registry::{RegistryError, VariantEntry, VariantFootprint};
use crate::text::chat_template::ChatTemplate;

/// Why registering or deleting an adapter failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum VariantError {
    /// The adapter cannot be served as given (400); `param` is the request field at fault.
    #[error("{message}")]
    Invalid {
        /// What is wrong, naming the file or field.
        message: String,
        /// The request field at fault (`name`, `path` or `kind`).
        param: &'static str,
    },
    /// The registry refused the name (bad: 400, taken or being deleted: 409, unknown: 404).
    #[error(transparent)]
    Registry(#[from] RegistryError),
    /// No worker can inspect it right now (503).
    #[error("{0}")]
    Unavailable(String),
}

impl EngineHandle {
    /// Registers the variant in `dir` as `name`: a PEFT LoRA adapter (`adapter_config.json`) or
    /// a compressed delta (`manifest.json`, written by `deltaserve compress`); with `want`, only
    /// that kind is accepted. A worker validates it against the model and reports its footprint,
    /// then every worker's scheduler learns it (nothing is loaded until a request needs it).
    /// Nothing changes when any step fails.
    pub async fn register_adapter(
        &self,
        name: &str,
        dir: &Path,
        want: Option<VariantKind>,
    ) -> Result<VariantEntry, VariantError> {
        let invalid = |message: String| VariantError::Invalid {
            message,
            param: "path",
        };
        let registry = &self.inner.model.adapters;
        let dir = registry.roots().resolve(dir).map_err(invalid)?;
        let found = variant_kind_of_dir(&dir).map_err(invalid)?;
        check_kind(found, want, &dir)?;
        if found == VariantKind::Lora {
            // Nothing a client sends may crash or freeze a worker: the config is checked here.
            super::peft_config::check_lora_config(&dir).map_err(invalid)?;
        }
        let path = dir
            .to_str()
            .ok_or_else(|| invalid(format!("adapter path {} is not UTF-8", dir.display())))?
            .to_string();
        let created = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        // A fine-tune saved with its tokenizer files may bring its own chat template.
        let template = ChatTemplate::from_variant_dir(&dir, self.inner.tokenizer.config())
            .map_err(|e| invalid(format!("its chat template: {e}")))?;
        let id = registry.reserve(name, dir.clone(), created)?;
        if let Some(template) = template {
            registry.set_chat_template(id, Arc::new(template));
        }
        match self.register_reserved(id, path, found).await {
            Ok(footprint) => Ok(registry
                .activate(id, footprint)
                .expect("a reserved entry stays until activated or removed")),
            Err(e) => {
                registry.remove(id);
                Err(e)
            }
        }
    }

    /// Inspects on one ready worker (which must agree that the directory holds a `found`), then
    /// registers with every actor (rolling back on failure).
    async fn register_reserved(
        &self,
        id: u32,
        path: String,
        found: VariantKind,
    ) -> Result<VariantFootprint, VariantError> {
        let actor = self
            .inner
            .actors
            .iter()
            .find(|a| a.ready.load(Ordering::Acquire))
            .ok_or_else(|| {
                VariantError::Unavailable(
                    "no worker is ready to inspect the adapter; retry shortly".into(),
                )
            })?;
        let gone = || VariantError::Unavailable("the engine is shutting down".into());
        let (reply, rx) = oneshot::channel();
        actor
            .tx
            .send(Command::Inspect {
                path: path.clone(),
                kind: found,
                reply,
            })
            .map_err(|_| gone())?;
        let info = rx
            .await
            .map_err(|_| gone())?
            .map_err(VariantError::Unavailable)?;
        if let Some(message) = info.error {
            // The worker's words may quote the files' contents: those stay in the log.
            tracing::info!(path = %path, "variant inspection refused: {message}");
            return Err(VariantError::Invalid {
                message: crate::validate::sanitize_file_message(&message),
                param: "path",
            });
        }
        let kind = info.kind;
        if kind != found {
            return Err(VariantError::Invalid {
                message: format!(
                    "the worker inspected {path} as a {} but its files make it a {}",
                    describe(kind),
                    describe(found)
                ),
                param: "path",
            });
        }
        let spec = VariantSpec {
            kind: sched_kind(kind),
            num_blocks: info.num_blocks,
            host_bytes: info.host_bytes,
            path,
        };
        let mut added = Vec::new();
        for actor in &self.inner.actors {
            let (reply, rx) = oneshot::channel();
            let sent = actor.tx.send(Command::AddAdapter {
                id,
                name: self.inner.model.adapters.name_of(id).unwrap_or_default(),
                spec: spec.clone(),
                reply,
            });
            let outcome = match sent {
                Ok(()) => rx
                    .await
                    .unwrap_or_else(|_| Err("the engine is shutting down".into())),
                Err(_) => Err("the engine is shutting down".into()),
            };
            if let Err(message) = outcome {
                for done in added {
                    let _ = self.remove_from(done, id).await;
                }
                return Err(VariantError::Invalid {
                    message,
                    param: "path",
                });
            }
            added.push(actor);
        }
        Ok(VariantFootprint {
            kind,
            summary: info.summary,
            num_blocks: info.num_blocks,
            host_bytes: info.host_bytes,
            max_rank: info.max_rank,
            target_modules: info.target_modules,
        })
    }

    /// Deletes adapter `name`: it stops resolving at once; this waits until no live request uses
    /// it on any worker, then frees its memory and forgets it. The wait runs in its own task, so
    /// a client that goes away does not leave the adapter half deleted.
    pub async fn delete_adapter(&self, name: &str) -> Result<VariantEntry, VariantError> {
        let entry = self.inner.model.adapters.begin_delete(name)?;
        let this = self.clone();
        let id = entry.id;
        let task = tokio::spawn(async move {
            for actor in &this.inner.actors {
                this.remove_from(actor, id).await;
            }
            this.inner.model.adapters.remove(id);
        });
        task.await
            .map_err(|e| VariantError::Unavailable(format!("deleting the adapter failed: {e}")))?;
        Ok(entry)
    }

    /// Asks `actor` to forget adapter `id` until it has (polling while requests still use it).
    async fn remove_from(&self, actor: &ActorRef, id: u32) {
        loop {
            let (reply, rx) = oneshot::channel();
            if actor.tx.send(Command::RemoveAdapter { id, reply }).is_err() {
                return;
            }
            match rx.await {
                Ok(RemoveOutcome::InUse(_)) => tokio::time::sleep(Duration::from_millis(20)).await,
                Ok(RemoveOutcome::Removed) | Err(_) => return,
            }
        }
    }
}

/// The kind of variant in `dir`, from its marker file: `adapter_config.json` (a PEFT LoRA
/// adapter) or `manifest.json` (a compressed delta written by `deltaserve compress`). The error
/// names both files.
pub fn variant_kind_of_dir(dir: &Path) -> Result<VariantKind, String> {
    let lora = dir.join("adapter_config.json").is_file();
    let delta = dir.join("manifest.json").is_file();
    match (lora, delta) {
        (true, false) => Ok(VariantKind::Lora),
        (false, true) => Ok(VariantKind::Delta),
        (false, false) => Err(format!(
            "no adapter_config.json (a PEFT LoRA adapter) or manifest.json (a compressed delta \
             from `deltaserve compress`) in {}",
            dir.display()
        )),
        (true, true) => Err(format!(
            "{} holds both adapter_config.json (a PEFT LoRA adapter) and manifest.json (a \
             compressed delta): it must be one or the other",
            dir.display()
        )),
    }
}

/// Refuses the `found` variant in `dir` when the caller asked for another kind (`want`); the
/// message names both kinds and their marker files (400, `param` = `kind`).
pub fn check_kind(
    found: VariantKind,
    want: Option<VariantKind>,
    dir: &Path,
) -> Result<(), VariantError> {
    match want {
        Some(want) if want != found => Err(VariantError::Invalid {
            message: format!(
                "{} holds a {}, not a {}",
                dir.display(),
                describe(found),
                describe(want)
            ),
            param: "kind",
        }),
        _ => Ok(()),
    }
}

/// A kind as people know it, with the file that marks it.
fn describe(kind: VariantKind) -> &'static str {
    match kind {
        VariantKind::Lora => "LoRA adapter (adapter_config.json)",
        VariantKind::Delta => "compressed delta (manifest.json, from `deltaserve compress`)",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn directories_are_told_apart_by_their_marker_file() {
        let root = tempfile::tempdir().unwrap();
        let make = |name: &str, files: &[&str]| {
            let dir = root.path().join(name);
            std::fs::create_dir(&dir).unwrap();
            for f in files {
                std::fs::write(dir.join(f), "{}").unwrap();
            }
            dir
        };
        let lora = make("lora", &["adapter_config.json"]);
        let delta = make("delta", &["manifest.json"]);
        let empty = make("empty", &[]);
        let both = make("both", &["adapter_config.json", "manifest.json"]);
        assert_eq!(variant_kind_of_dir(&lora), Ok(VariantKind::Lora));
        assert_eq!(variant_kind_of_dir(&delta), Ok(VariantKind::Delta));
        let err = variant_kind_of_dir(&empty).unwrap_err();
        assert!(
            err.contains("adapter_config.json") && err.contains("manifest.json"),
            "{err}"
        );
        assert!(variant_kind_of_dir(&both).unwrap_err().contains("both"));

        assert!(check_kind(VariantKind::Lora, None, &lora).is_ok());
        assert!(check_kind(VariantKind::Delta, Some(VariantKind::Delta), &delta).is_ok());
        let VariantError::Invalid { message, param } =
            check_kind(VariantKind::Lora, Some(VariantKind::Delta), &lora).unwrap_err()
        else {
            panic!("a kind mismatch is invalid input");
        };
        assert_eq!(param, "kind");
        assert!(
            message.contains("holds a LoRA adapter") && message.contains("not a compressed delta"),
            "{message}"
        );
        let VariantError::Invalid { message, .. } =
            check_kind(VariantKind::Delta, Some(VariantKind::Lora), &delta).unwrap_err()
        else {
            panic!("a kind mismatch is invalid input");
        };
        assert!(
            message.contains("holds a compressed delta") && message.contains("not a LoRA"),
            "{message}"
        );
    }
}
