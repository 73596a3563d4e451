//! The engine's side of scheduler ⇄ wire: the scheduler's configuration from the worker's Hello
//! plus the operator's limits, and a step as the plan sent with the ids it schedules. The
//! translation itself is the scheduler crate's (`deltaserve_sched::wire`, shared with the Python
//! binding). Pure functions: no IO, no actor state.

use deltaserve_ipc::wire::{SamplingParams, StepPlan};
pub(crate) use deltaserve_sched::wire::sched_kind;
use deltaserve_sched::wire::step_plan;
use deltaserve_sched::{ScheduledStep, SchedulerConfig};

use crate::worker::WorkerProcess;

/// Scheduler limits that do not come from the worker.
#[derive(Debug, Clone)]
pub struct SchedLimits {
    /// Most requests running in one step.
    pub max_num_seqs: usize,
    /// Token budget of one step.
    pub max_num_batched_tokens: usize,
    /// Host-memory budget for adapter copies on each worker (LoRA adapters and deltas share it).
    pub host_adapter_bytes: u64,
    /// Deltas a worker may hold on the GPU at once (its `--max-deltas` slots).
    pub max_deltas: usize,
    /// Send step N+1 before step N's output is back (see "Overlapped steps" in `actor.rs`).
    pub overlap_steps: bool,
    /// Admission control's SLOs (`--ttft-slo-ms`, `--tpot-slo-ms`; see `admission.rs`).
    pub slo: super::admission::Slo,
    /// Reuse cached KV pages of prompt prefixes per variant (`--enable-prefix-caching`).
    pub enable_prefix_caching: bool,
}

/// Scheduler configuration from what the worker reported plus the operator's limits.
pub(super) fn sched_config(worker: &WorkerProcess, limits: &SchedLimits) -> SchedulerConfig {
    SchedulerConfig {
        block_size: worker.hello.kv.block_size,
        num_blocks: worker.hello.kv.num_blocks,
        max_num_seqs: limits.max_num_seqs,
        max_num_batched_tokens: limits.max_num_batched_tokens,
        max_model_len: worker.hello.model.max_model_len,
        host_adapter_bytes: limits.host_adapter_bytes,
        prefetch_window: deltaserve_sched::DEFAULT_PREFETCH_WINDOW,
        max_deltas: limits.max_deltas,
        host_copy_reports: true,
        gpu_load_reports: true,
        delta_graph_tokens: worker.hello.delta_graph_tokens as usize,
        enable_prefix_caching: limits.enable_prefix_caching,
    }
}

/// The worker's plan for `step` (the scheduler's translation, `deltaserve_sched::wire`), and the
/// ids of the requests it schedules (new ones first). `sampling` gives a request's sampling
/// parameters, sent with it whenever it is sent in full.
pub(super) fn wire_plan(
    step: ScheduledStep,
    sampling: impl Fn(u64) -> SamplingParams,
) -> (StepPlan, Vec<u64>) {
    let plan = step_plan(step, sampling);
    let new = plan.new_requests.iter().map(|n| n.req_id);
    let ids = new.chain(plan.running.iter().map(|r| r.req_id)).collect();
    (plan, ids)
}

#[cfg(test)]
mod tests {
    use super::*;
    use deltaserve_sched::{ScheduledNew, ScheduledRunning};

    #[test]
    fn the_ids_are_the_new_requests_then_the_running_ones() {
        let new = |id| ScheduledNew {
            id,
            token_ids: vec![1],
            num_prompt_tokens: 1,
            num_computed_tokens: 0,
            num_scheduled_tokens: 1,
            block_ids: vec![0],
            adapter_id: 0,
        };
        let step = ScheduledStep {
            step_id: 4,
            new: vec![new(7), new(2)],
            running: vec![ScheduledRunning {
                id: 5,
                num_scheduled_tokens: 1,
                new_block_ids: vec![9],
            }],
            ..ScheduledStep::default()
        };
        let (plan, ids) = wire_plan(step, |_| SamplingParams::default());
        assert_eq!(ids, vec![7, 2, 5]);
        assert_eq!(plan.step_id, 4);
    }
}
