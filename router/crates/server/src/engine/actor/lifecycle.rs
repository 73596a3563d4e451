//! The worker's lifecycle as its actor handles it: a failed step (its requests fail, the others
//! go on), a lost worker (every request fails, the worker is marked unready and dropped), the
//! restart with back-off and a fresh scheduler (registrations kept, residency cold), and the
//! clean shutdown when the engine goes away.

use std::sync::atomic::Ordering;
use std::time::Duration;

use deltaserve_ipc::codec;
use deltaserve_ipc::wire;
use deltaserve_sched::Scheduler;

use super::{sched_config, Actor, SentStep, WorkerProcess};

impl Actor {
    /// A recoverable failure of the oldest step in flight (or, with `step_id` 0, of a frame
    /// the worker could not read, which it answers in that step's place): its requests fail,
    /// the others go on.
    pub(super) fn step_failed(&mut self, step_id: u64, message: &str) {
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
            if self.streams.contains(id) {
                self.sched.abort(id);
                self.fail(
                    id,
                    format!("the worker failed this request's step: {message}"),
                );
            }
        }
    }

    /// The worker is gone or unusable: fail everything, mark unready, and restart it.
    pub(super) fn worker_lost(&mut self, why: &str) {
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
        for id in self.streams.ids() {
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
    pub(super) async fn restart(&mut self) {
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

    /// Asks the worker to exit, then makes sure it has.
    pub(super) async fn shutdown(&mut self) {
        self.ready.store(false, Ordering::Release);
        for id in self.streams.ids() {
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
