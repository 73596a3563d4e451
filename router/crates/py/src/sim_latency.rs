//! The simulator's step-latency model at prediction time: the features of one scheduled step
//! ([`StepFeatures`], named by [`FEATURES`]) and the linear models over them ([`LatencyModel`]:
//! device time and worker host (launch) time, each one model for decode-only steps and one for
//! steps that prefill), plus the transfer bandwidths of the variant tiers. Fitting lives in
//! Python (`deltaserve.sim.latency`, numpy least squares over a profile); this side only
//! evaluates `coef · features`. [`SplitMix`] draws the optional step-time noise.
//!
//! ```text
//! step kind  = "prefill" if any chunk prefills (a new request, or more than 1 token) else "decode"
//! eager      = 1 unless a captured CUDA graph replays the step: decode, seqs <= graph_max_batch;
//!              prefill (mixed), tokens <= graph_max_tokens, seqs <= graph_max_batch, and with
//!              delta rows tokens <= graph_max_delta_tokens (0: such steps eager)
//! step_s     = max(0, Σ_f coef[kind][f] · feature[f])          device time
//! host_s     = max(0, Σ_f host_coef[kind][f] · feature[f])     the worker's launch (0: none modelled)
//! to_host_s  = host_bytes / disk_to_host_Bps[kind]   (one read; a worker runs READERS at once)
//! to_gpu_s   = host_bytes / host_to_gpu_Bps[kind]    (added to the step that carries the ToGpu;
//!                                                     a delta's, with gpu_load_reports, runs on
//!                                                     the load stream beside the steps instead)
//! ```
//!
//! The graph rule and `eager` are model inputs, not today's worker baked in: the limits are read
//! from a recording (which steps replayed a graph), and a refit prices each kind. So is the dense
//! path of delta prefill (`dense_delta_segments`, [`LatencyModel::dense_min_m`]): on CUDA the
//! worker runs a delta's prefill chunk of at least that many tokens as its whole delta
//! dequantised plus one matmul (`kernels/sbmm/meta.py`, `DeltaMeta.segments(dense_min_m=)`), one
//! dequantisation per delta however many of its chunks the step holds, and shorter chunks through
//! the SBMM work tiles. A replayed step that prefills with delta rows pads to a delta bucket of
//! the worker's mixed graphs and runs its deltas on the work tiles, but for at most one: the
//! delta in the graph's *dense lane* (`adapters/delta_graphs.py`; one dequantisation and one
//! masked matmul over the bucket per linear, the cost of an eager dense segment), chosen by
//! [`LatencyModel::dense_lane_delta`] from the lane's buckets ([`LatencyModel::dense_lane`]):
//!
//! ```text
//! dense_delta_segments = |{ delta of c : c a prefill chunk of a delta request, tokens(c) >= dense_min_m }|
//!                          in an eager step;
//!                        1 if a delta takes the dense lane, else 0, in a replayed step
//! lane delta           = in a replayed step that prefills (the decode graphs have no lane), of
//!                        bucket = the smallest lane bucket >= tokens: the delta with the most
//!                        tokens in the step, all its rows (ties: the first in row order), if it
//!                        has at least lane_min_tokens(bucket)
//!                        (`delta_graphs.dense_lane_tokens`, `DeltaPool.dense_lane_for`)
//! ```

use std::collections::{BTreeSet, HashMap};

use deltaserve_sched::{ScheduledStep, VariantKind};

use crate::sim_loop::{SimRequest, SimVariant};

/// The feature names, in the order of [`StepFeatures::values`]; Python reads them from
/// `_native.SIM_FEATURES` (one owner).
pub(crate) const FEATURES: [&str; NUM_FEATURES] = [
    "const",
    "tokens",
    "seqs",
    "prefill_tokens",
    "context_tokens",
    "prefill_attention",
    "lora_rank_sum",
    "lora_segments",
    "lora_tokens",
    "deltas",
    "delta_tokens",
    "eager",
    "dense_delta_segments",
];

/// How many features a step has ([`FEATURES`]).
pub(crate) const NUM_FEATURES: usize = 13;

/// What one step computes, as the latency model sees it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct StepFeatures {
    /// Tokens computed, all requests (prefill chunks + decode tokens).
    pub(crate) tokens: f64,
    /// Requests in the step.
    pub(crate) seqs: f64,
    /// Tokens of prefill chunks (new requests, and chunks of more than one token).
    pub(crate) prefill_tokens: f64,
    /// KV-cache tokens the step attends over: each request's cached length after the step,
    /// summed (proportional to the KV bytes read).
    pub(crate) context_tokens: f64,
    /// Σ over prefill chunks of `chunk × (start + chunk)`: the quadratic part of attention.
    pub(crate) prefill_attention: f64,
    /// Σ rank over the distinct LoRA adapters in the step (their weights are read once each).
    pub(crate) lora_rank_sum: f64,
    /// Distinct LoRA adapters in the step (kernel segments).
    pub(crate) lora_segments: f64,
    /// Tokens of requests with a LoRA adapter.
    pub(crate) lora_tokens: f64,
    /// Distinct deltas in the step (each delta's packed weights are read once).
    pub(crate) deltas: f64,
    /// Tokens (rows) of requests with a delta.
    pub(crate) delta_tokens: f64,
    /// 1 when the step runs eagerly, 0 when a captured graph replays it
    /// ([`LatencyModel::runs_eager`]).
    pub(crate) eager: f64,
    /// Distinct deltas with a prefill chunk the worker runs dense (module docstring): each is
    /// dequantised whole once, a fixed cost the token counts do not carry.
    pub(crate) dense_delta_segments: f64,
}

impl StepFeatures {
    /// The values in [`FEATURES`] order (`const` first, always 1).
    pub(crate) fn values(&self) -> [f64; NUM_FEATURES] {
        [
            1.0,
            self.tokens,
            self.seqs,
            self.prefill_tokens,
            self.context_tokens,
            self.prefill_attention,
            self.lora_rank_sum,
            self.lora_segments,
            self.lora_tokens,
            self.deltas,
            self.delta_tokens,
            self.eager,
            self.dense_delta_segments,
        ]
    }

    /// Whether the step prefills (then the prefill model prices it).
    pub(crate) fn prefills(&self) -> bool {
        self.prefill_tokens > 0.0
    }
}

/// The linear step-time models and the tier bandwidths.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct LatencyModel {
    /// Device seconds per unit of each feature, decode-only steps ([`FEATURES`] order).
    pub(crate) decode: [f64; NUM_FEATURES],
    /// Device seconds per unit of each feature, steps with a prefill chunk.
    pub(crate) prefill: [f64; NUM_FEATURES],
    /// Worker host seconds to launch a step, per unit of each feature: decode-only steps, then
    /// steps with a prefill chunk (all 0: launches cost nothing, the model before host time).
    pub(crate) host: [[f64; NUM_FEATURES]; 2],
    /// Largest decode batch (requests) a captured graph replays; 0: no graphs, every step eager.
    pub(crate) graph_max_batch: u32,
    /// Largest step that prefills (tokens) a captured graph replays; 0: such steps run eagerly.
    pub(crate) graph_max_tokens: u32,
    /// Largest step with delta rows that prefills (tokens) a captured graph replays; 0: such
    /// steps run eagerly (the worker before its mixed graphs took delta rows).
    pub(crate) graph_max_delta_tokens: u32,
    /// Disk -> host read bandwidth of a variant (bytes/s), `[lora, delta]`.
    pub(crate) disk_to_host_bps: [f64; 2],
    /// Host -> GPU copy bandwidth of a variant (bytes/s), `[lora, delta]`.
    pub(crate) host_to_gpu_bps: [f64; 2],
    /// Fewest tokens of a delta's prefill chunk that the worker runs dense (module docstring;
    /// at least 2, a one-token chunk being a decode row); `None`: no dense path (the CPU), and
    /// `dense_delta_segments` is 0 in every eager step.
    pub(crate) dense_min_m: Option<u32>,
    /// The delta token buckets of the worker's mixed graphs, ascending, each with its dense-lane
    /// threshold (module docstring; Python passes `mixed_graphs.DELTA_TOKEN_BUCKETS` and
    /// `delta_graphs.dense_lane_tokens`, this side keeps no copy); empty: no lane modelled (the
    /// CPU, models from before the lane), and `dense_delta_segments` is 0 in every replayed step.
    /// The table's buckets, not the worker's limit: a limit off the table is the worker's last
    /// bucket, which a recording does not show (the default, 512 tokens, is on it).
    pub(crate) dense_lane: Vec<LaneBucket>,
}

/// One delta token bucket of the worker's mixed graphs and its dense lane's threshold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct LaneBucket {
    /// Tokens the bucket's graph runs: a step pads to the smallest bucket holding its tokens.
    pub(crate) tokens: u32,
    /// Fewest tokens of one delta in a step of this bucket that run in the dense lane.
    pub(crate) lane_min_tokens: u32,
}

impl LatencyModel {
    /// A model with the given device coefficients, no host time and no graphs.
    #[cfg(test)]
    pub(crate) fn device_only(decode: [f64; NUM_FEATURES], prefill: [f64; NUM_FEATURES]) -> Self {
        LatencyModel {
            decode,
            prefill,
            host: [[0.0; NUM_FEATURES]; 2],
            graph_max_batch: 0,
            graph_max_tokens: 0,
            graph_max_delta_tokens: 0,
            disk_to_host_bps: [1e9, 1e9],
            host_to_gpu_bps: [1e10, 1e10],
            dense_min_m: None,
            dense_lane: Vec::new(),
        }
    }

    /// Seconds the step takes on the device (never negative).
    pub(crate) fn step_s(&self, f: &StepFeatures) -> f64 {
        let coef = if f.prefills() {
            &self.prefill
        } else {
            &self.decode
        };
        dot(coef, f)
    }

    /// Seconds the worker's host spends launching the step (never negative).
    pub(crate) fn host_s(&self, f: &StepFeatures) -> f64 {
        dot(&self.host[usize::from(f.prefills())], f)
    }

    /// Whether the step runs eagerly (no captured graph takes it; module docstring).
    pub(crate) fn runs_eager(&self, f: &StepFeatures) -> bool {
        let graphed = f.seqs <= f64::from(self.graph_max_batch)
            && if f.prefills() {
                f.tokens <= f64::from(self.graph_max_tokens)
                    && (f.delta_tokens == 0.0 || f.tokens <= f64::from(self.graph_max_delta_tokens))
            } else {
                true
            };
        !graphed
    }

    /// The delta the worker runs in the dense lane of step `f` when a graph replays it (module
    /// docstring), from the step's tokens per delta in row order (`tokens_by_delta` of
    /// [`step_features`]): in a step that prefills, padded to the smallest of [`Self::dense_lane`]
    /// holding its tokens, the delta with the most tokens (the first of those tied, as Python's
    /// `max` over the worker's insertion-ordered counts gives) if it has at least the bucket's
    /// `lane_min_tokens`. None in a decode step (the decode graphs have no lane), past the largest
    /// bucket, and with no lane modelled. Every delta counts as whole: the simulator does not
    /// model partial (zoo) deltas ([`SimVariant`]), which the worker keeps off the lane.
    pub(crate) fn dense_lane_delta(
        &self,
        f: &StepFeatures,
        tokens_by_delta: &[(u32, u32)],
    ) -> Option<u32> {
        if !f.prefills() {
            return None;
        }
        let bucket = self
            .dense_lane
            .iter()
            .find(|b| f64::from(b.tokens) >= f.tokens)?;
        let mut most: Option<(u32, u32)> = None;
        for &(delta, n) in tokens_by_delta {
            if most.is_none_or(|(_, m)| n > m) {
                most = Some((delta, n));
            }
        }
        most.filter(|&(_, n)| n >= bucket.lane_min_tokens)
            .map(|(delta, _)| delta)
    }

    /// Seconds to read `bytes` of a variant of `kind` from disk into host memory.
    pub(crate) fn to_host_s(&self, kind: VariantKind, bytes: u64) -> f64 {
        bytes as f64 / self.disk_to_host_bps[kind_index(kind)]
    }

    /// Seconds to copy `bytes` of a variant of `kind` from its host copy to the GPU.
    pub(crate) fn to_gpu_s(&self, kind: VariantKind, bytes: u64) -> f64 {
        bytes as f64 / self.host_to_gpu_bps[kind_index(kind)]
    }
}

/// `max(0, coef · features)`.
fn dot(coef: &[f64; NUM_FEATURES], f: &StepFeatures) -> f64 {
    let t: f64 = coef.iter().zip(f.values()).map(|(c, x)| c * x).sum();
    t.max(0.0)
}

/// Index of a kind in the bandwidth pairs: `[lora, delta]`.
pub(crate) fn kind_index(kind: VariantKind) -> usize {
    match kind {
        VariantKind::Lora => 0,
        VariantKind::Delta => 1,
    }
}

/// What [`step_features`] reads off one scheduled step.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct StepComposition {
    /// Its latency features (`eager` 0 until the model's graph rule sets it, and with it the
    /// dense segments of a replayed step).
    pub(crate) features: StepFeatures,
    /// `(request, tokens)` in plan order: new requests, then running ones.
    pub(crate) entries: Vec<(u64, u32)>,
    /// `(delta, tokens of all its rows)` of each delta in the step, in the order of its first
    /// row: what a replayed step's dense lane is chosen from ([`LatencyModel::dense_lane_delta`]).
    pub(crate) tokens_by_delta: Vec<(u32, u32)>,
}

/// The features, entries and tokens per delta of `step` ([`StepComposition`]), updating each
/// request's `cached` length; prefill chunks of a delta of at least `dense_min_m` tokens run
/// dense ([`LatencyModel::dense_min_m`]: the eager step's `dense_delta_segments`).
/// `deltaserve.sim.record.step_features` computes the same from a recording (tests/sim).
pub(crate) fn step_features(
    cached: &mut HashMap<u64, u32>,
    step: &ScheduledStep,
    requests: &[SimRequest],
    variants: &[SimVariant],
    dense_min_m: Option<u32>,
) -> StepComposition {
    let mut f = StepFeatures::default();
    let mut loras = BTreeSet::new();
    let mut dense = BTreeSet::new();
    let mut tokens_by_delta: Vec<(u32, u32)> = Vec::new();
    let mut entries = Vec::with_capacity(step.num_requests());
    let new = step
        .new
        .iter()
        .map(|n| (n.id, n.num_computed_tokens, n.num_scheduled_tokens, true));
    let running = step.running.iter().map(|r| {
        let from = cached.get(&r.id).copied().unwrap_or(0);
        (
            r.id,
            from,
            r.num_scheduled_tokens,
            r.num_scheduled_tokens > 1,
        )
    });
    let chunks: Vec<_> = new.chain(running).collect();
    for (id, from, n, prefill) in chunks {
        let to = from + n;
        cached.insert(id, to);
        entries.push((id, n));
        let runs_dense = prefill && dense_min_m.is_some_and(|m| n >= m);
        let tokens = n;
        let (n, to) = (f64::from(n), f64::from(to));
        f.tokens += n;
        f.seqs += 1.0;
        f.context_tokens += to;
        if prefill {
            f.prefill_tokens += n;
            f.prefill_attention += n * to;
        }
        let variant = requests[id as usize].variant;
        if variant == 0 {
            continue;
        }
        let v = &variants[variant as usize - 1];
        match v.kind {
            VariantKind::Lora => {
                f.lora_tokens += n;
                if loras.insert(variant) {
                    f.lora_rank_sum += f64::from(v.rank);
                }
            }
            VariantKind::Delta => {
                f.delta_tokens += n;
                match tokens_by_delta.iter_mut().find(|(d, _)| *d == variant) {
                    Some((_, t)) => *t += tokens,
                    None => tokens_by_delta.push((variant, tokens)),
                }
                if runs_dense {
                    dense.insert(variant);
                }
            }
        }
    }
    f.lora_segments = loras.len() as f64;
    f.deltas = tokens_by_delta.len() as f64;
    f.dense_delta_segments = dense.len() as f64;
    StepComposition {
        features: f,
        entries,
        tokens_by_delta,
    }
}

/// A seeded generator (SplitMix64) for the step-time noise: no dependency, the same numbers on
/// every platform.
pub(crate) struct SplitMix(pub(crate) u64);

impl SplitMix {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in (0, 1].
    fn unit(&mut self) -> f64 {
        ((self.next_u64() >> 11) + 1) as f64 / (1u64 << 53) as f64
    }

    /// A log-normal factor of mean 1 whose log has standard deviation `sigma` (1 for 0).
    pub(crate) fn log_normal(&mut self, sigma: f64) -> f64 {
        if sigma <= 0.0 {
            return 1.0;
        }
        let z = (-2.0 * self.unit().ln()).sqrt() * (std::f64::consts::TAU * self.unit()).cos();
        (sigma * z - sigma * sigma / 2.0).exp()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use deltaserve_sched::{ScheduledNew, ScheduledRunning};

    #[test]
    fn dense_delta_segments_count_each_delta_with_a_long_prefill_chunk_once() {
        let request = |variant| SimRequest {
            arrival_s: 0.0,
            prompt_len: 500,
            output_len: 4,
            variant,
            prompt_key: None,
        };
        // Requests 0..=4: base, delta 1, delta 1, delta 2, LoRA 3.
        let requests = [request(0), request(1), request(1), request(2), request(3)];
        let delta = SimVariant {
            kind: VariantKind::Delta,
            num_blocks: 0,
            host_bytes: 1,
            rank: 0,
        };
        let lora = SimVariant {
            kind: VariantKind::Lora,
            num_blocks: 1,
            host_bytes: 1,
            rank: 8,
        };
        let variants = [delta.clone(), delta, lora];
        let new = |id: u64, n: u32| ScheduledNew {
            id,
            token_ids: vec![0; 500],
            num_prompt_tokens: 500,
            num_computed_tokens: 0,
            num_scheduled_tokens: n,
            block_ids: vec![],
            adapter_id: requests[id as usize].variant,
        };
        let running = |id: u64, n: u32| ScheduledRunning {
            id,
            num_scheduled_tokens: n,
            new_block_ids: vec![],
        };
        // Delta 1: two chunks of 64 and more (one dequantisation); delta 2: a chunk of 63 (work
        // tiles); the base's and the LoRA's long chunks do not count.
        let step = ScheduledStep {
            step_id: 1,
            new: vec![
                new(0, 300),
                new(1, 64),
                new(2, 200),
                new(3, 63),
                new(4, 100),
            ],
            ..Default::default()
        };
        let mut cached = HashMap::new();
        let count = |cached: &mut HashMap<u64, u32>, step: &ScheduledStep, at| {
            step_features(cached, step, &requests, &variants, at)
                .features
                .dense_delta_segments
        };
        assert_eq!(count(&mut cached.clone(), &step, Some(64)), 1.0);
        assert_eq!(count(&mut cached.clone(), &step, Some(63)), 2.0);
        let by_delta = step_features(&mut cached.clone(), &step, &requests, &variants, None);
        assert_eq!(
            by_delta.tokens_by_delta,
            [(1, 264), (2, 63)],
            "first rows' order"
        );
        assert_eq!(by_delta.features.deltas, 2.0);
        assert_eq!(count(&mut cached, &step, None), 0.0, "no dense path");
        // Next step: delta 2's second chunk of 64 runs dense; delta 1's decode rows never do.
        let step = ScheduledStep {
            step_id: 2,
            running: vec![running(1, 1), running(2, 1), running(3, 64)],
            ..Default::default()
        };
        let by_delta = step_features(&mut cached.clone(), &step, &requests, &variants, None);
        assert_eq!(
            by_delta.tokens_by_delta,
            [(1, 2), (2, 64)],
            "decode rows count too"
        );
        assert_eq!(count(&mut cached, &step, Some(64)), 1.0);
        assert_eq!(cached[&3], 127);
    }

    #[test]
    fn the_dense_lane_takes_the_delta_with_the_most_tokens_at_its_buckets_threshold() {
        let mut m = LatencyModel::device_only([0.0; NUM_FEATURES], [0.0; NUM_FEATURES]);
        let prefill = |tokens: f64| StepFeatures {
            tokens,
            seqs: 3.0,
            prefill_tokens: tokens - 2.0,
            ..Default::default()
        };
        let lane = |f: &StepFeatures, by_delta: &[(u32, u32)]| m.dense_lane_delta(f, by_delta);
        assert_eq!(lane(&prefill(128.0), &[(1, 128)]), None, "no lane modelled");
        // As `dense_lane_tokens` gives them with a base of 64 tokens.
        m.dense_lane = [(64, 85), (128, 106), (256, 149)]
            .map(|(tokens, lane_min_tokens)| LaneBucket {
                tokens,
                lane_min_tokens,
            })
            .to_vec();
        let lane = |f: &StepFeatures, by_delta: &[(u32, u32)]| m.dense_lane_delta(f, by_delta);
        let step = prefill(128.0); // bucket 128 (106 tokens), not 256 (149)
        assert_eq!(
            lane(&step, &[(1, 105), (2, 23)]),
            None,
            "below the threshold"
        );
        assert_eq!(
            lane(&step, &[(1, 106), (2, 22)]),
            Some(1),
            "at the threshold"
        );
        assert_eq!(
            lane(&step, &[(1, 20), (2, 108)]),
            Some(2),
            "the delta with most tokens"
        );
        assert_eq!(
            lane(&prefill(129.0), &[(1, 129)]),
            None,
            "bucket 256: 149 tokens"
        );
        assert_eq!(
            lane(&prefill(257.0), &[(1, 257)]),
            None,
            "past the largest bucket"
        );
        m.dense_lane[2].lane_min_tokens = 100;
        let lane = |f: &StepFeatures, by_delta: &[(u32, u32)]| m.dense_lane_delta(f, by_delta);
        let step = prefill(240.0);
        assert_eq!(
            lane(&step, &[(3, 120), (1, 120)]),
            Some(3),
            "a tie: the first"
        );
        assert_eq!(
            lane(&step, &[(1, 120), (3, 120)]),
            Some(1),
            "a tie: the first"
        );
        let decode = StepFeatures {
            prefill_tokens: 0.0,
            ..prefill(128.0)
        };
        assert_eq!(
            lane(&decode, &[(1, 128)]),
            None,
            "the decode graphs have no lane"
        );
    }

    #[test]
    fn the_step_kind_picks_the_model_and_time_is_never_negative() {
        let mut decode = [0.0; NUM_FEATURES];
        decode[0] = 0.01;
        decode[2] = 0.001;
        let mut prefill = [0.0; NUM_FEATURES];
        prefill[0] = -1.0;
        prefill[3] = 0.5;
        let m = LatencyModel {
            disk_to_host_bps: [1e9, 2e9],
            host_to_gpu_bps: [1e10, 2e10],
            ..LatencyModel::device_only(decode, prefill)
        };
        let step = StepFeatures {
            seqs: 4.0,
            tokens: 4.0,
            ..Default::default()
        };
        assert!((m.step_s(&step) - 0.014).abs() < 1e-12);
        let chunk = StepFeatures {
            prefill_tokens: 1.0,
            ..step
        };
        assert_eq!(m.step_s(&chunk), 0.0, "clamped at zero");
        assert!((m.to_host_s(VariantKind::Lora, 2_000_000_000) - 2.0).abs() < 1e-12);
        assert!((m.to_gpu_s(VariantKind::Lora, 2_000_000_000) - 0.2).abs() < 1e-12);
        assert!((m.to_host_s(VariantKind::Delta, 2_000_000_000) - 1.0).abs() < 1e-12);
        assert!((m.to_gpu_s(VariantKind::Delta, 2_000_000_000) - 0.1).abs() < 1e-12);
        assert_eq!(FEATURES.len(), step.values().len());
        assert_eq!(m.host_s(&step), 0.0, "no host model: launches are free");
    }

    #[test]
    fn the_graph_rule_decides_eager_and_host_time_follows_the_kind() {
        let mut m = LatencyModel::device_only([0.0; NUM_FEATURES], [0.0; NUM_FEATURES]);
        let decode = StepFeatures {
            seqs: 8.0,
            tokens: 8.0,
            ..Default::default()
        };
        let mixed = StepFeatures {
            prefill_tokens: 100.0,
            tokens: 107.0,
            ..decode
        };
        assert!(m.runs_eager(&decode) && m.runs_eager(&mixed), "no graphs");
        m.graph_max_batch = 8;
        assert!(!m.runs_eager(&decode) && m.runs_eager(&mixed));
        m.graph_max_batch = 7;
        assert!(m.runs_eager(&decode), "past the largest bucket");
        m.graph_max_batch = 128;
        m.graph_max_tokens = 106;
        assert!(m.runs_eager(&mixed), "past the largest token bucket");
        m.graph_max_tokens = 512;
        assert!(!m.runs_eager(&mixed), "mixed steps captured");
        let delta = StepFeatures {
            delta_tokens: 3.0,
            ..mixed
        };
        assert!(
            m.runs_eager(&delta),
            "mixed steps with delta rows run eagerly without delta graphs"
        );
        m.graph_max_delta_tokens = 107;
        assert!(!m.runs_eager(&delta), "delta rows in a delta bucket");
        m.graph_max_delta_tokens = 106;
        assert!(m.runs_eager(&delta), "past the largest delta bucket");
        m.host[0][0] = 0.001;
        m.host[1][11] = 0.004; // eager prefill steps
        let eager = StepFeatures {
            eager: 1.0,
            ..mixed
        };
        assert!((m.host_s(&decode) - 0.001).abs() < 1e-12);
        assert!((m.host_s(&eager) - 0.004).abs() < 1e-12);
        assert_eq!(m.host_s(&mixed), 0.0);
    }
}
