"""Shared by the Python API tests: one PEFT adapter and one compressed delta of the tiny Llama,
made once per session, and the child processes of this process (to check none is left)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from helpers.deltas import make_delta
from helpers.peft_adapters import make_peft_adapter

SMALL = {"kv_cache_bytes": 1 << 20, "max_model_len": 128, "worker_threads": 1}
"""Flags that keep one CPU worker on the tiny Llama small and quick."""


@pytest.fixture(scope="session")
def variant_dirs(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path | None]]:
    """``name -> (directory, dense reference or None)``: ``sql`` a PEFT LoRA (q, v; rank 8), ``ft``
    a 4-bit 2:4 delta with its materialised reference."""
    root = tmp_path_factory.mktemp("python_api")
    lora = make_peft_adapter(tiny_llama, root / "sql", seed=5, target_modules=["q_proj", "v_proj"], r=8, lora_alpha=16)
    return {"sql": (lora[1], None), "ft": make_delta(tiny_llama, root / "ft", seed=51, bits=4)}


def child_pids() -> set[int]:
    """Live (not zombie) child processes of this process, from /proc."""
    me = os.getpid()
    out = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == me and fields[0] != "Z":
            out.add(int(entry.name))
    return out
