"""The zoo tests' checkpoints: the tiny 3-layer Llama as the base, fine-tunes made by perturbing
chosen layers of it, and one zoo holding two of them (built once per session).

- ``ft1``: layers 1 and 2 changed (a partial fine-tune that froze layer 0 and the embeddings/head)
- ``ft2``: ``ft1`` with layer 0 changed too (a child of ft1: shares its layers 1 and 2 exactly)
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from deltaserve.zoo import AddOptions, add_variant

CHEAP = AddOptions(nsamples=4, seqlen=32)
"""Calibration small enough for tests (lens and compressor)."""


def perturb(src: Path, out: Path, prefixes: list[str], scale: float, seed: int) -> Path:
    """A copy of ``src`` with every tensor whose name starts with one of ``prefixes`` moved by ``scale``
    x its mean magnitude of Gaussian noise."""
    shutil.copytree(src, out)
    tensors = load_file(out / "model.safetensors")
    gen = torch.Generator().manual_seed(seed)
    for name, t in tensors.items():
        if any(name.startswith(p) for p in prefixes):
            tensors[name] = t + scale * t.abs().mean() * torch.randn(t.shape, generator=gen)
    save_file(tensors, str(out / "model.safetensors"))
    return out


@dataclass(frozen=True)
class ZooFixture:
    base: Path
    ft1: Path
    ft2: Path
    zoo: Path


@pytest.fixture(scope="session")
def zoo_fixture(tiny_llama3: Path, tmp_path_factory: pytest.TempPathFactory) -> ZooFixture:
    root = tmp_path_factory.mktemp("zoo")
    ft1 = perturb(tiny_llama3, root / "ft1", ["model.layers.1.", "model.layers.2."], 0.5, seed=1)
    ft2 = perturb(ft1, root / "ft2", ["model.layers.0."], 0.5, seed=2)
    zoo = root / "zoo"
    add_variant(zoo, tiny_llama3, "ft1", ft1, CHEAP, progress=None)
    add_variant(zoo, tiny_llama3, "ft2", ft2, CHEAP, progress=None)
    return ZooFixture(tiny_llama3, ft1, ft2, zoo)
