"""The forward runner: one step's forward pass and sampling queued on the device, then its tokens.

``launch`` builds the step's rows from the scheduled requests (each computes tokens
``[num_computed, num_computed + n)`` and wants logits only when that reaches the end of its known
tokens; a partial prefill chunk does not), picks how to run them and queues the sampling::

    decode step a captured graph takes (``DecodeGraphs.takes``) ──> DecodeGraphs.run_rows: replay
    prefill / mixed step a token bucket takes (``MixedGraphs.takes``) ──> MixedGraphs.run_rows: replay
    anything else ──> every variant pool's begin_step(rows) ── DecoderLM.forward ── end_step
    ──> Sampler.launch over the logits rows

CUDA graphs: each decode bucket has a plain graph (no LoRA work, for base-only steps) and, with
LoRA on, a graph captured with the adapted linears active over static metadata; decode steps with
delta rows replay a graph of the step's delta configs (and LoRA rows, if any), captured when a
config's first delta is registered or else the first time such a step comes, where the CUDA SBMM op runs (else they run eagerly). Prefill and mixed steps
whose tokens fit a token bucket replay a graph of that bucket (``mixed_graphs.py``; LoRA rows
included; delta rows in steps of at most ``DELTASERVE_CUDA_GRAPH_MAX_DELTA_TOKENS`` tokens, a graph per delta bucket and
configs, captured likewise); beyond it, or with prompt logprobs or CPU-assisted
prefills, they run eagerly.

A running request whose last sampled token is still on the device (the step before is in flight)
computes it anyway: its input row is copied on the device from that step's sampled tensor, and so
is the token the sampler's penalties count (``in_flight_tokens``). A constrained request's grammar
mask needs that token on the host: the launch queues the forward, then waits for the step before's
sampled tokens (not for this forward) and fills the masks while the device runs it (``guidance.py``).
``finish`` waits for the sampled tokens and appends them to their requests.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from deltaserve import wire
from deltaserve.adapters.variants import StepRows, VariantKind, VariantPool
from deltaserve.helpers.assist import CpuAssist
from deltaserve.model.batch import ForwardBatch, to_device
from deltaserve.model.decoder import DecoderLM
from deltaserve.model.kv_cache import PagedKVCache

from . import prompt_logprobs
from .cuda_graphs import DecodeGraphs
from .guidance import GrammarGate
from .mixed_graphs import MixedGraphs
from .prompt_logprobs import LaunchedPromptLogprobs
from .requests import RequestState
from .sampler import LaunchedSample, Sampler


@dataclass
class LaunchedStep:
    """A step whose forward and sampling are queued on the device; ``Executor.finish`` completes it."""

    #: The plan's step id.
    step_id: int
    #: Every scheduled request and its token count, in batch order.
    scheduled: list[tuple[RequestState, int]]
    #: The requests that sample a token, in the sampled tensor's row order.
    samplers: list[RequestState]
    #: When the launch began (``timing.forward_us`` runs from here to the tokens being on the host).
    started: float
    #: The queued sampling (None when no request samples).
    sampled: LaunchedSample | None = None
    #: req_id -> its row in ``sampled``.
    sample_row: dict[int, int] = field(default_factory=dict)
    #: Recorded after the step's work on CUDA; None on CPU (work there is done when launch returns).
    done: torch.cuda.Event | None = None
    #: The step's floor (``step_floor.py``), set by the executor: ``timing.floor_us``.
    floor_us: int = 0
    #: Prompt logprobs queued for the requests that asked (``prompt_logprobs.py``).
    prompt: LaunchedPromptLogprobs | None = None

    def is_done(self) -> bool:
        """Whether the device has finished the step (``finish`` would not wait)."""
        return self.done is None or self.done.query()


class ForwardRunner:
    """Queues steps' forwards (graph replay or eager, with every variant pool's step state) and sampling."""

    def __init__(
        self,
        model: DecoderLM,
        kv: PagedKVCache,
        sampler: Sampler,
        pools: Mapping[VariantKind, VariantPool],
        graphs: DecodeGraphs | None,
        block_size: int,
    ) -> None:
        self.model = model
        self.kv = kv
        self.sampler = sampler
        self.pools = pools
        """The executor's variant pools by kind (the same dict)."""
        self.graphs = graphs
        """Captured decode steps, when enabled."""
        self.block_size = block_size
        self.device = kv.device
        self.assist: CpuAssist | None = None
        """CPU-assisted cold prefills, set by the executor when the helpers are on."""
        self.guidance: GrammarGate | None = None
        """Structured output's masks (``guidance.py``), set by the executor."""
        self.mixed: MixedGraphs | None = None
        """Captured prefill and mixed steps by token bucket (``mixed_graphs.py``), set by the executor."""

    def launch(
        self,
        step_id: int,
        scheduled: list[tuple[RequestState, int]],
        in_flight: LaunchedStep | None,
        eager: bool = False,
    ) -> LaunchedStep:
        """Queues the forward and sampling of ``scheduled`` (requests already updated by the plan);
        ``eager``: no captured graph replays (or is captured for) the step (``forward``)."""
        launched = LaunchedStep(step_id=step_id, scheduled=scheduled, samplers=[], started=time.perf_counter())
        if not scheduled:
            return launched
        seqs = []
        samplers = launched.samplers
        # Input rows that are tokens still being sampled by ``in_flight``: (row, its sampled row).
        patch_rows: list[int] = []
        patch_from: list[int] = []
        row = 0
        for state, n in scheduled:
            end = state.num_computed + n
            known = len(state.token_ids)
            wants_logits = end == known + state.pending
            tokens = state.token_ids[state.num_computed : end]
            if end > known:  # the pending token: a placeholder here, filled on the device below
                assert in_flight is not None and end == known + 1 == state.num_computed + 1
                patch_rows.append(row)
                patch_from.append(in_flight.sample_row[state.req_id])
                tokens = [0]
            seqs.append((tokens, state.num_computed, state.block_table, wants_logits))
            if wants_logits:
                samplers.append(state)
            row += n
        pending_inputs = None
        if patch_rows:
            assert in_flight is not None and in_flight.sampled is not None
            pending_inputs = (
                to_device(patch_rows, torch.long, self.device),
                in_flight.sampled.token_ids.index_select(0, to_device(patch_from, torch.long, self.device)),
            )
        decode = len(samplers) == len(seqs) and all(n == 1 for _, n in scheduled)
        prompt = prompt_logprobs.select(scheduled)
        logit_ids = [s.variant_id for s in samplers] + (prompt.variant_ids if prompt else [])
        rows = StepRows([(s.variant_id, n) for s, n in scheduled], logit_ids, decode)
        with torch.inference_mode():
            logits = self.forward(seqs, rows, pending_inputs, prompt.rows if prompt else None, eager)
            if prompt is not None:
                launched.prompt = prompt_logprobs.launch(prompt, logits[len(samplers) :])
                logits = logits[: len(samplers)]
            if samplers:
                params = [s.sampling for s in samplers]
                history = in_flight_tokens = None
                if self.sampler.needs_history(params):
                    history, in_flight_tokens = samplers, self.in_flight_tokens(samplers, in_flight)
                allowed = None
                if self.guidance is not None and any(s.grammar is not None for s in samplers):
                    # The forward is queued: the masks are computed while the device runs it.
                    allowed = self.guidance.masks(samplers, self.in_flight_on_host(samplers, in_flight), self.device)
                launched.sampled = self.sampler.launch(
                    logits,
                    params,
                    [len(s.token_ids) + s.pending - s.num_prompt_tokens for s in samplers],
                    history,
                    in_flight_tokens,
                    allowed,
                )
        # The step's tokens are computed (or queued to be): the next step continues from there.
        for state, n in scheduled:
            state.num_computed += n
        for j, state in enumerate(samplers):
            state.pending += 1
            launched.sample_row[state.req_id] = j
        if self.device.type == "cuda":
            launched.done = torch.cuda.Event()
            launched.done.record()
        return launched

    def in_flight_tokens(self, samplers: list[RequestState], in_flight: LaunchedStep | None) -> torch.Tensor | None:
        """[len(samplers)] on the device: each sampling request's output token that ``in_flight`` is
        still sampling (not yet in its ``token_ids``), -1 where none; None when no request has one.
        Penalties count it (the sampler's docs)."""
        rows = [j for j, s in enumerate(samplers) if s.pending]
        if not rows:
            return None
        assert in_flight is not None and in_flight.sampled is not None
        source = [in_flight.sample_row[samplers[j].req_id] for j in rows]
        tokens = torch.full((len(samplers),), -1, dtype=torch.long, device=self.device)
        sampled = in_flight.sampled.token_ids.index_select(0, to_device(source, torch.long, self.device))
        return tokens.index_copy_(0, to_device(rows, torch.long, self.device), sampled)

    def in_flight_on_host(self, samplers: list[RequestState], in_flight: LaunchedStep | None) -> list[int | None]:
        """Each constrained sampling request's output token ``in_flight`` is still sampling, read on
        the host (None where none): waits for that step's sampled tokens only, not for the forward
        queued since (``guidance.py`` explains how masks follow the token sampled one step earlier)."""
        if not any(s.pending and s.grammar is not None for s in samplers):
            return [None] * len(samplers)
        assert in_flight is not None and in_flight.sampled is not None
        tokens = in_flight.sampled.result().token_ids
        return [
            tokens[in_flight.sample_row[s.req_id]] if s.pending and s.grammar is not None else None for s in samplers
        ]

    def forward(
        self,
        seqs: list,
        rows: StepRows,
        pending_inputs: tuple[torch.Tensor, torch.Tensor] | None,
        extra_logit_rows: list[int] | None = None,
        eager: bool = False,
    ) -> torch.Tensor:
        """Logits of the rows that want them (then of ``extra_logit_rows``, prompt logprobs'): a
        captured graph's replay when one takes the step (unless ``eager``: a step whose model hooks
        must run, as a speculated prefill's gate), else an eager forward with every variant pool's
        step state set (pools without rows of the step set nothing)."""
        graphed = not eager and not extra_logit_rows
        if graphed and rows.decode and self.graphs is not None and self.graphs.takes(rows):
            return self.graphs.run_rows(ForwardBatch.build(seqs, self.block_size, "cpu"), rows, pending_inputs)
        mixed = self.mixed
        if graphed and mixed is not None and not (self.assist and self.assist.cold) and mixed.takes(rows):
            return mixed.run_rows(ForwardBatch.build(seqs, self.block_size, "cpu"), rows, pending_inputs)
        batch = ForwardBatch.build(seqs, self.block_size, self.device)
        if extra_logit_rows:
            extra = to_device(extra_logit_rows, torch.long, self.device)
            batch.logits_indices = torch.cat([batch.logits_indices, extra])
        if pending_inputs is not None:
            batch.input_ids.index_copy_(0, *pending_inputs)
        begun: list[VariantPool] = []
        try:
            if self.assist is not None:
                rows = self.assist.begin(rows)  # cold adapters' rows: the helpers', base for the pools
            if any(v != 0 for v, _ in rows.runs):  # a base-only step sets nothing
                for pool in self.pools.values():
                    if pool.begin_step(rows):
                        begun.append(pool)
            return self.model.forward(batch, self.kv)
        finally:
            for pool in begun:
                pool.end_step()
            if self.assist is not None:
                self.assist.end()

    def finish(self, launched: LaunchedStep) -> tuple[list[wire.RequestOutput], int]:
        """Waits for ``launched``'s sampled tokens and appends them to their requests; returns each
        scheduled request's output (``token_id`` None for partial prefill chunks) and ``forward_us``."""
        sampled = launched.sampled.result() if launched.sampled is not None else None
        prompt = launched.prompt.result() if launched.prompt is not None else {}
        forward_us = int((time.perf_counter() - launched.started) * 1e6)
        outputs = []
        for state, _ in launched.scheduled:
            j = launched.sample_row.get(state.req_id)
            if j is None or sampled is None:  # a partial prefill chunk: nothing to sample yet
                outputs.append(
                    wire.RequestOutput(
                        req_id=state.req_id,
                        token_id=None,
                        logprob=None,
                        top_logprobs=[],
                        prompt_logprobs=prompt.get(state.req_id, []),
                    )
                )
                continue
            token = sampled.token_ids[j]
            state.token_ids.append(token)
            state.pending -= 1
            outputs.append(
                wire.RequestOutput(
                    req_id=state.req_id,
                    token_id=token,
                    logprob=sampled.logprobs[j],
                    top_logprobs=[wire.TokenLogprob(token_id=t, logprob=lp) for t, lp in sampled.top_logprobs[j]],
                    prompt_logprobs=prompt.get(state.req_id, []),
                )
            )
        return outputs, forward_us
