"""SBMM (``deltaserve.kernels.sbmm``): one launch for all compressed deltas vs dequantise-then-matmul per delta.

The delta half of DeltaZip's decoupled forward for one Llama-2-7B linear, float16 activations,
``out[t] += x[t] @ Δ̃_{slot(t)}^T`` with packed deltas (pack.py format). Swept over:

    shape    out x in: 4096x4096 (q/k/v/o), 11008x4096 (gate/up), 4096x11008 (down)
    config   4b-2:4 and 2b-2:4 (``--configs`` also takes 4b, 2b: dense), group size 64
    batch    1, 8, 32, 64, 128, 256 tokens
    deltas   1, 8, 32 distinct deltas in the batch (points with more deltas than tokens are skipped);
             tokens spread round-robin and grouped by delta, as the scheduler orders them
    mode     decode (one row per token, ``DeltaMeta.rows``) and/or prefill (``--prefill-len`` tokens
             per request, one segment per request, ``DeltaMeta.segments``)

Implementations per point, timed with ``triton.testing.do_bench`` (median, L2 flushed):

    triton      ``sbmm(..., use_triton=True)``: the one Triton launch
    cuda        ``sbmm_cuda``: csrc/sbmm.cu on tensor cores (where it builds and takes the point; prefill
                points cut each delta's tokens into its 16-token tiles, as the worker does)
    dequant_mm  prefill only: every segment dense (``DeltaMeta.segments(dense_min_m=1)``): per delta,
                ``dequantize_slot`` once, then one matmul over its tokens (what long prompts take)
    reference   ``sbmm_ref``: per delta, ``dequantize`` (pack.py) then one matmul over its tokens
                (DeltaZip's naive loop; also the CPU path)
    dense_fp16  per delta, one matmul with the delta already dequantised to float16 (uncompressed
                deltas: what serving full fine-tunes as fp16 deltas costs; skipped above ``--dense-max-gb``)

Each row reports the bytes the op must move and its fraction of the device-to-device copy bandwidth
measured in the same run (``common.copy_bandwidth``), 1.0 being the memory floor:

    bytes = 2 * T * in                read x (float16)
          + 2 * 2 * T * out           read + write out
          + sum over the distinct deltas in the batch of their packed bytes (``PackedLinear.nbytes``:
            qvalues + qindices + float16 scales and zeros)

(dense_fp16's own floor is higher: 2 * out * in bytes per delta; its row uses the same byte count so
the columns compare times.) The Triton result is checked against the reference before it is timed.
``--cudagraph`` adds the Triton and CUDA paths timed inside a CUDA graph (no launch overhead). ``--tune``
first times every launch config of ``TUNE_GRID`` (``TUNE_GRID_FMA`` for FMA tiles) for the point's work-tile size (``sbmm.LAUNCH``)
and keeps the fastest for the point's ``triton`` rows; the rows record the config used.

    python3 -m bench.bench_sbmm                       # full sweep, writes bench/results/sbmm-<GPU>-<date>.json
    python3 -m bench.bench_sbmm --shapes 4096x4096 --batch 64 --deltas 8 --configs 4b-2:4 --cudagraph
    python3 -m bench.bench_sbmm --shapes 4096x11008 --batch 1,64 --deltas 1,8 --tune
    python3 -m bench.bench_sbmm --smoke               # CPU, Triton interpreter, tiny shapes: checks the script only
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from bench import script_env

script_env.prepare()  # before triton's first import: --smoke runs the kernels in the CPU interpreter

import torch  # noqa: E402

from bench.common import bench_device, device_name, write_result  # noqa: E402
from deltaserve.formats.packed_delta import PackedLinear, dequantize, pack  # noqa: E402
from deltaserve.kernels import sbmm as sbmm_module  # noqa: E402
from deltaserve.kernels.sbmm import DeltaMeta, DeltaWeights, make_delta_weights, sbmm, sbmm_ref  # noqa: E402

CONFIGS = {"4b-2:4": (4, True), "2b-2:4": (2, True), "4b": (4, False), "2b": (2, False)}
"""--configs names -> (bits, 2:4 sparse)."""
GROUP_SIZE = 64
TUNE_GRID = [{"BLOCK_N": n, "BLOCK_K": k, "num_warps": w, "num_stages": 3}
             for n in (16, 32, 64, 128) for k in (64, 128, 256, 512) for w in (4, 8)]  # fmt: skip
"""--tune: the launch configs tried per point with tl.dot work tiles (``sbmm.LAUNCH`` entries)."""
TUNE_GRID_FMA = [{"BLOCK_N": n, "BLOCK_K": k, "num_warps": w, "num_stages": 2, "SPLIT_K": sk}
                 for n in (16, 32, 64, 128) for k in (128, 256) for w in (1, 2, 4) for sk in (0, 1)]  # fmt: skip
"""--tune: the configs tried with FMA work tiles (at most ``sbmm.FMA_MAX_M`` tokens; SPLIT_K 0 = auto)."""
UNIQUE_DELTAS = 4
"""Distinct random deltas packed per (shape, config); the pool's slots hold copies of them (each slot
its own memory, so the bytes read are those of distinct deltas; packing 32 7B-shaped deltas is slow)."""


def random_packed(out_f: int, in_f: int, bits: int, sparse: bool, device: torch.device, seed: int) -> PackedLinear:
    """A random delta in the packed format (random codes, 2:4 mask, scales ~ 1e-3, integral zeros as the
    compressor writes them: the CUDA op's half2 dequantisation)."""
    g = torch.Generator(device=device).manual_seed(seed)
    codes = torch.randint(0, 2**bits, (out_f, in_f), generator=g, device=device, dtype=torch.int32)
    mask = None
    if sparse:
        keep = torch.rand(out_f, in_f // 4, 4, generator=g, device=device).argsort(-1)[..., :2]
        mask = torch.zeros(out_f, in_f // 4, 4, dtype=torch.bool, device=device)
        mask = mask.scatter_(-1, keep, True).reshape(out_f, in_f)
    scales = torch.rand(out_f, in_f // GROUP_SIZE, generator=g, device=device) * 1e-3 + 1e-4
    zeros = torch.randint(0, 2**bits, (out_f, in_f // GROUP_SIZE), generator=g, device=device).float()
    return pack(codes, mask, scales, zeros, bits, GROUP_SIZE)


class Pool:
    """One (shape, config)'s pool of ``num_slots`` deltas and, on demand, their float16 dense copies."""

    def __init__(self, out_f: int, in_f: int, bits: int, sparse: bool, num_slots: int, device: torch.device) -> None:
        unique = [random_packed(out_f, in_f, bits, sparse, device, s) for s in range(min(UNIQUE_DELTAS, num_slots))]
        self.weights: DeltaWeights = make_delta_weights([unique[s % len(unique)] for s in range(num_slots)])
        self.slot_bytes = unique[0].nbytes()
        self.out_f, self.in_f = out_f, in_f
        self._dense: dict[int, torch.Tensor] = {}

    def dense(self, slot: int) -> torch.Tensor:
        """Slot ``slot``'s delta dequantised to float16 [out, in] (kept for the dense_fp16 baseline)."""
        if slot not in self._dense:
            self._dense[slot] = dequantize(self.weights.packed(slot), torch.float16)
        return self._dense[slot]


class Point:
    """One sweep point: inputs, metadata, the implementations and the byte count."""

    def __init__(
        self,
        pool: Pool,
        batch: int,
        num_deltas: int,
        mode: str,
        prefill_len: int,
        dense_max_bytes: float,
        device: torch.device,
        seed: int = 0,
    ) -> None:
        dtype = torch.float16
        g = torch.Generator(device=device).manual_seed(seed)
        req = sorted(i % num_deltas for i in range(batch))  # grouped by delta, as the scheduler orders them
        if mode == "decode":
            self.meta = self.cuda_meta = DeltaMeta.rows(req, device)
            self.dense_meta = None
        else:
            lens = [prefill_len] * batch
            self.meta = DeltaMeta.segments(lens, req, device)
            self.cuda_meta = DeltaMeta.segments(lens, req, device, max_block_m=16)
            self.dense_meta = DeltaMeta.segments(lens, req, device, dense_min_m=1)
        t = self.tokens = self.meta.num_tokens
        self.pool = pool
        self.x = torch.randn(t, pool.in_f, generator=g, device=device).to(dtype)
        self.out = torch.randn(t, pool.out_f, generator=g, device=device).to(dtype)
        self.nbytes = 2 * t * pool.in_f + 2 * 2 * t * pool.out_f + num_deltas * pool.slot_bytes
        self.dense_fn: Callable[[], object] | None = None
        if num_deltas * 2 * pool.out_f * pool.in_f <= dense_max_bytes:
            groups = []
            for d in range(num_deltas):
                lo = next(s for s in range(len(self.meta.seg_delta_host)) if self.meta.seg_delta_host[s] == d)
                hi = max(s for s in range(len(self.meta.seg_delta_host)) if self.meta.seg_delta_host[s] == d)
                groups.append((self.meta.seg_start_host[lo], self.meta.seg_start_host[hi + 1], pool.dense(d)))
            x, out = self.x, self.out

            def dense() -> torch.Tensor:
                for lo, hi, w in groups:
                    out[lo:hi] += x[lo:hi] @ w.T
                return out

            self.dense_fn = dense

    def triton_fn(self) -> torch.Tensor:
        return sbmm(self.x, self.out, self.pool.weights, self.meta, use_triton=True)

    def cuda_fn(self) -> torch.Tensor:
        return sbmm_module.sbmm_cuda(self.x, self.out, self.pool.weights, self.cuda_meta)

    def cuda_ok(self) -> bool:
        """Whether csrc/sbmm.cu builds here and takes this point."""
        return (sbmm_module.cuda_supports(self.x, self.pool.weights, self.cuda_meta) is None
                and sbmm_module.cuda_ext.library("sbmm") is not None)  # fmt: skip

    def dequant_mm_fn(self) -> torch.Tensor:
        assert self.dense_meta is not None
        return sbmm(self.x, self.out, self.pool.weights, self.dense_meta)

    def ref_fn(self) -> torch.Tensor:
        return sbmm_ref(self.x, self.out, self.pool.weights, self.meta)

    def check(self) -> None:
        got = sbmm(self.x, self.out.clone(), self.pool.weights, self.meta, use_triton=True)
        want = sbmm_ref(self.x, self.out.clone(), self.pool.weights, self.meta)
        torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)
        if self.cuda_ok():
            got = sbmm_module.sbmm_cuda(self.x, self.out.clone(), self.pool.weights, self.cuda_meta)
            torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)
        if self.dense_meta is not None:
            got = sbmm(self.x, self.out.clone(), self.pool.weights, self.dense_meta)
            torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)
        if self.dense_fn is not None:
            saved = self.out.clone()
            torch.testing.assert_close(self.dense_fn(), want, rtol=2e-2, atol=2e-2)  # fp16 matmul rounds
            self.out.copy_(saved)


def tune(pt: Point, timer: Callable) -> dict:
    """The fastest ``TUNE_GRID`` config for ``pt`` (checked against the reference), now in ``sbmm.LAUNCH``."""
    bm = pt.meta.block_m
    best: tuple[float, dict] | None = None
    for cfg in TUNE_GRID_FMA if bm <= sbmm_module.FMA_MAX_M else TUNE_GRID:
        sbmm_module.LAUNCH[bm] = cfg
        try:
            pt.check()
            sec = timer(pt.triton_fn, False)
        except Exception as e:  # a config the compiler refuses (e.g. out of shared memory) is skipped
            print(f"    tune: {cfg} failed: {type(e).__name__}: {str(e)[:120]}", flush=True)
            continue
        if best is None or sec < best[0]:
            best = (sec, cfg)
    if best is None:
        sys.exit(f"--tune: no config of TUNE_GRID ran for BLOCK_M = {bm}")
    sbmm_module.LAUNCH[bm] = best[1]
    print(f"    tune: BLOCK_M {bm}: {best[1]} {best[0] * 1e6:.1f} us", flush=True)
    return best[1]


def parse_shape(s: str) -> tuple[int, int]:
    try:
        out_f, in_f = (int(v) for v in s.lower().split("x"))
    except ValueError:
        sys.exit(f"--shapes: {s!r}: want OUTxIN, e.g. 11008x4096")
    return out_f, in_f


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--shapes", default="4096x4096,11008x4096,4096x11008", help="comma-separated OUTxIN")
    p.add_argument("--configs", default="4b-2:4,2b-2:4", help=f"comma-separated, of {', '.join(CONFIGS)}")
    p.add_argument("--batch", default="1,8,32,64,128,256", help="comma-separated request counts")
    p.add_argument("--deltas", default="1,8,32", help="comma-separated distinct-delta counts")
    p.add_argument("--modes", default="decode", help="decode (rows) and/or prefill (segments)")
    p.add_argument("--prefill-len", type=int, default=16, help="tokens per request in prefill mode")
    p.add_argument("--dense-max-gb", type=float, default=8.0, help="skip dense_fp16 above this many GB of fp16 deltas")
    p.add_argument("--no-reference", action="store_true", help="skip timing the torch reference")
    p.add_argument("--cudagraph", action="store_true", help="also time the Triton path inside a CUDA graph")
    p.add_argument("--tune", action="store_true", help="pick the fastest launch config (TUNE_GRID) per point")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--out", type=Path, default=None, help="results directory (default bench/results)")
    p.add_argument("--smoke", action="store_true", help="CPU + Triton interpreter, tiny shapes, no bandwidth")
    args = p.parse_args()
    shapes = [parse_shape(s) for s in args.shapes.split(",") if s]
    configs = [c for c in args.configs.split(",") if c]
    batches = [int(b) for b in args.batch.split(",") if b]
    delta_counts = [int(d) for d in args.deltas.split(",") if d]
    modes = [m for m in args.modes.split(",") if m]
    for c in configs:
        if c not in CONFIGS:
            sys.exit(f"--configs: {c!r}: want one of {', '.join(CONFIGS)}")
    for m in modes:
        if m not in ("decode", "prefill"):
            sys.exit(f"--modes: {m!r}: want decode and/or prefill")
    if any(d < 1 for d in delta_counts) or any(b < 1 for b in batches):
        sys.exit("--batch and --deltas take positive integers")

    device, bw, timer = bench_device(args.smoke, args.device, "bench_sbmm.py")
    if args.smoke:
        shapes, batches, delta_counts = [(96, 128), (64, 256)], [1, 4], [1, 2]
        args.prefill_len, args.cudagraph = min(args.prefill_len, 4), False
        if args.tune:  # the interpreter would take minutes per config
            TUNE_GRID[:], TUNE_GRID_FMA[:] = TUNE_GRID[:2], TUNE_GRID_FMA[:2]

    header = (
        f"{'mode':>7} {'shape':>11} {'config':>7} {'batch':>5} {'deltas':>6} {'impl':>12} {'MB':>8} "
        f"{'us':>9} {'GB/s':>8} {'x copy bw':>9}"
    )
    print(header, flush=True)
    rows = []
    default_launch = {bm: dict(cfg) for bm, cfg in sbmm_module.LAUNCH.items()}
    with torch.no_grad():
        for out_f, in_f in shapes:
            for config in configs:
                bits, sparse = CONFIGS[config]
                pool = Pool(out_f, in_f, bits, sparse, max(delta_counts), device)
                for mode in modes:
                    for batch in batches:
                        for nd in delta_counts:
                            if nd > batch:
                                continue
                            pt = Point(pool, batch, nd, mode, args.prefill_len, args.dense_max_gb * 1e9, device)
                            sbmm_module.LAUNCH.update({bm: dict(c) for bm, c in default_launch.items()})
                            if args.tune:
                                tune(pt, timer)
                            pt.check()
                            impls: list[tuple[str, Callable[[], object] | None, bool]] = [
                                ("triton", pt.triton_fn, False)
                            ]
                            if args.cudagraph:
                                impls.append(("triton_graph", pt.triton_fn, True))
                            if pt.cuda_ok():
                                impls.append(("cuda", pt.cuda_fn, False))
                                if args.cudagraph:
                                    impls.append(("cuda_graph", pt.cuda_fn, True))
                            if pt.dense_meta is not None:
                                impls.append(("dequant_mm", pt.dequant_mm_fn, False))
                            if not args.no_reference:
                                impls.append(("reference", pt.ref_fn, False))
                            impls.append(("dense_fp16", pt.dense_fn, False))
                            shape = f"{out_f}x{in_f}"
                            for impl, fn, graph in impls:
                                row = {"mode": mode, "shape": shape, "config": config, "batch": batch, "deltas": nd,
                                       "impl": impl, "tokens": pt.tokens, "bytes": pt.nbytes}  # fmt: skip
                                if impl.startswith("cuda"):
                                    row["launch"] = {
                                        "BLOCK_M": pt.cuda_meta.block_m,
                                        "SPLIT_K": sbmm_module.cuda_split(pt.cuda_meta, pool.weights),
                                    }
                                if impl.startswith("triton"):
                                    row["launch"] = {
                                        "BLOCK_M": pt.meta.block_m,
                                        **sbmm_module.launch_config(pt.meta, pool.weights),
                                    }
                                if fn is None:
                                    row.update(
                                        us=None,
                                        GBps=None,
                                        fraction_of_copy_bw=None,
                                        skipped="dense deltas above --dense-max-gb",
                                    )
                                    print(f"{mode:>7} {shape:>11} {config:>7} {batch:>5} {nd:>6} {impl:>12}   skipped")
                                    rows.append(row)
                                    continue
                                sec = timer(fn, graph)
                                row.update(
                                    us=sec * 1e6,
                                    GBps=pt.nbytes / sec / 1e9,
                                    fraction_of_copy_bw=None if bw is None else pt.nbytes / sec / bw,
                                )
                                rows.append(row)
                                print(
                                    f"{mode:>7} {shape:>11} {config:>7} {batch:>5} {nd:>6} {impl:>12} "
                                    f"{pt.nbytes / 1e6:>8.2f} {row['us']:>9.1f} {row['GBps']:>8.1f} "
                                    f"{row['fraction_of_copy_bw'] or 0:>9.2f}",
                                    flush=True,
                                )
                            del pt
                del pool
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    path = write_result("sbmm", {
        "device": device_name(device), "shape": "smoke" if args.smoke else "llama-2-7b",
        "dtype": "float16", "group_size": GROUP_SIZE, "prefill_len": args.prefill_len, "tuned": args.tune,
        "copy_bandwidth_GBps": None if bw is None else bw / 1e9,
        "timer": "host wall clock (smoke)" if args.smoke else "triton.testing.do_bench median, L2 flushed",
        "rows": rows,
    }, args.out)  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
