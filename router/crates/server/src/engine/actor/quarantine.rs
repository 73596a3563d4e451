//! Variants the worker quarantined (`StepOutput::failed_variants`): their files changed,
//! vanished or turned out corrupt after registration. Only that variant's requests fail, with
//! an error naming it; it leaves this actor's scheduler (its pages and slot free, the worker
//! skips the drops) and stays unavailable, so new requests for it are refused at once
//! (`EngineHandle::generate`), until it is deleted and registered again. The worker never
//! restarts for it.

use deltaserve_ipc::wire::FailedVariant;

use super::Actor;

impl Actor {
    /// Fails every live request of each failed variant and takes the variant out of service.
    pub(super) fn variants_failed(&mut self, failed: &[FailedVariant]) {
        for f in failed {
            let id = f.variant_id;
            let name = self
                .adapter_names
                .get(&id)
                .cloned()
                .unwrap_or_else(|| format!("#{id}"));
            let message = format!(
                "variant `{name}` is unavailable: its files failed after registration: {}",
                f.message
            );
            tracing::error!(worker = self.index, variant = %name, "{message}");
            for req in self.streams.ids_of_variant(id) {
                self.sched.abort(req);
                self.fail(req, message.clone());
            }
            if let Err(e) = self.sched.unregister_adapter(id) {
                tracing::warn!(worker = self.index, variant = %name, "unregistering: {e}");
            }
            self.adapters.remove(&id);
            self.failed_variants
                .lock()
                .expect("failed variants")
                .insert(id, message);
        }
    }
}
