"""bench/replay.py against bench/fake_server.py with known latencies: TTFT, TPOT, throughput and
SLO attainment come out as scheduled, errors are recorded, and every request of an open loop at 5×
the highest rate the serving experiments use completes (how closely the client keeps to that
schedule is a wall-clock figure: bench/replay_capacity.py measures it).

Timing tolerances: the fake server writes token k of a request at received + ttft + k·tpot
(absolute times, so delays never accumulate). A client can never see a token before the server
writes it, so every measured TTFT is ≥ the scripted one (lower bounds are exact); above it, the
only addition is local socket + event-loop latency, ~1–2 ms measured here, bounded at 40 ms
(JITTER) for a loaded 2-core CI machine. TPOT = (e2e − ttft)/(n − 1) divides the difference of two
such jitters by n − 1, so it gets JITTER / (n − 1).

Interruption: a replay cancelled partway keeps the records of the requests it sent (completed ones
exact, those in flight marked interrupted and not completed), and serving.run() interrupted by
SIGINT or SIGTERM during a point writes that point to the result file before it re-raises."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import threading
import time

import numpy as np
import pytest

from bench import replay as rp
from bench import replay_capacity as capacity
from bench import serving
from bench import workload as wl
from bench.common import SMOKE_SHAPE
from bench.fake_server import FakeServer
from bench.serving import runner

JITTER = 0.040
EARLY = 0.001
"""How much earlier than the fake server's scheduled latency a time may be measured: the server sleeps
on its event loop's timer, and a CI run (stop 36's, this 2-core machine) once measured a first token
16 µs before its scheduled 50 ms. The bounds above a latency stay JITTER."""

# The latency checks above hold on an idle core, not beside other test processes: `make test` runs
# this module after the parallel ones, alone (see the `serial` marker in pyproject.toml).
pytestmark = pytest.mark.serial


def trace_of(rows: list[tuple[float, str, int]], kind: str = "lora") -> wl.Trace:
    """A hand-made trace: (arrival s, variant, output tokens) per request, 4-token prompts;
    variants of ``kind`` (rank-8 LoRA adapters, or full fine-tunes)."""
    names = sorted({v for _, v, _ in rows})
    return wl.Trace(
        params={"kind": "test"},
        variants=[wl.Variant(name=n, kind=kind, rank=8 if kind == "lora" else None) for n in names],
        requests=[
            wl.Request(i=i, t=t, variant=v, prompt=[5, 6, 7, 8], output_len=n) for i, (t, v, n) in enumerate(rows)
        ],
    )


# ---------------------------------------------------------------------------------------------
# Metrics, on hand-made records: exact


def test_summarize_exact():
    def rec(i, sched, sent, ttft, e2e, n, chunks, error=None):
        return rp.Record(i=i, variant="a", prompt_len=10, output_len=n, scheduled=sched, sent=sent, ttft=ttft,
                         e2e=e2e, n_out=n, chunk_times=chunks, status=200, error=error)  # fmt: skip

    records = [
        rec(0, 0.0, 0.001, 1.0, 2.0, 11, [1.0, 1.5, 2.0]),  # tpot 0.1
        rec(1, 1.0, 1.002, 2.0, 6.0, 5, [2.0, 6.0]),  # tpot 1.0, ends at 7.002
        rec(2, 2.0, 2.0, 7.0, 8.0, 3, [7.0, 8.0]),  # tpot 0.5, ends at 10.0 (last)
        rec(3, 3.0, 3.004, 0.5, 0.5, 1, [0.5]),  # one token: no tpot
        rec(4, 4.0, 4.0, None, None, 0, [], error="internal_error: boom"),
    ]
    s = rp.summarize(records, slo_ttft=1.5, slo_tpot=0.6)
    assert (s["requests"], s["completed"], s["failed"]) == (5, 4, 1)
    assert s["makespan_s"] == 10.0
    assert s["throughput_req_s"] == 4 / 10.0
    assert s["throughput_out_tok_s"] == (11 + 5 + 3 + 1) / 10.0
    # numpy linear interpolation over [0.5, 1, 2, 7]: p90 at rank 2.7 = 2 + 0.7 * 5 (float rounding only).
    assert s["ttft_s"] == pytest.approx({"mean": 10.5 / 4, "p50": 1.5, "p90": 5.5, "p99": 6.85}, rel=1e-12)
    assert s["tpot_s"]["p50"] == 0.5 and s["tpot_s"]["mean"] == pytest.approx(1.6 / 3)
    assert s["e2e_s"]["p50"] == 4.0
    assert s["inter_chunk_s"]["p50"] == 0.75 and s["inter_chunk_s"]["mean"] == 1.5  # gaps 0.5, 0.5, 4, 1
    assert s["client_lag_s"]["max"] == pytest.approx(0.004)
    # TTFT ≤ 1.5: requests 0 and 3; TPOT ≤ 0.6: 0, 2, 3 (3 has one token); the failure misses both.
    assert s["slo"] == {"ttft_s": 1.5, "tpot_s": 0.6, "ttft_attainment": 2 / 5, "tpot_attainment": 3 / 5,
                        "attainment": 2 / 5}  # fmt: skip
    assert s["errors"] == {"200: internal_error: boom": 1}
    assert rp.summarize(records)["slo"]["ttft_attainment"] == 3 / 5  # S-LoRA's 6 s: not request 2 (7 s)
    assert records[1].row()["tpot"] == 1.0 and "chunk_times" not in records[1].row()


# ---------------------------------------------------------------------------------------------
# Against the fake server


LATENCY = {"fast": (0.05, 0.010), "slow": (0.30, 0.020)}


@pytest.fixture(scope="module")
def fake():
    errors = {"missing": (404, "the model `missing` does not exist; GET /v1/models lists them")}
    with FakeServer(per_model=LATENCY, errors=errors, fail_after={"broken": 3}) as s:
        yield s


@pytest.mark.parametrize("protocol", rp.PROTOCOLS)
def test_known_latencies(fake, protocol):
    rows = [(0.1 * i, "fast" if i % 3 else "slow", 12 + i % 5) for i in range(18)]
    trace = trace_of(rows)
    records = rp.run_replay(trace, fake.url, protocol=protocol, ws_url=fake.ws_url)
    for r in records:
        ttft, tpot = LATENCY[r.variant]
        assert r.error is None, r
        assert r.n_out == r.output_len
        assert ttft - EARLY <= r.ttft <= ttft + JITTER, r
        assert r.tpot == pytest.approx(tpot, abs=JITTER / (r.n_out - 1)), r
        assert r.e2e == pytest.approx(ttft + (r.n_out - 1) * tpot, abs=JITTER)
        assert r.lag < JITTER
        if protocol == "ws":  # one message per token: the gaps are the scripted tpot
            assert len(r.chunk_times) == r.n_out
    s = rp.summarize(records, slo_ttft=0.15, slo_tpot=0.015)
    # The SLOs split fast (ttft 0.05, tpot 0.01) from slow (0.3, 0.02) with wide margins: exact.
    fast = sum(r.variant == "fast" for r in records) / len(records)
    assert s["slo"]["ttft_attainment"] == s["slo"]["tpot_attainment"] == s["slo"]["attainment"] == fast == 12 / 18
    # The last request to end decides the makespan (measured from trace time 0).
    end = max(t + LATENCY[v][0] + (n - 1) * LATENCY[v][1] for t, v, n in rows)
    assert s["makespan_s"] == pytest.approx(end, abs=JITTER)
    assert s["throughput_req_s"] == pytest.approx(18 / end, rel=JITTER / end)
    assert s["output_tokens"] == sum(n for _, _, n in rows)
    assert s["output_len_mismatch"] == 0


@pytest.mark.parametrize("protocol", rp.PROTOCOLS)
def test_errors_are_recorded(fake, protocol):
    trace = trace_of([(0.0, "fast", 5), (0.01, "missing", 5), (0.02, "broken", 8), (0.03, "fast", 5)])
    records = rp.run_replay(trace, fake.url, protocol=protocol, ws_url=fake.ws_url)
    ok, missing, broken, ok2 = records
    assert ok.error is None and ok2.error is None
    assert "does not exist" in missing.error and missing.e2e is None
    if protocol == "sse":
        assert missing.status == 404
    assert "scripted failure after 3 tokens" in broken.error and broken.e2e is None
    assert len(broken.chunk_times) == 3
    s = rp.summarize(records)
    assert (s["completed"], s["failed"]) == (2, 2)
    assert s["slo"]["ttft_attainment"] == 0.5  # failures are misses
    assert sum(s["errors"].values()) == 2


def test_unreachable_server_is_an_error_not_a_hang():
    trace = trace_of([(0.0, "fast", 3)])
    (r,) = rp.run_replay(trace, "http://127.0.0.1:9", protocol="sse", timeout_s=5)  # port 9: discard
    assert r.error is not None and r.e2e is None


def test_client_completes_five_times_the_highest_rate():
    """Open loop at 5× the highest experiment rate (bench/replay_capacity.py's workload) against a
    zero-delay fake server in its own process: every request completes with its full output and
    nothing is recorded twice or lost. How closely the client keeps to the schedule (send lag,
    throughput vs offered rate) is wall-clock and machine-dependent: bench/replay_capacity.py
    measures it and writes its JSON to bench/results/."""
    trace = capacity.capacity_trace(factor=5.0, duration=3.0, seed=9)
    assert len(trace.requests) / trace.duration > 0.8 * 5 * serving.MAX_RATE
    records, _ = capacity.run_capacity(trace, protocol="sse")
    s = rp.summarize(records)
    assert s["failed"] == 0 and s["output_len_mismatch"] == 0, s["errors"]
    assert s["requests"] == s["completed"] == len(trace.requests)
    assert sorted(r.i for r in records) == [q.i for q in trace.requests]
    by_i = {q.i: q for q in trace.requests}
    for r in records:
        assert r.n_out == r.output_len == by_i[r.i].output_len, r
        assert r.sent >= r.scheduled, r  # never sent early
    assert np.isfinite(s["ttft_s"]["p99"]) and s["throughput_out_tok_s"] > 0


# ---------------------------------------------------------------------------------------------
# Interruption


def test_summarize_interrupted_exact():
    """An interrupted replay's makespan ends at the interruption when requests were in flight;
    interrupted requests are failures (not completed, SLO misses) whatever they received."""

    def rec(i, sched, ttft, e2e, n, chunks, stopped=None):
        return rp.Record(i=i, variant="a", prompt_len=10, output_len=n, scheduled=sched, sent=sched, ttft=ttft,
                         e2e=e2e, n_out=n if stopped is None else 0, chunk_times=chunks, status=200,
                         error=None if stopped is None else rp.INTERRUPTED, interrupted_at=stopped)  # fmt: skip

    done = [rec(0, 0.5, 0.5, 1.0, 3, [0.5, 0.75, 1.0]), rec(1, 1.0, 1.0, 2.0, 5, [1.0, 2.0])]  # end 1.5, 3.0
    stuck = [rec(2, 1.5, 0.5, None, 4, [0.5], stopped=4.5), rec(3, 2.0, None, None, 4, [], stopped=4.5)]
    s = rp.summarize(done + stuck, slo_ttft=1.5)
    assert (s["requests"], s["completed"], s["failed"], s["interrupted"]) == (4, 2, 2, 2)
    assert s["makespan_s"] == 4.0  # first scheduled send (0.5) to the interruption (4.5), not to 3.0
    assert s["throughput_req_s"] == 2 / 4.0 and s["throughput_out_tok_s"] == 8 / 4.0
    assert s["ttft_s"]["mean"] == 0.75 and s["e2e_s"]["mean"] == 1.5  # completed requests only
    assert s["slo"]["ttft_attainment"] == 2 / 4  # request 2's first token came in time: still a miss
    assert s["errors"] == {"200: interrupted": 2}
    assert stuck[0].tpot is None and stuck[0].row()["interrupted_at"] == 4.5
    # Nothing completed: the makespan still runs to the interruption, the throughput is 0.
    s = rp.summarize(stuck)
    assert (s["makespan_s"], s["throughput_req_s"], s["completed"]) == (3.0, 0.0, 0)
    # Nothing in flight at the interruption (no record has interrupted_at): the last response ends it.
    assert rp.summarize(done)["makespan_s"] == 2.5 and rp.summarize(done)["interrupted"] == 0


STALL_LATENCY = {"fast": (0.05, 0.010), "stall": (0.05, 60.0), "hang": (60.0, 0.01)}
"""fast completes; stall sends its first token, then nothing for a minute; hang sends nothing."""


@pytest.fixture
def stalling():
    with FakeServer(per_model=STALL_LATENCY) as s:
        yield s
        # Its stalled HTTP handlers would still be asleep when its loop closes: end them first.
        asyncio.run_coroutine_threadsafe(_end_stalled_handlers(), s._loop).result(10)


async def _end_stalled_handlers() -> None:
    tasks = [t for t in asyncio.all_tasks() if t.get_coro().__name__ == "_serve_http"]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _wait_for(cond, timeout_s: float = 8.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)


@pytest.mark.parametrize("protocol", rp.PROTOCOLS)
def test_cancelled_replay_keeps_the_records_so_far(stalling, protocol):
    rows = [(0.0, "fast", 5), (0.05, "stall", 3), (0.10, "hang", 3), (0.15, "fast", 5), (20.0, "fast", 5)]
    trace = trace_of(rows)
    records: list[rp.Record] = []

    async def go():
        task = asyncio.create_task(rp.replay(trace, stalling.url, protocol=protocol, ws_url=stalling.ws_url,
                                             records=records))  # fmt: skip
        deadline = time.monotonic() + 8
        # Cancel once the fast requests are done and the stalled one has its first token.
        while not (len(records) == 4 and records[3].e2e is not None and records[1].ttft is not None):
            assert time.monotonic() < deadline and not task.done(), records
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(go())
    assert [r.i for r in records] == [0, 1, 2, 3]  # sent, in trace order; request 4 (at 20 s) never was
    fast, stall, hang, fast2 = records
    for r in (fast, fast2):  # completed: exact, as in an uninterrupted replay
        ttft, tpot = STALL_LATENCY["fast"]
        assert r.error is None and r.interrupted_at is None and r.n_out == r.output_len == 5, r
        assert ttft - EARLY <= r.ttft <= ttft + JITTER, r
        assert r.e2e == pytest.approx(ttft + 4 * tpot, abs=JITTER), r
    stopped = stall.interrupted_at
    assert stopped is not None and hang.interrupted_at == stopped
    assert fast2.sent + fast2.e2e < stopped < fast2.sent + fast2.e2e + 1.0
    for r in (stall, hang):  # in flight: interrupted, not completed
        assert r.error == rp.INTERRUPTED and r.e2e is None and r.tpot is None and r.status == 200, r
    first = STALL_LATENCY["stall"][0]
    assert first - EARLY <= stall.ttft <= first + JITTER  # its first token is kept
    assert len(stall.chunk_times) == 1 and hang.ttft is None and hang.chunk_times == []
    s = rp.summarize(records)
    assert (s["requests"], s["completed"], s["failed"], s["interrupted"]) == (4, 2, 2, 2)
    assert s["makespan_s"] == stopped  # first scheduled send (t = 0) to the interruption
    assert s["throughput_req_s"] == 2 / stopped and s["output_tokens"] == 10
    assert s["slo"]["ttft_attainment"] == 2 / 4 and s["errors"] == {"200: interrupted": 2}


def test_records_list_of_a_complete_replay_is_the_returned_one(stalling):
    records: list[rp.Record] = []
    out = rp.run_replay(trace_of([(0.0, "fast", 3), (0.02, "fast", 2)]), stalling.url, records=records)
    assert records == out and all(a is b for a, b in zip(records, out)) and len(out) == 2
    assert all(r.error is None and r.interrupted_at is None for r in out)


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_run_writes_the_point_it_was_interrupted_in(stalling, tmp_path, monkeypatch, capsys, sig):
    """serving.run() with two points: the first completes, the second is interrupted by a real
    signal (SIGINT: Ctrl-C, or SIGTERM with serving.py's handler) while its requests stall. As
    `timeout` does, the signal comes twice: the second while the partial point is written."""
    traces = {"a": trace_of([(0.0, "fast", 4), (0.02, "fast", 4)], "full"),
              "b": trace_of([(0.0, "fast", 4), (0.02, "stall", 4), (0.04, "hang", 4), (30.0, "fast", 4)], "full")}  # fmt: skip
    monkeypatch.setitem(serving.WORKLOADS, "test", lambda which: traces[which])
    monkeypatch.setitem(serving.SERVERS, "fake", contextlib.contextmanager(
        lambda spec: (yield serving.Endpoint(stalling.url, stalling.ws_url))))  # fmt: skip
    monkeypatch.setattr(runner, "detect_devices", lambda: ("cpu", "cpu"))
    write_result = runner.write_result

    def write_signalled_again(name, payload, out_dir):
        if payload["points"][-1]["interrupted"]:
            os.kill(os.getpid(), getattr(signal, sig))
        return write_result(name, payload, out_dir)

    monkeypatch.setattr(runner, "write_result", write_signalled_again)
    exp = serving.Experiment("interrupt", SMOKE_SHAPE, timeout_s=120.0,
                             points=tuple(serving.Point(label=k, trace={"which": k}, workload="test") for k in "ab"))  # fmt: skip

    def interrupt() -> None:  # once point b's fast request is done and its stalled one has a token
        log = stalling.log
        _wait_for(lambda: len(log) >= 5 and len(log[2].token_times) == 4 and len(log[3].token_times) == 1)
        time.sleep(0.3)
        os.kill(os.getpid(), getattr(signal, sig))

    # Ctrl-C's own handler, as in a terminal: a run started in the background of a non-interactive
    # shell (CI's, `cmd &`) inherits SIGINT ignored, and Python then installs no handler.
    old_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    old = signal.signal(signal.SIGTERM, serving.exit_on_sigterm) if sig == "SIGTERM" else None
    killer = threading.Thread(target=interrupt, daemon=True)
    try:
        killer.start()
        with pytest.raises(KeyboardInterrupt if sig == "SIGINT" else SystemExit) as exc:
            serving.run(exp, server="fake", out_dir=tmp_path, plots=False)
        killer.join(10)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handlers restored
        assert signal.getsignal(signal.SIGTERM) is (serving.exit_on_sigterm if old is not None else signal.SIG_DFL)
    finally:
        signal.signal(signal.SIGINT, old_int)
        if old is not None:
            signal.signal(signal.SIGTERM, old)
    if sig == "SIGTERM":
        assert exc.value.code == 128 + signal.SIGTERM
    (path,) = tmp_path.glob("interrupt-cpu-*.json")
    res = json.loads(path.read_text())
    assert res["complete"] is False and [p["label"] for p in res["points"]] == ["a", "b"]
    a, b = res["points"]
    assert a["interrupted"] is False and a["summary"]["completed"] == 2 and a["summary"]["interrupted"] == 0
    assert b["interrupted"] is True
    rows, s = b["requests"], b["summary"]
    assert [r["i"] for r in rows] == [0, 1, 2]  # the request at 30 s was never sent
    assert rows[0]["error"] is None and rows[0]["n_out"] == 4 and rows[0]["interrupted_at"] is None
    assert [r["error"] for r in rows[1:]] == [rp.INTERRUPTED] * 2
    assert rows[1]["ttft"] is not None and rows[2]["ttft"] is None
    stopped = rows[1]["interrupted_at"]
    assert stopped == rows[2]["interrupted_at"] and stopped > rows[0]["sent"] + rows[0]["e2e"]
    assert (s["requests"], s["completed"], s["failed"], s["interrupted"]) == (3, 1, 2, 2)
    assert s["makespan_s"] == stopped and s["throughput_req_s"] == 1 / stopped
    out = capsys.readouterr().out
    assert "INTERRUPTED after 3 of 4 requests sent, 1 completed" in out and str(path) in out
