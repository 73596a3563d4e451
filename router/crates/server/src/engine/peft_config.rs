//! A PEFT LoRA `adapter_config.json` checked in the router before any worker sees it: every
//! field the worker reads is type-checked, and every regex-valued one is compiled with a
//! linear-time engine (the `regex` crate) or refused, with a message naming the field and never
//! quoting the file. The worker matches the same patterns with the same engine and limits
//! (`deltaserve._native.regex_match`), so nothing a client registers can crash or freeze it.
//!
//! ```text
//!  target_modules   "all-linear" | regex (fullmatch) | [name, ...]      required
//!  exclude_modules  null | regex (fullmatch) | [name, ...]
//!  layers_to_transform  null | int | [int, ...];  layers_pattern  null | str | [str, ...]
//!  rank_pattern / alpha_pattern  null | {regex key: int rank | number}
//!  peft_type "LORA"; r int 1..=256; lora_alpha finite number; use_rslora, fan_in_fan_out bool;
//!  bias str
//! ```

use std::io::Read;
use std::path::Path;

use regex::RegexBuilder;
use serde_json::{Map, Value};

/// The file checked.
pub const CONFIG_NAME: &str = "adapter_config.json";
/// Largest `adapter_config.json` read (PEFT writes a few KiB).
pub const MAX_CONFIG_BYTES: u64 = 1 << 20;
/// Longest regex accepted, in bytes (the worker's limit too).
pub const MAX_PATTERN_BYTES: usize = 4096;
/// Largest compiled program (and lazy DFA cache) of one regex, in bytes (the worker's too).
pub const MAX_COMPILED_BYTES: usize = 1 << 20;
/// Deepest nesting of groups and repetitions in one regex (the worker's too).
pub const MAX_NESTING: u32 = 64;
/// The ranks the worker serves.
const RANKS: std::ops::RangeInclusive<i64> = 1..=256;

/// Reads and checks `dir/adapter_config.json`; the error names the file and the field.
pub fn check_lora_config(dir: &Path) -> Result<(), String> {
    let config = read_config(dir).map_err(|e| format!("{CONFIG_NAME}: {e}"))?;
    check_fields(&config).map_err(|e| format!("{CONFIG_NAME}: {e}"))
}

/// The file as a JSON object, read up to [`MAX_CONFIG_BYTES`].
fn read_config(dir: &Path) -> Result<Map<String, Value>, String> {
    let file = std::fs::File::open(dir.join(CONFIG_NAME))
        .map_err(|_| "cannot be opened as a file".to_string())?;
    let mut bytes = Vec::new();
    file.take(MAX_CONFIG_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|_| "cannot be read".to_string())?;
    if bytes.len() as u64 > MAX_CONFIG_BYTES {
        return Err(format!("is larger than {MAX_CONFIG_BYTES} bytes"));
    }
    match serde_json::from_slice::<Value>(&bytes) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err("must hold a JSON object".into()),
        Err(e) => Err(format!(
            "is not valid JSON (line {}, column {})",
            e.line(),
            e.column()
        )),
    }
}

/// Every field the worker reads, by type and (for regexes) by compiling it.
fn check_fields(c: &Map<String, Value>) -> Result<(), String> {
    let present = |key: &str| c.get(key).filter(|v| !v.is_null());
    if c.get("peft_type").and_then(Value::as_str) != Some("LORA") {
        return Err("field 'peft_type' must be \"LORA\" (only LoRA adapters are served)".into());
    }
    check_rank("field 'r'", c.get("r"))?;
    match c.get("lora_alpha") {
        Some(Value::Number(n)) if n.as_f64().is_some_and(f64::is_finite) => {}
        _ => return Err("field 'lora_alpha' must be a finite number".into()),
    }
    for key in ["use_rslora", "fan_in_fan_out"] {
        if c.get(key).is_some_and(|v| !v.is_boolean()) {
            return Err(format!("field '{key}' must be a boolean"));
        }
    }
    if c.get("bias").is_some_and(|v| !v.is_string()) {
        return Err("field 'bias' must be a string".into());
    }
    match present("target_modules") {
        None => return Err("field 'target_modules' is missing".into()),
        Some(Value::String(s)) if s == "all-linear" => {}
        Some(Value::String(s)) => compile("field 'target_modules'", &fullmatch(s))?,
        Some(v) => string_list("target_modules", v)?,
    }
    match present("exclude_modules") {
        None => {}
        Some(Value::String(s)) => compile("field 'exclude_modules'", &fullmatch(s))?,
        Some(v) => string_list("exclude_modules", v)?,
    }
    match present("layers_to_transform") {
        None => {}
        Some(v) if v.is_i64() || v.is_u64() => {}
        Some(Value::Array(items)) if items.iter().all(|i| i.is_i64() || i.is_u64()) => {}
        Some(_) => {
            return Err(
                "field 'layers_to_transform' must be an integer or a list of integers".into(),
            )
        }
    }
    match present("layers_pattern") {
        None => {}
        Some(Value::String(p)) => compile("field 'layers_pattern'", &layers_wrapper(p))?,
        Some(Value::Array(items)) => {
            for (i, item) in items.iter().enumerate() {
                let Value::String(p) = item else {
                    return Err(format!("field 'layers_pattern'[{i}] must be a string"));
                };
                compile(&format!("field 'layers_pattern'[{i}]"), &layers_wrapper(p))?;
            }
        }
        Some(_) => {
            return Err("field 'layers_pattern' must be a string or a list of strings".into())
        }
    }
    for key in ["rank_pattern", "alpha_pattern"] {
        match present(key) {
            None => {}
            Some(Value::Object(entries)) => {
                // (serde_json's map is sorted: no position is named, the file's order is lost.)
                for (pattern, value) in entries {
                    compile(
                        &format!("a key of field '{key}'"),
                        &pattern_key_wrapper(pattern),
                    )?;
                    let what = format!("a value of field '{key}'");
                    if key == "rank_pattern" {
                        check_rank(&what, Some(value))?;
                    } else if !value.as_f64().is_some_and(f64::is_finite) {
                        return Err(format!("{what} must be a finite number"));
                    }
                }
            }
            Some(_) => {
                return Err(format!(
                    "field '{key}' must be an object mapping module patterns to values"
                ))
            }
        }
    }
    Ok(())
}

/// A rank: an integer in [`RANKS`].
fn check_rank(what: &str, value: Option<&Value>) -> Result<(), String> {
    match value.and_then(Value::as_i64) {
        Some(r) if RANKS.contains(&r) && !value.is_some_and(Value::is_f64) => Ok(()),
        _ => Err(format!(
            "{what} must be an integer rank from {} to {}",
            RANKS.start(),
            RANKS.end()
        )),
    }
}

/// A list of strings (module names matched by suffix, no regex).
fn string_list(field: &str, v: &Value) -> Result<(), String> {
    match v {
        Value::Array(items) if items.iter().all(Value::is_string) => Ok(()),
        _ => Err(format!(
            "field '{field}' must be a string or a list of strings"
        )),
    }
}

/// `re.fullmatch(p, name)` as the worker runs it.
fn fullmatch(p: &str) -> String {
    format!(r"\A(?:{p})\z")
}

/// PEFT's `layers_pattern` use: `re.match(rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.", name)`.
fn layers_wrapper(p: &str) -> String {
    format!(r"\A(?:(?:^|.*?\.){p}\.(?P<idx>\d+)\.)")
}

/// PEFT's `rank_pattern` / `alpha_pattern` key use: `re.match(rf"(.*\.)?({k})$", name)`.
fn pattern_key_wrapper(k: &str) -> String {
    format!(r"\A(?:(.*\.)?({k})$)")
}

/// Compiles `pattern` with the worker's limits; the error names `what` (the field), never the
/// pattern.
fn compile(what: &str, pattern: &str) -> Result<(), String> {
    if pattern.len() > MAX_PATTERN_BYTES {
        return Err(format!(
            "{what} is a regex of more than {MAX_PATTERN_BYTES} bytes"
        ));
    }
    RegexBuilder::new(pattern)
        .size_limit(MAX_COMPILED_BYTES)
        .dfa_size_limit(MAX_COMPILED_BYTES)
        .nest_limit(MAX_NESTING)
        .build()
        .map(drop)
        .map_err(|e| match e {
            regex::Error::CompiledTooBig(limit) => {
                format!("{what} is a regex that needs more than {limit} bytes once compiled")
            }
            _ => format!(
                "{what} is not a regular expression the server accepts (malformed, or \
                 look-around / back-references, which are not supported)"
            ),
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn check(v: Value) -> Result<(), String> {
        check_fields(v.as_object().unwrap())
    }

    fn base() -> Value {
        json!({"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"],
               "exclude_modules": null, "layers_pattern": null, "rank_pattern": {},
               "alpha_pattern": {}, "use_rslora": false, "bias": "none"})
    }

    fn with(key: &str, value: Value) -> Value {
        let mut v = base();
        v[key] = value;
        v
    }

    #[track_caller]
    fn refused(v: Value, needles: &[&str]) {
        let err = check(v).expect_err("expected a refusal");
        for n in needles {
            assert!(err.contains(n), "{err:?} lacks {n:?}");
        }
    }

    #[test]
    fn peft_configs_pass() {
        check(base()).unwrap();
        check(with("target_modules", json!("all-linear"))).unwrap();
        check(with("target_modules", json!(r".*\.(q_proj|v_proj)"))).unwrap();
        check(with("exclude_modules", json!(["k_proj"]))).unwrap();
        check(with("layers_to_transform", json!([0, 1]))).unwrap();
        check(with("layers_pattern", json!("layers"))).unwrap();
        check(with(
            "rank_pattern",
            json!({"q_proj": 4, r"layers\.0\..*": 2}),
        ))
        .unwrap();
        check(with("alpha_pattern", json!({"q_proj": 4.5}))).unwrap();
    }

    #[test]
    fn the_crash_configs_of_issue_28_are_refused_naming_the_field() {
        refused(
            with("exclude_modules", json!("(")),
            &["'exclude_modules'", "regular expression"],
        );
        refused(with("layers_pattern", json!("[")), &["'layers_pattern'"]);
        refused(
            with("layers_pattern", json!(5)),
            &["'layers_pattern'", "string"],
        );
        refused(with("layers_pattern", json!([5])), &["'layers_pattern'[0]"]);
        refused(
            with("rank_pattern", json!({"(": 4})),
            &["a key of field 'rank_pattern'"],
        );
        refused(
            with("alpha_pattern", json!({"q": 1, "a[": 4})),
            &["a key of field 'alpha_pattern'"],
        );
        refused(
            with("target_modules", json!("(?=q)q_proj")),
            &["'target_modules'", "look-around"],
        );
        refused(
            with("target_modules", json!(r"(a)\1")),
            &["'target_modules'"],
        );
        refused(
            with("target_modules", json!("a{1000}{1000}")),
            &["'target_modules'", "compiled"],
        );
    }

    #[test]
    fn a_backtracking_pattern_compiles_and_matches_in_linear_time() {
        // Catastrophic for a backtracking engine; linear here, so it is accepted.
        check(with("target_modules", json!("(a+)+$"))).unwrap();
        let re = regex::Regex::new(&fullmatch("(a+)+$")).unwrap();
        let name = format!("{}b", "a".repeat(100_000));
        let started = std::time::Instant::now();
        assert!(!re.is_match(&name));
        assert!(started.elapsed().as_secs() < 5);
    }

    #[test]
    fn every_field_is_type_checked_without_quoting_the_file() {
        let secret = "sk-SECRET-123";
        for (key, value) in [
            ("peft_type", json!(secret)),
            ("r", json!(secret)),
            ("r", json!(0)),
            ("r", json!(8.5)),
            ("lora_alpha", json!(secret)),
            ("use_rslora", json!(secret)),
            ("fan_in_fan_out", json!(1)),
            ("bias", json!(5)),
            ("target_modules", json!(5)),
            ("target_modules", json!([secret, 5])),
            ("exclude_modules", json!({"a": secret})),
            ("layers_to_transform", json!(secret)),
            ("layers_to_transform", json!([1.5])),
            ("rank_pattern", json!(secret)),
            ("rank_pattern", json!({"q_proj": secret})),
            ("alpha_pattern", json!({"q_proj": secret})),
        ] {
            let err = check(with(key, value)).expect_err(key);
            assert!(err.contains(&format!("'{key}")), "{err}");
            assert!(!err.contains(secret), "{err}");
        }
        refused(
            json!({"peft_type": "LORA", "r": 8, "lora_alpha": 8}),
            &["'target_modules' is missing"],
        );
    }

    #[test]
    fn the_file_is_bounded_and_must_be_a_json_object() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(CONFIG_NAME);
        let err = check_lora_config(dir.path()).unwrap_err();
        assert!(err.contains("cannot be opened"), "{err}");
        std::fs::write(&path, "sk-SECRET not json").unwrap();
        let err = check_lora_config(dir.path()).unwrap_err();
        assert!(
            err.contains("not valid JSON") && !err.contains("SECRET"),
            "{err}"
        );
        std::fs::write(&path, "[1]").unwrap();
        assert!(check_lora_config(dir.path())
            .unwrap_err()
            .contains("JSON object"));
        std::fs::write(&path, " ".repeat(MAX_CONFIG_BYTES as usize + 1)).unwrap();
        assert!(check_lora_config(dir.path())
            .unwrap_err()
            .contains("larger than"));
        std::fs::write(&path, base().to_string()).unwrap();
        check_lora_config(dir.path()).unwrap();
    }
}
