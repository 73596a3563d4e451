"""Where a measured request's time to first token went, from the client's records
(``bench/replay.py``) and the worker's step recording (``deltaserve.sim.record``) on one clock
(``time.perf_counter`` and ``time.monotonic`` are both CLOCK_MONOTONIC on Linux), and the same
split of a simulated run (``deltaserve.sim.SimResult``)::

    wait     client send -> the worker receiving the first plan that schedules it (HTTP, the
             engine's queue, waiting for a step to be formed, the plan's trip)
    steps    that plan's arrival -> the output carrying its first token leaving the worker
    deliver  that output leaving -> the client seeing the token (router, stream, socket, client)

A client record is matched to the daemon's request id by (prompt length, variant id) in arrival
order (the router numbers requests as they arrive; the harness registers variants in trace
order, so variant ``i`` of the trace is id ``i + 1``), or by arrival order alone when the keys do
not match (a tokenizer that adds tokens).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np


class StartClock:
    """Stands in for ``bench.replay``'s ``time`` module during one replay and keeps its first
    ``perf_counter`` reading: ``replay`` takes it as ``start - lead_s`` (its trace's time 0 minus
    the lead), before any request is sent."""

    def __init__(self) -> None:
        self.first: float | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)

    def perf_counter(self) -> float:
        t = time.perf_counter()
        if self.first is None:
            self.first = t
        return t


def first_tokens(steps: list[dict[str, Any]]) -> dict[int, dict[str, float | int]]:
    """Request id -> ``prompt_len``, ``variant``, ``planned`` (when the worker received the first
    plan scheduling it) and ``first_out`` (when the output of the step completing its prompt
    left the worker)."""
    out: dict[int, dict[str, float | int]] = {}
    done: dict[int, int] = {}
    for s in steps:
        for rid, n, computed, prompt_len, variant in s["new"]:  # a preempted request comes again
            if rid not in out:
                out[rid] = {"prompt_len": prompt_len, "variant": variant, "planned": s["recv"]}
            done[rid] = computed + n
        for rid, n in s["running"]:
            if rid in done:
                done[rid] += n
        for rid in [r for r, d in done.items() if d >= out[r]["prompt_len"]]:
            out[rid].setdefault("first_out", s["sent"])
            del done[rid]
    return out


def match(records: list[Any], variant_id: Callable[[str], int],
          requests: Mapping[int, Mapping[str, Any]]) -> list[tuple[Any, int]]:  # fmt: skip
    """``(record, request id)`` pairs of the completed client records (module docstring);
    ``requests`` is :func:`first_tokens`' of the ids the worker saw from this replay."""
    recs = sorted((r for r in records if r.error is None and r.ttft is not None), key=lambda r: r.sent)
    by_key: dict[tuple[int, int], list[int]] = defaultdict(list)
    for rid in sorted(requests):
        by_key[(int(requests[rid]["prompt_len"]), int(requests[rid]["variant"]))].append(rid)
    pairs, used = [], {k: 0 for k in by_key}
    for r in recs:
        key = (r.prompt_len, variant_id(r.variant))
        if used.get(key, 0) < len(by_key.get(key, [])):
            pairs.append((r, by_key[key][used[key]]))
            used[key] += 1
    if len(pairs) < 0.9 * len(recs):  # keys differ: arrival order alone
        ids = sorted(requests)
        pairs = list(zip(recs, ids)) if len(ids) == len(recs) else []
    return pairs


def measured_split(records: list[Any], start: float, steps: list[dict[str, Any]],
                   variant_id: Callable[[str], int]) -> dict[str, Any]:  # fmt: skip
    """The mean (and median) wait / steps / deliver of one replay's requests (module docstring),
    with ``matched`` (requests placed on the worker's timeline) and each matched request's parts
    under ``per_request`` as ``[index, sent, wait, steps, deliver]`` (absolute ``sent``)."""
    t_lo = start + min((r.sent for r in records if r.sent == r.sent), default=0.0)
    window = [s for s in steps if s["recv"] >= t_lo - 1e-3]
    seen = first_tokens(window)
    pairs = match(records, variant_id, seen)
    rows = []
    for r, rid in pairs:
        q = seen[rid]
        if "first_out" not in q:
            continue
        sent = start + r.sent
        rows.append([r.i, sent, q["planned"] - sent, q["first_out"] - q["planned"], sent + r.ttft - q["first_out"]])
    return {"matched": len(rows), "of": len(records), **_means(np.array([x[2:] for x in rows]).reshape(-1, 3)),
            "per_request": rows}  # fmt: skip


def simulated_split(arrival_s: np.ndarray, scheduled_s: np.ndarray, first_token_s: np.ndarray,
                    router_gap_s: float, deliver_s: float) -> dict[str, Any]:  # fmt: skip
    """The same split of simulated requests: wait to the plan reaching the worker
    (``scheduled_s + router_gap_s``), steps to the output leaving it, deliver ``deliver_s``."""
    ok = ~np.isnan(first_token_s)
    planned = scheduled_s[ok] + router_gap_s
    out = first_token_s[ok] - deliver_s
    parts = np.stack([planned - arrival_s[ok], out - planned, np.full(int(ok.sum()), deliver_s)], axis=1)
    return {"matched": int(ok.sum()), "of": len(arrival_s), **_means(parts)}


def _means(parts: np.ndarray) -> dict[str, Any]:
    if len(parts) == 0:
        return {"mean_s": None, "median_s": None}
    names = ("wait", "steps", "deliver")
    return {"mean_s": {n: float(v) for n, v in zip(names, parts.mean(axis=0))},
            "median_s": {n: float(v) for n, v in zip(names, np.median(parts, axis=0))}}  # fmt: skip
