//! The simulator's virtual-clock loop: the router's real scheduler ([`Scheduler`], one per
//! simulated worker) driven the way the engine actor drives it
//! (`router/crates/server/src/engine/actor.rs`), with a [`LatencyModel`] in place of the GPU.
//! Pure Rust, no Python: `sim.rs` converts its inputs and [`SimOutcome`].
//!
//! # The actor's call sequence, replayed
//!
//! ```text
//! arrival of request i at t   (t = its trace arrival + ingress_s: HTTP and the command queue)
//!                             route it by the router's placement policy (`sim_placement.rs`;
//!                             least-loaded: the fewest live requests, ties the lowest index),
//!                             add_request, keep_busy
//! output of step N at t       host_copies_ready(reads finished by t), update(N's tokens),
//!                             keep_busy, then count tokens, each seen by its client at
//!                             t + deliver_s (streaming out; first token: TTFT; finish)
//! keep_busy                   no step in flight: schedule(); overlap_steps and one in flight:
//!                             schedule_ahead()   (both skipped when nothing is unfinished)
//! ```
//!
//! # Time
//!
//! A step sent at `t` reaches the worker at `t + router_gap_s`; its device work lasts the
//! model's `step_s` (times a seeded log-normal factor when `noise > 0`, or the given
//! `step_times`) plus its `ToGpu` copies, and the worker's launch the model's `host_s`.
//! `sim_pipeline.rs` times the two on the worker's host and device as the overlapped worker
//! loop runs them: an output leaves at its step's device end, or after the next step's launch
//! when that plan came while the step ran. A `ToHost` read starts when its step is sent, on the
//! first of its kind's [`READERS`] readers to be free (the worker's pools each read with that
//! many threads: `adapters/host_tier.py`'s `LOAD_THREADS`), and is reported with the first output
//! after it finished, as the worker's `host_ready` does. Every request samples a token each
//! time its chunk reaches the end of its known tokens (the scheduler ignores the token given
//! for a partial chunk), so output lengths are the trace's (`max_tokens`, `ignore_eos`).
//!
//! Events at the same instant: step outputs before arrivals, arrivals in trace order.

use std::cmp::Ordering;
use std::collections::{BTreeMap, BinaryHeap, HashMap, VecDeque};

use deltaserve_sched::{
    Scheduler, SchedulerConfig, SeqRequest, VariantKind, VariantOpKind, VariantSpec,
};

use crate::sim_latency::{step_features, LatencyModel, SplitMix, NUM_FEATURES};
use crate::sim_pipeline::{Previous, WorkerClock};
use crate::sim_placement::SimPlacer;
use deltaserve_server::engine::Placer;

/// One request of the trace.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SimRequest {
    /// Arrival, seconds from the start.
    pub(crate) arrival_s: f64,
    /// Prompt tokens.
    pub(crate) prompt_len: u32,
    /// Output tokens it generates (forced: `max_tokens`, EOS ignored).
    pub(crate) output_len: u32,
    /// Its variant: 0 for the base model, else `i + 1` for `variants[i]`.
    pub(crate) variant: u32,
    /// Its prompt's identity: requests with equal keys have equal prompts ([`Self::prompt`]),
    /// so the scheduler's prefix cache shares their pages; None: a prompt of zeros (prefix
    /// caching is then off, or every prompt would hit every other).
    pub(crate) prompt_key: Option<u64>,
}

impl SimRequest {
    /// The prompt's tokens: SplitMix64 of (key, position) when it has a key, else zeros.
    fn prompt(&self) -> Vec<u32> {
        let Some(key) = self.prompt_key else {
            return vec![0; self.prompt_len as usize];
        };
        (0..u64::from(self.prompt_len))
            .map(|j| {
                let mut z = key ^ j.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
                ((z ^ (z >> 31)) >> 33) as u32
            })
            .collect()
    }
}

/// One variant of the trace, registered with every worker's scheduler.
#[derive(Debug, Clone)]
pub(crate) struct SimVariant {
    /// LoRA adapter or delta.
    pub(crate) kind: VariantKind,
    /// Pool pages of a LoRA adapter on the GPU (0 for a delta).
    pub(crate) num_blocks: u32,
    /// Bytes of its host copy (also what a `ToGpu` copies).
    pub(crate) host_bytes: u64,
    /// LoRA rank (the latency model's `lora_rank_sum`); 0 for a delta.
    pub(crate) rank: u32,
}

/// How the engine around the schedulers behaves.
#[derive(Debug, Clone)]
pub(crate) struct SimOptions {
    /// Workers (GPUs), each with its own scheduler.
    pub(crate) workers: usize,
    /// The daemon's `--overlap-steps`: a step is formed ahead while one is in flight.
    pub(crate) overlap_steps: bool,
    /// Seconds from a plan being sent to the worker receiving it (router + IPC).
    pub(crate) router_gap_s: f64,
    /// Seconds from a request's arrival to the engine adding it (HTTP, tokenizer, command queue).
    pub(crate) ingress_s: f64,
    /// Seconds from a step's output leaving the worker to its tokens reaching the clients.
    pub(crate) deliver_s: f64,
    /// Standard deviation of the log of a multiplicative step-time noise (0: none).
    pub(crate) noise: f64,
    /// Seed of the noise.
    pub(crate) seed: u64,
    /// Requests a worker may hold (queued + running) before new ones are refused (the
    /// daemon's `--max-queued-per-worker`, answered with 429); `None`: no limit.
    pub(crate) max_queued_per_worker: Option<usize>,
    /// Device seconds of each step in launch order (one worker only), instead of the model's.
    pub(crate) step_times: Option<Vec<f64>>,
    /// Keep every step's composition in [`SimOutcome::steps`].
    pub(crate) record_steps: bool,
    /// Which worker an arrival goes to: the daemon's `--placement` policy, latency profile,
    /// TPOT SLO and batch size.
    pub(crate) placer: Placer,
}

/// One simulated step, for comparison with the daemon's.
#[derive(Debug, Clone)]
pub(crate) struct StepRecord {
    /// The worker that ran it.
    pub(crate) worker: usize,
    /// The scheduler's step id on that worker.
    pub(crate) step_id: u64,
    /// Formed by `schedule_ahead` (one step was in flight).
    pub(crate) ahead: bool,
    /// When it started on the device.
    pub(crate) start_s: f64,
    /// When its output reached the router.
    pub(crate) end_s: f64,
    /// `(request, tokens scheduled)`, new requests first, then running ones (the plan's order).
    pub(crate) entries: Vec<(u64, u32)>,
    /// Its prefill tokens (the latency model's feature).
    pub(crate) prefill_tokens: u32,
    /// Its latency-model features ([`crate::sim_latency::StepFeatures::values`] order, `eager` as the graph rule
    /// set it): tests check them against the recording side's (`deltaserve.sim.record`).
    pub(crate) features: [f64; NUM_FEATURES],
}

/// Everything a run measured; per-request vectors are indexed like the trace.
#[derive(Debug, Clone, Default)]
pub(crate) struct SimOutcome {
    /// When each request's first token reached its client (NaN: never).
    pub(crate) first_token_s: Vec<f64>,
    /// When each request was first sent to a worker in a plan (NaN: never).
    pub(crate) scheduled_s: Vec<f64>,
    /// When each request finished (NaN: rejected).
    pub(crate) finish_s: Vec<f64>,
    /// Output tokens each request received.
    pub(crate) output_tokens: Vec<u32>,
    /// The worker each request went to (-1: rejected, the queue limit was reached).
    pub(crate) worker_of: Vec<i64>,
    /// Device seconds each worker was busy (steps and copies).
    pub(crate) busy_s: Vec<f64>,
    /// Scheduler counters summed over the workers, by `SchedStats` field name.
    pub(crate) counters: BTreeMap<&'static str, u64>,
    /// Peaks over the run, the largest on any one worker: `kv_blocks`, `lora_blocks`,
    /// `host_bytes`, `deltas_on_gpu`, `running`, `waiting`.
    pub(crate) peaks: BTreeMap<&'static str, u64>,
    /// Every step, when `record_steps`.
    pub(crate) steps: Vec<StepRecord>,
}

/// A step sent and not answered yet.
struct InFlight {
    /// When its device work ends.
    device_end_s: f64,
    /// When its output reaches the router (a later launch may postpone it).
    out_s: f64,
    /// The sequence number of its current entry in the output queue (older ones are stale).
    due_seq: u64,
    /// The requests it scheduled.
    ids: Vec<u64>,
}

/// Reads a worker runs at once per variant kind (`LOAD_THREADS` of the worker's host tier).
pub const READERS: usize = 4;

/// One worker: its scheduler and the actor's and device's state around it.
struct WorkerSim {
    sched: Scheduler,
    in_flight: VecDeque<InFlight>,
    /// When the worker's thread and its device are free.
    clock: WorkerClock,
    /// When each reader of each variant kind (lora, delta) finishes the reads queued on it.
    readers_free_s: [[f64; READERS]; 2],
    /// Variant -> when its host copy is (or was) complete, while it has one.
    host_done_s: HashMap<u32, f64>,
    /// Reads not reported yet: variant -> completion time.
    unreported: BTreeMap<u32, f64>,
    /// Each running request's cached length (tokens its scheduled chunks reached).
    cached: HashMap<u64, u32>,
    /// Requests routed here and not finished: the engine's load measure.
    live: usize,
    /// The actor's request counter (the scheduler's arrival stamp).
    next_stamp: u64,
    /// Device seconds busy.
    busy_s: f64,
}

/// The run: workers, the event queue of step outputs, and the results so far.
struct Sim<'a> {
    requests: &'a [SimRequest],
    variants: &'a [SimVariant],
    model: &'a LatencyModel,
    opts: &'a SimOptions,
    workers: Vec<WorkerSim>,
    /// Step outputs to come: (end time, sequence number) -> worker.
    outputs: BinaryHeap<Due>,
    seq: u64,
    rng: SplitMix,
    placer: SimPlacer,
    launched: usize,
    out: SimOutcome,
}

/// A step output due at `t`; ordered earliest first (then by sequence number).
#[derive(Debug, Clone, Copy)]
struct Due {
    t: f64,
    seq: u64,
    worker: usize,
}

impl Ord for Due {
    fn cmp(&self, other: &Self) -> Ordering {
        (other.t.total_cmp(&self.t)).then(other.seq.cmp(&self.seq))
    }
}
impl PartialOrd for Due {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl PartialEq for Due {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Due {}

/// Runs `requests` (any order; replayed by arrival time) through `opts.workers` schedulers of
/// config `cfg`. Errors name the first bad input: a config the scheduler refuses, a variant it
/// refuses, a request it refuses (too long for `max_model_len`, too big for the pool), too few
/// `step_times`, or a run that stalls with requests unfinished.
pub(crate) fn simulate(
    cfg: &SchedulerConfig,
    requests: &[SimRequest],
    variants: &[SimVariant],
    model: &LatencyModel,
    opts: &SimOptions,
) -> Result<SimOutcome, String> {
    if opts.workers == 0 {
        return Err("workers must be at least 1".into());
    }
    if opts.step_times.is_some() && opts.workers != 1 {
        return Err("step_times replays one worker's steps: workers must be 1".into());
    }
    let mut workers = Vec::with_capacity(opts.workers);
    for _ in 0..opts.workers {
        let mut sched = Scheduler::new(cfg.clone()).map_err(|e| e.to_string())?;
        for (i, v) in variants.iter().enumerate() {
            let spec = VariantSpec {
                kind: v.kind,
                num_blocks: v.num_blocks,
                host_bytes: v.host_bytes,
                path: format!("sim://variant/{}", i + 1),
            };
            sched
                .register_adapter(i as u32 + 1, spec)
                .map_err(|e| format!("variant {i}: {e}"))?;
        }
        workers.push(WorkerSim {
            sched,
            in_flight: VecDeque::new(),
            clock: WorkerClock::default(),
            readers_free_s: [[0.0; READERS]; 2],
            host_done_s: HashMap::new(),
            unreported: BTreeMap::new(),
            cached: HashMap::new(),
            live: 0,
            next_stamp: 0,
            busy_s: 0.0,
        });
    }
    let n = requests.len();
    let mut sim = Sim {
        requests,
        variants,
        model,
        opts,
        workers,
        outputs: BinaryHeap::new(),
        seq: 0,
        rng: SplitMix(opts.seed),
        placer: SimPlacer::new(opts.placer.clone(), variants),
        launched: 0,
        out: SimOutcome {
            first_token_s: vec![f64::NAN; n],
            scheduled_s: vec![f64::NAN; n],
            finish_s: vec![f64::NAN; n],
            output_tokens: vec![0; n],
            worker_of: vec![-1; n],
            ..SimOutcome::default()
        },
    };
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&a, &b| requests[a].arrival_s.total_cmp(&requests[b].arrival_s));
    let mut next = 0;
    loop {
        let arrival = order
            .get(next)
            .map(|&i| requests[i].arrival_s + opts.ingress_s);
        match (arrival, sim.outputs.peek().copied()) {
            (None, None) => break,
            (Some(t), Some(due)) if due.t > t => {
                sim.arrive(order[next])?;
                next += 1;
            }
            (Some(_), None) => {
                sim.arrive(order[next])?;
                next += 1;
            }
            (_, Some(due)) => {
                sim.outputs.pop();
                let current = sim.workers[due.worker].in_flight.front();
                if current.is_some_and(|step| step.due_seq == due.seq) {
                    sim.output(due.worker, due.t)?;
                } // else postponed: a later entry answers it
            }
        }
    }
    sim.finish()
}

impl Sim<'_> {
    /// Request `i` arrives: routed, queued, and its worker kept busy.
    fn arrive(&mut self, i: usize) -> Result<(), String> {
        let r = self.requests[i];
        if r.variant as usize > self.variants.len() {
            return Err(format!(
                "request {i}: variant {} is not among the {} variants",
                r.variant,
                self.variants.len()
            ));
        }
        let loads: Vec<_> = self.workers.iter().map(|wk| (&wk.sched, wk.live)).collect();
        let w = self
            .placer
            .choose(&loads, self.opts.max_queued_per_worker, &r);
        let t = r.arrival_s + self.opts.ingress_s;
        let worker = &mut self.workers[w];
        if self
            .opts
            .max_queued_per_worker
            .is_some_and(|m| worker.live >= m)
        {
            return Ok(()); // refused (429): no token, no finish
        }
        let req = SeqRequest {
            id: i as u64,
            prompt: r.prompt(),
            max_tokens: r.output_len,
            eos_token_ids: Vec::new(),
            ignore_eos: true,
            arrival: worker.next_stamp,
            adapter_id: r.variant,
            skip_prefix_cache: false,
        };
        worker
            .sched
            .add_request(req)
            .map_err(|e| format!("request {i}: {e}"))?;
        worker.next_stamp += 1;
        worker.live += 1;
        self.out.worker_of[i] = w as i64;
        self.keep_busy(w, t)
    }

    /// The oldest step in flight on worker `w` answers at `t` (the actor's `on_step_output`).
    fn output(&mut self, w: usize, t: f64) -> Result<(), String> {
        let worker = &mut self.workers[w];
        let step = worker
            .in_flight
            .pop_front()
            .expect("an output answers a sent step");
        debug_assert_eq!(step.out_s, t);
        let ready: Vec<u32> = worker
            .unreported
            .iter()
            .filter(|&(_, &done)| done <= t)
            .map(|(&id, _)| id)
            .collect();
        for id in &ready {
            worker.unreported.remove(id);
        }
        worker.sched.host_copies_ready(&ready);
        let sampled: Vec<(u64, Option<u32>)> = step.ids.iter().map(|&id| (id, Some(1))).collect();
        let updates = worker.sched.update(&sampled);
        self.keep_busy(w, t)?;
        let seen = t + self.opts.deliver_s;
        for u in updates {
            let i = u.id as usize;
            if self.out.output_tokens[i] == 0 {
                self.out.first_token_s[i] = seen;
            }
            self.out.output_tokens[i] += 1;
            if u.finished.is_some() {
                self.out.finish_s[i] = seen;
                let worker = &mut self.workers[w];
                worker.live -= 1;
                worker.cached.remove(&u.id);
            }
        }
        Ok(())
    }

    /// The actor's `keep_busy`: a step when none is in flight, and with overlap the step after
    /// the one in flight.
    fn keep_busy(&mut self, w: usize, t: f64) -> Result<(), String> {
        if self.workers[w].in_flight.is_empty() {
            self.launch(w, t, false)?;
        }
        if self.opts.overlap_steps && self.workers[w].in_flight.len() == 1 {
            self.launch(w, t, true)?;
        }
        Ok(())
    }

    /// Forms a step on worker `w` at `t` and sends it: prices it, queues its reads and copies,
    /// and schedules its output.
    fn launch(&mut self, w: usize, t: f64, ahead: bool) -> Result<(), String> {
        let worker = &mut self.workers[w];
        if !worker.sched.has_unfinished() {
            return Ok(());
        }
        let step = if ahead {
            worker.sched.schedule_ahead()
        } else {
            worker.sched.schedule()
        };
        if step.is_empty() {
            return Ok(());
        }
        for id in &step.released {
            worker.cached.remove(id);
        }
        let composition = step_features(
            &mut worker.cached,
            &step,
            self.requests,
            self.variants,
            self.model.dense_min_m,
        );
        let (mut features, entries) = (composition.features, composition.entries);
        features.eager = f64::from(u8::from(self.model.runs_eager(&features)));
        if features.eager == 0.0 {
            // A replayed step runs its deltas on the work tiles, but for one in the dense lane.
            let lane = self
                .model
                .dense_lane_delta(&features, &composition.tokens_by_delta);
            features.dense_delta_segments = f64::from(u8::from(lane.is_some()));
        }
        let mut ready_s = t;
        let mut copy_s = 0.0;
        for op in &step.adapter_ops {
            let id = op.adapter_id;
            let variant = &self.variants[id as usize - 1];
            let (kind, bytes) = (variant.kind, variant.host_bytes);
            match op.kind {
                VariantOpKind::ToHost { .. } => {
                    let readers = &mut worker.readers_free_s[crate::sim_latency::kind_index(kind)];
                    let reader = (0..READERS)
                        .min_by(|&a, &b| readers[a].total_cmp(&readers[b]))
                        .expect("READERS > 0");
                    let done = t.max(readers[reader]) + self.model.to_host_s(kind, bytes);
                    readers[reader] = done;
                    worker.host_done_s.insert(id, done);
                    worker.unreported.insert(id, done);
                }
                VariantOpKind::ToGpu { .. } => {
                    ready_s = ready_s.max(worker.host_done_s.get(&id).copied().unwrap_or(t));
                    copy_s += self.model.to_gpu_s(kind, bytes);
                }
                VariantOpKind::DropHost => {
                    worker.host_done_s.remove(&id);
                    worker.unreported.remove(&id);
                }
                VariantOpKind::DropGpu => {}
            }
        }
        let compute_s = match &self.opts.step_times {
            Some(times) => *times.get(self.launched).ok_or_else(|| {
                format!(
                    "step_times has {} entries but the run needs step {}",
                    times.len(),
                    self.launched + 1
                )
            })?,
            None => self.model.step_s(&features) * self.rng.log_normal(self.opts.noise),
        };
        self.launched += 1;
        let previous = worker.in_flight.back().map(|p| Previous {
            device_end_s: p.device_end_s,
            out_s: p.out_s,
        });
        let arrive = t + self.opts.router_gap_s;
        let host_s = self.model.host_s(&features);
        let timed = worker
            .clock
            .launch(arrive, host_s, compute_s + copy_s, ready_s, previous);
        let (start, end) = (timed.device_start_s, timed.device_end_s);
        if let (Some(out), Some(p)) = (timed.previous_out_s, worker.in_flight.back_mut()) {
            self.seq += 1;
            p.out_s = out;
            p.due_seq = self.seq;
            self.outputs.push(Due {
                t: out,
                seq: self.seq,
                worker: w,
            });
        }
        worker.busy_s += compute_s + copy_s;
        self.seq += 1;
        worker.in_flight.push_back(InFlight {
            device_end_s: end,
            out_s: end,
            due_seq: self.seq,
            ids: entries.iter().map(|&(id, _)| id).collect(),
        });
        self.outputs.push(Due {
            t: end,
            seq: self.seq,
            worker: w,
        });
        for &(id, _) in &entries {
            let first = &mut self.out.scheduled_s[id as usize];
            if first.is_nan() {
                *first = t;
            }
        }
        let s = worker.sched.stats();
        for (name, value) in [
            ("kv_blocks", u64::from(s.used_blocks)),
            ("lora_blocks", u64::from(s.adapter_blocks)),
            ("host_bytes", s.host_adapter_bytes),
            ("deltas_on_gpu", s.deltas_on_gpu as u64),
            ("running", s.running as u64),
            ("waiting", s.waiting as u64),
        ] {
            let peak = self.out.peaks.entry(name).or_insert(0);
            *peak = (*peak).max(value);
        }
        if self.opts.record_steps {
            self.out.steps.push(StepRecord {
                worker: w,
                step_id: step.step_id,
                ahead,
                start_s: start,
                end_s: end,
                entries,
                prefill_tokens: features.prefill_tokens as u32,
                features: features.values(),
            });
        }
        Ok(())
    }

    /// The outcome, once no event is left: every routed request must have finished.
    fn finish(mut self) -> Result<SimOutcome, String> {
        for (w, worker) in self.workers.iter().enumerate() {
            if worker.sched.has_unfinished() {
                let s = worker.sched.stats();
                return Err(format!(
                    "the run stalled on worker {w}: {} waiting and {} running requests, nothing \
                     in flight (a scheduler bug: please report it with the trace)",
                    s.waiting, s.running
                ));
            }
        }
        let mut counters: BTreeMap<&'static str, u64> = BTreeMap::new();
        for worker in &self.workers {
            let s = worker.sched.stats();
            for (name, value) in [
                ("steps", s.steps),
                ("num_preemptions", s.num_preemptions),
                ("num_finished", s.num_finished),
                ("adapter_gpu_loads", s.adapter_gpu_loads),
                ("adapter_host_loads", s.adapter_host_loads),
                ("adapter_gpu_evictions", s.adapter_gpu_evictions),
                ("delta_skips", s.delta_skips),
                ("delta_skip_preemptions", s.delta_skip_preemptions),
                ("host_deferrals", s.host_deferrals),
                ("gpu_load_deferrals", s.gpu_load_deferrals),
                ("prefix_hit_tokens", s.prefix_hit_tokens),
            ] {
                *counters.entry(name).or_insert(0) += value;
            }
        }
        self.out.counters = counters;
        self.out.busy_s = self.workers.iter().map(|w| w.busy_s).collect();
        Ok(self.out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim_latency::{LaneBucket, FEATURES};
    use deltaserve_server::engine::{LatencyProfile, Placement};

    /// `(eager, dense_delta_segments)` under `model` of the step that prefills `prompts`
    /// (`(delta 1 or 2, tokens)`): they arrive while a base request's one-token prompt runs, and
    /// go in the next step together, beside its decode row (one token more).
    fn prefill_step(model: &LatencyModel, prompts: &[(u32, u32)]) -> (f64, f64) {
        let request = |variant, prompt_len| SimRequest {
            arrival_s: 0.0,
            prompt_len,
            output_len: 4,
            variant,
            prompt_key: None,
        };
        let mut requests = vec![request(0, 1)];
        requests.extend(prompts.iter().map(|&(variant, n)| request(variant, n)));
        let delta = SimVariant {
            kind: VariantKind::Delta,
            num_blocks: 0,
            host_bytes: 1,
            rank: 0,
        };
        let cfg = SchedulerConfig::new(16, 256, 4096);
        let opts = SimOptions {
            workers: 1,
            overlap_steps: false,
            router_gap_s: 0.0,
            ingress_s: 0.0,
            deliver_s: 0.0,
            noise: 0.0,
            seed: 0,
            max_queued_per_worker: None,
            step_times: None,
            record_steps: true,
            placer: Placer {
                policy: Placement::LeastLoaded,
                profile: LatencyProfile::default(),
                tpot_slo_us: None,
                max_num_seqs: cfg.max_num_seqs,
            },
        };
        let out = simulate(&cfg, &requests, &[delta.clone(), delta], model, &opts).unwrap();
        let feature = |step: &StepRecord, name| {
            step.features[FEATURES.iter().position(|f| *f == name).unwrap()]
        };
        let step = &out.steps[1];
        assert_eq!(
            step.entries.len(),
            prompts.len() + 1,
            "every prompt in one step"
        );
        assert_eq!(
            feature(step, "prefill_tokens"),
            feature(step, "tokens") - 1.0
        );
        (
            feature(step, "eager"),
            feature(step, "dense_delta_segments"),
        )
    }

    #[test]
    fn a_replayed_step_has_a_dense_segment_when_its_largest_delta_takes_the_lane() {
        let mut model = LatencyModel {
            graph_max_batch: 8,
            graph_max_tokens: 512,
            graph_max_delta_tokens: 512,
            dense_min_m: Some(64),
            ..LatencyModel::device_only([1e-3; NUM_FEATURES], [1e-3; NUM_FEATURES])
        };
        // `dense_lane_tokens` with a base of 64 tokens; a step of 107 tokens pads to bucket 128.
        assert_eq!(
            prefill_step(&model, &[(1, 106)]),
            (0.0, 0.0),
            "no lane modelled"
        );
        model.dense_lane = vec![
            LaneBucket {
                tokens: 64,
                lane_min_tokens: 85,
            },
            LaneBucket {
                tokens: 128,
                lane_min_tokens: 106,
            },
            LaneBucket {
                tokens: 512,
                lane_min_tokens: 234,
            },
        ];
        assert_eq!(
            prefill_step(&model, &[(1, 106)]),
            (0.0, 1.0),
            "at the threshold"
        );
        assert_eq!(prefill_step(&model, &[(1, 105)]), (0.0, 0.0), "below it");
        assert_eq!(
            prefill_step(&model, &[(2, 12), (1, 108)]),
            (0.0, 1.0),
            "the largest"
        );
        assert_eq!(
            prefill_step(&model, &[(1, 60), (2, 66)]),
            (0.0, 0.0),
            "both below"
        );
        assert_eq!(
            prefill_step(&model, &[(1, 240), (2, 240)]),
            (0.0, 1.0),
            "one lane"
        );
        // Eager steps keep their rule: one dense segment per delta with a chunk of dense_min_m.
        model.graph_max_delta_tokens = 0;
        assert_eq!(prefill_step(&model, &[(1, 64), (2, 64)]), (1.0, 2.0));
        assert_eq!(prefill_step(&model, &[(1, 63)]), (1.0, 0.0));
    }
}
