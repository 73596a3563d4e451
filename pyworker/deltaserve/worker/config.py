"""The worker's one config object: every knob of ``python -m deltaserve.worker``, typed and validated.

Each field is a CLI flag (``--kv-cache-bytes``) and, as a fallback default, an environment
variable (``DELTASERVE_WORKER_KV_CACHE_BYTES``); there are no other environment knobs. The table
of flags is derived from the dataclass fields, so a new knob is one new field with its doc.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

#: Environment prefix of the variables that back the CLI flags.
ENV_PREFIX = "DELTASERVE_WORKER_"
#: Accepted ``--dtype`` values; ``auto`` = float32 on CPU, the checkpoint's half type (else bfloat16) on CUDA.
DTYPES = ("auto", "float32", "float16", "bfloat16")
#: Largest ``--max-lora-rank`` (the largest rank ``adapters.lora`` accepts).
MAX_LORA_RANK = 256
#: Largest ``--max-loras-per-step`` (a step's distinct adapters are bounded by its sequences).
MAX_LORAS_PER_STEP = 65536
#: Largest ``--max-deltas`` (each slot reserves one delta's GPU memory).
MAX_DELTAS = 64
#: Largest ``--cpu-lora-helpers`` (one process per CPU).
MAX_CPU_LORA_HELPERS = 256


class ConfigError(ValueError):
    """A worker setting is invalid; the message names the flag and the accepted values."""


def _doc(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass
class WorkerConfig:
    """Settings of one worker process (see the module docstring for flags and env variables)."""

    model: Path = field(default=Path(""), metadata=_doc("HF model directory (config.json, *.safetensors)."))
    ipc_dir: Path = field(
        default=Path(""), metadata=_doc("Directory holding the rings + doorbells the router created.")
    )
    device: str = field(default="cpu", metadata=_doc("Torch device: cpu, cuda or cuda:N."))
    dtype: str = field(
        default="auto",
        metadata=_doc(
            "Compute dtype: auto (float32 on CPU; checkpoint half type or bfloat16 on CUDA), float32, float16, bfloat16."
        ),
    )
    block_size: int = field(default=16, metadata=_doc("Tokens per KV page (the router's accounting unit)."))
    kv_cache_bytes: int = field(
        default=0,
        metadata=_doc(
            "KV pool size in bytes; 0 = auto: 256 MiB on CPU, on CUDA gpu_memory_utilization x total "
            "minus memory in use after loading weights minus a profiled activation reserve."
        ),
    )
    gpu_memory_utilization: float = field(
        default=0.90, metadata=_doc("Fraction of the GPU's memory this worker may use in total (auto KV sizing).")
    )
    max_num_batched_tokens: int = field(
        default=2048, metadata=_doc("Most tokens one step computes; sizes the activation-reserve profiling run.")
    )
    max_model_len: int | None = field(
        default=None, metadata=_doc("Cap on prompt + output tokens (default: the model's and the KV pool's limit).")
    )
    seed: int = field(default=0, metadata=_doc("Seed of the worker-global generator used by unseeded requests."))
    kernels: str = field(
        default="auto",
        metadata=_doc(
            "Kernel implementations: auto (Triton on CUDA, torch references on CPU), torch (references "
            "everywhere, for A/B runs), triton (Triton everywhere)."
        ),
    )
    cuda_graph_max_batch: int = field(
        default=256,
        metadata=_doc(
            "Largest decode batch replayed from a captured CUDA graph (CUDA with the Triton kernels); "
            "larger batches and prefill steps run eagerly; 0 disables graphs."
        ),
    )
    recv_spin_us: int = field(
        default=2000,
        metadata=_doc(
            "Microseconds recv polls the ring before sleeping on the doorbell; the next plan usually "
            "arrives within a few hundred after an output, and polling skips the pipe wake-up."
        ),
    )
    num_threads: int = field(
        default=0, metadata=_doc("CPU threads for torch ops; 0 = the CPUs this process may run on.")
    )
    log_level: str = field(default="INFO", metadata=_doc("Logging level of the deltaserve.worker logger."))
    max_lora_rank: int = field(
        default=256,
        metadata=_doc(
            "Largest LoRA rank served (r_max of the per-step adapter tables); adapters of a higher rank are "
            f"refused at registration; 1..{MAX_LORA_RANK}, 0 turns LoRA off."
        ),
    )
    max_loras_per_step: int = field(
        default=256,
        metadata=_doc(
            "Most distinct LoRA adapters one step may use (slots of the per-step adapter tables); the "
            "router passes its max_num_seqs."
        ),
    )
    host_arena_bytes: int = field(
        default=0,
        metadata=_doc(
            "Host budget of the LoRA adapters' and deltas' host copies: that much (plus an eighth, at least "
            "1 GiB, against fragmentation) is allocated once at start-up and pinned on CUDA, so reading a "
            "variant never pins memory while steps run; 0 allocates each copy on its own. The router passes "
            "its host budget (--variant-host-bytes) on CUDA."
        ),
    )
    max_deltas: int = field(
        default=3,
        metadata=_doc(
            "GPU slots for compressed full-fine-tune deltas (DeltaZip's N: the router keeps at most this many "
            f"deltas on the GPU); 0..{MAX_DELTAS}, 0 turns delta serving off."
        ),
    )

    cpu_lora_helpers: int = field(
        default=0,
        metadata=_doc(
            "CPU LoRA helper processes (each pinned to one CPU): a cold adapter's prefill starts at once with its "
            f"LoRA computed by them while its pages load (CaraServe); 0..{MAX_CPU_LORA_HELPERS}, 0 turns them off."
        ),
    )
    cpu_lora_policy: str = field(
        default="adaptive",
        metadata=_doc(
            "When the helpers assist: adaptive (when the profiled model predicts their compute ends before the "
            "adapter's load), always (whenever one is free; tests and benchmarks)."
        ),
    )

    def validate(self) -> WorkerConfig:
        """Raises ConfigError naming the first bad setting; returns self for chaining."""
        if not (self.model / "config.json").is_file():
            raise ConfigError(f"--model {self.model}: not an HF model directory (no config.json)")
        if not self.ipc_dir.is_dir():
            raise ConfigError(f"--ipc-dir {self.ipc_dir}: not a directory (the router creates it before spawning)")
        if not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ConfigError(f"--device {self.device!r}: expected cpu, cuda or cuda:N")
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype {self.dtype!r}: expected one of {', '.join(DTYPES)}")
        if not 1 <= self.block_size <= 1024:
            raise ConfigError(f"--block-size {self.block_size}: expected 1..1024")
        if self.kv_cache_bytes < 0:
            raise ConfigError(f"--kv-cache-bytes {self.kv_cache_bytes}: expected >= 0 (0 = auto)")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"--gpu-memory-utilization {self.gpu_memory_utilization}: expected in (0, 1]")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(f"--max-num-batched-tokens {self.max_num_batched_tokens}: expected >= 1")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"--max-model-len {self.max_model_len}: expected >= 1")
        if self.host_arena_bytes < 0:
            raise ConfigError(f"--host-arena-bytes {self.host_arena_bytes}: expected >= 0 (0 = no arena)")
        if self.num_threads < 0:
            raise ConfigError(f"--num-threads {self.num_threads}: expected >= 0 (0 = all available CPUs)")
        if self.kernels not in ("auto", "torch", "triton"):
            raise ConfigError(f"--kernels {self.kernels!r}: expected auto, torch or triton")
        if not 0 <= self.cuda_graph_max_batch <= 4096:
            raise ConfigError(f"--cuda-graph-max-batch {self.cuda_graph_max_batch}: expected 0..4096")
        if not 0 <= self.recv_spin_us <= 1_000_000:
            raise ConfigError(f"--recv-spin-us {self.recv_spin_us}: expected 0..1000000 microseconds")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ConfigError(f"--log-level {self.log_level!r}: expected DEBUG, INFO, WARNING or ERROR")
        if not 0 <= self.max_lora_rank <= MAX_LORA_RANK:
            raise ConfigError(f"--max-lora-rank {self.max_lora_rank}: expected 0..{MAX_LORA_RANK} (0 = LoRA off)")
        if not 1 <= self.max_loras_per_step <= MAX_LORAS_PER_STEP:
            raise ConfigError(f"--max-loras-per-step {self.max_loras_per_step}: expected 1..{MAX_LORAS_PER_STEP}")
        if not 0 <= self.max_deltas <= MAX_DELTAS:
            raise ConfigError(f"--max-deltas {self.max_deltas}: expected 0..{MAX_DELTAS} (0 = deltas off)")
        if not 0 <= self.cpu_lora_helpers <= MAX_CPU_LORA_HELPERS:
            raise ConfigError(
                f"--cpu-lora-helpers {self.cpu_lora_helpers}: expected 0..{MAX_CPU_LORA_HELPERS} (0 = off)"
            )
        if self.cpu_lora_policy not in ("adaptive", "always"):
            raise ConfigError(f"--cpu-lora-policy {self.cpu_lora_policy!r}: expected adaptive or always")
        return self

    @classmethod
    def parser(cls) -> argparse.ArgumentParser:
        """The argparse parser: one flag per field, env variable as the fallback default."""
        parser = argparse.ArgumentParser(
            prog="python -m deltaserve.worker",
            description="deltaserve worker: runs the model for one router over shared-memory rings.",
        )
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            env = ENV_PREFIX + f.name.upper()
            default = os.environ.get(env, f.default)
            kind = {"Path": Path, "int": int, "float": float, "str": str, "int | None": int}[str(f.type)]
            required = f.name in ("model", "ipc_dir") and env not in os.environ
            try:
                typed_default = kind(default) if default is not None and not required else None
            except ValueError as e:
                raise ConfigError(f"environment variable {env}={default!r}: {e}") from e
            parser.add_argument(
                flag,
                type=kind,
                default=typed_default,
                required=required,
                help=f"{f.metadata['help']} [env {env}]",
            )
        return parser

    @classmethod
    def from_args(cls, argv: list[str] | None = None) -> WorkerConfig:
        """Parses and validates the command line (``argv`` defaults to ``sys.argv[1:]``)."""
        ns = cls.parser().parse_args(argv)
        return cls(**vars(ns)).validate()
