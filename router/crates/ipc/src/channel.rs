//! One direction of a link ([`Sender`] / [`Receiver`]: ring + doorbell), and the directory that
//! holds both directions of one router↔worker link ([`IpcDir`]).
//!
//! ```text
//!  <ipc dir>/                      router side                    worker side
//!    to_worker.ring    ───────▶   Sender.producer    ──frames──▶  Receiver.consumer
//!    to_worker.bell    ───────▶   Sender.bell        ──wake───▶   Receiver.bell
//!    from_worker.ring  ◀───────   Receiver.consumer  ◀─frames───  Sender.producer
//!    from_worker.bell  ◀───────   Receiver.bell      ◀─wake────   Sender.bell
//! ```
//!
//! The router creates the directory's files ([`IpcDir::create`]) before it spawns the worker and
//! passes the directory path; each side then opens its half ([`IpcDir::router_side`],
//! [`IpcDir::worker_side`]). Both calls block only on a full ring (send) or an empty one (recv);
//! a receiver that must notice a dead peer waits with a timeout and checks the process.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::doorbell::Doorbell;
use crate::error::{IpcError, Result};
use crate::ring::{Consumer, Producer, Ring};

/// Ring capacity used when the caller has no reason to pick another: 4 MiB, so a frame may be up
/// to 2 MiB (a `StepPlan` for hundreds of new requests with long prompts).
pub const DEFAULT_CAPACITY: usize = 4 << 20;

/// Failed pushes spent spinning before the sender starts sleeping between retries.
const SPIN_TRIES: u32 = 64;
/// Sleep between retries once spinning did not help (the consumer is busy, not just late).
const FULL_BACKOFF: Duration = Duration::from_micros(50);

/// The sending half of one direction.
#[derive(Debug)]
pub struct Sender {
    /// Where frames go.
    producer: Producer,
    /// Rung after every push, so the receiver wakes.
    bell: Doorbell,
}

impl Sender {
    /// Pairs an open producer with the doorbell of the same direction.
    pub fn new(producer: Producer, bell: Doorbell) -> Sender {
        Sender { producer, bell }
    }

    /// Sends one frame, waiting as long as the ring is full. An error only for a frame that can
    /// never fit or a broken ring/doorbell.
    pub fn send(&mut self, frame: &[u8]) -> Result<()> {
        self.send_timeout(frame, None).map(|_| ())
    }

    /// Sends one frame, waiting at most `timeout` (`None`: forever) for room. `Ok(false)` when
    /// the ring stayed full that long: the peer is not reading.
    pub fn send_timeout(&mut self, frame: &[u8], timeout: Option<Duration>) -> Result<bool> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut tries = 0u32;
        while !self.producer.try_push(frame)? {
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Ok(false);
            }
            tries += 1;
            if tries < SPIN_TRIES {
                std::hint::spin_loop();
            } else {
                std::thread::sleep(FULL_BACKOFF);
            }
        }
        self.bell.ring()?;
        Ok(true)
    }

    /// Sends one frame if there is room right now; `Ok(false)` if the ring is full.
    pub fn try_send(&mut self, frame: &[u8]) -> Result<bool> {
        if !self.producer.try_push(frame)? {
            return Ok(false);
        }
        self.bell.ring()?;
        Ok(true)
    }

    /// Largest frame this sender accepts.
    pub fn max_frame_len(&self) -> usize {
        self.producer.max_frame_len()
    }
}

/// The receiving half of one direction.
#[derive(Debug)]
pub struct Receiver {
    /// Where frames come from.
    consumer: Consumer,
    /// Waited on when the ring is empty.
    bell: Doorbell,
}

impl Receiver {
    /// Pairs an open consumer with the doorbell of the same direction.
    pub fn new(consumer: Consumer, bell: Doorbell) -> Receiver {
        Receiver { consumer, bell }
    }

    /// The next frame, waiting at most `timeout` (`None`: forever); `Ok(None)` on timeout.
    pub fn recv(&mut self, timeout: Option<Duration>) -> Result<Option<Vec<u8>>> {
        let mut buf = Vec::new();
        Ok(self.recv_into(&mut buf, timeout)?.then_some(buf))
    }

    /// Like [`recv`](Self::recv), into `buf` (cleared, allocation reused); `Ok(false)` on timeout.
    pub fn recv_into(&mut self, buf: &mut Vec<u8>, timeout: Option<Duration>) -> Result<bool> {
        let deadline = timeout.map(|t| Instant::now() + t);
        loop {
            if self.consumer.try_pop_into(buf)? {
                return Ok(true);
            }
            let left = match deadline {
                None => None,
                Some(d) => match d.checked_duration_since(Instant::now()) {
                    Some(left) if !left.is_zero() => Some(left),
                    _ => return Ok(false),
                },
            };
            // Woken or timed out, the ring is checked again: a wake-up may be spurious, and a
            // frame pushed just before the deadline is still delivered.
            self.bell.wait(left)?;
        }
    }

    /// The next frame if one is there now.
    pub fn try_recv(&mut self) -> Result<Option<Vec<u8>>> {
        self.consumer.try_pop()
    }

    /// Polls the ring (no syscalls) for up to `spin`; `Ok(true)` with the frame in `buf`.
    ///
    /// For a consumer that knows a frame is imminent (the worker right after sending a step's
    /// output): a frame that arrives during the spin skips the doorbell's wake-up latency, which
    /// is the largest part of a round trip. Doorbell bytes rung meanwhile stay in the FIFO and
    /// at most cause one spurious wake-up later.
    pub fn spin_into(&mut self, buf: &mut Vec<u8>, spin: Duration) -> Result<bool> {
        let until = Instant::now() + spin;
        loop {
            if self.consumer.try_pop_into(buf)? {
                return Ok(true);
            }
            if Instant::now() >= until {
                return Ok(false);
            }
            for _ in 0..64 {
                std::hint::spin_loop();
            }
        }
    }

    /// The doorbell's file descriptor, for waiting in an event loop instead of [`recv`](Self::recv):
    /// wait until it is readable, call [`clear_bell`](Self::clear_bell), then [`try_recv`](Self::try_recv)
    /// until it returns `None`.
    pub fn bell_fd(&self) -> std::os::fd::RawFd {
        self.bell.as_raw_fd()
    }

    /// Drains the doorbell (see [`bell_fd`](Self::bell_fd)).
    pub fn clear_bell(&self) -> Result<()> {
        self.bell.drain()
    }
}

/// The directory holding the four files of one router↔worker link.
#[derive(Debug, Clone)]
pub struct IpcDir {
    /// The directory (e.g. `/dev/shm/deltaserve-<pid>/worker-0`).
    dir: PathBuf,
}

impl IpcDir {
    /// Frames from the router to the worker.
    pub const TO_WORKER_RING: &'static str = "to_worker.ring";
    /// Wakes the worker.
    pub const TO_WORKER_BELL: &'static str = "to_worker.bell";
    /// Frames from the worker to the router.
    pub const FROM_WORKER_RING: &'static str = "from_worker.ring";
    /// Wakes the router.
    pub const FROM_WORKER_BELL: &'static str = "from_worker.bell";

    /// Router side: creates `dir` if needed and, replacing stale ones, both rings (`capacity`
    /// bytes each) and both doorbells.
    pub fn create(dir: impl AsRef<Path>, capacity: usize) -> Result<IpcDir> {
        let dir = dir.as_ref();
        fs::create_dir_all(dir).map_err(|e| IpcError::io("cannot create ipc dir", dir, e))?;
        let d = IpcDir {
            dir: dir.to_path_buf(),
        };
        Ring::create(d.file(Self::TO_WORKER_RING), capacity)?;
        Ring::create(d.file(Self::FROM_WORKER_RING), capacity)?;
        Doorbell::create(d.file(Self::TO_WORKER_BELL))?;
        Doorbell::create(d.file(Self::FROM_WORKER_BELL))?;
        Ok(d)
    }

    /// An existing link directory (created by [`IpcDir::create`], possibly in another process).
    /// Nothing is checked until a side is opened.
    pub fn at(dir: impl AsRef<Path>) -> IpcDir {
        IpcDir {
            dir: dir.as_ref().to_path_buf(),
        }
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// Opens the router's half: a sender to the worker and a receiver from it.
    pub fn router_side(&self) -> Result<(Sender, Receiver)> {
        let tx = Sender::new(
            Ring::open(self.file(Self::TO_WORKER_RING))?.into_producer()?,
            Doorbell::open(self.file(Self::TO_WORKER_BELL))?,
        );
        let rx = Receiver::new(
            Ring::open(self.file(Self::FROM_WORKER_RING))?.into_consumer()?,
            Doorbell::open(self.file(Self::FROM_WORKER_BELL))?,
        );
        Ok((tx, rx))
    }

    /// Opens the worker's half: a receiver from the router and a sender to it.
    pub fn worker_side(&self) -> Result<(Receiver, Sender)> {
        let rx = Receiver::new(
            Ring::open(self.file(Self::TO_WORKER_RING))?.into_consumer()?,
            Doorbell::open(self.file(Self::TO_WORKER_BELL))?,
        );
        let tx = Sender::new(
            Ring::open(self.file(Self::FROM_WORKER_RING))?.into_producer()?,
            Doorbell::open(self.file(Self::FROM_WORKER_BELL))?,
        );
        Ok((rx, tx))
    }

    /// Unlinks the four files and the directory (if then empty). Open mappings stay valid, so
    /// this is safe while either side still holds its half.
    pub fn remove(&self) -> Result<()> {
        for name in [
            Self::TO_WORKER_RING,
            Self::TO_WORKER_BELL,
            Self::FROM_WORKER_RING,
            Self::FROM_WORKER_BELL,
        ] {
            let path = self.file(name);
            match fs::remove_file(&path) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(IpcError::io("cannot remove", path, e)),
            }
        }
        let _ = fs::remove_dir(&self.dir); // not empty or already gone: leave it
        Ok(())
    }

    fn file(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::{decode_from_worker, decode_to_worker, encode, FromWorker, ToWorker};
    use crate::examples;
    use crate::ring::tests::{payload, Rng};

    #[test]
    fn router_and_worker_exchange_frames_both_ways() {
        let tmp = tempfile::tempdir().unwrap();
        let link = IpcDir::create(tmp.path().join("w0"), 8192).unwrap();
        let (mut to_worker, mut from_worker) = link.router_side().unwrap();
        let worker_dir = IpcDir::at(link.path());
        // The worker echoes every frame back reversed until it gets an empty one.
        let worker = std::thread::spawn(move || {
            let (mut rx, mut tx) = worker_dir.worker_side().unwrap();
            let mut buf = Vec::new();
            let mut n = 0;
            loop {
                assert!(
                    rx.recv_into(&mut buf, Some(Duration::from_secs(20)))
                        .unwrap(),
                    "router went silent"
                );
                if buf.is_empty() {
                    return n;
                }
                buf.reverse();
                tx.send(&buf).unwrap();
                n += 1;
            }
        });
        let mut rng = Rng(42);
        const N: u64 = 3_000;
        // Send ahead of receiving so the rings fill and both sides block on full and empty.
        let mut sent = std::collections::VecDeque::new();
        for i in 0..N {
            let msg = payload(i, 1 + rng.below(3000) as usize);
            sent.push_back(msg.clone());
            // Never block on a full ring here: the worker may itself be blocked on a full reply
            // ring that only this thread drains.
            loop {
                let pushed = to_worker.try_send(&msg).unwrap();
                while let Some(back) = from_worker.try_recv().unwrap() {
                    let mut want = sent.pop_front().unwrap();
                    want.reverse();
                    assert_eq!(back, want);
                }
                if pushed {
                    break;
                }
                std::thread::yield_now();
            }
        }
        while let Some(mut want) = sent.pop_front() {
            let back = from_worker
                .recv(Some(Duration::from_secs(20)))
                .unwrap()
                .expect("worker went silent");
            want.reverse();
            assert_eq!(back, want);
        }
        to_worker.send(&[]).unwrap();
        assert_eq!(worker.join().unwrap(), N);
        link.remove().unwrap();
        assert!(!link.path().exists());
    }

    #[test]
    fn messages_travel_over_a_link() {
        let tmp = tempfile::tempdir().unwrap();
        let link = IpcDir::create(tmp.path(), DEFAULT_CAPACITY).unwrap();
        let (mut tx, mut rx_router) = link.router_side().unwrap();
        let (mut rx, mut tx_worker) = link.worker_side().unwrap();
        tx.send(&encode(&examples::step_plan())).unwrap();
        let got =
            decode_to_worker(&rx.recv(Some(Duration::from_secs(5))).unwrap().unwrap()).unwrap();
        assert_eq!(got, ToWorker::StepPlan(examples::step_plan()));
        tx_worker.send(&encode(&examples::step_output())).unwrap();
        let got = decode_from_worker(&rx_router.recv(None).unwrap().unwrap()).unwrap();
        assert_eq!(got, FromWorker::StepOutput(examples::step_output()));
    }

    #[test]
    fn recv_times_out_and_full_send_times_out() {
        let tmp = tempfile::tempdir().unwrap();
        let link = IpcDir::create(tmp.path(), 256).unwrap();
        let (mut tx, mut rx) = link.router_side().unwrap();
        let t = Instant::now();
        assert_eq!(rx.recv(Some(Duration::from_millis(30))).unwrap(), None);
        assert!(t.elapsed() >= Duration::from_millis(30));

        // Nobody reads to_worker: it fills and a bounded send gives up.
        while tx.try_send(&[0; 100]).unwrap() {}
        assert!(!tx
            .send_timeout(&[0; 100], Some(Duration::from_millis(10)))
            .unwrap());
        let e = tx.send(&[0; 200]).unwrap_err();
        assert_eq!(e.error_type(), "frame_too_large");
    }

    #[test]
    fn recv_wakes_on_a_frame_sent_later() {
        let tmp = tempfile::tempdir().unwrap();
        let link = IpcDir::create(tmp.path(), 4096).unwrap();
        let (mut rx, _tx) = link.worker_side().unwrap();
        let dir = link.clone();
        let h = std::thread::spawn(move || {
            let (mut tx, _rx) = dir.router_side().unwrap();
            std::thread::sleep(Duration::from_millis(30));
            tx.send(b"late").unwrap();
        });
        let t = Instant::now();
        assert_eq!(
            rx.recv(Some(Duration::from_secs(10))).unwrap().as_deref(),
            Some(&b"late"[..])
        );
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "woken by the bell, not the timeout"
        );
        h.join().unwrap();
    }

    #[test]
    fn worker_side_of_a_missing_dir_says_which_file() {
        let tmp = tempfile::tempdir().unwrap();
        let e = IpcDir::at(tmp.path().join("nope"))
            .worker_side()
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("cannot open ring") && e.contains("to_worker.ring"),
            "{e}"
        );
    }
}
