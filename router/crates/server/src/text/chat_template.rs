//! [`ChatTemplate`]: the model's Jinja chat template, rendered the way HF `transformers` does.
//!
//! The template comes from `tokenizer_config.json`'s `chat_template` (a string, or a list of
//! `{name, template}` of which `default` is used) or else from `chat_template.jinja`. It is
//! compiled once with minijinja, with HF's environment settings (`trim_blocks`, `lstrip_blocks`)
//! and Python string/dict/list methods from minijinja-contrib's `pycompat` (`.strip()`,
//! `.startswith()`, `.items()`, ...), and sees the variables HF passes: `messages`,
//! `add_generation_prompt`, `bos_token`, `eos_token`, `tools` (when the request has tools),
//! any `chat_template_kwargs`, plus a `raise_exception(msg)` function. A list-valued
//! `chat_template` may also name a `tool_use` template, which HF uses when tools are given.
//!
//! Tool-calling conversations pass through as HF expects them: an assistant message's
//! `tool_calls` (with `function.arguments` parsed from OpenAI's JSON string into an object, as
//! tool templates index into it), and a `tool` message's `tool_call_id` and `name`.

use std::collections::BTreeMap;
use std::path::Path;

use minijinja::{Environment, ErrorKind};
use serde::{Deserialize, Deserializer, Serialize};
use serde_json::{Map, Value};

use super::tokenizer::TokenizerConfig;
use super::TextError;

/// Name of the compiled template inside the environment.
const TEMPLATE_NAME: &str = "chat";

/// Name of the template used when the request has tools (HF's list entry of that name).
const TOOL_TEMPLATE_NAME: &str = "tool_use";

/// Variables the renderer sets itself; `chat_template_kwargs` may not replace them.
pub const RESERVED_VARIABLES: &[&str] = &[
    "messages",
    "tools",
    "add_generation_prompt",
    "bos_token",
    "eos_token",
];

/// What a render sees besides the messages.
#[derive(Debug, Clone, Copy, Default)]
pub struct RenderOptions<'a> {
    /// End with the assistant's turn header.
    pub add_generation_prompt: bool,
    /// The request's `tools` (OpenAI's `[{type: "function", function: {...}}]`), passed as
    /// `tools`; `None` leaves the variable undefined, as HF does.
    pub tools: Option<&'a [Value]>,
    /// The request's `chat_template_kwargs`: extra variables (e.g. `enable_thinking`).
    pub kwargs: Option<&'a Map<String, Value>>,
}

impl RenderOptions<'_> {
    /// A prompt for the assistant's next turn, with nothing else.
    pub fn generation() -> Self {
        Self {
            add_generation_prompt: true,
            ..Self::default()
        }
    }
}

/// One message of a conversation, as the OpenAI API sends it.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, ... (passed to the template as is).
    pub role: String,
    /// The text, given as a string or as `{type: "text", text}` parts; `null` reads as empty.
    #[serde(default)]
    pub content: MessageContent,
    /// An assistant turn's calls: `[{id, type: "function", function: {name, arguments}}]`.
    #[serde(default)]
    pub tool_calls: Option<Vec<Value>>,
    /// A `tool` message: the id of the call it answers.
    #[serde(default)]
    pub tool_call_id: Option<String>,
    /// The author's name (for a `tool` message, the function's).
    #[serde(default)]
    pub name: Option<String>,
}

/// A message's content: OpenAI allows a string or a list of typed parts.
#[derive(Debug, Clone, PartialEq)]
pub enum MessageContent {
    /// Plain text.
    Text(String),
    /// Parts; only `text` parts are supported (the model is text-only).
    Parts(Vec<ContentPart>),
}

impl Default for MessageContent {
    fn default() -> Self {
        MessageContent::Text(String::new())
    }
}

/// One part of a multi-part message content.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct ContentPart {
    /// The part's kind; anything but `text` is refused when the message is rendered.
    #[serde(rename = "type")]
    pub kind: String,
    /// The text of a `text` part.
    #[serde(default)]
    pub text: Option<String>,
}

impl<'de> Deserialize<'de> for MessageContent {
    /// Accepts a string, an array of parts, or null, with an error that says which forms exist.
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        match Value::deserialize(d)? {
            Value::Null => Ok(MessageContent::Text(String::new())),
            Value::String(s) => Ok(MessageContent::Text(s)),
            Value::Array(items) => items
                .into_iter()
                .enumerate()
                .map(|(i, v)| {
                    ContentPart::deserialize(v)
                        .map_err(|e| D::Error::custom(format!("part {i}: {e}")))
                })
                .collect::<Result<Vec<_>, _>>()
                .map(MessageContent::Parts),
            other => Err(D::Error::custom(format!(
                "expected a string or an array of content parts, got {}",
                json_kind(&other)
            ))),
        }
    }
}

/// The JSON type of a value, for error messages.
pub(crate) fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

impl MessageContent {
    /// The content as one string: parts concatenated. Errors name the first non-text part.
    pub fn text(&self) -> Result<String, String> {
        match self {
            MessageContent::Text(s) => Ok(s.clone()),
            MessageContent::Parts(parts) => {
                let mut out = String::new();
                for (i, part) in parts.iter().enumerate() {
                    match (part.kind.as_str(), &part.text) {
                        ("text", Some(t)) => out.push_str(t),
                        ("text", None) => return Err(format!("part {i} has no `text`")),
                        (kind, _) => {
                            return Err(format!(
                                "part {i} has type `{kind}`; only `text` parts are supported"
                            ))
                        }
                    }
                }
                Ok(out)
            }
        }
    }
}

/// What the template sees of a message; absent fields stay undefined, as in HF.
#[derive(Serialize)]
struct RenderedMessage<'a> {
    role: &'a str,
    content: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_calls: Option<Vec<Value>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_call_id: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    name: Option<&'a str>,
}

impl<'a> RenderedMessage<'a> {
    /// Message `i` as the template sees it; errors name the message and field.
    fn new(i: usize, m: &'a ChatMessage) -> Result<Self, TextError> {
        let content = m
            .content
            .text()
            .map_err(|e| TextError::Template(format!("messages[{i}].content: {e}")))?;
        let tool_calls = m
            .tool_calls
            .as_ref()
            .map(|calls| {
                calls
                    .iter()
                    .enumerate()
                    .map(|(j, call)| {
                        template_tool_call(call).map_err(|e| {
                            TextError::Template(format!("messages[{i}].tool_calls[{j}]{e}"))
                        })
                    })
                    .collect::<Result<Vec<_>, _>>()
            })
            .transpose()?;
        Ok(Self {
            role: &m.role,
            content,
            tool_calls,
            tool_call_id: m.tool_call_id.as_deref(),
            name: m.name.as_deref(),
        })
    }
}

/// One tool call as templates index into it: `function.arguments` an object, parsed from
/// OpenAI's JSON string. The error continues a path (`.function.arguments: ...`).
fn template_tool_call(call: &Value) -> Result<Value, String> {
    let mut call = call.clone();
    let function = call
        .get_mut("function")
        .and_then(Value::as_object_mut)
        .ok_or_else(|| ": a tool call needs a `function` object".to_string())?;
    if !matches!(function.get("name"), Some(Value::String(_))) {
        return Err(".function: needs a string `name`".into());
    }
    if let Some(Value::String(args)) = function.get("arguments") {
        let parsed: Value = serde_json::from_str(args)
            .map_err(|e| format!(".function.arguments: not JSON ({e})"))?;
        function.insert("arguments".into(), parsed);
    }
    Ok(call)
}

/// A compiled chat template plus the special tokens it prints.
pub struct ChatTemplate {
    /// minijinja environment holding the compiled template under [`TEMPLATE_NAME`].
    env: Environment<'static>,
    /// Passed as `bos_token` (empty string when the tokenizer has none).
    bos_token: String,
    /// Passed as `eos_token` (empty string when the tokenizer has none).
    eos_token: String,
    /// Whether a `tool_use` template was compiled beside the default one.
    has_tool_template: bool,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("bos_token", &self.bos_token)
            .finish()
    }
}

impl ChatTemplate {
    /// The model directory's chat template, or `None` when it has none.
    pub fn from_model_dir(dir: impl AsRef<Path>) -> Result<Option<Self>, TextError> {
        let dir = dir.as_ref();
        let config = TokenizerConfig::from_model_dir(dir)?;
        Self::from_dir_with_tokens(
            dir,
            &config,
            config.bos_token.clone(),
            config.eos_token.clone(),
        )
    }

    /// A variant directory's own chat template (a fine-tune saved with its tokenizer files), or
    /// `None` when it has none. Special tokens the variant's `tokenizer_config.json` does not
    /// name are the base model's (`base`).
    pub fn from_variant_dir(dir: &Path, base: &TokenizerConfig) -> Result<Option<Self>, TextError> {
        let config = TokenizerConfig::from_model_dir(dir)?;
        let bos = config.bos_token.clone().or_else(|| base.bos_token.clone());
        let eos = config.eos_token.clone().or_else(|| base.eos_token.clone());
        Self::from_dir_with_tokens(dir, &config, bos, eos)
    }

    /// `--chat-template FILE`: the file's text is the template; the special tokens are the
    /// served model's (`config`).
    pub fn from_file(path: &Path, config: &TokenizerConfig) -> Result<Self, TextError> {
        let source = std::fs::read_to_string(path).map_err(|source| TextError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Self::new(source, config.bos_token.clone(), config.eos_token.clone()).map_err(|e| match e {
            TextError::Template(m) => TextError::Config {
                path: path.display().to_string(),
                message: m,
            },
            other => other,
        })
    }

    /// The template `config` (read from `dir`) names, else `dir/chat_template.jinja`.
    fn from_dir_with_tokens(
        dir: &Path,
        config: &TokenizerConfig,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> Result<Option<Self>, TextError> {
        let config_path = dir.join("tokenizer_config.json").display().to_string();
        let in_config = |message: String| TextError::Config {
            path: config_path.clone(),
            message,
        };
        let jinja_path = dir.join("chat_template.jinja").display().to_string();
        let mut origin = config_path.clone();
        let (source, tool_source) = match &config.chat_template {
            Some(Value::String(s)) => (Some(s.clone()), None),
            Some(Value::Array(list)) => {
                let named = |name: &str| {
                    list.iter()
                        .find(|t| t.get("name").and_then(Value::as_str) == Some(name))
                        .and_then(|t| t.get("template"))
                        .and_then(Value::as_str)
                        .map(str::to_string)
                };
                match named("default") {
                    Some(s) => (Some(s), named(TOOL_TEMPLATE_NAME)),
                    None => {
                        return Err(in_config(
                            "`chat_template` is a list without a `default` entry".into(),
                        ))
                    }
                }
            }
            Some(other) => {
                return Err(in_config(format!(
                    "`chat_template` must be a string or a list, not {}",
                    json_kind(other)
                )))
            }
            None => {
                let path = dir.join("chat_template.jinja");
                origin = jinja_path;
                match std::fs::read_to_string(&path) {
                    Ok(s) => (Some(s), None),
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => (None, None),
                    Err(source) => {
                        return Err(TextError::Io {
                            path: path.display().to_string(),
                            source,
                        })
                    }
                }
            }
        };
        let Some(source) = source else {
            return Ok(None);
        };
        let mut template = Self::new(source, bos_token, eos_token).map_err(|e| match e {
            TextError::Template(message) => TextError::Config {
                path: origin,
                message,
            },
            other => other,
        })?;
        if let Some(tool_source) = tool_source {
            template
                .env
                .add_template_owned(TOOL_TEMPLATE_NAME, tool_source)
                .map_err(|e| in_config(format!("the `tool_use` template cannot compile: {e}")))?;
            template.has_tool_template = true;
        }
        Ok(Some(template))
    }

    /// Compiles `source` with HF's settings.
    pub fn new(
        source: String,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> Result<Self, TextError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |message: String| -> Result<String, minijinja::Error> {
                Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
            },
        );
        env.add_template_owned(TEMPLATE_NAME, source)
            .map_err(|e| TextError::Template(format!("cannot compile: {e}")))?;
        Ok(Self {
            env,
            bos_token: bos_token.unwrap_or_default(),
            eos_token: eos_token.unwrap_or_default(),
            has_tool_template: false,
        })
    }

    /// The prompt text for `messages`, ending with the assistant's turn header when
    /// `options.add_generation_prompt`. A template's `raise_exception` becomes an error with
    /// its message; a `chat_template_kwargs` key the renderer sets itself is refused by name.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        options: &RenderOptions<'_>,
    ) -> Result<String, TextError> {
        let rendered = messages
            .iter()
            .enumerate()
            .map(|(i, m)| RenderedMessage::new(i, m))
            .collect::<Result<Vec<_>, TextError>>()?;
        let mut vars: BTreeMap<&str, minijinja::Value> = BTreeMap::new();
        for (key, value) in options.kwargs.into_iter().flatten() {
            if RESERVED_VARIABLES.contains(&key.as_str()) {
                return Err(TextError::Template(format!(
                    "chat_template_kwargs.{key}: `{key}` is set by the server and cannot be replaced"
                )));
            }
            vars.insert(key, minijinja::Value::from_serialize(value));
        }
        vars.insert("messages", minijinja::Value::from_serialize(&rendered));
        vars.insert(
            "add_generation_prompt",
            options.add_generation_prompt.into(),
        );
        vars.insert("bos_token", self.bos_token.as_str().into());
        vars.insert("eos_token", self.eos_token.as_str().into());
        if let Some(tools) = options.tools {
            vars.insert("tools", minijinja::Value::from_serialize(tools));
        }
        let name = if options.tools.is_some() && self.has_tool_template {
            TOOL_TEMPLATE_NAME
        } else {
            TEMPLATE_NAME
        };
        let template = self
            .env
            .get_template(name)
            .map_err(|e| TextError::Template(e.to_string()))?;
        template.render(vars).map_err(|e| {
            // `raise_exception` messages are the template author's words: pass them through.
            let detail = match e.kind() {
                ErrorKind::InvalidOperation => {
                    e.detail().unwrap_or("invalid operation").to_string()
                }
                _ => e.to_string(),
            };
            TextError::Template(detail)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SmolLM2's ChatML template.
    const SMOL: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    fn msgs(json: &str) -> Vec<ChatMessage> {
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn chatml_adds_default_system_prompt_and_generation_prompt() {
        let t = ChatTemplate::new(SMOL.into(), None, Some("<|im_end|>".into())).unwrap();
        let out = t
            .render(
                &msgs(r#"[{"role": "user", "content": "Hi"}]"#),
                &RenderOptions::generation(),
            )
            .unwrap();
        assert_eq!(
            out,
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
             <|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        let out = t
            .render(
                &msgs(r#"[{"role": "user", "content": "Hi"}]"#),
                &RenderOptions::default(),
            )
            .unwrap();
        assert!(out.ends_with("<|im_start|>user\nHi<|im_end|>\n"), "{out}");
    }

    #[test]
    fn own_system_message_and_content_parts() {
        let t = ChatTemplate::new(SMOL.into(), None, None).unwrap();
        let m = msgs(
            r#"[{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world"}]},
                {"role": "assistant", "content": null}]"#,
        );
        let out = t.render(&m, &RenderOptions::default()).unwrap();
        assert_eq!(
            out,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello, world<|im_end|>\n\
             <|im_start|>assistant\n<|im_end|>\n"
        );
    }

    #[test]
    fn non_text_parts_and_bad_content_are_refused() {
        let t = ChatTemplate::new(SMOL.into(), None, None).unwrap();
        let m = msgs(
            r#"[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]"#,
        );
        let err = t
            .render(&m, &RenderOptions::generation())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("messages[0].content") && err.contains("image_url"),
            "{err}"
        );
        let err =
            serde_json::from_str::<ChatMessage>(r#"{"role": "user", "content": 5}"#).unwrap_err();
        assert!(
            err.to_string()
                .contains("expected a string or an array of content parts"),
            "{err}"
        );
    }

    #[test]
    fn hf_features_strip_raise_exception_and_special_tokens() {
        let src = "{{ bos_token }}{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('Tool messages are not supported') }}{% endif %}\n\
                   [{{ m.role }}] {{ m.content.strip() }}{{ eos_token }}\n{% endfor %}";
        let t = ChatTemplate::new(src.into(), Some("<s>".into()), Some("</s>".into())).unwrap();
        let out = t
            .render(
                &msgs(r#"[{"role": "user", "content": "  hi  "}]"#),
                &RenderOptions::generation(),
            )
            .unwrap();
        // trim_blocks drops the newline after `{% endif %}`.
        assert_eq!(out, "<s>[user] hi</s>\n");
        let err = t
            .render(
                &msgs(r#"[{"role": "tool", "content": "x"}]"#),
                &RenderOptions::generation(),
            )
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "chat template error: Tool messages are not supported"
        );
        assert!(ChatTemplate::new("{% for %}".into(), None, None).is_err());
    }

    #[test]
    fn loads_from_tokenizer_config_list_or_jinja_file() {
        let dir = tempfile::tempdir().unwrap();
        assert!(ChatTemplate::from_model_dir(dir.path()).unwrap().is_none());
        std::fs::write(
            dir.path().join("chat_template.jinja"),
            "J{{ messages[0].content }}",
        )
        .unwrap();
        let t = ChatTemplate::from_model_dir(dir.path()).unwrap().unwrap();
        assert_eq!(
            t.render(
                &msgs(r#"[{"role": "user", "content": "x"}]"#),
                &RenderOptions::default()
            )
            .unwrap(),
            "Jx"
        );
        let cfg = serde_json::json!({
            "bos_token": "<s>",
            "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ bos_token }}"}]
        });
        std::fs::write(dir.path().join("tokenizer_config.json"), cfg.to_string()).unwrap();
        let t = ChatTemplate::from_model_dir(dir.path()).unwrap().unwrap();
        assert_eq!(t.render(&[], &RenderOptions::default()).unwrap(), "D<s>");
        std::fs::write(
            dir.path().join("tokenizer_config.json"),
            r#"{"chat_template": [{"name": "x", "template": "T"}]}"#,
        )
        .unwrap();
        let err = ChatTemplate::from_model_dir(dir.path()).unwrap_err();
        assert!(err.to_string().contains("default"), "{err}");
    }

    /// A Hermes-style tool template: tools listed in the system turn, calls and results as tags.
    const TOOLS: &str = "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>\n{% endif %}\
        {% for m in messages %}{% if m.tool_calls is defined %}{% for c in m.tool_calls %}\
        <call>{{ c.function.name }}({{ c.function.arguments.city }})</call>{% endfor %}\
        {% elif m.role == 'tool' %}<result id={{ m.tool_call_id }} name={{ m.name }}>{{ m.content }}</result>\
        {% else %}[{{ m.role }}] {{ m.content }}{% endif %}\n{% endfor %}\
        {% if enable_thinking is defined and not enable_thinking %}<no-think>{% endif %}";

    #[test]
    fn tools_and_tool_messages_reach_the_template() {
        let t = ChatTemplate::new(TOOLS.into(), None, None).unwrap();
        let tools: Vec<Value> = serde_json::from_str(
            r#"[{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]"#,
        )
        .unwrap();
        let m = msgs(
            r#"[{"role": "user", "content": "Paris?"},
                {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
                  "function": {"name": "weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                {"role": "tool", "tool_call_id": "c1", "name": "weather", "content": "sunny"}]"#,
        );
        let options = RenderOptions {
            tools: Some(&tools),
            ..RenderOptions::default()
        };
        assert_eq!(
            t.render(&m, &options).unwrap(),
            // trim_blocks drops the newline after each message's `{% endif %}`, as in HF.
            "<tools>weather;</tools>\n[user] Paris?<call>weather(Paris)</call>\
             <result id=c1 name=weather>sunny</result>"
        );
        // Without tools the variable is undefined, and the listing is left out.
        let out = t.render(&m[..1], &RenderOptions::default()).unwrap();
        assert_eq!(out, "[user] Paris?");
        let bad = msgs(
            r#"[{"role": "assistant", "tool_calls": [{"function": {"name": "w", "arguments": "{oops"}}]}]"#,
        );
        let err = t.render(&bad, &options).unwrap_err().to_string();
        assert!(
            err.contains("messages[0].tool_calls[0].function.arguments: not JSON"),
            "{err}"
        );
        let bad = msgs(r#"[{"role": "assistant", "tool_calls": [{"id": "x"}]}]"#);
        let err = t.render(&bad, &options).unwrap_err().to_string();
        assert!(
            err.contains("messages[0].tool_calls[0]: a tool call needs a `function`"),
            "{err}"
        );
    }

    #[test]
    fn chat_template_kwargs_are_variables_but_cannot_replace_the_servers() {
        let t = ChatTemplate::new(TOOLS.into(), None, None).unwrap();
        let m = msgs(r#"[{"role": "user", "content": "hi"}]"#);
        let kwargs: Map<String, Value> =
            serde_json::from_str(r#"{"enable_thinking": false}"#).unwrap();
        let options = RenderOptions {
            kwargs: Some(&kwargs),
            ..RenderOptions::default()
        };
        assert_eq!(t.render(&m, &options).unwrap(), "[user] hi<no-think>");
        for key in RESERVED_VARIABLES {
            let kwargs: Map<String, Value> =
                serde_json::from_str(&format!(r#"{{"{key}": 1}}"#)).unwrap();
            let options = RenderOptions {
                kwargs: Some(&kwargs),
                ..RenderOptions::default()
            };
            let err = t.render(&m, &options).unwrap_err().to_string();
            assert!(
                err.contains(&format!("chat_template_kwargs.{key}")),
                "{err}"
            );
        }
    }

    #[test]
    fn tool_use_template_is_used_only_with_tools() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = serde_json::json!({
            "chat_template": [{"name": "default", "template": "D"}, {"name": "tool_use", "template": "T{{ tools|length }}"}]
        });
        std::fs::write(dir.path().join("tokenizer_config.json"), cfg.to_string()).unwrap();
        let t = ChatTemplate::from_model_dir(dir.path()).unwrap().unwrap();
        let tools = vec![serde_json::json!({"type": "function", "function": {"name": "f"}})];
        let with_tools = RenderOptions {
            tools: Some(&tools),
            ..RenderOptions::default()
        };
        assert_eq!(t.render(&[], &with_tools).unwrap(), "T1");
        assert_eq!(t.render(&[], &RenderOptions::default()).unwrap(), "D");
    }

    #[test]
    fn file_and_variant_templates_take_the_base_special_tokens() {
        let dir = tempfile::tempdir().unwrap();
        let base = TokenizerConfig {
            bos_token: Some("<s>".into()),
            eos_token: Some("</s>".into()),
            ..TokenizerConfig::default()
        };
        let file = dir.path().join("t.jinja");
        std::fs::write(&file, "F{{ bos_token }}{{ eos_token }}").unwrap();
        let t = ChatTemplate::from_file(&file, &base).unwrap();
        assert_eq!(
            t.render(&[], &RenderOptions::default()).unwrap(),
            "F<s></s>"
        );
        let err = ChatTemplate::from_file(&dir.path().join("missing.jinja"), &base)
            .unwrap_err()
            .to_string();
        assert!(err.contains("missing.jinja"), "{err}");
        std::fs::write(&file, "{% for %}").unwrap();
        let err = ChatTemplate::from_file(&file, &base)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("t.jinja") && err.contains("cannot compile"),
            "{err}"
        );
        // A variant directory without a template has none; with one, its own eos wins.
        let variant = dir.path().join("v");
        std::fs::create_dir(&variant).unwrap();
        assert!(ChatTemplate::from_variant_dir(&variant, &base)
            .unwrap()
            .is_none());
        let cfg = serde_json::json!({"eos_token": "<|end|>", "chat_template": "V{{ bos_token }}{{ eos_token }}"});
        std::fs::write(variant.join("tokenizer_config.json"), cfg.to_string()).unwrap();
        let t = ChatTemplate::from_variant_dir(&variant, &base)
            .unwrap()
            .unwrap();
        assert_eq!(
            t.render(&[], &RenderOptions::default()).unwrap(),
            "V<s><|end|>"
        );
    }
}
