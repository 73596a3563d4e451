"""What storing one delta linear costs: ``DeltaWeights.store`` plain vs repacked (Triton, torch), in one run.

A cold variant's first token waits for its delta's load (DeltaZip serving: 224 linears of a Llama-2-7B
delta, each ``store``d into its pool slot). The repacked slot layout (``kernels/sbmm/repack.py``) permutes
the words at ``store``; this times, per Llama-2-7B linear shape and delta config, one ``store`` of a
``PackedLinear`` already on the GPU into a one-slot pool:

    plain           the format's layout: one copy per tensor
    repacked        the repack as a pool runs it on CUDA: one Triton launch (``kernels/sbmm/repack_triton.py``)
    repacked_torch  repack.py's torch code (the reference and CPU path; the CUDA path before the kernel): 6
                    to 11 launches, the codes moved a byte per code, straight into the slot

Each figure is the median wall clock of one ``store`` from the host's call to the GPU's finish
(synchronised: the store is launch-bound, so host time is what a load waits for), and the peak of
temporaries the CUDA caching allocator saw above the pool. ``*_back_to_back_ms``: per store of ``--runs``
stores enqueued one after another, synchronised once (a delta's load: ``store`` reads nothing back from the
device). The Triton and torch repacks' slots are checked equal word for word at every shape (the run fails
otherwise), and ``unpack`` (``DeltaWeights.packed``: the Triton path's ``plain_copy``) is timed both ways and
checked to give the format back. ``per_7b_delta_s`` sums a Llama-2-7B delta (32 layers of q, k, v, o
4096x4096, gate, up 11008x4096, down 4096x11008).

    python3 -m bench.sbmm_store [--configs 4b-2:4,2b-2:4,2b] [--runs 30] [--out DIR]
    python3 -m bench.sbmm_store --smoke      # CPU, small shapes, the kernel interpreted: checks the script runs
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from bench import script_env

script_env.prepare()  # deltaserve importable from pyworker/

from bench.common import device_name, random_packed_linear, write_result  # noqa: E402
from deltaserve.kernels import common as kernel_common  # noqa: E402
from deltaserve.kernels.sbmm import make_delta_weights  # noqa: E402

SHAPES = {"qkvo": (4096, 4096), "gate_up": (11008, 4096), "down": (4096, 11008)}
"""Llama-2-7B linears: name -> (out_features, in_features)."""
PER_LAYER = {"qkvo": 4, "gate_up": 2, "down": 1}
LAYERS = 32
CONFIGS = {"4b-2:4": (4, True), "2b-2:4": (2, True), "4b": (4, False), "2b": (2, False)}
GROUP = 64
VARIANTS = {"plain": "auto", "repacked": "triton", "repacked_torch": "torch"}
"""Each variant's pool layout (plain or repacked) and the kernel backend its ``store`` runs under
(``kernels.common.set_backend``: ``triton`` is the CUDA default's path, and the interpreter under --smoke)."""


# ---- timing ----


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def back_to_back(fn, dev: torch.device, runs: int) -> float:
    """Seconds per call of ``runs`` calls enqueued one after another, synchronised once (a delta's load)."""
    sync(dev)
    t0 = time.perf_counter()
    for _ in range(runs):
        fn()
    sync(dev)
    return (time.perf_counter() - t0) / runs


def timed(fn, dev: torch.device, runs: int) -> tuple[float, int]:
    """(median seconds per call, synchronised, after 3 warm-ups; peak bytes allocated above the start)."""
    for _ in range(3):
        fn()
    sync(dev)
    base = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        sync(dev)
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated(dev) - base if dev.type == "cuda" else 0
    return statistics.median(times), peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="4b-2:4,2b-2:4,2b", help=f"comma-separated, of {', '.join(CONFIGS)}")
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--smoke", action="store_true", help="CPU, small shapes, 2 runs: checks the script runs")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    dev = torch.device("cpu" if args.smoke else "cuda:0")
    shapes = {k: (256, 768) for k in SHAPES} if args.smoke else SHAPES
    runs = 2 if args.smoke else args.runs
    rows = []
    for cname in args.configs.split(","):
        bits, sparse = CONFIGS[cname]
        for sname, (out_f, in_f) in shapes.items():
            p = random_packed_linear(out_f, in_f, bits, sparse, GROUP, torch.Generator().manual_seed(out_f + bits)).to(
                dev
            )
            row: dict = {"config": cname, "group": GROUP, "linear": sname, "out": out_f, "in": in_f,
                         "linear_bytes": p.nbytes()}  # fmt: skip
            slots = {}
            for variant, backend in VARIANTS.items():
                previous = kernel_common.set_backend(backend)
                try:
                    w = make_delta_weights([None, p], dev, layout="plain" if variant == "plain" else "repacked")
                    assert w.layout == ("plain" if variant == "plain" else "repacked")
                    t, peak = timed(lambda w=w, p=p: w.store(0, p), dev, runs)
                    row[f"{variant}_ms"], row[f"{variant}_temp_bytes"] = t * 1e3, peak
                    row[f"{variant}_back_to_back_ms"] = back_to_back(lambda w=w, p=p: w.store(0, p), dev, runs) * 1e3
                    slots[variant] = {k: v.clone() for k, v in w._views(0).tensors().items()}
                    if variant != "plain":
                        unpacked = variant.replace("repacked", "unpack")
                        t, _ = timed(lambda w=w: w.packed(0), dev, runs)
                        row[f"{unpacked}_ms"] = t * 1e3
                        got = w.packed(0)
                        row[f"{unpacked}_roundtrip_exact"] = all(
                            torch.equal(got.tensors()[k], v) for k, v in p.tensors().items()
                        )
                finally:
                    kernel_common.set_backend(previous)
                del w
            row["triton_torch_identical"] = all(
                torch.equal(slots["repacked"][k], slots["repacked_torch"][k]) for k in slots["plain"]
            )
            row["repacked_over_plain"] = row["repacked_ms"] / row["plain_ms"]
            row["torch_over_triton"] = row["repacked_torch_ms"] / row["repacked_ms"]
            print(
                f"{cname:7s} {sname:8s} [{out_f}x{in_f}] plain {row['plain_ms']:.3f} ms  repacked {row['repacked_ms']:.3f} "
                f"({row['repacked_over_plain']:.2f}x plain; back to back {row['plain_back_to_back_ms']:.3f} / "
                f"{row['repacked_back_to_back_ms']:.3f}; temps {row['repacked_temp_bytes'] / 2**20:.1f} MiB of "
                f"{p.nbytes() / 2**20:.1f})  torch {row['repacked_torch_ms']:.3f} (back to back "
                f"{row['repacked_torch_back_to_back_ms']:.3f}; temps {row['repacked_torch_temp_bytes'] / 2**20:.1f} MiB)"
                f"  identical {row['triton_torch_identical']}  unpack {row['unpack_ms']:.3f} vs torch "
                f"{row['unpack_torch_ms']:.3f}",
                flush=True,
            )
            rows.append(row)
            del p, slots
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    per_delta = {}
    for cname in args.configs.split(","):
        by = {r["linear"]: r for r in rows if r["config"] == cname}
        per_delta[cname] = {
            v: LAYERS * sum(n * by[s][f"{v}_ms"] for s, n in PER_LAYER.items()) / 1e3
            for v in (*VARIANTS, *(f"{v}_back_to_back" for v in VARIANTS))
        }
        print(f"{cname}: per 7B delta (s) {per_delta[cname]}")
    exact = ("triton_torch_identical", "unpack_roundtrip_exact", "unpack_torch_roundtrip_exact")
    if not all(r[k] for r in rows for k in exact):
        raise SystemExit("the Triton repack differs from the torch one, or unpack does not invert it")
    payload = {"device": device_name(dev), "runs": runs, "torch": torch.__version__, "rows": rows,
               "per_7b_delta_s": per_delta}  # fmt: skip
    if not args.smoke:
        print(write_result("sbmm_store", payload, args.out))


if __name__ == "__main__":
    main()
