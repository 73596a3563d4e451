//! Requests the worker refused at admission (`StepOutput::refused_requests`): their grammar
//! (`response_format`, `tools`) does not compile. Only that request fails, with a message that
//! starts with [`GRAMMAR_REFUSED`] (the API answers it with a 400); the worker holds no state
//! for it and the rest of the batch runs on.

use deltaserve_ipc::wire::RefusedRequest;

use super::Actor;
use crate::validate::response_format::GRAMMAR_REFUSED;

impl Actor {
    /// Fails each refused request that is still live (one the client already left is skipped).
    pub(super) fn requests_refused(&mut self, refused: &[RefusedRequest]) {
        for r in refused {
            if !self.streams.contains(r.req_id) {
                continue;
            }
            tracing::info!(
                worker = self.index,
                req = r.req_id,
                "refused by the worker: {}",
                r.message
            );
            self.sched.abort(r.req_id);
            self.fail(r.req_id, format!("{GRAMMAR_REFUSED}{}", r.message));
        }
    }
}
