"""What allocating pinned host copies on loader threads costs the thread that launches steps (GPU).

S-LoRA's S2 at n = 1000 reads a rank-64/32/16/8 adapter (about 63 MB on average, 7B shape) into
a fresh pinned buffer for almost every request, on the host tier's loader threads, while the
main thread launches steps. Per step the main thread copies a few small input tensors to the
device (through the pinned staging buffer, ``host_to_device``), records an event, and launches a
few hundred kernels. This times those two parts of one host-side "step" separately (no device
sync inside them) while 0 or 4 loader threads each fill a 64 MB buffer in a loop:

- ``pageable``: a new pageable buffer each time (the control: memory traffic, no pinning);
- ``pinned-new``: a new pinned buffer each time (``cudaHostAlloc``; what the host tier did);
- ``pinned-arena``: a slice of one pinned buffer allocated before the run (``PinnedArena``).

    python3 -m bench.pinned_alloc_contention [--out DIR] [--seconds 3]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from pathlib import Path

import torch

from bench import script_env

script_env.prepare()  # deltaserve importable from pyworker/

from bench.common import write_result  # noqa: E402
from deltaserve.adapters.pinned_arena import PinnedArena  # noqa: E402
from deltaserve.model.batch import host_to_device  # noqa: E402

COPY_BYTES = 64 << 20
"""One loader thread's buffer: about an S2 adapter's host copy."""
KEEP_BYTES = 8 << 30
"""Bytes a loader keeps alive before letting them all go (more than it fills in a point, so with
``pinned-new`` every allocation is new pinned memory, as while the host tier grows)."""
INPUTS = 9
"""Small host tensors a step copies to the device (``ForwardBatch.build`` and the LoRA segments)."""
LAUNCHES = 300
"""Small kernels a step launches."""
LOADERS = ("none", "pageable", "pinned-new", "pinned-arena")


def loader(stop: threading.Event, kind: str, arena: PinnedArena | None, count: list[int]) -> None:
    kept: list[torch.Tensor] = []
    held = 0
    elems = COPY_BYTES // 2
    while not stop.is_set():
        if kind == "pinned-arena":
            assert arena is not None
            buf = arena.take(COPY_BYTES)
            if buf is None:  # full: give this loader's copies back, as the host tier evicts
                for b in kept:
                    arena.give(b)
                kept.clear()
                continue
            buf = buf.view(torch.float16)
        else:
            buf = torch.empty(elems, dtype=torch.float16, pin_memory=kind == "pinned-new")
        buf.fill_(1.0)  # the read writes every byte
        kept.append(buf if kind != "pinned-arena" else buf.view(torch.uint8))
        held += COPY_BYTES
        count[0] += 1
        if held >= KEEP_BYTES and kind != "pinned-arena":
            kept.clear()
            held = 0


def step_times(seconds: float) -> tuple[list[float], list[float]]:
    """Main-thread seconds of each step's input copies (+ event record) and of its launches."""
    dev = torch.device("cuda")
    x = torch.zeros(1 << 16, device=dev)
    data = [list(range(64)) for _ in range(INPUTS)]
    copies, launches = [], []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        outs = [host_to_device(torch.tensor(d, dtype=torch.int64), dev) for d in data]
        torch.cuda.Event().record()
        t1 = time.perf_counter()
        for _ in range(LAUNCHES):
            x.add_(1.0)
        t2 = time.perf_counter()
        copies.append(t1 - t0)
        launches.append(t2 - t1)
        del outs
        if len(copies) % 20 == 0:
            torch.cuda.synchronize()  # keep the queue short: the host side is what is timed
    torch.cuda.synchronize()
    return copies, launches


def summary(prefix: str, seconds: list[float]) -> dict:
    ms = sorted(v * 1e3 for v in seconds)
    return {
        f"{prefix}_ms_mean": statistics.fmean(ms),
        f"{prefix}_ms_p50": ms[len(ms) // 2],
        f"{prefix}_ms_p99": ms[int(len(ms) * 0.99)],
        f"{prefix}_ms_max": ms[-1],
    }


def run(kind: str, seconds: float) -> dict:
    stop = threading.Event()
    count = [0]
    loaders = 0 if kind == "none" else 4
    arenas = [PinnedArena(1 << 30) if kind == "pinned-arena" else None for _ in range(loaders)]
    threads = [threading.Thread(target=loader, args=(stop, kind, arenas[i], count)) for i in range(loaders)]
    for t in threads:
        t.start()
    time.sleep(0.2)
    try:
        copies, launches = step_times(seconds)
    finally:
        stop.set()
        for th in threads:
            th.join()
        for a in arenas:
            if a is not None:
                a.close()
    return {
        "loaders": loaders,
        "loader_memory": kind,
        "steps": len(copies),
        **summary("copies", copies),
        **summary("launches", launches),
        "loader_gb_per_s": count[0] * COPY_BYTES / (seconds + 0.2) / 1e9,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--seconds", type=float, default=3.0)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("pinned_alloc_contention needs a CUDA device")
    step_times(0.5)  # warm up
    rows = []
    for kind in LOADERS:
        r = run(kind, args.seconds)
        rows.append(r)
        print(
            f"loaders {r['loaders']} {kind:12s}: copies mean {r['copies_ms_mean']:.3f} ms p99 {r['copies_ms_p99']:.3f} "
            f"max {r['copies_ms_max']:.1f}; launches mean {r['launches_ms_mean']:.3f} p99 {r['launches_ms_p99']:.3f} "
            f"max {r['launches_ms_max']:.1f}; loaders {r['loader_gb_per_s']:.1f} GB/s"
        )
    path = write_result(
        "pinned_alloc_contention",
        {
            "device": torch.cuda.get_device_name(),
            "copy_bytes": COPY_BYTES,
            "inputs_per_step": INPUTS,
            "launches_per_step": LAUNCHES,
            "seconds_per_point": args.seconds,
            "rows": rows,
        },
        Path(args.out),
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
