//! [`BlockAllocator`]: the accounting of the worker's one GPU page pool (S-LoRA unified
//! paging), prefix-cache pages included. A page holds a request's KV cache, part of a LoRA
//! adapter's weights, or a full KV page of a prompt prefix kept for reuse (the prefix cache,
//! keyed and looked up in `prefix.rs`); the router owns which page belongs to whom, the worker
//! owns the pool tensor and only follows the page ids it is told.
//!
//! ```text
//!  pages 0..num_blocks, each in one state:
//!   free     on the free list: no owner, nothing worth keeping
//!   owned    by one request (its private KV) or one adapter (weights)      owner Request / Adapter
//!   cached   a full KV page published under its hash, shared: `refs` =     owner Cache
//!            the requests whose block tables hold it; refs 0 => in the LRU (evictable)
//!
//!  allocate(n)     free list first, then evict LRU cached pages (oldest first): cached pages
//!                  no request holds count as free, and go before any preemption
//!  release(r, ..)  r's own pages -> free list; cached pages -> refs - 1 (0: newest in the LRU)
//!  publish(p)      r's own page p -> cached, refs 1 (unless another page has its hash)
//!  acquire(p)      a hit: refs + 1 (out of the LRU when it was 0)
//! ```
//!
//! A cached page is never written again: a request publishes only pages whose every token it has
//! computed, and a request that hits computes from the first token past its hit pages.

use std::collections::{BTreeMap, HashMap};
use std::fmt;

use crate::prefix::PrefixKey;

/// Who holds a page: requests and adapters have separate id spaces, so the owner says which.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum PageOwner {
    /// KV cache of the request with this id, private to it.
    Request(u64),
    /// Weights of the GPU-resident LoRA adapter with this id.
    Adapter(u32),
    /// The prefix cache: a full KV page shared by the requests whose tables hold it (counted),
    /// kept for later hits while none does, until evicted.
    Cache,
}

impl fmt::Display for PageOwner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PageOwner::Request(id) => write!(f, "request {id}"),
            PageOwner::Adapter(id) => write!(f, "adapter {id}"),
            PageOwner::Cache => write!(f, "the prefix cache"),
        }
    }
}

/// A page of the prefix cache: what its KV is the KV of, and who holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct CachedPage {
    /// Chain hash of the page (`prefix::page_hash` of `parent`, `key` and `tokens`).
    pub(crate) hash: u64,
    /// Chain hash of the page before it (`prefix::ROOT_HASH` for a first page).
    pub(crate) parent: u64,
    /// The variant registration whose KV this is.
    pub(crate) key: PrefixKey,
    /// The page's token ids, compared on every hit (a hash collision never shares a page).
    pub(crate) tokens: Box<[u32]>,
    /// Live requests whose block tables hold the page.
    pub(crate) refs: u32,
    /// Its LRU stamp while `refs` is 0 (its key in the LRU), else unused.
    stamp: u64,
}

/// The prefix cache's pages: the hash index, each cached page's entry, and the LRU of those no
/// request holds.
#[derive(Debug, Clone, Default)]
struct PageCache {
    /// Chain hash -> the cached page holding it.
    by_hash: HashMap<u64, u32>,
    /// `entries[p]` describes page `p` while it is cached.
    entries: Vec<Option<CachedPage>>,
    /// Cached pages with no reference, by stamp: the first is the least recently released.
    lru: BTreeMap<u64, u32>,
    /// Source of LRU stamps.
    tick: u64,
    /// Pages cached now (referenced or not).
    num_cached: u32,
    /// Cached pages evicted to be handed out again (cumulative).
    evicted: u64,
}

/// A free list of page ids plus the owner of each page and the prefix cache's pages, so that
/// double-frees and wrongly shared pages are caught (`debug_assert` on every call,
/// [`BlockAllocator::check`] for tests).
#[derive(Debug, Clone)]
pub struct BlockAllocator {
    /// Page ids free to hand out; a stack so allocation and release are O(1) and deterministic.
    free: Vec<u32>,
    /// `owner[p]` is whoever holds page `p`, `None` while it is free.
    owner: Vec<Option<PageOwner>>,
    /// The cached pages (owner [`PageOwner::Cache`]).
    cache: PageCache,
}

impl BlockAllocator {
    /// A pool of `num_blocks` free pages, handed out lowest id first.
    pub fn new(num_blocks: u32) -> Self {
        Self {
            free: (0..num_blocks).rev().collect(),
            owner: vec![None; num_blocks as usize],
            cache: PageCache {
                entries: vec![None; num_blocks as usize],
                ..PageCache::default()
            },
        }
    }

    /// Pages in the pool.
    pub fn total(&self) -> u32 {
        self.owner.len() as u32
    }

    /// Pages [`Self::allocate`] can hand out now: free ones plus cached ones no request holds
    /// (evicted on demand).
    pub fn num_free(&self) -> u32 {
        (self.free.len() + self.cache.lru.len()) as u32
    }

    /// Pages held right now: by a request, an adapter, or cached and held by a request.
    pub fn num_used(&self) -> u32 {
        self.total() - self.num_free()
    }

    /// Pages in the prefix cache, held by requests or not.
    pub fn num_cached(&self) -> u32 {
        self.cache.num_cached
    }

    /// Cached pages no request holds (evictable; counted in [`Self::num_free`]).
    pub fn num_evictable(&self) -> u32 {
        self.cache.lru.len() as u32
    }

    /// Cached pages evicted so far to be handed out again.
    pub fn num_evicted(&self) -> u64 {
        self.cache.evicted
    }

    /// Hands `n` pages to `owner` (a request or an adapter), appending their ids to `out`: free
    /// pages first, then the least recently released cached pages, evicted. Returns false,
    /// allocating nothing, when fewer than `n` can be had.
    pub fn allocate(&mut self, owner: PageOwner, n: u32, out: &mut Vec<u32>) -> bool {
        debug_assert_ne!(
            owner,
            PageOwner::Cache,
            "cached pages are published, not allocated"
        );
        if n > self.num_free() {
            return false;
        }
        for _ in 0..n {
            let page = match self.free.pop() {
                Some(page) => page,
                None => self.evict_oldest(),
            };
            debug_assert!(
                self.owner[page as usize].is_none(),
                "page {page} on the free list is owned"
            );
            self.owner[page as usize] = Some(owner);
            out.push(page);
        }
        true
    }

    /// Takes the least recently released cached page out of the cache, unowned.
    fn evict_oldest(&mut self) -> u32 {
        let (_, page) = self
            .cache
            .lru
            .pop_first()
            .expect("allocate checked: enough evictable pages");
        let entry = self.cache.entries[page as usize]
            .take()
            .expect("an LRU page is cached");
        if self.cache.by_hash.get(&entry.hash) == Some(&page) {
            self.cache.by_hash.remove(&entry.hash);
        }
        self.cache.num_cached -= 1;
        self.cache.evicted += 1;
        self.owner[page as usize] = None;
        page
    }

    /// Drops `owner`'s hold on `pages` (a block table): its own pages go back to the pool,
    /// cached ones lose a reference (and join the LRU at 0). In reverse, so the next allocation
    /// reuses freed pages in the same order, and a table's deeper cached pages are evicted before
    /// the prefix pages others would hit first.
    pub fn release(&mut self, owner: PageOwner, pages: &[u32]) {
        for &page in pages.iter().rev() {
            if self.owner[page as usize] == Some(PageOwner::Cache) {
                self.unref(page);
                continue;
            }
            debug_assert_eq!(
                self.owner[page as usize],
                Some(owner),
                "page {page} released by {owner} but owned by {:?}",
                self.owner[page as usize]
            );
            self.owner[page as usize] = None;
            self.free.push(page);
        }
    }

    /// One reference to cached `page` less; at 0 it becomes the newest evictable page.
    fn unref(&mut self, page: u32) {
        let tick = &mut self.cache.tick;
        let entry = self.cache.entries[page as usize]
            .as_mut()
            .expect("a page owned by the cache has an entry");
        debug_assert!(entry.refs > 0, "cached page {page}: reference underflow");
        entry.refs -= 1;
        if entry.refs == 0 {
            *tick += 1;
            entry.stamp = *tick;
            self.cache.lru.insert(*tick, page);
        }
    }

    /// Whoever owns `page`, if anyone.
    pub fn owner_of(&self, page: u32) -> Option<PageOwner> {
        self.owner.get(page as usize).copied().flatten()
    }

    /// The cached page holding chain hash `hash`, with its entry (the caller compares it with
    /// what it looks for).
    pub(crate) fn find_cached(&self, hash: u64) -> Option<(u32, &CachedPage)> {
        let &page = self.cache.by_hash.get(&hash)?;
        Some((page, self.cached(page)?))
    }

    /// The entry of `page` while it is cached.
    pub(crate) fn cached(&self, page: u32) -> Option<&CachedPage> {
        self.cache.entries.get(page as usize)?.as_ref()
    }

    /// Every cached page with its entry, by page id.
    pub(crate) fn cached_pages(&self) -> impl Iterator<Item = (u32, &CachedPage)> {
        self.cache
            .entries
            .iter()
            .enumerate()
            .filter_map(|(p, e)| Some((p as u32, e.as_ref()?)))
    }

    /// A request's table takes cached `page` (a hit): one more reference, out of the LRU.
    pub(crate) fn acquire(&mut self, page: u32) {
        let entry = self.cache.entries[page as usize]
            .as_mut()
            .expect("only cached pages are acquired");
        if entry.refs == 0 {
            self.cache.lru.remove(&entry.stamp);
        }
        entry.refs += 1;
    }

    /// Moves `owner`'s fully computed `page` into the cache under `hash` (the chain hash of
    /// `parent`, `key` and `tokens`), still held by `owner` (1 reference). Returns false, changing
    /// nothing, when another page holds that hash already (two requests computed the same
    /// prefix at once): the page stays `owner`'s own.
    pub(crate) fn publish(
        &mut self,
        owner: PageOwner,
        page: u32,
        hash: u64,
        parent: u64,
        key: PrefixKey,
        tokens: &[u32],
    ) -> bool {
        debug_assert_eq!(
            self.owner[page as usize],
            Some(owner),
            "publish of page {page}"
        );
        if self.cache.by_hash.contains_key(&hash) {
            return false;
        }
        self.owner[page as usize] = Some(PageOwner::Cache);
        self.cache.entries[page as usize] = Some(CachedPage {
            hash,
            parent,
            key,
            tokens: tokens.into(),
            refs: 1,
            stamp: 0,
        });
        self.cache.by_hash.insert(hash, page);
        self.cache.num_cached += 1;
        true
    }

    /// Empties the prefix cache (the worker lost its KV): every cached page, which no request
    /// may hold any more, is free again. Not counted as evictions.
    pub(crate) fn clear_cache(&mut self) {
        debug_assert_eq!(
            self.cache.lru.len() as u32,
            self.cache.num_cached,
            "the cache is cleared while requests hold cached pages"
        );
        while let Some((_, page)) = self.cache.lru.pop_first() {
            self.cache.entries[page as usize] = None;
            self.owner[page as usize] = None;
            self.free.push(page);
        }
        self.cache.by_hash.clear();
        self.cache.num_cached = 0;
    }

    /// Test hook: overwrites cached `page`'s reference count, to see the invariant checker
    /// catch it.
    #[cfg(test)]
    pub(crate) fn set_refs_for_test(&mut self, page: u32, refs: u32) {
        if let Some(e) = self.cache.entries[page as usize].as_mut() {
            e.refs = refs;
        }
    }

    /// Test hook: puts `page` on the free list whatever it holds.
    #[cfg(test)]
    pub(crate) fn push_free_for_test(&mut self, page: u32) {
        self.free.push(page);
    }

    /// Pool-level invariants: every free-list id is in range, listed once, unowned and not
    /// cached; free + owned == total; every cached page (and only those) is owned by the cache,
    /// indexed under its own hash, in the LRU exactly when no request holds it, and counted
    /// once. (That the references equal the block tables holding each page is the scheduler's
    /// check, `invariants.rs`.)
    pub fn check(&self) -> Result<(), String> {
        let mut seen = vec![false; self.owner.len()];
        for &page in &self.free {
            let slot = seen.get_mut(page as usize).ok_or_else(|| {
                format!("free list holds page {page}, pool has {}", self.owner.len())
            })?;
            if *slot {
                return Err(format!("page {page} is on the free list twice"));
            }
            *slot = true;
            if let Some(o) = self.owner[page as usize] {
                return Err(format!("page {page} is free and owned by {o}"));
            }
            if self.cache.entries[page as usize].is_some() {
                return Err(format!("page {page} is free and cached"));
            }
        }
        let owned = self.owner.iter().filter(|o| o.is_some()).count();
        if owned + self.free.len() != self.owner.len() {
            return Err(format!(
                "{owned} owned + {} free pages != {} total",
                self.free.len(),
                self.owner.len()
            ));
        }
        self.check_cache()
    }

    /// The cache part of [`Self::check`].
    fn check_cache(&self) -> Result<(), String> {
        let c = &self.cache;
        let mut cached = 0u32;
        for (page, entry) in c.entries.iter().enumerate() {
            let page = page as u32;
            let is_cache_owned = self.owner[page as usize] == Some(PageOwner::Cache);
            let Some(e) = entry else {
                if is_cache_owned {
                    return Err(format!("page {page} is owned by the cache but not cached"));
                }
                continue;
            };
            cached += 1;
            if !is_cache_owned {
                return Err(format!(
                    "cached page {page} is owned by {:?}",
                    self.owner[page as usize]
                ));
            }
            if c.by_hash.get(&e.hash) != Some(&page) {
                return Err(format!(
                    "cached page {page}'s hash {:#x} indexes page {:?}",
                    e.hash,
                    c.by_hash.get(&e.hash)
                ));
            }
            let in_lru = e.refs == 0 && c.lru.get(&e.stamp) == Some(&page);
            if (e.refs == 0) != in_lru {
                return Err(format!(
                    "cached page {page} has {} references but is {}in the LRU",
                    e.refs,
                    if in_lru { "" } else { "not " }
                ));
            }
        }
        if cached != c.num_cached || c.by_hash.len() as u32 != cached {
            return Err(format!(
                "{} pages counted as cached, {} hashes indexed, {cached} cached entries",
                c.num_cached,
                c.by_hash.len()
            ));
        }
        let mut in_lru = vec![false; self.owner.len()];
        for (&stamp, &page) in &c.lru {
            let held = c.entries.get(page as usize).and_then(|e| e.as_ref());
            if !held.is_some_and(|e| e.refs == 0 && e.stamp == stamp) {
                return Err(format!(
                    "LRU entry {stamp} names page {page}, not an unheld cached page"
                ));
            }
            if std::mem::replace(&mut in_lru[page as usize], true) {
                return Err(format!("cached page {page} is in the LRU twice"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const R1: PageOwner = PageOwner::Request(1);
    const R2: PageOwner = PageOwner::Request(2);

    #[test]
    fn allocate_release_round_trip() {
        let mut a = BlockAllocator::new(4);
        let mut got = Vec::new();
        assert!(a.allocate(R1, 3, &mut got));
        assert_eq!(got, vec![0, 1, 2]);
        assert_eq!(a.owner_of(1), Some(R1));
        assert_eq!((a.num_free(), a.num_used()), (1, 3));
        let mut more = Vec::new();
        assert!(!a.allocate(R2, 2, &mut more), "only one page is free");
        assert!(more.is_empty(), "a failed allocation takes nothing");
        a.release(R1, &got);
        assert_eq!(a.num_free(), 4);
        assert!(a.check().is_ok());
        let mut again = Vec::new();
        assert!(a.allocate(R2, 3, &mut again));
        assert_eq!(again, vec![0, 1, 2], "released pages are reused in order");
    }

    #[test]
    fn requests_and_adapters_share_the_pool_with_distinct_owners() {
        let mut a = BlockAllocator::new(4);
        let (mut kv, mut w) = (Vec::new(), Vec::new());
        assert!(a.allocate(R1, 2, &mut kv));
        // Adapter 1 and request 1 are different owners even with the same number.
        assert!(a.allocate(PageOwner::Adapter(1), 2, &mut w));
        assert_eq!(a.owner_of(w[0]), Some(PageOwner::Adapter(1)));
        assert_eq!(a.owner_of(kv[0]), Some(R1));
        assert_eq!(a.num_free(), 0);
        a.release(PageOwner::Adapter(1), &w);
        assert_eq!(a.num_free(), 2);
        assert!(a.check().is_ok());
        assert_eq!(PageOwner::Adapter(7).to_string(), "adapter 7");
    }

    fn key() -> PrefixKey {
        PrefixKey {
            variant: 0,
            generation: 0,
        }
    }

    #[test]
    fn cached_pages_are_shared_then_evicted_least_recently_released_first() {
        let mut a = BlockAllocator::new(4);
        let mut r1 = Vec::new();
        assert!(a.allocate(R1, 3, &mut r1));
        for (i, &p) in r1.iter().enumerate() {
            assert!(a.publish(R1, p, 10 + i as u64, 0, key(), &[i as u32]));
        }
        assert_eq!((a.num_cached(), a.num_free(), a.num_evictable()), (3, 1, 0));
        let mut dup = Vec::new();
        assert!(a.allocate(R2, 1, &mut dup));
        assert!(
            !a.publish(R2, dup[0], 10, 0, key(), &[0]),
            "hash 10 is cached already"
        );
        assert_eq!(
            a.owner_of(dup[0]),
            Some(R2),
            "a refused page stays its owner's"
        );
        a.release(R2, &dup);
        // Request 2 hits the first page: two references.
        a.acquire(r1[0]);
        assert_eq!(a.cached(r1[0]).unwrap().refs, 2);
        a.release(R1, &r1);
        // Pages 1 and 2 are unheld (2 released first, so older); page 0 is still held.
        assert_eq!((a.num_free(), a.num_evictable()), (3, 2));
        assert!(a.check().is_ok());
        let mut got = Vec::new();
        assert!(a.allocate(R2, 2, &mut got));
        assert_eq!(
            got,
            vec![3, r1[2]],
            "the free page, then the oldest unheld cached page"
        );
        assert_eq!(a.num_evicted(), 1);
        assert!(
            a.find_cached(12).is_none(),
            "an evicted page leaves the index"
        );
        assert_eq!(a.find_cached(11).map(|(p, _)| p), Some(r1[1]));
        let mut more = Vec::new();
        assert!(a.allocate(R2, 1, &mut more));
        assert_eq!(more, vec![r1[1]]);
        assert!(
            !a.allocate(R2, 1, &mut more),
            "the held page is never handed out"
        );
        assert!(a.check().is_ok());
        a.release(R2, &[r1[0]]);
        a.clear_cache();
        assert_eq!((a.num_cached(), a.num_free()), (0, 1));
        assert!(a.check().is_ok());
        assert_eq!(PageOwner::Cache.to_string(), "the prefix cache");
    }

    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "released by request 2")]
    fn releasing_someone_elses_page_panics_in_debug() {
        let mut a = BlockAllocator::new(2);
        let mut got = Vec::new();
        a.allocate(R1, 1, &mut got);
        a.release(R2, &got);
    }

    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "released by adapter 1")]
    fn an_adapter_cannot_release_a_requests_page() {
        let mut a = BlockAllocator::new(2);
        let mut got = Vec::new();
        a.allocate(R1, 1, &mut got);
        a.release(PageOwner::Adapter(1), &got);
    }
}
