"""Serving compressed full-fine-tune deltas through ``Executor.step`` (DeltaZip's decoupled forward).

Deltas come from ``deltaserve compress`` itself on perturbed copies of the tiny models
(``helpers/deltas.py``); their dense reference ``W_base + dequant(Δ̃)`` (``materialize``) runs in
``transformers``. ``AdapterRouter`` (the LoRA serving test's stand-in for the router) sends the
ops: a delta's ``to_gpu`` has no pages (``num_blocks`` 0), it takes a worker delta slot. Checked:

- greedy tokens of a delta equal HF ``generate`` on its dense reference, for Llama (4-bit and
  2-bit 2:4), tied embeddings (the embedding delta also moves lm_head) and Qwen2 (bias deltas);
- a batch mixing base, LoRA and two deltas of different packed configs (chunked prefill,
  staggered arrivals, a preemption) gives each request exactly its tokens alone;
- a delta dropped from the GPU and loaded again (maybe into another slot) gives the same tokens;
- inspection: kind, summary and host bytes; a full-weights directory, another base's delta, or
  deltas switched off are refused with a message; bad delta ops are PlanErrors that change nothing.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch

from deltaserve import wire
from deltaserve.adapters.delta_blocks import SHARING_ENV
from deltaserve.adapters.delta_loads import DeltaLoads
from deltaserve.worker.config import ConfigError, validate
from deltaserve.worker.executor import Executor, PlanError

pytest.importorskip("peft")
from helpers.deltas import make_delta  # noqa: E402
from helpers.executors import KV_BYTES, hf_greedy, prompts  # noqa: E402
from helpers.peft_adapters import make_peft_adapter  # noqa: E402
from helpers.sched_driver import SchedDriver  # noqa: E402
from helpers.worker_config import cpu_worker_config  # noqa: E402
from worker.test_lora_serving import AdapterRouter  # noqa: E402

LORA, D4, D2 = 1, 2, 3
"""Variant ids of the mixed tests: a LoRA adapter, a 4-bit 2:4 delta, a 2-bit 2:4 delta."""
DELTA = wire.VariantKind.DELTA
TO_HOST, TO_GPU = wire.TierOp.TO_HOST, wire.TierOp.TO_GPU
DROP_GPU, DROP_HOST = wire.TierOp.DROP_GPU, wire.TierOp.DROP_HOST


def delta_op(
    aid: int,
    move: wire.TierOp,
    path: str = "",
    blocks: list[int] | None = None,
    *,
    kind: wire.VariantKind = DELTA,
    slot: int = 0,
) -> wire.VariantOp:
    """An op as the router sends it for a delta (a ``to_gpu`` names its slot, ``slot``)."""
    return wire.VariantOp(aid, move, path, blocks or [], kind, slot if move is TO_GPU and kind is DELTA else None)


pytestmark = pytest.mark.gpu_kernels  # `make test-gpu-kernels` selects it on a GPU


@pytest.fixture(scope="module")
def variants(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, tuple[Path, Path | None]]:
    """Variant id -> (directory, dense reference directory or None for the LoRA adapter)."""
    root = tmp_path_factory.mktemp("delta_serving")
    lora = make_peft_adapter(
        tiny_llama, root / "lora", seed=3, target_modules=["q_proj", "v_proj"], r=8, lora_alpha=16
    )[1]
    return {
        LORA: (lora, None),
        D4: make_delta(tiny_llama, root / "d4", seed=21, bits=4),
        D2: make_delta(tiny_llama, root / "d2", seed=22, bits=2),
    }


def _hf(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def test_greedy_equals_the_dense_reference_in_transformers(executor_factory, variants, hf_model) -> None:
    ex = executor_factory()
    dirs = {aid: d for aid, (d, _) in variants.items()}
    ps = prompts(3, ex.config.vocab_size, seed=4, lo=3, hi=20)
    router = AdapterRouter(ex, dirs, {})
    outputs: dict[int, list[list[int]]] = {}
    for aid, ref_dir in ((0, None), (D4, variants[D4][1]), (D2, variants[D2][1])):
        ref = hf_model if ref_dir is None else _hf(ref_dir)
        for j, prompt in enumerate(ps):
            rid = 100 * aid + j
            router.adapter_of[rid] = aid
            got = router.run({rid: (prompt, 10)})[rid]
            assert got == hf_greedy(ref, prompt, 10), (aid, j)
            outputs.setdefault(aid, []).append(got)
    assert outputs[0] != outputs[D4] != outputs[D2] != outputs[0]  # the deltas change the output
    assert ex.delta_pool is not None and sorted(ex.delta_pool.slot_of) == [D4, D2]


@pytest.mark.parametrize("fixture", ["tiny_llama_tied", "tiny_qwen2"])
def test_tied_embeddings_and_bias_deltas(fixture: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    base: Path = request.getfixturevalue(fixture)
    delta, ref_dir = make_delta(base, tmp_path / "d", seed=31, bits=4)
    ex = Executor(base, device="cpu", dtype="float32", block_size=4, kv_cache_bytes=KV_BYTES)
    router = AdapterRouter(ex, {1: delta}, {})
    ref, plain = _hf(ref_dir), _hf(base)
    for j, prompt in enumerate(prompts(2, ex.config.vocab_size, seed=6, lo=4, hi=16)):
        router.adapter_of[j] = 1
        got = router.run({j: (prompt, 8)})[j]
        assert got == hf_greedy(ref, prompt, 8), j
        assert got != hf_greedy(plain, prompt, 8), j


def test_mixed_batch_matches_each_alone(executor_factory, variants) -> None:
    ex = executor_factory()
    dirs = {aid: d for aid, (d, _) in variants.items()}
    n = 16
    ps = prompts(n, ex.config.vocab_size, seed=8, lo=2, hi=28)
    adapter_of = {i: i % 4 for i in range(n)}  # base, LoRA, 4-bit delta, 2-bit delta interleaved
    max_new = {i: 4 + i % 5 for i in range(n)}
    solo = AdapterRouter(ex, dirs, adapter_of)
    alone = {i: solo.run({i: (p, max_new[i])})[i] for i, p in enumerate(ps)}

    # Together: LoRA and delta host copies carved from one shared host arena (as on a GPU worker).
    shared = executor_factory(host_arena_bytes=64 << 20)
    assert shared.host_arena is not None and shared.lora_pool.arena is shared.delta_pool.arena is shared.host_arena
    router = AdapterRouter(shared, dirs, adapter_of, max_num_batched_tokens=7)
    reqs = {i: (p, max_new[i]) for i, p in enumerate(ps)}
    together = router.run_staggered(reqs, {i: i // 3 for i in range(n)}, preempt=6)  # 6 uses the 4-bit delta
    assert router.mixed_steps > 0
    assert together == alone
    assert len({tuple(alone[i]) for i in range(4)}) == 4


@pytest.mark.parametrize("sharing", ["on", "off"])
def test_one_delta_under_two_ids(executor_factory, variants, sharing: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ids registered from the same delta directory read the same payload file: every piece
    (each layer's attention and FFN linears, the embedding and the lm_head delta) is held once
    (``delta_blocks``), and in one batch each row gets the tokens it gets alone. With
    ``DELTASERVE_DELTA_PIECE_SHARING=off`` (benchmarks whose variants link a few payload files) they
    are two deltas, each piece held and read on its own, with the same tokens."""
    monkeypatch.setenv(SHARING_ENV, sharing)
    ex = executor_factory()
    d4 = variants[D4][0]
    router = AdapterRouter(ex, {D4: d4, 9: d4}, {0: D4, 1: 9})
    prompt = prompts(1, ex.config.vocab_size, seed=12, lo=9, hi=9)[0]
    alone = router.run({0: (prompt, 4)})[0]
    assert router.run({0: (prompt, 4), 1: (prompt, 4)}) == {0: alone, 1: alone}
    pool = ex.delta_pool
    assert pool is not None and sorted(pool.slot_of) == [D4, 9]
    if sharing == "on":
        assert pool.blocks.held_counts() == [1] * (pool.num_pieces + 2)  # embedding and lm_head included
        assert pool.piece_slots[D4] == pool.piece_slots[9]
    else:
        assert pool.blocks.held_counts() == [2] * (pool.num_pieces + 2)
        assert set(pool.piece_slots[D4]).isdisjoint(pool.piece_slots[9])


def test_a_bad_piece_sharing_value_stops_the_delta_pool(executor_factory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SHARING_ENV, "sometimes")
    with pytest.raises(ValueError, match="DELTASERVE_DELTA_PIECE_SHARING='sometimes': want on or off"):
        executor_factory()


@pytest.mark.parametrize("arena", [0, 64 << 20], ids=["no-arena", "arena"])
def test_delta_dropped_and_reloaded_gives_the_same_tokens(executor_factory, variants, arena: int) -> None:
    """With a host arena the payloads are views of its regions, a dropped delta's region is free
    again (and reused by the next read), and the reloaded delta still gives the same tokens."""
    ex = executor_factory(max_deltas=2, host_arena_bytes=arena)
    dirs = {aid: d for aid, (d, _) in variants.items()}
    router = AdapterRouter(ex, dirs, {1: D4, 2: D2, 3: D4})
    prompt = prompts(1, ex.config.vocab_size, seed=9, lo=10, hi=10)[0]
    first = router.run({1: (prompt, 6)})[1]
    assert ex.delta_pool is not None and ex.delta_pool.slot_of == {D4: 0}
    if arena:
        assert ex.host_arena is not None and ex.host_arena.owns(ex.delta_pool.wait_host(D4).buf)
        held = ex.host_arena.capacity - ex.host_arena.free_bytes
        assert held >= ex.delta_pool.wait_host(D4).nbytes
    router.evict(D4)
    router.run({2: (prompt, 6)})  # the 2-bit delta now takes slot 0
    assert ex.delta_pool.slot_of == {D2: 0} and D4 not in ex.delta_pool.host
    if arena:  # D4's region went back; D2's is the only one held
        assert ex.host_arena.capacity - ex.host_arena.free_bytes < held + ex.delta_pool.wait_host(D2).nbytes
    assert router.run({3: (prompt, 6)})[3] == first
    assert ex.delta_pool.slot_of == {D2: 0, D4: 1}


def test_inspect_reports_and_refuses(
    executor_factory, variants, tiny_qwen2: Path, tiny_llama: Path, tmp_path: Path
) -> None:
    ex = executor_factory()
    info = ex.inspect_variant(str(variants[D4][0]), DELTA)
    assert info.error is None and info.kind == DELTA and info.num_blocks == 0 and info.max_rank == 0
    assert info.summary.startswith("4-bit 2:4, ") and "smaller than fp16" in info.summary
    assert info.host_bytes > 0 and "q_proj" in info.target_modules
    lora = ex.inspect_variant(str(variants[LORA][0]))
    assert lora.error is None and lora.kind == wire.VariantKind.LORA and lora.summary == "rank 8"

    full, _ = make_delta(tiny_llama, tmp_path / "full", seed=5, full_weights=True)
    assert "not a delta of the base" in ex.inspect_variant(str(full), DELTA).error
    other, _ = make_delta(tiny_qwen2, tmp_path / "qwen", seed=5)
    err = ex.inspect_variant(str(other), DELTA).error
    assert err is not None and "architectures" in err, err
    off = executor_factory(max_deltas=0)
    off_info = off.inspect_variant(str(variants[D4][0]), DELTA)
    assert "delta serving is off on this worker (--max-deltas 0)" in off_info.error
    assert off.delta_pool is None


def _snapshot(ex: Executor):
    assert ex.delta_pool is not None
    return (
        copy.deepcopy(ex.requests),
        sorted(ex.delta_pool.host),
        dict(ex.delta_pool.slot_of),
        sorted(ex.lora_pool.host),
    )


def test_bad_delta_ops_are_plan_errors_that_change_nothing(executor_factory, variants) -> None:
    ex = executor_factory(max_deltas=1)
    d4, d2, lora = (str(variants[a][0]) for a in (D4, D2, LORA))
    op = delta_op
    ex.step(
        wire.StepPlan(step_id=1, adapter_ops=[op(D4, TO_HOST, d4, []), op(D4, TO_GPU, "", []), op(D2, TO_HOST, d2, [])])
    )
    ex.delta_pool.wait_host(D2)

    def new_req(rid, aid):
        return wire.NewRequest(
            req_id=rid,
            token_ids=[3, 4, 5],
            num_prompt_tokens=3,
            num_computed_tokens=0,
            num_scheduled_tokens=3,
            block_ids=[0],
            sampling=wire.SamplingParams(),
            adapter_id=aid,
        )

    cases = [
        ([op(D2, TO_GPU, "", [])], r"all 1 delta slots \(--max-deltas\) are taken"),
        ([op(D4, DROP_GPU, "", []), op(D2, TO_GPU, "", [5])], r"block_ids must be empty"),
        ([op(D4, TO_GPU, "", [])], r"already on the GPU"),
        ([op(D4, TO_HOST, d4, [])], r"already in host memory"),
        ([op(D4, DROP_GPU, "", []), op(D4, DROP_GPU, "", [])], r"drop_gpu adapter 2\): not on the GPU"),
        (
            [op(D4, TO_HOST, lora, [], kind=wire.VariantKind.LORA)],
            r"to_host adapter 2\): the id is a delta on this worker",
        ),  # a LoRA adapter's op
        ([op(D2, DROP_HOST, "", []), op(D2, TO_GPU, "", [])], r"not in host memory"),
        ([op(D4, DROP_HOST, "", []), op(D4, TO_HOST, "", [])], r"to_host adapter 2\): no path"),
    ]
    for ops, match in cases:
        before = _snapshot(ex)
        with pytest.raises(PlanError, match=match):
            ex.step(wire.StepPlan(step_id=2, adapter_ops=ops))
        assert before == _snapshot(ex), match
    before = _snapshot(ex)
    with pytest.raises(PlanError, match=r"request 7: adapter_id 3 is not on the GPU"):
        ex.step(wire.StepPlan(step_id=2, new_requests=[new_req(7, D2)]))
    assert before == _snapshot(ex)
    # Swapping the slot's delta in one plan (drop before load) is fine, and serves the new one.
    out = ex.step(
        wire.StepPlan(
            step_id=3, adapter_ops=[op(D4, DROP_GPU, "", []), op(D2, TO_GPU, "", [])], new_requests=[new_req(7, D2)]
        )
    )
    assert out.outputs[0].token_id is not None and ex.delta_pool.slot_of == {D2: 0}


def test_a_delta_goes_to_the_slot_the_router_names(executor_factory, variants) -> None:
    """The router picks every delta's slot (``VariantOp.slot``); the worker fills exactly that one and
    refuses, as a PlanError that changes nothing, a slot that is taken, outside ``--max-deltas`` or
    missing."""
    ex = executor_factory(max_deltas=2)
    d4, d2 = (str(variants[a][0]) for a in (D4, D2))
    ex.step(
        wire.StepPlan(
            step_id=1, adapter_ops=[delta_op(D4, TO_HOST, d4), delta_op(D4, TO_GPU, slot=1), delta_op(D2, TO_HOST, d2)]
        )
    )
    assert ex.delta_pool is not None and ex.delta_pool.slot_of == {D4: 1}
    ex.delta_pool.wait_host(D2)
    no_slot = wire.VariantOp(D2, TO_GPU, "", [], DELTA, None)
    for bad, match in [
        (delta_op(D2, TO_GPU, slot=1), r"to_gpu adapter 3\): delta slot 1 holds delta 2"),
        (delta_op(D2, TO_GPU, slot=2), r"slot 2 is not one of the 2 delta slots \(--max-deltas\)"),
        (no_slot, r"slot None is not one of the 2 delta slots"),
    ]:
        before = _snapshot(ex)
        with pytest.raises(PlanError, match=match):
            ex.step(wire.StepPlan(step_id=2, adapter_ops=[bad]))
        assert before == _snapshot(ex), match
    ex.step(wire.StepPlan(step_id=3, adapter_ops=[delta_op(D2, TO_GPU, slot=0)]))
    assert ex.delta_pool.slot_of == {D4: 1, D2: 0}
    # What a step using each reads and computes (worker/step_floor.py): per weight of its 2:4 block linears,
    # bits/2 of codes, 1 bit of indices, 32 bits of scale + zero per group of 64, and its dense lm_head
    # delta (the fine-tune changes lm_head) in float32; 2 FLOPs per kept value.
    weights = 2 * (64 * 64 * 2 + 64 * 32 * 2 + 64 * 128 * 3)  # Σ out·in over the tiny Llama's block linears
    head = ex.config.vocab_size * 64 * 4
    # Every byte is a piece's (per layer's attention / FFN, and the lm_head delta's): steps of deltas
    # sharing a piece read it once (``VariantCost.shared``).
    for aid, bits in ((D4, 4), (D2, 2)):
        cost = ex.delta_pool.step_cost(aid)
        assert cost is not None and cost.read_bytes == 0 and len(cost.shared) == 2 * ex.config.num_layers + 1
        assert sum(cost.shared.values()) == weights * (bits // 2 + 1) // 8 + weights // 16 + head
        assert cost.flops_per_token == weights
    with pytest.raises(ValueError, match="delta slot 0 holds delta 3"):  # the pool itself refuses too
        ex.delta_pool.to_gpu(99, 0)


def test_deltas_of_any_packed_configs_take_the_reserved_bytes_and_no_more(
    executor_factory, variants, tiny_llama: Path, tmp_path: Path
) -> None:
    """Every packed config's pools are views of one arena per linear: the delta slots take exactly the
    bytes the KV budget left for them (``delta_reserve_bytes``), whether their deltas are one config
    or three (4-bit 2:4, 2-bit 2:4, 4-bit dense), and a config no slot can hold is refused at inspection."""
    dense, _ = make_delta(tiny_llama, tmp_path / "dense", seed=35, bits=4, sparse=False)
    dirs = {D4: variants[D4][0], D2: variants[D2][0], 9: dense}
    ex = executor_factory(max_deltas=3)
    assert ex.delta_pool is not None
    router = AdapterRouter(ex, dirs, {1: D4, 2: D2, 3: 9})
    prompt = prompts(1, ex.config.vocab_size, seed=13, lo=6, hi=6)[0]
    router.run({1: (prompt, 2)})
    assert ex.delta_pool.gpu_bytes == ex.delta_reserve_bytes  # every slot's storage, from the first delta
    router.run({2: (prompt, 2)})
    router.run({3: (prompt, 2)})
    assert len(ex.delta_pool.step.weights) == 3 and sorted(ex.delta_pool.slot_of) == [D4, D2, 9]
    assert ex.delta_pool.gpu_bytes == ex.delta_reserve_bytes, "a second and third config took more"
    too_wide, _ = make_delta(tiny_llama, tmp_path / "wide", seed=36, bits=4, sparse=False, group_size=32)
    err = ex.inspect_variant(str(too_wide), DELTA).error
    assert err is not None and "more than a delta slot's" in err and "--group-size 64" in err, err


def test_max_deltas_setting(tiny_llama: Path) -> None:
    # The default (3) is the router's: ServerConfig's test checks the config it sends.
    assert validate(cpu_worker_config(tiny_llama, max_deltas=3)).max_deltas == 3
    assert validate(cpu_worker_config(tiny_llama, max_deltas=0)).max_deltas == 0
    with pytest.raises(ConfigError, match="max_deltas 65: expected 0..64"):
        validate(cpu_worker_config(tiny_llama, max_deltas=65))


@pytest.mark.skipif(
    not (os.environ.get("DELTASERVE_TEST_GPU") == "1" and torch.cuda.is_available()),
    reason="the Triton SBMM path needs a GPU (make test-gpu)",
)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_on_cuda_the_triton_path_serves_deltas_like_the_cpu_reference(tiny_llama: Path, variants, dtype: str) -> None:
    """The executor on CUDA (SBMM in Triton, dense deltas on the device) against the same executor on
    CPU (sbmm_ref): identical greedy tokens in float32; in bfloat16, the first token and close logits."""
    dirs = {aid: d for aid, (d, _) in variants.items()}
    adapter_of = {i: (0, LORA, D4, D2)[i % 4] for i in range(8)}
    got = {}
    for device in ("cpu", "cuda"):
        ex = Executor(tiny_llama, device=device, dtype=dtype, block_size=4, kv_cache_bytes=KV_BYTES)
        ps = prompts(8, ex.config.vocab_size, seed=12, lo=3, hi=20)
        got[device] = AdapterRouter(ex, dirs, adapter_of).run({i: (p, 6) for i, p in enumerate(ps)})
    if dtype == "float32":
        assert got["cuda"] == got["cpu"]
    else:
        assert sum(got["cuda"][i][0] == got["cpu"][i][0] for i in got["cpu"]) >= 7


def test_a_failed_delta_read_gives_its_arena_region_back(executor_factory, variants, tmp_path: Path) -> None:
    import shutil

    from deltaserve.adapters import AdapterLoadError

    ex = executor_factory(max_deltas=2, host_arena_bytes=64 << 20)
    assert ex.host_arena is not None
    broken = tmp_path / "broken"
    shutil.copytree(variants[D4][0], broken)
    assert ex.inspect_variant(str(broken), DELTA).error is None
    payload = broken / "delta.safetensors"
    payload.write_bytes(payload.read_bytes()[: payload.stat().st_size // 2])  # cut after registration
    ex.step(wire.StepPlan(step_id=1, adapter_ops=[delta_op(D4, TO_HOST, str(broken))]))
    with pytest.raises(AdapterLoadError, match="broken"):
        ex.delta_pool.wait_host(D4)
    assert ex.host_arena.free_bytes == ex.host_arena.capacity, "the failed read kept its region"


def _both_deltas_on_the_gpu(ex, variants):
    """``ex``'s delta pool after one plan loads D4 into slot 0 and D2 into slot 1 (host, then GPU)."""
    ex.step(
        wire.StepPlan(
            step_id=1,
            adapter_ops=[
                delta_op(aid, move, str(variants[aid][0]) if move is TO_HOST else "", slot=slot)
                for slot, aid in enumerate((D4, D2))
                for move in (TO_HOST, TO_GPU)
            ],
        )
    )
    assert ex.delta_pool is not None
    return ex.delta_pool


def test_graph_buffers_hold_the_steps_rows(executor_factory, variants) -> None:
    """The delta pool's static decode buffers, what a captured delta graph reads: ``graph_state`` points
    the step at them with no delta row yet; ``fill_graph_rows`` writes each row's slot and, per packed
    config and piece (each layer's attention and FFN: ``delta_blocks``) and for the lm_head delta, the
    work tiles of the same rows built directly (graph tiles of at most ``GRAPH_TILE`` tokens); on the
    CPU no config is graphable (the CUDA SBMM op is not there)."""
    from deltaserve.adapters.delta_pool import GRAPH_TILE, HEAD_TILE
    from deltaserve.kernels.sbmm import DeltaMeta

    pool = _both_deltas_on_the_gpu(executor_factory(), variants)
    keys = pool.graph_keys([D4, 0, D2, LORA])
    assert keys == ((2, True, 64), (4, True, 64)) and pool.graph_keys([0, LORA]) == ()
    assert not pool.graphable(keys)
    with pool.graph_state(9, 16, keys):
        assert pool.step.active and pool.step.token_index.tolist() == [0] * 9
        assert len(pool.step.piece_metas) == pool.num_pieces  # one metadata per layer's attention / FFN
        assert all([k for k, _ in metas] == list(keys) for metas in pool.step.piece_metas)
        first = pool.step.piece_metas[0][0][1]
        for _, meta in (*pool.step.piece_metas[0], *pool.step.piece_metas[-1], (None, pool.step.head_meta)):
            assert meta.tile_count.item() == 0 and all(t[2] == -1 for t in meta.tiles.tolist())
        assert first.block_m == GRAPH_TILE and pool.step.head_meta.block_m == HEAD_TILE
        # 3 slots: at most one partial tile each, plus 9 // cap full ones
        assert first.grid_tiles == 3 + 9 // GRAPH_TILE and pool.step.head_meta.grid_tiles == 3
    assert not pool.step.active
    s4, s2 = pool.slot_of[D4], pool.slot_of[D2]
    ids = [D4, 0, D2] + [D4] * 10 + [LORA]
    pool.fill_graph_rows(ids, 16, keys)
    g = pool.graph_rows
    slots = [s4, -1, s2] + [s4] * 10 + [-1] * 3
    assert g.index[:16].tolist() == [s + 1 for s in slots]
    cases = [
        (key, p, [s if s == slot else -1 for s in slots], GRAPH_TILE, g.metas[key])
        for key, slot in (((4, True, 64), s4), ((2, True, 64), s2))
        for p in (0, pool.num_pieces - 1)  # plain deltas: every piece in the delta's own slot
    ] + [(None, 0, slots, HEAD_TILE, g.head)]
    for key, p, rows, cap, bufs in cases:
        want = DeltaMeta.rows(rows, "cpu", max_block_m=cap)
        order, tiles, count = bufs
        grid = pool.graph_tiles(16, cap)
        got_tiles = tiles[p * grid * 3 : (p + 1) * grid * 3].view(grid, 3)
        assert order[p * 16 : (p + 1) * 16].tolist() == want.order.tolist(), key
        assert got_tiles.tolist() == want.tiles[:grid].tolist(), key
        assert count[p].item() == want.num_tiles <= grid and max(e - s for s, e, _ in want.tiles.tolist()) <= cap
        assert all(t[2] == -1 for t in want.tiles[grid:].tolist())  # what the graph leaves out is padding
    assert GRAPH_TILE == 16  # 11 rows of one delta: one tile (the CUDA op's widest, dequantising the delta once)
    assert g.metas[(4, True, 64)][2].tolist() == [1] * pool.num_pieces


def test_mixed_graph_buffers_hold_each_token_and_logits_row(executor_factory, variants) -> None:
    """The mixed steps' static buffers (``mixed_graph_state`` / ``fill_mixed_rows``, what a captured
    prefill or mixed step reads): every token of the bucket is a row of the SBMM metadata, so a prompt's
    tokens share their delta's work tiles; the logits rows (one per sampling sequence) have their own
    index and lm_head tiles. The decode buffers are left alone."""
    from deltaserve.adapters.delta_pool import GRAPH_TILE, HEAD_TILE
    from deltaserve.kernels.sbmm import DeltaMeta

    pool = _both_deltas_on_the_gpu(executor_factory(), variants)
    keys = pool.graph_keys([D4, D2])
    with pool.mixed_graph_state(32, 8, 64, 16, keys):
        assert pool.step.token_index.tolist() == [0] * 32 and pool.step.logit_index.tolist() == [0] * 8
        assert pool.step.piece_metas[0][0][1].grid_tiles == pool.graph_tiles(32, GRAPH_TILE)
        assert pool.step.head_meta.grid_tiles == pool.graph_tiles(8, HEAD_TILE)
    assert not pool.step.active and pool.graph_rows is None, "the decode buffers are not made"
    s4, s2 = pool.slot_of[D4], pool.slot_of[D2]
    # A 20-token prompt of D4, a base decode, a 5-token prompt of D2 and a D2 decode: 27 of 32 tokens.
    tokens = [D4] * 20 + [0] + [D2] * 5 + [D2]
    logits = [D4, 0, D2, D2]  # one logits row per sequence that samples
    pool.fill_mixed_rows(tokens + [0] * (32 - len(tokens)), logits + [0] * (8 - len(logits)), keys)
    g = pool.mixed_rows
    assert g is not None and g.max_batch == 64 and g.max_logits == 16
    token_slots = [s4] * 20 + [-1] + [s2] * 6 + [-1] * 5
    logit_slots = [s4, -1, s2, s2] + [-1] * 4
    assert g.index[:32].tolist() == [s + 1 for s in token_slots]
    assert g.logit_index[:8].tolist() == [s + 1 for s in logit_slots]
    for key, slot in (((4, True, 64), s4), ((2, True, 64), s2)):
        rows = [s if s == slot else -1 for s in token_slots]
        want = DeltaMeta.rows(rows, "cpu", max_block_m=GRAPH_TILE)
        order, tiles, count = g.metas[key]
        grid = pool.graph_tiles(32, GRAPH_TILE)
        assert order[:32].tolist() == want.order.tolist(), key
        assert tiles[: grid * 3].view(grid, 3).tolist() == want.tiles[:grid].tolist(), key
        assert count[0].item() == want.num_tiles == (2 if slot == s4 else 1)  # 20 tokens: two 16-token tiles
    want = DeltaMeta.rows(logit_slots, "cpu", max_block_m=HEAD_TILE)
    order, tiles, count = g.head
    assert order[:8].tolist() == want.order.tolist() and count.item() == want.num_tiles


def test_a_config_prepared_before_its_first_load(executor_factory, variants) -> None:
    """``prepare_config`` (the executor's, when the first delta of a config is registered on CUDA: its
    graphs are captured then) makes the config's pools before any load, and the loads then fill those
    same pools with the tokens of an executor that never prepared; a dense lane captured before any
    delta of the config is resident reads block slot 0's offsets. On CPU ``inspect_variant`` prepares
    nothing (no graphs to capture) and changes no state."""
    ex = executor_factory()
    pool = ex.delta_pool
    assert pool is not None
    d4 = str(variants[D4][0])
    assert ex.inspect_variant(d4, DELTA).error is None
    assert not pool.step.weights and pool.lane_scratch is None, "no graphs on CPU: inspection changes no state"
    key4 = pool.config_key(d4)
    assert key4 == (4, True, 64)
    assert pool.prepare_config(key4) is False, "no CUDA SBMM op here: steps of the config are not captured"
    pools = dict(pool.step.weights[key4])
    assert pool.lane_scratch is not None and not any(any(w.loaded) for w in pools.values())
    with pool.mixed_graph_state(32, 8, 64, 16, (key4,), lane_key=key4):
        assert pool.step.dense_lane is not None and pool.step.dense_lane.key == key4
    assert pool.mixed_rows is not None
    want = [[offs[0] for offs in pools[lin].slot_offsets] for lin in sorted(pools)]
    assert pool.mixed_rows.lane_offsets[key4].tolist() == want

    reqs = {i: (p, 6) for i, p in enumerate(prompts(4, ex.config.vocab_size, seed=8, lo=3, hi=20))}
    adapter_of = {i: (D4, 0)[i % 2] for i in reqs}
    arrivals = dict.fromkeys(reqs, 0)
    dirs = {D4: variants[D4][0]}
    got = SchedDriver(ex, dirs, adapter_of).run(reqs, arrivals)
    assert got == SchedDriver(executor_factory(), dirs, adapter_of).run(reqs, arrivals)
    assert all(pool.step.weights[key4][lin] is w for lin, w in pools.items()), "the load filled the prepared pools"
    assert any(any(w.loaded) for w in pools.values())


def test_deltas_load_beside_the_steps_of_running_requests(executor_factory, variants) -> None:
    """With ``gpu_load_reports`` (the router's setting) a delta's ``to_gpu`` goes out in a step that runs
    other requests, without the request that needs it; the worker copies it on its loader thread
    (threaded here on the CPU, as on CUDA) beside the following steps, reports it in ``gpu_ready``, and
    only then is the request admitted, with no second ``to_gpu``. The tokens are those of loads made
    inside the step, and steps overlapped as the engine runs them change nothing."""
    dirs = {D4: variants[D4][0], D2: variants[D2][0]}
    reqs = {i: (p, 8) for i, p in enumerate(prompts(4, 256, seed=12, lo=4, hi=14))}
    adapter_of = {1: D4, 2: D2, 3: D4}
    arrivals = {0: 0, 1: 2, 2: 3, 3: 3}  # request 0 (the base) runs while the deltas are wanted
    want = SchedDriver(executor_factory(max_deltas=2), dirs, adapter_of).run(reqs, arrivals)

    ex = executor_factory(max_deltas=2)
    assert ex.delta_pool is not None and not ex.delta_pool.loads.threaded  # the CPU worker's default
    ex.delta_pool.loads = DeltaLoads(ex.device, threaded=True)
    reported: list[int] = []
    take = ex.delta_pool.take_gpu_ready

    def take_and_note() -> list[int]:
        ready = take()
        reported.extend(ready)
        return ready

    ex.delta_pool.take_gpu_ready = take_and_note  # type: ignore[method-assign]
    driver = SchedDriver(ex, dirs, adapter_of, gpu_load_reports=True)
    assert driver.run_pipelined(reqs, arrivals) == want
    assert sorted(reported) == sorted([D2, D4])
    for delta, first_req in ((D4, 1), (D2, 2)):
        loads = [i for i, p in enumerate(driver.plans) if any(op.adapter_id == delta and op.op == TO_GPU
                                                              for op in p.adapter_ops)]  # fmt: skip
        admits = [i for i, p in enumerate(driver.plans) if any(r.req_id == first_req for r in p.new_requests)]
        assert len(loads) == 1 and len(admits) == 1, (delta, loads, admits)
        assert loads[0] < admits[0], f"delta {delta}: its request came in the step of its to_gpu"
        assert driver.plans[loads[0]].running, "a load ahead goes out in a step that runs others"
    assert driver.sched.stats()["gpu_load_deferrals"] >= 2


def test_graphs_at_registration_from_the_environment(executor_factory, monkeypatch: pytest.MonkeyPatch) -> None:
    """``DELTASERVE_DELTA_GRAPHS_AT_REGISTRATION``: which delta graphs a new config captures when its first
    delta is registered (both kinds by default, ``off`` none); a bad value stops the executor, naming it."""
    from deltaserve.worker.executor import CAPTURE_AT_REGISTRATION_ENV, graphs_at_registration

    monkeypatch.delenv(CAPTURE_AT_REGISTRATION_ENV, raising=False)
    assert graphs_at_registration() == {"decode", "mixed"}
    for text, want in (("off", set()), ("mixed", {"mixed"}), (" Decode, mixed", {"decode", "mixed"}), ("", None)):
        monkeypatch.setenv(CAPTURE_AT_REGISTRATION_ENV, text)
        assert graphs_at_registration() == (want if want is not None else {"decode", "mixed"}), text
    for bad in ("on", "decode,off", ","):
        monkeypatch.setenv(CAPTURE_AT_REGISTRATION_ENV, bad)
        with pytest.raises(ValueError, match=CAPTURE_AT_REGISTRATION_ENV):
            executor_factory()


def test_dense_lane_buffers_and_rule(executor_factory, variants, monkeypatch: pytest.MonkeyPatch) -> None:
    """The dense lane of a captured mixed step (``delta_graphs``): the delta with the most tokens takes it
    when it has ``dense_lane_tokens(bucket)`` of them and a piece at every layer; its rows are the lane's
    mask and in no work tile, and the lane's offsets are its slot's in every linear's pool."""
    from deltaserve.adapters import delta_graphs
    from deltaserve.adapters.delta_pool import GRAPH_TILE
    from deltaserve.kernels.sbmm import DeltaMeta

    pool = _both_deltas_on_the_gpu(executor_factory(), variants)
    runs = [(D4, 20), (0, 1), (D2, 5), (D2, 1)]
    assert delta_graphs.dense_lane_tokens(32) == 74 and pool.dense_lane_for(runs, 32) is None, "too few tokens"
    monkeypatch.setattr(delta_graphs, "DENSE_LANE_BASE_TOKENS", 0)  # 10 tokens of a 32-token bucket
    assert pool.dense_lane_for(runs, 32) == D4
    assert pool.dense_lane_for([(D4, 5), (D2, 12)], 32) == D2
    assert pool.dense_lane_for([(D4, 9), (0, 20)], 32) is None
    at = pool.piece_slots[D4]
    monkeypatch.setitem(pool.piece_slots, D4, (-1, *at[1:]))  # as a partial (zoo) delta: no piece at layer 0
    assert pool.dense_lane_for(runs, 32) is None, "a partial delta stays on the work tiles"
    monkeypatch.setitem(pool.piece_slots, D4, at)

    keys = pool.graph_keys([D4, D2])
    key4 = pool.key_of[D4]
    with pool.mixed_graph_state(32, 8, 64, 16, keys, lane_key=key4):
        lane = pool.step.dense_lane
        assert lane is not None and lane.key == key4 and lane.others.all()
        assert lane.scratch.numel() == max(w.out_features * w.in_features for w in pool.step.weights[key4].values())
    assert pool.step.dense_lane is None
    tokens = [D4] * 20 + [0] + [D2] * 6
    pool.fill_mixed_rows(tokens + [0] * 5, [D4, 0, D2, D2] + [0] * 4, keys, dense_lane=D4)
    g = pool.mixed_rows
    s4, s2 = pool.slot_of[D4], pool.slot_of[D2]
    assert g.lane_others[:32, 0].tolist() == [v != D4 for v in tokens + [0] * 5]
    assert g.index[:32].tolist()[:20] == [s4 + 1] * 20, "the lane's rows keep their index (norms, biases)"
    pools = pool.step.weights[key4]
    want = [[offs[s4] for offs in pools[lin].slot_offsets] for lin in sorted(pools)]
    assert g.lane_offsets[key4].tolist() == want
    for key, rows in ((key4, [-1] * 32), (pool.key_of[D2], [-1] * 21 + [s2] * 6 + [-1] * 5)):
        order, _, count = g.metas[key]
        meta = DeltaMeta.rows(rows, "cpu", max_block_m=GRAPH_TILE)
        assert count[0].item() == meta.num_tiles and order[:32].tolist() == meta.order.tolist(), key
