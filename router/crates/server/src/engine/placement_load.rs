//! Each worker's load as placement reads it: a snapshot its actor publishes after every step
//! (live requests per variant, the variants on its GPU and in its host memory) while the handle
//! wants it (more than one worker), the handle's own count of what it placed since, and the
//! placement counters `/metrics` reports. [`WorkerLoad::of`] and [`WorkerLoad::view`] are also
//! how the simulator (`deltaserve._native.simulate`) sees its simulated workers.
//!
//! ```text
//!   actor (after each step) ──publish(users, gpu, host)──▶ LoadCell ◀──view()── EngineHandle
//!                                                            ▲ placed(adapter): the request counts
//!                                                            │ until the actor's next snapshot
//! ```

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use deltaserve_sched::Scheduler;

use super::placement::{Batch, Residency, WorkerView};

/// One worker's published load.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WorkerLoad {
    /// Live (waiting or running) requests per variant id; the base model's are not listed.
    pub users: BTreeMap<u32, usize>,
    /// Variants whose weights are on the GPU (LoRA pages or a delta slot).
    pub gpu: BTreeSet<u32>,
    /// Variants with a host copy.
    pub host: BTreeSet<u32>,
    /// Tokens of the live requests (prompts and outputs): the KV their steps attend over.
    pub context_tokens: u64,
}

impl WorkerLoad {
    /// The load of the worker scheduled by `sched` over the variants `ids`: what its actor
    /// publishes after a step.
    pub fn of(sched: &Scheduler, ids: impl IntoIterator<Item = u32>) -> WorkerLoad {
        let mut load = WorkerLoad {
            context_tokens: sched.live_context_tokens(),
            ..WorkerLoad::default()
        };
        for id in ids {
            let users = sched.adapter_users(id);
            if users > 0 {
                load.users.insert(id, users);
            }
            if let Some(r) = sched.adapter_residency(id) {
                if r.gpu_blocks.is_some() || r.delta_slot.is_some() {
                    load.gpu.insert(id);
                }
                if r.on_host {
                    load.host.insert(id);
                }
            }
        }
        load
    }

    /// The worker as placement sees it for a request of `adapter_id`; `ranks` gives each
    /// variant's rank (0 for a delta or an unknown id).
    pub fn view(
        &self,
        ready: bool,
        outstanding: usize,
        has_room: bool,
        adapter_id: u32,
        ranks: &HashMap<u32, (u32, u64)>,
    ) -> WorkerView {
        let rank = |id: &u32| ranks.get(id).map_or(0, |r| r.0);
        let batch = Batch {
            requests: outstanding,
            rank_sum: self.users.keys().map(|id| u64::from(rank(id))).sum(),
            max_rank: self.users.keys().map(rank).max().unwrap_or(0),
            adapters: self.users.len(),
            context_tokens: self.context_tokens,
        };
        let residency = if adapter_id == 0 || self.gpu.contains(&adapter_id) {
            Residency::Gpu
        } else if self.host.contains(&adapter_id) {
            Residency::Host
        } else {
            Residency::Disk
        };
        WorkerView {
            ready,
            outstanding,
            has_room,
            batch,
            adapter_in_batch: adapter_id != 0 && self.users.contains_key(&adapter_id),
            residency,
        }
    }
}

/// The placement counters of one worker (rows of `metrics.rs`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PlacementReadings {
    /// Requests placement sent to this worker.
    pub placed: u64,
    /// Of those, placed where the predicted decode step broke the TPOT SLO (no worker could
    /// keep it).
    pub placed_over_slo: u64,
}

/// A worker's load, shared by its actor and the handle.
#[derive(Debug, Default)]
pub struct LoadCell {
    /// Set by the handle when it places by load (more than one worker): the actor publishes.
    pub wanted: AtomicBool,
    load: Mutex<WorkerLoad>,
    placed: AtomicU64,
    placed_over_slo: AtomicU64,
}

/// [`LoadCell`] behind an `Arc`.
pub type SharedLoad = Arc<LoadCell>;

impl LoadCell {
    /// The actor's snapshot after a step (it replaces what the handle counted since the last).
    pub fn publish(&self, load: WorkerLoad) {
        *self.load.lock().expect("load lock") = load;
    }

    /// Counts a request of `prompt_tokens` the handle placed here, until the actor's next
    /// snapshot includes it.
    pub fn placed(&self, adapter_id: u32, prompt_tokens: usize, over_slo: bool) {
        self.placed.fetch_add(1, Ordering::Relaxed);
        if over_slo {
            self.placed_over_slo.fetch_add(1, Ordering::Relaxed);
        }
        let mut load = self.load.lock().expect("load lock");
        load.context_tokens += prompt_tokens as u64;
        if adapter_id != 0 {
            *load.users.entry(adapter_id).or_default() += 1;
        }
    }

    /// The counters.
    pub fn readings(&self) -> PlacementReadings {
        PlacementReadings {
            placed: self.placed.load(Ordering::Relaxed),
            placed_over_slo: self.placed_over_slo.load(Ordering::Relaxed),
        }
    }

    /// The worker as placement sees it for a request of `adapter_id` ([`WorkerLoad::view`]).
    pub fn view(
        &self,
        ready: bool,
        outstanding: usize,
        has_room: bool,
        adapter_id: u32,
        ranks: &HashMap<u32, (u32, u64)>,
    ) -> WorkerView {
        let load = self.load.lock().expect("load lock");
        load.view(ready, outstanding, has_room, adapter_id, ranks)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn views_follow_the_snapshot_and_the_requests_placed_since() {
        let cell = LoadCell::default();
        let ranks: HashMap<u32, (u32, u64)> = [(1, (8, 0)), (2, (64, 0)), (3, (16, 0))].into();
        cell.publish(WorkerLoad {
            users: [(1, 3), (2, 1)].into(),
            gpu: [1, 2].into(),
            host: [1, 2, 3].into(),
            context_tokens: 4000,
        });
        let v = cell.view(true, 5, true, 3, &ranks);
        assert_eq!(
            v.batch,
            Batch {
                requests: 5,
                rank_sum: 72,
                max_rank: 64,
                adapters: 2,
                context_tokens: 4000,
            }
        );
        assert_eq!((v.residency, v.adapter_in_batch), (Residency::Host, false));
        assert_eq!(
            cell.view(true, 5, true, 9, &ranks).residency,
            Residency::Disk
        );
        assert_eq!(
            cell.view(true, 5, true, 0, &ranks).residency,
            Residency::Gpu
        );
        cell.placed(3, 100, true);
        let v = cell.view(true, 6, true, 3, &ranks);
        assert!(v.adapter_in_batch && v.batch.rank_sum == 88);
        assert_eq!(
            v.batch.context_tokens, 4100,
            "the placed request's prompt counts"
        );
        assert_eq!(
            cell.readings(),
            PlacementReadings {
                placed: 1,
                placed_over_slo: 1
            }
        );
        cell.publish(WorkerLoad::default()); // the actor's next snapshot replaces the count
        assert!(!cell.view(true, 6, true, 3, &ranks).adapter_in_batch);
    }
}
