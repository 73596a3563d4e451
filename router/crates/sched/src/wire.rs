//! Scheduler -> wire translation (feature `wire`), the one copy that both the router's engine
//! (`server/src/engine/plan.rs`) and the Python binding (`py/src/scheduler.rs`) use, so a plan
//! from `_native.Scheduler` is the plan the router sends: a [`ScheduledStep`] as the worker's
//! `StepPlan`, the scheduler's variant ops as wire `VariantOp`s, and variant kinds both ways.
//! Pure functions.

use deltaserve_ipc::wire::{self, SamplingParams, StepPlan, TierOp};

use crate::step::ScheduledStep;
use crate::variants::{VariantKind, VariantOp, VariantOpKind};

/// The worker's plan for `step`: new requests (sent in full, with `sampling`'s parameters for
/// each), running ones (only their appended pages), releases and variant ops, in the
/// scheduler's order.
pub fn step_plan(step: ScheduledStep, sampling: impl Fn(u64) -> SamplingParams) -> StepPlan {
    let new_requests = step
        .new
        .into_iter()
        .map(|n| wire::NewRequest {
            req_id: n.id,
            token_ids: n.token_ids,
            num_prompt_tokens: n.num_prompt_tokens,
            num_computed_tokens: n.num_computed_tokens,
            num_scheduled_tokens: n.num_scheduled_tokens,
            block_ids: n.block_ids,
            sampling: sampling(n.id),
            adapter_id: n.adapter_id,
        })
        .collect();
    let running = step
        .running
        .into_iter()
        .map(|r| wire::RunningRequest {
            req_id: r.id,
            num_scheduled_tokens: r.num_scheduled_tokens,
            new_block_ids: r.new_block_ids,
        })
        .collect();
    StepPlan {
        step_id: step.step_id,
        new_requests,
        running,
        released: step.released,
        adapter_ops: step.adapter_ops.into_iter().map(wire_op).collect(),
    }
}

/// The wire form of a scheduler's variant op.
pub fn wire_op(op: VariantOp) -> wire::VariantOp {
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
pub fn sched_kind(kind: wire::VariantKind) -> VariantKind {
    match kind {
        wire::VariantKind::Lora => VariantKind::Lora,
        wire::VariantKind::Delta => VariantKind::Delta,
    }
}

/// The wire's kind of a scheduler variant kind.
pub fn wire_kind(kind: VariantKind) -> wire::VariantKind {
    match kind {
        VariantKind::Lora => wire::VariantKind::Lora,
        VariantKind::Delta => wire::VariantKind::Delta,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::step::{ScheduledNew, ScheduledRunning};

    #[test]
    fn a_step_becomes_the_plan_the_worker_runs() {
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
                VariantOp {
                    adapter_id: 2,
                    variant: VariantKind::Lora,
                    kind: VariantOpKind::ToHost { path: "/a".into() },
                },
                VariantOp {
                    adapter_id: 2,
                    variant: VariantKind::Lora,
                    kind: VariantOpKind::ToGpu {
                        block_ids: vec![1],
                        slot: None,
                    },
                },
                VariantOp {
                    adapter_id: 1,
                    variant: VariantKind::Delta,
                    kind: VariantOpKind::DropGpu,
                },
                VariantOp {
                    adapter_id: 3,
                    variant: VariantKind::Delta,
                    kind: VariantOpKind::ToGpu {
                        block_ids: vec![],
                        slot: Some(1),
                    },
                },
                VariantOp {
                    adapter_id: 1,
                    variant: VariantKind::Delta,
                    kind: VariantOpKind::DropHost,
                },
            ],
        };
        let plan = step_plan(step, |id| SamplingParams {
            seed: Some(id),
            ..Default::default()
        });
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
