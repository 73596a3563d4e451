//! The engine actor: one task per worker that owns that worker's scheduler, its requests and
//! the link to its process (STYLE.md #7: handle + command enum + one task owning the state).
//!
//! # One iteration
//!
//! ```text
//!  StepOutput N arrives ─▶ scheduler.update(N) ─▶ schedule_ahead N+2 ─▶ send plan N+2
//!                          (N+1 is already on the worker)                    │
//!                          then, while the worker computes N+1:              ▼
//!                          detokenize N, check stop strings, stream events, drop cancelled requests
//! ```
//!
//! Overlapped steps (`--overlap-steps`, on by default): two plans are outstanding. Right after
//! sending plan N the actor forms N+1 with `Scheduler::schedule_ahead`, which schedules every
//! request N samples for the token it does not know yet, and sends it too; the worker launches
//! N+1 on the device behind N and computes those tokens from N's sampled tensor, so neither the
//! router's scheduling nor the worker's host work leaves the device idle. When a lookahead would
//! have to preempt (or nothing more can run) it is not formed: the actor waits for N's output and
//! schedules as usual. Off, one plan is outstanding and N+1 is scheduled once N's output is in.
//!
//! Scheduling before the streaming work keeps the worker's idle gap (the router + IPC overhead,
//! reported by the worker as `StepTiming::gap_us`) small. A request that EOS, a stop string or a
//! cancel ends after a later plan was sent is computed once more for nothing; its output is
//! ignored and the next plan releases it. The worker runs steps strictly in order, so pages freed
//! here are never written by two requests in the same step.
//!
//! # Adapters
//!
//! The scheduler decides where each variant lives (disk, host memory, pages of the worker's pool
//! for a LoRA adapter, one of the worker's `--max-deltas` slots for a compressed delta) and puts
//! the moves in the plan (`StepPlan::adapter_ops`); the actor only translates them.
//! Registration asks the worker to inspect a directory (`InspectAdapter`, answered in order with
//! the step outputs by an `AdapterInfo`), then the engine registers the footprint with every
//! actor's scheduler. Registrations outlive a worker restart; residency starts cold again.
//!
//! # Failures
//!
//! A recoverable `WorkerError` fails the requests of that step (they get an `Error` event); a
//! fatal one, an undecodable frame, or the process exiting fails every request of the worker and
//! restarts it, with back-off, while the handle reports the worker as not ready. No request is
//! ever left without a last event.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use deltaserve_ipc::codec::{self, FromWorker};
use deltaserve_ipc::wire::{self, SamplingParams, StepOutput, StepPlan};
use deltaserve_sched::{
    AdapterOp as SchedAdapterOp, AdapterOpKind, AdapterSpec, FinishReason as SchedFinish,
    Scheduler, SchedulerConfig, SeqRequest,
};
use tokio::sync::{mpsc, oneshot};

use crate::engine::{ActorRef, Command, EngineMetrics, FinishReason, GenerateEvent, RemoveOutcome};
use crate::text::detok::DetokStream;
use crate::text::tokenizer::TextTokenizer;
use crate::worker::{SpinWindow, WorkerProcess, WorkerSpec};

/// How many recent step gaps the percentile metrics look at.
const GAP_WINDOW: usize = 4096;

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
    /// Send step N+1 before step N's output is back (see "Overlapped steps" above).
    pub overlap_steps: bool,
}

/// A plan sent to the worker and not answered yet.
struct SentStep {
    /// Its id.
    step_id: u64,
    /// The requests it scheduled.
    ids: Vec<u64>,
    /// When it was sent.
    sent_at: Instant,
}

/// A request this actor owns.
struct Live {
    /// Where the request's events go; closed when the client went away.
    events: mpsc::UnboundedSender<GenerateEvent>,
    /// Incremental detokenizer with the request's stop strings.
    detok: DetokStream,
    /// Sampling parameters, sent with the request whenever it is (re)sent in full.
    sampling: SamplingParams,
    /// Prompt length, for usage.
    prompt_tokens: u32,
    /// Tokens generated so far, for usage.
    completion_tokens: u32,
}

/// Counters kept by the actor.
#[derive(Default)]
struct Counters {
    steps: u64,
    /// Steps formed by `schedule_ahead` (sent while another was outstanding).
    steps_ahead: u64,
    finished: u64,
    aborted: u64,
    tokens: u64,
    preemptions: u64,
    restarts: u64,
    /// Recent `gap_us` values reported by the worker.
    gaps: Window,
    /// Recent router shares of the gap: output decoded → next plan sent, in microseconds.
    router_us: Window,
    /// The worker's measured host bytes of adapter copies, from its last step output.
    adapter_host_bytes_measured: u64,
    /// Sum of the worker's reported step times (`total_us`), microseconds.
    worker_step_us: u64,
    /// Sum of their forward-and-sampling parts (`forward_us`), microseconds.
    worker_forward_us: u64,
}

/// The last [`GAP_WINDOW`] samples of a latency, for percentiles.
#[derive(Default)]
struct Window(VecDeque<u64>);

impl Window {
    fn push(&mut self, v: u64) {
        if self.0.len() == GAP_WINDOW {
            self.0.pop_front();
        }
        self.0.push_back(v);
    }

    /// Percentiles `ps` (each in 0..=1) by nearest rank; 0 when empty.
    fn percentiles<const N: usize>(&self, ps: [f64; N]) -> [u64; N] {
        let mut v: Vec<u64> = self.0.iter().copied().collect();
        v.sort_unstable();
        ps.map(|p| {
            if v.is_empty() {
                0
            } else {
                v[((v.len() - 1) as f64 * p).round() as usize]
            }
        })
    }
}

/// One worker's actor.
pub(crate) struct Actor {
    index: usize,
    spec: WorkerSpec,
    limits: SchedLimits,
    tokenizer: Arc<TextTokenizer>,
    commands: mpsc::UnboundedReceiver<Command>,
    outstanding: Arc<AtomicUsize>,
    ready: Arc<AtomicBool>,
    worker: Option<WorkerProcess>,
    sched: Scheduler,
    live: BTreeMap<u64, Live>,
    next_id: u64,
    /// Plans sent to the worker and not answered yet, oldest first (two when overlapping).
    in_flight: VecDeque<SentStep>,
    /// When the last step output arrived (a step sent before it started then).
    last_output_at: Instant,
    /// Moving average of a step's round trip (plan sent → output back), in seconds; sets when
    /// the receiver starts polling instead of sleeping.
    step_secs: f64,
    counters: Counters,
    /// Adapters registered with this actor's scheduler, kept to re-register them with the fresh
    /// scheduler a restarted worker gets.
    adapters: BTreeMap<u32, AdapterSpec>,
    /// `InspectAdapter`s sent to the worker and not answered yet, by inspect id.
    inspections: HashMap<u64, oneshot::Sender<Result<wire::AdapterInfo, String>>>,
    /// Next inspect id.
    next_inspect_id: u64,
}

/// What woke the actor up.
enum Wake {
    Command(Option<Command>),
    Worker(Result<FromWorker, String>),
    Exited(String),
}

impl Actor {
    /// Builds the actor around an already handshaken worker, and the reference the engine
    /// handle keeps to it.
    pub(crate) fn new(
        index: usize,
        spec: WorkerSpec,
        limits: SchedLimits,
        tokenizer: Arc<TextTokenizer>,
        worker: WorkerProcess,
    ) -> anyhow::Result<(Self, ActorRef)> {
        let sched = Scheduler::new(sched_config(&worker, &limits))?;
        let (tx, commands) = mpsc::unbounded_channel();
        let outstanding = Arc::new(AtomicUsize::new(0));
        let ready = Arc::new(AtomicBool::new(true));
        let handle = ActorRef {
            tx,
            outstanding: outstanding.clone(),
            ready: ready.clone(),
        };
        let actor = Self {
            index,
            spec,
            limits,
            tokenizer,
            commands,
            outstanding,
            ready,
            worker: Some(worker),
            sched,
            live: BTreeMap::new(),
            next_id: 1,
            in_flight: VecDeque::new(),
            last_output_at: Instant::now(),
            step_secs: 0.0,
            counters: Counters::default(),
            adapters: BTreeMap::new(),
            inspections: HashMap::new(),
            next_inspect_id: 1,
        };
        Ok((actor, handle))
    }

    /// Runs until every handle is gone, then shuts the worker down.
    pub(crate) async fn run(mut self) {
        loop {
            if self.worker.is_none() {
                self.restart().await;
                if self.worker.is_none() {
                    // Restart failed: keep answering commands (with errors) while backing off.
                    match tokio::time::timeout(Duration::from_secs(2), self.commands.recv()).await {
                        Ok(None) => return,
                        Ok(Some(cmd)) => self.on_command(cmd),
                        Err(_) => {}
                    }
                    continue;
                }
            }
            self.keep_busy();
            let spin = self.spin_window();
            let wake = {
                let worker = self.worker.as_mut().expect("worker present");
                tokio::select! {
                    cmd = self.commands.recv() => Wake::Command(cmd),
                    msg = worker.from_worker.recv(spin) => Wake::Worker(msg),
                    status = worker.child.wait() => Wake::Exited(match status {
                        Ok(s) => s.to_string(),
                        Err(e) => e.to_string(),
                    }),
                }
            };
            match wake {
                Wake::Command(None) => break,
                Wake::Command(Some(cmd)) => self.on_command(cmd),
                Wake::Worker(Ok(FromWorker::StepOutput(out))) => self.on_step_output(out),
                Wake::Worker(Ok(FromWorker::WorkerError(err))) => {
                    if err.fatal {
                        self.worker_lost(&format!(
                            "worker reported a fatal error: {}",
                            err.message
                        ));
                    } else {
                        self.step_failed(err.step_id, &err.message);
                    }
                }
                Wake::Worker(Ok(FromWorker::AdapterInfo(info))) => {
                    match self.inspections.remove(&info.inspect_id) {
                        Some(reply) => {
                            let _ = reply.send(Ok(info));
                        }
                        None => self.worker_lost(&format!(
                            "worker answered inspection {} nobody asked for",
                            info.inspect_id
                        )),
                    }
                }
                Wake::Worker(Ok(FromWorker::Hello(_))) => {
                    self.worker_lost("worker sent a second Hello");
                }
                Wake::Worker(Err(e)) => self.worker_lost(&format!("worker link broke: {e}")),
                Wake::Exited(status) => self.worker_lost(&format!("worker exited ({status})")),
            }
        }
        self.shutdown().await;
    }

    fn on_command(&mut self, cmd: Command) {
        match cmd {
            Command::Generate { req, events } => {
                if self.worker.is_none() {
                    let _ = events.send(GenerateEvent::Error {
                        message: "worker is restarting; retry shortly".into(),
                    });
                    self.outstanding.fetch_sub(1, Ordering::Relaxed);
                    return;
                }
                let id = self.next_id;
                self.next_id += 1;
                let seq = SeqRequest {
                    id,
                    prompt: req.prompt_token_ids.clone(),
                    max_tokens: req.max_tokens,
                    eos_token_ids: self
                        .worker
                        .as_ref()
                        .map(|w| w.hello.model.eos_token_ids.clone())
                        .unwrap_or_default(),
                    ignore_eos: req.ignore_eos,
                    arrival: id,
                    adapter_id: req.adapter_id,
                };
                if let Err(e) = self.sched.add_request(seq) {
                    let _ = events.send(GenerateEvent::Error {
                        message: e.to_string(),
                    });
                    self.outstanding.fetch_sub(1, Ordering::Relaxed);
                    return;
                }
                let detok =
                    DetokStream::new(self.tokenizer.clone(), &req.prompt_token_ids, req.stop);
                self.live.insert(
                    id,
                    Live {
                        events,
                        detok,
                        sampling: req.sampling,
                        prompt_tokens: req.prompt_token_ids.len() as u32,
                        completion_tokens: 0,
                    },
                );
            }
            Command::Metrics { reply } => {
                let _ = reply.send(self.metrics());
            }
            Command::Inspect { path, reply } => {
                let Some(worker) = self.worker.as_mut() else {
                    let _ = reply.send(Err("the worker is restarting; retry shortly".into()));
                    return;
                };
                let inspect_id = self.next_inspect_id;
                self.next_inspect_id += 1;
                let frame = codec::encode(&wire::InspectAdapter { inspect_id, path });
                if let Err(e) = worker.to_worker.send(&frame) {
                    let _ = reply.send(Err(format!("could not reach the worker: {e}")));
                    self.worker_lost(&format!("could not send an inspection to the worker: {e}"));
                    return;
                }
                self.inspections.insert(inspect_id, reply);
            }
            Command::AddAdapter { id, spec, reply } => {
                let result = self
                    .sched
                    .register_adapter(id, spec.clone())
                    .map_err(|e| format!("worker {}: {e}", self.index));
                if result.is_ok() {
                    self.adapters.insert(id, spec);
                }
                let _ = reply.send(result);
            }
            Command::RemoveAdapter { id, reply } => {
                let users = self.sched.adapter_users(id);
                if users > 0 {
                    let _ = reply.send(RemoveOutcome::InUse(users));
                    return;
                }
                // Unknown here (a rolled-back registration) is as good as removed.
                let _ = self.sched.unregister_adapter(id);
                self.adapters.remove(&id);
                let _ = reply.send(RemoveOutcome::Removed);
            }
        }
    }

    /// Sends what can run now: a step when none is outstanding, and with `overlap_steps` the
    /// step after the one outstanding.
    fn keep_busy(&mut self) {
        if self.in_flight.is_empty() {
            self.launch_step(false);
        }
        if self.limits.overlap_steps && self.in_flight.len() == 1 && self.worker.is_some() {
            self.launch_step(true);
        }
    }

    /// Drops requests whose client went away, then schedules and sends the next step if there
    /// is work; `ahead`: the step after the one outstanding (`Scheduler::schedule_ahead`).
    fn launch_step(&mut self, ahead: bool) {
        let gone: Vec<u64> = self
            .live
            .iter()
            .filter(|(_, l)| l.events.is_closed())
            .map(|(id, _)| *id)
            .collect();
        for id in gone {
            self.sched.abort(id);
            self.end(id, None);
        }
        if !self.sched.has_unfinished() {
            return;
        }
        let step = if ahead {
            self.sched.schedule_ahead()
        } else {
            self.sched.schedule()
        };
        if step.is_empty() {
            return;
        }
        self.counters.preemptions += step.preempted.len() as u64;
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
                    sampling: self
                        .live
                        .get(&n.id)
                        .map(|l| l.sampling.clone())
                        .unwrap_or_default(),
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
        let frame = codec::encode(&plan);
        let worker = self.worker.as_mut().expect("worker present");
        if let Err(e) = worker.to_worker.send(&frame) {
            self.worker_lost(&format!("could not send a step to the worker: {e}"));
            return;
        }
        self.counters.steps += 1;
        self.counters.steps_ahead += u64::from(ahead);
        self.in_flight.push_back(SentStep {
            step_id: plan.step_id,
            ids,
            sent_at: Instant::now(),
        });
    }

    /// When to poll for the step in flight instead of sleeping (GPU workers only: a CPU worker
    /// needs every core for its forward pass). The window is centred on the expected arrival,
    /// the moving average of the step round trip, ± 10% of it (at least 0.2 ms, at most 3 ms).
    fn spin_window(&self) -> Option<SpinWindow> {
        let oldest = self.in_flight.front()?;
        if self.spec.device == "cpu" || self.step_secs <= 0.0 {
            return None;
        }
        let started = self.started_at(oldest);
        let expected = started + Duration::from_secs_f64(self.step_secs);
        let margin = Duration::from_secs_f64(self.step_secs * 0.1)
            .clamp(Duration::from_micros(200), Duration::from_millis(3));
        Some(SpinWindow {
            from: expected.checked_sub(margin).unwrap_or(started).max(started),
            until: expected + margin,
        })
    }

    /// When the worker could start `step`: when it was sent, or, when it was sent ahead, when
    /// the step before it came back.
    fn started_at(&self, step: &SentStep) -> Instant {
        step.sent_at.max(self.last_output_at)
    }

    fn on_step_output(&mut self, out: StepOutput) {
        let Some(oldest) = self.in_flight.pop_front() else {
            self.worker_lost(&format!("worker answered step {} nobody sent", out.step_id));
            return;
        };
        if oldest.step_id != out.step_id {
            self.worker_lost(&format!(
                "worker answered step {} out of turn (expected {})",
                out.step_id, oldest.step_id
            ));
            return;
        }
        let received = Instant::now();
        let took = (received - self.started_at(&oldest)).as_secs_f64();
        self.last_output_at = received;
        self.step_secs = if self.step_secs == 0.0 {
            took
        } else {
            0.8 * self.step_secs + 0.2 * took
        };
        self.counters.gaps.push(out.timing.gap_us);
        self.counters.worker_step_us += out.timing.total_us;
        self.counters.worker_forward_us += out.timing.forward_us;
        self.counters.adapter_host_bytes_measured = out.adapter_host_bytes;
        // Before the next plan: requests whose adapter was being read may be admitted now.
        self.sched.host_copies_ready(&out.host_ready);

        // Requests ended since the step was sent are no longer the scheduler's: skip them.
        let sampled: Vec<(u64, Option<u32>)> = out
            .outputs
            .iter()
            .filter(|o| self.live.contains_key(&o.req_id))
            .map(|o| (o.req_id, o.token_id))
            .collect();
        let updates = self.sched.update(&sampled);

        // Keep the worker busy before doing the per-token work.
        let sent = self.counters.steps;
        self.keep_busy();
        if self.counters.steps != sent {
            self.counters
                .router_us
                .push(received.elapsed().as_micros() as u64);
        }

        let by_id: HashMap<u64, &wire::RequestOutput> =
            out.outputs.iter().map(|o| (o.req_id, o)).collect();
        for u in updates {
            let Some(live) = self.live.get_mut(&u.id) else {
                continue;
            };
            live.completion_tokens += 1;
            self.counters.tokens += 1;
            let step_text = live.detok.push(u.token);
            let mut text = step_text.delta;
            let reason = if step_text.stopped {
                Some(FinishReason::Stop)
            } else {
                match u.finished {
                    Some(SchedFinish::Eos) => Some(FinishReason::Stop),
                    Some(SchedFinish::Length) => Some(FinishReason::Length),
                    None => None,
                }
            };
            if reason.is_some() && !step_text.stopped {
                text.push_str(&live.detok.flush());
            }
            let (logprob, top_logprobs) = match by_id.get(&u.id) {
                Some(o) => (o.logprob, o.top_logprobs.clone()),
                None => (None, Vec::new()),
            };
            let _ = live.events.send(GenerateEvent::Token {
                token_id: u.token,
                text,
                logprob,
                top_logprobs,
            });
            if let Some(reason) = reason {
                if step_text.stopped {
                    self.sched.finish(u.id);
                }
                self.end(u.id, Some(reason));
            }
        }
    }

    /// A recoverable failure of the oldest step in flight (or, with `step_id` 0, of a frame
    /// the worker could not read, which it answers in that step's place): its requests fail,
    /// the others go on.
    fn step_failed(&mut self, step_id: u64, message: &str) {
        let Some(SentStep {
            step_id: oldest,
            ids,
            ..
        }) = self.in_flight.pop_front()
        else {
            self.worker_lost(&format!(
                "worker reported an error outside a step: {message}"
            ));
            return;
        };
        if step_id != 0 && step_id != oldest {
            self.worker_lost(&format!(
                "worker reported step {step_id} failed while step {oldest} was due: {message}"
            ));
            return;
        }
        tracing::warn!(
            worker = self.index,
            step_id = oldest,
            "step failed: {message}"
        );
        // The step produced nothing: the scheduler closes it as unanswered (which also keeps
        // a step formed ahead of it from being taken for it), then its requests fail.
        self.sched.update(&[]);
        for id in ids {
            if self.live.contains_key(&id) {
                self.sched.abort(id);
                self.fail(
                    id,
                    format!("the worker failed this request's step: {message}"),
                );
            }
        }
    }

    /// The worker is gone or unusable: fail everything, mark unready, and restart it.
    fn worker_lost(&mut self, why: &str) {
        tracing::error!(
            worker = self.index,
            "{why}; failing its requests and restarting it"
        );
        self.ready.store(false, Ordering::Release);
        self.worker = None; // kills the process (kill_on_drop)
        self.in_flight.clear();
        for (_, reply) in self.inspections.drain() {
            let _ = reply.send(Err(format!(
                "the worker failed during the inspection ({why})"
            )));
        }
        let ids: Vec<u64> = self.live.keys().copied().collect();
        for id in ids {
            self.fail(
                id,
                format!(
                    "worker {} failed ({why}); the request was dropped",
                    self.index
                ),
            );
        }
    }

    /// Starts a fresh worker and a fresh scheduler over its KV pool.
    async fn restart(&mut self) {
        self.counters.restarts += 1;
        let backoff = Duration::from_millis(500 * self.counters.restarts.min(20));
        tokio::time::sleep(backoff).await;
        match WorkerProcess::spawn(&self.spec, self.index).await {
            Ok(worker) => match Scheduler::new(sched_config(&worker, &self.limits)) {
                Ok(mut sched) => {
                    // Registrations outlive the worker; residency starts cold.
                    for (&id, spec) in &self.adapters {
                        if let Err(e) = sched.register_adapter(id, spec.clone()) {
                            tracing::error!(
                                worker = self.index,
                                adapter = id,
                                "re-registering after restart: {e}"
                            );
                        }
                    }
                    self.sched = sched;
                    self.worker = Some(worker);
                    self.ready.store(true, Ordering::Release);
                    tracing::info!(worker = self.index, "worker restarted");
                }
                Err(e) => tracing::error!(worker = self.index, "restarted worker unusable: {e}"),
            },
            Err(e) => tracing::error!(worker = self.index, "restarting worker failed: {e}"),
        }
    }

    /// Ends a request: a `Finished` event (`Some(reason)`), or silently when the client is gone.
    fn end(&mut self, id: u64, reason: Option<FinishReason>) {
        let Some(live) = self.live.remove(&id) else {
            return;
        };
        match reason {
            Some(reason) => {
                self.counters.finished += 1;
                let _ = live.events.send(GenerateEvent::Finished {
                    reason,
                    prompt_tokens: live.prompt_tokens,
                    completion_tokens: live.completion_tokens,
                });
            }
            None => self.counters.aborted += 1,
        }
        self.outstanding.fetch_sub(1, Ordering::Relaxed);
    }

    /// Ends a request with an `Error` event.
    fn fail(&mut self, id: u64, message: String) {
        let Some(live) = self.live.remove(&id) else {
            return;
        };
        self.counters.aborted += 1;
        let _ = live.events.send(GenerateEvent::Error { message });
        self.outstanding.fetch_sub(1, Ordering::Relaxed);
    }

    fn metrics(&self) -> EngineMetrics {
        let stats = self.sched.stats();
        let [gap_p50, gap_p99] = self.counters.gaps.percentiles([0.5, 0.99]);
        let [router_p50, router_p99] = self.counters.router_us.percentiles([0.5, 0.99]);
        EngineMetrics {
            requests_waiting: stats.waiting as u64,
            requests_running: stats.running as u64,
            kv_blocks_total: stats.total_blocks as u64,
            kv_blocks_free: stats.free_blocks as u64,
            steps_total: self.counters.steps,
            steps_ahead_total: self.counters.steps_ahead,
            preemptions_total: self.counters.preemptions,
            requests_finished_total: self.counters.finished,
            requests_aborted_total: self.counters.aborted,
            tokens_generated_total: self.counters.tokens,
            step_gap_us_p50: gap_p50,
            step_gap_us_p99: gap_p99,
            step_router_us_p50: router_p50,
            step_router_us_p99: router_p99,
            worker_restarts_total: self.counters.restarts,
            adapters_registered: 0,
            adapters_on_gpu: stats.adapters_on_gpu as u64,
            deltas_on_gpu: stats.deltas_on_gpu as u64,
            delta_skips_total: stats.delta_skips,
            delta_skip_preemptions_total: stats.delta_skip_preemptions,
            adapter_blocks: stats.adapter_blocks as u64,
            adapter_host_bytes: stats.host_adapter_bytes,
            adapter_host_bytes_measured: self.counters.adapter_host_bytes_measured,
            adapter_gpu_loads_total: stats.adapter_gpu_loads,
            adapter_host_loads_total: stats.adapter_host_loads,
            adapter_gpu_evictions_total: stats.adapter_gpu_evictions,
            adapter_host_deferrals_total: stats.host_deferrals,
            worker_step_us_total: self.counters.worker_step_us,
            worker_forward_us_total: self.counters.worker_forward_us,
        }
    }

    /// Asks the worker to exit, then makes sure it has.
    async fn shutdown(&mut self) {
        self.ready.store(false, Ordering::Release);
        let ids: Vec<u64> = self.live.keys().copied().collect();
        for id in ids {
            self.fail(id, "the server is shutting down".into());
        }
        if let Some(mut worker) = self.worker.take() {
            let frame = codec::encode(&wire::Shutdown {
                reason: "router shutdown".into(),
            });
            let _ = worker.to_worker.send(&frame);
            if tokio::time::timeout(Duration::from_secs(10), worker.child.wait())
                .await
                .is_err()
            {
                let _ = worker.child.start_kill();
            }
        }
    }
}

/// Scheduler configuration from what the worker reported plus the operator's limits.
fn sched_config(worker: &WorkerProcess, limits: &SchedLimits) -> SchedulerConfig {
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

/// The wire form of a scheduler's adapter op (`AdapterOp::op` strings are the wire's contract).
fn wire_op(op: SchedAdapterOp) -> wire::AdapterOp {
    let (name, path, block_ids) = match op.kind {
        AdapterOpKind::ToHost { path } => ("to_host", path, Vec::new()),
        AdapterOpKind::ToGpu { block_ids } => ("to_gpu", String::new(), block_ids),
        AdapterOpKind::DropGpu => ("drop_gpu", String::new(), Vec::new()),
        AdapterOpKind::DropHost => ("drop_host", String::new(), Vec::new()),
    };
    wire::AdapterOp {
        adapter_id: op.adapter_id,
        op: name.into(),
        path,
        block_ids,
    }
}
