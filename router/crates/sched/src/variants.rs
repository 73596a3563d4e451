//! The adapter table: every registered variant (a LoRA adapter or a compressed full fine-tune,
//! a "delta"; [`VariantKind`]), where its weights are (S-LoRA tiers: disk -> worker host memory
//! -> GPU), who uses it, and when it was last used. The [`crate::Scheduler`] decides *when* to
//! move an adapter; this module does the bookkeeping of each move (pages, slots, host bytes,
//! counters) and records the [`VariantOp`] the worker must apply.
//!
//! On the GPU the two kinds live in different places: a LoRA adapter in `num_blocks` pages of
//! the one pool that also holds the KV cache, a delta in one of the worker's `max_deltas` delta
//! slots (DeltaZip; no pool pages: its `num_blocks` is 0 and its `ToGpu` carries no page ids but
//! the slot). The table picks both, pages and slots: the worker allocates nothing it decides.
//! Host copies of both kinds share the one host budget (`host_adapter_bytes`).
//!
//! Residency of one adapter (the router's accounting; the worker follows the ops):
//!
//! ```text
//!                 ToHost                  ToGpu(pages)
//!   disk only ───────────▶ host ─────────────────────────▶ host + GPU
//!       ▲    ◀─────────────  │  ◀───────────────────────────  │    │
//!       │       DropHost     │           DropGpu              │    │ DropHost (GPU copy stays)
//!       │                    ▼                                │    ▼
//!       └───────────────── (DropGpu) ◀──────────────────────────── GPU only
//! ```
//!
//! `ToGpu` needs a host copy (the worker copies it into the pages or the slot), so "GPU only"
//! is reached by dropping the host copy of a GPU-resident adapter, never by loading. Pages of a
//! GPU-resident LoRA adapter are owned by [`PageOwner::Adapter`] in the one [`BlockAllocator`]
//! that also holds the KV cache; a GPU-resident delta holds an empty placement and counts
//! against the slot limit instead.
//!
//! Users: `users` counts live (waiting + running) requests naming the adapter (unregistering
//! is refused while it is non-zero); `running` counts the running ones (the GPU copy is never
//! evicted while it is non-zero). `last_use` is a tick stamped when a request using the adapter
//! is admitted, when the last running one leaves, and when a host copy is loaded: the LRU order
//! of eviction.
//!
//! This file holds the types, the table's bookkeeping (registration, users, step marks,
//! totals) and its invariants; `adapters/tiers.rs` holds the moves of the diagram and the LRU
//! plans that pick what to drop or evict.

use std::collections::BTreeMap;

use crate::block::{BlockAllocator, PageOwner};
use crate::config::SchedulerConfig;
use crate::error::SchedError;

mod tiers;

/// The two kinds of variant that share the adapter id space. Their labels (`lora`, `delta`) and
/// wire values are the wire's (`deltaserve_ipc::wire::VariantKind`); the router translates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum VariantKind {
    /// A PEFT LoRA adapter: `num_blocks` pages of the KV pool while GPU-resident (S-LoRA).
    Lora,
    /// A compressed full fine-tune (DeltaZip): one of the worker's `max_deltas` slots while
    /// GPU-resident, no pool pages.
    Delta,
}

/// What the scheduler needs to know about an adapter, from the worker's inspection of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VariantSpec {
    /// LoRA (pool pages on the GPU) or delta (a worker delta slot on the GPU).
    pub kind: VariantKind,
    /// Pool pages its weights take on the GPU (the worker's page layout decides); at least 1
    /// for a LoRA adapter, always 0 for a delta.
    pub num_blocks: u32,
    /// Bytes its host copy takes in worker memory; counted against the host budget (one budget
    /// for both kinds).
    pub host_bytes: u64,
    /// The directory the worker loads it from (sent in `ToHost`): a PEFT directory for LoRA,
    /// a `deltaserve compress` output for a delta.
    pub path: String,
}

/// One tier move for the worker to apply (after a step's releases, before its requests run).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VariantOp {
    /// The adapter it moves.
    pub adapter_id: u32,
    /// Its kind (from its registration): the worker applies the op with the pool of that kind.
    pub variant: VariantKind,
    /// The move.
    pub kind: VariantOpKind,
}

/// The four tier moves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VariantOpKind {
    /// Read and validate the adapter from `path` into host memory (may run in the background;
    /// a later `ToGpu` of the same adapter waits for it).
    ToHost {
        /// The adapter's directory (PEFT or delta).
        path: String,
    },
    /// Copy the host copy into these pool pages, in order (LoRA), or into delta slot `slot`
    /// (delta: `block_ids` empty). A `ToHost` came earlier and no `DropHost` since.
    ToGpu {
        /// The pages, `VariantSpec::num_blocks` of them; the same ids as KV pages. Empty for a
        /// delta.
        block_ids: Vec<u32>,
        /// The delta slot, in `0..max_deltas`, free until now (the lowest free one); `None` for
        /// a LoRA adapter.
        slot: Option<u32>,
    },
    /// Forget the GPU placement; a LoRA adapter's pages already belong to the router again, a
    /// delta's slot is free.
    DropGpu,
    /// Free the host copy.
    DropHost,
}

impl VariantOp {
    /// Whether the op frees memory (`DropGpu`, `DropHost`): those go before every load.
    pub fn is_drop(&self) -> bool {
        matches!(self.kind, VariantOpKind::DropGpu | VariantOpKind::DropHost)
    }

    /// A short name of the move for logs and tests (`to_host`, `to_gpu`, `drop_gpu`,
    /// `drop_host`; the wire sends a number, `deltaserve_ipc::wire::TierOp`).
    pub fn op_name(&self) -> &'static str {
        match self.kind {
            VariantOpKind::ToHost { .. } => "to_host",
            VariantOpKind::ToGpu { .. } => "to_gpu",
            VariantOpKind::DropGpu => "drop_gpu",
            VariantOpKind::DropHost => "drop_host",
        }
    }
}

/// Where a registered adapter's weights are, as the scheduler accounts them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VariantResidency<'a> {
    /// The worker holds (or is loading) a host copy.
    pub on_host: bool,
    /// The pool pages holding its weights, when GPU-resident (empty for a resident delta).
    pub gpu_blocks: Option<&'a [u32]>,
    /// The delta slot holding it, when it is a GPU-resident delta.
    pub delta_slot: Option<u32>,
}

/// One registered adapter.
#[derive(Debug, Clone)]
pub(crate) struct Adapter {
    /// Size and source, from registration.
    pub(crate) spec: VariantSpec,
    /// A host copy exists on the worker (after its `ToHost`, until a `DropHost`).
    pub(crate) on_host: bool,
    /// Its `ToHost` went out and the worker has not reported the read finished
    /// ([`VariantTable::host_loaded`]) nor waited for it in a `ToGpu`; only consulted with
    /// `host_copy_reports`.
    pub(crate) host_loading: bool,
    /// A delta whose `ToGpu` went out ahead of its requests' admission (`gpu_load_reports`, in
    /// a step with running requests) and whose copy the worker has not reported finished
    /// ([`VariantTable::gpu_loaded`]). Cleared by that report, by the admission of a request
    /// using it (that step waits for the copy) and by `DropGpu`. While set and requests run, its
    /// requests are passed over and it is not evicted (see `admission.rs`).
    pub(crate) gpu_loading: bool,
    /// Its pool pages while GPU-resident (an empty list for a delta in its slot).
    pub(crate) gpu_blocks: Option<Vec<u32>>,
    /// Its delta slot while it is a GPU-resident delta.
    pub(crate) delta_slot: Option<u32>,
    /// Live (waiting + running) requests naming it; unregistering waits for 0.
    pub(crate) users: usize,
    /// Running requests naming it; its GPU copy is pinned while non-zero.
    pub(crate) running: usize,
    /// LRU stamp (see the module docs); smaller = used longer ago.
    pub(crate) last_use: u64,
    /// Equals the table's `form` when the step being formed loads it (`ToHost` or `ToGpu`): a
    /// drop of it in that step would go out before the load, so it must not be dropped in it.
    pub(crate) step_mark: u64,
    /// Which registration this is (distinct for every `register`, from 1): the prefix cache's
    /// key, so pages computed with an earlier registration of the same id are never reused.
    pub(crate) generation: u64,
}

/// Adapter ops formed while building one step, kept apart so every drop precedes every load.
#[derive(Debug, Default)]
pub(crate) struct StepOps {
    /// `DropGpu` / `DropHost`, in decision order.
    pub(crate) drops: Vec<VariantOp>,
    /// `ToHost` / `ToGpu`, in decision order (a `ToHost` before the `ToGpu` it feeds).
    pub(crate) loads: Vec<VariantOp>,
}

impl StepOps {
    /// Whether no op was formed.
    pub(crate) fn is_empty(&self) -> bool {
        self.drops.is_empty() && self.loads.is_empty()
    }
}

/// Every registered adapter plus the tier totals, kept in step with the entries.
#[derive(Debug, Clone, Default)]
pub(crate) struct VariantTable {
    /// Registered adapters by id (a `BTreeMap` so scans, and thus eviction ties, are ordered).
    pub(crate) map: BTreeMap<u32, Adapter>,
    /// Sum of `host_bytes` over adapters with a host copy.
    host_bytes: u64,
    /// Sum of `num_blocks` over GPU-resident adapters.
    gpu_blocks: u32,
    /// GPU-resident LoRA adapters (in pool pages).
    on_gpu: usize,
    /// Delta slot -> the GPU-resident delta in it; at most `max_deltas` slots, each below it.
    delta_slots: BTreeMap<u32, u32>,
    /// Adapters with a host copy.
    on_host: usize,
    /// Source of `last_use` stamps.
    tick: u64,
    /// Number of the step being formed (every `schedule` call), for `step_mark`.
    form: u64,
    /// `ToGpu` ops emitted since start (both kinds).
    pub(crate) gpu_loads: u64,
    /// `ToHost` ops emitted since start (both kinds).
    pub(crate) host_loads: u64,
    /// GPU evictions since start, both kinds (unregistering not counted).
    pub(crate) gpu_evictions: u64,
    /// Registrations since start: the last one's `generation`.
    registrations: u64,
}

impl VariantTable {
    /// Adds an adapter in the disk tier. Refuses (changing nothing) id 0, a registered id, a
    /// LoRA adapter with zero pages, a delta with pages or while `max_deltas` is 0, an empty
    /// path, more pages than the pool or more host bytes than the host budget.
    pub(crate) fn register(
        &mut self,
        id: u32,
        spec: VariantSpec,
        cfg: &SchedulerConfig,
    ) -> Result<(), SchedError> {
        if id == 0 {
            return Err(SchedError::ReservedAdapterId);
        }
        if self.map.contains_key(&id) {
            return Err(SchedError::DuplicateAdapter { adapter_id: id });
        }
        match spec.kind {
            VariantKind::Lora if spec.num_blocks == 0 => {
                return Err(SchedError::InvalidAdapter {
                    adapter_id: id,
                    reason: "num_blocks is 0 (a LoRA adapter's weights occupy at least one page)"
                        .to_string(),
                });
            }
            VariantKind::Delta if spec.num_blocks != 0 => {
                return Err(SchedError::InvalidAdapter {
                    adapter_id: id,
                    reason: format!(
                        "num_blocks is {} but a delta takes a worker delta slot, not pool pages \
                         (num_blocks must be 0)",
                        spec.num_blocks
                    ),
                });
            }
            VariantKind::Delta if cfg.max_deltas == 0 => {
                return Err(SchedError::DeltasDisabled { adapter_id: id });
            }
            _ => {}
        }
        if spec.path.is_empty() {
            return Err(SchedError::InvalidAdapter {
                adapter_id: id,
                reason: "path is empty (the worker loads the adapter from it)".to_string(),
            });
        }
        if spec.num_blocks > cfg.num_blocks {
            return Err(SchedError::AdapterTooBig {
                adapter_id: id,
                num_blocks: spec.num_blocks,
                pool_blocks: cfg.num_blocks,
            });
        }
        if spec.host_bytes > cfg.host_adapter_bytes {
            return Err(SchedError::AdapterTooBigForHost {
                adapter_id: id,
                host_bytes: spec.host_bytes,
                host_budget: cfg.host_adapter_bytes,
            });
        }
        self.map.insert(
            id,
            Adapter {
                spec,
                on_host: false,
                host_loading: false,
                gpu_loading: false,
                gpu_blocks: None,
                delta_slot: None,
                users: 0,
                running: 0,
                last_use: 0,
                step_mark: 0,
                generation: self.registrations + 1,
            },
        );
        self.registrations += 1;
        Ok(())
    }

    /// Removes an unused adapter: frees its pages at once and appends its `DropGpu` /
    /// `DropHost` to `pending` for the worker. Refuses an unknown id or one still in use.
    pub(crate) fn unregister(
        &mut self,
        id: u32,
        blocks: &mut BlockAllocator,
        pending: &mut Vec<VariantOp>,
    ) -> Result<(), SchedError> {
        let a = self.map.get(&id).ok_or(SchedError::UnknownAdapter {
            request: None,
            adapter_id: id,
        })?;
        if a.users > 0 {
            return Err(SchedError::AdapterInUse {
                adapter_id: id,
                users: a.users,
            });
        }
        let mut ops = StepOps::default();
        if a.gpu_blocks.is_some() {
            self.drop_gpu(id, blocks, &mut ops);
        }
        if self.map[&id].on_host {
            self.drop_host(id, &mut ops);
        }
        pending.append(&mut ops.drops);
        self.map.remove(&id);
        Ok(())
    }

    /// The adapter's entry. Panics on an unregistered id: callers only pass ids of live
    /// requests, which add_request checked and unregistering cannot remove.
    pub(crate) fn get(&self, id: u32) -> &Adapter {
        &self.map[&id]
    }

    /// Mutable entry (same contract as [`VariantTable::get`]).
    fn get_mut(&mut self, id: u32) -> &mut Adapter {
        self.map
            .get_mut(&id)
            .expect("adapter of a live request is registered")
    }

    /// Stamps `id` as used now.
    fn touch(&mut self, id: u32) {
        self.tick += 1;
        let tick = self.tick;
        self.get_mut(id).last_use = tick;
    }

    /// A new live request names `id`.
    pub(crate) fn add_user(&mut self, id: u32) {
        self.get_mut(id).users += 1;
    }

    /// A live request naming `id` ended (it must no longer be counted as running).
    pub(crate) fn remove_user(&mut self, id: u32) {
        let a = self.get_mut(id);
        debug_assert!(a.users > a.running, "adapter {id}: user count underflow");
        a.users -= 1;
    }

    /// A request naming `id` was admitted (it must be GPU-resident now). A copy of it still
    /// under way counts as finished: the worker's step waits for it before running the request.
    pub(crate) fn start_running(&mut self, id: u32) {
        let a = self.get_mut(id);
        debug_assert!(
            a.gpu_blocks.is_some(),
            "adapter {id} runs but is not on the GPU"
        );
        a.gpu_loading = false;
        a.running += 1;
        self.touch(id);
    }

    /// A running request naming `id` left the worker (finished, aborted, preempted). The last
    /// one to leave stamps the adapter's last use.
    pub(crate) fn stop_running(&mut self, id: u32) {
        let a = self.get_mut(id);
        debug_assert!(a.running > 0, "adapter {id}: running count underflow");
        a.running -= 1;
        if a.running == 0 {
            self.touch(id);
        }
    }

    /// Starts forming a step: older step marks stop counting.
    pub(crate) fn begin_step(&mut self) {
        self.form += 1;
    }

    /// Whether the step being formed loads `id` (so must not drop it).
    pub(crate) fn needed_by_step(&self, id: u32) -> bool {
        self.map.get(&id).is_some_and(|a| a.step_mark == self.form)
    }

    /// Registered adapters.
    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether no adapter is registered (then every request is a base one).
    pub(crate) fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Host bytes held.
    pub(crate) fn host_bytes(&self) -> u64 {
        self.host_bytes
    }

    /// Pool pages held by adapters.
    pub(crate) fn gpu_blocks(&self) -> u32 {
        self.gpu_blocks
    }

    /// GPU-resident LoRA adapters.
    pub(crate) fn num_on_gpu(&self) -> usize {
        self.on_gpu
    }

    /// GPU-resident deltas (delta slots taken).
    pub(crate) fn num_deltas_on_gpu(&self) -> usize {
        self.delta_slots.len()
    }

    /// Adapters with a host copy.
    pub(crate) fn num_on_host(&self) -> usize {
        self.on_host
    }

    /// Table-level invariants: totals match the entries, the host budget holds, every
    /// GPU-resident adapter owns exactly its `num_blocks` pages in `blocks` (none for a delta),
    /// every GPU-resident delta (and only those) holds its own slot below `max_deltas`, a
    /// running user implies GPU residency, and a delta loading onto the GPU ahead of its requests
    /// is GPU-resident with no running user (only with `gpu_load_reports`).
    /// Returns the number of pages adapters own.
    pub(crate) fn check(
        &self,
        blocks: &BlockAllocator,
        cfg: &SchedulerConfig,
    ) -> Result<u64, String> {
        let budget = cfg.host_adapter_bytes;
        let (mut host, mut pages, mut on_gpu, mut on_host) = (0u64, 0u64, 0usize, 0usize);
        let mut deltas_on_gpu = 0usize;
        for (&id, a) in &self.map {
            if a.spec.kind == VariantKind::Delta && a.spec.num_blocks != 0 {
                return Err(format!("delta {id} has num_blocks {}", a.spec.num_blocks));
            }
            if a.running > a.users {
                return Err(format!(
                    "adapter {id}: {} running users > {} users",
                    a.running, a.users
                ));
            }
            if a.gpu_loading {
                if a.spec.kind != VariantKind::Delta || a.gpu_blocks.is_none() || a.running > 0 {
                    return Err(format!(
                        "adapter {id} is marked as loading onto the GPU but is not an idle \
                         GPU-resident delta ({:?}, resident {}, {} running)",
                        a.spec.kind,
                        a.gpu_blocks.is_some(),
                        a.running
                    ));
                }
                if !cfg.gpu_load_reports {
                    return Err(format!(
                        "delta {id} is loading ahead without gpu_load_reports"
                    ));
                }
            }
            if a.on_host {
                host += a.spec.host_bytes;
                on_host += 1;
            } else if a.host_loading {
                return Err(format!(
                    "adapter {id} is loading a host copy it does not have"
                ));
            }
            match &a.gpu_blocks {
                Some(p) => {
                    if p.len() as u32 != a.spec.num_blocks {
                        return Err(format!(
                            "adapter {id} holds {} pages, its spec says {}",
                            p.len(),
                            a.spec.num_blocks
                        ));
                    }
                    for &page in p {
                        if blocks.owner_of(page) != Some(PageOwner::Adapter(id)) {
                            return Err(format!(
                                "page {page} is in adapter {id}'s placement but owned by {:?}",
                                blocks.owner_of(page)
                            ));
                        }
                    }
                    pages += p.len() as u64;
                    match (a.spec.kind, a.delta_slot) {
                        (VariantKind::Lora, None) => on_gpu += 1,
                        (VariantKind::Delta, Some(slot)) => {
                            if slot as usize >= cfg.max_deltas {
                                return Err(format!(
                                    "delta {id} is in slot {slot}, outside max_deltas {}",
                                    cfg.max_deltas
                                ));
                            }
                            if self.delta_slots.get(&slot) != Some(&id) {
                                return Err(format!(
                                    "delta {id} is in slot {slot}, which the table gives to {:?}",
                                    self.delta_slots.get(&slot)
                                ));
                            }
                            deltas_on_gpu += 1;
                        }
                        (kind, slot) => {
                            return Err(format!(
                                "GPU-resident {kind:?} adapter {id} has delta slot {slot:?}"
                            ));
                        }
                    }
                }
                None if a.delta_slot.is_some() => {
                    return Err(format!(
                        "adapter {id} is off the GPU but holds delta slot {:?}",
                        a.delta_slot
                    ));
                }
                None if a.running > 0 => {
                    return Err(format!(
                        "adapter {id} has {} running users but is not on the GPU",
                        a.running
                    ));
                }
                None => {}
            }
        }
        if (host, pages, on_gpu, on_host)
            != (
                self.host_bytes,
                self.gpu_blocks as u64,
                self.on_gpu,
                self.on_host,
            )
        {
            return Err(format!(
                "adapter totals (host bytes, pages, on gpu, on host) are ({}, {}, {}, {}), \
                 the entries sum to ({host}, {pages}, {on_gpu}, {on_host})",
                self.host_bytes, self.gpu_blocks, self.on_gpu, self.on_host
            ));
        }
        if deltas_on_gpu != self.delta_slots.len() {
            return Err(format!(
                "{} delta slots taken, the entries say {deltas_on_gpu}",
                self.delta_slots.len()
            ));
        }
        if deltas_on_gpu > cfg.max_deltas {
            return Err(format!(
                "{deltas_on_gpu} deltas on the GPU > max_deltas {}",
                cfg.max_deltas
            ));
        }
        if host > budget {
            return Err(format!(
                "adapter host copies take {host} bytes > budget {budget}"
            ));
        }
        Ok(pages)
    }
}
