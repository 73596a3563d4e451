"""The fused small ops (``deltaserve.kernels`` rmsnorm / rope / silu_mul): Triton kernel vs torch reference.

Llama-2-7B shapes (hidden 4096, intermediate 11008, 32 heads x head_dim 128, MHA), float16, for
token counts 1, 64, 256, 2048. Each op is timed twice, the Triton kernel and its torch reference
(eager, the reference line of STYLE #20), with ``triton.testing.do_bench`` (median; the L2 cache
is flushed before every run, so nothing is served from cache). Each row reports the bytes the op
must move (read + written, below), the achieved bytes/s and its fraction of the device-to-device
copy bandwidth measured in the same run (``common.copy_bandwidth``): 1.0 is the memory floor.
``--cudagraph`` adds a column timed inside a CUDA graph (``do_bench_cudagraph``), i.e. without
launch overhead, as the decode step will run under graphs. That timer does not flush L2: the
small token counts' data (a few MB) then stays in L2 and may beat the copy bandwidth.

Bytes per op (fp16 = 2 bytes per element; T tokens):
    rmsnorm            read x [T, 4096] + weight, write out              (2 T N + N) * 2
    fused_add_rmsnorm  read x, residual, weight; write out, residual     (4 T N + N) * 2
    rotary_embedding   read + write q [T, 32, 128] and k [T, 32, 128]    (2 T (H + H_kv) D + T D) * 2 + 8 T
                       in place (views into a fused qkv output, as the decoder passes them),
                       plus one cos/sin row per token and the positions
    silu_and_mul       read gate_up [T, 2 * 11008], write [T, 11008]     3 T I * 2

Every kernel is checked against its reference before it is timed.

    python3 -m bench.bench_fused_ops [--tokens 1,64,256,2048] [--cudagraph] [--out DIR]
    python3 -m bench.bench_fused_ops --smoke      # CPU, Triton interpreter, tiny shapes: checks the script only
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from bench import script_env

script_env.prepare()  # before triton's first import: --smoke runs the kernels in the CPU interpreter

import torch  # noqa: E402

from bench.common import bench_device, device_name, write_result  # noqa: E402
from deltaserve.kernels.rmsnorm import (  # noqa: E402
    fused_add_rmsnorm_ref,
    fused_add_rmsnorm_triton,
    rmsnorm_ref,
    rmsnorm_triton,
)
from deltaserve.kernels.rope import rotary_embedding_ref, rotary_embedding_triton  # noqa: E402
from deltaserve.kernels.silu_mul import silu_and_mul_ref, silu_and_mul_triton  # noqa: E402

LLAMA2_7B = {"hidden": 4096, "intermediate": 11008, "heads": 32, "kv_heads": 32, "head_dim": 128, "max_pos": 4096}
SMOKE = {"hidden": 64, "intermediate": 96, "heads": 4, "kv_heads": 2, "head_dim": 16, "max_pos": 64}


class Case:
    """One op at one token count: its two implementations on prepared inputs, and its byte count."""

    def __init__(self, op: str, nbytes: int, triton_fn: Callable[[], object], ref_fn: Callable[[], object]) -> None:
        self.op = op
        """Entry-point name in ``deltaserve.kernels``."""
        self.nbytes = nbytes
        """Bytes the op must read plus write (module docstring)."""
        self.triton_fn = triton_fn
        """Runs the Triton kernel once."""
        self.ref_fn = ref_fn
        """Runs the torch reference once."""


def make_cases(shape: dict, tokens: int, dtype: torch.dtype, device: torch.device) -> list[Case]:
    n, inter = shape["hidden"], shape["intermediate"]
    h, hkv, d = shape["heads"], shape["kv_heads"], shape["head_dim"]
    es = torch.empty((), dtype=dtype).element_size()
    g = torch.Generator(device=device).manual_seed(tokens)

    def rnd(*s: int) -> torch.Tensor:
        return torch.randn(*s, generator=g, device=device, dtype=torch.float32).to(dtype)

    x, res, w = rnd(tokens, n), rnd(tokens, n), 1 + 0.1 * rnd(n)
    qkv = rnd(tokens, (h + 2 * hkv) * d)
    q = qkv[:, : h * d].view(tokens, h, d)
    k = qkv[:, h * d : (h + hkv) * d].view(tokens, hkv, d)
    positions = torch.randint(0, shape["max_pos"], (tokens,), generator=g, device=device)
    angles = torch.rand(shape["max_pos"], d // 2, generator=g, device=device) * 6.28
    cos_sin = torch.cat((angles.cos(), angles.sin()), dim=-1).to(dtype)
    gate_up = rnd(tokens, 2 * inter)

    # In place: rope is applied again on every timed run, a rotation keeps the values bounded.
    checks = [
        (rmsnorm_triton(x, w, 1e-5), rmsnorm_ref(x, w, 1e-5)),
        (fused_add_rmsnorm_triton(x, res, w, 1e-5)[0], fused_add_rmsnorm_ref(x, res, w, 1e-5)[0]),
        (silu_and_mul_triton(gate_up), silu_and_mul_ref(gate_up)),
    ]
    qa, ka, qb, kb = q.clone(), k.clone(), q.clone(), k.clone()
    rotary_embedding_triton(positions, qa, ka, cos_sin)
    rotary_embedding_ref(positions, qb, kb, cos_sin)
    checks += [(qa, qb), (ka, kb)]
    for got, want in checks:
        torch.testing.assert_close(got, want, rtol=2e-3 if dtype != torch.float32 else 1e-5, atol=1e-3)

    return [
        Case("rmsnorm", (2 * tokens * n + n) * es,
             lambda: rmsnorm_triton(x, w, 1e-5), lambda: rmsnorm_ref(x, w, 1e-5)),
        Case("fused_add_rmsnorm", (4 * tokens * n + n) * es,
             lambda: fused_add_rmsnorm_triton(x, res, w, 1e-5), lambda: fused_add_rmsnorm_ref(x, res, w, 1e-5)),
        Case("rotary_embedding", (2 * tokens * (h + hkv) * d + tokens * d) * es + 8 * tokens,
             lambda: rotary_embedding_triton(positions, q, k, cos_sin),
             lambda: rotary_embedding_ref(positions, q, k, cos_sin)),
        Case("silu_and_mul", 3 * tokens * inter * es,
             lambda: silu_and_mul_triton(gate_up), lambda: silu_and_mul_ref(gate_up)),
    ]  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--tokens", default="1,64,256,2048", help="comma-separated token counts")
    p.add_argument("--cudagraph", action="store_true", help="also time each call inside a CUDA graph")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--out", type=Path, default=None, help="results directory (default bench/results)")
    p.add_argument("--smoke", action="store_true", help="CPU + Triton interpreter, tiny shapes, no bandwidth")
    args = p.parse_args()
    tokens_list = [int(t) for t in args.tokens.split(",") if t]

    device, bw, timer = bench_device(args.smoke, args.device, "bench_fused_ops.py")
    shape = SMOKE if args.smoke else LLAMA2_7B
    if args.smoke:
        tokens_list = [t for t in tokens_list if t <= 64] or [1]
        args.cudagraph = False

    rows = []
    header = f"{'op':>18} {'tokens':>6} {'impl':>6} {'MB':>9} {'us':>9} {'GB/s':>8} {'x copy bw':>9}"
    if args.cudagraph:
        header += f" {'us graph':>9} {'x bw graph':>10}"
    print(header, flush=True)
    with torch.no_grad():
        for tokens in tokens_list:
            for case in make_cases(shape, tokens, torch.float16, device):
                for impl, fn in (("triton", case.triton_fn), ("torch", case.ref_fn)):
                    sec = timer(fn, False)
                    row = {
                        "op": case.op,
                        "tokens": tokens,
                        "impl": impl,
                        "bytes": case.nbytes,
                        "us": sec * 1e6,
                        "GBps": case.nbytes / sec / 1e9,
                        "fraction_of_copy_bw": None if bw is None else case.nbytes / sec / bw,
                    }
                    line = (
                        f"{case.op:>18} {tokens:>6} {impl:>6} {case.nbytes / 1e6:>9.3f} {row['us']:>9.1f} "
                        f"{row['GBps']:>8.1f} {row['fraction_of_copy_bw'] or 0:>9.2f}"
                    )
                    if args.cudagraph:
                        gsec = timer(fn, True)
                        row["us_graph"] = gsec * 1e6
                        row["fraction_of_copy_bw_graph"] = case.nbytes / gsec / bw
                        line += f" {row['us_graph']:>9.1f} {row['fraction_of_copy_bw_graph']:>10.2f}"
                    rows.append(row)
                    print(line, flush=True)
    path = write_result("fused_ops", {
        "device": device_name(device), "shape": "llama-2-7b" if not args.smoke else "smoke", "dims": shape,
        "dtype": "float16", "copy_bandwidth_GBps": None if bw is None else bw / 1e9,
        "timer": "host wall clock (smoke)" if args.smoke else "triton.testing.do_bench median, L2 flushed",
        "rows": rows,
    }, args.out)  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
