//! The two queues, both sorted by [`OrderKey`]: `waiting` (admission takes the front) and
//! `running` (preemption victims come off the back). Ordered inserts, taking a request out
//! ([`Scheduler::remove`]), recompute preemption ([`Scheduler::preempt`]), and phase 1 of a
//! step, which walks the running queue oldest first and preempts from its back when pages run
//! out ([`Scheduler::schedule_running`]).

use std::collections::VecDeque;

use crate::block::PageOwner;
use crate::inflight::{record_chunk, Chunk};
use crate::request::{OrderKey, Phase, Seq};
use crate::scheduler::{Scheduler, StepDraft};
use crate::skip_line::Skip;
use crate::step::ScheduledRunning;

impl Scheduler {
    /// Phase 1: the requests already on the worker, oldest first.
    ///
    /// ```text
    /// for r in running (arrival order):
    ///     n = min(len(r.tokens) - r.num_computed, budget)      # 1 in decode, a chunk in prefill
    ///                                           # (a chunk: within prompt_budget, not budget)
    ///     while pages for r.num_computed + n are not free:
    ///         if a LoRA adapter on the GPU has no running request: evict the LRU one (DropGpu)
    ///         else preempt the most recently arrived running request v   # free pages,
    ///         (v -> front of waiting, v -> released/preempted)  # computed = 0, recompute later
    ///         if v is r: stop phase 1
    ///     allocate, schedule r for n tokens, budget -= n
    /// ```
    ///
    /// With a step outstanding (`ahead`), a chunk starts where that step's ends and counts its
    /// pending token (see `inflight.rs`); `schedule_ahead` checked that no preemption is
    /// needed. Every running request, scheduled or not, adds to the draft's watermark when its
    /// next token needs a page it does not hold. Returns whether it preempted for pages (then
    /// phase 2 admits nothing: admitting now would only thrash).
    pub(crate) fn schedule_running(&mut self, draft: &mut StepDraft, ahead: bool) -> bool {
        let bs = self.cfg.block_size;
        let mut memory_preempted = false;
        let mut i = 0;
        while i < self.running.len() {
            let id = self.running[i].1;
            let seq = &self.seqs[&id];
            debug_assert!(
                seq.to_schedule() >= 1 || ahead,
                "running request {id} has nothing left to compute"
            );
            let decode = seq.to_schedule() == 1;
            let budget = if decode {
                draft.budget
            } else {
                self.prompt_budget(draft, self.adapters.is_delta(seq.adapter_id))
            };
            let (n, need) = self.next_chunk(seq, budget);
            if decode {
                draft.decodes_ahead = draft.decodes_ahead.saturating_sub(1); // 0 without a limit
            }
            if n == 0 {
                // Out of budget, or (ahead) done unless its outstanding token ends it: it stays
                // on the worker, unscheduled, and keeps its pages.
                let seq = &self.seqs[&id];
                draft.watermark += u64::from(
                    (seq.blocks.len() as u64) * (bs as u64) < seq.scheduled_to() as u64 + 1,
                );
                i += 1;
                continue;
            }
            debug_assert!(
                !ahead || self.blocks.num_free() >= need,
                "schedule_ahead checked that phase 1 needs no preemption"
            );
            let mut preempted_self = false;
            while self.blocks.num_free() < need {
                // Cached adapters nobody runs with go before any request is preempted.
                if let Some(idle) = self.adapters.lru_idle_gpu(0) {
                    self.adapters
                        .evict_gpu(idle, &mut self.blocks, &mut draft.ops);
                    continue;
                }
                let victim = self
                    .running
                    .last()
                    .expect("request `id` itself is running")
                    .1;
                self.preempt(victim);
                self.num_preemptions += 1;
                draft.step.preempted.push(victim);
                memory_preempted = true;
                if victim == id {
                    preempted_self = true;
                    break;
                }
            }
            if preempted_self {
                // It was the last running request, so phase 1 is over.
                break;
            }
            let seq = self.seqs.get_mut(&id).expect("running ids are live");
            let mut new_block_ids = Vec::new();
            let ok = self
                .blocks
                .allocate(PageOwner::Request(id), need, &mut new_block_ids);
            debug_assert!(ok, "enough pages were freed above");
            seq.blocks.extend_from_slice(&new_block_ids);
            let target = seq.scheduled_to() + n;
            let samples = target == seq.tokens.len() as u32 + seq.pending;
            seq.num_cached = seq.num_cached.max(target);
            seq.in_flight += n;
            seq.pending += u32::from(samples);
            draft.watermark +=
                u64::from((seq.blocks.len() as u64) * (bs as u64) < target as u64 + 1);
            draft.budget -= n as usize;
            record_chunk(&mut self.outstanding, Chunk { id, n, samples });
            draft.running_adapters.push(seq.adapter_id);
            draft.step.running.push(ScheduledRunning {
                id,
                num_scheduled_tokens: n,
                new_block_ids,
            });
            i += 1;
        }
        memory_preempted
    }

    /// Running request `seq`'s next chunk within `budget` tokens: its length (0 when it has
    /// nothing to compute or the budget is spent) and the pages it needs beyond those it holds.
    pub(crate) fn next_chunk(&self, seq: &Seq, budget: usize) -> (u32, u32) {
        let n = (seq.to_schedule() as usize).min(budget) as u32;
        let need = self
            .cfg
            .blocks_for((seq.scheduled_to() + n) as u64)
            .saturating_sub(seq.blocks.len() as u64) as u32;
        (n, need)
    }

    /// Takes a request out of the queues and frees its pages (cached ones lose its reference);
    /// a running one is queued for release. Returns whether it existed.
    pub(crate) fn remove(&mut self, id: u64) -> bool {
        let Some(mut seq) = self.seqs.remove(&id) else {
            return false;
        };
        match seq.phase {
            Phase::Waiting => {
                let pos = self
                    .waiting
                    .binary_search_by_key(&seq.key, |&(k, _)| k)
                    .expect("waiting request is queued");
                self.waiting.remove(pos);
            }
            Phase::Running => {
                let pos = self
                    .running
                    .binary_search_by_key(&seq.key, |&(k, _)| k)
                    .expect("running request is queued");
                self.running.remove(pos);
                self.blocks.release(PageOwner::Request(id), &seq.blocks);
                seq.drop_pending(&mut self.pending);
                self.pending_released.push(id);
                if seq.adapter_id != 0 {
                    self.adapters.stop_running(seq.adapter_id);
                }
                self.left_running(id, seq.adapter_id, seq.skip);
                self.forget_outstanding(id);
            }
        }
        if seq.adapter_id != 0 {
            self.adapters.remove_user(seq.adapter_id);
        }
        true
    }

    /// Preempts running request `id` (the last one for recompute preemption, any one for an
    /// orphaned skipper): frees its pages (its published ones stay cached, so it may hit them
    /// when admitted again), resets it for recomputation and puts it back in the
    /// waiting queue at its arrival position (the front, unless a request with an earlier
    /// arrival stamp was added since), no longer a skipper. Its adapter loses a running user
    /// but stays cached until evicted; its skippers, if any, are re-parented or orphaned.
    pub(crate) fn preempt(&mut self, id: u64) {
        let seq = self.seqs.get_mut(&id).expect("running ids are live");
        debug_assert_eq!(seq.phase, Phase::Running, "preempt of waiting request {id}");
        let key = seq.key;
        let pos = if self.running.last().is_some_and(|&(_, last)| last == id) {
            self.running.len() - 1
        } else {
            self.running
                .binary_search_by_key(&key, |&(k, _)| k)
                .expect("running request is queued")
        };
        self.running.remove(pos);
        self.blocks.release(PageOwner::Request(id), &seq.blocks);
        seq.drop_pending(&mut self.pending);
        if seq.adapter_id != 0 {
            self.adapters.stop_running(seq.adapter_id);
        }
        seq.blocks.clear();
        seq.num_computed = 0;
        seq.num_cached = 0;
        seq.in_flight = 0;
        seq.pending = 0;
        seq.phase = Phase::Waiting;
        let (adapter_id, skip) = (seq.adapter_id, std::mem::replace(&mut seq.skip, Skip::No));
        insert_sorted_deque(&mut self.waiting, key, id);
        self.pending_released.push(id);
        self.left_running(id, adapter_id, skip);
        self.forget_outstanding(id);
    }
}

/// Inserts into a deque sorted by key (O(1) at either end, the common cases).
pub(crate) fn insert_sorted_deque(q: &mut VecDeque<(OrderKey, u64)>, key: OrderKey, id: u64) {
    let pos = q.partition_point(|&(k, _)| k < key);
    q.insert(pos, (key, id));
}

/// Inserts into a vec sorted by key (O(1) when appending, the common case).
pub(crate) fn insert_sorted_vec(v: &mut Vec<(OrderKey, u64)>, key: OrderKey, id: u64) {
    if v.last().is_none_or(|&(k, _)| k < key) {
        v.push((key, id));
    } else {
        let pos = v.partition_point(|&(k, _)| k < key);
        v.insert(pos, (key, id));
    }
}
