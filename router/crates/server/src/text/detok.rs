//! [`DetokStream`]: one request's incremental detokenizer and stop-string matcher.
//!
//! # Decoding a window
//!
//! A token's text depends on its neighbours (byte-level BPE tokens carry parts of UTF-8
//! characters; SentencePiece drops the leading space of the first token decoded). So, as TGI and
//! vLLM do, each step decodes a small window of ids twice and emits the difference:
//!
//! ```text
//!   ids:  [ ... | prefix_offset .......... read_offset ........ new token ]
//!                 └── prefix_text ──────┘
//!                 └── new_text ────────────────────────────────────────┘
//!   delta = new_text[len(prefix_text)..]   unless new_text ends in U+FFFD (an incomplete
//!                                          character: wait for the next token)
//!   on emit: prefix_offset = read_offset, read_offset = len(ids)
//! ```
//!
//! The window starts with the last few prompt tokens, so the first generated token is decoded in
//! context. Concatenating every delta plus [`DetokStream::flush`] gives `decode(generated ids)`.
//!
//! # Stop strings
//!
//! Decoded text goes into `pending`. If a stop string occurs in it, the text before the match is
//! emitted, the match and everything after are dropped, and the stream is stopped (when several
//! matches are present, the one that ends first wins: that is the one a character-by-character
//! reader would have seen first). Otherwise all of `pending` is emitted except its longest suffix
//! that is a proper prefix of some stop string; that suffix waits until later text rules the
//! stop in or out, or until `flush` at a non-stop finish.
//!
//! With `min_tokens` ([`DetokStream::with_min_tokens`]), text decoded while fewer output tokens
//! than that exist is emitted without looking for stop strings (vLLM's stop checker skips them
//! too); matching starts with the text of output token `min_tokens`.

use std::sync::Arc;

use super::tokenizer::TextTokenizer;

/// Prompt tokens decoded in front of the first generated token, for context.
const PROMPT_CONTEXT_TOKENS: usize = 5;

/// What one pushed token produced.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepText {
    /// Text now safe to send to the client (may be empty).
    pub delta: String,
    /// A stop string appeared: the request must end, and `delta` is the last text it gets.
    pub stopped: bool,
}

/// Incremental detokenizer of one request's output, with its stop strings.
pub struct DetokStream {
    /// Shared tokenizer of the served model.
    tokenizer: Arc<TextTokenizer>,
    /// The prompt's last tokens (context only) followed by every generated token.
    ids: Vec<u32>,
    /// Start of the decoding window in `ids`.
    prefix_offset: usize,
    /// End of the text already decoded into `pending` or emitted.
    read_offset: usize,
    /// Stop strings (never empty strings).
    stop: Vec<String>,
    /// Decoded text not yet emitted because it could be the start of a stop string.
    pending: String,
    /// A stop string was found; nothing more is emitted.
    stopped: bool,
    /// Output tokens pushed so far.
    generated: u32,
    /// Stop strings are looked for once `generated` reaches this.
    min_tokens: u32,
}

impl DetokStream {
    /// A stream for a request with this prompt and these stop strings (empty strings ignored).
    pub fn new(tokenizer: Arc<TextTokenizer>, prompt_ids: &[u32], stop: Vec<String>) -> Self {
        let tail = &prompt_ids[prompt_ids.len().saturating_sub(PROMPT_CONTEXT_TOKENS)..];
        // A prompt (given as token ids) may end inside a character; its text would change once
        // the first generated token completes it, so such a tail gives no usable context.
        let tail_text = tokenizer.decode(tail).unwrap_or_default();
        let ids = if tail_text.ends_with(char::REPLACEMENT_CHARACTER) {
            Vec::new()
        } else {
            tail.to_vec()
        };
        Self {
            tokenizer,
            read_offset: ids.len(),
            prefix_offset: 0,
            ids,
            stop: stop.into_iter().filter(|s| !s.is_empty()).collect(),
            pending: String::new(),
            stopped: false,
            generated: 0,
            min_tokens: 0,
        }
    }

    /// No stop string is looked for in the text of the first `min_tokens - 1` output tokens.
    pub fn with_min_tokens(mut self, min_tokens: u32) -> Self {
        self.min_tokens = min_tokens;
        self
    }

    /// Whether stop strings are looked for yet.
    fn checking(&self) -> bool {
        self.generated >= self.min_tokens
    }

    /// Adds one generated token; returns the text it makes safe to emit.
    pub fn push(&mut self, token_id: u32) -> StepText {
        if self.stopped {
            return StepText {
                delta: String::new(),
                stopped: true,
            };
        }
        self.ids.push(token_id);
        self.generated += 1;
        if let Some(text) = self.decode_new(false) {
            self.pending.push_str(&text);
        }
        if !self.checking() {
            return StepText {
                delta: std::mem::take(&mut self.pending),
                stopped: false,
            };
        }
        self.release()
    }

    /// At a finish that was not a stop string: the text still held back (an incomplete
    /// character comes out as U+FFFD, as in a full decode). Empty after a stop.
    pub fn flush(&mut self) -> String {
        if self.stopped {
            return String::new();
        }
        if let Some(text) = self.decode_new(true) {
            self.pending.push_str(&text);
        }
        if let Some((start, _)) = self.first_stop().filter(|_| self.checking()) {
            self.pending.truncate(start);
            self.stopped = true;
        }
        std::mem::take(&mut self.pending)
    }

    /// True once a stop string was found.
    pub fn is_stopped(&self) -> bool {
        self.stopped
    }

    /// Text of the window beyond `read_offset`, if it is complete (or `force`), advancing the
    /// window.
    fn decode_new(&mut self, force: bool) -> Option<String> {
        if self.read_offset >= self.ids.len() {
            return None;
        }
        let prefix_text = self
            .tokenizer
            .decode(&self.ids[self.prefix_offset..self.read_offset])
            .unwrap_or_default();
        let new_text = self
            .tokenizer
            .decode(&self.ids[self.prefix_offset..])
            .unwrap_or_default();
        let complete = !new_text.ends_with(char::REPLACEMENT_CHARACTER);
        if new_text.len() <= prefix_text.len() || !(complete || force) {
            return None;
        }
        let delta = new_text.get(prefix_text.len()..)?.to_string();
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        Some(delta)
    }

    /// Emits what `pending` allows: up to a stop string, or all but a possible stop start.
    fn release(&mut self) -> StepText {
        if let Some((start, _)) = self.first_stop() {
            self.pending.truncate(start);
            self.stopped = true;
            return StepText {
                delta: std::mem::take(&mut self.pending),
                stopped: true,
            };
        }
        let hold = self.held_suffix_len();
        let delta = self.pending.drain(..self.pending.len() - hold).collect();
        StepText {
            delta,
            stopped: false,
        }
    }

    /// The stop-string match in `pending` that ends first (ties: the one starting first), as
    /// `(start, end)` byte offsets.
    fn first_stop(&self) -> Option<(usize, usize)> {
        self.stop
            .iter()
            .filter_map(|s| {
                self.pending
                    .find(s.as_str())
                    .map(|start| (start, start + s.len()))
            })
            .min_by_key(|&(start, end)| (end, start))
    }

    /// Length of the longest suffix of `pending` that is a proper prefix of a stop string.
    fn held_suffix_len(&self) -> usize {
        let mut hold = 0;
        for s in &self.stop {
            for k in (hold + 1..s.len()).rev() {
                if s.is_char_boundary(k) && self.pending.ends_with(&s[..k]) {
                    hold = k;
                    break;
                }
            }
        }
        hold
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::text::test_support::{tiny_tokenizer, SPECIALS};

    /// Pushes every id, then flushes unless stopped; returns the deltas and the flushed text.
    fn run(stream: &mut DetokStream, ids: &[u32]) -> (Vec<String>, String, bool) {
        let mut deltas = Vec::new();
        for &id in ids {
            let step = stream.push(id);
            deltas.push(step.delta);
            if step.stopped {
                return (deltas, String::new(), true);
            }
        }
        (deltas, stream.flush(), false)
    }

    /// The reference: the full decode cut at the stop match that ends first.
    fn truncate_at_stop(text: &str, stops: &[String]) -> String {
        let first = stops
            .iter()
            .filter(|s| !s.is_empty())
            .filter_map(|s| text.find(s.as_str()).map(|p| (p + s.len(), p)))
            .min();
        match first {
            Some((_, start)) => text[..start].to_string(),
            None => text.to_string(),
        }
    }

    #[test]
    fn multibyte_characters_split_over_tokens_never_emit_replacement() {
        let tok = tiny_tokenizer();
        let text = " the 日本語 théâtre 🎉🎉 done";
        let ids = tok.encode(text, false).unwrap();
        // One token per byte at least somewhere inside a character.
        assert!(ids
            .iter()
            .any(|&id| tok.decode(&[id]).unwrap().contains('\u{FFFD}')));
        let prompt = tok.encode("Hello", true).unwrap();
        let mut stream = DetokStream::new(tok.clone(), &prompt, vec![]);
        let (deltas, flushed, stopped) = run(&mut stream, &ids);
        assert!(!stopped);
        for d in &deltas {
            assert!(
                !d.contains('\u{FFFD}'),
                "delta {d:?} has a replacement character"
            );
        }
        assert_eq!(deltas.concat() + &flushed, text);
        // The emoji's first token (F0 9F) emits nothing on its own.
        assert!(deltas.iter().any(|d| d.is_empty()));
    }

    #[test]
    fn flush_returns_incomplete_tail_like_a_full_decode() {
        let tok = tiny_tokenizer();
        let ids = tok.encode("ab🎉", false).unwrap();
        let cut = &ids[..ids.len() - 1]; // the emoji without its last bytes
        let mut stream = DetokStream::new(tok.clone(), &[], vec![]);
        let (deltas, flushed, _) = run(&mut stream, cut);
        assert_eq!(deltas.concat(), "ab");
        assert_eq!(flushed, "\u{FFFD}");
        assert_eq!(deltas.concat() + &flushed, tok.decode(cut).unwrap());
        assert_eq!(stream.flush(), "", "flush twice gives nothing more");
    }

    #[test]
    fn stop_string_spanning_tokens_is_held_then_dropped() {
        let tok = tiny_tokenizer();
        let ids = tok.encode("hello ST ok STOP more", false).unwrap();
        let mut stream = DetokStream::new(tok.clone(), &[], vec!["STOP".into()]);
        let mut out = String::new();
        let mut saw_hold = false;
        for &id in &ids {
            let step = stream.push(id);
            out.push_str(&step.delta);
            if !step.stopped {
                // Text that could start "STOP" is never emitted before it is ruled out.
                assert!(
                    ["S", "ST", "STO"].iter().all(|p| !out.ends_with(p)),
                    "{out:?}"
                );
                saw_hold |= step.delta.is_empty() && !tok.decode(&[id]).unwrap().is_empty();
            }
            if step.stopped {
                break;
            }
        }
        assert!(saw_hold);
        assert!(stream.is_stopped());
        assert_eq!(out, "hello ST ok ");
        assert_eq!(
            stream.push(ids[0]),
            StepText {
                delta: String::new(),
                stopped: true
            }
        );
        assert_eq!(stream.flush(), "");
    }

    #[test]
    fn stop_across_byte_tokens_and_at_the_start() {
        let tok = tiny_tokenizer();
        // Stop string made of single-byte tokens ("x", "y", "z" have no merges).
        let ids = tok.encode("abxyzcd", false).unwrap();
        let mut stream = DetokStream::new(tok.clone(), &[], vec!["xyz".into()]);
        let (deltas, _, stopped) = run(&mut stream, &ids);
        assert!(stopped);
        assert_eq!(deltas.concat(), "ab");
        // The very first token is (the start of) the stop string.
        let ids = tok.encode("STOP after", false).unwrap();
        let mut stream = DetokStream::new(tok.clone(), &[], vec!["STOP".into()]);
        let step = stream.push(ids[0]);
        assert_eq!(
            step,
            StepText {
                delta: String::new(),
                stopped: true
            }
        );
        // A held prefix that turns out not to be a stop is released, and flushed at the end.
        let ids = tok.encode("a S", false).unwrap();
        let mut stream = DetokStream::new(tok.clone(), &[], vec!["STOP".into()]);
        let (deltas, flushed, stopped) = run(&mut stream, &ids);
        assert!(!stopped);
        assert_eq!(deltas.concat(), "a ");
        assert_eq!(flushed, "S");
    }

    #[test]
    fn stop_strings_are_not_looked_for_before_min_tokens() {
        let tok = tiny_tokenizer();
        let ids = tok.encode("xyabxy", false).unwrap();
        assert_eq!(ids.len(), 6, "single-byte tokens");
        // The first "xy" ends at output token 2 < min_tokens 3: emitted; the second stops.
        let mut stream = DetokStream::new(tok.clone(), &[], vec!["xy".into()]).with_min_tokens(3);
        let (deltas, _, stopped) = run(&mut stream, &ids);
        assert!(stopped);
        assert_eq!(deltas.concat(), "xyab");
        // A finish before min_tokens flushes everything, stop strings included.
        let mut stream = DetokStream::new(tok.clone(), &[], vec!["xy".into()]).with_min_tokens(9);
        let (deltas, flushed, stopped) = run(&mut stream, &ids);
        assert!(!stopped);
        assert_eq!(deltas.concat() + &flushed, "xyabxy");
        // min_tokens 1 is the same as none.
        let mut stream = DetokStream::new(tok.clone(), &[], vec!["xy".into()]).with_min_tokens(1);
        assert!(run(&mut stream, &ids).2);
    }

    #[test]
    fn stop_ending_first_wins() {
        let tok = tiny_tokenizer();
        let ids = tok.encode("zabcd", false).unwrap();
        let stops = vec!["abcd".to_string(), "bc".to_string()];
        let mut stream = DetokStream::new(tok.clone(), &[], stops.clone());
        let (deltas, _, stopped) = run(&mut stream, &ids);
        assert!(stopped);
        assert_eq!(deltas.concat(), "za");
        assert_eq!(truncate_at_stop("zabcd", &stops), "za");
    }

    /// xorshift64*: a deterministic generator for the property test (no `rand` dependency).
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
    }

    #[test]
    fn property_deltas_plus_flush_equal_truncated_full_decode() {
        let tok = tiny_tokenizer();
        let vocab = tok.vocab_size();
        // Tokens of real text (including split multi-byte characters) mixed with arbitrary ids
        // (invalid UTF-8 byte runs, special tokens).
        let corpus = tok
            .encode(" the STOP hello 日本 théâtre 🎉 orll ", false)
            .unwrap();
        let specials: Vec<u32> = SPECIALS
            .iter()
            .map(|s| tok.token_to_id(s).unwrap())
            .collect();
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
        let mut stopped_cases = 0;
        for case in 0..400 {
            let len = 1 + rng.below(40);
            let ids: Vec<u32> = (0..len)
                .map(|_| match rng.below(10) {
                    0 => rng.below(vocab) as u32,
                    1 => specials[rng.below(specials.len())],
                    _ => corpus[rng.below(corpus.len())],
                })
                .collect();
            let full = tok.decode(&ids).unwrap();
            // Stop strings: substrings of this output (so they do occur), or fixed ones.
            let mut stops = Vec::new();
            for _ in 0..rng.below(3) {
                let chars: Vec<char> = full.chars().collect();
                if chars.is_empty() || rng.below(3) == 0 {
                    stops.push(["STOP", "日", "e ", "\u{FFFD}", "🎉"][rng.below(5)].to_string());
                } else {
                    let a = rng.below(chars.len());
                    let b = (a + 1 + rng.below(4)).min(chars.len());
                    stops.push(chars[a..b].iter().collect());
                }
            }
            let prompt = if case % 2 == 0 {
                tok.encode("Q: the", true).unwrap()
            } else {
                Vec::new()
            };
            let mut stream = DetokStream::new(tok.clone(), &prompt, stops.clone());
            let (deltas, flushed, stopped) = run(&mut stream, &ids);
            let expected = truncate_at_stop(&full, &stops);
            assert_eq!(
                deltas.concat() + &flushed,
                expected,
                "case {case}: ids {ids:?} stops {stops:?} deltas {deltas:?}"
            );
            if stopped {
                stopped_cases += 1;
                assert_ne!(
                    expected, full,
                    "case {case}: stopped without a stop string in the text"
                );
            }
            if !full.contains('\u{FFFD}') {
                // Valid output: no delta ever shows a half character.
                assert!(
                    deltas.iter().all(|d| !d.contains('\u{FFFD}')),
                    "case {case}: {deltas:?}"
                );
            }
        }
        assert!(
            stopped_cases > 50,
            "the test must exercise stops: {stopped_cases}"
        );
    }
}
