"""Drives an in-process ``Executor`` with the router's own scheduler, ``deltaserve._native.Scheduler``.

``SchedDriver`` plays the router's engine without its IO: it queues requests and variants in the
real scheduler (``router/crates/sched``), sends the ``StepPlan`` it forms to ``Executor.step`` (or
``launch`` / ``finish``, one step ahead), and hands the ``StepOutput`` back. So worker tests run
the plans the router sends: its page allocation, chunked prefill under the step's token budget,
decode diffs, releases, adapter tier ops and preemptions.

Around that it only keeps what a test asks about: each request's output tokens, and counts of
step shapes. It checks the worker's half of the contract on every output: a request samples a
token exactly when its scheduled tokens reach the end of what the worker knows, and every
scheduled request is answered.

Preemption: the scheduler preempts for pages, and when a token it scheduled a later step on never
came. ``preempt(req_id)`` uses the second: it forms the next step ahead (``schedule_ahead``) while
the request samples, runs both, and withholds that token, so the scheduler releases the request
and sends it again in full (prompt plus the outputs it has), as after any preemption.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import msgpack

from deltaserve import _native, wire
from deltaserve.worker.executor import Executor

GREEDY = wire.SamplingParams(temperature=0.0, top_p=1.0, top_k=0, seed=None, logprobs=None)
"""Arg-max sampling, the default of ``SchedDriver.add``."""


class SchedDriver:
    """Runs requests on ``executor`` with plans from the real scheduler.

    ``variants`` maps a variant id (LoRA adapter or delta) to its directory; each is inspected by
    the executor now and registered with the scheduler when a request first needs it (again after
    ``evict``). ``adapter_of[req_id]`` names a request's variant (absent: the base model).
    ``max_num_batched_tokens`` is the scheduler's token budget per step, which chunks prefills;
    ``enable_prefix_caching`` lets new requests start on cached prefix pages (the router's default).
    ``gpu_load_reports``: a delta's ``to_gpu`` goes out ahead of its requests while others run, which
    are admitted once the worker reports the copy (``StepOutput.gpu_ready``), as the router does.
    ``delta_graph_tokens``: prompt chunks of steps with delta rows keep within it (None: the Hello's,
    as the router takes it: the executor's largest delta graph bucket, 0 without mixed graphs).
    """

    def __init__(
        self,
        executor: Executor,
        variants: dict[int, Path] | None = None,
        adapter_of: dict[int, int] | None = None,
        *,
        max_num_batched_tokens: int = 2048,
        enable_prefix_caching: bool = False,
        gpu_load_reports: bool = False,
        delta_graph_tokens: int | None = None,
    ) -> None:
        self.ex = executor
        self.variants = dict(variants or {})
        self.adapter_of = {} if adapter_of is None else adapter_of
        self.info: dict[int, wire.VariantInfo] = {}
        """The executor's inspection of each variant: kind, pages, host bytes."""
        for aid, path in self.variants.items():
            # As the router's admin workflow (engine/admin.rs): the marker file says the kind.
            kind = wire.VariantKind.DELTA if (Path(path) / "manifest.json").is_file() else wire.VariantKind.LORA
            info = executor.inspect_variant(str(path), kind)
            assert info.error is None, info.error
            self.info[aid] = info
        hello = executor.hello(wire.SCHEMA_HASH)  # the router sizes its scheduler from the Hello
        self.sched = _native.Scheduler(
            hello.kv.block_size,
            hello.kv.num_blocks,
            hello.model.max_model_len,
            max_num_batched_tokens=max_num_batched_tokens,
            max_deltas=0 if executor.delta_pool is None else executor.delta_pool.max_deltas,
            enable_prefix_caching=enable_prefix_caching,
            gpu_load_reports=gpu_load_reports,
            delta_graph_tokens=hello.delta_graph_tokens if delta_graph_tokens is None else delta_graph_tokens,
        )
        self.outputs: dict[int, list[int]] = {}
        """Output tokens of each request added, as the scheduler appended them."""
        self.step_id = 0
        """Id of the last plan formed."""
        self.plans: list[wire.StepPlan] = []
        """Every plan formed, in order."""
        self.clock = 0
        """Steps answered so far: the arrival stamp of requests added now."""
        self.mixed_steps = 0
        """Steps with rows of two or more variants, some prefill (more than 1 token) and some decode."""
        self.adapter_decode_steps = 0
        """Steps of decode rows only (1 token each), at least one of them with a variant."""
        self._on_worker: dict[int, list[int]] = {}
        """The worker's view of each request it holds: [known tokens, computed tokens, variant]."""
        self._samples: dict[tuple[int, int], bool] = {}
        """(step, request) -> whether that step samples the request's next token."""

    # ------------------------------------------------------------------------------ requests

    def add(self, req_id: int, prompt: list[int], max_new: int, sampling: wire.SamplingParams = GREEDY) -> None:
        """Queues a request with its variant (``adapter_of``), registering the variant if needed."""
        aid = self.adapter_of.get(req_id, 0)
        if aid and self.sched.adapter_residency(aid) is None:
            info = self.info[aid]
            self.sched.register_adapter(aid, info.kind.label, info.num_blocks, info.host_bytes, str(self.variants[aid]))
        self.sched.add_request(
            req_id,
            list(prompt),
            max_new,
            arrival=self.clock,
            adapter_id=aid,
            sampling=msgpack.packb(sampling.to_wire(), use_bin_type=True),
        )
        self.outputs[req_id] = []

    def evict(self, aid: int) -> list[int]:
        """Unregisters an idle variant: its pages are free at once, its ``drop_gpu`` / ``drop_host``
        go out with the next step. Returns the pages it held."""
        residency = self.sched.adapter_residency(aid)
        assert residency is not None, f"variant {aid} is not registered"
        self.sched.unregister_adapter(aid)
        return list(residency[1] or [])

    @property
    def unfinished(self) -> bool:
        """Whether a request is waiting or running."""
        return self.sched.has_unfinished()

    def adapter_pages(self, aid: int) -> list[int]:
        """The pool pages a GPU-resident LoRA adapter holds (empty when off the GPU)."""
        residency = self.sched.adapter_residency(aid)
        return list(residency[1] or []) if residency else []

    # ------------------------------------------------------------------------------ steps

    def plan(self) -> wire.StepPlan | None:
        """The scheduler's next step (``None``: nothing can run); with no step outstanding, as a
        step still outstanding would be abandoned."""
        return self._sent(self.sched.schedule())

    def plan_ahead(self) -> wire.StepPlan | None:
        """The step after the outstanding one, formed before its output (``None``: not now)."""
        return self._sent(self.sched.schedule_ahead())

    def apply(self, out: wire.StepOutput, withhold: int | None = None) -> None:
        """Checks the worker's answer and hands it to the scheduler, less ``withhold``'s token."""
        for o in out.outputs:
            samples = self._samples.pop((out.step_id, o.req_id))
            assert (o.token_id is not None) == samples, "exactly the requests that reach their end sample"
        unanswered = [rid for step, rid in self._samples if step == out.step_id]
        assert not unanswered, f"step {out.step_id}: no output for {unanswered}"
        if withhold is not None:
            out = dataclasses.replace(out, outputs=[o for o in out.outputs if o.req_id != withhold])
        for rid, token, _finished in self.sched.update(wire.encode(out)):
            self.outputs[rid].append(token)
        self.sched.check_invariants()
        self.clock += 1

    def step(self) -> wire.StepOutput:
        """Plans, runs and applies one step."""
        plan = self.plan()
        assert plan is not None, f"requests are left but the scheduler formed no step: {self.sched}"
        out = self.ex.step(plan)
        self.apply(out)
        return out

    def preempt(self, req_id: int, tries: int = 100) -> bool:
        """Runs steps until the scheduler has preempted ``req_id`` (see the module docstring), so
        the next plan releases it and sends it again in full. False if it finished first."""
        for _ in range(tries):
            if not self.sched.contains(req_id):
                return False
            plan = self.plan()
            assert plan is not None
            out = self.ex.step(plan)
            ahead = self.plan_ahead() if self._samples.get((plan.step_id, req_id)) else None
            if ahead is None:
                self.apply(out)
                continue
            ahead_out = self.ex.step(ahead)
            builds_on_it = any(r.req_id == req_id for r in ahead.running)
            before = self.sched.stats()["num_preemptions"]
            self.apply(out, withhold=req_id if builds_on_it else None)
            self.apply(ahead_out)
            if builds_on_it:
                assert self.sched.stats()["num_preemptions"] == before + 1 and self.sched.contains(req_id)
                return True
        raise AssertionError(f"request {req_id} was never scheduled in two steps in a row")

    def _sent(self, frame: bytes | None) -> wire.StepPlan | None:
        """Decodes a plan, follows it in the worker's view, and counts its shape."""
        if frame is None:
            return None
        plan = wire.decode(frame)
        assert isinstance(plan, wire.StepPlan)
        self.step_id = plan.step_id
        self.plans.append(plan)
        for rid in plan.released:
            self._on_worker.pop(rid, None)
        rows = []
        for new in plan.new_requests:
            self._on_worker[new.req_id] = [len(new.token_ids), new.num_computed_tokens, new.adapter_id]
            rows.append(self._schedule(plan.step_id, new.req_id, new.num_scheduled_tokens))
        for run in plan.running:
            rows.append(self._schedule(plan.step_id, run.req_id, run.num_scheduled_tokens))
        variants = {aid for _, aid in rows if aid}
        if len(variants) >= 2 and any(n > 1 for n, _ in rows) and any(n == 1 for n, _ in rows):
            self.mixed_steps += 1
        if variants and all(n == 1 for n, _ in rows):
            self.adapter_decode_steps += 1
        return plan

    def _schedule(self, step_id: int, rid: int, n: int) -> tuple[int, int]:
        """Records that ``step_id`` computes ``n`` tokens of ``rid``; returns ``(n, its variant)``."""
        view = self._on_worker[rid]
        view[1] += n
        samples = view[1] == view[0]
        view[0] += samples  # the sampled token is known to the worker from now on
        self._samples[(step_id, rid)] = samples
        return n, view[2]

    # ------------------------------------------------------------------------------ whole runs

    def run(
        self,
        reqs: dict[int, tuple[list[int], int]],
        arrivals: dict[int, int] | None = None,
        sampling: dict[int, wire.SamplingParams] | None = None,
    ) -> dict[int, list[int]]:
        """Runs ``reqs`` (``id -> (prompt, max_new)``), each added at its arrival step (default
        0), one step at a time until all are done; returns their outputs."""
        pending, added, steps = dict(reqs), [], 0
        while pending or self.unfinished:
            added += self._arrive(pending, arrivals, sampling, steps)
            if self.unfinished:
                self.step()
            steps += 1
            assert steps < 10_000
        return {rid: self.outputs[rid] for rid in added}

    def run_pipelined(
        self,
        reqs: dict[int, tuple[list[int], int]],
        arrivals: dict[int, int] | None = None,
        sampling: dict[int, wire.SamplingParams] | None = None,
    ) -> dict[int, list[int]]:
        """Like ``run``, but as the router's engine overlaps steps: while step N runs, step N+1 is
        formed (``schedule_ahead``) and launched behind it, scheduling the requests N samples
        for that token before anyone knows it; N is finished and applied after."""
        pending, added, steps = dict(reqs), [], 0
        in_flight: list = []  # launched steps, oldest first
        while pending or self.unfinished or in_flight:
            added += self._arrive(pending, arrivals, sampling, steps)
            if not in_flight and self.unfinished:
                plan = self.plan()
                assert plan is not None
                in_flight.append(self.ex.launch(plan, None))
            if len(in_flight) == 1 and (ahead := self.plan_ahead()) is not None:
                in_flight.append(self.ex.launch(ahead, in_flight[0]))
            if in_flight:
                self.apply(self.ex.finish(in_flight.pop(0)))
            steps += 1
            assert steps < 10_000
        return {rid: self.outputs[rid] for rid in added}

    def run_staggered(
        self, reqs: dict[int, tuple[list[int], int]], arrivals: dict[int, int], preempt: int
    ) -> dict[int, list[int]]:
        """Runs ``reqs`` arriving at their step numbers, preempting request ``preempt`` once after
        its second token (it comes back as a NewRequest and must keep its variant); returns outputs."""
        pending, added, steps, preempted = dict(reqs), [], 0, False
        while pending or self.unfinished:
            added += self._arrive(pending, arrivals, None, steps)
            if not preempted and self.sched.contains(preempt) and len(self.outputs[preempt]) >= 2:
                preempted = self.preempt(preempt)
            elif self.unfinished:
                self.step()
            steps += 1
            assert steps < 1000
        assert preempted, f"request {preempt} finished before it could be preempted"
        return {rid: self.outputs[rid] for rid in added}

    def _arrive(
        self,
        pending: dict[int, tuple[list[int], int]],
        arrivals: dict[int, int] | None,
        sampling: dict[int, wire.SamplingParams] | None,
        steps: int,
    ) -> list[int]:
        """Adds the requests of ``pending`` that arrive by step ``steps``; returns their ids."""
        due = [rid for rid in pending if (arrivals or {}).get(rid, 0) <= steps]
        for rid in due:
            prompt, max_new = pending.pop(rid)
            self.add(rid, prompt, max_new, (sampling or {}).get(rid, GREEDY))
        return due
