//! Where the simulator sends an arriving request: the router's own [`Placer`] (`--placement`,
//! `router/crates/server/src/engine/placement.rs`) on every simulated worker's load at the
//! arrival's virtual time, built as the engine builds it ([`WorkerLoad::of`] the worker's
//! scheduler, [`WorkerLoad::view`]). No policy lives here: this file only gathers its inputs.

use std::collections::HashMap;

use clap::ValueEnum;
use deltaserve_sched::{Scheduler, VariantKind};
use deltaserve_server::engine::placement::Incoming;
use deltaserve_server::engine::placement_load::WorkerLoad;
use deltaserve_server::engine::{Placement, Placer};

use crate::sim_loop::{SimRequest, SimVariant};

/// The `--placement` names, in the daemon's order (`_native.PLACEMENTS`).
pub(crate) fn placement_names() -> Vec<&'static str> {
    Placement::value_variants()
        .iter()
        .map(|p| p.label())
        .collect()
}

/// The policy called `name` (the daemon's `--placement` values); the error lists them.
pub(crate) fn placement_named(name: &str) -> Result<Placement, String> {
    Placement::value_variants()
        .iter()
        .copied()
        .find(|p| p.label() == name)
        .ok_or_else(|| {
            format!(
                "placement must be one of {}, got {name:?}",
                placement_names().join(", ")
            )
        })
}

/// The placer of one run and the variants' ranks and host bytes it prices (the engine's
/// `ranks`: a LoRA adapter's rank, 0 for a delta).
pub(crate) struct SimPlacer {
    placer: Placer,
    ranks: HashMap<u32, (u32, u64)>,
    /// Requests placed so far: `random`'s draw, as the engine's tickets.
    tickets: u64,
}

impl SimPlacer {
    pub(crate) fn new(placer: Placer, variants: &[SimVariant]) -> Self {
        let ranks = variants
            .iter()
            .enumerate()
            .map(|(i, v)| {
                let rank = if v.kind == VariantKind::Lora {
                    v.rank
                } else {
                    0
                };
                (i as u32 + 1, (rank, v.host_bytes))
            })
            .collect();
        Self {
            placer,
            ranks,
            tickets: 0,
        }
    }

    /// The worker `req` goes to among `workers` (each worker's scheduler and its live requests,
    /// routed and not finished), where a worker has room below `max_queued` live requests. When
    /// none has room this is the least loaded one, whose full queue then refuses the request.
    pub(crate) fn choose(
        &mut self,
        workers: &[(&Scheduler, usize)],
        max_queued: Option<usize>,
        req: &SimRequest,
    ) -> usize {
        let ids = 1..=self.ranks.len() as u32;
        let views: Vec<_> = workers
            .iter()
            .map(|&(sched, live)| {
                let room = max_queued.is_none_or(|m| live < m);
                WorkerLoad::of(sched, ids.clone()).view(true, live, room, req.variant, &self.ranks)
            })
            .collect();
        let (rank, adapter_bytes) = self.ranks.get(&req.variant).copied().unwrap_or((0, 0));
        let incoming = Incoming {
            rank,
            prompt_tokens: req.prompt_len,
            adapter_bytes,
        };
        let ticket = self.tickets;
        self.tickets += 1;
        self.placer
            .choose(&views, &incoming, ticket)
            .expect("every simulated worker is ready")
            .worker
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policies_are_named_as_the_daemons_flag() {
        assert_eq!(
            placement_names(),
            ["caraserve", "least-loaded", "first-fit", "random"]
        );
        for name in placement_names() {
            assert_eq!(placement_named(name).unwrap().label(), name);
        }
        let err = placement_named("round-robin").unwrap_err();
        assert!(
            err.contains("caraserve, least-loaded, first-fit, random")
                && err.contains("round-robin"),
            "{err}"
        );
    }
}
