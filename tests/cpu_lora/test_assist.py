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
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from deltaserve.helpers import assist as assist_mod
from helpers.executors import hf_greedy, make_executor, prompts
from helpers.sched_driver import SchedDriver

from .adapters import make_adapters

peft = pytest.importorskip("peft")


@pytest.fixture(scope="module")
def adapters(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, tuple[Path, torch.nn.Module]]:
    return make_adapters(tiny_llama, tmp_path_factory.mktemp("cpu_lora"), seed=20)


@pytest.fixture(scope="module")
def router(tiny_llama: Path, adapters):
    ex = make_executor(tiny_llama, cpu_lora_helpers=2, cpu_lora_policy="always", max_deltas=0)
    assert ex.cpu_assist is not None
    ex.cpu_assist.pool.start()
    assert len(ex.cpu_assist.pool.wait_ready(30.0)) == 2
    yield SchedDriver(ex, {aid: d for aid, (d, _) in adapters.items()}, {})
    ex.close()


def totals(ex) -> Counts:
    """The executor's assist decisions since start-up (each StepOutput carried its share)."""
    t = ex.cpu_assist.totals
    return Counts(t.assisted, t.fallbacks)


@dataclass
class Counts:
    assisted: int
    fallbacks: int

    def __sub__(self, other: Counts) -> Counts:
        return Counts(self.assisted - other.assisted, self.fallbacks - other.fallbacks)


def run_cold(router: SchedDriver, rid: int, aid: int, prompt: list[int], n: int = 6) -> list[int]:
    """Request ``rid`` on adapter ``aid``, cold: registered now, evicted after."""
    router.adapter_of[rid] = aid
    out = router.run({rid: (prompt, n)})[rid]
    router.evict(aid)
    return out


def test_cold_prefills_on_helpers_match_peft(router, adapters) -> None:
    ex = router.ex
    ps = prompts(2, ex.config.vocab_size, seed=5, lo=6, hi=24)
    before = totals(ex)
    for aid, (_, pm) in adapters.items():
        for j, prompt in enumerate(ps):
            got = run_cold(router, 10 * aid + j, aid, prompt)
            with torch.no_grad():
                assert got == hf_greedy(pm, prompt, 6), (aid, j)
    stats = totals(ex) - before
    assert stats.assisted == 4 and stats.fallbacks == 0, stats


def test_adaptive_policy_assists_only_when_the_load_is_slower(router, adapters) -> None:
    ex = router.ex
    assist = ex.cpu_assist
    prompt = prompts(1, ex.config.vocab_size, seed=6, lo=9, hi=9)[0]
    load_bw = assist.model.load_bytes_per_ms
    assist.policy = "adaptive"
    try:
        assist.model.load_bytes_per_ms = 1e15  # loads are instant: CPU assist cannot win
        before = assist.totals.declined.get("slower", 0), totals(ex)
        assert run_cold(router, 400, 1, prompt) == hf_greedy(adapters[1][1], prompt, 6)
        assert assist.totals.declined.get("slower", 0) == before[0] + 1 and (totals(ex) - before[1]).assisted == 0
        assist.model.load_bytes_per_ms = 1e-3  # loads take forever: assist
        before = assist.totals.declined.get("slower", 0), totals(ex)
        assert run_cold(router, 401, 1, prompt) == hf_greedy(adapters[1][1], prompt, 6)
        assert (totals(ex) - before[1]).assisted == 1
    finally:
        assist.policy, assist.model.load_bytes_per_ms = "always", load_bw


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
    before = totals(ex)
    restarts = pool.restarts
    got = run_cold(router, 500, 2, prompt)
    with torch.no_grad():
        assert got == hf_greedy(adapters[2][1], prompt, 6)
    stats = totals(ex) - before
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
        before = totals(ex)
        got = run_cold(router, 600, 1, prompt)
    finally:
        with contextlib.suppress(ProcessLookupError):  # killed and reaped by the pool, normally
            os.kill(pid, signal.SIGCONT)
    with torch.no_grad():
        assert got == hf_greedy(adapters[1][1], prompt, 6)
    stats = totals(ex) - before
    assert stats.fallbacks == 1, stats
    assert pool.pid(stalled) != pid  # killed, and started again (or to be, at the next cold prefill)
