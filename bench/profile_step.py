"""Where a decode step's device time goes, kernel by kernel: torch.profiler over ``Executor.step``
(Llama-2-7B shape, random weights, KV length 512), for base, compressed-delta and LoRA decode steps
replayed from CUDA graphs (``--eager``: run eagerly). Each case's kernels are grouped by kind
(``KINDS``) and set against the base step of the same batch, so what a variant adds to a step splits
into its parts: the SBMM, the lm_head delta, the norm and embedding deltas' gathers, LoRA's shrink and
expand, and what the base kernels themselves lose beside them.

Cases (``--cases``, comma-separated), each ``<rows>-b<batch>``, ``<rows>-b<batch>-c<chunk>`` or
``<rows>-b<batch>-c<chunk>-p<cached>``:

- ``base-bN``: every row on the base model;
- ``deltaK-bN``: row i on compressed delta ``1 + i % K`` (4-bit 2:4, group 64, on every block linear,
  plus dense embedding / lm_head / norm deltas: what ``deltaserve compress`` writes; each delta its own
  GPU slot, as ``bench.delta_decode_step``);
- ``loraK-bN``: row i on LoRA adapter ``1 + i % K`` (rank 16 on all seven projections, as
  ``bench.lora_decode_step``);
- ``-cM`` after any of them: a mixed step, as continuous batching forms them under load: every step
  also prefills a new M-token prompt (on the first variant of the case's kind) beside the decodes,
  replayed from the mixed graphs' token buckets (``--eager``: eagerly). It is set against
  ``base-bN-cM`` when the run has that case. ``b0`` with a chunk: the chunk alone.
- ``-pP`` after ``-cM``: the prompt's first P tokens are cached (a prefix-cache hit), so the step
  computes its last M beside the decodes: ``base-b0-c32-p992`` is the step behind TTFT with a warm
  1,000-token system prompt (``bench.prefix_caching``).

Device time per step is the sum of the kernels' durations over the profiled steps divided by their
number, set against the worker's floor of the step (``floor_us``, ``worker/step_floor.py``: the
bytes it reads at the copy bandwidth or its FLOPs at the matmul peak, the larger; 0 on the CPU,
which measures none); ``step_ms`` is the wall clock of the same steps (profiled, so a little above the plain
benchmarks' figures).

    python3 -m bench.profile_step [--cases base-b1,base-b64,delta1-b64,delta8-b64,lora1-b64,lora64-b64]
        [--steps 5] [--warmup 3] [--eager] [--top 12] [--out DIR]
    python3 -m bench.profile_step --smoke [--out DIR]   # tiny shape on the CPU (CPU ops): checks the script

``--host-profile``: the launching thread's side instead. The timed steps run under ``cProfile`` (no
torch profiler), and each case records the Python functions with the most own time per step
(``host_functions``: own and cumulative µs per step, calls per step). The step's wall time is then
inflated by cProfile's per-call cost, so read the shares, not the totals.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import re
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import torch

from bench import script_env

script_env.prepare()  # deltaserve importable from pyworker/

from bench.common import (  # noqa: E402
    SHAPES,
    SMOKE_SHAPE,
    device_name,
    shape_config,
    write_random_checkpoint,
    write_random_lora_dir,
    write_result,
)
from bench.decode_step import bench_batch  # noqa: E402
from bench.delta_decode_step import make_delta_dirs  # noqa: E402
from bench.delta_decode_step import place as place_deltas  # noqa: E402
from bench.lora_decode_step import SEVEN  # noqa: E402
from bench.lora_decode_step import place as place_loras  # noqa: E402
from deltaserve.adapters.delta_blocks import SHARING_ENV  # noqa: E402
from deltaserve.worker.executor import Executor  # noqa: E402

KINDS: tuple[tuple[str, str], ...] = (
    ("sbmm", r"sbmm"),
    ("lm_head delta", r"dense_delta"),
    ("lora", r"lora|sgmv|mbgmv|bgmv"),
    ("attention", r"paged|attn|attention|flash"),
    ("gemm", r"gemm|cutlass|xmma|nvjet|cublas|sm90_|sm80_|splitkreduce|aten::(addmm|mm|bmm|matmul)$"),
    ("norm", r"rmsnorm|norm"),
    ("rope", r"rope"),
    ("silu_mul", r"silu"),
    ("gather / index", r"index|gather|embedding|scatter"),
    ("copy / fill", r"memcpy|memset|copy|fill"),
    ("elementwise / reduce", r"elementwise|vectorized|unrolled|reduce|add|mul"),
)
"""(kind, regex over the lower-cased kernel name), first match wins; anything else is ``other``."""

LORA_RANK = 16
DELTA_CONFIG = {"bits": 4, "sparse": True, "group_size": 64}
DEFAULT_CASES = "base-b1,base-b64,delta1-b64,delta8-b64,lora1-b64,lora64-b64"
SMOKE = {
    "cases": "base-b2,delta2-b2,lora2-b2,base-b2-c5,lora2-b2-c5,base-b0-c5-p16,lora2-b0-c5-p16",
    "steps": 2,
    "warmup": 1,
    "ctx": 16,
}
"""``--smoke`` overrides (with ``SMOKE_SHAPE``, float32 on the CPU, CPU operators instead of kernels)."""


@dataclass(frozen=True)
class Case:
    name: str
    kind: str
    """``base``, ``delta`` or ``lora``."""
    variants: int
    batch: int
    chunk: int = 0
    """Prompt tokens prefilled beside the decodes each step (0: a decode step)."""
    cached: int = 0
    """Tokens of that prompt already cached ahead of the chunk (a prefix-cache hit)."""

    def rows(self, first_id: int) -> list[int]:
        """The variant id of each row (0: the base)."""
        if self.kind == "base":
            return [0] * self.batch
        return [first_id + i % self.variants for i in range(self.batch)]

    def chunk_row(self, first_id: int) -> int:
        """The chunk's variant id: the case's first."""
        return 0 if self.kind == "base" else first_id


def parse_case(spec: str) -> Case:
    m = re.fullmatch(r"(base|delta(\d+)|lora(\d+))-b(\d+)(?:-c(\d+)(?:-p(\d+))?)?", spec.strip())
    if m is None:
        raise SystemExit(
            f"--cases: {spec!r} is not base-bN, deltaK-bN or loraK-bN (then -cM for a mixed step, then -pP "
            "for a cached prefix)"
        )
    kind = m.group(1).rstrip("0123456789")
    variants = int(m.group(2) or m.group(3) or 0)
    batch, chunk, cached = int(m.group(4)), int(m.group(5) or 0), int(m.group(6) or 0)
    if batch + chunk < 1 or (kind != "base" and variants < 1) or (m.group(5) is not None and chunk < 1):
        raise SystemExit(f"--cases: {spec!r} needs a batch >= 1 (or a chunk), at least one variant and a chunk >= 1")
    return Case(spec.strip(), kind, variants, batch, chunk, cached)


def kind_of(kernel: str) -> str:
    low = kernel.lower()
    return next((kind for kind, pattern in KINDS if re.search(pattern, low)), "other")


def kernel_times(prof: torch.profiler.profile, steps: int, device_kernels: bool) -> dict[str, tuple[float, float]]:
    """Kernel name -> (µs per step, launches per step) over the profiled steps; on the CPU
    (``device_kernels`` False) the operators' self CPU time instead."""
    totals: dict[str, list[float]] = {}
    for e in prof.events():
        on_device = e.device_type == torch.autograd.DeviceType.CUDA
        if on_device != device_kernels:
            continue
        us = e.time_range.elapsed_us() if device_kernels else e.self_cpu_time_total
        entry = totals.setdefault(e.name, [0.0, 0.0])
        entry[0] += us
        entry[1] += 1
    return {name: (us / steps, n / steps) for name, (us, n) in totals.items()}


def host_functions(host: cProfile.Profile, steps: int, keep: int = 60) -> list[dict]:
    """The ``keep`` Python functions with the most own time over the profiled steps, per step: own and
    cumulative µs, calls."""
    rows = []
    for (file, line, name), (_, calls, own, cum, _) in pstats.Stats(host).stats.items():  # type: ignore[attr-defined]
        where = name if file == "~" else f"{Path(file).name}:{line}({name})"
        rows.append(
            {"function": where, "own_us": own / steps * 1e6, "cum_us": cum / steps * 1e6, "calls": calls / steps}
        )
    return sorted(rows, key=lambda r: -r["own_us"])[:keep]


def by_kind(kernels: dict[str, tuple[float, float]]) -> dict[str, dict[str, float]]:
    """Kind -> {"us": µs per step, "launches": per step}."""
    out: dict[str, dict[str, float]] = {}
    for name, (us, n) in kernels.items():
        k = out.setdefault(kind_of(name), {"us": 0.0, "launches": 0.0})
        k["us"] += us
        k["launches"] += n
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["us"]))


def profile_case(ex: Executor, case: Case, args, first_id: int, first_block: int, variant_base: int) -> dict:
    """The case's timed steps under the profiler: wall times, kernels and their kinds."""
    on_gpu = ex.device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU]
    if on_gpu:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    prof = torch.profiler.profile(activities=activities)
    host = cProfile.Profile() if args.host_profile else None
    start, stop = (prof.start, prof.stop) if host is None else (host.enable, host.disable)

    def after_step(index: int) -> None:  # index 0 admits the requests, then warm-up, then the timed steps
        if index in (args.warmup, args.warmup + args.steps):
            if on_gpu:
                torch.cuda.synchronize(ex.device)
            (start if index == args.warmup else stop)()

    def replays() -> int:  # decode and mixed graphs
        mixed = ex.runner.mixed
        return (ex.graphs.replays if ex.graphs is not None else 0) + (mixed.replays if mixed is not None else 0)

    before = replays()
    stats: dict = {}
    floors: list[int] = []
    times = bench_batch(
        ex,
        case.batch,
        args.ctx,
        args.steps,
        args.warmup,
        first_id=first_id,
        adapter_ids=case.rows(variant_base),
        first_block=first_block,
        after_step=after_step,
        stats=stats,
        floors=floors,
        chunk=case.chunk,
        chunk_adapter=case.chunk_row(variant_base),
        chunk_cached=case.cached,
    )
    row = {
        "case": case.name,
        "batch": case.batch,
        "chunk": case.chunk,
        "cached_prefix": case.cached,
        "requests_per_step": statistics.median(stats["outputs_per_step"]),
        "rows": case.kind,
        "variants": case.variants,
        "step_ms": statistics.median(times) * 1e3,
        "graph_replays": replays() - before,
        "floor_us": statistics.median(floors),
    }
    if host is not None:
        return {**row, "host_functions": host_functions(host, args.steps)}
    kernels = kernel_times(prof, args.steps, device_kernels=on_gpu)
    device_us = sum(us for us, _ in kernels.values())
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][0])
    return {
        **row,
        "device_us_per_step": device_us,
        "device_over_floor": device_us / row["floor_us"] if any(floors) else None,
        "launches_per_step": sum(n for _, n in kernels.values()),
        "by_kind": by_kind(kernels),
        "kernels": [{"name": name, "us": us, "launches": n} for name, (us, n) in ranked],
    }


def against_base(rows: list[dict]) -> None:
    """Adds each variant case's device time minus the base step of its batch and chunk, per kind
    (``added_by_kind``)."""
    base = {(r["batch"], r["chunk"], r["cached_prefix"]): r for r in rows if r["rows"] == "base"}
    for r in rows:
        b = base.get((r["batch"], r["chunk"], r["cached_prefix"]))
        if r["rows"] == "base" or b is None:
            continue
        kinds = set(r["by_kind"]) | set(b["by_kind"])
        added = {k: r["by_kind"].get(k, {}).get("us", 0.0) - b["by_kind"].get(k, {}).get("us", 0.0) for k in kinds}
        r["added_us"] = r["device_us_per_step"] - b["device_us_per_step"]
        r["added_step_ms"] = r["step_ms"] - b["step_ms"]
        r["added_by_kind"] = dict(sorted(added.items(), key=lambda kv: -abs(kv[1])))


def report(r: dict, top: int) -> None:
    if "host_functions" in r:
        print(f"\n{r['case']}: step {r['step_ms']:.2f} ms under cProfile ({r['graph_replays']} graph replays)")
        print(f"  {'own us':>9s} {'cum us':>9s} {'calls':>7s}  function")
        for f in r["host_functions"][:top]:
            print(f"  {f['own_us']:9.1f} {f['cum_us']:9.1f} {f['calls']:7.1f}  {f['function'][:100]}")
        return
    floor = (
        f", {r['device_over_floor']:.2f}x the worker's floor {r['floor_us'] / 1e3:.2f} ms"
        if r["device_over_floor"]
        else ""
    )
    print(
        f"\n{r['case']}: step {r['step_ms']:.2f} ms, device {r['device_us_per_step'] / 1e3:.2f} ms in "
        f"{r['launches_per_step']:.0f} kernels ({r['graph_replays']} graph replays){floor}"
    )
    for kind, v in r["by_kind"].items():
        added = r.get("added_by_kind", {}).get(kind)
        extra = "" if added is None else f"   {added:+9.1f} us vs base"
        print(f"  {kind:22s} {v['us']:9.1f} us  {v['launches']:6.0f} launches{extra}")
    if "added_us" in r:
        print(f"  added to the base step: device {r['added_us']:+.1f} us, wall {r['added_step_ms']:+.2f} ms")
    for k in r["kernels"][:top]:
        print(f"    {k['us']:9.1f} us {k['launches']:5.0f}x  {k['name'][:110]}")


def most_variants(cases: list[Case], kind: str) -> int:
    """The most variants of ``kind`` (``delta`` / ``lora``) any case uses: what the executor holds."""
    return max((c.variants for c in cases if c.kind == kind), default=0)


def build_executor(base: Path, device: torch.device, dtype: str, cases: list[Case], eager: bool, kv_bytes: int):
    batch = max(c.batch + (c.chunk > 0) for c in cases)
    loras, deltas = most_variants(cases, "lora"), most_variants(cases, "delta")
    return Executor(
        base,
        device=str(device),
        dtype=dtype,
        block_size=16,
        kv_cache_bytes=kv_bytes,
        gpu_memory_utilization=0.92,
        cuda_graph_max_batch=0 if eager or device.type != "cuda" else batch,
        max_lora_rank=LORA_RANK if loras else 0,
        max_loras_per_step=batch,
        max_deltas=deltas,
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama-2-7b")
    p.add_argument("--cases", default=DEFAULT_CASES)
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--top", type=int, default=12, help="kernels printed per case (the JSON keeps all)")
    p.add_argument("--eager", action="store_true", help="run the steps eagerly (no CUDA graphs)")
    p.add_argument("--smoke", action="store_true", help="tiny shape on the CPU (checks the script runs)")
    p.add_argument(
        "--host-profile",
        action="store_true",
        help="cProfile the launching thread over the timed steps instead of the kernels (module docstring)",
    )
    p.add_argument("--out", type=Path, default=None, help="result directory (default bench/results)")
    p.add_argument("--suffix", default="", help="appended to the result's experiment name")
    args = p.parse_args(argv)
    if args.smoke:
        args.shape = SMOKE_SHAPE
        for k, v in SMOKE.items():
            setattr(args, k, v)
    if args.warmup < 1 or args.steps < 1:
        raise SystemExit("--warmup and --steps must be >= 1")
    return args


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    with mock.patch.dict(os.environ, {SHARING_ENV: "off"}):  # every delta id its own slot, for this run
        return run(args)


def run(args: argparse.Namespace) -> Path:
    cases = [parse_case(s) for s in args.cases.split(",")]
    if args.smoke:
        device, dtype, kv_bytes = torch.device("cpu"), "float32", 64 << 20
    else:
        if not torch.cuda.is_available():
            raise SystemExit("profile_step.py needs a CUDA device (or --smoke for a CPU check of the script)")
        device, dtype, kv_bytes = torch.device("cuda:0"), "float16", 0
    config = shape_config(args.shape)
    deltas, loras = most_variants(cases, "delta"), most_variants(cases, "lora")
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        base = write_random_checkpoint(config, root / args.shape, seed=0, device=device.type)
        delta_dirs = (
            make_delta_dirs(base, root / "deltas", deltas, 2, DELTA_CONFIG["bits"], True, DELTA_CONFIG["group_size"])
            if deltas
            else {}
        )
        lora_base = 1 + deltas  # variant ids: deltas 1..deltas, then the adapters
        lora_dirs: dict[int, Path] = {}
        if loras:  # every adapter links one random weight file
            weights = write_random_lora_dir(root / "w", SHAPES[args.shape], LORA_RANK, SEVEN, seed=1)
            lora_dirs = {
                lora_base + k: write_random_lora_dir(
                    root / "loras" / f"a{k}",
                    SHAPES[args.shape],
                    LORA_RANK,
                    SEVEN,
                    weights=weights / "adapter_model.safetensors",
                )
                for k in range(loras)
            }
        ex = build_executor(base, device, dtype, cases, args.eager, kv_bytes)
        t0 = time.perf_counter()
        if delta_dirs:
            place_deltas(ex, delta_dirs, step_id=999_998)
        first_block = place_loras(ex, lora_dirs, 0) if lora_dirs else 0
        print(f"{deltas} deltas and {loras} adapters placed in {time.perf_counter() - t0:.1f} s", flush=True)
        for k, case in enumerate(cases):
            variant_base = {"base": 0, "delta": 1, "lora": lora_base}[case.kind]
            rows.append(profile_case(ex, case, args, (k + 1) * 100_000, first_block, variant_base))
        for pool in (ex.delta_pool, ex.lora_pool):
            if pool is not None:
                pool.close()
    if not args.host_profile:
        against_base(rows)
    for r in rows:
        report(r, args.top)
    payload = {
        "device": device_name(device),
        "shape": args.shape,
        "dtype": dtype,
        "kv_len": args.ctx,
        "mode": "eager" if args.eager or device.type != "cuda" else "graphs",
        "timed_steps": args.steps,
        "delta_config": DELTA_CONFIG,
        "lora_rank": LORA_RANK,
        "lora_projections": list(SEVEN),
        "piece_sharing": "off",
        "unit": "us per step (CUDA kernels; CPU operators' self time in --smoke; --host-profile: Python functions)",
        "rows": rows,
        "source": "python3 -m bench.profile_step "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in (("cases", args.cases), ("steps", args.steps)))
        + (" --eager" if args.eager else "")
        + (" --host-profile" if args.host_profile else ""),
    }
    path = write_result("profile_step" + args.suffix, payload, args.out)
    print(f"\nwrote {path}")
    return path


if __name__ == "__main__":
    main()
