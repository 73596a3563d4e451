"""``deltaserve.sim``: the router's real scheduler (the Rust ``sched`` crate, through
``deltaserve._native``) as a capacity-planning simulator. Requests arrive at their trace times on
a virtual clock; each step the scheduler forms the batch exactly as the daemon's engine actor
asks it to (``schedule`` / ``schedule_ahead``, ``update``, ``host_copies_ready``,
``gpu_copies_ready``); a linear step-latency model prices the step; variant reads and copies take
their modelled transfer times (a delta's copy to the GPU beside the steps, as the daemon's worker runs it).
With several workers each arrival is placed by the router's own ``--placement`` policy
(``replay(placement=...)``, default least-loaded).

    from deltaserve import sim
    result = sim.replay("trace.jsonl", seed=0)        # bundled H200 model, daemon defaults
    print(result.summary()["ttft_s"])
    model = sim.LatencyModel.fit(samples)             # from a profile: a list of measured steps
    cfg = sim.daemon_config(model, max_num_seqs=128)  # one worker's scheduler config

    python -m deltaserve.sim replay --trace T.jsonl [--workers 2] [--max-num-seqs 128] [--placement caraserve]
    python -m deltaserve.sim plan --trace T.jsonl --slo-ttft-ms 6000 [--gpu-kind NAME]
    python -m deltaserve.sim fit --profile steps.json --out model.json

# Layout

- ``latency.py``: :class:`LatencyModel` (fit by least squares, save / load, predict) and
  :class:`Memory` (the GPU's pool and the variants' footprints).
- ``trace.py``: :class:`SimTrace`, :func:`load_trace` (bench/workload.py's JSONL or objects).
- ``replay.py``: :func:`replay`, :class:`SimResult`, :func:`daemon_config`.
- ``models.py``: the bundled models (``models/*.json``) and the default's derivation from
  ``bench/results``.
- ``plan.py``: the GPUs-per-rate sweep, its table and plot; ``__main__.py``: the command line.
"""

from deltaserve.sim.latency import FEATURES, LatencyModel, Memory
from deltaserve.sim.models import bundled_model, bundled_models, default_model
from deltaserve.sim.replay import SLO_TTFT_S, SimResult, daemon_config, replay
from deltaserve.sim.trace import SimTrace, SimVariant, load_trace

__all__ = [
    "FEATURES", "SLO_TTFT_S", "LatencyModel", "Memory", "SimResult", "SimTrace", "SimVariant", "bundled_model",
    "bundled_models", "daemon_config", "default_model", "load_trace", "replay",
]  # fmt: skip
