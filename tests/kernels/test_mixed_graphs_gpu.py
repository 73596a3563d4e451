"""Prefill and mixed steps replayed from token-bucket CUDA graphs (``worker/mixed_graphs.py``) give
exactly the tokens of eager steps (GPU only: `make test-gpu-graphs`). Chunked prefills next to decodes
cross bucket boundaries (padding tokens and sequences), steps beyond the largest bucket run eagerly,
LoRA rows of two adapters and the base share steps, and the pipelined run (each step launched before
the one before is finished) patches in-flight tokens into the graph's inputs."""

from __future__ import annotations

import os

import pytest
import torch
from worker.test_executor import MiniRouter, prompts

from deltaserve.worker.executor import Executor

pytestmark = [
    pytest.mark.gpu_graphs,
    pytest.mark.skipif(
        not (os.environ.get("DELTASERVE_TEST_GPU") == "1" and torch.cuda.is_available()),
        reason="CUDA graphs need a GPU (make test-gpu)",
    ),
]


def _executor(model_dir, graphs: bool, dtype: str = "float32") -> Executor:
    return Executor(
        model_dir,
        device="cuda:0",
        dtype=dtype,
        block_size=4,
        kv_cache_bytes=16 << 20,
        cuda_graph_max_batch=16 if graphs else 0,
        cuda_graph_max_tokens=64 if graphs else 0,
    )


def _run(ex, reqs, arrivals, variants=None, adapter_of=None, pipelined=False, max_num_batched_tokens=80):
    router = MiniRouter(ex, variants, adapter_of, max_num_batched_tokens=max_num_batched_tokens)
    return (router.run_pipelined if pipelined else router.run)(reqs, arrivals)


@pytest.mark.parametrize("pipelined", [False, True])
def test_mixed_steps_replay_and_equal_eager(tiny_llama, pipelined: bool) -> None:
    n = 20
    reqs = {i: (p, 8) for i, p in enumerate(prompts(n, 500, seed=n, lo=1, hi=60))}
    arrivals = {i: i // 2 for i in range(n)}
    eager, graphs = _executor(tiny_llama, False), _executor(tiny_llama, True)
    assert eager.runner.mixed is None and graphs.runner.mixed is not None
    want = _run(eager, reqs, arrivals, pipelined=pipelined)
    eager_steps = []  # a replay calls no forward: these are the steps that ran eagerly
    forward = graphs.model.forward
    graphs.model.forward = lambda batch, kv: (
        eager_steps.append((batch.num_tokens, batch.num_seqs)) or forward(batch, kv)
    )
    assert _run(graphs, reqs, arrivals, pipelined=pipelined) == want
    assert graphs.runner.mixed.replays > 0, "prefill and mixed steps should replay graphs"
    assert eager_steps, "the token budget (80) forms steps beyond the largest bucket (64)"
    assert all(t > 64 or s > 16 for t, s in eager_steps), f"only steps beyond the bounds run eagerly: {eager_steps}"


def test_long_prompt_chunks_split_attention_in_replay_and_eager(tiny_llama) -> None:
    """Chunks of 150-400-token prompts attend over several 64-key tiles, so small steps split their
    keys (``kernels.paged_attention.prefill_num_splits``) in the graphs and in the eager steps alike:
    the tokens match."""
    n = 6
    reqs = {i: (p, 6) for i, p in enumerate(prompts(n, 500, seed=5, lo=150, hi=400))}
    arrivals = {i: i for i in range(n)}
    eager, graphs = _executor(tiny_llama, False), _executor(tiny_llama, True)
    want = _run(eager, reqs, arrivals)
    assert _run(graphs, reqs, arrivals) == want
    assert graphs.runner.mixed.replays > 0


@pytest.fixture(scope="module")
def lora_dirs(tiny_llama, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Two PEFT adapters of different ranks and targets (q/v at rank 8; all seven at rank 16)."""
    pytest.importorskip("peft")
    from helpers.peft_adapters import SEVEN, make_peft_adapter

    root = tmp_path_factory.mktemp("mixed_graphs_gpu")
    return {
        1: make_peft_adapter(tiny_llama, root / "a1", seed=11, target_modules=["q_proj", "v_proj"], r=8)[1],
        2: make_peft_adapter(tiny_llama, root / "a2", seed=12, target_modules=SEVEN, r=16, lora_alpha=8)[1],
    }


def test_lora_mixed_steps_replay_and_equal_eager(tiny_llama, lora_dirs) -> None:
    n = 12
    reqs = {i: (p, 6) for i, p in enumerate(prompts(n, 500, seed=3, lo=2, hi=40))}
    arrivals = {i: i // 2 for i in range(n)}
    adapter_of = {i: i % 3 for i in range(n)}
    eager, graphs = _executor(tiny_llama, False), _executor(tiny_llama, True)
    assert graphs.runner.mixed is not None and graphs.runner.mixed.lora_graphs, "LoRA graphs are captured"
    want = _run(eager, reqs, arrivals, lora_dirs, adapter_of)
    assert _run(graphs, reqs, arrivals, lora_dirs, adapter_of) == want
    assert graphs.runner.mixed.lora_replays > 0, "steps with LoRA rows should replay the LoRA graphs"


def test_lora_steps_without_adapter_rows_replay_the_chunk_only_graphs(tiny_llama, lora_dirs) -> None:
    """Lone prompts of adapters, and adapters' chunks next to base decodes, replay the LoRA graphs
    captured without the MBGMV row list; steps with adapters' decode rows the full ones: the eager
    tokens either way."""
    reqs = {i: (p, k) for i, (p, k) in enumerate(zip(prompts(6, 500, seed=8, lo=5, hi=40), (2, 8, 2, 3, 2, 2)))}
    arrivals = {0: 0, 1: 4, 2: 6, 3: 7, 4: 20, 5: 24}
    adapter_of = {0: 2, 1: 0, 2: 1, 3: 2, 4: 1, 5: 2}
    eager, graphs = _executor(tiny_llama, False), _executor(tiny_llama, True)
    mixed = graphs.runner.mixed
    assert mixed is not None and mixed.chunk_lora_graphs, "chunk-only LoRA graphs are captured"
    want = _run(eager, reqs, arrivals, lora_dirs, adapter_of)
    assert _run(graphs, reqs, arrivals, lora_dirs, adapter_of) == want
    assert mixed.chunk_lora_replays >= 3 and mixed.lora_replays > mixed.chunk_lora_replays


@pytest.mark.parametrize(("pipelined", "lane"), [(False, False), (True, False), (False, True)])
def test_delta_mixed_steps_replay_and_equal_eager(tmp_path, pipelined: bool, lane: bool, monkeypatch) -> None:
    """Prefill chunks and decodes of two compressed deltas of different packed configs (4-bit and 2-bit
    2:4), a LoRA adapter and the base share steps: steps of at most 64 tokens replay delta graphs
    (one per delta bucket, configs and LoRA: each config's own at its registration, the rest at the first
    such step) whose SBMM tiles, gathers
    and lm_head delta read the delta pool's mixed-step buffers, and give exactly the eager tokens
    (whose long prompts ran as dense segments). A model the CUDA SBMM op takes, float16. ``lane``: the
    dense lane's threshold lowered to these prompts (a third of the bucket), so the delta with the most
    tokens of a step runs in the graph's dense lane (dequantised from device-side offsets, one masked
    matmul) beside the other's tiles."""
    from deltaserve.adapters import delta_graphs
    from helpers.deltas import make_delta
    from helpers.peft_adapters import make_peft_adapter
    from helpers.tiny_models import make_tiny_model

    kw = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
    base = make_tiny_model(tmp_path, "llama", seed=5, **kw)
    dirs = {
        1: make_peft_adapter(base, tmp_path / "lora", seed=3, target_modules=["q_proj", "v_proj"], r=8)[1],
        2: make_delta(base, tmp_path / "d4", seed=21, bits=4)[0],
        3: make_delta(base, tmp_path / "d2", seed=22, bits=2)[0],
    }
    n = 12
    reqs = {i: (p, 6) for i, p in enumerate(prompts(n, 500, seed=4, lo=2, hi=70))}
    arrivals = {i: i // 2 for i in range(n)}
    adapter_of = {i: (2, 3, 1, 0, 2)[i % 5] for i in range(n)}
    if lane:
        monkeypatch.setattr(delta_graphs, "DENSE_LANE_BASE_TOKENS", 0)
    eager, graphs = _executor(base, False, "float16"), _executor(base, True, "float16")
    pool = graphs.delta_pool
    assert pool is not None
    lanes = set()  # the configs of the deltas that ran in a dense lane
    fill = pool.fill_mixed_rows

    def fill_mixed_rows(token_ids, logit_ids, keys, dense_lane=None):
        if dense_lane is not None:
            lanes.add(pool.key_of[dense_lane])
        return fill(token_ids, logit_ids, keys, dense_lane)

    pool.fill_mixed_rows = fill_mixed_rows  # type: ignore[method-assign]
    chunk = 40 if lane else 80  # 40: prompts come in chunks, so steps of <= 64 tokens hold long delta runs
    want = _run(eager, reqs, arrivals, dirs, adapter_of, pipelined=pipelined, max_num_batched_tokens=chunk)
    got = _run(graphs, reqs, arrivals, dirs, adapter_of, pipelined=pipelined, max_num_batched_tokens=chunk)
    _assert_tokens(got, want, lane)
    mixed = graphs.runner.mixed
    assert mixed is not None and mixed.delta_replays > 0, "steps with delta rows should replay delta graphs"
    configs = [{*k, *([lane_key] if lane_key else [])} for _, _, k, lane_key in mixed.delta_graphs]
    assert any(len(c) == 2 for c in configs), f"a step with both packed configs replayed: {configs}"
    assert any(lora for _, lora, _, _ in mixed.delta_graphs), "a step with LoRA and delta rows replayed"
    if lane:
        assert mixed.lane_replays > 0 and len(lanes) == 2, f"both configs took the lane: {lanes}"
    else:
        assert mixed.lane_replays == 0 and not lanes, "these prompts are too short for the lane"


def _assert_tokens(got: dict[int, list[int]], want: dict[int, list[int]], lane: bool) -> None:
    """The replayed run's tokens are the eager run's; with the dense lane's threshold lowered to runs of
    10-40 tokens, but for one request's second half: the lane's sums (one cuBLAS matmul over the masked
    bucket) are not the eager step's (SBMM work tiles: the eager step runs segments of < 64 tokens there),
    so a near-tie of these random models' logits may flip late; a wrong slot or mask changes most tokens.
    (CPU: the lane gives the eager tokens exactly, tests/worker/test_mixed_graphs.py.)"""
    if not lane:
        assert got == want
        return
    late = {i: next(k for k, (a, b) in enumerate(zip(got[i], want[i])) if a != b) for i in want if got[i] != want[i]}
    assert len(late) <= 1 and all(k >= len(want[i]) // 2 for i, k in late.items()), (late, got, want)


@pytest.mark.parametrize("lane", [False, True])
def test_delta_graphs_are_captured_at_registration(tmp_path, lane: bool, monkeypatch) -> None:
    """Registering (inspecting) the first delta of a packed config captures that config's delta graphs
    (``Executor._capture_delta_config``): the decode graph of every batch bucket and the mixed-step graphs
    of every delta bucket (``MixedGraphs.config_variants``, with the dense lanes where a bucket holds one).
    Serving two deltas of that config beside the base then captures nothing and gives the eager tokens;
    ``lane``: the lane's threshold lowered, so lane graphs captured before any delta was resident (slot
    0's offsets) replay with each step's own."""
    from deltaserve.adapters import delta_graphs
    from helpers.deltas import make_delta
    from helpers.tiny_models import make_tiny_model

    kw = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
    base = make_tiny_model(tmp_path, "llama", seed=5, **kw)
    dirs = {2: make_delta(base, tmp_path / "a", seed=21)[0], 3: make_delta(base, tmp_path / "b", seed=23)[0]}
    n = 10
    reqs = {i: (p, 6) for i, p in enumerate(prompts(n, 500, seed=7, lo=2, hi=70))}
    arrivals = {i: i // 2 for i in range(n)}
    adapter_of = {i: (2, 3, 0)[i % 3] for i in range(n)}
    if lane:
        monkeypatch.setattr(delta_graphs, "DENSE_LANE_BASE_TOKENS", 0)
    eager, graphs = _executor(base, False, "float16"), _executor(base, True, "float16")
    want = _run(eager, reqs, arrivals, dirs, adapter_of, max_num_batched_tokens=40)
    router = MiniRouter(graphs, dirs, adapter_of, max_num_batched_tokens=40)  # inspects both deltas
    decode, mixed, pool = graphs.graphs, graphs.runner.mixed, graphs.delta_pool
    assert decode is not None and mixed is not None and pool is not None and not pool.slot_of
    key = pool.config_key(dirs[2])
    assert set(decode.delta_graphs) == {(b, False, (key,)) for b in decode.graphs}
    assert set(mixed.delta_graphs) == set(mixed.config_variants(key))
    assert any(lane_key is not None for *_, lane_key in mixed.delta_graphs) == lane
    captured = (dict(decode.delta_graphs), dict(mixed.delta_graphs))
    _assert_tokens(router.run(reqs, arrivals), want, lane)
    assert (decode.delta_graphs, mixed.delta_graphs) == captured, "no graph captured while serving"
    assert mixed.delta_replays > 0 and (mixed.lane_replays > 0) == lane
