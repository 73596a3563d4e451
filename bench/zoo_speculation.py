"""Speculative surrogate blocks (issue 23, BlockLLM §5.2): time to first token of a cold zoo variant's
prefill with and without speculation (``adapters/block_speculation.py``), and the acceptance rate.

One executor in this process (no router: the plans are the router's for a cold variant at an idle
server, ``to_host`` + ``to_gpu`` + the prefill in one step), a random base (``--shape``, Llama-2-7B by
default) and zoo variants whose own blocks (random 4-bit 2:4 codes, ``zoo_mix.write_zoo``) sit in
different layers::

    tail     the last half of the layers own (a partial fine-tune): consecutive own blocks, so no
             speculation; the layers before the first own one run while the delta is read
    sparse   every 4th layer from a quarter of the way: speculation on the first own block, its
             window the three layers up to the next own one
    single   one own block in the middle: speculation up to the last layer

Per variant and ``--prompts`` length, ``--reps`` cold prefills per mode, interleaved: ``off`` (the
executor waits for the read, then places the delta and runs the prefill), ``on`` (speculate only
while the read is running) and ``always`` (speculate whatever the read's state); plus the prefill
with the delta already placed (``warm``, the floor). Before each cold prefill the payload files are
dropped from the page cache (``posix_fadvise DONTNEED``), so the read comes from the disk as at a
cold start (``--keep-cache``: from the page cache). The weights are random: the acceptance rate
(cosine >= 0.95 between the surrogate's and the real block's output) says little about real
fine-tunes, and every speculation is recomputed unless bit-equal, so tokens are exact in all modes.

    python -m bench.zoo_speculation [--prompts 128,512] [--reps 3] [--device cuda:0]
    python -m bench.zoo_speculation --smoke          # the tiny shape on the CPU: a check
    python -m bench.zoo_speculation --device cpu --base DEMO_DIR --prompts 64   # a real base on the CPU

Result: ``bench/results/zoo_speculation-<device>-<date>.json`` (device, commit, shapes, per-mode
medians, counts and cosines).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import script_env

script_env.prepare()

import torch  # noqa: E402

from bench.common import SMOKE_SHAPE, device_name, shape_config, write_random_delta_dir, write_result  # noqa: E402
from bench.plans import new_request  # noqa: E402
from bench.serving.variants import write_base_checkpoint  # noqa: E402
from bench.zoo_mix import write_zoo  # noqa: E402
from deltaserve import wire  # noqa: E402
from deltaserve.adapters.block_speculation import BlockSpeculation, gate_plan  # noqa: E402
from deltaserve.worker.executor import Executor  # noqa: E402

DELTA = wire.VariantKind.DELTA
MODES = ("off", "on", "always")


def layouts(num_layers: int) -> dict[str, set[int]]:
    """Variant name -> its own layers (module docstring)."""
    return {
        "tail": set(range(num_layers // 2, num_layers)),
        "sparse": set(range(num_layers // 4, num_layers, 4)),
        "single": {num_layers // 2},
    }


def evict(directory: Path) -> None:
    """Drops the files under ``directory`` from the page cache (their next read comes from the disk)."""
    for f in directory.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


class ColdPrefills:
    """Plans for one executor: a variant's cold prefill (its ``to_host`` and ``to_gpu`` in the plan),
    then its release and the variant's ``drop_gpu`` / ``drop_host``, so every timed step starts cold."""

    def __init__(self, ex: Executor) -> None:
        self.ex, self.step_id, self.req = ex, 0, 0

    def _plan(self, **kw: Any) -> wire.StepPlan:
        self.step_id += 1
        return wire.StepPlan(step_id=self.step_id, **kw)

    def _request(self, tokens: int, aid: int) -> wire.NewRequest:
        self.req += 1
        blocks = list(range(-(-(tokens + 1) // self.ex.block_size)))
        gen = torch.Generator().manual_seed(self.req)
        ids = torch.randint(3, self.ex.config.vocab_size, (tokens,), generator=gen).tolist()
        return new_request(self.req, ids, blocks, adapter_id=aid)

    def _timed(self, plan: wire.StepPlan) -> float:
        if self.ex.device.type == "cuda":
            torch.cuda.synchronize(self.ex.device)
        t0 = time.perf_counter()
        self.ex.step(plan)
        return time.perf_counter() - t0

    def cold(self, variant: Path, tokens: int, keep_cache: bool) -> float:
        """Seconds of one cold prefill of ``variant`` (id 1, slot 0), ``tokens`` long."""
        if not keep_cache:
            evict(variant)
        ops = [wire.VariantOp(1, wire.TierOp.TO_HOST, str(variant), [], DELTA, None),
               wire.VariantOp(1, wire.TierOp.TO_GPU, "", [], DELTA, 0)]  # fmt: skip
        new = self._request(tokens, 1)
        seconds = self._timed(self._plan(adapter_ops=ops, new_requests=[new]))
        drop = [wire.VariantOp(1, wire.TierOp.DROP_GPU, "", [], DELTA, None),
                wire.VariantOp(1, wire.TierOp.DROP_HOST, "", [], DELTA, None)]  # fmt: skip
        self.ex.step(self._plan(released=[new.req_id], adapter_ops=drop))
        return seconds

    def warm(self, variant: Path, tokens: int) -> float:
        """Seconds of the same prefill with the variant already placed (then dropped again)."""
        ops = [wire.VariantOp(1, wire.TierOp.TO_HOST, str(variant), [], DELTA, None),
               wire.VariantOp(1, wire.TierOp.TO_GPU, "", [], DELTA, 0)]  # fmt: skip
        self.ex.step(self._plan(adapter_ops=ops))
        new = self._request(tokens, 1)
        seconds = self._timed(self._plan(new_requests=[new]))
        drop = [wire.VariantOp(1, wire.TierOp.DROP_GPU, "", [], DELTA, None),
                wire.VariantOp(1, wire.TierOp.DROP_HOST, "", [], DELTA, None)]  # fmt: skip
        self.ex.step(self._plan(released=[new.req_id], adapter_ops=drop))
        return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama-2-7b")
    ap.add_argument("--layers", type=int, help="decoder layers (default: the shape's)")
    ap.add_argument("--prompts", default="128,512")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--keep-cache", action="store_true", help="read the payloads from the page cache")
    ap.add_argument("--work-dir", type=Path, default=None, help="where the model and zoo go (reused)")
    ap.add_argument("--base", type=Path, default=None, help="an existing model directory as the base (e.g. the demo)")
    ap.add_argument("--smoke", action="store_true", help="the tiny shape (8 layers) on the CPU, 1 rep")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    prompts = [int(x) for x in a.prompts.split(",")]
    shape, layers, device, dtype, reps = a.shape, a.layers, a.device, "float16", a.reps
    if a.smoke:
        shape, layers, device, dtype, reps, prompts = SMOKE_SHAPE, 8, "cpu", "float32", 1, [16]
    elif device == "cpu":
        dtype = "float32"
    elif not torch.cuda.is_available():
        raise SystemExit("zoo_speculation: no CUDA device (--device cpu, or --smoke)")
    config = json.loads((a.base / "config.json").read_text()) if a.base else shape_config(shape, layers)
    n = config["num_hidden_layers"]
    work = a.work_dir or Path(tempfile.mkdtemp(prefix="zoo-spec-"))
    root = work / (f"{a.base.name}-{n}l" if a.base else f"{shape}-{n}l")
    t0 = time.perf_counter()
    base = a.base or write_base_checkpoint(root, config, "cpu" if device == "cpu" else "cuda")
    payload = root / "payload"
    if not (payload / "manifest.json").is_file():
        write_random_delta_dir(base, payload, 4, True, 64, seed=400)
    own = layouts(n)
    zoo = write_zoo(
        root / "zoo", base, [payload], {k: {"kind": "partial", "own": dict.fromkeys(v, 0)} for k, v in own.items()}
    )
    print(f"files ready in {time.perf_counter() - t0:.1f} s under {root}", flush=True)
    ex = Executor(base, device=device, dtype=dtype, max_num_batched_tokens=max(prompts), max_deltas=1,
                  max_lora_rank=0, kv_cache_bytes=(4 << 30) if device != "cpu" else (64 << 20))  # fmt: skip
    assert ex.delta_pool is not None
    runs = ColdPrefills(ex)
    speculation = {m: BlockSpeculation(ex.delta_pool, m) for m in MODES if m != "off"}
    rows = []
    for name, layers_own in own.items():
        variant = zoo / "variants" / name
        plan = gate_plan(layers_own, n)
        for p in prompts:
            for m in MODES:  # warm-up: kernels compiled, the code paths taken once
                ex.speculation = speculation.get(m)
                runs.cold(variant, p, keep_cache=True)
            before = {m: len(s.totals.cosines) for m, s in speculation.items()}
            counted = {m: (s.totals.speculated, s.totals.accepted, s.totals.exact, s.totals.recomputed_layers,
                           s.totals.waited) for m, s in speculation.items()}  # fmt: skip
            times: dict[str, list[float]] = {m: [] for m in MODES}
            stats: dict[str, Any] = {}
            for _ in range(reps):
                for m in MODES:
                    ex.speculation = speculation.get(m)
                    times[m].append(runs.cold(variant, p, a.keep_cache))
            for m, s in speculation.items():  # the gates' totals over the timed prefills
                t = s.totals
                now = (t.speculated, t.accepted, t.exact, t.recomputed_layers, t.waited)
                keys = ("speculated", "accepted", "exact", "recomputed_layers", "waited")
                stats[m] = {k: a - b for k, a, b in zip(keys, now, counted[m])} | {"cosines": t.cosines[before[m] :]}
            ex.speculation = None
            warm = statistics.median(runs.warm(variant, p) for _ in range(reps))
            row = {"variant": name, "own_layers": sorted(layers_own), "first_own": plan.first_own,
                   "land_at": plan.land_at, "speculates": plan.speculates, "prompt_tokens": p,
                   "warm_ms": warm * 1e3, **{f"{m}_ms": statistics.median(t) * 1e3 for m, t in times.items()},
                   "all_ms": {m: [x * 1e3 for x in t] for m, t in times.items()}, "stats": stats}  # fmt: skip
            rows.append(row)
            print(f"{name:7s} p{p:<5d} warm {row['warm_ms']:8.1f} ms  off {row['off_ms']:8.1f}  on {row['on_ms']:8.1f}  "
                  f"always {row['always_ms']:8.1f}  accepted {stats['always']['accepted']}/{stats['always']['speculated']}",
                  flush=True)  # fmt: skip
    payload_bytes = sum(f.stat().st_size for f in (zoo / "blocks").iterdir())
    result = {
        "device": device_name(ex.device), "shape": str(a.base) if a.base else shape, "config": config, "dtype": dtype, "reps": reps,
        "page_cache": "kept" if a.keep_cache else "dropped before each cold prefill",
        "zoo_block_bytes": payload_bytes, "rows": rows, "wall_s": time.perf_counter() - t0,
        "note": "random weights: the acceptance rate says little about real fine-tunes; tokens are exact in every mode",
    }  # fmt: skip
    ex.close()
    path = write_result("zoo_speculation", result, a.out)
    print(f"result: {path}")


if __name__ == "__main__":
    main()
