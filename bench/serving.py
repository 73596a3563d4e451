"""Serving experiments, one command each: start the server, replay the generated traces
open-loop, write ``bench/results/<experiment>-<device>-<date>.json`` and PNG plots.

    python bench/serving.py smoke                     # CPU demo model, a handful of requests
    python bench/serving.py slora-s1 [--n 5,100] [--rate 24] [--duration 60]
    python bench/serving.py slora-s2
    python bench/serving.py slo-vs-rate [--cv 4] [--rate 2,8,16]
    python bench/serving.py slo-vs-rate --smoke       # any experiment, shrunk, on the demo model
    python bench/serving.py plot results/a.json results/b.json   # one plot set from several runs

Flow of one experiment::

    Experiment.points()          one trace spec per point (n, rate, cv, ...)
      → write_adapters()         random PEFT LoRA dirs of the model's shape (ranks of the trace's
                                 variants), every point's adapters in one --lora-dir
      → SERVERS[--server]        starts the server once for all points (deltaserve: the daemon
                                 with --model / --lora-dir; peft, swap, merged: the baselines of
                                 bench/baselines.py, SSE only), waits for /ready
      → replay.replay()          per point, in order; the server is idle between points
      → write_result() + plots   all points with their traces' parameters, summaries and
                                 per-request rows; throughput vs n, SLO attainment vs rate,
                                 latency CDFs

Adapters: ``write_adapters`` writes ``adapter_config.json`` per adapter and links its
``adapter_model.safetensors`` to one of ``--distinct-weights`` random weight files per rank (so
2000 rank-64 adapters of Llama-2-7B do not need 270 GB of disk). Loading still reads and copies
every adapter separately; only the page cache is shared. Weights: A ~ N(0, 1/in), B ~ N(0, 0.01²),
lora_alpha = r; targets q, k, v, o (S-LoRA's).

Experiments (defaults; ``--smoke`` shrinks each to a few requests on the CPU demo model)::

    smoke        demo model (SmolLM2-135M), 3 random adapters (ranks 8, 4), 6 requests, sse + ws
    slora-s1     S-LoRA Table 3, S1: Llama-2-7B shape, rank 8, n ∈ {5, 100, 1000, 2000}, alpha 1,
                 cv 1, lengths U[8, 512], rate 24 req/s (above what one GPU serves: saturates),
                 60 s per point (S-LoRA: 5 min)
    slora-s2     the same with ranks 64/32/16/8 round-robin
    slo-vs-rate  S2 ranks, n = 100, alpha 1, cv ∈ {1, 4}, rate ∈ {2, 4, 8, 12, 16, 20, 24}, 60 s

``MAX_RATE`` (24 req/s) is the highest rate any experiment uses; tests/test_replay.py checks the
client sustains 5× it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import baselines  # noqa: E402
import replay as rp  # noqa: E402
import workload as wl  # noqa: E402
from common import (  # noqa: E402
    REPO, RESULTS, SHAPES, git_commit, lora_config, write_lora_weights, write_random_model_dir, write_result,
)

MAX_RATE = 24.0
"""The highest request rate any experiment below offers (req/s)."""
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
"""Projections the generated adapters adapt (S-LoRA's choice)."""
S2_RANKS = (64, 32, 16, 8)
"""S-LoRA Table 1, S2."""
GPU_FLAGS = ("--lora-host-bytes", str(48 << 30))
"""S-LoRA keeps every adapter in host memory: 2000 rank-8 Llama-2-7B adapters are 34 GB (S2's
average rank ~30: too many for host RAM at n = 2000, so the host tier evicts there)."""


# ---------------------------------------------------------------------------------------------
# Experiments


@dataclass(frozen=True)
class Point:
    """One measurement: a trace spec (``workload.slora`` keyword arguments) and how to replay it."""

    label: str
    """Names the point in results and plot legends."""
    trace: dict[str, Any]
    """Keyword arguments of ``workload.slora``."""
    protocol: str = "sse"
    """Replay transport (``replay.PROTOCOLS``)."""


@dataclass(frozen=True)
class Experiment:
    """A named set of points run against one server start."""

    name: str
    """The result file's experiment name."""
    shape: str
    """A ``common.SHAPES`` key (random weights of that shape), or ``"demo"`` (SmolLM2 on CPU)."""
    points: tuple[Point, ...]
    """In run order."""
    slo_tpot: float | None = None
    """TPOT SLO (seconds) for the attainment figures; the TTFT SLO is S-LoRA's 6 s."""
    server_flags: tuple[str, ...] = ()
    """Extra daemon flags."""
    timeout_s: float = 900.0
    """Per-request limit (an overloaded server may queue for minutes)."""


def _label(trace: dict, protocol: str) -> str:
    return f"n={trace['n_variants']} R={trace['rate']:g} cv={trace['cv']:g} {protocol}"


def _slora_points(ns, rates, cvs, ranks, duration, lengths, protocols=("sse",), vocab=(100, 32000)):
    return tuple(
        Point(label=f"n={n} R={rate:g} cv={cv:g} {p}", protocol=p,
              trace={"n_variants": n, "alpha": 1.0, "rate": rate, "cv": cv, "duration": duration,
                     "input_range": lengths, "output_range": lengths, "ranks": ranks, "vocab": vocab, "seed": 0})
        for n in ns for rate in rates for cv in cvs for p in protocols
    )  # fmt: skip


def experiment(name: str, *, n: list[int] | None = None, rate: list[float] | None = None, cv: list[float] | None = None,
               duration: float | None = None, smoke: bool = False) -> Experiment:  # fmt: skip
    """The named experiment with optional overrides of its sweeps (``--n``, ``--rate``, ``--cv``,
    ``--duration``); ``smoke`` shrinks it to a few short requests on the CPU demo model."""
    lengths = (8, 512)
    if name == "smoke":
        return Experiment(name, "demo", _slora_points([3], [2.0], [1.0], (8, 4), 3.0, (4, 12), ("sse", "ws"),
                                                      vocab=(1000, 40000)), timeout_s=300)  # fmt: skip
    if name in ("slora-s1", "slora-s2"):
        ranks = (8,) if name == "slora-s1" else S2_RANKS
        exp = Experiment(name, "llama-2-7b", _slora_points(n or [5, 100, 1000, 2000], rate or [MAX_RATE], cv or [1.0],
                                                           ranks, duration or 60.0, lengths), server_flags=GPU_FLAGS)  # fmt: skip
    elif name == "slo-vs-rate":
        exp = Experiment(name, "llama-2-7b", _slora_points(n or [100], rate or [2, 4, 8, 12, 16, 20, 24],
                                                           cv or [1.0, 4.0], S2_RANKS, duration or 60.0, lengths),
                         slo_tpot=0.2, server_flags=GPU_FLAGS)  # fmt: skip
    else:
        raise SystemExit(f"unknown experiment {name!r}; known: {', '.join(EXPERIMENTS)}")
    if smoke:  # same sweep structure, ~6 short requests per point on the demo model; rates keep their order
        def shrink(t: dict) -> dict:
            r = 1 + 3 * min(t["rate"], MAX_RATE) / MAX_RATE
            return {**t, "n_variants": math.ceil(math.log10(t["n_variants"])) + 1, "ranks": tuple(min(k, 8) for k in t["ranks"]),
                    "rate": r, "duration": 6 / r, "input_range": (4, 12), "output_range": (2, 6),
                    "vocab": (1000, 40000)}  # fmt: skip

        pts = tuple(replace(p, trace=shrink(p.trace), label=_label(shrink(p.trace), p.protocol)) for p in exp.points[:4])
        exp = replace(exp, shape="demo", points=pts, timeout_s=300, server_flags=())
    return exp


EXPERIMENTS = ("smoke", "slora-s1", "slora-s2", "slo-vs-rate")


# ---------------------------------------------------------------------------------------------
# Model and adapters


def demo_model_dir(python: str = sys.executable) -> Path:
    out = subprocess.run([python, "-m", "deltaserve.demo_model", "--print-path"], check=True, capture_output=True,
                         text=True)  # fmt: skip
    return Path(out.stdout.strip().splitlines()[0])


def write_adapters(root: Path, variants: list[wl.Variant], config: dict, distinct: int = 8) -> Path:
    """A ``--lora-dir``: one subdirectory per variant, its weights a link to one of ``distinct``
    random files per rank (under ``root/.weights``, which has no adapter_config.json)."""
    weights = root / ".weights"
    weights.mkdir(parents=True, exist_ok=True)
    per_rank: dict[int, int] = {}
    for v in variants:
        if v.kind != "lora" or v.rank is None:
            raise ValueError(f"variant {v.name}: only LoRA variants can be generated here (kind {v.kind})")
        k = per_rank.get(v.rank, 0)
        per_rank[v.rank] = k + 1
        src = weights / f"r{v.rank}-{k % distinct}.safetensors"
        if not src.exists():
            write_lora_weights(src, config, v.rank, seed=v.rank * 1000 + k % distinct, targets=LORA_TARGETS)
        d = root / v.name
        d.mkdir(exist_ok=True)
        (d / "adapter_config.json").write_text(json.dumps(lora_config(v.rank, LORA_TARGETS), indent=1))
        link = d / "adapter_model.safetensors"
        if not link.exists():
            link.symlink_to(src)
    return root


# ---------------------------------------------------------------------------------------------
# Servers


@dataclass
class ServerSpec:
    """What a server launcher gets."""

    model_dir: Path | None
    """HF model directory; None serves the daemon's bundled demo model."""
    lora_dir: Path
    """Every adapter the experiment's traces use (``--lora-dir``)."""
    devices: str
    """``cpu`` or CUDA ids."""
    flags: list[str] = field(default_factory=list)
    """Extra server flags (the experiment's, then ``--server-flag``s)."""
    daemon: Path | None = None
    """The deltaserve binary."""
    log: Path | None = None
    """Where the server's output goes."""


@dataclass(frozen=True)
class Endpoint:
    """Where a started server listens."""

    url: str
    """Base URL of /v1/completions."""
    ws_url: str | None = None
    """The /v1/ws URL when it is not ``url``'s (the fake serves it on a second port)."""
    model: str | None = None
    """The ``model`` every request names, whatever its variant (the merged baseline serves one
    model); None sends each request's variant name."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen | None, timeout_s: float, log: Path | None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text(errors="replace")[-4000:] if log else ""
            raise RuntimeError(f"the server exited with {proc.returncode} before /ready:\n{tail}")
        try:
            with urllib.request.urlopen(f"{url}/ready", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url}/ready not 200 after {timeout_s} s (log: {log})")


@contextlib.contextmanager
def launch(cmd: list[str], url: str, log_path: Path | None, ready_timeout_s: float = 1800) -> Iterator[str]:
    """Runs ``cmd`` (a server listening at ``url``) in its own session, output to ``log_path``;
    yields ``url`` once /ready answers 200, and stops the server (SIGTERM, then SIGKILL) after."""
    log = open(log_path, "w") if log_path else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "info")})  # fmt: skip
    try:
        wait_ready(url, proc, ready_timeout_s, log_path)
        yield url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if log is not subprocess.DEVNULL:
            log.close()


@contextlib.contextmanager
def deltaserve_server(spec: ServerSpec) -> Iterator[Endpoint]:
    """The deltaserve daemon on a free port, with every adapter from ``spec.lora_dir``."""
    daemon = spec.daemon or default_daemon()
    port = _free_port()
    cmd = [str(daemon), "--port", str(port), "--python", sys.executable, "--devices", spec.devices,
           "--lora-dir", str(spec.lora_dir), *spec.flags]  # fmt: skip
    if spec.model_dir is not None:
        cmd += ["--model", str(spec.model_dir)]
    with launch(cmd, f"http://127.0.0.1:{port}", spec.log) as url:
        yield Endpoint(url)


@contextlib.contextmanager
def fake_server(spec: ServerSpec) -> Iterator[Endpoint]:
    """bench/fake_server.py (10 ms to the first token, 1 ms per token): a dry run of the driver."""
    from fake_server import FakeServer

    with FakeServer(ttft=0.01, tpot=0.001) as s:
        yield Endpoint(s.url, s.ws_url)


SERVERS: dict[str, Callable[[ServerSpec], contextlib.AbstractContextManager[Endpoint]]] = {
    "deltaserve": deltaserve_server,
    "fake": fake_server,
    "peft": baselines.peft_server,
    "swap": baselines.swap_server,
    "merged": baselines.merged_server,
}
"""Server launchers by ``--server`` name: each yields the :class:`Endpoint` of a ready server
speaking /v1/completions (SSE) and, for ws points, /v1/ws. The baselines (bench/baselines.py)
speak SSE only."""


def default_daemon() -> Path:
    env = os.environ.get("DELTASERVE_BIN")
    builds = [REPO / "target" / "release" / "deltaserve", REPO / "target" / "debug" / "deltaserve"]
    for p in ([Path(env)] if env else []) + builds:
        if p.is_file():
            return p
    raise FileNotFoundError(
        "no deltaserve binary: set DELTASERVE_BIN or --daemon, or `cargo build --release -p deltaserve-daemon`"
    )


# ---------------------------------------------------------------------------------------------
# Running


def detect_devices() -> tuple[str, str]:
    """(``--devices`` value, device name for the result file): GPU 0 when CUDA is available."""
    try:
        import torch

        if torch.cuda.is_available():
            return "0", torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return "cpu", "cpu"


def run(exp: Experiment, *, server: str = "deltaserve", out_dir: Path | None = None, devices: str | None = None,
        daemon: Path | None = None, server_flags: list[str] | None = None, distinct_weights: int = 8,
        plots: bool = True, suffix: str = "") -> Path:  # fmt: skip
    """Runs every point of ``exp``; returns the result file (plots beside it)."""
    auto_devices, device = detect_devices()
    devices = devices or auto_devices
    if devices == "cpu":
        device = "cpu"
    traces = [wl.slora(**p.trace) for p in exp.points]
    with tempfile.TemporaryDirectory(prefix="deltaserve-bench-") as tmp:
        tmp = Path(tmp)
        if exp.shape == "demo":
            model_dir, config_dir = None, demo_model_dir()
        else:
            model_dir = config_dir = write_random_model_dir(exp.shape, tmp / exp.shape)
        config = json.loads((config_dir / "config.json").read_text())
        all_variants = {v.name: v for t in traces for v in t.variants}
        t0 = time.perf_counter()
        lora_dir = write_adapters(tmp / "adapters", list(all_variants.values()), config, distinct_weights)
        adapters_s = time.perf_counter() - t0
        log = (out_dir or RESULTS) / f"{exp.name}{suffix}-server.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        spec = ServerSpec(model_dir=model_dir, lora_dir=lora_dir, devices=devices,
                          flags=[*exp.server_flags, *(server_flags or [])], daemon=daemon, log=log)  # fmt: skip
        loop = rp.event_loop_policy()
        points = []
        t0 = time.perf_counter()
        with SERVERS[server](spec) as endpoint:
            ready_s = time.perf_counter() - t0
            for p, trace in zip(exp.points, traces):
                print(f"[{exp.name}] {p.label}: {len(trace.requests)} requests over {trace.duration:.1f} s",
                      flush=True)  # fmt: skip
                model_for = (lambda v, m=endpoint.model: m) if endpoint.model else None
                records = asyncio.run(rp.replay(trace, endpoint.url, protocol=p.protocol, ws_url=endpoint.ws_url,
                                                model_for=model_for, timeout_s=exp.timeout_s))  # fmt: skip
                summary = rp.summarize(records, slo_tpot=exp.slo_tpot)
                print(f"    {summary['throughput_req_s']:.2f} req/s, {summary['throughput_out_tok_s']:.0f} tok/s, "
                      f"ttft p50 {_fmt(summary['ttft_s']['p50'])} s, failed {summary['failed']}, "
                      f"SLO {_fmt(summary['slo']['attainment'])}", flush=True)  # fmt: skip
                points.append({"label": p.label, "protocol": p.protocol, "trace": trace.params, "summary": summary,
                               "requests": [r.row() for r in records]})  # fmt: skip
    payload = {
        "device": device,
        "server": server,
        "server_flags": spec.flags,
        "model": exp.shape,
        "slo_tpot_s": exp.slo_tpot,
        "timeout_s": exp.timeout_s,
        "distinct_weight_files_per_rank": distinct_weights,
        "adapters": len(all_variants),
        "adapter_generation_s": adapters_s,
        "server_ready_s": ready_s,
        "client_event_loop": loop,
        "points": points,
    }
    path = write_result(exp.name + suffix, payload, out_dir)
    if plots:
        plot([path])
    return path


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


# ---------------------------------------------------------------------------------------------
# Plots


def plot(paths: list[Path], out_stem: Path | None = None) -> list[Path]:
    """Throughput vs n, SLO attainment vs rate and latency CDFs over the points of ``paths``
    (one line per result file and sweep); returns the PNGs written (none without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots", file=sys.stderr)
        return []
    runs = [(Path(p), json.loads(Path(p).read_text())) for p in paths]
    stem = out_stem or runs[0][0].with_suffix("")
    written = []

    def line_name(path: Path, res: dict, extra: str) -> str:
        return f"{res['server']} {extra}" if len(runs) == 1 else f"{path.stem} {extra}"

    # Throughput vs n (points that differ in n at one rate and cv).
    fig, ax = plt.subplots(figsize=(6, 4))
    drew = False
    for path, res in runs:
        groups: dict[tuple, list] = {}
        for pt in res["points"]:
            t = pt["trace"]
            key = (t["rate"], t["cv"], pt["protocol"])
            groups.setdefault(key, []).append((t["n_variants"], pt["summary"]["throughput_req_s"]))
        for (rate, cv, proto), xs in groups.items():
            if len(xs) > 1 and len({x for x, _ in xs}) > 1:
                xs.sort()
                label = line_name(path, res, f"R={rate:g} cv={cv:g} {proto}")
                ax.plot([x for x, _ in xs], [y for _, y in xs], "o-", label=label)
                drew = True
    if drew:
        ax.set(xscale="log", xlabel="adapters (n)", ylabel="throughput (req/s)", title="Throughput vs number of adapters")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)
        written.append(_save(fig, f"{stem}-throughput.png"))
    plt.close(fig)

    # SLO attainment vs rate (points that differ in rate at one n and cv).
    fig, ax = plt.subplots(figsize=(6, 4))
    drew = False
    for path, res in runs:
        groups = {}
        for pt in res["points"]:
            t = pt["trace"]
            groups.setdefault((t["n_variants"], t["cv"], pt["protocol"]), []).append((t["rate"], pt["summary"]["slo"]))
        for (n, cv, proto), xs in groups.items():
            if len({x for x, _ in xs}) > 1:
                xs.sort(key=lambda x: x[0])
                ax.plot([x for x, _ in xs], [s["ttft_attainment"] for _, s in xs], "o-",
                        label=line_name(path, res, f"n={n} cv={cv:g} TTFT≤{xs[0][1]['ttft_s']:g}s"))  # fmt: skip
                if xs[0][1]["tpot_s"] is not None:
                    ax.plot([x for x, _ in xs], [s["attainment"] for _, s in xs], "s--",
                            label=line_name(path, res, f"n={n} cv={cv:g} + TPOT≤{xs[0][1]['tpot_s']:g}s"))  # fmt: skip
                drew = True
    if drew:
        ax.set(xlabel="request rate R (req/s)", ylabel="SLO attainment", title="SLO attainment vs rate", ylim=(0, 1.05))
        ax.legend(fontsize=7)
        written.append(_save(fig, f"{stem}-slo.png"))
    plt.close(fig)

    # Latency CDFs (TTFT and end-to-end) of every point.
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    for path, res in runs:
        for pt in res["points"]:
            for ax, key in ((a1, "ttft"), (a2, "e2e")):
                xs = np.sort([r[key] for r in pt["requests"] if r["error"] is None and r[key] is not None])
                if len(xs):
                    ax.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post", label=line_name(path, res, pt["label"]))
    a1.set(xlabel="TTFT (s)", ylabel="fraction of requests", title="TTFT CDF")
    a2.set(xlabel="end-to-end latency (s)", title="End-to-end latency CDF")
    a2.legend(fontsize=6)
    written.append(_save(fig, f"{stem}-cdf.png"))
    plt.close(fig)
    return written


def _save(fig, name: str) -> Path:
    fig.tight_layout()
    fig.savefig(name, dpi=120)
    return Path(name)


def _list(kind):
    return lambda s: [kind(x) for x in s.split(",")]


def main(argv: list[str] | None = None) -> Path | None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("experiment", choices=(*EXPERIMENTS, "plot"))
    p.add_argument("files", nargs="*", type=Path, help="plot: result JSON files")
    p.add_argument("--server", choices=sorted(SERVERS), default="deltaserve")
    p.add_argument("--smoke", action="store_true", help="a few short requests on the CPU demo model")
    p.add_argument("--n", type=_list(int), help="override the adapter counts, e.g. 5,100")
    p.add_argument("--rate", type=_list(float), help="override the rates (req/s)")
    p.add_argument("--cv", type=_list(float), help="override the arrival cvs")
    p.add_argument("--duration", type=float, help="override seconds of arrivals per point")
    p.add_argument("--devices", help="`cpu` or CUDA ids (default: 0 when CUDA is available)")
    p.add_argument("--daemon", type=Path, help="deltaserve binary (default: $DELTASERVE_BIN, target/release, target/debug)")
    p.add_argument("--server-flag", action="append", default=[],
                   help="extra server flag (repeat), e.g. --server-flag=--max-num-seqs=128")  # fmt: skip
    p.add_argument("--distinct-weights", type=int, default=8, help="random weight files per rank shared by the adapters")
    p.add_argument("--suffix", default="", help="appended to the experiment name in the result file name")
    p.add_argument("--out-dir", type=Path, default=None, help=f"where results go (default {RESULTS})")
    p.add_argument("--no-plots", action="store_true")
    a = p.parse_args(argv)
    if a.experiment == "plot":
        if not a.files:
            p.error("plot needs result files")
        for f in plot(a.files):
            print(f)
        return None
    exp = experiment(a.experiment, n=a.n, rate=a.rate, cv=a.cv, duration=a.duration, smoke=a.smoke)
    suffix = a.suffix + ("-smoke" if a.smoke and a.experiment != "smoke" else "")
    path = run(exp, server=a.server, out_dir=a.out_dir, devices=a.devices, daemon=a.daemon, server_flags=a.server_flag,
               distinct_weights=a.distinct_weights, plots=not a.no_plots, suffix=suffix)  # fmt: skip
    print(path, f"(commit {git_commit()})")
    return path


if __name__ == "__main__":
    main()
