//! [`SamplingDefaults`]: the sampling parameters a model's authors ship in its
//! `generation_config.json` (`temperature`, `top_p`, `top_k`, `repetition_penalty`), used for a
//! request that does not name them, as vLLM does by default. `--generation-config none` turns them
//! off (every unnamed field then takes OpenAI's default: temperature 1, top_p 1, no top_k, no
//! repetition penalty).
//!
//! `do_sample` is not read: a server samples whenever the request's temperature is above 0, and
//! the request's own fields always win. A value outside what a request may send is refused at
//! start-up with the file and field named, never clamped.

use std::path::Path;

use serde_json::Value;

/// Defaults for the request fields a model may ship; `None`: the API's own default.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SamplingDefaults {
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub repetition_penalty: Option<f64>,
}

impl SamplingDefaults {
    /// The defaults in `dir/generation_config.json` (none when the file is absent).
    pub fn from_model_dir(dir: &Path) -> Result<Self, String> {
        let path = dir.join("generation_config.json");
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Self::default()),
            Err(e) => return Err(format!("cannot read {}: {e}", path.display())),
        };
        Self::from_json(&text).map_err(|e| format!("{}: {e}", path.display()))
    }

    /// The defaults in a `generation_config.json` text.
    pub fn from_json(text: &str) -> Result<Self, String> {
        let value: Value = serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
        let map = value
            .as_object()
            .ok_or_else(|| "not a JSON object".to_string())?;
        let number = |key: &str| -> Result<Option<f64>, String> {
            match map.get(key) {
                None | Some(Value::Null) => Ok(None),
                Some(v) => v
                    .as_f64()
                    .map(Some)
                    .ok_or_else(|| format!("`{key}` must be a number, not {v}")),
            }
        };
        let out = Self {
            temperature: number("temperature")?,
            top_p: number("top_p")?,
            top_k: match number("top_k")? {
                None => None,
                Some(k) if k.fract() == 0.0 => Some(k as i64),
                Some(k) => return Err(format!("`top_k` must be an integer, not {k}")),
            },
            repetition_penalty: number("repetition_penalty")?,
        };
        let check = |ok: bool, key: &str, v: f64, range: &str| {
            if ok {
                Ok(())
            } else {
                Err(format!("`{key}` is {v}; a request may send {range}"))
            }
        };
        if let Some(t) = out.temperature {
            check((0.0..=2.0).contains(&t), "temperature", t, "0 to 2")?;
        }
        if let Some(p) = out.top_p {
            check(p > 0.0 && p <= 1.0, "top_p", p, "(0, 1]")?;
        }
        if let Some(k) = out.top_k {
            check(k >= -1, "top_k", k as f64, "-1, 0 or a positive count")?;
        }
        if let Some(r) = out.repetition_penalty {
            check(r > 0.0, "repetition_penalty", r, "more than 0")?;
        }
        Ok(out)
    }

    /// Whether the model shipped any default.
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_sampling_fields_and_ignores_the_rest() {
        let d = SamplingDefaults::from_json(
            r#"{"do_sample": true, "temperature": 0.6, "top_p": 0.95, "top_k": 20,
                "repetition_penalty": 1.05, "eos_token_id": [1, 2], "max_new_tokens": 512}"#,
        )
        .unwrap();
        assert_eq!(
            d,
            SamplingDefaults {
                temperature: Some(0.6),
                top_p: Some(0.95),
                top_k: Some(20),
                repetition_penalty: Some(1.05),
            }
        );
        let none =
            SamplingDefaults::from_json(r#"{"bos_token_id": 1, "eos_token_id": 2}"#).unwrap();
        assert!(none.is_empty());
    }

    #[test]
    fn a_value_no_request_may_send_is_refused_by_name() {
        for (json, field) in [
            (r#"{"temperature": 3.0}"#, "temperature"),
            (r#"{"top_p": 0}"#, "top_p"),
            (r#"{"top_k": 2.5}"#, "top_k"),
            (r#"{"repetition_penalty": 0}"#, "repetition_penalty"),
            (r#"{"temperature": "hot"}"#, "temperature"),
        ] {
            let err = SamplingDefaults::from_json(json).unwrap_err();
            assert!(err.contains(field), "{json}: {err}");
        }
        assert!(SamplingDefaults::from_json("[]").is_err());
    }

    #[test]
    fn a_missing_file_has_no_defaults_and_a_bad_one_names_itself() {
        let dir = tempfile::tempdir().unwrap();
        assert!(SamplingDefaults::from_model_dir(dir.path())
            .unwrap()
            .is_empty());
        std::fs::write(dir.path().join("generation_config.json"), "{oops").unwrap();
        let err = SamplingDefaults::from_model_dir(dir.path()).unwrap_err();
        assert!(err.contains("generation_config.json"), "{err}");
    }
}
