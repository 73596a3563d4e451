//! Pipe doorbells: how a consumer sleeps until its ring has data, without spinning.
//!
//! A doorbell is a named FIFO next to its ring. Both sides open it with
//! `O_RDWR | O_NONBLOCK | O_CLOEXEC`; on Linux opening a FIFO read-write never blocks, so the
//! open order of the two processes does not matter, and the FIFO never reports EOF/EPIPE when
//! the peer is gone (the link is torn down by process supervision, not by the bell).
//!
//! ```text
//!  producer                               consumer
//!  ────────                               ────────
//!  try_push(frame)                        loop {
//!  ring()  ── 1 byte into the FIFO ──▶      if try_pop() is Some → done
//!                                           wait(timeout)  (poll POLLIN, then drain the FIFO)
//!                                         }
//! ```
//!
//! No wake-up is lost: the producer rings *after* publishing, and the consumer waits only after
//! finding the ring empty. If the push lands between the consumer's empty check and its wait,
//! the byte is already in the FIFO and `wait` returns at once. A wake-up may be spurious (the
//! frame it announced was already popped), so the consumer always re-checks the ring.
//! Several rings before a wait coalesce: a full FIFO (EAGAIN) means a wake-up is pending.

use std::ffi::CString;
use std::fs;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::error::{IpcError, Result};

/// One end (both ends, really) of a named-FIFO doorbell.
#[derive(Debug)]
pub struct Doorbell {
    /// The FIFO opened read-write and non-blocking.
    fd: OwnedFd,
    /// The FIFO's path, for error messages.
    path: PathBuf,
}

impl Doorbell {
    /// Creates the FIFO at `path` (replacing any file there) with mode 0600. Does not open it.
    pub fn create(path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        match fs::remove_file(path) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(IpcError::io("cannot replace existing doorbell", path, e)),
        }
        let c = c_path(path)?;
        // SAFETY: `c` is a valid NUL-terminated path that outlives the call.
        if unsafe { libc::mkfifo(c.as_ptr(), 0o600) } != 0 {
            return Err(IpcError::io(
                "cannot create doorbell FIFO",
                path,
                io::Error::last_os_error(),
            ));
        }
        Ok(())
    }

    /// Opens the FIFO at `path`; fails clearly if it is missing or not a FIFO.
    pub fn open(path: impl AsRef<Path>) -> Result<Doorbell> {
        let path = path.as_ref();
        let meta = fs::metadata(path).map_err(|e| IpcError::io("cannot open doorbell", path, e))?;
        if !meta.file_type().is_fifo() {
            return Err(IpcError::io(
                "cannot open doorbell",
                path,
                io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "not a FIFO (create it with Doorbell::create)",
                ),
            ));
        }
        let c = c_path(path)?;
        // SAFETY: `c` is a valid NUL-terminated path; the returned fd is checked and then owned.
        let fd = unsafe {
            libc::open(
                c.as_ptr(),
                libc::O_RDWR | libc::O_NONBLOCK | libc::O_CLOEXEC,
            )
        };
        if fd < 0 {
            return Err(IpcError::io(
                "cannot open doorbell",
                path,
                io::Error::last_os_error(),
            ));
        }
        // SAFETY: `fd` is a freshly opened descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(Doorbell {
            fd,
            path: path.to_path_buf(),
        })
    }

    /// Signals the waiting side. Never blocks: if the FIFO is full a wake-up is already pending.
    pub fn ring(&self) -> Result<()> {
        loop {
            // SAFETY: writes one byte from a valid 1-byte buffer to our open fd.
            let n = unsafe { libc::write(self.fd.as_raw_fd(), [1u8].as_ptr().cast(), 1) };
            if n == 1 {
                return Ok(());
            }
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EAGAIN) => return Ok(()),
                Some(libc::EINTR) => continue,
                _ => return Err(IpcError::io("cannot ring doorbell", &self.path, e)),
            }
        }
    }

    /// Waits until the bell has been rung (`true`) or `timeout` passes (`false`); `None` waits
    /// forever. Drains all pending rings, so the next wait blocks until the next ring.
    pub fn wait(&self, timeout: Option<Duration>) -> Result<bool> {
        let deadline = timeout.map(|t| Instant::now() + t);
        loop {
            let ms = match deadline {
                None => -1,
                Some(d) => {
                    let left = d.saturating_duration_since(Instant::now());
                    // Round up so a short timeout still sleeps instead of spinning on 0.
                    left.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32
                }
            };
            let mut pfd = libc::pollfd {
                fd: self.fd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: `pfd` is a valid pollfd array of length 1 for the duration of the call.
            let n = unsafe { libc::poll(&mut pfd, 1, ms) };
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.raw_os_error() == Some(libc::EINTR) {
                    continue;
                }
                return Err(IpcError::io("cannot wait on doorbell", &self.path, e));
            }
            if n > 0 && pfd.revents & libc::POLLIN != 0 {
                self.drain()?;
                return Ok(true);
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Ok(false);
            }
        }
    }

    /// The FIFO's file descriptor, for callers that wait on it in their own event loop (e.g.
    /// tokio's `AsyncFd`); they must call [`drain`](Self::drain) once it is readable.
    pub fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.fd.as_raw_fd()
    }

    /// Reads every pending byte without blocking, so the next wait sleeps until the next ring.
    pub fn drain(&self) -> Result<()> {
        let mut buf = [0u8; 64];
        loop {
            // SAFETY: reads at most `buf.len()` bytes into a valid buffer from our open fd.
            let n = unsafe { libc::read(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
            if n > 0 {
                continue;
            }
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                _ if n == 0 => return Ok(()),
                Some(libc::EAGAIN) => return Ok(()),
                Some(libc::EINTR) => continue,
                _ => return Err(IpcError::io("cannot drain doorbell", &self.path, e)),
            }
        }
    }

    /// The FIFO's path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

fn c_path(path: &Path) -> Result<CString> {
    CString::new(path.as_os_str().as_bytes()).map_err(|_| {
        IpcError::io(
            "bad path",
            path,
            io::Error::new(io::ErrorKind::InvalidInput, "path contains a NUL byte"),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_wakes_a_waiter_and_silence_times_out() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.bell");
        Doorbell::create(&path).unwrap();
        let waiter = Doorbell::open(&path).unwrap();
        let ringer = Doorbell::open(&path).unwrap();

        let t = Instant::now();
        assert!(!waiter.wait(Some(Duration::from_millis(30))).unwrap());
        assert!(t.elapsed() >= Duration::from_millis(30));

        let h = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            ringer.ring().unwrap();
            ringer
        });
        let t = Instant::now();
        assert!(waiter.wait(Some(Duration::from_secs(10))).unwrap());
        assert!(t.elapsed() < Duration::from_secs(5));
        let ringer = h.join().unwrap();

        // Many rings coalesce into one pending wake-up, drained by one wait.
        for _ in 0..100_000 {
            ringer.ring().unwrap(); // fills the FIFO; EAGAIN must be swallowed
        }
        assert!(waiter.wait(Some(Duration::ZERO)).unwrap());
        assert!(!waiter.wait(Some(Duration::from_millis(5))).unwrap());
    }

    #[test]
    fn open_refuses_missing_and_non_fifo() {
        let dir = tempfile::tempdir().unwrap();
        let e = Doorbell::open(dir.path().join("none.bell"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("cannot open doorbell") && e.contains("none.bell"),
            "{e}"
        );
        let plain = dir.path().join("plain.bell");
        fs::write(&plain, b"").unwrap();
        let e = Doorbell::open(&plain).unwrap_err().to_string();
        assert!(e.contains("not a FIFO"), "{e}");
    }
}
