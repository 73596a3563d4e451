"""The zoo tests' checkpoints: the tiny 3-layer Llama as the base, fine-tunes made by perturbing
chosen layers of it, and one zoo holding two of them (built once per session).

- ``ft1``: layers 1 and 2 changed (a partial fine-tune that froze layer 0 and the embeddings/head)
- ``ft2``: ``ft1`` with layer 0 changed too (a child of ft1: shares its layers 1 and 2 exactly)

and a second zoo for substitution under load (``sub_zoo``): a copy of the first (not opted in) plus ``ft3``,
layer 1 barely changed and layer 2 changed a lot, added with ``--substitute-min-similarity 0.98``
(its substitute runs layer 1 as the base's, layer 2 its own).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, replace
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


@dataclass(frozen=True)
class SubZooFixture:
    base: Path
    ft1: Path
    ft3: Path
    zoo: Path


@pytest.fixture(scope="session")
def sub_zoo(zoo_fixture: ZooFixture, tmp_path_factory: pytest.TempPathFactory) -> SubZooFixture:
    root = tmp_path_factory.mktemp("sub_zoo")
    light = perturb(zoo_fixture.base, root / "light", ["model.layers.1."], 1e-3, seed=4)
    ft3 = perturb(light, root / "ft3", ["model.layers.2."], 0.5, seed=5)
    zoo = root / "zoo"
    shutil.copytree(zoo_fixture.zoo, zoo)  # ft1 and ft2, neither opted in
    add_variant(zoo, zoo_fixture.base, "ft3", ft3, replace(CHEAP, substitute_min_similarity=0.98), progress=None)
    return SubZooFixture(zoo_fixture.base, zoo_fixture.ft1, ft3, zoo)
