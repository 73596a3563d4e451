"""Time to first token with and without prefix caching, one shared system prompt per variant.

Issue 26's prefix-caching benchmark (target: at least 5x lower TTFT with a 1,000-token shared
system prompt, and identical greedy tokens). Two daemons serve the same model in turn, one with
prefix caching (the default) and one with ``--no-enable-prefix-caching``; each serves the base
model and ``--loras`` rank-``--rank`` LoRA adapters on all seven projections (random weights).
Every variant has its own ``--system-tokens`` system prompt (token ids); a request is that prompt
followed by a ``--user-tokens`` question distinct per request. Per daemon and variant:

- ``first``: the first request (with caching: a miss that fills the cache);
- ``ttft``: ``--trials`` more requests, one at a time, each ``max_tokens: 1`` (its latency is its
  TTFT): with caching they hit every whole page of the system prompt;
- greedy: one ``--gen-tokens`` completion at temperature 0, compared between the two daemons (and
  where they part, ``greedy_first_difference``, with how close the choice was there in each:
  ``greedy_top2_gap_where_parted``, the best minus the second-best logprob);
- ``split``: where the TTFT trials' time went, from the daemon's ``/metrics`` over them: the
  worker's mean step (``busy_us`` of its own work, ``forward_us`` of the model, ``floor_us`` of the
  step's bytes and FLOPs), the router's mean TTFT, and the rest of the client's TTFT (HTTP, router,
  both IPC hops, the worker's host work outside the step).

The result has the median TTFTs, their ratio per variant and over all, whether every greedy
completion was identical, and the caching daemon's ``/metrics`` prefix counters.

    python3 -m bench.prefix_caching [--devices 0] [--shape llama-2-7b] [--num-layers 32]
        [--loras 3] [--system-tokens 1000] [--user-tokens 24] [--trials 8] [--out DIR]
    python3 -m bench.prefix_caching --devices cpu --demo --system-tokens 192 --trials 2 --loras 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

from bench import script_env

script_env.prepare()

from bench.common import write_random_lora_dir, write_random_served_model, write_result  # noqa: E402
from bench.launch import Endpoint, ServerSpec, deltaserve_server, demo_model_dir  # noqa: E402
from bench.serving.runner import metrics_delta, server_metrics  # noqa: E402

SEVEN = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TTFT_HISTOGRAM = ("deltaserve_time_to_first_token_seconds_sum", "deltaserve_time_to_first_token_seconds_count")
PREFIX_METRICS = ("queried_tokens_total", "hit_tokens_total", "cached_pages", "evicted_pages_total")


def complete(url: str, model: str, prompt: list[int], max_tokens: int, logprobs: int = 0) -> tuple[float, dict]:
    """(seconds, the first choice) of one greedy completion; ``logprobs``: the choice's ``logprobs``
    with that many alternatives per token."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    if logprobs:
        body["logprobs"] = logprobs
    req = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(), {"content-type": "application/json"}
    )
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        answer = json.loads(r.read())
    return time.perf_counter() - t0, answer["choices"][0]


def prefix_metrics(metrics: dict[str, float] | None) -> dict[str, float]:
    """The prefix cache's counters (``PREFIX_METRICS``) from the daemon's ``/metrics`` samples."""
    metrics = metrics or {}
    return {k: metrics.get(f"deltaserve_prefix_cache_{k}", 0.0) for k in PREFIX_METRICS}


def first_difference(a: list[str], b: list[str]) -> int | None:
    """Index of the first generated token where two completions differ, or None when they are the same."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def top2_gap(logprobs: dict, i: int) -> float | None:
    """How far the best token's logprob at generated token ``i`` sits above the second best (a
    near-tie when tiny), from a completion's ``logprobs`` with two alternatives per token."""
    top = sorted((logprobs.get("top_logprobs") or [])[i].values(), reverse=True) if i < len(logprobs["tokens"]) else []
    return top[0] - top[1] if len(top) >= 2 else None


def ttft_split(before: dict | None, after: dict | None, client_s: list[float]) -> dict[str, float] | None:
    """Where the trials' mean TTFT went, in ms per request, from the daemon's ``/metrics`` before
    and after them (each request is ``max_tokens: 1`` and runs alone), or None without metrics."""
    delta = metrics_delta(before, after)
    if before is None or after is None or not delta or not delta.get("deltaserve_steps_total"):
        return None
    steps = delta["deltaserve_steps_total"]
    per_step = {
        k: delta.get(f"deltaserve_worker_{k}_us_total", 0.0) / steps / 1e3 for k in ("busy", "forward", "floor")
    }
    # The TTFT histogram's _sum and _count are cumulative, so their increase is taken here.
    ttft_sum, ttft_n = (after.get(k, 0.0) - before.get(k, 0.0) for k in TTFT_HISTOGRAM)
    client_ms = statistics.fmean(client_s) * 1e3
    return {
        "steps_per_request": steps / len(client_s),
        "client_ttft_ms": client_ms,
        "router_ttft_ms": ttft_sum / max(ttft_n, 1.0) * 1e3,
        "worker_busy_ms": per_step["busy"],
        "worker_forward_ms": per_step["forward"],
        "worker_floor_ms": per_step["floor"],
        "outside_step_ms": client_ms - per_step["busy"] * steps / len(client_s),
    }


def router_speedup(cached: dict | None, uncached: dict | None) -> float | None:
    """The speed-up of the router's mean TTFT (from its queue to the first token: no HTTP and no
    client) between two ``ttft_split``s of one variant, or None without both."""
    if not cached or not uncached or not cached["router_ttft_ms"]:
        return None
    return uncached["router_ttft_ms"] / cached["router_ttft_ms"]


def run_daemon(spec: ServerSpec, variants: list[str], prompts: dict, args) -> dict:
    """One daemon's numbers: per variant the first request's latency, the TTFT samples and the
    greedy text; plus its prefix-cache counters."""
    out: dict = {"first_s": {}, "ttft_s": {}, "greedy": {}, "split": {}}
    with deltaserve_server(spec) as ep:
        base = json.loads(urllib.request.urlopen(f"{ep.url}/v1/models").read())["data"][0]["id"]
        name = {v: base if v == "base" else f"{base}:{v}" for v in variants}
        for _ in range(2):  # first steps, allocator, kernels for a whole prompt and (cached) a hit
            complete(ep.url, base, prompts["warmup"], 1)
        for v in variants:
            system = prompts["system"][v]
            out["first_s"][v] = complete(ep.url, name[v], system + prompts["user"][0], 1)[0]
            before = server_metrics(Endpoint(ep.url))
            out["ttft_s"][v] = [
                complete(ep.url, name[v], system + prompts["user"][t], 1)[0] for t in range(1, args.trials + 1)
            ]
            out["split"][v] = ttft_split(before, server_metrics(Endpoint(ep.url)), out["ttft_s"][v])
            out["greedy"][v] = complete(ep.url, name[v], system + prompts["user"][-1], args.gen_tokens, 2)[1][
                "logprobs"
            ]
        out["metrics"] = prefix_metrics(server_metrics(Endpoint(ep.url)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", default="0", help="CUDA ids, or cpu")
    ap.add_argument("--shape", default="llama-2-7b", help="random-weight model shape (bench/common.py SHAPES)")
    ap.add_argument("--num-layers", type=int, default=None, help="override the shape's layer count")
    ap.add_argument("--demo", action="store_true", help="serve the bundled demo model instead of --shape")
    ap.add_argument("--loras", type=int, default=3, help="LoRA variants besides the base model")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--user-tokens", type=int, default=24)
    ap.add_argument("--trials", type=int, default=8)
    ap.add_argument("--gen-tokens", type=int, default=16, help="greedy tokens compared between the daemons")
    ap.add_argument("--flag", action="append", default=[], help="extra daemon flag for both (as --flag=--x)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        if args.demo:
            model_dir = demo_model_dir()
            shape = model_dir.name
        else:
            model_dir = write_random_served_model(args.shape, tmp / "model", args.num_layers)
            shape = args.shape
        config = json.loads((model_dir / "config.json").read_text())
        lora_dir = tmp / "loras"
        lora_dir.mkdir()
        loras = [f"lora{i}" for i in range(args.loras)]
        for i, v in enumerate(loras):
            write_random_lora_dir(lora_dir / v, config, args.rank, SEVEN, seed=i)
        variants = ["base", *loras]
        vocab = config["vocab_size"]

        def ids(seed: int, n: int) -> list[int]:
            return [3 + (seed * 7919 + i * 104729) % (vocab - 3) for i in range(n)]

        prompts = {
            "warmup": ids(999, args.system_tokens + args.user_tokens),
            "system": {v: ids(10 + i, args.system_tokens) for i, v in enumerate(variants)},
            "user": [ids(1000 + t, args.user_tokens) for t in range(args.trials + 2)],
        }
        runs = {}
        for mode, flags in (("cached", ["--enable-prefix-caching"]), ("uncached", ["--no-enable-prefix-caching"])):
            spec = ServerSpec(model_dir, lora_dir if loras else None, args.devices, flags=[*flags, *args.flag],
                              log=tmp / f"daemon-{mode}.log")  # fmt: skip
            runs[mode] = run_daemon(spec, variants, prompts, args)

    device = "cpu"
    if args.devices != "cpu":
        import torch

        device = torch.cuda.get_device_name(int(args.devices.split(",")[0]))
    median_ms = {mode: {v: statistics.median(r["ttft_s"][v]) * 1e3 for v in variants} for mode, r in runs.items()}
    speedup = {v: median_ms["uncached"][v] / median_ms["cached"][v] for v in variants}
    all_ms = {mode: statistics.median(x * 1e3 for v in variants for x in r["ttft_s"][v]) for mode, r in runs.items()}
    greedy = {mode: {v: r["greedy"][v] for v in variants} for mode, r in runs.items()}
    first_diff = {v: first_difference(greedy["cached"][v]["tokens"], greedy["uncached"][v]["tokens"]) for v in variants}
    identical = {v: first_diff[v] is None for v in variants}
    # Where two completions part, how close the choice was in each (fp16 rounding flips near-ties)
    parting = {
        v: {mode: top2_gap(greedy[mode][v], i) for mode in greedy} for v, i in first_diff.items() if i is not None
    }
    for v in variants:
        print(f"{v:>8}: TTFT cached {median_ms['cached'][v]:8.1f} ms, uncached {median_ms['uncached'][v]:8.1f} ms, "
              f"{speedup[v]:5.2f}x; greedy identical: {identical[v]}"
              + ("" if first_diff[v] is None else f" (from token {first_diff[v]} of {args.gen_tokens}; top-2 "
                 f"logprob gap there {parting[v]})"))  # fmt: skip
        for mode, r in runs.items():
            if (split := r["split"][v]) is not None:
                print(f"{'':>10}{mode:>8}: " + ", ".join(f"{k} {x:.2f}" for k, x in split.items()))
    overall = all_ms["uncached"] / all_ms["cached"]
    print(f"all variants: {all_ms['cached']:.1f} vs {all_ms['uncached']:.1f} ms: {overall:.2f}x (target >= 5x)")
    # The same ratio on the router's clock: what the server adds, without the HTTP trip and this client.
    server = {v: router_speedup(runs["cached"]["split"][v], runs["uncached"]["split"][v]) for v in variants}
    if all(x is not None for x in server.values()):
        print("router TTFT speed-up: " + ", ".join(f"{v} {x:.2f}x" for v, x in server.items()))
    print(f"prefix cache counters (cached daemon): {runs['cached']['metrics']}")
    payload = {
        "device": device,
        "shape": shape,
        "num_layers": config["num_hidden_layers"],
        "variants": variants,
        "rank": args.rank,
        "target_modules": list(SEVEN),
        "system_tokens": args.system_tokens,
        "user_tokens": args.user_tokens,
        "trials": args.trials,
        "gen_tokens": args.gen_tokens,
        "flags": args.flag,
        "median_ttft_ms": median_ms,
        "median_ttft_ms_all": all_ms,
        "speedup": speedup,
        "speedup_all": overall,
        "speedup_router": server,
        "first_request_ms": {m: {v: r["first_s"][v] * 1e3 for v in variants} for m, r in runs.items()},
        "samples_ms": {m: {v: [round(x * 1e3, 2) for x in r["ttft_s"][v]] for v in variants} for m, r in runs.items()},
        "greedy_identical": identical,
        "all_greedy_identical": all(identical.values()),
        "greedy_first_difference": first_diff,
        "greedy_top2_gap_where_parted": parting,
        "prefix_metrics": {m: r["metrics"] for m, r in runs.items()},
        "ttft_split": {m: r["split"] for m, r in runs.items()},
    }
    print(write_result("prefix_caching", payload, args.out))


if __name__ == "__main__":
    main()
