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
//! output of step N at t       host_copies_ready(reads finished by t), gpu_copies_ready(delta
//!                             copies beside the steps finished by t), update(N's tokens),
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
//! `step_times`) plus its `ToGpu` copies (`to_gpu_s`; but delta copies with `gpu_load_reports`,
//! below), and the worker's launch the model's `host_s`. A step carrying a `ToGpu` does not
//! start on the device before that variant's host read is done (the worker's thread waits for
//! it). `sim_pipeline.rs` times the two on the worker's host and device as the overlapped worker
//! loop runs them: an output leaves at its step's device end, or after the next step's launch
//! when that plan came while the step ran. A `ToHost` read starts when its step is sent, on the
//! first of its kind's [`READERS`] readers to be free (the worker's pools each read with that
//! many threads: `adapters/host_tier.py`'s `LOAD_THREADS`), and is reported with the first output
//! after it finished, as the worker's `host_ready` does.
//!
//! With the config's `gpu_load_reports` (the daemon's), a delta's `ToGpu` is copied beside the
//! steps, on the worker's one load stream (`adapters/delta_loads.py`), and adds nothing to its
//! step's device time:
//!
//! ```text
//! copy start = max(launch start of its step: max(arrival at the worker, worker thread free),
//!                  device end of the steps queued before it, its host read's end,
//!                  the load stream free: the end of the copy queued before it)
//! copy end   = copy start + to_gpu_s(delta, host bytes)    (the load stream is free then)
//! ```
//!
//! A step whose scheduled requests use a delta whose copy has not ended starts on the device at
//! the copy's end at the earliest (with nothing else running the scheduler admits a request with
//! its delta's `ToGpu`, and that step waits so); the others run beside the copy. The copy is
//! reported (`gpu_copies_ready`) with the first output at or after its end, as the worker's
//! `gpu_ready` does; a `DropGpu` of the delta forgets it (a later `ToGpu` copies anew). Such
//! copies are not in a worker's `busy_s`. LoRA copies stay in their steps.
//!
//! Every request samples a token each time its chunk reaches the end of its known tokens (the
//! scheduler ignores the token given for a partial chunk), so output lengths are the trace's
//! (`max_tokens`, `ignore_eos`).
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
    /// Device seconds each worker was busy: its steps, with the copies inside them (delta copies
    /// beside the steps, with `gpu_load_reports`, run on the load stream and are not counted).
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
    /// With `gpu_load_reports`: when the worker's load stream finishes the delta copies queued
    /// on it (they run beside the steps, one after another).
    load_free_s: f64,
    /// With `gpu_load_reports`: delta -> when its copy beside the steps is (or was) complete,
    /// while it is on the GPU (a step using it waits for it).
    gpu_done_s: HashMap<u32, f64>,
    /// Copies beside the steps not reported yet: delta -> completion time.
    gpu_unreported: BTreeMap<u32, f64>,
    /// Each running request's cached length (tokens its scheduled chunks reached).
    cached: HashMap<u64, u32>,
    /// Requests routed here and not finished: the engine's load measure.
    live: usize,
    /// The actor's request counter (the scheduler's arrival stamp).
    next_stamp: u64,
    /// Device seconds busy (steps and the copies inside them).
    busy_s: f64,
}

/// The run: workers, the event queue of step outputs, and the results so far.
struct Sim<'a> {
    requests: &'a [SimRequest],
    variants: &'a [SimVariant],
    model: &'a LatencyModel,
    opts: &'a SimOptions,
    /// The config's `gpu_load_reports`: delta copies run beside the steps (module docs).
    gpu_load_reports: bool,
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
            load_free_s: 0.0,
            gpu_done_s: HashMap::new(),
            gpu_unreported: BTreeMap::new(),
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
        gpu_load_reports: cfg.gpu_load_reports,
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
        let ready = take_done(&mut worker.unreported, t);
        worker.sched.host_copies_ready(&ready);
        let loaded = take_done(&mut worker.gpu_unreported, t);
        worker.sched.gpu_copies_ready(&loaded);
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
        let arrive = t + self.opts.router_gap_s;
        // A delta copy beside the steps starts once the worker's thread takes the plan and after
        // the steps queued before this one (`delta_loads.py` records its `after` event then).
        let copy_after_s = arrive
            .max(worker.clock.host_free_s)
            .max(worker.clock.device_free_s);
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
                    // The worker's thread waits for the host read before it places the variant.
                    let host_done = worker.host_done_s.get(&id).copied().unwrap_or(t);
                    ready_s = ready_s.max(host_done);
                    if self.gpu_load_reports && kind == VariantKind::Delta {
                        let start = copy_after_s.max(host_done).max(worker.load_free_s);
                        let done = start + self.model.to_gpu_s(kind, bytes);
                        worker.load_free_s = done;
                        worker.gpu_done_s.insert(id, done);
                        worker.gpu_unreported.insert(id, done);
                    } else {
                        copy_s += self.model.to_gpu_s(kind, bytes);
                    }
                }
                VariantOpKind::DropHost => {
                    worker.host_done_s.remove(&id);
                    worker.unreported.remove(&id);
                }
                VariantOpKind::DropGpu => {
                    // Its copy (still on the load stream or not) is forgotten, not reported.
                    worker.gpu_done_s.remove(&id);
                    worker.gpu_unreported.remove(&id);
                }
            }
        }
        if self.gpu_load_reports {
            // A step that runs a delta's requests waits for its copy beside the steps.
            for &(id, _) in &entries {
                let variant = self.requests[id as usize].variant;
                if let Some(&done) = worker.gpu_done_s.get(&variant) {
                    ready_s = ready_s.max(done);
                }
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

/// Takes from `unreported` (variant id -> the time its read or copy ends) the ids done by `t`, in
/// id order: what the worker's next output reports (`host_ready`, `gpu_ready`).
fn take_done(unreported: &mut BTreeMap<u32, f64>, t: f64) -> Vec<u32> {
    let done: Vec<u32> = unreported
        .iter()
        .filter(|&(_, &end)| end <= t)
        .map(|(&id, _)| id)
        .collect();
    for id in &done {
        unreported.remove(id);
    }
    done
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
        let opts = one_worker(&cfg, false);
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

    /// One worker, no router gap, ingress or delivery, placing by load.
    fn one_worker(cfg: &SchedulerConfig, overlap_steps: bool) -> SimOptions {
        SimOptions {
            workers: 1,
            overlap_steps,
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
        }
    }

    /// Steps of 10 ms whatever they hold; a delta of 1 GB reads in 5 ms and copies in 95 ms.
    const STEP_S: f64 = 0.010;
    const READ_S: f64 = 0.005;
    const COPY_S: f64 = 0.095;

    fn flat_model() -> LatencyModel {
        let mut coefs = [0.0; NUM_FEATURES];
        coefs[FEATURES.iter().position(|f| *f == "const").unwrap()] = STEP_S;
        LatencyModel {
            disk_to_host_bps: [1e9 / READ_S; 2],
            host_to_gpu_bps: [1e9 / COPY_S; 2],
            ..LatencyModel::device_only(coefs, coefs)
        }
    }

    fn deltas(n: usize) -> Vec<SimVariant> {
        let delta = SimVariant {
            kind: VariantKind::Delta,
            num_blocks: 0,
            host_bytes: 1_000_000_000,
            rank: 0,
        };
        vec![delta; n]
    }

    /// The daemon's reports (host reads; GPU loads as given), 3 delta slots.
    fn reporting(gpu_load_reports: bool) -> SchedulerConfig {
        SchedulerConfig {
            host_copy_reports: true,
            gpu_load_reports,
            ..SchedulerConfig::new(16, 256, 4096)
        }
    }

    fn request(arrival_s: f64, output_len: u32, variant: u32) -> SimRequest {
        SimRequest {
            arrival_s,
            prompt_len: 4,
            output_len,
            variant,
            prompt_key: None,
        }
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    /// A base request decoding from 0 s and a request of delta 1 arriving at 0.105 s while it
    /// runs: its read goes out in the step sent at 0.11 s (done at 0.115 s), its copy with the
    /// one sent at 0.12 s.
    fn delta_beside_a_running_request(gpu_load_reports: bool, overlap_steps: bool) -> SimOutcome {
        let cfg = reporting(gpu_load_reports);
        let requests = [request(0.0, 40, 0), request(0.105, 4, 1)];
        let opts = one_worker(&cfg, overlap_steps);
        let out = simulate(&cfg, &requests, &deltas(1), &flat_model(), &opts).unwrap();
        assert!(
            out.finish_s.iter().all(|t| t.is_finite()),
            "the run finishes"
        );
        assert_eq!(out.output_tokens, vec![40, 4]);
        out
    }

    /// The first step that runs request `req`.
    fn first_step_of(out: &SimOutcome, req: u64) -> &StepRecord {
        out.steps
            .iter()
            .find(|s| s.entries.iter().any(|&(id, _)| id == req))
            .unwrap()
    }

    #[test]
    fn with_gpu_load_reports_a_delta_copies_beside_the_steps_and_its_request_waits_for_it() {
        let out = delta_beside_a_running_request(true, false);
        // The copy runs from 0.12 s (its step's start) to 0.215 s; the output at 0.22 s reports
        // it and the request goes in the step sent then.
        assert!(
            close(out.scheduled_s[1], 0.22),
            "admitted after the copy: {}",
            out.scheduled_s[1]
        );
        for step in &out.steps {
            assert!(
                close(step.end_s - step.start_s, STEP_S),
                "no step waits or grows for the copy: {step:?}"
            );
        }
        let between = out
            .steps
            .iter()
            .filter(|s| s.start_s > 0.12 - 1e-9 && s.start_s < 0.22 - 1e-9)
            .count();
        assert_eq!(
            between, 10,
            "the base request ran on while the delta copied"
        );
        assert!(out.counters["gpu_load_deferrals"] >= 10);
        assert_eq!(out.counters["adapter_gpu_loads"], 1);
        let steps = out.steps.len() as f64;
        assert!(
            close(out.busy_s[0], steps * STEP_S),
            "the copy is not device busy time"
        );
    }

    #[test]
    fn a_copy_beside_the_steps_starts_after_the_steps_queued_before_its_own() {
        // Overlapped steps: the step sent at the output at T runs from T + 10 ms (behind the
        // one in flight). The copy sent at 0.12 s starts when the step before its own ends,
        // 0.13 s, and ends at 0.225 s: the output at 0.22 s is too early to report it.
        let out = delta_beside_a_running_request(true, true);
        assert!(
            close(out.scheduled_s[1], 0.23),
            "admitted after the copy: {}",
            out.scheduled_s[1]
        );
        assert!(out.steps.iter().all(|s| close(s.end_s - s.start_s, STEP_S)));
        let first = first_step_of(&out, 1);
        assert!(first.ahead && close(first.start_s, 0.24));
    }

    #[test]
    fn copies_beside_the_steps_run_one_after_another_on_the_load_stream() {
        // Requests of delta 1 (copy 95 ms) and delta 2 (half its size: 47.5 ms) arrive together
        // while a base request runs; both are read from 0.11 s and loaded ahead in the step sent
        // at 0.12 s: delta 1 copies until 0.215 s, delta 2 after it, until 0.2625 s.
        let cfg = reporting(true);
        let mut variants = deltas(2);
        variants[1].host_bytes /= 2;
        let requests = [
            request(0.0, 40, 0),
            request(0.105, 4, 1),
            request(0.105, 4, 2),
        ];
        let out = simulate(
            &cfg,
            &requests,
            &variants,
            &flat_model(),
            &one_worker(&cfg, false),
        )
        .unwrap();
        assert!(out.finish_s.iter().all(|t| t.is_finite()));
        assert!(close(out.scheduled_s[1], 0.22), "{}", out.scheduled_s[1]);
        assert!(close(out.scheduled_s[2], 0.27), "{}", out.scheduled_s[2]);
    }

    #[test]
    fn without_gpu_load_reports_the_step_that_admits_a_delta_request_holds_its_copy() {
        let out = delta_beside_a_running_request(false, false);
        assert!(
            close(out.scheduled_s[1], 0.12),
            "admitted once read: {}",
            out.scheduled_s[1]
        );
        let load = first_step_of(&out, 1);
        assert!(close(load.start_s, 0.12) && close(load.end_s - load.start_s, STEP_S + COPY_S));
        let longer = out
            .steps
            .iter()
            .filter(|s| !close(s.end_s - s.start_s, STEP_S))
            .count();
        assert_eq!(longer, 1, "only the step with the copy");
        assert_eq!(out.counters["gpu_load_deferrals"], 0);
        let steps = out.steps.len() as f64;
        assert!(close(out.busy_s[0], steps * STEP_S + COPY_S));
    }

    #[test]
    fn with_nothing_else_running_the_step_waits_for_the_copy_it_carries() {
        let ends: Vec<(f64, f64)> = [false, true]
            .into_iter()
            .map(|reports| {
                let cfg = reporting(reports);
                let model = flat_model();
                let opts = one_worker(&cfg, true);
                let out = simulate(&cfg, &[request(0.0, 3, 1)], &deltas(1), &model, &opts).unwrap();
                assert_eq!(
                    out.counters["gpu_load_deferrals"], 0,
                    "admitted with its ToGpu"
                );
                (out.steps[0].start_s, out.steps[0].end_s)
            })
            .collect();
        // Inside the step: it starts once read and holds the copy; beside it: it starts once
        // the copy (from the read's end) is done and holds its compute alone. Same end.
        assert!(close(ends[0].0, READ_S) && close(ends[0].1, READ_S + COPY_S + STEP_S));
        assert!(close(ends[1].0, READ_S + COPY_S) && close(ends[1].1, READ_S + COPY_S + STEP_S));
    }

    #[test]
    fn overlapped_steps_with_many_deltas_and_few_slots_finish_and_never_hold_a_copy() {
        // Six deltas through two slots, arrivals every 20 ms over base requests that keep the
        // worker busy: loads ahead, evictions (DropGpu of deltas loaded ahead, then loaded
        // again) and admissions with the ToGpu when nothing else runs.
        let cfg = SchedulerConfig {
            max_deltas: 2,
            ..reporting(true)
        };
        let mut requests = Vec::new();
        for i in 0..60u32 {
            let variant = if i % 3 == 0 { 0 } else { 1 + (i * 7) % 6 };
            requests.push(request(f64::from(i) * 0.02, 3 + i % 9, variant));
        }
        let model = flat_model();
        let out = simulate(&cfg, &requests, &deltas(6), &model, &one_worker(&cfg, true)).unwrap();
        assert!(out.finish_s.iter().all(|t| t.is_finite()));
        let outputs: Vec<u32> = requests.iter().map(|r| r.output_len).collect();
        assert_eq!(out.output_tokens, outputs);
        assert!(out.counters["gpu_load_deferrals"] > 0);
        assert!(out.counters["adapter_gpu_evictions"] > 0);
        assert!(out.steps.iter().all(|s| close(s.end_s - s.start_s, STEP_S)));
        let without = SchedulerConfig {
            gpu_load_reports: false,
            ..cfg
        };
        let off = simulate(
            &without,
            &requests,
            &deltas(6),
            &model,
            &one_worker(&without, true),
        );
        let off = off.unwrap();
        assert!(
            off.steps
                .iter()
                .any(|s| s.end_s - s.start_s > STEP_S + 1e-9),
            "without reports, steps hold copies"
        );
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
