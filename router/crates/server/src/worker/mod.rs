//! One Python worker process as the router sees it: starting it and handshaking
//! ([`spawn`]), and the shared-memory link that carries its frames back ([`link`]); IPC
//! directories a killed daemon left behind are removed at the first start ([`stale_ipc`]).
//!
//! A worker that dies is noticed by the actor through [`WorkerProcess::child`] and the link's
//! errors; restarting it is the actor's job.

mod link;
mod spawn;
mod stale_ipc;

pub use link::{FrameReceiver, SpinWindow, StepPace};
pub use spawn::{check_schema, WorkerProcess, WorkerSpec, WorkerStartError};
