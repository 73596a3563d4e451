//! Scenario and randomized tests of compressed deltas (DeltaZip) in the scheduler: registration
//! rules, the `max_deltas` GPU slots with LRU eviction of idle deltas only, skip-the-line for
//! requests of deltas that already run (never for base or LoRA requests), parent-based
//! preemption and re-parenting, no starvation of a blocked head, and deltas loaded onto the GPU
//! ahead of their requests with `gpu_load_reports` (the randomized mix of base,
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
    /// Loads ahead that the worker's reports settled (`gpu_copies_ready`, summed).
    settled: usize,
}

impl Rig {
    /// Registers LoRA adapters `(id, pages)` and deltas `ids` (10 host bytes each).
    fn new(c: &SchedulerConfig, loras: &[(u32, u32)], deltas: &[u32]) -> Self {
        let mut rig = Rig {
            s: Scheduler::new(c.clone()).unwrap(),
            w: FakeWorker::new(c.clone()),
            ids: Vec::new(),
            settled: 0,
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

    /// Schedules one step, runs it on the worker, applies the outputs (with reports of every
    /// host read, which take one step here, and of the delta copies finished) and checks
    /// everything.
    fn step(&mut self) -> ScheduledStep {
        let st = self.s.schedule();
        assert!(!st.is_empty(), "expected work: {:?}", self.s.stats());
        let outs = self.w.run(&st, &mut common::sample_token);
        self.w.assert_matches(&self.s, self.ids.iter().copied());
        let read = self.w.finish_reads(|_| true);
        self.s.host_copies_ready(&read);
        let copied = self.w.gpu_ready();
        self.settled += self.s.gpu_copies_ready(&copied);
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

/// [`dcfg`] as the router runs it: host reads and delta copies reported by the worker
/// (`host_copy_reports`, `gpu_load_reports`), 64 pages, and a prefetch window of 4 (so requests
/// behind the head may be passed over too).
fn gcfg(max_deltas: usize) -> SchedulerConfig {
    SchedulerConfig {
        host_copy_reports: true,
        gpu_load_reports: true,
        prefetch_window: 4,
        ..dcfg(64, max_deltas)
    }
}

/// The step's `to_gpu` ops as `"to_gpu:id"` labels (prefetched `to_host`s left out).
fn to_gpus(st: &ScheduledStep) -> Vec<String> {
    ops(st)
        .into_iter()
        .filter(|o| o.starts_with("to_gpu"))
        .collect()
}

/// Steps until `id` has left (finished), asserting that no step admits a request or loads a
/// delta meanwhile.
fn step_until_gone(rig: &mut Rig, id: u64) {
    let mut guard = 0;
    while rig.s.contains(id) {
        let st = rig.step();
        assert!(new_ids(&st).is_empty(), "admitted {:?}", new_ids(&st));
        assert!(to_gpus(&st).is_empty(), "loaded {:?}", to_gpus(&st));
        guard += 1;
        assert!(guard < 50, "request {id} never finished");
    }
}

#[test]
fn with_gpu_load_reports_a_delta_is_loaded_beside_the_steps_before_its_requests_run() {
    let c = gcfg(2);
    let mut rig = Rig::new(&c, &[], &[1, 2]);
    rig.w.copy_steps = u32::MAX; // copies finish only when the test says so
    rig.add(req(1, 4, 30));
    assert_eq!(new_ids(&rig.step()), [1]);
    // Request 1 runs. 2 and 3 need delta 1, which is not even on the host: its read starts and
    // both are passed over (host deferrals); base request 4 behind them goes first.
    rig.add(areq(2, 4, 3, 1));
    rig.add(areq(3, 4, 3, 1));
    rig.add(req(4, 4, 30));
    let st = rig.step();
    assert_eq!(
        (ops(&st), new_ids(&st)),
        (vec!["to_host:1".to_string()], vec![4])
    );
    assert_eq!(rig.s.stats().host_deferrals, 2);
    assert_eq!(rig.s.stats().gpu_load_deferrals, 0);

    // The read is reported. The delta's copy goes out in this step, beside requests 1 and 4,
    // and neither 2 nor 3 is admitted: both wait for the copy, keeping their places.
    let st = rig.step();
    assert_eq!(ops(&st), ["to_gpu:1"]);
    assert!(new_ids(&st).is_empty(), "admitted {:?}", new_ids(&st));
    assert_eq!(st.running.len(), 2);
    let loaded = rig.s.adapter_residency(1).unwrap();
    assert_eq!(loaded.delta_slot, Some(0), "the slot is taken at once");
    assert_eq!(rig.s.stats().gpu_load_deferrals, 2, "2 and 3, one each");
    assert_eq!(rig.s.stats().adapter_gpu_loads, 1);
    assert_eq!(rig.s.stats().waiting, 2);
    assert!(rig.w.is_copying(1));

    // No report yet: they wait again, and no op is repeated.
    let st = rig.step();
    assert!(st.adapter_ops.is_empty() && new_ids(&st).is_empty());
    assert_eq!(rig.s.stats().gpu_load_deferrals, 4);

    // The copy finishes and is reported: reports of it again, of a delta not loading and of an
    // unknown id change nothing.
    rig.w.finish_copies(|_| true);
    let ready = rig.w.gpu_ready();
    assert_eq!(ready, [1]);
    assert_eq!(rig.s.gpu_copies_ready(&ready), 1);
    let before = rig.s.stats();
    assert_eq!(rig.s.gpu_copies_ready(&[1, 2, 99]), 0);
    assert_eq!(rig.s.stats(), before);
    rig.s.check_invariants().unwrap();

    // Both are admitted in the next step, with no second `to_gpu`.
    let st = rig.step();
    assert_eq!(new_ids(&st), [2, 3]);
    assert!(st.adapter_ops.is_empty(), "ops {:?}", ops(&st));
    assert_eq!(rig.s.stats().gpu_load_deferrals, 4);
    assert_eq!(rig.s.stats().adapter_gpu_loads, 1);
    assert_eq!(rig.w.copy_waits, 0, "no step waited for the copy");
    while rig.s.has_unfinished() {
        rig.step();
    }
    assert_eq!(rig.w.copy_waits, 0);
}

#[test]
fn with_gpu_load_reports_and_nothing_running_a_request_is_admitted_with_its_delta_copy() {
    let c = gcfg(2);
    let mut rig = Rig::new(&c, &[], &[1, 2]);
    rig.w.copy_steps = u32::MAX;
    // Nothing runs: the request goes out with its delta's read and copy, and that step waits
    // for both (there is nothing else to compute, and no report could come back otherwise).
    rig.add(areq(1, 4, 3, 1));
    let st = rig.step();
    assert_eq!(
        (ops(&st), new_ids(&st)),
        (
            vec!["to_host:1".to_string(), "to_gpu:1".to_string()],
            vec![1]
        )
    );
    assert_eq!((rig.w.read_waits, rig.w.copy_waits), (1, 1));
    assert_eq!(rig.s.stats().gpu_load_deferrals, 0);
    assert_eq!(
        rig.settled, 0,
        "the copy was never pending: its report settles nothing"
    );
    while rig.s.has_unfinished() {
        rig.step();
    }

    // A delta loaded ahead whose copy is still unreported once the requests that ran beside it
    // are gone: with nothing else to run its request is admitted (the step waits for the copy),
    // and the late report settles nothing.
    rig.add(req(2, 4, 3));
    assert_eq!(new_ids(&rig.step()), [2]);
    rig.add(areq(3, 4, 3, 2));
    assert_eq!(ops(&rig.step()), ["to_host:2"]);
    let st = rig.step();
    assert_eq!(
        (ops(&st), new_ids(&st)),
        (vec!["to_gpu:2".to_string()], vec![])
    );
    assert!(!rig.s.contains(2), "request 2 is done");
    let st = rig.step();
    assert_eq!(new_ids(&st), [3]);
    assert!(st.running.is_empty() && st.adapter_ops.is_empty());
    assert_eq!(rig.w.copy_waits, 2, "this step waited for the copy");
    assert_eq!(rig.s.stats().gpu_load_deferrals, 1);
    assert_eq!(rig.s.gpu_copies_ready(&[2]), 0);
    assert_eq!(rig.settled, 0);
    while rig.s.has_unfinished() {
        rig.step();
    }
}

#[test]
fn a_delta_loading_ahead_keeps_its_slot_while_requests_run_and_gives_it_up_when_none_do() {
    // One slot. Delta 1 is loaded ahead for request 2; request 3 (delta 2) then needs the slot.
    let c = gcfg(1);
    let mut rig = Rig::new(&c, &[], &[1, 2]);
    rig.w.copy_steps = u32::MAX;
    rig.add(req(1, 4, 30));
    rig.step();
    rig.add(areq(2, 4, 3, 1));
    rig.add(areq(3, 4, 3, 2));
    assert_eq!(ops(&rig.step()), ["to_host:1", "to_host:2"]);
    let st = rig.step();
    assert_eq!(
        ops(&st),
        ["to_gpu:1"],
        "delta 2 is not given delta 1's slot"
    );
    assert!(new_ids(&st).is_empty());
    let st = rig.step();
    assert!(st.adapter_ops.is_empty(), "ops {:?}", ops(&st));
    assert!(rig.s.adapter_residency(1).unwrap().delta_slot.is_some());
    assert!(rig.s.adapter_residency(2).unwrap().delta_slot.is_none());

    // The copy is reported: 2 runs on delta 1, 3 waits for the slot until 2 is done, and then
    // delta 2 is loaded ahead in its place (delta 1 idle and copied: evictable).
    rig.w.finish_copies(|_| true);
    let ready = rig.w.gpu_ready();
    assert_eq!(rig.s.gpu_copies_ready(&ready), 1);
    assert_eq!(new_ids(&rig.step()), [2]);
    step_until_gone(&mut rig, 2);
    let st = rig.step();
    assert_eq!(ops(&st), ["drop_gpu:1", "to_gpu:2"]);
    assert!(new_ids(&st).is_empty());

    // Delta 2 is loading and its request is aborted; request 4 (delta 1) cannot have the slot
    // while request 1 runs. Once nothing runs, the loading delta gives the slot up: the queue's
    // head must not wait for a report that only a step sent could bring.
    rig.s.abort(3);
    rig.add(areq(4, 4, 3, 1));
    let st = rig.step();
    assert!(st.adapter_ops.is_empty() && new_ids(&st).is_empty());
    rig.s.finish(1);
    let st = rig.step();
    assert_eq!(new_ids(&st), [4]);
    assert_eq!(ops(&st), ["drop_gpu:2", "to_gpu:1"]);
    assert!(
        rig.w.copying.is_empty(),
        "the dropped copy was not waited for"
    );
    rig.w.copy_steps = 1;
    while rig.s.has_unfinished() {
        rig.step();
    }
}

/// [`dcfg`] (4-token pages, a 64-token budget) with 64 pages, 2 delta slots and the worker's
/// delta graphs up to `limit` tokens.
fn limit_cfg(limit: usize) -> SchedulerConfig {
    SchedulerConfig {
        delta_graph_tokens: limit,
        ..dcfg(64, 2)
    }
}

/// Each scheduled request's tokens this step: `(id, tokens)`, new ones first.
fn chunks(st: &ScheduledStep) -> Vec<(u64, u32)> {
    let new = st.new.iter().map(|n| (n.id, n.num_scheduled_tokens));
    new.chain(st.running.iter().map(|r| (r.id, r.num_scheduled_tokens)))
        .collect()
}

#[test]
fn with_a_delta_graph_limit_a_delta_prompt_is_chunked_to_fit_beside_the_decodes() {
    let mut rig = Rig::new(&limit_cfg(16), &[], &[1]);
    rig.add(areq(1, 4, 20, 1));
    assert_eq!(chunks(&rig.step()), [(1, 4)]);
    // A 30-token prompt of the same delta: 15 tokens beside request 1's decode, then 15 more.
    rig.add(areq(2, 30, 3, 1));
    let st = rig.step();
    assert_eq!(chunks(&st), [(2, 15), (1, 1)]);
    assert_eq!(st.num_scheduled_tokens(), 16);
    assert_eq!(chunks(&rig.step()), [(1, 1), (2, 15)]);
    assert_eq!(chunks(&rig.step()), [(1, 1), (2, 1)]);
    // Without the limit the whole prompt goes at once (31 tokens, within the 64-token budget).
    let mut off = Rig::new(&limit_cfg(0), &[], &[1]);
    off.add(areq(1, 4, 20, 1));
    off.step();
    off.add(areq(2, 30, 3, 1));
    assert_eq!(chunks(&off.step()), [(2, 30), (1, 1)]);
    for r in [&mut rig, &mut off] {
        while r.s.has_unfinished() {
            r.step();
        }
    }
}

#[test]
fn the_delta_graph_limit_holds_base_prompts_only_in_steps_with_delta_rows() {
    let mut rig = Rig::new(&limit_cfg(16), &[], &[1]);
    // No delta row: a base prompt takes the whole budget.
    rig.add(req(1, 40, 20));
    assert_eq!(chunks(&rig.step()), [(1, 40)]);
    // A delta prompt behind a step already past the limit waits: admitting it would make the
    // step run eagerly. The next step takes it within the limit beside the two decodes.
    rig.add(req(2, 20, 3));
    rig.add(areq(3, 30, 3, 1));
    assert_eq!(chunks(&rig.step()), [(2, 20), (1, 1)]);
    assert_eq!(chunks(&rig.step()), [(3, 14), (1, 1), (2, 1)]);
    // With the delta running, a base prompt shares the limit too.
    rig.add(req(4, 30, 3));
    assert_eq!(chunks(&rig.step()), [(1, 1), (2, 1), (3, 14)]);
    while rig.s.has_unfinished() {
        rig.step();
    }
}

#[test]
fn when_the_decodes_alone_pass_the_delta_graph_limit_prompts_are_not_held_back() {
    // Graphs up to 2 tokens: two one-token prompts fill the first step; then the decodes alone
    // reach the limit (every step runs eagerly), and holding prompts back would only starve them.
    let mut rig = Rig::new(&limit_cfg(2), &[], &[1]);
    for id in 1..=3 {
        rig.add(areq(id, 1, 20, 1));
    }
    assert_eq!(new_ids(&rig.step()), [1, 2]);
    assert_eq!(new_ids(&rig.step()), [3]);
    rig.add(areq(4, 10, 3, 1));
    let st = rig.step();
    assert_eq!(new_ids(&st), [4]);
    assert_eq!(st.num_scheduled_tokens(), 13);
    while rig.s.has_unfinished() {
        rig.step();
    }
}
