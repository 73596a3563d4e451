"""The ``wire.WorkerConfig`` a test sends when it starts a worker process itself and plays the router.

The daemon builds this frame from its flags (``ServerConfig::worker_config`` owns every default);
a test chooses its own values instead: the tiny CPU worker of ``helpers.executors`` (float32,
block size 4, ``KV_BYTES`` of KV, one thread). Send it as the link's first frame::

    link = _native.RouterLink(str(ipc_dir))
    link.send(wire.encode(cpu_worker_config(model)))
    # python -m deltaserve.worker --ipc-dir ipc_dir ... then wait for the Hello
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from deltaserve import wire

from .executors import KV_BYTES


def cpu_worker_config(model: Path, **overrides) -> wire.WorkerConfig:
    """A valid config for a CPU worker of ``model``; ``overrides`` replace fields."""
    cfg = wire.WorkerConfig(
        schema_hash=wire.SCHEMA_HASH,
        model_dir=str(model),
        device="cpu",
        dtype="float32",
        block_size=4,
        kv_cache_bytes=KV_BYTES,
        gpu_memory_utilization=0.9,
        max_num_batched_tokens=2048,
        num_threads=1,
        recv_spin_us=0,
        log_level="INFO",
        max_lora_rank=256,
        max_loras_per_step=256,
        max_deltas=3,
        cuda_ops=False,
        profile_every_s=10.0,
        cpu_lora_policy="adaptive",
    )
    return replace(cfg, **overrides)
