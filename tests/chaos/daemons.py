"""The chaos suite's daemons: ``tests/e2e/daemon.py``'s :class:`Daemon` on the tiny model, with a
KV pool sized in tokens (``kv_bytes``), so a module can make its pool the bottleneck."""

from __future__ import annotations

import json
from pathlib import Path

from e2e.daemon import Daemon

__all__ = ["Daemon", "kv_bytes", "tiny_daemon_flags"]


def kv_bytes(model_dir: Path, tokens: int) -> int:
    """`--kv-cache-bytes` for `tokens` tokens of the (fp32, CPU) model in `model_dir`."""
    cfg = json.loads((model_dir / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return tokens * cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head_dim * 4


def tiny_daemon_flags(model_dir: Path, kv_tokens: int, *extra: str) -> list[str]:
    return ["--kv-cache-bytes", str(kv_bytes(model_dir, kv_tokens)), "--max-model-len", "256", *extra]
