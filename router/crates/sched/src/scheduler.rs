//! [`Scheduler`]: request queues, per-request KV block tables, and the step algorithm
//! (see the crate docs for the algorithm and the worker-side contract).
//!
//! Request life cycle (`Seq::phase`):
//!
//! ```text
//!  add_request ──▶ Waiting ──admit (phase 2)──▶ Running ──EOS / max_tokens / finish / abort──▶ gone
//!                     ▲                            │           (pages freed, id -> released)
//!                     └────── preempt (phase 1) ───┘
//!                        pages freed, num_computed = 0, id -> released; resent in full later
//! ```

use std::collections::{BTreeMap, VecDeque};

use crate::block::BlockAllocator;
use crate::config::SchedulerConfig;
use crate::error::SchedError;
use crate::step::{
    FinishReason, SchedStats, ScheduledNew, ScheduledRunning, ScheduledStep, SeqRequest, SeqUpdate,
};

/// Position of a request in every queue: earlier arrival first, ties by `add_request` order.
/// Unique per request, so queues sorted by it have one well-defined order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct OrderKey {
    /// The caller's arrival stamp.
    arrival: u64,
    /// Counter of `add_request` calls, to break ties deterministically.
    seq_no: u64,
}

/// Where a live request is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// In `waiting`: owns no pages, not on the worker.
    Waiting,
    /// In `running`: on the worker, owns the pages of its block table.
    Running,
}

/// Everything the scheduler tracks about one live request.
#[derive(Debug, Clone)]
struct Seq {
    /// Its place in the queues.
    key: OrderKey,
    /// `prompt ++ outputs`: what a resumed request recomputes, and what `new` entries carry.
    tokens: Vec<u32>,
    /// Length of the prompt at the front of `tokens`.
    num_prompt_tokens: u32,
    /// Output limit (finish with `Length`).
    max_tokens: u32,
    /// Ids that finish the request with `Eos`.
    eos_token_ids: Vec<u32>,
    /// Ignore `eos_token_ids` (always run to `max_tokens`).
    ignore_eos: bool,
    /// Leading tokens whose KV the worker has computed (confirmed by an `update`).
    num_computed: u32,
    /// Token positions the block table covers: the furthest any scheduled chunk reached since
    /// the request was (re)admitted. Pages owned == ceil(num_cached / block_size).
    num_cached: u32,
    /// Page ids, in order: page i holds tokens `[i * block_size, (i + 1) * block_size)`.
    blocks: Vec<u32>,
    /// Which queue it is in.
    phase: Phase,
    /// Tokens scheduled in the outstanding step (0 when not part of it); `update` applies them.
    in_flight: u32,
}

impl Seq {
    /// Output tokens generated so far.
    fn num_outputs(&self) -> u32 {
        self.tokens.len() as u32 - self.num_prompt_tokens
    }
}

/// The pure iteration-level scheduler: owns the queues, the page pool and every block table.
/// Deterministic: the same sequence of calls yields the same plans.
#[derive(Debug, Clone)]
pub struct Scheduler {
    /// Limits (validated).
    cfg: SchedulerConfig,
    /// The KV page pool.
    blocks: BlockAllocator,
    /// Every live (waiting or running) request by id.
    seqs: BTreeMap<u64, Seq>,
    /// Requests not on the worker, sorted by `OrderKey`; admission takes the front.
    waiting: VecDeque<(OrderKey, u64)>,
    /// Requests on the worker, sorted by `OrderKey`; preemption victims come off the back.
    running: Vec<(OrderKey, u64)>,
    /// Ids to put in the next non-empty step's `released`.
    pending_released: Vec<u64>,
    /// Ids scheduled in the outstanding step (the last `schedule` not yet followed by `update`).
    in_flight: Vec<u64>,
    /// Next `OrderKey::seq_no`.
    next_seq_no: u64,
    /// Non-empty steps formed; the last one's `step_id`.
    steps: u64,
    /// Preemptions since start.
    num_preemptions: u64,
    /// Requests finished (length, EOS, or `finish`).
    num_finished: u64,
    /// Requests aborted.
    num_aborted: u64,
}

impl Scheduler {
    /// A scheduler over an empty queue and an all-free pool of `cfg.num_blocks` pages.
    pub fn new(cfg: SchedulerConfig) -> Result<Self, SchedError> {
        cfg.validate()?;
        Ok(Self {
            blocks: BlockAllocator::new(cfg.num_blocks),
            cfg,
            seqs: BTreeMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            pending_released: Vec::new(),
            in_flight: Vec::new(),
            next_seq_no: 0,
            steps: 0,
            num_preemptions: 0,
            num_finished: 0,
            num_aborted: 0,
        })
    }

    /// The validated config.
    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    /// Queues a request. Rejects, without changing any state: an id already waiting or running,
    /// an empty prompt, `max_tokens == 0`, `prompt + max_tokens > max_model_len`, and a request
    /// whose cache (at most `prompt + max_tokens - 1` tokens) could not fit even in an empty pool.
    pub fn add_request(&mut self, req: SeqRequest) -> Result<(), SchedError> {
        let id = req.id;
        if self.seqs.contains_key(&id) {
            return Err(SchedError::DuplicateId { id });
        }
        if req.prompt.is_empty() {
            return Err(SchedError::EmptyPrompt { id });
        }
        if req.max_tokens == 0 {
            return Err(SchedError::ZeroMaxTokens { id });
        }
        let prompt_tokens = req.prompt.len() as u64;
        let total = prompt_tokens + req.max_tokens as u64;
        if total > self.cfg.max_model_len as u64 {
            return Err(SchedError::TooLong {
                id,
                prompt_tokens,
                max_tokens: req.max_tokens,
                total,
                max_model_len: self.cfg.max_model_len,
            });
        }
        // The last sampled token is never fed back, so at most total - 1 tokens are cached.
        let max_cached_tokens = total - 1;
        let needed_blocks = self.cfg.blocks_for(max_cached_tokens);
        if needed_blocks > self.cfg.num_blocks as u64 {
            return Err(SchedError::TooBigForPool {
                id,
                max_cached_tokens,
                needed_blocks,
                block_size: self.cfg.block_size,
                num_blocks: self.cfg.num_blocks,
            });
        }
        let key = OrderKey {
            arrival: req.arrival,
            seq_no: self.next_seq_no,
        };
        self.next_seq_no += 1;
        let num_prompt_tokens = req.prompt.len() as u32;
        self.seqs.insert(
            id,
            Seq {
                key,
                tokens: req.prompt,
                num_prompt_tokens,
                max_tokens: req.max_tokens,
                eos_token_ids: req.eos_token_ids,
                ignore_eos: req.ignore_eos,
                num_computed: 0,
                num_cached: 0,
                blocks: Vec::new(),
                phase: Phase::Waiting,
                in_flight: 0,
            },
        );
        insert_sorted_deque(&mut self.waiting, key, id);
        Ok(())
    }

    /// Removes a waiting or running request and frees its pages; a running one is listed in the
    /// next non-empty step's `released`. Returns whether the request existed.
    pub fn abort(&mut self, id: u64) -> bool {
        let existed = self.remove(id);
        if existed {
            self.num_aborted += 1;
        }
        existed
    }

    /// Ends a request for a reason the caller decided (a stop string matched, the client went
    /// away after its last token...). Same mechanics as [`Scheduler::abort`], counted as finished.
    pub fn finish(&mut self, id: u64) -> bool {
        let existed = self.remove(id);
        if existed {
            self.num_finished += 1;
        }
        existed
    }

    /// Whether `id` is waiting or running.
    pub fn contains(&self, id: u64) -> bool {
        self.seqs.contains_key(&id)
    }

    /// The output tokens generated so far for a live request.
    pub fn output_tokens(&self, id: u64) -> Option<&[u32]> {
        self.seqs
            .get(&id)
            .map(|s| &s.tokens[s.num_prompt_tokens as usize..])
    }

    /// Forms the next step (see the crate docs for the algorithm). Returns an empty step
    /// (`is_empty()`, `step_id == 0`) when nothing can run; pending releases then wait for the
    /// next non-empty step. Calling it again before [`Scheduler::update`] abandons the
    /// outstanding step: its requests are rescheduled from where their last update left them.
    pub fn schedule(&mut self) -> ScheduledStep {
        self.clear_in_flight();
        let bs = self.cfg.block_size;
        let mut step = ScheduledStep::default();
        let mut budget = self.cfg.max_num_batched_tokens;
        // Running requests whose next step needs at least one more page than they hold after
        // this one; admission keeps that many pages free (the watermark).
        let mut watermark: u64 = 0;

        // Phase 1: requests already on the worker, oldest first.
        let mut i = 0;
        while i < self.running.len() {
            let id = self.running[i].1;
            let (n, need) = {
                let seq = &self.seqs[&id];
                let remaining = seq.tokens.len() as u32 - seq.num_computed;
                debug_assert!(
                    remaining >= 1,
                    "running request {id} has nothing left to compute"
                );
                let n = (remaining as usize).min(budget) as u32;
                let need = self
                    .cfg
                    .blocks_for((seq.num_computed + n) as u64)
                    .saturating_sub(seq.blocks.len() as u64) as u32;
                (n, need)
            };
            if n == 0 {
                // Out of budget: it stays on the worker, unscheduled, and keeps its pages.
                let seq = &self.seqs[&id];
                watermark += u64::from(
                    (seq.blocks.len() as u64) * (bs as u64) < seq.num_computed as u64 + 1,
                );
                i += 1;
                continue;
            }
            let mut preempted_self = false;
            while self.blocks.num_free() < need {
                let victim = self
                    .running
                    .last()
                    .expect("request `id` itself is running")
                    .1;
                self.preempt(victim);
                self.num_preemptions += 1;
                step.preempted.push(victim);
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
            let ok = self.blocks.allocate(id, need, &mut new_block_ids);
            debug_assert!(ok, "enough pages were freed above");
            seq.blocks.extend_from_slice(&new_block_ids);
            let target = seq.num_computed + n;
            seq.num_cached = seq.num_cached.max(target);
            seq.in_flight = n;
            watermark += u64::from((seq.blocks.len() as u64) * (bs as u64) < target as u64 + 1);
            budget -= n as usize;
            self.in_flight.push(id);
            step.running.push(ScheduledRunning {
                id,
                num_scheduled_tokens: n,
                new_block_ids,
            });
            i += 1;
        }

        // Phase 2: admit waiting requests FCFS, unless this step had to preempt (admitting now
        // would only thrash). Head-of-line blocking is deliberate: no request jumps the queue.
        if step.preempted.is_empty() {
            while let Some(&(key, id)) = self.waiting.front() {
                if self.running.len() >= self.cfg.max_num_seqs || budget == 0 {
                    break;
                }
                let seq = self.seqs.get_mut(&id).expect("waiting ids are live");
                let n = seq.tokens.len().min(budget) as u32;
                let need = self.cfg.blocks_for(n as u64);
                if (self.blocks.num_free() as u64) < need + watermark {
                    break;
                }
                self.waiting.pop_front();
                let mut block_ids = Vec::with_capacity(need as usize);
                let ok = self.blocks.allocate(id, need as u32, &mut block_ids);
                debug_assert!(ok, "free pages were checked above");
                seq.blocks.clone_from(&block_ids);
                seq.phase = Phase::Running;
                seq.num_cached = n;
                seq.in_flight = n;
                watermark += u64::from((block_ids.len() as u64) * (bs as u64) < n as u64 + 1);
                budget -= n as usize;
                step.new.push(ScheduledNew {
                    id,
                    token_ids: seq.tokens.clone(),
                    num_prompt_tokens: seq.num_prompt_tokens,
                    num_computed_tokens: 0,
                    num_scheduled_tokens: n,
                    block_ids,
                });
                self.in_flight.push(id);
                insert_sorted_vec(&mut self.running, key, id);
            }
        }

        if step.is_empty() {
            // Preempting leaves the oldest running request scheduled, so this cannot happen with
            // preemptions; if it ever did, their ids still go out with the next step's releases.
            debug_assert!(
                step.preempted.is_empty(),
                "preempted {:?} yet scheduled nothing",
                step.preempted
            );
            step.preempted.clear();
            return step;
        }
        self.steps += 1;
        step.step_id = self.steps;
        step.released = std::mem::take(&mut self.pending_released);
        step
    }

    /// Applies the worker's results for the step last returned by [`Scheduler::schedule`]:
    /// `(id, Some(token))` when the step computed a request to the end of its known tokens (the
    /// token is appended; the request finishes on an EOS id unless `ignore_eos`, or at
    /// `max_tokens`), `(id, None)` for a partial prefill chunk (its computed count advances).
    ///
    /// Tolerated, for robustness: ids not in that step (aborted or finished since, or unknown)
    /// and repeated ids are ignored; a token for a partial chunk is ignored; a scheduled request
    /// with no output, or with `None` where a token was due, is not advanced and is scheduled
    /// again from the same point (the worker overwrites those cache slots).
    pub fn update(&mut self, outputs: &[(u64, Option<u32>)]) -> Vec<SeqUpdate> {
        let mut updates = Vec::with_capacity(outputs.len());
        let mut any_finished = false;
        for &(id, token) in outputs {
            let Some(seq) = self.seqs.get_mut(&id) else {
                continue;
            };
            let n = std::mem::take(&mut seq.in_flight);
            if n == 0 {
                continue;
            }
            let end = seq.num_computed + n;
            if (end as usize) < seq.tokens.len() {
                seq.num_computed = end;
                continue;
            }
            let Some(token) = token else { continue };
            seq.num_computed = end;
            seq.tokens.push(token);
            let finished = if !seq.ignore_eos && seq.eos_token_ids.contains(&token) {
                Some(FinishReason::Eos)
            } else if seq.num_outputs() >= seq.max_tokens {
                Some(FinishReason::Length)
            } else {
                None
            };
            if finished.is_some() {
                self.blocks.release(id, &seq.blocks);
                self.seqs.remove(&id);
                self.pending_released.push(id);
                self.num_finished += 1;
                any_finished = true;
            }
            updates.push(SeqUpdate {
                id,
                token,
                finished,
            });
        }
        self.clear_in_flight();
        if any_finished {
            let seqs = &self.seqs;
            self.running.retain(|(_, id)| seqs.contains_key(id));
        }
        updates
    }

    /// The worker lost its state (crashed and restarted): forgets the outstanding step and the
    /// pending releases, and moves every running request back to the waiting queue to be
    /// recomputed (sent in full again). Returns the requeued ids, oldest first. Not counted as
    /// preemptions.
    pub fn reset_worker(&mut self) -> Vec<u64> {
        self.clear_in_flight();
        let mut requeued = Vec::with_capacity(self.running.len());
        while let Some(&(_, id)) = self.running.last() {
            self.preempt(id);
            requeued.push(id);
        }
        self.pending_released.clear();
        requeued.reverse();
        requeued
    }

    /// Counters for metrics and tests.
    pub fn stats(&self) -> SchedStats {
        SchedStats {
            waiting: self.waiting.len(),
            running: self.running.len(),
            free_blocks: self.blocks.num_free(),
            used_blocks: self.blocks.num_used(),
            total_blocks: self.blocks.total(),
            num_preemptions: self.num_preemptions,
            steps: self.steps,
            pending_released: self.pending_released.len(),
            num_finished: self.num_finished,
            num_aborted: self.num_aborted,
        }
    }

    /// Whether any request is waiting or running.
    pub fn has_unfinished(&self) -> bool {
        !self.seqs.is_empty()
    }

    /// Checks every structural invariant; `Err` says which one broke and for what. O(pages +
    /// requests): for tests and debugging, not for the hot path.
    ///
    /// - the pool: no page free and owned, none listed twice, free + owned == total;
    /// - every page in a block table is owned by that request, and tables sum to the used pages;
    /// - a running request owns exactly ceil(num_cached / block_size) pages and
    ///   num_computed <= num_cached <= len(tokens), num_computed < len(tokens);
    /// - a waiting request owns no pages and has nothing computed;
    /// - queues hold each live request once, in their phase, sorted by arrival order;
    /// - nobody has reached max_tokens or max_model_len without being finished.
    pub fn check_invariants(&self) -> Result<(), String> {
        self.blocks.check()?;
        let mut owned = 0u64;
        for (&id, seq) in &self.seqs {
            let len = seq.tokens.len() as u64;
            if seq.num_outputs() >= seq.max_tokens {
                return Err(format!(
                    "request {id} has {} outputs, max_tokens {}",
                    seq.num_outputs(),
                    seq.max_tokens
                ));
            }
            if len > self.cfg.max_model_len as u64 {
                return Err(format!("request {id} holds {len} tokens > max_model_len"));
            }
            if seq.num_computed as u64 >= len {
                return Err(format!(
                    "request {id}: num_computed {} >= {len} tokens",
                    seq.num_computed
                ));
            }
            match seq.phase {
                Phase::Waiting => {
                    if !seq.blocks.is_empty()
                        || seq.num_computed != 0
                        || seq.num_cached != 0
                        || seq.in_flight != 0
                    {
                        return Err(format!(
                            "waiting request {id} holds {} pages, computed {}, cached {}, in flight {}",
                            seq.blocks.len(),
                            seq.num_computed,
                            seq.num_cached,
                            seq.in_flight
                        ));
                    }
                }
                Phase::Running => {
                    let want = self.cfg.blocks_for(seq.num_cached as u64);
                    if seq.blocks.len() as u64 != want {
                        return Err(format!(
                            "request {id} owns {} pages for {} cached tokens (want {want})",
                            seq.blocks.len(),
                            seq.num_cached
                        ));
                    }
                    if seq.num_computed > seq.num_cached || seq.num_cached as u64 > len {
                        return Err(format!(
                            "request {id}: computed {} <= cached {} <= tokens {len} broken",
                            seq.num_computed, seq.num_cached
                        ));
                    }
                    if seq.in_flight > 0 && seq.num_computed + seq.in_flight > seq.num_cached {
                        return Err(format!("request {id}: in-flight chunk runs past its pages"));
                    }
                }
            }
            for &page in &seq.blocks {
                if self.blocks.owner_of(page) != Some(id) {
                    return Err(format!(
                        "page {page} is in request {id}'s table but owned by {:?}",
                        self.blocks.owner_of(page)
                    ));
                }
            }
            owned += seq.blocks.len() as u64;
        }
        if owned != self.blocks.num_used() as u64 {
            return Err(format!(
                "block tables hold {owned} pages, pool has {} used",
                self.blocks.num_used()
            ));
        }
        if self.waiting.len() + self.running.len() != self.seqs.len() {
            return Err(format!(
                "{} waiting + {} running != {} live requests",
                self.waiting.len(),
                self.running.len(),
                self.seqs.len()
            ));
        }
        let queues = [
            (
                Phase::Waiting,
                self.waiting.iter().copied().collect::<Vec<_>>(),
            ),
            (Phase::Running, self.running.clone()),
        ];
        for (phase, queue) in queues {
            for (j, &(key, id)) in queue.iter().enumerate() {
                let seq = self
                    .seqs
                    .get(&id)
                    .ok_or_else(|| format!("{phase:?} queue holds dead request {id}"))?;
                if seq.phase != phase || seq.key != key {
                    return Err(format!(
                        "request {id} is in the {phase:?} queue as {:?} with key {key:?}",
                        seq.phase
                    ));
                }
                if j > 0 && queue[j - 1].0 >= key {
                    return Err(format!(
                        "{phase:?} queue is out of arrival order at request {id}"
                    ));
                }
            }
        }
        if self.running.len() > self.cfg.max_num_seqs {
            return Err(format!(
                "{} running > max_num_seqs {}",
                self.running.len(),
                self.cfg.max_num_seqs
            ));
        }
        Ok(())
    }

    /// Takes a request out of the queues and frees its pages; a running one is queued for
    /// release. Returns whether it existed.
    fn remove(&mut self, id: u64) -> bool {
        let Some(seq) = self.seqs.remove(&id) else {
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
                self.blocks.release(id, &seq.blocks);
                self.pending_released.push(id);
            }
        }
        true
    }

    /// Preempts the last running request, which must be `id`: frees its pages, resets it for
    /// recomputation and puts it back in the waiting queue at its arrival position (the front,
    /// unless a request with an earlier arrival stamp was added since).
    fn preempt(&mut self, id: u64) {
        let (key, last) = self.running.pop().expect("preempt needs a running request");
        debug_assert_eq!(
            last, id,
            "only the most recently arrived running request is preempted"
        );
        let seq = self.seqs.get_mut(&id).expect("running ids are live");
        self.blocks.release(id, &seq.blocks);
        seq.blocks.clear();
        seq.num_computed = 0;
        seq.num_cached = 0;
        seq.in_flight = 0;
        seq.phase = Phase::Waiting;
        insert_sorted_deque(&mut self.waiting, key, id);
        self.pending_released.push(id);
    }

    /// Forgets which requests the outstanding step scheduled.
    fn clear_in_flight(&mut self) {
        for id in self.in_flight.drain(..) {
            if let Some(seq) = self.seqs.get_mut(&id) {
                seq.in_flight = 0;
            }
        }
    }
}

/// Inserts into a deque sorted by key (O(1) at either end, the common cases).
fn insert_sorted_deque(q: &mut VecDeque<(OrderKey, u64)>, key: OrderKey, id: u64) {
    let pos = q.partition_point(|&(k, _)| k < key);
    q.insert(pos, (key, id));
}

/// Inserts into a vec sorted by key (O(1) when appending, the common case).
fn insert_sorted_vec(v: &mut Vec<(OrderKey, u64)>, key: OrderKey, id: u64) {
    if v.last().is_none_or(|&(k, _)| k < key) {
        v.push((key, id));
    } else {
        let pos = v.partition_point(|&(k, _)| k < key);
        v.insert(pos, (key, id));
    }
}
