"""The worker's configuration: the router's ``WorkerConfig`` frame (``deltaserve.wire``), checked here.

Every setting and its default is owned once, by the router's ``ServerConfig``
(``router/crates/server/src/config.rs``: flags, env aliases, docs). The router writes one
``wire.WorkerConfig`` as the first frame of a new link, before it starts the worker, so the
worker's command line names only the link::

    python -m deltaserve.worker --ipc-dir DIR
      open DIR's rings ── recv the first frame ── WorkerConfig? ── schema hash ours? ── validate
                                                    └─ no: ConfigError       └─ no: SchemaMismatch

A test or tool that starts a worker directly plays the router: it creates the link
(``_native.RouterLink``), sends ``wire.encode(wire.WorkerConfig(...))`` and waits for the Hello.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import msgpack

from deltaserve import wire

WorkerConfig = wire.WorkerConfig
"""The worker's settings: the generated wire struct (its field docs say what each one means)."""

#: Accepted ``dtype`` values; ``auto`` = float32 on CPU, the checkpoint's half type (else bfloat16) on CUDA.
DTYPES = ("auto", "float32", "float16", "bfloat16")
#: Largest ``max_lora_rank`` (the largest rank ``adapters.lora`` accepts).
MAX_LORA_RANK = 256
#: Largest ``max_loras_per_step`` (a step's distinct adapters are bounded by its sequences).
MAX_LORAS_PER_STEP = 65536
#: Largest ``max_deltas`` (each slot reserves one delta's GPU memory).
MAX_DELTAS = 64
#: Largest ``cpu_lora_helpers`` (one process per CPU).
MAX_CPU_LORA_HELPERS = 256
#: Accepted ``cpu_lora_policy`` values (``helpers/model.py``).
CPU_LORA_POLICIES = ("adaptive", "always")
#: Largest ``cpu_lora_helpers``.
MAX_CPU_LORA_HELPERS = 256
#: Accepted ``log_level`` values.
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
#: How long the worker waits for the router's WorkerConfig frame (the router writes it before it
#: starts the worker, so it is normally there at once).
CONFIG_TIMEOUT_S = 60.0


class ConfigError(ValueError):
    """A worker setting is invalid; the message names the setting and the accepted values."""


class SchemaMismatch(Exception):
    """The router's schema hash (``router_hash``) is not this worker's ``wire.SCHEMA_HASH``."""

    def __init__(self, router_hash: str) -> None:
        super().__init__(f"router schema {router_hash}, worker schema {wire.SCHEMA_HASH}")
        self.router_hash = router_hash


def parse_args(argv: list[str] | None = None) -> Path:
    """The command line: the link's directory alone (``argv`` defaults to ``sys.argv[1:]``)."""
    parser = argparse.ArgumentParser(
        prog="python -m deltaserve.worker",
        description=(
            "deltaserve worker: runs the model for one router over shared-memory rings. Its settings "
            "arrive as the router's first frame (wire.WorkerConfig), not as flags."
        ),
    )
    parser.add_argument(
        "--ipc-dir", type=Path, required=True, help="Directory holding the rings + doorbells the router created."
    )
    ipc_dir: Path = parser.parse_args(argv).ipc_dir
    if not ipc_dir.is_dir():
        raise ConfigError(f"--ipc-dir {ipc_dir}: not a directory (the router creates it before spawning)")
    return ipc_dir


def from_frame(frame: bytes | None) -> wire.WorkerConfig:
    """The validated config in the router's first frame. Raises ``SchemaMismatch`` when the router
    speaks another schema (checked first, before the body has to decode), else ``ConfigError``."""
    if frame is None:
        raise ConfigError(f"no WorkerConfig frame from the router within {CONFIG_TIMEOUT_S:.0f} s")
    router_hash = _schema_hash_of(frame)
    if router_hash is not None and router_hash != wire.SCHEMA_HASH:
        raise SchemaMismatch(router_hash)
    try:
        msg = wire.decode(frame)
    except ValueError as e:
        raise ConfigError(f"the router's first frame does not decode: {e}") from e
    if not isinstance(msg, wire.WorkerConfig):
        raise ConfigError(f"expected a WorkerConfig as the router's first frame, got {type(msg).__name__}")
    return validate(msg)


def _schema_hash_of(frame: bytes) -> str | None:
    """``schema_hash``, the first field of a WorkerConfig frame, read without decoding the rest
    (whose layout may be another schema's); None when the frame is not shaped like one."""
    try:
        kind, body = msgpack.unpackb(frame, raw=False)
    except Exception:  # noqa: BLE001 - any malformed frame: from_frame's decode says what is wrong
        return None
    if kind != wire.WorkerConfig.KIND or type(body) is not list or not body or type(body[0]) is not str:
        return None
    return body[0]


def validate(cfg: wire.WorkerConfig) -> wire.WorkerConfig:
    """Raises ConfigError naming the first bad setting; returns ``cfg`` for chaining. The router
    checks its flags first; this is the worker's own guard, for any peer that sends a config."""
    if not (Path(cfg.model_dir) / "config.json").is_file():
        raise ConfigError(f"model_dir {cfg.model_dir}: not an HF model directory (no config.json)")
    if not re.fullmatch(r"cpu|cuda(:\d+)?", cfg.device):
        raise ConfigError(f"device {cfg.device!r}: expected cpu, cuda or cuda:N")
    if cfg.dtype not in DTYPES:
        raise ConfigError(f"dtype {cfg.dtype!r}: expected one of {', '.join(DTYPES)}")
    if not 1 <= cfg.block_size <= 1024:
        raise ConfigError(f"block_size {cfg.block_size}: expected 1..1024")
    for name in ("kv_cache_bytes", "host_arena_bytes", "num_threads", "seed"):
        if getattr(cfg, name) < 0:
            raise ConfigError(f"{name} {getattr(cfg, name)}: expected >= 0 (0 = the default)")
    if not 0.0 < cfg.gpu_memory_utilization <= 1.0:
        raise ConfigError(f"gpu_memory_utilization {cfg.gpu_memory_utilization}: expected in (0, 1]")
    if cfg.max_num_batched_tokens < 1:
        raise ConfigError(f"max_num_batched_tokens {cfg.max_num_batched_tokens}: expected >= 1")
    if cfg.max_model_len is not None and cfg.max_model_len < 1:
        raise ConfigError(f"max_model_len {cfg.max_model_len}: expected >= 1")
    if not 0 <= cfg.cuda_graph_max_batch <= 4096:
        raise ConfigError(f"cuda_graph_max_batch {cfg.cuda_graph_max_batch}: expected 0..4096")
    if not 0 <= cfg.recv_spin_us <= 1_000_000:
        raise ConfigError(f"recv_spin_us {cfg.recv_spin_us}: expected 0..1000000 microseconds")
    if cfg.log_level.upper() not in LOG_LEVELS:
        raise ConfigError(f"log_level {cfg.log_level!r}: expected one of {', '.join(LOG_LEVELS)}")
    if not 0 <= cfg.max_lora_rank <= MAX_LORA_RANK:
        raise ConfigError(f"max_lora_rank {cfg.max_lora_rank}: expected 0..{MAX_LORA_RANK} (0 = LoRA off)")
    if not 1 <= cfg.max_loras_per_step <= MAX_LORAS_PER_STEP:
        raise ConfigError(f"max_loras_per_step {cfg.max_loras_per_step}: expected 1..{MAX_LORAS_PER_STEP}")
    if not 0 <= cfg.max_deltas <= MAX_DELTAS:
        raise ConfigError(f"max_deltas {cfg.max_deltas}: expected 0..{MAX_DELTAS} (0 = deltas off)")
    if not 0 <= cfg.cpu_lora_helpers <= MAX_CPU_LORA_HELPERS:
        raise ConfigError(f"cpu_lora_helpers {cfg.cpu_lora_helpers}: expected 0..{MAX_CPU_LORA_HELPERS} (0 = off)")
    if cfg.cpu_lora_policy not in CPU_LORA_POLICIES:
        raise ConfigError(f"cpu_lora_policy {cfg.cpu_lora_policy!r}: expected {' or '.join(CPU_LORA_POLICIES)}")
    if not 0 <= cfg.cpu_lora_helpers <= MAX_CPU_LORA_HELPERS:
        raise ConfigError(f"cpu_lora_helpers {cfg.cpu_lora_helpers}: expected 0..{MAX_CPU_LORA_HELPERS} (0 = off)")
    if cfg.cpu_lora_policy not in ("adaptive", "always"):
        raise ConfigError(f"cpu_lora_policy {cfg.cpu_lora_policy!r}: expected adaptive or always")
    if cfg.profile_path is not None and not cfg.profile_every_s > 0:
        raise ConfigError(f"profile_every_s {cfg.profile_every_s}: expected a positive number of seconds")
    return cfg
