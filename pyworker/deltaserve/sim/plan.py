"""Capacity planning: for a trace's traffic at several request rates, how many GPUs (daemon
workers) of the modelled kind, with which ``--max-num-seqs`` / ``--max-deltas``, meet a TTFT SLO.

    for rate in rates:                         the trace's arrivals scaled to that mean rate
      for (max_num_seqs, max_deltas) in grid:  the daemon config of one worker (daemon_config)
        gpus = the fewest workers (1 .. max_gpus) whose simulated run has SLO attainment
               >= target; found by doubling, then bisection (more workers never hurt much)
      best = the config needing the fewest GPUs (ties: higher attainment)

:func:`plan` returns every cell; :func:`table` prints it; :func:`plot` draws GPUs against rate
per config (matplotlib, from the ``bench`` extra; without it the plot is skipped with a note).
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from deltaserve.sim.latency import LatencyModel
from deltaserve.sim.replay import daemon_config, replay
from deltaserve.sim.trace import SimTrace


@dataclass(frozen=True)
class Cell:
    """One (rate, config) of the sweep."""

    rate: float
    """Mean request rate replayed (req/s)."""
    max_num_seqs: int
    """The daemon's --max-num-seqs."""
    max_deltas: int
    """The daemon's --max-deltas."""
    gpus: int | None
    """Fewest workers meeting the SLO; None: not even ``max_gpus``."""
    attainment: float
    """SLO attainment with ``gpus`` workers (with ``max_gpus`` when none suffices)."""
    ttft_p90_s: float | None
    """p90 TTFT with that many workers."""
    throughput_req_s: float
    """Completed requests per second with that many workers."""


def _run(trace: SimTrace, model: LatencyModel, seqs: int, deltas: int, gpus: int, slo_ttft_s: float,
         seed: int) -> dict[str, Any]:  # fmt: skip
    cfg = daemon_config(model, max_num_seqs=seqs, max_deltas=deltas)
    return replay(trace, cfg, model, seed, workers=gpus, slo_ttft_s=slo_ttft_s).summary()


def fewest_gpus(trace: SimTrace, model: LatencyModel, seqs: int, deltas: int, slo_ttft_s: float, target: float,
                max_gpus: int, seed: int = 0) -> tuple[int | None, dict[str, Any]]:  # fmt: skip
    """The fewest workers (at most ``max_gpus``) whose run meets ``target`` attainment, and that
    run's summary (the ``max_gpus`` run's when none does)."""
    runs: dict[int, dict[str, Any]] = {}

    def ok(n: int) -> bool:
        if n not in runs:
            runs[n] = _run(trace, model, seqs, deltas, n, slo_ttft_s, seed)
        return runs[n]["slo"]["ttft_attainment"] >= target

    hi = 1
    while not ok(hi):
        if hi >= max_gpus:
            return None, runs[hi]
        hi = min(2 * hi, max_gpus)
    lo = hi // 2  # fails (or 0)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid
    return hi, runs[hi]


def plan(trace: SimTrace, model: LatencyModel, *, rates: list[float], max_num_seqs: list[int],
         max_deltas: list[int], slo_ttft_s: float, target: float = 0.9, max_gpus: int = 16,
         seed: int = 0) -> list[Cell]:  # fmt: skip
    """Every cell of the sweep (module docstring)."""
    if not 0 < target <= 1:
        raise ValueError(f"target attainment {target}: want a share in (0, 1]")
    if max_gpus < 1:
        raise ValueError(f"max_gpus {max_gpus}: want at least 1")
    cells = []
    for rate, seqs, deltas in itertools.product(rates, max_num_seqs, max_deltas):
        gpus, s = fewest_gpus(trace.at_rate(rate), model, seqs, deltas, slo_ttft_s, target, max_gpus, seed)
        cells.append(Cell(rate=rate, max_num_seqs=seqs, max_deltas=deltas, gpus=gpus,
                          attainment=s["slo"]["ttft_attainment"], ttft_p90_s=s["ttft_s"]["p90"],
                          throughput_req_s=s["throughput_req_s"]))  # fmt: skip
    return cells


def best(cells: list[Cell]) -> dict[float, Cell]:
    """Per rate, the config needing the fewest GPUs (ties: higher attainment, then fewer seqs)."""
    out: dict[float, Cell] = {}
    for c in cells:
        key = (c.gpus is None, c.gpus or 0, -c.attainment, c.max_num_seqs, c.max_deltas)
        cur = out.get(c.rate)
        if cur is None or key < (cur.gpus is None, cur.gpus or 0, -cur.attainment, cur.max_num_seqs, cur.max_deltas):
            out[c.rate] = c
    return out


def table(cells: list[Cell], max_gpus: int) -> str:
    """The best config per rate, one line each."""
    lines = [f"{'rate':>8} {'gpus':>5} {'max-num-seqs':>12} {'max-deltas':>10} {'attain':>7} {'ttft p90':>9}"]
    for rate, c in sorted(best(cells).items()):
        gpus = str(c.gpus) if c.gpus is not None else f">{max_gpus}"
        p90 = "-" if c.ttft_p90_s is None else f"{c.ttft_p90_s:.2f}s"
        lines.append(f"{rate:>8g} {gpus:>5} {c.max_num_seqs:>12} {c.max_deltas:>10} {c.attainment:>7.3f} {p90:>9}")
    return "\n".join(lines)


def to_json(cells: list[Cell]) -> list[dict[str, Any]]:
    """The cells as dicts."""
    return [asdict(c) for c in cells]


def plot(cells: list[Cell], path: Path, title: str) -> Path | None:
    """GPUs needed against rate, one line per config; None (with a note on stderr) without
    matplotlib."""
    try:
        import matplotlib  # type: ignore[import-not-found,unused-ignore]

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        import sys

        print("note: matplotlib is not installed (pip install 'deltaserve[bench]'): no plot", file=sys.stderr)
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    configs = sorted({(c.max_num_seqs, c.max_deltas) for c in cells})
    for seqs, deltas in configs:
        pts = sorted((c.rate, c.gpus) for c in cells if (c.max_num_seqs, c.max_deltas) == (seqs, deltas))
        ax.plot([r for r, g in pts if g], [g for r, g in pts if g], marker="o",
                label=f"--max-num-seqs {seqs} --max-deltas {deltas}")  # fmt: skip
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("GPUs needed")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
