"""What storing one delta linear costs: ``DeltaWeights.store`` plain vs repacked, old repack vs new, in one run.

A cold variant's first token waits for its delta's load (DeltaZip serving: 224 linears of a Llama-2-7B
delta, each ``store``d into its pool slot). The repacked slot layout (``kernels/sbmm/repack.py``) permutes
the words at ``store``; this times, per Llama-2-7B linear shape and delta config, one ``store`` of a
``PackedLinear`` already on the GPU into a one-slot pool:

    plain          the format's layout: one copy per tensor
    repacked       kernels/sbmm/repack.py as it is (codes moved a byte per code, straight into the slot)
    repacked_old   c1e1e60's repack (below, the baseline only): 1024-row chunks, a shift / or per field in
                   int64, into new tensors, then copied into the slot

Each figure is the median wall clock of one ``store`` from the host's call to the GPU's finish
(synchronised: the store is launch-bound, so host time is what a load waits for), and the peak of
temporaries the CUDA caching allocator saw above the pool. ``*_back_to_back_ms``: per store of ``--runs``
stores enqueued one after another, synchronised once (a delta's load: ``store`` reads nothing back from the
device). The old and new repacks' slots are checked equal word for word at every shape; ``unpack``
(``DeltaWeights.packed``: the Triton path's ``plain_copy``) is timed against the old one. ``per_7b_delta_s``
sums a Llama-2-7B delta (32 layers of q, k, v, o 4096x4096, gate, up 11008x4096, down 4096x11008).

    python3 -m bench.sbmm_store [--configs 4b-2:4,2b-2:4,2b] [--runs 30] [--out DIR]
    python3 -m bench.sbmm_store --smoke      # CPU, small shapes: checks the script runs
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
from deltaserve.formats.packed_delta import PackedLinear  # noqa: E402
from deltaserve.kernels.sbmm import layout as layout_mod  # noqa: E402
from deltaserve.kernels.sbmm import make_delta_weights  # noqa: E402
from deltaserve.kernels.sbmm import repack as R  # noqa: E402

SHAPES = {"qkvo": (4096, 4096), "gate_up": (11008, 4096), "down": (4096, 11008)}
"""Llama-2-7B linears: name -> (out_features, in_features)."""
PER_LAYER = {"qkvo": 4, "gate_up": 2, "down": 1}
LAYERS = 32
CONFIGS = {"4b-2:4": (4, True), "2b-2:4": (2, True), "4b": (4, False), "2b": (2, False)}
GROUP = 64


# ---- c1e1e60's repack: the timing baseline (and the full-shape equality check), not a second owner ----


def _old_permute(view: tuple[int, ...], order: tuple[int, ...], to_frag: bool, t: torch.Tensor) -> torch.Tensor:
    if to_frag:
        return t.reshape(view).permute(order)
    return t.reshape(tuple(view[d] for d in order)).permute(tuple(order.index(i) for i in range(len(order))))


def _old_codes(p: PackedLinear, to_frag: bool) -> torch.Tensor:
    bits, per = p.bits, 32 // p.bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=p.qvalues.device)
    steps, ko = R.KS // (32 if p.sparse else 16), 2 if bits == 2 else 1
    order = (0, 5, 1, 6, 2, 4, 9, 10, 7, 8, 3)
    dst = torch.empty_like(p.qvalues)
    for r0 in range(0, p.out_features, 8 * R.ROWS):
        words = p.qvalues[r0 : r0 + 8 * R.ROWS]
        fields = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
        view = (words.shape[0] // R.ROWS, 4, 2, 2, 8, p.in_features // R.KS, steps // ko, ko, 2, 4, 2)
        moved = _old_permute(view, order, to_frag, fields).reshape(-1, per).to(torch.int64)
        out = torch.zeros(moved.shape[0], dtype=torch.int64, device=words.device)
        for i in range(per):
            out |= moved[:, i] << (i * bits)
        dst[r0 : r0 + words.shape[0]] = torch.where(out >= 2**31, out - 2**32, out).to(torch.int32).reshape(words.shape)
    return dst


def _old_halves(
    t: torch.Tensor, p: PackedLinear, tail: tuple[int, ...], order: tuple[int, ...], to_frag: bool
) -> torch.Tensor:
    dst = torch.empty_like(t)
    for r0 in range(0, t.shape[0], 8 * R.ROWS):
        rows = t[r0 : r0 + 8 * R.ROWS]
        halves = rows.contiguous().view(torch.int16) if rows.dtype == torch.int32 else rows
        view = (rows.shape[0] // R.ROWS, 4, 2, 2, 8, p.in_features // R.KS, *tail)
        moved = _old_permute(view, order, to_frag, halves).contiguous().reshape(halves.shape)
        dst[r0 : r0 + rows.shape[0]] = moved.view(torch.int32) if rows.dtype == torch.int32 else moved
    return dst


def old_convert(p: PackedLinear, to_frag: bool = True) -> PackedLinear:
    """c1e1e60's ``repack`` (``to_frag``) or ``unpack``."""
    g = (R.KS // p.group_size,)
    qi = None if p.qindices is None else _old_halves(p.qindices, p, (8, 2), (0, 5, 1, 6, 2, 4, 7, 3), to_frag)
    sc, zr = (_old_halves(t, p, g, (0, 5, 1, 6, 4, 2, 3), to_frag) for t in (p.scales, p.zeros))
    codes = _old_codes(p, to_frag)
    return PackedLinear(p.bits, p.sparse, p.group_size, p.out_features, p.in_features, codes, qi, sc, zr)


def old_store_repack(p: PackedLinear, out: PackedLinear | None = None) -> PackedLinear:
    """The old ``store``: repack into new tensors, then copy them into the slot."""
    r = old_convert(p)
    assert out is not None
    for name, t in r.tensors().items():
        getattr(out, name).copy_(t)
    return out


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
    shapes = {k: (512, 768) for k in SHAPES} if args.smoke else SHAPES
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
            for variant in ("plain", "repacked", "repacked_old"):
                w = make_delta_weights([None, p], dev, layout="plain" if variant == "plain" else "repacked")
                assert w.layout == ("plain" if variant == "plain" else "repacked")
                saved = layout_mod.fragments.repack
                if variant == "repacked_old":
                    layout_mod.fragments.repack = old_store_repack  # type: ignore[assignment]
                try:
                    t, peak = timed(lambda w=w, p=p: w.store(0, p), dev, runs)
                finally:
                    layout_mod.fragments.repack = saved
                row[f"{variant}_ms"], row[f"{variant}_temp_bytes"] = t * 1e3, peak
                row[f"{variant}_back_to_back_ms"] = back_to_back(lambda w=w, p=p: w.store(0, p), dev, runs) * 1e3
                slots[variant] = {k: v.clone() for k, v in w._views(0).tensors().items()}
                if variant == "repacked":
                    row["unpack_ms"], row["unpack_temp_bytes"] = timed(lambda w=w: w.packed(0), dev, runs)
                    row["unpack_ms"] *= 1e3
                    got = w.packed(0)
                    row["unpack_roundtrip_exact"] = all(
                        torch.equal(got.tensors()[k], v) for k, v in p.tensors().items()
                    )
                    frag = w._views(0)
                    t_old, _ = timed(lambda frag=frag: old_convert(frag, False), dev, runs)
                    row["unpack_old_ms"] = t_old * 1e3
                del w
            row["old_new_identical"] = all(
                torch.equal(slots["repacked"][k], slots["repacked_old"][k]) for k in slots["plain"]
            )
            row["repacked_over_plain"] = row["repacked_ms"] / row["plain_ms"]
            row["old_over_new"] = row["repacked_old_ms"] / row["repacked_ms"]
            print(
                f"{cname:7s} {sname:8s} [{out_f}x{in_f}] plain {row['plain_ms']:.3f} ms  repacked {row['repacked_ms']:.3f} "
                f"({row['repacked_over_plain']:.2f}x plain; back to back {row['plain_back_to_back_ms']:.3f} / "
                f"{row['repacked_back_to_back_ms']:.3f}; temps {row['repacked_temp_bytes'] / 2**20:.1f} MiB of "
                f"{p.nbytes() / 2**20:.1f})  old {row['repacked_old_ms']:.3f} (temps {row['repacked_old_temp_bytes'] / 2**20:.1f}"
                f" MiB)  identical {row['old_new_identical']}  unpack {row['unpack_ms']:.3f} vs old {row['unpack_old_ms']:.3f}",
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
            for v in ("plain", "repacked", "repacked_old", "plain_back_to_back", "repacked_back_to_back")
        }
        print(f"{cname}: per 7B delta (s) {per_delta[cname]}")
    if not all(r["old_new_identical"] and r["unpack_roundtrip_exact"] for r in rows):
        raise SystemExit("the new repack differs from the old one, or unpack does not invert it")
    payload = {"device": device_name(dev), "runs": runs, "torch": torch.__version__, "rows": rows,
               "per_7b_delta_s": per_delta}  # fmt: skip
    if not args.smoke:
        print(write_result("sbmm_store", payload, args.out))


if __name__ == "__main__":
    main()
