"""Structured output: one llguidance matcher per constrained request, and the token masks the
sampler applies to those rows (``SamplingParams.grammar``: ``response_format`` and ``tools``).

Why llguidance (the PyPI wheel, used here in the worker): it is maintained (vLLM and SGLang use
it), its Rust core computes a mask in about 50 µs with JSON Schema and Lark grammars, and a
prebuilt abi3 wheel costs CI no compile time (the Rust crate would add minutes to the 2-core
build of both the daemon and the native module).

Life of a constrained request on the worker::

    NewRequest with grammar ── GrammarGate.admit_plan: compile (LLMatcher) ──┬─ error: the request leaves
        │                                                                    │  the plan, reported in
        │                                                                    │  StepOutput.refused_requests
        ▼                                                                    │  (and its later running
    RequestState.grammar = Constrained(matcher, consumed=0)                  │  entries are skipped until
        │                                                                    │  the router releases it)
        ▼ every step that samples it (runner.launch, after queuing the forward):
    catch up: consume output tokens [consumed, known) + the in-flight token ── fill its bitmask row
        ── copy the [rows, V/32] bitmask to the device ── the sampler sets -inf where a bit is 0

How masks follow the token sampled one step earlier (overlapped steps). Step N+1 is launched
while the device still runs step N; a request that sampled in N computes that token in N+1 from
N's sampled tensor, and the host does not know it yet (``RequestState.pending``). Its mask for
N+1 depends on it, so ``runner.launch`` first queues N+1's forward, then waits for N's sampled
tokens only (the event recorded right after N's sampling, ``LaunchedSample.result``; not N+1's
work), advances the matcher with that token, and fills the masks on the CPU while the device
runs N+1's forward; the sampling queued after it reads the mask. Unconstrained batches wait for
nothing and pay nothing; rows of a mixed batch without a grammar are untouched. A matcher counts
the output tokens it consumed, so after a preemption (a NewRequest that carries the tokens
generated before) the new matcher is rebuilt by consuming them at the first mask.

When the grammar is complete the mask allows only the model's EOS ids, so the request ends by
EOS. A matcher that errs (it cannot: every token it consumes was allowed by its own mask) also
gets an EOS-only mask, with a log line, never a crash. Masks are row-local and deterministic, so
a constrained row samples the same tokens whatever else is in its batch, seeded like any other.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from deltaserve import wire
from deltaserve.model.batch import host_to_device, to_device

if TYPE_CHECKING:
    from .requests import RequestState

log = logging.getLogger(__name__)

#: Bits per word of an llguidance bitmask (int32 words, bit i of word w is token 32 * w + i).
BITS = 32
#: Constrained rows from which a CUDA worker fills the masks on llguidance's thread pool. Fewer
#: rows, or a CPU worker, fill them one by one on this thread: the pool's threads spin after
#: their work, which on the CPU took the cores from torch's own threads (a 4x slower forward
#: on 2 cores).
PARALLEL_MIN_ROWS = 8


@dataclass
class Constrained:
    """A constrained request's grammar state on the worker."""

    #: The llguidance ``LLMatcher`` (typed loosely: llguidance is imported lazily).
    matcher: Any
    #: Output tokens the matcher has consumed (output i is ``token_ids[num_prompt_tokens + i]``).
    consumed: int = 0
    #: The matcher erred once (logged once; its masks allow only EOS since).
    failed: bool = False


class GrammarGate:
    """Compiles the grammars of a plan's new requests, refuses those that do not compile, and fills
    the masks of the constrained rows of a step. The llguidance tokenizer is built from the model's
    ``tokenizer.json`` at the first grammar (unconstrained workloads never pay for it)."""

    def __init__(self, model_dir: Path, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.model_dir = Path(model_dir)
        """Where ``tokenizer.json`` is (the router tokenizes with the same file)."""
        self.vocab_size = vocab_size
        """The logits' width: tokens past the tokenizer's vocabulary are never allowed."""
        self.eos_token_ids = list(eos_token_ids)
        """The ids the router stops on: what a complete grammar allows."""
        self._tokenizer: Any = None
        self._executor: Any = None
        self.refused: list[wire.RefusedRequest] = []
        """Refusals since the last ``take_refusals``."""
        self.dropped: set[int] = set()
        """Refused requests the router may still schedule as running (a plan formed before it
        heard of the refusal), until it releases them."""

    @property
    def words(self) -> int:
        """int32 words of one row's bitmask."""
        return (self.vocab_size + BITS - 1) // BITS

    def tokenizer(self) -> Any:
        """The llguidance tokenizer (built once)."""
        if self._tokenizer is None:
            import llguidance

            path = self.model_dir / "tokenizer.json"
            if not path.is_file():
                raise GrammarError("structured output needs the model's tokenizer.json, which it lacks")
            self._tokenizer = llguidance.LLTokenizer(
                path.read_text(), n_vocab=self.vocab_size, eos_token=self.eos_token_ids or None
            )
        return self._tokenizer

    def compile(self, grammar: str) -> Constrained:
        """A fresh matcher for ``grammar``; raises ``GrammarError`` with llguidance's message."""
        import llguidance

        tokenizer = self.tokenizer()
        try:
            matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        except Exception as e:  # noqa: BLE001 - whatever a client's grammar does refuses only it
            raise GrammarError(f"{type(e).__name__}: {e}") from e
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return Constrained(matcher)

    def admit_plan(
        self, plan: wire.StepPlan, requests: MutableMapping[int, RequestState]
    ) -> tuple[wire.StepPlan, dict[int, Constrained]]:
        """``plan`` without its new requests whose grammar does not compile (reported by the next
        ``take_refusals``) and without running entries of requests refused earlier; with the
        compiled matchers of the others by req_id. ``plan`` itself when nothing is removed."""
        self.dropped.difference_update(plan.released)
        compiled: dict[int, Constrained] = {}
        refused: set[int] = set()
        for new in plan.new_requests:
            if new.sampling.grammar is None:
                continue
            try:
                compiled[new.req_id] = self.compile(new.sampling.grammar)
            except GrammarError as e:
                message = f"the grammar does not compile: {e}"
                log.warning("request %d refused: %s", new.req_id, message)
                self.refused.append(wire.RefusedRequest(req_id=new.req_id, message=message))
                refused.add(new.req_id)
                requests.pop(new.req_id, None)
        self.dropped.update(refused)
        if not self.dropped or not (refused or any(r.req_id in self.dropped for r in plan.running)):
            return plan, compiled
        new_requests = [n for n in plan.new_requests if n.req_id not in refused]
        running = [r for r in plan.running if r.req_id not in self.dropped]
        return dataclasses.replace(plan, new_requests=new_requests, running=running), compiled

    def take_refusals(self) -> list[wire.RefusedRequest]:
        """The refusals to report in the next StepOutput (each once)."""
        out, self.refused = self.refused, []
        return out

    def masks(
        self, samplers: Sequence[RequestState], in_flight_tokens: Sequence[int | None], device: torch.device
    ) -> tuple[list[int], torch.Tensor] | None:
        """The constrained rows of a step and their bitmask ``[rows, words]`` int32 on ``device``
        (``host_to_device``: no wait for the device's queued work); None when no row is constrained.

        ``in_flight_tokens[j]`` is row j's output token the previous step sampled and the host
        has not appended yet (None where none): the matcher consumes it before the mask.
        """
        rows = [j for j, s in enumerate(samplers) if s.grammar is not None]
        if not rows:
            return None
        bitmask = torch.empty((len(rows), self.words), dtype=torch.int32)
        batch = []
        for i, j in enumerate(rows):
            state = samplers[j]
            constrained = state.grammar
            assert constrained is not None
            self.catch_up(state, constrained, in_flight_tokens[j])
            if constrained.failed:
                self.eos_only(bitmask[i])
            else:
                batch.append((constrained.matcher, i))
        if batch:
            self.fill(batch, bitmask, parallel=device.type == "cuda" and len(batch) >= PARALLEL_MIN_ROWS)
        return rows, host_to_device(bitmask, device)

    def catch_up(self, state: RequestState, constrained: Constrained, in_flight: int | None) -> None:
        """Consumes the output tokens ``constrained`` has not seen: the host's, then ``in_flight``."""
        outputs = state.token_ids[state.num_prompt_tokens :]
        new = outputs[constrained.consumed :] + ([in_flight] if in_flight is not None else [])
        if not new or constrained.failed:
            constrained.consumed += len(new)
            return
        matcher = constrained.matcher
        if matcher.is_stopped():
            constrained.consumed += len(new)  # EOS (again, with ignore_eos): nothing left to match
            return
        if not matcher.consume_tokens(new):
            constrained.failed = True
            log.error("request %d: grammar matcher failed: %s", state.req_id, matcher.get_error())
        constrained.consumed += len(new)

    def fill(self, batch: list[tuple[Any, int]], bitmask: torch.Tensor, parallel: bool = False) -> None:
        """Fills ``bitmask``'s row i for each ``(matcher, i)``: on llguidance's threads when
        ``parallel``, else one after the other here (``PARALLEL_MIN_ROWS``)."""
        row_bytes = self.words * 4
        if parallel:
            import llguidance

            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            self._executor.unsafe_compute_mask_ptr(batch, bitmask.data_ptr(), row_bytes, bitmask.shape[0])
        else:
            for matcher, i in batch:
                matcher.unsafe_compute_mask_ptr(bitmask[i].data_ptr(), row_bytes)
        for matcher, i in batch:
            if matcher.is_error():  # e.g. a limit hit while computing the mask
                log.error("grammar matcher failed computing a mask: %s", matcher.get_error())
                self.eos_only(bitmask[i])

    def eos_only(self, row: torch.Tensor) -> None:
        """Sets ``row`` (one bitmask row) to allow only the EOS ids."""
        words: dict[int, int] = {}
        for eos in self.eos_token_ids:
            words[eos // BITS] = words.get(eos // BITS, 0) | (1 << (eos % BITS))
        row.zero_()
        for w, bits in words.items():
            row[w] = bits - (1 << BITS) if bits >= 1 << (BITS - 1) else bits  # as a signed int32


class GrammarError(ValueError):
    """A grammar llguidance refuses (its message says why)."""


def apply_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> torch.Tensor:
    """``logits`` [S, V] with -inf at the tokens ``bitmask`` [len(rows), words] forbids in ``rows``
    (in place; returned). Row-local: other rows are untouched."""
    vocab = logits.shape[1]
    shifts = torch.arange(BITS, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :vocab]
    index = to_device(rows, torch.long, logits.device)
    logits[index] = logits.index_select(0, index).masked_fill(~allowed, float("-inf"))
    return logits
