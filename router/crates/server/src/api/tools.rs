//! `tools` / `tool_choice` / `parallel_tool_calls` on `/v1/chat/completions`: checked here,
//! turned into a grammar where the call is forced, and the generated text turned back into
//! `tool_calls` (whole, or as streamed deltas).
//!
//! ```text
//!  tool_choice          grammar (SamplingParams::grammar)               the text is            answer
//!  none                 —                                                content                content
//!  auto (default)       —                                                content, maybe with    tool_calls parsed from
//!                                                                        <tool_call>{json}      Hermes-style tags, the
//!                                                                        </tool_call> blocks    rest as content
//!  required             JSON array (1.., or exactly 1 without            [{"name": .., "arguments": {..}}, ..]
//!                       parallel_tool_calls) of {name: const, arguments: that tool's parameters}
//!  {"function": {name}} that tool's `parameters` schema                  the arguments          one tool call
//! ```
//!
//! `auto` leaves the model free, as vLLM's tool parsers do: most tool-tuned chat templates
//! (Qwen 2.5/3, Hermes, SmolLM3) tell the model to answer calls as `<tool_call>{"name": ..,
//! "arguments": {..}}</tool_call>`, so those blocks (naming a tool of the request, arguments an
//! object) become `tool_calls`; anything else stays content. `required` follows vLLM's grammar for
//! it. The answer's `finish_reason` is `tool_calls` when it has calls and ended by EOS.
//!
//! Streaming: a named function's arguments stream as they are generated (`function.arguments`
//! pieces after a first delta with the call's `id`, `type` and `name`); `auto` streams content
//! as it comes, holding back only what may begin a `<tool_call>` tag, and from the first tag on
//! waits for the end (its calls, and the content after them, come in the choice's last deltas);
//! `required` needs the whole array, so its calls come in the choice's last deltas.

use deltaserve_ipc::wire::SamplingParams;
use serde_json::{json, Map, Value};

use super::error::ApiError;
use super::openai::{
    ChatCompletionRequest, ChatDelta, FunctionCall, FunctionCallDelta, ToolCall, ToolCallDelta,
};
use super::response_id;
use crate::validate::response_format::{check_grammar_fields, schema_grammar, valid_name};

/// Opening tag of a Hermes-style tool call in `auto` mode.
pub const CALL_OPEN: &str = "<tool_call>";
/// Closing tag of a Hermes-style tool call.
pub const CALL_CLOSE: &str = "</tool_call>";

/// One function of `tools`.
#[derive(Debug, Clone)]
pub struct ToolSpec {
    /// `function.name`.
    pub name: String,
    /// `function.parameters` (`{"type": "object"}` when absent: any object).
    pub parameters: Value,
}

/// What `tool_choice` asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolMode {
    /// No calls: plain content (the tools may still be shown to the template).
    None,
    /// The model decides; Hermes-style blocks are parsed.
    Auto,
    /// At least one call (exactly one unless `parallel`), enforced by a grammar.
    Required {
        /// `parallel_tool_calls` (default true).
        parallel: bool,
    },
    /// One call of this function, enforced by a grammar.
    Named(String),
}

/// The request's checked tools.
#[derive(Debug, Clone)]
pub struct Tools {
    /// The functions, in request order.
    pub specs: Vec<ToolSpec>,
    /// What `tool_choice` asks for.
    pub mode: ToolMode,
    /// `parallel_tool_calls` (default true): with `false`, `auto` keeps only the first call.
    pub parallel: bool,
}

impl Tools {
    /// The grammar that enforces the call (`required`, a named function), `None` otherwise.
    pub fn grammar(&self) -> Option<String> {
        match &self.mode {
            ToolMode::None | ToolMode::Auto => None,
            ToolMode::Named(name) => self
                .specs
                .iter()
                .find(|s| &s.name == name)
                .map(|s| schema_grammar(&s.parameters)),
            ToolMode::Required { parallel } => {
                let one_of: Vec<Value> = self
                    .specs
                    .iter()
                    .map(|s| {
                        json!({
                            "type": "object",
                            "properties": {"name": {"const": s.name}, "arguments": s.parameters},
                            "required": ["name", "arguments"],
                            "additionalProperties": false,
                        })
                    })
                    .collect();
                let mut schema =
                    json!({"type": "array", "minItems": 1, "items": {"anyOf": one_of}});
                if !parallel {
                    schema["maxItems"] = json!(1);
                }
                Some(schema_grammar(&schema))
            }
        }
    }

    /// The calls in a choice's generated `text`, and the content left (module docs); no calls
    /// for `none`, or when the text does not parse (e.g. cut by `max_tokens`).
    pub fn parse(&self, text: &str) -> (Vec<FunctionCall>, Option<String>) {
        let plain = || (Vec::new(), Some(text.to_string()));
        match &self.mode {
            ToolMode::None => plain(),
            ToolMode::Named(name) => (
                vec![FunctionCall {
                    name: name.clone(),
                    arguments: text.to_string(),
                }],
                None,
            ),
            ToolMode::Required { .. } => {
                let Ok(Value::Array(items)) = serde_json::from_str::<Value>(text) else {
                    return plain();
                };
                let calls: Option<Vec<FunctionCall>> =
                    items.iter().map(|i| self.call_of(i)).collect();
                match calls {
                    Some(calls) if !calls.is_empty() => (calls, None),
                    _ => plain(),
                }
            }
            ToolMode::Auto => {
                let mut calls = Vec::new();
                let mut content = String::new();
                let mut rest = text;
                while let Some(start) = rest.find(CALL_OPEN) {
                    let body = &rest[start + CALL_OPEN.len()..];
                    let Some(end) = body.find(CALL_CLOSE) else {
                        break;
                    };
                    let call = serde_json::from_str::<Value>(body[..end].trim())
                        .ok()
                        .and_then(|v| self.call_of(&v));
                    match call {
                        Some(call) => {
                            content.push_str(&rest[..start]);
                            calls.push(call);
                        }
                        None => content
                            .push_str(&rest[..start + CALL_OPEN.len() + end + CALL_CLOSE.len()]),
                    }
                    rest = &body[end + CALL_CLOSE.len()..];
                }
                content.push_str(rest);
                if calls.is_empty() {
                    return plain();
                }
                if !self.parallel {
                    calls.truncate(1);
                }
                let content = content.trim();
                (calls, (!content.is_empty()).then(|| content.to_string()))
            }
        }
    }

    /// `{"name": <a tool of the request>, "arguments": {..}}` (arguments may also be a JSON
    /// string of an object, as some models write them) as a call.
    fn call_of(&self, value: &Value) -> Option<FunctionCall> {
        let name = value.get("name")?.as_str()?;
        if !self.specs.iter().any(|s| s.name == name) {
            return None;
        }
        let arguments = match value.get("arguments").or_else(|| value.get("parameters"))? {
            Value::Object(m) => Value::Object(m.clone()).to_string(),
            Value::String(s) if serde_json::from_str::<Map<String, Value>>(s).is_ok() => s.clone(),
            _ => return None,
        };
        Some(FunctionCall {
            name: name.to_string(),
            arguments,
        })
    }
}

/// The calls as the response message's `tool_calls`, each with a fresh id.
pub fn with_ids(calls: Vec<FunctionCall>) -> Vec<ToolCall> {
    calls
        .into_iter()
        .map(|function| ToolCall {
            id: response_id("call"),
            kind: "function",
            function,
        })
        .collect()
}

/// The request's checked tools (`None`: no tools); a forced call's grammar goes on `sampling`
/// (whose `response_format` grammar, if any, is already there: the two cannot be combined).
pub fn check_into(
    req: &ChatCompletionRequest,
    sampling: &mut SamplingParams,
) -> Result<Option<Tools>, ApiError> {
    let tools = check(
        req.tools.as_ref(),
        req.tool_choice.as_ref(),
        req.parallel_tool_calls,
    )?;
    if let Some(grammar) = tools.as_ref().and_then(Tools::grammar) {
        if sampling.grammar.is_some() {
            return Err(ApiError::invalid(
                "tool_choice",
                "a forced tool call (`required` or a named function) cannot be combined with `response_format`",
            ));
        }
        sampling.grammar = Some(grammar);
        check_grammar_fields(sampling)?;
    }
    Ok(tools)
}

/// The request's `tools` as the chat template gets them (HF's `tools` variable).
pub fn for_template(req: &ChatCompletionRequest) -> Option<&[Value]> {
    req.tools
        .as_ref()
        .and_then(Value::as_array)
        .map(Vec::as_slice)
}

/// Checks `tools`, `tool_choice` and `parallel_tool_calls`; `None` when there are no tools (and
/// `tool_choice` is absent or `none`). Every refusal names its field.
pub fn check(
    tools: Option<&Value>,
    tool_choice: Option<&Value>,
    parallel_tool_calls: Option<bool>,
) -> Result<Option<Tools>, ApiError> {
    let specs = match tools {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(items)) => items
            .iter()
            .enumerate()
            .map(|(i, item)| tool_spec(i, item))
            .collect::<Result<Vec<_>, _>>()?,
        Some(_) => {
            return Err(ApiError::invalid(
                "tools",
                "`tools` must be an array of {\"type\": \"function\", \"function\": {...}}",
            ))
        }
    };
    for (i, spec) in specs.iter().enumerate() {
        if specs[..i].iter().any(|s| s.name == spec.name) {
            return Err(ApiError::invalid(
                format!("tools[{i}].function.name"),
                format!("two tools are named `{}`", spec.name),
            ));
        }
    }
    let parallel = parallel_tool_calls.unwrap_or(true);
    let mode = match tool_choice {
        None | Some(Value::Null) => {
            if specs.is_empty() {
                ToolMode::None
            } else {
                ToolMode::Auto
            }
        }
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolMode::None,
            "auto" => ToolMode::Auto,
            "required" => ToolMode::Required { parallel },
            other => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    format!("`tool_choice` must be `none`, `auto`, `required` or {{\"type\": \"function\", \"function\": {{\"name\": ..}}}}, got `{other}`"),
                ))
            }
        },
        Some(v) => {
            let name = (v.get("type").and_then(Value::as_str) == Some("function"))
                .then(|| v.get("function")?.get("name")?.as_str())
                .flatten()
                .ok_or_else(|| {
                    ApiError::invalid(
                        "tool_choice",
                        "`tool_choice` as an object must be {\"type\": \"function\", \"function\": {\"name\": ..}}",
                    )
                })?;
            if !specs.iter().any(|s| s.name == name) {
                return Err(ApiError::invalid(
                    "tool_choice",
                    format!("`tool_choice` names `{name}`, which is not one of `tools`"),
                ));
            }
            ToolMode::Named(name.to_string())
        }
    };
    if specs.is_empty() && mode != ToolMode::None {
        return Err(ApiError::invalid(
            "tool_choice",
            "`tool_choice` other than `none` needs `tools`",
        ));
    }
    if specs.is_empty() {
        return Ok(None);
    }
    Ok(Some(Tools {
        specs,
        mode,
        parallel,
    }))
}

/// `tools[i]`, checked.
fn tool_spec(i: usize, item: &Value) -> Result<ToolSpec, ApiError> {
    let at = |field: &str| format!("tools[{i}]{field}");
    let obj = item
        .as_object()
        .ok_or_else(|| ApiError::invalid(at(""), format!("`{}` must be an object", at(""))))?;
    if obj.get("type").and_then(Value::as_str) != Some("function") {
        return Err(ApiError::invalid(
            at(".type"),
            format!("`{}` must be `function`", at(".type")),
        ));
    }
    if let Some(extra) = obj
        .keys()
        .find(|k| !["type", "function"].contains(&k.as_str()))
    {
        let field = at(&format!(".{extra}"));
        return Err(ApiError::invalid(
            &field,
            format!("`{field}` is not a field of a tool"),
        ));
    }
    let function = obj
        .get("function")
        .and_then(Value::as_object)
        .ok_or_else(|| {
            ApiError::invalid(
                at(".function"),
                format!("`{}` must be an object with a `name`", at(".function")),
            )
        })?;
    let mut name = None;
    let mut parameters = json!({"type": "object"});
    for (key, v) in function {
        let field = at(&format!(".function.{key}"));
        match key.as_str() {
            "name" => match v.as_str() {
                Some(n) if valid_name(n) => name = Some(n.to_string()),
                _ => {
                    return Err(ApiError::invalid(
                        &field,
                        format!("`{field}` must be 1 to 64 letters, digits, `_` or `-`"),
                    ))
                }
            },
            "description" if v.is_string() || v.is_null() => {}
            "strict" if v.is_boolean() || v.is_null() => {}
            "parameters" => {
                let is_object_schema = v
                    .as_object()
                    .is_some_and(|m| m.get("type").is_none_or(|t| t == "object"));
                if !is_object_schema {
                    return Err(ApiError::invalid(
                        &field,
                        format!(
                            "`{field}` must be a JSON Schema of an object (`\"type\": \"object\"`)"
                        ),
                    ));
                }
                parameters = v.clone();
            }
            "description" | "strict" => {
                return Err(ApiError::invalid(
                    &field,
                    format!("`{field}` has the wrong type"),
                ))
            }
            _ => {
                return Err(ApiError::invalid(
                    &field,
                    format!("`{field}` is not a field of a function"),
                ))
            }
        }
    }
    let name = name.ok_or_else(|| {
        let field = at(".function.name");
        ApiError::invalid(&field, format!("`{field}` is required"))
    })?;
    Ok(ToolSpec { name, parameters })
}

/// One streamed choice's tool-call state (module docs: a named function's arguments stream;
/// `auto` streams content until a `<tool_call>` tag may begin, and is parsed from there at the
/// end; `required` is parsed at the end).
#[derive(Debug, Default)]
pub struct ToolStream {
    /// The text not sent yet (`auto`: from where a call may begin; `required`: all of it).
    text: String,
    /// A named function's call has been opened (its first delta sent); `auto`: a call tag
    /// appeared, so the rest waits for the end.
    opened: bool,
}

impl ToolStream {
    /// The deltas for a piece of generated `text` (none while it is buffered).
    pub fn text(&mut self, tools: &Tools, text: String) -> Vec<ChatDelta> {
        match &tools.mode {
            ToolMode::None => vec![content_delta(text)],
            ToolMode::Named(name) => {
                let first = !std::mem::replace(&mut self.opened, true);
                vec![ChatDelta {
                    tool_calls: Some(vec![ToolCallDelta {
                        index: 0,
                        id: first.then(|| response_id("call")),
                        kind: first.then_some("function"),
                        function: FunctionCallDelta {
                            name: first.then(|| name.clone()),
                            arguments: text,
                        },
                    }]),
                    ..ChatDelta::default()
                }]
            }
            ToolMode::Auto => {
                self.text.push_str(&text);
                if self.opened {
                    return Vec::new();
                }
                let safe = match self.text.find(CALL_OPEN) {
                    Some(start) => {
                        self.opened = true;
                        start
                    }
                    None => self.text.len() - partial_tag(&self.text),
                };
                if safe == 0 {
                    return Vec::new();
                }
                vec![content_delta(self.text.drain(..safe).collect())]
            }
            ToolMode::Required { .. } => {
                self.text.push_str(&text);
                Vec::new()
            }
        }
    }

    /// The last deltas of a choice that ended with `reason`, and the finish reason to send.
    pub fn finish(
        &mut self,
        tools: &Tools,
        reason: &'static str,
    ) -> (Vec<ChatDelta>, &'static str) {
        match &tools.mode {
            ToolMode::None => (Vec::new(), reason),
            ToolMode::Named(_) => {
                let mut out = Vec::new();
                if !self.opened {
                    out = self.text(tools, String::new());
                }
                (
                    out,
                    if reason == "stop" {
                        "tool_calls"
                    } else {
                        reason
                    },
                )
            }
            ToolMode::Auto | ToolMode::Required { .. } => {
                let text = std::mem::take(&mut self.text);
                let (calls, content) = tools.parse(&text);
                let mut out: Vec<ChatDelta> = content
                    .filter(|c| !c.is_empty())
                    .into_iter()
                    .map(content_delta)
                    .collect();
                let has_calls = !calls.is_empty();
                for (index, call) in with_ids(calls).into_iter().enumerate() {
                    out.push(ChatDelta {
                        tool_calls: Some(vec![ToolCallDelta {
                            index: index as u32,
                            id: Some(call.id),
                            kind: Some("function"),
                            function: FunctionCallDelta {
                                name: Some(call.function.name),
                                arguments: call.function.arguments,
                            },
                        }]),
                        ..ChatDelta::default()
                    });
                }
                (out, finish_reason(has_calls, reason))
            }
        }
    }
}

/// The length of the longest end of `text` that begins [`CALL_OPEN`] (held back while streaming).
fn partial_tag(text: &str) -> usize {
    (1..CALL_OPEN.len())
        .rev()
        .find(|&k| {
            text.len() >= k
                && text.is_char_boundary(text.len() - k)
                && CALL_OPEN.starts_with(&text[text.len() - k..])
        })
        .unwrap_or(0)
}

/// `tool_calls` when the answer has calls and ended normally, else `reason`.
pub fn finish_reason(has_calls: bool, reason: &'static str) -> &'static str {
    if has_calls && reason == "stop" {
        "tool_calls"
    } else {
        reason
    }
}

fn content_delta(text: String) -> ChatDelta {
    ChatDelta {
        content: Some(text),
        ..ChatDelta::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weather() -> Value {
        json!([{"type": "function", "function": {"name": "get_weather", "description": "d",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
            {"type": "function", "function": {"name": "noop"}}])
    }

    fn param(tools: Value, choice: Option<Value>) -> String {
        match check(Some(&tools), choice.as_ref(), None).unwrap_err() {
            ApiError::InvalidRequest { param, .. } => param.unwrap_or_default(),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn tool_choice_modes_and_grammars() {
        let t = check(Some(&weather()), None, None).unwrap().unwrap();
        assert_eq!(t.mode, ToolMode::Auto);
        assert!(t.grammar().is_none());
        let named = json!({"type": "function", "function": {"name": "get_weather"}});
        let t = check(Some(&weather()), Some(&named), None)
            .unwrap()
            .unwrap();
        let g: Value = serde_json::from_str(&t.grammar().unwrap()).unwrap();
        assert_eq!(g["grammars"][0]["json_schema"]["required"], json!(["city"]));
        let t = check(Some(&weather()), Some(&json!("required")), Some(false))
            .unwrap()
            .unwrap();
        let g: Value = serde_json::from_str(&t.grammar().unwrap()).unwrap();
        let schema = &g["grammars"][0]["json_schema"];
        assert_eq!(
            (schema["minItems"].clone(), schema["maxItems"].clone()),
            (json!(1), json!(1))
        );
        assert_eq!(
            schema["items"]["anyOf"][1]["properties"]["name"],
            json!({"const": "noop"})
        );
        assert!(check(None, Some(&json!("none")), None).unwrap().is_none());
        assert!(check(Some(&json!([])), None, None).unwrap().is_none());
    }

    #[test]
    fn bad_tools_name_the_field() {
        assert_eq!(param(json!({}), None), "tools");
        assert_eq!(param(json!([{"type": "fn"}]), None), "tools[0].type");
        assert_eq!(
            param(json!([{"type": "function", "function": {}}]), None),
            "tools[0].function.name"
        );
        assert_eq!(
            param(
                json!([{"type": "function", "function": {"name": "a", "parameters": {"type": "array"}}}]),
                None
            ),
            "tools[0].function.parameters"
        );
        assert_eq!(param(weather(), Some(json!("sometimes"))), "tool_choice");
        let missing = json!({"type": "function", "function": {"name": "nope"}});
        assert_eq!(param(weather(), Some(missing)), "tool_choice");
        assert_eq!(param(json!([]), Some(json!("required"))), "tool_choice");
        let twice = json!([{"type": "function", "function": {"name": "a"}}, {"type": "function", "function": {"name": "a"}}]);
        assert_eq!(param(twice, None), "tools[1].function.name");
    }

    #[test]
    fn outputs_become_tool_calls() {
        let auto = check(Some(&weather()), None, None).unwrap().unwrap();
        let text = "Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
        let (calls, content) = auto.parse(text);
        assert_eq!(calls.len(), 1);
        assert_eq!(
            (calls[0].name.as_str(), calls[0].arguments.as_str()),
            ("get_weather", r#"{"city":"Paris"}"#)
        );
        assert_eq!(content.as_deref(), Some("Let me look."));
        // An unknown tool or a broken block stays content.
        let (calls, content) =
            auto.parse("<tool_call>{\"name\": \"rm\", \"arguments\": {}}</tool_call>");
        assert!(calls.is_empty() && content.unwrap().contains("rm"));
        let required = check(Some(&weather()), Some(&json!("required")), None)
            .unwrap()
            .unwrap();
        let (calls, content) = required.parse(
            r#"[{"name":"noop","arguments":{}},{"name":"get_weather","arguments":{"city":"x"}}]"#,
        );
        assert_eq!(calls.len(), 2);
        assert!(content.is_none());
        let (calls, _) = required.parse(r#"[{"name":"noop","argu"#);
        assert!(calls.is_empty(), "a cut-off answer stays content");
    }

    #[test]
    fn auto_streams_content_until_a_call_tag_may_begin() {
        let auto = check(Some(&weather()), None, None).unwrap().unwrap();
        let mut s = ToolStream::default();
        let content =
            |d: Vec<ChatDelta>| d.into_iter().filter_map(|d| d.content).collect::<String>();
        assert_eq!(content(s.text(&auto, "Sure, ".into())), "Sure, ");
        assert_eq!(
            content(s.text(&auto, "one <tool".into())),
            "one ",
            "a tag's start is held back"
        );
        assert_eq!(
            content(s.text(&auto, "_call>{\"name\": \"noop\", ".into())),
            ""
        );
        assert!(s
            .text(&auto, "\"arguments\": {}}</tool_call>".into())
            .is_empty());
        let (last, reason) = s.finish(&auto, "stop");
        assert_eq!(reason, "tool_calls");
        let call = last[0].tool_calls.as_ref().unwrap()[0].clone();
        assert_eq!(
            (
                call.function.name.as_deref(),
                call.function.arguments.as_str()
            ),
            (Some("noop"), "{}")
        );
        let mut plain = ToolStream::default();
        assert_eq!(content(plain.text(&auto, "a <".into())), "a ");
        assert_eq!(content(plain.text(&auto, " b".into())), "< b");
        let (last, reason) = plain.finish(&auto, "stop");
        assert!(last.is_empty() && reason == "stop");
    }

    #[test]
    fn a_named_call_streams_its_arguments() {
        let named = json!({"type": "function", "function": {"name": "get_weather"}});
        let t = check(Some(&weather()), Some(&named), None)
            .unwrap()
            .unwrap();
        let mut s = ToolStream::default();
        let first = serde_json::to_value(&s.text(&t, "{\"ci".into())[0]).unwrap();
        assert_eq!(
            first["tool_calls"][0]["function"],
            json!({"name": "get_weather", "arguments": "{\"ci"})
        );
        assert_eq!(first["tool_calls"][0]["type"], "function");
        let next = serde_json::to_value(&s.text(&t, "ty\"}".into())[0]).unwrap();
        assert_eq!(
            next["tool_calls"][0],
            json!({"index": 0, "function": {"arguments": "ty\"}"}})
        );
        assert_eq!(s.finish(&t, "stop").1, "tool_calls");
    }
}
