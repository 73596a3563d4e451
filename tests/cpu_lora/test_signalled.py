"""The sync-free invocation (``helpers/signalled.py``) through ``Executor`` on the CPU, and a deferred
placement's failure.

On a CPU worker the signalled protocol runs over ``signal_op``'s host fallback: j frames, helpers
waiting on the SEQ word, the wait on DONE words, the watcher answering for a helper that dies,
fails or stalls. Checked: greedy tokens equal HF ``generate`` on the PEFT model, and each failure
is answered by the watcher with the right tokens, counted, and the helper restarted. A deferred
ToGpu that fails with the variant's ``AdapterLoadError`` quarantines that variant (its request ends
with the failure's message) while the worker and the other request go on. On a GPU (``gpu_kernels``):
the sync-free path is the default and its tokens equal PEFT's and the host-synchronised path's.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

import pytest
import torch
from worker.test_executor import FakeLink

from deltaserve import wire
from deltaserve.adapters.host_tier import AdapterLoadError
from deltaserve.helpers import assist as assist_mod
from deltaserve.helpers import protocol as p
from deltaserve.helpers import signal_op
from deltaserve.worker.loop import WorkerLoop
from helpers.executors import hf_greedy, make_executor, prompts
from helpers.sched_driver import GREEDY, SchedDriver

from .adapters import make_adapters

peft = pytest.importorskip("peft")


@pytest.fixture(scope="module")
def adapters(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, tuple[Path, torch.nn.Module]]:
    return make_adapters(tiny_llama, tmp_path_factory.mktemp("cpu_lora_signalled"), seed=40)


def _signalled_router(tiny_llama: Path, adapters):
    """A CPU executor with 2 helpers invoked the sync-free way, driven by the real scheduler."""
    ex = make_executor(tiny_llama, cpu_lora_helpers=2, cpu_lora_policy="always", max_deltas=0)
    assert ex.cpu_assist is not None and not ex.cpu_assist.sync_free, "CPU workers default to the host path"
    ex.cpu_assist.set_invocation("signal")
    ex.cpu_assist.pool.start()
    assert len(ex.cpu_assist.pool.wait_ready(30.0)) == 2
    try:
        yield SchedDriver(ex, {aid: d for aid, (d, _) in adapters.items()}, {})
    finally:
        ex.close()


@pytest.fixture(scope="module")
def router(tiny_llama: Path, adapters):
    yield from _signalled_router(tiny_llama, adapters)


@pytest.fixture
def fresh_router(tiny_llama: Path, adapters):
    """Its own helpers: which helper takes a short prompt depends on what the pool ran before."""
    yield from _signalled_router(tiny_llama, adapters)


def run_cold(router: SchedDriver, rid: int, aid: int, prompt: list[int], n: int = 5) -> list[int]:
    router.adapter_of[rid] = aid
    out = router.run({rid: (prompt, n)})[rid]
    router.evict(aid)
    return out


def totals(ex) -> tuple[int, int]:
    t = ex.cpu_assist.totals
    return t.assisted, t.fallbacks


def test_signalled_cold_prefills_match_peft(router, adapters) -> None:
    ex = router.ex
    seq0 = ex.cpu_assist.pool.seq
    before = totals(ex)
    for aid, (_, pm) in adapters.items():
        prompt = prompts(1, ex.config.vocab_size, seed=aid, lo=7, hi=20)[0]
        assert run_cold(router, 100 + aid, aid, prompt) == hf_greedy(pm, prompt, 5), aid
    after = totals(ex)
    assert (after[0] - before[0], after[1] - before[1]) == (2, 0)
    words = ex.cpu_assist.pool.words
    last = ex.cpu_assist.pool.seq
    assert last > seq0 and int(words[:, p.SEQ].max()) == last, "one number per (step, layer, module) job"


@pytest.mark.parametrize("failure", ["killed", "stalled"])
def test_watcher_answers_for_a_failed_helper(fresh_router, adapters, monkeypatch, failure) -> None:
    router = fresh_router
    ex = router.ex
    assist = ex.cpu_assist
    pool = assist.pool
    assert len(pool.wait_ready(30.0)) == 2
    monkeypatch.setattr(assist_mod, "MIN_JOB_TIMEOUT_S", 0.05)
    victim = pool.ready()[0]  # the first free helper: a short prompt gets only it
    pid = pool.pid(victim)
    sends = {"n": 0}
    send = assist._send_signalled

    def send_then_fail(*a):  # the helper fails once its second job is out
        sends["n"] += 1
        pending = send(*a)
        if sends["n"] == 2:
            os.kill(pid, signal.SIGKILL if failure == "killed" else signal.SIGSTOP)
        return pending

    monkeypatch.setattr(assist, "_send_signalled", send_then_fail)
    prompt = prompts(1, ex.config.vocab_size, seed=9, lo=11, hi=11)[0]
    before = totals(ex)
    try:
        got = run_cold(router, 200 + len(failure), 2, prompt)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    with torch.no_grad():
        assert got == hf_greedy(adapters[2][1], prompt, 5)
    after = totals(ex)
    assert (after[0] - before[0], after[1] - before[1]) == (1, 1)
    monkeypatch.undo()
    run_cold(router, 210 + len(failure), 1, prompt)  # the next cold prefill restarts it
    assert pool.pid(victim) not in (None, pid)


@pytest.mark.parametrize("fails", ["landing", "host_read"])
def test_a_failed_load_quarantines_only_its_variant(router, adapters, monkeypatch, fails) -> None:
    """``landing``: the deferred ToGpu fails after the helpers took the prefill (the variant is
    quarantined at the next step); ``host_read``: the host read failed before the decision (declined,
    and the normal ToGpu quarantines it in the same step)."""
    ex = router.ex
    lora = ex.lora_pool
    bad = 7 if fails == "landing" else 8  # fresh ids for adapter 1's files
    k = 9000 if fails == "landing" else 9100  # step ids
    path, pm = adapters[1]
    info = ex.inspect_variant(str(path))
    nb = ex.num_blocks
    pages = list(range(nb - 4 - info.num_blocks, nb - 4))
    name = "to_gpu" if fails == "landing" else "wait_host"
    real = getattr(lora, name)

    def failing(adapter_id, *args):
        if adapter_id == bad:
            raise AdapterLoadError(f"adapter {adapter_id}: its files changed")
        return real(adapter_id, *args)

    monkeypatch.setattr(lora, name, failing)

    def new(req_id: int, adapter_id: int, block: int) -> wire.NewRequest:
        return wire.NewRequest(
            req_id=req_id, token_ids=[3, 4, 5], num_prompt_tokens=3, num_computed_tokens=0,
            num_scheduled_tokens=3, block_ids=[block, block + 1], sampling=GREEDY, adapter_id=adapter_id,
        )  # fmt: skip

    load = [wire.VariantOp(bad, wire.TierOp.TO_HOST, str(path), []), wire.VariantOp(bad, wire.TierOp.TO_GPU, "", pages)]
    before, declined = totals(ex), ex.cpu_assist.totals.declined.get("host_failed", 0)
    frames = [
        wire.StepPlan(step_id=k + 2, adapter_ops=load, new_requests=[new(9000, bad, nb - 2), new(9001, 0, nb - 4)]),
        wire.StepPlan(step_id=k + 3, running=[wire.RunningRequest(9000, 1, []), wire.RunningRequest(9001, 1, [])]),
        wire.StepPlan(step_id=k + 4, released=[9000], running=[wire.RunningRequest(9001, 1, [])]),
        wire.Shutdown(reason="done"),
    ]
    link = FakeLink([wire.encode(f) for f in frames])
    assert WorkerLoop(ex, link).run() == 0, "the worker serves on"
    _, out2, out3, out4 = link.sent
    assert all(isinstance(o, wire.StepOutput) for o in (out2, out3, out4)), link.sent
    failed_at = out3 if fails == "landing" else out2
    if fails == "landing":
        assert totals(ex)[0] - before[0] == 1, "its prefill was assisted (the ToGpu deferred)"
        assert sorted(o.req_id for o in out2.outputs) == [9000, 9001] and out2.failed_variants == []
    else:
        assert ex.cpu_assist.totals.declined.get("host_failed", 0) == declined + 1
        assert [o.req_id for o in out2.outputs] == [9001]
    assert [o.req_id for o in out3.outputs] == [9001]
    assert [f.variant_id for f in failed_at.failed_variants] == [bad]
    assert "could not be loaded" in failed_at.failed_variants[0].message
    assert [o.req_id for o in out4.outputs] == [9001] and 9000 not in ex.requests
    assert bad not in lora.host_ids() and bad not in lora.gpu
    monkeypatch.undo()
    ex.step(wire.StepPlan(step_id=k + 5, released=[9001]))  # the link's last request ends


needs_op = pytest.mark.skipif(
    not torch.cuda.is_available() or signal_op.library() is None, reason="needs a CUDA device and the built op"
)


@pytest.mark.gpu_kernels
@needs_op
def test_sync_free_on_cuda_equals_peft_and_the_host_path(tiny_llama: Path, adapters) -> None:
    """On a GPU the default invocation is the sync-free one (the copy of x, the SEQ words and the wait
    on DONE queued on the stream): greedy tokens equal PEFT's and the host-synchronised path's; a
    stalled helper is answered by the watcher with the same tokens."""
    from deltaserve.worker.executor import Executor

    ex = Executor(
        tiny_llama, device="cuda", dtype="float32", block_size=4, kv_cache_bytes=64 << 20,
        cpu_lora_helpers=2, cpu_lora_policy="always", max_deltas=0,
    )  # fmt: skip
    try:
        assist = ex.cpu_assist
        assert assist is not None and assist.sync_free, "CUDA with the op built: sync-free by default"
        assist.pool.start()
        assert len(assist.pool.wait_ready(30.0)) == 2
        router = SchedDriver(ex, {aid: d for aid, (d, _) in adapters.items()}, {})
        prompt = prompts(1, ex.config.vocab_size, seed=3, lo=24, hi=24)[0]
        got: dict[str, list[list[int]]] = {}
        for invocation in ("signal", "host"):
            assist.set_invocation(invocation)
            got[invocation] = [run_cold(router, 300 + 10 * len(got) + aid, aid, prompt) for aid in adapters]
        with torch.no_grad():
            want = [hf_greedy(pm, prompt, 5) for _, pm in adapters.values()]
        assert got["signal"] == want and got["host"] == want
        assert assist.totals.assisted == 4 and assist.totals.fallbacks == 0
        assist.set_invocation("signal")
        pid = assist.pool.pid(assist.pool.ready()[0])
        os.kill(pid, signal.SIGSTOP)
        try:
            assert run_cold(router, 399, 2, prompt) == want[1]
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        assert assist.totals.fallbacks >= 1 and int(assist.failed[0]) == 0
    finally:
        ex.close()
