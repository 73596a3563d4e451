//! [`QueueDrain`]: how fast one worker's admission queue drains while requests wait in it (see
//! `admission.rs`'s module docs): the requests that left it per microsecond, over the steps that
//! were sent with requests still waiting (otherwise the arrivals, not the server, set how many
//! left), each step's weight decaying over [`DRAIN_WINDOW_STEPS`].

/// Backlogged steps measured before the queue's drain rate replaces the modelled slot wait.
pub const MIN_DRAIN_STEPS: u32 = 16;
/// The drain rate's memory: each backlogged step's weight decays by `1 - 1 / this`.
pub const DRAIN_WINDOW_STEPS: f64 = 64.0;

/// The measurement: requests that left since the last measured step, whether the last step sent
/// left requests waiting, and decayed sums over the backlogged steps of the requests that left
/// and of their steps' microseconds.
#[derive(Debug, Clone, Copy, Default)]
pub struct QueueDrain {
    left_since_step: usize,
    backlogged: bool,
    drained: f64,
    drain_us: f64,
    steps: u32,
}

impl QueueDrain {
    /// `requests` left the queue (scheduled, or ended unscheduled).
    pub fn left(&mut self, requests: usize) {
        self.left_since_step += requests;
    }

    /// A step was sent; `waiting`: requests are still queued after it.
    pub fn launched(&mut self, waiting: bool) {
        self.backlogged = waiting;
    }

    /// Folds one measured step of `step_us` in: the requests that left since the last one, if
    /// the last step sent left requests waiting.
    pub fn measure(&mut self, step_us: f64) {
        let left = std::mem::take(&mut self.left_since_step);
        if self.backlogged && step_us > 0.0 {
            let keep = 1.0 - 1.0 / DRAIN_WINDOW_STEPS;
            self.drained = self.drained * keep + left as f64;
            self.drain_us = self.drain_us * keep + step_us;
            self.steps = self.steps.saturating_add(1);
        }
    }

    /// Requests per microsecond, once [`MIN_DRAIN_STEPS`] backlogged steps were measured and a
    /// request left.
    pub fn per_us(&self) -> Option<f64> {
        (self.steps >= MIN_DRAIN_STEPS && self.drained > 0.0 && self.drain_us > 0.0)
            .then(|| self.drained / self.drain_us)
    }
}
