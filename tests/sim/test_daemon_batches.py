"""The simulator forms the daemon's batches: a trace replayed against the real daemon (tiny Llama on
CPU, its worker recording every step through ``deltaserve.sim.record``) and in the simulator fed
the recorded step times gives the same requests with the same token counts in every step.

Arrivals: the router's arrival time of a request is not recorded (the worker sees plans only), and
on this shared 2-core machine a request takes 10-200 ms from the client's send to the router, so a
request admitted as soon as it arrives could land on either side of a step boundary. The trace
is therefore shaped so that admission never depends on when a request arrived, only on the
order (the daemon's request ids, assigned in arrival order): one running slot (``--max-num-seqs
1``), request A first, the others sent while A decodes 30 tokens (held back 50 ms per step by the
recorder), so they all queue behind it. What the comparison checks is the actor's call sequence
replayed by the simulator: overlapped steps (``schedule_ahead`` while one step is in flight,
``schedule`` when none is), chunked prefill under a 16-token budget, the last token's lookahead,
releases and FCFS admission.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from e2e.daemon import Daemon

from deltaserve import _native, sim
from deltaserve.sim.record import read_steps, recording_python, step_periods
from deltaserve.sim.trace import from_requests

DELAY_S = 0.05
# (prompt tokens, output tokens): A first, then B..F in a burst after A's first token.
FIRST = (24, 30)
BURST = [(12, 8), (5, 3), (30, 6), (9, 12), (17, 4)]
SEQS, BUDGET, BLOCK, BLOCKS = 1, 16, 16, 16


@pytest.fixture(scope="module")
def recorded(tiny_llama, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("record")
    record = tmp / "steps.jsonl"
    script = recording_python(tmp / "python", record, delay_s=DELAY_S)
    kv = BLOCK * BLOCKS * _kv_bytes_per_token(tiny_llama)
    # The prompts are prefixes of each other and the simulator has no prefix cache: the daemon's off.
    flags = ["--max-num-seqs", str(SEQS), "--max-num-batched-tokens", str(BUDGET), "--kv-cache-bytes", str(kv),
             "--max-model-len", "128", "--worker-threads", "1", "--no-enable-prefix-caching"]  # fmt: skip
    with Daemon(tiny_llama, *flags, python=str(script)) as d:
        d.wait_ready()
        sends = run_client(d.url)
    return sends, read_steps(record)


def _kv_bytes_per_token(model_dir) -> int:
    import json

    cfg = json.loads((model_dir / "config.json").read_text())
    head = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head * 4


def _body(prompt_len: int, out: int, stream: bool) -> dict:
    return {"model": "tiny", "prompt": [7 + i for i in range(prompt_len)], "max_tokens": out, "ignore_eos": True,
            "temperature": 0.0, "stream": stream}  # fmt: skip


def run_client(url: str) -> list[float]:
    """Sends A, waits for its first token, sends B..F; returns each send time (monotonic)."""
    model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    sends: list[float] = []
    errors: list[BaseException] = []

    def post(body: dict) -> None:
        try:
            r = httpx.post(f"{url}/v1/completions", json={**body, "model": model}, timeout=120)
            r.raise_for_status()
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = []
    sends.append(time.monotonic())
    with httpx.stream("POST", f"{url}/v1/completions", json={**_body(*FIRST, True), "model": model}, timeout=120) as r:
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: ") and '"text"' in line:
                break
        for p, o in BURST:
            t = threading.Thread(target=post, args=(_body(p, o, False),))
            sends.append(time.monotonic())
            t.start()
            threads.append(t)
            time.sleep(0.002)  # keeps the arrival order the send order
        for _ in lines:
            pass
    for t in threads:
        t.join()
    assert not errors, errors
    return sends


def test_simulated_batches_equal_the_daemons(recorded):
    sends, steps = recorded
    output_of = dict([FIRST, *BURST])
    sent_at = {p: t - sends[0] for (p, _), t in zip([FIRST, *BURST], sends)}
    prompt_of = {n[0]: n[3] for s in steps for n in s["new"]}
    order = sorted(prompt_of)  # the daemon's ids: its arrival order
    assert len(order) == len(output_of)
    daemon = [[(order.index(rid), n) for rid, n, *_ in s["new"]] + [(order.index(rid), n) for rid, n in s["running"]]
              for s in steps]  # fmt: skip
    assert sum(n for step in daemon for _, n in step) == sum(p + o - 1 for p, o in output_of.items()), "no preemption"
    arrivals, t = [], -1.0
    for rid in order:  # the send times, in the daemon's arrival order
        t = max(sent_at[prompt_of[rid]], t + 1e-6)
        arrivals.append(t)
    finish_a = sum(step_periods(steps)[: FIRST[1] + 1])
    assert arrivals[-1] < finish_a / 2, "every request arrived while A was decoding"
    trace = from_requests([{"t": t, "prompt_len": prompt_of[rid], "output_len": output_of[prompt_of[rid]]}
                           for t, rid in zip(arrivals, order)], [])  # fmt: skip
    cfg = _native.SchedulerConfig(BLOCK, BLOCKS, 128)
    cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.host_copy_reports = SEQS, BUDGET, True
    res = sim.replay(trace, cfg, sim.default_model(), step_times=step_periods(steps), record_steps=True)
    simulated = [list(entries) for *_, entries, _prefill, _features in res.steps]
    assert simulated == daemon


def test_each_recorded_step_carries_the_workers_timing_floor_and_copy_reports(recorded):
    _, steps = recorded
    for s in steps:
        t = s["timing"]
        assert set(t) == {"gap_us", "forward_us", "total_us", "busy_us", "floor_us"}, t
        assert t["busy_us"] <= t["total_us"] and t["floor_us"] >= 0
        assert s["host_ready"] == [] and s["gpu_ready"] == [], "no variant was read or loaded"
    assert sum(s["timing"]["floor_us"] for s in steps) > 0, "the CPU worker measures its roofline too"
