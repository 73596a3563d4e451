"""Blocks: a checkpoint cut at architectural boundaries only, and the content hash of each piece.

The components of a decoder, in forward order (BlockLLM §4.3's finest units)::

    embed               model.embed_tokens.weight
    layers.{i}.attn     model.layers.{i}.input_layernorm.weight, model.layers.{i}.self_attn.*
    layers.{i}.mlp      model.layers.{i}.post_attention_layernorm.weight, model.layers.{i}.mlp.*
                        (with sandwich norms, Gemma 2: pre/post_feedforward_layernorm and mlp; the
                        post_attention_layernorm then goes with the attention)
    head                model.norm.weight, lm_head.weight (untied only; a tied head is the embedding)

A component's output is the residual stream after it (the head's: the logits), which is exactly the
next component's input: there is no arithmetic between blocks. Each norm goes with the sub-layer it
belongs to, so a block is a function of the stream alone.

``content_hash`` is sha256 over every tensor's name, dtype, shape and bytes in name order: two
components with the same hash hold the same tensors at the same place, whichever checkpoint they
come from (identical blocks, stored once).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from ..compress.delta_dir import checkpoint_shapes
from ..model.arch import ModelConfig
from ..model.decoder import DecoderLM

EMBED, HEAD = "embed", "head"
"""The names of the first and last component."""
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.([a-z_]+)\.")
_ATTN_PARTS = {"input_layernorm", "self_attn"}
_MLP_PARTS = {"pre_feedforward_layernorm", "mlp", "post_feedforward_layernorm"}


def components(num_layers: int) -> list[str]:
    """Every component name in forward order."""
    return [EMBED, *(f"layers.{i}.{part}" for i in range(num_layers) for part in ("attn", "mlp")), HEAD]


def layer_of(component: str) -> int:
    """The decoder layer a component belongs to: -1 for the embedding, ``num_layers`` for the head."""
    if component == EMBED:
        return -1
    if component == HEAD:
        return 1 << 30
    return int(component.split(".")[1])


def component_of(tensor: str, sandwich: bool = False) -> str:
    """The component an HF checkpoint tensor belongs to (ValueError for one outside every component).

    ``post_attention_layernorm`` feeds the FFN in a pre-norm layer (Llama), but normalises the
    attention's output where the FFN has its own ``pre_feedforward_layernorm`` (``sandwich``, Gemma 2)."""
    if tensor == "model.embed_tokens.weight":
        return EMBED
    if tensor in ("model.norm.weight", "lm_head.weight"):
        return HEAD
    m = _LAYER_RE.match(tensor)
    attn = _ATTN_PARTS | ({"post_attention_layernorm"} if sandwich else set())
    mlp = _MLP_PARTS | (set() if sandwich else {"post_attention_layernorm"})
    if m is None or m.group(2) not in attn | mlp:
        raise ValueError(f"tensor '{tensor}' belongs to no block (embedding, attention, FFN, final norm + lm_head)")
    return f"layers.{m.group(1)}.{'attn' if m.group(2) in attn else 'mlp'}"


def is_sandwich(tensors: list[str]) -> bool:
    """Whether a checkpoint's layers norm the FFN input on their own (``component_of``)."""
    return any(".pre_feedforward_layernorm." in n for n in tensors)


def tensor_names(cfg: ModelConfig) -> dict[str, list[str]]:
    """Component -> the HF tensor names it holds (sorted), as ``DecoderLM`` reads a checkpoint of ``cfg``."""
    with torch.device("meta"):
        layout = DecoderLM(cfg, dtype=torch.float32).checkpoint_layout()
    out: dict[str, list[str]] = {c: [] for c in components(cfg.num_layers)}
    sandwich = is_sandwich(list(layout))
    for name in layout:
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        out[component_of(name, sandwich)].append(name)
    return {c: sorted(names) for c, names in out.items()}


class Checkpoint:
    """Per-tensor reads of an HF directory (headers once, files kept open while in use)."""

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        self.located = checkpoint_shapes(self.model_dir)
        """Tensor name -> (file, shape)."""
        self._handles: dict[Path, object] = {}

    def get(self, name: str) -> torch.Tensor:
        """One tensor as stored (CPU, its own dtype); KeyError names the directory."""
        if name not in self.located:
            raise KeyError(f"{self.model_dir} lacks tensor '{name}'")
        f = self.located[name][0]
        handle = self._handles.get(f)
        if handle is None:
            handle = self._handles[f] = safe_open(f, framework="pt")
        return handle.get_tensor(name)  # type: ignore[attr-defined]

    def tensors(self, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        for name in names:
            yield name, self.get(name)


def content_hash(tensors: Iterator[tuple[str, torch.Tensor]]) -> str:
    """sha256 (hex) of (name, dtype, shape, bytes) of each tensor, in the order given (sorted by name)."""
    h = hashlib.sha256()
    for name, t in tensors:
        h.update(f"{name}|{str(t.dtype).removeprefix('torch.')}|{list(t.shape)}|".encode())
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def component_hashes(ck: Checkpoint, names: dict[str, list[str]]) -> dict[str, str]:
    """Component -> ``content_hash`` of its tensors in ``ck``."""
    return {c: content_hash(ck.tensors(ns)) for c, ns in names.items()}
