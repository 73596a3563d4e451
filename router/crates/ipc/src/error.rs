//! [`IpcError`]: the one error type of the transport (ring, doorbell, channel, ipc dir).
//! Frame-content errors are [`CodecError`](crate::codec::CodecError), a separate boundary.

use std::io;
use std::path::PathBuf;

/// Why a ring, doorbell or link could not be created, opened or used.
#[derive(Debug, thiserror::Error)]
pub enum IpcError {
    /// An OS call on a file of the link failed.
    #[error("{op} {}: {source}", path.display())]
    Io {
        /// What was being done, e.g. `cannot open ring`.
        op: &'static str,
        /// The file it was done to.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The file exists but is not a ring this build understands.
    #[error("{} is not a usable deltaserve ring: {reason}", path.display())]
    BadRing {
        /// The ring file.
        path: PathBuf,
        /// What was wrong (magic, version, capacity, size).
        reason: String,
    },
    /// `Ring::create` was asked for a capacity it cannot use.
    #[error("ring capacity {capacity} is invalid: it must be a power of two between {min} and {max} bytes")]
    BadCapacity {
        /// The capacity asked for.
        capacity: u64,
        /// Smallest allowed capacity.
        min: u64,
        /// Largest allowed capacity.
        max: u64,
    },
    /// A frame that can never fit in the ring.
    #[error(
        "frame of {len} bytes exceeds this ring's limit of {max} bytes (half its capacity): \
         large bytes never travel on the ring; pass a path or a separate shared-memory segment"
    )]
    FrameTooLarge {
        /// Payload length of the frame.
        len: usize,
        /// Largest payload the ring accepts.
        max: usize,
    },
    /// The ring's shared state is inconsistent (a broken peer or a foreign writer).
    #[error("ring {} is corrupt: {reason}", path.display())]
    Corrupt {
        /// The ring file.
        path: PathBuf,
        /// What was inconsistent.
        reason: String,
    },
}

impl IpcError {
    /// Stable label for metrics and logs.
    pub fn error_type(&self) -> &'static str {
        match self {
            IpcError::Io { .. } => "io",
            IpcError::BadRing { .. } => "bad_ring",
            IpcError::BadCapacity { .. } => "bad_capacity",
            IpcError::FrameTooLarge { .. } => "frame_too_large",
            IpcError::Corrupt { .. } => "corrupt",
        }
    }

    pub(crate) fn io(op: &'static str, path: impl Into<PathBuf>, source: io::Error) -> Self {
        IpcError::Io {
            op,
            path: path.into(),
            source,
        }
    }
}

/// Result of transport operations.
pub type Result<T, E = IpcError> = std::result::Result<T, E>;
