"""The step floor (``worker/step_floor.py``): the roofline model against hand-computed bytes and FLOPs,
the costs it reads off the tiny Llama and a LoRA adapter, and the ``timing.floor_us`` the executor
reports (positive for a step that runs something, 0 for an empty one; never compared with time)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deltaserve import wire
from deltaserve.adapters.variants import VariantCost
from deltaserve.worker.step_floor import (
    ROOFLINE_ENV,
    ModelCosts,
    Roofline,
    StepRun,
    causal_pairs,
    measure_roofline,
    parse_roofline,
    scheduled_floor,
    step_floor,
)
from helpers.peft_adapters import make_peft_adapter
from helpers.sched_driver import SchedDriver

COSTS = ModelCosts(
    weight_bytes=1000, block_linear_params=100, head_params=50, kv_bytes_per_token=8, attn_flops_per_pair=16
)
ONE_PER_US = Roofline(copy_bytes_per_s=1e6, matmul_flops_per_s=1e6, source="test")
"""1 byte or 1 FLOP per microsecond: the floor in µs is max(bytes, flops)."""


def test_decode_step_is_weights_plus_kv() -> None:
    runs = [StepRun(0, computed=10, tokens=1, logits=True), StepRun(0, computed=20, tokens=1, logits=True)]
    f = step_floor(COSTS, ONE_PER_US, runs, {})
    assert f.bytes == 1000 + (11 + 21) * 8
    assert f.flops == 2 * 100 * 2 + 2 * 50 * 2 + 16 * (11 + 21)  # linears, head rows, one pair per key
    assert f.floor_us == 1256  # memory-bound


def test_prefill_chunk_counts_causal_pairs_and_no_head_without_logits() -> None:
    assert causal_pairs(4, 6) == 6 * 4 + 21 and causal_pairs(0, 1) == 1
    f = step_floor(COSTS, ONE_PER_US, [StepRun(0, computed=4, tokens=6, logits=False)], {})
    assert f.bytes == 1000 + 10 * 8
    assert f.flops == 2 * 100 * 6 + 16 * 45
    assert f.floor_us == 1920  # compute-bound


def test_variants_are_read_once_per_step_and_computed_per_token() -> None:
    lora, delta = VariantCost(read_bytes=300, flops_per_token=40), VariantCost(read_bytes=500, flops_per_token=60)
    runs = [
        StepRun(7, computed=3, tokens=1, logits=True),  # LoRA 7, twice: its bytes once
        StepRun(7, computed=5, tokens=2, logits=True),
        StepRun(9, computed=0, tokens=4, logits=True),  # delta 9
        StepRun(0, computed=2, tokens=1, logits=True),
        StepRun(8, computed=0, tokens=1, logits=True),  # no cost known (e.g. its LoRA runs on CPU helpers)
    ]
    f = step_floor(COSTS, ONE_PER_US, runs, {7: lora, 9: delta})
    kv_tokens = 4 + 7 + 4 + 3 + 1
    pairs = causal_pairs(3, 1) + causal_pairs(5, 2) + causal_pairs(0, 4) + causal_pairs(2, 1) + causal_pairs(0, 1)
    assert f.bytes == 1000 + kv_tokens * 8 + 300 + 500
    assert f.flops == 2 * 100 * 9 + 2 * 50 * 5 + 16 * pairs + 40 * 3 + 60 * 4
    half_speed = Roofline(copy_bytes_per_s=5e5, matmul_flops_per_s=1e6, source="test")
    assert step_floor(COSTS, half_speed, runs, {7: lora, 9: delta}).floor_us == 2 * f.bytes


def test_a_block_two_variants_share_is_read_once() -> None:
    """Zoo variants sharing an own block (``VariantCost.shared``, by block identity): a step with both
    reads it once; their own bytes and every token's FLOPs count as usual."""
    a = VariantCost(read_bytes=10, flops_per_token=4, shared={"layer1": 200, "a-only": 30})
    b = VariantCost(read_bytes=20, flops_per_token=6, shared={"layer1": 200})
    runs = [StepRun(1, computed=0, tokens=1, logits=True), StepRun(2, computed=0, tokens=1, logits=True)]
    both = step_floor(COSTS, ONE_PER_US, runs, {1: a, 2: b})
    alone = step_floor(COSTS, ONE_PER_US, runs[:1], {1: a})
    assert both.bytes - alone.bytes == 20 + 1 * 8  # b's own bytes and its KV token: the shared block once
    assert both.flops - alone.flops == 2 * 100 + 2 * 50 + 16 * 1 + 6


def test_an_empty_step_has_no_floor() -> None:
    assert step_floor(COSTS, ONE_PER_US, [], {}).floor_us == 0


def test_roofline_is_measured_once_or_taken_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ROOFLINE_ENV, raising=False)
    measured = measure_roofline(torch.device("cpu"), torch.float32)
    assert measured.copy_bytes_per_s > 0 and measured.matmul_flops_per_s > 0 and "measured" in measured.source
    assert measure_roofline(torch.device("cpu"), torch.float32) is measured  # cached for the process
    monkeypatch.setenv(ROOFLINE_ENV, "3000,900")
    pinned = measure_roofline(torch.device("cpu"), torch.float32)
    assert (pinned.copy_bytes_per_s, pinned.matmul_flops_per_s) == (3e12, 9e14)
    for bad in ("3000", "fast,900", "0,900"):
        with pytest.raises(ValueError, match=ROOFLINE_ENV):
            parse_roofline(bad)


def test_model_costs_of_the_tiny_llama(executor_factory) -> None:
    ex = executor_factory(max_lora_rank=0, max_deltas=0)
    c = ex.config
    per_layer = 64 * 64 * 2 + 64 * 32 * 2 + 64 * 128 * 3  # q, o; k, v (2 KV heads of 16); gate, up, down
    assert (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.intermediate_size) == (64, 2, 4, 2, 128)
    costs = ex.model_costs
    assert costs.block_linear_params == 2 * per_layer
    assert costs.head_params == c.vocab_size * 64
    norms = 2 * 2 * 64 + 64
    assert costs.weight_bytes == 4 * (2 * c.vocab_size * 64 + 2 * per_layer + norms)  # float32, untied
    assert costs.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4
    assert costs.attn_flops_per_pair == 4 * 2 * 4 * 16


def test_executor_reports_the_floor_of_what_the_step_runs(executor_factory) -> None:
    ex = executor_factory(max_lora_rank=0, max_deltas=0)
    new = [
        wire.NewRequest(
            req_id=i,
            token_ids=list(range(3, 3 + n)),
            num_prompt_tokens=n,
            num_computed_tokens=0,
            num_scheduled_tokens=n,
            block_ids=[2 * i, 2 * i + 1],
            sampling=wire.SamplingParams(),
        )
        for i, n in ((0, 5), (1, 7))
    ]
    out = ex.step(wire.StepPlan(step_id=1, new_requests=new))
    runs = [StepRun(0, 0, 5, True), StepRun(0, 0, 7, True)]
    assert out.timing.floor_us == step_floor(ex.model_costs, ex.roofline, runs, {}).floor_us > 0
    assert ex.step(wire.StepPlan(step_id=2)).timing.floor_us == 0


def test_a_lora_adapter_costs_its_a_and_b_rows(executor_factory, tmp_path_factory: pytest.TempPathFactory) -> None:
    adapter = make_peft_adapter(
        Path(executor_factory(max_deltas=0).model_dir), tmp_path_factory.mktemp("floor_lora") / "a", seed=5,
        target_modules=["q_proj", "v_proj"], r=8, lora_alpha=16,
    )[1]  # fmt: skip
    ex = executor_factory(max_deltas=0)
    router = SchedDriver(ex, {1: adapter}, {1: 1})
    router.add(1, [4, 5, 6], 2)
    router.step()
    cost = ex.lora_pool.step_cost(1)
    exact = 2 * 8 * ((64 + 64) + (64 + 32)) * 4  # layers x rank x (q: in + out, v: in + out) x float32
    assert cost is not None and exact <= cost.read_bytes < exact + 2 * 4096  # alignment padding at most
    assert cost.flops_per_token == 2 * cost.read_bytes // 4
    state = ex.requests[1]
    with_adapter = scheduled_floor(ex.model_costs, ex.roofline, [(state, 1)], ex.pools)
    state.variant_id = 0
    base = scheduled_floor(ex.model_costs, ex.roofline, [(state, 1)], ex.pools)
    assert (
        with_adapter.bytes - base.bytes == cost.read_bytes and with_adapter.flops - base.flops == cost.flops_per_token
    )
    assert ex.lora_pool.step_cost(99) is None
