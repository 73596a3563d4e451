"""Prefill and mixed steps through ``MixedGraphs``' static buffers (``worker/mixed_graphs.py``) give the
tokens of today's eager path, on the CPU with capture off: the same padding, bucket choice, sequence
and tile tables and LoRA segment tables a replayed graph reads, run as one eager forward. Steps
beyond the largest bucket or with more sequences than its bound still run eagerly, and padding
tokens write their K/V only to the scratch page. (GPU: replay vs eager in
``tests/kernels/test_mixed_graphs_gpu.py``.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deltaserve import wire
from deltaserve.adapters.variants import StepRows
from deltaserve.kernels import common as kernel_common
from deltaserve.kernels.lora import LoraMeta
from deltaserve.model import ForwardBatch
from deltaserve.worker.mixed_graphs import (
    DELTA_MAX_TOKENS_ENV,
    MAX_TOKENS_ENV,
    MixedGraphs,
    delta_max_tokens_from_env,
    max_tokens_from_env,
    token_buckets_up_to,
)
from deltaserve.worker.plan_check import PlanLimits
from helpers.executors import make_executor, prompts
from helpers.sched_driver import SchedDriver


def static_steps(ex, max_tokens: int, max_seqs: int, max_delta_tokens: int | None = None) -> MixedGraphs:
    """Gives a CPU executor ``MixedGraphs(capture=False)`` and, as with graphs on CUDA, keeps its last
    page from the router for the padding tokens' K/V."""
    ex.num_blocks -= 1
    ex.max_model_len = min(ex.max_model_len, ex.num_blocks * ex.block_size)
    ex.limits = PlanLimits(ex.config.vocab_size, ex.num_blocks, ex.block_size, ex.max_model_len)
    mixed = MixedGraphs(
        ex.model,
        ex.kv,
        max_tokens,
        max_seqs,
        ex.max_model_len,
        scratch_slot=ex.num_blocks * ex.block_size,
        lora=ex.lora_pool,
        capture=False,
        deltas=ex.delta_pool,
        max_delta_tokens=max_delta_tokens,
    )
    ex.runner.mixed = mixed
    return mixed


def _run(ex, reqs, arrivals, variants=None, adapter_of=None, **driver) -> dict[int, list[int]]:
    return SchedDriver(ex, variants, adapter_of, max_num_batched_tokens=40, **driver).run(reqs, arrivals)


def test_buckets() -> None:
    assert token_buckets_up_to(0) == []
    assert token_buckets_up_to(100) == [16, 32, 48, 64, 96, 100]
    assert token_buckets_up_to(512)[-2:] == [448, 512]
    # From 256 tokens to 2,048 a step pads by at most 20 % (the dense matmuls are compute-bound there).
    sizes = token_buckets_up_to(4096)
    assert all((b - a) / b <= 0.2 for a, b in zip(sizes, sizes[1:]) if a >= 256 and b <= 2048)


def test_config_variants_cover_each_delta_bucket_and_its_lanes(executor_factory) -> None:
    """What the executor captures when the first delta of a packed config is registered
    (``MixedGraphs.capture_config``): each delta bucket's work tiles for the config alone, and the lane
    beside them and alone in every bucket that can hold a dense lane; nothing with capture off."""
    from deltaserve.adapters.delta_graphs import dense_lane_tokens

    mixed = static_steps(executor_factory(), 512, 16, max_delta_tokens=512)
    key = (4, True, 64)
    got = mixed.config_variants(key)
    assert len(got) == len(set(got))
    assert [v for v in got if v[3] is None] == [(tb, False, (key,), None) for tb in mixed.delta_sizes]
    lanes = sorted({tb for tb, _, _, lane in got if lane is not None})
    assert lanes == [tb for tb in mixed.delta_sizes if dense_lane_tokens(tb) <= tb] == [128, 256, 384, 512]
    assert sorted(v for v in got if v[3] is not None) == sorted(
        (tb, False, keys, key) for tb in lanes for keys in ((key,), ())
    )
    assert mixed.capture_config(key) == 0 and not mixed.delta_graphs, "capture off (CPU): nothing captured"


def test_the_largest_delta_bucket_is_what_the_hello_tells_the_router(tiny_llama: Path) -> None:
    """``Hello.delta_graph_tokens``: the most tokens a step with delta rows replays with, the largest
    delta bucket (at most the largest bucket of all); 0 without delta buckets or a delta pool."""
    mixed = static_steps(make_executor(tiny_llama, max_deltas=2), 2048, 16, max_delta_tokens=512)
    assert mixed.delta_graph_tokens == mixed.delta_sizes[-1] == 512
    assert (
        static_steps(make_executor(tiny_llama, max_deltas=2), 300, 16, max_delta_tokens=512).delta_graph_tokens == 300
    )
    assert static_steps(make_executor(tiny_llama, max_deltas=2), 2048, 16, max_delta_tokens=0).delta_graph_tokens == 0
    assert static_steps(make_executor(tiny_llama, max_deltas=0), 2048, 16, max_delta_tokens=512).delta_graph_tokens == 0


def test_graph_token_limits_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """``DELTASERVE_CUDA_GRAPH_MAX_TOKENS`` and ``DELTASERVE_CUDA_GRAPH_MAX_DELTA_TOKENS``: defaults 2048
    and 512, 0 turns the graphs off (for delta rows: such steps run eagerly), a bad value stops the worker."""
    for name in (MAX_TOKENS_ENV, DELTA_MAX_TOKENS_ENV):
        monkeypatch.delenv(name, raising=False)
    assert (max_tokens_from_env(), delta_max_tokens_from_env()) == (2048, 512)
    monkeypatch.setenv(DELTA_MAX_TOKENS_ENV, " 0 ")
    assert delta_max_tokens_from_env() == 0
    monkeypatch.setenv(DELTA_MAX_TOKENS_ENV, "1024")
    assert delta_max_tokens_from_env() == 1024
    for bad, why in (("lots", "want a token count 0..4096"), ("-1", "want 0..4096"), ("5000", "want 0..4096")):
        monkeypatch.setenv(DELTA_MAX_TOKENS_ENV, bad)
        with pytest.raises(ValueError, match=f"{DELTA_MAX_TOKENS_ENV}=.*{why}"):
            delta_max_tokens_from_env()


def test_static_steps_give_eager_tokens(tiny_llama: Path) -> None:
    """Chunked prefills next to decodes (token budget 40 > the largest bucket 16, so some steps run
    eagerly), staggered arrivals: every step of at most 16 tokens and 4 sequences goes through the
    static buffers, and every request gets the eager path's tokens."""
    n = 5
    reqs = {i: (p, 3) for i, p in enumerate(prompts(n, 64, seed=4, lo=1, hi=30))}
    arrivals = {i: 2 * i for i in range(n)}
    want = _run(make_executor(tiny_llama, max_lora_rank=0, max_model_len=128), reqs, arrivals)
    ex = make_executor(tiny_llama, max_lora_rank=0, max_model_len=128)
    mixed = static_steps(ex, 16, 4)
    calls = []
    eager = ex.runner.model.forward
    ex.runner.model.forward = lambda batch, kv: calls.append(batch.attn_tiles is not None) or eager(batch, kv)
    assert _run(ex, reqs, arrivals) == want
    assert mixed.replays == sum(calls) > 0, "steps ran through the static buffers"
    assert not all(calls), "steps beyond the largest bucket or its sequences ran eagerly"


@pytest.fixture(scope="module")
def lora_dirs(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    pytest.importorskip("peft")
    from helpers.peft_adapters import SEVEN, make_peft_adapter

    root = tmp_path_factory.mktemp("mixed_graphs")
    return {
        1: make_peft_adapter(tiny_llama, root / "a1", seed=11, target_modules=["q_proj", "v_proj"], r=8)[1],
        2: make_peft_adapter(tiny_llama, root / "a2", seed=12, target_modules=SEVEN, r=16, lora_alpha=8)[1],
    }


def test_static_steps_with_lora_rows_give_eager_tokens(tiny_llama: Path, lora_dirs: dict[int, Path]) -> None:
    """Prefill chunks and decodes of two adapters and the base in the same steps (SGMV over the static
    segment and tile tables, MBGMV over the static row list, the pool's slots) give the eager tokens;
    eager and static steps lay their LoRA rows out as ``LoraMeta.mixed_step`` does."""
    n = 5
    reqs = {i: (p, 2) for i, p in enumerate(prompts(n, 64, seed=5, lo=3, hi=24))}
    arrivals = {i: i for i in range(n)}
    adapter_of = {i: i % 3 for i in range(n)}
    eager_ex = make_executor(tiny_llama, max_model_len=128)
    eager_metas = recorded_lora_metas(eager_ex)
    want = _run(eager_ex, reqs, arrivals, lora_dirs, adapter_of)
    ex = make_executor(tiny_llama, max_model_len=128)
    mixed = static_steps(ex, 64, 8)
    static_metas = recorded_lora_metas(ex)
    assert _run(ex, reqs, arrivals, lora_dirs, adapter_of) == want
    assert mixed.replays > 0
    # Eager and static steps alike: decode rows on MBGMV, chunks on SGMV, laid out as LoraMeta.mixed_step does.
    for metas in (eager_metas, static_metas):
        assert any(rows and tiles for (rows, tiles), _ in metas), "mixed steps with LoRA decode rows ran"
        for got, want_tables in metas:
            assert got == want_tables


def test_steps_without_adapter_rows_skip_the_row_list(
    tiny_llama: Path, lora_dirs: dict[int, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Steps whose one-token sequences have no adapter (a lone prompt of an adapter; an adapter's chunk
    next to a base decode) run the chunk-only LoRA metadata (no MBGMV row list: the graph without
    the row kernels) and give the eager tokens; a step with an adapter's decode row keeps the list.
    The Triton kernels run (interpreted): they read the tiles and rows, where the torch reference
    reads every segment and would hide a dropped row."""
    monkeypatch.setattr(kernel_common, "_backend", "triton")
    reqs = {i: (p, k) for i, (p, k) in enumerate(zip(prompts(4, 64, seed=9, lo=5, hi=20), (2, 6, 2, 3)))}
    arrivals = {0: 0, 1: 4, 2: 6, 3: 7}  # 0 alone; 2's chunk beside 1's base decodes; 3 beside 2's decode
    adapter_of = {0: 2, 1: 0, 2: 1, 3: 2}
    want = _run(make_executor(tiny_llama, max_model_len=128), reqs, arrivals, lora_dirs, adapter_of)
    ex = make_executor(tiny_llama, max_model_len=128)
    mixed = static_steps(ex, 64, 8)
    metas: list[LoraMeta] = []
    forward = ex.runner.model.forward
    ex.runner.model.forward = lambda batch, kv: metas.append(ex.lora_pool.step.meta) or forward(batch, kv)
    assert _run(ex, reqs, arrivals, lora_dirs, adapter_of) == want
    chunk_only = [m for m in metas if m is not None and not m.decode and m.rows is None]
    assert mixed.chunk_lora_replays == len(chunk_only) >= 2, "the lone prompt and the chunk beside a base decode"
    assert mixed.lora_replays > mixed.chunk_lora_replays, "the step with an adapter's decode row keeps the list"
    assert all(m.num_rows == 0 and m.tiles is not None for m in chunk_only)


@pytest.fixture(scope="module")
def delta_dirs(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    from helpers.deltas import make_delta

    root = tmp_path_factory.mktemp("mixed_graph_deltas")
    return {
        3: make_delta(tiny_llama, root / "d4", seed=21, bits=4)[0],
        4: make_delta(tiny_llama, root / "d2", seed=22, bits=2)[0],
    }


@pytest.fixture(scope="module")
def delta_workload(tiny_llama: Path, lora_dirs: dict[int, Path], delta_dirs: dict[int, Path]) -> tuple:
    """Six requests of two compressed deltas (4-bit and 2-bit: two packed configs), a LoRA adapter and the
    base, and their eager tokens: (requests, arrivals, variant dirs, variant of each request, tokens)."""
    n = 6
    reqs = {i: (p, 3) for i, p in enumerate(prompts(n, 64, seed=6, lo=3, hi=40))}
    arrivals = {i: i for i in range(n)}
    adapter_of = {i: (3, 4, 1, 0)[i % 4] for i in range(n)}
    variants = {**lora_dirs, **delta_dirs}
    want = _run(make_executor(tiny_llama, max_model_len=128, max_deltas=2), reqs, arrivals, variants, adapter_of)
    return reqs, arrivals, variants, adapter_of, want


def _delta_step_tokens(ex) -> tuple[list[tuple[int, int]], list[int]]:
    """Records the executor's steps with delta rows: (token rows, logits rows) of each that went through
    the static buffers, and the tokens of each that ran eagerly."""
    token_rows: list[tuple[int, int]] = []
    eager_tokens: list[int] = []
    forward = ex.runner.model.forward

    def recording(batch, kv):
        step = ex.delta_pool.step
        if step.active and batch.attn_tiles is not None:  # a static-buffer step with delta rows
            assert step.token_index is not None and step.logit_index is not None
            token_rows.append((step.token_index.shape[0], step.logit_index.shape[0]))
        elif step.active:
            eager_tokens.append(batch.num_tokens)
        return forward(batch, kv)

    ex.runner.model.forward = recording
    return token_rows, eager_tokens


def test_static_steps_with_delta_rows_give_eager_tokens(
    tiny_llama: Path, delta_dirs: dict[int, Path], delta_workload: tuple
) -> None:
    """Prefill chunks and decodes of two compressed deltas (4-bit and 2-bit: two packed configs), a LoRA
    adapter and the base in the same steps go through the static buffers with every token a row of the
    SBMM metadata and the logits rows their own (``DeltaPool.begin_step`` over token rows, what the
    captured step's buffers hold) and give the eager tokens, whose deltas' prompts ran as segments.
    The scheduler keeps the prompt chunks of steps with delta rows within the largest delta bucket (32
    tokens here; ``Hello.delta_graph_tokens``), so none runs eagerly; a scheduler told no limit makes
    steps beyond it, which run eagerly, with the same tokens."""
    reqs, arrivals, variants, adapter_of, want = delta_workload
    base = _run(make_executor(tiny_llama, max_model_len=128), reqs, arrivals)
    assert any(want[i] != base[i] for i in want if adapter_of[i] in delta_dirs), "the deltas change tokens"
    ex = make_executor(tiny_llama, max_model_len=128, max_deltas=2)
    mixed = static_steps(ex, 32, 8)
    assert mixed.delta_sizes == [32] and ex.hello(wire.SCHEMA_HASH).delta_graph_tokens == 32
    token_rows, eager_tokens = _delta_step_tokens(ex)
    assert _run(ex, reqs, arrivals, variants, adapter_of) == want
    assert mixed.delta_replays == len(token_rows) > 0, "steps with delta rows went through the static buffers"
    assert all(t == 32 and r == 8 for t, r in token_rows), "every token of the bucket a row; a logits row per sequence"
    assert mixed.lora_replays > 0
    assert not eager_tokens, f"steps with delta rows beyond the delta graphs: {eager_tokens}"

    # A scheduler without the limit (its 40-token budget): steps beyond the delta bucket run eagerly.
    unlimited = make_executor(tiny_llama, max_model_len=128, max_deltas=2)
    static_steps(unlimited, 32, 8)
    _, eager_tokens = _delta_step_tokens(unlimited)
    assert _run(unlimited, reqs, arrivals, variants, adapter_of, delta_graph_tokens=0) == want
    assert eager_tokens and all(t > 32 for t in eager_tokens), f"only steps beyond the delta bucket: {eager_tokens}"

    # DELTASERVE_CUDA_GRAPH_MAX_DELTA_TOKENS=0: every step with delta rows runs eagerly, the same tokens.
    off = make_executor(tiny_llama, max_model_len=128, max_deltas=2)
    no_deltas = static_steps(off, 32, 8, max_delta_tokens=0)
    assert no_deltas.delta_sizes == [] and off.hello(wire.SCHEMA_HASH).delta_graph_tokens == 0
    assert _run(off, reqs, arrivals, variants, adapter_of) == want
    assert no_deltas.delta_replays == 0 and no_deltas.replays == 0, "every step of this run has delta rows"


def test_static_steps_with_a_dense_lane_give_eager_tokens(
    tiny_llama: Path, delta_workload: tuple, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the dense lane's threshold lowered to a tiny model's prompts (``dense_lane_tokens``: 10 tokens
    of a 32-token bucket), the delta with the most tokens of a step runs in the lane (its delta
    dequantised from offsets on the device, one masked matmul over the bucket; its tokens in no work
    tile) beside the other delta's tiles, LoRA rows and base rows, and the tokens are the eager ones."""
    from deltaserve.adapters import delta_graphs

    reqs, arrivals, variants, adapter_of, want = delta_workload
    monkeypatch.setattr(delta_graphs, "DENSE_LANE_BASE_TOKENS", 0)
    assert delta_graphs.dense_lane_tokens(32) == 10
    ex = make_executor(tiny_llama, max_model_len=128, max_deltas=2)
    mixed = static_steps(ex, 32, 8)
    lanes: list[tuple[int, int]] = []  # (lane rows, the lane delta's rows left on the work tiles)
    forward = ex.runner.model.forward

    def recording(batch, kv):
        step = ex.delta_pool.step
        lane = step.dense_lane
        if lane is not None:
            on_tiles = {s for metas in step.piece_metas for _, meta in metas for s, _ in meta.slot_tokens}
            lane_slot = step.token_index[~lane.others[:, 0]].unique().tolist()
            assert len(lane_slot) == 1, lane_slot
            lanes.append((int((~lane.others).sum()), int(lane_slot[0] - 1 in on_tiles)))
        return forward(batch, kv)

    ex.runner.model.forward = recording
    assert _run(ex, reqs, arrivals, variants, adapter_of) == want
    assert mixed.lane_replays == len(lanes) > 0 and mixed.delta_replays > mixed.lane_replays
    assert all(rows >= 10 and not left for rows, left in lanes), lanes


def recorded_lora_metas(ex) -> list[tuple[tuple[list, list], tuple[list, list]]]:
    """Per forward ``ex`` runs with adapter rows (filled as they run, decode steps left out): what
    its LoRA metadata holds (static buffers, refilled by the next step) and what
    ``LoraMeta.mixed_step`` lays out for the same segments (``meta_tables``)."""
    metas: list[tuple[tuple[list, list], tuple[list, list]]] = []
    forward = ex.runner.model.forward

    def recording(batch, kv):
        meta = ex.lora_pool.step.meta
        if meta is not None and not meta.decode:
            metas.append((meta_tables(meta), meta_tables(LoraMeta.mixed_step(*real_segments(meta), "cpu"))))
        return forward(batch, kv)

    ex.runner.model.forward = recording
    return metas


def real_segments(meta: LoraMeta) -> tuple[list[int], list[int]]:
    """The segments of a meta's host copies, less the empty ones (a static meta's, after its padding)."""
    starts, slots = meta.seg_start_host, meta.seg_adapter_host
    lens = [starts[i + 1] - starts[i] for i in range(len(slots))]
    keep = [i for i, n in enumerate(lens) if n]
    return [lens[i] for i in keep], [slots[i] for i in keep]


def meta_tables(meta: LoraMeta) -> tuple[list, list]:
    """What the kernels compute over: MBGMV (row, slot) pairs with an adapter, SGMV tiles of real tokens."""
    rows = [] if meta.rows is None else meta.rows.tolist()[: meta.num_rows]
    slots = [] if meta.row_adapter is None else meta.row_adapter.tolist()[: meta.num_rows]
    assert meta.tiles is not None
    ends = meta.seg_start_host[1:]
    tiles = [
        (s, m0) for s, m0 in meta.tiles.tolist()[: meta.num_tiles] if meta.seg_adapter_host[s] >= 0 and m0 < ends[s]
    ]
    return [(r, a) for r, a in zip(rows, slots) if a >= 0], tiles


def test_padding_writes_only_the_scratch_page(tiny_llama: Path) -> None:
    """One step of two prefill chunks (13 tokens, bucket 16): the K/V pages that change are the step's
    own and the scratch page; the logits are the eager forward's rows."""
    ex = make_executor(tiny_llama, max_lora_rank=0)
    mixed = static_steps(ex, 16, 4)
    bs = ex.block_size
    seqs = [([5, 6, 7, 8, 9], 0, [3, 4], True), (list(range(10, 18)), 0, [7, 8], True)]
    step = ForwardBatch.build(seqs, bs, "cpu")
    before = ex.kv.kv.clone()
    logits = mixed.run_rows(step, StepRows([(0, 5), (0, 8)], [0, 0], False))
    changed = {p for p in range(ex.kv.num_blocks) if not torch.equal(before[:, :, p], ex.kv.kv[:, :, p])}
    assert changed == {3, 4, 7, 8, ex.num_blocks}, changed
    ex.kv.kv.copy_(before)
    with torch.inference_mode():
        want = ex.model.forward(ForwardBatch.build(seqs, bs, "cpu"), ex.kv)
    torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)
