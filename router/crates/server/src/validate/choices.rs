//! `n` (choices per request, both endpoints) and `best_of` (candidates ranked by cumulative
//! logprob, `/v1/completions` only), checked against one bound: a request fans out into this
//! many engine requests (`crate::api::choices`), so it is small.

use crate::api::error::ApiError;

/// Most choices (`n`) and candidates (`best_of`) per request.
pub const MAX_CHOICES: i64 = 16;

/// `n`: absent or 1..=[`MAX_CHOICES`].
pub(super) fn check_n(n: Option<i64>) -> Result<u32, ApiError> {
    match n.unwrap_or(1) {
        n @ 1..=MAX_CHOICES => Ok(n as u32),
        n => Err(ApiError::invalid(
            "n",
            format!("`n` must be between 1 and {MAX_CHOICES}, got {n}"),
        )),
    }
}

/// `best_of`: absent (= `n`) or `n`..=[`MAX_CHOICES`]; more candidates than choices cannot
/// stream (the best are known only at the end), as in OpenAI's API.
pub(super) fn check_best_of(best_of: Option<i64>, n: u32, stream: bool) -> Result<u32, ApiError> {
    let Some(best_of) = best_of else {
        return Ok(n);
    };
    if !(1..=MAX_CHOICES).contains(&best_of) {
        return Err(ApiError::invalid(
            "best_of",
            format!("`best_of` must be between 1 and {MAX_CHOICES}, got {best_of}"),
        ));
    }
    if best_of < i64::from(n) {
        return Err(ApiError::invalid(
            "best_of",
            format!("`best_of` ({best_of}) must be at least `n` ({n})"),
        ));
    }
    if stream && best_of > i64::from(n) {
        return Err(ApiError::invalid(
            "best_of",
            "`best_of` greater than `n` cannot be used with `stream`",
        ));
    }
    Ok(best_of as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn param_and_message(e: ApiError) -> (Option<String>, String) {
        match e {
            ApiError::InvalidRequest { message, param } => (param, message),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn n_is_bounded() {
        assert_eq!(check_n(None).unwrap(), 1);
        assert_eq!(check_n(Some(16)).unwrap(), 16);
        for bad in [0, -1, 17] {
            let (param, message) = param_and_message(check_n(Some(bad)).unwrap_err());
            assert_eq!(param.as_deref(), Some("n"));
            assert!(message.contains("between 1 and 16"), "{message}");
        }
    }

    #[test]
    fn best_of_is_at_least_n_bounded_and_not_streamed() {
        assert_eq!(check_best_of(None, 3, true).unwrap(), 3);
        assert_eq!(check_best_of(Some(5), 2, false).unwrap(), 5);
        assert_eq!(check_best_of(Some(2), 2, true).unwrap(), 2, "= n streams");
        for (best_of, n, stream, needle) in [
            (1, 2, false, "at least `n` (2)"),
            (17, 1, false, "between 1 and 16"),
            (0, 1, false, "between 1 and 16"),
            (3, 1, true, "`stream`"),
        ] {
            let (param, message) =
                param_and_message(check_best_of(Some(best_of), n, stream).unwrap_err());
            assert_eq!(param.as_deref(), Some("best_of"));
            assert!(message.contains(needle), "{message}");
        }
    }
}
