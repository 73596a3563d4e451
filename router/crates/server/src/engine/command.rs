//! The actor protocol: what the engine handle sends one worker's actor ([`Command`]), what it
//! keeps of the actor ([`ActorRef`]), and the actor's answer to a removal ([`RemoveOutcome`]).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicUsize};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use deltaserve_ipc::wire::{VariantInfo, VariantKind};
use deltaserve_sched::VariantSpec;
use tokio::sync::{mpsc, oneshot};

use super::admission::Admission;
use super::{EngineMetrics, GenerateEvent, GenerateRequest};

/// How an actor answered a request to forget an adapter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum RemoveOutcome {
    /// Forgotten: its pages are free and the worker drops it with the next step.
    Removed,
    /// Live requests still use it; ask again later.
    InUse(usize),
}

/// Commands an actor accepts (STYLE.md #7).
#[derive(Debug)]
pub(crate) enum Command {
    Generate {
        req: GenerateRequest,
        events: mpsc::UnboundedSender<GenerateEvent>,
        /// When the engine accepted it (the latency histograms start here).
        arrived: Instant,
    },
    Metrics {
        reply: oneshot::Sender<EngineMetrics>,
    },
    /// Ask the worker to validate an adapter directory as a variant of `kind` (changes nothing).
    Inspect {
        path: String,
        kind: VariantKind,
        reply: oneshot::Sender<Result<VariantInfo, String>>,
    },
    /// Register an inspected adapter with the actor's scheduler (`name`: what errors call it).
    AddAdapter {
        id: u32,
        name: String,
        spec: VariantSpec,
        reply: oneshot::Sender<Result<(), String>>,
    },
    /// Forget an adapter once no live request uses it.
    RemoveAdapter {
        id: u32,
        reply: oneshot::Sender<RemoveOutcome>,
    },
    /// End every live request with an `Error` event carrying `message` (the drain timeout).
    AbortAll { message: String },
}

/// One worker's actor, as the handle sees it.
#[derive(Debug)]
pub(crate) struct ActorRef {
    /// Commands into the actor.
    pub tx: mpsc::UnboundedSender<Command>,
    /// Requests handed to this actor and not yet ended: the load-balancing signal.
    pub outstanding: Arc<AtomicUsize>,
    /// True while the actor's worker is up and handshaken.
    pub ready: Arc<AtomicBool>,
    /// Variants whose files failed on this actor's worker after registration (id -> the error
    /// their requests got): unavailable until deleted and registered again.
    pub failed_variants: FailedVariants,
    /// This worker's admission control (`admission.rs`): the actor measures, the handle admits.
    pub admission: SharedAdmission,
    /// This worker's load as placement reads it (`placement_load.rs`): the actor publishes.
    pub load: super::placement_load::SharedLoad,
}

/// One worker's [`Admission`], shared by its actor and its [`ActorRef`].
pub(crate) type SharedAdmission = Arc<Mutex<Admission>>;

/// Variant id -> why it failed, shared by an actor and its [`ActorRef`].
pub(crate) type FailedVariants = Arc<Mutex<BTreeMap<u32, String>>>;
