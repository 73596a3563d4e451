//! Scheduler ⇄ wire translation: a scheduled step as the worker's `StepPlan`, the scheduler's
//! adapter ops as wire `VariantOp`s, variant kinds both ways, and the scheduler's configuration
//! from the worker's Hello plus the operator's limits. Pure functions: no IO, no actor state.

use deltaserve_ipc::wire::{self, SamplingParams, StepPlan, TierOp};
use deltaserve_sched::{
    ScheduledStep, SchedulerConfig, VariantKind as SchedKind, VariantOp as SchedAdapterOp,
    VariantOpKind,
};

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
    }
}

/// The worker's plan for `step`, and the ids of the requests it schedules (new ones first).
/// `sampling` gives a request's sampling parameters, sent with it whenever it is sent in full.
pub(super) fn wire_plan(
    step: ScheduledStep,
    sampling: impl Fn(u64) -> SamplingParams,
) -> (StepPlan, Vec<u64>) {
    let mut ids = Vec::with_capacity(step.new.len() + step.running.len());
    let new_requests = step
        .new
        .into_iter()
        .map(|n| {
            ids.push(n.id);
            wire::NewRequest {
                req_id: n.id,
                token_ids: n.token_ids,
                num_prompt_tokens: n.num_prompt_tokens,
                num_computed_tokens: n.num_computed_tokens,
                num_scheduled_tokens: n.num_scheduled_tokens,
                block_ids: n.block_ids,
                sampling: sampling(n.id),
                adapter_id: n.adapter_id,
            }
        })
        .collect();
    let running = step
        .running
        .into_iter()
        .map(|r| {
            ids.push(r.id);
            wire::RunningRequest {
                req_id: r.id,
                num_scheduled_tokens: r.num_scheduled_tokens,
                new_block_ids: r.new_block_ids,
            }
        })
        .collect();
    let plan = StepPlan {
        step_id: step.step_id,
        new_requests,
        running,
        released: step.released,
        adapter_ops: step.adapter_ops.into_iter().map(wire_op).collect(),
    };
    (plan, ids)
}

/// The wire form of a scheduler's adapter op.
fn wire_op(op: SchedAdapterOp) -> wire::VariantOp {
    let (tier_op, path, block_ids, slot) = match op.kind {
        VariantOpKind::ToHost { path } => (TierOp::ToHost, path, Vec::new(), None),
        VariantOpKind::ToGpu { block_ids, slot } => (TierOp::ToGpu, String::new(), block_ids, slot),
        VariantOpKind::DropGpu => (TierOp::DropGpu, String::new(), Vec::new(), None),
        VariantOpKind::DropHost => (TierOp::DropHost, String::new(), Vec::new(), None),
    };
    wire::VariantOp {
        adapter_id: op.adapter_id,
        op: tier_op,
        path,
        block_ids,
        kind: wire_kind(op.variant),
        slot,
    }
}

/// The scheduler's kind of a wire (or API) variant kind.
pub(crate) fn sched_kind(kind: wire::VariantKind) -> SchedKind {
    match kind {
        wire::VariantKind::Lora => SchedKind::Lora,
        wire::VariantKind::Delta => SchedKind::Delta,
    }
}

/// The wire's kind of a scheduler variant kind.
pub(crate) fn wire_kind(kind: SchedKind) -> wire::VariantKind {
    match kind {
        SchedKind::Lora => wire::VariantKind::Lora,
        SchedKind::Delta => wire::VariantKind::Delta,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use deltaserve_sched::{ScheduledNew, ScheduledRunning};

    #[test]
    fn a_step_becomes_a_plan_with_new_requests_first() {
        let step = ScheduledStep {
            step_id: 4,
            new: vec![ScheduledNew {
                id: 7,
                token_ids: vec![1, 2, 3],
                num_prompt_tokens: 3,
                num_computed_tokens: 0,
                num_scheduled_tokens: 3,
                block_ids: vec![0],
                adapter_id: 2,
            }],
            running: vec![ScheduledRunning {
                id: 5,
                num_scheduled_tokens: 1,
                new_block_ids: vec![9],
            }],
            released: vec![3],
            preempted: vec![],
            adapter_ops: vec![
                SchedAdapterOp {
                    adapter_id: 2,
                    variant: SchedKind::Lora,
                    kind: VariantOpKind::ToHost { path: "/a".into() },
                },
                SchedAdapterOp {
                    adapter_id: 2,
                    variant: SchedKind::Lora,
                    kind: VariantOpKind::ToGpu {
                        block_ids: vec![1],
                        slot: None,
                    },
                },
                SchedAdapterOp {
                    adapter_id: 1,
                    variant: SchedKind::Delta,
                    kind: VariantOpKind::DropGpu,
                },
                SchedAdapterOp {
                    adapter_id: 3,
                    variant: SchedKind::Delta,
                    kind: VariantOpKind::ToGpu {
                        block_ids: vec![],
                        slot: Some(1),
                    },
                },
                SchedAdapterOp {
                    adapter_id: 1,
                    variant: SchedKind::Delta,
                    kind: VariantOpKind::DropHost,
                },
            ],
        };
        let (plan, ids) = wire_plan(step, |id| SamplingParams {
            seed: Some(id),
            ..Default::default()
        });
        assert_eq!(ids, vec![7, 5]);
        assert_eq!(plan.step_id, 4);
        assert_eq!(plan.new_requests[0].sampling.seed, Some(7));
        assert_eq!(plan.new_requests[0].adapter_id, 2);
        assert_eq!(plan.running[0].new_block_ids, vec![9]);
        assert_eq!(plan.released, vec![3]);
        let ops: Vec<(&str, &str, &[u32])> = plan
            .adapter_ops
            .iter()
            .map(|o| (o.op.label(), o.path.as_str(), o.block_ids.as_slice()))
            .collect();
        assert_eq!(
            ops,
            vec![
                ("to_host", "/a", &[][..]),
                ("to_gpu", "", &[1][..]),
                ("drop_gpu", "", &[][..]),
                ("to_gpu", "", &[][..]),
                ("drop_host", "", &[][..]),
            ]
        );
        let kinds: Vec<wire::VariantKind> = plan.adapter_ops.iter().map(|o| o.kind).collect();
        let (lora, delta) = (wire::VariantKind::Lora, wire::VariantKind::Delta);
        assert_eq!(
            kinds,
            [lora, lora, delta, delta, delta],
            "each op names its variant's kind"
        );
        let slots: Vec<Option<u32>> = plan.adapter_ops.iter().map(|o| o.slot).collect();
        assert_eq!(
            slots,
            [None, None, None, Some(1), None],
            "a delta's to_gpu names its slot"
        );
        for kind in wire::VariantKind::ALL {
            assert_eq!(wire_kind(sched_kind(*kind)), *kind);
        }
    }
}
