//! `regex_match(pattern, texts, whole)`: Python `re.match` / `re.fullmatch` over a list of
//! strings with a linear-time engine (the `regex` crate), so a pattern from an adapter's config
//! (PEFT's `target_modules`, `exclude_modules`, `layers_pattern`, `rank_pattern` keys) can never
//! backtrack catastrophically in the worker. The limits are the router's
//! (`deltaserve-server`'s `peft_config`): what the router registered, the worker can match.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use regex::RegexBuilder;

/// Longest pattern accepted, in bytes.
const MAX_PATTERN_BYTES: usize = 4096;
/// Largest compiled program (and lazy DFA cache) a pattern may need, in bytes.
const MAX_COMPILED_BYTES: usize = 1 << 20;
/// Deepest nesting of groups and repetitions.
const MAX_NESTING: u32 = 64;

/// For each text, whether `pattern` matches at its start (`whole`: the whole text), as Python's
/// `re.match` (`re.fullmatch`) would for patterns both engines accept. `ValueError` naming the
/// problem (never quoting the pattern) when the pattern is too long, too large once compiled,
/// or not a regex this engine accepts (look-around and back-references are not: they are what
/// makes matching exponential).
#[pyfunction]
#[pyo3(signature = (pattern, texts, whole=false))]
pub fn regex_match(pattern: &str, texts: Vec<String>, whole: bool) -> PyResult<Vec<bool>> {
    if pattern.len() > MAX_PATTERN_BYTES {
        return Err(PyValueError::new_err(format!(
            "the pattern is {} bytes; at most {MAX_PATTERN_BYTES} are accepted",
            pattern.len()
        )));
    }
    let anchored = if whole {
        format!(r"\A(?:{pattern})\z")
    } else {
        format!(r"\A(?:{pattern})")
    };
    let regex = RegexBuilder::new(&anchored)
        .size_limit(MAX_COMPILED_BYTES)
        .dfa_size_limit(MAX_COMPILED_BYTES)
        .nest_limit(MAX_NESTING)
        .build()
        .map_err(|e| PyValueError::new_err(describe(&e)))?;
    Ok(texts.iter().map(|t| regex.is_match(t)).collect())
}

/// Why a pattern was refused, without quoting it.
fn describe(e: &regex::Error) -> String {
    match e {
        regex::Error::CompiledTooBig(limit) => {
            format!("the pattern needs more than {limit} bytes once compiled")
        }
        _ => "not a regular expression the linear-time engine accepts (look-around and \
              back-references are not supported) or malformed"
            .to_string(),
    }
}
