//! [`BlockAllocator`]: the accounting of the worker's one GPU page pool (S-LoRA unified
//! paging). A page holds either a request's KV cache or part of a LoRA adapter's weights; the
//! router owns which page belongs to whom, the worker owns the pool tensor and only follows the
//! page ids it is told.
//!
//! ```text
//!  pages 0..num_blocks
//!  free:  [ 7 6 5 ]                  <- stack; pop() hands out the lowest id first at start-up
//!  owner: [ r1 r1 A3 - A3 r2 r2 - ]  <- one owner per allocated page (request rN or adapter AN)
//! ```

use std::fmt;

/// Who holds a page: requests and adapters have separate id spaces, so the owner says which.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum PageOwner {
    /// KV cache of the request with this id.
    Request(u64),
    /// Weights of the GPU-resident LoRA adapter with this id.
    Adapter(u32),
}

impl fmt::Display for PageOwner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PageOwner::Request(id) => write!(f, "request {id}"),
            PageOwner::Adapter(id) => write!(f, "adapter {id}"),
        }
    }
}

/// A free list of page ids plus the owner of each page, so that double-frees and shared pages
/// are caught (`debug_assert` on every call, [`BlockAllocator::check`] for tests).
#[derive(Debug, Clone)]
pub struct BlockAllocator {
    /// Page ids free to hand out; a stack so allocation and release are O(1) and deterministic.
    free: Vec<u32>,
    /// `owner[p]` is whoever holds page `p`, `None` while it is free.
    owner: Vec<Option<PageOwner>>,
}

impl BlockAllocator {
    /// A pool of `num_blocks` free pages, handed out lowest id first.
    pub fn new(num_blocks: u32) -> Self {
        Self {
            free: (0..num_blocks).rev().collect(),
            owner: vec![None; num_blocks as usize],
        }
    }

    /// Pages in the pool.
    pub fn total(&self) -> u32 {
        self.owner.len() as u32
    }

    /// Pages free right now.
    pub fn num_free(&self) -> u32 {
        self.free.len() as u32
    }

    /// Pages owned by a request or an adapter right now.
    pub fn num_used(&self) -> u32 {
        self.total() - self.num_free()
    }

    /// Hands `n` pages to `owner`, appending their ids to `out`. Returns false, allocating
    /// nothing, when fewer than `n` are free.
    pub fn allocate(&mut self, owner: PageOwner, n: u32, out: &mut Vec<u32>) -> bool {
        if n > self.num_free() {
            return false;
        }
        for _ in 0..n {
            let page = self.free.pop().expect("checked: enough free pages");
            debug_assert!(
                self.owner[page as usize].is_none(),
                "page {page} on the free list is owned"
            );
            self.owner[page as usize] = Some(owner);
            out.push(page);
        }
        true
    }

    /// Returns `pages` (all owned by `owner`) to the pool. They are pushed in reverse so that the
    /// next allocation reuses them in the same order.
    pub fn release(&mut self, owner: PageOwner, pages: &[u32]) {
        for &page in pages.iter().rev() {
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

    /// Whoever owns `page`, if anyone.
    pub fn owner_of(&self, page: u32) -> Option<PageOwner> {
        self.owner.get(page as usize).copied().flatten()
    }

    /// Pool-level invariants: every free-list id is in range, listed once and unowned; free +
    /// owned == total.
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
        }
        let owned = self.owner.iter().filter(|o| o.is_some()).count();
        if owned + self.free.len() != self.owner.len() {
            return Err(format!(
                "{owned} owned + {} free pages != {} total",
                self.free.len(),
                self.owner.len()
            ));
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
