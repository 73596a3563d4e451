"""The Triton prefill attention with split keys (``kernels.paged_attention.prefill_num_splits``)
inside whole steps: eager steps (tile tables built from ``ForwardBatch.host_q_lens``) and steps
through ``MixedGraphs``' static buffers (the bucket's rows, idle tile rows, ``tile_count``) give the
reference attention's tokens and, within float32 rounding, its logits. On the CPU under the Triton
interpreter with the GPU's split rule forced (a 64-SM device), prompts long enough that later
chunks attend over several key tiles. (Static and eager steps differ in their matmuls' row counts,
so their logits are compared with the reference, not with each other, bit for bit; GPU: replay vs
eager in ``tests/kernels/test_mixed_graphs_gpu.py``.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deltaserve.kernels import common as kernel_common
from deltaserve.kernels import paged_attention as pa
from helpers.executors import make_executor, prompts
from helpers.sched_driver import SchedDriver
from worker.test_mixed_graphs import static_steps

FAKE_SMS = 64
REQS = {i: (p, 3) for i, p in enumerate(prompts(4, 64, seed=7, lo=70, hi=110))}
ARRIVALS = {i: 3 * i for i in range(4)}


def _logged_run(ex) -> tuple[dict[int, list[int]], list[torch.Tensor]]:
    """Tokens of the run and the logits of every step, in order."""
    logits: list[torch.Tensor] = []
    forward = ex.runner.forward
    ex.runner.forward = lambda *a, **kw: logits.append(forward(*a, **kw).clone()) or logits[-1]
    tokens = SchedDriver(ex, max_num_batched_tokens=40).run(REQS, ARRIVALS)
    return tokens, logits


@pytest.fixture(scope="module")
def reference(tiny_llama: Path) -> tuple[dict[int, list[int]], list[torch.Tensor]]:
    """The run on the torch reference attention (the CPU's default backend)."""
    return _logged_run(make_executor(tiny_llama, max_lora_rank=0, max_model_len=256))


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_split_attention_steps_match_the_reference(tiny_llama: Path, reference, static: bool, monkeypatch) -> None:
    monkeypatch.setattr(kernel_common, "_backend", "triton")
    splits: list[int] = []

    def rule(q, kv_heads, block_q, interpreting):
        splits.append(pa.prefill_num_splits(q.shape[0], kv_heads, block_q, FAKE_SMS))
        return splits[-1]

    monkeypatch.setattr(pa, "_default_prefill_splits", rule)
    ex = make_executor(tiny_llama, max_lora_rank=0, max_model_len=256)
    mixed = static_steps(ex, 64, 4) if static else None
    tokens, logits = _logged_run(ex)
    want_tokens, want = reference
    assert max(splits) > 1, "prefill launches split keys"
    assert mixed is None or mixed.replays > 0, "steps ran through the static buffers"
    assert tokens == want_tokens
    assert len(logits) == len(want)
    for got, ref in zip(logits, want):
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
