"""Serving LoRA adapters through ``Executor.step`` with router-driven ``adapter_ops``, against PEFT.

Three adapters made by the ``peft`` library on the tiny Llama (non-zero random A and B, so each
visibly changes the output): A = rank 8 on q, v (alpha 16); B = rank 16 on all seven projections
with rsLoRA (alpha 8); C = rank 4 on gate, up, down with ``rank_pattern`` (down rank 12, up rank 2
in layer 1). ``SchedDriver`` (``helpers/sched_driver.py``) plays the router with its own scheduler:
it registers the adapters ``inspect_variant`` describes, the scheduler gives them pages of the same
pool as KV and sends ``to_host`` / ``to_gpu`` / ``drop_gpu`` / ``drop_host`` in its plans. Checked:

- greedy tokens of each adapter equal HF ``generate`` on the PEFT model itself (unmerged), and
  base requests equal plain HF;
- a mixed batch (base, A, B, C interleaved, 16 requests of different lengths, chunked prefill,
  staggered arrivals so prefill and decode rows of several adapters share steps, one preemption)
  gives each request exactly its tokens alone;
- an adapter evicted (its pages then filled with other requests' KV) and re-loaded on other pages
  gives the same tokens;
- bad ops and requests on non-resident adapters are a PlanError that changes nothing;
- the loop answers ``InspectVariant``; a failed adapter load fails that adapter's requests only;
- ``--max-lora-rank`` / ``--max-loras-per-step`` flags (``--loras`` is gone).
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import pytest
import torch

from deltaserve import wire
from deltaserve.adapters.lora import MAX_RANK
from deltaserve.worker.config import MAX_LORA_RANK, ConfigError, parse_args, validate
from deltaserve.worker.executor import Executor, PlanError

peft = pytest.importorskip("peft")
from helpers.executors import hf_greedy, prompts  # noqa: E402
from helpers.peft_adapters import SEVEN, make_peft_adapter  # noqa: E402
from helpers.sched_driver import GREEDY, SchedDriver  # noqa: E402
from helpers.worker_config import cpu_worker_config  # noqa: E402
from worker.test_executor import FakeLink  # noqa: E402

SPECS = {
    1: dict(target_modules=["q_proj", "v_proj"], r=8, lora_alpha=16),
    2: dict(target_modules=SEVEN, r=16, lora_alpha=8, use_rslora=True),
    3: dict(
        target_modules=["gate_proj", "up_proj", "down_proj"],
        r=4,
        lora_alpha=6,
        rank_pattern={"down_proj": 12, "layers.1.mlp.up_proj": 2},
    ),
}


AdapterRouter = SchedDriver
"""The name ``tests/worker/test_delta_serving.py`` and ``tests/kernels/test_cuda_graphs.py`` import."""


@pytest.fixture(scope="module")
def adapters(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, tuple[Path, torch.nn.Module]]:
    """Adapter id -> (PEFT dir, the PEFT model itself: HF base + unmerged LoRA layers)."""
    root = tmp_path_factory.mktemp("lora_serving")
    return {
        aid: make_peft_adapter(tiny_llama, root / f"a{aid}", seed=10 + aid, **kw)[::-1] for aid, kw in SPECS.items()
    }


@pytest.fixture(scope="module")
def dirs(adapters) -> dict[int, Path]:
    return {aid: d for aid, (d, _) in adapters.items()}


def test_greedy_matches_peft_and_base_matches_hf(executor_factory, adapters, dirs, hf_model) -> None:
    ex = executor_factory()
    ps = prompts(3, ex.config.vocab_size, seed=3, lo=3, hi=20)
    refs = {0: hf_model, **{aid: pm for aid, (_, pm) in adapters.items()}}
    outputs: dict[int, list[list[int]]] = {}
    router = SchedDriver(ex, dirs, {})
    for aid, ref in refs.items():
        for j, prompt in enumerate(ps):
            rid = 100 * aid + j
            router.adapter_of[rid] = aid
            got = router.run({rid: (prompt, 10)})[rid]
            with torch.no_grad():
                assert got == hf_greedy(ref, prompt, 10), (aid, j)
            outputs.setdefault(aid, []).append(got)
    # The adapters change the output (so the comparisons above could fail).
    assert all(outputs[a] != outputs[b] for a in outputs for b in outputs if a < b)


def test_mixed_batch_matches_each_alone(executor_factory, dirs) -> None:
    ex = executor_factory()
    n = 16
    ps = prompts(n, ex.config.vocab_size, seed=7, lo=2, hi=30)
    adapter_of = {i: i % 4 for i in range(n)}  # base, A, B, C interleaved
    max_new = {i: 4 + i % 6 for i in range(n)}
    solo = SchedDriver(ex, dirs, adapter_of)
    alone = {i: solo.run({i: (p, max_new[i])})[i] for i, p in enumerate(ps)}

    router = SchedDriver(executor_factory(), dirs, adapter_of, max_num_batched_tokens=9)
    reqs = {i: (p, max_new[i]) for i, p in enumerate(ps)}
    together = router.run_staggered(reqs, {i: i // 3 for i in range(n)}, preempt=6)  # 6 uses adapter B
    assert router.mixed_steps > 0 and router.adapter_decode_steps > 0
    assert together == alone
    assert len({tuple(alone[i]) for i in range(4)}) == 4  # same-shaped requests, four different answers


def test_evicted_adapter_reloaded_on_other_pages_gives_the_same_tokens(executor_factory, dirs) -> None:
    ex = executor_factory()
    router = SchedDriver(ex, dirs, {1: 2, 2: 2})
    prompt = prompts(1, ex.config.vocab_size, seed=11, lo=12, hi=12)[0]
    first = router.run({1: (prompt, 8)})[1]
    old = router.evict(2)
    # The scheduler hands out the pages freed last first: the fillers' KV (at least 8 x 9 pages)
    # takes all of the adapter's old pages (64).
    filler = {10 + i: (p, 3) for i, p in enumerate(prompts(8, ex.config.vocab_size, seed=12, lo=33, hi=40))}
    for rid, (p, k) in filler.items():
        router.add(rid, p, k)
    router.step()
    used = {b for rid in filler for b in ex.requests[rid].block_table}
    assert used & set(old), "the filler's KV should land in the evicted adapter's pages"
    assert 2 not in ex.lora_pool.gpu and 2 not in ex.lora_pool.host
    # Loaded again while the fillers still hold those pages.
    again = router.run({2: (prompt, 8)})[2]
    assert not set(ex.lora_pool.gpu[2].block_ids) & set(old)
    assert again == first


def _snapshot(ex: Executor):
    pool = ex.lora_pool
    return (
        copy.deepcopy(ex.requests),
        sorted(pool.host),
        {a: g.block_ids for a, g in pool.gpu.items()},
        dict(pool.page_owner),
        dict(pool.slot_of),
        ex.kv.kv.clone(),
    )


def _same(a, b) -> bool:
    return a[:-1] == b[:-1] and torch.equal(a[-1], b[-1])


def test_bad_ops_are_plan_errors_that_change_nothing(executor_factory, dirs) -> None:
    ex = executor_factory()
    router = SchedDriver(ex, dirs, {1: 1})
    router.add(1, [4, 5, 6, 7, 8], 20)
    router.step()
    ops = [wire.VariantOp(2, wire.TierOp.TO_HOST, str(dirs[2]), [])]
    ex.step(wire.StepPlan(step_id=1000, adapter_ops=ops))  # B on host only
    ex.lora_pool.wait_host(2)
    a_pages, kv_page = router.adapter_pages(1), ex.requests[1].block_table[0]
    nb = router.info[2].num_blocks
    good = router.plan()  # request 1's next decode step
    held = {*a_pages, *ex.requests[1].block_table, *(b for r in good.running for b in r.new_block_ids)}
    free = [b for b in range(ex.num_blocks) if b not in held][:nb]

    def plan(*adapter_ops, new=(), running=None):
        return wire.StepPlan(
            step_id=good.step_id,
            new_requests=list(new),
            running=good.running if running is None else running,
            adapter_ops=list(adapter_ops),
        )

    def new_req(rid, aid, blocks):
        return wire.NewRequest(
            req_id=rid,
            token_ids=[3, 4, 5],
            num_prompt_tokens=3,
            num_computed_tokens=0,
            num_scheduled_tokens=3,
            block_ids=blocks,
            sampling=GREEDY,
            adapter_id=aid,
        )

    op = wire.VariantOp
    cases = [
        (plan(op(2, 9, "", [])), r"unknown op 9"),
        (
            plan(op(5, wire.TierOp.TO_GPU, "", free)),
            r"to_gpu adapter 5\): not in host memory \(a to_host must come first",
        ),
        (plan(op(2, wire.TierOp.TO_GPU, "", [ex.num_blocks] + free[1:])), r"outside the pool of \d+ blocks"),
        (plan(op(2, wire.TierOp.TO_GPU, "", [a_pages[0]] + free[1:])), r"hold adapter 1"),
        (plan(op(2, wire.TierOp.TO_GPU, "", [kv_page] + free[1:])), r"hold request KV"),
        (plan(op(2, wire.TierOp.TO_GPU, "", free[:-1])), rf"{nb - 1} block ids, the adapter needs {nb}"),
        (plan(op(2, wire.TierOp.TO_GPU, "", [free[0]] * nb)), r"repeated"),
        (plan(op(2, wire.TierOp.DROP_GPU, "", [])), r"drop_gpu adapter 2\): not on the GPU"),
        (plan(op(7, wire.TierOp.DROP_HOST, "", [])), r"drop_host adapter 7\): not in host memory"),
        (plan(op(1, wire.TierOp.TO_HOST, str(dirs[1]), [])), r"already in host memory"),
        (plan(op(1, wire.TierOp.TO_GPU, "", free)), r"already on the GPU"),
        (plan(op(0, wire.TierOp.TO_HOST, str(dirs[1]), [])), r"adapter id 0 is the base model"),
        (plan(new=[new_req(2, 2, [free[0]])]), r"request 2: adapter_id 2 is not on the GPU"),
        (plan(op(1, wire.TierOp.DROP_GPU, "", [])), r"request 1: adapter_id 1 is not on the GPU .*resident: none"),
        (plan(new=[new_req(2, 0, [a_pages[0]])]), r"request 2: KV block ids \[\d+\] hold adapter 1's weights"),
        # A valid op followed by a bad one: neither is applied.
        (plan(op(2, wire.TierOp.TO_GPU, "", free), op(9, wire.TierOp.DROP_GPU, "", [])), r"drop_gpu adapter 9"),
    ]
    for bad, match in cases:
        before = _snapshot(ex)
        with pytest.raises(PlanError, match=match):
            ex.step(bad)
        assert _same(before, _snapshot(ex)), match
    assert 2 not in ex.lora_pool.gpu

    # The good plan still works afterwards, with the adapter's delta.
    out = ex.step(good)
    router.apply(out)
    assert out.outputs[0].req_id == 1 and out.outputs[0].token_id is not None

    one = executor_factory(max_loras_per_step=1)
    r1 = SchedDriver(one, dirs, {1: 1, 2: 2})  # its scheduler allows 256 requests per step, so 256 adapters
    r1.add(1, [3, 4, 5], 1), r1.add(2, [3, 4, 5], 1)
    with pytest.raises(PlanError, match=r"2 distinct adapters in one step exceed --max-loras-per-step 1"):
        one.step(r1.plan())
    off = executor_factory(max_lora_rank=0)
    with pytest.raises(PlanError, match=r"LoRA is off on this worker \(--max-lora-rank 0\)"):
        off.step(wire.StepPlan(step_id=1, adapter_ops=[op(1, wire.TierOp.TO_HOST, str(dirs[1]), [])]))
    with pytest.raises(PlanError, match=r"adapter_id 1 is not on the GPU"):
        off.step(wire.StepPlan(step_id=1, new_requests=[new_req(1, 1, [0])]))


def test_loop_answers_inspect_and_a_failed_load_fails_that_variant_only(executor_factory, dirs, tmp_path: Path) -> None:
    from deltaserve.worker.loop import WorkerLoop

    ex = executor_factory()
    gone = tmp_path / "gone"
    shutil.copytree(dirs[1], gone)
    good_info = ex.inspect_variant(str(gone))
    frames = [
        wire.InspectVariant(inspect_id=41, path=str(gone)),
        wire.InspectVariant(inspect_id=42, path=str(tmp_path / "missing")),
        wire.StepPlan(step_id=1, adapter_ops=[wire.VariantOp(1, wire.TierOp.TO_HOST, str(dirs[1]), [])]),
    ]
    link = FakeLink([wire.encode(f) for f in frames])
    loop = WorkerLoop(ex, link)
    # Run until the link is drained (recv returns None; the parent is alive, so stop it by hand).
    loop.parent_alive = lambda: False  # type: ignore[method-assign]
    loop.run()
    _, info41, info42, out = link.sent
    assert isinstance(info41, wire.VariantInfo) and info41.inspect_id == 41 and info41.error is None
    assert info41.num_blocks == good_info.num_blocks > 0 and info41.host_bytes == good_info.host_bytes > 0
    assert isinstance(info42, wire.VariantInfo) and info42.inspect_id == 42 and "missing" in info42.error
    assert isinstance(out, wire.StepOutput) and out.adapter_host_bytes == info41.host_bytes

    # The directory vanishes after registration: the to_gpu that needs it fails that variant only
    # (issue 28). Its requests leave this step and the next one (sent before the router knew);
    # the base request beside them is served; the worker serves on.
    shutil.rmtree(gone)
    pages = list(range(good_info.num_blocks))

    def new(req_id: int, adapter_id: int, block: int) -> wire.NewRequest:
        return wire.NewRequest(
            req_id=req_id,
            token_ids=[3, 4],
            num_prompt_tokens=2,
            num_computed_tokens=0,
            num_scheduled_tokens=2,
            block_ids=[block],
            sampling=GREEDY,
            adapter_id=adapter_id,
        )

    def load() -> list[wire.VariantOp]:
        return [wire.VariantOp(3, wire.TierOp.TO_HOST, str(gone), []), wire.VariantOp(3, wire.TierOp.TO_GPU, "", pages)]

    frames = [
        wire.StepPlan(step_id=2, adapter_ops=load(), new_requests=[new(8, 3, 900), new(9, 0, 901)]),
        wire.StepPlan(step_id=3, running=[wire.RunningRequest(8, 1, []), wire.RunningRequest(9, 1, [])]),
        wire.StepPlan(step_id=4, released=[8], running=[wire.RunningRequest(9, 1, [])]),
        wire.Shutdown(reason="done"),
    ]
    link = FakeLink([wire.encode(f) for f in frames])
    assert WorkerLoop(ex, link).run() == 0
    _, out2, out3, out4 = link.sent
    assert all(isinstance(o, wire.StepOutput) for o in (out2, out3, out4)), link.sent
    assert [o.req_id for o in out2.outputs] == [9] and [f.variant_id for f in out2.failed_variants] == [3]
    message = out2.failed_variants[0].message
    assert "could not be loaded" in message and "gone" not in message and "Traceback" not in message
    assert [o.req_id for o in out3.outputs] == [9] and out3.failed_variants == []
    assert [o.req_id for o in out4.outputs] == [9] and 8 not in ex.requests

    # Registered again once its files are back (the router's next to_host): it serves.
    shutil.copytree(dirs[1], gone)
    again = wire.StepPlan(step_id=5, released=[9], adapter_ops=load(), new_requests=[new(10, 3, 902)])
    link = FakeLink([wire.encode(again), wire.encode(wire.Shutdown(reason="done"))])
    assert WorkerLoop(ex, link).run() == 0
    _, out5 = link.sent
    assert isinstance(out5, wire.StepOutput) and [o.req_id for o in out5.outputs] == [10], out5
    assert out5.failed_variants == []


def test_lora_settings(tiny_llama: Path, tmp_path: Path) -> None:
    # The defaults (256, 256 = --max-num-seqs) are the router's: ServerConfig's test checks them.
    cfg = validate(cpu_worker_config(tiny_llama, max_lora_rank=64, max_loras_per_step=32))
    assert (cfg.max_lora_rank, cfg.max_loras_per_step) == (64, 32) and MAX_LORA_RANK == MAX_RANK
    assert validate(cpu_worker_config(tiny_llama, max_lora_rank=0)).max_lora_rank == 0
    for bad, match in [
        ({"max_lora_rank": 257}, "max_lora_rank 257"),
        ({"max_lora_rank": -1}, "max_lora_rank -1"),
        ({"max_loras_per_step": 0}, "max_loras_per_step 0"),
    ]:
        with pytest.raises(ConfigError, match=match):
            validate(cpu_worker_config(tiny_llama, **bad))
    with pytest.raises(SystemExit):  # adapters arrive as ops, settings in the config frame: no flags
        parse_args(["--ipc-dir", str(tmp_path), "--loras", "{}"])
