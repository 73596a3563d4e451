"""A delta's load to the GPU queues its copies instead of waiting for each, and a ``to_gpu`` op's load runs
beside the steps (GPU only: `make test-gpu-sbmm`).

``DeltaPool.to_gpu`` copies the packed linears from the pinned host copy with ``non_blocking``: the host
returns while the stream is still busy (a step in flight), the slot holds the host copy's words once the
stream has run, and dropping the host copy right away fences its arena region until the copies ran
(``pinned_arena.give_back``), so no later read can overwrite the bytes a queued copy still has to read."""

from __future__ import annotations

import os

import pytest
import torch

from deltaserve import wire
from deltaserve.adapters.delta_blocks import part_of, piece_index
from deltaserve.worker.executor import Executor

pytestmark = [
    pytest.mark.gpu_sbmm,
    pytest.mark.skipif(
        not (os.environ.get("DELTASERVE_TEST_GPU") == "1" and torch.cuda.is_available()),
        reason="needs a GPU (make test-gpu-sbmm)",
    ),
]


def test_a_load_returns_before_its_copies_run_and_fills_the_slot(tmp_path) -> None:
    from helpers.deltas import make_delta
    from helpers.tiny_models import make_tiny_model

    kw = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
    base = make_tiny_model(tmp_path, "llama", seed=5, **kw)
    first = make_delta(base, tmp_path / "d4a", seed=20, bits=4)[0]
    delta = make_delta(base, tmp_path / "d4", seed=21, bits=4)[0]
    ex = Executor(
        base,
        device="cuda:0",
        dtype="float16",
        block_size=4,
        kv_cache_bytes=16 << 20,
        cuda_graph_max_batch=0,
        host_arena_bytes=64 << 20,
    )
    pool, arena = ex.delta_pool, ex.host_arena
    assert pool is not None and arena is not None
    # The first delta of a packed config makes its pools (their slot offsets checked on the host once):
    # that load waits for the stream; the next one of the config is the one timed here.
    pool.to_host(6, first)
    pool.wait_host(6)
    pool.to_gpu(6, 1)
    pool.to_host(7, delta)
    host = pool.wait_host(7)
    assert arena.owns(host.buf)
    want = {k: {n: t.clone() for n, t in p.tensors().items()} for k, p in host.packed.items()}
    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000_000)  # a long kernel ahead of the load: a step still running
    pool.to_gpu(7, 0)
    assert not torch.cuda.current_stream().query(), "to_gpu returned without waiting for the stream"
    pool.drop_host(7)
    fenced = [event for _, _, event in arena._fenced]
    assert fenced and fenced[-1] is not None and not fenced[-1].query(), "the region stays fenced until the copies ran"
    torch.cuda.synchronize()
    weights = pool.step.weights[host.key]
    at = pool.piece_slots[7]
    for (layer, proj), tensors in want.items():
        got = weights[(layer, proj)].packed(at[piece_index(layer, part_of(ex.config, proj))]).tensors()
        assert got.keys() == tensors.keys()
        for name, t in tensors.items():
            assert torch.equal(got[name].cpu(), t), (layer, proj, name)


def test_a_load_beside_the_steps_leaves_the_step_stream_free_and_is_reported_when_done(tmp_path) -> None:
    """``load_beside_steps`` (a ``to_gpu`` op's path): the copies go on the loader's stream after the steps
    already queued (a slot an evicted delta held may still be read), the step stream runs on while they
    are still copying, ``take_gpu_ready`` reports the delta only once they ran, a step that uses it waits
    for them (``wait_gpu``), and the host copy dropped meanwhile stays fenced until they ran."""
    from helpers.deltas import make_delta
    from helpers.tiny_models import make_tiny_model

    kw = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
    base = make_tiny_model(tmp_path, "llama", seed=5, **kw)
    first = make_delta(base, tmp_path / "d4a", seed=20, bits=4)[0]
    delta = make_delta(base, tmp_path / "d4", seed=21, bits=4)[0]
    ex = Executor(base, device="cuda:0", dtype="float16", block_size=4, kv_cache_bytes=16 << 20,
                  cuda_graph_max_batch=0, host_arena_bytes=64 << 20)  # fmt: skip
    pool, arena = ex.delta_pool, ex.host_arena
    assert pool is not None and arena is not None and pool.loads.threaded and pool.loads.stream is not None
    pool.to_host(6, first)
    pool.wait_host(6)
    pool.to_gpu(6, 1)
    pool.to_host(7, delta)
    host = pool.wait_host(7)
    want = {k: {n: t.clone() for n, t in p.tensors().items()} for k, p in host.packed.items()}
    torch.cuda.synchronize()
    assert pool.take_gpu_ready() == [], "to_gpu in place reports nothing"

    place = pool._place

    def slow_place(delta_id: int, slot: int):
        work = place(delta_id, slot)

        def slow() -> None:
            torch.cuda._sleep(2_000_000_000)  # on the load stream: a copy still crossing PCIe
            work()

        return slow

    pool._place = slow_place  # type: ignore[method-assign]
    step_stream = torch.cuda.current_stream()
    torch.cuda._sleep(200_000_000)  # a step in flight, ahead of the load
    pool.apply(wire.VariantOp(7, wire.TierOp.TO_GPU, "", [], wire.VariantKind.DELTA, 0))
    assert pool.slot_of[7] == 0 and pool.loads.loading(7)
    pool.drop_host(7)
    marker = torch.cuda.Event()
    marker.record(step_stream)  # a later step
    marker.synchronize()
    assert pool.take_gpu_ready() == [], "the step stream ran on; the load is still copying"
    assert pool.loads.loading(7)
    fenced = [event for _, _, event in arena._fenced]
    assert fenced and fenced[-1] is not None and not fenced[-1].query(), "the region stays fenced until the copies ran"
    pool.wait_gpu([7, 6])  # a step that uses both
    after = torch.cuda.Event()
    after.record(step_stream)
    after.synchronize()  # the step stream waited for the copies
    assert pool.take_gpu_ready() == [7]
    weights = pool.step.weights[host.key]
    at = pool.piece_slots[7]
    for (layer, proj), tensors in want.items():
        got = weights[(layer, proj)].packed(at[piece_index(layer, part_of(ex.config, proj))]).tensors()
        for name, t in tensors.items():
            assert torch.equal(got[name].cpu(), t), (layer, proj, name)
