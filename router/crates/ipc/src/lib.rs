//! deltaserve-ipc: everything that crosses the router↔worker process boundary, owned in one place.
//!
//! # Layout (the data flow, bottom up)
//!
//! - [`wire`]     the wire structs (`StepPlan`, `StepOutput`, `Hello`, …) and enums
//!   ([`wire::VariantKind`], [`wire::TierOp`], with their labels), and the [`wire::SCHEMA`] /
//!   [`wire::ENUMS`] tables built from the same definitions by two macros.
//! - [`codec`]    struct ⇄ frame bytes (`[KIND, body]` msgpack), direction-typed decoding
//!   ([`codec::ToWorker`], [`codec::FromWorker`]) with [`codec::CodecError`].
//! - [`schema`]   canonical schema text and its FNV-1a hash (checked in the worker handshake).
//! - [`gen_py`]   the generator of the Python mirror `pyworker/deltaserve/wire.py`
//!   (`cargo run -p deltaserve-ipc --bin ipc-schema -- gen-py`).
//! - [`ring`]     single-producer single-consumer byte ring in a shared-memory file.
//! - [`doorbell`] named-FIFO doorbells: sleep until the ring has data, without losing wake-ups.
//! - [`channel`]  ring + doorbell = one direction ([`channel::Sender`], [`channel::Receiver`]);
//!   [`channel::IpcDir`] holds the four files of one router↔worker link.
//! - [`error`]    [`IpcError`], the transport's one error type.
//! - [`examples`] fixed example messages: the source of the golden frames in `tests/golden/`.
//!
//! The Python worker reaches the same ring code through the pyo3 module (`router/crates/py`).

pub mod channel;
pub mod codec;
pub mod doorbell;
pub mod error;
pub mod examples;
pub mod gen_py;
pub mod ring;
pub mod schema;
pub mod wire;

pub use channel::{IpcDir, Receiver, Sender, DEFAULT_CAPACITY};
pub use codec::{decode_from_worker, decode_to_worker, encode, CodecError, FromWorker, ToWorker};
pub use error::IpcError;
pub use schema::schema_hash;
