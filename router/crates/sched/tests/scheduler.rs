//! Scenario tests of the step algorithm through the public API, each driven by the fake worker
//! in `common`, which also checks the worker-side contract on every plan.

mod common;

use common::{cfg, req, run_to_completion, sample_token, FakeWorker};
use deltaserve_sched::{FinishReason, SchedError, Scheduler, SeqRequest};

#[test]
fn prefill_and_decode_share_one_step() {
    let c = cfg(4, 64, 8, 64, 128);
    let mut s = Scheduler::new(c.clone()).unwrap();
    let mut w = FakeWorker::new(c);
    s.add_request(req(1, 5, 10)).unwrap();
    let st = s.schedule();
    assert_eq!(st.step_id, 1);
    assert_eq!(st.new.len(), 1);
    assert_eq!(
        (
            st.new[0].id,
            st.new[0].num_scheduled_tokens,
            st.new[0].block_ids.len()
        ),
        (1, 5, 2)
    );
    let ups = s.update(&w.run(&st, &mut sample_token));
    assert_eq!(ups.len(), 1);
    assert_eq!(ups[0].token, sample_token(1, 0));

    s.add_request(req(2, 3, 10)).unwrap();
    let st = s.schedule();
    assert_eq!(st.running.len(), 1, "request 1 decodes");
    assert_eq!(
        (st.running[0].id, st.running[0].num_scheduled_tokens),
        (1, 1)
    );
    assert!(
        st.running[0].new_block_ids.is_empty(),
        "6 tokens fit in its 2 pages"
    );
    assert_eq!(st.new.len(), 1, "request 2 prefills in the same step");
    assert_eq!((st.new[0].id, st.new[0].num_scheduled_tokens), (2, 3));
    assert_eq!(st.num_scheduled_tokens(), 4);
    let ups = s.update(&w.run(&st, &mut sample_token));
    assert_eq!(ups.iter().map(|u| u.id).collect::<Vec<_>>(), vec![2, 1]);
    assert_eq!(
        s.output_tokens(1).unwrap(),
        &[sample_token(1, 0), sample_token(1, 1)]
    );
    s.check_invariants().unwrap();
}

#[test]
fn chunked_prefill_covers_the_prompt_exactly_within_the_budget() {
    let c = cfg(4, 64, 8, 8, 128);
    let mut s = Scheduler::new(c.clone()).unwrap();
    let mut w = FakeWorker::new(c);
    // Request 1 decodes while request 2's 20-token prompt is prefilled in chunks.
    s.add_request(req(1, 2, 30)).unwrap();
    let st = s.schedule();
    s.update(&w.run(&st, &mut sample_token));
    s.add_request(req(2, 20, 5)).unwrap();

    let mut chunks = Vec::new();
    let mut first_token_step = None;
    for step_no in 0..6 {
        let st = s.schedule();
        assert!(st.num_scheduled_tokens() <= 8);
        assert_eq!(st.running[0].id, 1, "the decode comes first, oldest first");
        assert_eq!(st.running[0].num_scheduled_tokens, 1);
        let chunk = st
            .new
            .iter()
            .find(|n| n.id == 2)
            .map(|n| n.num_scheduled_tokens)
            .or_else(|| {
                st.running
                    .iter()
                    .find(|r| r.id == 2)
                    .map(|r| r.num_scheduled_tokens)
            })
            .unwrap();
        assert_eq!(st.num_scheduled_tokens(), 1 + chunk as usize);
        chunks.push(chunk);
        let ups = s.update(&w.run(&st, &mut sample_token));
        if ups.iter().any(|u| u.id == 2) {
            first_token_step = Some(step_no);
            break;
        }
    }
    assert_eq!(
        chunks,
        vec![7, 7, 6],
        "chunks of the remaining budget, summing to the prompt"
    );
    assert_eq!(
        first_token_step,
        Some(2),
        "the first token comes with the last chunk"
    );
    assert_eq!(s.output_tokens(2).unwrap(), &[sample_token(2, 0)]);
    // Then request 2 decodes one token per step.
    let st = s.schedule();
    assert_eq!(
        st.running
            .iter()
            .map(|r| (r.id, r.num_scheduled_tokens))
            .collect::<Vec<_>>(),
        vec![(1, 1), (2, 1)]
    );
    s.check_invariants().unwrap();
}

#[test]
fn max_num_seqs_bounds_the_running_set() {
    let c = cfg(4, 64, 2, 64, 128);
    let mut s = Scheduler::new(c.clone()).unwrap();
    let mut w = FakeWorker::new(c);
    s.add_request(req(1, 3, 2)).unwrap();
    s.add_request(req(2, 3, 5)).unwrap();
    s.add_request(req(3, 3, 5)).unwrap();
    s.add_request(req(4, 3, 5)).unwrap();
    let st = s.schedule();
    assert_eq!(st.new.iter().map(|n| n.id).collect::<Vec<_>>(), vec![1, 2]);
    assert_eq!((s.stats().running, s.stats().waiting), (2, 2));
    s.update(&w.run(&st, &mut sample_token));
    let st = s.schedule();
    assert!(st.new.is_empty(), "the running set is full");
    let ups = s.update(&w.run(&st, &mut sample_token));
    assert!(ups
        .iter()
        .any(|u| u.id == 1 && u.finished == Some(FinishReason::Length)));
    let st = s.schedule();
    assert_eq!(st.released, vec![1]);
    assert_eq!(
        st.new.iter().map(|n| n.id).collect::<Vec<_>>(),
        vec![3],
        "one slot freed, FCFS"
    );
    s.update(&w.run(&st, &mut sample_token));
    let ups = run_to_completion(&mut s, &mut w, 100);
    assert_eq!(ups.iter().filter(|u| u.finished.is_some()).count(), 3);
}

#[test]
fn finishes_at_max_tokens_and_at_eos_unless_ignored() {
    let c = cfg(4, 64, 8, 64, 128);
    let eos = sample_token(2, 1); // request 2's second output
    let mut s = Scheduler::new(c.clone()).unwrap();
    let mut w = FakeWorker::new(c);
    s.add_request(req(1, 3, 4)).unwrap();
    s.add_request(SeqRequest {
        eos_token_ids: vec![999, eos],
        ..req(2, 3, 10)
    })
    .unwrap();
    s.add_request(SeqRequest {
        eos_token_ids: vec![eos],
        ignore_eos: true,
        ..req(3, 3, 6)
    })
    .unwrap();
    let ups = run_to_completion(&mut s, &mut w, 100);
    let outputs = |id: u64| ups.iter().filter(|u| u.id == id).collect::<Vec<_>>();

    let one = outputs(1);
    assert_eq!(one.len(), 4);
    assert!(one[..3].iter().all(|u| u.finished.is_none()));
    assert_eq!(one[3].finished, Some(FinishReason::Length));

    let two = outputs(2);
    assert_eq!(two.len(), 2, "stops at the EOS id");
    assert_eq!(
        (two[1].token, two[1].finished),
        (eos, Some(FinishReason::Eos))
    );

    let three = outputs(3);
    assert_eq!(three.len(), 6, "ignore_eos runs to max_tokens");
    assert_eq!(three[5].finished, Some(FinishReason::Length));
    assert_eq!(s.stats().free_blocks, 64);
    assert_eq!(s.stats().num_finished, 3);
}

#[test]
fn eos_on_the_last_allowed_token_reports_eos() {
    let c = cfg(4, 64, 8, 64, 128);
    let mut s = Scheduler::new(c.clone()).unwrap();
    let mut w = FakeWorker::new(c);
    s.add_request(SeqRequest {
        eos_token_ids: vec![sample_token(1, 0)],
        ..req(1, 3, 1)
    })
    .unwrap();
    let ups = run_to_completion(&mut s, &mut w, 10);
    assert_eq!(ups.len(), 1);
    assert_eq!(ups[0].finished, Some(FinishReason::Eos));
}

#[test]
fn abort_frees_pages_and_reports_running_ids_only() {
    let c = cfg(4, 16, 1, 64, 128);
    let mut s = Scheduler::new(c.clone()).unwrap();
    let mut w = FakeWorker::new(c);
    s.add_request(req(1, 9, 10)).unwrap();
    s.add_request(req(2, 5, 10)).unwrap(); // waits: max_num_seqs = 1
    let st = s.schedule();
    assert_eq!(s.stats().used_blocks, 3);
    let outs = w.run(&st, &mut sample_token);

    assert!(s.abort(2), "waiting request");
    assert!(
        s.abort(1),
        "running request, aborted while its step is in flight"
    );
    assert!(!s.abort(1), "already gone");
    assert!(!s.abort(77), "never existed");
    assert_eq!(s.stats().free_blocks, 16, "pages are free at once");
    assert_eq!(s.stats().num_aborted, 2);
    assert!(
        s.update(&outs).is_empty(),
        "outputs of an aborted request are dropped"
    );
    assert!(!s.has_unfinished());
    s.check_invariants().unwrap();

    // Nothing to run: the release waits for the next non-empty step.
    let st = s.schedule();
    assert!(st.is_empty());
    assert_eq!(st.step_id, 0);
    assert_eq!(s.stats().pending_released, 1);
    s.add_request(req(3, 2, 2)).unwrap();
    let st = s.schedule();
    assert_eq!(
        st.released,
        vec![1],
        "only the request that was on the worker"
    );
    assert_eq!(st.new[0].id, 3);
    assert_eq!(st.new[0].block_ids, vec![0], "freed pages are reused");
    w.run(&st, &mut sample_token);
}

#[test]
fn finish_by_caller_releases_like_abort() {
    let c = cfg(4, 16, 4, 64, 128);
    let mut s = Scheduler::new(c.clone()).unwrap();
    let mut w = FakeWorker::new(c);
    s.add_request(req(1, 3, 10)).unwrap();
    s.add_request(req(2, 3, 10)).unwrap();
    let st = s.schedule();
    s.update(&w.run(&st, &mut sample_token));
    assert!(s.finish(1));
    assert!(!s.finish(1));
    let st = s.schedule();
    assert_eq!(st.released, vec![1]);
    assert_eq!(st.running.iter().map(|r| r.id).collect::<Vec<_>>(), vec![2]);
    assert_eq!(s.stats().num_finished, 1);
}

#[test]
fn preempts_the_latest_and_resumes_it_with_its_outputs() {
    // 2-token pages, 6 pages. Each request: 4-token prompt, 6 outputs -> up to 9 cached tokens
    // = 5 pages, so both fit at first but not to the end.
    let c = cfg(2, 6, 8, 64, 64);
    let mut s = Scheduler::new(c.clone()).unwrap();
    let mut w = FakeWorker::new(c);
    s.add_request(req(1, 4, 6)).unwrap();
    s.add_request(req(2, 4, 6)).unwrap();

    let mut preempted_at = None;
    let mut outputs_at_preemption = Vec::new();
    let mut resumed = None;
    let mut ups = Vec::new();
    for _ in 0..50 {
        if !s.has_unfinished() {
            break;
        }
        let st = s.schedule();
        if !st.preempted.is_empty() {
            assert_eq!(
                st.preempted,
                vec![2],
                "the most recently arrived request is the victim"
            );
            assert!(st.released.contains(&2));
            assert_eq!(st.running.iter().map(|r| r.id).collect::<Vec<_>>(), vec![1]);
            assert!(st.new.is_empty(), "no admission in a step that preempted");
            preempted_at.get_or_insert(st.step_id);
            outputs_at_preemption = s.output_tokens(2).unwrap().to_vec();
            assert_eq!(s.stats().waiting, 1);
        }
        if let Some(n) = st.new.iter().find(|n| n.id == 2 && preempted_at.is_some()) {
            // Resumed in full: prompt ++ the outputs generated before preemption.
            let mut want: Vec<u32> = req(2, 4, 6).prompt;
            want.extend(&outputs_at_preemption);
            assert_eq!(n.token_ids, want);
            assert_eq!(n.num_prompt_tokens, 4);
            assert_eq!(n.num_computed_tokens, 0);
            resumed = Some(st.step_id);
        }
        ups.extend(s.update(&w.run(&st, &mut sample_token)));
        s.check_invariants().unwrap();
    }
    assert!(!s.has_unfinished());
    let p = preempted_at.expect("the pool is too small for both: someone is preempted");
    assert!(resumed.expect("the victim resumes") > p);
    assert!(
        !outputs_at_preemption.is_empty(),
        "it had generated tokens before preemption"
    );
    assert_eq!(s.stats().num_preemptions, 1);
    for id in [1, 2] {
        let mine: Vec<_> = ups.iter().filter(|u| u.id == id).collect();
        assert_eq!(
            mine.len(),
            6,
            "request {id} ends with exactly max_tokens outputs"
        );
        assert_eq!(mine.last().unwrap().finished, Some(FinishReason::Length));
        let toks: Vec<u32> = mine.iter().map(|u| u.token).collect();
        let want: Vec<u32> = (0..6).map(|pos| sample_token(id, pos)).collect();
        assert_eq!(
            toks, want,
            "request {id}: tokens before preemption kept, none repeated"
        );
    }
    assert_eq!(s.stats().free_blocks, 6);
}

#[test]
fn a_request_that_is_itself_the_victim_is_preempted_and_skipped() {
    // 2-token pages, 4 pages. Request 1: prompt 2; request 2: prompt 3 (both up to 3 pages).
    let c = cfg(2, 4, 8, 64, 64);
    let mut s = Scheduler::new(c.clone()).unwrap();
    let mut w = FakeWorker::new(c);
    s.add_request(req(1, 2, 4)).unwrap();
    s.add_request(req(2, 3, 4)).unwrap();
    // Step 1: 1 takes 1 page, 2 takes 2 pages; 1 page left.
    let st = s.schedule();
    assert_eq!(
        st.new.iter().map(|n| n.block_ids.len()).collect::<Vec<_>>(),
        vec![1, 2]
    );
    s.update(&w.run(&st, &mut sample_token));
    // Step 2: 1 computes token 2 and takes the last page; 2 computes token 3 in its pages.
    let st = s.schedule();
    assert_eq!(
        st.running
            .iter()
            .map(|r| r.new_block_ids.len())
            .collect::<Vec<_>>(),
        vec![1, 0]
    );
    assert_eq!(s.stats().free_blocks, 0);
    s.update(&w.run(&st, &mut sample_token));
    // Step 3: 1 computes token 3 in its pages; 2 needs a 3rd page for token 4, none is free,
    // and the latest running request is 2 itself: it is preempted and skipped.
    let st = s.schedule();
    assert_eq!(st.preempted, vec![2]);
    assert_eq!(st.released, vec![2]);
    assert_eq!(st.running.iter().map(|r| r.id).collect::<Vec<_>>(), vec![1]);
    assert_eq!(s.stats().free_blocks, 2);
    assert_eq!(s.output_tokens(2).unwrap().len(), 2);
    s.update(&w.run(&st, &mut sample_token));
    s.check_invariants().unwrap();
    // Request 1 finishes, then 2 resumes with its 2 outputs and finishes with exactly 4.
    let ups = run_to_completion(&mut s, &mut w, 20);
    let two: Vec<u32> = ups.iter().filter(|u| u.id == 2).map(|u| u.token).collect();
    assert_eq!(two, vec![sample_token(2, 2), sample_token(2, 3)]);
    assert_eq!(s.stats().num_preemptions, 1);
    assert_eq!(s.stats().free_blocks, 4);
}

#[test]
fn admission_keeps_a_page_for_running_decodes() {
    // 4-token pages, 3 pages. Request 1: 4-token prompt fills its page exactly, so its next
    // token needs a 2nd page. Request 2 needs 2 pages for its 8-token prompt: admitting it
    // would take the page request 1 needs, so it must wait (no preemption ever happens).
    let c = cfg(4, 3, 8, 64, 64);
    let mut s = Scheduler::new(c.clone()).unwrap();
    let mut w = FakeWorker::new(c);
    s.add_request(req(1, 4, 3)).unwrap();
    s.add_request(req(2, 8, 1)).unwrap();
    let st = s.schedule();
    assert_eq!(
        st.new.iter().map(|n| n.id).collect::<Vec<_>>(),
        vec![1],
        "watermark holds request 2 back"
    );
    s.update(&w.run(&st, &mut sample_token));
    let ups = run_to_completion(&mut s, &mut w, 50);
    assert_eq!(ups.iter().filter(|u| u.finished.is_some()).count(), 2);
    assert_eq!(s.stats().num_preemptions, 0);
}

#[test]
fn admission_errors_leave_state_unchanged() {
    // 4-token pages, 4 pages = 16 cached tokens; context 20.
    let c = cfg(4, 4, 8, 64, 20);
    let mut s = Scheduler::new(c.clone()).unwrap();
    let mut w = FakeWorker::new(c);
    s.add_request(req(1, 3, 5)).unwrap();
    let st = s.schedule();
    s.update(&w.run(&st, &mut sample_token));
    s.add_request(req(2, 3, 5)).unwrap(); // waiting
    let before = s.clone();

    let cases: Vec<(SeqRequest, &str)> = vec![
        (req(1, 3, 5), "duplicate_id"),
        (req(2, 3, 5), "duplicate_id"),
        (req(3, 0, 5), "empty_prompt"),
        (req(4, 3, 0), "zero_max_tokens"),
        (req(5, 12, 9), "context_length_exceeded"), // 21 > 20
        (req(6, 10, 8), "kv_pool_too_small"),       // 17 cached tokens > 16
    ];
    for (r, kind) in cases {
        let id = r.id;
        let err = s.add_request(r).unwrap_err();
        assert_eq!(err.error_type(), kind, "request {id}: {err}");
        assert!(err.to_string().contains(&format!("request {id}")), "{err}");
    }
    let err = s.add_request(req(5, 12, 9)).unwrap_err();
    assert_eq!(
        err,
        SchedError::TooLong {
            id: 5,
            prompt_tokens: 12,
            max_tokens: 9,
            total: 21,
            max_model_len: 20
        }
    );
    assert_eq!(s.stats(), before.stats());
    s.check_invariants().unwrap();
    // Same future as if the bad calls never happened.
    let mut twin = before;
    assert_eq!(s.schedule(), twin.schedule());

    // The boundaries themselves are accepted: 20 tokens of context, 16 cached tokens.
    let mut s = Scheduler::new(cfg(4, 4, 8, 64, 20)).unwrap();
    s.add_request(req(7, 10, 7)).unwrap(); // 17 total, 16 cached = 4 pages
    s.add_request(req(8, 1, 19)).unwrap_err(); // 20 total but 19 cached > 16
    let mut s = Scheduler::new(cfg(4, 8, 8, 64, 20)).unwrap();
    s.add_request(req(8, 1, 19)).unwrap(); // 20 total = max_model_len
}

#[test]
fn invalid_config_is_refused() {
    let err = Scheduler::new(cfg(0, 4, 8, 64, 20)).unwrap_err();
    assert_eq!(err.error_type(), "invalid_config");
    assert!(err.to_string().contains("block_size"), "{err}");
}

#[test]
fn lost_outputs_are_rescheduled_from_the_same_point() {
    let c = cfg(4, 16, 8, 6, 64);
    let mut s = Scheduler::new(c.clone()).unwrap();
    let mut w = FakeWorker::new(c);
    s.add_request(req(1, 10, 3)).unwrap();
    let st = s.schedule();
    assert_eq!(st.new[0].num_scheduled_tokens, 6);
    let outs = w.run(&st, &mut sample_token);
    w.rollback(1);
    assert!(s.update(&[]).is_empty(), "no output: not advanced");
    let _ = outs;
    let st = s.schedule();
    assert_eq!(
        st.running[0].num_scheduled_tokens, 6,
        "the same chunk again"
    );
    assert!(st.running[0].new_block_ids.is_empty(), "its pages are kept");
    s.update(&w.run(&st, &mut sample_token));
    let st = s.schedule();
    assert_eq!(st.running[0].num_scheduled_tokens, 4);
    // The chunk reached the end but the worker sent no token: not advanced either.
    w.run(&st, &mut sample_token);
    w.rollback(1);
    assert!(s.update(&[(1, None)]).is_empty());
    let st = s.schedule();
    assert_eq!(st.running[0].num_scheduled_tokens, 4);
    let ups = s.update(&w.run(&st, &mut sample_token));
    assert_eq!(ups.len(), 1);
    // Duplicate and unknown ids are ignored.
    let st = s.schedule();
    let outs = w.run(&st, &mut sample_token);
    let mut doubled = outs.clone();
    doubled.extend(outs);
    doubled.push((42, Some(1)));
    assert_eq!(s.update(&doubled).len(), 1);
    assert_eq!(s.output_tokens(1).unwrap().len(), 2);
    s.check_invariants().unwrap();
}

#[test]
fn reset_worker_requeues_everything_for_recompute() {
    let c = cfg(4, 16, 8, 64, 64);
    let mut s = Scheduler::new(c.clone()).unwrap();
    let mut w = FakeWorker::new(c.clone());
    s.add_request(req(1, 5, 10)).unwrap();
    s.add_request(req(2, 3, 10)).unwrap();
    for _ in 0..3 {
        let st = s.schedule();
        s.update(&w.run(&st, &mut sample_token));
    }
    s.abort(2);
    assert_eq!(s.reset_worker(), vec![1]);
    assert_eq!(s.stats().free_blocks, 16);
    assert_eq!(s.stats().num_preemptions, 0);
    let mut w = FakeWorker::new(c);
    let st = s.schedule();
    assert!(
        st.released.is_empty(),
        "the new worker knows nothing to release"
    );
    assert_eq!(st.new.len(), 1);
    assert_eq!(st.new[0].token_ids.len(), 5 + 3);
    s.update(&w.run(&st, &mut sample_token));
    let ups = run_to_completion(&mut s, &mut w, 50);
    assert_eq!(ups.last().unwrap().finished, Some(FinishReason::Length));
}

#[test]
fn earlier_arrival_stamp_goes_first() {
    let c = cfg(4, 16, 1, 64, 64);
    let mut s = Scheduler::new(c).unwrap();
    s.add_request(SeqRequest {
        arrival: 50,
        ..req(1, 3, 2)
    })
    .unwrap();
    s.add_request(SeqRequest {
        arrival: 10,
        ..req(2, 3, 2)
    })
    .unwrap();
    s.add_request(SeqRequest {
        arrival: 10,
        ..req(3, 3, 2)
    })
    .unwrap();
    let st = s.schedule();
    assert_eq!(st.new[0].id, 2, "earliest stamp, then add order");
    s.check_invariants().unwrap();
}

#[test]
fn a_lowered_running_cap_lets_the_batch_shrink_without_preempting() {
    // cfg(block_size, num_blocks, max_num_seqs, max_num_batched_tokens, max_model_len)
    let c = cfg(4, 64, 8, 64, 128);
    let mut s = Scheduler::new(c.clone()).unwrap();
    let mut w = FakeWorker::new(c);
    for id in 1..=4 {
        s.add_request(req(id, 2, 3)).unwrap();
    }
    let st = s.schedule();
    assert_eq!(st.new.len(), 4);
    s.update(&w.run(&st, &mut sample_token));
    s.set_max_num_seqs(1);
    assert_eq!(
        s.config().max_num_seqs,
        4,
        "never below the requests running"
    );
    s.add_request(req(5, 2, 3)).unwrap();
    let st = s.schedule();
    assert!(st.new.is_empty(), "no room under the cap");
    assert!(
        st.preempted.is_empty(),
        "running requests are not preempted"
    );
    assert_eq!(st.running.len(), 4);
    s.check_invariants().unwrap();
    run_to_completion(&mut s, &mut w, 100);
    s.set_max_num_seqs(0);
    assert_eq!(s.config().max_num_seqs, 1, "at least one");
}
