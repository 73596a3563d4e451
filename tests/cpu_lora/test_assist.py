"""CPU-assisted cold prefills through ``Executor`` (``deltaserve.helpers``), against PEFT.

One executor with two helpers (policy ``always``) serves PEFT adapters made by ``peft`` on the tiny
Llama. Every request's adapter is cold (evicted after each request, so its ToGpu comes with its
prefill): the helpers compute the prefill's LoRA while the pages load, and the next step's decode
runs on the normal path. Checked: greedy tokens equal HF ``generate`` on the PEFT model, prefills
were assisted; a helper killed mid-prefill and a stalled helper: the request still gets the right
tokens, the fallback is counted and a new helper starts.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

import pytest
import torch

from deltaserve.helpers import assist as assist_mod
from helpers.executors import hf_greedy, make_executor, prompts
from helpers.peft_adapters import SEVEN, make_peft_adapter
from helpers.sched_driver import SchedDriver

peft = pytest.importorskip("peft")

SPECS = {
    1: dict(target_modules=["q_proj", "v_proj"], r=8, lora_alpha=16),
    2: dict(target_modules=SEVEN, r=16, lora_alpha=8, use_rslora=True),
}


@pytest.fixture(scope="module")
def adapters(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, tuple[Path, torch.nn.Module]]:
    root = tmp_path_factory.mktemp("cpu_lora")
    return {
        aid: make_peft_adapter(tiny_llama, root / f"a{aid}", seed=20 + aid, **kw)[::-1] for aid, kw in SPECS.items()
    }


@pytest.fixture(scope="module")
def router(tiny_llama: Path, adapters):
    ex = make_executor(tiny_llama, cpu_lora_helpers=2, cpu_lora_policy="always", max_deltas=0)
    assert ex.cpu_assist is not None
    ex.cpu_assist.pool.start()
    assert len(ex.cpu_assist.pool.wait_ready(30.0)) == 2
    yield SchedDriver(ex, {aid: d for aid, (d, _) in adapters.items()}, {})
    ex.close()


def run_cold(router: SchedDriver, rid: int, aid: int, prompt: list[int], n: int = 6) -> list[int]:
    """Request ``rid`` on adapter ``aid``, cold: registered now, evicted after."""
    router.adapter_of[rid] = aid
    out = router.run({rid: (prompt, n)})[rid]
    router.evict(aid)
    return out


def test_cold_prefills_on_helpers_match_peft(router, adapters) -> None:
    ex = router.ex
    ps = prompts(2, ex.config.vocab_size, seed=5, lo=6, hi=24)
    ex.take_assist_stats()
    for aid, (_, pm) in adapters.items():
        for j, prompt in enumerate(ps):
            got = run_cold(router, 10 * aid + j, aid, prompt)
            with torch.no_grad():
                assert got == hf_greedy(pm, prompt, 6), (aid, j)
    stats = ex.take_assist_stats()
    assert stats.assisted == 4 and stats.fallbacks == 0, stats


def test_helper_killed_mid_prefill_falls_back_and_restarts(router, adapters, monkeypatch) -> None:
    ex = router.ex
    pool = ex.cpu_assist.pool
    prompt = prompts(1, ex.config.vocab_size, seed=7, lo=12, hi=12)[0]
    victim = pool.ready()[0]
    pid = pool.pid(victim)
    calls = {"n": 0}
    wait = pool.wait

    def wait_killing(jobs, deadline):  # kill the helper once its second job is out
        calls["n"] += 1
        if calls["n"] == 2 and victim in jobs:
            os.kill(pid, signal.SIGKILL)
        return wait(jobs, deadline)

    monkeypatch.setattr(pool, "wait", wait_killing)
    ex.take_assist_stats()
    restarts = pool.restarts
    got = run_cold(router, 500, 2, prompt)
    with torch.no_grad():
        assert got == hf_greedy(adapters[2][1], prompt, 6)
    stats = ex.take_assist_stats()
    assert calls["n"] >= 2 and stats.assisted == 1 and stats.fallbacks == 1, stats
    monkeypatch.undo()
    # The next cold prefill starts a fresh helper in its place.
    run_cold(router, 501, 1, prompt)
    assert pool.restarts == restarts + 1 and pool.pid(victim) not in (None, pid)


def test_stalled_helper_times_out_with_correct_tokens(router, adapters, monkeypatch) -> None:
    ex = router.ex
    pool = ex.cpu_assist.pool
    assert len(pool.wait_ready(30.0)) == 2
    monkeypatch.setattr(assist_mod, "MIN_JOB_TIMEOUT_S", 0.05)
    prompt = prompts(1, ex.config.vocab_size, seed=8, lo=10, hi=10)[0]
    stalled = pool.ready()[0]  # the first free helper: a short prompt gets one
    pid = pool.pid(stalled)
    os.kill(pid, signal.SIGSTOP)
    try:
        ex.take_assist_stats()
        got = run_cold(router, 600, 1, prompt)
    finally:
        with contextlib.suppress(ProcessLookupError):  # killed and reaped by the pool, normally
            os.kill(pid, signal.SIGCONT)
    with torch.no_grad():
        assert got == hf_greedy(adapters[1][1], prompt, 6)
    stats = ex.take_assist_stats()
    assert stats.fallbacks == 1, stats
    assert pool.pid(stalled) != pid  # killed, and started again (or to be, at the next cold prefill)
