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
//! the moves in the plan (`StepPlan::adapter_ops`); the actor only translates them (`plan.rs`).
//! Registration asks the worker to inspect a directory (`InspectVariant`, answered in order with
//! the step outputs by an `VariantInfo`), then the engine registers the footprint with every
//! actor's scheduler. Registrations outlive a worker restart; residency starts cold again.
//!
//! # Failures
//!
//! A variant whose files fail after registration is the worker's `StepOutput::failed_variants`:
//! only its requests fail, and it is unavailable until registered again (`actor/quarantine.rs`).
//! A recoverable `WorkerError` fails the requests of that step (they get an `Error` event); a
//! fatal one, an undecodable frame, or the process exiting fails every request of the worker and
//! restarts it, with back-off, while the handle reports the worker as not ready. No request is
//! ever left without a last event.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicUsize};
use std::sync::Arc;
use std::time::{Duration, Instant};

use deltaserve_ipc::codec::{self, FromWorker};
use deltaserve_ipc::wire::{self, StepOutput};
use deltaserve_sched::{Scheduler, SeqRequest, VariantSpec};
use tokio::sync::{mpsc, oneshot};

use super::admission::Admission;
use super::command::{ActorRef, Command, FailedVariants, RemoveOutcome, SharedAdmission};
use super::metrics::{ActorCounters, EngineMetrics, RequestLatency, WorkerReadings};
use super::plan::{sched_config, wire_plan, SchedLimits};
use super::streams::Streams;
use super::FinishReason;
use crate::text::tokenizer::TextTokenizer;
use crate::worker::{SpinWindow, StepPace, WorkerProcess, WorkerSpec};

mod expired;
mod lifecycle;
pub(crate) use expired::SLO_EXPIRED;
mod quarantine;
mod refused;
mod variants;

/// A plan sent to the worker and not answered yet.
struct SentStep {
    /// Its id.
    step_id: u64,
    /// The requests it scheduled.
    ids: Vec<u64>,
    /// When it was sent.
    sent_at: Instant,
    /// Its shape, for admission control's step costs: requests decoding one token, and prompt
    /// tokens (prefill chunks).
    decode_seqs: usize,
    prefill_tokens: usize,
}

/// One worker's actor.
pub(crate) struct Actor {
    index: usize,
    spec: WorkerSpec,
    limits: SchedLimits,
    commands: mpsc::UnboundedReceiver<Command>,
    ready: Arc<AtomicBool>,
    worker: Option<WorkerProcess>,
    sched: Scheduler,
    /// The live requests and their event streams.
    streams: Streams,
    next_id: u64,
    /// Plans sent to the worker and not answered yet, oldest first (two when overlapping).
    in_flight: VecDeque<SentStep>,
    /// The worker's step rhythm; sets when the receiver polls instead of sleeping.
    pace: StepPace,
    counters: ActorCounters,
    /// Adapters registered with this actor's scheduler, kept to re-register them with the fresh
    /// scheduler a restarted worker gets.
    adapters: BTreeMap<u32, VariantSpec>,
    /// `InspectVariant`s sent to the worker and not answered yet, by inspect id.
    inspections: HashMap<u64, oneshot::Sender<Result<wire::VariantInfo, String>>>,
    /// Next inspect id.
    next_inspect_id: u64,
    /// Registered adapters' names, for the errors of a variant that fails.
    adapter_names: BTreeMap<u32, String>,
    /// Variants the worker quarantined (`actor/quarantine.rs`), shared with the handle.
    failed_variants: FailedVariants,
    /// Admission control (`admission.rs`), shared with the handle: fed every step's time.
    admission: SharedAdmission,
    /// When the previous step output arrived (a step's time is at most the interval since).
    last_output_at: Option<Instant>,
    /// This worker's load for placement (`placement_load.rs`), shared with the handle.
    load: super::placement_load::SharedLoad,
}

/// What woke the actor up.
enum Wake {
    Command(Option<Command>),
    Worker(Result<FromWorker, String>),
    Exited(String),
}

impl Actor {
    /// Builds the actor around an already handshaken worker, and the reference the engine
    /// handle keeps to it. `latency`: the histograms every actor of the engine observes.
    pub(crate) fn new(
        index: usize,
        spec: WorkerSpec,
        limits: SchedLimits,
        tokenizer: Arc<TextTokenizer>,
        worker: WorkerProcess,
        latency: RequestLatency,
    ) -> anyhow::Result<(Self, ActorRef)> {
        let sched = Scheduler::new(sched_config(&worker, &limits))?;
        let (tx, commands) = mpsc::unbounded_channel();
        let outstanding = Arc::new(AtomicUsize::new(0));
        let ready = Arc::new(AtomicBool::new(true));
        let failed_variants = FailedVariants::default();
        let admission = SharedAdmission::new(std::sync::Mutex::new(Admission::new(
            limits.slo,
            limits.max_num_seqs,
            limits.max_num_batched_tokens,
        )));
        let load = super::placement_load::SharedLoad::default();
        let handle = ActorRef {
            tx,
            outstanding: outstanding.clone(),
            ready: ready.clone(),
            failed_variants: failed_variants.clone(),
            admission: admission.clone(),
            load: load.clone(),
        };
        let actor = Self {
            index,
            spec,
            limits,
            commands,
            ready,
            worker: Some(worker),
            sched,
            streams: Streams::new(tokenizer, outstanding, latency),
            next_id: 1,
            in_flight: VecDeque::new(),
            pace: StepPace::default(),
            counters: ActorCounters::default(),
            adapters: BTreeMap::new(),
            inspections: HashMap::new(),
            next_inspect_id: 1,
            adapter_names: BTreeMap::new(),
            failed_variants,
            admission,
            last_output_at: None,
            load,
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
                Wake::Worker(Ok(FromWorker::VariantInfo(info))) => self.inspected(info),
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
            Command::Generate {
                mut req,
                events,
                arrived,
            } => {
                let Some(worker) = self.worker.as_ref() else {
                    let message = "worker is restarting; retry shortly".into();
                    self.dequeued(req.prompt_token_ids.len() as u32);
                    self.streams.refuse(events, message);
                    return;
                };
                let id = self.next_id;
                self.next_id += 1;
                let seq_prompt_tokens = req.prompt_token_ids.len() as u32;
                // EOS (unless ignore_eos) and stop_token_ids end a request alike; the worker
                // bans them all below min_tokens.
                let ending = req.ending_token_ids(&worker.hello.model.eos_token_ids);
                if req.sampling.min_tokens > 0 {
                    req.sampling.min_tokens_banned = ending.clone();
                }
                let seq = SeqRequest {
                    id,
                    prompt: req.prompt_token_ids.clone(),
                    max_tokens: req.max_tokens,
                    eos_token_ids: ending,
                    ignore_eos: false,
                    arrival: id,
                    adapter_id: req.adapter_id,
                    // Prompt logprobs need every prompt position's logits: no cached prefix.
                    skip_prefix_cache: req.sampling.prompt_logprobs.is_some(),
                };
                match self.sched.add_request(seq) {
                    Ok(()) => self.streams.open(id, req, events, arrived),
                    Err(e) => {
                        self.dequeued(seq_prompt_tokens);
                        self.streams.refuse(events, e.to_string());
                    }
                }
            }
            Command::Metrics { reply } => {
                let _ = reply.send(self.metrics());
            }
            Command::Inspect { path, kind, reply } => self.inspect(path, kind, reply),
            Command::AddAdapter {
                id,
                name,
                spec,
                reply,
            } => self.add_adapter(id, name, spec, reply),
            Command::RemoveAdapter { id, reply } => self.remove_adapter(id, reply),
            Command::AbortAll { message } => {
                for id in self.streams.ids() {
                    self.sched.abort(id);
                    self.fail(id, message.clone());
                }
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
        for id in self.streams.abandoned() {
            self.sched.abort(id);
            self.end(id, None);
        }
        self.expire_queued();
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
        let (mut left_queue, mut left_tokens, mut prefill_tokens) = (0, 0u64, 0);
        for n in &step.new {
            prefill_tokens += n.num_scheduled_tokens as usize;
            if self.streams.scheduled(n.id) {
                left_queue += 1;
                left_tokens += u64::from(n.num_prompt_tokens);
            }
        }
        let mut decode_seqs = 0;
        for r in &step.running {
            match r.num_scheduled_tokens {
                1 => decode_seqs += 1,
                n => prefill_tokens += n as usize,
            }
        }
        self.admission
            .lock()
            .expect("admission lock")
            .launched(left_queue, left_tokens);
        let (plan, ids) = wire_plan(step, |id| self.streams.sampling(id));
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
            decode_seqs,
            prefill_tokens,
        });
    }

    /// When to poll for the step in flight instead of sleeping (GPU workers only: a CPU worker
    /// needs every core for its forward pass).
    fn spin_window(&self) -> Option<SpinWindow> {
        let oldest = self.in_flight.front()?;
        if self.spec.device() == "cpu" {
            return None;
        }
        self.pace.spin_window(oldest.sent_at)
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
        let received = self.pace.output_arrived(oldest.sent_at);
        self.counters.gaps.push(out.timing.gap_us);
        self.counters.worker_step_us += out.timing.total_us;
        self.counters.worker_forward_us += out.timing.forward_us;
        self.counters.worker_floor_us += out.timing.floor_us;
        self.counters.worker_busy_us += out.timing.busy_us;
        self.counters.adapter_host_bytes_measured = out.adapter_host_bytes;
        self.counters.cpu_assisted_prefills += u64::from(out.cpu_assisted_prefills);
        self.counters.cpu_assist_fallbacks += u64::from(out.cpu_assist_fallbacks);
        self.counters.cpu_assist_declined += u64::from(out.cpu_assist_declined);
        self.counters.speculated_prefills += u64::from(out.speculated_prefills);
        self.counters.speculation_accepted += u64::from(out.speculation_accepted);
        self.counters.speculation_recomputed_layers += u64::from(out.speculation_recomputed_layers);
        // Before the next plan: requests whose adapter was being read, or whose delta was being
        // copied onto the GPU, may be admitted now.
        self.sched.host_copies_ready(&out.host_ready);
        self.sched.gpu_copies_ready(&out.gpu_ready);
        // A variant the worker quarantined fails only its own requests (none has an output).
        self.variants_failed(&out.failed_variants);
        // A request whose grammar the worker refused fails alone (it has no output).
        self.requests_refused(&out.refused_requests);

        // Requests ended since the step was sent are no longer the scheduler's: skip them.
        let sampled: Vec<(u64, Option<u32>)> = out
            .outputs
            .iter()
            .filter(|o| self.streams.contains(o.req_id))
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
        // Off the critical path: the new cap applies from the next plan formed.
        let worker_us = match out.timing.busy_us {
            0 => out.timing.total_us,
            busy => busy,
        };
        self.measure_step(&oldest, worker_us, received);

        let (tokens, ended) = self.streams.stream(updates, &out.outputs);
        self.counters.tokens += tokens;
        for e in ended {
            if e.stopped {
                self.sched.finish(e.id);
            }
            self.end(e.id, Some(e.reason));
        }
    }

    /// Feeds a step's measured time to admission control (the smaller of the worker's time on
    /// it and the interval since the previous output, see `admission.rs`) and gives the scheduler
    /// the running-batch cap that keeps the decode step within the TPOT SLO.
    fn measure_step(&mut self, step: &SentStep, worker_us: u64, received: Instant) {
        let since_previous = self
            .last_output_at
            .replace(received)
            .map(|t| received.saturating_duration_since(t).as_micros() as u64)
            .unwrap_or(u64::MAX);
        let step_us = worker_us.min(since_previous) as f64;
        let running = self.sched.num_running();
        let cap = {
            let mut admission = self.admission.lock().expect("admission lock");
            admission.step_measured(step.decode_seqs, step.prefill_tokens, step_us, running);
            admission.cap()
        };
        self.sched.set_max_num_seqs(cap);
        self.publish_load();
    }

    /// Publishes this worker's live requests per variant and the variants it holds, for
    /// placement across workers (only while the handle wants them: more than one worker).
    fn publish_load(&self) {
        if !self.load.wanted.load(std::sync::atomic::Ordering::Relaxed) {
            return;
        }
        let load =
            super::placement_load::WorkerLoad::of(&self.sched, self.adapters.keys().copied());
        self.load.publish(load);
    }

    /// An admitted request of `prompt_tokens` left the admission queue unscheduled.
    fn dequeued(&mut self, prompt_tokens: u32) {
        let mut admission = self.admission.lock().expect("admission lock");
        admission.dequeued(1, u64::from(prompt_tokens));
    }

    /// Tells admission control the running batch's size after a request ended between steps
    /// (a stop string, a cancel, an error): with no further step it would be stale.
    fn publish_running(&mut self) {
        let running = self.sched.num_running();
        self.admission
            .lock()
            .expect("admission lock")
            .set_running(running);
    }

    /// Ends a request: a `Finished` event (`Some(reason)`), or silently when the client is gone.
    fn end(&mut self, id: u64, reason: Option<FinishReason>) {
        if let Some(tokens) = self.streams.queued_prompt_tokens(id) {
            self.dequeued(tokens);
        }
        if self.streams.end(id, reason) {
            match reason {
                Some(_) => self.counters.finished += 1,
                None => self.counters.aborted += 1,
            }
            self.publish_running();
        }
    }

    /// Ends a request with an `Error` event.
    fn fail(&mut self, id: u64, message: String) {
        if let Some(tokens) = self.streams.queued_prompt_tokens(id) {
            self.dequeued(tokens);
        }
        if self.streams.fail(id, message) {
            self.counters.aborted += 1;
            self.publish_running();
        }
    }

    fn metrics(&self) -> EngineMetrics {
        let admission = self.admission.lock().expect("admission lock").readings();
        EngineMetrics::of_worker(&WorkerReadings {
            sched: self.sched.stats(),
            actor: &self.counters,
            latency: self.streams.latency(),
            admission,
            placement: self.load.readings(),
        })
    }
}
