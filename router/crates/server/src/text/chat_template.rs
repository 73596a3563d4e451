//! [`ChatTemplate`]: the model's Jinja chat template, rendered the way HF `transformers` does.
//!
//! The template comes from `tokenizer_config.json`'s `chat_template` (a string, or a list of
//! `{name, template}` of which `default` is used) or else from `chat_template.jinja`. It is
//! compiled once with minijinja, with HF's environment settings (`trim_blocks`, `lstrip_blocks`)
//! and Python string/dict/list methods from minijinja-contrib's `pycompat` (`.strip()`,
//! `.startswith()`, `.items()`, ...), and sees the variables HF passes: `messages`,
//! `add_generation_prompt`, `bos_token`, `eos_token`, plus a `raise_exception(msg)` function.

use std::path::Path;

use minijinja::{Environment, ErrorKind};
use serde::{Deserialize, Deserializer, Serialize};
use serde_json::Value;

use super::tokenizer::TokenizerConfig;
use super::TextError;

/// Name of the compiled template inside the environment.
const TEMPLATE_NAME: &str = "chat";

/// One message of a conversation, as the OpenAI API sends it.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, ... (passed to the template as is).
    pub role: String,
    /// The text, given as a string or as `{type: "text", text}` parts; `null` reads as empty.
    #[serde(default)]
    pub content: MessageContent,
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

/// What the template sees of a message.
#[derive(Serialize)]
struct RenderedMessage<'a> {
    role: &'a str,
    content: String,
}

/// A compiled chat template plus the special tokens it prints.
pub struct ChatTemplate {
    /// minijinja environment holding the compiled template under [`TEMPLATE_NAME`].
    env: Environment<'static>,
    /// Passed as `bos_token` (empty string when the tokenizer has none).
    bos_token: String,
    /// Passed as `eos_token` (empty string when the tokenizer has none).
    eos_token: String,
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
        let config_path = dir.join("tokenizer_config.json").display().to_string();
        let source = match &config.chat_template {
            Some(Value::String(s)) => Some(s.clone()),
            Some(Value::Array(list)) => {
                let named = list
                    .iter()
                    .find(|t| t.get("name").and_then(Value::as_str) == Some("default"));
                match named
                    .and_then(|t| t.get("template"))
                    .and_then(Value::as_str)
                {
                    Some(s) => Some(s.to_string()),
                    None => {
                        return Err(TextError::Config {
                            path: config_path,
                            message: "`chat_template` is a list without a `default` entry".into(),
                        })
                    }
                }
            }
            Some(other) => {
                return Err(TextError::Config {
                    path: config_path,
                    message: format!(
                        "`chat_template` must be a string or a list, not {}",
                        json_kind(other)
                    ),
                })
            }
            None => {
                let path = dir.join("chat_template.jinja");
                match std::fs::read_to_string(&path) {
                    Ok(s) => Some(s),
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
                    Err(source) => {
                        return Err(TextError::Io {
                            path: path.display().to_string(),
                            source,
                        })
                    }
                }
            }
        };
        source
            .map(|s| Self::new(s, config.bos_token.clone(), config.eos_token.clone()))
            .transpose()
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
        })
    }

    /// The prompt text for `messages`, ending with the assistant's turn header when
    /// `add_generation_prompt`. A template's `raise_exception` becomes an error with its message.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TextError> {
        let rendered = messages
            .iter()
            .enumerate()
            .map(|(i, m)| {
                let content = m
                    .content
                    .text()
                    .map_err(|e| TextError::Template(format!("messages[{i}].content: {e}")))?;
                Ok(RenderedMessage {
                    role: &m.role,
                    content,
                })
            })
            .collect::<Result<Vec<_>, TextError>>()?;
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| TextError::Template(e.to_string()))?;
        template
            .render(minijinja::context! {
                messages => rendered,
                add_generation_prompt => add_generation_prompt,
                bos_token => &self.bos_token,
                eos_token => &self.eos_token,
            })
            .map_err(|e| {
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
            .render(&msgs(r#"[{"role": "user", "content": "Hi"}]"#), true)
            .unwrap();
        assert_eq!(
            out,
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
             <|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        let out = t
            .render(&msgs(r#"[{"role": "user", "content": "Hi"}]"#), false)
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
        let out = t.render(&m, false).unwrap();
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
        let err = t.render(&m, true).unwrap_err().to_string();
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
            .render(&msgs(r#"[{"role": "user", "content": "  hi  "}]"#), true)
            .unwrap();
        // trim_blocks drops the newline after `{% endif %}`.
        assert_eq!(out, "<s>[user] hi</s>\n");
        let err = t
            .render(&msgs(r#"[{"role": "tool", "content": "x"}]"#), true)
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
            t.render(&msgs(r#"[{"role": "user", "content": "x"}]"#), false)
                .unwrap(),
            "Jx"
        );
        let cfg = serde_json::json!({
            "bos_token": "<s>",
            "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ bos_token }}"}]
        });
        std::fs::write(dir.path().join("tokenizer_config.json"), cfg.to_string()).unwrap();
        let t = ChatTemplate::from_model_dir(dir.path()).unwrap().unwrap();
        assert_eq!(t.render(&[], false).unwrap(), "D<s>");
        std::fs::write(
            dir.path().join("tokenizer_config.json"),
            r#"{"chat_template": [{"name": "x", "template": "T"}]}"#,
        )
        .unwrap();
        let err = ChatTemplate::from_model_dir(dir.path()).unwrap_err();
        assert!(err.to_string().contains("default"), "{err}");
    }
}
