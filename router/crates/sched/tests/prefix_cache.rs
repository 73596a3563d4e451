//! Prefix caching (`prefix.rs`): hits are whole pages and at most `len - 1` tokens, keys keep
//! variants and their registrations apart, cached pages are refcounted and evicted least
//! recently released first and never while a request holds them, preemption and abort drop
//! their references, `n` identical prompts are prefilled once, and, over random operations, a
//! worker that tracks what each KV slot holds only ever reads its own tokens' KV.

mod common;

use std::collections::{BTreeMap, HashMap, VecDeque};

use common::{adapter, cfg, Rng};
use deltaserve_sched::{
    ScheduledStep, Scheduler, SchedulerConfig, SeqRequest, SeqUpdate, VariantOpKind,
};

/// A config with prefix caching on.
fn pcfg(block_size: u32, num_blocks: u32, budget: usize) -> SchedulerConfig {
    SchedulerConfig {
        enable_prefix_caching: true,
        ..cfg(block_size, num_blocks, 16, budget, 512)
    }
}

/// A request with this prompt.
fn preq(id: u64, prompt: &[u32], max_tokens: u32, adapter_id: u32) -> SeqRequest {
    SeqRequest {
        id,
        prompt: prompt.to_vec(),
        max_tokens,
        eos_token_ids: Vec::new(),
        ignore_eos: false,
        arrival: id,
        adapter_id,
        skip_prefix_cache: false,
    }
}

/// What a KV slot holds: (the tag of the request that wrote it, the token at that position).
type Slot = Option<(u64, u32)>;

/// A worker that tracks what each KV slot holds and checks that every request reads only the
/// KV of its own tokens under its own tag (its variant registration), and never writes a page
/// another request holds.
struct KvWorker {
    block_size: usize,
    /// req id -> (tokens, computed, block table, tag).
    reqs: BTreeMap<u64, (Vec<u32>, usize, Vec<u32>, u64)>,
    /// page -> its slots.
    slots: HashMap<u32, Vec<Slot>>,
    /// Tokens computed (prefill and decode), cumulative.
    computed_tokens: u64,
}

impl KvWorker {
    fn new(block_size: u32) -> Self {
        Self {
            block_size: block_size as usize,
            reqs: BTreeMap::new(),
            slots: HashMap::new(),
            computed_tokens: 0,
        }
    }

    /// Runs `step`; `tag` gives a new request's tag. Samples `id * 7 + position` (mod 50).
    fn run(&mut self, step: &ScheduledStep, tag: &dyn Fn(u64) -> u64) -> Vec<(u64, Option<u32>)> {
        let bs = self.block_size;
        for id in &step.released {
            self.reqs
                .remove(id)
                .expect("released ids are on the worker");
        }
        for op in &step.adapter_ops {
            if let VariantOpKind::ToGpu { block_ids, .. } = &op.kind {
                for p in block_ids {
                    // Adapter weights overwrite the page.
                    self.slots.remove(p);
                    for (id, r) in &self.reqs {
                        assert!(
                            !r.2.contains(p),
                            "adapter pages {p} in request {id}'s table"
                        );
                    }
                }
            }
        }
        let mut chunks = Vec::new();
        for n in &step.new {
            let c = n.num_computed_tokens as usize;
            assert_eq!(
                c % bs,
                0,
                "request {}: a hit of {c} tokens is not whole pages",
                n.id
            );
            assert!(
                c < n.token_ids.len(),
                "request {}: the last token is never a hit",
                n.id
            );
            let t = (n.token_ids.clone(), c, n.block_ids.clone(), tag(n.id));
            assert!(self.reqs.insert(n.id, t).is_none());
            chunks.push((n.id, n.num_scheduled_tokens as usize));
        }
        for r in &step.running {
            self.reqs.get_mut(&r.id).unwrap().2.extend(&r.new_block_ids);
            chunks.push((r.id, r.num_scheduled_tokens as usize));
        }
        let mut holders: HashMap<u32, u32> = HashMap::new();
        for r in self.reqs.values() {
            for &p in &r.2 {
                *holders.entry(p).or_default() += 1;
            }
        }
        let mut out = Vec::new();
        for (id, n) in chunks {
            let (tokens, computed, blocks, tag) = self.reqs.get_mut(&id).unwrap();
            for pos in 0..*computed {
                let slot = self.slots.get(&blocks[pos / bs]).and_then(|s| s[pos % bs]);
                assert_eq!(
                    slot,
                    Some((*tag, tokens[pos])),
                    "request {id} reads page {} slot {} holding someone else's KV",
                    blocks[pos / bs],
                    pos % bs
                );
            }
            for pos in *computed..*computed + n {
                let page = blocks[pos / bs];
                assert_eq!(
                    holders[&page], 1,
                    "request {id} writes page {page}, which other requests hold"
                );
                self.slots.entry(page).or_insert_with(|| vec![None; bs])[pos % bs] =
                    Some((*tag, tokens[pos]));
            }
            *computed += n;
            self.computed_tokens += n as u64;
            if *computed == tokens.len() {
                let t = ((id as usize * 7 + tokens.len()) % 50) as u32 + 1;
                tokens.push(t);
                out.push((id, Some(t)));
            } else {
                out.push((id, None));
            }
        }
        out
    }
}

/// Steps `s` on `w` until nothing is unfinished; every request's tag is `tag`'s.
fn drain(s: &mut Scheduler, w: &mut KvWorker, tag: &dyn Fn(u64) -> u64) -> Vec<SeqUpdate> {
    let mut all = Vec::new();
    for _ in 0..500 {
        if !s.has_unfinished() {
            return all;
        }
        let step = s.schedule();
        assert!(!step.is_empty(), "stuck: {:?}", s.stats());
        all.extend(s.update(&w.run(&step, tag)));
        s.check_invariants().unwrap();
    }
    panic!("not done after 500 steps");
}

fn base_tag(_: u64) -> u64 {
    0
}

#[test]
fn hits_are_whole_pages_and_leave_the_last_token_to_compute() {
    for (len, hit) in [(3, 0), (4, 0), (5, 4), (8, 4), (9, 8), (12, 8), (13, 12)] {
        let mut s = Scheduler::new(pcfg(4, 32, 64)).unwrap();
        let mut w = KvWorker::new(4);
        let prompt: Vec<u32> = (100..100 + len).collect();
        s.add_request(preq(1, &prompt, 2, 0)).unwrap();
        drain(&mut s, &mut w, &base_tag);
        s.add_request(preq(2, &prompt, 2, 0)).unwrap();
        let step = s.schedule();
        assert_eq!(step.new[0].num_computed_tokens, hit, "prompt of {len}");
        assert_eq!(step.new[0].num_scheduled_tokens, len - hit);
        s.update(&w.run(&step, &base_tag));
        drain(&mut s, &mut w, &base_tag);
        let st = s.stats();
        assert_eq!(st.prefix_hit_tokens, hit as u64);
        assert_eq!(st.prefix_queried_tokens, 2 * len as u64);
        assert_eq!(
            st.free_blocks, 32,
            "cached pages nobody holds count as free"
        );
        assert_eq!(st.used_blocks, 0);
    }
}

#[test]
fn a_longer_prompt_hits_the_shared_part_and_a_different_one_misses() {
    let mut s = Scheduler::new(pcfg(4, 32, 64)).unwrap();
    let mut w = KvWorker::new(4);
    let system: Vec<u32> = (1..=10).collect();
    s.add_request(preq(1, &system, 3, 0)).unwrap();
    drain(&mut s, &mut w, &base_tag);
    // Pages 0 and 1 hold tokens 1..=8 of the system prompt.
    let mut longer = system.clone();
    longer.extend([77, 78, 79]);
    s.add_request(preq(2, &longer, 2, 0)).unwrap();
    let mut other = system.clone();
    other[0] = 99;
    s.add_request(preq(3, &other, 2, 0)).unwrap();
    let step = s.schedule();
    let hits: BTreeMap<u64, u32> = step
        .new
        .iter()
        .map(|n| (n.id, n.num_computed_tokens))
        .collect();
    assert_eq!(hits[&2], 8, "two pages of system prompt");
    assert_eq!(hits[&3], 0, "the first token differs: nothing matches");
    s.update(&w.run(&step, &base_tag));
    drain(&mut s, &mut w, &base_tag);
}

#[test]
fn variants_and_their_registrations_never_share_pages() {
    let c = pcfg(4, 64, 64);
    let mut s = Scheduler::new(c).unwrap();
    let mut w = KvWorker::new(4);
    s.register_adapter(1, adapter(1, 0, 1, 10)).unwrap();
    s.register_adapter(2, adapter(2, 0, 1, 10)).unwrap();
    let prompt: Vec<u32> = (1..=9).collect();
    let mut tags: BTreeMap<u64, u64> = BTreeMap::new();
    // One request per variant, one after the other: each misses the others' pages.
    for (id, a) in [(1, 0), (2, 1), (3, 2)] {
        tags.insert(id, a as u64);
        s.add_request(preq(id, &prompt, 2, a)).unwrap();
        let t = tags.clone();
        drain(&mut s, &mut w, &move |i| t[&i]);
    }
    assert_eq!(
        s.stats().prefix_hit_tokens,
        0,
        "base, LoRA 1 and LoRA 2 are keyed apart"
    );
    // The same variant again hits its own.
    tags.insert(4, 1);
    s.add_request(preq(4, &prompt, 2, 1)).unwrap();
    let step = s.schedule();
    assert_eq!(step.new[0].num_computed_tokens, 8);
    let t = tags.clone();
    s.update(&w.run(&step, &move |i| t[&i]));
    let t = tags.clone();
    drain(&mut s, &mut w, &move |i| t[&i]);
    // Adapter 1 registered again (same id, same path): its old pages are stale.
    s.unregister_adapter(1).unwrap();
    s.register_adapter(1, adapter(1, 0, 1, 10)).unwrap();
    tags.insert(5, 10);
    s.add_request(preq(5, &prompt, 2, 1)).unwrap();
    let step = s.schedule();
    assert_eq!(
        step.new[0].num_computed_tokens, 0,
        "a new registration misses"
    );
    let t = tags.clone();
    s.update(&w.run(&step, &move |i| t[&i]));
    let t = tags.clone();
    drain(&mut s, &mut w, &move |i| t[&i]);
    assert_eq!(s.stats().prefix_hit_tokens, 8);
}

#[test]
fn unheld_pages_are_evicted_oldest_first_and_held_ones_never() {
    // 8 pages of 4 tokens. Prompts of 9 tokens publish 2 prompt pages each.
    let mut s = Scheduler::new(pcfg(4, 8, 64)).unwrap();
    let mut w = KvWorker::new(4);
    let a: Vec<u32> = (1..=9).collect();
    let b: Vec<u32> = (101..=109).collect();
    s.add_request(preq(1, &a, 2, 0)).unwrap();
    drain(&mut s, &mut w, &base_tag);
    s.add_request(preq(2, &b, 2, 0)).unwrap();
    drain(&mut s, &mut w, &base_tag);
    assert_eq!(s.stats().prefix_cached_blocks, 4);
    assert_eq!(s.stats().free_blocks, 8);
    // A request holds a's pages (a hit) while a big one needs 5 pages: only b's unheld pages
    // and the free ones can go; a's stay.
    s.add_request(preq(3, &a, 3, 0)).unwrap();
    let step = s.schedule();
    assert_eq!(step.new[0].num_computed_tokens, 8);
    let held: Vec<u32> = step.new[0].block_ids[..2].to_vec();
    s.update(&w.run(&step, &base_tag));
    let big: Vec<u32> = (201..=217).collect();
    s.add_request(preq(4, &big, 1, 0)).unwrap();
    let step = s.schedule();
    let pages = &step.new[0].block_ids;
    assert!(
        pages.iter().all(|p| !held.contains(p)),
        "held pages {held:?} handed out"
    );
    assert_eq!(s.stats().prefix_evicted_blocks, 2, "b's pages were evicted");
    s.update(&w.run(&step, &base_tag));
    s.check_invariants().unwrap();
    drain(&mut s, &mut w, &base_tag);
    // a survives (held through the pressure); b was evicted.
    s.add_request(preq(5, &a, 2, 0)).unwrap();
    s.add_request(preq(6, &b, 2, 0)).unwrap();
    let step = s.schedule();
    let hits: Vec<u32> = step.new.iter().map(|n| n.num_computed_tokens).collect();
    assert_eq!(hits, vec![8, 0]);
    s.update(&w.run(&step, &base_tag));
    drain(&mut s, &mut w, &base_tag);
}

#[test]
fn the_least_recently_released_page_goes_first() {
    let mut s = Scheduler::new(pcfg(4, 6, 64)).unwrap();
    let mut w = KvWorker::new(4);
    let prompts: Vec<Vec<u32>> = (0..3).map(|k| (k * 100..k * 100 + 5).collect()).collect();
    for (i, p) in prompts.iter().enumerate() {
        s.add_request(preq(i as u64 + 1, p, 1, 0)).unwrap();
        drain(&mut s, &mut w, &base_tag);
    }
    // Three cached first pages (released in order 1, 2, 3) plus free ones; take 4 pages.
    assert_eq!(s.stats().prefix_cached_blocks, 3);
    let big: Vec<u32> = (1000..1016).collect();
    s.add_request(preq(9, &big, 1, 0)).unwrap();
    drain(&mut s, &mut w, &base_tag);
    // Prompt 0's page was the oldest: evicted; 1 and 2 still hit (each looked up alone: an
    // admission may itself evict the next oldest page).
    let hits: Vec<u32> = prompts
        .iter()
        .map(|p| {
            let mut probe = s.clone();
            probe.add_request(preq(20, p, 1, 0)).unwrap();
            probe.schedule().new[0].num_computed_tokens
        })
        .collect();
    assert_eq!(hits, vec![0, 4, 4]);
    assert_eq!(s.stats().prefix_evicted_blocks, 1);
}

#[test]
fn abort_drops_references_and_a_worker_reset_empties_the_cache() {
    let mut s = Scheduler::new(pcfg(4, 32, 64)).unwrap();
    let mut w = KvWorker::new(4);
    let p: Vec<u32> = (1..=13).collect();
    s.add_request(preq(1, &p, 2, 0)).unwrap();
    drain(&mut s, &mut w, &base_tag);
    s.add_request(preq(2, &p, 5, 0)).unwrap();
    s.add_request(preq(3, &p, 5, 0)).unwrap();
    let step = s.schedule();
    assert!(step.new.iter().all(|n| n.num_computed_tokens == 12));
    s.update(&w.run(&step, &base_tag));
    assert_eq!(
        s.stats().free_blocks,
        32 - 3 - 2,
        "3 shared pages, 1 own page each"
    );
    assert!(s.abort(2));
    s.check_invariants().unwrap();
    assert_eq!(s.stats().free_blocks, 32 - 3 - 1);
    let step = s.schedule();
    s.update(&w.run(&step, &base_tag));
    s.reset_worker();
    s.check_invariants().unwrap();
    assert_eq!(s.stats().prefix_cached_blocks, 0, "the worker's KV is gone");
    assert_eq!(s.stats().free_blocks, 32);
    let mut w = KvWorker::new(4);
    let step = s.schedule();
    assert_eq!(step.new[0].num_computed_tokens, 0);
    s.update(&w.run(&step, &base_tag));
    drain(&mut s, &mut w, &base_tag);
}

#[test]
fn a_preempted_request_hits_the_pages_it_published() {
    // 12 pages of 4 tokens. Request 3 (13-token prompt) runs; an older, bigger request takes
    // the rest, so 3's next page preempts 3 itself; readmitted, it hits its published pages.
    let mut s = Scheduler::new(pcfg(4, 12, 64)).unwrap();
    let mut w = KvWorker::new(4);
    let p: Vec<u32> = (1..=13).collect();
    s.add_request(preq(3, &p, 8, 0)).unwrap();
    let step = s.schedule();
    s.update(&w.run(&step, &base_tag));
    let big: Vec<u32> = (500..526).collect();
    s.add_request(SeqRequest {
        arrival: 0,
        ..preq(9, &big, 7, 0)
    })
    .unwrap();
    let mut resumed_with = None;
    for _ in 0..100 {
        if !s.has_unfinished() {
            break;
        }
        let step = s.schedule();
        if let Some(n) = step.new.iter().find(|n| n.id == 3) {
            resumed_with = Some(n.num_computed_tokens);
        }
        s.update(&w.run(&step, &base_tag));
        s.check_invariants().unwrap();
    }
    assert!(!s.has_unfinished());
    assert_eq!(s.stats().num_preemptions, 1);
    assert_eq!(
        resumed_with,
        Some(16),
        "its prompt and first output pages were cached"
    );
}

#[test]
fn n_identical_prompts_are_prefilled_once() {
    let mut s = Scheduler::new(pcfg(4, 64, 256)).unwrap();
    let mut w = KvWorker::new(4);
    let p: Vec<u32> = (1..=41).collect();
    for id in 1..=3 {
        s.add_request(preq(id, &p, 3, 0)).unwrap();
    }
    let step = s.schedule();
    assert_eq!(step.new.len(), 1, "siblings wait for the first one's pages");
    assert_eq!(s.stats().prefix_deferrals, 2);
    s.update(&w.run(&step, &base_tag));
    let step = s.schedule();
    let new: Vec<(u64, u32, u32)> = step
        .new
        .iter()
        .map(|n| (n.id, n.num_computed_tokens, n.num_scheduled_tokens))
        .collect();
    assert_eq!(new, vec![(2, 40, 1), (3, 40, 1)]);
    s.update(&w.run(&step, &base_tag));
    drain(&mut s, &mut w, &base_tag);
    let st = s.stats();
    assert_eq!(st.prefix_hit_tokens, 80);
    assert!((st.prefix_hit_rate() - 80.0 / 123.0).abs() < 1e-9);
    // 41 prompt tokens once, 1 each for the siblings, then 2 decode tokens each.
    assert_eq!(w.computed_tokens, 41 + 1 + 1 + 3 * 2);
}

#[test]
fn a_sibling_waits_for_a_chunked_prefill_and_others_go_past_it() {
    // Budget 12: the first sibling's prompt takes 2 steps; the sibling waits for the page being
    // computed, while an unrelated request behind it is admitted.
    let mut s = Scheduler::new(pcfg(4, 64, 12)).unwrap();
    let mut w = KvWorker::new(4);
    let p: Vec<u32> = (1..=20).collect();
    s.add_request(preq(1, &p, 2, 0)).unwrap();
    s.add_request(preq(2, &p, 2, 0)).unwrap();
    s.add_request(preq(3, &[900, 901], 2, 0)).unwrap();
    let mut admitted_at: BTreeMap<u64, (usize, u32)> = BTreeMap::new();
    for k in 0..50 {
        if !s.has_unfinished() {
            break;
        }
        let step = s.schedule();
        for n in &step.new {
            admitted_at.insert(n.id, (k, n.num_computed_tokens));
        }
        s.update(&w.run(&step, &base_tag));
        s.check_invariants().unwrap();
    }
    assert_eq!(admitted_at[&1], (0, 0));
    assert_eq!(admitted_at[&3], (1, 0), "passed the waiting sibling");
    assert_eq!(
        admitted_at[&2],
        (2, 16),
        "the sibling hit every page it could"
    );
    assert_eq!(s.stats().prefix_deferrals, 1);
}

#[test]
fn a_step_passes_over_at_most_64_waiting_requests_for_pending_pages() {
    let mut s = Scheduler::new(pcfg(4, 512, 4096)).unwrap();
    let mut w = KvWorker::new(4);
    let p: Vec<u32> = (1..=9).collect();
    for id in 1..=70 {
        s.add_request(preq(id, &p, 1, 0)).unwrap();
    }
    s.add_request(preq(71, &[500, 501], 1, 0)).unwrap();
    let step = s.schedule();
    let new: Vec<u64> = step.new.iter().map(|n| n.id).collect();
    assert_eq!(
        new,
        vec![1],
        "64 siblings passed over, then admission stops for the step"
    );
    assert_eq!(s.stats().prefix_deferrals, 64);
    s.update(&w.run(&step, &base_tag));
    let step = s.schedule();
    assert_eq!(
        step.new.len(),
        16,
        "max_num_seqs, every sibling on the cached pages"
    );
    assert!(step.new.iter().all(|n| n.num_computed_tokens == 8));
    s.update(&w.run(&step, &base_tag));
    drain(&mut s, &mut w, &base_tag);
}

#[test]
fn a_request_that_skips_the_cache_computes_its_whole_prompt_and_still_publishes() {
    let mut s = Scheduler::new(pcfg(4, 32, 64)).unwrap();
    let mut w = KvWorker::new(4);
    let p: Vec<u32> = (1..=9).collect();
    s.add_request(preq(1, &p, 2, 0)).unwrap();
    drain(&mut s, &mut w, &base_tag);
    s.add_request(SeqRequest {
        skip_prefix_cache: true,
        ..preq(2, &p, 2, 0)
    })
    .unwrap();
    let step = s.schedule();
    assert_eq!(step.new[0].num_computed_tokens, 0);
    s.update(&w.run(&step, &base_tag));
    drain(&mut s, &mut w, &base_tag);
    assert_eq!(s.stats().prefix_queried_tokens, 9, "it did not look up");
}

#[test]
fn with_prefix_caching_off_nothing_is_cached() {
    let mut s = Scheduler::new(cfg(4, 32, 16, 64, 512)).unwrap();
    let mut w = KvWorker::new(4);
    let p: Vec<u32> = (1..=9).collect();
    for id in 1..=2 {
        s.add_request(preq(id, &p, 2, 0)).unwrap();
    }
    let step = s.schedule();
    assert_eq!(step.new.len(), 2, "nobody waits");
    s.update(&w.run(&step, &base_tag));
    drain(&mut s, &mut w, &base_tag);
    let st = s.stats();
    assert_eq!(
        (
            st.prefix_cached_blocks,
            st.prefix_queried_tokens,
            st.prefix_hit_tokens
        ),
        (0, 0, 0)
    );
}

/// Random adds (prompts from a few shared prefixes, base and two LoRA adapters, groups of
/// identical requests), aborts, steps (one at a time with dropped outputs, or overlapped as the
/// server sends them), adapters registered again and worker resets, over small pools: the invariants hold after every operation, and the KV
/// worker never sees a request read KV that is not its own tokens' under its registration.
#[test]
fn random_operations_never_read_foreign_kv() {
    let (mut hit_tokens, mut preemptions, mut deferrals, mut evictions) = (0u64, 0u64, 0u64, 0u64);
    for seed in 0..40u64 {
        let mut rng = Rng(seed);
        let bs = rng.range(2, 5) as u32;
        let num_blocks = rng.range(12, 40) as u32;
        let c = SchedulerConfig {
            max_num_seqs: rng.range(2, 8) as usize,
            ..pcfg(bs, num_blocks, rng.range(4, 40) as usize)
        };
        let mut s = Scheduler::new(c).unwrap();
        let mut w = KvWorker::new(bs);
        // adapter id -> its registration's tag; request id -> its tag.
        let mut registration: BTreeMap<u32, u64> = BTreeMap::from([(0, 0)]);
        let mut next_tag = 1u64;
        for a in 1..=2 {
            s.register_adapter(a, adapter(a, 0, 1, 10)).unwrap();
            registration.insert(a, next_tag);
            next_tag += 1;
        }
        let mut tags: BTreeMap<u64, u64> = BTreeMap::new();
        let prefixes: Vec<Vec<u32>> = (0..3)
            .map(|k| (0..rng.range(1, 14)).map(|i| (k * 50 + i) as u32).collect())
            .collect();
        let mut next_id = 1u64;
        // Steps sent to the worker and not run yet; with `overlap`, a second one is formed
        // ahead of the first's update, as the server's actor does.
        let overlap = rng.pct(50);
        let mut sent: VecDeque<ScheduledStep> = VecDeque::new();
        for _ in 0..150 {
            match rng.range(0, 9) {
                0..=3 => {
                    let a = rng.range(0, 2) as u32;
                    let mut prompt = prefixes[rng.range(0, 2) as usize].clone();
                    prompt.extend((0..rng.range(0, 5)).map(|i| 1000 + i as u32));
                    if prompt.is_empty() {
                        prompt.push(7);
                    }
                    let copies = if rng.pct(30) { 3 } else { 1 };
                    for _ in 0..copies {
                        let r = preq(next_id, &prompt, rng.range(1, 6) as u32, a);
                        if s.add_request(r).is_ok() {
                            tags.insert(next_id, registration[&a]);
                        }
                        next_id += 1;
                    }
                }
                4 => {
                    let id = rng.range(1, next_id);
                    s.abort(id);
                }
                5 if rng.pct(20) => {
                    let a = rng.range(1, 2) as u32;
                    if s.adapter_users(a) == 0 {
                        s.unregister_adapter(a).unwrap();
                        s.register_adapter(a, adapter(a, 0, 1, 10)).unwrap();
                        registration.insert(a, next_tag);
                        next_tag += 1;
                    }
                }
                6 if rng.pct(10) => {
                    s.reset_worker();
                    w = KvWorker::new(bs);
                    sent.clear();
                }
                _ => {
                    if sent.is_empty() && s.has_unfinished() {
                        let step = s.schedule();
                        if !step.is_empty() {
                            sent.push_back(step);
                        }
                    }
                    if overlap && sent.len() == 1 {
                        let step = s.schedule_ahead();
                        if !step.is_empty() {
                            sent.push_back(step);
                        }
                    }
                    let Some(step) = sent.pop_front() else {
                        continue;
                    };
                    let t = tags.clone();
                    let mut outs = w.run(&step, &move |i| t[&i]);
                    if !overlap && rng.pct(5) {
                        // A dropped output: the scheduler reschedules from the same point,
                        // the worker undoes its chunk and overwrites those slots.
                        let (id, token) = outs.remove(0);
                        let n = step
                            .new
                            .iter()
                            .map(|n| (n.id, n.num_scheduled_tokens))
                            .chain(step.running.iter().map(|r| (r.id, r.num_scheduled_tokens)))
                            .find(|&(i, _)| i == id)
                            .unwrap()
                            .1;
                        let r = w.reqs.get_mut(&id).unwrap();
                        if token.is_some() {
                            r.0.pop();
                        }
                        r.1 -= n as usize;
                    }
                    s.update(&outs);
                }
            }
            s.check_invariants().unwrap();
        }
        while let Some(step) = sent.pop_front() {
            let t = tags.clone();
            s.update(&w.run(&step, &move |i| t[&i]));
        }
        let t = tags.clone();
        drain(&mut s, &mut w, &move |i| t[&i]);
        let st = s.stats();
        assert_eq!(st.used_blocks, 0);
        hit_tokens += st.prefix_hit_tokens;
        preemptions += st.num_preemptions;
        deferrals += st.prefix_deferrals;
        evictions += st.prefix_evicted_blocks;
    }
    assert!(
        hit_tokens > 500,
        "the scenarios hit the cache: {hit_tokens}"
    );
    assert!(preemptions > 5, "the scenarios preempt: {preemptions}");
    assert!(deferrals > 5, "siblings waited for pages: {deferrals}");
    assert!(evictions > 50, "cached pages were evicted: {evictions}");
}
