"""`--placement` policies on a skewed trace with mixed ranks, over the real router (CaraServe §7.5).

One daemon per policy (caraserve, least-loaded, first-fit, random), each with the same workers
(``--devices``: several CPU workers, or GPUs ``0,1``), the same adapters and the same trace: S-LoRA's
synthetic workload with power-law popularity (a MAF-like skew) over ``--adapters`` adapters of ranks
8 / 16 / 32 / 64 (round-robin) on q, k, v, Poisson arrivals at ``--rate``. The latency profile the
router prices with is measured first on this model and device (``deltaserve profile``, the first
worker's device), so the policy sees this machine's costs. The TPOT SLO (``--tpot-slo-ms``; default:
twice the profile's decode step at batch 8 with Σ rank 256) is given to the daemon (the caraserve
policy's penalty, first fit's room) and used for the attainment figure. Per policy: SLO attainment
(TTFT within 6 s and TPOT within the SLO), mean and p50/p99 TPOT, TTFT, how many requests each
policy placed past the SLO (``deltaserve_placement_over_slo_total``).

    python3 -m bench.placement_policies --devices cpu,cpu [--shape smoke-llama] [--rate 4] [--duration 20]
    python3 -m bench.placement_policies --devices 0,1 --shape llama-2-7b --rate 16 --duration 30 \
        --work-dir /tmp/pp --policies caraserve,least-loaded       # 2 GPUs; then first-fit,random

A ``--work-dir`` keeps the model, adapters and profile between runs (the profile is measured once).

CPU workers share the host's cores (the daemon splits them); the profile runs with all of them,
so on CPU its absolute numbers overstate a worker's speed (the ranking between workers holds).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench import script_env

script_env.prepare()

from bench import replay as rp  # noqa: E402
from bench import workload as wl  # noqa: E402
from bench.common import (  # noqa: E402
    SMOKE_SHAPE,
    lora_config,
    shape_config,
    write_lora_weights,
    write_random_served_model,
    write_result,
)
from bench.launch import ServerSpec, deltaserve_server  # noqa: E402
from bench.serving.runner import metrics_delta, server_metrics  # noqa: E402

POLICIES = ("caraserve", "least-loaded", "first-fit", "random")
RANKS = (8, 16, 32, 64)
QKV = ("q_proj", "k_proj", "v_proj")


def write_adapters(root: Path, trace: wl.Trace, config: dict, targets=QKV) -> Path:
    """A ``--lora-dir`` with one directory per variant of ``trace``, weights shared per rank."""
    root.mkdir(parents=True, exist_ok=True)
    for v in trace.variants:
        src = root / f".r{v.rank}.safetensors"
        if not src.exists():
            write_lora_weights(src, config, v.rank, seed=v.rank, targets=targets)
        d = root / v.name
        d.mkdir(exist_ok=True)
        (d / "adapter_config.json").write_text(json.dumps(lora_config(v.rank, targets)))
        (d / "adapter_model.safetensors").symlink_to(src)
    return root


def run_profile(model: Path, device: str, out: Path, smoke: bool) -> dict:
    """``python -m deltaserve.profile`` (what ``deltaserve profile`` runs) on ``model``; its JSON."""
    grid = ["--batches", "1,4,8", "--prompts", "16,64", "--ctx", "16", "--reps", "3"] if smoke else []
    cmd = [sys.executable, "-m", "deltaserve.profile", "--model", str(model), "--device", device,
           "--ranks", ",".join(map(str, RANKS)), "--out", str(out), *grid]  # fmt: skip
    if device == "cpu":
        cmd += ["--kv-cache-bytes", str(256 << 20)]
    subprocess.run(cmd, check=True, env={**os.environ, "PYTHONPATH": str(script_env.PYWORKER)})
    return json.loads(out.read_text())


def default_slo_ms(profile: dict) -> float:
    """Twice the profile's decode step at batch 8 with Σ rank 256 (milliseconds)."""
    d = profile["decode"]
    step = d.get("const", 0) + 8 * (d.get("tokens", 0) + d.get("seqs", 0) + d.get("lora_tokens", 0))
    step += 256 * d.get("lora_rank_sum", 0) + 4 * d.get("lora_segments", 0)
    return 2e3 * step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", default="cpu,cpu")
    ap.add_argument("--shape", default=SMOKE_SHAPE)
    ap.add_argument("--layers", type=int)
    ap.add_argument("--adapters", type=int, default=64)
    ap.add_argument("--alpha", type=float, default=1.0, help="power-law popularity exponent (S-LoRA's 1)")
    ap.add_argument("--rate", type=float, default=4.0)
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--input", default="16,128", help="prompt length range")
    ap.add_argument("--output", default="16,64", help="output length range")
    ap.add_argument("--tpot-slo-ms", type=float)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--work-dir", type=Path)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    policies = a.policies.split(",")
    work = a.work_dir or Path(tempfile.mkdtemp(prefix="placement-"))
    config = shape_config(a.shape, a.layers)
    model = write_random_served_model(a.shape, work / "model", a.layers)
    first = a.devices.split(",")[0]
    device = "cpu" if first == "cpu" else f"cuda:{first.removeprefix('cuda:')}"
    profile_path = work / "profile.json"
    if profile_path.is_file():  # measured by an earlier run in this --work-dir
        profile = json.loads(profile_path.read_text())
    else:
        profile = run_profile(model, device, profile_path, a.shape == SMOKE_SHAPE)
    slo_ms = a.tpot_slo_ms or default_slo_ms(profile)
    lo, hi = (int(x) for x in a.input.split(","))
    olo, ohi = (int(x) for x in a.output.split(","))
    trace = wl.slora(a.adapters, a.alpha, a.rate, 1.0, a.duration, (lo, hi), (olo, ohi), RANKS,
                     vocab=(3, config["vocab_size"]), seed=1)  # fmt: skip
    lora_dir = work / "loras"
    if not lora_dir.is_dir():
        write_adapters(lora_dir, trace, config)
    results = {}
    for policy in policies:
        flags = ["--placement", policy, "--latency-profile", str(profile_path), "--tpot-slo-ms", str(round(slo_ms)),
                 "--max-lora-rank", str(max(RANKS)), "--log-format", "json"]  # fmt: skip
        spec = ServerSpec(model, lora_dir, a.devices, flags, log=work / f"daemon-{policy}.log")
        with deltaserve_server(spec) as endpoint:
            before = server_metrics(endpoint)
            records = rp.run_replay(trace, endpoint.url, protocol="sse", timeout_s=600)
            delta = metrics_delta(before, server_metrics(endpoint)) or {}
        summary = rp.summarize(records, slo_tpot=slo_ms / 1e3)
        tpots = [r.tpot for r in records if r.tpot is not None and r.error is None]
        results[policy] = {
            "slo_attainment": summary["slo"]["attainment"],
            "tpot_attainment": summary["slo"]["tpot_attainment"],
            "mean_tpot_ms": statistics.mean(tpots) * 1e3 if tpots else None,
            "tpot_s": summary["tpot_s"], "ttft_s": summary["ttft_s"], "completed": summary["completed"],
            "failed": summary["failed"], "errors": summary["errors"],
            "placed": delta.get("deltaserve_placement_decisions_total"),
            "placed_over_slo": delta.get("deltaserve_placement_over_slo_total"),
            "adapter_gpu_loads": delta.get("deltaserve_adapter_gpu_loads_total"),
        }  # fmt: skip
        print(policy, json.dumps({k: results[policy][k] for k in ("slo_attainment", "mean_tpot_ms", "placed_over_slo")}),
              flush=True)  # fmt: skip
    payload = {
        "device": profile["device"], "devices": a.devices, "shape": a.shape, "layers": config["num_hidden_layers"],
        "adapters": a.adapters, "ranks": list(RANKS), "targets": list(QKV), "alpha": a.alpha, "rate": a.rate,
        "duration": a.duration, "requests": len(trace.requests), "input_range": [lo, hi], "output_range": [olo, ohi],
        "tpot_slo_ms": slo_ms, "profile_r2": profile.get("r2"), "policies": results,
    }  # fmt: skip
    name = "placement_policies" if set(policies) == set(POLICIES) else "placement_policies-" + "+".join(policies)
    print(write_result(name, payload, a.out))


if __name__ == "__main__":
    main()
