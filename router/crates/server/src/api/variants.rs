//! The adapter admin API: register, list and delete variants while serving: LoRA adapters
//! (PEFT directories) and compressed full fine-tunes ("deltas", `deltaserve compress` output).
//!
//! ```text
//!  POST   /v1/adapters          {"name": "sql", "path": "/srv/adapters/sql"}  -> 201 adapter card
//!                               (+ optional "kind": "lora" | "delta", asserted)
//!  GET    /v1/adapters          -> {"object": "list", "data": [adapter card, ...]}
//!  DELETE /v1/adapters/{name}   -> 200 {"id": name, "object": "adapter", "deleted": true}
//! ```
//!
//! The kind is told from the directory (`adapter_config.json`: LoRA, `manifest.json`: delta);
//! a `kind` in the body must match it. Registration validates the variant on a worker before
//! anything changes (a bad one is a 400 naming the file or field, a taken name a 409); nothing
//! is loaded until a request needs it.
//! Deletion makes the name unresolvable at once, waits for the adapter's in-flight requests, then
//! frees its memory; the name becomes free when the response is sent.

use std::path::PathBuf;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};

use deltaserve_ipc::wire::VariantKind;

use super::error::{ApiError, ApiJson};
use super::Backend;
use crate::registry::{VariantEntry, VariantState};

/// `POST /v1/adapters` body.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateAdapter {
    /// The name clients will select it by (`"<base>:<name>"` or `"<name>"`).
    pub name: String,
    /// The PEFT LoRA directory or `deltaserve compress` delta directory, on the server's
    /// filesystem.
    pub path: PathBuf,
    /// The kind the caller expects; registration is refused (400) when the directory holds the
    /// other one. Absent: whichever the directory holds.
    #[serde(default)]
    pub kind: Option<KindField>,
}

/// `kind` as the API spells it.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KindField {
    /// A PEFT LoRA adapter.
    Lora,
    /// A compressed full fine-tune.
    Delta,
}

impl From<KindField> for VariantKind {
    fn from(k: KindField) -> Self {
        match k {
            KindField::Lora => VariantKind::Lora,
            KindField::Delta => VariantKind::Delta,
        }
    }
}

/// One adapter as the API shows it.
#[derive(Debug, Serialize)]
pub struct VariantCard {
    /// The adapter's name.
    pub id: String,
    /// Always `"adapter"`.
    pub object: &'static str,
    /// What to put in a request's `model` field: `"<base>:<name>"`.
    pub model: String,
    /// The base model it applies to.
    pub parent: String,
    /// `lora` or `delta` (once inspected; `null` while pending).
    pub kind: Option<&'static str>,
    /// One line for people: `rank 16`, `4-bit 2:4, 2.6x smaller than fp16`, ...
    pub summary: Option<String>,
    /// The directory it was loaded from (PEFT or delta).
    pub path: String,
    /// Unix seconds of registration.
    pub created: u64,
    /// `pending`, `active` or `deleting`.
    pub status: VariantState,
    /// Largest rank over its adapted projections (0 for a delta).
    pub max_rank: Option<u32>,
    /// Adapted projections.
    pub target_modules: Vec<String>,
    /// GPU pool pages its weights take when resident (0 for a delta, which takes a delta slot).
    pub num_blocks: Option<u32>,
    /// Bytes of its host-memory copy.
    pub host_bytes: Option<u64>,
}

impl VariantCard {
    fn new(base: &str, e: VariantEntry) -> Self {
        let fp = e.footprint;
        Self {
            model: format!("{base}:{}", e.name),
            id: e.name,
            object: "adapter",
            parent: base.to_string(),
            kind: fp.as_ref().map(|f| f.kind.label()),
            summary: fp.as_ref().map(|f| f.summary.clone()),
            path: e.path.display().to_string(),
            created: e.created,
            status: e.state,
            max_rank: fp.as_ref().map(|f| f.max_rank),
            target_modules: fp
                .as_ref()
                .map(|f| f.target_modules.clone())
                .unwrap_or_default(),
            num_blocks: fp.as_ref().map(|f| f.num_blocks),
            host_bytes: fp.as_ref().map(|f| f.host_bytes),
        }
    }
}

/// `GET /v1/adapters` body.
#[derive(Debug, Serialize)]
pub struct AdapterList {
    /// Always `"list"`.
    pub object: &'static str,
    /// Every registered adapter, in registration order.
    pub data: Vec<VariantCard>,
}

/// `DELETE /v1/adapters/{name}` body.
#[derive(Debug, Serialize)]
pub struct AdapterDeleted {
    /// The deleted adapter's name.
    pub id: String,
    /// Always `"adapter"`.
    pub object: &'static str,
    /// Always true (failures are errors).
    pub deleted: bool,
}

/// `POST /v1/adapters`.
pub async fn create_adapter<B: Backend>(
    State(backend): State<B>,
    ApiJson(body): ApiJson<CreateAdapter>,
) -> Result<Response, ApiError> {
    let entry = backend
        .register_adapter(body.name, body.path, body.kind.map(VariantKind::from))
        .await?;
    let card = VariantCard::new(&backend.model().name, entry);
    Ok((StatusCode::CREATED, Json(card)).into_response())
}

/// `GET /v1/adapters`.
pub async fn list_adapters<B: Backend>(State(backend): State<B>) -> Json<AdapterList> {
    let model = backend.model();
    Json(AdapterList {
        object: "list",
        data: model
            .adapters
            .list()
            .into_iter()
            .map(|e| VariantCard::new(&model.name, e))
            .collect(),
    })
}

/// `DELETE /v1/adapters/{name}`.
pub async fn delete_adapter<B: Backend>(
    State(backend): State<B>,
    Path(name): Path<String>,
) -> Result<Json<AdapterDeleted>, ApiError> {
    let entry = backend.delete_adapter(name).await?;
    Ok(Json(AdapterDeleted {
        id: entry.name,
        object: "adapter",
        deleted: true,
    }))
}

#[cfg(test)]
mod tests {
    use serde_json::{json, Value};

    use crate::api::fake::FakeBackend;
    use crate::api::router_with;
    use crate::api::test_http::{post_json, send};
    use crate::engine::FinishReason;

    fn app() -> (FakeBackend, axum::Router) {
        let fake = FakeBackend::new(FakeBackend::tokens(&["x"], FinishReason::Stop));
        (fake.clone(), router_with(fake))
    }

    fn json_of(body: &str) -> Value {
        serde_json::from_str(body).unwrap()
    }

    /// `POST /v1/adapters` with a JSON body: status, headers, body text.
    async fn post(
        app: &axum::Router,
        body: &'static str,
    ) -> (axum::http::StatusCode, axum::http::HeaderMap, String) {
        post_json(app.clone(), "/v1/adapters", body).await
    }

    /// Posts `req` and asserts the refusal: HTTP `status`, a message containing `text`, and the
    /// `param` field when one is given.
    async fn assert_refused(
        app: &axum::Router,
        req: &'static str,
        status: u16,
        text: &str,
        param: Option<&str>,
    ) {
        let (got, _, body) = post(app, req).await;
        assert_eq!(got.as_u16(), status, "{req}: {body}");
        let err = &json_of(&body)["error"];
        assert!(
            err["message"].as_str().unwrap().contains(text),
            "{req}: {body}"
        );
        if let Some(p) = param {
            assert_eq!(err["param"], p, "{req}: {body}");
        }
    }

    #[tokio::test]
    async fn register_list_select_and_delete() {
        let (_, app) = app();
        let (status, _, body) = post(&app, r#"{"name": "sql", "path": "/adapters/sql"}"#).await;
        assert_eq!(status, 201, "{body}");
        let card = json_of(&body);
        assert_eq!(card["id"], "sql");
        assert_eq!(card["model"], "tiny:sql");
        assert_eq!(card["status"], "active");
        assert_eq!(card["max_rank"], 8);
        assert_eq!(card["kind"], "lora");
        assert_eq!(card["summary"], "rank 8");

        let (_, _, body) = send(app.clone(), "GET", "/v1/adapters", None, "").await;
        let list = json_of(&body);
        assert_eq!(list["object"], "list");
        assert_eq!(list["data"].as_array().unwrap().len(), 1);

        let (_, _, body) = send(app.clone(), "GET", "/v1/models", None, "").await;
        let ids: Vec<Value> = json_of(&body)["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["id"].clone())
            .collect();
        assert_eq!(ids, [json!("tiny"), json!("tiny:sql")]);

        let complete_sql = || {
            post_json(
                app.clone(),
                "/v1/completions",
                r#"{"model": "tiny:sql", "prompt": "hi", "max_tokens": 1}"#,
            )
        };
        let (status, _, body) = complete_sql().await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(json_of(&body)["model"], "tiny:sql");

        let (status, _, body) = send(app.clone(), "DELETE", "/v1/adapters/sql", None, "").await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(
            json_of(&body),
            json!({"id": "sql", "object": "adapter", "deleted": true})
        );
        let (status, _, body) = complete_sql().await;
        assert_eq!(status, 404, "deleted adapters no longer resolve: {body}");
    }

    #[tokio::test]
    async fn refusals_are_clear_and_change_nothing() {
        let (fake, app) = app();
        let (status, _, body) = post(&app, r#"{"name": "a", "path": "/adapters/a"}"#).await;
        assert_eq!(status, 201, "{body}");

        let cases: [(&str, u16, &str, Option<&str>); 6] = [
            (
                r#"{"name": "a", "path": "/adapters/a"}"#,
                409,
                "already taken",
                None,
            ),
            (
                r#"{"name": "tiny", "path": "/adapters/b"}"#,
                409,
                "already taken",
                None,
            ),
            (
                r#"{"name": "x:y", "path": "/adapters/b"}"#,
                400,
                "invalid",
                Some("name"),
            ),
            (
                r#"{"name": "b", "path": "/adapters/bad-dora"}"#,
                400,
                "use_dora",
                Some("path"),
            ),
            (r#"{"name": "b"}"#, 400, "path", None),
            (
                r#"{"name": "b", "path": "/x", "rank": 4}"#,
                400,
                "rank",
                None,
            ),
        ];
        for (req, want_status, want_text, want_param) in cases {
            assert_refused(&app, req, want_status, want_text, want_param).await;
        }
        assert_eq!(
            crate::api::Backend::model(&fake).adapters.list().len(),
            1,
            "refusals left the registry as it was"
        );

        let (status, _, body) = send(app.clone(), "DELETE", "/v1/adapters/nope", None, "").await;
        assert_eq!(status, 404, "{body}");
        let err = &json_of(&body)["error"];
        assert_eq!(err["code"], "adapter_not_found");
        assert!(err["message"]
            .as_str()
            .unwrap()
            .contains("GET /v1/adapters"));
    }

    #[tokio::test]
    async fn deltas_register_like_adapters_and_a_given_kind_is_asserted() {
        let (fake, app) = app();
        let (status, _, body) = post(&app, r#"{"name": "ft", "path": "/deltas/ft"}"#).await;
        assert_eq!(status, 201, "{body}");
        let card = json_of(&body);
        assert_eq!(card["kind"], "delta", "told from the directory");
        assert_eq!(card["summary"], "4-bit 2:4, 2.6x smaller than fp16");
        assert_eq!(card["num_blocks"], 0);
        assert_eq!(card["model"], "tiny:ft");
        let (status, _, body) = post(
            &app,
            r#"{"name": "ft2", "path": "/deltas/ft2", "kind": "delta"}"#,
        )
        .await;
        assert_eq!(status, 201, "{body}");
        let (status, _, body) = post(
            &app,
            r#"{"name": "sql", "path": "/adapters/sql", "kind": "lora"}"#,
        )
        .await;
        assert_eq!(status, 201, "{body}");

        let cases: [(&str, &str, Option<&str>); 3] = [
            (
                r#"{"name": "x", "path": "/adapters/x", "kind": "delta"}"#,
                "not a compressed delta",
                Some("kind"),
            ),
            (
                r#"{"name": "x", "path": "/deltas/x", "kind": "lora"}"#,
                "not a LoRA adapter",
                Some("kind"),
            ),
            (
                r#"{"name": "x", "path": "/deltas/x", "kind": "full"}"#,
                "kind",
                None,
            ),
        ];
        for (req, want_text, want_param) in cases {
            assert_refused(&app, req, 400, want_text, want_param).await;
        }
        assert_eq!(crate::api::Backend::model(&fake).adapters.list().len(), 3);

        let (_, _, body) = send(app.clone(), "GET", "/v1/models", None, "").await;
        let models = json_of(&body);
        let kinds: Vec<(Value, Value)> = models["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| (m["id"].clone(), m["kind"].clone()))
            .collect();
        assert_eq!(
            kinds,
            [
                (json!("tiny"), Value::Null),
                (json!("tiny:ft"), json!("delta")),
                (json!("tiny:ft2"), json!("delta")),
                (json!("tiny:sql"), json!("lora")),
            ]
        );
        let (status, _, body) = post_json(
            app.clone(),
            "/v1/completions",
            r#"{"model": "ft", "prompt": "hi", "max_tokens": 1}"#,
        )
        .await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(json_of(&body)["model"], "tiny:ft");
    }
}
