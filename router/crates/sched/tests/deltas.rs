//! Scenario and randomized tests of compressed deltas (DeltaZip) in the scheduler: registration
//! rules, the `max_deltas` GPU slots with LRU eviction of idle deltas only, skip-the-line for
//! requests of deltas that already run (never for base or LoRA requests), parent-based
//! preemption and re-parenting, no starvation of a blocked head, and a randomized mix of base,
//! LoRA and delta requests checked after every operation. Every plan goes through the fake
//! worker in `common`, which also checks that no step puts more than `max_deltas` deltas on
//! the GPU.

mod common;

use std::collections::BTreeMap;

use common::{adapter, areq, cfg, delta, req, FakeWorker, Rng};
use deltaserve_sched::{
    AdapterSpec, FinishReason, ScheduledStep, Scheduler, SchedulerConfig, SeqRequest, VariantKind,
};

/// A config with `num_blocks` pages of 4 tokens, 8 sequences, a 64-token budget, `max_deltas`
/// delta slots and no prefetch (so every op shows up where a request needs it).
fn dcfg(num_blocks: u32, max_deltas: usize) -> SchedulerConfig {
    SchedulerConfig {
        max_deltas,
        prefetch_window: 0,
        ..cfg(4, num_blocks, 8, 64, 64)
    }
}

/// A scheduler, its fake worker and the registered ids.
struct Rig {
    s: Scheduler,
    w: FakeWorker,
    ids: Vec<u32>,
}

impl Rig {
    /// Registers LoRA adapters `(id, pages)` and deltas `ids` (10 host bytes each).
    fn new(c: &SchedulerConfig, loras: &[(u32, u32)], deltas: &[u32]) -> Self {
        let mut rig = Rig {
            s: Scheduler::new(c.clone()).unwrap(),
            w: FakeWorker::new(c.clone()),
            ids: Vec::new(),
        };
        let specs = loras
            .iter()
            .map(|&(id, pages)| (id, adapter(id, 0, pages, 10)))
            .chain(deltas.iter().map(|&id| (id, delta(id, 0, 10))));
        for (id, spec) in specs {
            rig.w.put_on_disk(id, &spec);
            rig.s.register_adapter(id, spec).unwrap();
            rig.ids.push(id);
        }
        rig.ids.sort_unstable();
        rig
    }

    fn add(&mut self, r: SeqRequest) {
        self.s.add_request(r).unwrap();
    }

    /// Schedules one step, runs it on the worker, applies the outputs and checks everything.
    fn step(&mut self) -> ScheduledStep {
        let st = self.s.schedule();
        assert!(!st.is_empty(), "expected work: {:?}", self.s.stats());
        let outs = self.w.run(&st, &mut common::sample_token);
        self.w.assert_matches(&self.s, self.ids.iter().copied());
        self.s.update(&outs);
        self.s.check_invariants().unwrap();
        st
    }
}

/// Ids sent in full this step, in the step's order (grouped by adapter, arrival within one).
fn new_ids(st: &ScheduledStep) -> Vec<u64> {
    st.new.iter().map(|n| n.id).collect()
}

/// The step's adapter ops as `"kind:id"` labels, in order.
fn ops(st: &ScheduledStep) -> Vec<String> {
    st.adapter_ops
        .iter()
        .map(|o| format!("{}:{}", o.op_name(), o.adapter_id))
        .collect()
}

#[test]
fn delta_registration_is_checked_and_refusals_change_nothing() {
    let c = dcfg(16, 2);
    let mut s = Scheduler::new(c.clone()).unwrap();
    s.register_adapter(1, delta(1, 0, 10)).unwrap();
    let before = s.stats();
    let with_pages = AdapterSpec {
        num_blocks: 2,
        ..delta(2, 0, 10)
    };
    let pageless_lora = AdapterSpec {
        kind: VariantKind::Lora,
        ..delta(3, 0, 10)
    };
    let bad: Vec<(u32, AdapterSpec, &str, &[&str])> = vec![
        (
            2,
            with_pages,
            "invalid_adapter",
            &["adapter 2", "num_blocks is 2", "delta slot"],
        ),
        (
            3,
            pageless_lora,
            "invalid_adapter",
            &["adapter 3", "num_blocks is 0"],
        ),
        (
            4,
            delta(4, 0, c.host_adapter_bytes + 1),
            "adapter_too_big",
            &["adapter 4", "host"],
        ),
        (1, delta(1, 1, 10), "duplicate_adapter", &["adapter 1"]),
    ];
    for (id, spec, kind, words) in bad {
        let err = s.register_adapter(id, spec).unwrap_err();
        assert_eq!(err.error_type(), kind, "adapter {id}: {err}");
        for word in words {
            assert!(err.to_string().contains(word), "{err} should name {word}");
        }
    }
    assert_eq!(s.stats(), before, "refusals changed the state");
    s.check_invariants().unwrap();

    // A delta takes no pool pages: a request may fill the whole pool with its KV.
    s.add_request(areq(1, 60, 4, 1)).unwrap(); // 63 cached tokens = 16 pages

    // max_deltas 0 turns deltas off; LoRA adapters are unaffected.
    let mut off = Scheduler::new(SchedulerConfig { max_deltas: 0, ..c }).unwrap();
    let err = off.register_adapter(1, delta(1, 0, 10)).unwrap_err();
    assert_eq!(err.error_type(), "deltas_disabled");
    assert!(
        err.to_string().contains("adapter 1") && err.to_string().contains("max_deltas is 0"),
        "{err}"
    );
    off.register_adapter(2, adapter(2, 0, 1, 10)).unwrap();
    assert_eq!(off.stats().adapters_registered, 1);

    // The kinds' labels are the wire's: `deltaserve_ipc::wire` tests them.
}

#[test]
fn at_most_max_deltas_are_resident_and_only_idle_ones_are_evicted_lru_first() {
    let c = dcfg(32, 2);
    let mut rig = Rig::new(&c, &[], &[1, 2, 3]);
    rig.add(areq(1, 4, 1, 1));
    rig.add(areq(2, 4, 1, 2));
    let st = rig.step();
    assert_eq!(ops(&st), ["to_host:1", "to_gpu:1", "to_host:2", "to_gpu:2"]);
    assert!(
        st.adapter_ops.iter().all(|op| match &op.kind {
            deltaserve_sched::AdapterOpKind::ToGpu { block_ids, .. } => block_ids.is_empty(),
            _ => true,
        }),
        "a delta's to_gpu names no pages"
    );
    assert_eq!(rig.s.stats().deltas_on_gpu, 2);
    assert_eq!(
        rig.s.stats().adapters_on_gpu,
        0,
        "deltas are not pool adapters"
    );
    assert_eq!(rig.s.stats().adapter_blocks, 0);

    // Delta 1 is used again: delta 2 becomes the least recently used.
    rig.add(areq(3, 4, 1, 1));
    assert!(
        rig.step().adapter_ops.is_empty(),
        "a warm delta needs no op"
    );
    rig.add(areq(4, 4, 1, 3));
    let st = rig.step();
    assert_eq!(ops(&st), ["drop_gpu:2", "to_host:3", "to_gpu:3"]);
    assert_eq!(rig.s.stats().adapter_gpu_evictions, 1);
    assert!(rig.s.adapter_residency(2).unwrap().gpu_blocks.is_none());
    assert!(
        rig.s.adapter_residency(2).unwrap().on_host,
        "its host copy stays"
    );

    // A delta in use is never evicted: delta 1 runs, so delta 3 (idle) makes room for 2.
    rig.add(areq(5, 4, 6, 1));
    assert_eq!(new_ids(&rig.step()), [5]);
    rig.add(areq(6, 4, 6, 2));
    let st = rig.step();
    assert_eq!(new_ids(&st), [6]);
    assert_eq!(ops(&st), ["drop_gpu:3", "to_gpu:2"]);

    // Both slots pinned: a third delta waits until one of them is idle, then the one idle
    // longest (delta 1: request 5 started, and so ended, first) gives up its slot.
    rig.add(areq(7, 4, 1, 3));
    let mut guard = 0;
    let st = loop {
        let st = rig.step();
        if new_ids(&st).contains(&7) {
            break st;
        }
        assert!(st.adapter_ops.is_empty(), "nothing moves while both run");
        assert!(rig.s.contains(5) || rig.s.contains(6));
        guard += 1;
        assert!(guard < 20, "request 7 never admitted");
    };
    assert!(!rig.s.contains(5) && !rig.s.contains(6));
    assert_eq!(ops(&st), ["drop_gpu:1", "to_gpu:3"]);
    assert_eq!(rig.w.max_deltas_seen, 2);
    assert_eq!(
        rig.s.stats().delta_skips,
        0,
        "nobody was queued behind a blocked head"
    );
}

#[test]
fn skip_the_line_admits_a_running_deltas_requests_but_never_base_or_lora_ones() {
    let c = dcfg(64, 1);
    let mut rig = Rig::new(&c, &[(9, 1)], &[1, 2]);
    // LoRA 9 runs (request 100, first in the queue), so its queued requests would fit at once
    // if they could skip like a delta's.
    rig.add(SeqRequest {
        arrival: 0,
        ..areq(100, 4, 8, 9)
    });
    rig.add(areq(1, 4, 5, 1));
    rig.add(areq(2, 4, 1, 2)); // the head once 1 runs: delta 2 needs delta 1's slot
    rig.add(areq(3, 4, 2, 1));
    rig.add(req(4, 4, 1));
    rig.add(areq(5, 4, 1, 9));
    rig.add(areq(6, 4, 2, 1));
    rig.add(areq(7, 4, 1, 2));
    let st = rig.step();
    assert_eq!(new_ids(&st), [1, 3, 6, 100], "3 and 6 skip past 2, 4 and 5");
    assert!(st.preempted.is_empty());
    assert_eq!(rig.s.skip_parent(1), None, "admitted in FCFS order");
    assert_eq!(rig.s.skip_parent(3), Some(1));
    assert_eq!(rig.s.skip_parent(6), Some(1));
    assert_eq!(rig.s.stats().delta_skips, 2);
    assert_eq!(rig.s.stats().waiting, 4);

    // While request 1 runs, the base and LoRA requests wait behind the blocked head (LoRA 9
    // running does not let request 5 skip).
    while rig.s.contains(1) {
        let st = rig.step();
        assert!(new_ids(&st).is_empty(), "admitted {:?}", new_ids(&st));
        assert!(
            st.preempted.is_empty(),
            "3 and 6 finished before their parent"
        );
    }
    let st = rig.step();
    let mut admitted = new_ids(&st);
    admitted.sort_unstable();
    assert_eq!(admitted, [2, 4, 5, 7], "FCFS once delta 2 gets the slot");
    assert_eq!(ops(&st), ["drop_gpu:1", "to_host:2", "to_gpu:2"]);
    let stats = rig.s.stats();
    assert_eq!((stats.delta_skips, stats.delta_skip_preemptions), (2, 0));
}

#[test]
fn when_the_parent_finishes_its_skippers_are_preempted_in_order_and_the_head_gets_the_slot() {
    let c = dcfg(64, 1);
    let mut rig = Rig::new(&c, &[], &[1, 2]);
    rig.add(areq(1, 4, 2, 1));
    rig.add(areq(2, 4, 1, 2));
    rig.add(areq(3, 4, 8, 1));
    rig.add(areq(4, 4, 8, 1));
    assert_eq!(new_ids(&rig.step()), [1, 3, 4]);
    rig.step(); // request 1 finishes
    assert!(!rig.s.contains(1));
    assert_eq!(rig.s.skip_parent(3), None, "orphaned");
    assert_eq!(rig.s.output_tokens(3).unwrap().len(), 2);

    let st = rig.step();
    assert_eq!(st.preempted, [3, 4]);
    for id in [1, 3, 4] {
        assert!(st.released.contains(&id), "{id} not in {:?}", st.released);
    }
    assert_eq!(new_ids(&st), [2], "the head takes the freed slot at once");
    assert_eq!(ops(&st), ["drop_gpu:1", "to_host:2", "to_gpu:2"]);
    let stats = rig.s.stats();
    assert_eq!(
        (stats.delta_skip_preemptions, stats.num_preemptions),
        (2, 2)
    );
    assert_eq!(stats.waiting, 2);
    assert_eq!(rig.s.output_tokens(3).unwrap().len(), 2, "outputs are kept");

    // Request 2 is done; 3 and 4 come back in their original order, as non-skippers, resent
    // with prompt ++ the outputs they had.
    let st = rig.step();
    assert_eq!(new_ids(&st), [3, 4]);
    assert_eq!(ops(&st), ["drop_gpu:2", "to_gpu:1"]);
    for n in &st.new {
        assert_eq!(n.token_ids.len(), 4 + 2);
        assert_eq!(rig.s.skip_parent(n.id), None);
    }
    while rig.s.has_unfinished() {
        rig.step();
    }
    assert_eq!(rig.s.stats().num_finished, 4);
}

#[test]
fn skippers_move_to_the_next_oldest_non_skipper_of_their_delta() {
    let c = dcfg(64, 1);
    let mut rig = Rig::new(&c, &[], &[1, 2]);
    rig.add(areq(1, 4, 2, 1));
    rig.add(areq(2, 4, 6, 1));
    rig.add(areq(3, 4, 1, 2));
    rig.add(areq(4, 4, 12, 1));
    assert_eq!(new_ids(&rig.step()), [1, 2, 4]);
    assert_eq!(rig.s.skip_parent(4), Some(1), "the oldest non-skipper");
    rig.step(); // request 1 finishes; request 2 still runs delta 1
    assert!(!rig.s.contains(1));
    assert_eq!(rig.s.skip_parent(4), Some(2), "re-parented, not preempted");
    let mut steps = 0;
    while rig.s.contains(2) {
        let st = rig.step();
        assert!(
            st.preempted.is_empty(),
            "no recompute while delta 1 legitimately runs"
        );
        assert!(st.running.iter().any(|r| r.id == 4));
        steps += 1;
        assert!(steps < 10);
    }
    let st = rig.step();
    assert_eq!(
        st.preempted,
        [4],
        "request 2 was its delta's last non-skipper"
    );
    assert_eq!(new_ids(&st), [3]);
    assert_eq!(rig.s.stats().delta_skip_preemptions, 1);
}

#[test]
fn preempted_skippers_are_not_let_skip_again_in_the_same_step() {
    // Request 1 (delta 1) holds 5 of the 18 pages and keeps one free for its next token; the
    // head, request 11 (delta 1 as well), needs 13 pages plus that one, so it is blocked on
    // pages, and 3 and 4 skip past it and past 2 (delta 2, no slot).
    let c = SchedulerConfig {
        max_num_batched_tokens: 128, // no chunking: 11 needs its 13 pages at once
        ..dcfg(18, 1)
    };
    let mut rig = Rig::new(&c, &[], &[1, 2]);
    rig.add(areq(1, 20, 3, 1));
    rig.add(SeqRequest {
        arrival: 1,
        ..areq(11, 52, 3, 1)
    });
    rig.add(areq(2, 4, 1, 2));
    rig.add(areq(3, 4, 8, 1));
    rig.add(areq(4, 4, 8, 1));
    assert_eq!(new_ids(&rig.step()), [1, 3, 4]);
    while rig.s.contains(1) {
        assert!(new_ids(&rig.step()).is_empty());
    }
    // 3 and 4 are preempted; that frees the pages the head needs, so 11 is admitted (a
    // non-skipper of delta 1, selecting it again) and 2 blocks on the slot. 3 and 4 would fit,
    // but letting them skip back in would only have recomputed them for nothing.
    let st = rig.step();
    assert_eq!(st.preempted, [3, 4]);
    assert_eq!(new_ids(&st), [11]);
    assert_eq!(rig.s.stats().waiting, 3);
    // In the next step they may skip again, now riding on 11.
    let st = rig.step();
    assert_eq!(new_ids(&st), [3, 4]);
    assert_eq!(rig.s.skip_parent(3), Some(11));
    assert_eq!(rig.s.stats().delta_skips, 4);
    // 11 finishes, 3 and 4 are preempted again, and 2 finally gets the slot.
    while rig.s.contains(11) {
        rig.step();
    }
    let st = rig.step();
    assert_eq!(st.preempted, [3, 4]);
    assert_eq!(new_ids(&st), [2]);
    while rig.s.has_unfinished() {
        rig.step();
    }
}

#[test]
fn a_stream_of_requests_for_the_running_delta_cannot_starve_the_head() {
    let c = SchedulerConfig {
        max_num_seqs: 64,
        ..dcfg(512, 1)
    };
    let mut rig = Rig::new(&c, &[], &[1, 2]);
    rig.add(areq(1, 4, 10, 1));
    rig.add(areq(2, 4, 1, 2));
    let mut admitted_at = None;
    for step in 1..=30u64 {
        // A new request for delta 1 every step (ids 3, 4, ...): each one could skip past 2.
        rig.add(areq(step + 2, 4, 5, 1));
        let st = rig.step();
        if new_ids(&st).contains(&2) {
            admitted_at = Some(step);
            break;
        }
    }
    let at = admitted_at.expect("the head was starved");
    assert!(at <= 11, "admitted only at step {at}");
    assert!(rig.s.stats().delta_skips >= 8);
    assert!(rig.s.stats().delta_skip_preemptions > 0);
    let mut guard = 0;
    while rig.s.has_unfinished() {
        rig.step();
        guard += 1;
        assert!(guard < 200, "not drained: {:?}", rig.s.stats());
    }
}

/// What the randomized test knows about one accepted request.
struct Truth {
    prompt: Vec<u32>,
    outputs: Vec<u32>,
    max_tokens: u32,
    adapter_id: u32,
}

/// What the random scenarios add up, to show they exercise the delta paths.
#[derive(Default, Debug)]
struct Coverage {
    skips: u64,
    skip_preemptions: u64,
    memory_preemptions: u64,
    delta_evictions: u64,
    delta_tokens_finished: u64,
    full_slots: u64,
}

/// LoRA adapters are ids 1..=3, deltas 4..=7 (0 = base).
const LORAS: [u32; 3] = [1, 2, 3];
const DELTAS: [u32; 4] = [4, 5, 6, 7];

/// One random scenario: adds (base, LoRA and delta requests), aborts, finishes, worker resets,
/// lost outputs and steps; every invariant after every operation; then a drain in which every
/// request must finish.
fn scenario(seed: u64, ops: usize, cov: &mut Coverage) {
    let mut rng = Rng(seed);
    let bs = rng.range(1, 4) as u32;
    let c = SchedulerConfig {
        host_adapter_bytes: rng.range(20, 60),
        prefetch_window: rng.range(0, 4) as usize,
        max_deltas: rng.range(1, 3) as usize,
        ..cfg(
            bs,
            rng.range(8, 40) as u32,
            rng.range(1, 8) as usize,
            rng.range(4, 48) as usize,
            rng.range(16, 64) as u32,
        )
    };
    let mut s = Scheduler::new(c.clone()).unwrap();
    let mut w = FakeWorker::new(c.clone());
    let mut specs: BTreeMap<u32, AdapterSpec> = BTreeMap::new();
    for id in LORAS {
        specs.insert(id, adapter(id, 0, rng.range(1, 2) as u32, rng.range(1, 20)));
    }
    for id in DELTAS {
        specs.insert(id, delta(id, 0, rng.range(1, 20)));
    }
    for (&id, spec) in &specs {
        w.put_on_disk(id, spec);
        s.register_adapter(id, spec.clone()).unwrap();
    }
    let mut live: BTreeMap<u64, Truth> = BTreeMap::new();
    let mut next_id = 1u64;
    let mut sample_rng = Rng(seed ^ 0x5EED);

    let mut step_once = |s: &mut Scheduler,
                         w: &mut FakeWorker,
                         live: &mut BTreeMap<u64, Truth>,
                         rng: &mut Rng,
                         cov: &mut Coverage| {
        let before = s.stats();
        let st = s.schedule();
        if st.is_empty() {
            assert!(
                !s.has_unfinished(),
                "seed {seed}: empty step with work left"
            );
            return;
        }
        for n in &st.new {
            let t = &live[&n.id];
            let mut want = t.prompt.clone();
            want.extend(&t.outputs);
            assert_eq!(n.token_ids, want, "seed {seed}: {} resent wrong", n.id);
        }
        for op in &st.adapter_ops {
            if op.op_name() == "drop_gpu" && DELTAS.contains(&op.adapter_id) {
                cov.delta_evictions += 1;
            }
        }
        let mut outs = w.run(&st, &mut |_, _| sample_rng.range(1, 50) as u32);
        w.assert_matches(s, specs_ids());
        let after = s.stats();
        cov.skips += after.delta_skips - before.delta_skips;
        let skip_preempted = after.delta_skip_preemptions - before.delta_skip_preemptions;
        cov.skip_preemptions += skip_preempted;
        cov.memory_preemptions += st.preempted.len() as u64 - skip_preempted;
        cov.full_slots += u64::from(after.deltas_on_gpu == c.max_deltas);
        if rng.pct(3) && !outs.is_empty() {
            let k = rng.range(0, outs.len() as u64 - 1) as usize;
            let (id, _) = outs.remove(k);
            w.rollback(id);
        }
        for u in s.update(&outs) {
            let t = live.get_mut(&u.id).unwrap();
            t.outputs.push(u.token);
            if let Some(reason) = u.finished {
                assert_eq!(reason, FinishReason::Length, "no EOS ids in this test");
                assert_eq!(t.outputs.len() as u32, t.max_tokens);
                let t = live.remove(&u.id).unwrap();
                cov.delta_tokens_finished += u64::from(DELTAS.contains(&t.adapter_id));
            }
        }
    };

    for _ in 0..ops {
        let roll = rng.range(0, 99);
        if roll < 30 {
            let adapter_id = match rng.range(0, 9) {
                0 | 1 => 0,
                2..=4 => LORAS[rng.range(0, 2) as usize],
                _ => DELTAS[rng.range(0, 3) as usize],
            };
            let max_len = c.max_model_len as u64;
            let plen = rng.range(1, max_len.min(24) - 1);
            let max_tokens = rng.range(1, (max_len - plen).min(16)) as u32;
            let pages = specs.get(&adapter_id).map_or(0, |a| a.num_blocks as u64);
            let fits =
                (plen + max_tokens as u64 - 1).div_ceil(bs as u64) + pages <= c.num_blocks as u64;
            let r = SeqRequest {
                id: next_id,
                prompt: (0..plen).map(|_| rng.range(1, 50) as u32).collect(),
                max_tokens,
                eos_token_ids: Vec::new(),
                ignore_eos: false,
                arrival: next_id,
                adapter_id,
            };
            let truth = Truth {
                prompt: r.prompt.clone(),
                outputs: Vec::new(),
                max_tokens,
                adapter_id,
            };
            match s.add_request(r) {
                Ok(()) => {
                    assert!(fits, "seed {seed}: accepted a request too big for the pool");
                    live.insert(next_id, truth);
                }
                Err(e) => assert!(!fits, "seed {seed}: refused a valid request: {e}"),
            }
            next_id += 1;
        } else if roll < 33 && !live.is_empty() {
            let id = *live
                .keys()
                .nth(rng.range(0, live.len() as u64 - 1) as usize)
                .unwrap();
            let existed = if rng.pct(50) {
                s.abort(id)
            } else {
                s.finish(id)
            };
            assert!(existed && live.remove(&id).is_some());
        } else if roll < 34 {
            s.reset_worker();
            w.reset();
            assert_eq!(s.stats().deltas_on_gpu, 0);
        } else {
            step_once(&mut s, &mut w, &mut live, &mut rng, cov);
        }
        if let Err(e) = s.check_invariants() {
            panic!("seed {seed}: {e}\nconfig {c:?}\nstats {:?}", s.stats());
        }
        assert_eq!(s.stats().waiting + s.stats().running, live.len());
    }
    // Drain: no new work, and every request must finish (no starvation, no livelock).
    let mut guard = 0;
    while s.has_unfinished() {
        step_once(&mut s, &mut w, &mut live, &mut rng, cov);
        s.check_invariants().unwrap();
        guard += 1;
        assert!(guard < 5_000, "seed {seed}: not drained: {:?}", s.stats());
    }
    assert!(live.is_empty());
    assert!(w.max_deltas_seen <= c.max_deltas);
    let st = s.stats();
    assert_eq!(st.used_blocks, 0, "seed {seed}: KV pages leaked");
}

/// Every registered id of the randomized scenarios.
fn specs_ids() -> impl Iterator<Item = u32> {
    LORAS.into_iter().chain(DELTAS)
}

#[test]
fn random_mixes_of_base_lora_and_delta_requests_keep_every_invariant_and_all_finish() {
    let mut cov = Coverage::default();
    for seed in 0..24u64 {
        scenario(seed, 1_500, &mut cov);
    }
    assert!(cov.skips > 0, "skip-the-line must be exercised: {cov:?}");
    assert!(cov.skip_preemptions > 0, "parent-based preemption: {cov:?}");
    assert!(cov.memory_preemptions > 0, "recompute preemption: {cov:?}");
    assert!(cov.delta_evictions > 0, "delta slot evictions: {cov:?}");
    assert!(
        cov.full_slots > 0,
        "all delta slots taken at times: {cov:?}"
    );
    assert!(
        cov.delta_tokens_finished > 0,
        "delta requests finish: {cov:?}"
    );
}
