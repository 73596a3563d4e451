//! The engine's metrics, declared once.
//!
//! [`engine_metrics!`] below is THE table of engine gauges and counters. One row names a metric
//! (`deltaserve_<row>` in `GET /metrics`), its Prometheus type, how two workers' values merge,
//! where an actor reads it, and its help text. From the table come:
//!
//! - [`EngineMetrics`], the snapshot struct (one `u64` field per row);
//! - [`EngineMetrics::of_worker`], one actor's snapshot from its scheduler and counters;
//! - [`EngineMetrics::merge`], the sum over workers (counters and most gauges add; the step
//!   gap percentiles take the largest worker's);
//! - [`families`], the Prometheus families that `prometheus`'s text encoder writes.
//!
//! A new metric is one row. Besides the table, the request latency histograms
//! ([`RequestLatency`]) are observed by the actors as each request's events happen and shared
//! by all of them, so they need no merge.

use std::collections::VecDeque;
use std::time::Duration;

use deltaserve_sched::SchedStats;
use prometheus::core::Collector;
use prometheus::proto::MetricFamily;
use prometheus::{Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts};

/// Every engine metric's name starts with this.
pub const PREFIX: &str = "deltaserve_";

/// How many recent step gaps the percentile metrics look at.
const GAP_WINDOW: usize = 4096;

/// Prometheus metric type of a row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Only goes up (until a worker restart resets its scheduler's counts).
    Counter,
    /// A current level.
    Gauge,
}

/// How a row's values from two workers combine into the engine's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Merge {
    /// Added up.
    Sum,
    /// The largest (a percentile: the slowest worker's).
    Max,
}

impl Merge {
    fn apply(self, a: u64, b: u64) -> u64 {
        match self {
            Merge::Sum => a + b,
            Merge::Max => a.max(b),
        }
    }
}

/// One row of the table, for code that walks it.
#[derive(Debug, Clone, Copy)]
pub struct MetricRow {
    /// The name without [`PREFIX`].
    pub name: &'static str,
    pub kind: Kind,
    pub merge: Merge,
    /// The `# HELP` text.
    pub help: &'static str,
}

impl MetricRow {
    /// The row's family with `value`.
    fn family(&self, value: u64) -> Vec<MetricFamily> {
        let name = format!("{PREFIX}{}", self.name);
        match self.kind {
            Kind::Counter => {
                let c =
                    IntCounter::new(name, self.help).expect("table rows are valid metric names");
                c.inc_by(value);
                c.collect()
            }
            Kind::Gauge => {
                let g = IntGauge::new(name, self.help).expect("table rows are valid metric names");
                g.set(i64::try_from(value).unwrap_or(i64::MAX));
                g.collect()
            }
        }
    }
}

/// What one actor's row sources read: its scheduler's stats and the actor's own counters.
pub(super) struct WorkerReadings<'a> {
    pub sched: SchedStats,
    pub actor: &'a ActorCounters,
    pub latency: &'a RequestLatency,
    /// Admission control's readings (`admission.rs`).
    pub admission: super::admission::AdmissionReadings,
    /// Placement's counters (`placement_load.rs`).
    pub placement: super::placement_load::PlacementReadings,
}

/// Declares the table (see the module docs). Row syntax:
/// `name: Kind, Merge, |w| <u64 from w: &WorkerReadings>, "help";`
macro_rules! engine_metrics {
    ($(
        $name:ident: $kind:ident, $merge:ident, |$w:ident| $source:expr,
            $help:literal;
    )*) => {
        /// A snapshot of the engine's gauges and counters (one worker's, or merged over
        /// workers), and the request latency histograms.
        #[derive(Debug, Clone, Default)]
        pub struct EngineMetrics {
            $( #[doc = $help] pub $name: u64, )*
            /// Request latency histograms, shared by every actor.
            pub latency: RequestLatency,
        }

        /// The table's rows, in `/metrics` order.
        pub const ENGINE_METRICS: &[MetricRow] = &[$(
            MetricRow {
                name: stringify!($name),
                kind: Kind::$kind,
                merge: Merge::$merge,
                help: $help,
            },
        )*];

        impl EngineMetrics {
            /// One worker's snapshot.
            pub(super) fn of_worker(readings: &WorkerReadings<'_>) -> Self {
                Self {
                    $( $name: {
                        #[allow(unused_variables)]
                        let $w = readings;
                        $source
                    }, )*
                    latency: readings.latency.clone(),
                }
            }

            /// Folds `other` (another worker's snapshot) in, row by row. The histograms are
            /// shared by every actor, so the merged snapshot keeps `other`'s.
            pub fn merge(&mut self, other: &Self) {
                $( self.$name = Merge::$merge.apply(self.$name, other.$name); )*
                self.latency = other.latency.clone();
            }

            /// The values in table order.
            pub fn values(&self) -> Vec<u64> {
                vec![$( self.$name ),*]
            }
        }
    };
}

engine_metrics! {
    requests_waiting: Gauge, Sum, |w| w.sched.waiting as u64,
        "Requests queued, not yet running.";
    requests_running: Gauge, Sum, |w| w.sched.running as u64,
        "Requests in the running batch.";
    kv_blocks_total: Gauge, Sum, |w| w.sched.total_blocks as u64,
        "KV cache pages in the pool.";
    kv_blocks_free: Gauge, Sum, |w| w.sched.free_blocks as u64,
        "KV cache pages free (prefix-cache pages no request holds included: they are evicted when needed).";
    steps_total: Counter, Sum, |w| w.actor.steps,
        "Engine steps run.";
    steps_ahead_total: Counter, Sum, |w| w.actor.steps_ahead,
        "Steps sent before the previous step's output was back (overlapped steps).";
    preemptions_total: Counter, Sum, |w| w.actor.preemptions,
        "Requests preempted to free KV pages.";
    requests_finished_total: Counter, Sum, |w| w.actor.finished,
        "Requests that ended (stop or length).";
    requests_aborted_total: Counter, Sum, |w| w.actor.aborted,
        "Requests cancelled by their client.";
    tokens_generated_total: Counter, Sum, |w| w.actor.tokens,
        "Output tokens generated.";
    step_gap_us_p50: Gauge, Max, |w| w.actor.gaps.percentile(0.5),
        "Median router + IPC gap between worker steps, microseconds.";
    step_gap_us_p99: Gauge, Max, |w| w.actor.gaps.percentile(0.99),
        "99th percentile router + IPC gap between worker steps, microseconds.";
    step_router_us_p50: Gauge, Max, |w| w.actor.router_us.percentile(0.5),
        "Median time from a worker's step output to the router sending the next plan, microseconds (the router's share of the gap).";
    step_router_us_p99: Gauge, Max, |w| w.actor.router_us.percentile(0.99),
        "99th percentile of the router's share of the step gap, microseconds.";
    worker_restarts_total: Counter, Sum, |w| w.actor.restarts,
        "Worker processes restarted.";
    // The registry's count: actors report 0, the engine handle starts the sum with it.
    adapters_registered: Gauge, Sum, |w| 0,
        "Variants (LoRA adapters and compressed deltas) registered and selectable.";
    adapters_on_gpu: Gauge, Sum, |w| w.sched.adapters_on_gpu as u64,
        "LoRA adapters whose weights are in a GPU pool.";
    adapter_blocks: Gauge, Sum, |w| w.sched.adapter_blocks as u64,
        "Pool pages holding adapter weights (the other used pages hold KV).";
    adapter_host_bytes: Gauge, Sum, |w| w.sched.host_adapter_bytes,
        "Host-memory bytes of adapter copies, as the schedulers account them.";
    adapter_host_bytes_measured: Gauge, Sum, |w| w.actor.adapter_host_bytes_measured,
        "Host-memory bytes of adapter copies, as the workers measured them after their last step.";
    adapter_gpu_loads_total: Counter, Sum, |w| w.sched.adapter_gpu_loads,
        "Adapter copies from host memory onto the GPU (LoRA pool pages or delta slots).";
    adapter_host_loads_total: Counter, Sum, |w| w.sched.adapter_host_loads,
        "Adapter reads (LoRA and delta) from disk into host memory.";
    adapter_gpu_evictions_total: Counter, Sum, |w| w.sched.adapter_gpu_evictions,
        "Adapters evicted from the GPU to make room (LoRA pool pages or delta slots).";
    adapter_host_deferrals_total: Counter, Sum, |w| w.sched.host_deferrals,
        "Times a waiting request was passed over for a step because its adapter's host read was still running (it keeps its place).";
    adapter_gpu_load_deferrals_total: Counter, Sum, |w| w.sched.gpu_load_deferrals,
        "Times a waiting request was passed over for a step because its delta was still being copied onto the GPU beside the steps (it keeps its place).";
    worker_step_us_total: Counter, Sum, |w| w.actor.worker_step_us,
        "Worker time of the steps run (plan decoded to output encoded), microseconds.";
    worker_forward_us_total: Counter, Sum, |w| w.actor.worker_forward_us,
        "The forward-and-sampling part of that worker time, microseconds (the rest: adapter ops, waits for adapter loads included, and batch building).";
    worker_floor_us_total: Counter, Sum, |w| w.actor.worker_floor_us,
        "Floor of the steps run (the worker's roofline: bytes read / measured copy bandwidth or FLOPs / measured matmul peak, the larger), microseconds; worker_busy_us_total / this is the served-step efficiency.";
    worker_busy_us_total: Counter, Sum, |w| w.actor.worker_busy_us,
        "Worker time on the steps alone, microseconds: each step from the later of its plan decoded and the previous output encoded to its output encoded (a step launched behind the one in flight does not count that wait, as worker_step_us_total does).";
    deltas_on_gpu: Gauge, Sum, |w| w.sched.deltas_on_gpu as u64,
        "Compressed deltas in the workers' delta slots (at most --max-deltas per worker).";
    delta_skips_total: Counter, Sum, |w| w.sched.delta_skips,
        "Requests admitted past a blocked queue head because their delta was already running (DeltaZip's skip-the-line).";
    delta_skip_preemptions_total: Counter, Sum, |w| w.sched.delta_skip_preemptions,
        "Skip-the-line requests preempted (recomputed later) because their delta's last in-order request left.";
    cpu_assisted_prefills_total: Counter, Sum, |w| w.actor.cpu_assisted_prefills,
        "Cold prefills whose LoRA the workers' CPU helpers computed while the adapter's pages loaded (--cpu-lora-helpers).";
    cpu_assist_fallbacks_total: Counter, Sum, |w| w.actor.cpu_assist_fallbacks,
        "CPU-assisted prefills where a helper failed or stalled, so the worker computed its rows itself.";
    cpu_assist_declined_total: Counter, Sum, |w| w.actor.cpu_assist_declined,
        "Cold prefills the CPU helpers did not take (none free, predicted no faster than the load, one-token prefill).";
    zoo_speculated_prefills_total: Counter, Sum, |w| w.actor.speculated_prefills,
        "Cold delta prefills that ran a surrogate block while the delta loaded (DELTASERVE_BLOCK_SPECULATION; tokens stay exact).";
    zoo_speculation_accepted_total: Counter, Sum, |w| w.actor.speculation_accepted,
        "Speculated prefills whose real block's output had cosine >= 0.95 with the surrogate's (BlockLLM's criterion).";
    zoo_speculation_recomputed_layers_total: Counter, Sum, |w| w.actor.speculation_recomputed_layers,
        "Layers rerun (their KV rewritten) after speculated blocks, summed over prefills.";
    admission_refused_ttft_total: Counter, Sum, |w| w.admission.refused_ttft,
        "Requests refused at once (429) because their predicted time to first token exceeded the TTFT SLO (--ttft-slo-ms).";
    admission_refused_queue_full_total: Counter, Sum, |w| w.admission.refused_queue_full,
        "Requests refused at once (429) because --max-queued-per-worker requests were queued or running.";
    admission_expired_in_queue_total: Counter, Sum, |w| w.actor.expired_in_queue,
        "Admitted requests answered 429 while still queued because they had waited past the TTFT SLO (--ttft-slo-ms): their first token could no longer come in time (S-LoRA's early abort).";
    admission_predicted_wait_us: Gauge, Max, |w| w.admission.predicted_queue_wait_us,
        "Predicted time for the queued requests to start (admission control's estimate), microseconds; the longest worker's.";
    admission_running_cap: Gauge, Sum, |w| w.admission.running_cap,
        "Running-batch cap that keeps the measured decode step within the TPOT SLO (--tpot-slo-ms).";
    placement_decisions_total: Counter, Sum, |w| w.placement.placed,
        "Requests placed on a worker by --placement (with one worker: every request).";
    placement_over_slo_total: Counter, Sum, |w| w.placement.placed_over_slo,
        "Requests placed where the latency model predicted a decode step past the TPOT SLO (--tpot-slo-ms) on every worker with room.";
    admission_queued_requests: Gauge, Sum, |w| w.admission.queued,
        "Admitted requests no step has scheduled yet.";
    admission_drain_per_s: Gauge, Sum, |w| w.admission.drain_per_s,
        "How fast the queue drains under backlog, requests per second (admission control's measurement; 0 before it is measured).";
    admission_effective_step_us: Gauge, Max, |w| w.admission.effective_step_us,
        "Admission control's estimate of the running batch's time per output token at its cap (decode step, mixed steps' fixed cost and joining prefills), microseconds; the largest worker's.";
    admission_mixed_step_overhead_us: Gauge, Max, |w| w.admission.mixed_step_overhead_us,
        "Admission control's estimate of a step's fixed cost for carrying a prefill (beyond its decodes), microseconds; the largest worker's.";
    admission_prefill_ns_per_token: Gauge, Max, |w| w.admission.prefill_ns_per_token,
        "Admission control's estimate of a prefill's cost per prompt token, nanoseconds; the largest worker's.";
    prefix_cache_queried_tokens_total: Counter, Sum, |w| w.sched.prefix_queried_tokens,
        "Prompt tokens of admitted requests looked up in the prefix cache (--enable-prefix-caching); hit_tokens / this is the hit rate.";
    prefix_cache_hit_tokens_total: Counter, Sum, |w| w.sched.prefix_hit_tokens,
        "Looked-up prompt tokens whose KV pages were cached (same variant registration), so not computed.";
    prefix_cache_cached_pages: Gauge, Sum, |w| w.sched.prefix_cached_blocks as u64,
        "KV pages in the prefix cache, held by running requests or kept for later hits.";
    prefix_cache_evicted_pages_total: Counter, Sum, |w| w.sched.prefix_evicted_blocks,
        "Prefix-cache pages no request held, evicted (least recently released first) to be handed out again.";
    prefix_cache_deferrals_total: Counter, Sum, |w| w.sched.prefix_deferrals,
        "Times a waiting request was passed over for a step to reuse prefix pages a running request was computing (the n choices of a request share one prefill).";
}

/// The Prometheus families of a snapshot: the table's rows in order, then the histograms.
pub fn families(m: &EngineMetrics) -> Vec<MetricFamily> {
    let mut out: Vec<MetricFamily> = ENGINE_METRICS
        .iter()
        .zip(m.values())
        .flat_map(|(row, value)| row.family(value))
        .collect();
    out.extend(m.latency.families());
    out
}

/// A counter family with one sample per `(label value, count)`, in the order given.
pub fn labeled_counter(
    name: &str,
    help: &str,
    label: &str,
    counts: &[(&str, u64)],
) -> MetricFamily {
    let vec = IntCounterVec::new(Opts::new(name, help), &[label]).expect("a valid metric name");
    for (value, count) in counts {
        vec.with_label_values(&[*value]).inc_by(*count);
    }
    let mut family = vec.collect().remove(0);
    family.mut_metric().sort_by_key(|m| {
        counts
            .iter()
            .position(|(v, _)| m.get_label().first().map(|l| l.value()) == Some(*v))
    });
    family
}

/// Prometheus text format 0.0.4 of `families`.
pub fn text(families: &[MetricFamily]) -> String {
    let mut out = String::new();
    prometheus::TextEncoder::new()
        .encode_utf8(families, &mut out)
        .expect("encoding into a String cannot fail");
    out
}

/// Per-request latency histograms, in seconds, observed by the actors (see `streams.rs`).
/// Clones share the same histograms.
#[derive(Debug, Clone)]
pub struct RequestLatency {
    /// Request accepted by the engine → its first token sent to the client.
    pub time_to_first_token: Histogram,
    /// (last token − first token) / (tokens − 1), per request of at least two tokens.
    pub time_per_output_token: Histogram,
    /// Request accepted → finished (stop or length).
    pub e2e_request_latency: Histogram,
    /// Request accepted → first scheduled in a step.
    pub request_queue_time: Histogram,
}

impl Default for RequestLatency {
    fn default() -> Self {
        let histogram = |name: &str, help: &str, buckets: &[f64]| {
            Histogram::with_opts(
                HistogramOpts::new(format!("{PREFIX}{name}"), help).buckets(buckets.to_vec()),
            )
            .expect("valid histogram names and buckets")
        };
        Self {
            time_to_first_token: histogram(
                "time_to_first_token_seconds",
                "Time from a request's arrival at the engine to its first output token, seconds.",
                &[
                    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                    30.0, 60.0, 120.0, 300.0,
                ],
            ),
            time_per_output_token: histogram(
                "time_per_output_token_seconds",
                "Mean time between a request's output tokens after the first, seconds (requests of two or more tokens).",
                &[
                    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25,
                    0.5, 1.0, 2.5,
                ],
            ),
            e2e_request_latency: histogram(
                "e2e_request_latency_seconds",
                "Time from a request's arrival at the engine to its end (stop or length), seconds.",
                &[
                    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
                    300.0, 600.0,
                ],
            ),
            request_queue_time: histogram(
                "request_queue_time_seconds",
                "Time from a request's arrival at the engine to its first step, seconds.",
                &[
                    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                    0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
                ],
            ),
        }
    }
}

impl RequestLatency {
    /// The four histogram families.
    fn families(&self) -> Vec<MetricFamily> {
        [
            &self.time_to_first_token,
            &self.time_per_output_token,
            &self.e2e_request_latency,
            &self.request_queue_time,
        ]
        .into_iter()
        .flat_map(|h| h.collect())
        .collect()
    }

    /// Observes a request's end: its end-to-end latency, and its time per output token from
    /// the first token's time (`first_token_after`) over `tokens` tokens.
    pub(super) fn request_finished(
        &self,
        total: Duration,
        first_token_after: Option<Duration>,
        tokens: u32,
    ) {
        self.e2e_request_latency.observe(total.as_secs_f64());
        if let Some(first) = first_token_after {
            if tokens >= 2 {
                let decode = total.saturating_sub(first).as_secs_f64();
                self.time_per_output_token
                    .observe(decode / f64::from(tokens - 1));
            }
        }
    }
}

/// Counters an actor keeps itself (the rest come from its scheduler's [`SchedStats`]).
#[derive(Default)]
pub(super) struct ActorCounters {
    pub steps: u64,
    /// Steps formed by `schedule_ahead` (sent while another was outstanding).
    pub steps_ahead: u64,
    pub finished: u64,
    pub aborted: u64,
    pub tokens: u64,
    pub preemptions: u64,
    pub restarts: u64,
    /// Recent `gap_us` values reported by the worker.
    pub gaps: Window,
    /// Recent router shares of the gap: output decoded → next plan sent, in microseconds.
    pub router_us: Window,
    /// The worker's measured host bytes of adapter copies, from its last step output.
    pub adapter_host_bytes_measured: u64,
    /// Sum of the worker's reported step times (`total_us`), microseconds.
    pub worker_step_us: u64,
    /// Sum of their forward-and-sampling parts (`forward_us`), microseconds.
    pub worker_forward_us: u64,
    /// Sum of the steps' floors (`floor_us`), microseconds.
    pub worker_floor_us: u64,
    /// Sum of the worker's time on the steps alone (`busy_us`), microseconds.
    pub worker_busy_us: u64,
    /// Sum of the worker's `cpu_assisted_prefills`.
    pub cpu_assisted_prefills: u64,
    /// Sum of the worker's `cpu_assist_fallbacks`.
    pub cpu_assist_fallbacks: u64,
    /// Sum of the worker's `cpu_assist_declined`.
    pub cpu_assist_declined: u64,
    /// Sum of the worker's `speculated_prefills`.
    pub speculated_prefills: u64,
    /// Sum of the worker's `speculation_accepted`.
    pub speculation_accepted: u64,
    /// Sum of the worker's `speculation_recomputed_layers`.
    pub speculation_recomputed_layers: u64,
    /// Queued requests aborted because they waited past the TTFT SLO (`actor/expired.rs`).
    pub expired_in_queue: u64,
}

/// The last [`GAP_WINDOW`] samples of a latency, for percentiles.
#[derive(Default)]
pub(super) struct Window(VecDeque<u64>);

impl Window {
    pub fn push(&mut self, v: u64) {
        if self.0.len() == GAP_WINDOW {
            self.0.pop_front();
        }
        self.0.push_back(v);
    }

    /// Percentile `p` (in 0..=1) by nearest rank; 0 when empty.
    pub fn percentile(&self, p: f64) -> u64 {
        let mut v: Vec<u64> = self.0.iter().copied().collect();
        v.sort_unstable();
        if v.is_empty() {
            0
        } else {
            v[((v.len() - 1) as f64 * p).round() as usize]
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every metric `GET /metrics` served before the table existed, with its type (the
    /// benchmarks and end-to-end tests scrape them by these names).
    const NAMES_BEFORE_THE_TABLE: &[(&str, &str)] = &[
        ("requests_waiting", "gauge"),
        ("requests_running", "gauge"),
        ("kv_blocks_total", "gauge"),
        ("kv_blocks_free", "gauge"),
        ("steps_total", "counter"),
        ("steps_ahead_total", "counter"),
        ("preemptions_total", "counter"),
        ("requests_finished_total", "counter"),
        ("requests_aborted_total", "counter"),
        ("tokens_generated_total", "counter"),
        ("step_gap_us_p50", "gauge"),
        ("step_gap_us_p99", "gauge"),
        ("step_router_us_p50", "gauge"),
        ("step_router_us_p99", "gauge"),
        ("worker_restarts_total", "counter"),
        ("adapters_registered", "gauge"),
        ("adapters_on_gpu", "gauge"),
        ("adapter_blocks", "gauge"),
        ("adapter_host_bytes", "gauge"),
        ("adapter_host_bytes_measured", "gauge"),
        ("adapter_gpu_loads_total", "counter"),
        ("adapter_host_loads_total", "counter"),
        ("adapter_gpu_evictions_total", "counter"),
        ("adapter_host_deferrals_total", "counter"),
        ("adapter_gpu_load_deferrals_total", "counter"),
        ("worker_step_us_total", "counter"),
        ("worker_forward_us_total", "counter"),
        ("worker_floor_us_total", "counter"),
        ("worker_busy_us_total", "counter"),
        ("deltas_on_gpu", "gauge"),
        ("delta_skips_total", "counter"),
        ("delta_skip_preemptions_total", "counter"),
        ("cpu_assisted_prefills_total", "counter"),
        ("cpu_assist_fallbacks_total", "counter"),
        ("cpu_assist_declined_total", "counter"),
        ("zoo_speculated_prefills_total", "counter"),
        ("zoo_speculation_accepted_total", "counter"),
        ("zoo_speculation_recomputed_layers_total", "counter"),
        ("admission_refused_ttft_total", "counter"),
        ("admission_refused_queue_full_total", "counter"),
        ("admission_expired_in_queue_total", "counter"),
        ("admission_predicted_wait_us", "gauge"),
        ("admission_running_cap", "gauge"),
        ("placement_decisions_total", "counter"),
        ("placement_over_slo_total", "counter"),
        ("admission_queued_requests", "gauge"),
        ("admission_drain_per_s", "gauge"),
        ("admission_effective_step_us", "gauge"),
        ("admission_mixed_step_overhead_us", "gauge"),
        ("admission_prefill_ns_per_token", "gauge"),
        ("prefix_cache_queried_tokens_total", "counter"),
        ("prefix_cache_hit_tokens_total", "counter"),
        ("prefix_cache_cached_pages", "gauge"),
        ("prefix_cache_evicted_pages_total", "counter"),
        ("prefix_cache_deferrals_total", "counter"),
    ];

    fn worker(sched: SchedStats, actor: &ActorCounters, latency: &RequestLatency) -> EngineMetrics {
        EngineMetrics::of_worker(&WorkerReadings {
            sched,
            actor,
            latency,
            admission: Default::default(),
            placement: Default::default(),
        })
    }

    #[test]
    fn the_text_has_every_old_name_with_its_type_in_the_old_order() {
        let m = EngineMetrics {
            steps_total: 12,
            kv_blocks_free: 7,
            ..Default::default()
        };
        let body = text(&families(&m));
        for (name, kind) in NAMES_BEFORE_THE_TABLE {
            assert!(
                body.contains(&format!("\n# TYPE deltaserve_{name} {kind}\n")),
                "{name} {kind} missing from\n{body}"
            );
        }
        assert!(body.contains("\ndeltaserve_steps_total 12\n"), "{body}");
        assert!(body.contains("\ndeltaserve_kv_blocks_free 7\n"), "{body}");
        let typed: Vec<&str> = body
            .lines()
            .filter_map(|l| l.strip_prefix("# TYPE deltaserve_"))
            .filter_map(|l| l.split(' ').next())
            .collect();
        let old: Vec<&str> = NAMES_BEFORE_THE_TABLE.iter().map(|(n, _)| *n).collect();
        assert_eq!(typed[..old.len()], old[..], "table order is /metrics order");
        assert_eq!(ENGINE_METRICS.len(), old.len());
    }

    #[test]
    fn two_workers_sum_counters_and_gauges_and_take_the_slowest_percentiles() {
        let latency = RequestLatency::default();
        let mut a = ActorCounters {
            steps: 10,
            tokens: 100,
            restarts: 1,
            adapter_host_bytes_measured: 5,
            ..Default::default()
        };
        let mut b = ActorCounters {
            steps: 3,
            tokens: 7,
            ..Default::default()
        };
        for v in [10, 20, 30] {
            a.gaps.push(v);
        }
        for v in [50, 60, 70] {
            b.gaps.push(v);
        }
        b.router_us.push(9);
        let sa = SchedStats {
            waiting: 2,
            running: 4,
            free_blocks: 6,
            total_blocks: 10,
            adapter_gpu_loads: 3,
            delta_skips: 1,
            gpu_load_deferrals: 2,
            prefix_hit_tokens: 32,
            prefix_cached_blocks: 5,
            ..Default::default()
        };
        let sb = SchedStats {
            waiting: 1,
            running: 0,
            free_blocks: 10,
            total_blocks: 10,
            adapter_gpu_loads: 4,
            gpu_load_deferrals: 5,
            prefix_hit_tokens: 16,
            prefix_cached_blocks: 2,
            ..Default::default()
        };
        let mut total = EngineMetrics {
            adapters_registered: 3,
            ..Default::default()
        };
        total.merge(&worker(sa, &a, &latency));
        total.merge(&worker(sb, &b, &latency));
        assert_eq!(total.requests_waiting, 3);
        assert_eq!(total.requests_running, 4);
        assert_eq!(total.kv_blocks_free, 16);
        assert_eq!(total.kv_blocks_total, 20);
        assert_eq!(total.steps_total, 13);
        assert_eq!(total.tokens_generated_total, 107);
        assert_eq!(total.worker_restarts_total, 1);
        assert_eq!(total.adapter_host_bytes_measured, 5);
        assert_eq!(total.adapter_gpu_loads_total, 7);
        assert_eq!(total.delta_skips_total, 1);
        assert_eq!(total.adapter_gpu_load_deferrals_total, 7);
        assert_eq!(
            total.adapters_registered, 3,
            "the registry's, not the actors'"
        );
        assert_eq!(total.step_gap_us_p50, 60, "the slower worker's median");
        assert_eq!(total.step_gap_us_p99, 70);
        assert_eq!(total.step_router_us_p50, 9);
        let body = text(&families(&total));
        assert!(body.contains("\ndeltaserve_steps_total 13\n"), "{body}");
        assert!(
            body.contains("\ndeltaserve_adapter_gpu_load_deferrals_total 7\n"),
            "{body}"
        );
        assert!(
            body.contains("\ndeltaserve_prefix_cache_hit_tokens_total 48\n"),
            "{body}"
        );
        assert!(
            body.contains("\ndeltaserve_prefix_cache_cached_pages 7\n"),
            "{body}"
        );
        assert!(body.contains("\ndeltaserve_step_gap_us_p50 60\n"), "{body}");
    }

    #[test]
    fn histograms_are_shared_and_exported() {
        let latency = RequestLatency::default();
        let seen_by_another_actor = latency.clone();
        latency.time_to_first_token.observe(0.02);
        latency.request_queue_time.observe(0.0003);
        seen_by_another_actor.request_finished(
            Duration::from_millis(300),
            Some(Duration::from_millis(100)),
            5,
        );
        // One token: an end-to-end time but no time per output token.
        latency.request_finished(
            Duration::from_millis(40),
            Some(Duration::from_millis(40)),
            1,
        );
        let m = EngineMetrics {
            latency,
            ..Default::default()
        };
        let body = text(&families(&m));
        for line in [
            "# TYPE deltaserve_time_to_first_token_seconds histogram",
            "deltaserve_time_to_first_token_seconds_bucket{le=\"0.01\"} 0",
            "deltaserve_time_to_first_token_seconds_bucket{le=\"0.025\"} 1",
            "deltaserve_time_to_first_token_seconds_count 1",
            "# TYPE deltaserve_time_per_output_token_seconds histogram",
            // (300 - 100) ms over 4 tokens after the first: 50 ms.
            "deltaserve_time_per_output_token_seconds_bucket{le=\"0.03\"} 0",
            "deltaserve_time_per_output_token_seconds_bucket{le=\"0.05\"} 1",
            "deltaserve_time_per_output_token_seconds_count 1",
            "# TYPE deltaserve_e2e_request_latency_seconds histogram",
            "deltaserve_e2e_request_latency_seconds_bucket{le=\"0.05\"} 1",
            "deltaserve_e2e_request_latency_seconds_bucket{le=\"0.5\"} 2",
            "deltaserve_e2e_request_latency_seconds_count 2",
            "# TYPE deltaserve_request_queue_time_seconds histogram",
            "deltaserve_request_queue_time_seconds_bucket{le=\"0.00025\"} 0",
            "deltaserve_request_queue_time_seconds_bucket{le=\"0.0005\"} 1",
            "deltaserve_request_queue_time_seconds_bucket{le=\"+Inf\"} 1",
        ] {
            assert!(body.contains(line), "{line:?} missing from\n{body}");
        }
        // Merging keeps the shared histograms.
        let mut total = EngineMetrics::default();
        total.merge(&m);
        assert_eq!(total.latency.e2e_request_latency.get_sample_count(), 2);
    }

    #[test]
    fn labeled_counters_keep_the_given_order() {
        let f = labeled_counter("x_total", "X.", "type", &[("b", 2), ("a", 0), ("c", 1)]);
        let body = text(&[f]);
        assert_eq!(
            body,
            "# HELP x_total X.\n# TYPE x_total counter\nx_total{type=\"b\"} 2\n\
             x_total{type=\"a\"} 0\nx_total{type=\"c\"} 1\n"
        );
    }

    #[test]
    fn window_percentiles_by_nearest_rank() {
        let mut w = Window::default();
        assert_eq!(w.percentile(0.5), 0);
        for v in (1..=100).rev() {
            w.push(v);
        }
        assert_eq!((w.percentile(0.5), w.percentile(0.99)), (51, 99));
        for _ in 0..GAP_WINDOW {
            w.push(7);
        }
        assert_eq!(
            w.percentile(0.99),
            7,
            "only the last GAP_WINDOW samples count"
        );
    }
}
