"""Serving experiments, one command each: start the server, replay the generated traces
open-loop, write ``bench/results/<experiment>-<device>-<date>.json`` and PNG plots.

The command line of ``python -m bench.serving`` (:func:`main`); the package docstring
(bench/serving/__init__.py) lists the commands. ``--server a,b`` runs the servers one after the
other on the same files; each result file then ends in ``-<server>`` (a single non-deltaserve
``--server`` too), and one more plot set compares them.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from bench.common import RESULTS, git_commit
from bench.serving.experiments import EXPERIMENTS, WORKLOADS, experiment
from bench.serving.report import plot
from bench.serving.runner import detect_devices, run, work_directory
from bench.serving.servers import SERVERS, flags_for
from bench.serving.variants import prepare_variants


def _list(kind):
    return lambda s: [kind(x) for x in s.split(",")]


def _servers(spec: str) -> list[str]:
    names = [s for s in spec.split(",") if s]
    for s in names:
        if s not in SERVERS:
            raise argparse.ArgumentTypeError(f"{s!r}: want one of {', '.join(sorted(SERVERS))}")
    if not names or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"{spec!r}: want distinct server names, comma-separated")
    return names


def main(argv: list[str] | None = None) -> Path | None:
    """The command line (module docstring); returns the first server's result file (all are printed)."""
    p = argparse.ArgumentParser(prog="python -m bench.serving", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("experiment", choices=(*EXPERIMENTS, "plot"))
    p.add_argument("files", nargs="*", type=Path, help="plot: result JSON files")
    p.add_argument("--server", type=_servers, default=["deltaserve"],
                   help=f"one of {', '.join(sorted(SERVERS))}, or several comma-separated (run in turn)")  # fmt: skip
    p.add_argument("--smoke", action="store_true", help="a few short requests on a tiny CPU model")
    p.add_argument("--n", type=_list(int), help="override the adapter (variant) counts, e.g. 5,100")
    p.add_argument("--rate", type=_list(float), help="override the rates (req/s)")
    p.add_argument("--cv", type=_list(float), help="override the arrival cvs")
    p.add_argument("--popularity", type=_list(str), help="deltazip: override the popularities (zipf-1.5,uniform)")
    p.add_argument("--duration", type=float, help="override seconds of arrivals per point")
    p.add_argument("--devices", help="`cpu` or CUDA ids (default: 0 when CUDA is available)")
    p.add_argument(
        "--daemon", type=Path, help="deltaserve binary (default: $DELTASERVE_BIN, target/release, target/debug)"
    )
    p.add_argument("--server-flag", action="append", default=[],
                   help="extra server flag (repeat), e.g. --server-flag=--max-num-seqs=128; SERVER:FLAG gives it "
                        "to that server only, e.g. --server-flag=swap:--resident=2; replaces the experiment's "
                        "value of the same flag")  # fmt: skip
    p.add_argument("--distinct-weights", type=int, default=None,
                   help="random weight files per LoRA rank (default 8), or delta payloads (deltazip: 4)")  # fmt: skip
    p.add_argument("--distinct-checkpoints", type=int, default=None,
                   help="deltazip, swap: real full checkpoints behind the variants, the base included (default 2)")  # fmt: skip
    p.add_argument("--work-dir", type=Path, default=None,
                   help="keep the model and variant files here and reuse them in later runs (default: a temporary "
                        "directory per command)")  # fmt: skip
    p.add_argument(
        "--prepare-only", action="store_true", help="write the files of every --server to --work-dir, then exit"
    )
    p.add_argument("--suffix", default="", help="appended to the experiment name in the result file name")
    p.add_argument("--out-dir", type=Path, default=None, help=f"where results go (default {RESULTS})")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--record", action="store_true",
                   help="deltaserve: record every step its worker runs (<name>-steps.jsonl.gz beside the result) "
                        "and report where the worker's time went, by kind of step (bench/step_breakdown.py)")  # fmt: skip
    a = p.parse_args(argv)
    if a.experiment == "plot":
        if not a.files:
            p.error("plot needs result files")
        for f in plot(a.files):
            print(f)
        return None
    exp = experiment(a.experiment, n=a.n, rate=a.rate, cv=a.cv, duration=a.duration, popularity=a.popularity,
                     smoke=a.smoke)  # fmt: skip
    suffix = a.suffix + ("-smoke" if a.smoke and a.experiment != "smoke" else "")
    servers = a.server
    if a.prepare_only:
        if a.work_dir is None:
            p.error("--prepare-only needs --work-dir (where the files stay)")
        devices = a.devices or detect_devices()[0]
        variants = list({v.name: v for pt in exp.points for v in WORKLOADS[pt.workload](**pt.trace).variants}.values())
        for server in servers:
            t0 = time.perf_counter()
            with work_directory(a.work_dir) as work:
                prepare_variants(exp, server, variants, work, devices, a.distinct_weights, a.distinct_checkpoints)
            print(f"{server}: files ready under {work} in {time.perf_counter() - t0:.1f} s", flush=True)
        return None
    paths = []
    with work_directory(a.work_dir) as work:  # several servers share one set of files
        for server in servers:
            tag = f"-{server}" if len(servers) > 1 or server != "deltaserve" else ""
            path = run(exp, server=server, out_dir=a.out_dir, devices=a.devices, daemon=a.daemon,
                       server_flags=flags_for(server, a.server_flag), distinct_weights=a.distinct_weights,
                       distinct_checkpoints=a.distinct_checkpoints, plots=not a.no_plots, suffix=suffix + tag,
                       work_dir=work, record=a.record and server == "deltaserve")  # fmt: skip
            print(path, f"(commit {git_commit()})", flush=True)
            paths.append(path)
    if len(paths) > 1 and not a.no_plots:
        stem = paths[0].with_suffix("")
        stem = stem.with_name(stem.name.replace(f"-{servers[0]}-", f"-{'-vs-'.join(servers)}-", 1))
        for f in plot(paths, out_stem=stem):
            print(f)
    return paths[0]


def exit_on_sigterm(signum, frame) -> None:
    """A SIGTERM handler: unwinds like Ctrl-C (``SystemExit(128 + SIGTERM)``), so the point in
    progress is written with what it measured (``runner.run``) and the server it started is
    stopped (it runs in its own session, so it would otherwise outlive this process and hold the
    GPU)."""
    raise SystemExit(128 + signum)
