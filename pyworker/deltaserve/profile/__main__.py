"""``python -m deltaserve.profile`` (``deltaserve profile``): the command line of ``deltaserve.profile``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _ints(s: str) -> list[int]:
    try:
        out = [int(x) for x in s.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r}: want comma-separated integers") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"{s!r}: want positive integers")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="deltaserve profile", description=__doc__)
    p.add_argument("--model", type=Path, required=True, help="the served model's HF directory")
    p.add_argument("--device", default="cpu", help="cpu or cuda:N (default cpu)")
    p.add_argument("--dtype", default="auto", help="auto, float16, bfloat16 or float32 (default auto)")
    p.add_argument("--batches", type=_ints, default=[1, 8, 32, 64], help="decode batch sizes (default 1,8,32,64)")
    p.add_argument("--ranks", type=_ints, default=[8, 16, 32, 64], help="LoRA ranks (default 8,16,32,64)")
    p.add_argument("--prompts", type=_ints, default=[128, 512, 1024], help="prefill lengths (default 128,512,1024)")
    p.add_argument("--targets", default="q_proj,k_proj,v_proj", help="adapted projections (default q,k,v: CaraServe's)")
    p.add_argument("--ctx", type=int, default=256, help="cached tokens per decoding request (default 256)")
    p.add_argument("--reps", type=int, default=5, help="timed steps per point (the median counts; default 5)")
    p.add_argument("--kv-cache-bytes", type=int, default=0, help="KV pool bytes (default: the worker's sizing)")
    p.add_argument("--out", type=Path, required=True, help="where the profile JSON goes")
    a = p.parse_args(argv)
    targets = tuple(t for t in a.targets.split(",") if t)
    if not (a.model / "config.json").is_file():  # before torch is imported: a quick, clear error
        print(
            f"deltaserve profile: --model {a.model}: no config.json (an HF model directory is needed)", file=sys.stderr
        )
        return 2
    from deltaserve.profile.measure import profile

    try:
        model = profile(
            a.model, device=a.device, dtype=a.dtype, batches=a.batches, ranks=a.ranks, prompts=a.prompts,
            targets=targets, ctx=a.ctx, reps=a.reps, kv_cache_bytes=a.kv_cache_bytes,
        )  # fmt: skip
    except (ValueError, FileNotFoundError) as e:
        print(f"deltaserve profile: {e}", file=sys.stderr)
        return 2
    model.save(a.out)
    print(json.dumps({"out": str(a.out), "device": model.device, "r2": model.r2, "samples": model.samples}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
