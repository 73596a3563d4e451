"""Paged attention: the Triton kernels (``deltaserve.kernels.paged_attention``) next to the torch
reference (``paged_attention_ref``), one layer, fp16, on CUDA.

Decode: Llama-2-7B heads (32 q / 32 kv, head_dim 128) and Llama-3-8B (32 / 8), batch 1..256, KV
length 512 and 2048, block size 16, pages shuffled over the pool. Reported per row: median time of
the kernel launched eagerly and replayed from a CUDA graph (the way the decode step will run it),
the reference's time, and the KV bytes the step must read (K and V of every context token)
÷ time, next to the device-to-device copy bandwidth measured in the same run (bytes read +
written ÷ time, ``common.copy_bandwidth``).

Prefill: 1 x 2048 and 16 x 512 prompts (causal, from an empty cache), FLOP/s of the kernel and
the reference, counting 4·D·H FLOPs per visible (query, key) pair (QK^T and PV).

Each configuration is first checked: kernel vs reference, max |difference| in the JSON.

    python3 -m bench.bench_paged_attention [--batches 1,8,32,64,128,256] [--ctx 512,2048] [--out DIR]
        [--splits 1,2,4,8,16]

``--splits``: each decode row also replays the kernel from a CUDA graph at each of these split counts
(``splits_graph_ms``; each one's max |difference| from the default launch's output in
``splits_max_abs_diff``): the sweep behind ``decode_num_splits``.

Needs a CUDA GPU, TRITON_INTERPRET unset. Writes bench/results/paged_attention-<device>-<date>.json.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
from pathlib import Path

import torch

from bench import script_env

script_env.prepare()  # deltaserve importable from pyworker/

from bench.common import copy_bandwidth, device_name, write_result  # noqa: E402
from deltaserve.kernels.paged_attention import decode_num_splits, paged_attention, paged_decode  # noqa: E402
from deltaserve.model import ForwardBatch  # noqa: E402
from deltaserve.model.attention import attention_metadata, paged_attention_ref  # noqa: E402

HEADS = {"llama-2-7b": (32, 32, 128), "llama-3-8b": (32, 8, 128)}
"""shape name -> (query heads, kv heads, head_dim)."""
BLOCK_SIZE = 16


def time_cuda(fn, iters: int, warmup: int = 3) -> float:
    """Median seconds of ``fn()`` over ``iters`` calls, each timed with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def make_step(lens: list[tuple[int, int]], heads: int, kv_heads: int, dim: int, device, seed: int):
    """Random q and one layer's K/V pool (fp16) for sequences ``(cached, new)``, pages shuffled."""
    need = [-(-(c + n) // BLOCK_SIZE) for c, n in lens]
    pages = list(range(1, sum(need) + 1))
    random.Random(seed).shuffle(pages)
    seqs, at = [], 0
    for (cached, new), n in zip(lens, need):
        seqs.append(([0] * new, cached, pages[at : at + n], False))
        at += n
    batch = ForwardBatch.build(seqs, BLOCK_SIZE, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    cache = torch.randn(
        (2, sum(need) + 1, BLOCK_SIZE, kv_heads, dim), generator=gen, device=device, dtype=torch.float16
    )
    q = torch.randn((batch.num_tokens, heads, dim), generator=gen, device=device, dtype=torch.float16)
    return q, cache[0], cache[1], batch


def run_kernel(q, ck, cv, batch, scale):
    return paged_attention(
        q,
        ck,
        cv,
        batch.block_tables,
        batch.seq_lens,
        batch.query_start_loc,
        batch.max_query_len,
        scale,
        max_seq_len=batch.max_seq_len,
    )


def graph_replay_ms(launch, iters: int) -> float:
    """Median ms of ``launch`` captured once in a CUDA graph and replayed (warmed up on a side stream)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        launch()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    graph.replay()
    torch.cuda.synchronize()
    return time_cuda(graph.replay, iters) * 1e3


def bench_decode(
    shape: str, batch_size: int, ctx: int, bw: float, iters: int, device, sweep: tuple[int, ...] = ()
) -> dict:
    heads, kv_heads, dim = HEADS[shape]
    scale = dim**-0.5
    q, ck, cv, batch = make_step([(ctx - 1, 1)] * batch_size, heads, kv_heads, dim, device, seed=batch_size)
    kv_bytes = batch_size * ctx * kv_heads * dim * 2 * ck.element_size()
    splits = decode_num_splits(
        batch_size, kv_heads, ctx, torch.cuda.get_device_properties(device).multi_processor_count
    )
    row: dict = {"shape": shape, "batch": batch_size, "ctx": ctx, "kv_bytes": kv_bytes, "num_splits": splits}

    out = run_kernel(q, ck, cv, batch, scale)
    meta = attention_metadata(batch, BLOCK_SIZE, None, backend="torch")
    meta.reference.bias(q.dtype)  # built once per step in the decoder: not part of a layer's time
    try:
        ref = paged_attention_ref(q, ck, cv, batch, scale, meta=meta)
        row["max_abs_diff"] = (out.float() - ref.float()).abs().max().item()
        del ref
        row["ref_ms"] = time_cuda(lambda: paged_attention_ref(q, ck, cv, batch, scale, meta=meta), iters) * 1e3
    except torch.OutOfMemoryError:
        row["ref_ms"] = None
        torch.cuda.empty_cache()
    row["kernel_ms"] = time_cuda(lambda: run_kernel(q, ck, cv, batch, scale), iters) * 1e3

    # The same launch captured in a CUDA graph and replayed: kernel time without Python launch cost.
    static_out = torch.empty_like(q)

    def launch(n: int):
        return lambda: paged_decode(q, ck, cv, batch.block_tables, batch.seq_lens, scale, num_splits=n, out=static_out)

    try:
        row["graph_ms"] = graph_replay_ms(launch(splits), iters)
        row["graph_matches_eager"] = bool(torch.equal(static_out, out))
    except Exception as exc:  # noqa: BLE001 (a failed capture is a result to report, not a crash)
        row["graph_ms"] = None
        row["graph_error"] = f"{type(exc).__name__}: {exc}"
    if sweep:
        row["splits_graph_ms"], row["splits_max_abs_diff"] = {}, {}
        for n in sweep:
            row["splits_graph_ms"][n] = graph_replay_ms(launch(n), iters)
            row["splits_max_abs_diff"][n] = (static_out.float() - out.float()).abs().max().item()
    best = row["graph_ms"] or row["kernel_ms"]
    row["kernel_GBps"] = kv_bytes / (best / 1e3) / 1e9
    row["kernel_vs_copy_bw"] = kv_bytes / (best / 1e3) / bw
    if row["ref_ms"]:
        row["ref_GBps"] = kv_bytes / (row["ref_ms"] / 1e3) / 1e9
    return row  # the caller empties the CUDA cache once this step's tensors are gone


def bench_prefill(shape: str, num_seqs: int, length: int, iters: int, device) -> dict:
    heads, kv_heads, dim = HEADS[shape]
    scale = dim**-0.5
    q, ck, cv, batch = make_step([(0, length)] * num_seqs, heads, kv_heads, dim, device, seed=length)
    flops = 4 * dim * heads * num_seqs * length * (length + 1) // 2
    row: dict = {"shape": shape, "num_seqs": num_seqs, "length": length, "flops": flops}
    out = run_kernel(q, ck, cv, batch, scale)
    meta = attention_metadata(batch, BLOCK_SIZE, None, backend="torch")
    meta.reference.bias(q.dtype)
    ref = paged_attention_ref(q, ck, cv, batch, scale, meta=meta)
    row["max_abs_diff"] = (out.float() - ref.float()).abs().max().item()
    row["kernel_ms"] = time_cuda(lambda: run_kernel(q, ck, cv, batch, scale), iters) * 1e3
    row["ref_ms"] = time_cuda(lambda: paged_attention_ref(q, ck, cv, batch, scale, meta=meta), iters) * 1e3
    row["kernel_TFLOPs"] = flops / (row["kernel_ms"] / 1e3) / 1e12
    row["ref_TFLOPs"] = flops / (row["ref_ms"] / 1e3) / 1e12
    return row  # the caller empties the CUDA cache once this step's tensors are gone


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=",".join(HEADS))
    p.add_argument("--batches", default="1,8,32,64,128,256")
    p.add_argument("--ctx", default="512,2048")
    p.add_argument("--prefill", default="1x2048,16x512", help="NUMxLEN prompts, comma separated ('' skips)")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--splits", default="", help="split counts each decode row also replays (module docstring)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    try:
        sweep = tuple(int(n) for n in args.splits.split(",") if n)
    except ValueError:
        sys.exit(f"--splits: want split counts like 1,2,4,8, got {args.splits!r}")
    if any(n < 1 for n in sweep):
        sys.exit(f"--splits: every split count must be >= 1, got {args.splits!r}")
    if not torch.cuda.is_available():
        sys.exit("bench_paged_attention.py needs a CUDA GPU")
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("unset TRITON_INTERPRET: it runs the kernels in the CPU interpreter")
    shapes = args.shapes.split(",")
    for s in shapes:
        if s not in HEADS:
            sys.exit(f"unknown shape {s!r}; known: {', '.join(HEADS)}")
    device = torch.device("cuda:0")
    torch.cuda.set_device(device)
    bw = copy_bandwidth(device)
    print(f"{device_name(device)}: copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)

    decode_rows = []
    for shape in shapes:
        for ctx in (int(c) for c in args.ctx.split(",")):
            for b in (int(x) for x in args.batches.split(",")):
                row = bench_decode(shape, b, ctx, bw, args.iters, device, sweep)
                torch.cuda.empty_cache()
                decode_rows.append(row)
                ref = f"{row['ref_ms']:.3f}" if row["ref_ms"] else "oom"
                graph = f"{row['graph_ms']:.3f}" if row["graph_ms"] else "failed"
                print(
                    f"decode {shape} ctx {ctx:5d} batch {b:4d} splits {row['num_splits']:2d}: kernel "
                    f"{row['kernel_ms']:.3f} ms (graph {graph} ms) {row['kernel_GBps']:.0f} GB/s = "
                    f"{row['kernel_vs_copy_bw']:.2f}x copy bw | ref {ref} ms | "
                    f"max diff {row.get('max_abs_diff', float('nan')):.1e}",
                    flush=True,
                )
                if sweep:
                    print("  splits: " + ", ".join(f"{n}: {ms:.4f} ms" for n, ms in row["splits_graph_ms"].items()))
                if "graph_error" in row:
                    print(f"  graph capture failed: {row['graph_error']}", flush=True)

    prefill_rows = []
    for shape in shapes:
        for spec in filter(None, args.prefill.split(",")):
            n, length = (int(x) for x in spec.split("x"))
            row = bench_prefill(shape, n, length, max(5, args.iters // 5), device)
            torch.cuda.empty_cache()
            prefill_rows.append(row)
            print(
                f"prefill {shape} {n}x{length}: kernel {row['kernel_ms']:.3f} ms {row['kernel_TFLOPs']:.1f} "
                f"TFLOP/s | ref {row['ref_ms']:.3f} ms {row['ref_TFLOPs']:.1f} TFLOP/s | "
                f"max diff {row['max_abs_diff']:.1e}",
                flush=True,
            )

    path = write_result(
        "paged_attention" + ("-splits" if sweep else ""),
        {
            "device": device_name(device),
            "dtype": "float16",
            "block_size": BLOCK_SIZE,
            "copy_bandwidth_GBps": bw / 1e9,
            "heads": HEADS,
            "iters": args.iters,
            "splits_sweep": list(sweep),
            "triton": __import__("triton").__version__,
            "torch": torch.__version__,
            "decode": decode_rows,
            "prefill": prefill_rows,
        },
        args.out,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
