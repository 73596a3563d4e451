"""Batched token sampling: float32 logits ``[S, V]`` + per-row params -> token ids (+ logprobs).

Pipeline for one batch (each stage runs only when some row needs it)::

    logits [S, V] ─ adjusted (rows with logit_bias / min_tokens / penalties only: logit_adjust.py)
      ─ grammar masks (constrained rows only: -inf where the bitmask forbids; guidance.py)
      adjusted ─────┬─ greedy rows (temperature 0) ─────────────── argmax ──────────────┐
                    ├─ sampling rows: / temperature ─ top-k/top-p mask (one sort) ─ softmax
                    │     └─ draw: argmax(p / q), q ~ Exp(1)  (the "exponential race",     │
                    │        equivalent to a multinomial draw; q from the worker-global    │
                    │        generator, or per seeded row from Generator(hash(seed, i)))   │
                    └─ logprob rows: log_softmax(unmodified logits) ─ sampled + top-n ─────┴─> SampleResult

``Sampler.launch`` only queues this on the device (a ``LaunchedSample`` of tensors);
``LaunchedSample.result()`` waits and returns Python values. The executor launches step N+1,
whose inputs are step N's sampled tensor, before it waits for step N's result.

Determinism: a seeded row draws its noise from a generator seeded with ``hash(seed, i)`` where
``i`` is the index of the output token being drawn, and every other stage is row-local, so a seeded
request samples the same tokens whatever else is in its batch (and after a preemption and resume).

Logprobs are the log-softmax of the *unmodified* logits (no logit bias, ``min_tokens`` ban,
penalty, temperature, top-k or top-p): the OpenAI API reports the model's own distribution, and so
do vLLM's default (``raw_logprobs``) and TGI. A greedy, biased or penalized token therefore still
gets its true model probability (a token ``logit_bias`` forces may report a low one).

Penalties count the tokens so far, including the one the previous step is still sampling when
steps overlap: ``launch`` takes each row's known tokens (``history``) and ``in_flight``, a device
tensor of each row's token still on the device (-1 where none); the counts are built on the device
from both, so nothing waits (``logit_adjust.py``). Rows without bias, bans or penalties take no
extra work, and when no row has any the logits are not even copied.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from deltaserve.model.batch import to_device

from .guidance import apply_bitmask
from .logit_adjust import TokenHistory, adjusted_logits, is_penalized

if TYPE_CHECKING:
    from deltaserve import wire


@dataclass
class SampleResult:
    """What the sampler produced for each row, in row order."""

    #: The chosen token per row.
    token_ids: list[int]
    #: Logprob of the chosen token under the unmodified distribution; None where not requested.
    logprobs: list[float | None]
    #: Top-n ``(token_id, logprob)`` alternatives per row, most likely first; empty where not requested.
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)


def seed_for(seed: int, index: int) -> int:
    """The generator seed for output token ``index`` of a request seeded with ``seed``.

    A cryptographic hash keeps streams of neighbouring (seed, index) pairs unrelated; 63 bits so
    every torch version accepts it.
    """
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


@dataclass
class LaunchedSample:
    """Sampling queued on the device: the chosen tokens and logprobs as tensors, not yet on the host."""

    #: LongTensor [S]: the chosen token per row (a later step may read its inputs from it).
    token_ids: torch.Tensor
    #: Rows sampled.
    num_rows: int
    #: Rows that asked for logprobs, in order; the tensors below have one row per entry.
    logprob_rows: list[int] = field(default_factory=list)
    #: Top alternatives each of those rows asked for.
    top_n: list[int] = field(default_factory=list)
    #: [len(logprob_rows)]: logprob of the chosen token.
    picked: torch.Tensor | None = None
    #: [len(logprob_rows), max(top_n)]: the best logprobs and their token ids, most likely first.
    top_vals: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    #: On CUDA: pinned host copies of the tensors above, queued behind the sampling, and the
    #: event after them. ``result`` waits for that event only, not for steps launched later.
    host: dict[str, torch.Tensor] = field(default_factory=dict)
    copied: torch.cuda.Event | None = None
    #: ``result``'s value once read (the next step's grammar masks read it before ``finish`` does).
    cached: SampleResult | None = None

    def copy_to_host(self) -> None:
        """Queues the copies ``result`` reads (CUDA only; on the CPU it reads the tensors)."""
        if self.token_ids.device.type != "cuda":
            return
        for name in ("token_ids", "picked", "top_vals", "top_ids"):
            t = getattr(self, name)
            if t is not None:
                self.host[name] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                self.host[name].copy_(t, non_blocking=True)
        self.copied = torch.cuda.Event()
        self.copied.record()

    def result(self) -> SampleResult:
        """Waits for this step's samples (not for the device's later work); Python values."""
        if self.cached is None:
            self.cached = self._read()
        return self.cached

    def _read(self) -> SampleResult:
        if self.copied is not None:
            self.copied.synchronize()

        def values(name: str) -> list | None:
            t = self.host.get(name, getattr(self, name))
            return None if t is None else t.tolist()

        rows = self.num_rows
        token_ids = values("token_ids")
        assert token_ids is not None  # every row samples a token
        result = SampleResult(token_ids=token_ids, logprobs=[None] * rows, top_logprobs=[[] for _ in range(rows)])
        if self.picked is None:
            return result
        picked = values("picked")
        assert picked is not None  # self.picked is set
        top_vals, top_ids = values("top_vals"), values("top_ids")
        for j, r in enumerate(self.logprob_rows):
            result.logprobs[r] = float(picked[j])
            n = self.top_n[j]
            if n > 0 and top_ids is not None and top_vals is not None:
                result.top_logprobs[r] = list(zip(top_ids[j][:n], (float(v) for v in top_vals[j][:n])))
        return result


class Sampler:
    """Samples one token per row; holds the worker-global generator for unseeded requests."""

    def __init__(self, device: torch.device | str = "cpu", seed: int = 0) -> None:
        #: Device the logits live on; generators must match it.
        self.device = torch.device(device)
        #: Worker-global stream for requests without a seed (seeded from ``--seed``).
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)

    def sample(
        self,
        logits: torch.Tensor,
        params: list[wire.SamplingParams],
        output_index: list[int],
        history: Sequence[TokenHistory] | None = None,
        in_flight: torch.Tensor | None = None,
    ) -> SampleResult:
        """Samples one token per row of ``logits`` and waits for the result (``launch(...).result()``)."""
        return self.launch(logits, params, output_index, history, in_flight).result()

    @staticmethod
    def needs_history(params: Sequence[wire.SamplingParams]) -> bool:
        """Whether some row is penalized: ``launch`` then needs ``history`` (and ``in_flight``)."""
        return any(is_penalized(p) for p in params)

    def launch(
        self,
        logits: torch.Tensor,
        params: list[wire.SamplingParams],
        output_index: list[int],
        history: Sequence[TokenHistory] | None = None,
        in_flight: torch.Tensor | None = None,
        allowed: tuple[list[int], torch.Tensor] | None = None,
    ) -> LaunchedSample:
        """Queues the sampling of one token per row of ``logits`` on its device; nothing waits.

        Shape: logits [S, V] float32; params and output_index have length S. ``output_index[r]``
        is the index of the output token row r draws (seeds the per-request generator and gates
        ``min_tokens``). ``history[r]`` holds row r's tokens the host knows and ``in_flight`` [S]
        (LongTensor on the logits' device) its output token still on the device, or -1; both are
        read only when ``needs_history(params)``. ``allowed`` is the grammar masks of the
        constrained rows (``guidance.py``: the rows and their ``[rows, V/32]`` int32 bitmask on the
        device), applied after the bias and penalties. Every read of ``logits`` is queued here, so
        the caller may overwrite them (a graph replay) before ``result()``.
        """
        num_rows, vocab = logits.shape
        if len(params) != num_rows or len(output_index) != num_rows:
            raise ValueError(
                f"sampler got {num_rows} logit rows but {len(params)} params / {len(output_index)} indices"
            )
        raw = logits.float()
        logits = adjusted_logits(raw, params, output_index, history, in_flight)
        if allowed is not None:
            logits = apply_bitmask(logits.clone() if logits is raw else logits, *allowed)
        device = logits.device
        chosen = torch.empty(num_rows, dtype=torch.long, device=device)

        greedy = [r for r, p in enumerate(params) if p.temperature <= 0.0]
        sampled = [r for r, p in enumerate(params) if p.temperature > 0.0]
        if greedy:
            if len(greedy) == num_rows:
                chosen = logits.argmax(dim=-1)
            else:
                rows = to_device(greedy, torch.long, device)
                chosen[rows] = logits[rows].argmax(dim=-1)
        if sampled:
            rows = to_device(sampled, torch.long, device)
            chosen[rows] = self._sample_rows(
                logits[rows], [params[r] for r in sampled], [output_index[r] for r in sampled]
            )

        launched = LaunchedSample(token_ids=chosen, num_rows=num_rows)
        want = [r for r, p in enumerate(params) if p.logprobs is not None]
        if want:
            rows = to_device(want, torch.long, device)
            logprobs = torch.log_softmax(raw[rows], dim=-1)
            launched.logprob_rows = want
            launched.top_n = [min(int(params[r].logprobs or 0), vocab) for r in want]
            launched.picked = logprobs.gather(1, chosen[rows].unsqueeze(1)).squeeze(1)
            max_n = max(launched.top_n)
            if max_n > 0:
                launched.top_vals, launched.top_ids = logprobs.topk(max_n, dim=-1, sorted=True)
        launched.copy_to_host()
        return launched

    def _sample_rows(
        self, logits: torch.Tensor, params: list[wire.SamplingParams], output_index: list[int]
    ) -> torch.Tensor:
        """Random draw for rows with temperature > 0. Shape: logits [R, V] -> token ids [R]."""
        num_rows, vocab = logits.shape
        device = logits.device
        temps = to_device([p.temperature for p in params], torch.float32, device)
        scaled = logits / temps.unsqueeze(1)

        top_k = [int(p.top_k) if 0 < p.top_k < vocab else 0 for p in params]
        top_p = [float(p.top_p) if 0.0 < p.top_p < 1.0 else 1.0 for p in params]
        truncate = any(top_k) or any(v < 1.0 for v in top_p)
        if truncate:
            # Work in sorted order (one stable sort serves both filters); map back at the end.
            scaled, order = scaled.sort(dim=-1, descending=True, stable=True)
            positions = torch.arange(vocab, device=device).unsqueeze(0)
            if any(top_k):
                k = to_device([k or vocab for k in top_k], torch.long, device).unsqueeze(1)
                scaled = scaled.masked_fill(positions >= k, float("-inf"))
            if any(v < 1.0 for v in top_p):
                p = to_device(top_p, torch.float32, device).unsqueeze(1)
                probs_sorted = torch.softmax(scaled, dim=-1)
                mass_before = probs_sorted.cumsum(dim=-1) - probs_sorted
                # Keep the smallest prefix whose mass reaches p; the first token always stays.
                scaled = scaled.masked_fill((mass_before >= p) & (positions > 0), float("-inf"))
        probs = torch.softmax(scaled, dim=-1)

        noise = torch.empty_like(probs)
        unseeded = [j for j, prm in enumerate(params) if prm.seed is None]
        if unseeded:
            if len(unseeded) == num_rows:
                noise.exponential_(generator=self.generator)
            else:
                draw = torch.empty(len(unseeded), vocab, device=device).exponential_(generator=self.generator)
                noise[to_device(unseeded, torch.long, device)] = draw
        for j, prm in enumerate(params):
            if prm.seed is not None:
                gen = torch.Generator(device=device)
                gen.manual_seed(seed_for(int(prm.seed), output_index[j]))
                noise[j].exponential_(generator=gen)
        # argmax(p / q) with q ~ Exp(1) picks token t with probability p_t (exponential race).
        # The clamp keeps a (measure-zero) q == 0 from turning a masked p == 0 into 0/0 = nan.
        picked = (probs / noise.clamp_min_(1e-20)).argmax(dim=-1)
        if truncate:
            picked = order.gather(1, picked.unsqueeze(1)).squeeze(1)
        return picked
