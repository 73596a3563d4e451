//! Which worker a new request goes to (`--placement`): pure and synchronous, decided on a
//! snapshot of every worker's load (CaraServe §5, Algorithm 1; Punica's first fit).
//!
//! # Policies ([`Placement`])
//!
//! - `caraserve` (the default): the worker with the least *added latency cost* to the requests
//!   it already serves, from the rank-aware latency model ([`LatencyProfile`]):
//!
//!   ```text
//!   cost(w) = n·(T(batch + r) − T(batch))         every running request's steps get slower
//!           + n·prefill(P)                        r's prefill delays them once
//!           + (n + 1)·copy(r) + read(r)           r's adapter: host → GPU blocks the step
//!                                                 (0 where it is on the GPU), disk → host only r
//!           + PENALTY  if T(batch + r) > the TPOT SLO (--tpot-slo-ms)
//!   T(batch) = const + per_token·requests + per_rank·rank_term + per_adapter·distinct adapters
//!            + per_context·context tokens (prompts and outputs of its requests)
//!   rank_term = Σ rank over the batch's distinct adapters (MBGMV, no padding: deltaserve's kernels)
//!             | requests × max rank                      (BGMV, padded to the largest rank)
//!   ```
//!
//!   `n` counts the worker's outstanding requests (queued ones too). Ties go to the worker that
//!   holds the adapter (GPU, then host), then the less loaded, then the lower index.
//! - `least-loaded`: the fewest outstanding requests (the engine's rule before placement).
//! - `first-fit` (Punica): the first worker, in index order, whose batch has room (fewer
//!   outstanding than `--max-num-seqs` and, with a TPOT SLO, a predicted step within it).
//! - `random`: uniform over the workers with room (a deterministic sequence per ticket).
//!
//! Every policy picks among ready workers below `--max-queued-per-worker` first; when none has
//! room it returns the least loaded ready one (whose full queue then refuses the request, 429).

use serde::Deserialize;
use std::path::Path;

/// Added to a worker's cost where the request would break the TPOT SLO (microseconds): any
/// worker within the SLO is cheaper than every worker beyond it.
pub const OVER_SLO_PENALTY_US: f64 = 1e12;

/// `--placement`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Placement {
    /// Least added latency cost per the rank-aware model, a penalty past the TPOT SLO.
    Caraserve,
    /// Fewest outstanding requests.
    LeastLoaded,
    /// The first worker with room (Punica).
    FirstFit,
    /// Uniform over the workers with room.
    Random,
}

impl Placement {
    /// The label of metrics and logs.
    pub fn label(self) -> &'static str {
        match self {
            Placement::Caraserve => "caraserve",
            Placement::LeastLoaded => "least-loaded",
            Placement::FirstFit => "first-fit",
            Placement::Random => "random",
        }
    }
}

/// How the adapters' ranks enter a decode step's time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RankCost {
    /// Σ rank over the batch's distinct adapters (MBGMV: no padding).
    SumOfRanks,
    /// requests × the largest rank (BGMV: every row padded to it).
    BatchTimesMaxRank,
}

/// The rank-aware latency model placement prices requests with (microseconds): what
/// `deltaserve profile` writes (the simulator's latency model JSON, `pyworker/deltaserve/sim`),
/// read by `--latency-profile`; [`LatencyProfile::default`] without one.
#[derive(Debug, Clone, PartialEq)]
pub struct LatencyProfile {
    /// Decode step time with no request (µs).
    pub decode_const_us: f64,
    /// Per request of the batch (µs).
    pub decode_per_request_us: f64,
    /// Per unit of the rank term (µs).
    pub decode_per_rank_us: f64,
    /// Per distinct adapter of the batch (µs): a kernel segment each (large on CPU workers).
    pub decode_per_adapter_us: f64,
    /// Per token of KV the batch attends over (µs).
    pub decode_per_context_token_us: f64,
    /// How ranks add up ([`RankCost`]).
    pub rank_cost: RankCost,
    /// Prefill time per prompt token (µs).
    pub prefill_per_token_us: f64,
    /// Host → GPU copy of an adapter (bytes per µs).
    pub host_to_gpu_bytes_per_us: f64,
    /// Disk → host read of an adapter (bytes per µs).
    pub disk_to_host_bytes_per_us: f64,
    /// The device the profile was measured on ("" for the defaults).
    pub device: String,
}

impl Default for LatencyProfile {
    /// The bundled Llama-2-7B model measured on an H200 (`sim/models/llama-2-7b-H200.json`),
    /// rounded: a 4.6 ms step, 0.2 µs per unit of Σ rank, 43 µs per LoRA request, 0.14 µs per
    /// token of context.
    fn default() -> Self {
        Self {
            decode_const_us: 4622.0,
            decode_per_request_us: 43.4,
            decode_per_rank_us: 0.21,
            decode_per_adapter_us: 0.007,
            decode_per_context_token_us: 0.138,
            rank_cost: RankCost::SumOfRanks,
            prefill_per_token_us: 10.8,
            host_to_gpu_bytes_per_us: 19_878.0,
            disk_to_host_bytes_per_us: 600.0,
            device: String::new(),
        }
    }
}

/// The JSON of the simulator's `LatencyModel` (seconds per feature unit), the fields read.
#[derive(Debug, Deserialize)]
struct SimModelJson {
    decode: std::collections::BTreeMap<String, f64>,
    prefill: std::collections::BTreeMap<String, f64>,
    #[serde(default)]
    disk_to_host_bps: std::collections::BTreeMap<String, f64>,
    #[serde(default)]
    host_to_gpu_bps: std::collections::BTreeMap<String, f64>,
    #[serde(default)]
    device: String,
    #[serde(default)]
    rank_cost: Option<RankCost>,
}

impl LatencyProfile {
    /// Reads a profile file (`deltaserve profile`'s output); the error names the file and field.
    pub fn load(path: &Path) -> Result<Self, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("--latency-profile {}: {e}", path.display()))?;
        Self::from_json(&text).map_err(|e| format!("--latency-profile {}: {e}", path.display()))
    }

    /// Parses the simulator's latency model JSON: a decode step costs `const + (seqs + tokens +
    /// lora_tokens)·requests + lora_rank_sum·Σ rank + lora_segments·adapters +
    /// context_tokens·context`, a prefill `prefill_tokens + tokens` per token; bandwidths are the
    /// `lora` ones.
    pub fn from_json(text: &str) -> Result<Self, String> {
        let m: SimModelJson =
            serde_json::from_str(text).map_err(|e| format!("not a latency profile: {e}"))?;
        let get = |map: &std::collections::BTreeMap<String, f64>, k: &str| -> Result<f64, String> {
            let v = map.get(k).copied().unwrap_or(0.0);
            if v.is_finite() && v >= 0.0 {
                Ok(v * 1e6)
            } else {
                Err(format!(
                    "coefficient {k} must be a non-negative number, got {v}"
                ))
            }
        };
        let bw =
            |map: &std::collections::BTreeMap<String, f64>, default: f64| -> Result<f64, String> {
                match map.get("lora") {
                    None => Ok(default),
                    Some(&v) if v.is_finite() && v > 0.0 => Ok(v / 1e6),
                    Some(v) => Err(format!("bandwidth lora must be positive bytes/s, got {v}")),
                }
            };
        let d = &m.decode;
        let defaults = Self::default();
        Ok(Self {
            decode_const_us: get(d, "const")?,
            decode_per_request_us: get(d, "seqs")? + get(d, "tokens")? + get(d, "lora_tokens")?,
            decode_per_rank_us: get(d, "lora_rank_sum")?,
            decode_per_adapter_us: get(d, "lora_segments")?,
            decode_per_context_token_us: get(d, "context_tokens")?,
            rank_cost: m.rank_cost.unwrap_or(RankCost::SumOfRanks),
            prefill_per_token_us: get(&m.prefill, "prefill_tokens")? + get(&m.prefill, "tokens")?,
            host_to_gpu_bytes_per_us: bw(&m.host_to_gpu_bps, defaults.host_to_gpu_bytes_per_us)?,
            disk_to_host_bytes_per_us: bw(&m.disk_to_host_bps, defaults.disk_to_host_bytes_per_us)?,
            device: m.device,
        })
    }

    /// A decode step's time (µs) for `batch`.
    pub fn decode_us(&self, batch: &Batch) -> f64 {
        let rank_term = match self.rank_cost {
            RankCost::SumOfRanks => batch.rank_sum as f64,
            RankCost::BatchTimesMaxRank => (batch.requests as f64) * batch.max_rank as f64,
        };
        self.decode_const_us
            + self.decode_per_request_us * batch.requests as f64
            + self.decode_per_rank_us * rank_term
            + self.decode_per_adapter_us * batch.adapters as f64
            + self.decode_per_context_token_us * batch.context_tokens as f64
    }
}

/// Where a worker holds the new request's adapter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Residency {
    /// On the GPU (or the base model: nothing to load).
    Gpu,
    /// In host memory: a host → GPU copy before its prefill.
    Host,
    /// On disk only: a read, then the copy.
    Disk,
}

/// A worker's batch as the latency model sees it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Batch {
    /// Requests (running and queued).
    pub requests: usize,
    /// Σ rank over its distinct adapters.
    pub rank_sum: u64,
    /// Largest rank in it (0: base requests only).
    pub max_rank: u32,
    /// Its distinct adapters.
    pub adapters: usize,
    /// Tokens of KV its requests attend over (prompts and outputs so far).
    pub context_tokens: u64,
}

impl Batch {
    /// The batch with one more request of an adapter of `rank` and a prompt of
    /// `prompt_tokens`; `new_adapter`: not in it yet.
    pub fn with(self, rank: u32, new_adapter: bool, prompt_tokens: u32) -> Batch {
        Batch {
            requests: self.requests + 1,
            rank_sum: self.rank_sum + if new_adapter { u64::from(rank) } else { 0 },
            max_rank: self.max_rank.max(rank),
            adapters: self.adapters + usize::from(new_adapter),
            context_tokens: self.context_tokens + u64::from(prompt_tokens),
        }
    }
}

/// One worker as placement sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerView {
    /// Up and handshaken.
    pub ready: bool,
    /// Requests queued or running.
    pub outstanding: usize,
    /// Below `--max-queued-per-worker`.
    pub has_room: bool,
    /// Its batch.
    pub batch: Batch,
    /// Whether its batch already uses the new request's adapter.
    pub adapter_in_batch: bool,
    /// Where it holds the new request's adapter.
    pub residency: Residency,
}

/// The request being placed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Incoming {
    /// Its adapter's rank (0: the base model or a delta).
    pub rank: u32,
    /// Its prompt's tokens.
    pub prompt_tokens: u32,
    /// Its adapter's host bytes (what a load copies).
    pub adapter_bytes: u64,
}

/// What a policy decided.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Choice {
    /// The worker's index.
    pub worker: usize,
    /// Its predicted decode step with the request (µs).
    pub step_us: f64,
    /// The step would break the TPOT SLO.
    pub over_slo: bool,
}

/// Everything a decision reads besides the workers.
#[derive(Debug, Clone)]
pub struct Placer {
    /// The policy.
    pub policy: Placement,
    /// The latency model.
    pub profile: LatencyProfile,
    /// `--tpot-slo-ms` in µs (`None`: no SLO, no penalty).
    pub tpot_slo_us: Option<f64>,
    /// `--max-num-seqs`: the batch first fit fills.
    pub max_num_seqs: usize,
}

impl Placer {
    /// Picks a worker for `req` (module docs); `ticket` seeds `random`. `None`: no worker is ready.
    pub fn choose(&self, workers: &[WorkerView], req: &Incoming, ticket: u64) -> Option<Choice> {
        let ready: Vec<usize> = (0..workers.len()).filter(|&i| workers[i].ready).collect();
        let least_loaded = |among: &[usize]| {
            among
                .iter()
                .copied()
                .min_by_key(|&i| (workers[i].outstanding, i))
        };
        let fallback = least_loaded(&ready)?;
        let roomy: Vec<usize> = ready
            .iter()
            .copied()
            .filter(|&i| workers[i].has_room)
            .collect();
        let pick = match self.policy {
            _ if roomy.is_empty() => fallback,
            Placement::LeastLoaded => least_loaded(&roomy).unwrap_or(fallback),
            Placement::Random => roomy[(splitmix64(ticket) % roomy.len() as u64) as usize],
            Placement::FirstFit => roomy
                .iter()
                .copied()
                .find(|&i| {
                    workers[i].outstanding < self.max_num_seqs && !self.over_slo(&workers[i], req)
                })
                .unwrap_or_else(|| least_loaded(&roomy).unwrap_or(fallback)),
            Placement::Caraserve => roomy
                .iter()
                .copied()
                .min_by(|&a, &b| {
                    let key = |i: usize| {
                        (
                            self.cost_us(&workers[i], req),
                            workers[i].residency,
                            workers[i].outstanding,
                            i,
                        )
                    };
                    key(a)
                        .partial_cmp(&key(b))
                        .unwrap_or(std::cmp::Ordering::Equal)
                })
                .unwrap_or(fallback),
        };
        let w = &workers[pick];
        Some(Choice {
            worker: pick,
            step_us: self.step_with(w, req),
            over_slo: self.over_slo(w, req),
        })
    }

    /// The decode step of `w`'s batch with `req` (µs).
    pub fn step_with(&self, w: &WorkerView, req: &Incoming) -> f64 {
        let new_adapter = req.rank > 0 && !w.adapter_in_batch;
        self.profile
            .decode_us(&w.batch.with(req.rank, new_adapter, req.prompt_tokens))
    }

    fn over_slo(&self, w: &WorkerView, req: &Incoming) -> bool {
        self.tpot_slo_us
            .is_some_and(|slo| self.step_with(w, req) > slo)
    }

    /// The added latency cost of `req` on `w` (µs; module docs).
    pub fn cost_us(&self, w: &WorkerView, req: &Incoming) -> f64 {
        let p = &self.profile;
        let n = w.outstanding as f64;
        let slower = self.step_with(w, req) - p.decode_us(&w.batch);
        let prefill = p.prefill_per_token_us * f64::from(req.prompt_tokens);
        let bytes = req.adapter_bytes as f64;
        let copy = bytes / p.host_to_gpu_bytes_per_us.max(1e-9);
        let load = match w.residency {
            Residency::Gpu => 0.0,
            Residency::Host => (n + 1.0) * copy,
            Residency::Disk => (n + 1.0) * copy + bytes / p.disk_to_host_bytes_per_us.max(1e-9),
        };
        let penalty = if self.over_slo(w, req) {
            OVER_SLO_PENALTY_US
        } else {
            0.0
        };
        n * slower + n * prefill + load + penalty
    }
}

/// A well-mixed 64-bit hash of `x` (splitmix64): `random`'s deterministic draw per ticket.
fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A worker serving `n` requests, each of its own adapter of `rank`, that holds the new one.
    fn serving(n: usize, rank: u32) -> WorkerView {
        WorkerView {
            ready: true,
            outstanding: n,
            has_room: true,
            batch: Batch {
                requests: n,
                rank_sum: n as u64 * u64::from(rank),
                max_rank: rank,
                adapters: n,
                context_tokens: 0,
            },
            adapter_in_batch: false,
            residency: Residency::Gpu,
        }
    }

    fn placer(policy: Placement, profile: LatencyProfile, slo_ms: Option<f64>) -> Placer {
        Placer {
            policy,
            profile,
            tpot_slo_us: slo_ms.map(|ms| ms * 1e3),
            max_num_seqs: 32,
        }
    }

    fn model(const_ms: f64, per_rank_ms: f64, rank_cost: RankCost) -> LatencyProfile {
        LatencyProfile {
            decode_const_us: const_ms * 1e3,
            decode_per_request_us: 0.0,
            decode_per_rank_us: per_rank_ms * 1e3,
            decode_per_adapter_us: 0.0,
            decode_per_context_token_us: 0.0,
            rank_cost,
            ..LatencyProfile::default()
        }
    }

    /// CaraServe §2.3, Fig. 5: instance 1 serves 24 requests of rank 32, instance 2 16 of rank
    /// 64; a rank-64 request arrives; SLO 36 ms. The models go through the figure's step times:
    /// BGMV 34.8 / 35.8 ms (∝ requests × max rank), MBGMV 35.3 / 35.9 ms (∝ Σ rank).
    #[test]
    fn caraserve_toy_example_picks_the_documented_instance() {
        let workers = [serving(24, 32), serving(16, 64)];
        let new = Incoming {
            rank: 64,
            prompt_tokens: 0,
            adapter_bytes: 0,
        };
        let bgmv = model(31.8, 1.0 / 256.0, RankCost::BatchTimesMaxRank);
        assert!((bgmv.decode_us(&workers[0].batch) - 34_800.0).abs() < 1.0);
        assert!((bgmv.decode_us(&workers[1].batch) - 35_800.0).abs() < 1.0);
        let mbgmv = model(33.5, 0.6 / 256.0, RankCost::SumOfRanks);
        assert!((mbgmv.decode_us(&workers[0].batch) - 35_300.0).abs() < 1.0);
        assert!((mbgmv.decode_us(&workers[1].batch) - 35_900.0).abs() < 1.0);

        // BGMV: joining instance 1 pads 25 requests to rank 64 (38.05 ms; instance 2 reaches
        // 36.05 ms, also past the SLO, but slows 16 requests by 0.25 ms, not 24 by 3.25 ms).
        let c = placer(Placement::Caraserve, bgmv, Some(36.0))
            .choose(&workers, &new, 0)
            .unwrap();
        assert_eq!(c.worker, 1, "{c:?}");
        // MBGMV: instance 2 has the larger Σ rank and would pass 36 ms; instance 1 stays within.
        let p = placer(Placement::Caraserve, mbgmv.clone(), Some(36.0));
        let c = p.choose(&workers, &new, 0).unwrap();
        assert_eq!(c.worker, 0, "{c:?}");
        assert!(!c.over_slo && (c.step_us - 35_450.0).abs() < 1.0);
        assert!(p.over_slo(&workers[1], &new));
        // Without the SLO's penalty the cheaper added cost (16 requests slowed, not 24) wins.
        let c = placer(Placement::Caraserve, mbgmv, None)
            .choose(&workers, &new, 0)
            .unwrap();
        assert_eq!(c.worker, 1);
    }

    #[test]
    fn caraserve_prefers_workers_holding_the_adapter_gpu_then_host() {
        let profile = LatencyProfile::default();
        let p = placer(Placement::Caraserve, profile, None);
        let new = Incoming {
            rank: 16,
            prompt_tokens: 32,
            adapter_bytes: 80 << 20,
        };
        let mut workers = [serving(4, 16), serving(4, 16), serving(4, 16)];
        workers[0].residency = Residency::Disk;
        workers[1].residency = Residency::Host;
        workers[2].residency = Residency::Gpu;
        assert_eq!(p.choose(&workers, &new, 0).unwrap().worker, 2);
        workers[2].residency = Residency::Disk;
        assert_eq!(p.choose(&workers, &new, 0).unwrap().worker, 1);
        // An adapter already in a batch adds no rank: that worker is cheaper at equal load.
        let mut same = [serving(4, 16), serving(4, 16)];
        same[1].adapter_in_batch = true;
        assert_eq!(p.choose(&same, &new, 0).unwrap().worker, 1);
    }

    #[test]
    fn the_other_policies() {
        let new = Incoming {
            rank: 8,
            prompt_tokens: 10,
            adapter_bytes: 0,
        };
        let workers = [serving(5, 8), serving(2, 64), serving(3, 8)];
        let p = |policy| placer(policy, LatencyProfile::default(), None);
        assert_eq!(
            p(Placement::LeastLoaded)
                .choose(&workers, &new, 0)
                .unwrap()
                .worker,
            1
        );
        assert_eq!(
            p(Placement::FirstFit)
                .choose(&workers, &new, 0)
                .unwrap()
                .worker,
            0
        );
        let mut full = workers.clone();
        full[0].outstanding = 32; // first fit skips a full batch
        assert_eq!(
            p(Placement::FirstFit)
                .choose(&full, &new, 0)
                .unwrap()
                .worker,
            1
        );
        let picks: std::collections::BTreeSet<usize> = (0..64)
            .map(|t| {
                p(Placement::Random)
                    .choose(&workers, &new, t)
                    .unwrap()
                    .worker
            })
            .collect();
        assert_eq!(picks.len(), 3, "random reaches every worker");
        assert_eq!(
            p(Placement::Random).choose(&workers, &new, 7),
            p(Placement::Random).choose(&workers, &new, 7)
        );
        // First fit with an SLO skips a worker whose step would break it.
        let tight = placer(
            Placement::FirstFit,
            model(10.0, 0.1, RankCost::SumOfRanks),
            Some(14.0),
        );
        let ranks = [serving(4, 64), serving(4, 8)]; // 10 + 0.1·(256 + 8) ms vs 10 + 0.1·40 ms
        assert_eq!(tight.choose(&ranks, &new, 0).unwrap().worker, 1);
    }

    #[test]
    fn only_ready_workers_with_room_and_the_least_loaded_when_none_has_room() {
        let new = Incoming {
            rank: 8,
            prompt_tokens: 10,
            adapter_bytes: 0,
        };
        let mut workers = [serving(1, 8), serving(3, 8), serving(2, 8)];
        workers[0].ready = false;
        for policy in [
            Placement::Caraserve,
            Placement::LeastLoaded,
            Placement::FirstFit,
            Placement::Random,
        ] {
            let p = placer(policy, LatencyProfile::default(), None);
            assert_ne!(p.choose(&workers, &new, 3).unwrap().worker, 0, "{policy:?}");
        }
        for w in &mut workers {
            w.has_room = false;
        }
        let p = placer(Placement::Caraserve, LatencyProfile::default(), None);
        assert_eq!(p.choose(&workers, &new, 0).unwrap().worker, 2);
        workers[1].ready = false;
        workers[2].ready = false;
        assert_eq!(p.choose(&workers, &new, 0), None);
    }

    #[test]
    fn long_contexts_make_a_worker_slower_and_can_break_the_slo() {
        // The H200 model: 0.14 us per token of context. 16 requests of 4,000 tokens add ~9 ms to
        // a ~5.4 ms step: a 12 ms SLO holds on the short-context worker only.
        let mut long = serving(16, 16);
        long.batch.context_tokens = 64_000;
        let short = serving(16, 16);
        let req = Incoming {
            rank: 16,
            prompt_tokens: 100,
            adapter_bytes: 0,
        };
        let p = placer(Placement::FirstFit, LatencyProfile::default(), Some(12.0));
        assert!(p.step_with(&long, &req) > p.step_with(&short, &req) + 8_000.0);
        let choice = p.choose(&[long, short], &req, 0).unwrap();
        assert_eq!((choice.worker, choice.over_slo), (1, false));
    }

    #[test]
    fn profiles_load_from_the_simulators_json() {
        let json = r#"{"decode": {"const": 0.004, "seqs": 1e-5, "tokens": 0, "lora_tokens": 2e-5,
            "lora_rank_sum": 2e-7, "lora_segments": 5e-6, "context_tokens": 1.5e-7}, "prefill": {"tokens": 1e-5, "prefill_tokens": 1e-6},
            "host_to_gpu_bps": {"lora": 2e10, "delta": 2e10}, "device": "NVIDIA H100 80GB HBM3",
            "r2": {"decode": 0.99}}"#;
        let p = LatencyProfile::from_json(json).unwrap();
        assert!(
            (p.decode_const_us - 4000.0).abs() < 1e-9
                && (p.decode_per_request_us - 30.0).abs() < 1e-9
        );
        assert!(
            (p.decode_per_rank_us - 0.2).abs() < 1e-9
                && (p.prefill_per_token_us - 11.0).abs() < 1e-9
        );
        assert!(
            (p.host_to_gpu_bytes_per_us - 20_000.0).abs() < 1e-6
                && p.device.starts_with("NVIDIA H100")
        );
        assert!((p.decode_per_adapter_us - 5.0).abs() < 1e-9);
        assert!((p.decode_per_context_token_us - 0.15).abs() < 1e-9);
        assert_eq!(p.rank_cost, RankCost::SumOfRanks);
        let bgmv = json.replacen(
            "{\"decode\"",
            "{\"rank_cost\": \"batch_times_max_rank\", \"decode\"",
            1,
        );
        assert_eq!(
            LatencyProfile::from_json(&bgmv).unwrap().rank_cost,
            RankCost::BatchTimesMaxRank
        );
        let missing = LatencyProfile::load(Path::new("/nonexistent/profile.json")).unwrap_err();
        assert!(
            missing.contains("--latency-profile /nonexistent/profile.json"),
            "{missing}"
        );
        assert!(LatencyProfile::from_json("{}")
            .unwrap_err()
            .contains("not a latency profile"));
        let negative = json.replace("\"const\": 0.004", "\"const\": -1");
        assert!(LatencyProfile::from_json(&negative)
            .unwrap_err()
            .contains("const"));
    }
}
