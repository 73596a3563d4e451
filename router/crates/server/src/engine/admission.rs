//! Admission control that keeps goodput: one worker's estimate of what its steps cost, from the
//! step times it measured, and the decision to admit a request or refuse it at once (429 with
//! `Retry-After`) because it could not get its first token within the TTFT SLO.
//!
//! # The estimate ([`StepCosts`])
//!
//! Every step the worker answers is observed with its shape (decoding requests, prefill tokens)
//! and its time (the smaller of the worker's `StepTiming::busy_us`, its time on that step alone,
//! and the interval since the previous output). Two cheap moving estimates follow:
//!
//! - decode step time vs batch size `t(b)`: a moving mean per batch size over the steps
//!   without prefill, started from the smallest of a size's first [`ROBUST_START`] samples (a
//!   one-off hiccup, such as a first-time kernel compile, is not a size's cost); between measured
//!   sizes the line through the neighbours, outside them the line from the smallest to the
//!   largest (never falling). A size not seen for [`STALE_AFTER_DECODE_STEPS`] decode steps no
//!   longer counts;
//! - a mixed step's cost beyond its decodes, `F + s_tok·tokens`: a fixed part `F` (a step with a
//!   prefill runs eagerly, without the decode step's CUDA graph: on an H200 that alone is ~5 ms)
//!   and a cost per prefill token `s_tok` (its inverse is the prefill throughput, tokens/s), the
//!   line through exponentially weighted moments of `(tokens, step time − t(decoding requests))`
//!   over steps with a prefill. While the token counts hardly vary the line is undetermined, and
//!   the whole cost is per token (`F` = 0): priced per token alone, a fixed cost grows with the
//!   batch and caps it far below what the SLO allows;
//! - prefill tokens per decoding request per step, `x`: the ratio of the exponentially weighted
//!   means of prefill tokens and of decoding requests over the steps that decode, and the share
//!   `m` of those steps that carry a prefill. A running request's time per output token is its
//!   steps' time, prefills of the requests that join meanwhile included: in a steady state `x` =
//!   prompt tokens / output tokens of the requests served, so a step of `b` decoding requests
//!   costs `t(b) + m·F + b·x·s_tok` (the *effective* step). (A mean of per-step ratios would
//!   count a step of one decode beside a whole prompt as heavily as a full batch's.)
//!
//! # The decision ([`Admission`])
//!
//! A new request of `P` prompt tokens behind `Q` queued prompt tokens and `k − 1` queued requests
//! would see a TTFT of about
//!
//! ```text
//!   prefill: (Q + P)·s_tok + ceil((Q + P) / chunk)·(t(running) + F)      chunk = token budget − running
//!   slot:    max(0, k − free slots) / cap · mean output tokens · t(cap)   (slots free as requests end)
//! ```
//!
//! Once the queue has been drained under backlog for [`MIN_DRAIN_STEPS`] steps, the wait is
//! measured instead of modelled: the queue's drain rate `r` (requests that left it per
//! microsecond, over the steps that began with requests waiting, decayed over
//! [`DRAIN_WINDOW_STEPS`]) gives the `k`-th queued request
//!
//! ```text
//!   queue:   k / r          prefill: t(running) + F + (P + running·x)·s_tok   (its own chunk, in one step)
//! ```
//!
//! (the model above priced slots from decode-only steps, which under overload are rare and
//! cheaper than the steps that run: on an H200 at 2× saturation it predicted 114 ms where
//! admitted requests waited 1.1 s).
//!
//! It is refused when that exceeds [`TTFT_HEADROOM`] of the TTFT SLO; `Retry-After` is the predicted time for the
//! queue ahead of it to drain (at least 1 s). The running batch is capped at the largest `b` whose
//! effective step is within the TPOT SLO (the actor gives the cap to its scheduler; requests beyond it wait
//! in the queue and count toward the TTFT). A size measured within the SLO (by its decode step
//! priced as an effective step, or by the time of every step with that many decoding requests,
//! prefills included) lets the batch grow an eighth past it (so an estimate from a few small
//! batches cannot keep it small); a size whose every-step time was measured over the SLO
//! [`ROBUST_START`] times caps it below, for [`CAP_EVIDENCE_STEPS`] steps of any kind since it
//! was last measured (the batch may then reach the size again and measure it
//! anew: a cap is never a ratchet, however rarely steps without a prefill come). With nothing queued and a free slot, or on an idle worker, a
//! request is always admitted. Until [`MIN_DECODE_SAMPLES`] decode steps were
//! measured every request is admitted (the static `--max-queued-per-worker` cap still applies).
//!
//! Admission control is on when an operator sets an SLO (`--ttft-slo-ms` or `--tpot-slo-ms`): a
//! server nobody gave a deadline queues every request, as vLLM-style servers do, and benchmarks of
//! saturated throughput admit everything. With one SLO set, the other is a measured default: TPOT
//! [`DEFAULT_TPOT_FACTOR`] × the unloaded decode step `t(1)`, TTFT [`DEFAULT_TTFT_FACTOR`] × `t(1)`
//! but at least [`MIN_DEFAULT_TTFT_US`].
//!
//! Pure: no clock, no IO; the actor feeds it measured microseconds and the handle asks it.

/// Weight of the newest sample in the moving estimates.
const NEW_SAMPLE_WEIGHT: f64 = 0.05;
/// Weight of the newest sample of one decode batch size (each size is seen less often).
const BUCKET_SAMPLE_WEIGHT: f64 = 0.2;
/// Decode steps measured before admission control refuses anything.
pub const MIN_DECODE_SAMPLES: u64 = 8;
/// Unset `--tpot-slo-ms`: this many unloaded decode steps.
pub const DEFAULT_TPOT_FACTOR: f64 = 10.0;
/// Unset `--ttft-slo-ms`: this many unloaded decode steps ...
pub const DEFAULT_TTFT_FACTOR: f64 = 500.0;
/// ... and at least this long, microseconds.
pub const MIN_DEFAULT_TTFT_US: f64 = 2_000_000.0;

/// Batch sizes tracked one by one; larger decode batches share the last bucket's estimate.
const MAX_TRACKED_BATCH: usize = 4096;
/// A batch size not seen for this many decode steps no longer counts (its time may be old).
pub const STALE_AFTER_DECODE_STEPS: u64 = 4096;
/// A size measured over the TPOT SLO caps the batch below it for this many steps of any kind
/// after its last measurement (under a steady stream of arrivals most steps carry a prefill, so
/// decode steps are no clock for it); then the batch may reach it again.
pub const CAP_EVIDENCE_STEPS: u64 = 1024;
/// A batch size's first samples: its estimate is their minimum (then a moving mean), and it
/// caps the batch only once measured this many times.
pub const ROBUST_START: u32 = 3;
/// A request is admitted while its predicted TTFT is within this share of the SLO. The
/// prediction is a mean: admitting up to the SLO itself let about half of the requests admitted
/// at the margin miss it (45 % of the admitted kept both SLOs on an H200 at 2× saturation, at
/// bda874f). With prefill and mixed steps replayed from CUDA graphs, 0.8 kept goodput at the
/// saturated throughput but only 78 % of the admitted within both SLOs (H200, 5c0e161); 0.7 kept
/// 91 %, goodput 1.28× the closed loop's saturation (H100, 862154c; `bench/README.md`).
pub const TTFT_HEADROOM: f64 = 0.7;
/// Mixed steps measured before their line (fixed part and slope) is trusted.
const MIN_MIXED_SAMPLES: u32 = 16;
/// The line needs token counts that vary: a standard deviation of at least this share of
/// their mean.
const MIN_TOKEN_SPREAD: f64 = 0.1;
mod drain;

pub use drain::{QueueDrain, DRAIN_WINDOW_STEPS, MIN_DRAIN_STEPS};

/// One decode batch size's estimate.
#[derive(Debug, Clone, Copy)]
struct Bucket {
    /// Step time, microseconds (see [`ROBUST_START`]).
    us: f64,
    /// Samples folded in.
    samples: u32,
    /// The decode step it was last seen at.
    seen: u64,
    /// The step (of any kind) it was last seen at.
    seen_step: u64,
}

/// `bucket` with one more sample of `us` at clock `now` (a stale or missing bucket starts over;
/// see [`ROBUST_START`]).
fn fold(bucket: Option<Bucket>, us: f64, now: u64, step: u64) -> Bucket {
    match bucket {
        Some(k) if now - k.seen <= STALE_AFTER_DECODE_STEPS => Bucket {
            us: if k.samples < ROBUST_START {
                k.us.min(us)
            } else {
                k.us + BUCKET_SAMPLE_WEIGHT * (us - k.us)
            },
            samples: k.samples.saturating_add(1),
            seen: now,
            seen_step: step,
        },
        _ => Bucket {
            us,
            samples: 1,
            seen: now,
            seen_step: step,
        },
    }
}

/// Moving estimates of one worker's step costs (see the module docs).
#[derive(Debug, Clone, Default)]
pub struct StepCosts {
    /// Per decode batch size.
    decode: Vec<Option<Bucket>>,
    decode_samples: u64,
    /// Per decode batch size, every step that decodes, prefills or not: what a running request
    /// measurably spends per output token at that size under the present arrivals (its
    /// staleness counts steps of any kind).
    every: Vec<Option<Bucket>>,
    /// Steps observed, of any kind (the clock of staleness).
    steps: u64,
    /// Moving moments of the mixed steps' (prefill tokens, time beyond their decodes).
    mixed: MixedSteps,
    /// Over the steps that decode: moving means of their prefill tokens and decoding requests,
    /// and the share of them with a prefill (see the module docs).
    tokens_per_decode_step: f64,
    decodes_per_decode_step: f64,
    mixed_share: f64,
}

/// Exponentially weighted moments of the mixed steps: prefill tokens `n` and the step time
/// beyond its decodes `y`, microseconds (see [`StepCosts::mixed_line`]).
#[derive(Debug, Clone, Copy, Default)]
struct MixedSteps {
    samples: u32,
    n: f64,
    nn: f64,
    y: f64,
    ny: f64,
}

impl MixedSteps {
    fn observe(&mut self, n: f64, y: f64) {
        let w = if self.samples == 0 {
            1.0
        } else {
            NEW_SAMPLE_WEIGHT
        };
        self.samples = self.samples.saturating_add(1);
        self.n += w * (n - self.n);
        self.nn += w * (n * n - self.nn);
        self.y += w * (y - self.y);
        self.ny += w * (n * y - self.ny);
    }
}

impl StepCosts {
    /// Folds in one measured step: `decode_seqs` requests decoding one token each,
    /// `prefill_tokens` prompt tokens, `step_us` microseconds.
    pub fn observe(&mut self, decode_seqs: usize, prefill_tokens: usize, step_us: f64) {
        self.steps += 1;
        if decode_seqs > 0 {
            let mixed = if prefill_tokens > 0 { 1.0 } else { 0.0 };
            self.tokens_per_decode_step +=
                NEW_SAMPLE_WEIGHT * (prefill_tokens as f64 - self.tokens_per_decode_step);
            self.decodes_per_decode_step +=
                NEW_SAMPLE_WEIGHT * (decode_seqs as f64 - self.decodes_per_decode_step);
            self.mixed_share += NEW_SAMPLE_WEIGHT * (mixed - self.mixed_share);
            let b = decode_seqs.min(MAX_TRACKED_BATCH);
            if self.every.len() <= b {
                self.every.resize(b + 1, None);
            }
            self.every[b] = Some(fold(self.every[b], step_us, self.steps, self.steps));
        }
        if prefill_tokens == 0 {
            if decode_seqs == 0 {
                return;
            }
            let b = decode_seqs.min(MAX_TRACKED_BATCH);
            if self.decode.len() <= b {
                self.decode.resize(b + 1, None);
            }
            self.decode_samples += 1;
            let now = self.decode_samples;
            self.decode[b] = Some(fold(self.decode[b], step_us, now, self.steps));
            return;
        }
        // Before a decode step was measured, the prefill's share of the step is unknown.
        let Some(decode_part) = self.decode_step_us(decode_seqs) else {
            return;
        };
        self.mixed
            .observe(prefill_tokens as f64, (step_us - decode_part).max(0.0));
    }

    /// A mixed step's cost beyond its decodes as `(F, s_tok)`: fixed microseconds and
    /// microseconds per prefill token (`None` before a mixed step was measured). The line
    /// through the moments once enough steps with varied token counts were seen, its slope
    /// within [0, mean cost per token]; otherwise all of it per token.
    pub fn mixed_line(&self) -> Option<(f64, f64)> {
        let m = &self.mixed;
        if m.samples == 0 || m.n <= 0.0 {
            return None;
        }
        let per_token = m.y / m.n;
        let var = (m.nn - m.n * m.n).max(0.0);
        if m.samples < MIN_MIXED_SAMPLES || var.sqrt() < MIN_TOKEN_SPREAD * m.n {
            return Some((0.0, per_token));
        }
        let slope = ((m.ny - m.n * m.y) / var).clamp(0.0, per_token);
        Some((m.y - slope * m.n, slope))
    }

    /// A mixed step's fixed cost beyond its decodes, microseconds (0 while undetermined).
    pub fn mixed_step_overhead_us(&self) -> f64 {
        self.mixed_line().map_or(0.0, |(fixed, _)| fixed)
    }

    /// Prefill tokens per decoding request per step, `x` (see the module docs).
    pub fn prefill_per_decode(&self) -> f64 {
        if self.decodes_per_decode_step > 0.0 {
            self.tokens_per_decode_step / self.decodes_per_decode_step
        } else {
            0.0
        }
    }

    /// Predicted time of a step decoding `batch` requests beside `prefill_tokens` prompt
    /// tokens, microseconds.
    pub fn mixed_step_us(&self, batch: usize, prefill_tokens: f64) -> Option<f64> {
        let t = self.decode_step_us(batch)?;
        if prefill_tokens <= 0.0 {
            return Some(t);
        }
        let (fixed, per_token) = self.mixed_line().unwrap_or((0.0, 0.0));
        Some(t + fixed + per_token * prefill_tokens)
    }

    /// Decode steps observed so far.
    pub fn decode_samples(&self) -> u64 {
        self.decode_samples
    }

    /// The measured batch sizes (not stale) and their step times, smallest first.
    fn points(&self) -> impl Iterator<Item = (usize, f64)> + '_ {
        self.buckets().map(|(b, k)| (b, k.us))
    }

    /// The batch sizes not stale, smallest first.
    fn buckets(&self) -> impl Iterator<Item = (usize, Bucket)> + '_ {
        let now = self.decode_samples;
        self.decode
            .iter()
            .enumerate()
            .filter_map(move |(b, k)| match k {
                Some(k) if now - k.seen <= STALE_AFTER_DECODE_STEPS => Some((b, *k)),
                _ => None,
            })
    }

    /// Predicted time of a step decoding `batch` requests, microseconds (`None` before any
    /// decode step was measured): the measured time at that batch size; between two measured
    /// sizes, the line through them; outside them, the line from the smallest to the largest
    /// (above: never below the largest's time; below: between half the smallest's and it).
    pub fn decode_step_us(&self, batch: usize) -> Option<f64> {
        let batch = batch.min(MAX_TRACKED_BATCH);
        let (mut first, mut below, mut above, mut last) = (None, None, None, None);
        for (b, t) in self.points() {
            first = first.or(Some((b, t)));
            last = Some((b, t));
            if b <= batch {
                below = Some((b, t));
            } else if above.is_none() {
                above = Some((b, t));
            }
        }
        let line = |(b0, t0): (usize, f64), (b1, t1): (usize, f64)| {
            let slope = if b1 > b0 {
                ((t1 - t0) / (b1 - b0) as f64).max(0.0)
            } else {
                0.0
            };
            t0 + slope * (batch as f64 - b0 as f64)
        };
        Some(match (below, above) {
            (Some((b, t)), _) if b == batch => t,
            (Some(lo), Some(hi)) => line(lo, hi),
            (None, Some((_, t))) => line(first?, last?).clamp(t / 2.0, t),
            (Some(lo), None) => line(first?, last?).max(lo.1),
            (None, None) => return None,
        })
    }

    /// The time a running request spends per output token in a step decoding `batch` requests,
    /// the prefills of requests joining at the measured rate included (the module docs'
    /// effective step), microseconds.
    pub fn effective_step_us(&self, batch: usize) -> Option<f64> {
        let t = self.decode_step_us(batch)?;
        Some(t + self.mixed_fixed_share_us() + batch as f64 * self.prefill_share_us())
    }

    /// Prefill time a decoding request brings into each step: `x · s_tok`, microseconds.
    fn prefill_share_us(&self) -> f64 {
        self.prefill_per_decode() * self.prefill_us_per_token().unwrap_or(0.0)
    }

    /// The mixed steps' fixed cost spread over every decoding step: `m · F`, microseconds.
    fn mixed_fixed_share_us(&self) -> f64 {
        self.mixed_share * self.mixed_step_overhead_us()
    }

    /// The largest batch size measured within `slo_us` (its every-step time, or its decode
    /// step priced as an effective step), and the smallest whose every-step time was measured
    /// over it at least [`ROBUST_START`] times, within the last [`CAP_EVIDENCE_STEPS`]. Only
    /// measured time per output token caps: the modelled effective step is an estimate, and
    /// capping on it let one bad estimate hold the batch far below the SLO.
    fn measured_bounds(&self, slo_us: f64) -> (Option<usize>, Option<usize>) {
        let (fixed, share) = (self.mixed_fixed_share_us(), self.prefill_share_us());
        let modelled = self
            .points()
            .filter(|(b, t)| *t + fixed + *b as f64 * share <= slo_us)
            .map(|(b, _)| b)
            .last();
        let fresh = |k: &Bucket| self.steps - k.seen_step <= STALE_AFTER_DECODE_STEPS;
        let every = || {
            self.every
                .iter()
                .enumerate()
                .filter_map(|(b, k)| k.filter(|k| fresh(k)).map(|k| (b, k)))
        };
        let measured = every()
            .filter(|(_, k)| k.us <= slo_us && k.samples >= ROBUST_START)
            .map(|(b, _)| b)
            .next_back();
        let over = every()
            .find(|(_, k)| {
                k.us > slo_us
                    && k.samples >= ROBUST_START
                    && self.steps - k.seen_step <= CAP_EVIDENCE_STEPS
            })
            .map(|(b, _)| b);
        (modelled.max(measured), over)
    }

    /// Measured prefill cost per prompt token, microseconds (the slope of [`Self::mixed_line`]).
    pub fn prefill_us_per_token(&self) -> Option<f64> {
        self.mixed_line().map(|(_, per_token)| per_token)
    }

    /// Prefill throughput, tokens per second.
    pub fn prefill_tokens_per_s(&self) -> Option<f64> {
        self.prefill_us_per_token()
            .filter(|us| *us > 0.0)
            .map(|us| 1e6 / us)
    }
}

/// The operator's SLOs (`--ttft-slo-ms`, `--tpot-slo-ms`); `None`: the measured default.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Slo {
    pub ttft_us: Option<f64>,
    pub tpot_us: Option<f64>,
}

impl Slo {
    /// Whether admission control is on: an SLO was set.
    pub fn is_set(&self) -> bool {
        self.ttft_us.is_some() || self.tpot_us.is_some()
    }

    /// From the flags' milliseconds (0 or absent: the measured default when the other is set;
    /// neither: admission control off).
    pub fn from_ms(ttft_ms: Option<u64>, tpot_ms: Option<u64>) -> Self {
        let us = |ms: Option<u64>| ms.filter(|m| *m > 0).map(|m| m as f64 * 1000.0);
        Self {
            ttft_us: us(ttft_ms),
            tpot_us: us(tpot_ms),
        }
    }
}

/// Why a request was refused at once: which bound, when to retry, and a message for people.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{message}")]
pub struct SloRefusal {
    /// The flag whose bound refused it (`ttft_slo_ms`).
    pub bound: &'static str,
    /// Seconds until the queue ahead is predicted to drain (at least 1).
    pub retry_after_secs: u64,
    pub message: String,
}

/// Admission control's `/metrics` rows of one worker.
#[derive(Debug, Clone, Copy, Default)]
pub struct AdmissionReadings {
    pub refused_ttft: u64,
    pub refused_queue_full: u64,
    pub predicted_queue_wait_us: u64,
    pub running_cap: u64,
    /// Admitted requests not yet scheduled.
    pub queued: u64,
    /// The queue's measured drain rate, requests per second (0 before it is measured).
    pub drain_per_s: u64,
    /// The estimates behind the cap and the TTFT prediction (0 before they are measured): the
    /// effective step at the cap and a mixed step's fixed cost, microseconds; the prefill cost
    /// per token, nanoseconds.
    pub effective_step_us: u64,
    pub mixed_step_overhead_us: u64,
    pub prefill_ns_per_token: u64,
}

/// One worker's admission state, shared by its actor (which measures steps and moves requests
/// out of the queue) and the engine handle (which admits or refuses).
#[derive(Debug, Clone)]
pub struct Admission {
    slo: Slo,
    costs: StepCosts,
    /// The operator's `--max-num-seqs` and `--max-num-batched-tokens`.
    max_num_seqs: usize,
    token_budget: usize,
    /// Requests in the running batch after the last step.
    running: usize,
    /// [`Self::running_cap`] as of the last step (computed once per step).
    cap: usize,
    /// Requests admitted and not yet scheduled, and their prompt tokens.
    queued_requests: usize,
    queued_prompt_tokens: u64,
    /// Moving mean of admitted requests' `max_tokens`.
    mean_output_tokens: f64,
    /// How fast the queue drains under backlog (see the module docs).
    drain: QueueDrain,
    /// Refusals: predicted TTFT over the SLO; the static queue cap.
    pub refused_ttft: u64,
    pub refused_queue_full: u64,
}

impl Admission {
    pub fn new(slo: Slo, max_num_seqs: usize, token_budget: usize) -> Self {
        Self {
            slo,
            costs: StepCosts::default(),
            max_num_seqs: max_num_seqs.max(1),
            token_budget: token_budget.max(1),
            running: 0,
            cap: max_num_seqs.max(1),
            queued_requests: 0,
            queued_prompt_tokens: 0,
            mean_output_tokens: 0.0,
            drain: QueueDrain::default(),
            refused_ttft: 0,
            refused_queue_full: 0,
        }
    }

    /// The measured costs.
    pub fn costs(&self) -> &StepCosts {
        &self.costs
    }

    fn measured(&self) -> bool {
        self.costs.decode_samples() >= MIN_DECODE_SAMPLES
    }

    /// The TPOT SLO in force, microseconds (`None` with admission control off, or before
    /// measurements when unset).
    pub fn tpot_slo_us(&self) -> Option<f64> {
        self.slo.tpot_us.or_else(|| {
            if !self.slo.is_set() {
                return None;
            }
            let unloaded = self.costs.decode_step_us(1).filter(|_| self.measured())?;
            Some(unloaded * DEFAULT_TPOT_FACTOR)
        })
    }

    /// The TTFT SLO in force, microseconds (`None` with admission control off, or before
    /// measurements when unset).
    pub fn ttft_slo_us(&self) -> Option<f64> {
        self.slo.ttft_us.or_else(|| {
            if !self.slo.is_set() {
                return None;
            }
            let unloaded = self.costs.decode_step_us(1).filter(|_| self.measured())?;
            Some((unloaded * DEFAULT_TTFT_FACTOR).max(MIN_DEFAULT_TTFT_US))
        })
    }

    /// `--ttft-slo-ms` when the operator set it, microseconds: the bound a queued request may
    /// not wait past (`actor/expired.rs`; never the measured default).
    pub fn ttft_slo_bound_us(&self) -> Option<f64> {
        self.slo.ttft_us
    }

    /// The SLOs in force from now on.
    pub fn set_slo(&mut self, slo: Slo) {
        self.slo = slo;
        self.cap = self.running_cap();
    }

    /// The running-batch cap as of the last step (see [`Self::running_cap`]).
    pub fn cap(&self) -> usize {
        self.cap
    }

    /// Most requests the running batch may hold: the largest `b ≤ --max-num-seqs` whose
    /// predicted effective step is within the TPOT SLO (at least 1); `--max-num-seqs` before
    /// measurements.
    pub fn running_cap(&self) -> usize {
        let Some(slo) = self.tpot_slo_us().filter(|_| self.measured()) else {
            return self.max_num_seqs;
        };
        // The predicted cap, where the estimate crosses the SLO (searched, at most 4096 sizes).
        let predicted = (1..=self.max_num_seqs.min(MAX_TRACKED_BATCH))
            .take_while(|b| self.costs.effective_step_us(*b).is_some_and(|t| t <= slo))
            .last()
            .unwrap_or(1);
        // Measured sizes overrule it: one within the SLO lets the batch grow past it (an
        // estimate from a few small batches must not keep the batch small for good), one over
        // it caps the batch below it.
        let (within, over) = self.costs.measured_bounds(slo);
        let mut cap = predicted.max(within.map_or(1, |b| b + (b / 8).max(1)));
        if let Some(over) = over {
            cap = cap.min(over.saturating_sub(1));
        }
        cap.clamp(1, self.max_num_seqs)
    }

    /// Predicted TTFT of a request of `prompt_tokens` joining the queue now, microseconds
    /// (`None` before measurements).
    pub fn predicted_ttft_us(&self, prompt_tokens: u64) -> Option<f64> {
        self.predicted_ttft_parts_us(prompt_tokens)
            .map(|(prefill, slot)| prefill + slot)
    }

    /// [`Self::predicted_ttft_us`] in its two parts: the prefills queued ahead (and its own),
    /// and the wait for a slot in the running batch.
    fn predicted_ttft_parts_us(&self, prompt_tokens: u64) -> Option<(f64, f64)> {
        if !self.measured() {
            return None;
        }
        let t_running = self.costs.decode_step_us(self.running)?;
        let per_token = self.costs.prefill_us_per_token().unwrap_or(0.0);
        let position = self.queued_requests + usize::from(prompt_tokens > 0);
        if let Some(rate) = self.drain_per_us().filter(|_| self.queued_requests > 0) {
            let joining = self.running as f64 * self.costs.prefill_per_decode();
            let own = self
                .costs
                .mixed_step_us(self.running, prompt_tokens as f64 + joining)?;
            return Some((own, position as f64 / rate));
        }
        let tokens = (self.queued_prompt_tokens + prompt_tokens) as f64;
        let chunk = self.token_budget.saturating_sub(self.running).max(1) as f64;
        let fixed = self.costs.mixed_step_overhead_us();
        let prefill = tokens * per_token + (tokens / chunk).ceil() * (t_running + fixed);
        let cap = self.cap;
        let free = cap.saturating_sub(self.running);
        let beyond = position.saturating_sub(free) as f64;
        let slot = beyond / cap as f64
            * self.mean_output_tokens.max(1.0)
            * self.costs.decode_step_us(cap)?;
        Some((prefill, slot))
    }

    /// Predicted time for the requests already queued to start, microseconds (0 before
    /// measurements): the `/metrics` gauge and the basis of `Retry-After`.
    pub fn predicted_queue_wait_us(&self) -> f64 {
        if self.queued_requests == 0 {
            return 0.0;
        }
        self.predicted_ttft_us(0).unwrap_or(0.0)
    }

    /// Admits a request (it joins the queue) or refuses it because its predicted TTFT exceeds
    /// the SLO. Changes nothing on refusal but the refusal count. With nothing queued and a
    /// free slot in the running batch the request is always admitted: it starts at the next
    /// step, and waiting would not make it faster (and the steps it runs keep the estimates
    /// fresh, so a pessimistic estimate cannot refuse everything for good). So is it when
    /// `worker_idle` (no live request on the worker: the batch the last step reported, which
    /// this state still counts, has ended since).
    pub fn admit(
        &mut self,
        worker_idle: bool,
        prompt_tokens: u64,
        max_tokens: u32,
    ) -> Result<(), SloRefusal> {
        let starts_next = worker_idle || (self.queued_requests == 0 && self.running < self.cap);
        let refusal = if starts_next {
            None
        } else {
            self.refusal(prompt_tokens)
        };
        if let Some(refusal) = refusal {
            self.refused_ttft += 1;
            return Err(refusal);
        }
        let first = self.queued_requests == 0 && self.mean_output_tokens == 0.0;
        self.mean_output_tokens = if first {
            f64::from(max_tokens)
        } else {
            self.mean_output_tokens
                + NEW_SAMPLE_WEIGHT * (f64::from(max_tokens) - self.mean_output_tokens)
        };
        self.queued_requests += 1;
        self.queued_prompt_tokens += prompt_tokens;
        Ok(())
    }

    /// The refusal of a request of `prompt_tokens` whose predicted TTFT exceeds the SLO.
    fn refusal(&self, prompt_tokens: u64) -> Option<SloRefusal> {
        let (prefill, slot) = self.predicted_ttft_parts_us(prompt_tokens)?;
        let slo = self.ttft_slo_us()?;
        let predicted = prefill + slot;
        if predicted <= TTFT_HEADROOM * slo {
            return None;
        }
        let drain_s = (self.predicted_queue_wait_us() / 1e6).ceil() as u64;
        let retry_after_secs = drain_s.max(1);
        let bound = if self.slo.ttft_us.is_some() {
            "--ttft-slo-ms"
        } else {
            "the measured default TTFT SLO (--ttft-slo-ms unset)"
        };
        Some(SloRefusal {
            bound: "ttft_slo_ms",
            retry_after_secs,
            message: format!(
                "overloaded: the predicted time to first token, {:.0} ms ({:.0} ms of prefills, \
                 {:.0} ms waiting for a slot in the running batch of {}), exceeds {:.0} % of \
                 {bound} of {:.0} ms (the margin for the prediction's error; {} requests queued); \
                 retry after {retry_after_secs} s",
                predicted / 1e3,
                prefill / 1e3,
                slot / 1e3,
                self.running,
                TTFT_HEADROOM * 100.0,
                slo / 1e3,
                self.queued_requests
            ),
        })
    }

    /// Admitted requests left the queue (a step scheduled them, or they ended before one did),
    /// with their prompt tokens.
    pub fn dequeued(&mut self, requests: usize, prompt_tokens: u64) {
        self.drain.left(requests.min(self.queued_requests));
        self.queued_requests = self.queued_requests.saturating_sub(requests);
        self.queued_prompt_tokens = self.queued_prompt_tokens.saturating_sub(prompt_tokens);
    }

    /// A step was sent that scheduled `requests` queued requests (maybe none) with their prompt
    /// tokens: if requests still wait after it, the server, not the arrivals, is setting the
    /// queue's pace until the next step (see [`Self::drain_per_us`]).
    pub fn launched(&mut self, requests: usize, prompt_tokens: u64) {
        self.dequeued(requests, prompt_tokens);
        self.drain.launched(self.queued_requests > 0);
    }

    /// The queue's measured drain rate, requests per microsecond ([`QueueDrain::per_us`]).
    pub fn drain_per_us(&self) -> Option<f64> {
        self.drain.per_us()
    }

    /// What `/metrics` shows of it.
    pub fn readings(&self) -> AdmissionReadings {
        AdmissionReadings {
            refused_ttft: self.refused_ttft,
            refused_queue_full: self.refused_queue_full,
            predicted_queue_wait_us: self.predicted_queue_wait_us() as u64,
            running_cap: self.cap as u64,
            queued: self.queued_requests as u64,
            drain_per_s: self.drain_per_us().map_or(0, |r| (r * 1e6).round() as u64),
            effective_step_us: self.costs.effective_step_us(self.cap).unwrap_or(0.0) as u64,
            mixed_step_overhead_us: self.costs.mixed_step_overhead_us() as u64,
            prefill_ns_per_token: self
                .costs
                .prefill_us_per_token()
                .map_or(0, |us| (us * 1e3).round() as u64),
        }
    }

    /// The running batch's size now (a request ended between steps).
    pub fn set_running(&mut self, running: usize) {
        self.running = running;
    }

    /// A measured step (see [`StepCosts::observe`]) and the running batch after it.
    pub fn step_measured(
        &mut self,
        decode_seqs: usize,
        prefill_tokens: usize,
        step_us: f64,
        running: usize,
    ) {
        self.costs.observe(decode_seqs, prefill_tokens, step_us);
        self.drain.measure(step_us);
        self.running = running;
        self.cap = self.running_cap();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A worker whose decode step costs `a + c·b` µs and whose prefill costs `p` µs a token.
    fn measured(a: f64, c: f64, p: f64) -> Admission {
        let mut adm = Admission::new(Slo::default(), 64, 512);
        for b in [1usize, 2, 4, 8, 16, 8, 4, 2, 1, 16] {
            adm.step_measured(b, 0, a + c * b as f64, 0);
        }
        adm.step_measured(0, 100, a + p * 100.0, 0);
        adm
    }

    #[test]
    fn the_decode_line_and_prefill_rate_follow_synthetic_steps() {
        let adm = measured(1000.0, 250.0, 20.0);
        let c = adm.costs();
        assert!((c.decode_step_us(1).unwrap() - 1250.0).abs() < 1.0);
        assert!((c.decode_step_us(32).unwrap() - 9000.0).abs() < 1.0);
        assert!((c.prefill_us_per_token().unwrap() - 20.0).abs() < 0.1);
        assert!((c.prefill_tokens_per_s().unwrap() - 50_000.0).abs() < 300.0);
    }

    #[test]
    fn one_batch_size_gives_a_flat_line_and_new_samples_move_it() {
        let mut c = StepCosts::default();
        assert_eq!(c.decode_step_us(4), None);
        c.observe(0, 100, 5000.0);
        assert_eq!(
            c.prefill_us_per_token(),
            None,
            "a prefill before any decode step has no known share of its step"
        );
        for _ in 0..20 {
            c.observe(4, 0, 800.0);
        }
        assert!((c.decode_step_us(1).unwrap() - 800.0).abs() < 1e-6);
        assert!((c.decode_step_us(64).unwrap() - 800.0).abs() < 1e-6);
        for _ in 0..200 {
            c.observe(4, 0, 1600.0);
        }
        assert!(
            (c.decode_step_us(4).unwrap() - 1600.0).abs() < 1.0,
            "old samples fade"
        );
    }

    #[test]
    fn nothing_is_refused_before_enough_steps_were_measured() {
        let mut adm = Admission::new(Slo::from_ms(Some(1), Some(1)), 64, 512);
        for _ in 0..MIN_DECODE_SAMPLES - 1 {
            adm.step_measured(1, 0, 50_000.0, 1);
        }
        for _ in 0..100 {
            adm.admit(false, 1000, 64).unwrap();
        }
        assert_eq!(adm.running_cap(), 64);
        assert_eq!(adm.predicted_queue_wait_us(), 0.0);
    }

    #[test]
    fn the_running_batch_is_capped_by_the_tpot_slo() {
        let mut adm = measured(1000.0, 250.0, 20.0);
        // No SLO given: admission control is off, the batch is the operator's --max-num-seqs.
        assert_eq!(
            (adm.running_cap(), adm.tpot_slo_us(), adm.ttft_slo_us()),
            (64, None, None)
        );
        assert!(
            adm.admit(false, 100_000, 64).is_ok(),
            "nothing is refused without an SLO"
        );
        // A TTFT SLO alone: the default TPOT, 10 x t(1) = 12.5 ms: 1000 + 250 b <= 12500  =>  b <= 46.
        adm.set_slo(Slo::from_ms(Some(60_000), None));
        assert_eq!(adm.running_cap(), 46);
        adm.set_slo(Slo::from_ms(None, Some(5)));
        // 1000 + 250 b <= 5000  =>  b <= 16, measured at 16: an eighth more is tried ...
        assert_eq!(adm.running_cap(), 18);
        // ... and once measured over the SLO (three times), the batch stays below it.
        adm.step_measured(17, 0, 5250.0, 17);
        assert_eq!(
            adm.running_cap(),
            18,
            "one sample over the SLO is not yet a cap"
        );
        adm.step_measured(17, 0, 5250.0, 17);
        adm.step_measured(17, 0, 5250.0, 17);
        assert_eq!((adm.running_cap(), adm.cap()), (16, 16));
        adm.set_slo(Slo::from_ms(None, Some(1)));
        assert_eq!(adm.running_cap(), 1, "never below one");
    }

    #[test]
    fn a_hiccup_is_no_cost_and_a_cap_is_no_ratchet() {
        // Seen on an H200 at 2x saturation: the running cap fell to 2 and admission control
        // refused 92 % of a load the GPU could serve. One slow step at a batch size must not be
        // that size's cost, and a cap must not hold once its evidence is old.
        let mut adm = measured(1000.0, 250.0, 20.0);
        adm.set_slo(Slo::from_ms(None, Some(5)));
        // 1000 + 250 b <= 5000  =>  b <= 16, measured at 16: an eighth more, 18.
        assert_eq!(adm.running_cap(), 18);
        adm.step_measured(17, 0, 90_000.0, 17); // the hiccup
        assert_eq!(adm.running_cap(), 18, "one slow step does not cap");
        adm.step_measured(17, 0, 4_900.0, 17);
        assert!(
            (adm.costs().decode_step_us(17).unwrap() - 4_900.0).abs() < 1e-6,
            "the hiccup is forgotten"
        );
        assert_eq!(adm.running_cap(), 19);
        // A size measured over the SLO three times caps the batch ...
        for _ in 0..ROBUST_START {
            adm.step_measured(20, 0, 20_000.0, 19);
        }
        assert_eq!(adm.running_cap(), 19);
        // ... while its evidence is recent; steps with a prefill count as time passing too, and
        // then the batch may grow to it again (19 measured within the SLO lets it try 21).
        for _ in 0..CAP_EVIDENCE_STEPS {
            adm.step_measured(16, 10, 5_000.0, 19);
        }
        adm.step_measured(19, 0, 4_990.0, 19);
        assert!(adm.running_cap() > 20, "{}", adm.running_cap());
    }

    #[test]
    fn prefills_of_joining_requests_count_toward_the_tpot() {
        // Seen on an H200: with the cap on decode-only steps (10 ms at 128 requests, under an
        // 11 ms TPOT SLO), the steps that also ran the prefills of arriving requests took 13 ms,
        // and fewer than 1 % of the admitted requests kept the SLO.
        let mut adm = measured(1000.0, 250.0, 20.0);
        adm.set_slo(Slo::from_ms(None, Some(5)));
        assert_eq!(
            adm.running_cap(),
            18,
            "decode-only steps: 1000 + 250 b <= 5000"
        );
        // Steady arrivals: each step of 16 decoding requests also prefills 16 prompt tokens
        // (1 per request per step, e.g. 32-token prompts and 32-token answers), 20 us each.
        for _ in 0..400 {
            adm.step_measured(16, 16, 5000.0 + 16.0 * 20.0, 16);
        }
        let c = adm.costs();
        let share = c.effective_step_us(10).unwrap() - c.decode_step_us(10).unwrap();
        assert!((share - 10.0 * 20.0).abs() < 1.0, "{share}");
        // 1000 + 250 b + 20 b <= 5000  =>  b <= 14 (16's effective step, 5320 us, is over).
        assert_eq!(adm.running_cap(), 14);
    }

    #[test]
    fn a_mixed_steps_fixed_cost_is_not_priced_per_token() {
        // Seen on an H200 at 2x saturation: the running cap fell from 256 to 8 while the steps
        // that ran took half the TPOT SLO. A step with a prefill runs eagerly, a fixed ~5 ms
        // beyond its decodes; priced per prefill token, that cost grew with the batch.
        let mut adm = Admission::new(Slo::from_ms(None, Some(14)), 256, 8192);
        let decode = |b: usize| 6000.0 + 20.0 * b as f64;
        for b in [1usize, 8, 16, 32, 64, 128, 64, 32, 16, 8] {
            adm.step_measured(b, 0, decode(b), b);
        }
        // Every step of 64 decoding requests also prefills 32..128 prompt tokens (mean 80).
        for i in 0..400 {
            let tokens = 32 * (1 + i % 4);
            adm.step_measured(64, tokens, decode(64) + 5000.0 + 10.0 * tokens as f64, 64);
        }
        let c = adm.costs();
        let (fixed, per_token) = c.mixed_line().unwrap();
        assert!(
            (fixed - 5000.0).abs() < 50.0 && (per_token - 10.0).abs() < 0.5,
            "{fixed} {per_token}"
        );
        // A moving mean over the 32..128 cycle: within a tenth of 80/64.
        assert!((c.prefill_per_decode() - 80.0 / 64.0).abs() < 0.1);
        assert!((c.mixed_step_us(64, 100.0).unwrap() - (decode(64) + 6000.0)).abs() < 60.0);
        // 6000 + 20 b + 5000 + b·1.25·10 <= 14000  =>  b <= 92 (per token alone, about 59).
        assert!(
            (90..=94).contains(&adm.running_cap()),
            "{}",
            adm.running_cap()
        );
    }

    #[test]
    fn measured_time_per_output_token_overrules_the_model() {
        // The model extrapolates decode-only steps (1000 + 250 b: 7 ms at 24), but steps of 24
        // decoding requests (prefills included) measurably take 4.8 ms, within a 5 ms SLO.
        let mut adm = measured(1000.0, 250.0, 20.0);
        adm.set_slo(Slo::from_ms(None, Some(5)));
        assert_eq!(adm.running_cap(), 18);
        for _ in 0..ROBUST_START {
            adm.step_measured(24, 8, 4800.0, 24);
        }
        assert_eq!(
            adm.running_cap(),
            27,
            "24 measured within: an eighth past it"
        );
        // Measured over it, at 27, three times: the batch stays below 27.
        for _ in 0..ROBUST_START {
            adm.step_measured(27, 8, 5400.0, 27);
        }
        assert_eq!(adm.running_cap(), 26);
    }

    #[test]
    fn a_mixed_line_needs_varied_token_counts() {
        let mut c = StepCosts::default();
        for _ in 0..20 {
            c.observe(4, 0, 1000.0);
        }
        assert_eq!(c.mixed_line(), None);
        for _ in 0..100 {
            c.observe(4, 50, 1000.0 + 500.0);
        }
        assert_eq!(
            c.mixed_line(),
            Some((0.0, 10.0)),
            "one token count: all of it per token"
        );
        assert_eq!(c.mixed_step_us(4, 0.0), Some(1000.0));
    }

    #[test]
    fn a_request_over_the_ttft_slo_is_refused_with_the_queue_drain_time() {
        let mut adm = measured(1000.0, 250.0, 20.0);
        adm.set_slo(Slo::from_ms(Some(50), Some(5)));
        // 100 prompt tokens: 2000 us prefill + one step at b = 0 (1000 us) = 3 ms each.
        let mut admitted = 0;
        while adm.admit(false, 100, 16).is_ok() {
            admitted += 1;
            assert!(admitted < 1000);
        }
        assert!(admitted >= 10, "{admitted}");
        let err = adm.admit(false, 100, 16).unwrap_err();
        assert_eq!(err.bound, "ttft_slo_ms");
        assert!(err.retry_after_secs >= 1);
        assert!(err.message.contains("--ttft-slo-ms"), "{}", err.message);
        assert!(
            err.message.contains("time to first token"),
            "{}",
            err.message
        );
        assert_eq!(adm.refused_ttft, 2);
        let wait = adm.predicted_queue_wait_us();
        // Refused past TTFT_HEADROOM of the 50 ms SLO: the queue ahead is about that (within one
        // 3 ms request).
        let bound = TTFT_HEADROOM * 50_000.0;
        assert!(wait > bound - 3_000.0 && wait <= bound + 3_000.0, "{wait}");
        // The queue drains: requests are admitted again.
        adm.dequeued(admitted, 100 * admitted as u64);
        assert_eq!(adm.predicted_queue_wait_us(), 0.0);
        adm.admit(false, 100, 16).unwrap();
    }

    #[test]
    fn an_idle_worker_admits_whatever_its_estimate() {
        let mut adm = measured(1000.0, 250.0, 20.0);
        adm.set_slo(Slo::from_ms(Some(1), Some(5)));
        adm.admit(false, 1000, 16).unwrap();
        let err = adm.admit(false, 1000, 16).unwrap_err();
        assert_eq!(err.bound, "ttft_slo_ms");
        adm.dequeued(1, 1000);
        adm.admit(false, 1000, 16).unwrap();
        adm.dequeued(1, 1000);
        // The last step reported a full batch (cap 1 at a 1 ms TPOT) that has ended since.
        adm.set_slo(Slo::from_ms(Some(1), Some(1)));
        adm.step_measured(1, 0, 1250.0, 1);
        assert_eq!(adm.running_cap(), 1);
        assert!(adm.admit(false, 10, 16).is_err());
        adm.admit(true, 10, 16).unwrap();
        adm.dequeued(1, 10);
        adm.set_running(0);
        adm.admit(false, 10, 16).unwrap();
    }

    #[test]
    fn a_full_batch_makes_queued_requests_wait_for_slots() {
        let mut adm = measured(1000.0, 250.0, 0.0);
        adm.set_slo(Slo::from_ms(Some(1000), Some(5)));
        // Cap 16 (17 was measured over the TPOT SLO), all running: the first queued request
        // waits for a slot to free.
        for _ in 0..ROBUST_START {
            adm.step_measured(17, 0, 5250.0, 16);
        }
        adm.step_measured(16, 0, 5000.0, 16);
        assert_eq!(adm.cap(), 16);
        adm.admit(false, 10, 100).unwrap();
        let one = adm.predicted_ttft_us(10).unwrap();
        // (2 / 16) slots x 100 tokens x 5000 us = 62.5 ms, plus a prefill step.
        assert!((one - 62_500.0 - 5000.0).abs() < 100.0, "{one}");
        assert!(adm.predicted_queue_wait_us() < one);
    }

    #[test]
    fn under_backlog_the_queue_wait_is_its_measured_drain() {
        // The model says slots free fast (decode-only steps of 1 ms, 4-token answers), but the
        // steps that run take 5 ms and free one slot each: 200 requests/s, 5 ms per place.
        let mut adm = measured(1000.0, 0.0, 0.0);
        adm.set_slo(Slo::from_ms(Some(50), Some(100)));
        for _ in 0..64 {
            adm.admit(false, 10, 4).ok();
        }
        let queued = adm.readings().queued as usize;
        assert!(queued > 0);
        for i in 0..(MIN_DRAIN_STEPS as usize + 40) {
            adm.launched(1, 10);
            adm.step_measured(4, 10, 5000.0, 4);
            if i % 2 == 0 {
                adm.admit(false, 10, 4).ok();
                adm.admit(false, 10, 4).ok();
            }
        }
        let rate = adm.drain_per_us().expect("measured under backlog");
        assert!((rate * 1e6 - 200.0).abs() < 1.0, "{}", rate * 1e6);
        assert_eq!(adm.readings().drain_per_s, 200);
        // From an empty queue, admitted until the last one's wait, 5 ms a place ahead (and a
        // 9 ms step of its own: 1 ms of decodes and 20 prefill tokens at 400 us), reaches
        // TTFT_HEADROOM of the 50 ms SLO, 40 ms.
        let queued = adm.readings().queued as usize;
        adm.launched(queued, 10 * queued as u64);
        while adm.admit(false, 10, 4).is_ok() {}
        let queued = adm.readings().queued;
        assert!((5..=7).contains(&queued), "{queued}");
        let err = adm.admit(false, 10, 4).unwrap_err();
        assert!(
            err.message.contains("waiting for a slot"),
            "{}",
            err.message
        );
    }

    #[test]
    fn a_queue_that_empties_each_step_measures_no_drain() {
        let mut adm = measured(1000.0, 250.0, 20.0);
        adm.set_slo(Slo::from_ms(Some(50), Some(100)));
        for _ in 0..100 {
            adm.admit(false, 10, 4).unwrap();
            adm.step_measured(1, 10, 1250.0, 1); // admitted after the step was measured ...
            adm.launched(1, 10); // ... and scheduled by the next, with nothing else waiting
        }
        assert_eq!(
            adm.drain_per_us(),
            None,
            "arrivals, not the server, set the pace"
        );
    }

    #[test]
    fn the_default_ttft_slo_is_measured_and_has_a_floor() {
        let mut adm = measured(1000.0, 250.0, 20.0);
        adm.set_slo(Slo::from_ms(None, Some(20)));
        assert_eq!(adm.ttft_slo_us(), Some(MIN_DEFAULT_TTFT_US));
        adm.set_slo(Slo::from_ms(Some(3_000), None));
        assert!((adm.tpot_slo_us().unwrap() - 12_500.0).abs() < 1e-6);
        let mut slow = measured(10_000.0, 0.0, 20.0);
        slow.set_slo(Slo::from_ms(None, Some(20)));
        assert!((slow.ttft_slo_us().unwrap() - 5_000_000.0).abs() < 1e-3);
        let unmeasured = Admission::new(Slo::from_ms(None, Some(20)), 8, 8);
        assert_eq!(unmeasured.ttft_slo_us(), None);
    }
}
