//! `GET /v1/models`: the OpenAI model list: the base model, then each active variant (LoRA
//! adapter or compressed delta) as `<base>:<variant>`, with its `parent` and `kind`; a zoo
//! variant's substitute (`<name>.substitute`, `crate::substitution`) is internal and not listed.
//! `GET /v1/models/{id}`: one of those cards (`id` as listed, or a variant's bare name), else a
//! 404. A tenant sees only the models it may use, in both.

use axum::extract::{Path, State};
use axum::Json;

use super::auth::Requester;
use super::error::ApiError;
use super::openai::{ModelCard, ModelList};
use super::tenants::Caller;
use super::Backend;
use crate::engine::ServedModel;
use crate::registry::VariantState;

/// `GET /v1/models`.
pub async fn list_models<B: Backend>(State(backend): State<B>, who: Requester) -> Json<ModelList> {
    Json(ModelList {
        object: "list",
        data: cards(backend.model(), &who.caller),
    })
}

/// `GET /v1/models/{id}`.
pub async fn get_model<B: Backend>(
    State(backend): State<B>,
    who: Requester,
    Path(id): Path<String>,
) -> Result<Json<ModelCard>, ApiError> {
    let model = backend.model();
    let wanted = match model.resolve(Some(&id)) {
        Some(variant) => model.display_name(variant),
        None => return Err(ApiError::ModelNotFound(id)),
    };
    cards(model, &who.caller)
        .into_iter()
        .find(|c| c.id == wanted)
        .map(Json)
        .ok_or(ApiError::ModelNotFound(id))
}

/// The cards of every model `caller` may use: the base, then each active variant.
fn cards(model: &ServedModel, caller: &Caller) -> Vec<ModelCard> {
    let card = |id: String, parent: Option<String>, kind: Option<&'static str>| ModelCard {
        id,
        object: "model",
        created: model.created,
        owned_by: "deltaserve",
        max_model_len: model.max_model_len,
        parent,
        kind,
    };
    let mut data = vec![card(model.name.clone(), None, None)];
    let active = model
        .adapters
        .list()
        .into_iter()
        .filter(|a| a.state == VariantState::Active)
        .filter(|a| !model.adapters.substitutions().is_substitute(&a.name));
    for adapter in active {
        data.push(card(
            format!("{}:{}", model.name, adapter.name),
            Some(model.name.clone()),
            adapter.footprint.as_ref().map(|f| f.kind.label()),
        ));
    }
    data.retain(|m| caller.may_use(&m.id));
    data
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use crate::api::fake::FakeBackend;
    use crate::api::router_with;
    use crate::api::test_http::send;
    use crate::engine::FinishReason;

    #[tokio::test]
    async fn lists_the_served_model() {
        let app = router_with(FakeBackend::new(FakeBackend::tokens(
            &[],
            FinishReason::Stop,
        )));
        let (status, _, body) = send(app, "GET", "/v1/models", None, "").await;
        assert_eq!(status, 200);
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(
            v,
            json!({"object": "list", "data": [{"id": "tiny", "object": "model", "created": 1_700_000_000u64,
                   "owned_by": "deltaserve", "max_model_len": 64}]})
        );
    }

    #[tokio::test]
    async fn gets_one_model_or_404() {
        let app = || {
            router_with(FakeBackend::new(FakeBackend::tokens(
                &[],
                FinishReason::Stop,
            )))
        };
        let (status, _, body) = send(app(), "GET", "/v1/models/tiny", None, "").await;
        assert_eq!(status, 200, "{body}");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["id"], "tiny");
        assert_eq!(v["object"], "model");
        for missing in ["/v1/models/nope", "/v1/models/tiny:nope"] {
            let (status, _, body) = send(app(), "GET", missing, None, "").await;
            assert_eq!(status, 404, "{body}");
            let v: serde_json::Value = serde_json::from_str(&body).unwrap();
            assert_eq!(v["error"]["code"], "model_not_found", "{body}");
        }
    }
}
