//! Scenario tests of LoRA adapters in the scheduler: registration, the unified page pool
//! (adapter pages next to KV pages, LRU eviction of idle adapters), the host tier (budget, LRU
//! drops, drops before loads), prefetch, unregistering, worker resets and grouping by adapter.
//! Every plan also goes through the fake worker in `common`, which checks the worker contract.

mod common;

use common::{adapter, areq, cfg, req, run_to_completion, sample_token, FakeWorker};
use deltaserve_sched::{
    ScheduledStep, Scheduler, SchedulerConfig, SeqRequest, VariantOpKind, VariantSpec,
};

/// A config with the host tier given (host budget in bytes, prefetch window).
fn acfg(block_size: u32, num_blocks: u32, host: u64, window: usize) -> SchedulerConfig {
    SchedulerConfig {
        host_adapter_bytes: host,
        prefetch_window: window,
        ..cfg(block_size, num_blocks, 8, 64, 128)
    }
}

/// A scheduler and fake worker with adapters `ids` registered, each `pages` pages and
/// `bytes` host bytes.
fn setup(c: &SchedulerConfig, ids: &[u32], pages: u32, bytes: u64) -> (Scheduler, FakeWorker) {
    let mut s = Scheduler::new(c.clone()).unwrap();
    let mut w = FakeWorker::new(c.clone());
    for &id in ids {
        let spec = adapter(id, 0, pages, bytes);
        w.put_on_disk(id, &spec);
        s.register_adapter(id, spec).unwrap();
    }
    (s, w)
}

/// The step's adapter ops as `"kind:id"` labels, in order.
fn ops(st: &ScheduledStep) -> Vec<String> {
    st.adapter_ops
        .iter()
        .map(|o| format!("{}:{}", o.op_name(), o.adapter_id))
        .collect()
}

/// Schedules one step, runs it on the worker and applies the outputs; returns the step.
fn step(s: &mut Scheduler, w: &mut FakeWorker) -> ScheduledStep {
    let st = s.schedule();
    assert!(!st.is_empty(), "expected work: {:?}", s.stats());
    s.update(&w.run(&st, &mut sample_token));
    s.check_invariants().unwrap();
    st
}

#[test]
fn registration_errors_change_nothing() {
    let c = acfg(4, 16, 100, 64);
    let (mut s, mut w) = setup(&c, &[1], 2, 10);
    s.add_request(areq(1, 4, 3, 1)).unwrap();
    let before = s.clone();

    let bad: Vec<(u32, VariantSpec, &str, &[&str])> = vec![
        (0, adapter(0, 0, 1, 1), "invalid_adapter", &["id 0"]),
        (1, adapter(1, 1, 1, 1), "duplicate_adapter", &["adapter 1"]),
        (
            2,
            adapter(2, 0, 17, 1),
            "adapter_too_big",
            &["adapter 2", "17", "16"],
        ),
        (
            3,
            adapter(3, 0, 1, 101),
            "adapter_too_big",
            &["adapter 3", "101", "100"],
        ),
        (
            4,
            adapter(4, 0, 0, 1),
            "invalid_adapter",
            &["adapter 4", "num_blocks"],
        ),
        (
            5,
            VariantSpec {
                path: String::new(),
                ..adapter(5, 0, 1, 1)
            },
            "invalid_adapter",
            &["adapter 5", "path"],
        ),
    ];
    for (id, spec, kind, words) in bad {
        let err = s.register_adapter(id, spec).unwrap_err();
        assert_eq!(err.error_type(), kind, "adapter {id}: {err}");
        for word in words {
            assert!(err.to_string().contains(word), "{err} should name {word}");
        }
    }
    // The boundaries are accepted: the whole pool, the whole host budget.
    let mut edge = Scheduler::new(c.clone()).unwrap();
    edge.register_adapter(9, adapter(9, 0, 16, 100)).unwrap();

    // Requests naming an unknown adapter, or too big with theirs, are refused by name.
    let err = s.add_request(areq(7, 4, 3, 5)).unwrap_err();
    assert_eq!(err.error_type(), "unknown_adapter");
    assert_eq!(err.to_string(), "request 7: adapter 5 is not registered");
    // 50 + 12 - 1 = 61 cached tokens = 16 pages: fits alone, not with adapter 1's 2 pages.
    let err = s.add_request(areq(8, 50, 12, 1)).unwrap_err();
    assert_eq!(err.error_type(), "kv_pool_too_small");
    assert!(
        err.to_string().contains("+ 2 pages for its adapter"),
        "{err}"
    );
    let err = s.unregister_adapter(6).unwrap_err();
    assert_eq!(err.error_type(), "unknown_adapter");
    assert_eq!(err.to_string(), "adapter 6 is not registered");

    assert_eq!(s.stats(), before.stats());
    assert_eq!(s.adapter_users(1), 1);
    s.check_invariants().unwrap();
    // Same future as if the bad calls never happened.
    let mut twin = before;
    let st = s.schedule();
    assert_eq!(st, twin.schedule());
    s.update(&w.run(&st, &mut sample_token));
    let mut base = Scheduler::new(c).unwrap();
    base.add_request(req(8, 50, 12)).unwrap();
}

#[test]
fn a_cold_adapter_loads_to_host_then_gpu_and_a_warm_one_needs_no_ops() {
    let c = acfg(4, 16, 100, 0);
    let (mut s, mut w) = setup(&c, &[1], 2, 10);
    s.add_request(areq(1, 4, 2, 1)).unwrap();
    let st = step(&mut s, &mut w);
    assert_eq!(ops(&st), ["to_host:1", "to_gpu:1"]);
    assert_eq!(
        st.adapter_ops[0].kind,
        VariantOpKind::ToHost {
            path: "/adapters/1/v0".to_string()
        }
    );
    assert_eq!(
        st.adapter_ops[1].kind,
        VariantOpKind::ToGpu {
            block_ids: vec![0, 1],
            slot: None
        }
    );
    assert_eq!(st.new[0].adapter_id, 1);
    assert_eq!(
        st.new[0].block_ids,
        vec![2],
        "KV pages come from the same pool"
    );
    let stats = s.stats();
    assert_eq!(
        (stats.adapter_blocks, stats.used_blocks, stats.free_blocks),
        (2, 1, 13)
    );
    assert_eq!((stats.adapters_on_gpu, stats.adapters_on_host), (1, 1));
    assert_eq!(stats.host_adapter_bytes, 10);

    // Decoding with it, then a second request for it: no op at all.
    let st = step(&mut s, &mut w);
    assert!(st.adapter_ops.is_empty());
    s.add_request(areq(2, 4, 2, 1)).unwrap();
    let st = step(&mut s, &mut w);
    assert!(st.adapter_ops.is_empty(), "warm: {:?}", ops(&st));
    assert_eq!(st.new[0].adapter_id, 1);
    run_to_completion(&mut s, &mut w, 20);
    let stats = s.stats();
    assert_eq!(
        (stats.adapter_gpu_loads, stats.adapter_host_loads),
        (1, 1),
        "loaded once"
    );
    assert_eq!(stats.used_blocks, 0);
    assert_eq!(stats.adapter_blocks, 2, "it stays cached with no user");
    assert!(w.adapter_tokens > 0);
}

#[test]
fn idle_adapters_are_evicted_lru_first_when_requests_need_pages_never_one_in_use() {
    // 4-token pages, 8 pages; adapters of 2 pages each.
    let c = acfg(4, 8, 100, 0);
    let (mut s, mut w) = setup(&c, &[1, 2, 3], 2, 10);
    // Adapter 1 is used and goes idle, then adapter 2: both cached, 1 least recently used.
    s.add_request(areq(1, 4, 1, 1)).unwrap();
    step(&mut s, &mut w);
    s.add_request(areq(2, 4, 1, 2)).unwrap();
    step(&mut s, &mut w);
    // Request 3 keeps adapter 3 in use: 2 adapter pages + 1 KV page; 1 page left.
    s.add_request(areq(3, 4, 20, 3)).unwrap();
    let st = step(&mut s, &mut w);
    assert_eq!(ops(&st), ["to_host:3", "to_gpu:3"]);
    assert_eq!(s.stats().free_blocks, 1);
    // Request 3's next token takes the last free page; request 4 needs 2 pages: adapter 1 (the
    // least recently used idle one) goes, adapter 2 stays.
    s.add_request(req(4, 5, 1)).unwrap();
    let a1_pages = s.adapter_residency(1).unwrap().gpu_blocks.unwrap().to_vec();
    let st = step(&mut s, &mut w);
    assert_eq!(ops(&st), ["drop_gpu:1"]);
    assert_eq!(
        st.new[0].block_ids, a1_pages,
        "its pages hold request 4's KV"
    );
    let r1 = s.adapter_residency(1).unwrap();
    assert!(
        r1.gpu_blocks.is_none() && r1.on_host,
        "only the GPU copy went"
    );
    assert!(s.adapter_residency(2).unwrap().gpu_blocks.is_some());
    // Request 5 needs 3 pages: request 4's 2 came back, adapter 2 goes too.
    s.add_request(req(5, 9, 1)).unwrap();
    let st = step(&mut s, &mut w);
    assert_eq!(ops(&st), ["drop_gpu:2"]);
    assert_eq!(st.new[0].id, 5);
    // Request 6 needs 5 pages; only adapter 3 is left, and request 3 runs with it: 6 waits.
    s.add_request(req(6, 17, 1)).unwrap();
    let st = step(&mut s, &mut w);
    assert!(st.adapter_ops.is_empty());
    assert!(st.new.is_empty(), "request 6 waits; adapter 3 is in use");
    assert!(s.adapter_residency(3).unwrap().gpu_blocks.is_some());
    assert_eq!(s.stats().adapter_gpu_evictions, 2);
    assert_eq!(s.stats().num_preemptions, 0);
    run_to_completion(&mut s, &mut w, 100);
}

#[test]
fn running_requests_evict_idle_adapters_before_preempting_anybody() {
    // 2-token pages, 8 pages. Adapter 1 (2 pages) is cached idle; then requests 2 and 3 (base,
    // up to 5 and 4 pages) grow one token per step until the 6 other pages run out.
    let c = acfg(2, 8, 100, 0);
    let (mut s, mut w) = setup(&c, &[1], 2, 10);
    s.add_request(areq(1, 2, 1, 1)).unwrap();
    step(&mut s, &mut w);
    s.add_request(req(2, 4, 6)).unwrap();
    s.add_request(req(3, 2, 6)).unwrap();
    let mut evicted_at = None;
    let mut preempted_at = None;
    for _ in 0..40 {
        if !s.has_unfinished() {
            break;
        }
        let st = step(&mut s, &mut w);
        if ops(&st) == ["drop_gpu:1"] {
            assert!(st.new.is_empty(), "evicted for a running request");
            evicted_at.get_or_insert(st.step_id);
        }
        if !st.preempted.is_empty() {
            preempted_at.get_or_insert(st.step_id);
        }
    }
    assert!(!s.has_unfinished());
    let evicted = evicted_at.expect("the idle adapter makes room");
    // 5 + 4 pages do not fit in 8 either: preemption comes, but only after the eviction.
    let p = preempted_at.expect("the two requests outgrow the pool");
    assert!(
        p > evicted,
        "preempted at step {p} before evicting at {evicted}"
    );
    assert_eq!(s.stats().adapter_gpu_evictions, 1);
    assert_eq!(s.stats().free_blocks, 8);
}

#[test]
fn the_host_budget_holds_with_lru_drops_before_loads() {
    // 25 bytes of host tier, adapters of 10 bytes: at most 2 host copies.
    let c = acfg(4, 32, 25, 0);
    let (mut s, mut w) = setup(&c, &[1, 2, 3, 4, 5, 6], 1, 10);
    for (id, a) in [(1, 1), (2, 2)] {
        s.add_request(areq(id, 4, 1, a)).unwrap();
        step(&mut s, &mut w);
    }
    assert_eq!(s.stats().host_adapter_bytes, 20);
    // Adapter 3 needs host room: adapter 1's host copy (LRU) is dropped, its GPU copy stays.
    s.add_request(areq(3, 4, 1, 3)).unwrap();
    let st = step(&mut s, &mut w);
    assert_eq!(ops(&st), ["drop_host:1", "to_host:3", "to_gpu:3"]);
    let r1 = s.adapter_residency(1).unwrap();
    assert!(!r1.on_host && r1.gpu_blocks.is_some());
    assert_eq!(s.stats().host_adapter_bytes, 20);

    // Three admissions in one step, each needing host room. The copies loaded onto the GPU in
    // this step are needed by it, so adapter 6 does not fit until the next step; every drop
    // goes out before every load.
    for (id, a) in [(4, 4), (5, 5), (6, 6)] {
        s.add_request(areq(id, 4, 3, a)).unwrap();
    }
    let st = step(&mut s, &mut w);
    assert_eq!(
        ops(&st),
        [
            "drop_host:2",
            "drop_host:3",
            "to_host:4",
            "to_gpu:4",
            "to_host:5",
            "to_gpu:5"
        ]
    );
    assert_eq!(st.new.iter().map(|n| n.id).collect::<Vec<_>>(), [4, 5]);
    let st = step(&mut s, &mut w);
    assert_eq!(ops(&st), ["drop_host:4", "to_host:6", "to_gpu:6"]);
    assert_eq!(st.new[0].id, 6);
    assert!(s.stats().host_adapter_bytes <= 25);
    run_to_completion(&mut s, &mut w, 50);
}

#[test]
fn prefetch_loads_queued_adapters_to_host_ahead_of_admission() {
    // One request runs at a time; the next two in the queue are prefetched.
    let c = SchedulerConfig {
        max_num_seqs: 1,
        ..acfg(4, 16, 100, 2)
    };
    let (mut s, mut w) = setup(&c, &[1, 2, 3, 4], 1, 10);
    for (id, a) in [(1, 1), (2, 2), (3, 2), (4, 3), (5, 4)] {
        s.add_request(areq(id, 4, 2, a)).unwrap();
    }
    let st = step(&mut s, &mut w);
    assert_eq!(
        ops(&st),
        ["to_host:1", "to_gpu:1", "to_host:2"],
        "window = requests 2 and 3, both adapter 2"
    );
    // Request 1 decodes; the window is unchanged.
    let st = step(&mut s, &mut w);
    assert!(st.adapter_ops.is_empty());
    // Request 2 is admitted from its host copy; the window moves to requests 3 and 4.
    let st = step(&mut s, &mut w);
    assert_eq!(ops(&st), ["to_gpu:2", "to_host:3"]);
    assert_eq!(s.stats().adapter_host_loads, 3);

    // With no window, nothing is loaded ahead.
    let c0 = SchedulerConfig {
        prefetch_window: 0,
        ..c.clone()
    };
    let (mut s, mut w) = setup(&c0, &[1, 2], 1, 10);
    s.add_request(areq(1, 4, 2, 1)).unwrap();
    s.add_request(areq(2, 4, 2, 2)).unwrap();
    assert_eq!(ops(&step(&mut s, &mut w)), ["to_host:1", "to_gpu:1"]);
}

#[test]
fn with_host_copy_reports_a_request_waits_for_its_read_without_stalling_the_step() {
    // Three running slots; adapter 2 is cold. Reads finish only when the test reports them.
    let c = SchedulerConfig {
        max_num_seqs: 3,
        host_copy_reports: true,
        ..acfg(4, 32, 100, 4)
    };
    let (mut s, mut w) = setup(&c, &[1, 2], 1, 10);
    let ids = |st: &ScheduledStep| st.new.iter().map(|n| n.id).collect::<Vec<_>>();
    // Nothing runs: a cold adapter's request is admitted at once (the worker waits for its
    // read, as there is nothing else to compute; and no report could come back otherwise).
    s.add_request(areq(1, 4, 20, 1)).unwrap();
    let st = step(&mut s, &mut w);
    assert_eq!(
        (ops(&st), ids(&st)),
        (vec!["to_host:1".into(), "to_gpu:1".into()], vec![1])
    );
    assert_eq!(w.read_waits, 1);

    // Request 1 runs. Request 2's adapter is cold: its read starts and it is passed over, and
    // base request 3 behind it is admitted in its place.
    s.add_request(areq(2, 4, 3, 2)).unwrap();
    s.add_request(req(3, 4, 20)).unwrap();
    let st = step(&mut s, &mut w);
    assert_eq!((ops(&st), ids(&st)), (vec!["to_host:2".into()], vec![3]));
    assert_eq!(s.stats().host_deferrals, 1);
    assert_eq!(s.stats().waiting, 1);
    // No report yet: it waits again (no op repeated), the step computes the others.
    let st = step(&mut s, &mut w);
    assert!(st.adapter_ops.is_empty() && st.new.is_empty());
    assert_eq!(s.stats().host_deferrals, 2);
    // The read finishes. Request 4 arrives for the last slot, but 2 kept its place.
    let done = w.finish_reads(|_| true);
    assert_eq!(done, [2]);
    assert_eq!(s.host_copies_ready(&done), 1);
    assert_eq!(
        s.host_copies_ready(&[2, 1, 99]),
        0,
        "stale and unknown reports change nothing"
    );
    s.add_request(req(4, 4, 3)).unwrap();
    let st = step(&mut s, &mut w);
    assert_eq!((ops(&st), ids(&st)), (vec!["to_gpu:2".into()], vec![2]));
    assert_eq!(
        w.read_waits, 1,
        "no step with running requests waited for a read"
    );
    run_to_completion(&mut s, &mut w, 100);

    // A read dropped before it is reported: the stale report does not count a later read.
    let (mut s, mut w) = setup(&c, &[2, 3], 1, 60);
    s.add_request(req(1, 4, 20)).unwrap();
    step(&mut s, &mut w);
    s.add_request(areq(2, 4, 3, 2)).unwrap();
    let st = step(&mut s, &mut w);
    assert_eq!(ops(&st), ["to_host:2"]);
    s.abort(2);
    s.add_request(areq(3, 4, 3, 3)).unwrap();
    let st = step(&mut s, &mut w);
    assert_eq!(
        ops(&st),
        ["drop_host:2", "to_host:3"],
        "budget 100 holds one 60-byte copy: 2's read is dropped unreported"
    );
    assert_eq!(s.host_copies_ready(&[2]), 0);
    assert_eq!(s.stats().waiting, 1);
}

#[test]
fn prefetch_never_drops_what_the_step_or_the_window_needs() {
    // 20 bytes of host tier, adapters of 10 bytes; one request at a time, window 2.
    let c = SchedulerConfig {
        max_num_seqs: 1,
        ..acfg(4, 16, 20, 2)
    };
    let (mut s, mut w) = setup(&c, &[1, 2, 3], 1, 10);
    for (id, a) in [(1, 1), (2, 2), (3, 3)] {
        s.add_request(areq(id, 4, 3, a)).unwrap();
    }
    // Adapter 1 is loaded to the GPU this step, 2 fits; 3 would need 1's or 2's host copy.
    let st = step(&mut s, &mut w);
    assert_eq!(ops(&st), ["to_host:1", "to_gpu:1", "to_host:2"]);
    // Next step adapter 1's host copy is neither needed by the step nor in the window.
    let st = step(&mut s, &mut w);
    assert_eq!(ops(&st), ["drop_host:1", "to_host:3"]);
    assert!(s.adapter_residency(1).unwrap().gpu_blocks.is_some());
    run_to_completion(&mut s, &mut w, 50);
}

#[test]
fn unregister_is_refused_while_used_and_its_drops_go_out_with_the_next_step() {
    let c = acfg(4, 16, 100, 0);
    let (mut s, mut w) = setup(&c, &[1], 2, 10);
    s.add_request(areq(1, 4, 2, 1)).unwrap();
    let err = s.unregister_adapter(1).unwrap_err();
    assert_eq!(err.error_type(), "adapter_in_use", "waiting user: {err}");
    assert!(err.to_string().contains("1 live request"), "{err}");
    step(&mut s, &mut w);
    let before = s.stats();
    assert_eq!(
        s.unregister_adapter(1).unwrap_err().error_type(),
        "adapter_in_use",
        "running user"
    );
    assert_eq!(s.stats(), before);
    run_to_completion(&mut s, &mut w, 20);
    assert_eq!(s.adapter_users(1), 0);
    assert_eq!(s.stats().free_blocks, 14);

    s.unregister_adapter(1).unwrap();
    assert_eq!(s.stats().free_blocks, 16, "its pages are free at once");
    assert_eq!(s.stats().adapters_registered, 0);
    assert_eq!(s.stats().host_adapter_bytes, 0);
    assert!(s.adapter_residency(1).is_none());
    s.check_invariants().unwrap();
    // An empty step keeps the drops; the next non-empty step sends them first, then loads
    // (here of a new adapter registered under the same id).
    assert!(s.schedule().is_empty());
    let spec = adapter(1, 1, 1, 10);
    w.put_on_disk(1, &spec);
    s.register_adapter(1, spec).unwrap();
    s.add_request(areq(2, 4, 2, 1)).unwrap();
    let st = step(&mut s, &mut w);
    assert_eq!(
        ops(&st),
        ["drop_gpu:1", "drop_host:1", "to_host:1", "to_gpu:1"]
    );
    assert_eq!(
        st.adapter_ops[2].kind,
        VariantOpKind::ToHost {
            path: "/adapters/1/v1".to_string()
        }
    );
    run_to_completion(&mut s, &mut w, 20);
}

#[test]
fn reset_worker_forgets_every_adapter_copy() {
    let c = acfg(4, 16, 100, 0);
    let (mut s, mut w) = setup(&c, &[1, 2], 2, 10);
    s.add_request(areq(1, 4, 1, 2)).unwrap();
    step(&mut s, &mut w);
    s.add_request(areq(2, 4, 10, 1)).unwrap();
    step(&mut s, &mut w);
    // Adapter 2 is idle: unregistering queues its drops, which the reset makes moot.
    s.unregister_adapter(2).unwrap();
    assert_eq!(s.reset_worker(), vec![2]);
    let st = s.stats();
    assert_eq!(
        (
            st.adapters_on_gpu,
            st.adapters_on_host,
            st.adapter_blocks,
            st.host_adapter_bytes
        ),
        (0, 0, 0, 0)
    );
    assert_eq!(st.free_blocks, 16);
    assert_eq!(st.adapters_registered, 1);
    assert_eq!(s.adapter_users(1), 1);
    let r = s.adapter_residency(1).unwrap();
    assert!(!r.on_host && r.gpu_blocks.is_none());
    s.check_invariants().unwrap();
    w.reset();
    let st = step(&mut s, &mut w);
    assert_eq!(
        ops(&st),
        ["to_host:1", "to_gpu:1"],
        "loaded again from disk"
    );
    assert!(st.released.is_empty());
    run_to_completion(&mut s, &mut w, 50);
}

#[test]
fn steps_group_requests_by_adapter_in_arrival_order() {
    // 1-token prompts, budget 3: requests 1..3 are admitted first, 4 and 5 once they end.
    let c = SchedulerConfig {
        max_num_batched_tokens: 3,
        ..acfg(4, 32, 100, 64)
    };
    let (mut s, mut w) = setup(&c, &[1, 2], 1, 10);
    for (id, a) in [(1, 2), (2, 0), (3, 1), (4, 2), (5, 1)] {
        s.add_request(SeqRequest {
            adapter_id: a,
            ..req(id, 1, 2)
        })
        .unwrap();
    }
    let st = step(&mut s, &mut w);
    let new: Vec<(u32, u64)> = st.new.iter().map(|n| (n.adapter_id, n.id)).collect();
    assert_eq!(new, [(0, 2), (1, 3), (2, 1)]);
    let st = step(&mut s, &mut w);
    assert_eq!(
        st.running.iter().map(|r| r.id).collect::<Vec<_>>(),
        [2, 3, 1],
        "running diffs are grouped the same way"
    );
    let st = step(&mut s, &mut w);
    let new: Vec<(u32, u64)> = st.new.iter().map(|n| (n.adapter_id, n.id)).collect();
    assert_eq!(new, [(1, 5), (2, 4)]);
    // Two requests of one adapter keep their arrival order.
    let (mut s, mut w) = setup(&c, &[1], 1, 10);
    for id in [7, 8, 9] {
        s.add_request(SeqRequest {
            adapter_id: if id == 8 { 0 } else { 1 },
            ..req(id, 1, 2)
        })
        .unwrap();
    }
    let st = step(&mut s, &mut w);
    assert_eq!(st.new.iter().map(|n| n.id).collect::<Vec<_>>(), [8, 7, 9]);
}
