//! Steps in flight: what each outstanding step (sent, no `update` yet) scheduled ([`Chunk`]s in
//! `Scheduler::outstanding`, oldest first), forming a second step behind the first
//! ([`Scheduler::schedule_ahead`]), and applying the worker's results to the oldest one
//! ([`Scheduler::update`]).
//!
//! # Overlapped steps
//!
//! With one step outstanding, [`Scheduler::schedule_ahead`] forms the next one so the worker
//! can launch it behind the first. A request the outstanding step samples for has one
//! *pending* token: known to exist, not yet known. Phase 1 schedules it for that token (the
//! chunk starts where the outstanding one ends, `num_computed + in_flight`), unless the pending
//! token is its last (`outputs + pending == max_tokens`); the worker feeds the token from its
//! own copy of the sample. A request that the pending token ends (EOS) is thus computed once
//! more for nothing; `update` drops that chunk with the request, and its pages, freed then, are
//! handed out only in a later step, which the worker runs after. Refused (an empty step,
//! nothing changed) when it would have to preempt, for pages or for orphaned skippers:
//! preemption waits for the `update`. `update` always applies the oldest outstanding step; a
//! token that does not come although a later step computes past it preempts its request
//! (recomputed later).

use std::collections::{BTreeMap, VecDeque};

use crate::block::PageOwner;
use crate::scheduler::Scheduler;
use crate::skip_line::Skip;
use crate::step::{FinishReason, ScheduledStep, SeqUpdate};

/// One request's part of an outstanding step.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Chunk {
    /// The request.
    pub(crate) id: u64,
    /// Tokens scheduled.
    pub(crate) n: u32,
    /// Whether the chunk reaches the end of the known tokens, so the worker samples one.
    pub(crate) samples: bool,
}

impl Scheduler {
    /// Forms the step after the one outstanding step, before its `update` (see "Overlapped
    /// steps" above): every request that step samples for is scheduled for that token, unknown
    /// yet, unless it has reached `max_tokens` with it. Returns an empty step, changing
    /// nothing, unless exactly one step is outstanding, and when the step would have to
    /// preempt: for pages (phase 1 needs more than the free pages) or orphaned skippers; the
    /// caller then waits for the `update` and calls [`Scheduler::schedule`].
    pub fn schedule_ahead(&mut self) -> ScheduledStep {
        if self.outstanding.len() != 1 || self.num_orphans > 0 || !self.running_fit_free_pages() {
            return ScheduledStep::default();
        }
        self.form_step(true)
    }

    /// Whether phase 1 of the next step finds every page it needs free (no eviction, no
    /// preemption).
    fn running_fit_free_pages(&self) -> bool {
        let mut budget = self.cfg.max_num_batched_tokens;
        let mut need: u64 = 0;
        for &(_, id) in &self.running {
            let (n, pages) = self.next_chunk(&self.seqs[&id], budget);
            budget -= n as usize;
            need += u64::from(pages);
        }
        need <= self.blocks.num_free() as u64
    }

    /// Applies the worker's results for the oldest outstanding step (the one [`Scheduler::schedule`]
    /// returned, then the one [`Scheduler::schedule_ahead`] returned): `(id, Some(token))` when
    /// the step computed a request to the end of its known tokens (the token is appended; the
    /// request finishes on an EOS id unless `ignore_eos`, checked first, or at `max_tokens`,
    /// freeing its pages at once while its adapter stays cached), `(id, None)` for a partial
    /// prefill chunk (its computed count advances). With prefix caching, every page whose
    /// tokens are now all computed is published (`prefix.rs`), before a finished request's
    /// pages are released.
    ///
    /// Tolerated, for robustness: ids not in that step (aborted or finished since, or unknown)
    /// and repeated ids are ignored; a token for a partial chunk is ignored; a scheduled request
    /// with no output, or with `None` where a token was due, is not advanced and is scheduled
    /// again from the same point (the worker overwrites those cache slots), or, when a later
    /// outstanding step already computes past it, preempted (recomputed later). An update with
    /// no step outstanding changes nothing.
    pub fn update(&mut self, outputs: &[(u64, Option<u32>)]) -> Vec<SeqUpdate> {
        let Some(chunks) = self.outstanding.pop_front() else {
            return Vec::new();
        };
        let mut unanswered: BTreeMap<u64, Chunk> = chunks.into_iter().map(|c| (c.id, c)).collect();
        let mut updates = Vec::with_capacity(outputs.len());
        // Finished requests: (id, adapter, skip state), for their skippers once all are gone.
        let mut finished_ids: Vec<(u64, u32, Skip)> = Vec::new();
        // Requests whose token never came although a later outstanding step builds on it.
        let mut lost: Vec<u64> = Vec::new();
        // In the worker's order; then the step's requests it did not answer, with no token.
        let answers = outputs
            .iter()
            .copied()
            .map(Some)
            .chain(std::iter::repeat(None));
        for answer in answers {
            let (chunk, token) = match answer {
                Some((id, token)) => match unanswered.remove(&id) {
                    Some(chunk) => (chunk, token),
                    None => continue, // not in this step, or repeated
                },
                None => match unanswered.pop_first() {
                    Some((_, chunk)) => (chunk, None),
                    None => break,
                },
            };
            let Some(seq) = self.seqs.get_mut(&chunk.id) else {
                continue;
            };
            seq.in_flight -= chunk.n;
            seq.pending -= u32::from(chunk.samples);
            let answered = answer.is_some();
            let bs = self.cfg.block_size;
            if !chunk.samples && answered {
                seq.num_computed += chunk.n; // a partial chunk: any token is ignored
                seq.publish_computed(chunk.id, bs, &mut self.blocks, &mut self.pending);
                continue;
            }
            let Some(token) = token.filter(|_| chunk.samples) else {
                if seq.in_flight > 0 {
                    lost.push(chunk.id);
                }
                continue;
            };
            seq.num_computed += chunk.n;
            seq.tokens.push(token);
            seq.publish_computed(chunk.id, bs, &mut self.blocks, &mut self.pending);
            let finished = if !seq.ignore_eos && seq.eos_token_ids.contains(&token) {
                Some(FinishReason::Eos)
            } else if seq.num_outputs() >= seq.max_tokens {
                Some(FinishReason::Length)
            } else {
                None
            };
            if finished.is_some() {
                self.blocks
                    .release(PageOwner::Request(chunk.id), &seq.blocks);
                seq.drop_pending(&mut self.pending);
                if seq.adapter_id != 0 {
                    self.adapters.stop_running(seq.adapter_id);
                    self.adapters.remove_user(seq.adapter_id);
                }
                finished_ids.push((chunk.id, seq.adapter_id, seq.skip));
                self.seqs.remove(&chunk.id);
                self.pending_released.push(chunk.id);
                self.num_finished += 1;
            }
            updates.push(SeqUpdate {
                id: chunk.id,
                token,
                finished,
            });
        }
        if !finished_ids.is_empty() {
            let seqs = &self.seqs;
            self.running.retain(|(_, id)| seqs.contains_key(id));
            for (id, adapter_id, skip) in finished_ids {
                self.left_running(id, adapter_id, skip);
                self.forget_outstanding(id);
            }
        }
        for id in lost {
            self.preempt(id);
            self.num_preemptions += 1;
        }
        updates
    }

    /// Drops `id`'s chunks from the outstanding steps: it left the running set (preempted,
    /// finished, aborted), so their outputs mean nothing now, even if the id comes back.
    pub(crate) fn forget_outstanding(&mut self, id: u64) {
        for chunks in &mut self.outstanding {
            chunks.retain(|c| c.id != id);
        }
    }

    /// Forgets what the outstanding steps scheduled.
    pub(crate) fn clear_in_flight(&mut self) {
        for chunk in self.outstanding.drain(..).flatten() {
            if let Some(seq) = self.seqs.get_mut(&chunk.id) {
                seq.in_flight = 0;
                seq.pending = 0;
            }
        }
    }
}

/// Adds `chunk` to the step being formed (the newest of the `outstanding` steps; a field, not
/// `&mut Scheduler`, so phase 1 can call it while it holds a request).
pub(crate) fn record_chunk(outstanding: &mut VecDeque<Vec<Chunk>>, chunk: Chunk) {
    outstanding
        .back_mut()
        .expect("form_step pushed this step's chunks")
        .push(chunk);
}
