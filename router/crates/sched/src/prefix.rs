//! Prefix caching: the KV pages of a prompt prefix reused across requests of one variant
//! registration (vLLM's automatic prefix caching, keyed per variant). The pages themselves (the
//! hash index, references, the LRU of pages no request holds) are the allocator's
//! (`block.rs`); this module keys, looks up, publishes, and keeps `n` choices from computing
//! one prompt n times.
//!
//! ```text
//!  page i of a request's tokens:  hash_i = H(hash_{i-1}, key, tokens[i*bs .. (i+1)*bs])
//!                                  hash_{-1} = ROOT_HASH, key = (variant id, registration)
//!  admission (phases 2 and skip-the-line), with prefix caching on:
//!     hits = longest run of pages 0.. cached under hash_i with the same parent, key and tokens,
//!            at most (len(tokens) - 1) / bs pages: the last token is always computed (its
//!            logits are sampled) and nobody ever writes into a shared page
//!     if page `hits` is being computed by a running request (pending): pass the request over
//!            for this step (it keeps its place) and take that page too once it is published
//!     else admit with num_computed = hits * bs, block table = hit pages (+1 reference each,
//!            out of the LRU) ++ its own new pages; pending += its other full known pages
//!  update: each page whose tokens are all computed is published (request-owned -> cached,
//!          1 reference), unless its hash is cached already; it leaves the pending pages
//!  release (finish, abort, preempt): own pages free, cached pages -1 reference (0: LRU)
//! ```
//!
//! The key is the variant's registration (`generation`, distinct for every `register`), never
//! only its id: a variant registered again, same name and id or not, misses every page computed
//! with its previous weights, and base-model pages (key `(0, 0)`) are never a variant's (a LoRA
//! or delta changes the KV of every layer it touches). Pages are published only once the worker
//! has computed them (an `update` confirmed it), and the worker runs steps in order, so a hit
//! always reads KV that is there. Recompute preemption gets cheaper too: a preempted request's
//! pages stay cached until needed, and it hits them when it is admitted again.
//!
//! `n` choices of one prompt: the first is admitted and its prompt's full pages are pending; the
//! others wait for each of those pages to be published (they are passed over, keeping their
//! place) and then hit all of them, so the prompt is prefilled once. Only waiting requests a
//! running request's pages would serve are passed over, at most [`MAX_PREFIX_DEFERRALS`] per
//! step; with nothing running, nothing is pending.

use std::collections::hash_map::RandomState;
use std::collections::HashMap;
use std::hash::{BuildHasher, Hash, Hasher};

use crate::block::{BlockAllocator, PageOwner};
use crate::request::Seq;
use crate::scheduler::Scheduler;

/// The chain hash before a request's first page.
pub(crate) const ROOT_HASH: u64 = 0x6465_6c74_6173_7276;

/// Most waiting requests one step passes over for a pending page; beyond it admission stops
/// for the step (so a burst of requests with one prompt costs a bounded walk per step).
pub(crate) const MAX_PREFIX_DEFERRALS: usize = 64;

/// What a cached page's KV was computed with: the variant and which registration of it. The
/// base model is `(0, 0)`; registrations count from 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct PrefixKey {
    /// The variant id (0 = base).
    pub(crate) variant: u32,
    /// Its registration (`Adapter::generation`; 0 for the base).
    pub(crate) generation: u64,
}

/// The chain hash of a page holding `tokens` after a page hashed `parent`, under `key`: SipHash
/// keyed at random per scheduler (`hasher`), so no client can craft a prompt whose pages collide
/// with another's. A hit also compares the parent hash, key and tokens, so only a 64-bit
/// collision of two parents' keyed hashes could share a wrong page.
pub(crate) fn page_hash(hasher: &RandomState, parent: u64, key: PrefixKey, tokens: &[u32]) -> u64 {
    let mut h = hasher.build_hasher();
    parent.hash(&mut h);
    key.hash(&mut h);
    tokens.hash(&mut h);
    h.finish()
}

/// The scheduler's page hashing and the chain hashes of pages being computed by running
/// requests (full pages of their known tokens not published yet), with how many requests
/// compute each.
#[derive(Debug, Clone, Default)]
pub(crate) struct PendingPages {
    /// The keys of every page hash (`page_hash`), drawn at random when the scheduler is made.
    hasher: RandomState,
    /// Pending chain hash -> requests computing that page.
    counts: HashMap<u64, u32>,
}

impl PendingPages {
    fn add(&mut self, hash: u64) {
        *self.counts.entry(hash).or_default() += 1;
    }

    fn remove(&mut self, hash: u64) {
        match self.counts.get_mut(&hash) {
            Some(1) => {
                self.counts.remove(&hash);
            }
            Some(n) => *n -= 1,
            None => debug_assert!(false, "pending page {hash:#x} removed twice"),
        }
    }

    fn contains(&self, hash: u64) -> bool {
        self.counts.contains_key(&hash)
    }

    /// The multiset, for the invariant check.
    pub(crate) fn counts(&self) -> &HashMap<u64, u32> {
        &self.counts
    }
}

/// How a waiting request would be admitted, worked out before anything changes.
#[derive(Debug, Clone)]
pub(crate) struct PrefixPlan {
    /// Cached pages it reuses: the first pages of its table.
    pub(crate) hits: Vec<u32>,
    /// Tokens of its first chunk (from the end of the hits).
    pub(crate) n: u32,
    /// Pages it takes from the pool: its own new pages plus the hit pages no request held
    /// (they leave the evictable ones).
    pub(crate) pages: u64,
}

impl Seq {
    /// Makes sure `page_hashes` covers its first `pages` full pages.
    fn hash_pages(&mut self, hasher: &RandomState, block_size: u32, pages: usize) {
        let Some(key) = self.cache_key else { return };
        let bs = block_size as usize;
        while self.page_hashes.len() < pages {
            let i = self.page_hashes.len();
            let parent = self.page_hashes.last().copied().unwrap_or(ROOT_HASH);
            let hash = page_hash(hasher, parent, key, &self.tokens[i * bs..(i + 1) * bs]);
            self.page_hashes.push(hash);
        }
    }

    /// Publishes the pages of its table whose tokens are all computed now (and that it has not
    /// offered yet); they leave the pending pages.
    pub(crate) fn publish_computed(
        &mut self,
        id: u64,
        block_size: u32,
        blocks: &mut BlockAllocator,
        pending: &mut PendingPages,
    ) {
        let Some(key) = self.cache_key else { return };
        let full = (self.num_computed / block_size) as usize;
        let from = self.num_published as usize;
        if full <= from {
            return;
        }
        self.hash_pages(&pending.hasher, block_size, full);
        let bs = block_size as usize;
        for i in from..full {
            let page = self.blocks[i];
            let parent = if i == 0 {
                ROOT_HASH
            } else {
                self.page_hashes[i - 1]
            };
            let hash = self.page_hashes[i];
            if blocks.owner_of(page) == Some(PageOwner::Request(id)) {
                let tokens = &self.tokens[i * bs..(i + 1) * bs];
                blocks.publish(PageOwner::Request(id), page, hash, parent, key, tokens);
            }
            if (i as u32) < self.pending_to {
                pending.remove(hash);
            }
        }
        self.num_published = full as u32;
        self.pending_to = self.pending_to.max(self.num_published);
    }

    /// It leaves the running set: its pages still pending are not computed by it any more.
    pub(crate) fn drop_pending(&mut self, pending: &mut PendingPages) {
        for i in self.num_published..self.pending_to {
            pending.remove(self.page_hashes[i as usize]);
        }
        self.num_published = 0;
        self.pending_to = 0;
    }
}

impl Scheduler {
    /// How waiting request `id` would be admitted with at most `budget` tokens this step: its
    /// prefix-cache hits, first chunk and the pages that takes. `None` when it should wait for a
    /// page a running request is computing (see the module docs). Changes nothing but the
    /// request's hash memo.
    pub(crate) fn plan_prefix(&mut self, id: u64, budget: usize) -> Option<PrefixPlan> {
        let bs = self.cfg.block_size;
        let seq = self.seqs.get_mut(&id).expect("waiting ids are live");
        let len = seq.tokens.len();
        let mut hits = Vec::new();
        if let Some(key) = seq.cache_key.filter(|_| !seq.skip_prefix_cache) {
            let max_pages = (len - 1) / bs as usize;
            seq.hash_pages(&self.pending.hasher, bs, max_pages);
            let mut parent = ROOT_HASH;
            for (i, &hash) in seq.page_hashes[..max_pages].iter().enumerate() {
                let tokens = &seq.tokens[i * bs as usize..(i + 1) * bs as usize];
                match self.blocks.find_cached(hash) {
                    Some((page, e))
                        if e.parent == parent && e.key == key && *e.tokens == *tokens =>
                    {
                        hits.push(page);
                    }
                    _ => break,
                }
                parent = hash;
            }
            if hits.len() < max_pages && self.pending.contains(seq.page_hashes[hits.len()]) {
                return None;
            }
        }
        let computed = hits.len() * bs as usize;
        let n = (len - computed).min(budget) as u32;
        let own = self.cfg.blocks_for((computed + n as usize) as u64) - hits.len() as u64;
        let revived = hits
            .iter()
            .filter(|&&p| self.blocks.cached(p).is_some_and(|e| e.refs == 0))
            .count() as u64;
        Some(PrefixPlan {
            hits,
            n,
            pages: own + revived,
        })
    }

    /// Admission's prefix-cache part for request `id` (out of `waiting`, about to be admitted
    /// with `hits`): holds the hit pages, counts the lookup, and marks its other full known
    /// pages pending. Returns the tokens its hits cover (its `num_computed`).
    pub(crate) fn take_prefix(&mut self, id: u64, hits: &[u32]) -> u32 {
        let bs = self.cfg.block_size;
        let seq = self.seqs.get_mut(&id).expect("admitted ids are live");
        if seq.cache_key.is_none() {
            return 0;
        }
        for &page in hits {
            self.blocks.acquire(page);
        }
        if !seq.skip_prefix_cache {
            self.prefix_queried += seq.tokens.len() as u64;
            self.prefix_hits += u64::from(hits.len() as u32 * bs);
        }
        let full = seq.tokens.len() / bs as usize;
        seq.hash_pages(&self.pending.hasher, bs, full);
        seq.num_published = hits.len() as u32;
        seq.pending_to = full as u32;
        for i in hits.len()..full {
            self.pending.add(seq.page_hashes[i]);
        }
        hits.len() as u32 * bs
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::SchedulerConfig;
    use crate::step::SeqRequest;

    fn sched(num_blocks: u32) -> Scheduler {
        let cfg = SchedulerConfig {
            enable_prefix_caching: true,
            ..SchedulerConfig::new(4, num_blocks, 256)
        };
        Scheduler::new(cfg).unwrap()
    }

    fn req(id: u64, prompt: Vec<u32>) -> SeqRequest {
        SeqRequest {
            id,
            prompt,
            max_tokens: 2,
            eos_token_ids: Vec::new(),
            ignore_eos: false,
            arrival: id,
            adapter_id: 0,
            skip_prefix_cache: false,
        }
    }

    /// Runs `s` until nothing is left, answering every sampling chunk with token 7.
    fn drain(s: &mut Scheduler) {
        while s.has_unfinished() {
            let step = s.schedule();
            assert!(!step.is_empty());
            let outs: Vec<(u64, Option<u32>)> = step
                .new
                .iter()
                .map(|n| n.id)
                .chain(step.running.iter().map(|r| r.id))
                .map(|id| (id, Some(7)))
                .collect();
            s.update(&outs);
            s.check_invariants().unwrap();
        }
    }

    #[test]
    fn the_chain_hash_depends_on_parent_key_and_tokens() {
        let base = PrefixKey {
            variant: 0,
            generation: 0,
        };
        let lora = PrefixKey {
            variant: 1,
            generation: 1,
        };
        let keys = RandomState::new();
        let h = page_hash(&keys, ROOT_HASH, base, &[1, 2, 3, 4]);
        assert_eq!(
            h,
            page_hash(&keys, ROOT_HASH, base, &[1, 2, 3, 4]),
            "deterministic"
        );
        assert_ne!(h, page_hash(&keys, ROOT_HASH, lora, &[1, 2, 3, 4]));
        assert_ne!(h, page_hash(&keys, h, base, &[1, 2, 3, 4]));
        assert_ne!(h, page_hash(&keys, ROOT_HASH, base, &[1, 2, 3, 5]));
        let other = RandomState::new();
        assert_ne!(
            h,
            page_hash(&other, ROOT_HASH, base, &[1, 2, 3, 4]),
            "keyed per scheduler"
        );
    }

    #[test]
    fn the_invariant_checker_catches_a_corrupted_refcount() {
        let mut s = sched(16);
        s.add_request(req(1, (0..9).collect())).unwrap();
        drain(&mut s);
        assert_eq!(s.stats().prefix_cached_blocks, 2);
        s.add_request(req(2, (0..9).collect())).unwrap();
        let step = s.schedule();
        assert_eq!(step.new[0].num_computed_tokens, 8);
        s.check_invariants().unwrap();
        let shared = step.new[0].block_ids[0];
        s.blocks.set_refs_for_test(shared, 2);
        let err = s.check_invariants().unwrap_err();
        assert!(err.contains("references"), "{err}");
        s.blocks.set_refs_for_test(shared, 0);
        let err = s.check_invariants().unwrap_err();
        assert!(err.contains("LRU") || err.contains("references"), "{err}");
    }

    #[test]
    fn the_invariant_checker_catches_a_page_both_free_and_cached() {
        let mut s = sched(16);
        s.add_request(req(1, (0..9).collect())).unwrap();
        drain(&mut s);
        s.check_invariants().unwrap();
        let mut broken = s.clone();
        let cached = (0..16)
            .find(|&p| broken.blocks.cached(p).is_some())
            .unwrap();
        broken.blocks.push_free_for_test(cached);
        let err = broken.check_invariants().unwrap_err();
        assert!(err.contains(&format!("page {cached} is free and")), "{err}");
    }
}
