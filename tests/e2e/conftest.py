"""Fixtures for end-to-end tests: running daemons over the tiny test model and the demo model."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from .daemon import Daemon


@pytest.fixture(scope="session")
def tiny_daemon(tiny_llama):
    """A daemon serving the tiny random Llama on CPU, with a small KV pool (1024 tokens)."""
    d = Daemon(tiny_llama, "--kv-cache-bytes", str(_kv_bytes(tiny_llama, 1024)), "--max-model-len", "256")
    with d:
        yield d


def _kv_bytes(model_dir: Path, tokens: int) -> int:
    import json

    cfg = json.loads((model_dir / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return tokens * cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head_dim * 4


@pytest.fixture(scope="session")
def demo_model_dir() -> Path:
    out = subprocess.run(
        [sys.executable, "-m", "deltaserve.demo_model", "--print-path"], check=True, capture_output=True, text=True
    )
    return Path(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def demo_daemon(demo_model_dir):
    with Daemon(demo_model_dir) as d:
        yield d
