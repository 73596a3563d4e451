//! The actor's side of adapter administration: asking its worker to inspect a directory (the
//! answer, an `VariantInfo`, arrives in order with the step outputs), and registering or
//! forgetting an adapter with its scheduler. The workflow across actors is `engine/admin.rs`.

use deltaserve_ipc::codec;
use deltaserve_ipc::wire;
use deltaserve_sched::VariantSpec;
use tokio::sync::oneshot;

use super::{Actor, RemoveOutcome};

impl Actor {
    /// Sends an `InspectVariant` for `path` (a variant of `kind`); `reply` gets the worker's
    /// `VariantInfo`.
    pub(super) fn inspect(
        &mut self,
        path: String,
        kind: wire::VariantKind,
        reply: oneshot::Sender<Result<wire::VariantInfo, String>>,
    ) {
        let Some(worker) = self.worker.as_mut() else {
            let _ = reply.send(Err("the worker is restarting; retry shortly".into()));
            return;
        };
        let inspect_id = self.next_inspect_id;
        self.next_inspect_id += 1;
        let frame = codec::encode(&wire::InspectVariant {
            inspect_id,
            path,
            kind,
        });
        if let Err(e) = worker.to_worker.send(&frame) {
            let _ = reply.send(Err(format!("could not reach the worker: {e}")));
            self.worker_lost(&format!("could not send an inspection to the worker: {e}"));
            return;
        }
        self.inspections.insert(inspect_id, reply);
    }

    /// The worker's answer to an inspection.
    pub(super) fn inspected(&mut self, info: wire::VariantInfo) {
        match self.inspections.remove(&info.inspect_id) {
            Some(reply) => {
                let _ = reply.send(Ok(info));
            }
            None => self.worker_lost(&format!(
                "worker answered inspection {} nobody asked for",
                info.inspect_id
            )),
        }
    }

    /// Registers an inspected adapter with this actor's scheduler.
    pub(super) fn add_adapter(
        &mut self,
        id: u32,
        name: String,
        spec: VariantSpec,
        reply: oneshot::Sender<Result<(), String>>,
    ) {
        let result = self
            .sched
            .register_adapter(id, spec.clone())
            .map_err(|e| format!("worker {}: {e}", self.index));
        if result.is_ok() {
            self.adapters.insert(id, spec);
            self.adapter_names.insert(id, name);
        }
        let _ = reply.send(result);
    }

    /// Forgets adapter `id` unless live requests still use it.
    pub(super) fn remove_adapter(&mut self, id: u32, reply: oneshot::Sender<RemoveOutcome>) {
        let users = self.sched.adapter_users(id);
        if users > 0 {
            let _ = reply.send(RemoveOutcome::InUse(users));
            return;
        }
        // Unknown here (a rolled-back registration) is as good as removed.
        let _ = self.sched.unregister_adapter(id);
        self.adapters.remove(&id);
        self.adapter_names.remove(&id);
        self.failed_variants
            .lock()
            .expect("failed variants")
            .remove(&id);
        let _ = reply.send(RemoveOutcome::Removed);
    }
}
