//! Criterion benchmark of one scheduler iteration, `schedule()` + `update()`, in the engine's
//! steady decode state: every running request is scheduled one token and reports one sampled
//! token, none finishes, nothing is admitted or preempted. Three groups:
//!
//! - `queue`: running R ∈ {1, 16, 64, 256} base-model requests (`max_num_seqs` 256) with
//!   W ∈ {0, 1 000, 10 000} waiting requests that cannot be admitted.
//! - `variants`: 256 running requests spread evenly over V ∈ {0 (all base), 1, 8, 32, 256}
//!   LoRA adapters in a seeded random arrival order, all registered and GPU-resident (pinned by
//!   their running requests).
//! - `prefix`: `queue`'s R = 256 cases (W ∈ {0, 1 000}) with prefix caching on.
//!
//! Run: `cargo bench -p deltaserve-sched --bench schedule -- --quick` (numbers for this CPU are
//! in `bench/README.md`). `cargo test --benches` runs each case once, as a smoke test.
//!
//! # How the state stays steady
//!
//! A decoding request grows by one token per step, so its block table gains a page every
//! `block_size` steps; no state is truly stationary. Each case builds its starting state once
//! (untimed): the running requests admitted, prefilled and decoding, the waiting ones queued
//! and refused, checked by a probe step on a copy. Timed iterations then run back to back on a
//! copy of that state, a whole page cycle after another, so page allocations are counted at
//! their real rate; when the copy has taken as many steps as its requests' `max_tokens` and the
//! pool allow, it is replaced by a fresh copy outside the timed span (cloning and dropping are
//! never timed). After every timed span the copy is checked again: still R running, W waiting,
//! no preemption, nothing finished; a broken scenario panics instead of timing something else.
//!
//! # Why the waiting requests cannot be admitted
//!
//! They all name one cold adapter registered as large as the pool allows (the pool minus the
//! pages of one waiting request), so it fits only into an almost empty pool: while any request
//! runs, the head of the queue cannot get its adapter's pages, and FCFS admission keeps every
//! request behind it waiting, the way a large cold adapter blocks the queue under memory
//! pressure. Its host copy is prefetched during setup, so the steady steps move no adapter. At
//! R = 256 `max_num_seqs` stops admission first. Without waiting requests that adapter is not
//! registered.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use deltaserve_sched::{Scheduler, SchedulerConfig, SeqRequest, VariantKind, VariantSpec};

/// Tokens per KV page (the worker's usual page size).
const BLOCK_SIZE: u32 = 16;
/// `max_num_seqs` in every case: the engine's default batch limit.
const MAX_NUM_SEQS: usize = deltaserve_sched::DEFAULT_MAX_NUM_SEQS;
/// Prompt length of each running request.
const RUNNING_PROMPT_TOKENS: u32 = 128;
/// Steady decode steps a copy of the starting state can take before it is replaced; a multiple
/// of `BLOCK_SIZE`, so whole page cycles are timed. Sets the running requests' `max_tokens`
/// and the pool size (every running request can grow this far without preemption).
const STEPS_PER_COPY: u32 = 4096;
/// Upper bound on the tokens a running request generates during setup (its prefill samples
/// one; admission of 256 requests at 2048 tokens per step takes 16 steps).
const SETUP_TOKENS: u32 = 64;
/// `max_tokens` of each running request: never reached while a copy is in use.
const RUNNING_MAX_TOKENS: u32 = STEPS_PER_COPY + SETUP_TOKENS;
/// Prompt length of each waiting request.
const WAITING_PROMPT_TOKENS: u32 = 64;
/// `max_tokens` of each waiting request.
const WAITING_MAX_TOKENS: u32 = 16;
/// Pool pages of one LoRA adapter: a Llama-2-7B rank-16 adapter on all seven projections
/// takes 11 pages in the worker's layout (`bench/README.md`, adapter load table).
const ADAPTER_PAGES: u32 = 11;
/// Host bytes of one LoRA adapter's host copy (that adapter: 76.2 MiB).
const ADAPTER_HOST_BYTES: u64 = 80 << 20;
/// Id of the oversized cold adapter every waiting request names (above any variant's id).
const BLOCKING_ADAPTER: u32 = 1_000_000;
/// Seed of the arrival order of the variants' requests (the same in every run).
const SHUFFLE_SEED: u64 = 6;
/// The token every request "samples"; no request has EOS ids, and all ignore EOS anyway.
const TOKEN: u32 = 7;

/// One benchmark case.
#[derive(Debug, Clone, Copy)]
struct Case {
    /// Requests running (decoding) in the steady state.
    running: usize,
    /// Requests waiting that cannot be admitted.
    waiting: usize,
    /// Distinct LoRA adapters among the running requests (0 = all on the base model).
    variants: u32,
    /// Prefix caching on: every request has the same prompt (the running ones hit the first
    /// one's pages) and, decoding the same token, fills pages whose hash is already cached.
    prefix_caching: bool,
}

/// A case's starting state and what its steady steps must look like.
struct Fixture {
    /// The scheduler after setup: `case.running` requests decoding, `case.waiting` refused.
    start: Scheduler,
    /// The case it was built for (checked after every timed span).
    case: Case,
    /// Steps a copy of `start` takes before it is replaced: whole page cycles, checked during
    /// setup to stay short of every running request's `max_tokens`.
    steps_per_copy: u32,
}

/// The copy of the starting state the timed steps run on.
struct Live {
    /// The scheduler being stepped.
    sched: Scheduler,
    /// Steps this copy may still take.
    steps_left: u32,
    /// The worker's outputs for the step, reused from step to step.
    outputs: Vec<(u64, Option<u32>)>,
}

/// Pages one request of `tokens` prompt tokens and `max_tokens` outputs can ever hold.
fn max_pages(tokens: u32, max_tokens: u32) -> u32 {
    (tokens + max_tokens - 1).div_ceil(BLOCK_SIZE)
}

/// A request of `prompt_tokens` prompt tokens that runs to `max_tokens` (ignores EOS).
fn request(
    id: u64,
    prompt_tokens: u32,
    max_tokens: u32,
    arrival: u64,
    adapter_id: u32,
) -> SeqRequest {
    SeqRequest {
        id,
        prompt: (0..prompt_tokens).map(|t| t % 32_000).collect(),
        max_tokens,
        eos_token_ids: Vec::new(),
        ignore_eos: true,
        arrival,
        adapter_id,
        skip_prefix_cache: false,
    }
}

/// `0..n` in a random order fixed by `seed` (Fisher-Yates over a SplitMix64 stream).
fn shuffled(n: u32, seed: u64) -> Vec<u32> {
    let mut state = seed;
    let mut next = move || {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    let mut v: Vec<u32> = (0..n).collect();
    for i in (1..v.len()).rev() {
        v.swap(i, (next() % (i as u64 + 1)) as usize);
    }
    v
}

/// One engine iteration: form a step, then report a sampled token for every request in it.
fn step(sched: &mut Scheduler, outputs: &mut Vec<(u64, Option<u32>)>) -> usize {
    let planned = sched.schedule();
    outputs.clear();
    outputs.extend(planned.new.iter().map(|n| (n.id, Some(TOKEN))));
    outputs.extend(planned.running.iter().map(|r| (r.id, Some(TOKEN))));
    sched.update(outputs).len()
}

/// Panics unless `sched` is still in the steady state of `case` (`what` says when).
fn check_steady(sched: &Scheduler, case: Case, what: &str) {
    let stats = sched.stats();
    assert!(
        stats.running == case.running
            && stats.waiting == case.waiting
            && stats.num_preemptions == 0
            && stats.num_finished == 0,
        "{case:?} {what}: left the steady state: {stats:?}"
    );
}

/// Builds the starting state of `case` (see the module docs) and checks, on a copy, that a
/// step from it is the steady one: every running request decodes one token, nothing is
/// admitted, no adapter moves.
fn fixture(case: Case) -> Fixture {
    let running = case.running as u32;
    let kv_pages = running * max_pages(RUNNING_PROMPT_TOKENS, RUNNING_MAX_TOKENS);
    let waiting_pages = max_pages(WAITING_PROMPT_TOKENS, WAITING_MAX_TOKENS);
    // Every running request can reach max_tokens and every variant stay resident, so the pool
    // never runs out; the extra pages let one waiting request plus the blocking adapter fit
    // an empty pool (add_request's check).
    let num_blocks = kv_pages + case.variants * ADAPTER_PAGES + waiting_pages;
    let cfg = SchedulerConfig {
        max_num_seqs: MAX_NUM_SEQS,
        enable_prefix_caching: case.prefix_caching,
        ..SchedulerConfig::new(
            BLOCK_SIZE,
            num_blocks,
            RUNNING_PROMPT_TOKENS + RUNNING_MAX_TOKENS,
        )
    };
    let mut sched = Scheduler::new(cfg).expect("benchmark config is valid");
    for a in 1..=case.variants {
        let spec = VariantSpec {
            kind: VariantKind::Lora,
            num_blocks: ADAPTER_PAGES,
            host_bytes: ADAPTER_HOST_BYTES,
            path: format!("/adapters/variant-{a}"),
        };
        sched.register_adapter(a, spec).expect("variant fits");
    }
    // Each variant serves running / variants requests, in a shuffled arrival order (sorted
    // or round-robin orders would make the step's grouping by adapter unrealistically cheap).
    let slots = shuffled(case.running as u32, SHUFFLE_SEED);
    for i in 0..case.running as u64 {
        let adapter = match case.variants {
            0 => 0,
            v => slots[i as usize] % v + 1,
        };
        let req = request(i, RUNNING_PROMPT_TOKENS, RUNNING_MAX_TOKENS, i, adapter);
        sched.add_request(req).expect("running request fits");
    }
    let mut outputs = Vec::new();
    for _ in 0..SETUP_TOKENS / 2 {
        if sched.stats().running == case.running {
            break;
        }
        step(&mut sched, &mut outputs);
    }
    if case.waiting > 0 {
        let spec = VariantSpec {
            kind: VariantKind::Lora,
            num_blocks: num_blocks - waiting_pages,
            host_bytes: ADAPTER_HOST_BYTES,
            path: "/adapters/blocking".to_string(),
        };
        sched
            .register_adapter(BLOCKING_ADAPTER, spec)
            .expect("blocking adapter fits the pool");
        for i in 0..case.waiting as u64 {
            let id = case.running as u64 + i;
            let req = request(
                id,
                WAITING_PROMPT_TOKENS,
                WAITING_MAX_TOKENS,
                id,
                BLOCKING_ADAPTER,
            );
            sched.add_request(req).expect("waiting request fits");
        }
    }
    // Finish every prefill and prefetch the blocking adapter's host copy.
    step(&mut sched, &mut outputs);
    check_steady(&sched, case, "after setup");

    let mut probe = sched.clone();
    let planned = probe.schedule();
    assert!(
        planned.new.is_empty()
            && planned.adapter_ops.is_empty()
            && planned.running.len() == case.running
            && planned.running.iter().all(|r| r.num_scheduled_tokens == 1),
        "{case:?}: the first timed step would not be a steady decode step: {} new, {} running, ops {:?}",
        planned.new.len(),
        planned.running.len(),
        planned.adapter_ops
    );
    if case.variants > 0 {
        assert_eq!(
            sched.stats().adapters_on_gpu,
            case.variants as usize,
            "{case:?}: every variant must be resident"
        );
    }
    let generated = (0..case.running as u64)
        .map(|id| sched.output_tokens(id).expect("running").len() as u32)
        .max()
        .unwrap_or(0);
    // A request finishes on its max_tokens-th token: a copy must stay one step short of it.
    let room = RUNNING_MAX_TOKENS - generated - 1;
    assert!(
        room >= STEPS_PER_COPY,
        "{case:?}: setup generated {generated} tokens"
    );
    sched
        .check_invariants()
        .unwrap_or_else(|e| panic!("{case:?}: broken invariant after setup: {e}"));
    Fixture {
        start: sched,
        case,
        steps_per_copy: STEPS_PER_COPY,
    }
}

/// Times `iters` consecutive steady iterations, continuing on `live` (the copy left by the
/// previous sample) and replacing it with a fresh copy of `fx.start` whenever it runs out of
/// steps; cloning, dropping and checking are outside the timed spans.
fn time_steps(fx: &Fixture, live: &mut Option<Live>, iters: u64) -> Duration {
    let mut elapsed = Duration::ZERO;
    let mut left = iters;
    while left > 0 {
        if live.as_ref().is_none_or(|l| l.steps_left == 0) {
            let fresh = Live {
                sched: fx.start.clone(),
                steps_left: fx.steps_per_copy,
                outputs: Vec::with_capacity(fx.case.running),
            };
            drop(live.replace(fresh));
        }
        let l = live.as_mut().expect("filled above");
        let n = left.min(u64::from(l.steps_left));
        let t0 = Instant::now();
        for _ in 0..n {
            black_box(step(&mut l.sched, &mut l.outputs));
        }
        elapsed += t0.elapsed();
        l.steps_left -= n as u32;
        left -= n;
        check_steady(&l.sched, fx.case, "after a timed span");
    }
    elapsed
}

/// Benchmarks every case of `cases` in group `name`, labelled by `label`.
fn run_group(c: &mut Criterion, name: &str, cases: &[Case], label: fn(&Case) -> String) {
    let mut group = c.benchmark_group(name);
    for &case in cases {
        let fx = fixture(case);
        let mut live = None;
        group.bench_function(BenchmarkId::from_parameter(label(&case)), |b| {
            b.iter_custom(|iters| time_steps(&fx, &mut live, iters))
        });
    }
    group.finish();
}

/// The `queue` group: running requests × waiting requests, all on the base model.
fn queue(c: &mut Criterion) {
    let mut cases = Vec::new();
    for running in [1, 16, 64, 256] {
        for waiting in [0, 1_000, 10_000] {
            cases.push(Case {
                running,
                waiting,
                variants: 0,
                prefix_caching: false,
            });
        }
    }
    run_group(c, "queue", &cases, |c| {
        format!("running={}/waiting={}", c.running, c.waiting)
    });
}

/// The `variants` group: 256 running requests over 0 (base) to 256 distinct adapters.
fn variants(c: &mut Criterion) {
    let cases: Vec<Case> = [0, 1, 8, 32, 256]
        .into_iter()
        .map(|variants| Case {
            running: 256,
            waiting: 0,
            variants,
            prefix_caching: false,
        })
        .collect();
    run_group(c, "variants", &cases, |c| {
        format!("running=256/variants={}", c.variants)
    });
}

/// The `prefix` group: `queue`'s 256-running cases with prefix caching on (every page a
/// decoding request fills is hashed and published, or found cached already; the blocked head
/// of the queue is looked up every step).
fn prefix(c: &mut Criterion) {
    let cases: Vec<Case> = [0, 1_000]
        .into_iter()
        .map(|waiting| Case {
            running: 256,
            waiting,
            variants: 0,
            prefix_caching: true,
        })
        .collect();
    run_group(c, "prefix", &cases, |c| {
        format!("running=256/waiting={}", c.waiting)
    });
}

criterion_group! {
    name = benches;
    // 19 cases: short warm-up and measurement keep a full run (and `--quick`) to minutes.
    config = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    targets = queue, variants, prefix
}
criterion_main!(benches);
