"""``bench/http_trip.py``'s row: a client form's mean TTFT set against the router's histogram over
the same requests."""

from __future__ import annotations

import pytest

from bench.http_trip import trip_row


def test_trip_is_the_client_mean_less_the_router_mean_over_the_same_requests() -> None:
    before = {"deltaserve_time_to_first_token_seconds_sum": 2.0, "deltaserve_time_to_first_token_seconds_count": 5.0}
    after = {"deltaserve_time_to_first_token_seconds_sum": 2.024, "deltaserve_time_to_first_token_seconds_count": 8.0}
    row = trip_row("stream", [0.0085, 0.0090, 0.0095], before, after)
    assert row == pytest.approx(
        {"form": "stream", "requests": 3, "client_ttft_ms": 9.0, "router_ttft_ms": 8.0, "trip_ms": 1.0}
    )
