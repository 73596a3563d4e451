"""A delta's load host -> GPU slot with its copies queued (this tree) against each copy waited for (the tree
before: ``PackedLinear.to`` forced blocking), in one process on one device, alternating.

Llama-2-7B shape, one random 4-bit 2:4 delta (group 64), the worker's executor with a pinned host arena:
``bench.delta_decode_step.load_time`` per round and way (disk -> host once, then ``to_gpu`` into a free slot
best of 5, synchronised; and the launching thread's share, until ``to_gpu`` returns).

    python3 -m bench.archive.delta_load_ab [--rounds 2] [--out DIR]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from unittest import mock

import torch

from bench import script_env

script_env.prepare()  # deltaserve importable from pyworker/

from bench.common import device_name, shape_config, write_random_checkpoint, write_result  # noqa: E402
from bench.delta_decode_step import load_time, make_delta_dirs  # noqa: E402
from deltaserve.formats import packed_delta  # noqa: E402
from deltaserve.worker.executor import Executor  # noqa: E402

QUEUED = packed_delta.PackedLinear.to


def blocking(self: packed_delta.PackedLinear, device, non_blocking: bool = False) -> packed_delta.PackedLinear:
    """``PackedLinear.to`` as the loads used it before: every copy waited for."""
    return QUEUED(self, device, non_blocking=False)


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("delta_load_ab needs a CUDA device")
    runs: dict[str, list[dict]] = {"queued": [], "blocking": []}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        base = write_random_checkpoint(shape_config("llama-2-7b"), root / "base", seed=0, device="cuda")
        path = next(iter(make_delta_dirs(base, root / "deltas", 1, 1, 4, True, 64).values()))
        ex = Executor(base, device="cuda:0", dtype="float16", block_size=16, gpu_memory_utilization=0.9,
                      cuda_graph_max_batch=0, max_deltas=2, host_arena_bytes=8 << 30)  # fmt: skip
        delta_id = 50
        for _ in range(args.rounds):
            for way, to in (("queued", QUEUED), ("blocking", blocking)):
                with mock.patch.object(packed_delta.PackedLinear, "to", to):
                    runs[way].append(load_time(ex, path, delta_id, torch.cuda.synchronize))
                delta_id += 1
    payload = {"device": device_name(torch.device("cuda:0")), "shape": "llama-2-7b", "delta": "4-bit 2:4, group 64",
               "unit": "ms", "runs": runs}  # fmt: skip
    return write_result("delta_load_ab", payload, args.out)


if __name__ == "__main__":
    main()
