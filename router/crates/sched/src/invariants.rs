//! The structural invariants of a [`Scheduler`], checked from scratch against its state:
//! [`Scheduler::check_invariants`] (pool, block tables, adapters, in-flight chunks, queues)
//! and its skip-the-line part. For tests and debugging (the property tests call it after every
//! operation), never on the hot path.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use crate::block::PageOwner;
use crate::request::{Phase, Seq};
use crate::scheduler::Scheduler;
use crate::skip_line::Skip;

impl Scheduler {
    /// Checks every structural invariant; `Err` says which one broke and for what. O(pages +
    /// requests): for tests and debugging, not for the hot path.
    ///
    /// - the pool: no page free and owned (or free and cached), none listed twice, free + owned
    ///   == total; every cached page indexed under its hash, in the LRU exactly when unheld;
    /// - every page in a block table is owned by that request, or, among its published leading
    ///   pages, cached with the same tokens; every page of a GPU-resident adapter is owned by
    ///   that adapter; each cached page's reference count equals the tables holding it; and
    ///   own pages, adapter pages and held cached pages (each once) sum to the used pages;
    /// - the pending prefix pages are exactly the running requests' full known pages past
    ///   their published ones;
    /// - adapters: totals match, host bytes within budget, at most `max_deltas` deltas on the
    ///   GPU, every live request's adapter is registered and counts it as a user (a running one
    ///   also as running, and is on the GPU: pages for LoRA, a slot for a delta); a delta
    ///   loading ahead (`gpu_load_reports`) is GPU-resident with no running request; pending
    ///   adapter ops are drops only;
    /// - skip-the-line: only running requests of deltas are skippers; every skipper's parent is
    ///   a running non-skipper of the same delta; an orphaned skipper's delta has no running
    ///   non-skipper; the skipper and orphan counts match;
    /// - a running request owns exactly ceil(num_cached / block_size) pages and
    ///   num_computed <= num_cached <= len(tokens) + pending, num_computed < len(tokens);
    /// - at most two steps are outstanding, and each request's in-flight tokens and pending
    ///   samples are the sums of its chunks in them;
    /// - a waiting request owns no pages and has nothing computed or in flight;
    /// - queues hold each live request once, in their phase, sorted by arrival order;
    /// - nobody has reached max_tokens or max_model_len without being finished.
    pub fn check_invariants(&self) -> Result<(), String> {
        self.blocks.check()?;
        if self.outstanding.len() > 2 {
            return Err(format!("{} steps outstanding", self.outstanding.len()));
        }
        let mut chunked: BTreeMap<u64, (u32, u32)> = BTreeMap::new();
        for chunk in self.outstanding.iter().flatten() {
            if self.seqs.contains_key(&chunk.id) {
                let sums = chunked.entry(chunk.id).or_default();
                sums.0 += chunk.n;
                sums.1 += u32::from(chunk.samples);
            }
        }
        for (&id, seq) in &self.seqs {
            let (n, samples) = chunked.get(&id).copied().unwrap_or_default();
            if (seq.in_flight, seq.pending) != (n, samples) {
                return Err(format!(
                    "request {id}: in flight {} / pending {} but its outstanding chunks hold {n} / {samples}",
                    seq.in_flight, seq.pending
                ));
            }
        }
        let adapter_pages = self.adapters.check(&self.blocks, &self.cfg)?;
        let mut owned = adapter_pages;
        // adapter id -> (live users, running users), recounted from the requests.
        let mut users: BTreeMap<u32, (usize, usize)> = BTreeMap::new();
        // cached page -> block tables holding it; pending page hash -> requests computing it.
        let mut refs: BTreeMap<u32, u32> = BTreeMap::new();
        let mut pending: HashMap<u64, u32> = HashMap::new();
        for (&id, seq) in &self.seqs {
            let len = seq.tokens.len() as u64;
            if seq.num_outputs() >= seq.max_tokens {
                return Err(format!(
                    "request {id} has {} outputs, max_tokens {}",
                    seq.num_outputs(),
                    seq.max_tokens
                ));
            }
            if len > self.cfg.max_model_len as u64 {
                return Err(format!("request {id} holds {len} tokens > max_model_len"));
            }
            if seq.num_computed as u64 >= len {
                return Err(format!(
                    "request {id}: num_computed {} >= {len} tokens",
                    seq.num_computed
                ));
            }
            match seq.phase {
                Phase::Waiting => {
                    if !seq.blocks.is_empty()
                        || seq.num_computed != 0
                        || seq.num_cached != 0
                        || seq.in_flight != 0
                        || seq.pending != 0
                        || seq.num_published != 0
                        || seq.pending_to != 0
                    {
                        return Err(format!(
                            "waiting request {id} holds {} pages, computed {}, cached {}, in flight {}",
                            seq.blocks.len(),
                            seq.num_computed,
                            seq.num_cached,
                            seq.in_flight
                        ));
                    }
                }
                Phase::Running => {
                    let want = self.cfg.blocks_for(seq.num_cached as u64);
                    if seq.blocks.len() as u64 != want {
                        return Err(format!(
                            "request {id} owns {} pages for {} cached tokens (want {want})",
                            seq.blocks.len(),
                            seq.num_cached
                        ));
                    }
                    if seq.num_computed > seq.num_cached
                        || seq.num_cached as u64 > len + seq.pending as u64
                    {
                        return Err(format!(
                            "request {id}: computed {} <= cached {} <= tokens {len} + pending {} broken",
                            seq.num_computed, seq.num_cached, seq.pending
                        ));
                    }
                    if seq.in_flight > 0 && seq.num_computed + seq.in_flight > seq.num_cached {
                        return Err(format!("request {id}: in-flight chunk runs past its pages"));
                    }
                }
            }
            if seq.adapter_id != 0 {
                let count = users.entry(seq.adapter_id).or_default();
                count.0 += 1;
                count.1 += usize::from(seq.phase == Phase::Running);
            }
            owned += self.check_table(id, seq, &mut refs, &mut pending)?;
        }
        owned += self.check_cached_refs(&refs)?;
        if pending != *self.pending.counts() {
            return Err(format!(
                "pending prefix pages are {:?}, the running requests say {pending:?}",
                self.pending.counts()
            ));
        }
        if owned != self.blocks.num_used() as u64 {
            return Err(format!(
                "block tables and adapters hold {owned} pages, pool has {} used",
                self.blocks.num_used()
            ));
        }
        if let Some((a, (live, _))) = users
            .iter()
            .find(|(a, _)| !self.adapters.map.contains_key(a))
        {
            return Err(format!(
                "{live} live request(s) name unregistered adapter {a}"
            ));
        }
        for (&a, entry) in &self.adapters.map {
            let (live, running) = users.get(&a).copied().unwrap_or_default();
            if (entry.users, entry.running) != (live, running) {
                return Err(format!(
                    "adapter {a} counts {} users / {} running, the requests say {live} / {running}",
                    entry.users, entry.running
                ));
            }
        }
        if let Some(op) = self.pending_ops.iter().find(|op| !op.is_drop()) {
            return Err(format!("pending adapter ops hold a load: {op:?}"));
        }
        if self.waiting.len() + self.running.len() != self.seqs.len() {
            return Err(format!(
                "{} waiting + {} running != {} live requests",
                self.waiting.len(),
                self.running.len(),
                self.seqs.len()
            ));
        }
        let queues = [
            (
                Phase::Waiting,
                self.waiting.iter().copied().collect::<Vec<_>>(),
            ),
            (Phase::Running, self.running.clone()),
        ];
        for (phase, queue) in queues {
            for (j, &(key, id)) in queue.iter().enumerate() {
                let seq = self
                    .seqs
                    .get(&id)
                    .ok_or_else(|| format!("{phase:?} queue holds dead request {id}"))?;
                if seq.phase != phase || seq.key != key {
                    return Err(format!(
                        "request {id} is in the {phase:?} queue as {:?} with key {key:?}",
                        seq.phase
                    ));
                }
                if j > 0 && queue[j - 1].0 >= key {
                    return Err(format!(
                        "{phase:?} queue is out of arrival order at request {id}"
                    ));
                }
            }
        }
        if self.running.len() > self.cfg.max_num_seqs {
            return Err(format!(
                "{} running > max_num_seqs {}",
                self.running.len(),
                self.cfg.max_num_seqs
            ));
        }
        self.check_skippers()
    }

    /// Running or waiting request `id`'s block table: each page its own, or one of its leading
    /// published pages cached with its tokens (counted into `refs`); its pending pages (into
    /// `pending`). Returns how many pages it owns itself.
    fn check_table(
        &self,
        id: u64,
        seq: &Seq,
        refs: &mut BTreeMap<u32, u32>,
        pending: &mut HashMap<u64, u32>,
    ) -> Result<u64, String> {
        let bs = self.cfg.block_size as usize;
        let mut own = 0u64;
        for (i, &page) in seq.blocks.iter().enumerate() {
            match self.blocks.owner_of(page) {
                Some(PageOwner::Request(o)) if o == id => own += 1,
                Some(PageOwner::Cache) if i < seq.num_published as usize => {
                    let entry = self
                        .blocks
                        .cached(page)
                        .expect("cache-owned pages are cached");
                    if *entry.tokens != seq.tokens[i * bs..(i + 1) * bs] {
                        return Err(format!(
                            "request {id}'s page {i} is cached page {page}, which holds other tokens"
                        ));
                    }
                    *refs.entry(page).or_default() += 1;
                }
                owner => {
                    return Err(format!(
                        "page {page} is request {id}'s page {i} (of {} published) but owned by {owner:?}",
                        seq.num_published
                    ));
                }
            }
        }
        if seq.phase == Phase::Running {
            let published_tokens = seq.num_published as usize * bs;
            if published_tokens > seq.num_computed as usize
                || (seq.pending_to as usize) * bs > seq.tokens.len()
                || (seq.pending_to > 0 && seq.pending_to < seq.num_published)
            {
                return Err(format!(
                    "request {id}: {} published pages, pending to {}, computed {} of {} tokens",
                    seq.num_published,
                    seq.pending_to,
                    seq.num_computed,
                    seq.tokens.len()
                ));
            }
            for i in seq.num_published..seq.pending_to {
                *pending.entry(seq.page_hashes[i as usize]).or_default() += 1;
            }
        }
        Ok(own)
    }

    /// Every cached page's reference count against `refs` (the tables holding it). Returns the
    /// number of cached pages some table holds (the used ones).
    fn check_cached_refs(&self, refs: &BTreeMap<u32, u32>) -> Result<u64, String> {
        let mut held = 0u64;
        for (page, entry) in self.blocks.cached_pages() {
            let tables = refs.get(&page).copied().unwrap_or(0);
            if entry.refs != tables {
                return Err(format!(
                    "cached page {page} counts {} references, {tables} block tables hold it",
                    entry.refs
                ));
            }
            held += u64::from(tables > 0);
        }
        if let Some((page, _)) = refs.iter().find(|(&p, _)| self.blocks.cached(p).is_none()) {
            return Err(format!("page {page} is held as cached but is not cached"));
        }
        Ok(held)
    }

    /// The skip-the-line part of [`Scheduler::check_invariants`].
    fn check_skippers(&self) -> Result<(), String> {
        let (mut skippers, mut orphans) = (0usize, 0usize);
        // Deltas with a running non-skipper.
        let selected: BTreeSet<u32> = self
            .seqs
            .values()
            .filter(|s| s.phase == Phase::Running && s.skip == Skip::No)
            .map(|s| s.adapter_id)
            .filter(|&a| self.adapters.is_delta(a))
            .collect();
        for (&id, seq) in &self.seqs {
            if seq.skip == Skip::No {
                continue;
            }
            if seq.phase != Phase::Running {
                return Err(format!(
                    "waiting request {id} is marked as a skipper ({:?})",
                    seq.skip
                ));
            }
            if !self.adapters.is_delta(seq.adapter_id) {
                return Err(format!(
                    "request {id} skipped the line but its variant {} is not a delta",
                    seq.adapter_id
                ));
            }
            skippers += 1;
            match seq.skip {
                Skip::Parent(p) => {
                    let parent = self.seqs.get(&p).ok_or_else(|| {
                        format!("skipper {id}'s parent {p} is not a live request")
                    })?;
                    if parent.phase != Phase::Running
                        || parent.skip != Skip::No
                        || parent.adapter_id != seq.adapter_id
                    {
                        return Err(format!(
                            "skipper {id} (delta {}) has parent {p}, which is {:?}, {:?}, \
                             delta {}: not a running non-skipper of the same delta",
                            seq.adapter_id, parent.phase, parent.skip, parent.adapter_id
                        ));
                    }
                }
                Skip::Orphaned => {
                    orphans += 1;
                    if selected.contains(&seq.adapter_id) {
                        return Err(format!(
                            "skipper {id} is orphaned while delta {} has a running non-skipper",
                            seq.adapter_id
                        ));
                    }
                }
                Skip::No => unreachable!("skipped above"),
            }
        }
        if (skippers, orphans) != (self.num_skippers, self.num_orphans) {
            return Err(format!(
                "{} skippers / {} orphans counted, the requests say {skippers} / {orphans}",
                self.num_skippers, self.num_orphans
            ));
        }
        Ok(())
    }
}
