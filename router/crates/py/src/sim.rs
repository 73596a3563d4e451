//! `_native.SchedulerConfig` and `_native.simulate`: the scheduler's config struct for Python
//! (its defaults are [`SchedulerConfig::new`]'s, not a copy) and the capacity-planning
//! simulator's entry (`sim_loop.rs` runs it, `sim_latency.rs` prices its steps,
//! `sim_placement.rs` places its arrivals with the router's `--placement` policies). Conversion
//! only: plain values in, a dict of plain values out; `deltaserve.sim` builds the public API.

use std::collections::BTreeMap;

use deltaserve_ipc::wire;
use deltaserve_sched::SchedulerConfig as Config;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::scheduler::SchedError;
use crate::sim_latency::{LaneBucket, LatencyModel, FEATURES, NUM_FEATURES};
use crate::sim_loop::{simulate as run, SimOptions, SimRequest, SimVariant};
use crate::sim_placement::placement_named;
use deltaserve_sched::wire::sched_kind;
use deltaserve_server::engine::{LatencyProfile, Placer};

/// The feature names of the latency model, in coefficient order.
pub(crate) const SIM_FEATURES: [&str; NUM_FEATURES] = FEATURES;

/// The scheduler's limits (`deltaserve_sched::SchedulerConfig`), every field readable and
/// writable; `validate()` checks them as the scheduler will.
#[pyclass(
    name = "SchedulerConfig",
    module = "deltaserve._native",
    get_all,
    set_all,
    eq,
    skip_from_py_object
)]
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct PySchedulerConfig {
    /// Tokens per KV page.
    block_size: u32,
    /// Pages in the worker's KV pool.
    num_blocks: u32,
    /// Most requests running at once.
    max_num_seqs: usize,
    /// Token budget of one step.
    max_num_batched_tokens: usize,
    /// Longest prompt + output.
    max_model_len: u32,
    /// Host-tier budget for variant copies (bytes).
    host_adapter_bytes: u64,
    /// Waiting requests whose variants are prefetched into host memory.
    prefetch_window: usize,
    /// GPU delta slots.
    max_deltas: usize,
    /// Whether the worker reports finished host reads (the daemon: on).
    host_copy_reports: bool,
    /// Whether the worker copies a delta's `ToGpu` beside the steps and reports it finished, its
    /// requests admitted after the report while others run (the daemon: on; `sim_loop.rs` times
    /// the copies on the worker's load stream).
    gpu_load_reports: bool,
    /// Most tokens of a step with delta rows that the worker replays from a graph: prompt chunks
    /// of such steps keep within it (the daemon: the worker's Hello; 0: no limit).
    delta_graph_tokens: usize,
}

impl From<Config> for PySchedulerConfig {
    fn from(c: Config) -> Self {
        let Config {
            block_size,
            num_blocks,
            max_num_seqs,
            max_num_batched_tokens,
            max_model_len,
            host_adapter_bytes,
            prefetch_window,
            max_deltas,
            host_copy_reports,
            gpu_load_reports,
            delta_graph_tokens,
            // Set per run: on when `simulate` is given the prompts' identities (`prompt_keys`).
            enable_prefix_caching: _,
        } = c;
        PySchedulerConfig {
            block_size,
            num_blocks,
            max_num_seqs,
            max_num_batched_tokens,
            max_model_len,
            host_adapter_bytes,
            prefetch_window,
            max_deltas,
            host_copy_reports,
            gpu_load_reports,
            delta_graph_tokens,
        }
    }
}

impl From<&PySchedulerConfig> for Config {
    fn from(c: &PySchedulerConfig) -> Self {
        Config {
            block_size: c.block_size,
            num_blocks: c.num_blocks,
            max_num_seqs: c.max_num_seqs,
            max_num_batched_tokens: c.max_num_batched_tokens,
            max_model_len: c.max_model_len,
            host_adapter_bytes: c.host_adapter_bytes,
            prefetch_window: c.prefetch_window,
            max_deltas: c.max_deltas,
            host_copy_reports: c.host_copy_reports,
            gpu_load_reports: c.gpu_load_reports,
            delta_graph_tokens: c.delta_graph_tokens,
            enable_prefix_caching: false,
        }
    }
}

#[pymethods]
impl PySchedulerConfig {
    /// The scheduler's defaults (`SchedulerConfig::new`) around the pool geometry and context
    /// limit given.
    #[new]
    fn new(block_size: u32, num_blocks: u32, max_model_len: u32) -> Self {
        Config::new(block_size, num_blocks, max_model_len).into()
    }

    /// Raises `SchedError` naming the first unusable field.
    fn validate(&self, py: Python<'_>) -> PyResult<()> {
        Config::from(self).validate().map_err(|e| {
            let err = SchedError::new_err(e.to_string());
            match err.value(py).setattr("error_type", e.error_type()) {
                Ok(()) => err,
                Err(setattr_failed) => setattr_failed,
            }
        })
    }

    /// Every field by name.
    fn as_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("block_size", self.block_size)?;
        d.set_item("num_blocks", self.num_blocks)?;
        d.set_item("max_num_seqs", self.max_num_seqs)?;
        d.set_item("max_num_batched_tokens", self.max_num_batched_tokens)?;
        d.set_item("max_model_len", self.max_model_len)?;
        d.set_item("host_adapter_bytes", self.host_adapter_bytes)?;
        d.set_item("prefetch_window", self.prefetch_window)?;
        d.set_item("max_deltas", self.max_deltas)?;
        d.set_item("host_copy_reports", self.host_copy_reports)?;
        d.set_item("gpu_load_reports", self.gpu_load_reports)?;
        d.set_item("delta_graph_tokens", self.delta_graph_tokens)?;
        Ok(d)
    }

    fn __repr__(&self) -> String {
        let py_bool = |b: bool| if b { "True" } else { "False" };
        format!(
            "SchedulerConfig(block_size={}, num_blocks={}, max_num_seqs={}, \
             max_num_batched_tokens={}, max_model_len={}, host_adapter_bytes={}, \
             prefetch_window={}, max_deltas={}, host_copy_reports={}, gpu_load_reports={}, \
             delta_graph_tokens={})",
            self.block_size,
            self.num_blocks,
            self.max_num_seqs,
            self.max_num_batched_tokens,
            self.max_model_len,
            self.host_adapter_bytes,
            self.prefetch_window,
            self.max_deltas,
            py_bool(self.host_copy_reports),
            py_bool(self.gpu_load_reports),
            self.delta_graph_tokens,
        )
    }
}

/// A latency model from its device and host coefficient lists ([`FEATURES`] order; host:
/// decode then prefill), graph rule, dense-prefill threshold, dense lane and bandwidths.
fn latency_model(
    (decode, prefill, disk_to_host_bps, host_to_gpu_bps): LatencyTuple,
    host: Option<(Vec<f64>, Vec<f64>)>,
    (graph_max_batch, graph_max_tokens, graph_max_delta_tokens): (u32, u32, u32),
    dense_min_m: Option<u32>,
    dense_lane: Option<Vec<(u32, u32)>>,
) -> PyResult<LatencyModel> {
    if let Some(m) = dense_min_m.filter(|m| *m < 2) {
        return Err(PyValueError::new_err(format!(
            "dense_min_m must be at least 2 tokens (a one-token chunk is a decode row), got {m}"
        )));
    }
    let dense_lane = lane_buckets(dense_lane)?;
    let coefs = |name: &str, v: Vec<f64>| -> PyResult<[f64; NUM_FEATURES]> {
        if v.iter().any(|c| !c.is_finite()) {
            return Err(PyValueError::new_err(format!(
                "latency {name} coefficients must be finite, got {v:?}"
            )));
        }
        v.try_into().map_err(|v: Vec<f64>| {
            PyValueError::new_err(format!(
                "latency {name} coefficients: want {} ({}), got {}",
                FEATURES.len(),
                FEATURES.join(", "),
                v.len()
            ))
        })
    };
    for (name, bw) in [
        ("disk_to_host_bps (lora)", disk_to_host_bps.0),
        ("disk_to_host_bps (delta)", disk_to_host_bps.1),
        ("host_to_gpu_bps (lora)", host_to_gpu_bps.0),
        ("host_to_gpu_bps (delta)", host_to_gpu_bps.1),
    ] {
        if !(bw.is_finite() && bw > 0.0) {
            return Err(PyValueError::new_err(format!(
                "latency {name} must be a positive number of bytes/s, got {bw}"
            )));
        }
    }
    let host = match host {
        Some((d, p)) => [coefs("host decode", d)?, coefs("host prefill", p)?],
        None => [[0.0; NUM_FEATURES]; 2],
    };
    Ok(LatencyModel {
        decode: coefs("decode", decode)?,
        prefill: coefs("prefill", prefill)?,
        host,
        graph_max_batch,
        graph_max_tokens,
        graph_max_delta_tokens,
        disk_to_host_bps: [disk_to_host_bps.0, disk_to_host_bps.1],
        host_to_gpu_bps: [host_to_gpu_bps.0, host_to_gpu_bps.1],
        dense_min_m,
        dense_lane,
    })
}

/// The dense lane's `(bucket tokens, lane_min_tokens)` pairs as [`LaneBucket`]s (`None`: no lane,
/// an empty list); `ValueError` unless there is at least one, the buckets ascend strictly from 1
/// token and every threshold is at least 1 token.
fn lane_buckets(pairs: Option<Vec<(u32, u32)>>) -> PyResult<Vec<LaneBucket>> {
    let Some(pairs) = pairs else {
        return Ok(Vec::new());
    };
    let bad = |why: &str| {
        PyValueError::new_err(format!(
            "dense_lane: want (bucket tokens, lane_min_tokens) pairs, {why}; got {pairs:?}"
        ))
    };
    if pairs.is_empty() {
        return Err(bad("at least one (None: no lane)"));
    }
    if pairs.iter().any(|&(tokens, min)| tokens == 0 || min == 0) {
        return Err(bad("each at least 1 token"));
    }
    if pairs.windows(2).any(|w| w[0].0 >= w[1].0) {
        return Err(bad("buckets in strictly ascending order"));
    }
    Ok(pairs
        .iter()
        .map(|&(tokens, lane_min_tokens)| LaneBucket {
            tokens,
            lane_min_tokens,
        })
        .collect())
}

/// `(decode, prefill, disk_to_host_bps, host_to_gpu_bps)` as Python passes them.
type LatencyTuple = (Vec<f64>, Vec<f64>, (f64, f64), (f64, f64));

/// Replays `requests` (`(arrival_s, prompt_len, output_len, variant)`, variant 0 = base, `i`
/// = `variants[i - 1]`) through `workers` copies of the real scheduler on a virtual clock.
/// `variants` are `(kind, num_blocks, host_bytes, rank)`; `latency` is `(decode coefficients,
/// prefill coefficients, disk_to_host_bps, host_to_gpu_bps)` with coefficients in
/// `SIM_FEATURES` order and bandwidths as `(lora, delta)` pairs. Arrivals are placed by the
/// daemon's `--placement` policy `placement` (`PLACEMENTS`), pricing with `latency_profile` (the
/// JSON `--latency-profile` reads, the same model's; `None`: the daemon's default) and
/// `tpot_slo_s` (`--tpot-slo-ms`). `host` (decode, prefill coefficients) prices the worker's
/// launch of each step and `graphs` (`graph_max_batch`, `graph_max_tokens`,
/// `graph_max_delta_tokens`; `None`: none)
/// decides which steps run eagerly (`sim_latency.rs`); `dense_min_m` is the fewest tokens of
/// a delta's prefill chunk the worker runs dense (`None`: none, the CPU; feature
/// `dense_delta_segments` of an eager step); `dense_lane` the delta token buckets of the
/// worker's mixed graphs, ascending, each `(tokens, lane_min_tokens)`: the fewest tokens of one
/// delta that run in that bucket's dense lane (`None`: no lane; `dense_delta_segments` of a
/// replayed step); `ingress_s` delays each arrival and
/// `deliver_s` each token seen (`sim_loop.rs`). `prompt_keys` (one per request: equal keys,
/// equal prompts) turns the scheduler's prefix caching on, as the daemon's default; `None`:
/// off, prompts of zeros. Returns plain lists and counters (`deltaserve.sim` summarizes them).
/// Bad input raises `ValueError` naming it; the run itself releases the GIL.
#[pyfunction]
#[pyo3(signature = (
    config, requests, variants, latency, *, workers = 1, overlap_steps = true,
    router_gap_s = 0.0, noise = 0.0, seed = 0, max_queued_per_worker = None, step_times = None,
    record_steps = false, placement = "least-loaded", latency_profile = None, tpot_slo_s = None,
    host = None, graphs = None, ingress_s = 0.0, deliver_s = 0.0, prompt_keys = None,
    dense_min_m = None, dense_lane = None,
))]
#[allow(clippy::too_many_arguments)] // one keyword per option
#[allow(clippy::type_complexity)] // plain tuples are the conversion
pub(crate) fn simulate<'py>(
    py: Python<'py>,
    config: &PySchedulerConfig,
    requests: Vec<(f64, u32, u32, u32)>,
    variants: Vec<(String, u32, u64, u32)>,
    latency: LatencyTuple,
    workers: usize,
    overlap_steps: bool,
    router_gap_s: f64,
    noise: f64,
    seed: u64,
    max_queued_per_worker: Option<usize>,
    step_times: Option<Vec<f64>>,
    record_steps: bool,
    placement: &str,
    latency_profile: Option<&str>,
    tpot_slo_s: Option<f64>,
    host: Option<(Vec<f64>, Vec<f64>)>,
    graphs: Option<(u32, u32, u32)>,
    ingress_s: f64,
    deliver_s: f64,
    prompt_keys: Option<Vec<u64>>,
    dense_min_m: Option<u32>,
    dense_lane: Option<Vec<(u32, u32)>>,
) -> PyResult<Bound<'py, PyDict>> {
    let mut cfg = Config::from(config);
    if let Some(keys) = prompt_keys.as_ref().filter(|k| k.len() != requests.len()) {
        return Err(PyValueError::new_err(format!(
            "prompt_keys: want one per request ({}), got {}",
            requests.len(),
            keys.len()
        )));
    }
    // Prompt identities make the daemon's prefix caching (on by default) meaningful.
    cfg.enable_prefix_caching = prompt_keys.is_some();
    let policy = placement_named(placement).map_err(PyValueError::new_err)?;
    let profile = match latency_profile {
        Some(json) => LatencyProfile::from_json(json)
            .map_err(|e| PyValueError::new_err(format!("latency_profile: {e}")))?,
        None => LatencyProfile::default(),
    };
    if let Some(slo) = tpot_slo_s.filter(|s| !(s.is_finite() && *s > 0.0)) {
        return Err(PyValueError::new_err(format!(
            "tpot_slo_s must be a positive number of seconds, got {slo}"
        )));
    }
    let placer = Placer {
        policy,
        profile,
        tpot_slo_us: tpot_slo_s.map(|s| s * 1e6),
        max_num_seqs: cfg.max_num_seqs,
    };
    let model = latency_model(
        latency,
        host,
        graphs.unwrap_or((0, 0, 0)),
        dense_min_m,
        dense_lane,
    )?;
    let requests = requests
        .into_iter()
        .enumerate()
        .map(|(i, (arrival_s, prompt_len, output_len, variant))| {
            if !(arrival_s.is_finite() && arrival_s >= 0.0) {
                return Err(PyValueError::new_err(format!(
                    "request {i}: arrival {arrival_s} must be a finite number of seconds >= 0"
                )));
            }
            Ok(SimRequest {
                arrival_s,
                prompt_len,
                output_len,
                variant,
                prompt_key: prompt_keys.as_ref().map(|k| k[i]),
            })
        })
        .collect::<PyResult<Vec<_>>>()?;
    let variants = variants
        .into_iter()
        .enumerate()
        .map(|(i, (kind, num_blocks, host_bytes, rank))| {
            let kind = wire::VariantKind::from_label(&kind).ok_or_else(|| {
                PyValueError::new_err(format!(
                    "variant {i}: kind must be 'lora' or 'delta', got {kind:?}"
                ))
            })?;
            Ok(SimVariant {
                kind: sched_kind(kind),
                num_blocks,
                host_bytes,
                rank,
            })
        })
        .collect::<PyResult<Vec<_>>>()?;
    for (name, x) in [
        ("router_gap_s", router_gap_s),
        ("noise", noise),
        ("ingress_s", ingress_s),
        ("deliver_s", deliver_s),
    ] {
        if !(x.is_finite() && x >= 0.0) {
            return Err(PyValueError::new_err(format!(
                "{name} must be a finite number >= 0, got {x}"
            )));
        }
    }
    if let Some(bad) = step_times
        .iter()
        .flatten()
        .find(|t| !(t.is_finite() && **t >= 0.0))
    {
        return Err(PyValueError::new_err(format!(
            "step_times must be finite seconds >= 0, got {bad}"
        )));
    }
    let opts = SimOptions {
        workers,
        overlap_steps,
        router_gap_s,
        ingress_s,
        deliver_s,
        noise,
        seed,
        max_queued_per_worker,
        step_times,
        record_steps,
        placer,
    };
    let out = py
        .detach(|| run(&cfg, &requests, &variants, &model, &opts))
        .map_err(PyValueError::new_err)?;
    let d = PyDict::new(py);
    d.set_item("first_token_s", out.first_token_s)?;
    d.set_item("finish_s", out.finish_s)?;
    d.set_item("scheduled_s", out.scheduled_s)?;
    d.set_item("output_tokens", out.output_tokens)?;
    d.set_item("worker_of", out.worker_of)?;
    d.set_item("busy_s", out.busy_s)?;
    d.set_item("counters", out.counters)?;
    d.set_item("peaks", out.peaks)?;
    let steps: Vec<_> = out
        .steps
        .into_iter()
        .map(|s| {
            (
                s.worker,
                s.step_id,
                s.ahead,
                s.start_s,
                s.end_s,
                s.entries,
                s.prefill_tokens,
                FEATURES
                    .iter()
                    .copied()
                    .zip(s.features)
                    .collect::<BTreeMap<_, _>>(),
            )
        })
        .collect();
    d.set_item("steps", steps)?;
    Ok(d)
}
