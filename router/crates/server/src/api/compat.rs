//! The peers' adapter routes, translated onto this server's variant registry, so clients and
//! gateways written for vLLM keep working (admin routes, like `/v1/adapters`):
//!
//! ```text
//!  POST /v1/load_lora_adapter    {"lora_name": "sql", "lora_path": "/srv/sql"}
//!                                -> 200 text "Success: LoRA adapter 'sql' added successfully."
//!  POST /v1/unload_lora_adapter  {"lora_name": "sql"}  (+ vLLM's optional "lora_int_id")
//!                                -> 200 text "Success: LoRA adapter 'sql' removed successfully."
//! ```
//!
//! Loading is `POST /v1/adapters` with `kind: "lora"` (the same checks, roots and worker
//! inspection; a failure is the same JSON error), unloading is `DELETE /v1/adapters/{name}`.
//! vLLM's `load_inplace` (replace a loaded adapter's weights under the same name) is refused:
//! here a name keeps its weights for its life; unload, then load.

use std::path::PathBuf;

use axum::extract::State;
use serde::Deserialize;

use deltaserve_ipc::wire::VariantKind;

use super::error::{ApiError, ApiJson};
use super::Backend;

/// `POST /v1/load_lora_adapter` body (vLLM's `LoadLoRAAdapterRequest`).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoadLoraAdapter {
    /// The name requests select it by.
    pub lora_name: String,
    /// The PEFT directory on the server.
    pub lora_path: PathBuf,
    /// vLLM: replace the weights of an adapter already loaded under this name. Only `false`.
    #[serde(default)]
    pub load_inplace: bool,
}

/// `POST /v1/unload_lora_adapter` body (vLLM's `UnloadLoRAAdapterRequest`).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UnloadLoraAdapter {
    /// The adapter's name.
    pub lora_name: String,
    /// vLLM's internal id; accepted and not needed (names are unique here).
    #[serde(default)]
    pub lora_int_id: Option<i64>,
}

/// `POST /v1/load_lora_adapter`.
pub async fn load_lora_adapter<B: Backend>(
    State(backend): State<B>,
    ApiJson(body): ApiJson<LoadLoraAdapter>,
) -> Result<String, ApiError> {
    if body.load_inplace {
        return Err(ApiError::invalid(
            "load_inplace",
            "`load_inplace` is not supported: unload the adapter, then load the new weights",
        ));
    }
    let entry = backend
        .register_adapter(body.lora_name, body.lora_path, Some(VariantKind::Lora))
        .await?;
    Ok(format!(
        "Success: LoRA adapter '{}' added successfully.",
        entry.name
    ))
}

/// `POST /v1/unload_lora_adapter`.
pub async fn unload_lora_adapter<B: Backend>(
    State(backend): State<B>,
    ApiJson(body): ApiJson<UnloadLoraAdapter>,
) -> Result<String, ApiError> {
    let _ = body.lora_int_id;
    let entry = backend.delete_adapter(body.lora_name).await?;
    Ok(format!(
        "Success: LoRA adapter '{}' removed successfully.",
        entry.name
    ))
}

#[cfg(test)]
mod tests {
    use serde_json::Value;

    use crate::api::fake::FakeBackend;
    use crate::api::router_with;
    use crate::api::test_http::post_json;
    use crate::engine::FinishReason;

    #[tokio::test]
    async fn loads_lists_and_unloads_like_vllm() {
        let fake = FakeBackend::new(FakeBackend::tokens(&["x"], FinishReason::Stop));
        let app = router_with(fake.clone());
        let post = |path: &'static str, body: &'static str| post_json(app.clone(), path, body);
        let (status, _, body) = post(
            "/v1/load_lora_adapter",
            r#"{"lora_name": "sql", "lora_path": "/srv/sql"}"#,
        )
        .await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(body, "Success: LoRA adapter 'sql' added successfully.");
        assert!(fake.model.resolve(Some("tiny:sql")).is_some());

        // The same refusals as /v1/adapters: a taken name, a delta directory, bad fields.
        for (req, status, param) in [
            (
                r#"{"lora_name": "sql", "lora_path": "/srv/other"}"#,
                409,
                Value::Null,
            ),
            (
                r#"{"lora_name": "d", "lora_path": "/srv/delta"}"#,
                400,
                "kind".into(),
            ),
            (
                r#"{"lora_name": "x", "lora_path": "/srv/x", "load_inplace": true}"#,
                400,
                "load_inplace".into(),
            ),
            (r#"{"lora_name": "x"}"#, 400, Value::Null),
            (
                r#"{"lora_name": "x", "lora_path": "/x", "bogus": 1}"#,
                400,
                "bogus".into(),
            ),
        ] {
            let (got, _, body) = post("/v1/load_lora_adapter", req).await;
            assert_eq!(got.as_u16(), status, "{req}: {body}");
            let v: Value = serde_json::from_str(&body).unwrap();
            if !param.is_null() {
                assert_eq!(v["error"]["param"], param, "{req}: {body}");
            }
        }
        assert!(fake.model.resolve(Some("tiny:d")).is_none());

        let (status, _, body) = post(
            "/v1/unload_lora_adapter",
            r#"{"lora_name": "sql", "lora_int_id": 1}"#,
        )
        .await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(body, "Success: LoRA adapter 'sql' removed successfully.");
        assert!(fake.model.resolve(Some("tiny:sql")).is_none());
        let (status, _, body) = post("/v1/unload_lora_adapter", r#"{"lora_name": "sql"}"#).await;
        assert_eq!(status, 404, "{body}");
    }
}
