"""Multi-LoRA delta kernels (``deltaserve.kernels.lora``): SGMV / MBGMV vs gather+bmm vs the torch reference.

One LoRA-adapted projection of Llama-2-7B (in = out = hidden 4096), float16, ``out += scale_a *
(x A_a^T) B_a^T`` per token (shrink + expand, ``lora_delta`` with one slice). Swept over:

    rank        8, 16, 32, 64, 128, and "mixed" (ranks 8..128 cycled over the adapters, r_max 128:
                MBGMV loops to each row's own rank, the gather+bmm baseline pads to r_max)
    batch       1, 16, 64, 256 requests
    popularity  identical (one adapter), distinct (one each), uniform (ceil(sqrt(n)) adapters),
                skewed (Zipf-1.5 draws), as in Punica's tests (STYLE #21)
    mode        decode (one token per request: MBGMV) and prefill (``--prefill-len`` tokens per
                request, requests grouped by adapter into segments: SGMV)

Three implementations per point, timed with ``triton.testing.do_bench`` (median, L2 flushed):

    triton      ``lora_delta(..., use_triton=True)``: the two Triton launches (+ the v buffer)
    gather_bmm  Punica's baseline: gather each token's padded A [r_max, 4096] and B [4096, r_max]
                from a dense stack, then two ``torch.bmm`` (skipped when the gathered copies would
                exceed ``--bmm-max-gb``)
    reference   ``lora_delta(..., use_triton=False)``: the torch reference (a loop per adapter)

Each row reports the bytes the op must move and its fraction of the device-to-device copy
bandwidth measured in the same run (``common.copy_bandwidth``), 1.0 being the memory floor:

    bytes = 2 * (T * in            read x
                 + 2 * T * out     read + write out
                 + sum over the distinct adapters a in the batch of rank_a * (in + out))   weights

(float16 = 2 bytes; the small rank-wide intermediate v is not counted). The Triton result is
checked against the reference before it is timed. ``--cudagraph`` adds the Triton path timed
inside a CUDA graph (no launch overhead; the decode step runs under graphs).

    python3 bench/bench_lora.py                                    # full sweep, writes bench/results/lora-<GPU>-<date>.json
    python3 bench/bench_lora.py --ranks 16 --batch 64 --modes decode --cudagraph
    python3 bench/bench_lora.py --smoke     # CPU, Triton interpreter, tiny shapes: checks the script only
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import Callable

if "--smoke" in sys.argv:  # must precede the first import of triton
    os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pyworker"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import copy_bandwidth, device_name, time_cuda, time_host, write_result  # noqa: E402
from deltaserve.kernels.lora import LoraMeta, LoraSlice, lora_delta, make_weights  # noqa: E402

POPULARITY = ("identical", "distinct", "uniform", "skewed")
MIXED_RANKS = (8, 16, 32, 64, 128)
"""Ranks cycled over the adapters for ``--ranks mixed``."""


def request_adapters(popularity: str, n: int, rng: np.random.Generator) -> list[int]:
    """Adapter slot (0 .. n - 1) of each of ``n`` requests."""
    if popularity == "identical":
        return [0] * n
    if popularity == "distinct":
        return list(range(n))
    if popularity == "uniform":
        k = math.ceil(math.sqrt(n))
        return [i % k for i in range(n)]
    if popularity == "skewed":
        p = 1.0 / np.arange(1, n + 1) ** 1.5
        return [int(a) for a in rng.choice(n, size=n, p=p / p.sum())]
    raise ValueError(f"popularity {popularity!r}: want one of {', '.join(POPULARITY)}")


class Point:
    """One sweep point: inputs, the three implementations and the byte count."""

    def __init__(self, hidden: int, rank: str, batch: int, popularity: str, mode: str, prefill_len: int,
                 bmm_max_bytes: float, device: torch.device, seed: int = 0) -> None:
        dtype = torch.float16
        rng = np.random.default_rng(seed)
        g = torch.Generator(device=device).manual_seed(seed)
        ranks = [int(rank)] * batch if rank != "mixed" else [MIXED_RANKS[i % len(MIXED_RANKS)] for i in range(batch)]
        r_max = max(ranks)
        req = request_adapters(popularity, batch, rng)
        used = sorted(set(req))
        adapters: list = [None] * batch
        for a in used:
            A = (torch.randn(ranks[a], hidden, generator=g, device=device) / math.sqrt(hidden)).to(dtype)
            B = (0.01 * torch.randn(hidden, ranks[a], generator=g, device=device)).to(dtype)
            adapters[a] = (A, B, 2.0)
        total = sum(ranks[a] for a in used)
        self.weights = make_weights(adapters, r_max, total, perm=torch.randperm(total))
        if mode == "decode":
            self.meta = LoraMeta.mbgmv(req, device)
            token_adapter = req
        else:  # the scheduler groups a step's requests by adapter: one segment per adapter
            order = sorted(range(batch), key=lambda i: req[i])
            seg_adapter = [req[i] for i in order]
            self.meta = LoraMeta.sgmv([prefill_len] * batch, seg_adapter, device)
            token_adapter = [a for a in seg_adapter for _ in range(prefill_len)]
        t = self.meta.num_tokens
        self.tokens = t
        self.x = torch.randn(t, hidden, generator=g, device=device).to(dtype)
        self.out = torch.randn(t, hidden, generator=g, device=device).to(dtype)
        self.slices = [LoraSlice(0, hidden, self.weights)]
        self.nbytes = 2 * (t * hidden + 2 * t * hidden + sum(ranks[a] * 2 * hidden for a in used))

        # gather+bmm baseline: dense padded stacks, gathered per token.
        gathered = 2 * t * r_max * 2 * hidden
        self.bmm_fn: Callable[[], object] | None = None
        if gathered <= bmm_max_bytes:
            a_dense = torch.zeros(batch, r_max, hidden, dtype=dtype, device=device)
            b_dense = torch.zeros(batch, hidden, r_max, dtype=dtype, device=device)
            for a in used:
                A, B, _ = adapters[a]
                a_dense[a, : ranks[a]] = A
                b_dense[a, :, : ranks[a]] = B
            idx = torch.tensor(token_adapter, dtype=torch.long, device=device)
            scale = torch.full((t, 1, 1), 2.0, dtype=dtype, device=device)
            x, out = self.x, self.out

            def bmm() -> torch.Tensor:
                v = torch.bmm(x[:, None, :], a_dense[idx].transpose(1, 2))  # [T, 1, r_max]
                delta = torch.bmm(v, b_dense[idx].transpose(1, 2))  # [T, 1, hidden]
                return out.add_((scale * delta)[:, 0])

            self.bmm_fn = bmm

    def triton_fn(self) -> torch.Tensor:
        return lora_delta(self.x, self.out, self.slices, self.meta, use_triton=True)

    def ref_fn(self) -> torch.Tensor:
        return lora_delta(self.x, self.out, self.slices, self.meta, use_triton=False)

    def check(self) -> None:
        got = lora_delta(self.x, self.out.clone(), self.slices, self.meta, use_triton=True)
        want = lora_delta(self.x, self.out.clone(), self.slices, self.meta, use_triton=False)
        torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)
        if self.bmm_fn is not None:
            saved = self.out.clone()
            base = self.bmm_fn()
            torch.testing.assert_close(base, want, rtol=2e-2, atol=2e-2)  # fp16 bmm rounds v
            self.out.copy_(saved)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--ranks", default="8,16,32,64,128,mixed", help="comma-separated ranks, or 'mixed'")
    p.add_argument("--batch", default="1,16,64,256", help="comma-separated request counts")
    p.add_argument("--popularity", default=",".join(POPULARITY))
    p.add_argument("--modes", default="decode,prefill", help="decode (MBGMV) and/or prefill (SGMV)")
    p.add_argument("--prefill-len", type=int, default=16, help="tokens per request in prefill mode")
    p.add_argument("--bmm-max-gb", type=float, default=4.0, help="skip gather_bmm above this gathered size")
    p.add_argument("--no-reference", action="store_true", help="skip timing the torch reference")
    p.add_argument("--cudagraph", action="store_true", help="also time the Triton path inside a CUDA graph")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--out", type=Path, default=None, help="results directory (default bench/results)")
    p.add_argument("--smoke", action="store_true", help="CPU + Triton interpreter, tiny shapes, no bandwidth")
    args = p.parse_args()
    ranks = [r for r in args.ranks.split(",") if r]
    batches = [int(b) for b in args.batch.split(",") if b]
    pops = [q for q in args.popularity.split(",") if q]
    modes = [m for m in args.modes.split(",") if m]
    for r in ranks:
        if r != "mixed" and not (r.isdigit() and int(r) >= 1):
            sys.exit(f"--ranks: {r!r} is neither a positive integer nor 'mixed'")
    for m in modes:
        if m not in ("decode", "prefill"):
            sys.exit(f"--modes: {m!r}: want decode and/or prefill")

    if args.smoke:
        device, hidden, bw, timer = torch.device("cpu"), 64, None, time_host
        ranks = [r for r in ranks if r != "mixed" and int(r) <= 16][:2] + ["mixed"] * ("mixed" in ranks)
        batches = [1, 4]
        args.prefill_len, args.cudagraph = min(args.prefill_len, 4), False
    else:
        if not torch.cuda.is_available():
            sys.exit("bench_lora.py needs a CUDA device (or --smoke for a CPU check of the script)")
        device, hidden, timer = torch.device(args.device), 4096, time_cuda
        torch.cuda.set_device(device)
        bw = copy_bandwidth(device)
        print(f"{device_name(device)}: device-to-device copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)

    header = (f"{'mode':>7} {'rank':>5} {'batch':>5} {'popularity':>10} {'impl':>10} {'MB':>8} {'us':>9} "
              f"{'GB/s':>8} {'x copy bw':>9}")
    print(header, flush=True)
    rows = []
    with torch.no_grad():
        for mode in modes:
            for rank in ranks:
                for batch in batches:
                    for pop in pops:
                        pt = Point(hidden, rank, batch, pop, mode, args.prefill_len, args.bmm_max_gb * 1e9, device)
                        pt.check()
                        impls: list[tuple[str, Callable[[], object] | None, bool]] = [("triton", pt.triton_fn, False)]
                        if args.cudagraph:
                            impls.append(("triton_graph", pt.triton_fn, True))
                        impls.append(("gather_bmm", pt.bmm_fn, False))
                        if not args.no_reference:
                            impls.append(("reference", pt.ref_fn, False))
                        for impl, fn, graph in impls:
                            row = {"mode": mode, "rank": rank, "batch": batch, "popularity": pop, "impl": impl,
                                   "tokens": pt.tokens, "bytes": pt.nbytes}
                            if fn is None:
                                row.update(us=None, GBps=None, fraction_of_copy_bw=None, skipped="gathered copy too big")
                                print(f"{mode:>7} {rank:>5} {batch:>5} {pop:>10} {impl:>10}   skipped (--bmm-max-gb)")
                                rows.append(row)
                                continue
                            sec = timer(fn, graph)
                            row.update(us=sec * 1e6, GBps=pt.nbytes / sec / 1e9,
                                       fraction_of_copy_bw=None if bw is None else pt.nbytes / sec / bw)
                            rows.append(row)
                            print(f"{mode:>7} {rank:>5} {batch:>5} {pop:>10} {impl:>10} {pt.nbytes / 1e6:>8.2f} "
                                  f"{row['us']:>9.1f} {row['GBps']:>8.1f} {row['fraction_of_copy_bw'] or 0:>9.2f}",
                                  flush=True)
                        del pt
                        if device.type == "cuda":
                            torch.cuda.empty_cache()
    path = write_result("lora", {
        "device": device_name(device), "shape": "smoke" if args.smoke else "llama-2-7b", "hidden": hidden,
        "dtype": "float16", "prefill_len": args.prefill_len,
        "copy_bandwidth_GBps": None if bw is None else bw / 1e9,
        "timer": "host wall clock (smoke)" if args.smoke else "triton.testing.do_bench median, L2 flushed",
        "rows": rows,
    }, args.out)  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
