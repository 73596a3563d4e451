"""What allocating pinned host copies on loader threads costs the thread that launches steps (GPU).

S-LoRA's S2 at n = 2000 reads a rank-64/32/16/8 adapter (about 63 MB on average, 7B shape) into
a fresh pinned buffer for almost every request, on the host tier's loader threads, while the
main thread launches steps: per step it copies a few small input tensors to the device (pinning
each one first: ``host_to_device``) and launches a few hundred kernels. This times one such
host-side "step" on the main thread (no device sync inside it), with 0 or 4 loader threads that
each allocate and fill a 64 MB buffer in a loop, either pinned (as the host tier does on CUDA) or
pageable (the control), and the step's inputs either pinned one by one (``host_to_device``) or
written into one pinned staging buffer allocated once.

    python3 bench/pinned_alloc_contention.py [--out DIR] [--seconds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pyworker"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import write_result  # noqa: E402

from deltaserve.model.batch import host_to_device  # noqa: E402

COPY_BYTES = 64 << 20
"""One loader thread's buffer: about an S2 adapter's host copy."""
KEEP_BYTES = 8 << 30
"""Buffers a loader keeps alive before letting them all go (S2 at n = 2000 drops none; kept
bounded here), so most allocations are new pinned memory rather than cached blocks."""
INPUTS = 9
"""Small host tensors a step copies to the device (``ForwardBatch.build`` and the LoRA segments)."""
LAUNCHES = 300
"""Small kernels a step launches."""


def loader(stop: threading.Event, pinned: bool, count: list[int]) -> None:
    kept: list[torch.Tensor] = []
    held = 0
    while not stop.is_set():
        buf = torch.empty(COPY_BYTES // 2, dtype=torch.float16, pin_memory=pinned)
        buf.fill_(1.0)  # the read writes every byte
        kept.append(buf)
        held += COPY_BYTES
        count[0] += 1
        if held >= KEEP_BYTES // 4:
            kept.clear()
            held = 0


def step_times(inputs: str, seconds: float) -> list[float]:
    dev = torch.device("cuda")
    x = torch.zeros(1 << 16, device=dev)
    data = [list(range(64)) for _ in range(INPUTS)]
    staging = torch.empty(INPUTS * 64, dtype=torch.int64, pin_memory=True)
    done = torch.cuda.Event()
    times = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        if inputs == "pin-each":
            outs = [host_to_device(torch.tensor(d, dtype=torch.int64), dev) for d in data]
        else:  # one staging buffer: the previous step's copies must be done before it is rewritten
            done.synchronize()
            for i, d in enumerate(data):
                staging[i * 64 : (i + 1) * 64] = torch.tensor(d, dtype=torch.int64)
            outs = [staging.to(dev, non_blocking=True)]
            done.record()
        for _ in range(LAUNCHES):
            x.add_(1.0)
        times.append(time.perf_counter() - t0)
        del outs
        if len(times) % 20 == 0:
            torch.cuda.synchronize()  # keep the queue short: the host side is what is timed
    torch.cuda.synchronize()
    return times


def run(inputs: str, loaders: int, pinned: bool, seconds: float) -> dict:
    stop = threading.Event()
    count = [0]
    threads = [threading.Thread(target=loader, args=(stop, pinned, count)) for _ in range(loaders)]
    for t in threads:
        t.start()
    time.sleep(0.2)
    try:
        t = step_times(inputs, seconds)
    finally:
        stop.set()
        for th in threads:
            th.join()
    t_ms = sorted(v * 1e3 for v in t)
    return {
        "inputs": inputs,
        "loaders": loaders,
        "loader_memory": ("pinned" if pinned else "pageable") if loaders else "-",
        "steps": len(t_ms),
        "step_ms_mean": statistics.fmean(t_ms),
        "step_ms_p50": t_ms[len(t_ms) // 2],
        "step_ms_p99": t_ms[int(len(t_ms) * 0.99)],
        "loader_gb_per_s": count[0] * COPY_BYTES / (seconds + 0.2) / 1e9,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--seconds", type=float, default=3.0)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("pinned_alloc_contention needs a CUDA device")
    step_times("pin-each", 0.5)  # warm up
    rows = []
    for inputs in ("pin-each", "staging"):
        for loaders, pinned in ((0, False), (4, False), (4, True)):
            r = run(inputs, loaders, pinned, args.seconds)
            rows.append(r)
            print(f"{inputs:9s} loaders {loaders} {r['loader_memory']:8s}: step mean {r['step_ms_mean']:.3f} ms, "
                  f"p50 {r['step_ms_p50']:.3f}, p99 {r['step_ms_p99']:.3f}; loaders {r['loader_gb_per_s']:.1f} GB/s")
    path = write_result("pinned_alloc_contention", {
        "device": torch.cuda.get_device_name(), "copy_bytes": COPY_BYTES, "inputs_per_step": INPUTS,
        "launches_per_step": LAUNCHES, "seconds_per_point": args.seconds, "rows": rows}, Path(args.out))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
