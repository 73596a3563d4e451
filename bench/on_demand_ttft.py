"""Time to first token of an adapter resolved at request time, against one registered at start-up.

Issue 25's benchmark. One daemon serves a random-weight model (``--shape``, ``--num-layers``) with a
``--lora-dir``; per trial, three rank-``--rank`` adapters on all seven projections, each with its
own weights file (written before timing, so every one is equally in the page cache):

- ``registered_cold``: in the directory at start-up (registered then), first request now: the
  weights go disk -> host -> GPU pages before the prefill;
- ``registered_warm``: the same adapter's second request (its pages are on the GPU);
- ``resolved``: copied into the directory after start-up; its first request finds it, registers
  it (the router's checks and a worker's inspection), then loads and serves it like the first;
- ``base``: the base model, for scale.

Each request is a ``--prompt-tokens`` prompt of token ids with ``max_tokens: 1`` (its latency is
its TTFT), sent alone, so the numbers are the load path's and not a queue's.

    python3 -m bench.on_demand_ttft [--devices 0] [--shape llama-2-7b] [--num-layers 32] [--trials 5]
                                    [--rank 16] [--prompt-tokens 128] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

from bench import script_env

script_env.prepare()

from bench.common import shape_config, write_random_lora_dir, write_random_served_model, write_result  # noqa: E402
from bench.launch import ServerSpec, deltaserve_server  # noqa: E402

SEVEN = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def latency_s(url: str, model: str, prompt: list[int]) -> float:
    """Seconds for one ``max_tokens: 1`` completion (its time to first token)."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body, {"content-type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        answer = json.loads(r.read())
    elapsed = time.perf_counter() - t0
    assert answer["choices"][0]["finish_reason"] == "length", answer
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", default="0")
    ap.add_argument("--shape", default="llama-2-7b")
    ap.add_argument("--num-layers", type=int, default=None, help="override the shape's layer count")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--flag", action="append", default=[], help="extra daemon flag (repeatable, as --flag=--x)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    config = shape_config(args.shape, args.num_layers)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model_dir = write_random_served_model(args.shape, tmp / "model", args.num_layers)
        lora_dir, staged = tmp / "loras", tmp / "staged"
        lora_dir.mkdir()
        for t in range(args.trials):
            write_random_lora_dir(lora_dir / f"cold-{t}", config, args.rank, SEVEN, seed=2 * t)
            write_random_lora_dir(staged / f"late-{t}", config, args.rank, SEVEN, seed=2 * t + 1)
        adapter_bytes = (lora_dir / "cold-0" / "adapter_model.safetensors").stat().st_size
        spec = ServerSpec(model_dir, lora_dir, args.devices, flags=list(args.flag), log=tmp / "daemon.log")
        prompt = [3 + (i * 7919) % (config["vocab_size"] - 3) for i in range(args.prompt_tokens)]
        samples: dict[str, list[float]] = {"base": [], "registered_cold": [], "registered_warm": [], "resolved": []}
        with deltaserve_server(spec) as ep:
            models = json.loads(urllib.request.urlopen(f"{ep.url}/v1/models").read())["data"]
            base = models[0]["id"]
            latency_s(ep.url, base, prompt)  # warm-up: first step, allocator, graphs
            for t in range(args.trials):
                samples["base"].append(latency_s(ep.url, base, prompt))
                samples["registered_cold"].append(latency_s(ep.url, f"{base}:cold-{t}", prompt))
                samples["registered_warm"].append(latency_s(ep.url, f"{base}:cold-{t}", prompt))
                shutil.copytree(staged / f"late-{t}", lora_dir / f"late-{t}")
                samples["resolved"].append(latency_s(ep.url, f"{base}:late-{t}", prompt))
    device = "cpu"
    if args.devices != "cpu":
        import torch

        device = torch.cuda.get_device_name(int(args.devices.split(",")[0]))

    median_ms = {k: statistics.median(v) * 1e3 for k, v in samples.items()}
    for k, v in median_ms.items():
        print(f"{k:>16}: median {v:8.1f} ms over {len(samples[k])}")
    print(f"resolved / registered_cold: {median_ms['resolved'] / median_ms['registered_cold']:.2f}x")
    payload = {
        "device": device,
        "shape": args.shape,
        "num_layers": config["num_hidden_layers"],
        "rank": args.rank,
        "target_modules": list(SEVEN),
        "adapter_bytes": adapter_bytes,
        "prompt_tokens": args.prompt_tokens,
        "trials": args.trials,
        "flags": args.flag,
        "median_ms": median_ms,
        "samples_ms": {k: [round(x * 1e3, 2) for x in v] for k, v in samples.items()},
        "resolved_over_registered_cold": median_ms["resolved"] / median_ms["registered_cold"],
    }
    print(write_result("on_demand_ttft", payload, args.out))


if __name__ == "__main__":
    main()
