"""Traces as the simulator reads them: arrival times, prompt and output lengths, and the variant
of every request, plus the variants' kinds and ranks (:class:`SimTrace`).

Sources (:func:`load_trace`): a JSONL file in the format of ``bench/workload.py`` (a header line
``{"trace": {..., "variants": [{"name", "kind", "rank"}, ...]}}`` then one request per line:
``{"t", "variant", "prompt" (token ids) or "prompt_len", "output_len"}``, optionally
``"prompt_key"``: an integer naming the prompt's contents, equal for equal prompts, given for
every request or none; with keys the simulator runs the daemon's prefix caching), any object with
``requests`` and ``variants`` attributes in that shape (``bench.workload.Trace``), or a
:class:`SimTrace`. Variant kinds: ``"lora"`` (with a rank), ``"full"`` or ``"delta"`` (a
compressed full fine-tune); a request names its variant, or ``None`` / ``""`` for the base model.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

DELTA_KINDS = ("full", "delta")
"""Trace kinds served as compressed deltas."""


@dataclass(frozen=True)
class SimVariant:
    """A variant named by a trace."""

    name: str
    """What requests name."""
    kind: str
    """``"lora"`` or ``"delta"``."""
    rank: int = 0
    """LoRA rank (0 for a delta)."""


@dataclass(frozen=True)
class SimTrace:
    """Requests in arrival order, as parallel tuples."""

    arrival_s: tuple[float, ...]
    """Arrival of each request, seconds from the start."""
    prompt_len: tuple[int, ...]
    """Prompt tokens of each request."""
    output_len: tuple[int, ...]
    """Output tokens of each request (forced: ``max_tokens`` with EOS ignored)."""
    variant: tuple[int, ...]
    """Each request's variant: 0 for the base model, ``i + 1`` for ``variants[i]``."""
    variants: tuple[SimVariant, ...] = ()
    """Every variant the trace defines."""
    prompt_key: tuple[int, ...] | None = None
    """Each request's prompt identity (equal keys: equal prompts; 0 <= key < 2**64), or None:
    the prompts' contents are unknown and the simulator runs without prefix caching."""

    def __len__(self) -> int:
        return len(self.arrival_s)

    @property
    def duration_s(self) -> float:
        """Arrival of the last request."""
        return max(self.arrival_s, default=0.0)

    @property
    def rate(self) -> float:
        """Mean arrival rate (requests/s): requests over the last arrival time."""
        return len(self) / self.duration_s if self.duration_s > 0 else math.inf

    def at_rate(self, rate: float) -> SimTrace:
        """The same requests with arrival times scaled so the mean rate is ``rate`` req/s."""
        if not (rate > 0 and math.isfinite(rate)):
            raise ValueError(f"rate {rate}: want a positive number of requests/s")
        k = self.rate / rate
        return replace(self, arrival_s=tuple(t * k for t in self.arrival_s))

    def head(self, n: int) -> SimTrace:
        """The first ``n`` requests."""
        keys = None if self.prompt_key is None else self.prompt_key[:n]
        return replace(self, arrival_s=self.arrival_s[:n], prompt_len=self.prompt_len[:n],
                       output_len=self.output_len[:n], variant=self.variant[:n], prompt_key=keys)  # fmt: skip


def _variant(v: Any, where: str) -> SimVariant:
    get = v.get if isinstance(v, dict) else lambda k, d=None: getattr(v, k, d)
    name, kind, rank = get("name"), get("kind"), get("rank") or 0
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}: a variant needs a non-empty name, got {name!r}")
    if kind in DELTA_KINDS:
        return SimVariant(name, "delta", 0)
    if kind != "lora" or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"{where}: variant {name!r}: want kind 'lora' with a rank >= 1, or 'full' / 'delta'; "
                         f"got kind {kind!r}, rank {rank!r}")  # fmt: skip
    return SimVariant(name, "lora", rank)


def from_requests(requests: list[Any], variants: list[Any], where: str = "trace") -> SimTrace:
    """A :class:`SimTrace` of request and variant records (dicts or objects, module docstring),
    sorted by arrival (stable)."""
    vs = tuple(_variant(v, where) for v in variants)
    index = {v.name: i + 1 for i, v in enumerate(vs)}
    rows = []
    for k, r in enumerate(requests):
        get = r.get if isinstance(r, dict) else lambda key, d=None, r=r: getattr(r, key, d)
        t, name, out = get("t"), get("variant"), get("output_len")
        prompt = get("prompt")
        plen = len(prompt) if prompt is not None else get("prompt_len")
        if not isinstance(t, int | float) or not math.isfinite(t) or t < 0:
            raise ValueError(f"{where}: request {k}: t must be seconds >= 0, got {t!r}")
        if not isinstance(plen, int) or plen < 1 or not isinstance(out, int) or out < 1:
            raise ValueError(f"{where}: request {k}: want a prompt and output_len of at least 1 token, "
                             f"got {plen!r} and {out!r}")  # fmt: skip
        if name not in (None, "") and name not in index:
            raise ValueError(f"{where}: request {k}: variant {name!r} is not among the trace's variants")
        key = get("prompt_key")
        if key is not None and not (isinstance(key, int) and 0 <= key < 2**64):
            raise ValueError(f"{where}: request {k}: prompt_key must be an integer in [0, 2**64), got {key!r}")
        rows.append((float(t), plen, out, index.get(name, 0) if name else 0, key))
    keyed = sum(r[4] is not None for r in rows)
    if 0 < keyed < len(rows):
        raise ValueError(
            f"{where}: {keyed} of {len(rows)} requests have a prompt_key: give it for every request or none"
        )
    rows.sort(key=lambda row: row[0])
    return SimTrace(arrival_s=tuple(r[0] for r in rows), prompt_len=tuple(r[1] for r in rows),
                    output_len=tuple(r[2] for r in rows), variant=tuple(r[3] for r in rows), variants=vs,
                    prompt_key=tuple(r[4] for r in rows if r[4] is not None) if keyed else None)  # fmt: skip


def read_jsonl(path: str | Path) -> SimTrace:
    """A trace file in ``bench/workload.py``'s format; a bad line raises ``ValueError`` naming it."""
    path = Path(path)
    lines = path.read_text().splitlines()
    if not lines:
        raise ValueError(f"{path}: empty trace file (expected a header line)")
    try:
        header = json.loads(lines[0])["trace"]
        variants = header["variants"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f'{path}:1: bad header ({e}); expected {{"trace": {{..., "variants": [...]}}}}') from None
    requests = []
    for lineno, line in enumerate(lines[1:], start=2):
        try:
            requests.append(json.loads(line))
        except ValueError as e:
            raise ValueError(f"{path}:{lineno}: bad request line ({e})") from None
    return from_requests(requests, variants, where=str(path))


def load_trace(trace: Any) -> SimTrace:
    """A :class:`SimTrace` from a path, a ``bench.workload.Trace``-like object or a SimTrace."""
    if isinstance(trace, SimTrace):
        return trace
    if isinstance(trace, str | Path):
        return read_jsonl(trace)
    if hasattr(trace, "requests") and hasattr(trace, "variants"):
        return from_requests(list(trace.requests), list(trace.variants))
    raise TypeError(f"a trace is a JSONL path, a bench.workload.Trace or a SimTrace, not {type(trace).__name__}")
