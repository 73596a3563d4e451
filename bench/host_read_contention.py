"""What reading adapters into host memory costs the thread that launches steps (CPU only).

The worker reads adapters on background threads while its main thread launches steps; every
torch call of the main thread needs the GIL. This times a small torch call on the main thread
alone and while 1 or 4 threads read a 7B-shaped rank-8 adapter (all seven projections) in a loop,
two ways:

- ``python``: tensor by tensor in Python, as the host tier did before 293f6b9 (``get_tensor``, a
  cast, an ``aminmax`` finiteness check and a copy per tensor);
- ``native``: ``read_lora_spec`` plus one ``LoraSpec.read_into`` (GIL released), as now.

    python3 -m bench.host_read_contention [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

from bench import script_env

script_env.prepare()  # deltaserve importable from pyworker/

from bench.common import shape_config, write_random_lora_dir, write_result  # noqa: E402
from deltaserve.adapters.lora import load_lora_adapter  # noqa: E402
from deltaserve.model.arch import ModelConfig  # noqa: E402

SEVEN = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def python_read(path: Path) -> int:
    """The per-tensor read the host tier used to do (the baseline)."""
    from safetensors import safe_open

    total = 0
    with safe_open(str(path / "adapter_model.safetensors"), framework="pt", device="cpu") as f:
        for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
            t = f.get_tensor(key).to(torch.float16)
            lo, hi = torch.aminmax(t)
            assert bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))
            total += t.clone().numel()
    return total


def main_call_us(x: torch.Tensor, calls: int) -> float:
    """Mean µs of one small torch call on this thread."""
    t0 = time.perf_counter()
    for _ in range(calls):
        x.add(1.0)
    return (time.perf_counter() - t0) / calls * 1e6


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, default=8)
    p.add_argument(
        "--targets", choices=("all", "qkvo"), default="all", help="all seven projections (S-LoRA S1) or q, k, v, o (S2)"
    )
    p.add_argument("--readers", default="python,native", help="which readers to time, comma-separated")
    p.add_argument("--suffix", default="", help="appended to the experiment name of the result file")
    p.add_argument("--calls", type=int, default=20000)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    cfg = shape_config("llama-2-7b")
    base = ModelConfig.from_dict(cfg)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        targets = SEVEN if args.targets == "all" else SEVEN[:4]
        adapter = write_random_lora_dir(Path(tmp) / "a", cfg, args.rank, targets)
        readers = {
            "python": lambda: python_read(adapter),
            "native": lambda: load_lora_adapter(adapter, base, dtype=torch.float16),
        }
        readers = {k: v for k, v in readers.items() if k in args.readers.split(",")}
        adapter_bytes = sum(f.stat().st_size for f in adapter.iterdir())
        x = torch.randn(64, 64)
        alone = statistics.median(main_call_us(x, args.calls) for _ in range(3))
        print(f"main-thread call alone: {alone:.2f} us", flush=True)
        for name, read in readers.items():
            read()
            t0 = time.perf_counter()
            for _ in range(5):
                read()
            read_ms = (time.perf_counter() - t0) / 5 * 1e3
            for threads in (1, 4):
                stop = threading.Event()
                reads = [0]

                def loop(read=read, stop=stop, reads=reads) -> None:
                    while not stop.is_set():
                        read()
                        reads[0] += 1

                workers = [threading.Thread(target=loop) for _ in range(threads)]
                for w in workers:
                    w.start()
                time.sleep(0.3)
                us = main_call_us(x, args.calls)
                stop.set()
                for w in workers:
                    w.join()
                rows.append(
                    {
                        "reader": name,
                        "threads": threads,
                        "read_ms_alone": read_ms,
                        "main_call_us": us,
                        "main_call_us_alone": alone,
                        "reads_during": reads[0],
                    }
                )
                print(
                    f"{name:6s} reader, {threads} thread(s): read {read_ms:6.1f} ms alone; "
                    f"main-thread call {us:6.2f} us (alone {alone:.2f})",
                    flush=True,
                )
    path = write_result(
        "host_read_contention" + args.suffix,
        {
            "device": "cpu",
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "shape": "llama-2-7b",
            "rank": args.rank,
            "targets": list(targets),
            "rows": rows,
            "adapter_bytes": adapter_bytes,
        },
        args.out,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
