"""Serving experiments, one command each: start the server, replay the generated traces
open-loop, write ``bench/results/<experiment>-<device>-<date>.json`` and PNG plots. From the
repository root:

    python -m bench.serving smoke                     # CPU demo model, a handful of requests
    python -m bench.serving slora-s1 [--n 5,100] [--rate 24] [--duration 60]
    python -m bench.serving slora-s2
    python -m bench.serving slo-vs-rate [--cv 4] [--rate 2,8,16]
    python -m bench.serving deltazip --server deltaserve,swap [--popularity uniform] [--rate 0.5]
    python -m bench.serving deltazip --work-dir /tmp/dz --prepare-only   # write the model files once
    python -m bench.serving slo-vs-rate --smoke       # any experiment, shrunk, on a tiny CPU model
    python -m bench.serving plot results/a.json results/b.json   # one plot set from several runs

The package, in the order one experiment goes through it (runner.py draws the flow)::

    experiments.py   the named experiments and their points (trace specs); MAX_RATE
    variants.py      the model and variant files a server reads (random LoRA adapters, random
                     full checkpoints and compressed deltas), under --work-dir
    servers.py       SERVERS: the launchers by --server name (the daemon, the fake, the
                     baselines of bench/baselines.py run as their own process)
    runner.py        run(): prepare, start the server, replay every point, write the result
    report.py        plot(): PNGs of one or several result files
    cli.py           main(): the command line; __main__.py runs it

Servers are started through bench/launch.py (``ServerSpec``, ``Endpoint``, ``launch``), traces
come from bench/workload.py and are replayed by bench/replay.py. Nothing here imports
bench/baselines.py, and it imports nothing from here (tests/bench/test_bench_imports.py checks).
"""

from bench.launch import Endpoint, ServerSpec
from bench.serving.cli import exit_on_sigterm, main
from bench.serving.experiments import EXPERIMENTS, MAX_RATE, WORKLOADS, Experiment, Point, experiment
from bench.serving.report import plot
from bench.serving.runner import run
from bench.serving.servers import SERVERS, flags_for, merge_flags
from bench.serving.variants import VariantFiles, prepare_variants

__all__ = [
    "EXPERIMENTS", "MAX_RATE", "SERVERS", "WORKLOADS", "Endpoint", "Experiment", "Point", "ServerSpec",
    "VariantFiles", "exit_on_sigterm", "experiment", "flags_for", "main", "merge_flags", "plot", "prepare_variants",
    "run",
]  # fmt: skip
