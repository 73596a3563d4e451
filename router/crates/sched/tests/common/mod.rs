//! Test harness shared by the scheduler's integration tests: request/config builders, a tiny
//! seeded PRNG, and `FakeWorker`, which applies plans the way the Python worker does and
//! asserts the worker-side contract (pages never shared between requests and adapters, chunks
//! contiguous, tables cover them, adapter ops in a legal order within the host budget and the
//! delta slots, every scheduled request's adapter on the GPU). With `host_copy_reports` it also
//! models host reads that take time: a `to_host` starts a read that the test finishes
//! ([`FakeWorker::finish_reads`]) and reports, and a `to_gpu` of an adapter still being read
//! (which would make the real worker's step wait) is allowed only in a step with no running
//! request. With `gpu_load_reports` it likewise models delta copies beside the steps: a delta's
//! `to_gpu` starts a copy that finishes [`FakeWorker::copy_steps`] steps later (or when the test
//! finishes it, [`FakeWorker::finish_copies`]) and is then reported ([`FakeWorker::gpu_ready`]),
//! and a request running with a delta still being copied (which would make the real worker's step
//! wait) is allowed only in a step with no running request.

#![allow(dead_code)]

use std::collections::BTreeMap;

use deltaserve_sched::{
    PageOwner, ScheduledStep, Scheduler, SchedulerConfig, SeqRequest, VariantKind, VariantOpKind,
    VariantSpec,
};

/// A config with the given geometry and limits.
pub fn cfg(
    block_size: u32,
    num_blocks: u32,
    max_num_seqs: usize,
    budget: usize,
    max_model_len: u32,
) -> SchedulerConfig {
    SchedulerConfig {
        block_size,
        num_blocks,
        max_num_seqs,
        max_num_batched_tokens: budget,
        max_model_len,
        host_adapter_bytes: deltaserve_sched::DEFAULT_HOST_ADAPTER_BYTES,
        prefetch_window: deltaserve_sched::DEFAULT_PREFETCH_WINDOW,
        max_deltas: deltaserve_sched::DEFAULT_MAX_DELTAS,
        host_copy_reports: false,
        gpu_load_reports: false,
        delta_graph_tokens: 0,
        enable_prefix_caching: false,
    }
}

/// A LoRA adapter spec with a path unique to `(id, generation)`.
pub fn adapter(id: u32, generation: u32, num_blocks: u32, host_bytes: u64) -> VariantSpec {
    VariantSpec {
        kind: VariantKind::Lora,
        num_blocks,
        host_bytes,
        path: format!("/adapters/{id}/v{generation}"),
    }
}

/// A delta spec (no pool pages) with a path unique to `(id, generation)`.
pub fn delta(id: u32, generation: u32, host_bytes: u64) -> VariantSpec {
    VariantSpec {
        kind: VariantKind::Delta,
        num_blocks: 0,
        host_bytes,
        path: format!("/deltas/{id}/v{generation}"),
    }
}

/// A request with a recognisable prompt (`id * 1000 + i`), no EOS ids, arrival = id.
pub fn req(id: u64, prompt_len: usize, max_tokens: u32) -> SeqRequest {
    SeqRequest {
        id,
        prompt: (0..prompt_len as u32)
            .map(|i| id as u32 * 1000 + i)
            .collect(),
        max_tokens,
        eos_token_ids: Vec::new(),
        ignore_eos: false,
        arrival: id,
        adapter_id: 0,
        skip_prefix_cache: false,
    }
}

/// [`req`] for adapter `adapter_id`.
pub fn areq(id: u64, prompt_len: usize, max_tokens: u32, adapter_id: u32) -> SeqRequest {
    SeqRequest {
        adapter_id,
        ..req(id, prompt_len, max_tokens)
    }
}

/// SplitMix64: a tiny deterministic PRNG for the property-style tests.
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next_u64() % (hi - lo + 1)
    }
    /// True with probability `pct` percent.
    pub fn pct(&mut self, pct: u64) -> bool {
        self.next_u64() % 100 < pct
    }
}

/// The fake sampler: output token `pos` of request `id` (deterministic, so a recomputed request
/// would sample the same thing, and tests can predict outputs).
pub fn sample_token(id: u64, pos: usize) -> u32 {
    (id as u32).wrapping_mul(7919).wrapping_add(pos as u32 * 31) % 50 + 1
}

/// What the worker keeps per request.
#[derive(Debug, Clone)]
pub struct WorkerReq {
    /// prompt ++ outputs, as the worker knows them.
    pub tokens: Vec<u32>,
    /// Prompt length.
    pub num_prompt: u32,
    /// Tokens whose KV is computed.
    pub computed: u32,
    /// Block table.
    pub blocks: Vec<u32>,
    /// The last step's chunk and whether it sampled, so a dropped output can be undone.
    pub last: Option<(u32, bool)>,
    /// Its adapter (0 = base), from its `new` entry.
    pub adapter_id: u32,
}

/// Applies plans like the real worker and checks the contract.
#[derive(Debug, Clone)]
pub struct FakeWorker {
    pub cfg: SchedulerConfig,
    pub reqs: BTreeMap<u64, WorkerReq>,
    /// Page -> worker-side request or adapter holding it.
    pub pages: BTreeMap<u32, PageOwner>,
    /// What a `to_host` finds on "disk": path -> (adapter id, spec). Survives resets.
    pub disk: BTreeMap<String, (u32, VariantSpec)>,
    /// Host copies: adapter id -> its spec (bytes, pages).
    pub host: BTreeMap<u32, VariantSpec>,
    /// GPU placements: adapter id -> its pages (none for a delta in its slot).
    pub gpu: BTreeMap<u32, Vec<u32>>,
    /// Deltas in delta slots (a subset of `gpu`'s keys) -> the slot each holds: distinct slots
    /// below `cfg.max_deltas`, as the scheduler picked them.
    pub delta_slots: BTreeMap<u32, u32>,
    /// Most deltas ever in slots at once.
    pub max_deltas_seen: usize,
    /// Tokens computed for requests with an adapter (cumulative).
    pub adapter_tokens: u64,
    /// Adapter ops applied (cumulative), by kind: to_host, to_gpu, drop_gpu, drop_host.
    pub op_counts: [u64; 4],
    /// Host copies still being read (only with `cfg.host_copy_reports`), in `to_host` order.
    pub reading: Vec<u32>,
    /// `to_gpu`s that had to wait for a read (cumulative; only in steps with nothing running).
    pub read_waits: u64,
    /// Delta copies still running (only with `cfg.gpu_load_reports`): delta id -> steps left
    /// (counting the one that sent its `to_gpu`), in `to_gpu` order.
    pub copying: Vec<(u32, u32)>,
    /// Steps a delta copy takes: it finishes at the end of the `copy_steps`-th step counting the
    /// one that sent it (1: reported with that step's output; `u32::MAX`: only when the test
    /// finishes it or a step waits for it).
    pub copy_steps: u32,
    /// Finished copies not reported yet (what the next `StepOutput::gpu_ready` lists).
    pub copied: Vec<u32>,
    /// Steps that ran a request whose delta was still being copied (cumulative; only in steps
    /// with nothing running): the step waited for the copy.
    pub copy_waits: u64,
}

impl FakeWorker {
    pub fn new(cfg: SchedulerConfig) -> Self {
        Self {
            cfg,
            reqs: BTreeMap::new(),
            pages: BTreeMap::new(),
            disk: BTreeMap::new(),
            host: BTreeMap::new(),
            gpu: BTreeMap::new(),
            delta_slots: BTreeMap::new(),
            max_deltas_seen: 0,
            adapter_tokens: 0,
            op_counts: [0; 4],
            reading: Vec::new(),
            read_waits: 0,
            copying: Vec::new(),
            copy_steps: 1,
            copied: Vec::new(),
            copy_waits: 0,
        }
    }

    /// Puts an adapter directory on the fake disk (what registration inspected).
    pub fn put_on_disk(&mut self, id: u32, spec: &VariantSpec) {
        self.disk.insert(spec.path.clone(), (id, spec.clone()));
    }

    /// The worker restarted: everything but the disk is gone.
    pub fn reset(&mut self) {
        self.reqs.clear();
        self.pages.clear();
        self.host.clear();
        self.gpu.clear();
        self.delta_slots.clear();
        self.reading.clear();
        self.copying.clear();
        self.copied.clear();
    }

    /// Finishes the reads `done` picks (given each adapter id, in `to_host` order) and returns
    /// their ids: what the real worker reports in `StepOutput::host_ready`.
    pub fn finish_reads(&mut self, mut done: impl FnMut(u32) -> bool) -> Vec<u32> {
        let (finished, still): (Vec<u32>, Vec<u32>) =
            self.reading.iter().partition(|&&id| done(id));
        self.reading = still;
        finished
    }

    /// Finishes the copies `done` picks (given each delta id, in `to_gpu` order) now; the next
    /// [`FakeWorker::gpu_ready`] reports them.
    pub fn finish_copies(&mut self, mut done: impl FnMut(u32) -> bool) {
        self.finish_copies_by(|id, _| done(id));
    }

    /// Finishes the copies `done` picks, given each delta id and its steps left.
    fn finish_copies_by(&mut self, mut done: impl FnMut(u32, u32) -> bool) {
        let mut still = Vec::with_capacity(self.copying.len());
        for (id, left) in std::mem::take(&mut self.copying) {
            if done(id, left) {
                self.copied.push(id);
            } else {
                still.push((id, left));
            }
        }
        self.copying = still;
    }

    /// The copies finished since the last call, in the order they finished: what the real
    /// worker reports in `StepOutput::gpu_ready`.
    pub fn gpu_ready(&mut self) -> Vec<u32> {
        std::mem::take(&mut self.copied)
    }

    /// Whether delta `id`'s copy is still running.
    pub fn is_copying(&self, id: u32) -> bool {
        self.copying.iter().any(|&(c, _)| c == id)
    }

    /// Bytes of host copies held.
    pub fn host_bytes(&self) -> u64 {
        self.host.values().map(|s| s.host_bytes).sum()
    }

    /// Checks that the worker's adapter tiers are exactly what the scheduler accounts (true
    /// after every non-empty step, when no op is pending).
    pub fn assert_matches(&self, s: &Scheduler, ids: impl IntoIterator<Item = u32>) {
        let mut want_host = Vec::new();
        let mut want_gpu = BTreeMap::new();
        let mut want_slots = BTreeMap::new();
        for id in ids {
            let r = s
                .adapter_residency(id)
                .unwrap_or_else(|| panic!("adapter {id} is not registered"));
            if r.on_host {
                want_host.push(id);
            }
            if let Some(p) = r.gpu_blocks {
                want_gpu.insert(id, p.to_vec());
            }
            if let Some(s) = r.delta_slot {
                want_slots.insert(id, s);
            }
        }
        assert_eq!(
            self.host.keys().copied().collect::<Vec<_>>(),
            want_host,
            "host copies differ from the scheduler's accounting"
        );
        assert_eq!(self.gpu, want_gpu, "GPU placements differ");
        assert_eq!(self.host_bytes(), s.stats().host_adapter_bytes);
        assert_eq!(self.delta_slots.len(), s.stats().deltas_on_gpu);
        assert_eq!(self.delta_slots, want_slots, "delta slots differ");
    }

    /// Applies the step's adapter ops in order, checking each against the contract.
    fn apply_adapter_ops(&mut self, step: &ScheduledStep) {
        let mut loading = false;
        for op in &step.adapter_ops {
            let id = op.adapter_id;
            assert_ne!(id, 0, "an op for adapter 0 (the base model)");
            if op.is_drop() {
                assert!(
                    !loading,
                    "step {}: {} of adapter {id} after a load: {:?}",
                    step.step_id,
                    op.op_name(),
                    step.adapter_ops
                );
            } else {
                loading = true;
            }
            match &op.kind {
                VariantOpKind::ToHost { path } => {
                    let (disk_id, spec) = self
                        .disk
                        .get(path)
                        .unwrap_or_else(|| panic!("to_host of {path}: no such directory"));
                    assert_eq!(*disk_id, id, "to_host of {path} for the wrong adapter");
                    assert_eq!(op.variant, spec.kind, "to_host of adapter {id}: wrong kind");
                    let spec = spec.clone();
                    assert!(
                        self.host.insert(id, spec).is_none(),
                        "to_host of adapter {id}, which is already on the host"
                    );
                    if self.cfg.host_copy_reports {
                        self.reading.push(id);
                    }
                    self.op_counts[0] += 1;
                }
                VariantOpKind::ToGpu { block_ids, slot } => {
                    let spec = self.host.get(&id).unwrap_or_else(|| {
                        panic!("to_gpu of adapter {id} with no host copy (no to_host, or dropped)")
                    });
                    assert_eq!(
                        block_ids.len() as u32,
                        spec.num_blocks,
                        "adapter {id} placed on the wrong number of pages"
                    );
                    assert_eq!(op.variant, spec.kind, "to_gpu of adapter {id}: wrong kind");
                    if let Some(i) = self.reading.iter().position(|&r| r == id) {
                        assert!(
                            step.running.is_empty(),
                            "step {}: to_gpu of adapter {id}, whose host read has not been \
                             reported, stalls the {} running requests",
                            step.step_id,
                            step.running.len()
                        );
                        self.reading.remove(i);
                        self.read_waits += 1;
                    }
                    if spec.kind == VariantKind::Delta {
                        assert!(
                            self.delta_slots.len() < self.cfg.max_deltas,
                            "step {}: to_gpu of delta {id} while all {} delta slots are taken",
                            step.step_id,
                            self.cfg.max_deltas
                        );
                        let s =
                            slot.unwrap_or_else(|| panic!("to_gpu of delta {id} names no slot"));
                        assert!(
                            s < self.cfg.max_deltas as u32,
                            "delta {id} in slot {s} >= max_deltas"
                        );
                        if let Some((other, _)) = self.delta_slots.iter().find(|(_, &t)| t == s) {
                            panic!("slot {s} given to delta {id} while delta {other} holds it");
                        }
                        self.delta_slots.insert(id, s);
                        self.max_deltas_seen = self.max_deltas_seen.max(self.delta_slots.len());
                        if self.cfg.gpu_load_reports {
                            self.copying.push((id, self.copy_steps));
                        }
                    } else {
                        assert_eq!(
                            *slot, None,
                            "to_gpu of LoRA adapter {id} names a delta slot"
                        );
                    }
                    assert!(
                        !self.gpu.contains_key(&id),
                        "to_gpu of adapter {id}, which is already on the GPU"
                    );
                    for &p in block_ids {
                        assert!(p < self.cfg.num_blocks, "page {p} out of range");
                        if let Some(other) = self.pages.insert(p, PageOwner::Adapter(id)) {
                            panic!("page {p} given to adapter {id} while {other} holds it");
                        }
                    }
                    self.gpu.insert(id, block_ids.clone());
                    self.op_counts[1] += 1;
                }
                VariantOpKind::DropGpu => {
                    let pages = self
                        .gpu
                        .remove(&id)
                        .unwrap_or_else(|| panic!("drop_gpu of adapter {id}, not on the GPU"));
                    for p in pages {
                        assert_eq!(self.pages.remove(&p), Some(PageOwner::Adapter(id)));
                    }
                    self.delta_slots.remove(&id);
                    // The real worker orders the drop after a copy still running (or cancels
                    // it); a report of it would be stale, so none is made.
                    self.copying.retain(|&(c, _)| c != id);
                    self.copied.retain(|&c| c != id);
                    self.op_counts[2] += 1;
                }
                VariantOpKind::DropHost => {
                    assert!(
                        self.host.remove(&id).is_some(),
                        "drop_host of adapter {id}, not on the host"
                    );
                    self.reading.retain(|&r| r != id);
                    self.op_counts[3] += 1;
                }
            }
            assert!(
                self.host_bytes() <= self.cfg.host_adapter_bytes,
                "step {}: after {} of adapter {id} the host holds {} bytes > budget {}",
                step.step_id,
                op.op_name(),
                self.host_bytes(),
                self.cfg.host_adapter_bytes
            );
        }
    }

    /// With `cfg.delta_graph_tokens`: a step with a row of a delta and a prompt chunk (a new
    /// request, or a running one computing more than one token) schedules at most that many
    /// tokens, unless its decodes alone reach it (the worker's delta graphs: such a step would
    /// otherwise run eagerly). A step that preempted may pass it: the scheduler counted its
    /// decodes before phase 1 preempted some of them.
    fn check_delta_graph_limit(&self, step: &ScheduledStep) {
        let limit = self.cfg.delta_graph_tokens;
        let adapter = |id: u64| {
            step.new
                .iter()
                .find(|n| n.id == id)
                .map(|n| n.adapter_id)
                .unwrap_or_else(|| self.reqs[&id].adapter_id)
        };
        let mut ids = step
            .new
            .iter()
            .map(|n| n.id)
            .chain(step.running.iter().map(|r| r.id));
        let delta_rows = ids.any(|id| self.delta_slots.contains_key(&adapter(id)));
        let decodes = step
            .running
            .iter()
            .filter(|r| r.num_scheduled_tokens == 1)
            .count();
        let prompts = !step.new.is_empty() || decodes < step.running.len();
        if limit > 0 && delta_rows && prompts && decodes < limit && step.preempted.is_empty() {
            assert!(
                step.num_scheduled_tokens() <= limit,
                "step {}: {} tokens with delta rows and a prompt chunk > the delta graph limit \
                 {limit}: new {:?}, running {:?}, preempted {:?}",
                step.step_id,
                step.num_scheduled_tokens(),
                step.new
                    .iter()
                    .map(|n| (n.id, n.adapter_id, n.num_scheduled_tokens))
                    .collect::<Vec<_>>(),
                step.running
                    .iter()
                    .map(|r| (r.id, adapter(r.id), r.num_scheduled_tokens))
                    .collect::<Vec<_>>(),
                step.preempted
            );
        }
    }

    /// Runs one step: drops `released`, takes `new` in full, applies `running` diffs, computes
    /// each chunk and samples with `sample` where a chunk reaches the end. Panics on any
    /// contract violation.
    pub fn run(
        &mut self,
        step: &ScheduledStep,
        sample: &mut dyn FnMut(u64, usize) -> u32,
    ) -> Vec<(u64, Option<u32>)> {
        assert!(!step.is_empty(), "an empty step must not be sent");
        assert!(step.step_id > 0);
        for id in &step.preempted {
            assert!(
                step.released.contains(id),
                "preempted {id} not in released {:?}",
                step.released
            );
        }
        assert!(
            step.num_scheduled_tokens() <= self.cfg.max_num_batched_tokens,
            "step {} schedules {} tokens > budget {}",
            step.step_id,
            step.num_scheduled_tokens(),
            self.cfg.max_num_batched_tokens
        );
        for id in &step.released {
            let r = self
                .reqs
                .remove(id)
                .unwrap_or_else(|| panic!("released {id} is not on the worker"));
            for p in r.blocks {
                self.pages.remove(&p);
            }
        }
        self.apply_adapter_ops(step);
        self.check_delta_graph_limit(step);
        for r in self.reqs.values_mut() {
            r.last = None;
        }
        self.wait_for_copies(step);
        let mut out = Vec::new();
        for n in &step.new {
            assert!(
                !self.reqs.contains_key(&n.id),
                "new {} is already on the worker",
                n.id
            );
            assert_eq!(n.num_computed_tokens, 0);
            assert!(n.num_prompt_tokens as usize <= n.token_ids.len());
            self.reqs.insert(
                n.id,
                WorkerReq {
                    tokens: n.token_ids.clone(),
                    num_prompt: n.num_prompt_tokens,
                    computed: 0,
                    blocks: Vec::new(),
                    last: None,
                    adapter_id: n.adapter_id,
                },
            );
            self.claim(n.id, &n.block_ids);
            out.push(self.compute(n.id, n.num_scheduled_tokens, sample));
        }
        for r in &step.running {
            assert!(
                self.reqs.contains_key(&r.id),
                "running {} is not on the worker",
                r.id
            );
            self.claim(r.id, &r.new_block_ids);
            out.push(self.compute(r.id, r.num_scheduled_tokens, sample));
        }
        assert!(
            self.reqs.len() <= self.cfg.max_num_seqs,
            "{} requests on the worker",
            self.reqs.len()
        );
        // The copies beside the step advance; those done are reported with its output.
        for (_, left) in &mut self.copying {
            *left = left.saturating_sub(1);
        }
        self.finish_copies_by(|_, left| left == 0);
        out
    }

    /// A step that runs a request (new or running) whose delta is still being copied waits for
    /// the copy: allowed only when nothing else would have run (no `running` entry), as the
    /// scheduler promises; the copy is then finished (and reported with the step's output).
    fn wait_for_copies(&mut self, step: &ScheduledStep) {
        if self.copying.is_empty() {
            return;
        }
        let adapters = step.new.iter().map(|n| (n.id, n.adapter_id)).chain(
            step.running
                .iter()
                .filter_map(|r| self.reqs.get(&r.id).map(|w| (r.id, w.adapter_id))),
        );
        let mut waited = Vec::new();
        for (id, a) in adapters {
            if a != 0 && self.is_copying(a) {
                assert!(
                    step.running.is_empty(),
                    "step {}: request {id} runs with delta {a}, whose copy has not been reported, \
                     stalling the {} running requests",
                    step.step_id,
                    step.running.len()
                );
                if !waited.contains(&a) {
                    waited.push(a);
                }
            }
        }
        for a in waited {
            self.copy_waits += 1;
            self.finish_copies(|c| c == a);
        }
    }

    fn claim(&mut self, id: u64, pages: &[u32]) {
        for &p in pages {
            assert!(p < self.cfg.num_blocks, "page {p} out of range");
            if let Some(other) = self.pages.insert(p, PageOwner::Request(id)) {
                panic!("page {p} given to request {id} while {other} still holds it on the worker");
            }
            self.reqs.get_mut(&id).unwrap().blocks.push(p);
        }
    }

    fn compute(
        &mut self,
        id: u64,
        n: u32,
        sample: &mut dyn FnMut(u64, usize) -> u32,
    ) -> (u64, Option<u32>) {
        let bs = self.cfg.block_size as usize;
        let adapter_id = self.reqs[&id].adapter_id;
        if adapter_id != 0 {
            assert!(
                self.gpu.contains_key(&adapter_id),
                "request {id} runs with adapter {adapter_id}, which is not on the GPU"
            );
            self.adapter_tokens += n as u64;
        }
        let r = self.reqs.get_mut(&id).unwrap();
        assert!(n >= 1, "request {id} scheduled 0 tokens");
        let end = r.computed + n;
        assert!(
            end as usize <= r.tokens.len(),
            "request {id}: chunk to {end} past {} known tokens",
            r.tokens.len()
        );
        assert!(
            r.blocks.len() * bs >= end as usize,
            "request {id}: {} pages cannot hold {end} tokens",
            r.blocks.len()
        );
        assert!(r.tokens.len() <= self.cfg.max_model_len as usize);
        r.computed = end;
        if end as usize == r.tokens.len() {
            let pos = r.tokens.len() - r.num_prompt as usize;
            let t = sample(id, pos);
            r.tokens.push(t);
            r.last = Some((n, true));
            (id, Some(t))
        } else {
            r.last = Some((n, false));
            (id, None)
        }
    }

    /// Undoes the last step for `id`, as if its output never reached the scheduler.
    pub fn rollback(&mut self, id: u64) {
        let r = self.reqs.get_mut(&id).unwrap();
        let (n, sampled) = r.last.take().expect("request ran in the last step");
        r.computed -= n;
        if sampled {
            r.tokens.pop();
        }
    }

    /// Token ids the worker holds for `id`.
    pub fn tokens(&self, id: u64) -> &[u32] {
        &self.reqs[&id].tokens
    }
}

/// Drives `s` with the fake worker until nothing is unfinished (panics after `limit` steps);
/// returns every update in order.
pub fn run_to_completion(
    s: &mut Scheduler,
    w: &mut FakeWorker,
    limit: usize,
) -> Vec<deltaserve_sched::SeqUpdate> {
    let mut all = Vec::new();
    for _ in 0..limit {
        if !s.has_unfinished() {
            return all;
        }
        let step = s.schedule();
        assert!(
            !step.is_empty(),
            "unfinished requests but an empty step: {:?}",
            s.stats()
        );
        let outs = w.run(&step, &mut sample_token);
        all.extend(s.update(&outs));
        s.check_invariants().unwrap();
    }
    panic!("not finished after {limit} steps: {:?}", s.stats());
}
