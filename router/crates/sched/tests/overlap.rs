//! Overlapped steps: `schedule_ahead` forms step N+1 while step N's outputs are still out, the
//! fake worker runs the steps in order, and the outputs reach `update` one step late. Every
//! request must still get exactly its tokens, the worker-side contract must hold on every plan,
//! and a refused lookahead must change nothing.

mod common;

use std::collections::{BTreeMap, VecDeque};

use common::{cfg, req, sample_token, FakeWorker, Rng};
use deltaserve_sched::{FinishReason, ScheduledStep, Scheduler, SeqRequest};

/// What a request should produce: the fake sampler's tokens up to its first EOS id (inclusive)
/// or `max_tokens`, and why it ended.
fn expected(r: &SeqRequest) -> (Vec<u32>, FinishReason) {
    let mut out = Vec::new();
    for pos in 0..r.max_tokens as usize {
        let t = sample_token(r.id, pos);
        out.push(t);
        if !r.ignore_eos && r.eos_token_ids.contains(&t) {
            return (out, FinishReason::Eos);
        }
    }
    (out, FinishReason::Length)
}

/// The scheduler's whole state, less the adapter table's count of formed steps (every call
/// that forms a step, empty or not, advances it).
fn state_of(s: &Scheduler) -> String {
    let debug = format!("{s:?}");
    let start = debug
        .find(" form: ")
        .expect("VariantTable has a form counter");
    let end = start + debug[start..].find(',').unwrap();
    format!("{}{}", &debug[..start], &debug[end..])
}

/// Sends a step to the worker and queues its outputs for a later `update`.
fn send(w: &mut FakeWorker, step: &ScheduledStep, outs: &mut VecDeque<Vec<(u64, Option<u32>)>>) {
    outs.push_back(w.run(step, &mut sample_token));
}

#[test]
fn overlapped_steps_give_every_request_its_tokens() {
    for seed in 0..12u64 {
        let mut rng = Rng(seed);
        // A small pool for some seeds, so that lookahead meets page pressure and falls back.
        let num_blocks = if seed % 3 == 0 { 24 } else { 256 };
        let c = cfg(4, num_blocks, 8, 24, 96);
        let mut s = Scheduler::new(c.clone()).unwrap();
        let mut w = FakeWorker::new(c);
        let mut outs = VecDeque::new();
        let mut reqs: BTreeMap<u64, SeqRequest> = BTreeMap::new();
        let mut got: BTreeMap<u64, Vec<u32>> = BTreeMap::new();
        let mut ended: BTreeMap<u64, FinishReason> = BTreeMap::new();
        let mut aborted = Vec::new();
        let (mut ahead, mut refused) = (0, 0);
        let mut next_id = 1;
        for tick in 0..4000 {
            if next_id <= 40 && rng.pct(30) {
                let mut r = req(next_id, rng.range(1, 30) as usize, rng.range(1, 40) as u32);
                r.eos_token_ids = vec![rng.range(1, 51) as u32];
                r.ignore_eos = rng.pct(20);
                s.add_request(r.clone()).unwrap();
                reqs.insert(next_id, r);
                next_id += 1;
            }
            if rng.pct(2) {
                // A client goes away mid-flight (outputs for it may still be out).
                if let Some(&id) = reqs.keys().find(|id| s.contains(**id)) {
                    s.abort(id);
                    aborted.push(id);
                }
            }
            if outs.is_empty() {
                let step = s.schedule();
                if !step.is_empty() {
                    send(&mut w, &step, &mut outs);
                }
            }
            if outs.len() == 1 {
                let before = state_of(&s);
                let step = s.schedule_ahead();
                if step.is_empty() {
                    refused += 1;
                    assert_eq!(before, state_of(&s), "an empty lookahead changes nothing");
                } else {
                    ahead += 1;
                    send(&mut w, &step, &mut outs);
                }
            }
            s.check_invariants().unwrap();
            let Some(step_outs) = outs.pop_front() else {
                if next_id > 40 && !s.has_unfinished() {
                    break;
                }
                continue;
            };
            for u in s.update(&step_outs) {
                got.entry(u.id).or_default().push(u.token);
                if let Some(reason) = u.finished {
                    ended.insert(u.id, reason);
                }
            }
            s.check_invariants().unwrap();
            assert!(tick < 3999, "seed {seed}: not finished: {:?}", s.stats());
        }
        assert!(!s.has_unfinished());
        for (id, r) in &reqs {
            let outputs = got.get(id).cloned().unwrap_or_default();
            let (want, reason) = expected(r);
            if aborted.contains(id) {
                assert!(
                    want.starts_with(&outputs),
                    "seed {seed}: request {id}: {outputs:?} vs {want:?}"
                );
            } else {
                assert_eq!(outputs, want, "seed {seed}: request {id}");
                assert_eq!(ended.get(id), Some(&reason), "seed {seed}: request {id}");
            }
        }
        assert!(ahead > 0, "seed {seed}: no step was formed ahead");
        if num_blocks == 24 {
            assert!(
                refused > 0,
                "seed {seed}: the small pool never refused a lookahead"
            );
        }
    }
}

#[test]
fn a_step_ahead_schedules_the_token_being_sampled_and_stops_at_max_tokens() {
    let c = cfg(4, 64, 8, 64, 128);
    let mut s = Scheduler::new(c.clone()).unwrap();
    let mut w = FakeWorker::new(c);
    let mut outs = VecDeque::new();
    assert!(
        s.schedule_ahead().is_empty(),
        "nothing outstanding: nothing to look ahead of"
    );
    s.add_request(req(1, 4, 3)).unwrap();
    let first = s.schedule();
    assert_eq!(first.new[0].num_scheduled_tokens, 4);
    send(&mut w, &first, &mut outs);
    // Step 2 decodes the token step 1 samples; its 5th position needs a second page.
    let second = s.schedule_ahead();
    assert_eq!(second.step_id, 2);
    assert_eq!(
        (second.running[0].id, second.running[0].num_scheduled_tokens),
        (1, 1)
    );
    assert_eq!(second.running[0].new_block_ids.len(), 1);
    send(&mut w, &second, &mut outs);
    assert!(s.schedule_ahead().is_empty(), "two steps outstanding");
    s.check_invariants().unwrap();
    let ups = s.update(&outs.pop_front().unwrap());
    assert_eq!((ups[0].token, ups[0].finished), (sample_token(1, 0), None));
    // Step 3 decodes output 2 (sampled by step 2); output 3 would be the last (max_tokens 3).
    let third = s.schedule_ahead();
    assert_eq!(
        (third.running[0].id, third.running[0].num_scheduled_tokens),
        (1, 1)
    );
    send(&mut w, &third, &mut outs);
    s.update(&outs.pop_front().unwrap());
    assert!(
        s.schedule_ahead().is_empty(),
        "the outstanding step samples the last token: nothing to compute"
    );
    let ups = s.update(&outs.pop_front().unwrap());
    assert_eq!(ups[0].finished, Some(FinishReason::Length));
    assert_eq!(
        w.tokens(1)[4..],
        [sample_token(1, 0), sample_token(1, 1), sample_token(1, 2)]
    );
    assert!(!s.has_unfinished());
    s.check_invariants().unwrap();
}

#[test]
fn a_token_lost_under_a_step_ahead_means_recompute() {
    let c = cfg(4, 64, 8, 64, 128);
    let mut s = Scheduler::new(c.clone()).unwrap();
    let mut w = FakeWorker::new(c);
    let mut outs = VecDeque::new();
    s.add_request(req(1, 4, 8)).unwrap();
    s.add_request(req(2, 4, 8)).unwrap();
    let first = s.schedule();
    send(&mut w, &first, &mut outs);
    let second = s.schedule_ahead();
    send(&mut w, &second, &mut outs);
    // The worker's answer to step 1 lacks request 2's token, which step 2 already consumed.
    let mut answer = outs.pop_front().unwrap();
    answer.retain(|(id, _)| *id == 1);
    let ups = s.update(&answer);
    assert_eq!(ups.iter().map(|u| u.id).collect::<Vec<_>>(), vec![1]);
    assert_eq!(s.stats().running, 1, "request 2 went back to the queue");
    s.check_invariants().unwrap();
    // Step 2's output for request 2 is ignored; the next step releases and re-sends it.
    let ups = s.update(&outs.pop_front().unwrap());
    assert_eq!(ups.iter().map(|u| u.id).collect::<Vec<_>>(), vec![1]);
    let third = s.schedule();
    assert!(third.released.contains(&2) && third.new.iter().any(|n| n.id == 2));
    s.check_invariants().unwrap();
}

#[test]
fn schedule_is_refused_while_a_step_formed_ahead_is_outstanding() {
    // schedule, schedule_ahead, schedule again without an update, then a tokenless answer used
    // to leave request 1 with a cached position past its tokens (the page step 2 took for the
    // token step 1 samples) and no pending sample: "cached <= tokens + pending" broken.
    let c = cfg(4, 64, 8, 64, 128);
    let mut s = Scheduler::new(c.clone()).unwrap();
    let mut w = FakeWorker::new(c);
    let mut outs = VecDeque::new();
    s.add_request(req(1, 4, 8)).unwrap();
    let first = s.schedule();
    send(&mut w, &first, &mut outs);
    let second = s.schedule_ahead();
    assert_eq!(
        second.running[0].new_block_ids.len(),
        1,
        "a page for the token being sampled"
    );
    send(&mut w, &second, &mut outs);
    assert_eq!(s.outstanding_steps(), 2);
    let before = state_of(&s);
    let refused = s.schedule();
    assert!(refused.is_empty() && refused.step_id == 0, "{refused:?}");
    assert_eq!(s.outstanding_steps(), 2, "nothing abandoned");
    assert_eq!(state_of(&s), before, "nothing changed");
    outs.pop_front(); // the worker's answer to step 1 loses its token instead
    s.update(&[(1, None)]);
    s.check_invariants().unwrap();
    // From here the request runs to the end with a worker that answers every step.
    while s.has_unfinished() {
        if s.outstanding_steps() == 0 {
            let step = s.schedule();
            send(&mut w, &step, &mut outs);
        }
        s.update(&outs.pop_front().unwrap());
        s.check_invariants().unwrap();
    }
    // With a single step outstanding, scheduling again still abandons it.
    s.add_request(req(2, 4, 2)).unwrap();
    assert!(!s.schedule().is_empty());
    assert!(
        !s.schedule().is_empty(),
        "one outstanding step is abandoned"
    );
    s.check_invariants().unwrap();
}
