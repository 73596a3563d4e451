"""When CPU assist pays, and how many helpers a cold prefill gets: the profile and the decision.

Profile (CaraServe §4.2, profiling-guided parallelisation): each helper measures, at start-up, the
multiply-adds per ms its core reaches on a shrink + expand (``compute.profile_macs_per_ms``); the
worker measures how fast a host copy reaches the pool (``load_bytes_per_ms``: a pinned host-to-
device copy on CUDA, a memcpy on CPU) and learns the per-job round trip (``overhead_ms``, a moving
average of what jobs took beyond their predicted compute). For one cold adapter X with T prefill
tokens this step::

    macs_per_token(X) = sum over (layer, adapted slice s) of rank(l, s) * (in_s + out_s)
    T_max(X)          = max(1, floor(BUDGET_MS * macs_per_ms / macs_per_token(X)))   tokens one helper takes
    helpers(X)        = ceil(T / T_max(X)), at most the helpers still free this step (0 free: no assist)
    cpu_ms(X, k)      = jobs(X) * overhead_ms + ceil(T / k) * macs_per_token(X) / macs_per_ms
    load_ms(X)        = host_bytes(X) / load_bytes_per_ms
    assist            = policy "always", or cpu_ms(X, k) < load_ms(X)               (policy "adaptive")

``AssistStats`` counts every decision: assisted, declined (and why), fallbacks (a helper failed or
stalled during an assisted prefill: the worker computed its rows itself).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

BUDGET_MS = 20.0
"""The CPU time one helper may spend on its share of one cold prefill's LoRA: CaraServe's cold
starts are a few to tens of ms, so a helper's share should end within the load it hides."""
POLICIES = ("adaptive", "always")
"""``--cpu-lora-policy``: adaptive (assist when the model predicts a lower TTFT), always (whenever a
helper is free and the host copy is shared, waiting up to ``ALWAYS_WAIT_READY_S`` for helpers still
starting; for tests and benchmarks, which must not depend on how fast helper processes start)."""
ALWAYS_WAIT_READY_S = 30.0
"""Under ``always``, how long a cold prefill waits for starting helpers' hellos (each imports torch;
on a loaded host that can take seconds)."""


@dataclass
class AssistStats:
    """Decision counts since the last ``take`` (reported per step, summed by the router)."""

    assisted: int = 0
    """Cold prefills (requests) whose LoRA the helpers computed this step."""
    fallbacks: int = 0
    """Assisted prefills where a helper failed or stalled (the worker computed its rows itself)."""
    declined: dict[str, int] = field(default_factory=dict)
    """Cold prefills not assisted, by reason: slower (the model predicted no gain), no_helper (none
    free or ready), not_shared (the host copy is outside the shared arena), host_not_ready (still
    being read), host_failed (its host read failed: the normal ToGpu quarantines it), decode (a
    one-token prefill runs on the normal path)."""

    def decline(self, reason: str, n: int = 1) -> None:
        self.declined[reason] = self.declined.get(reason, 0) + n

    def take(self) -> AssistStats:
        """The counts so far, and zero them."""
        out = AssistStats(self.assisted, self.fallbacks, dict(self.declined))
        self.assisted, self.fallbacks, self.declined = 0, 0, {}
        return out


def measure_load_bytes_per_ms(device: torch.device, nbytes: int = 16 << 20) -> float:
    """Bytes per ms of a host-to-pool copy on ``device`` (the best of three; pinned on CUDA)."""
    pin = device.type == "cuda"
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=pin)
        if pin:
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return nbytes / max(best * 1e3, 1e-6)


@dataclass
class AssistModel:
    """The profile and the decision rule (module docstring)."""

    load_bytes_per_ms: float
    """Host copy -> pool bandwidth."""
    macs_per_ms: float = 0.0
    """One helper's throughput (the median helper's profile); 0 until a helper said hello."""
    overhead_ms: float = 0.2
    """Round trip of one job beyond its compute (learned: ``observe``)."""

    def t_max(self, macs_per_token: int) -> int:
        """Most tokens one helper takes of one cold prefill."""
        if self.macs_per_ms <= 0 or macs_per_token <= 0:
            return 1
        return max(1, int(BUDGET_MS * self.macs_per_ms / macs_per_token))

    def helpers_for(self, tokens: int, macs_per_token: int) -> int:
        """⌈tokens / T_max⌉."""
        t_max = self.t_max(macs_per_token)
        return -(-tokens // t_max)

    def cpu_ms(self, tokens: int, helpers: int, macs_per_token: int, jobs: int) -> float:
        """Predicted time of the helpers' share of the prefill (the slowest helper's rows)."""
        if self.macs_per_ms <= 0:
            return float("inf")
        rows = -(-tokens // max(1, helpers))
        return jobs * self.overhead_ms + rows * macs_per_token / self.macs_per_ms

    def load_ms(self, host_bytes: int) -> float:
        """Predicted time of the host copy's load into the pool."""
        return host_bytes / max(self.load_bytes_per_ms, 1e-9)

    def observe(self, measured_ms: float, predicted_compute_ms: float) -> None:
        """Learns the per-job overhead from one job's wall time (moving average)."""
        extra = max(0.0, measured_ms - predicted_compute_ms)
        self.overhead_ms = 0.9 * self.overhead_ms + 0.1 * extra


__all__ = ["AssistModel", "AssistStats", "BUDGET_MS", "POLICIES", "measure_load_bytes_per_ms"]
