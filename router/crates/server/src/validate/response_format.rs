//! `response_format` (both endpoints): checked here and turned into the one grammar string the
//! worker's llguidance matcher compiles (`SamplingParams::grammar`, llguidance's JSON form):
//!
//! ```text
//!  {"type": "text"} | absent                          ─▶ None (unconstrained)
//!  {"type": "json_object"}                            ─▶ {"grammars": [{"json_schema": {"type": "object", ..}}]}
//!  {"type": "json_schema", "json_schema":
//!     {"name": .., "schema": {..}, "strict": ..}}     ─▶ {"grammars": [{"json_schema": <schema + x-guidance>}]}
//!  anything else                                      ─▶ 400 naming the field
//! ```
//!
//! What the router cannot check (a `$ref` that points nowhere, a keyword llguidance does not
//! support) the worker finds when it compiles the grammar at admission: the request then fails
//! with a 400 whose message starts with [`GRAMMAR_REFUSED`] (the batch runs on). A schema without
//! `strict: true` is enforced all the same (the grammar is the only way this server follows one).

use deltaserve_ipc::wire::SamplingParams;
use serde_json::{json, Map, Value};

use crate::api::error::ApiError;

/// How a worker's refusal of a request's grammar starts (the engine's error message; the API
/// answers it with a 400 instead of a 500).
pub const GRAMMAR_REFUSED: &str = "the structured-output grammar was refused by the worker: ";

/// The longest `json_schema.name` (OpenAI's limit).
const MAX_NAME_LEN: usize = 64;

/// Puts the grammar `response_format` asks for on `sampling` and checks the fields a grammar
/// cannot honour ([`check_grammar_fields`]).
pub fn apply(
    response_format: Option<&Value>,
    sampling: &mut SamplingParams,
) -> Result<(), ApiError> {
    sampling.grammar = grammar(response_format)?;
    check_grammar_fields(sampling)
}

/// The grammar `response_format` asks for (`None`: unconstrained text), or a 400 naming the
/// field that is wrong.
pub fn grammar(response_format: Option<&Value>) -> Result<Option<String>, ApiError> {
    let Some(value) = response_format else {
        return Ok(None);
    };
    let obj = match value {
        Value::Null => return Ok(None),
        Value::Object(obj) => obj,
        _ => {
            return Err(ApiError::invalid(
                "response_format",
                "`response_format` must be an object such as {\"type\": \"json_object\"}",
            ))
        }
    };
    let kind = obj.get("type").and_then(Value::as_str).ok_or_else(|| {
        ApiError::invalid(
            "response_format.type",
            "`response_format.type` is required: `text`, `json_object` or `json_schema`",
        )
    })?;
    let allowed: &[&str] = match kind {
        "text" | "json_object" => &["type"],
        "json_schema" => &["type", "json_schema"],
        other => {
            return Err(ApiError::invalid(
                "response_format.type",
                format!(
                    "`response_format.type` must be `text`, `json_object` or `json_schema`, got `{other}`"
                ),
            ))
        }
    };
    if let Some(extra) = obj.keys().find(|k| !allowed.contains(&k.as_str())) {
        return Err(ApiError::invalid(
            format!("response_format.{extra}"),
            format!("`response_format.{extra}` is not a field of a `{kind}` response format"),
        ));
    }
    match kind {
        "text" => Ok(None),
        "json_object" => Ok(Some(schema_grammar(&json!({"type": "object"})))),
        _ => json_schema(obj.get("json_schema")).map(|schema| Some(schema_grammar(&schema))),
    }
}

/// The llguidance grammar (JSON form) that matches JSON documents valid against `schema`,
/// written as `json.dumps` writes them (`", "` and `": "` separators, no other whitespace: a
/// model cannot pad the document with whitespace forever). The schema's own `x-guidance` options
/// (llguidance's extension) win over these.
pub fn schema_grammar(schema: &Value) -> String {
    let mut options = json!({
        "whitespace_flexible": false,
        "item_separator": ", ",
        "key_separator": ": ",
    });
    let schema = match schema {
        Value::Object(obj) => {
            let mut obj = obj.clone();
            if let (Some(Value::Object(own)), Some(merged)) =
                (obj.get("x-guidance"), options.as_object_mut())
            {
                merged.extend(own.clone());
            }
            obj.insert("x-guidance".into(), options);
            Value::Object(obj)
        }
        Value::Bool(true) => json!({"x-guidance": options.take()}),
        other => other.clone(),
    };
    json!({"grammars": [{"json_schema": schema}]}).to_string()
}

/// The schema of a `json_schema` response format (`{}`, any JSON value, when it has none).
fn json_schema(value: Option<&Value>) -> Result<Value, ApiError> {
    const PARAM: &str = "response_format.json_schema";
    let obj: &Map<String, Value> = value.and_then(Value::as_object).ok_or_else(|| {
        ApiError::invalid(
            PARAM,
            "`response_format.json_schema` must be an object with a `name` and a `schema`",
        )
    })?;
    for (key, v) in obj {
        let ok = match key.as_str() {
            "name" => v.as_str().is_some_and(valid_name),
            "description" => v.is_string(),
            "schema" => v.is_object() || v.is_boolean(),
            "strict" => v.is_boolean() || v.is_null(),
            _ => {
                return Err(ApiError::invalid(
                    format!("{PARAM}.{key}"),
                    format!("`{PARAM}.{key}` is not a field of a JSON schema response format"),
                ))
            }
        };
        if !ok {
            let what = match key.as_str() {
                "name" => "a string of 1 to 64 letters, digits, `_` or `-`",
                "description" => "a string",
                "schema" => "a JSON Schema object",
                _ => "a boolean",
            };
            return Err(ApiError::invalid(
                format!("{PARAM}.{key}"),
                format!("`{PARAM}.{key}` must be {what}"),
            ));
        }
    }
    if !obj.contains_key("name") {
        return Err(ApiError::invalid(
            format!("{PARAM}.name"),
            format!("`{PARAM}.name` is required"),
        ));
    }
    Ok(obj.get("schema").cloned().unwrap_or_else(|| json!({})))
}

/// Refuses the sampling fields a grammar cannot honour: `min_tokens` (a complete grammar allows
/// only EOS, which `min_tokens` bans: nothing would be left to sample).
pub fn check_grammar_fields(sampling: &SamplingParams) -> Result<(), ApiError> {
    if sampling.grammar.is_some() && sampling.min_tokens > 0 {
        return Err(ApiError::invalid(
            "min_tokens",
            "`min_tokens` cannot be combined with `response_format` or a forced tool call",
        ));
    }
    Ok(())
}

/// OpenAI's rule for schema and function names: 1 to 64 of `a-zA-Z0-9_-`.
pub fn valid_name(name: &str) -> bool {
    (1..=MAX_NAME_LEN).contains(&name.len())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

#[cfg(test)]
mod tests {
    use super::*;

    fn param(v: Value) -> String {
        match grammar(Some(&v)).unwrap_err() {
            ApiError::InvalidRequest { param, .. } => param.unwrap_or_default(),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn formats_become_one_grammar() {
        assert_eq!(grammar(None).unwrap(), None);
        assert_eq!(grammar(Some(&json!({"type": "text"}))).unwrap(), None);
        let object = grammar(Some(&json!({"type": "json_object"})))
            .unwrap()
            .unwrap();
        let object: Value = serde_json::from_str(&object).unwrap();
        assert_eq!(object["grammars"][0]["json_schema"]["type"], "object");
        assert_eq!(
            object["grammars"][0]["json_schema"]["x-guidance"]["whitespace_flexible"],
            false
        );
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let rf = json!({"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": true}});
        let g: Value = serde_json::from_str(&grammar(Some(&rf)).unwrap().unwrap()).unwrap();
        let mut got = g["grammars"][0]["json_schema"].clone();
        got.as_object_mut().unwrap().remove("x-guidance");
        assert_eq!(got, schema);
    }

    #[test]
    fn bad_formats_name_the_field() {
        assert_eq!(param(json!("json")), "response_format");
        assert_eq!(param(json!({"type": "yaml"})), "response_format.type");
        assert_eq!(param(json!({})), "response_format.type");
        assert_eq!(
            param(json!({"type": "json_object", "schema": {}})),
            "response_format.schema"
        );
        assert_eq!(
            param(json!({"type": "json_schema"})),
            "response_format.json_schema"
        );
        assert_eq!(
            param(json!({"type": "json_schema", "json_schema": {"schema": {}}})),
            "response_format.json_schema.name"
        );
        assert_eq!(
            param(json!({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}})),
            "response_format.json_schema.schema"
        );
        assert_eq!(
            param(json!({"type": "json_schema", "json_schema": {"name": "a b"}})),
            "response_format.json_schema.name"
        );
    }
}
