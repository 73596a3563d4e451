//! `GET /v1/models`: the OpenAI model list: the base model, then each active variant (LoRA
//! adapter or compressed delta) as `<base>:<variant>`, with its `parent` and `kind`.

use axum::extract::State;
use axum::Json;

use super::auth::Requester;
use super::openai::{ModelCard, ModelList};
use super::Backend;
use crate::registry::VariantState;

/// The handler.
/// A tenant sees only the models it may use.
pub async fn list_models<B: Backend>(State(backend): State<B>, who: Requester) -> Json<ModelList> {
    let model = backend.model();
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
        .filter(|a| a.state == VariantState::Active);
    for adapter in active {
        data.push(card(
            format!("{}:{}", model.name, adapter.name),
            Some(model.name.clone()),
            adapter.footprint.as_ref().map(|f| f.kind.label()),
        ));
    }
    data.retain(|m| who.caller.may_use(&m.id));
    Json(ModelList {
        object: "list",
        data,
    })
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
}
