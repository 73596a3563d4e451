//! S-LoRA's early abort: with a TTFT SLO (`--ttft-slo-ms`), a request still queued (no step has
//! scheduled it) once it has waited longer than the SLO can no longer get its first token in
//! time. Before each step it is answered with a 429 whose message starts with [`SLO_EXPIRED`]
//! (the API answers it as an SLO refusal, `Retry-After` included) instead of taking a place in
//! the batch that a request still able to keep its SLO could use. Requests already scheduled,
//! preempted ones included, are never aborted this way.

use std::time::Duration;

use super::Actor;

/// How an expired request's error message begins (the API maps it to a 429).
pub const SLO_EXPIRED: &str = "expired in the queue: ";

impl Actor {
    /// Aborts the queued requests that waited past the TTFT SLO (see the module docs).
    pub(super) fn expire_queued(&mut self) {
        let Some(slo_us) = self
            .admission
            .lock()
            .expect("admission lock")
            .ttft_slo_bound_us()
        else {
            return;
        };
        let slo = Duration::from_micros(slo_us as u64);
        for id in self.streams.queued_longer_than(slo) {
            self.sched.abort(id);
            self.counters.expired_in_queue += 1;
            tracing::info!(worker = self.index, req = id, "expired in the queue");
            self.fail(
                id,
                format!(
                    "{SLO_EXPIRED}the request waited over --ttft-slo-ms ({} ms) for a place in the \
                     running batch, so its first token could no longer come in time; retry later",
                    slo.as_millis()
                ),
            );
        }
    }
}
