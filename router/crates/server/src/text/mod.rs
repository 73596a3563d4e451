//! Text in and out of the model: everything that turns client strings into token ids and back.
//!
//! # Layout
//!
//! - [`tokenizer`]: [`TextTokenizer`](tokenizer::TextTokenizer), the model directory's
//!   `tokenizer.json` plus the special tokens from `tokenizer_config.json`.
//! - [`detok`]: [`DetokStream`](detok::DetokStream), incremental detokenization of one request's
//!   output with stop-string handling (used by the engine actor, one per live request).
//! - [`chat_template`]: [`ChatTemplate`](chat_template::ChatTemplate), the model's Jinja chat
//!   template rendered with minijinja (HF-compatible: `.strip()`, `raise_exception`, ...).
//!
//! Errors from all three are one [`TextError`].

pub mod chat_template;
pub mod detok;
pub mod tokenizer;

/// Why loading or using the tokenizer or chat template failed.
#[derive(Debug, thiserror::Error)]
pub enum TextError {
    /// A model-directory file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// A model-directory JSON file is malformed.
    #[error("cannot parse {path}: {message}")]
    Config { path: String, message: String },
    /// The `tokenizers` crate refused to load, encode or decode.
    #[error("tokenizer error: {0}")]
    Tokenizer(String),
    /// The chat template failed to compile, or failed to render (including the template's own
    /// `raise_exception`, which is how HF templates reject a conversation).
    #[error("chat template error: {0}")]
    Template(String),
}

impl TextError {
    /// A stable label for logs and metrics (STYLE.md #12).
    pub fn error_type(&self) -> &'static str {
        match self {
            TextError::Io { .. } => "io",
            TextError::Config { .. } => "config",
            TextError::Tokenizer(_) => "tokenizer",
            TextError::Template(_) => "template",
        }
    }
}

/// Shared by the tests of this crate: a tiny byte-level BPE tokenizer built in memory.
#[cfg(test)]
pub(crate) mod test_support {
    use std::sync::Arc;

    use super::tokenizer::{TextTokenizer, TokenizerConfig};

    /// GPT-2's byte → printable-char map: the alphabet byte-level BPE vocabularies are written in.
    pub fn byte_char(b: u8) -> char {
        let printable = (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
        if printable {
            char::from(b)
        } else {
            // The non-printable bytes, in order, map to U+0100, U+0101, ...
            let rank = (0u8..b)
                .filter(|&x| {
                    !((b'!'..=b'~').contains(&x) || (0xA1..=0xAC).contains(&x) || x >= 0xAE)
                })
                .count() as u32;
            char::from_u32(256 + rank).unwrap()
        }
    }

    /// Byte-level spelling of a UTF-8 string.
    pub fn spell(s: &str) -> String {
        s.bytes().map(byte_char).collect()
    }

    /// Special tokens of the tiny tokenizer, after the 256 byte tokens and the merges.
    pub const SPECIALS: [&str; 3] = ["<s>", "</s>", "<|im_end|>"];

    /// Multi-byte merges, some ending inside a UTF-8 character ("日" is E6 97 A5: the merge of
    /// E6 97 leaves A5 for the next token), so decoding token by token splits characters.
    fn merges() -> Vec<(String, String)> {
        let bytes = |s: &[u8]| {
            s.iter()
                .map(|&b| byte_char(b).to_string())
                .collect::<Vec<_>>()
        };
        let rie = "日".as_bytes();
        let emoji = "🎉".as_bytes();
        vec![
            (spell(" "), spell("t")),
            (spell("h"), spell("e")),
            (spell(" t"), spell("he")),
            (spell("l"), spell("l")),
            (spell("o"), spell("r")),
            (spell("S"), spell("T")),
            (spell("ST"), spell("O")),
            (spell("STO"), spell("P")),
            (bytes(&rie[..1])[0].clone(), bytes(&rie[1..2])[0].clone()),
            (
                bytes(&emoji[..1])[0].clone(),
                bytes(&emoji[1..2])[0].clone(),
            ),
            (
                bytes("é".as_bytes())[0].clone(),
                bytes("é".as_bytes())[1].clone(),
            ),
            (spell("é"), spell("t")),
        ]
    }

    /// The tokenizer's `tokenizer.json`, as a string (also written to disk by loader tests).
    pub fn tiny_tokenizer_json() -> String {
        let mut vocab = serde_json::Map::new();
        for b in 0..=255u8 {
            vocab.insert(byte_char(b).to_string(), serde_json::json!(vocab.len()));
        }
        let merges = merges();
        for (a, b) in &merges {
            let merged = format!("{a}{b}");
            let id = vocab.len();
            vocab.entry(merged).or_insert(serde_json::json!(id));
        }
        let first_special = vocab.len();
        let added: Vec<_> = SPECIALS
            .iter()
            .enumerate()
            .map(|(i, s)| {
                serde_json::json!({"id": first_special + i, "content": s, "single_word": false,
                    "lstrip": false, "rstrip": false, "normalized": false, "special": true})
            })
            .collect();
        let merges: Vec<_> = merges
            .iter()
            .map(|(a, b)| serde_json::json!([a, b]))
            .collect();
        serde_json::json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": added,
            "normalizer": null,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
            "post_processor": null,
            "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
            "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                "vocab": vocab, "merges": merges}
        })
        .to_string()
    }

    /// The tiny tokenizer, with `<s>` as BOS (added when encoding with special tokens) and
    /// `</s>` as EOS.
    pub fn tiny_tokenizer() -> Arc<TextTokenizer> {
        let config = TokenizerConfig {
            bos_token: Some("<s>".into()),
            eos_token: Some("</s>".into()),
            add_bos_token: Some(true),
            chat_template: None,
        };
        Arc::new(TextTokenizer::from_json_str(&tiny_tokenizer_json(), config).unwrap())
    }
}
