"""Chaos: twice the measured saturation, with admission control on (issue 28). One daemon on the
tiny model with ``--ttft-slo-ms``; nothing here asserts how fast anything is.

A closed loop of ``CONCURRENCY`` streaming clients for ``SATURATION_S`` measures the saturated
throughput (completed requests/s); then an open loop of Poisson arrivals at twice that rate runs
for ``OVERLOAD_S`` (5 s in CI; ``DELTASERVE_CHAOS_LONG=1`` runs the issue's 30 s). Every request
gets an answer, a 200 that completes or a 429 with ``Retry-After`` at once; some are refused;
nothing is left running afterwards. The figures (requests tried, status mix, admitted share,
max latency, admitted completions/s vs the saturated rate) are printed (``pytest -s``).
``bench/admission_overload.py`` (whose clients this reuses) measures SLO attainment and goodput.

Marked ``serial``: the saturation it measures must be the daemon's alone, not shared with a
parallel test's daemon, or twice it may not overload.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections import Counter

import httpx
import pytest

from bench.admission_overload import closed_loop, open_loop

from .daemons import Daemon, tiny_daemon_flags

pytestmark = pytest.mark.serial

LONG = os.environ.get("DELTASERVE_CHAOS_LONG") == "1"
CONCURRENCY = 16
SATURATION_S = 3.0
OVERLOAD_S = 30.0 if LONG else 5.0
PROMPT_LEN, MAX_TOKENS = 16, 32
TTFT_SLO_MS = 250


def _server_ttft(daemon) -> tuple[float, float]:
    """(first tokens within the SLO, all first tokens) by the daemon's TTFT histogram."""
    m = daemon.metrics()
    within = m[f'deltaserve_time_to_first_token_seconds_bucket{{le="{TTFT_SLO_MS / 1000}"}}']
    return within, m["deltaserve_time_to_first_token_seconds_count"]


@pytest.fixture(scope="module")
def daemon(tiny_llama):
    flags = tiny_daemon_flags(tiny_llama, 8192, "--ttft-slo-ms", str(TTFT_SLO_MS))
    with Daemon(tiny_llama, *flags) as d:
        yield d


def test_twice_the_saturation_gets_429s_with_retry_after_and_every_request_an_answer(daemon, tiny_llama):
    vocab = json.loads((tiny_llama / "config.json").read_text())["vocab_size"]
    warm = httpx.post(f"{daemon.url}/v1/completions", json={"prompt": "warm", "max_tokens": 8}, timeout=60)
    assert warm.status_code == 200, warm.text

    started = time.perf_counter()
    saturated = asyncio.run(closed_loop(daemon.url, CONCURRENCY, SATURATION_S, PROMPT_LEN, MAX_TOKENS, vocab))
    rate = sum(r.get("ok", False) for r in saturated) / (time.perf_counter() - started)
    assert rate > 0, saturated[:3]

    async def overload(rate: float):
        async with asyncio.timeout(OVERLOAD_S + 120):
            return await open_loop(daemon.url, 2 * rate, OVERLOAD_S, PROMPT_LEN, MAX_TOKENS, vocab)

    # On a shared 2-core machine the closed loop can underestimate the saturation (its clients
    # and the daemon compete for the cores): when the daemon kept up with twice it, refusing
    # nothing, it was not saturated; the rate it kept up with is the better measure, once.
    ttft_before = _server_ttft(daemon)
    tried: list[dict] = []
    for attempt in range(2):
        started = time.perf_counter()
        results = asyncio.run(overload(rate))
        tried += results
        took = time.perf_counter() - started
        admitted_rate = sum(r["status"] == 200 for r in results) / took
        if any(r["status"] == 429 for r in results) or attempt == 1:
            break
        print(f"\nchaos overload: nothing refused at {2 * rate:.1f} req/s; saturation taken as {admitted_rate:.1f}")
        rate = max(rate, admitted_rate)
    statuses = Counter(r["status"] for r in results)
    admitted = [r for r in results if r["status"] == 200]
    refused = [r for r in results if r["status"] == 429]
    slowest = max(r["end"] - r["start"] for r in results)
    ttfts = sorted(r["ttft_s"] for r in admitted if "ttft_s" in r) or [0.0]
    ttft_after = _server_ttft(daemon)
    served = ttft_after[1] - ttft_before[1]
    server_within = (ttft_after[0] - ttft_before[0]) / served if served else 1.0
    within = sum(t * 1000 <= TTFT_SLO_MS for t in ttfts) / len(ttfts)
    print(f"\nchaos overload: saturation {rate:.1f} req/s ({CONCURRENCY} clients); {len(results)} requests at "
          f"{2 * rate:.1f} req/s for {OVERLOAD_S:.0f} s (done in {took:.1f} s): status mix {dict(statuses)}, "
          f"admitted {len(admitted) / len(results):.0%}, max latency {slowest:.2f} s, admitted TTFT median "
          f"{ttfts[len(ttfts) // 2] * 1000:.0f} ms / max {ttfts[-1] * 1000:.0f} ms ({within:.0%} within the SLO; "
          f"{server_within:.0%} by the daemon's own TTFT histogram), "
          f"admitted completions {len(admitted) / took:.1f} req/s")  # fmt: skip
    every = Counter(r["status"] for r in tried)
    assert set(every) <= {200, 429}, every  # an answer for every request, never a 5xx
    assert all(r.get("ok") for r in tried if r["status"] == 200)
    assert all(r.get("ok") for r in admitted), [r for r in admitted if not r.get("ok")][:3]
    assert refused, "twice the saturation should refuse some requests"
    assert all(r["retry_after"] and int(r["retry_after"]) >= 1 for r in refused), refused[:3]
    m = daemon.metrics()
    assert m["deltaserve_requests_running"] == 0 and m["deltaserve_requests_waiting"] == 0, m
