"""One daemon per test module, on the tiny random Llama (CPU), for the client tests.

``daemon`` is module-scoped: each test file that uses it starts one daemon and shares it across
its tests (test files are pytest-xdist's unit of distribution, so a package-wide daemon would be
started once per worker anyway). The daemon comes from ``tests/e2e/daemon.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from e2e.daemon import Daemon

MAX_MODEL_LEN = 512
"""The tiny model's whole context, so a long request outlives a client's reaction."""


def kv_cache_bytes(model_dir: Path, tokens: int) -> int:
    """Bytes of float32 KV cache for ``tokens`` tokens of the model in ``model_dir``."""
    cfg = json.loads((model_dir / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return tokens * cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head_dim * 4


@pytest.fixture(scope="module")
def daemon(tiny_llama):
    """A daemon serving the tiny Llama on CPU with room for a few requests and LoRA pages."""
    kv = kv_cache_bytes(tiny_llama, 4 * MAX_MODEL_LEN)
    with Daemon(tiny_llama, "--kv-cache-bytes", str(kv), "--max-model-len", str(MAX_MODEL_LEN)) as d:
        yield d
