//! The shared-memory link from one worker: the ring plus its doorbell FIFO, awaited in tokio's
//! reactor, and the spin window that polls the ring instead of sleeping near a step's end
//! (when: [`StepPace`], from the worker's step rhythm).
//!
//! ```text
//!  recv():   try the ring; if empty, await the doorbell FIFO in tokio's reactor (epoll),
//!            drain it, try again
//! ```
//!
//! Waiting on the doorbell's fd inside the runtime (not on a reader thread) means the frame that
//! ends a step wakes the actor's task directly: one wake-up per step instead of two, which is
//! most of the router's share of the step gap.

use std::os::fd::{FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

use deltaserve_ipc::channel::Receiver;
use deltaserve_ipc::codec::{self, FromWorker};
use tokio::io::unix::{AsyncFd, AsyncFdReadyGuard};

/// Frames from the worker, awaited in the tokio reactor.
pub struct FrameReceiver {
    /// A duplicate of the doorbell's descriptor, registered with the reactor.
    bell: AsyncFd<OwnedFd>,
    /// The ring and its doorbell.
    rx: Receiver,
}

impl FrameReceiver {
    pub(super) fn new(rx: Receiver) -> std::io::Result<Self> {
        // The reactor gets its own descriptor of the FIFO (same open file description), so the
        // registration never outlives the fd it names.
        // SAFETY: dup of a descriptor the Receiver keeps open; checked for failure below.
        let dup = unsafe { libc::dup(rx.bell_fd()) };
        if dup < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `dup` is a fresh, valid descriptor that nothing else owns.
        let owned = unsafe { OwnedFd::from_raw_fd(dup) };
        // SAFETY: the AsyncFd owns `owned`, so it stays open and unchanged for its lifetime.
        let bell = unsafe { AsyncFd::register(owned) }?;
        Ok(Self { bell, rx })
    }

    /// The next decoded frame. Cancel-safe: a frame is popped and returned without awaiting in
    /// between, so dropping this future (e.g. in `select!`) never loses one.
    ///
    /// With a [`SpinWindow`], once the window opens the ring is polled in short slices (yielding
    /// to the runtime between them) instead of sleeping in epoll: on virtual machines a parked
    /// thread's wake-up costs ~100 µs, the largest part of the step gap. Before the window
    /// opens, and after it closes, this sleeps on the doorbell as usual.
    pub async fn recv(&mut self, spin: Option<SpinWindow>) -> Result<FromWorker, String> {
        loop {
            if let Some(frame) = self.rx.try_recv().map_err(|e| e.to_string())? {
                return codec::decode_from_worker(&frame).map_err(|e| e.to_string());
            }
            let now = Instant::now();
            match spin {
                Some(w) if now >= w.from && now < w.until => {
                    let slice_end = (now + SPIN_SLICE).min(w.until);
                    while Instant::now() < slice_end {
                        if let Some(frame) = self.rx.try_recv().map_err(|e| e.to_string())? {
                            return codec::decode_from_worker(&frame).map_err(|e| e.to_string());
                        }
                        for _ in 0..64 {
                            std::hint::spin_loop();
                        }
                    }
                    tokio::task::yield_now().await;
                }
                Some(w) if now < w.from => {
                    tokio::select! {
                        ready = self.bell.readable() => self.clear(ready.map_err(|e| e.to_string())?)?,
                        _ = tokio::time::sleep_until(w.from.into()) => {}
                    }
                }
                _ => {
                    let ready = self.bell.readable().await.map_err(|e| e.to_string())?;
                    self.clear(ready)?;
                }
            }
        }
    }

    /// Edge-triggered readiness: drain the FIFO to EAGAIN, then clear (the caller re-checks the ring).
    fn clear(&self, mut ready: AsyncFdReadyGuard<'_, OwnedFd>) -> Result<(), String> {
        self.rx.clear_bell().map_err(|e| e.to_string())?;
        ready.clear_ready();
        Ok(())
    }
}

/// Longest the receiver polls before yielding to the runtime once.
const SPIN_SLICE: Duration = Duration::from_micros(50);

/// When to poll the ring instead of sleeping: from `from` until `until`.
#[derive(Debug, Clone, Copy)]
pub struct SpinWindow {
    pub from: Instant,
    pub until: Instant,
}

/// The worker's step rhythm as its actor sees it: a moving average of a step's round trip
/// (plan sent → output back) and when the last output came back. From it, [`Self::spin_window`]
/// tells when to poll for the next output instead of sleeping.
#[derive(Debug, Clone)]
pub struct StepPace {
    /// Moving average of the round trip, in seconds; 0 before the first output.
    step_secs: f64,
    /// When the last step output arrived (a step sent before it started then).
    last_output_at: Instant,
}

impl Default for StepPace {
    fn default() -> Self {
        Self {
            step_secs: 0.0,
            last_output_at: Instant::now(),
        }
    }
}

impl StepPace {
    /// When the worker could start a step sent at `sent_at`: then, or, when it was sent ahead,
    /// when the step before it came back.
    pub fn started_at(&self, sent_at: Instant) -> Instant {
        sent_at.max(self.last_output_at)
    }

    /// The output of the step sent at `sent_at` arrived now; returns now.
    pub fn output_arrived(&mut self, sent_at: Instant) -> Instant {
        let received = Instant::now();
        let took = (received - self.started_at(sent_at)).as_secs_f64();
        self.last_output_at = received;
        self.step_secs = if self.step_secs == 0.0 {
            took
        } else {
            0.8 * self.step_secs + 0.2 * took
        };
        received
    }

    /// When to poll for the step sent at `sent_at` instead of sleeping: a window centred on its
    /// expected arrival, the moving average of the round trip, ± 10% of it (at least 0.2 ms, at
    /// most 3 ms). `None` before the first output.
    pub fn spin_window(&self, sent_at: Instant) -> Option<SpinWindow> {
        if self.step_secs <= 0.0 {
            return None;
        }
        let started = self.started_at(sent_at);
        let expected = started + Duration::from_secs_f64(self.step_secs);
        let margin = Duration::from_secs_f64(self.step_secs * 0.1)
            .clamp(Duration::from_micros(200), Duration::from_millis(3));
        Some(SpinWindow {
            from: expected.checked_sub(margin).unwrap_or(started).max(started),
            until: expected + margin,
        })
    }
}
