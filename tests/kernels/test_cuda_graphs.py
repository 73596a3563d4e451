"""Decode steps replayed from CUDA graphs give exactly the tokens of eager steps (GPU only:
`make test-gpu`). Batch sizes cross bucket boundaries, so padding rows are exercised, and one
batch exceeds the largest graph, so the eager fallback is too."""

from __future__ import annotations

import os

import pytest
import torch
from worker.test_executor import MiniRouter, prompts

from deltaserve.worker.executor import Executor

pytestmark = [
    pytest.mark.gpu_graphs,  # `make test-gpu-graphs` selects it on a GPU
    pytest.mark.skipif(
        not (os.environ.get("DELTASERVE_TEST_GPU") == "1" and torch.cuda.is_available()),
        reason="CUDA graphs need a GPU (make test-gpu)",
    ),
]


def _executor(model_dir, graph_batch: int) -> Executor:
    return Executor(
        model_dir,
        device="cuda:0",
        dtype="float32",
        block_size=4,
        kv_cache_bytes=16 << 20,
        cuda_graph_max_batch=graph_batch,
    )


@pytest.mark.parametrize("n", [1, 3, 16, 17, 40])
def test_graph_replay_equals_eager(tiny_llama, n: int) -> None:
    eager, graphs = _executor(tiny_llama, 0), _executor(tiny_llama, 32)
    assert eager.graphs is None and graphs.graphs is not None
    assert graphs.num_blocks == graphs.kv.num_blocks - 1, "the scratch page is kept from the router"
    reqs = {i: (p, 12) for i, p in enumerate(prompts(n, graphs.config.vocab_size, seed=n))}
    assert MiniRouter(graphs).run(reqs) == MiniRouter(eager).run(reqs)
    if n <= 32:
        assert graphs.graphs.replays > 0, "decode steps should have been replayed from graphs"
    else:  # every decode step has 40 rows, beyond the largest graph: all eager
        assert graphs.graphs.replays == 0


def test_lora_decode_steps_replay_from_graphs_and_equal_eager(tiny_llama, tmp_path) -> None:
    """Decode steps with adapter rows (three adapters of different ranks and targets, plus base
    rows) replay the LoRA graphs and give exactly the eager tokens."""
    from worker.test_lora_serving import SPECS, AdapterRouter

    from helpers.peft_adapters import make_peft_adapter

    dirs = {
        aid: make_peft_adapter(tiny_llama, tmp_path / f"a{aid}", seed=10 + aid, **kw)[1] for aid, kw in SPECS.items()
    }
    eager, graphs = _executor(tiny_llama, 0), _executor(tiny_llama, 32)
    assert graphs.graphs is not None and graphs.graphs.lora_graphs, "LoRA graphs are captured"
    n = 12
    adapter_of = {i: i % 4 for i in range(n)}
    reqs = {i: (p, 10) for i, p in enumerate(prompts(n, graphs.config.vocab_size, seed=3))}
    want = AdapterRouter(eager, dirs, adapter_of).run(reqs)
    router = AdapterRouter(graphs, dirs, adapter_of)
    assert router.run(reqs) == want
    assert router.adapter_decode_steps > 0 and graphs.graphs.replays >= router.adapter_decode_steps


def test_lora_graphs_with_and_without_overlap_equal_eager(tiny_llama, tmp_path) -> None:
    """LoRA decode graphs captured with the overlap (each module's shrinks on a side stream beside
    its base matmul: two branches per module in the graph) and without it give exactly the eager
    tokens."""
    from worker.test_lora_serving import SPECS, AdapterRouter

    from deltaserve.kernels import lora as lora_kernels
    from helpers.peft_adapters import make_peft_adapter

    dirs = {
        aid: make_peft_adapter(tiny_llama, tmp_path / f"a{aid}", seed=20 + aid, **kw)[1] for aid, kw in SPECS.items()
    }
    n = 12
    adapter_of = {i: i % 4 for i in range(n)}
    eager = _executor(tiny_llama, 0)
    reqs = {i: (p, 10) for i, p in enumerate(prompts(n, eager.config.vocab_size, seed=5))}
    want = AdapterRouter(eager, dirs, adapter_of).run(reqs)
    previous = lora_kernels.get_overlap()
    try:
        for on in (True, False):
            lora_kernels.set_overlap(on)  # graphs keep what they were captured with
            graphs = _executor(tiny_llama, 32)
            router = AdapterRouter(graphs, dirs, adapter_of)
            assert router.run(reqs) == want, f"overlap {on}"
            assert router.adapter_decode_steps > 0 and graphs.graphs.replays >= router.adapter_decode_steps
    finally:
        lora_kernels.set_overlap(previous)


@pytest.mark.parametrize("arch", ["llama", "llama-tied", "qwen2"])
def test_delta_decode_steps_replay_from_graphs_and_equal_eager(arch: str, tmp_path, monkeypatch) -> None:
    """Decode steps with rows of two compressed deltas of different packed configs (4-bit and 2-bit
    2:4), a LoRA adapter and the base replay delta graphs (one per
    config set) and give exactly the eager tokens: the SBMM tiles, the embedding / norm / bias gathers
    and the lm_head delta all read the static buffers. A model the CUDA SBMM op takes (in_features a
    multiple of 256), float16; tied embeddings (the embedding delta moves lm_head) and Qwen2 (bias
    deltas). Two ids of one delta directory share every block (held once, per-piece block slots in the
    graph's buffers). The prompts' mixed steps replay graphs too, with the dense lane off: one delta's
    short prompts (under 64 tokens each, so SBMM tiles in the eager step) can fill a bucket's lane, whose
    one cuBLAS matmul sums in another order, and these random weights' near-ties then flip (the lane's
    tokens are checked in tests/kernels/test_mixed_graphs_gpu.py)."""
    from worker.test_lora_serving import AdapterRouter

    from deltaserve.adapters import delta_graphs
    from helpers.deltas import make_delta
    from helpers.peft_adapters import make_peft_adapter
    from helpers.tiny_models import make_tiny_model

    kw = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
    if arch == "llama-tied":
        kw["tie_word_embeddings"] = True
    base = make_tiny_model(tmp_path, "qwen2" if arch == "qwen2" else "llama", seed=5, **kw)
    dirs = {
        1: make_peft_adapter(base, tmp_path / "lora", seed=3, target_modules=["q_proj", "v_proj"], r=8, lora_alpha=16)[
            1
        ],
        2: make_delta(base, tmp_path / "d4", seed=21, bits=4)[0],
        3: make_delta(base, tmp_path / "d2", seed=22, bits=2)[0],
    }
    dirs[4] = dirs[2]  # the same payload file under another id: every piece shared (``delta_blocks``)

    def executor(graph_batch: int) -> Executor:
        return Executor(
            base,
            device="cuda:0",
            dtype="float16",
            block_size=4,
            kv_cache_bytes=16 << 20,
            cuda_graph_max_batch=graph_batch,
        )

    monkeypatch.setattr(delta_graphs, "DENSE_LANE_BASE_TOKENS", 1 << 20)
    n = 14
    seen: set = set()
    for adapter_of in (
        {i: (0, 1, 2, 3)[i % 4] for i in range(n)},  # every kind in one batch
        {i: 2 for i in range(n)},  # one delta, more rows than a graph work tile
        {i: (2, 4, 3)[i % 3] for i in range(n)},  # two ids holding the same blocks once, one group per piece
    ):
        eager, graphs = executor(0), executor(32)
        reqs = {i: (p, 10) for i, p in enumerate(prompts(n, graphs.config.vocab_size, seed=7))}
        want = AdapterRouter(eager, dirs, adapter_of).run(reqs)
        got = AdapterRouter(graphs, dirs, adapter_of).run(reqs)
        assert got == want
        assert graphs.graphs.replays > 0 and graphs.graphs.delta_graphs, "decode steps with deltas should replay graphs"
        seen |= set(graphs.graphs.delta_graphs)
    keys = {k for _, _, k in seen}
    assert ((2, True, 64), (4, True, 64)) in keys and ((4, True, 64),) in keys, keys
    assert any(lora for _, lora, _ in seen), "the mixed steps had LoRA rows"
