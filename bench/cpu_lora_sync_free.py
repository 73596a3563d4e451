"""Sync-free vs host-synchronised CPU LoRA invocation: the latency of one assisted prefill iteration.

CaraServe §4.2 / §7.4 (Fig. 16): the base process copies each layer's LoRA input to the host and
signals the CPU helpers; with PyTorch alone the launching thread synchronises before the signal,
which stalls the next kernel launches; a fused async-copy + signal op removes the sync (16% lower
latency per prefill iteration on an A10). Here: one cold prefill step (its adapter's ToGpu
deferred, the helpers computing its LoRA) of ``P`` prompt tokens, timed on the wall from the plan
to its sampled token, under both invocations of ``deltaserve.helpers`` (``CpuAssist.set_invocation``:
"signal" = ``csrc/cpu_lora_signal.cu`` and the watcher, "host" = a blocking copy, the J doorbell
and a host wait per module), interleaved per repetition; and the same step with the adapter
already on the GPU (no helpers) for scale. Llama-2-7B shape, random weights, one rank-``--rank``
adapter on q, k, v (CaraServe's), ``--helpers`` helper processes, policy ``always``.

    python3 -m bench.cpu_lora_sync_free [--prompts 128,256,512,1024] [--helpers 8] [--rank 64] [--reps 5]
    python3 -m bench.cpu_lora_sync_free --smoke      # a CPU check of the script (tiny shape)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from bench import script_env

script_env.prepare()

import torch  # noqa: E402

from bench.common import (  # noqa: E402
    SMOKE_SHAPE,
    device_name,
    shape_config,
    write_random_lora_dir,
    write_random_served_model,
    write_result,
)
from bench.plans import new_request  # noqa: E402
from deltaserve import wire  # noqa: E402
from deltaserve.worker.executor import Executor  # noqa: E402

QKV = ("q_proj", "k_proj", "v_proj")
ADAPTER = 1


class Cold:
    """Plans for one executor: a cold prefill of adapter 1 (ToGpu in the same plan), then its release
    and the adapter's eviction, so every timed step starts cold."""

    def __init__(self, ex: Executor, lora: Path) -> None:
        self.ex, self.step_id, self.req = ex, 0, 0
        info = ex.inspect_variant(str(lora))
        assert info.error is None, info.error
        self.pages = list(range(info.num_blocks))
        self.kv0 = info.num_blocks
        ex.step(self._plan(adapter_ops=[wire.VariantOp(ADAPTER, wire.TierOp.TO_HOST, str(lora), [])]))
        ex.cpu_assist.lora.wait_host(ADAPTER)  # the host copy is read: loads come from host memory

    def _plan(self, **kw) -> wire.StepPlan:
        self.step_id += 1
        return wire.StepPlan(step_id=self.step_id, **kw)

    def prefill_s(self, tokens: int, cold: bool) -> float:
        """Seconds of one prefill step of ``tokens`` tokens (adapter cold, or placed just before)."""
        ex = self.ex
        to_gpu = wire.VariantOp(ADAPTER, wire.TierOp.TO_GPU, "", self.pages)
        if not cold:
            ex.step(self._plan(adapter_ops=[to_gpu]))
        self.req += 1
        blocks = list(range(self.kv0, self.kv0 + -(-(tokens + 1) // ex.block_size)))
        ids = torch.randint(3, ex.config.vocab_size, (tokens,)).tolist()
        new = new_request(self.req, ids, blocks, adapter_id=ADAPTER)
        plan = self._plan(adapter_ops=[to_gpu] if cold else [], new_requests=[new])
        if ex.device.type == "cuda":
            torch.cuda.synchronize(ex.device)
        t0 = time.perf_counter()
        ex.step(plan)
        seconds = time.perf_counter() - t0
        drop = wire.VariantOp(ADAPTER, wire.TierOp.DROP_GPU, "", [])
        ex.step(self._plan(released=[self.req], adapter_ops=[drop]))
        return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama-2-7b")
    ap.add_argument("--layers", type=int, help="decoder layers (default: the shape's)")
    ap.add_argument("--prompts", default="128,256,512,1024")
    ap.add_argument("--helpers", type=int, default=8)
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--smoke", action="store_true", help="the tiny shape on the CPU, 2 helpers, 2 reps")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    prompts = [int(x) for x in a.prompts.split(",")]
    shape, device, dtype, helpers, reps = a.shape, a.device, "float16", a.helpers, a.reps
    if a.smoke:
        shape, device, dtype, helpers, reps, prompts = SMOKE_SHAPE, "cpu", "float32", 2, 2, [16, 32]
    elif not torch.cuda.is_available():
        raise SystemExit("cpu_lora_sync_free needs a CUDA device (or --smoke)")
    with tempfile.TemporaryDirectory(prefix="sync-free-") as tmp:
        model = write_random_served_model(shape, Path(tmp) / "model", a.layers)
        lora = write_random_lora_dir(Path(tmp) / "lora", shape_config(shape, a.layers), a.rank, QKV)
        ex = Executor(model, device=device, dtype=dtype, max_num_batched_tokens=max(prompts), max_deltas=0,
                      cpu_lora_helpers=helpers, cpu_lora_policy="always", max_lora_rank=a.rank,
                      kv_cache_bytes=(2 << 30) if device != "cpu" else (64 << 20))  # fmt: skip
        assist = ex.cpu_assist
        assert assist is not None
        invocations = ["signal", "host"] if (a.smoke or assist.sync_free) else ["host"]
        assist.pool.start()
        assist.pool.wait_ready(60.0)
        cold = Cold(ex, lora)
        times: dict[str, dict[int, list[float]]] = {k: {p: [] for p in prompts} for k in [*invocations, "gpu_resident"]}
        for p in prompts:
            for inv in invocations:  # warm-up: kernels compiled, helpers' pages touched
                assist.set_invocation(inv)
                cold.prefill_s(p, True)
            for _ in range(reps):
                for inv in invocations:
                    assist.set_invocation(inv)
                    before = assist.totals.assisted
                    s = cold.prefill_s(p, True)
                    if assist.totals.assisted > before:
                        times[inv][p].append(s)
                times["gpu_resident"][p].append(cold.prefill_s(p, False))
        stats = assist.totals
        ex.close()
    rows = []
    for p in prompts:
        row = {
            "prompt_tokens": p,
            **{f"{k}_ms": statistics.median(v[p]) * 1e3 if v[p] else None for k, v in times.items()},
        }
        if row.get("signal_ms") and row.get("host_ms"):
            row["signal_vs_host"] = row["signal_ms"] / row["host_ms"]
        rows.append(row)
        print(row, flush=True)
    payload = {
        "device": device_name(torch.device(device)), "shape": shape, "layers": a.layers or shape_config(shape)["num_hidden_layers"],
        "rank": a.rank, "targets": list(QKV), "helpers": helpers, "reps": reps, "dtype": dtype,
        "sync_free_available": "signal" in invocations, "assisted": stats.assisted, "fallbacks": stats.fallbacks,
        "declined": stats.declined, "rows": rows,
        "note": "wall time of one cold prefill step (plan to sampled token); median over reps; steps the "
                "helpers did not take are left out (assisted counts the kept ones)",
    }  # fmt: skip
    print(write_result("cpu_lora_sync_free", payload, a.out))


if __name__ == "__main__":
    main()
