//! DeltaZip's skip-the-line for requests of deltas (compressed full fine-tunes), and the
//! parent-based preemption that keeps it starvation-free. Only deltas take part: base and LoRA
//! requests never skip, and with no delta running this code costs nothing.
//!
//! - Skip-the-line: FCFS admission picks at most `max_deltas` deltas; a delta with a running
//!   request admitted in FCFS order (a non-skipper) is *selected*. When FCFS admission stops
//!   because the head cannot be admitted (not on `max_num_seqs` or the token budget), the rest
//!   of the queue is scanned in order and every request of a selected delta is admitted if its
//!   first chunk fits the free pages (above the watermark), the budget and `max_num_seqs` (one
//!   that does not fit is passed over). Such a *skipper* rides on a *parent*, the oldest running
//!   non-skipper of its delta ([`Scheduler::skip_the_line`]).
//! - Parent-based preemption (no starvation): when a non-skipper leaves the running set
//!   (finished, aborted, preempted), its skippers move to the oldest running non-skipper of the
//!   same delta if one is left; otherwise they are orphaned ([`Scheduler::left_running`]), and
//!   the next `schedule` preempts every orphan first (pages freed, back into the queue at its
//!   arrival position, id in `released` and `preempted`, recomputed later) without stopping
//!   that step's admission ([`Scheduler::preempt_orphans`]); a request preempted so is not let
//!   skip again in that call. New non-skippers are admitted only in FCFS order, which the
//!   blocked head holds up, so the selected deltas' non-skippers only dwindle: they finish,
//!   their skippers are preempted, and the head gets its slot and its pages.
//!
//! The skip state of a running request of a delta (`Seq::skip`; waiting requests are always
//! `No`):
//!
//! ```text
//!  admitted FCFS ──▶ No (may be a parent)
//!  admitted past a blocked head ──▶ Parent(p) ──p leaves, another No of the delta runs──▶ Parent(q)
//!                                      │
//!                                      └──p leaves, none left──▶ Orphaned ──next schedule()──▶ preempted
//! ```

use std::collections::BTreeMap;

use crate::request::Phase;
use crate::scheduler::{Scheduler, StepDraft};

/// How a running request was admitted, for DeltaZip's skip-the-line (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Skip {
    /// Admitted in FCFS order (every waiting request is `No`). A running `No` request of a delta
    /// "selects" that delta: queued requests of it may skip the line, and it can be their parent.
    No,
    /// Admitted past a blocked queue head because its delta was selected; it rides on this
    /// parent, the oldest running `No` request of the same delta when it was (re)assigned.
    Parent(u64),
    /// Its parent left and no running `No` request of its delta remains: it is preempted at the
    /// start of the next `schedule`, so the skipped requests get their turn.
    Orphaned,
}

impl Scheduler {
    /// Phase 0: DeltaZip's parent-based preemption. Every orphaned skipper (its delta has no
    /// running non-skipper left) goes back into the queue at its arrival position, to be
    /// recomputed, so the requests it skipped get their turn:
    ///
    /// ```text
    /// for r in running with r.skip == Orphaned:
    ///     preempt r: pages freed, r -> waiting (arrival position), r -> released/preempted
    /// ```
    ///
    /// Not a sign of memory pressure: phase 2 still runs, but does not let them skip the line
    /// again in this call. Returns their ids, oldest first.
    pub(crate) fn preempt_orphans(&mut self) -> Vec<u64> {
        if self.num_orphans == 0 {
            return Vec::new();
        }
        let orphans: Vec<u64> = self
            .running
            .iter()
            .map(|&(_, id)| id)
            .filter(|id| self.seqs[id].skip == Skip::Orphaned)
            .collect();
        for &id in &orphans {
            self.preempt(id);
        }
        self.num_preemptions += orphans.len() as u64;
        self.delta_skip_preemptions += orphans.len() as u64;
        debug_assert_eq!(self.num_orphans, 0, "every orphan was preempted");
        orphans
    }

    /// The end of phase 2, once FCFS admission stopped at a head it cannot admit:
    ///
    /// ```text
    /// selected = deltas with a running non-skipper, each with its oldest one (the parent)
    /// for w in waiting[1..] (queue order) of a selected delta, not preempted in phase 0:
    ///     stop if running == max_num_seqs or budget == 0
    ///     n = min(len(w.tokens) - prefix hits, budget)    # no skip while its prefix is pending
    ///     if its pages + watermark <= free pages:
    ///         admit w (sent in `new`), w.skip = Parent(parent of w.delta), budget -= n
    /// ```
    ///
    /// A request that does not fit is passed over, and the scan goes on. A skipper's delta is
    /// already resident, so it needs no adapter op; and since it runs, it is not loading ahead
    /// (`gpu_load_reports`: admitting a request clears that mark, and a resident delta is not
    /// loaded again), so no skipper's step waits for a delta copy. `not_again` (skippers preempted in this
    /// call) are left for FCFS admission.
    pub(crate) fn skip_the_line(&mut self, draft: &mut StepDraft, not_again: &[u64]) {
        if self.adapters.num_deltas_on_gpu() == 0 {
            return; // no delta runs (the common LoRA-only case costs nothing)
        }
        // Selected deltas, each with the oldest running non-skipper (its skippers' parent).
        let mut parents: BTreeMap<u32, u64> = BTreeMap::new();
        for &(_, id) in &self.running {
            let seq = &self.seqs[&id];
            if seq.skip == Skip::No && self.adapters.is_delta(seq.adapter_id) {
                parents.entry(seq.adapter_id).or_insert(id);
            }
        }
        if parents.is_empty() {
            return;
        }
        // The waiting requests of the selected deltas, in queue order; the scan ends once it has
        // seen all of them (their adapters count them), so it rarely walks the whole queue.
        let mut unseen: usize = parents
            .keys()
            .map(|&d| {
                let a = self.adapters.get(d);
                a.users - a.running
            })
            .sum();
        let mut candidates = Vec::new();
        for (pos, &(key, id)) in self.waiting.iter().enumerate() {
            if unseen == 0 {
                break;
            }
            if !parents.contains_key(&self.seqs[&id].adapter_id) {
                continue;
            }
            unseen -= 1;
            // The head is the request FCFS could not admit.
            if pos > 0 && !not_again.contains(&id) {
                candidates.push((key, id));
            }
        }
        let mut admitted = false;
        for (key, id) in candidates {
            if self.running.len() >= self.cfg.max_num_seqs || draft.budget == 0 {
                break;
            }
            let delta = self.seqs[&id].adapter_id;
            let budget = self.prompt_budget(draft, true);
            if budget == 0 {
                break;
            }
            let Some(prefix) = self.plan_prefix(id, budget) else {
                continue; // its next prefix page is being computed: it waits for it
            };
            if prefix.pages + draft.watermark > self.blocks.num_free() as u64 {
                continue;
            }
            self.take_prefix(id, &prefix.hits);
            draft.watermark += self.admit(key, id, prefix.hits, prefix.n, &mut draft.step);
            draft.budget -= prefix.n as usize;
            self.seqs.get_mut(&id).expect("admitted ids are live").skip =
                Skip::Parent(parents[&delta]);
            self.num_skippers += 1;
            self.delta_skips += 1;
            admitted = true;
        }
        if admitted {
            let seqs = &self.seqs;
            self.waiting
                .retain(|(_, id)| seqs[id].phase == Phase::Waiting);
        }
    }

    /// Skip-the-line bookkeeping once running request `id` (of `adapter_id`, in `skip`) has left
    /// `running` (finished, aborted or preempted). A skipper only leaves the counts. A
    /// non-skipper's skippers move to the oldest running non-skipper of the same delta, or,
    /// when none is left, are orphaned: the next `schedule` preempts them.
    pub(crate) fn left_running(&mut self, id: u64, adapter_id: u32, skip: Skip) {
        match skip {
            Skip::Parent(_) => self.num_skippers -= 1,
            Skip::Orphaned => {
                self.num_skippers -= 1;
                self.num_orphans -= 1;
            }
            Skip::No => {
                if self.num_skippers == 0 || adapter_id == 0 {
                    return;
                }
                let children: Vec<u64> = self
                    .running
                    .iter()
                    .map(|&(_, r)| r)
                    .filter(|r| self.seqs[r].skip == Skip::Parent(id))
                    .collect();
                if children.is_empty() {
                    return;
                }
                let heir = self.running.iter().map(|&(_, r)| r).find(|r| {
                    let seq = &self.seqs[r];
                    seq.adapter_id == adapter_id && seq.skip == Skip::No
                });
                let next = match heir {
                    Some(h) => Skip::Parent(h),
                    None => {
                        self.num_orphans += children.len();
                        Skip::Orphaned
                    }
                };
                for c in children {
                    self.seqs.get_mut(&c).expect("running ids are live").skip = next;
                }
            }
        }
    }
}
