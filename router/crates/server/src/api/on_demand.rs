//! Request-time resolution: before a generation request is validated, a `model` field naming a
//! variant that is not registered is looked for in the configured sources
//! ([`crate::variant_sources`]) and registered, so the request is then served like any other.
//!
//! ```text
//!  model resolves already / no sources / another base / caller may not use it  -> nothing here
//!  (validation answers: served, or the usual 404 that leaks nothing)
//!  else: take the name's loading lock; registered meanwhile? done
//!        found in a source  -> register (roots, config checks, a worker's inspection): a bad
//!                              one is that registration's 400, and nothing changes
//!        not found          -> 404 `model_not_found` naming where it looked
//! ```
//!
//! Registering only inspects the files; the weights load when the scheduler first needs them,
//! as for any variant, so other requests never wait for it.

use super::error::ApiError;
use super::tenants::Caller;
use super::Backend;

/// Registers the variant `requested` names when it is not registered but a source has it.
pub async fn resolve_variant<B: Backend>(
    backend: &B,
    requested: Option<&str>,
    caller: &Caller,
) -> Result<(), ApiError> {
    let model = backend.model();
    let sources = model.adapters.sources();
    let Some(requested) = requested else {
        return Ok(());
    };
    if sources.is_empty() || model.resolve(Some(requested)).is_some() {
        return Ok(());
    }
    let name = match requested.split_once(':') {
        Some((base, name)) if base == model.name => name,
        Some(_) => return Ok(()),
        None => requested,
    };
    if !sources.may_hold(name) || !caller.may_use(&format!("{}:{name}", model.name)) {
        return Ok(());
    }
    let lock = sources.loading_lock(name);
    let _loading = lock.lock().await;
    if model.resolve(Some(requested)).is_some() {
        return Ok(()); // a concurrent first request registered it
    }
    let found = sources
        .find(name)
        .map_err(|looked| ApiError::VariantNotFound(requested.to_string(), looked))?;
    let entry = backend
        .register_adapter(name.to_string(), found.dir, found.kind)
        .await?;
    tracing::info!(
        adapter = %entry.name,
        id = entry.id,
        path = %entry.path.display(),
        "variant registered at its first request"
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use serde_json::{json, Value};

    use crate::api::fake::FakeBackend;
    use crate::api::router_with;
    use crate::api::test_http::post_json;
    use crate::engine::{FinishReason, ServedModel};
    use crate::registry::VariantRegistry;
    use crate::variant_sources::VariantSources;

    fn backend(lora_dir: &std::path::Path) -> FakeBackend {
        let mut fake = FakeBackend::new(FakeBackend::tokens(&["x"], FinishReason::Stop));
        let registry = VariantRegistry::new("tiny").with_sources(VariantSources::new(
            vec![lora_dir.to_path_buf()],
            vec![],
            None,
        ));
        fake.model = Arc::new(ServedModel {
            adapters: Arc::new(registry),
            ..(*fake.model).clone()
        });
        fake
    }

    async fn complete(fake: &FakeBackend, model: &str) -> (u16, Value) {
        let body = json!({"model": model, "prompt": "hi", "max_tokens": 1}).to_string();
        let (status, _, text) = post_json(router_with(fake.clone()), "/v1/completions", body).await;
        (status.as_u16(), serde_json::from_str(&text).unwrap())
    }

    #[tokio::test]
    async fn an_unregistered_adapter_in_a_lora_dir_is_served_on_first_use() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("sql")).unwrap();
        std::fs::create_dir(dir.path().join("bad-dora")).unwrap();
        let fake = backend(dir.path());

        let (status, v) = complete(&fake, "tiny:sql").await;
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["model"], "tiny:sql");
        let id = fake.model.resolve(Some("sql")).expect("registered");
        let (status, _) = complete(&fake, "sql").await;
        assert_eq!(status, 200);
        assert_eq!(fake.model.resolve(Some("sql")), Some(id), "registered once");

        let (status, v) = complete(&fake, "tiny:nope").await;
        assert_eq!(status, 404, "{v}");
        assert_eq!(v["error"]["code"], "model_not_found");
        let message = v["error"]["message"].as_str().unwrap();
        assert!(message.contains("--lora-dir"), "{message}");

        // A directory the worker refuses: the registration's 400, and nothing registered.
        let (status, v) = complete(&fake, "tiny:bad-dora").await;
        assert_eq!(status, 400, "{v}");
        assert!(fake.model.resolve(Some("bad-dora")).is_none());
        // Names that could leave the directory, and other bases, are plain 404s.
        for model in ["tiny:..", "tiny:a/../sql", "other:sql"] {
            let (status, v) = complete(&fake, model).await;
            assert_eq!(status, 404, "{model}: {v}");
        }
        assert_eq!(fake.model.adapters.list().len(), 1);
    }
}
