"""Compressed deltas of the tiny test models, for serving tests: a "full fine-tune" made by perturbing
every tensor of a base checkpoint, compressed with ``deltaserve compress``'s own ``compress``, and its
dense reference ``W_base + dequant(Δ̃)`` written by ``materialize`` (what ``transformers`` runs).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from deltaserve.compress import materialize
from deltaserve.compress.compressor import CompressConfig, compress


def make_finetune(base: Path, out: Path, seed: int, scale: float = 0.3) -> Path:
    """A copy of ``base`` with every tensor moved by ``scale`` x its mean magnitude of noise (tied
    embeddings stay tied). Large enough that greedy outputs differ from the base's."""
    shutil.copytree(base, out)
    tensors = load_file(out / "model.safetensors")
    gen = torch.Generator().manual_seed(seed)
    for name, t in tensors.items():
        tensors[name] = t + scale * t.abs().mean() * torch.randn(t.shape, generator=gen)
    if "lm_head.weight" in tensors and json.loads((out / "config.json").read_text()).get("tie_word_embeddings"):
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    save_file(tensors, str(out / "model.safetensors"))
    return out


def make_delta(
    base: Path,
    root: Path,
    seed: int,
    bits: int = 4,
    sparse: bool = True,
    full_weights: bool = False,
    group_size: int = 64,
) -> tuple[Path, Path]:
    """A compressed delta of a perturbed ``base`` under ``root``; returns (delta dir, dense reference dir)."""
    root.mkdir(parents=True, exist_ok=True)
    ft = make_finetune(base, root / "finetuned", seed)
    delta = root / "delta"
    cfg = CompressConfig(
        bits=bits, sparse=sparse, nsamples=8, seqlen=32, full_weights=full_weights, group_size=group_size
    )
    compress(base, ft, delta, cfg, None)
    return delta, materialize(delta, base, root / "reference")
