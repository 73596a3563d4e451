"""Where a served run's worker time went, by kind of step: a worker recording (``deltaserve.sim.record``,
one JSON line per step) split into the kinds that bound served-step efficiency differently::

    loads      a step that copies a variant to the GPU (a ``to_gpu`` op): the copy is in its time
    eager      a step with a prompt chunk that ran eagerly (no graph replayed: a compressed delta's
               prompt, prompt logprobs, a step beyond the largest token bucket)
    mixed      a step with a prompt chunk replayed from a mixed-step graph
    decode     a decode-only step (``graph`` says whether it replayed one)

Per kind: steps, Σ busy (``timing.busy_us``, from the previous output to this step's), Σ own time,
Σ floor (``timing.floor_us``; recordings made before it was recorded have none), Σ device span (CUDA
events around the step), Σ launch (the worker thread's host time launching it), and the slowest
steps by own time.

Decode steps replayed from graphs are also grouped by batch size and by how many variants other than
the base their rows run (``--by-batch`` prints them): each group's median device span and median floor.
Two trees' kernels compare there at matched shapes, whatever mix of steps each run happened to make.

Own time re-attributes launches: with overlapped steps the worker launches step N + 1 before it
finishes step N, so a slow launch of N + 1 (an eager step's ~2,000 kernel launches from Python, a
kernel compiled on first use) delays N's output and lands in N's busy time. A step's own time is its
busy time less the launch of the step after it (when that launch began before its output) plus its
own launch (when that began before the previous output); the sum over a run is about the same.

    python3 -m bench.step_breakdown RECORDING.jsonl[.gz] [--top 8] [--by-batch]
        [--out DIR --device "NVIDIA H200" --recorded-at COMMIT] [--name NAME]
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from bench import script_env

script_env.prepare()  # deltaserve importable from pyworker/

from bench.common import write_result  # noqa: E402
from deltaserve.wire import TierOp  # noqa: E402

KINDS = ("loads", "eager", "mixed", "decode (graph)", "decode (eager)")
BATCH_BINS = ((1, 3), (4, 7), (8, 15), (16, 31), (32, 63), (64, 1 << 30))
"""Batch sizes the decode groups take (first, last)."""
BASE = 0
"""The variant id of the base model in a recording's requests."""


def read_recording(path: Path) -> list[dict[str, Any]]:
    """The recording's steps (``.gz`` or plain JSONL), in the order the worker sent them."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        steps = [json.loads(line) for line in f if line.strip()]
    return sorted(steps, key=lambda s: s["sent"])


def kind_of(step: dict[str, Any]) -> str:
    """One of ``KINDS`` (the module docstring)."""
    if any(op[1] == TierOp.TO_GPU for op in step.get("ops", [])):
        return "loads"
    if step["new"] or any(n > 1 for _, n in step["running"]):
        return "mixed" if step.get("graph") else "eager"
    return "decode (graph)" if step.get("graph") else "decode (eager)"


def _launch_s(step: dict[str, Any]) -> float:
    launch = step.get("launch")
    return (launch[1] - launch[0]) if launch else 0.0


def own_seconds(steps: list[dict[str, Any]]) -> list[float]:
    """Each step's own time (the module docstring), in seconds, in the order of ``steps``."""
    own = []
    for i, s in enumerate(steps):
        t = s["timing"]["busy_us"] / 1e6
        after = steps[i + 1] if i + 1 < len(steps) else None
        if after is not None and after.get("launch") and after["launch"][0] < s["sent"]:
            t -= _launch_s(after)
        if i > 0 and s.get("launch") and s["launch"][0] < steps[i - 1]["sent"]:
            t += _launch_s(s)
        own.append(t)
    return own


def breakdown(steps: Iterable[dict[str, Any]], top: int = 8) -> dict[str, Any]:
    """Totals per kind, the run's totals, and the ``top`` slowest steps (by busy time)."""
    steps = list(steps)
    has_floor = all("floor_us" in s["timing"] for s in steps)
    own = own_seconds(steps)
    rows: dict[str, dict[str, float]] = {}
    for s, own_s in zip(steps, own):
        r = rows.setdefault(kind_of(s), {"steps": 0, "busy_s": 0.0, "own_s": 0.0, "floor_s": 0.0, "device_s": 0.0,
                                         "launch_s": 0.0})  # fmt: skip
        r["steps"] += 1
        r["busy_s"] += s["timing"]["busy_us"] / 1e6
        r["own_s"] += own_s
        r["floor_s"] += s["timing"].get("floor_us", 0) / 1e6
        r["device_s"] += s.get("device_s") or 0.0
        r["launch_s"] += _launch_s(s)
    total_own = sum(r["own_s"] for r in rows.values())
    for r in rows.values():
        r["share_of_own"] = r["own_s"] / total_own if total_own else 0.0
        r["own_over_floor"] = r["own_s"] / r["floor_s"] if has_floor and r["floor_s"] else None
        if not has_floor:
            r.pop("floor_s")
    slowest = sorted(zip(steps, own), key=lambda so: -so[1])[:top]
    return {
        "steps": len(steps),
        "busy_s": sum(r["busy_s"] for r in rows.values()),
        "own_s": total_own,
        "floor_s": sum(s["timing"]["floor_us"] for s in steps) / 1e6 if has_floor else None,
        "kinds": {k: rows[k] for k in KINDS if k in rows},
        "decode_groups": decode_groups(steps),
        "slowest": [
            {
                "step_id": s["step_id"],
                "kind": kind_of(s),
                "own_ms": own_s * 1e3,
                "busy_ms": s["timing"]["busy_us"] / 1e3,
                "device_ms": (s.get("device_s") or 0.0) * 1e3,
                "launch_ms": _launch_s(s) * 1e3 if s.get("launch") else None,
                "prompt_tokens": [n[1] for n in s["new"]],
                "running": len(s["running"]),
            }
            for s, own_s in slowest
        ],
    }


def decode_groups(steps: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Decode steps replayed from graphs, grouped by batch (``BATCH_BINS``) and by the number of variants other
    than the base among their rows: steps, median device span and median floor (ms), and Σ device ÷ Σ floor.
    A row whose request the recording never admitted (it began mid-run) makes its step's count unknown: such
    steps are left out."""
    variant_of: dict[int, int] = {}
    groups: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for s in steps:
        for n in s["new"]:
            variant_of[n[0]] = n[4]
        if kind_of(s) != "decode (graph)" or not s.get("device_s") or "floor_us" not in s["timing"]:
            continue
        rows = [rid for rid, _ in s["running"]]
        if any(r not in variant_of for r in rows):
            continue
        first = next(lo for lo, hi in BATCH_BINS if lo <= len(rows) <= hi)
        groups.setdefault((first, len({variant_of[r] for r in rows} - {BASE})), []).append(s)
    out = []
    for (first, variants), group in sorted(groups.items()):
        last = next(hi for lo, hi in BATCH_BINS if lo == first)
        device = [s["device_s"] * 1e3 for s in group]
        floor = [s["timing"]["floor_us"] / 1e3 for s in group]
        out.append({
            "batch": f"{first}+" if last == BATCH_BINS[-1][1] else f"{first}-{last}", "variants": variants,
            "steps": len(group), "device_ms_p50": statistics.median(device), "floor_ms_p50": statistics.median(floor),
            "device_over_floor": sum(device) / sum(floor),
        })  # fmt: skip
    return out


def report(result: dict[str, Any], by_batch: bool = False) -> None:
    floor = result["floor_s"]
    print(f"{result['steps']} steps, busy {result['busy_s']:.2f} s, own {result['own_s']:.2f} s"
          + (f", floor {floor:.2f} s" if floor else ""))  # fmt: skip
    for kind, r in result["kinds"].items():
        ratio = f", {r['own_over_floor']:.2f}x its floor" if r.get("own_over_floor") else ""
        print(f"  {kind:15s} {r['steps']:5d} steps  own {r['own_s']:7.2f} s ({r['share_of_own']:5.1%})  "
              f"busy {r['busy_s']:7.2f} s  device {r['device_s']:7.2f} s  launch {r['launch_s']:7.2f} s{ratio}")  # fmt: skip
    if by_batch:
        print("  decode (graph) by batch and variants besides the base: steps, median device / floor (ms)")
        for g in result["decode_groups"]:
            print(f"    batch {g['batch']:>5s}, {g['variants']:2d} besides the base: {g['steps']:5d} steps  "
                  f"{g['device_ms_p50']:6.2f} / {g['floor_ms_p50']:6.2f}  ({g['device_over_floor']:.2f}x)")  # fmt: skip
    for s in result["slowest"]:
        print(f"  step {s['step_id']}: {s['kind']}, own {s['own_ms']:.1f} ms (busy {s['busy_ms']:.1f}), "
              f"device {s['device_ms']:.1f} ms, prompts {s['prompt_tokens']}, {s['running']} running")  # fmt: skip


def main(argv: list[str] | None = None) -> Path | None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("recording", type=Path)
    p.add_argument("--top", type=int, default=8, help="how many of the slowest steps to list")
    p.add_argument("--by-batch", action="store_true", help="also print the decode graph steps by batch and variants")
    p.add_argument("--out", type=Path, default=None, help="result directory (default bench/results); none: print only")
    p.add_argument("--name", default=None, help="experiment name of the result file (default: the recording's stem)")
    p.add_argument("--device", default=None, help="the card the recording was made on (needed with --out)")
    p.add_argument("--recorded-at", default=None, help="the commit the recorded daemon ran (needed with --out)")
    args = p.parse_args(argv)
    if args.out is not None and not (args.device and args.recorded_at):
        p.error("--out needs --device and --recorded-at: a recording does not say where or from which tree it came")
    result = breakdown(read_recording(args.recording), args.top)
    report(result, args.by_batch)
    if args.out is None:
        return None
    name = args.name or args.recording.name.split(".")[0]
    payload = {"device": args.device, "recorded_at": args.recorded_at, "recording": str(args.recording), **result}
    return write_result(f"step_breakdown-{name}", payload, args.out)


if __name__ == "__main__":
    main()
