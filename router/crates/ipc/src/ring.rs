//! A single-producer single-consumer byte ring in a shared-memory file.
//!
//! The router and a worker each map the same file (normally under `/dev/shm`); one side only
//! pushes, the other only pops. The ring is implemented once, here; the Python worker uses it
//! through the pyo3 module.
//!
//! # Layout
//!
//! ```text
//!  offset 0    ┌──────────────────────────────────────────────┐
//!              │ magic u64 "DSRING\0\1" (stored last, Release) │  written once by Ring::create,
//!              │ version u32 | reserved u32 | capacity u64     │  read-only afterwards
//!  offset 128  ├──────────────────────────────────────────────┤
//!              │ head: AtomicU64  bytes ever written           │  producer-owned, own cache line(s)
//!  offset 256  ├──────────────────────────────────────────────┤
//!              │ tail: AtomicU64  bytes ever read              │  consumer-owned, own cache line(s)
//!  offset 384  ├──────────────────────────────────────────────┤
//!              │ data: capacity bytes (power of two)           │  byte i of the stream lives at
//!              │                                               │  data[i & (capacity - 1)]
//!              └──────────────────────────────────────────────┘
//! ```
//!
//! Each frame in the stream is a little-endian `u32` payload length followed by the payload,
//! both copied with wrap-around (a frame may straddle the end of `data`). `head - tail` is the
//! number of unread bytes, so the ring is empty when they are equal and full when it is
//! `capacity`. A payload may be at most `capacity / 2 - 4` bytes, so a frame always fits once the
//! consumer catches up; bigger data never travels on the ring.
//!
//! # Ordering
//!
//! The producer copies a frame into free space, then publishes it with `head.store(Release)`;
//! the consumer reads `head` with Acquire, copies the frame out, then frees it with
//! `tail.store(Release)`, which the producer reads with Acquire before reusing the space. Each
//! side caches the other's cursor and re-reads it only when the cached value says "empty" or
//! "full", so the shared cache lines move only when needed.
//!
//! The map is a [`memmap2::MmapRaw`]: the peer writes the same bytes concurrently, so no Rust
//! reference to the data region is ever formed; it is accessed by raw-pointer copies only.

use std::fs::{self, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::ptr;
use std::sync::atomic::{AtomicU64, Ordering};

use memmap2::MmapRaw;

use crate::error::{IpcError, Result};

/// `b"DSRING\0\x01"` as a little-endian u64: identifies a ring file.
pub const MAGIC: u64 = u64::from_le_bytes(*b"DSRING\0\x01");
/// Layout version; bumped when the header or frame format changes.
pub const VERSION: u32 = 1;
/// Smallest accepted capacity in bytes.
pub const MIN_CAPACITY: u64 = 64;
/// Largest accepted capacity in bytes (frame lengths are u32).
pub const MAX_CAPACITY: u64 = 1 << 32;
/// Bytes of the length prefix in front of every payload.
const LEN_PREFIX: usize = 4;

/// Fields written once at creation.
#[repr(C, align(128))]
struct Meta {
    /// [`MAGIC`] once the header is initialised; 0 before.
    magic: AtomicU64,
    /// [`VERSION`] of the creator.
    version: u32,
    /// Zero; keeps `capacity` 8-aligned and leaves room for flags.
    _reserved: u32,
    /// Size of the data region in bytes, a power of two.
    capacity: u64,
}

/// A cursor alone on its cache line(s), so producer and consumer never false-share.
#[repr(C, align(128))]
struct Cursor(AtomicU64);

/// The fixed header at offset 0 of the file.
#[repr(C)]
struct Header {
    /// Identity and geometry.
    meta: Meta,
    /// Bytes ever written (producer-owned).
    head: Cursor,
    /// Bytes ever read (consumer-owned).
    tail: Cursor,
}

/// Size of the header; the data region starts here.
pub const HEADER_SIZE: usize = std::mem::size_of::<Header>();
const _: () = assert!(HEADER_SIZE == 384);

/// One mapping of a ring file. Turn it into a [`Producer`] or a [`Consumer`]; each mapping has
/// exactly one role, and each ring exactly one producer and one consumer (not enforced across
/// processes: the [`IpcDir`](crate::channel::IpcDir) file names fix who opens which side).
#[derive(Debug)]
pub struct Ring {
    /// The shared mapping of the whole file (header + data).
    map: MmapRaw,
    /// The file, for error messages.
    path: PathBuf,
    /// Data region size, a power of two (cached from the header).
    capacity: u64,
}

impl Ring {
    /// Creates a ring file of `capacity` data bytes at `path` and initialises its header.
    ///
    /// An existing file at `path` is unlinked first rather than truncated, so a process that
    /// still maps the old ring keeps a valid (orphaned) mapping instead of faulting.
    pub fn create(path: impl AsRef<Path>, capacity: usize) -> Result<Ring> {
        let path = path.as_ref();
        let capacity = capacity as u64;
        if !capacity.is_power_of_two() || !(MIN_CAPACITY..=MAX_CAPACITY).contains(&capacity) {
            return Err(IpcError::BadCapacity {
                capacity,
                min: MIN_CAPACITY,
                max: MAX_CAPACITY,
            });
        }
        match fs::remove_file(path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(IpcError::io("cannot replace existing ring", path, e)),
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)
            .map_err(|e| IpcError::io("cannot create ring", path, e))?;
        file.set_len(HEADER_SIZE as u64 + capacity)
            .map_err(|e| IpcError::io("cannot size ring", path, e))?;
        let map = MmapRaw::map_raw(&file).map_err(|e| IpcError::io("cannot map ring", path, e))?;
        let ring = Ring {
            map,
            path: path.to_path_buf(),
            capacity,
        };
        let hdr = ring.header_ptr();
        // SAFETY: the mapping is HEADER_SIZE + capacity bytes, page-aligned (so aligned for
        // Header), and the file was just created by us: no peer has published anything yet.
        // Plain fields are written before `magic` is stored with Release, and `open` refuses the
        // file until it loads that magic with Acquire, so no reader sees them half-written.
        unsafe {
            ptr::addr_of_mut!((*hdr).meta.version).write(VERSION);
            ptr::addr_of_mut!((*hdr).meta._reserved).write(0);
            ptr::addr_of_mut!((*hdr).meta.capacity).write(capacity);
        }
        ring.header().head.0.store(0, Ordering::Relaxed);
        ring.header().tail.0.store(0, Ordering::Relaxed);
        ring.header().meta.magic.store(MAGIC, Ordering::Release);
        Ok(ring)
    }

    /// Maps an existing ring file, checking magic, version, capacity and size.
    pub fn open(path: impl AsRef<Path>) -> Result<Ring> {
        let path = path.as_ref();
        let bad = |reason: String| IpcError::BadRing {
            path: path.to_path_buf(),
            reason,
        };
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|e| IpcError::io("cannot open ring", path, e))?;
        let len = file
            .metadata()
            .map_err(|e| IpcError::io("cannot stat ring", path, e))?
            .len();
        if len < HEADER_SIZE as u64 {
            return Err(bad(format!(
                "file is {len} bytes, smaller than the {HEADER_SIZE}-byte header"
            )));
        }
        let map = MmapRaw::map_raw(&file).map_err(|e| IpcError::io("cannot map ring", path, e))?;
        let mut ring = Ring {
            map,
            path: path.to_path_buf(),
            capacity: 0,
        };
        let magic = ring.header().meta.magic.load(Ordering::Acquire);
        if magic != MAGIC {
            return Err(bad(format!(
                "magic is {:?}, expected {:?} (not a ring, or not initialised yet)",
                String::from_utf8_lossy(&magic.to_le_bytes()),
                String::from_utf8_lossy(&MAGIC.to_le_bytes()),
            )));
        }
        let (version, capacity) = (ring.header().meta.version, ring.header().meta.capacity);
        if version != VERSION {
            return Err(bad(format!(
                "layout version {version}, this build reads version {VERSION}"
            )));
        }
        if !capacity.is_power_of_two() || !(MIN_CAPACITY..=MAX_CAPACITY).contains(&capacity) {
            return Err(bad(format!(
                "capacity {capacity} is not a power of two in {MIN_CAPACITY}..={MAX_CAPACITY}"
            )));
        }
        if len != HEADER_SIZE as u64 + capacity {
            return Err(bad(format!(
                "file is {len} bytes, expected {} ({HEADER_SIZE}-byte header + capacity {capacity})",
                HEADER_SIZE as u64 + capacity
            )));
        }
        ring.capacity = capacity;
        Ok(ring)
    }

    /// Data bytes in the ring.
    pub fn capacity(&self) -> usize {
        self.capacity as usize
    }

    /// Largest payload a frame may carry: `capacity / 2 - 4`.
    pub fn max_frame_len(&self) -> usize {
        (self.capacity / 2) as usize - LEN_PREFIX
    }

    /// The ring file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Unread bytes (length prefixes included) at this instant.
    pub fn len_bytes(&self) -> u64 {
        let head = self.header().head.0.load(Ordering::Acquire);
        head.wrapping_sub(self.header().tail.0.load(Ordering::Acquire))
    }

    /// Makes this mapping the ring's producer.
    pub fn into_producer(self) -> Result<Producer> {
        let head = self.header().head.0.load(Ordering::Acquire);
        let tail = self.header().tail.0.load(Ordering::Acquire);
        self.check_cursors(head, tail)?;
        let max_frame = self.max_frame_len();
        Ok(Producer {
            ring: self,
            head,
            cached_tail: tail,
            max_frame,
        })
    }

    /// Makes this mapping the ring's consumer.
    pub fn into_consumer(self) -> Result<Consumer> {
        let head = self.header().head.0.load(Ordering::Acquire);
        let tail = self.header().tail.0.load(Ordering::Acquire);
        self.check_cursors(head, tail)?;
        Ok(Consumer {
            ring: self,
            tail,
            cached_head: head,
        })
    }

    fn check_cursors(&self, head: u64, tail: u64) -> Result<()> {
        let used = head.wrapping_sub(tail);
        if used > self.capacity {
            return Err(self.corrupt(format!(
                "head {head} and tail {tail} are {used} bytes apart, capacity is {}",
                self.capacity
            )));
        }
        Ok(())
    }

    fn corrupt(&self, reason: String) -> IpcError {
        IpcError::Corrupt {
            path: self.path.clone(),
            reason,
        }
    }

    fn header_ptr(&self) -> *mut Header {
        self.map.as_mut_ptr().cast::<Header>()
    }

    fn header(&self) -> &Header {
        // SAFETY: the mapping is at least HEADER_SIZE bytes (checked by create/open) and
        // page-aligned. After initialisation only the atomics change, through atomic operations;
        // the plain `meta` fields are written once before `magic` is published.
        unsafe { &*self.header_ptr() }
    }

    /// Copies `src` into the stream at byte position `pos`, wrapping at the end of `data`.
    ///
    /// Callers (the producer) only write bytes in `[head, tail + capacity)`, which the consumer
    /// does not read until `head` is published past them.
    fn write_at(&self, pos: u64, src: &[u8]) {
        let (off, first) = self.split(pos, src.len());
        // SAFETY: `off + first <= capacity` and `src.len() - first <= capacity` (callers never
        // write more than capacity bytes), so both copies stay inside the data region of the
        // live mapping; `src` is a separate Rust slice, so the ranges do not overlap.
        unsafe {
            let data = self.map.as_mut_ptr().add(HEADER_SIZE);
            ptr::copy_nonoverlapping(src.as_ptr(), data.add(off), first);
            ptr::copy_nonoverlapping(src.as_ptr().add(first), data, src.len() - first);
        }
    }

    /// Copies bytes at stream position `pos` into `dst`, wrapping at the end of `data`.
    ///
    /// Callers (the consumer) only read bytes in `[tail, head)`, published by the producer's
    /// Release store of `head` and not rewritten until `tail` moves past them.
    fn read_at(&self, pos: u64, dst: &mut [u8]) {
        let (off, first) = self.split(pos, dst.len());
        // SAFETY: as in `write_at`: both ranges lie inside the data region; `dst` is a separate
        // Rust slice.
        unsafe {
            let data = self.map.as_ptr().add(HEADER_SIZE);
            ptr::copy_nonoverlapping(data.add(off), dst.as_mut_ptr(), first);
            ptr::copy_nonoverlapping(data, dst.as_mut_ptr().add(first), dst.len() - first);
        }
    }

    /// `(offset of pos in data, bytes before the wrap)` for a copy of `len <= capacity` bytes.
    fn split(&self, pos: u64, len: usize) -> (usize, usize) {
        debug_assert!(len as u64 <= self.capacity);
        let off = (pos & (self.capacity - 1)) as usize;
        (off, len.min(self.capacity as usize - off))
    }
}

/// The writing end of a ring.
#[derive(Debug)]
pub struct Producer {
    /// The mapping.
    ring: Ring,
    /// Bytes ever written: our own cursor, mirrored to the header on publish.
    head: u64,
    /// Last `tail` read from the header; refreshed only when the cached value says "full".
    cached_tail: u64,
    /// Largest payload accepted.
    max_frame: usize,
}

impl Producer {
    /// Appends one frame. `Ok(false)` when there is not room right now (retry after the consumer
    /// reads); an error when the payload can never fit (more than `capacity / 2 - 4` bytes).
    pub fn try_push(&mut self, payload: &[u8]) -> Result<bool> {
        if payload.len() > self.max_frame {
            return Err(IpcError::FrameTooLarge {
                len: payload.len(),
                max: self.max_frame,
            });
        }
        let need = (LEN_PREFIX + payload.len()) as u64;
        let cap = self.ring.capacity;
        if self.head.wrapping_sub(self.cached_tail) + need > cap {
            self.cached_tail = self.ring.header().tail.0.load(Ordering::Acquire);
            let used = self.head.wrapping_sub(self.cached_tail);
            if used > cap {
                return Err(self.ring.corrupt(format!(
                    "consumer tail {} is ahead of producer head {}",
                    self.cached_tail, self.head
                )));
            }
            if used + need > cap {
                return Ok(false);
            }
        }
        self.ring
            .write_at(self.head, &(payload.len() as u32).to_le_bytes());
        self.ring.write_at(self.head + LEN_PREFIX as u64, payload);
        self.head += need;
        self.ring
            .header()
            .head
            .0
            .store(self.head, Ordering::Release);
        Ok(true)
    }

    /// Largest payload [`try_push`](Self::try_push) accepts.
    pub fn max_frame_len(&self) -> usize {
        self.max_frame
    }

    /// The underlying ring.
    pub fn ring(&self) -> &Ring {
        &self.ring
    }
}

/// The reading end of a ring.
#[derive(Debug)]
pub struct Consumer {
    /// The mapping.
    ring: Ring,
    /// Bytes ever read: our own cursor, mirrored to the header after each frame.
    tail: u64,
    /// Last `head` read from the header; refreshed only when the cached value says "empty".
    cached_head: u64,
}

impl Consumer {
    /// Takes the next frame, if one is there.
    pub fn try_pop(&mut self) -> Result<Option<Vec<u8>>> {
        let mut buf = Vec::new();
        Ok(self.try_pop_into(&mut buf)?.then_some(buf))
    }

    /// Takes the next frame into `buf` (cleared first, its allocation reused); `Ok(false)` when
    /// the ring is empty. An error means the shared state is inconsistent, never "try again".
    pub fn try_pop_into(&mut self, buf: &mut Vec<u8>) -> Result<bool> {
        if self.cached_head == self.tail {
            self.cached_head = self.ring.header().head.0.load(Ordering::Acquire);
            if self.cached_head == self.tail {
                return Ok(false);
            }
        }
        let avail = self.cached_head.wrapping_sub(self.tail);
        if avail > self.ring.capacity || avail < LEN_PREFIX as u64 {
            return Err(self.ring.corrupt(format!(
                "{avail} unread bytes between tail {} and head {}",
                self.tail, self.cached_head
            )));
        }
        let mut len = [0u8; LEN_PREFIX];
        self.ring.read_at(self.tail, &mut len);
        let len = u32::from_le_bytes(len) as usize;
        if len > self.ring.max_frame_len() || (LEN_PREFIX + len) as u64 > avail {
            return Err(self.ring.corrupt(format!(
                "frame length {len} at stream offset {} exceeds the {avail} published bytes or the {}-byte limit",
                self.tail,
                self.ring.max_frame_len()
            )));
        }
        buf.clear();
        buf.resize(len, 0);
        self.ring.read_at(self.tail + LEN_PREFIX as u64, buf);
        self.tail += (LEN_PREFIX + len) as u64;
        self.ring
            .header()
            .tail
            .0
            .store(self.tail, Ordering::Release);
        Ok(true)
    }

    /// The underlying ring.
    pub fn ring(&self) -> &Ring {
        &self.ring
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Deterministic xorshift64* generator, so tests need no extra dependency.
    pub(crate) struct Rng(pub u64);
    impl Rng {
        pub(crate) fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }
        pub(crate) fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
    }

    /// Payload `i` of length `len`: content depends on both, so misordering or tearing shows.
    pub(crate) fn payload(i: u64, len: usize) -> Vec<u8> {
        (0..len)
            .map(|j| (i.wrapping_mul(31).wrapping_add(j as u64 * 7) % 251) as u8)
            .collect()
    }

    #[test]
    fn push_pop_one() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("r.ring");
        let mut p = Ring::create(&path, 1024).unwrap().into_producer().unwrap();
        let mut c = Ring::open(&path).unwrap().into_consumer().unwrap();
        assert_eq!(c.try_pop().unwrap(), None);
        assert!(p.try_push(b"hello").unwrap());
        assert!(p.try_push(b"").unwrap());
        assert_eq!(c.ring().len_bytes(), 4 + 5 + 4);
        assert_eq!(c.try_pop().unwrap().as_deref(), Some(&b"hello"[..]));
        assert_eq!(c.try_pop().unwrap().as_deref(), Some(&b""[..]));
        assert_eq!(c.try_pop().unwrap(), None);
    }

    #[test]
    fn wraps_around_across_two_mappings_and_threads() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("r.ring");
        // A small ring so that thousands of frames wrap it hundreds of times, with frames
        // (and length prefixes) straddling the end of the data region.
        let cap = 4096usize;
        let ring = Ring::create(&path, cap).unwrap();
        let max = ring.max_frame_len();
        let mut c = Ring::open(&path).unwrap().into_consumer().unwrap();
        let mut p = ring.into_producer().unwrap();
        const N: u64 = 20_000;
        let producer = std::thread::spawn(move || {
            let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
            let mut full = 0u64;
            for i in 0..N {
                let len = match rng.below(10) {
                    0 => max,
                    1 => 0,
                    _ => rng.below(300) as usize,
                };
                let msg = payload(i, len);
                while !p.try_push(&msg).unwrap() {
                    full += 1;
                    std::thread::yield_now();
                }
            }
            full
        });
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        let mut buf = Vec::new();
        for i in 0..N {
            let len = match rng.below(10) {
                0 => max,
                1 => 0,
                _ => rng.below(300) as usize,
            };
            while !c.try_pop_into(&mut buf).unwrap() {
                std::thread::yield_now();
            }
            assert_eq!(buf.len(), len, "frame {i} has the wrong length");
            assert!(buf == payload(i, len), "frame {i} has the wrong content");
        }
        producer.join().unwrap();
        assert_eq!(c.try_pop().unwrap(), None);
        assert!(
            c.tail > 100 * cap as u64,
            "the test must wrap the ring many times"
        );
    }

    #[test]
    fn full_ring_refuses_then_accepts_after_a_pop() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("r.ring");
        let mut p = Ring::create(&path, 256).unwrap().into_producer().unwrap();
        let mut c = Ring::open(&path).unwrap().into_consumer().unwrap();
        // 60-byte payloads take 64 bytes each: exactly four fit in 256.
        for i in 0..4 {
            assert!(p.try_push(&payload(i, 60)).unwrap(), "frame {i} should fit");
        }
        assert!(
            !p.try_push(&payload(4, 60)).unwrap(),
            "a full ring must refuse"
        );
        assert!(
            !p.try_push(&[]).unwrap(),
            "even an empty frame needs 4 bytes"
        );
        assert_eq!(c.try_pop().unwrap(), Some(payload(0, 60)));
        assert!(p.try_push(&payload(4, 60)).unwrap());
        for i in 1..5 {
            assert_eq!(c.try_pop().unwrap(), Some(payload(i, 60)));
        }
    }

    #[test]
    fn oversize_frame_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let mut p = Ring::create(dir.path().join("r.ring"), 1024)
            .unwrap()
            .into_producer()
            .unwrap();
        assert_eq!(p.max_frame_len(), 508);
        assert!(p.try_push(&vec![0; 508]).unwrap());
        let e = p.try_push(&vec![0; 509]).unwrap_err();
        assert!(matches!(e, IpcError::FrameTooLarge { len: 509, max: 508 }));
        assert!(
            e.to_string()
                .contains("large bytes never travel on the ring"),
            "{e}"
        );
    }

    #[test]
    fn create_validates_capacity() {
        let dir = tempfile::tempdir().unwrap();
        for cap in [0, 100, 32, (MAX_CAPACITY * 2) as usize] {
            let e = Ring::create(dir.path().join("r.ring"), cap).unwrap_err();
            assert!(e.to_string().contains("must be a power of two"), "{e}");
        }
    }

    #[test]
    fn create_replaces_a_stale_ring() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("r.ring");
        let mut p = Ring::create(&path, 1024).unwrap().into_producer().unwrap();
        assert!(p.try_push(b"stale").unwrap());
        let _fresh = Ring::create(&path, 2048).unwrap();
        let mut c = Ring::open(&path).unwrap().into_consumer().unwrap();
        assert_eq!(c.ring().capacity(), 2048);
        assert_eq!(c.try_pop().unwrap(), None);
    }

    #[test]
    fn open_explains_what_is_wrong() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("missing.ring");
        let e = Ring::open(&missing).unwrap_err().to_string();
        assert!(
            e.contains("cannot open ring") && e.contains("missing.ring"),
            "{e}"
        );

        let small = dir.path().join("small.ring");
        fs::write(&small, b"tiny").unwrap();
        let e = Ring::open(&small).unwrap_err().to_string();
        assert!(e.contains("smaller than the 384-byte header"), "{e}");

        let foreign = dir.path().join("foreign.ring");
        fs::write(&foreign, vec![7u8; 4096]).unwrap();
        let e = Ring::open(&foreign).unwrap_err().to_string();
        assert!(e.contains("magic") && e.contains("not a ring"), "{e}");

        let resized = dir.path().join("resized.ring");
        drop(Ring::create(&resized, 1024).unwrap());
        fs::OpenOptions::new()
            .write(true)
            .open(&resized)
            .unwrap()
            .set_len(384 + 512)
            .unwrap();
        let e = Ring::open(&resized).unwrap_err().to_string();
        assert!(e.contains("expected 1408"), "{e}");
    }

    #[test]
    fn corrupt_length_is_reported_not_trusted() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("r.ring");
        let mut p = Ring::create(&path, 1024).unwrap().into_producer().unwrap();
        let mut c = Ring::open(&path).unwrap().into_consumer().unwrap();
        assert!(p.try_push(b"abcd").unwrap());
        // A foreign writer scribbles over the length prefix.
        p.ring().write_at(0, &u32::MAX.to_le_bytes());
        let e = c.try_pop().unwrap_err().to_string();
        assert!(
            e.contains("is corrupt") && e.contains("frame length 4294967295"),
            "{e}"
        );
    }
}
