"""Serving workloads: deterministic request traces (arrival time, variant, prompt token ids, forced
output length) from the three papers' generators, written to and read from JSONL.

File format (one JSON object per line)::

    {"trace": {"kind": "slora", "seed": 0, "rate": 2.0, ..., "variants": [{"name": "a0000",
               "kind": "lora", "rank": 8}, ...], "n_requests": 600}}                header, once
    {"i": 0, "t": 0.412345, "variant": "a0007", "prompt": [1932, 77, ...], "output_len": 311}
    ...                                                                         one per request

``t`` is seconds from the start of the replay; requests are sorted by ``t``. Outputs are forced to
``output_len`` tokens: a replayed request carries ``max_tokens = output_len`` and
``ignore_eos = true`` (:meth:`Request.body`).

Generators (each a function returning a :class:`Trace`)::

    slora     S-LoRA §7.2 synthetic: n adapters, popularity with exponent alpha, one Gamma arrival
              process of total rate R and coefficient of variation cv, lengths U[lo, hi], ranks
              round-robin from a list, R * duration requests.
    punica    Punica §7 popularity shapes over N requests: distinct (N variants), uniform
              (ceil(sqrt N) variants, equally many requests each), skewed (Zipf-1.5 draws over N
              variants: P(i) ∝ i^-1.5), identical (one variant); Poisson arrivals at rate R.
    deltazip  DeltaZip §6: 32 full-fine-tune variants, Poisson arrivals at rate lambda, uniform or
              Zipf-1.5 popularity, rate * duration requests.

Popularity in ``slora`` (``popularity=``):

- ``"power"`` (default) is what S-LoRA's code does (``benchmarks/trace.py``: the adapter of a
  request is ``floor(n * u)`` with ``u ~ numpy.random.power(alpha)``, density ``alpha u^(alpha-1)``
  on [0, 1]), so ``P(index < k) = (k / n)^alpha``: alpha = 1 is *uniform* over the n adapters and
  smaller alpha is more skewed. This is what their Table 3 (alpha = 1) measured.
- ``"zipf"`` is the paper text's reading, adapter i's rate ∝ (i + 1)^-alpha, so log(count) against
  log(rank) has slope -alpha.

Randomness: one ``numpy.random.SeedSequence(seed)`` spawns independent streams for arrivals,
popularity, lengths and prompt ids, so changing one parameter (say the rate) leaves the other
draws unchanged. Same parameters and seed → byte-identical file (with the same numpy).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

PUNICA_SHAPES = ("distinct", "uniform", "skewed", "identical")
"""Punica's popularity shapes, in the order its figures list them."""
PUNICA_ZIPF = 1.5
"""Punica's and DeltaZip's skew: P(variant i) ∝ i^-1.5 (DeltaZip's definition; Punica's own text
gives a geometric ratio, and bench/bench_lora.py already draws this one)."""
DELTAZIP_VARIANTS = 32
"""DeltaZip §6: 32 full-fine-tune variants unless stated otherwise."""
DELTAZIP_POPULARITY = ("uniform", "zipf-1.5")


@dataclass(frozen=True)
class Variant:
    """One servable variant named in a trace."""

    name: str
    """What requests name (the ``model`` field sent is mapped from it by the replay client)."""
    kind: str
    """``"lora"`` (an adapter of ``rank``) or ``"full"`` (a full fine-tune, DeltaZip)."""
    rank: int | None = None
    """LoRA rank (round-robin from the generator's list); None for full fine-tunes."""


@dataclass(frozen=True)
class Request:
    """One request of a trace."""

    i: int
    """Index in arrival order; the replay client's id for it."""
    t: float
    """Arrival, seconds from the start of the replay."""
    variant: str
    """Name of the :class:`Variant` it asks for."""
    prompt: list[int]
    """Prompt token ids (random ids in the trace's vocab range)."""
    output_len: int
    """Output tokens forced with ``max_tokens`` + ``ignore_eos``."""

    def body(self, model: str, stream: bool = True) -> dict[str, Any]:
        """The completions request body (also the ``request`` of a WebSocket ``generate``)."""
        body: dict[str, Any] = {
            "model": model, "prompt": self.prompt, "max_tokens": self.output_len, "ignore_eos": True,
            "temperature": 0.0, "stream": stream,
        }  # fmt: skip
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body


@dataclass
class Trace:
    """A generated workload: its parameters (including the variants) and its requests."""

    params: dict[str, Any]
    """Everything the generator was given (kind, seed, rates, ranges, ...): the file's header."""
    variants: list[Variant]
    """Every variant the generator defined (a request may not use all of them)."""
    requests: list[Request] = field(default_factory=list)
    """Sorted by arrival time."""

    @property
    def duration(self) -> float:
        """Arrival time of the last request (0 for an empty trace)."""
        return self.requests[-1].t if self.requests else 0.0

    def dumps(self) -> str:
        header = {"trace": {**self.params, "variants": [asdict(v) for v in self.variants],
                            "n_requests": len(self.requests)}}  # fmt: skip
        lines = [json.dumps(header, separators=(",", ":"))]
        lines += [json.dumps(asdict(r), separators=(",", ":")) for r in self.requests]
        return "\n".join(lines) + "\n"

    def write(self, path: Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.dumps())
        return path

    @classmethod
    def read(cls, path: Path) -> Trace:
        """Reads a file written by :meth:`write`; a malformed line raises ``ValueError`` naming it."""
        path = Path(path)
        lines = path.read_text().splitlines()
        if not lines:
            raise ValueError(f"{path}: empty trace file (expected a header line)")
        try:
            header = json.loads(lines[0])["trace"]
            variants = [Variant(**v) for v in header.pop("variants")]
            n = header.pop("n_requests")
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f'{path}:1: bad header ({e}); expected {{"trace": {{..., "variants": [...]}}}}') from None
        names = {v.name for v in variants}
        requests = []
        for lineno, line in enumerate(lines[1:], start=2):
            try:
                r = Request(**json.loads(line))
            except (ValueError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: bad request line ({e})") from None
            if r.variant not in names:
                raise ValueError(f"{path}:{lineno}: variant {r.variant!r} is not in the header's variants")
            requests.append(r)
        if len(requests) != n:
            raise ValueError(f"{path}: header says {n} requests, the file has {len(requests)}")
        return cls(params=header, variants=variants, requests=requests)


# ---------------------------------------------------------------------------------------------
# Building blocks


def gamma_arrivals(rng: np.random.Generator, n: int, rate: float, cv: float) -> np.ndarray:
    """Arrival times of a Gamma renewal process: gaps ~ Gamma(shape 1/cv², scale cv²/rate), so
    the mean gap is 1/rate and the gaps' coefficient of variation is cv (cv = 1: Poisson). As in
    S-LoRA, the first request arrives after one gap."""
    return np.cumsum(rng.gamma(1.0 / (cv * cv), cv * cv / rate, size=n))


def power_indices(rng: np.random.Generator, n: int, alpha: float, size: int) -> np.ndarray:
    """S-LoRA's draw: ``floor(n * u)``, ``u ~ power(alpha)``, so ``P(index < k) = (k / n)^alpha``."""
    return np.minimum((rng.power(alpha, size) * n).astype(np.int64), n - 1)


def zipf_indices(rng: np.random.Generator, n: int, s: float, size: int) -> np.ndarray:
    """Index i in 0 .. n - 1 with probability ∝ (i + 1)^-s."""
    p = 1.0 / np.arange(1, n + 1, dtype=np.float64) ** s
    return rng.choice(n, size=size, p=p / p.sum())


def _check(cond: bool, what: str) -> None:
    if not cond:
        raise ValueError(what)


def _check_common(rate: float, input_range, output_range, vocab) -> None:
    _check(rate > 0 and math.isfinite(rate), f"rate {rate}: must be a positive number of requests/s")
    for name, (lo, hi) in (("input_range", input_range), ("output_range", output_range)):
        _check(1 <= lo <= hi, f"{name} [{lo}, {hi}]: need 1 <= low <= high")
    _check(0 <= vocab[0] < vocab[1], f"vocab [{vocab[0]}, {vocab[1]}): need 0 <= low < high")


def _assemble(
    params: dict,
    variants: list[Variant],
    times: np.ndarray,
    which: np.ndarray,
    streams: list[np.random.Generator],
    input_range,
    output_range,
    vocab,
) -> Trace:
    """Lengths and prompts from their own streams, then the requests sorted by time."""
    n = len(times)
    len_rng, prompt_rng = streams
    in_lens = len_rng.integers(input_range[0], input_range[1] + 1, size=n)
    out_lens = len_rng.integers(output_range[0], output_range[1] + 1, size=n)
    ids = prompt_rng.integers(vocab[0], vocab[1], size=int(in_lens.sum()))
    bounds = np.concatenate([[0], np.cumsum(in_lens)])
    order = np.argsort(times, kind="stable")
    requests = [
        Request(i=k, t=round(float(times[j]), 6), variant=variants[int(which[j])].name,
                prompt=ids[bounds[j]:bounds[j + 1]].tolist(), output_len=int(out_lens[j]))
        for k, j in enumerate(order)
    ]  # fmt: skip
    return Trace(params=params, variants=variants, requests=requests)


def _streams(seed: int) -> list[np.random.Generator]:
    """Arrivals, popularity, lengths, prompt ids."""
    return [np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(4)]


# ---------------------------------------------------------------------------------------------
# The three generators


def slora(
    n_variants: int,
    alpha: float,
    rate: float,
    cv: float,
    duration: float,
    input_range: tuple[int, int] = (8, 512),
    output_range: tuple[int, int] = (8, 512),
    ranks: tuple[int, ...] = (8,),
    vocab: tuple[int, int] = (100, 32000),
    seed: int = 0,
    popularity: str = "power",
) -> Trace:
    """S-LoRA's synthetic workload: ``int(rate * duration)`` requests (see the module docstring)."""
    _check_common(rate, input_range, output_range, vocab)
    _check(n_variants >= 1, f"n_variants {n_variants}: need at least 1")
    _check(alpha > 0, f"alpha {alpha}: must be positive")
    _check(cv > 0, f"cv {cv}: must be positive")
    _check(duration > 0, f"duration {duration}: must be positive seconds")
    _check(len(ranks) >= 1 and all(r >= 1 for r in ranks), f"ranks {ranks}: need at least one rank >= 1")
    _check(popularity in ("power", "zipf"), f"popularity {popularity!r}: want 'power' or 'zipf'")
    arr, pop, *rest = _streams(seed)
    n = int(rate * duration)
    times = gamma_arrivals(arr, n, rate, cv)
    which = (power_indices if popularity == "power" else zipf_indices)(pop, n_variants, alpha, n)
    variants = [Variant(name=f"a{i:04d}", kind="lora", rank=int(ranks[i % len(ranks)])) for i in range(n_variants)]
    params = {"kind": "slora", "seed": seed, "n_variants": n_variants, "alpha": alpha, "popularity": popularity,
              "rate": rate, "cv": cv, "duration": duration, "input_range": list(input_range),
              "output_range": list(output_range), "ranks": list(ranks), "vocab": list(vocab)}  # fmt: skip
    return _assemble(params, variants, times, which, rest, input_range, output_range, vocab)


def punica_indices(shape: str, n: int, rng: np.random.Generator) -> tuple[int, np.ndarray]:
    """(number of variants, variant index of each of ``n`` requests) for one of :data:`PUNICA_SHAPES`."""
    if shape == "distinct":
        return n, rng.permutation(n)
    if shape == "uniform":
        k = math.ceil(math.sqrt(n))
        return k, rng.permutation(np.arange(n) % k)
    if shape == "skewed":
        return n, zipf_indices(rng, n, PUNICA_ZIPF, n)
    if shape == "identical":
        return 1, np.zeros(n, dtype=np.int64)
    raise ValueError(f"Punica shape {shape!r}: want one of {', '.join(PUNICA_SHAPES)}")


def punica(
    shape: str,
    n_requests: int,
    rate: float,
    input_range: tuple[int, int] = (8, 512),
    output_range: tuple[int, int] = (8, 512),
    ranks: tuple[int, ...] = (16,),
    vocab: tuple[int, int] = (100, 32000),
    seed: int = 0,
) -> Trace:
    """Punica's popularity shapes over ``n_requests`` requests, Poisson arrivals at ``rate``."""
    _check_common(rate, input_range, output_range, vocab)
    _check(n_requests >= 1, f"n_requests {n_requests}: need at least 1")
    _check(len(ranks) >= 1 and all(r >= 1 for r in ranks), f"ranks {ranks}: need at least one rank >= 1")
    arr, pop, *rest = _streams(seed)
    n_variants, which = punica_indices(shape, n_requests, pop)
    times = gamma_arrivals(arr, n_requests, rate, 1.0)
    variants = [Variant(name=f"p{i:04d}", kind="lora", rank=int(ranks[i % len(ranks)])) for i in range(n_variants)]
    params = {"kind": "punica", "seed": seed, "shape": shape, "rate": rate,
              "input_range": list(input_range), "output_range": list(output_range), "ranks": list(ranks),
              "vocab": list(vocab)}  # fmt: skip
    return _assemble(params, variants, times, which, rest, input_range, output_range, vocab)  # header: n_requests


def deltazip(
    rate: float,
    duration: float,
    popularity: str = "zipf-1.5",
    n_variants: int = DELTAZIP_VARIANTS,
    input_range: tuple[int, int] = (8, 512),
    output_range: tuple[int, int] = (8, 512),
    vocab: tuple[int, int] = (100, 32000),
    seed: int = 0,
) -> Trace:
    """DeltaZip's workload: full-fine-tune variants, Poisson arrivals, ``int(rate * duration)`` requests."""
    _check_common(rate, input_range, output_range, vocab)
    _check(duration > 0, f"duration {duration}: must be positive seconds")
    _check(n_variants >= 1, f"n_variants {n_variants}: need at least 1")
    arr, pop, *rest = _streams(seed)
    n = int(rate * duration)
    times = gamma_arrivals(arr, n, rate, 1.0)
    if popularity == "uniform":
        which = pop.integers(0, n_variants, size=n)
    elif popularity == "zipf-1.5":
        which = zipf_indices(pop, n_variants, 1.5, n)
    else:
        raise ValueError(f"popularity {popularity!r}: want one of {', '.join(DELTAZIP_POPULARITY)}")
    variants = [Variant(name=f"ft{i:02d}", kind="full") for i in range(n_variants)]
    params = {"kind": "deltazip", "seed": seed, "popularity": popularity, "n_variants": n_variants, "rate": rate,
              "duration": duration, "input_range": list(input_range), "output_range": list(output_range),
              "vocab": list(vocab)}  # fmt: skip
    return _assemble(params, variants, times, which, rest, input_range, output_range, vocab)


def main() -> None:
    """``python -m bench.workload slora --n 100 --rate 4 --out trace.jsonl`` (and punica, deltazip)."""
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("kind", choices=("slora", "punica", "deltazip"))
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rate", type=float, default=2.0)
    p.add_argument("--duration", type=float, default=300.0)
    p.add_argument("--n", type=int, default=200, help="slora: adapters; punica: requests; deltazip: variants")
    p.add_argument("--alpha", type=float, default=1.0)
    p.add_argument("--cv", type=float, default=1.0)
    p.add_argument("--popularity", default=None, help="slora: power|zipf; deltazip: uniform|zipf-1.5")
    p.add_argument("--shape", default="skewed", choices=PUNICA_SHAPES)
    p.add_argument("--ranks", default="8", help="comma-separated, round-robin over the variants")
    p.add_argument("--input-range", default="8,512")
    p.add_argument("--output-range", default="8,512")
    p.add_argument("--vocab", default="100,32000", help="prompt ids are drawn from [low, high)")
    a = p.parse_args()
    pair = lambda s: tuple(int(x) for x in s.split(","))  # noqa: E731
    common = {"input_range": pair(a.input_range), "output_range": pair(a.output_range), "vocab": pair(a.vocab),
              "seed": a.seed}  # fmt: skip
    if a.kind == "slora":
        t = slora(a.n, a.alpha, a.rate, a.cv, a.duration, ranks=pair(a.ranks), popularity=a.popularity or "power",
                  **common)  # fmt: skip
    elif a.kind == "punica":
        t = punica(a.shape, a.n, a.rate, ranks=pair(a.ranks), **common)
    else:
        t = deltazip(a.rate, a.duration, popularity=a.popularity or "zipf-1.5", n_variants=a.n, **common)
    print(t.write(a.out), len(t.requests), "requests")


if __name__ == "__main__":
    main()
