"""How much load the replay client (bench/replay.py) can offer: an open loop at a multiple of the
highest rate the serving experiments use (``serving.MAX_RATE``), prompt and output lengths U[8, 512]
as in the experiments, against a zero-delay fake server (bench/fake_server.py) in its own process.

The client, not the server, must never be the bound of a serving experiment: at 5× MAX_RATE the
measured throughput should equal the offered rate and the client's send lag (actual − scheduled
send time) should stay far below the latencies being measured. Those are wall-clock figures, so
they live here and not in the test suite (tests/bench/test_replay.py runs :func:`run_capacity` and checks
only what cannot depend on the machine's speed: every request completes with its full output).

    python -m bench.replay_capacity                 # 5× MAX_RATE for 3 s, writes results/replay_capacity-x5-cpu-DATE.json
    python -m bench.replay_capacity --factor 10 --duration 5 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import time

from bench import replay as rp
from bench import serving
from bench import workload as wl
from bench.launch import bench_env, module_command


def capacity_trace(factor: float = 5.0, duration: float = 3.0, seed: int = 9) -> wl.Trace:
    """S-LoRA's workload shape (10 variants, Poisson) at ``factor`` × MAX_RATE for ``duration`` s."""
    return wl.slora(10, 1.0, factor * serving.MAX_RATE, 1.0, duration, input_range=(8, 512),
                    output_range=(8, 512), seed=seed)  # fmt: skip


def run_capacity(trace: wl.Trace, protocol: str = "sse") -> tuple[list[rp.Record], float]:
    """Replays ``trace`` against a zero-delay fake server started in its own process; returns the
    records and the replay's wall time (s). The server is always stopped."""
    proc = subprocess.Popen(module_command("bench.fake_server", "--port", "0"), stdout=subprocess.PIPE, text=True,
                            env=bench_env())  # fmt: skip
    try:
        line = proc.stdout.readline()
        fields = line.split()
        if len(fields) < 4:
            raise RuntimeError(f"fake_server.py did not announce its address (printed {line!r})")
        url = fields[3]
        t0 = time.perf_counter()
        records = rp.run_replay(trace, url, protocol=protocol)
        return records, time.perf_counter() - t0
    finally:
        proc.terminate()
        proc.wait(10)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--factor", type=float, default=5.0, help="offered rate as a multiple of serving.MAX_RATE")
    p.add_argument("--duration", type=float, default=3.0, help="seconds of arrivals per run")
    p.add_argument("--repeats", type=int, default=3, help="runs (seeds 9, 10, ...)")
    p.add_argument("--protocol", choices=rp.PROTOCOLS, default="sse")
    p.add_argument("--no-write", action="store_true", help="print only; write no result file")
    a = p.parse_args()
    if a.factor <= 0 or a.duration <= 0 or a.repeats < 1:
        raise SystemExit("--factor and --duration must be positive and --repeats >= 1")

    runs = []
    for i in range(a.repeats):
        trace = capacity_trace(a.factor, a.duration, seed=9 + i)
        records, wall = run_capacity(trace, a.protocol)
        s = rp.summarize(records)
        offered = len(trace.requests) / trace.duration
        run = {
            "seed": 9 + i, "requests": len(trace.requests), "offered_req_s": offered, "wall_s": wall,
            "failed": s["failed"], "output_len_mismatch": s["output_len_mismatch"],
            "throughput_req_s": s["throughput_req_s"], "throughput_ratio": s["throughput_req_s"] / offered,
            "throughput_out_tok_s": s["throughput_out_tok_s"],
            "client_lag_ms": {k: v * 1e3 for k, v in s["client_lag_s"].items()},
            "ttft_p99_ms": s["ttft_s"]["p99"] * 1e3,
        }  # fmt: skip
        runs.append(run)
        print(f"seed {run['seed']}: {offered:.0f} req/s offered, {run['throughput_req_s']:.1f} req/s served "
              f"({run['throughput_ratio']:.3f}), {run['throughput_out_tok_s']:.0f} tok/s, lag p50 "
              f"{run['client_lag_ms']['p50']:.1f} / p99 {run['client_lag_ms']['p99']:.1f} ms, "
              f"failed {run['failed']}")  # fmt: skip
    if a.no_write:
        return
    from bench.common import write_result

    path = write_result(f"replay_capacity-x{a.factor:g}", {
        "device": "cpu", "host": {"cpus": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)),
                                  "machine": platform.machine(), "python": platform.python_version()},
        "params": {"factor": a.factor, "max_rate": serving.MAX_RATE, "rate": a.factor * serving.MAX_RATE,
                   "duration": a.duration, "protocol": a.protocol, "input_range": [8, 512], "output_range": [8, 512]},
        "runs": runs,
    })  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
