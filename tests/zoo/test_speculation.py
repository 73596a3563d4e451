"""Speculative surrogate blocks for a cold zoo variant's prefill (``adapters/block_speculation.py``).

Through ``Executor.step`` with the router's own scheduler (``SchedDriver``): the cold variant's
``to_host``, ``to_gpu`` and prefill come in one plan; with mode ``always`` the prefill runs the base
block as the surrogate of the variant's first own block, continues downstream, and verifies when the
delta lands. Checked: greedy tokens equal the normal path's exactly (the surrogate's output is rejected
and the window rerun), the counts, and the paper's rules (``gate_plan``): never two consecutive
blocks, never the last one; a read failing when the delta lands fails only that variant.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from deltaserve.adapters.block_speculation import BlockSpeculation, GatePlan, gate_plan
from helpers.executors import make_executor, prompts
from helpers.sched_driver import SchedDriver

from .conftest import CHEAP, ZooFixture, perturb

pytest.importorskip("peft")

VARIANT = 1


@pytest.fixture(scope="module")
def first_layer_zoo(zoo_fixture: ZooFixture, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A zoo variant whose only own block is layer 0 of the 3-layer base: layer 1 can run on a surrogate."""
    from deltaserve.zoo import add_variant

    root = tmp_path_factory.mktemp("spec_zoo")
    ft0 = perturb(zoo_fixture.base, root / "ft0", ["model.layers.0."], 0.5, seed=7)
    add_variant(root / "zoo", zoo_fixture.base, "ft0", ft0, CHEAP, progress=None)
    return root / "zoo" / "variants" / "ft0"


def _generate(base: Path, variant: Path, mode: str | None, ps: list[list[int]]):
    """Greedy tokens of ``ps`` (one after the other, the variant cold for the first), the counts the
    StepOutputs carried (speculated, accepted, recomputed layers) and the gates' totals."""
    ex = make_executor(base, max_deltas=2, max_lora_rank=0)
    assert ex.delta_pool is not None
    if mode is not None:
        ex.speculation = BlockSpeculation(ex.delta_pool, mode)
    driver = SchedDriver(ex, {VARIANT: variant}, {i: VARIANT for i in range(len(ps))})
    out, counts = [], [0, 0, 0]
    for i, p in enumerate(ps):
        driver.add(i, p, 6)
        while driver.unfinished:
            step = driver.step()
            for j, n in enumerate(
                (step.speculated_prefills, step.speculation_accepted, step.speculation_recomputed_layers)
            ):
                counts[j] += n
        out.append(driver.outputs[i])
    return out, counts, ex.speculation.totals if ex.speculation is not None else None


def test_speculation_keeps_exact_tokens_with_a_rejected_surrogate(zoo_fixture: ZooFixture, first_layer_zoo: Path):
    ps = prompts(2, 128, seed=3, lo=6, hi=12)
    want, _, _ = _generate(zoo_fixture.base, first_layer_zoo, None, ps)
    got, (speculated, accepted, recomputed), totals = _generate(zoo_fixture.base, first_layer_zoo, "always", ps)
    assert got == want
    driver = SchedDriver(make_executor(zoo_fixture.base, max_deltas=1, max_lora_rank=0))
    driver.add(0, ps[0], 6)
    while driver.unfinished:
        driver.step()
    assert driver.outputs[0] != want[0]  # the surrogate's tokens (the base's) would have been wrong
    assert speculated == 1  # the cold prefill only: the second request finds the delta placed
    assert recomputed == 1  # layer 1 rerun from layer 0's real output
    assert totals is not None and totals.exact == 0 and len(totals.cosines) == 1 and totals.cosines[0] < 1.0
    assert accepted == (totals.cosines[0] >= 0.95)


def test_consecutive_own_blocks_land_without_speculating(zoo_fixture: ZooFixture) -> None:
    """ft1 owns layers 1 and 2 (consecutive, the second the last): the gate waits at layer 1."""
    ft1 = zoo_fixture.zoo / "variants" / "ft1"
    ps = prompts(1, 128, seed=5, lo=6, hi=10)
    want, _, _ = _generate(zoo_fixture.base, ft1, None, ps)
    got, counts, _ = _generate(zoo_fixture.base, ft1, "always", ps)
    assert got == want
    assert counts == [0, 0, 0]


@pytest.mark.parametrize(
    ("own", "layers", "plan"),
    [
        ({0}, 3, GatePlan(0, 2)),  # layer 1 on the surrogate's output, land before the last layer
        ({0, 1}, 4, GatePlan(0, 0)),  # never two consecutive blocks
        ({2}, 3, GatePlan(2, 2)),  # never the last block
        ({1}, 3, GatePlan(1, 1)),  # nothing between it and the last layer: no speculation
        ({1, 4}, 8, GatePlan(1, 4)),  # land at the next own block
        ({3}, 3, GatePlan(3, 3)),  # only the head is own: land before it
    ],
)
def test_gate_plan_follows_the_paper_rules(own: set[int], layers: int, plan: GatePlan) -> None:
    assert gate_plan(own, layers) == plan
    assert plan.speculates == (plan.land_at > plan.first_own)


def test_unknown_mode_is_refused(zoo_fixture: ZooFixture) -> None:
    ex = make_executor(zoo_fixture.base, max_deltas=1, max_lora_rank=0)
    assert ex.delta_pool is not None
    with pytest.raises(ValueError, match="DELTASERVE_BLOCK_SPECULATION='sometimes'"):
        BlockSpeculation(ex.delta_pool, "sometimes")


def test_a_read_failing_at_landing_fails_only_that_variant(
    zoo_fixture: ZooFixture, first_layer_zoo: Path, tmp_path: Path
):
    """The delta's files break after registration: the read fails when the gate lands it, mid-forward.
    Its request gets no output and the variant is reported failed; the worker serves on."""
    from deltaserve import wire

    broken = tmp_path / "ft0"
    shutil.copytree(first_layer_zoo, broken)  # copies: the zoo's own block files stay intact
    for f in broken.glob("*.safetensors"):
        f.write_bytes(b"not a safetensors file")
    ex = make_executor(zoo_fixture.base, max_deltas=1, max_lora_rank=0)
    assert ex.delta_pool is not None
    ex.speculation = BlockSpeculation(ex.delta_pool, "always")
    greedy = wire.SamplingParams(temperature=0.0, top_p=1.0, top_k=0, seed=None, logprobs=None)

    def new(req_id: int, aid: int) -> wire.NewRequest:
        return wire.NewRequest(req_id=req_id, token_ids=[5, 6, 7, 8, 9], num_prompt_tokens=5, num_computed_tokens=0,
                               num_scheduled_tokens=5, block_ids=[2 * req_id, 2 * req_id + 1], sampling=greedy,
                               adapter_id=aid)  # fmt: skip

    delta = wire.VariantKind.DELTA
    ops = [wire.VariantOp(VARIANT, wire.TierOp.TO_HOST, str(broken), [], delta, None),
           wire.VariantOp(VARIANT, wire.TierOp.TO_GPU, "", [], delta, 0)]  # fmt: skip
    out = ex.step(wire.StepPlan(step_id=1, adapter_ops=ops, new_requests=[new(1, VARIANT), new(2, 0)]))
    assert [f.variant_id for f in out.failed_variants] == [VARIANT]
    assert [o.req_id for o in out.outputs] == [2] and out.outputs[0].token_id is not None
    assert 1 not in ex.requests and VARIANT not in ex.delta_pool.slot_of
    out = ex.step(wire.StepPlan(step_id=2, released=[1, 2], new_requests=[new(3, 0)]))
    assert [o.req_id for o in out.outputs] == [3]
