"""The profile-driven decision (``helpers/model.py``): T_max, helpers per cold prefill, the adaptive rule."""

from __future__ import annotations

from deltaserve.helpers.model import BUDGET_MS, AssistModel, AssistStats


def test_t_max_and_helpers_follow_the_profile() -> None:
    m = AssistModel(load_bytes_per_ms=1e6, macs_per_ms=1e6)
    macs_per_token = 50_000  # e.g. rank 8 on q, v of a 64-wide model over 2 layers... any per-token work
    t_max = m.t_max(macs_per_token)
    assert t_max == int(BUDGET_MS * 1e6 / macs_per_token) == 400
    assert [m.helpers_for(t, macs_per_token) for t in (1, 400, 401, 1200)] == [1, 1, 2, 3]
    assert AssistModel(1e6).t_max(macs_per_token) == 1, "no profile yet: one token per helper"


def test_adaptive_rule_compares_cpu_time_with_the_load() -> None:
    m = AssistModel(load_bytes_per_ms=1e6, macs_per_ms=1e6, overhead_ms=0.1)
    cpu = m.cpu_ms(tokens=100, helpers=2, macs_per_token=10_000, jobs=8)
    assert cpu == 8 * 0.1 + 50 * 10_000 / 1e6
    assert m.load_ms(10_000_000) == 10.0 > cpu  # a 10 MB load hides 1.3 ms of CPU LoRA: assist
    assert m.load_ms(100_000) < cpu  # a small adapter loads faster: no assist
    assert AssistModel(1e6).cpu_ms(10, 1, 1, 1) == float("inf"), "never assist before a helper profiled"


def test_stats_count_and_reset() -> None:
    s = AssistStats()
    s.assisted += 2
    s.decline("slower")
    s.decline("slower", 2)
    taken = s.take()
    assert (taken.assisted, taken.declined) == (2, {"slower": 3})
    assert (s.assisted, s.fallbacks, s.declined) == (0, 0, {})


def test_overhead_is_learned() -> None:
    m = AssistModel(1e6, macs_per_ms=1e6, overhead_ms=0.0)
    for _ in range(50):
        m.observe(measured_ms=2.0, predicted_compute_ms=1.0)
    assert 0.9 < m.overhead_ms <= 1.0
