//! [`TextTokenizer`]: the served model's tokenizer (`tokenizer.json`, loaded with the HF
//! `tokenizers` crate) plus the special tokens `tokenizer_config.json` names.
//!
//! [`TokenizerConfig`] is the one reader of `tokenizer_config.json`; the chat template loader
//! takes its `chat_template`, `bos_token` and `eos_token` from it too.

use std::path::Path;

use serde_json::Value;

use super::TextError;

/// The parts of `tokenizer_config.json` the router uses. Missing file or fields are `None`.
#[derive(Debug, Clone, Default)]
pub struct TokenizerConfig {
    /// Text of the beginning-of-sequence token (chat templates print it; `add_bos_token` adds it).
    pub bos_token: Option<String>,
    /// Text of the end-of-sequence token (chat templates print it after assistant turns).
    pub eos_token: Option<String>,
    /// Whether encoding with special tokens must start with BOS (Llama-style tokenizers whose
    /// `tokenizer.json` post-processor may not add it).
    pub add_bos_token: Option<bool>,
    /// The raw `chat_template` value: a string, or a list of `{name, template}`.
    pub chat_template: Option<Value>,
}

impl TokenizerConfig {
    /// Reads `dir/tokenizer_config.json`; a missing file gives the empty config.
    pub fn from_model_dir(dir: &Path) -> Result<Self, TextError> {
        let path = dir.join("tokenizer_config.json");
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Self::default()),
            Err(source) => {
                return Err(TextError::Io {
                    path: path.display().to_string(),
                    source,
                })
            }
        };
        Self::from_json_str(&text).map_err(|message| TextError::Config {
            path: path.display().to_string(),
            message,
        })
    }

    /// Parses the content of a `tokenizer_config.json`.
    pub fn from_json_str(text: &str) -> Result<Self, String> {
        let value: Value = serde_json::from_str(text).map_err(|e| e.to_string())?;
        let Value::Object(map) = value else {
            return Err("expected a JSON object".into());
        };
        let token = |key: &str| -> Result<Option<String>, String> {
            match map.get(key) {
                None | Some(Value::Null) => Ok(None),
                Some(Value::String(s)) => Ok(Some(s.clone())),
                // An `AddedToken` written out in full: {"content": "<s>", "lstrip": false, ...}.
                Some(Value::Object(o)) => match o.get("content") {
                    Some(Value::String(s)) => Ok(Some(s.clone())),
                    _ => Err(format!("`{key}` is an object without a string `content`")),
                },
                Some(other) => Err(format!("`{key}` must be a string, not {other}")),
            }
        };
        let add_bos_token = match map.get("add_bos_token") {
            None | Some(Value::Null) => None,
            Some(Value::Bool(b)) => Some(*b),
            Some(other) => return Err(format!("`add_bos_token` must be a boolean, not {other}")),
        };
        Ok(Self {
            bos_token: token("bos_token")?,
            eos_token: token("eos_token")?,
            add_bos_token,
            chat_template: map.get("chat_template").filter(|v| !v.is_null()).cloned(),
        })
    }
}

/// The served model's tokenizer. Shared (`Arc`) by the API layer (encoding prompts) and the
/// engine actors (incremental decoding).
pub struct TextTokenizer {
    /// The HF tokenizer from `tokenizer.json`.
    inner: tokenizers::Tokenizer,
    /// Special tokens and flags from `tokenizer_config.json`.
    config: TokenizerConfig,
    /// Id of `config.bos_token`, when it is in the vocabulary; prepended by [`Self::encode`] when
    /// `add_bos_token` is set and the post-processor did not add it.
    bos_id: Option<u32>,
    /// Id of `config.eos_token`, when it is in the vocabulary.
    eos_id: Option<u32>,
}

impl std::fmt::Debug for TextTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextTokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("bos_token", &self.config.bos_token)
            .field("eos_token", &self.config.eos_token)
            .finish()
    }
}

impl TextTokenizer {
    /// Loads `dir/tokenizer.json` and `dir/tokenizer_config.json` (optional).
    pub fn from_model_dir(dir: impl AsRef<Path>) -> Result<Self, TextError> {
        let dir = dir.as_ref();
        let path = dir.join("tokenizer.json");
        let json = std::fs::read_to_string(&path).map_err(|source| TextError::Io {
            path: path.display().to_string(),
            source,
        })?;
        let config = TokenizerConfig::from_model_dir(dir)?;
        Self::from_json_str(&json, config).map_err(|e| match e {
            TextError::Tokenizer(m) => TextError::Tokenizer(format!("{}: {m}", path.display())),
            other => other,
        })
    }

    /// Builds a tokenizer from the content of a `tokenizer.json` and an already-read config.
    pub fn from_json_str(json: &str, config: TokenizerConfig) -> Result<Self, TextError> {
        let inner: tokenizers::Tokenizer = json
            .parse()
            .map_err(|e: tokenizers::Error| TextError::Tokenizer(e.to_string()))?;
        let bos_id = config
            .bos_token
            .as_deref()
            .and_then(|t| inner.token_to_id(t));
        let eos_id = config
            .eos_token
            .as_deref()
            .and_then(|t| inner.token_to_id(t));
        Ok(Self {
            inner,
            config,
            bos_id,
            eos_id,
        })
    }

    /// Token ids of `text`. With `add_special_tokens` the tokenizer's post-processor runs (BOS
    /// and the like), and BOS is prepended when `add_bos_token` asks for it and it is missing.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TextError> {
        let encoding = self
            .inner
            .encode(text, add_special_tokens)
            .map_err(|e| TextError::Tokenizer(e.to_string()))?;
        let mut ids = encoding.get_ids().to_vec();
        if add_special_tokens && self.config.add_bos_token == Some(true) {
            if let Some(bos) = self.bos_id {
                if ids.first() != Some(&bos) {
                    ids.insert(0, bos);
                }
            }
        }
        Ok(ids)
    }

    /// The text of `ids`, special tokens left out. Incomplete UTF-8 comes out as U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> Result<String, TextError> {
        self.inner
            .decode(ids, true)
            .map_err(|e| TextError::Tokenizer(e.to_string()))
    }

    /// The text of one token on its own, special tokens included (for logprob listings).
    pub fn token_text(&self, id: u32) -> String {
        self.inner.decode(&[id], false).unwrap_or_default()
    }

    /// Number of token ids the tokenizer knows, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The id of a token spelled exactly `token` (vocabulary spelling, e.g. `Ġthe`).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// What `tokenizer_config.json` said (special tokens, the chat template).
    pub fn config(&self) -> &TokenizerConfig {
        &self.config
    }

    /// The BOS token's text, for chat templates.
    pub fn bos_token(&self) -> Option<&str> {
        self.config.bos_token.as_deref()
    }

    /// The EOS token's text, for chat templates.
    pub fn eos_token(&self) -> Option<&str> {
        self.config.eos_token.as_deref()
    }

    /// The EOS token's id, when `tokenizer_config.json` names one that is in the vocabulary.
    pub fn eos_token_id(&self) -> Option<u32> {
        self.eos_id
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::text::test_support::{tiny_tokenizer, tiny_tokenizer_json};

    #[test]
    fn round_trips_text_and_adds_bos() {
        let tok = tiny_tokenizer();
        let text = "the théâtre 日本 🎉 STOP";
        let ids = tok.encode(text, false).unwrap();
        assert!(ids.len() < text.len(), "merges should apply: {ids:?}");
        assert_eq!(tok.decode(&ids).unwrap(), text);
        let with_bos = tok.encode(text, true).unwrap();
        assert_eq!(with_bos[0], tok.token_to_id("<s>").unwrap());
        assert_eq!(&with_bos[1..], &ids[..]);
        // Special tokens are skipped when decoding.
        let mut ids2 = with_bos.clone();
        ids2.push(tok.eos_token_id().unwrap());
        assert_eq!(tok.decode(&ids2).unwrap(), text);
        assert_eq!(tok.token_text(tok.eos_token_id().unwrap()), "</s>");
        assert_eq!(tok.vocab_size(), 256 + 12 + 3);
    }

    #[test]
    fn loads_from_model_dir_with_config_objects() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("tokenizer.json"), tiny_tokenizer_json()).unwrap();
        std::fs::write(
            dir.path().join("tokenizer_config.json"),
            r#"{"bos_token": {"content": "<s>", "lstrip": false}, "eos_token": "</s>", "add_bos_token": false}"#,
        )
        .unwrap();
        let tok = TextTokenizer::from_model_dir(dir.path()).unwrap();
        assert_eq!(tok.bos_token(), Some("<s>"));
        assert_eq!(tok.eos_token(), Some("</s>"));
        assert_eq!(
            tok.encode("he", true).unwrap().len(),
            1,
            "add_bos_token is false"
        );
    }

    #[test]
    fn missing_or_bad_files_are_clear_errors() {
        let dir = tempfile::tempdir().unwrap();
        let err = TextTokenizer::from_model_dir(dir.path()).unwrap_err();
        assert!(err.to_string().contains("tokenizer.json"), "{err}");
        std::fs::write(dir.path().join("tokenizer.json"), tiny_tokenizer_json()).unwrap();
        std::fs::write(
            dir.path().join("tokenizer_config.json"),
            r#"{"bos_token": 3}"#,
        )
        .unwrap();
        let err = TextTokenizer::from_model_dir(dir.path()).unwrap_err();
        assert!(err.to_string().contains("bos_token"), "{err}");
        std::fs::write(dir.path().join("tokenizer.json"), "{not json").unwrap();
        std::fs::remove_file(dir.path().join("tokenizer_config.json")).unwrap();
        let err = TextTokenizer::from_model_dir(dir.path()).unwrap_err();
        assert_eq!(err.error_type(), "tokenizer");
    }
}
