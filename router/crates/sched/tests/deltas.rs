//! Scenario and randomized tests of compressed deltas (DeltaZip) in the scheduler: registration
//! rules, the `max_deltas` GPU slots with LRU eviction of idle deltas only, skip-the-line for
//! requests of deltas that already run (never for base or LoRA requests), parent-based
//! preemption and re-parenting, and no starvation of a blocked head (the randomized mix of base,
//! LoRA and delta requests is `deltas_random.rs`). Every plan goes through the fake worker in
//! `common`, which also checks that no step puts more than `max_deltas` deltas on the GPU.

mod common;

use common::{adapter, areq, cfg, delta, req, FakeWorker};
use deltaserve_sched::{
    ScheduledStep, Scheduler, SchedulerConfig, SeqRequest, VariantKind, VariantSpec,
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
    let with_pages = VariantSpec {
        num_blocks: 2,
        ..delta(2, 0, 10)
    };
    let pageless_lora = VariantSpec {
        kind: VariantKind::Lora,
        ..delta(3, 0, 10)
    };
    let bad: Vec<(u32, VariantSpec, &str, &[&str])> = vec![
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
            deltaserve_sched::VariantOpKind::ToGpu { block_ids, .. } => block_ids.is_empty(),
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
