"""CaraServe's cold-start workload (§2.3, §7.2) through the daemon: Cached vs OnDmd vs CPU-assisted.

Llama-2-7B shape (random weights), ``--adapters`` (512) rank-``--rank`` (64) LoRA adapters on q, k, v
(≈100 MiB each), power-law popularity (a MAF-like skew), Poisson arrivals at each of ``--rates``
(3 / 6 / 9 req/s). Before the measured replays every adapter gets one short request, so its host
copy is in memory (CaraServe's setting: adapters in host memory, loaded on demand). Modes, one
daemon each (``--mode``):

    cached  a pool large enough for every adapter (the KV pool at --gpu-memory-utilization): after
            the warm-up they are all on the GPU (the oracle; the loads it still did are reported)
    ondmd   a small pool (``--pool-bytes``): most requests' adapters are copied host -> GPU before
            their prefill, which waits (--cpu-lora-helpers 0)
    cpu     the same small pool, with ``--helpers`` CPU LoRA helper processes (policy ``--policy``):
            a cold prefill starts at once, its LoRA on the helpers while the pages load

Per rate: TTFT, TPOT and request latency (mean, p50, p99), and the daemon's counts (adapter GPU
loads, assisted / declined / fallback prefills). Each mode fits an 80 GB card and takes about 3
minutes (startup, warm-up, 3 x ``--duration`` s); run the three and compare mean TTFT with Cached's
(the issue's target: CPU-assisted ≤ 1.15 x Cached).

    python3 -m bench.caraserve_coldstart --mode cached
    python3 -m bench.caraserve_coldstart --mode ondmd
    python3 -m bench.caraserve_coldstart --mode cpu [--helpers 8] [--policy adaptive]
    python3 -m bench.caraserve_coldstart --mode cpu --smoke       # the tiny shape on CPU workers
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from bench import script_env

script_env.prepare()

from bench import replay as rp  # noqa: E402
from bench import workload as wl  # noqa: E402
from bench.common import SMOKE_SHAPE, shape_config, write_random_served_model, write_result  # noqa: E402
from bench.launch import ServerSpec, deltaserve_server  # noqa: E402
from bench.placement_policies import QKV, write_adapters  # noqa: E402
from bench.serving.runner import metrics_delta, server_metrics  # noqa: E402

MODES = ("cached", "ondmd", "cpu")
COUNTS = ("adapter_gpu_loads_total", "adapter_host_loads_total", "cpu_assisted_prefills_total",
          "cpu_assist_declined_total", "cpu_assist_fallbacks_total")  # fmt: skip


def warmup_trace(trace: wl.Trace, rate: float) -> wl.Trace:
    """One 1-token request per adapter of ``trace`` at ``rate`` req/s (their host reads happen now)."""
    reqs = [wl.Request(i, i / rate, v.name, [5, 6, 7, 8], 1) for i, v in enumerate(trace.variants)]
    return wl.Trace({"kind": "warmup"}, trace.variants, reqs)


def figures(records: list[rp.Record]) -> dict:
    done = [r for r in records if r.error is None and r.e2e is not None]
    s = rp.summarize(records)

    def mean(xs: list[float]) -> float | None:
        return statistics.mean(xs) if xs else None

    return {
        "requests": s["requests"], "completed": s["completed"], "failed": s["failed"], "errors": s["errors"],
        "ttft_mean_s": mean([r.ttft for r in done if r.ttft is not None]), "ttft_s": s["ttft_s"],
        "tpot_mean_s": mean([r.tpot for r in done if r.tpot is not None]), "tpot_s": s["tpot_s"],
        "e2e_mean_s": mean([r.e2e for r in done]), "e2e_s": s["e2e_s"],
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=MODES, required=True)
    ap.add_argument("--shape", default="llama-2-7b")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--devices", default="0")
    ap.add_argument("--adapters", type=int, default=512)
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--alpha", type=float, default=1.0, help="power-law popularity exponent")
    ap.add_argument("--rates", default="3,6,9")
    ap.add_argument("--duration", type=float, default=30.0)
    ap.add_argument("--input", default="32,256", help="prompt length range")
    ap.add_argument("--output", default="32,128", help="output length range")
    ap.add_argument("--pool-bytes", type=int, default=8 << 30, help="--kv-cache-bytes of ondmd and cpu")
    ap.add_argument("--host-bytes", type=int, default=56 << 30, help="--variant-host-bytes (512 x 100 MiB copies fit)")
    ap.add_argument("--helpers", type=int, default=8)
    ap.add_argument("--policy", default="adaptive", choices=("adaptive", "always"))
    ap.add_argument(
        "--from-disk",
        action="store_true",
        help="no warm-up: each adapter's first request reads it from disk (CaraServe's other setting)",
    )
    ap.add_argument("--smoke", action="store_true", help="a CPU check of the script: tiny shape, 16 adapters, 4 s")
    ap.add_argument("--work-dir", type=Path)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    rates = [float(r) for r in a.rates.split(",")]
    shape, devices, n, rank, duration, pool = a.shape, a.devices, a.adapters, a.rank, a.duration, a.pool_bytes
    if a.smoke:
        shape, devices, n, rank, duration, pool, rates = SMOKE_SHAPE, "cpu", 16, 8, 4.0, 1 << 20, [2.0]
    work = a.work_dir or Path(tempfile.mkdtemp(prefix="caraserve-"))
    config = shape_config(shape, a.layers)
    model = write_random_served_model(shape, work / "model", a.layers)
    lo, hi = (int(x) for x in a.input.split(","))
    olo, ohi = (int(x) for x in a.output.split(","))
    if a.smoke:
        lo, hi, olo, ohi = 8, 32, 4, 8
    traces = [wl.slora(n, a.alpha, r, 1.0, duration, (lo, hi), (olo, ohi), (rank,), vocab=(3, config["vocab_size"]),
                       seed=7 + i) for i, r in enumerate(rates)]  # fmt: skip
    lora_dir = work / "loras"
    if not lora_dir.exists():
        write_adapters(lora_dir, traces[0], config, QKV)
    flags = ["--max-lora-rank", str(rank), "--variant-host-bytes", str(a.host_bytes), "--log-format", "json"]
    if a.mode != "cached":
        flags += ["--kv-cache-bytes", str(pool)]
    flags += ["--cpu-lora-helpers", str(a.helpers if a.mode == "cpu" else 0)]
    if a.mode == "cpu":
        flags += ["--cpu-lora-policy", a.policy]
    spec = ServerSpec(model, lora_dir, devices, flags, log=work / f"daemon-{a.mode}.log")
    points = []
    with deltaserve_server(spec) as endpoint:
        warm_failed = 0
        if not a.from_disk:
            warm = rp.run_replay(warmup_trace(traces[0], 64.0), endpoint.url, protocol="sse", timeout_s=600)
            warm_failed = sum(r.error is not None for r in warm)
        for rate, trace in zip(rates, traces):
            before = server_metrics(endpoint)
            records = rp.run_replay(trace, endpoint.url, protocol="sse", timeout_s=600)
            delta = metrics_delta(before, server_metrics(endpoint)) or {}
            point = {"rate": rate, **figures(records), **{k: delta.get(f"deltaserve_{k}") for k in COUNTS}}
            points.append(point)
            print(json.dumps({k: point[k] for k in ("rate", "ttft_mean_s", "tpot_mean_s", "e2e_mean_s",
                                                    "adapter_gpu_loads_total", "cpu_assisted_prefills_total")}),
                  flush=True)  # fmt: skip
    import torch

    device = "cpu" if devices.startswith("cpu") else torch.cuda.get_device_name(int(devices.split(",")[0]))
    payload = {
        "device": device, "mode": a.mode, "shape": shape, "layers": config["num_hidden_layers"], "adapters": n,
        "rank": rank, "targets": list(QKV), "alpha": a.alpha, "duration": duration, "input_range": [lo, hi],
        "output_range": [olo, ohi], "pool_bytes": None if a.mode == "cached" else pool, "host_bytes": a.host_bytes,
        "helpers": a.helpers if a.mode == "cpu" else 0, "policy": a.policy if a.mode == "cpu" else None,
        "warmup_failed": warm_failed, "from_disk": a.from_disk, "points": points,
    }  # fmt: skip
    print(write_result(f"caraserve_coldstart-{a.mode}{'-disk' if a.from_disk else ''}", payload, a.out))


if __name__ == "__main__":
    main()
