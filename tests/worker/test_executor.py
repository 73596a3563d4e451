"""Executor on a tiny Llama: plans from the router's own scheduler, against HF transformers.

``SchedDriver`` (``helpers/sched_driver.py``) runs the real scheduler through ``deltaserve._native``
(page allocation, chunked prefill, decode diffs, release after finishing, preemption + resume), so
the tests exercise the plans the router sends.
"""

from __future__ import annotations

import copy
import inspect
import weakref
from pathlib import Path

import pytest
import torch

from deltaserve import wire
from deltaserve.worker.executor import Executor, PlanError
from helpers.executors import KV_BYTES, hf_greedy, prompts
from helpers.sched_driver import GREEDY, SchedDriver
from helpers.worker_config import cpu_worker_config

MiniRouter = SchedDriver
"""The name ``tests/kernels/test_cuda_graphs.py`` imports (with ``prompts``)."""
__all__ = ["KV_BYTES", "MiniRouter", "hf_greedy", "prompts"]  # for the tests that import them from here


def test_greedy_matches_hf_generate(executor_factory, hf_model) -> None:
    ex = executor_factory()
    for i, prompt in enumerate(prompts(3, ex.config.vocab_size, seed=1, lo=5, hi=30)):
        got = SchedDriver(ex).run({i: (prompt, 12)})[i]
        assert got == hf_greedy(hf_model, prompt, 12), f"prompt {i}"


def test_chunked_prefill_in_three_steps_gives_the_same_tokens(executor_factory) -> None:
    ex = executor_factory()
    prompt = prompts(1, ex.config.vocab_size, seed=2, lo=20, hi=20)[0]
    whole = SchedDriver(ex).run({1: (prompt, 8)})[1]
    router = SchedDriver(executor_factory(), max_num_batched_tokens=7)
    router.add(2, prompt, 8)
    first, second, third = router.step(), router.step(), router.step()
    assert [o.token_id for o in first.outputs] == [None] and [o.token_id for o in second.outputs] == [None]
    assert third.outputs[0].token_id == whole[0]
    while router.unfinished:
        router.step()
    # The 7-token budget chunks the prefill (7 + 7 + 6); decode schedules 1 token per step.
    assert router.step_id == 3 + 7
    rerun = SchedDriver(executor_factory(), max_num_batched_tokens=7).run({2: (prompt, 8)})[2]
    assert rerun == whole


def test_batch_of_16_matches_each_alone(executor_factory) -> None:
    ex = executor_factory()
    ps = prompts(16, ex.config.vocab_size, seed=3, lo=1, hi=37)
    alone = {i: SchedDriver(ex).run({i: (p, 6 + i % 5)})[i] for i, p in enumerate(ps)}
    # Staggered arrivals and a small token budget: steps mix new prefills, chunks and decodes.
    batched = SchedDriver(executor_factory(), max_num_batched_tokens=9).run(
        {i: (p, 6 + i % 5) for i, p in enumerate(ps)}, arrivals={i: i // 3 for i in range(16)}
    )
    assert batched == alone


def test_steps_launched_before_the_previous_one_finished_give_the_same_tokens(executor_factory) -> None:
    """Overlapped steps: step N+1 computes the tokens step N samples from the device tensor."""
    ex = executor_factory()
    ps = prompts(10, ex.config.vocab_size, seed=6, lo=1, hi=23)
    seeded = wire.SamplingParams(temperature=0.8, top_p=0.9, top_k=0, seed=7, logprobs=3)
    sampling = {i: seeded for i in (1, 4, 7)}
    reqs = {i: (p, 3 + i % 6) for i, p in enumerate(ps)}
    arrivals = {i: i // 2 for i in range(10)}
    in_order = SchedDriver(ex, max_num_batched_tokens=6).run(reqs, arrivals, sampling)
    overlapped_ex = executor_factory()
    overlapped = SchedDriver(overlapped_ex, max_num_batched_tokens=6).run_pipelined(reqs, arrivals, sampling)
    assert [len(overlapped[i]) for i in range(10)] == [3 + i % 6 for i in range(10)]
    assert overlapped == in_order
    assert all(st.pending == 0 for st in overlapped_ex.requests.values())


def test_released_requests_are_dropped(executor_factory) -> None:
    ex = executor_factory()
    router = SchedDriver(ex)
    router.add(7, [5, 6, 7, 8, 9], 3)
    router.step()
    assert 7 in ex.requests
    router.sched.abort(7)  # the client went away: the next plan releases it
    router.add(8, [5, 6], 1)
    plan = router.plan()
    assert plan.released == [7]
    router.apply(ex.step(plan))
    assert 7 not in ex.requests
    with pytest.raises(PlanError, match="does not hold"):
        ex.step(
            wire.StepPlan(
                step_id=100, running=[wire.RunningRequest(req_id=7, num_scheduled_tokens=1, new_block_ids=[])]
            )
        )


@pytest.mark.parametrize(
    "sampling", [GREEDY, wire.SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=42, logprobs=None)]
)
def test_resumed_request_continues_identically(executor_factory, sampling) -> None:
    prompt = prompts(1, executor_factory().config.vocab_size, seed=4, lo=11, hi=11)[0]
    expected = _outputs_of(executor_factory(), prompt, sampling)
    # A different global seed must not matter for seeded or greedy requests.
    router = SchedDriver(executor_factory(seed=1))
    router.add(1, prompt, 12, sampling)
    while len(router.outputs[1]) < 5:
        router.step()
    assert router.preempt(1)  # next plan releases it and re-sends it in full (prompt + 5 outputs)
    plan = router.plan()
    assert len(router.outputs[1]) == 5
    assert plan.released == [1] and plan.new_requests[0].token_ids == prompt + router.outputs[1]
    assert plan.new_requests[0].num_prompt_tokens == len(prompt)
    router.apply(router.ex.step(plan))
    while router.unfinished:
        router.step()
    assert router.outputs[1] == expected


def _outputs_of(ex: Executor, prompt: list[int], sampling: wire.SamplingParams) -> list[int]:
    router = SchedDriver(ex)
    router.add(1, prompt, 12, sampling)
    while router.unfinished:
        router.step()
    return router.outputs[1]


def test_logprobs_reach_the_output(executor_factory, hf_model) -> None:
    ex = executor_factory()
    prompt = [10, 20, 30, 40]
    params = wire.SamplingParams(temperature=0.0, top_p=1.0, top_k=0, seed=None, logprobs=3)
    out = ex.step(
        wire.StepPlan(
            step_id=1,
            new_requests=[
                wire.NewRequest(
                    req_id=1,
                    token_ids=prompt,
                    num_prompt_tokens=4,
                    num_computed_tokens=0,
                    num_scheduled_tokens=4,
                    block_ids=[0],
                    sampling=params,
                )
            ],
        )
    )
    (o,) = out.outputs
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0, -1].float(), -1)
    assert o.token_id == int(ref.argmax())
    assert o.logprob == pytest.approx(float(ref.max()), abs=1e-4)
    assert [t.token_id for t in o.top_logprobs] == ref.topk(3).indices.tolist()
    assert out.timing.forward_us > 0


def snapshot(ex: Executor) -> dict:
    return copy.deepcopy(ex.requests)


def test_bad_plans_raise_and_leave_state_unchanged(executor_factory) -> None:
    ex = executor_factory()
    router = SchedDriver(ex)
    router.add(1, [4, 5, 6, 7, 8, 9], 20)
    router.step()
    router.step()
    before = snapshot(ex)
    vocab, pool = ex.config.vocab_size, ex.kv.num_blocks

    def new(req_id=2, tokens=(3, 4, 5), computed=0, scheduled=3, blocks=(pool - 1,)):
        return wire.NewRequest(
            req_id=req_id,
            token_ids=list(tokens),
            num_prompt_tokens=len(tokens),
            num_computed_tokens=computed,
            num_scheduled_tokens=scheduled,
            block_ids=list(blocks),
            sampling=GREEDY,
        )

    ok_running = wire.RunningRequest(req_id=1, num_scheduled_tokens=1, new_block_ids=[])
    cases = {
        "unknown running": (
            [],
            [wire.RunningRequest(req_id=77, num_scheduled_tokens=1, new_block_ids=[])],
            "does not hold",
        ),
        "block outside pool": ([new(blocks=[pool])], [ok_running], "outside the pool"),
        "token >= vocab": ([new(tokens=[3, vocab, 5])], [ok_running], "outside the vocab size"),
        "scheduled beyond known (new)": ([new(scheduled=4)], [ok_running], "only 3 are known"),
        "scheduled beyond known (running)": (
            [],
            [wire.RunningRequest(req_id=1, num_scheduled_tokens=2, new_block_ids=[])],
            "only 8 are known",
        ),
        "too few blocks": (
            [new(tokens=list(range(3, 12)), scheduled=9, blocks=[pool - 1])],
            [ok_running],
            "cannot hold",
        ),
        "duplicate new": ([new(req_id=1)], [], "already holds"),
    }
    for name, (news, runs, match) in cases.items():
        with pytest.raises(PlanError, match=match) as info:
            ex.step(wire.StepPlan(step_id=50, new_requests=news, running=runs, released=[]))
        assert info.value.req_ids, name
        assert snapshot(ex) == before, f"{name}: state changed"
    # A good plan still works afterwards, and continues where the request was.
    out = ex.step(wire.StepPlan(step_id=51, running=[ok_running]))
    assert out.outputs[0].req_id == 1 and out.outputs[0].token_id is not None


def test_failed_step_drops_its_requests(executor_factory) -> None:
    ex = executor_factory()
    router = SchedDriver(ex)
    router.add(1, [4, 5, 6], 20)
    router.step()
    plan = wire.StepPlan(step_id=9, running=[wire.RunningRequest(req_id=1, num_scheduled_tokens=5, new_block_ids=[])])
    with pytest.raises(PlanError):
        ex.step(plan)
    assert ex.drop_step_requests(plan) == [1]
    assert ex.requests == {}


def test_hello_reports_model_and_kv(executor_factory, tiny_llama: Path) -> None:
    ex = executor_factory()
    hello = ex.hello("abc")
    assert hello.schema_hash == "abc"
    assert hello.model.vocab_size == ex.config.vocab_size and hello.model.dtype == "float32"
    assert hello.model.device == "cpu" and hello.model.num_layers == ex.config.num_layers
    assert hello.model.num_params == sum(p.numel() for p in ex.model.parameters())
    assert hello.kv.block_size == 4
    assert hello.delta_graph_tokens == 0, "no CUDA graphs on the CPU: no limit for the router to keep"
    assert (
        hello.kv.num_blocks * hello.kv.bytes_per_block
        <= KV_BYTES
        < (hello.kv.num_blocks + 1) * hello.kv.bytes_per_block
    )
    assert hello.model.max_model_len == min(512, hello.kv.num_blocks * 4)
    assert executor_factory(max_model_len=100).hello("x").model.max_model_len == 100
    small = executor_factory(kv_cache_bytes=hello.kv.bytes_per_block * 10)
    assert small.hello("x").model.max_model_len == 40 and small.kv.num_blocks == 10
    assert wire.decode(wire.encode(hello)) == hello


# ---------------------------------------------------------------------------------------- worker loop


class FakeLink:
    """In-process stand-in for WorkerLink: frames in from a list, frames out to a list."""

    def __init__(self, inbound: list[bytes]) -> None:
        self.inbound = list(inbound)
        self.sent: list[object] = []

    def send(self, data: bytes) -> None:
        self.sent.append(wire.decode(data))

    def recv(self, timeout_s: float | None = None) -> bytes | None:
        return self.inbound.pop(0) if self.inbound else None


def test_loop_serves_reports_plan_errors_and_shuts_down(executor_factory) -> None:
    from deltaserve.worker.loop import WorkerLoop

    ex = executor_factory()
    good = wire.StepPlan(
        step_id=1,
        new_requests=[
            wire.NewRequest(
                req_id=5,
                token_ids=[3, 4, 5],
                num_prompt_tokens=3,
                num_computed_tokens=0,
                num_scheduled_tokens=3,
                block_ids=[0],
                sampling=GREEDY,
            )
        ],
    )
    bad = wire.StepPlan(step_id=2, running=[wire.RunningRequest(req_id=5, num_scheduled_tokens=9, new_block_ids=[])])
    again = wire.StepPlan(
        step_id=3,
        new_requests=[
            wire.NewRequest(
                req_id=6,
                token_ids=[7],
                num_prompt_tokens=1,
                num_computed_tokens=0,
                num_scheduled_tokens=1,
                block_ids=[1],
                sampling=GREEDY,
            )
        ],
    )
    frames = [
        wire.encode(good),
        b"\x01garbage",
        wire.encode(bad),
        wire.encode(again),
        wire.encode(wire.Shutdown(reason="test")),
    ]
    link = FakeLink(frames)
    assert WorkerLoop(ex, link).run() == 0
    hello, out1, err_frame, err_plan, out3 = link.sent
    assert isinstance(hello, wire.Hello) and hello.schema_hash == wire.SCHEMA_HASH
    assert isinstance(out1, wire.StepOutput) and out1.step_id == 1 and out1.outputs[0].token_id is not None
    assert out1.timing.total_us >= out1.timing.forward_us > 0 and out1.timing.gap_us >= 0
    assert isinstance(err_frame, wire.WorkerError) and not err_frame.fatal and err_frame.step_id == 0
    assert isinstance(err_plan, wire.WorkerError) and not err_plan.fatal
    assert err_plan.step_id == 2 and err_plan.req_ids == [5] and "request 5" in err_plan.message
    assert 5 not in ex.requests  # failed requests are forgotten; the router re-sends them in full
    assert isinstance(out3, wire.StepOutput) and out3.step_id == 3


def test_loop_launches_the_next_plan_before_answering_the_running_step(executor_factory, monkeypatch) -> None:
    """While the device still runs step N, a plan that has arrived is launched behind it, and only
    then is N answered; the overlapped tokens equal those of steps run one at a time."""
    from deltaserve.worker.executor import LaunchedStep
    from deltaserve.worker.loop import WorkerLoop

    def plans() -> list[wire.StepPlan]:
        first = wire.StepPlan(
            step_id=1,
            new_requests=[
                wire.NewRequest(
                    req_id=5,
                    token_ids=[3, 4, 5, 6, 7],
                    num_prompt_tokens=5,
                    num_computed_tokens=0,
                    num_scheduled_tokens=5,
                    block_ids=[0, 1],
                    sampling=GREEDY,
                )
            ],
        )
        # Steps 2 and 3 compute the tokens sampled by 1 and 2, planned before those are known.
        rest = [
            wire.StepPlan(
                step_id=i,
                running=[wire.RunningRequest(req_id=5, num_scheduled_tokens=1, new_block_ids=[2] if i == 4 else [])],
            )
            for i in (2, 3, 4)
        ]
        return [first, *rest]

    one_at_a_time = executor_factory()
    expected = [one_at_a_time.step(p).outputs[0].token_id for p in plans()]

    ex = executor_factory()
    link = FakeLink([wire.encode(p) for p in plans()] + [wire.encode(wire.Shutdown(reason="test"))])
    events: list[tuple[str, int]] = []
    launch = ex.launch
    monkeypatch.setattr(
        ex, "launch", lambda plan, in_flight: events.append(("launch", plan.step_id)) or launch(plan, in_flight)
    )
    send = link.send
    link.send = lambda data: (send(data), events.append(("send", getattr(link.sent[-1], "step_id", 0))))
    # The CPU finishes a step inside launch; pretend the device is busy while frames are waiting.
    monkeypatch.setattr(LaunchedStep, "is_done", lambda self: not link.inbound)
    assert WorkerLoop(ex, link).run() == 0
    outs = link.sent[1:]
    assert [o.step_id for o in outs] == [1, 2, 3, 4]
    assert [o.outputs[0].token_id for o in outs] == expected
    assert events[1:] == [
        ("launch", 1),
        ("launch", 2),
        ("send", 1),
        ("launch", 3),
        ("send", 2),
        ("launch", 4),
        ("send", 3),
        ("send", 4),
    ]
    assert [o.timing.gap_us for o in outs[1:]] == [0, 0, 0]  # each plan came while a step ran
    assert ex.requests[5].pending == 0 and ex.requests[5].token_ids[5:] == expected


def test_loop_reports_unexpected_errors_as_fatal(executor_factory, monkeypatch) -> None:
    from deltaserve.worker.loop import EXIT_FATAL, WorkerLoop

    ex = executor_factory()

    def boom(plan, in_flight):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(ex, "launch", boom)
    plan = wire.StepPlan(step_id=4, running=[wire.RunningRequest(req_id=1, num_scheduled_tokens=1, new_block_ids=[])])
    link = FakeLink([wire.encode(plan), wire.encode(wire.Shutdown(reason="never reached"))])
    assert WorkerLoop(ex, link).run() == EXIT_FATAL
    err = link.sent[-1]
    assert isinstance(err, wire.WorkerError) and err.fatal and err.step_id == 4 and err.req_ids == [1]
    assert "illegal memory access" in err.message and "Traceback" in err.message


def _worker_cmd(link, model: Path, ipc_dir: Path, **config) -> tuple[list[str], dict[str, str]]:
    """Sends the worker's config on ``link`` (as the router does, before the process starts) and
    returns the command line (the link's directory alone) and environment that start it."""
    import os
    import sys

    import deltaserve

    link.send(wire.encode(cpu_worker_config(model, **config)))
    env = dict(os.environ)
    src = str(Path(deltaserve.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([src] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return [sys.executable, "-m", "deltaserve.worker", "--ipc-dir", str(ipc_dir)], env


def _recv(link, timeout: float = 120.0):
    frame = link.recv(timeout_s=timeout)
    assert frame is not None, "worker sent nothing"
    return wire.decode(frame)


def test_worker_process_end_to_end(tiny_llama: Path, tmp_path: Path, executor_factory) -> None:
    import subprocess

    native = pytest.importorskip("deltaserve._native", reason="deltaserve._native is not built (maturin develop)")
    ipc = tmp_path / "ipc"
    link = native.RouterLink(str(ipc))
    cmd, env = _worker_cmd(link, tiny_llama, ipc)
    log_path = tmp_path / "worker.log"
    with log_path.open("w") as log_file:
        proc = subprocess.Popen(cmd, env=env, stderr=log_file, stdout=log_file)
    try:
        hello = _recv(link)
        assert isinstance(hello, wire.Hello), hello
        assert hello.schema_hash == wire.SCHEMA_HASH == native.schema_hash()
        assert hello.pid == proc.pid
        assert hello.kv.block_size == 4 and hello.kv.num_blocks == KV_BYTES // hello.kv.bytes_per_block
        assert hello.model.vocab_size > 0 and hello.model.device == "cpu"

        # Same plans through the in-process executor give the reference tokens.
        prompt = [3, 14, 15, 92, 65, 35, 89, 79]
        reference = SchedDriver(executor_factory()).run({1: (prompt, 5)})[1]
        router = SchedDriver(executor_factory())
        router.add(1, prompt, 5)
        while router.unfinished:
            plan = router.plan()
            link.send(wire.encode(plan))
            out = _recv(link)
            assert isinstance(out, wire.StepOutput) and out.step_id == plan.step_id, out
            assert out.timing.total_us > 0
            router.apply(out)
        assert router.outputs[1] == reference

        link.send(
            wire.encode(
                wire.StepPlan(
                    step_id=77, running=[wire.RunningRequest(req_id=12345, num_scheduled_tokens=1, new_block_ids=[])]
                )
            )
        )
        err = _recv(link)
        assert isinstance(err, wire.WorkerError) and not err.fatal and err.req_ids == [12345] and err.step_id == 77

        # Still serving after the recoverable error.
        link.send(
            wire.encode(
                wire.StepPlan(
                    step_id=78,
                    new_requests=[
                        wire.NewRequest(
                            req_id=2,
                            token_ids=[5, 6],
                            num_prompt_tokens=2,
                            num_computed_tokens=0,
                            num_scheduled_tokens=2,
                            block_ids=[0],
                            sampling=GREEDY,
                        )
                    ],
                )
            )
        )
        out = _recv(link)
        assert isinstance(out, wire.StepOutput) and out.step_id == 78 and out.outputs[0].token_id is not None

        link.send(wire.encode(wire.Shutdown(reason="test over")))
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        print(log_path.read_text())


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "\nState:\tZ" in state  # reparented zombie nobody reaps: exited all the same


def test_worker_exits_when_its_parent_dies(tiny_llama: Path, tmp_path: Path) -> None:
    import shlex
    import subprocess
    import time

    native = pytest.importorskip("deltaserve._native", reason="deltaserve._native is not built (maturin develop)")
    ipc = tmp_path / "ipc"
    link = native.RouterLink(str(ipc))
    cmd, env = _worker_cmd(link, tiny_llama, ipc)
    # An intermediate shell is the worker's parent; it exits as soon as the worker has started.
    shell = subprocess.Popen(["sh", "-c", " ".join(map(shlex.quote, cmd)) + " 2>/dev/null &"], env=env)
    assert shell.wait(timeout=30) == 0
    hello = _recv(link)
    assert isinstance(hello, wire.Hello)
    deadline = time.monotonic() + 20
    while not _gone(hello.pid):
        assert time.monotonic() < deadline, "worker outlived its parent"
        time.sleep(0.2)


def test_worker_config_frame_and_validation(tiny_llama: Path, tmp_path: Path) -> None:
    from deltaserve.worker.config import ConfigError, SchemaMismatch, from_frame, parse_args, validate

    good = cpu_worker_config(tiny_llama, device="cuda:1", max_model_len=64)
    cfg = from_frame(wire.encode(good))
    assert (cfg.device, cfg.max_model_len, cfg.block_size, cfg.kv_cache_bytes) == ("cuda:1", 64, 4, KV_BYTES)
    for bad, match in [
        ({"device": "tpu"}, "device 'tpu'"),
        ({"dtype": "int8"}, "dtype 'int8'"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization 1.5"),
        ({"kv_cache_bytes": -1}, "kv_cache_bytes -1"),
        ({"log_level": "LOUD"}, "log_level 'LOUD'"),
        ({"model_dir": str(tmp_path)}, "no config.json"),
    ]:
        with pytest.raises(ConfigError, match=match):
            validate(cpu_worker_config(tiny_llama, **bad))
    with pytest.raises(ConfigError, match="expected a WorkerConfig"):
        from_frame(wire.encode(wire.Shutdown(reason="not a config")))
    with pytest.raises(ConfigError, match="no WorkerConfig frame"):
        from_frame(None)
    with pytest.raises(SchemaMismatch, match="router schema 00000000deadbeef"):
        from_frame(wire.encode(cpu_worker_config(tiny_llama, schema_hash="00000000deadbeef")))
    # The command line names the link alone; the old setting flags are refused.
    assert parse_args(["--ipc-dir", str(tmp_path)]) == tmp_path
    with pytest.raises(ConfigError, match="not a directory"):
        parse_args(["--ipc-dir", str(tmp_path / "missing")])
    with pytest.raises(SystemExit):
        parse_args(["--ipc-dir", str(tmp_path), "--block-size", "8"])


def test_worker_process_reports_a_bad_config_and_exits(tiny_llama: Path, tmp_path: Path) -> None:
    import subprocess

    native = pytest.importorskip("deltaserve._native", reason="deltaserve._native is not built (maturin develop)")
    ipc = tmp_path / "ipc"
    link = native.RouterLink(str(ipc))
    cmd, env = _worker_cmd(link, tiny_llama, ipc, max_deltas=65)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    err = _recv(link, timeout=5)
    assert isinstance(err, wire.WorkerError) and err.fatal, err
    assert "max_deltas 65: expected 0..64" in err.message, err.message
    assert proc.returncode == 2 and "max_deltas 65" in proc.stderr, proc.stderr


def test_the_worker_freezes_its_loaded_heap() -> None:
    """``serve`` freezes what the load left alive before serving (``freeze_loaded_objects``): later
    collections skip it, and what is made afterwards is still collected."""
    import gc

    from deltaserve.worker import loop

    assert "freeze_loaded_objects()" in inspect.getsource(loop.serve)
    gc.unfreeze()
    try:
        loaded = _Node()
        loaded.me = loaded  # a cycle alive at the freeze: part of the loaded heap
        loaded_ref = weakref.ref(loaded)
        loop.freeze_loaded_objects()
        assert gc.get_freeze_count() > 1000
        del loaded  # unreachable now, but frozen: a collection must not even look at it
        node = _Node()
        node.me = node  # a cycle made after the freeze: only the collector can free it
        ref = weakref.ref(node)
        del node
        gc.collect()
        assert ref() is None, "what is made after the freeze is still collected"
        assert loaded_ref() is not None, "the frozen heap is skipped by later collections"
        # (The freeze count itself is no measure: other threads may free frozen objects by refcount.)
    finally:
        gc.unfreeze()
        gc.collect()


class _Node:
    me: object = None
