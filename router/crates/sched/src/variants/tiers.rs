//! The adapter table's tier moves (the residency diagram is in [`super`], the module that owns
//! the table): loading and dropping host copies, placing a variant on the GPU (LoRA pages or a
//! delta slot) and evicting it, and the LRU plans that pick which host copies to drop or which
//! idle GPU copies to evict to make room. Each move keeps the table's totals in step and
//! records the [`VariantOp`] the worker must apply; the [`crate::Scheduler`] decides when to
//! move.

use super::{Adapter, StepOps, VariantKind, VariantOp, VariantOpKind, VariantTable};
use crate::block::{BlockAllocator, PageOwner};

impl VariantTable {
    /// Drops the host copies `drops` (the room a host drop plan found), then loads `id`'s.
    pub(crate) fn load_host_after(&mut self, drops: Vec<u32>, id: u32, ops: &mut StepOps) {
        for d in drops {
            self.drop_host(d, ops);
        }
        self.load_host(id, ops);
    }

    /// Loads a host copy of `id` (which has none) and marks it as loaded by the step being
    /// formed.
    pub(crate) fn load_host(&mut self, id: u32, ops: &mut StepOps) {
        let form = self.form;
        let a = self.get_mut(id);
        debug_assert!(!a.on_host, "adapter {id} is already on the host");
        a.on_host = true;
        a.host_loading = true;
        a.step_mark = form;
        let (bytes, path, variant) = (a.spec.host_bytes, a.spec.path.clone(), a.spec.kind);
        self.host_bytes += bytes;
        self.on_host += 1;
        self.host_loads += 1;
        self.touch(id);
        ops.loads.push(VariantOp {
            adapter_id: id,
            variant,
            kind: VariantOpKind::ToHost { path },
        });
    }

    /// The worker reported `id`'s host copy read (or its read failed: the `ToGpu` reports
    /// that). Returns whether a load was pending; unknown ids, and adapters whose copy was
    /// dropped since (the report is stale), change nothing.
    pub(crate) fn host_loaded(&mut self, id: u32) -> bool {
        match self.map.get_mut(&id) {
            Some(a) if a.host_loading => {
                a.host_loading = false;
                true
            }
            _ => false,
        }
    }

    /// Marks delta `id`, placed on the GPU by the step being formed, as loading ahead of its
    /// requests (`gpu_load_reports`): its requests wait for [`VariantTable::gpu_loaded`] while
    /// others run, and it is not evicted meanwhile.
    pub(crate) fn start_gpu_load(&mut self, id: u32) {
        let a = self.get_mut(id);
        debug_assert!(
            a.spec.kind == VariantKind::Delta && a.gpu_blocks.is_some() && a.running == 0,
            "only an idle GPU-resident delta loads ahead"
        );
        a.gpu_loading = true;
    }

    /// The worker reported `id`'s GPU copy finished (or failed: the step that needs it reports
    /// that). Returns whether a load ahead was pending; unknown ids, and deltas not loading
    /// (admitted since, dropped since, or never loaded ahead), change nothing.
    pub(crate) fn gpu_loaded(&mut self, id: u32) -> bool {
        match self.map.get_mut(&id) {
            Some(a) if a.gpu_loading => {
                a.gpu_loading = false;
                true
            }
            _ => false,
        }
    }

    /// Whether running a request of `id` (0 = base) now would wait for a GPU copy of a delta
    /// (`gpu_load_reports`): it is a delta not GPU-resident (its `ToGpu` is still to be sent) or
    /// loading ahead (the copy not reported finished). LoRA adapters: never (their `ToGpu` goes
    /// out with their request's admission).
    pub(crate) fn gpu_load_pending(&self, id: u32) -> bool {
        id != 0 && {
            let a = self.get(id);
            a.spec.kind == VariantKind::Delta && (a.gpu_blocks.is_none() || a.gpu_loading)
        }
    }

    /// Whether placing `id` (0 = base) on the GPU would wait for a host read: it is not
    /// GPU-resident and its host copy is missing or, with `reports`, still loading.
    pub(crate) fn host_copy_pending(&self, id: u32, reports: bool) -> bool {
        id != 0 && {
            let a = self.get(id);
            a.gpu_blocks.is_none() && (!a.on_host || (reports && a.host_loading))
        }
    }

    /// Frees the host copy of `id`.
    pub(crate) fn drop_host(&mut self, id: u32, ops: &mut StepOps) {
        let a = self.get_mut(id);
        debug_assert!(a.on_host, "adapter {id} has no host copy to drop");
        a.on_host = false;
        a.host_loading = false;
        let (bytes, variant) = (a.spec.host_bytes, a.spec.kind);
        self.host_bytes -= bytes;
        self.on_host -= 1;
        ops.drops.push(VariantOp {
            adapter_id: id,
            variant,
            kind: VariantOpKind::DropHost,
        });
    }

    /// Places `id` (host copy present, not GPU-resident) into freshly allocated pages (a LoRA
    /// adapter) or the lowest free delta slot (a delta) and marks it as loaded by the step being
    /// formed. The caller made sure the pages, or a slot, are free.
    pub(crate) fn load_gpu(&mut self, id: u32, blocks: &mut BlockAllocator, ops: &mut StepOps) {
        let form = self.form;
        let slot = (self.get(id).spec.kind == VariantKind::Delta).then(|| self.lowest_free_slot());
        let a = self.get_mut(id);
        debug_assert!(
            a.on_host,
            "adapter {id} goes to the GPU without a host copy"
        );
        debug_assert!(a.gpu_blocks.is_none(), "adapter {id} is already on the GPU");
        let n = a.spec.num_blocks;
        let mut pages = Vec::with_capacity(n as usize);
        let ok = blocks.allocate(PageOwner::Adapter(id), n, &mut pages);
        assert!(
            ok,
            "adapter {id}: {n} free pages were checked by the caller"
        );
        a.gpu_blocks = Some(pages.clone());
        a.delta_slot = slot;
        a.step_mark = form;
        // The worker's `ToGpu` waits for the read, so the copy is ready for every later step.
        a.host_loading = false;
        let variant = a.spec.kind;
        match slot {
            None => self.on_gpu += 1,
            Some(s) => {
                self.delta_slots.insert(s, id);
            }
        }
        self.gpu_blocks += n;
        self.gpu_loads += 1;
        ops.loads.push(VariantOp {
            adapter_id: id,
            variant,
            kind: VariantOpKind::ToGpu {
                block_ids: pages,
                slot,
            },
        });
    }

    /// The lowest delta slot no delta holds (the caller checked one is free below `max_deltas`).
    fn lowest_free_slot(&self) -> u32 {
        (0..)
            .zip(self.delta_slots.keys())
            .find(|(want, &taken)| *want != taken)
            .map_or(self.delta_slots.len() as u32, |(free, _)| free)
    }

    /// Frees the pages (or the delta slot) of GPU-resident `id` (no running request may use
    /// it).
    pub(super) fn drop_gpu(&mut self, id: u32, blocks: &mut BlockAllocator, ops: &mut StepOps) {
        let a = self.get_mut(id);
        debug_assert_eq!(
            a.running, 0,
            "adapter {id} evicted while running requests use it"
        );
        let pages = a.gpu_blocks.take().expect("adapter is GPU-resident");
        // A copy still under way is the worker's to finish or cancel before the slot is reused.
        a.gpu_loading = false;
        let variant = a.spec.kind;
        match a.delta_slot.take() {
            None => self.on_gpu -= 1,
            Some(s) => {
                self.delta_slots.remove(&s);
            }
        }
        blocks.release(PageOwner::Adapter(id), &pages);
        self.gpu_blocks -= pages.len() as u32;
        ops.drops.push(VariantOp {
            adapter_id: id,
            variant,
            kind: VariantOpKind::DropGpu,
        });
    }

    /// Evicts idle GPU-resident `id` to make room (counted as an eviction).
    pub(crate) fn evict_gpu(&mut self, id: u32, blocks: &mut BlockAllocator, ops: &mut StepOps) {
        self.drop_gpu(id, blocks, ops);
        self.gpu_evictions += 1;
    }

    /// Whether `a` (id `id`) may be evicted from the GPU now: of kind `kind`, resident, no
    /// running user, not loaded by the step being formed, and not `keep`.
    fn evictable(&self, id: u32, a: &Adapter, keep: u32, kind: VariantKind) -> bool {
        id != keep
            && a.spec.kind == kind
            && a.running == 0
            && a.gpu_blocks.is_some()
            && a.step_mark != self.form
    }

    /// The least recently used evictable GPU-resident adapter of kind `kind` other than `keep`.
    /// A delta still loading ahead of its requests (`gpu_loading`) only when `take_loading`, and
    /// then only when no other will do.
    fn lru_idle(&self, keep: u32, kind: VariantKind, take_loading: bool) -> Option<u32> {
        self.map
            .iter()
            .filter(|&(&id, a)| {
                self.evictable(id, a, keep, kind) && (take_loading || !a.gpu_loading)
            })
            .min_by_key(|&(&id, a)| (a.gpu_loading, a.last_use, id))
            .map(|(&id, _)| id)
    }

    /// The least recently used evictable LoRA adapter other than `keep` (evicting it frees
    /// pages; deltas hold none, so they never go for pages).
    pub(crate) fn lru_idle_gpu(&self, keep: u32) -> Option<u32> {
        self.lru_idle(keep, VariantKind::Lora, false)
    }

    /// The least recently used evictable delta other than `keep` (evicting it frees a slot).
    /// A delta loading ahead of its requests is skipped, unless `take_loading` (a step in which
    /// nothing else runs: no report could come back before the step is sent, so a loading
    /// delta must not hold a slot the queue's head needs); then it goes last.
    pub(crate) fn lru_idle_delta(&self, keep: u32, take_loading: bool) -> Option<u32> {
        self.lru_idle(keep, VariantKind::Delta, take_loading)
    }

    /// Whether one more delta may be placed on the GPU without evicting one.
    pub(crate) fn delta_slot_free(&self, max_deltas: usize) -> bool {
        self.delta_slots.len() < max_deltas
    }

    /// Whether `id` is a registered delta.
    pub(crate) fn is_delta(&self, id: u32) -> bool {
        self.map
            .get(&id)
            .is_some_and(|a| a.spec.kind == VariantKind::Delta)
    }

    /// Evictable LoRA adapters other than `keep`, least recently used first, just enough of
    /// them to free `pages` pages; `None` when all of them together free fewer.
    pub(crate) fn gpu_eviction_plan(&self, pages: u64, keep: u32) -> Option<Vec<u32>> {
        let mut cands: Vec<(u64, u32, u32)> = self
            .map
            .iter()
            .filter(|&(&id, a)| self.evictable(id, a, keep, VariantKind::Lora))
            .map(|(&id, a)| (a.last_use, id, a.spec.num_blocks))
            .collect();
        cands.sort_unstable();
        take_until(cands.into_iter().map(|(_, id, n)| (id, n as u64)), pages)
    }

    /// Host copies to drop to free `bytes` bytes: `class(id)` is `None` for a copy that must
    /// stay, else its class (lower classes go first), then least recently used first. `None`
    /// when all droppable copies together free fewer bytes.
    pub(crate) fn host_drop_plan(
        &self,
        bytes: u64,
        mut class: impl FnMut(u32) -> Option<u8>,
    ) -> Option<Vec<u32>> {
        let mut cands: Vec<(u8, u64, u32, u64)> = self
            .map
            .iter()
            .filter(|(_, a)| a.on_host)
            .filter_map(|(&id, a)| class(id).map(|c| (c, a.last_use, id, a.spec.host_bytes)))
            .collect();
        cands.sort_unstable();
        take_until(cands.into_iter().map(|(_, _, id, b)| (id, b)), bytes)
    }

    /// Host bytes held beyond `budget` if `extra` more were loaded now.
    pub(crate) fn host_deficit(&self, extra: u64, budget: u64) -> u64 {
        (self.host_bytes + extra).saturating_sub(budget)
    }

    /// The worker lost everything: no adapter is on the host or the GPU any more and their
    /// pages are free. Registrations and use counts stay.
    pub(crate) fn forget_residency(&mut self, blocks: &mut BlockAllocator) {
        for (&id, a) in self.map.iter_mut() {
            if let Some(pages) = a.gpu_blocks.take() {
                blocks.release(PageOwner::Adapter(id), &pages);
            }
            a.on_host = false;
            a.host_loading = false;
            a.gpu_loading = false;
            a.delta_slot = None;
        }
        self.host_bytes = 0;
        self.gpu_blocks = 0;
        self.on_gpu = 0;
        self.delta_slots.clear();
        self.on_host = 0;
    }
}

/// The shortest prefix of `items` (id, size) whose sizes sum to at least `need`, as ids;
/// `None` when all of them sum to less.
fn take_until(items: impl Iterator<Item = (u32, u64)>, need: u64) -> Option<Vec<u32>> {
    let mut got = 0u64;
    let mut ids = Vec::new();
    for (id, size) in items {
        if got >= need {
            break;
        }
        got += size;
        ids.push(id);
    }
    (got >= need).then_some(ids)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::SchedulerConfig;
    use crate::variants::VariantSpec;

    fn spec(num_blocks: u32, host_bytes: u64) -> VariantSpec {
        VariantSpec {
            kind: VariantKind::Lora,
            num_blocks,
            host_bytes,
            path: "/adapters/a".to_string(),
        }
    }

    #[test]
    fn take_until_stops_at_the_first_prefix_that_covers() {
        let items = [(1, 2u64), (2, 3), (3, 4)];
        assert_eq!(take_until(items.into_iter(), 0), Some(vec![]));
        assert_eq!(take_until(items.into_iter(), 2), Some(vec![1]));
        assert_eq!(take_until(items.into_iter(), 3), Some(vec![1, 2]));
        assert_eq!(take_until(items.into_iter(), 9), Some(vec![1, 2, 3]));
        assert_eq!(take_until(items.into_iter(), 10), None);
    }

    #[test]
    fn deltas_take_slots_not_pages_and_are_never_evicted_for_pages() {
        let cfg = SchedulerConfig {
            max_deltas: 2,
            ..SchedulerConfig::new(4, 8, 64)
        };
        let mut blocks = BlockAllocator::new(8);
        let mut t = VariantTable::default();
        let mut ops = StepOps::default();
        let delta = |host_bytes| VariantSpec {
            kind: VariantKind::Delta,
            ..spec(0, host_bytes)
        };
        t.register(1, spec(2, 10), &cfg).unwrap();
        t.register(2, delta(10), &cfg).unwrap();
        t.register(3, delta(10), &cfg).unwrap();
        for id in 1..=3 {
            t.load_host(id, &mut ops);
            t.load_gpu(id, &mut blocks, &mut ops);
        }
        assert_eq!(blocks.num_free(), 6, "only the LoRA adapter took pages");
        assert_eq!((t.num_on_gpu(), t.num_deltas_on_gpu()), (1, 2));
        assert!(!t.delta_slot_free(2));
        let to_gpu = |id: u32| -> Vec<VariantOpKind> {
            let ops = ops.loads.iter().filter(|op| op.adapter_id == id);
            let kinds = ops.map(|op| op.kind.clone());
            kinds
                .filter(|k| matches!(k, VariantOpKind::ToGpu { .. }))
                .collect()
        };
        let slot = |s| VariantOpKind::ToGpu {
            block_ids: vec![],
            slot: Some(s),
        };
        assert_eq!(to_gpu(2), [slot(0)], "a delta takes a slot, no pages");
        assert_eq!(to_gpu(3), [slot(1)]);
        assert!(
            matches!(&to_gpu(1)[..], [VariantOpKind::ToGpu { slot: None, .. }]),
            "a LoRA adapter has no slot"
        );
        t.begin_step();
        // Pages come from LoRA adapters only; slots from deltas only.
        assert_eq!(t.lru_idle_gpu(0), Some(1));
        assert_eq!(t.gpu_eviction_plan(1, 0), Some(vec![1]));
        assert_eq!(t.gpu_eviction_plan(3, 0), None);
        assert_eq!(t.lru_idle_delta(0, false), Some(2));
        assert_eq!(t.lru_idle_delta(2, false), Some(3));
        t.add_user(2);
        t.start_running(2);
        assert_eq!(t.lru_idle_delta(0, false), Some(3), "a running delta stays");
        let mut drops = StepOps::default();
        t.evict_gpu(3, &mut blocks, &mut drops);
        assert!(t.delta_slot_free(2));
        // The freed slot is the lowest free one: the next delta takes it.
        t.register(4, delta(10), &cfg).unwrap();
        t.load_host(4, &mut ops);
        t.load_gpu(4, &mut blocks, &mut ops);
        assert_eq!(
            (t.get(2).delta_slot, t.get(4).delta_slot),
            (Some(0), Some(1))
        );
        t.begin_step();
        let mut drops = StepOps::default();
        t.evict_gpu(4, &mut blocks, &mut drops);
        assert_eq!(t.check(&blocks, &cfg), Ok(2));
        let no_slots = SchedulerConfig {
            max_deltas: 0,
            ..cfg.clone()
        };
        assert!(t
            .check(&blocks, &no_slots)
            .unwrap_err()
            .contains("max_deltas"));
    }

    #[test]
    fn a_delta_loading_ahead_is_evicted_only_when_allowed_and_last() {
        let cfg = SchedulerConfig {
            max_deltas: 3,
            gpu_load_reports: true,
            ..SchedulerConfig::new(4, 8, 64)
        };
        let mut blocks = BlockAllocator::new(8);
        let mut t = VariantTable::default();
        let mut ops = StepOps::default();
        for id in 1..=3 {
            let delta = VariantSpec {
                kind: VariantKind::Delta,
                ..spec(0, 10)
            };
            t.register(id, delta, &cfg).unwrap();
            t.load_host(id, &mut ops);
            t.load_gpu(id, &mut blocks, &mut ops);
        }
        // Delta 1 is the least recently used; it loads ahead, and so does 3.
        t.start_gpu_load(1);
        t.start_gpu_load(3);
        assert!(t.gpu_load_pending(1) && !t.gpu_load_pending(2));
        assert_eq!(t.check(&blocks, &cfg), Ok(0));
        t.begin_step();
        assert_eq!(
            t.lru_idle_delta(0, false),
            Some(2),
            "loading deltas are skipped"
        );
        assert_eq!(t.lru_idle_delta(2, false), None);
        assert_eq!(t.lru_idle_delta(0, true), Some(2), "and taken last");
        assert_eq!(
            t.lru_idle_delta(2, true),
            Some(1),
            "least recently used first"
        );
        // The report settles a load once; unknown ids and deltas not loading change nothing.
        assert!(t.gpu_loaded(1));
        assert!(!t.gpu_loaded(1) && !t.gpu_loaded(2) && !t.gpu_loaded(99));
        assert_eq!(t.lru_idle_delta(2, false), Some(1));
        // Admission (the step waits for the copy) and a drop end a load too.
        t.add_user(3);
        t.start_running(3);
        assert!(!t.get(3).gpu_loading && !t.gpu_loaded(3));
        t.start_gpu_load(2);
        t.evict_gpu(2, &mut blocks, &mut ops);
        assert!(
            !t.get(2).gpu_loading && t.gpu_load_pending(2),
            "off the GPU: a load is due"
        );
        // Marked loading while running, or without reports, breaks the table's invariants.
        t.map.get_mut(&3).unwrap().gpu_loading = true;
        assert!(t.check(&blocks, &cfg).unwrap_err().contains("loading"));
        t.map.get_mut(&3).unwrap().gpu_loading = false;
        t.start_gpu_load(1);
        let no_reports = SchedulerConfig {
            gpu_load_reports: false,
            ..cfg.clone()
        };
        assert!(t
            .check(&blocks, &no_reports)
            .unwrap_err()
            .contains("gpu_load_reports"));
    }

    #[test]
    fn eviction_plans_follow_lru_and_skip_pinned_adapters() {
        let cfg = SchedulerConfig::new(4, 16, 64);
        let mut blocks = BlockAllocator::new(16);
        let mut t = VariantTable::default();
        let mut ops = StepOps::default();
        for id in 1..=3 {
            t.register(id, spec(2, 10), &cfg).unwrap();
            t.load_host(id, &mut ops);
            t.load_gpu(id, &mut blocks, &mut ops);
        }
        // Loaded by the step being formed: nothing may be evicted (or dropped) in it.
        assert_eq!(t.lru_idle_gpu(0), None);
        assert_eq!(t.gpu_eviction_plan(1, 0), None);
        assert!(t.needed_by_step(1));
        t.begin_step();
        assert!(!t.needed_by_step(1));
        // Use order: 2, then 3, then 1 becomes idle last. 3 stays running.
        for id in [2, 3, 1] {
            t.add_user(id);
            t.start_running(id);
        }
        t.stop_running(2);
        t.stop_running(1);
        assert_eq!(t.lru_idle_gpu(0), Some(2));
        assert_eq!(t.lru_idle_gpu(2), Some(1), "the kept adapter is skipped");
        assert_eq!(t.gpu_eviction_plan(3, 0), Some(vec![2, 1]));
        assert_eq!(
            t.gpu_eviction_plan(5, 0),
            None,
            "3 is running: only 4 pages"
        );
        // Host: class None keeps a copy, lower classes go first.
        let plan = t.host_drop_plan(15, |id| match id {
            1 => Some(0),
            2 => Some(1),
            _ => None,
        });
        assert_eq!(plan, Some(vec![1, 2]));
        // Stamps: 3 was admitted last at tick 5, 2 and 1 went idle at ticks 7 and 8.
        assert_eq!(t.host_drop_plan(21, |_| Some(0)), Some(vec![3, 2, 1]));
        assert_eq!(t.host_drop_plan(31, |_| Some(0)), None);
        let budget = |host_adapter_bytes| SchedulerConfig {
            host_adapter_bytes,
            ..cfg.clone()
        };
        assert_eq!(t.check(&blocks, &budget(30)), Ok(6));
        assert!(
            t.check(&blocks, &budget(29)).is_err(),
            "30 bytes held > budget 29"
        );
    }
}
