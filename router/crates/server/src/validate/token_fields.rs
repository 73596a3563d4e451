//! The request fields that reshape the logits or stop on token ids: `logit_bias`,
//! `presence_penalty`, `frequency_penalty`, `repetition_penalty`, `min_tokens`, `stop_token_ids`
//! (OpenAI's and vLLM's meanings), checked into their wire form. The worker's sampler applies
//! them (`pyworker/deltaserve/worker/logit_adjust.py`); the engine stops on `stop_token_ids`.

use deltaserve_ipc::wire::{LogitBias, Penalties};
use serde_json::Value;

use crate::api::error::ApiError;
use crate::text::chat_template::json_kind;

/// Most `logit_bias` entries (OpenAI's limit).
pub const MAX_LOGIT_BIAS: usize = 300;
/// Largest `logit_bias` magnitude (OpenAI's range is [-100, 100]).
pub const MAX_BIAS: f64 = 100.0;
/// Largest `presence_penalty` / `frequency_penalty` magnitude (OpenAI's range is [-2, 2]).
pub const MAX_PENALTY: f64 = 2.0;
/// Most `stop_token_ids`.
pub const MAX_STOP_TOKEN_IDS: usize = 256;

/// The fields as the request has them.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct TokenFields<'a> {
    pub logit_bias: Option<&'a Value>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub repetition_penalty: Option<f64>,
    pub min_tokens: Option<i64>,
    pub stop_token_ids: Option<&'a Value>,
}

/// The fields checked: what the wire's `SamplingParams` and the engine take.
#[derive(Debug, Clone, Default, PartialEq)]
pub(super) struct Checked {
    /// Sorted by token id, one entry per id.
    pub logit_bias: Vec<LogitBias>,
    /// `None` when every penalty is neutral (0, 0, 1).
    pub penalties: Option<Penalties>,
    pub min_tokens: u32,
    /// Without repeats, in the request's order.
    pub stop_token_ids: Vec<u32>,
}

/// Checks the fields against the vocabulary; every error names its field.
pub(super) fn check(f: &TokenFields<'_>, vocab_size: u32) -> Result<Checked, ApiError> {
    let penalty = |name: &str, value: Option<f64>| -> Result<f64, ApiError> {
        match value {
            None => Ok(0.0),
            Some(v) if (-MAX_PENALTY..=MAX_PENALTY).contains(&v) => Ok(v),
            Some(v) => Err(ApiError::invalid(
                name,
                format!("`{name}` must be between -{MAX_PENALTY} and {MAX_PENALTY}, got {v}"),
            )),
        }
    };
    let presence = penalty("presence_penalty", f.presence_penalty)?;
    let frequency = penalty("frequency_penalty", f.frequency_penalty)?;
    let repetition = match f.repetition_penalty {
        None => 1.0,
        Some(v) if v > 0.0 && v.is_finite() => v,
        Some(v) => {
            return Err(ApiError::invalid(
                "repetition_penalty",
                format!("`repetition_penalty` must be greater than 0 (1 is off), got {v}"),
            ))
        }
    };
    let penalties =
        (presence != 0.0 || frequency != 0.0 || repetition != 1.0).then_some(Penalties {
            presence,
            frequency,
            repetition,
        });
    let min_tokens = match f.min_tokens {
        None => 0,
        Some(m) if m >= 0 => u32::try_from(m).unwrap_or(u32::MAX),
        Some(m) => {
            return Err(ApiError::invalid(
                "min_tokens",
                format!("`min_tokens` must be at least 0, got {m}"),
            ))
        }
    };
    Ok(Checked {
        logit_bias: logit_bias(f.logit_bias, vocab_size)?,
        penalties,
        min_tokens,
        stop_token_ids: stop_token_ids(f.stop_token_ids, vocab_size)?,
    })
}

/// `min_tokens` may not exceed the request's `max_tokens` (vLLM's rule), named by `max_param`.
pub(super) fn check_min_tokens(
    min_tokens: u32,
    max_tokens: u32,
    max_param: &str,
) -> Result<(), ApiError> {
    if min_tokens > max_tokens {
        return Err(ApiError::invalid(
            "min_tokens",
            format!("`min_tokens` ({min_tokens}) must not exceed `{max_param}` ({max_tokens})"),
        ));
    }
    Ok(())
}

/// A token id given as `value` (a JSON number, or a string of digits for `logit_bias` keys).
fn token_id(value: Option<u64>, vocab_size: u32) -> Option<u32> {
    value
        .filter(|&id| id < u64::from(vocab_size))
        .map(|id| id as u32)
}

fn id_error(param: &str, what: String, vocab_size: u32) -> ApiError {
    ApiError::invalid(
        param,
        format!(
            "{what} is not a valid token id (integers from 0 to {})",
            vocab_size.saturating_sub(1)
        ),
    )
}

/// `logit_bias`: an object from token ids (strings of digits) to numbers in [-100, 100].
fn logit_bias(value: Option<&Value>, vocab_size: u32) -> Result<Vec<LogitBias>, ApiError> {
    let map = match value {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Object(map)) => map,
        Some(other) => {
            return Err(ApiError::invalid(
                "logit_bias",
                format!(
                    "`logit_bias` must be an object mapping token ids to biases, got {}",
                    json_kind(other)
                ),
            ))
        }
    };
    if map.len() > MAX_LOGIT_BIAS {
        return Err(ApiError::invalid(
            "logit_bias",
            format!(
                "`logit_bias` may have at most {MAX_LOGIT_BIAS} entries, got {}",
                map.len()
            ),
        ));
    }
    let mut out: Vec<LogitBias> = Vec::with_capacity(map.len());
    for (key, bias) in map {
        let parsed = key
            .parse::<u64>()
            .ok()
            .filter(|_| key.bytes().all(|b| b.is_ascii_digit()));
        let token_id = token_id(parsed, vocab_size)
            .ok_or_else(|| id_error("logit_bias", format!("logit_bias key {key:?}"), vocab_size))?;
        let bias = match bias.as_f64() {
            Some(b) if (-MAX_BIAS..=MAX_BIAS).contains(&b) => b,
            _ => {
                return Err(ApiError::invalid(
                    "logit_bias",
                    format!("logit_bias[{key:?}] must be a number between -{MAX_BIAS} and {MAX_BIAS}, got {bias}"),
                ))
            }
        };
        out.push(LogitBias { token_id, bias });
    }
    out.sort_by_key(|b| b.token_id);
    if let Some(w) = out.windows(2).find(|w| w[0].token_id == w[1].token_id) {
        return Err(ApiError::invalid(
            "logit_bias",
            format!("`logit_bias` names token {} twice", w[0].token_id),
        ));
    }
    Ok(out)
}

/// `stop_token_ids`: an array of token ids.
fn stop_token_ids(value: Option<&Value>, vocab_size: u32) -> Result<Vec<u32>, ApiError> {
    let items = match value {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(items)) => items,
        Some(other) => {
            return Err(ApiError::invalid(
                "stop_token_ids",
                format!(
                    "`stop_token_ids` must be an array of token ids, got {}",
                    json_kind(other)
                ),
            ))
        }
    };
    if items.len() > MAX_STOP_TOKEN_IDS {
        return Err(ApiError::invalid(
            "stop_token_ids",
            format!(
                "at most {MAX_STOP_TOKEN_IDS} `stop_token_ids` are allowed, got {}",
                items.len()
            ),
        ));
    }
    let mut ids = Vec::with_capacity(items.len());
    for (i, v) in items.iter().enumerate() {
        let id = token_id(v.as_u64(), vocab_size).ok_or_else(|| {
            id_error(
                "stop_token_ids",
                format!("stop_token_ids[{i}] = {v}"),
                vocab_size,
            )
        })?;
        if !ids.contains(&id) {
            ids.push(id);
        }
    }
    Ok(ids)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(json: &str) -> Result<Checked, ApiError> {
        let v: Value = serde_json::from_str(json).unwrap();
        let f = TokenFields {
            logit_bias: v.get("logit_bias"),
            presence_penalty: v.get("presence_penalty").and_then(Value::as_f64),
            frequency_penalty: v.get("frequency_penalty").and_then(Value::as_f64),
            repetition_penalty: v.get("repetition_penalty").and_then(Value::as_f64),
            min_tokens: v.get("min_tokens").and_then(Value::as_i64),
            stop_token_ids: v.get("stop_token_ids"),
        };
        check(&f, 300)
    }

    fn refused(json: &str, param: &str, needles: &[&str]) {
        match fields(json) {
            Err(ApiError::InvalidRequest {
                message,
                param: Some(p),
            }) => {
                assert_eq!(p, param, "{json}: {message}");
                for n in needles {
                    assert!(message.contains(n), "{json}: {message} lacks {n}");
                }
            }
            other => panic!("{json}: {other:?}"),
        }
    }

    #[test]
    fn neutral_values_cost_nothing_on_the_wire() {
        let none = fields("{}").unwrap();
        assert_eq!(none, Checked::default());
        let neutral = fields(
            r#"{"presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1,
                "logit_bias": {}, "stop_token_ids": [], "min_tokens": 0}"#,
        )
        .unwrap();
        assert_eq!(neutral, Checked::default());
    }

    #[test]
    fn accepted_values_become_their_wire_form() {
        let c = fields(
            r#"{"logit_bias": {"299": 100, "5": -100, "7": 0.5}, "presence_penalty": -2,
                "frequency_penalty": 2, "repetition_penalty": 0.5, "min_tokens": 3,
                "stop_token_ids": [9, 0, 9]}"#,
        )
        .unwrap();
        let bias: Vec<(u32, f64)> = c.logit_bias.iter().map(|b| (b.token_id, b.bias)).collect();
        assert_eq!(bias, vec![(5, -100.0), (7, 0.5), (299, 100.0)]);
        assert_eq!(
            c.penalties,
            Some(Penalties {
                presence: -2.0,
                frequency: 2.0,
                repetition: 0.5
            })
        );
        assert_eq!((c.min_tokens, c.stop_token_ids), (3, vec![9, 0]));
        // One penalty alone turns the others to their neutral values.
        let c = fields(r#"{"repetition_penalty": 1.2}"#).unwrap();
        assert_eq!(
            c.penalties,
            Some(Penalties {
                presence: 0.0,
                frequency: 0.0,
                repetition: 1.2
            })
        );
    }

    #[test]
    fn out_of_range_values_are_400s_naming_the_field() {
        refused(
            r#"{"presence_penalty": 2.5}"#,
            "presence_penalty",
            &["between -2 and 2", "2.5"],
        );
        refused(r#"{"frequency_penalty": -3}"#, "frequency_penalty", &["-3"]);
        refused(
            r#"{"repetition_penalty": 0}"#,
            "repetition_penalty",
            &["greater than 0"],
        );
        refused(
            r#"{"repetition_penalty": -1}"#,
            "repetition_penalty",
            &["-1"],
        );
        refused(r#"{"min_tokens": -1}"#, "min_tokens", &["at least 0"]);
        refused(
            r#"{"logit_bias": {"5": 101}}"#,
            "logit_bias",
            &["between -100 and 100", "101"],
        );
        refused(r#"{"logit_bias": {"5": "x"}}"#, "logit_bias", &["a number"]);
        refused(
            r#"{"logit_bias": {"300": 1}}"#,
            "logit_bias",
            &["\"300\"", "0 to 299"],
        );
        refused(r#"{"logit_bias": {"-1": 1}}"#, "logit_bias", &["\"-1\""]);
        refused(r#"{"logit_bias": {"a": 1}}"#, "logit_bias", &["\"a\""]);
        refused(
            r#"{"logit_bias": {"5": 1, "05": 2}}"#,
            "logit_bias",
            &["token 5 twice"],
        );
        refused(
            r#"{"logit_bias": [1]}"#,
            "logit_bias",
            &["an object", "an array"],
        );
        let many: Vec<String> = (0..301).map(|i| format!("\"{i}\": 1")).collect();
        refused(
            &format!(r#"{{"logit_bias": {{{}}}}}"#, many.join(",")),
            "logit_bias",
            &["at most 300"],
        );
        refused(
            r#"{"stop_token_ids": [1, 300]}"#,
            "stop_token_ids",
            &["stop_token_ids[1] = 300", "0 to 299"],
        );
        refused(r#"{"stop_token_ids": [-1]}"#, "stop_token_ids", &["-1"]);
        refused(r#"{"stop_token_ids": ["1"]}"#, "stop_token_ids", &["\"1\""]);
        refused(
            r#"{"stop_token_ids": 5}"#,
            "stop_token_ids",
            &["an array of token ids", "a number"],
        );
        assert!(check_min_tokens(5, 5, "max_tokens").is_ok());
        match check_min_tokens(6, 5, "max_completion_tokens") {
            Err(ApiError::InvalidRequest { message, param }) => {
                assert_eq!(param.as_deref(), Some("min_tokens"));
                assert!(message.contains("`max_completion_tokens` (5)"), "{message}");
            }
            other => panic!("{other:?}"),
        }
    }
}
