"""Plots of serving results (PNG beside the result file; none without matplotlib): throughput vs
n, SLO attainment vs rate, throughput and mean end-to-end latency vs rate, and latency CDFs, one
line per result file and sweep (``python -m bench.serving plot A.json B.json`` overlays runs)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np


def _sweep(t: dict) -> tuple[float, str]:
    """(cv, popularity) of a trace's parameters (deltazip traces: Poisson, cv 1)."""
    return t.get("cv", 1.0), t.get("popularity", "power")


def _sweep_name(cv: float, popularity: str) -> str:
    return f"cv={cv:g}" + ("" if popularity == "power" else f" {popularity}")


def plot(paths: list[Path], out_stem: Path | None = None) -> list[Path]:
    """Throughput vs n, SLO attainment vs rate, throughput and mean end-to-end latency vs rate,
    and latency CDFs over the points of ``paths`` (one line per result file and sweep); returns
    the PNGs written (none without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots", file=sys.stderr)
        return []
    runs = [(Path(p), json.loads(Path(p).read_text())) for p in paths]
    stem = out_stem or runs[0][0].with_suffix("")
    written = []

    def line_name(path: Path, res: dict, extra: str) -> str:
        return f"{res['server']} {extra}" if len(runs) == 1 else f"{path.stem} {extra}"

    # Throughput vs n (points that differ in n at one rate and cv).
    fig, ax = plt.subplots(figsize=(6, 4))
    drew = False
    for path, res in runs:
        groups: dict[tuple, list] = {}
        for pt in res["points"]:
            t = pt["trace"]
            key = (t["rate"], *_sweep(t), pt["protocol"])
            groups.setdefault(key, []).append((t["n_variants"], pt["summary"]["throughput_req_s"]))
        for (rate, cv, pop, proto), xs in groups.items():
            if len(xs) > 1 and len({x for x, _ in xs}) > 1:
                xs.sort()
                label = line_name(path, res, f"R={rate:g} {_sweep_name(cv, pop)} {proto}")
                ax.plot([x for x, _ in xs], [y for _, y in xs], "o-", label=label)
                drew = True
    if drew:
        ax.set(
            xscale="log", xlabel="adapters (n)", ylabel="throughput (req/s)", title="Throughput vs number of adapters"
        )
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)
        written.append(_save(fig, f"{stem}-throughput.png"))
    plt.close(fig)

    # SLO attainment vs rate (points that differ in rate at one n and cv).
    fig, ax = plt.subplots(figsize=(6, 4))
    drew = False
    for path, res in runs:
        groups = {}
        for pt in res["points"]:
            t = pt["trace"]
            key = (t["n_variants"], *_sweep(t), pt["protocol"])
            groups.setdefault(key, []).append((t["rate"], pt["summary"]["slo"]))
        for (n, cv, pop, _proto), xs in groups.items():
            if len({x for x, _ in xs}) > 1:
                xs.sort(key=lambda x: x[0])
                sweep = _sweep_name(cv, pop)
                ax.plot([x for x, _ in xs], [s["ttft_attainment"] for _, s in xs], "o-",
                        label=line_name(path, res, f"n={n} {sweep} TTFT≤{xs[0][1]['ttft_s']:g}s"))  # fmt: skip
                if xs[0][1]["tpot_s"] is not None:
                    ax.plot([x for x, _ in xs], [s["attainment"] for _, s in xs], "s--",
                            label=line_name(path, res, f"n={n} {sweep} + TPOT≤{xs[0][1]['tpot_s']:g}s"))  # fmt: skip
                drew = True
    if drew:
        ax.set(xlabel="request rate R (req/s)", ylabel="SLO attainment", title="SLO attainment vs rate", ylim=(0, 1.05))
        ax.legend(fontsize=7)
        written.append(_save(fig, f"{stem}-slo.png"))
    plt.close(fig)

    # Throughput and mean end-to-end latency vs rate (the deltazip comparison: one line per server
    # run and popularity).
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    drew = False
    for path, res in runs:
        groups = {}
        for pt in res["points"]:
            t, sm = pt["trace"], pt["summary"]
            groups.setdefault((t["n_variants"], *_sweep(t), pt["protocol"]), []).append(
                (t["rate"], sm["throughput_req_s"], sm["e2e_s"]["mean"])
            )
        for (n, cv, pop, proto), xs in groups.items():
            if len({x for x, _, _ in xs}) > 1:
                xs.sort(key=lambda x: x[0])
                label = line_name(path, res, f"n={n} {_sweep_name(cv, pop)} {proto}")
                a1.plot([x for x, _, _ in xs], [y for _, y, _ in xs], "o-", label=label)
                a2.plot([x for x, _, _ in xs], [math.nan if e is None else e for _, _, e in xs], "o-", label=label)
                drew = True
    if drew:
        a1.set(xlabel="request rate (req/s)", ylabel="throughput (req/s)", title="Throughput vs rate")
        a1.set_ylim(bottom=0)
        a2.set(xlabel="request rate (req/s)", ylabel="mean end-to-end latency (s)", title="Mean latency vs rate")
        a2.set_ylim(bottom=0)
        a2.legend(fontsize=7)
        written.append(_save(fig, f"{stem}-rate.png"))
    plt.close(fig)

    # Latency CDFs (TTFT and end-to-end) of every point.
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    for path, res in runs:
        for pt in res["points"]:
            for ax, key in ((a1, "ttft"), (a2, "e2e")):
                xs = np.sort([r[key] for r in pt["requests"] if r["error"] is None and r[key] is not None])
                if len(xs):
                    ax.step(
                        xs, np.arange(1, len(xs) + 1) / len(xs), where="post", label=line_name(path, res, pt["label"])
                    )
    a1.set(xlabel="TTFT (s)", ylabel="fraction of requests", title="TTFT CDF")
    a2.set(xlabel="end-to-end latency (s)", title="End-to-end latency CDF")
    a2.legend(fontsize=6)
    written.append(_save(fig, f"{stem}-cdf.png"))
    plt.close(fig)
    return written


def _save(fig, name: str) -> Path:
    fig.tight_layout()
    fig.savefig(name, dpi=120)
    return Path(name)
