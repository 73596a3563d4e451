"""``bench/prefix_caching.py``'s TTFT split: the trials' client TTFT set against the worker's step
and the router's TTFT, from the daemon's ``/metrics`` before and after them."""

from __future__ import annotations

import pytest

from bench.prefix_caching import first_difference, router_speedup, top2_gap, ttft_split


def test_split_takes_each_counter_and_histogram_over_the_trials() -> None:
    before = {
        "deltaserve_steps_total": 10.0,
        "deltaserve_worker_busy_us_total": 50_000.0,
        "deltaserve_worker_forward_us_total": 40_000.0,
        "deltaserve_worker_floor_us_total": 20_000.0,
        "deltaserve_time_to_first_token_seconds_sum": 1.0,
        "deltaserve_time_to_first_token_seconds_count": 10.0,
    }
    after = {
        "deltaserve_steps_total": 14.0,
        "deltaserve_worker_busy_us_total": 74_000.0,  # 6 ms a step
        "deltaserve_worker_forward_us_total": 63_200.0,
        "deltaserve_worker_floor_us_total": 33_200.0,
        "deltaserve_time_to_first_token_seconds_sum": 1.028,  # 7 ms a request
        "deltaserve_time_to_first_token_seconds_count": 14.0,
    }
    split = ttft_split(before, after, [0.0075, 0.0085, 0.0080, 0.0080])
    assert split == pytest.approx(
        {
            "steps_per_request": 1.0,
            "client_ttft_ms": 8.0,
            "router_ttft_ms": 7.0,
            "worker_busy_ms": 6.0,
            "worker_forward_ms": 5.8,
            "worker_floor_ms": 3.3,
            "outside_step_ms": 2.0,
        }
    )


@pytest.mark.parametrize(
    "before,after",
    [(None, {}), ({}, None), ({}, {}), ({"deltaserve_steps_total": 3.0}, {"deltaserve_steps_total": 3.0})],
)
def test_no_metrics_or_no_steps_give_no_split(before, after) -> None:
    assert ttft_split(before, after, [0.01]) is None


def test_first_difference_and_the_gap_there() -> None:
    assert first_difference(["a", "b", "c"], ["a", "b", "c"]) is None
    assert first_difference(["a", "b", "c"], ["a", "x", "c"]) == 1
    assert first_difference(["a", "b"], ["a", "b", "c"]) == 2
    lp = {"tokens": ["a", "b"], "top_logprobs": [{"a": -0.1, "z": -3.0}, {"b": -1.0, "x": -1.002}]}
    assert top2_gap(lp, 1) == pytest.approx(0.002)
    assert top2_gap(lp, 2) is None  # past the completion


def test_router_speedup_compares_the_router_clocks() -> None:
    cached = {"router_ttft_ms": 6.5, "client_ttft_ms": 7.5}
    uncached = {"router_ttft_ms": 26.0, "client_ttft_ms": 27.0}
    assert router_speedup(cached, uncached) == pytest.approx(4.0)
    assert router_speedup(None, uncached) is None and router_speedup(cached, None) is None
