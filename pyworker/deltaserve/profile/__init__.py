"""``deltaserve profile``: measure this device's step latencies and fit the rank-aware latency model.

CaraServe §5 (Fig. 9): decode-step and prefill latency are linear in the batch's token count and,
with MBGMV (deltaserve's decode kernel: no padding), in the Σ rank of its adapters. The profile
runs steps of an in-process ``Executor`` on the served model with random PEFT adapters of the given
ranks, over a grid of batch sizes, adapter counts and prompt lengths, records each step's features
as the simulator defines them (``deltaserve.sim.latency``: tokens, seqs, prefill_tokens, ...,
lora_rank_sum) and fits the simulator's :class:`~deltaserve.sim.latency.LatencyModel` (one owner
of the latency model: the simulator replays with it, the daemon's ``--latency-profile`` reads it
for ``--placement``). The JSON carries the device, R² per step kind and the samples.

    deltaserve profile --model DIR --device cuda:0 --out profile.json
    deltaserve --devices 0,1 --latency-profile profile.json --placement caraserve ...

# Layout

- ``measure.py``: random adapters, the step grid and its timing (:func:`measure`), the fit (:func:`profile`);
- ``__main__.py``: the command line.
"""

__all__: list[str] = []  # the functions are in ``deltaserve.profile.measure`` (imports torch)
