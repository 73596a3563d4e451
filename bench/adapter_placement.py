"""What placing one LoRA adapter in the KV pool's pages (``LoraPool.to_gpu``) costs the thread that
launches steps, by rank (S-LoRA's S2 ranks on q, k, v, o; Llama-2-7B shape, fp16, host copies already
read). Under S2 at n = 1000 about one adapter is placed per mixed step, on the launching thread, so
this host time adds to the step's. Also the device time of the placement's copies, and (``--profile``)
where the host time goes (cProfile, top functions). Both region copies are timed: the Triton kernel
(``kernels/region_copy.py``, one launch) and its torch reference (one ``copy_`` per region).

    python3 -m bench.adapter_placement [--out DIR] [--reps 20] [--profile]
    python3 -m bench.adapter_placement --smoke      # 2 layers on the CPU: checks the script runs
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench import script_env

script_env.prepare()  # deltaserve importable from pyworker/

from bench.common import SHAPES, device_name, write_random_lora_dir, write_random_model_dir, write_result  # noqa: E402
from deltaserve.adapters.lora_pool import LoraPool  # noqa: E402
from deltaserve.adapters.pinned_arena import PinnedArena  # noqa: E402
from deltaserve.kernels import common as kernel_common  # noqa: E402
from deltaserve.model.arch import ModelConfig  # noqa: E402
from deltaserve.model.kv_cache import PagedKVCache  # noqa: E402

QKVO = ("q_proj", "k_proj", "v_proj", "o_proj")
RANKS = (64, 32, 16, 8)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="llama-2-7b")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--profile", action="store_true", help="print cProfile's top functions of the placements")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    device = torch.device("cpu" if args.smoke else "cuda:0")
    shape = dict(SHAPES[args.shape], **({"num_hidden_layers": 2} if args.smoke else {}))
    reps = 2 if args.smoke else args.reps
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir = write_random_model_dir(args.shape, tmp / "model")
        (model_dir / "config.json").write_text(__import__("json").dumps(shape))
        cfg = ModelConfig.from_model_dir(model_dir)
        kv = PagedKVCache(
            cfg.num_layers, 256 if args.smoke else 2048, 16, cfg.num_kv_heads, cfg.head_dim, torch.float16, device
        )
        pool = LoraPool(
            cfg,
            kv,
            max_lora_rank=max(RANKS),
            max_loras_per_step=256,
            max_tokens=2048,
            arena=PinnedArena(1 << 30, pin=device.type == "cuda"),
        )
        prof = cProfile.Profile() if args.profile else None  # the Triton placements
        dirs = {rank: write_random_lora_dir(tmp / f"r{rank}", shape, rank, QKVO, seed=rank) for rank in RANKS}
        for impl in ("torch", "triton"):
            kernel_common.set_backend("auto" if impl == "triton" else "torch")
            for aid, rank in enumerate(RANKS, start=1):
                info = pool.inspect(dirs[rank])
                assert info.error is None, info.error
                if aid not in pool.host:
                    pool.to_host(aid, dirs[rank])
                pool.wait_host(aid)
                pages = list(range(info.num_blocks))
                host, dev = [], []
                for _ in range(reps + 2):
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        start.record()
                    t0 = time.perf_counter()
                    if prof and impl == "triton":
                        prof.enable()
                    pool.to_gpu(aid, pages)
                    if prof and impl == "triton":
                        prof.disable()
                    host.append(time.perf_counter() - t0)
                    if device.type == "cuda":
                        end.record()
                        end.synchronize()
                        dev.append(start.elapsed_time(end) / 1e3)
                    pool.drop_gpu(aid)
                host, dev = host[2:], dev[2:]  # first placements warm up the allocator and kernels
                rows.append(
                    {
                        "region_copy": impl,
                        "rank": rank,
                        "pages": info.num_blocks,
                        "host_bytes": info.host_bytes,
                        "host_ms": statistics.median(host) * 1e3,
                        "device_ms": statistics.median(dev) * 1e3 if dev else None,
                    }
                )
                print(
                    f"{impl:6s} rank {rank:3d}: {info.num_blocks:3d} pages, {info.host_bytes / 1e6:6.1f} MB: "
                    f"launching thread {rows[-1]['host_ms']:6.3f} ms"
                    + (f", device {rows[-1]['device_ms']:6.3f} ms" if dev else ""),
                    flush=True,
                )
        kernel_common.set_backend("auto")
        pool.close()
        if prof:
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(15)
            print(out.getvalue())
    if args.smoke:
        return
    path = write_result(
        "adapter_placement",
        {
            "device": device_name(device),
            "shape": args.shape,
            "dtype": "float16",
            "targets": list(QKVO),
            "reps": reps,
            "rows": rows,
        },
        args.out,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
