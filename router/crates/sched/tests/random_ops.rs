//! Property-style test: seeded random sequences of add / abort / finish / schedule / update /
//! lost outputs / worker resets, over many pool shapes. After every operation the scheduler's
//! invariants must hold; every plan must satisfy the fake worker's contract checks (pages never
//! shared on the worker, chunks contiguous and covered, budget and max_num_seqs respected,
//! resumed requests carry exactly prompt ++ their outputs); every request ends exactly once,
//! with a consistent reason; and at the end the whole pool is free.

mod common;

use std::collections::BTreeMap;

use common::{cfg, FakeWorker, Rng};
use deltaserve_sched::{FinishReason, ScheduledStep, Scheduler, SchedulerConfig, SeqRequest};

const EOS: u32 = 0;

/// What the test knows about one accepted request.
struct Truth {
    prompt: Vec<u32>,
    outputs: Vec<u32>,
    max_tokens: u32,
    ignore_eos: bool,
}

/// Runs one random scenario and returns its plans (for the determinism check).
fn scenario(seed: u64, ops: usize) -> Vec<ScheduledStep> {
    let mut rng = Rng(seed);
    let bs = rng.range(1, 8) as u32;
    let c: SchedulerConfig = cfg(
        bs,
        rng.range(2, 40) as u32,
        rng.range(1, 8) as usize,
        rng.range(1, 48) as usize,
        rng.range(8, 96) as u32,
    );
    let mut s = Scheduler::new(c.clone()).unwrap();
    let mut w = FakeWorker::new(c.clone());
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
                         ended: &mut u64,
                         rng: &mut Rng,
                         plans: &mut Vec<ScheduledStep>| {
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
        }
        let mut outs = w.run(&st, &mut sample);
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
                live.remove(&u.id);
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
            };
            let before = s.stats();
            let truth = Truth {
                prompt: r.prompt.clone(),
                outputs: Vec::new(),
                max_tokens: r.max_tokens,
                ignore_eos: r.ignore_eos,
            };
            let total = r.prompt.len() as u64 + r.max_tokens as u64;
            let should_fit = !live.contains_key(&id)
                && !r.prompt.is_empty()
                && r.max_tokens > 0
                && total <= max_len
                && (total - 1).div_ceil(bs as u64) <= c.num_blocks as u64;
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
            w = FakeWorker::new(c.clone());
        } else {
            step_once(&mut s, &mut w, &mut live, &mut ended, &mut rng, &mut plans);
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
        step_once(&mut s, &mut w, &mut live, &mut ended, &mut rng, &mut plans);
        s.check_invariants().unwrap();
        guard += 1;
        assert!(guard < 20_000, "seed {seed}: not drained: {:?}", s.stats());
    }
    assert!(live.is_empty());
    let st = s.stats();
    assert_eq!(st.free_blocks, st.total_blocks, "seed {seed}: pages leaked");
    assert_eq!(st.used_blocks, 0);
    assert_eq!(st.num_finished + st.num_aborted, ended);
    plans
}

#[test]
fn random_operations_keep_every_invariant() {
    let mut total_preemptions = 0;
    for seed in 0..40u64 {
        let plans = scenario(seed, 2_500);
        total_preemptions += plans.iter().map(|p| p.preempted.len()).sum::<usize>();
    }
    assert!(
        total_preemptions > 0,
        "the scenarios must exercise preemption"
    );
}

#[test]
fn same_calls_give_the_same_plans() {
    for seed in [3u64, 17, 29] {
        assert_eq!(scenario(seed, 1_500), scenario(seed, 1_500));
    }
}
