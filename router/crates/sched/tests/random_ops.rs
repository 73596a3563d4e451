//! Property-style test: seeded random sequences of add / abort / finish / schedule / update /
//! lost outputs / worker resets / adapter registration and unregistration, over many pool
//! shapes, adapter mixes and host budgets, with and without host copy reports (host reads that
//! finish at random steps later; a step with running requests never waits for one). After every operation the scheduler's invariants
//! must hold; every plan must satisfy the fake worker's contract checks (pages never shared
//! between requests and adapters on the worker, chunks contiguous and covered, budget and
//! max_num_seqs respected, adapter ops legal and in drops-then-loads order, host bytes within
//! budget after every op, every scheduled request's adapter on the GPU, resumed requests carry
//! exactly prompt ++ their outputs); after every step the worker's tiers equal the scheduler's
//! accounting; every request ends exactly once, with a consistent reason; and at the end the
//! pool holds nothing but cached adapters.

mod common;

use std::collections::BTreeMap;

use common::{adapter, cfg, FakeWorker, Rng};
use deltaserve_sched::{
    FinishReason, ScheduledStep, Scheduler, SchedulerConfig, SeqRequest, VariantSpec,
};

const EOS: u32 = 0;
/// Adapter ids drawn by the scenarios are `0..=MAX_ADAPTER` (0 and unregistered ones included).
const MAX_ADAPTER: u32 = 12;

/// What the test knows about one accepted request.
struct Truth {
    prompt: Vec<u32>,
    outputs: Vec<u32>,
    max_tokens: u32,
    ignore_eos: bool,
    adapter_id: u32,
}

/// What the scenarios add up, to show they exercise every path.
#[derive(Default)]
struct Coverage {
    preemptions: usize,
    /// Worker op counts: to_host, to_gpu, drop_gpu, drop_host.
    ops: [u64; 4],
    /// Tokens computed for adapter requests.
    adapter_tokens: u64,
    /// Adapter requests that ended by length / EOS.
    adapter_finished: u64,
    /// Waiting requests passed over for a host read (scheduler stats).
    host_deferrals: u64,
    /// `to_gpu`s that waited for a read (allowed only with nothing running).
    read_waits: u64,
}

/// A random adapter spec; sometimes too big for the pool or the host budget.
fn random_spec(rng: &mut Rng, c: &SchedulerConfig, id: u32, generation: u32) -> VariantSpec {
    let pages = if rng.pct(5) {
        c.num_blocks + 1
    } else {
        rng.range(1, (c.num_blocks as u64 / 3).clamp(1, 4)) as u32
    };
    let bytes = if rng.pct(5) {
        c.host_adapter_bytes + 1
    } else {
        rng.range(1, c.host_adapter_bytes)
    };
    adapter(id, generation, pages, bytes)
}

/// Runs one random scenario and returns its plans (for the determinism check).
fn scenario(seed: u64, ops: usize, cov: &mut Coverage) -> Vec<ScheduledStep> {
    let mut rng = Rng(seed);
    let bs = rng.range(1, 8) as u32;
    let mut c: SchedulerConfig = cfg(
        bs,
        rng.range(2, 40) as u32,
        rng.range(1, 8) as usize,
        rng.range(1, 48) as usize,
        rng.range(8, 96) as u32,
    );
    // A host tier that holds a few adapters at most, and a short (sometimes no) prefetch.
    c.host_adapter_bytes = rng.range(8, 40);
    c.prefetch_window = rng.range(0, 6) as usize;
    c.host_copy_reports = rng.pct(50);
    let mut s = Scheduler::new(c.clone()).unwrap();
    let mut w = FakeWorker::new(c.clone());
    // Registered adapters as the test knows them, and a generation counter for unique paths.
    let mut registered: BTreeMap<u32, VariantSpec> = BTreeMap::new();
    let mut generation = 0u32;
    let mut register = |s: &mut Scheduler,
                        w: &mut FakeWorker,
                        registered: &mut BTreeMap<u32, VariantSpec>,
                        rng: &mut Rng,
                        id: u32| {
        generation += 1;
        let spec = random_spec(rng, &c, id, generation);
        let ok = id != 0
            && !registered.contains_key(&id)
            && spec.num_blocks <= c.num_blocks
            && spec.host_bytes <= c.host_adapter_bytes;
        let before = s.stats();
        match s.register_adapter(id, spec.clone()) {
            Ok(()) => {
                assert!(ok, "seed {seed}: accepted adapter {id} {spec:?}");
                w.put_on_disk(id, &spec);
                registered.insert(id, spec);
            }
            Err(e) => {
                assert!(!ok, "seed {seed}: refused adapter {id} {spec:?}: {e}");
                assert_eq!(
                    s.stats(),
                    before,
                    "a refused registration changed the state"
                );
            }
        }
    };
    for id in 1..=rng.range(0, MAX_ADAPTER as u64 - 2) as u32 {
        register(&mut s, &mut w, &mut registered, &mut rng, id);
    }
    let mut live: BTreeMap<u64, Truth> = BTreeMap::new();
    let mut ended = 0u64;
    let mut next_id = 1u64;
    let mut clock = 0u64;
    let mut plans = Vec::new();
    // The sampler draws from the same seeded stream: EOS (0) about one time in 12.
    let mut sample_rng = Rng(seed ^ 0xDEAD_BEEF);
    let mut sample = move |_id: u64, _pos: usize| sample_rng.range(0, 11) as u32;

    let mut step_once = |s: &mut Scheduler,
                         w: &mut FakeWorker,
                         live: &mut BTreeMap<u64, Truth>,
                         registered: &BTreeMap<u32, VariantSpec>,
                         ended: &mut u64,
                         rng: &mut Rng,
                         plans: &mut Vec<ScheduledStep>,
                         cov: &mut Coverage| {
        let st = s.schedule();
        if st.is_empty() {
            // Liveness: the oldest running request always fits, and with nothing running the
            // front waiting request fits an empty pool, so an empty step means no work at all.
            assert!(
                !s.has_unfinished(),
                "seed {seed}: empty step with work left: {:?}",
                s.stats()
            );
            return;
        }
        for n in &st.new {
            let t = &live[&n.id];
            let mut want = t.prompt.clone();
            want.extend(&t.outputs);
            assert_eq!(
                n.token_ids, want,
                "request {} resent with the wrong tokens",
                n.id
            );
            assert_eq!(n.num_prompt_tokens as usize, t.prompt.len());
            assert_eq!(n.adapter_id, t.adapter_id);
        }
        // Grouped by adapter: each list sorted by adapter id, arrival order within one.
        for pair in st.new.windows(2) {
            assert!(pair[0].adapter_id <= pair[1].adapter_id, "new not grouped");
        }
        let running_adapters: Vec<u32> =
            st.running.iter().map(|r| live[&r.id].adapter_id).collect();
        assert!(
            running_adapters.is_sorted(),
            "running not grouped: {running_adapters:?}"
        );
        let mut outs = w.run(&st, &mut sample);
        w.assert_matches(s, registered.keys().copied());
        // Some reads finish; the worker reports them with the step's output.
        let read = w.finish_reads(|_| rng.pct(40));
        assert_eq!(
            s.host_copies_ready(&read),
            read.len(),
            "every finished read was pending"
        );
        cov.preemptions += st.preempted.len();
        plans.push(st);
        if rng.pct(5) && !outs.is_empty() {
            // Lose one request's output (e.g. a recoverable worker error for it).
            let k = rng.range(0, outs.len() as u64 - 1) as usize;
            let (id, _) = outs.remove(k);
            w.rollback(id);
        }
        let ups = s.update(&outs);
        for u in &ups {
            let worker_tok = outs.iter().find(|o| o.0 == u.id).unwrap().1;
            assert_eq!(Some(u.token), worker_tok);
            let t = live.get_mut(&u.id).unwrap();
            t.outputs.push(u.token);
            let n = t.outputs.len() as u32;
            match u.finished {
                None => {
                    assert!(n < t.max_tokens);
                    assert!(
                        t.ignore_eos || u.token != EOS,
                        "EOS sampled but not finished"
                    );
                }
                Some(FinishReason::Eos) => assert!(!t.ignore_eos && u.token == EOS),
                Some(FinishReason::Length) => {
                    assert_eq!(n, t.max_tokens);
                    assert!(t.ignore_eos || u.token != EOS, "EOS takes precedence");
                }
            }
            if u.finished.is_some() {
                let t = live.remove(&u.id).unwrap();
                cov.adapter_finished += u64::from(t.adapter_id != 0);
                *ended += 1;
            }
        }
    };

    for _ in 0..ops {
        let roll = rng.range(0, 99);
        if roll < 25 {
            clock += rng.range(0, 3);
            let id = if rng.pct(5) && !live.is_empty() {
                *live.keys().next().unwrap()
            } else {
                next_id
            };
            let max_len = c.max_model_len as u64;
            let plen = rng.range(0, max_len.min(40)) as usize;
            let adapter_id = if rng.pct(30) {
                0
            } else {
                rng.range(0, MAX_ADAPTER as u64) as u32
            };
            let r = SeqRequest {
                id,
                prompt: (0..plen).map(|_| rng.range(1, 11) as u32).collect(),
                max_tokens: rng.range(0, 24) as u32,
                eos_token_ids: vec![EOS],
                ignore_eos: rng.pct(20),
                // Mostly monotone, sometimes an older stamp.
                arrival: if rng.pct(10) {
                    clock.saturating_sub(rng.range(0, 5))
                } else {
                    clock
                },
                adapter_id,
                skip_prefix_cache: false,
            };
            let before = s.stats();
            let truth = Truth {
                prompt: r.prompt.clone(),
                outputs: Vec::new(),
                max_tokens: r.max_tokens,
                ignore_eos: r.ignore_eos,
                adapter_id,
            };
            let total = r.prompt.len() as u64 + r.max_tokens as u64;
            let adapter_pages = match adapter_id {
                0 => Some(0),
                a => registered.get(&a).map(|spec| spec.num_blocks as u64),
            };
            let should_fit = !live.contains_key(&id)
                && !r.prompt.is_empty()
                && r.max_tokens > 0
                && total <= max_len
                && adapter_pages
                    .is_some_and(|p| (total - 1).div_ceil(bs as u64) + p <= c.num_blocks as u64);
            match s.add_request(r) {
                Ok(()) => {
                    assert!(should_fit, "accepted a request that must be refused");
                    live.insert(id, truth);
                    next_id += 1;
                }
                Err(e) => {
                    assert!(!should_fit, "refused a valid request: {e}");
                    assert_eq!(s.stats(), before, "a refused request changed the state");
                    if id == next_id {
                        next_id += 1;
                    }
                }
            }
        } else if roll < 30 {
            let id = if !live.is_empty() && rng.pct(90) {
                *live
                    .keys()
                    .nth(rng.range(0, live.len() as u64 - 1) as usize)
                    .unwrap()
            } else {
                next_id + 1000
            };
            let existed = if rng.pct(50) {
                s.abort(id)
            } else {
                s.finish(id)
            };
            assert_eq!(existed, live.remove(&id).is_some());
            if existed {
                ended += 1;
            }
        } else if roll < 31 {
            s.reset_worker();
            w.reset();
            let st = s.stats();
            assert_eq!(
                (
                    st.adapters_on_gpu,
                    st.adapters_on_host,
                    st.adapter_blocks,
                    st.host_adapter_bytes
                ),
                (0, 0, 0, 0),
                "after a worker reset no adapter is anywhere"
            );
        } else if roll < 33 {
            let id = rng.range(0, MAX_ADAPTER as u64) as u32;
            register(&mut s, &mut w, &mut registered, &mut rng, id);
        } else if roll < 35 {
            let id = rng.range(0, MAX_ADAPTER as u64) as u32;
            let users = live.values().filter(|t| t.adapter_id == id).count();
            assert_eq!(s.adapter_users(id), if id == 0 { 0 } else { users });
            let before = s.stats();
            match s.unregister_adapter(id) {
                Ok(()) => {
                    assert!(registered.remove(&id).is_some() && users == 0);
                }
                Err(e) => {
                    let want = if registered.contains_key(&id) {
                        "adapter_in_use"
                    } else {
                        "unknown_adapter"
                    };
                    assert_eq!(e.error_type(), want, "seed {seed}: adapter {id}: {e}");
                    assert_eq!(
                        s.stats(),
                        before,
                        "a refused unregistration changed the state"
                    );
                }
            }
        } else {
            step_once(
                &mut s,
                &mut w,
                &mut live,
                &registered,
                &mut ended,
                &mut rng,
                &mut plans,
                cov,
            );
        }
        if let Err(e) = s.check_invariants() {
            panic!(
                "seed {seed}: invariant broken: {e}\nconfig {c:?}\nstats {:?}",
                s.stats()
            );
        }
        assert_eq!(s.stats().waiting + s.stats().running, live.len());
    }

    // Drain: no new work; everything must finish (no livelock) and free the pool.
    let mut guard = 0;
    while s.has_unfinished() {
        step_once(
            &mut s,
            &mut w,
            &mut live,
            &registered,
            &mut ended,
            &mut rng,
            &mut plans,
            cov,
        );
        s.check_invariants().unwrap();
        guard += 1;
        assert!(guard < 20_000, "seed {seed}: not drained: {:?}", s.stats());
    }
    assert!(live.is_empty());
    let st = s.stats();
    assert_eq!(
        st.free_blocks + st.adapter_blocks,
        st.total_blocks,
        "seed {seed}: pages leaked"
    );
    assert_eq!(st.used_blocks, 0);
    assert_eq!(st.num_finished + st.num_aborted, ended);
    // With no request left every adapter can go: unregistering frees the whole pool.
    for id in registered.keys() {
        assert_eq!(s.adapter_users(*id), 0);
        s.unregister_adapter(*id).unwrap();
    }
    assert_eq!(s.stats().free_blocks, st.total_blocks);
    assert_eq!(s.stats().host_adapter_bytes, 0);
    s.check_invariants().unwrap();
    for (k, n) in w.op_counts.iter().enumerate() {
        cov.ops[k] += n;
    }
    cov.adapter_tokens += w.adapter_tokens;
    cov.host_deferrals += st.host_deferrals;
    cov.read_waits += w.read_waits;
    plans
}

#[test]
fn random_operations_keep_every_invariant() {
    let mut cov = Coverage::default();
    for seed in 0..40u64 {
        scenario(seed, 2_500, &mut cov);
    }
    assert!(
        cov.preemptions > 0,
        "the scenarios must exercise preemption"
    );
    let names = ["to_host", "to_gpu", "drop_gpu", "drop_host"];
    for (name, n) in names.iter().zip(cov.ops) {
        assert!(n > 0, "the scenarios must exercise {name}");
    }
    assert!(
        cov.adapter_tokens > 0 && cov.adapter_finished > 0,
        "adapter requests run"
    );
    assert!(
        cov.host_deferrals > 0 && cov.read_waits > 0,
        "the scenarios must pass requests over for host reads, and admit into an idle worker \
         without waiting for reports"
    );
}

#[test]
fn same_calls_give_the_same_plans() {
    for seed in [3u64, 17, 29] {
        let mut cov = Coverage::default();
        assert_eq!(
            scenario(seed, 1_500, &mut cov),
            scenario(seed, 1_500, &mut cov)
        );
    }
}
