//! Times `schedule()` and `update()` with 256 requests decoding (the engine's steady state), on
//! the base model alone and spread round-robin over 32 LoRA adapters (grouping by adapter):
//! `cargo run --release -p deltaserve-sched --example bench_schedule`.

use std::time::Instant;

use deltaserve_sched::{AdapterSpec, Scheduler, SchedulerConfig, SeqRequest};

fn main() {
    bench(0);
    bench(32);
}

/// Runs the measurement with `num_adapters` adapters (0 = base requests only).
fn bench(num_adapters: u32) {
    let cfg = SchedulerConfig {
        block_size: 16,
        num_blocks: 65_536,
        max_num_seqs: 256,
        max_num_batched_tokens: 8192,
        max_model_len: 8192,
        host_adapter_bytes: deltaserve_sched::DEFAULT_HOST_ADAPTER_BYTES,
        prefetch_window: deltaserve_sched::DEFAULT_PREFETCH_WINDOW,
    };
    let mut s = Scheduler::new(cfg).expect("valid config");
    for a in 1..=num_adapters {
        let spec = AdapterSpec {
            num_blocks: 8,
            host_bytes: 1 << 20,
            path: format!("/adapters/{a}"),
        };
        s.register_adapter(a, spec).expect("fits");
    }
    for id in 0..256u64 {
        let prompt = (0..512u32).collect();
        let req = SeqRequest {
            id,
            prompt,
            max_tokens: 4096,
            eos_token_ids: vec![],
            ignore_eos: true,
            arrival: id,
            adapter_id: if num_adapters == 0 {
                0
            } else {
                id as u32 % num_adapters + 1
            },
        };
        s.add_request(req).expect("fits");
    }
    // Prefill everything (a few steps), then measure decode steps.
    let mut outs: Vec<(u64, Option<u32>)> = Vec::with_capacity(256);
    let run = |s: &mut Scheduler, outs: &mut Vec<(u64, Option<u32>)>| {
        let t0 = Instant::now();
        let st = s.schedule();
        let t1 = Instant::now();
        outs.clear();
        outs.extend(st.new.iter().map(|n| (n.id, Some(7))));
        outs.extend(st.running.iter().map(|r| (r.id, Some(7))));
        let t2 = Instant::now();
        let ups = s.update(outs);
        let t3 = Instant::now();
        (
            st.num_requests(),
            ups.len(),
            (t1 - t0).as_nanos(),
            (t3 - t2).as_nanos(),
        )
    };
    for _ in 0..20 {
        run(&mut s, &mut outs);
    }
    let steps = 2000;
    let (mut sched_ns, mut upd_ns) = (Vec::with_capacity(steps), Vec::with_capacity(steps));
    for _ in 0..steps {
        let (n, u, a, b) = run(&mut s, &mut outs);
        assert_eq!((n, u), (256, 256), "all 256 decode every step");
        sched_ns.push(a);
        upd_ns.push(b);
    }
    sched_ns.sort_unstable();
    upd_ns.sort_unstable();
    let p = |v: &[u128], q: f64| v[((v.len() - 1) as f64 * q) as usize] as f64 / 1000.0;
    println!(
        "256 decoding requests, {num_adapters} adapters, {steps} steps: schedule p50 {:.1} us p99 {:.1} us; update p50 {:.1} us p99 {:.1} us",
        p(&sched_ns, 0.5),
        p(&sched_ns, 0.99),
        p(&upd_ns, 0.5),
        p(&upd_ns, 0.99)
    );
}
