"""Admission control under overload (issue 28): does the daemon keep its goodput at 2x its
measured saturation?

Two runs of the daemon on the demo model (CPU by default):

1. **Saturation**: a closed loop of ``--concurrency`` streaming clients for ``--saturation-s``
   seconds (default flags). Its completed requests/s is the saturated throughput; its mean time
   to first token and per output token set the SLOs (``--ttft-factor`` and ``--tpot-factor`` x
   them; ``--ttft-slo-ms`` overrides the first).
2. **Overload**: a fresh daemon with ``--ttft-slo-ms`` and that ``--tpot-slo-ms``, under an open
   loop of Poisson arrivals at ``--load`` x the saturated rate for ``--duration-s`` seconds.

Reported (JSON in bench/results, with device, commit and config): requests sent, the status mix
(429s with ``Retry-After``), admitted share, SLO attainment of the admitted requests (TTFT and
TPOT within the SLOs, measured at the client), goodput (requests/s finishing within the SLOs) vs
the saturated throughput, and whether every request got an answer.

    python -m bench.admission_overload            # ~2 minutes on CPU
    python -m bench.admission_overload --devices 0 --model DIR   # on a GPU
    python -m bench.admission_overload --devices 0 --shape llama-2-7b --client-procs 8   # random weights
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import multiprocessing
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from bench.common import write_random_served_model, write_result
from bench.launch import default_daemon, demo_model_dir, free_port, launch


async def one_request(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int) -> dict:
    """Streams one completion; returns its status, client-side TTFT / TPOT and Retry-After."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    start = time.perf_counter()
    out: dict = {"start": start}
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            out["status"] = r.status_code
            if r.status_code != 200:
                await r.aread()
                out["retry_after"] = r.headers.get("retry-after")
                out["message"] = r.text[:300]
                return out
            first = last = None
            tokens = 0
            errored = False
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    errored = True
                    break
                now = time.perf_counter()
                first = first or now
                last = now
                tokens += 1
            out["ok"] = not errored and first is not None
            if first is not None and last is not None:
                out["ttft_s"] = first - start
                out["tpot_s"] = (last - first) / max(1, max_tokens - 1)
    except httpx.HTTPError as e:
        out["status"] = f"client error: {type(e).__name__}"
    finally:
        out["end"] = time.perf_counter()
    return out


def prompt_of(rng: random.Random, length: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(length)]


async def closed_loop(
    url: str, concurrency: int, seconds: float, prompt_len: int, max_tokens: int, vocab: int, seed: int = 1
) -> list[dict]:
    rng = random.Random(seed)
    deadline = time.perf_counter() + seconds
    results: list[dict] = []

    async def client_loop(client: httpx.AsyncClient) -> None:
        while time.perf_counter() < deadline:
            results.append(await one_request(client, url, prompt_of(rng, prompt_len, vocab), max_tokens))

    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=httpx.Limits(max_connections=1000)) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
    return results


async def open_loop(
    url: str, rate: float, seconds: float, prompt_len: int, max_tokens: int, vocab: int, seed: int = 2
) -> list[dict]:
    rng = random.Random(seed)
    tasks = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=httpx.Limits(max_connections=4000)) as client:
        t0 = time.perf_counter()
        t = 0.0
        while True:
            t += rng.expovariate(rate)
            if t > seconds:
                break
            await asyncio.sleep(max(0.0, t0 + t - time.perf_counter()))
            tasks.append(asyncio.create_task(one_request(client, url, prompt_of(rng, prompt_len, vocab), max_tokens)))
            tasks[-1].due = t0 + t  # type: ignore[attr-defined]  # when the arrival was due
        results = list(await asyncio.gather(*tasks))
    for task, r in zip(tasks, results):
        r["send_lag_s"] = r["start"] - task.due  # type: ignore[attr-defined]  # the client falling behind
    return results


def run_loop(loop: str, procs: int, url: str, load: float, seconds: float, prompt_len: int, max_tokens: int,
             vocab: int) -> list[dict]:  # fmt: skip
    """``closed_loop`` (``load`` = clients) or ``open_loop`` (``load`` = requests/s) split over
    ``procs`` client processes, each with its share of the load and its own seed: one Python
    event loop parsing every streamed token falls behind long before a GPU does."""
    if procs <= 1:
        return _loop_in_process(loop, 0, url, load, seconds, prompt_len, max_tokens, vocab)
    shares = [load / procs] * procs
    if loop == "closed":  # whole clients
        shares = [float(int(load) // procs + (i < int(load) % procs)) for i in range(procs)]
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(procs, mp_context=ctx) as pool:
        futures = [pool.submit(_loop_in_process, loop, i, url, share, seconds, prompt_len, max_tokens, vocab)
                   for i, share in enumerate(shares) if share > 0]  # fmt: skip
        return [r for f in futures for r in f.result()]


def _loop_in_process(loop: str, index: int, url: str, load: float, seconds: float, prompt_len: int,
                     max_tokens: int, vocab: int) -> list[dict]:  # fmt: skip
    if loop == "closed":
        return asyncio.run(closed_loop(url, int(load), seconds, prompt_len, max_tokens, vocab, seed=1 + 100 * index))
    return asyncio.run(open_loop(url, load, seconds, prompt_len, max_tokens, vocab, seed=2 + 100 * index))


def device_label(devices: str) -> str:
    """The device kind the results are filed under: ``cpu`` or the first GPU's name."""
    if devices == "cpu":
        return "cpu"
    import torch

    return torch.cuda.get_device_name(int(devices.split(",")[0]))


WATCHED = (
    "deltaserve_requests_running",
    "deltaserve_requests_waiting",
    "deltaserve_admission_queued_requests",
    "deltaserve_admission_drain_per_s",
    "deltaserve_admission_running_cap",
    "deltaserve_admission_predicted_wait_us",
    "deltaserve_admission_refused_ttft_total",
    "deltaserve_admission_effective_step_us",
    "deltaserve_admission_mixed_step_overhead_us",
    "deltaserve_admission_prefill_ns_per_token",
)
"""Gauges and counters sampled during the overload, to see admission control at work."""


class MetricsSampler:
    """Samples ``names`` from ``url``/metrics every ``period_s`` in a thread while in its
    ``with`` block; ``samples`` is a list of ``{"t": s, name: value}``."""

    def __init__(self, url: str, names: tuple[str, ...], period_s: float) -> None:
        self.url, self.names, self.period_s = url, names, period_s
        self.samples: list[dict[str, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> MetricsSampler:
        self._t0 = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        with httpx.Client(timeout=5) as client:
            while not self._stop.wait(self.period_s):
                try:
                    text = client.get(f"{self.url}/metrics").text
                except httpx.HTTPError:
                    continue
                row: dict[str, float] = {"t": round(time.perf_counter() - self._t0, 2)}
                for line in text.splitlines():
                    name, _, value = line.partition(" ")
                    if name in self.names:
                        row[name.removeprefix("deltaserve_")] = float(value)
                self.samples.append(row)


def server_latency(metrics: str) -> dict[str, float]:
    """Mean server-side latencies (seconds) from the daemon's histograms: what the engine measured,
    without the client's own delays (its event loop also parses every streamed token)."""
    values: dict[str, float] = {}
    for line in metrics.splitlines():
        name, _, value = line.partition(" ")
        if name.endswith(("_seconds_sum", "_seconds_count")) and "{" not in name:
            values[name.removeprefix("deltaserve_")] = float(value)
    means = {}
    for family in ("time_to_first_token", "time_per_output_token", "e2e_request_latency", "request_queue_time"):
        count = values.get(f"{family}_seconds_count", 0.0)
        if count:
            means[f"mean_{family}_s"] = values[f"{family}_seconds_sum"] / count
    return means


def quantiles(xs: list[float]) -> dict[str, float]:
    """p50 / p90 / p99 of ``xs`` (empty: nothing)."""
    if len(xs) < 2:
        return {}
    q = statistics.quantiles(xs, n=100)
    return {"p50": q[49], "p90": q[89], "p99": q[98]}


def daemon_cmd(args, port: int, flags: list[str]) -> list[str]:
    cmd = [str(args.daemon or default_daemon()), "--port", str(port), "--python", sys.executable,
           "--devices", args.devices, "--model", str(args.model or demo_model_dir()), *flags]  # fmt: skip
    return cmd


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="model directory (default: the demo model)")
    p.add_argument("--shape", help="serve this shape (bench.common.SHAPES) with random weights instead of --model")
    p.add_argument("--daemon", type=Path, help="deltaserve binary (default: $DELTASERVE_BIN or the release build)")
    p.add_argument("--devices", default="cpu")
    p.add_argument("--concurrency", type=int, default=16, help="closed-loop clients for the saturation run")
    p.add_argument("--saturation-s", type=float, default=20.0)
    p.add_argument("--duration-s", type=float, default=30.0, help="open-loop arrivals for this long")
    p.add_argument("--load", type=float, default=2.0, help="open-loop rate as a multiple of saturation")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--ttft-slo-ms", type=int, help="TTFT SLO (default: --ttft-factor x the saturated TTFT)")
    p.add_argument("--ttft-factor", type=float, default=2.0, help="TTFT SLO = this x the saturated mean TTFT")
    p.add_argument("--tpot-factor", type=float, default=1.5, help="TPOT SLO = this x the saturated TPOT")
    p.add_argument("--client-procs", type=int, default=1, help="client processes sharing the load (8 on a GPU)")
    p.add_argument("--out", type=Path, help="results directory (default bench/results)")
    args = p.parse_args()
    if args.shape:
        args.model = write_random_served_model(args.shape, Path(tempfile.mkdtemp()) / args.shape)
    model = args.model or demo_model_dir()
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    logs = Path("/tmp")

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # Admission control off (bounds of an hour): the engine's own saturated throughput.
    unbounded = ["--ttft-slo-ms", "3600000", "--tpot-slo-ms", "3600000"]
    with launch(daemon_cmd(args, port, unbounded), url, logs / "admission-saturation.log"):
        asyncio.run(closed_loop(url, 2, 3.0, args.prompt_len, args.max_tokens, vocab))  # warm-up
        t0 = time.perf_counter()
        sat = run_loop(
            "closed",
            args.client_procs,
            url,
            args.concurrency,
            args.saturation_s,
            args.prompt_len,
            args.max_tokens,
            vocab,
        )
        sat_wall = time.perf_counter() - t0
        sat_server = server_latency(httpx.get(f"{url}/metrics", timeout=10).text)
    sat_ok = [r for r in sat if r.get("ok")]
    sat_rps = len(sat_ok) / sat_wall
    sat_tpot = statistics.mean(r["tpot_s"] for r in sat_ok)
    sat_ttft = statistics.mean(r["ttft_s"] for r in sat_ok)
    tpot_slo_ms = max(1, round(sat_tpot * args.tpot_factor * 1000))
    ttft_slo_ms = args.ttft_slo_ms or max(1, round(sat_ttft * args.ttft_factor * 1000))
    print(f"saturation: {sat_rps:.2f} req/s, mean TTFT {sat_ttft * 1e3:.0f} ms, mean TPOT {sat_tpot * 1e3:.1f} ms "
          f"({len(sat_ok)} of {len(sat)} ok)", flush=True)  # fmt: skip

    rate = args.load * sat_rps
    flags = ["--ttft-slo-ms", str(ttft_slo_ms), "--tpot-slo-ms", str(tpot_slo_ms)]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with launch(daemon_cmd(args, port, flags), url, logs / "admission-overload.log"):
        asyncio.run(closed_loop(url, 2, 3.0, args.prompt_len, args.max_tokens, vocab))  # warm-up: measured steps
        t0 = time.perf_counter()
        with MetricsSampler(url, WATCHED, period_s=0.5) as series:
            over = run_loop("open", args.client_procs, url, rate, args.duration_s, args.prompt_len, args.max_tokens,
                            vocab)  # fmt: skip
        over_wall = time.perf_counter() - t0
        metrics = httpx.get(f"{url}/metrics", timeout=10).text

    statuses: dict[str, int] = {}
    for r in over:
        statuses[str(r.get("status"))] = statuses.get(str(r.get("status")), 0) + 1
    admitted = [r for r in over if r.get("status") == 200]
    refused = [r for r in over if r.get("status") == 429]
    in_slo = [r for r in admitted if r.get("ok") and r["ttft_s"] * 1e3 <= ttft_slo_ms
              and r["tpot_s"] * 1e3 <= tpot_slo_ms]  # fmt: skip
    answered = all(r.get("status") in (200, 429, 503) for r in over)
    goodput = len(in_slo) / over_wall
    result = {
        "device": device_label(args.devices),
        "config": {
            "model": str(model),
            "prompt_len": args.prompt_len,
            "max_tokens": args.max_tokens,
            "concurrency": args.concurrency,
            "client_procs": args.client_procs,
            "saturation_s": args.saturation_s,
            "duration_s": args.duration_s,
            "load": args.load,
            "ttft_slo_ms": ttft_slo_ms,
            "ttft_factor": args.ttft_factor,
            "tpot_slo_ms": tpot_slo_ms,
            "tpot_factor": args.tpot_factor,
        },  # fmt: skip
        "saturation": {
            "requests_per_s": sat_rps,
            "mean_ttft_s": sat_ttft,
            "mean_tpot_s": sat_tpot,
            "requests": len(sat),
            "ok": len(sat_ok),
            "server": sat_server,
        },  # fmt: skip
        "overload": {
            "offered_requests_per_s": rate,
            "requests": len(over),
            "statuses": statuses,
            "admitted_share": len(admitted) / max(1, len(over)),
            "refused_429": len(refused),
            "refused_with_retry_after": sum(1 for r in refused if r.get("retry_after")),
            "slo_attainment_of_admitted": len(in_slo) / max(1, len(admitted)),
            "goodput_requests_per_s": goodput,
            "goodput_vs_saturated": goodput / sat_rps,
            "every_request_answered": answered,
            "max_latency_s": max((r["end"] - r["start"] for r in over), default=0.0),
            "wall_s": over_wall,
            "refusal_example": refused[0].get("message") if refused else None,
            "client_send_lag_s": quantiles([r["send_lag_s"] for r in over]),
            "admitted_ttft_s": quantiles([r["ttft_s"] for r in admitted if r.get("ok")]),
            "admitted_tpot_s": quantiles([r["tpot_s"] for r in admitted if r.get("ok")]),
            "server": server_latency(metrics),
        },
        "metrics": [line for line in metrics.splitlines() if line.startswith("deltaserve_admission")],
        "metrics_every_500ms": series.samples,
    }
    path = write_result("admission_overload", result, args.out)
    print(json.dumps(result["overload"], indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
