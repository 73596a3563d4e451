//! The randomized test of compressed deltas (DeltaZip) in the scheduler: a mix of base, LoRA and
//! delta requests with aborts, worker resets and lost outputs, every invariant checked after every
//! operation, and every request finishing in the drain, with and without the worker's reports of
//! host reads and of delta copies beside the steps. The fake worker in `common` checks every plan
//! it applies (no more than `max_deltas` deltas on the GPU, each in a free slot the plan names; no
//! step with running requests waits for a read or a copy). The scenario tests are in `deltas.rs`.

mod common;

use std::collections::BTreeMap;

use common::{adapter, cfg, delta, FakeWorker, Rng};
use deltaserve_sched::{FinishReason, Scheduler, SchedulerConfig, SeqRequest, VariantSpec};

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
    /// Waiting requests passed over for a delta copy beside the steps (`gpu_load_reports`).
    gpu_load_deferrals: u64,
    /// Loads ahead settled by the worker's reports.
    copies_settled: u64,
    /// Steps that waited for a delta copy (only with nothing else running; the fake worker
    /// checks that).
    copy_waits: u64,
}

/// LoRA adapters are ids 1..=3, deltas 4..=7 (0 = base).
const LORAS: [u32; 3] = [1, 2, 3];
const DELTAS: [u32; 4] = [4, 5, 6, 7];

/// One random scenario: adds (base, LoRA and delta requests), aborts, finishes, worker resets,
/// lost outputs and steps; every invariant after every operation; then a drain in which every
/// request must finish. The seed also picks, without drawing from the stream, whether the
/// worker reports host reads and delta copies (as the router runs it: both; or one, or none),
/// how many steps a delta copy takes, and the worker's delta graph limit (none, 3 or 12 tokens).
fn scenario(seed: u64, ops: usize, cov: &mut Coverage) {
    let mut rng = Rng(seed);
    let bs = rng.range(1, 4) as u32;
    let c = SchedulerConfig {
        host_copy_reports: seed % 4 >= 2,
        gpu_load_reports: seed % 2 == 1,
        delta_graph_tokens: [0, 3, 12][(seed / 12 % 3) as usize],
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
    w.copy_steps = 1 + (seed / 4 % 3) as u32;
    let mut specs: BTreeMap<u32, VariantSpec> = BTreeMap::new();
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
        // The worker reports the reads (all done after one step here) and the copies finished.
        let read = w.finish_reads(|_| true);
        s.host_copies_ready(&read);
        let copied = w.gpu_ready();
        let settled = s.gpu_copies_ready(&copied);
        assert!(settled <= copied.len());
        cov.copies_settled += settled as u64;
        let after = s.stats();
        cov.skips += after.delta_skips - before.delta_skips;
        let skip_preempted = after.delta_skip_preemptions - before.delta_skip_preemptions;
        cov.skip_preemptions += skip_preempted;
        cov.memory_preemptions += st.preempted.len() as u64 - skip_preempted;
        cov.full_slots += u64::from(after.deltas_on_gpu == c.max_deltas);
        cov.gpu_load_deferrals += after.gpu_load_deferrals - before.gpu_load_deferrals;
        if !c.gpu_load_reports {
            assert_eq!(
                after.gpu_load_deferrals, 0,
                "seed {seed}: deferred without reports"
            );
        }
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
                skip_prefix_cache: false,
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
    cov.copy_waits += w.copy_waits;
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
    assert!(
        cov.gpu_load_deferrals > 0 && cov.copies_settled > 0 && cov.copy_waits > 0,
        "deltas loaded ahead, reported, and waited for with nothing else running: {cov:?}"
    );
}
