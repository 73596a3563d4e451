//! `_native.Scheduler`: the router's scheduler ([`deltaserve_sched::Scheduler`]) for Python, so
//! tests drive the worker with the plans the router would send, and tools can run the real
//! scheduler as a simulator. Conversion only: requests, variants and the config come in as
//! plain values, steps go out as encoded wire `StepPlan` frames (through
//! [`deltaserve_sched::wire`], the router's own translation), and worker answers come back as
//! encoded `StepOutput` frames. No IO, no clock: arrival stamps are the caller's numbers.
//!
//! Besides the scheduler it keeps only what the router's engine keeps next to it for the same
//! translation: each live request's sampling parameters (sent with it whenever it goes to the
//! worker in full) and the ids of the steps sent and not yet answered (an output must answer
//! the oldest).
//!
//! Refusals ([`deltaserve_sched::SchedError`]) raise `SchedError`, a `ValueError` whose
//! `error_type` attribute is the stable label the router's metrics and HTTP layer use.

use std::collections::{BTreeMap, HashMap, VecDeque};

use deltaserve_ipc::codec::{self, FromWorker};
use deltaserve_ipc::wire::{self, SamplingParams};
use deltaserve_sched::{
    SchedStats, ScheduledStep, SchedulerConfig, SeqRequest, VariantSpec,
    DEFAULT_HOST_ADAPTER_BYTES, DEFAULT_MAX_DELTAS, DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS, DEFAULT_PREFETCH_WINDOW,
};
use pyo3::create_exception;
use pyo3::exceptions::{PyAssertionError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use deltaserve_sched::wire::{sched_kind, step_plan};

create_exception!(
    deltaserve._native,
    SchedError,
    PyValueError,
    "The scheduler refused a config, request or variant; `error_type` is its stable label."
);

/// A refusal as `SchedError(message)` with its `error_type` label set.
fn sched_err(py: Python<'_>, e: deltaserve_sched::SchedError) -> PyErr {
    let err = SchedError::new_err(e.to_string());
    match err.value(py).setattr("error_type", e.error_type()) {
        Ok(()) => err,
        Err(setattr_failed) => setattr_failed,
    }
}

/// A frame that is not what the call takes: `ValueError` with the codec's message.
fn frame_err(e: codec::CodecError) -> PyErr {
    PyValueError::new_err(e.to_string())
}

/// The router's scheduler plus what the plan translation needs next to it.
#[pyclass(module = "deltaserve._native")]
pub(crate) struct Scheduler {
    /// The scheduler itself.
    sched: deltaserve_sched::Scheduler,
    /// Each live request's sampling parameters, for its `NewRequest`s (the router's engine keeps
    /// them with the request's stream).
    sampling: HashMap<u64, SamplingParams>,
    /// Steps sent and not yet answered, oldest first (at most two: `schedule_ahead`).
    outstanding: VecDeque<u64>,
}

impl Scheduler {
    /// The step as an encoded `StepPlan` frame, remembered as outstanding; `None` when empty.
    fn send<'py>(&mut self, py: Python<'py>, step: ScheduledStep) -> Option<Bound<'py, PyBytes>> {
        if step.is_empty() {
            return None;
        }
        self.outstanding.push_back(step.step_id);
        let sampling = &self.sampling;
        let plan = step_plan(step, |id| sampling.get(&id).cloned().unwrap_or_default());
        Some(PyBytes::new(py, &codec::encode(&plan)))
    }
}

// `Scheduler.__new__`'s text_signature spells these out.
const _: () = {
    assert!(DEFAULT_MAX_NUM_SEQS == 256);
    assert!(DEFAULT_MAX_NUM_BATCHED_TOKENS == 2048);
    assert!(DEFAULT_HOST_ADAPTER_BYTES == 4294967296);
    assert!(DEFAULT_PREFETCH_WINDOW == 64);
    assert!(DEFAULT_MAX_DELTAS == 3);
};

#[pymethods]
impl Scheduler {
    /// A scheduler over an empty queue and an all-free pool (`SchedulerConfig`; the router takes
    /// `block_size`, `num_blocks` and `max_model_len` from the worker's `Hello`).
    #[new]
    #[pyo3(signature = (
        block_size, num_blocks, max_model_len, *,
        max_num_seqs = DEFAULT_MAX_NUM_SEQS,
        max_num_batched_tokens = DEFAULT_MAX_NUM_BATCHED_TOKENS,
        host_adapter_bytes = DEFAULT_HOST_ADAPTER_BYTES,
        prefetch_window = DEFAULT_PREFETCH_WINDOW,
        max_deltas = DEFAULT_MAX_DELTAS,
        host_copy_reports = false,
        gpu_load_reports = false,
        delta_graph_tokens = 0,
        enable_prefix_caching = false,
    ),
    // The defaults spelled out for `help()` and stubtest (`...` otherwise); the asserts above
    // keep them equal to the constants (before `impl Scheduler`).
    text_signature = "(block_size, num_blocks, max_model_len, *, max_num_seqs=256, \
        max_num_batched_tokens=2048, host_adapter_bytes=4294967296, prefetch_window=64, \
        max_deltas=3, host_copy_reports=False, gpu_load_reports=False, \
        delta_graph_tokens=0, enable_prefix_caching=False)"
    )]
    #[allow(clippy::too_many_arguments)] // one keyword per config field
    fn new(
        py: Python<'_>,
        block_size: u32,
        num_blocks: u32,
        max_model_len: u32,
        max_num_seqs: usize,
        max_num_batched_tokens: usize,
        host_adapter_bytes: u64,
        prefetch_window: usize,
        max_deltas: usize,
        host_copy_reports: bool,
        gpu_load_reports: bool,
        delta_graph_tokens: usize,
        enable_prefix_caching: bool,
    ) -> PyResult<Self> {
        let cfg = SchedulerConfig {
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
            enable_prefix_caching,
        };
        let sched = deltaserve_sched::Scheduler::new(cfg).map_err(|e| sched_err(py, e))?;
        Ok(Scheduler {
            sched,
            sampling: HashMap::new(),
            outstanding: VecDeque::new(),
        })
    }

    /// Registers a variant in the disk tier ([`deltaserve_sched::Scheduler::register_adapter`]).
    fn register_adapter(
        &mut self,
        py: Python<'_>,
        adapter_id: u32,
        kind: &str,
        num_blocks: u32,
        host_bytes: u64,
        path: String,
    ) -> PyResult<()> {
        let kind = wire::VariantKind::from_label(kind).ok_or_else(|| {
            PyValueError::new_err(format!("kind must be 'lora' or 'delta', got {kind:?}"))
        })?;
        let spec = VariantSpec {
            kind: sched_kind(kind),
            num_blocks,
            host_bytes,
            path,
        };
        self.sched
            .register_adapter(adapter_id, spec)
            .map_err(|e| sched_err(py, e))
    }

    /// Forgets a variant no live request names; its drops go out with the next step.
    fn unregister_adapter(&mut self, py: Python<'_>, adapter_id: u32) -> PyResult<()> {
        self.sched
            .unregister_adapter(adapter_id)
            .map_err(|e| sched_err(py, e))
    }

    /// Queues a request ([`deltaserve_sched::Scheduler::add_request`]); `sampling` is the msgpack
    /// body of a wire `SamplingParams` (defaults when `None`).
    #[pyo3(signature = (
        req_id, prompt, max_tokens, *,
        arrival = 0, adapter_id = 0, eos_token_ids = Vec::new(), ignore_eos = false, sampling = None,
    ),
    text_signature = "($self, req_id, prompt, max_tokens, *, arrival=0, adapter_id=0, \
        eos_token_ids=(), ignore_eos=False, sampling=None)"
    )]
    #[allow(clippy::too_many_arguments)] // one keyword per request field
    fn add_request(
        &mut self,
        py: Python<'_>,
        req_id: u64,
        prompt: Vec<u32>,
        max_tokens: u32,
        arrival: u64,
        adapter_id: u32,
        eos_token_ids: Vec<u32>,
        ignore_eos: bool,
        sampling: Option<&[u8]>,
    ) -> PyResult<()> {
        let sampling: SamplingParams = match sampling {
            None => SamplingParams::default(),
            Some(body) => rmp_serde::from_slice(body).map_err(|e| {
                PyValueError::new_err(format!("sampling is not a SamplingParams body: {e}"))
            })?,
        };
        let req = SeqRequest {
            id: req_id,
            prompt,
            max_tokens,
            eos_token_ids,
            ignore_eos,
            arrival,
            adapter_id,
            // As the router's engine: prompt logprobs need every prompt position computed.
            skip_prefix_cache: sampling.prompt_logprobs.is_some(),
        };
        self.sched.add_request(req).map_err(|e| sched_err(py, e))?;
        self.sampling.insert(req_id, sampling);
        Ok(())
    }

    /// The next step as an encoded `StepPlan` frame, or `None` when nothing can run. Abandons an
    /// outstanding step (see [`deltaserve_sched::Scheduler::schedule`]); raises `ValueError`,
    /// changing nothing, while a step formed by `schedule_ahead` is outstanding.
    fn schedule<'py>(&mut self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyBytes>>> {
        if self.sched.outstanding_steps() > 1 {
            return Err(PyValueError::new_err(
                "schedule() while a step formed by schedule_ahead() is outstanding: update() the \
                 outstanding steps first (a step ahead cannot be taken back)",
            ));
        }
        self.outstanding.clear();
        let step = self.sched.schedule();
        Ok(self.send(py, step))
    }

    /// The step after the one outstanding, formed before its output
    /// ([`deltaserve_sched::Scheduler::schedule_ahead`]); `None` when it cannot be formed.
    fn schedule_ahead<'py>(&mut self, py: Python<'py>) -> Option<Bound<'py, PyBytes>> {
        let step = self.sched.schedule_ahead();
        self.send(py, step)
    }

    /// Applies an encoded `StepOutput` frame answering the oldest outstanding step, as the
    /// router does: its `host_ready` and `gpu_ready` first, then its sampled tokens. Returns the
    /// tokens appended, `(req_id, token, finish_reason)` with `"length"`, `"eos"` or `None`.
    fn update(&mut self, output: &[u8]) -> PyResult<Vec<(u64, u32, Option<&'static str>)>> {
        let out = match codec::decode_from_worker(output).map_err(frame_err)? {
            FromWorker::StepOutput(out) => out,
            other => {
                return Err(PyValueError::new_err(format!(
                    "update takes a StepOutput frame, got {other:?}"
                )))
            }
        };
        match self.outstanding.front() {
            Some(&oldest) if oldest == out.step_id => {}
            Some(&oldest) => {
                return Err(PyValueError::new_err(format!(
                    "the output answers step {} but the oldest outstanding step is {oldest}",
                    out.step_id
                )))
            }
            None => {
                return Err(PyValueError::new_err(format!(
                    "the output answers step {} but no step is outstanding",
                    out.step_id
                )))
            }
        }
        self.outstanding.pop_front();
        self.sched.host_copies_ready(&out.host_ready);
        self.sched.gpu_copies_ready(&out.gpu_ready);
        let sampled: Vec<(u64, Option<u32>)> =
            out.outputs.iter().map(|o| (o.req_id, o.token_id)).collect();
        let updates = self.sched.update(&sampled);
        Ok(updates
            .into_iter()
            .map(|u| {
                if u.finished.is_some() {
                    self.sampling.remove(&u.id);
                }
                (u.id, u.token, u.finished.map(|f| f.as_str()))
            })
            .collect())
    }

    /// The worker finished reading these variants' host copies; returns how many reads settled.
    fn host_copies_ready(&mut self, adapter_ids: Vec<u32>) -> usize {
        self.sched.host_copies_ready(&adapter_ids)
    }

    /// The worker finished copying these deltas onto the GPU; returns how many loads settled.
    fn gpu_copies_ready(&mut self, adapter_ids: Vec<u32>) -> usize {
        self.sched.gpu_copies_ready(&adapter_ids)
    }

    /// Ends a request (the client went away); its id goes out in the next step's `released`.
    fn abort(&mut self, req_id: u64) -> bool {
        self.sampling.remove(&req_id);
        self.sched.abort(req_id)
    }

    /// Ends a request for a reason the caller decided (a stop string); counted as finished.
    fn finish(&mut self, req_id: u64) -> bool {
        self.sampling.remove(&req_id);
        self.sched.finish(req_id)
    }

    /// The worker lost its state: every running request is requeued to be sent in full, every
    /// variant's residency forgotten. Returns the requeued ids, oldest first.
    fn reset_worker(&mut self) -> Vec<u64> {
        self.outstanding.clear();
        self.sched.reset_worker()
    }

    /// Whether the request is waiting or running.
    fn contains(&self, req_id: u64) -> bool {
        self.sched.contains(req_id)
    }

    /// Whether any request is waiting or running.
    fn has_unfinished(&self) -> bool {
        self.sched.has_unfinished()
    }

    /// The output tokens of a live request so far; `None` for an unknown one.
    fn output_tokens(&self, req_id: u64) -> Option<Vec<u32>> {
        self.sched.output_tokens(req_id).map(<[u32]>::to_vec)
    }

    /// The parent of a running skipper (DeltaZip's skip-the-line); `None` otherwise.
    fn skip_parent(&self, req_id: u64) -> Option<u64> {
        self.sched.skip_parent(req_id)
    }

    /// Live requests naming the variant; 0 for an unknown one.
    fn adapter_users(&self, adapter_id: u32) -> usize {
        self.sched.adapter_users(adapter_id)
    }

    /// `(on_host, gpu_blocks)` of a registered variant (`gpu_blocks` `None` off the GPU, empty
    /// for a delta in its slot); `None` for an unknown one.
    fn adapter_residency(&self, adapter_id: u32) -> Option<(bool, Option<Vec<u32>>)> {
        self.sched
            .adapter_residency(adapter_id)
            .map(|r| (r.on_host, r.gpu_blocks.map(<[u32]>::to_vec)))
    }

    /// The scheduler's counters ([`SchedStats`]) by field name.
    fn stats(&self) -> BTreeMap<&'static str, u64> {
        stats_by_name(self.sched.stats())
    }

    /// Raises `AssertionError` naming the first broken internal invariant (for tests).
    fn check_invariants(&self) -> PyResult<()> {
        self.sched
            .check_invariants()
            .map_err(PyAssertionError::new_err)
    }

    fn __repr__(&self) -> String {
        let s = self.sched.stats();
        format!(
            "Scheduler(waiting={}, running={}, free_blocks={}/{}, steps={})",
            s.waiting, s.running, s.free_blocks, s.total_blocks, s.steps
        )
    }
}

/// Every [`SchedStats`] counter by its field name. Destructured in full, so a new counter is a
/// compile error here until it is exposed.
fn stats_by_name(s: SchedStats) -> BTreeMap<&'static str, u64> {
    let SchedStats {
        waiting,
        running,
        free_blocks,
        used_blocks,
        total_blocks,
        num_preemptions,
        steps,
        pending_released,
        num_finished,
        num_aborted,
        adapters_registered,
        adapters_on_gpu,
        deltas_on_gpu,
        adapters_on_host,
        adapter_blocks,
        host_adapter_bytes,
        adapter_gpu_loads,
        adapter_host_loads,
        adapter_gpu_evictions,
        delta_skips,
        delta_skip_preemptions,
        host_deferrals,
        gpu_load_deferrals,
        prefix_queried_tokens,
        prefix_hit_tokens,
        prefix_cached_blocks,
        prefix_evicted_blocks,
        prefix_deferrals,
    } = s;
    BTreeMap::from([
        ("waiting", waiting as u64),
        ("running", running as u64),
        ("free_blocks", free_blocks.into()),
        ("used_blocks", used_blocks.into()),
        ("total_blocks", total_blocks.into()),
        ("num_preemptions", num_preemptions),
        ("steps", steps),
        ("pending_released", pending_released as u64),
        ("num_finished", num_finished),
        ("num_aborted", num_aborted),
        ("adapters_registered", adapters_registered as u64),
        ("adapters_on_gpu", adapters_on_gpu as u64),
        ("deltas_on_gpu", deltas_on_gpu as u64),
        ("adapters_on_host", adapters_on_host as u64),
        ("adapter_blocks", adapter_blocks.into()),
        ("host_adapter_bytes", host_adapter_bytes),
        ("adapter_gpu_loads", adapter_gpu_loads),
        ("adapter_host_loads", adapter_host_loads),
        ("adapter_gpu_evictions", adapter_gpu_evictions),
        ("delta_skips", delta_skips),
        ("delta_skip_preemptions", delta_skip_preemptions),
        ("host_deferrals", host_deferrals),
        ("gpu_load_deferrals", gpu_load_deferrals),
        ("prefix_queried_tokens", prefix_queried_tokens),
        ("prefix_hit_tokens", prefix_hit_tokens),
        ("prefix_cached_blocks", prefix_cached_blocks.into()),
        ("prefix_evicted_blocks", prefix_evicted_blocks),
        ("prefix_deferrals", prefix_deferrals),
    ])
}
