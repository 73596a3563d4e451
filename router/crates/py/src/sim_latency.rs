//! The simulator's step-latency model at prediction time: the features of one scheduled step
//! ([`StepFeatures`], named by [`FEATURES`]) and the two linear models over them
//! ([`LatencyModel`]: one for decode-only steps, one for steps that prefill), plus the transfer
//! bandwidths of the variant tiers. Fitting lives in Python (`deltaserve.sim.latency`, numpy
//! least squares over a profile); this side only evaluates `coef · features`. [`SplitMix`]
//! draws the optional step-time noise.
//!
//! ```text
//! step kind  = "prefill" if any chunk prefills (a new request, or more than 1 token) else "decode"
//! step_s     = max(0, Σ_f coef[kind][f] · feature[f])
//! to_host_s  = host_bytes / disk_to_host_Bps[kind]   (one read; a worker runs READERS at once)
//! to_gpu_s   = host_bytes / host_to_gpu_Bps[kind]    (added to the step that carries the ToGpu)
//! ```

use deltaserve_sched::VariantKind;

/// The feature names, in the order of [`StepFeatures::values`]; Python reads them from
/// `_native.SIM_FEATURES` (one owner).
pub(crate) const FEATURES: [&str; 11] = [
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
];

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
}

impl StepFeatures {
    /// The values in [`FEATURES`] order (`const` first, always 1).
    pub(crate) fn values(&self) -> [f64; 11] {
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
    /// Seconds per unit of each feature, decode-only steps ([`FEATURES`] order).
    pub(crate) decode: [f64; 11],
    /// Seconds per unit of each feature, steps with a prefill chunk.
    pub(crate) prefill: [f64; 11],
    /// Disk -> host read bandwidth of a variant (bytes/s), `[lora, delta]`.
    pub(crate) disk_to_host_bps: [f64; 2],
    /// Host -> GPU copy bandwidth of a variant (bytes/s), `[lora, delta]`.
    pub(crate) host_to_gpu_bps: [f64; 2],
}

impl LatencyModel {
    /// Seconds the step takes on the device (never negative).
    pub(crate) fn step_s(&self, f: &StepFeatures) -> f64 {
        let coef = if f.prefills() {
            &self.prefill
        } else {
            &self.decode
        };
        let t: f64 = coef.iter().zip(f.values()).map(|(c, x)| c * x).sum();
        t.max(0.0)
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

/// Index of a kind in the bandwidth pairs: `[lora, delta]`.
pub(crate) fn kind_index(kind: VariantKind) -> usize {
    match kind {
        VariantKind::Lora => 0,
        VariantKind::Delta => 1,
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

    #[test]
    fn the_step_kind_picks_the_model_and_time_is_never_negative() {
        let mut decode = [0.0; 11];
        decode[0] = 0.01;
        decode[2] = 0.001;
        let mut prefill = [0.0; 11];
        prefill[0] = -1.0;
        prefill[3] = 0.5;
        let m = LatencyModel {
            decode,
            prefill,
            disk_to_host_bps: [1e9, 2e9],
            host_to_gpu_bps: [1e10, 2e10],
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
    }
}
