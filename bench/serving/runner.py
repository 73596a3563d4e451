"""Serving experiments, one command each: start the server, replay the generated traces
open-loop, write ``bench/results/<experiment>-<device>-<date>.json`` and PNG plots.

    python bench/serving.py smoke                     # CPU demo model, a handful of requests
    python bench/serving.py slora-s1 [--n 5,100] [--rate 24] [--duration 60]
    python bench/serving.py slora-s2
    python bench/serving.py slo-vs-rate [--cv 4] [--rate 2,8,16]
    python bench/serving.py deltazip --server deltaserve,swap [--popularity uniform] [--rate 0.5]
    python bench/serving.py deltazip --work-dir /tmp/dz --prepare-only   # write the model files once
    python bench/serving.py slo-vs-rate --smoke       # any experiment, shrunk, on a tiny CPU model
    python bench/serving.py plot results/a.json results/b.json   # one plot set from several runs

Flow of one experiment::

    Experiment.points()          one trace spec per point (n, rate, cv, popularity, ...)
      → prepare_variants()       the files the server reads, under --work-dir (kept, reused by
                                 later runs) or a temporary directory:
                                   LoRA variants: write_adapters(), random PEFT LoRA dirs of the
                                   model's shape, every point's adapters in one --lora-dir
                                   full fine-tunes (deltazip): write_full_variants(), a real
                                   random base checkpoint plus, for deltaserve, one compressed
                                   delta dir per variant (--delta NAME=DIR), for swap, one full
                                   HF model dir per variant (--models-dir)
      → SERVERS[--server]        starts the server once for all points (deltaserve: the daemon
                                 with --model and --lora-dir / --delta; peft, swap, merged: the
                                 baselines of bench/baselines.py, SSE only), waits for /ready
      → replay.replay()          per point, in order; the server is idle between points; the
                                 result file is rewritten after every point ("complete": false
                                 until the last), so a killed run keeps what it measured.
                                 Interrupted during a point (Ctrl-C / SIGINT, SIGTERM), the run
                                 also keeps that point: the records of its requests sent so far
                                 (those still in flight with error "interrupted"), summarized as
                                 any point (replay's docstring: an interrupted point's makespan
                                 ends at the interruption), marked "interrupted": true; the file
                                 is written, the server stopped (further SIGINT / SIGTERM ignored
                                 meanwhile: `timeout` sends its signal twice), and the
                                 interruption re-raised
      → probe_variants()         (deltazip) one fixed greedy prompt per probed variant: their
                                 outputs differ when the variants' weights are really applied
      → write_result() + plots   all points with their traces' parameters, summaries and
                                 per-request rows; throughput vs n, SLO attainment vs rate,
                                 throughput and mean latency vs rate, latency CDFs

``--server a,b`` runs the servers one after the other on the same files; each result file then
ends in ``-<server>`` (a single non-deltaserve ``--server`` too), and one more plot set compares them.

Adapters: ``write_adapters`` writes ``adapter_config.json`` per adapter and links its
``adapter_model.safetensors`` to one of ``--distinct-weights`` random weight files per rank (so
2000 rank-64 adapters of Llama-2-7B do not need 270 GB of disk). Loading still reads and copies
every adapter separately; only the page cache is shared. Weights: A ~ N(0, 1/in), B ~ N(0, 0.01²),
lora_alpha = r; targets q, k, v, o (S-LoRA's).

Full fine-tunes (``write_full_variants``): the base is ``common.write_random_checkpoint`` (real
fp16 safetensors: a delta's lineage check and the swap baseline read real files) plus a word-level
tokenizer (the daemon needs a tokenizer.json). For deltaserve, ``--distinct-weights`` delta
payloads (``common.write_random_delta_dir``: random 4-bit 2:4 codes, a valid delta of this base)
are written; each variant gets its own directory with a copy of one payload's manifest and a link
to its payload. For swap, ``--distinct-checkpoints`` real full checkpoints (the base itself and
base + 1 % noise per further one: a 7B fp16 checkpoint is 13.5 GB) back the variants' model
directories, each variant a link to one of them. Either way every variant is read and loaded on
its own; only the page cache is shared (both servers load from it).

Experiments (defaults; ``--smoke`` shrinks each to a few requests on a tiny model on the CPU)::

    smoke        demo model (SmolLM2-135M), 3 random adapters (ranks 8, 4), 6 requests, sse + ws
    slora-s1     S-LoRA Table 3, S1: Llama-2-7B shape, rank 8, n ∈ {5, 100, 1000, 2000}, alpha 1,
                 cv 1, lengths U[8, 512], rate 40 req/s (above what one H200 serves: saturates),
                 60 s per point (S-LoRA: 5 min)
    slora-s2     the same with ranks 64/32/16/8 round-robin
    slo-vs-rate  S2 ranks, n = 100, alpha 1, cv ∈ {1, 4}, rate ∈ {2, 4, 8, 12, 16, 20, 24}, 60 s
    deltazip     DeltaZip §6 analogue: Llama-2-7B shape, n = 32 full fine-tunes (4-bit 2:4 deltas
                 for deltaserve, full fp16 models for swap), Poisson arrivals, popularity
                 ∈ {zipf-1.5, uniform} × rate ∈ {0.5, 1} req/s, 60 s per point; prompts U[8, 512],
                 outputs U[8, 128] tokens (shorter than the other experiments' U[8, 512] so the
                 swap baseline, which swaps a 13.5 GB model for most batches, drains a point in
                 minutes on one H100; workload.deltazip has no paper lengths). deltaserve:
                 --max-deltas 3 (DeltaZip's N) and a 32 GiB host tier (~9 deltas of 3.4 GB);
                 swap: --resident auto (as many full models as fit beside one batch, as
                 DeltaZip's vLLM-SCB baseline holds: 9 on an H200), --max-batch 32.
                 --distinct-weights 4 delta payloads, --distinct-checkpoints 2 (base + one).
                 Probes 4 variants after the points. Smoke: the tiny smoke-llama shape, 4
                 variants (all distinct), 2 slots, 4 requests per point.

``MAX_RATE`` (40 req/s) is the highest rate any experiment uses; tests/test_replay.py checks the
client sustains 5× it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import baselines  # noqa: E402
import replay as rp  # noqa: E402
import workload as wl  # noqa: E402
from common import (  # noqa: E402
    REPO, RESULTS, SHAPES, SMOKE_SHAPE, checkpoint_tensor_shapes, git_commit, lora_config, write_lora_weights,
    write_random_checkpoint, write_random_delta_dir, write_random_model_dir, write_result,
)
from router_overhead import write_word_tokenizer  # noqa: E402

MAX_RATE = 40.0
"""The highest request rate any experiment below offers (req/s)."""
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
"""Projections the generated adapters adapt (S-LoRA's choice)."""
S2_RANKS = (64, 32, 16, 8)
"""S-LoRA Table 1, S2."""
GPU_FLAGS = ("--lora-host-bytes", str(48 << 30), "--max-deltas", "0")
"""S-LoRA keeps every adapter in host memory: 2000 rank-8 Llama-2-7B adapters are 34 GB (S2's
average rank ~30: too many for host RAM at n = 2000, so the host tier evicts there). No delta
slots: the LoRA experiments give the whole pool to KV and adapters, as S-LoRA does."""
DAEMON_GPU_FLAGS = {"deltaserve": GPU_FLAGS, "merged": GPU_FLAGS}
"""The LoRA experiments' flags per server: only the daemon takes them."""
DELTAZIP_RATES = (0.5, 1.0)
"""Default DeltaZip-analogue rates (req/s); expected to overload the swap baseline, which reads a 13.5 GB model
for most batches (not measured yet)."""
DELTAZIP_LENGTHS = ((8, 512), (8, 128))
"""Prompt and output length ranges of the deltazip experiment (see the module docstring)."""
DELTAZIP_FLAGS = {
    "deltaserve": ("--max-deltas", "3", "--lora-host-bytes", str(32 << 30)),
    "swap": ("--resident", "auto"),
}
"""DeltaZip's N = 3 delta slots, a host tier of ~9 Llama-2-7B deltas; swap keeps as many full models."""
DELTA_BITS, DELTA_SPARSE, DELTA_GROUP = 4, True, 64
"""The compressed deltas' format (DeltaZip's 4-bit 2:4)."""
FINETUNE_NOISE = 0.01
"""Swap's extra full checkpoints: the base + this × each tensor's scale of Gaussian noise."""
PROBE_TOKENS = 8
"""Greedy tokens generated per probed variant."""


# ---------------------------------------------------------------------------------------------
# Experiments


@dataclass(frozen=True)
class Point:
    """One measurement: a trace spec (``workload.slora`` keyword arguments) and how to replay it."""

    label: str
    """Names the point in results and plot legends."""
    trace: dict[str, Any]
    """Keyword arguments of the ``workload`` generator."""
    protocol: str = "sse"
    """Replay transport (``replay.PROTOCOLS``)."""
    workload: str = "slora"
    """The trace generator, a key of ``WORKLOADS``."""


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
    server_flags: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """Extra flags per ``--server`` name (``--server-flag``s given for a flag replace its value)."""
    timeout_s: float = 900.0
    """Per-request limit (an overloaded server may queue for minutes)."""
    distinct_weights: int = 8
    """Random weight files written per LoRA rank, or delta payloads (``--distinct-weights``)."""
    distinct_checkpoints: int = 2
    """Real full checkpoints behind the swap baseline's variants, the base included
    (``--distinct-checkpoints``)."""
    probe_variants: int = 0
    """Variants sent one fixed greedy prompt after the points (``probe_variants``)."""


WORKLOADS: dict[str, Callable[..., wl.Trace]] = {"slora": wl.slora, "deltazip": wl.deltazip}
"""Trace generators by ``Point.workload``."""


def _label(trace: dict, protocol: str) -> str:
    return f"n={trace['n_variants']} R={trace['rate']:g} cv={trace['cv']:g} {protocol}"


def _slora_points(ns, rates, cvs, ranks, duration, lengths, protocols=("sse",), vocab=(100, 32000)):
    return tuple(
        Point(label=f"n={n} R={rate:g} cv={cv:g} {p}", protocol=p,
              trace={"n_variants": n, "alpha": 1.0, "rate": rate, "cv": cv, "duration": duration,
                     "input_range": lengths, "output_range": lengths, "ranks": ranks, "vocab": vocab, "seed": 0})
        for n in ns for rate in rates for cv in cvs for p in protocols
    )  # fmt: skip


def _deltazip_points(popularities, ns, rates, duration, input_range, output_range, vocab=(100, 32000)):
    return tuple(
        Point(label=f"{pop} n={n} R={rate:g}", workload="deltazip",
              trace={"rate": rate, "duration": duration, "popularity": pop, "n_variants": n,
                     "input_range": input_range, "output_range": output_range, "vocab": vocab, "seed": 0})
        for pop in popularities for n in ns for rate in rates
    )  # fmt: skip


def deltazip_experiment(n: list[int] | None = None, rate: list[float] | None = None,
                        popularity: list[str] | None = None, duration: float | None = None,
                        smoke: bool = False) -> Experiment:  # fmt: skip
    """The DeltaZip analogue (module docstring); ``smoke``: 4 variants of the tiny smoke shape, a
    few requests per point at rates that keep the sweep's order."""
    pops = popularity or ["zipf-1.5", "uniform"]
    for pop in pops:
        if pop not in wl.DELTAZIP_POPULARITY:
            raise SystemExit(f"--popularity {pop!r}: want one of {', '.join(wl.DELTAZIP_POPULARITY)}")
    rates = rate or list(DELTAZIP_RATES)
    if smoke:  # 4 requests per point (int(rate * duration)), rates 3 and 4 req/s for the defaults
        pts = _deltazip_points(pops, n or [4], [2.0 + 2.0 * r for r in rates], 1.0, (4, 12), (2, 6), vocab=(3, 256))
        pts = tuple(replace(p, trace={**p.trace, "duration": 4.5 / p.trace["rate"]}) for p in pts)
        return Experiment("deltazip", SMOKE_SHAPE, pts, timeout_s=300, distinct_weights=4, distinct_checkpoints=4,
                          server_flags={"deltaserve": ("--max-deltas", "2"), "swap": ("--resident", "2")},
                          probe_variants=4)  # fmt: skip
    return Experiment("deltazip", "llama-2-7b", _deltazip_points(pops, n or [wl.DELTAZIP_VARIANTS], rates,
                                                                 duration or 60.0, *DELTAZIP_LENGTHS),
                      server_flags=DELTAZIP_FLAGS, distinct_weights=4, distinct_checkpoints=2, probe_variants=4)  # fmt: skip


def experiment(name: str, *, n: list[int] | None = None, rate: list[float] | None = None, cv: list[float] | None = None,
               duration: float | None = None, popularity: list[str] | None = None,
               smoke: bool = False) -> Experiment:  # fmt: skip
    """The named experiment with optional overrides of its sweeps (``--n``, ``--rate``, ``--cv``,
    ``--duration``, ``--popularity``); ``smoke`` shrinks it to a few short requests on a tiny CPU
    model."""
    lengths = (8, 512)
    if name == "deltazip":
        if cv:
            raise SystemExit("--cv: the deltazip experiment's arrivals are Poisson (cv 1)")
        return deltazip_experiment(n, rate, popularity, duration, smoke)
    if popularity:
        raise SystemExit(f"--popularity: only the deltazip experiment sweeps popularity, not {name!r}")
    if name == "smoke":
        return Experiment(name, "demo", _slora_points([3], [2.0], [1.0], (8, 4), 3.0, (4, 12), ("sse", "ws"),
                                                      vocab=(1000, 40000)), timeout_s=300)  # fmt: skip
    if name in ("slora-s1", "slora-s2"):
        ranks = (8,) if name == "slora-s1" else S2_RANKS
        exp = Experiment(name, "llama-2-7b", _slora_points(n or [5, 100, 1000, 2000], rate or [MAX_RATE], cv or [1.0],
                                                           ranks, duration or 60.0, lengths),
                         server_flags=DAEMON_GPU_FLAGS)  # fmt: skip
    elif name == "slo-vs-rate":
        exp = Experiment(name, "llama-2-7b", _slora_points(n or [100], rate or [2, 4, 8, 12, 16, 20, 24],
                                                           cv or [1.0, 4.0], S2_RANKS, duration or 60.0, lengths),
                         slo_tpot=0.2, server_flags=DAEMON_GPU_FLAGS)  # fmt: skip
    else:
        raise SystemExit(f"unknown experiment {name!r}; known: {', '.join(EXPERIMENTS)}")
    if smoke:  # same sweep structure, ~6 short requests per point on the demo model; rates keep their order
        def shrink(t: dict) -> dict:
            r = 1 + 3 * min(t["rate"], MAX_RATE) / MAX_RATE
            return {**t, "n_variants": math.ceil(math.log10(t["n_variants"])) + 1, "ranks": tuple(min(k, 8) for k in t["ranks"]),
                    "rate": r, "duration": 6 / r, "input_range": (4, 12), "output_range": (2, 6),
                    "vocab": (1000, 40000)}  # fmt: skip

        pts = tuple(replace(p, trace=shrink(p.trace), label=_label(shrink(p.trace), p.protocol)) for p in exp.points[:4])
        exp = replace(exp, shape="demo", points=pts, timeout_s=300, server_flags={})
    return exp


EXPERIMENTS = ("smoke", "slora-s1", "slora-s2", "slo-vs-rate", "deltazip")


# ---------------------------------------------------------------------------------------------
# Model and adapters


def demo_model_dir(python: str = sys.executable) -> Path:
    out = subprocess.run([python, "-m", "deltaserve.demo_model", "--print-path"], check=True, capture_output=True,
                         text=True)  # fmt: skip
    return Path(out.stdout.strip().splitlines()[0])


def write_adapters(root: Path, variants: list[wl.Variant], config: dict, distinct: int = 8,
                   weights: Path | None = None) -> Path:  # fmt: skip
    """A ``--lora-dir``: one subdirectory per variant, its weights a link to one of ``distinct``
    random files per rank (under ``weights``, default ``root/.weights``, which has no
    adapter_config.json; existing files there are reused)."""
    weights = weights or root / ".weights"
    weights.mkdir(parents=True, exist_ok=True)
    root.mkdir(parents=True, exist_ok=True)
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
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(src)
    return root


def _fresh_dir(path: Path) -> Path:
    """``path`` emptied (it holds only links and small files this module wrote) and recreated."""
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


def _checkpoint_bytes(config: dict) -> tuple[int, int]:
    """(fp16 bytes of a full checkpoint of ``config``, estimated bytes of one random 4-bit 2:4 delta
    payload: 0.4375 bytes per block-linear weight, fp16 for the rest)."""
    shapes = checkpoint_tensor_shapes(config)
    total = linear = 0
    for name, shape in shapes.items():
        n = math.prod(shape)
        total += n
        if name.startswith("model.layers.") and name.endswith("proj.weight"):
            linear += n
    return 2 * total, int(linear * 0.4375) + 2 * (total - linear)


def _gen_device(devices: str) -> str:
    """Where random checkpoints are drawn: CUDA (much faster at 7B) when the run uses a GPU."""
    return "cpu" if devices == "cpu" else "cuda"


def _drop_partial(checkpoint: Path) -> None:
    """Removes what an interrupted ``write_random_checkpoint`` of ``checkpoint`` left (it writes
    ``<name>.partial`` and renames it when done)."""
    shutil.rmtree(checkpoint.with_name(checkpoint.name + ".partial"), ignore_errors=True)


def _release_gpu(gen_device: str) -> None:
    """Gives this process's cached CUDA blocks back, so the server started next sees them free."""
    if gen_device == "cuda":
        import torch

        torch.cuda.empty_cache()


@dataclass
class VariantFiles:
    """What ``prepare_variants`` wrote for one server."""

    model_dir: Path | None
    """The base model the daemon serves (None: the demo model)."""
    lora_dir: Path | None
    """``--lora-dir`` of LoRA variants, or the swap baseline's ``--models-dir`` of full models."""
    deltas: dict[str, Path] = field(default_factory=dict)
    """Compressed delta directories by variant name (``--delta NAME=DIR``)."""


def write_base_checkpoint(work: Path, config: dict, gen_device: str) -> Path:
    """``work/base``: a random fp16 checkpoint of ``config`` with a word-level tokenizer, written
    once (an existing one is reused)."""
    base = work / "base"
    if not base.exists():
        t0 = time.perf_counter()
        _drop_partial(base)
        write_random_checkpoint(config, base, seed=0, device=gen_device)
        _release_gpu(gen_device)
        print(f"base checkpoint written in {time.perf_counter() - t0:.1f} s: {base}", flush=True)
    if not (base / "tokenizer.json").is_file():
        write_word_tokenizer(base, config["vocab_size"])
    return base


def write_full_variants(work: Path, out: Path, server: str, variants: list[wl.Variant], config: dict,
                        distinct_deltas: int, distinct_checkpoints: int, gen_device: str) -> VariantFiles:  # fmt: skip
    """The files ``server`` needs to serve the full fine-tunes ``variants`` (module docstring):
    the shared ones (base, payloads, checkpoints) under ``work``, reused when present; the
    per-variant directories (manifest copies, links) under ``out``, rewritten."""
    if server not in ("deltaserve", "swap", "fake"):
        raise SystemExit(f"--server {server}: full fine-tunes are served by deltaserve (compressed deltas) or swap "
                         "(whole models), not by the LoRA baselines")  # fmt: skip
    if server == "fake":  # answers any model name: no files
        return VariantFiles(model_dir=None, lora_dir=_fresh_dir(out))
    if distinct_deltas < 1 or distinct_checkpoints < 1:
        raise SystemExit("--distinct-weights and --distinct-checkpoints must be >= 1")
    full_bytes, delta_bytes = _checkpoint_bytes(config)
    base = work / "base"
    need = 0 if base.exists() else full_bytes
    if server == "deltaserve":
        payloads = [work / f"delta-payloads-{DELTA_BITS}bit-2of4" / f"w{k}" for k in range(distinct_deltas)]
        need += delta_bytes * sum(not (d / "manifest.json").is_file() for d in payloads)
    elif server == "swap":
        finetunes = [work / "finetunes" / f"ft{k}" for k in range(1, distinct_checkpoints)]
        need += full_bytes * sum(not d.exists() for d in finetunes)
    work.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(work).free
    if need > 0.95 * free:
        raise SystemExit(f"{work}: {need / 1e9:.1f} GB of model files to write, {free / 1e9:.1f} GB free; lower "
                         "--distinct-weights / --distinct-checkpoints or pick another --work-dir")  # fmt: skip
    base = write_base_checkpoint(work, config, gen_device)
    out = _fresh_dir(out)
    if server == "deltaserve":
        from deltaserve.compress.delta_dir import MANIFEST, read_manifest

        for k, d in enumerate(payloads):
            if not (d / MANIFEST).is_file():
                if d.exists():
                    shutil.rmtree(d)  # an interrupted write: the manifest is renamed into place last
                t0 = time.perf_counter()
                write_random_delta_dir(base, d, DELTA_BITS, DELTA_SPARSE, DELTA_GROUP, seed=100 + k)
                print(f"delta payload {k} written in {time.perf_counter() - t0:.1f} s: {d}", flush=True)
        deltas = {}
        for i, v in enumerate(variants):
            src = payloads[i % len(payloads)]
            d = out / v.name
            d.mkdir()
            shutil.copyfile(src / MANIFEST, d / MANIFEST)
            payload = read_manifest(src)["payload"]["file"]
            (d / payload).symlink_to(src / payload)
            deltas[v.name] = d
        return VariantFiles(model_dir=base, lora_dir=None, deltas=deltas)
    checkpoints = [base]  # swap
    for d in finetunes:
        if not d.exists():
            t0 = time.perf_counter()
            _drop_partial(d)
            write_random_checkpoint(config, d, seed=0, noise=FINETUNE_NOISE, noise_seed=int(d.name[2:]),
                                    device=gen_device)  # fmt: skip
            _release_gpu(gen_device)
            print(f"fine-tuned checkpoint written in {time.perf_counter() - t0:.1f} s: {d}", flush=True)
        if not (d / "tokenizer.json").is_file():
            write_word_tokenizer(d, config["vocab_size"])
        checkpoints.append(d)
    for i, v in enumerate(variants):
        (out / v.name).symlink_to(checkpoints[i % len(checkpoints)], target_is_directory=True)
    return VariantFiles(model_dir=base, lora_dir=out, deltas={})


def prepare_variants(exp: Experiment, server: str, variants: list[wl.Variant], work: Path, devices: str,
                     distinct_weights: int | None = None, distinct_checkpoints: int | None = None) -> VariantFiles:  # fmt: skip
    """The model and variant files ``server`` reads for ``exp``, under ``work`` (per shape)."""
    kinds = {v.kind for v in variants}
    shape_dir = work / exp.shape
    if kinds == {"full"}:
        if exp.shape == "demo":
            raise ValueError(f"{exp.name}: full fine-tunes need a random checkpoint shape, not the demo model")
        return write_full_variants(shape_dir, shape_dir / f"{exp.name}-{server}", server, variants,
                                   SHAPES[exp.shape], distinct_weights or exp.distinct_weights,
                                   distinct_checkpoints or exp.distinct_checkpoints, _gen_device(devices))  # fmt: skip
    if kinds != {"lora"}:
        raise ValueError(f"{exp.name}: variants of kinds {sorted(kinds)}: want all LoRA or all full fine-tunes")
    if exp.shape == "demo":
        model_dir, config_dir = None, demo_model_dir()
    else:
        model_dir = config_dir = write_random_model_dir(exp.shape, shape_dir / "random-model")
        if not (model_dir / "tokenizer.json").is_file():
            write_word_tokenizer(model_dir, SHAPES[exp.shape]["vocab_size"])
    config = json.loads((config_dir / "config.json").read_text())
    lora_dir = write_adapters(_fresh_dir(shape_dir / f"{exp.name}-adapters"), variants, config,
                              distinct_weights or exp.distinct_weights, weights=shape_dir / "lora-weights")  # fmt: skip
    return VariantFiles(model_dir=model_dir, lora_dir=lora_dir)


# ---------------------------------------------------------------------------------------------
# Servers


@dataclass
class ServerSpec:
    """What a server launcher gets."""

    model_dir: Path | None
    """HF model directory; None serves the daemon's bundled demo model."""
    lora_dir: Path | None
    """Every adapter the experiment's traces use (``--lora-dir``; None: no adapters), or the swap
    baseline's directory of full models."""
    devices: str
    """``cpu`` or CUDA ids."""
    flags: list[str] = field(default_factory=list)
    """Extra server flags (the experiment's, then ``--server-flag``s)."""
    daemon: Path | None = None
    """The deltaserve binary."""
    log: Path | None = None
    """Where the server's output goes."""
    deltas: dict[str, Path] = field(default_factory=dict)
    """Compressed deltas the daemon serves (``--delta NAME=DIR``), by name."""


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
    """The deltaserve daemon on a free port, with every adapter from ``spec.lora_dir`` and every
    delta of ``spec.deltas``."""
    daemon = spec.daemon or default_daemon()
    port = _free_port()
    cmd = [str(daemon), "--port", str(port), "--python", sys.executable, "--devices", spec.devices, *spec.flags]
    if spec.lora_dir is not None:
        cmd += ["--lora-dir", str(spec.lora_dir)]
    for name, d in spec.deltas.items():
        cmd += ["--delta", f"{name}={d}"]
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


def merge_flags(defaults: tuple[str, ...] | list[str], extra: list[str]) -> list[str]:
    """``defaults`` less every flag that ``extra`` sets (``--f=V`` or ``--f V``), then ``extra``:
    a ``--server-flag`` replaces an experiment's value instead of repeating the flag (which the
    daemon refuses)."""
    given = {f.split("=", 1)[0] for f in extra if f.startswith("--")}
    out: list[str] = []
    keep = True
    for f in defaults:
        if f.startswith("--"):
            keep = f.split("=", 1)[0] not in given
        if keep:
            out.append(f)
    return out + list(extra)


@contextlib.contextmanager
def work_directory(path: Path | None) -> Iterator[Path]:
    """``path`` (created, kept afterwards) or a temporary directory removed after the run."""
    if path is not None:
        path = Path(path).resolve()
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="deltaserve-bench-") as tmp:
        yield Path(tmp)


def probe_variants(endpoint: Endpoint, names: list[str], vocab: tuple[int, int], timeout_s: float) -> dict[str, Any]:
    """One fixed prompt, ``PROBE_TOKENS`` greedy tokens (EOS ignored), for each of ``names`` in
    turn: per variant the output text, the chosen tokens' logprobs (the daemon reports them; the
    baselines do not), or the error; and how many of each differ. Variants whose weights differ
    give different logprobs even where a random model's greedy text coincides."""
    lo, hi = vocab
    prompt = [lo + (37 * i + 11) % (hi - lo) for i in range(8)]
    outputs: dict[str, str] = {}
    logprobs: dict[str, list[float]] = {}
    errors: dict[str, str] = {}
    for name in names:
        body = {"model": endpoint.model or name, "prompt": prompt, "max_tokens": PROBE_TOKENS, "ignore_eos": True,
                "temperature": 0.0, "stream": False, "logprobs": 1}  # fmt: skip
        req = urllib.request.Request(f"{endpoint.url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                choice = json.loads(r.read())["choices"][0]
            outputs[name] = choice["text"]
            if (choice.get("logprobs") or {}).get("token_logprobs") is not None:
                logprobs[name] = choice["logprobs"]["token_logprobs"]
        except urllib.error.HTTPError as e:
            errors[name] = f"HTTP {e.code}: {e.read().decode(errors='replace')[:300]}"
        except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
            errors[name] = f"{type(e).__name__}: {e}"
    return {"prompt": prompt, "max_tokens": PROBE_TOKENS, "outputs": outputs, "token_logprobs": logprobs,
            "errors": errors, "distinct_outputs": len(set(outputs.values())),
            "distinct_logprobs": len({tuple(v) for v in logprobs.values()})}  # fmt: skip


def run(exp: Experiment, *, server: str = "deltaserve", out_dir: Path | None = None, devices: str | None = None,
        daemon: Path | None = None, server_flags: list[str] | None = None, distinct_weights: int | None = None,
        distinct_checkpoints: int | None = None, plots: bool = True, suffix: str = "",
        work_dir: Path | None = None) -> Path:  # fmt: skip
    """Runs every point of ``exp`` against ``server``; returns the result file (plots beside it).
    The model and variant files go to ``work_dir`` (kept and reused; default: a temporary
    directory); the result file is rewritten after every point, and once more with the partial
    point (``"interrupted": true``) when KeyboardInterrupt or SystemExit stops a point's replay,
    which is then re-raised (the file keeps ``"complete": false``)."""
    if server not in SERVERS:
        raise SystemExit(f"--server {server!r}: want one of {', '.join(sorted(SERVERS))}")
    auto_devices, device = detect_devices()
    devices = devices or auto_devices
    if devices == "cpu":
        device = "cpu"
    traces = [WORKLOADS[p.workload](**p.trace) for p in exp.points]
    all_variants = {v.name: v for t in traces for v in t.variants}
    full = all(v.kind == "full" for v in all_variants.values())
    name = exp.name + suffix
    log = (out_dir or RESULTS) / f"{name}-server.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with work_directory(work_dir) as work:
        t0 = time.perf_counter()
        files = prepare_variants(exp, server, list(all_variants.values()), work, devices, distinct_weights,
                                 distinct_checkpoints)  # fmt: skip
        prepare_s = time.perf_counter() - t0
        spec = ServerSpec(model_dir=files.model_dir, lora_dir=files.lora_dir, devices=devices, deltas=files.deltas,
                          flags=merge_flags(exp.server_flags.get(server, ()), server_flags or []), daemon=daemon,
                          log=log)  # fmt: skip
        payload: dict[str, Any] = {
            "device": device,
            "server": server,
            "server_flags": spec.flags,
            "model": exp.shape,
            "slo_tpot_s": exp.slo_tpot,
            "timeout_s": exp.timeout_s,
            "distinct_weight_files_per_rank": None if full else (distinct_weights or exp.distinct_weights),
            "adapters": len(all_variants),
            "adapter_generation_s": prepare_s,
            "client_event_loop": rp.event_loop_policy(),
            "complete": False,
            "points": [],
        }
        if full:
            payload["full_finetunes"] = {
                "delta_format": {"bits": DELTA_BITS, "sparsity": "2:4" if DELTA_SPARSE else "none",
                                 "group_size": DELTA_GROUP, "values": "random codes (common.write_random_delta_dir)"},
                "distinct_delta_payloads": distinct_weights or exp.distinct_weights,
                "distinct_checkpoints": distinct_checkpoints or exp.distinct_checkpoints,
                "finetune_noise": FINETUNE_NOISE,
            }  # fmt: skip
        t0 = time.perf_counter()
        # `stopping` exits after the server's context: what an interruption enters there lasts
        # until the server is stopped.
        with contextlib.ExitStack() as stopping, SERVERS[server](spec) as endpoint:
            payload["server_ready_s"] = time.perf_counter() - t0
            for p, trace in zip(exp.points, traces):
                print(f"[{name}] {p.label}: {len(trace.requests)} requests over {trace.duration:.1f} s",
                      flush=True)  # fmt: skip
                model_for = (lambda v, m=endpoint.model: m) if endpoint.model else None
                records: list[rp.Record] = []  # filled as requests are sent: kept when interrupted
                metrics_before = server_metrics(endpoint)
                try:
                    rp.run_replay(trace, endpoint.url, protocol=p.protocol, ws_url=endpoint.ws_url, model_for=model_for,
                                  timeout_s=exp.timeout_s, records=records)  # fmt: skip
                except (KeyboardInterrupt, SystemExit):  # Ctrl-C, SIGTERM: keep the point so far, then stop
                    stopping.enter_context(_repeated_signals_ignored())
                    _add_point(payload, p, trace, records, exp, interrupted=True)
                    path = write_result(name, payload, out_dir)
                    print(f"    interrupted: partial result in {path}", flush=True)
                    raise
                _add_point(payload, p, trace, records, exp, interrupted=False)
                m = payload["points"][-1]["server_metrics"] = metrics_delta(metrics_before, server_metrics(endpoint))
                if m:
                    print("    server: " + ", ".join(f"{k.removeprefix('deltaserve_').removesuffix('_total')} {m[k]:g}"
                                                    for k in METRICS_SHOWN if k in m), flush=True)  # fmt: skip
                stats = baseline_stats(endpoint)
                if stats is not None:
                    payload["points"][-1]["server_stats"] = stats
                    print(f"    server: {stats}", flush=True)
                write_result(name, payload, out_dir)
            if exp.probe_variants:
                names = [v.name for v in traces[0].variants][: exp.probe_variants]
                payload["probe"] = probe_variants(endpoint, names, tuple(traces[0].params["vocab"]), exp.timeout_s)
                pr = payload["probe"]
                print(f"    probe of {len(names)} variants: {pr['distinct_outputs']} distinct outputs, "
                      f"{pr['distinct_logprobs']} distinct logprob sequences"
                      f"{', errors: ' + str(pr['errors']) if pr['errors'] else ''}", flush=True)  # fmt: skip
    payload["complete"] = True
    path = write_result(name, payload, out_dir)
    if plots:
        plot([path])
    return path


METRICS_SHOWN = ("deltaserve_steps_total", "deltaserve_preemptions_total", "deltaserve_adapter_host_loads_total",
                 "deltaserve_adapter_gpu_loads_total", "deltaserve_adapter_gpu_evictions_total",
                 "deltaserve_adapter_host_deferrals_total",
                 "deltaserve_worker_step_us_total", "deltaserve_worker_forward_us_total", "deltaserve_step_gap_us_p50")
"""The metrics a point's summary line prints (all of them go to the result file)."""


def _server_get(endpoint: Endpoint, path: str) -> bytes | None:
    """The body of GET ``path`` on the server, or None when it has no such route or does not answer."""
    base = endpoint.url.split("/v1/")[0]
    try:
        with urllib.request.urlopen(f"{base}{path}", timeout=5) as r:
            return r.read()
    except (OSError, ValueError):
        return None


def baseline_stats(endpoint: Endpoint) -> dict[str, Any] | None:
    """A baseline's ``/stats`` counters (bench/baselines.py ``Engine.stats``: loads, batches, slots,
    resident variants), or None when the server has none (the daemon, the fake server)."""
    body = _server_get(endpoint, "/stats")
    try:
        return None if body is None else json.loads(body)
    except ValueError:
        return None


def server_metrics(endpoint: Endpoint) -> dict[str, float] | None:
    """The server's Prometheus ``/metrics`` as {name: value} (unlabelled samples only), or None
    when it has none (the baselines, the fake server) or does not answer."""
    body = _server_get(endpoint, "/metrics")
    if body is None:
        return None
    try:
        text = body.decode()
    except ValueError:
        return None
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and not line.startswith("#") and "{" not in parts[0]:
            try:
                out[parts[0]] = float(parts[1])
            except ValueError:
                continue
    return out or None


def metrics_delta(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, Any] | None:
    """What a point did to the server's metrics: counters (``*_total``) as the point's increase,
    gauges as read after the point. None without metrics."""
    if before is None or after is None:
        return None
    return {k: (v - before.get(k, 0.0) if k.endswith("_total") else v) for k, v in after.items()}


@contextlib.contextmanager
def _repeated_signals_ignored() -> Iterator[None]:
    """SIGINT and SIGTERM do nothing inside (their handlers restored after): a run that one of
    them interrupted writes its partial point and stops its server undisturbed. ``timeout -s
    INT`` signals the process and then its process group, so the process gets the signal twice,
    the second often while the result is being written; a second Ctrl-C changes nothing either
    (the server's stop is bounded: SIGTERM, SIGKILL after 60 s). Main thread only (elsewhere a
    no-op: signals are handled there)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)


def _add_point(payload: dict[str, Any], p: Point, trace: wl.Trace, records: list[rp.Record], exp: Experiment,
               interrupted: bool) -> None:  # fmt: skip
    """Appends point ``p``'s summary and per-request rows to ``payload`` and prints its line; an
    ``interrupted`` point has the records of the requests sent before the interruption (those in
    flight then: error ``replay.INTERRUPTED``)."""
    summary = rp.summarize(records, slo_tpot=exp.slo_tpot)
    head = (f"INTERRUPTED after {len(records)} of {len(trace.requests)} requests sent, "
            f"{summary['completed']} completed: " if interrupted else "")  # fmt: skip
    print(f"    {head}{summary['throughput_req_s']:.2f} req/s, {summary['throughput_out_tok_s']:.0f} tok/s, "
          f"ttft p50 {_fmt(summary['ttft_s']['p50'])} s, e2e mean {_fmt(summary['e2e_s']['mean'])} s, "
          f"failed {summary['failed']} ({summary['interrupted']} of them cut by the interruption), "
          f"SLO {_fmt(summary['slo']['attainment'])}", flush=True)  # fmt: skip
    payload["points"].append({"label": p.label, "protocol": p.protocol, "trace": trace.params,
                              "interrupted": interrupted, "summary": summary,
                              "requests": [r.row() for r in records]})  # fmt: skip


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


# ---------------------------------------------------------------------------------------------
# Plots


def _sweep(t: dict) -> tuple[float, str]:
    """(cv, popularity) of a trace's parameters (deltazip traces: Poisson, cv 1)."""
    return t.get("cv", 1.0), t.get("popularity", "power")


def _sweep_name(cv: float, popularity: str) -> str:
    return f"cv={cv:g}" + ("" if popularity == "power" else f" {popularity}")


def plot(paths: list[Path], out_stem: Path | None = None) -> list[Path]:
    """Throughput vs n, SLO attainment vs rate, throughput and mean end-to-end latency vs rate,
    and latency CDFs over the points of ``paths`` (one line per result file and sweep); returns
    the PNGs written (none without matplotlib)."""
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
            key = (t["rate"], *_sweep(t), pt["protocol"])
            groups.setdefault(key, []).append((t["n_variants"], pt["summary"]["throughput_req_s"]))
        for (rate, cv, pop, proto), xs in groups.items():
            if len(xs) > 1 and len({x for x, _ in xs}) > 1:
                xs.sort()
                label = line_name(path, res, f"R={rate:g} {_sweep_name(cv, pop)} {proto}")
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
            key = (t["n_variants"], *_sweep(t), pt["protocol"])
            groups.setdefault(key, []).append((t["rate"], pt["summary"]["slo"]))
        for (n, cv, pop, proto), xs in groups.items():
            if len({x for x, _ in xs}) > 1:
                xs.sort(key=lambda x: x[0])
                sweep = _sweep_name(cv, pop)
                ax.plot([x for x, _ in xs], [s["ttft_attainment"] for _, s in xs], "o-",
                        label=line_name(path, res, f"n={n} {sweep} TTFT≤{xs[0][1]['ttft_s']:g}s"))  # fmt: skip
                if xs[0][1]["tpot_s"] is not None:
                    ax.plot([x for x, _ in xs], [s["attainment"] for _, s in xs], "s--",
                            label=line_name(path, res, f"n={n} {sweep} + TPOT≤{xs[0][1]['tpot_s']:g}s"))  # fmt: skip
                drew = True
    if drew:
        ax.set(xlabel="request rate R (req/s)", ylabel="SLO attainment", title="SLO attainment vs rate", ylim=(0, 1.05))
        ax.legend(fontsize=7)
        written.append(_save(fig, f"{stem}-slo.png"))
    plt.close(fig)

    # Throughput and mean end-to-end latency vs rate (the deltazip comparison: one line per server
    # run and popularity).
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    drew = False
    for path, res in runs:
        groups = {}
        for pt in res["points"]:
            t, sm = pt["trace"], pt["summary"]
            groups.setdefault((t["n_variants"], *_sweep(t), pt["protocol"]), []).append(
                (t["rate"], sm["throughput_req_s"], sm["e2e_s"]["mean"]))
        for (n, cv, pop, proto), xs in groups.items():
            if len({x for x, _, _ in xs}) > 1:
                xs.sort(key=lambda x: x[0])
                label = line_name(path, res, f"n={n} {_sweep_name(cv, pop)} {proto}")
                a1.plot([x for x, _, _ in xs], [y for _, y, _ in xs], "o-", label=label)
                a2.plot([x for x, _, _ in xs], [math.nan if e is None else e for _, _, e in xs], "o-", label=label)
                drew = True
    if drew:
        a1.set(xlabel="request rate (req/s)", ylabel="throughput (req/s)", title="Throughput vs rate")
        a1.set_ylim(bottom=0)
        a2.set(xlabel="request rate (req/s)", ylabel="mean end-to-end latency (s)", title="Mean latency vs rate")
        a2.set_ylim(bottom=0)
        a2.legend(fontsize=7)
        written.append(_save(fig, f"{stem}-rate.png"))
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


def flags_for(server: str, flags: list[str]) -> list[str]:
    """The ``--server-flag``s for ``server``: those without a prefix and those written
    ``SERVER:FLAG`` for it (prefix removed)."""
    out = []
    for f in flags:
        prefix, sep, rest = f.partition(":")
        if sep and prefix in SERVERS:
            if prefix == server:
                out.append(rest)
        else:
            out.append(f)
    return out


def _servers(spec: str) -> list[str]:
    names = [s for s in spec.split(",") if s]
    for s in names:
        if s not in SERVERS:
            raise argparse.ArgumentTypeError(f"{s!r}: want one of {', '.join(sorted(SERVERS))}")
    if not names or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"{spec!r}: want distinct server names, comma-separated")
    return names


def main(argv: list[str] | None = None) -> Path | None:
    """The command line (module docstring); returns the first server's result file (all are printed)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("experiment", choices=(*EXPERIMENTS, "plot"))
    p.add_argument("files", nargs="*", type=Path, help="plot: result JSON files")
    p.add_argument("--server", type=_servers, default=["deltaserve"],
                   help=f"one of {', '.join(sorted(SERVERS))}, or several comma-separated (run in turn)")  # fmt: skip
    p.add_argument("--smoke", action="store_true", help="a few short requests on a tiny CPU model")
    p.add_argument("--n", type=_list(int), help="override the adapter (variant) counts, e.g. 5,100")
    p.add_argument("--rate", type=_list(float), help="override the rates (req/s)")
    p.add_argument("--cv", type=_list(float), help="override the arrival cvs")
    p.add_argument("--popularity", type=_list(str), help="deltazip: override the popularities (zipf-1.5,uniform)")
    p.add_argument("--duration", type=float, help="override seconds of arrivals per point")
    p.add_argument("--devices", help="`cpu` or CUDA ids (default: 0 when CUDA is available)")
    p.add_argument("--daemon", type=Path, help="deltaserve binary (default: $DELTASERVE_BIN, target/release, target/debug)")
    p.add_argument("--server-flag", action="append", default=[],
                   help="extra server flag (repeat), e.g. --server-flag=--max-num-seqs=128; SERVER:FLAG gives it "
                        "to that server only, e.g. --server-flag=swap:--resident=2; replaces the experiment's "
                        "value of the same flag")  # fmt: skip
    p.add_argument("--distinct-weights", type=int, default=None,
                   help="random weight files per LoRA rank (default 8), or delta payloads (deltazip: 4)")  # fmt: skip
    p.add_argument("--distinct-checkpoints", type=int, default=None,
                   help="deltazip, swap: real full checkpoints behind the variants, the base included (default 2)")  # fmt: skip
    p.add_argument("--work-dir", type=Path, default=None,
                   help="keep the model and variant files here and reuse them in later runs (default: a temporary "
                        "directory per command)")  # fmt: skip
    p.add_argument("--prepare-only", action="store_true", help="write the files of every --server to --work-dir, then exit")
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
    exp = experiment(a.experiment, n=a.n, rate=a.rate, cv=a.cv, duration=a.duration, popularity=a.popularity,
                     smoke=a.smoke)  # fmt: skip
    suffix = a.suffix + ("-smoke" if a.smoke and a.experiment != "smoke" else "")
    servers = a.server
    if a.prepare_only:
        if a.work_dir is None:
            p.error("--prepare-only needs --work-dir (where the files stay)")
        devices = a.devices or detect_devices()[0]
        variants = list({v.name: v for pt in exp.points for v in WORKLOADS[pt.workload](**pt.trace).variants}.values())
        for server in servers:
            t0 = time.perf_counter()
            with work_directory(a.work_dir) as work:
                prepare_variants(exp, server, variants, work, devices, a.distinct_weights, a.distinct_checkpoints)
            print(f"{server}: files ready under {work} in {time.perf_counter() - t0:.1f} s", flush=True)
        return None
    paths = []
    with work_directory(a.work_dir) as work:  # several servers share one set of files
        for server in servers:
            tag = f"-{server}" if len(servers) > 1 or server != "deltaserve" else ""
            path = run(exp, server=server, out_dir=a.out_dir, devices=a.devices, daemon=a.daemon,
                       server_flags=flags_for(server, a.server_flag), distinct_weights=a.distinct_weights,
                       distinct_checkpoints=a.distinct_checkpoints, plots=not a.no_plots, suffix=suffix + tag,
                       work_dir=work)  # fmt: skip
            print(path, f"(commit {git_commit()})", flush=True)
            paths.append(path)
    if len(paths) > 1 and not a.no_plots:
        stem = paths[0].with_suffix("")
        stem = stem.with_name(stem.name.replace(f"-{servers[0]}-", f"-{'-vs-'.join(servers)}-", 1))
        for f in plot(paths, out_stem=stem):
            print(f)
    return paths[0]


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    # A killed run (`timeout`, a job limit) unwinds like Ctrl-C: the point in progress is written
    # with what it measured (run()), and the server it started is stopped (it runs in its own
    # session, so it would otherwise outlive this process and hold the GPU).
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    main()
