"""Equivalence by logit lens (BlockLLM §4.1): how much a variant changes if one of its blocks is the base's.

For each component c asked about, on calibration text (one prefill of every sample)::

    own(c)    the residual stream where c's effect is complete, in the variant
    base(c)   the same, in the variant with c's tensors replaced by the base's
    lens(s)   = softmax(lm_head(norm(s)))           the variant's final norm and lm_head
    similarity(c) = mean over tokens of cos(lens(own(c)), lens(base(c)))

"Where c's effect is complete": the embedding's at the input of layer 0, a layer's attention or FFN
at the output of its decoder layer (for attention, one FFN later: the decoder layer is the unit the
model code runs, see below), the head's on its own probabilities over the variant's final stream.
The stream is the variant's own everywhere else, so each similarity answers "replace only this block".

It runs the repo's ``DecoderLM`` (``model/decoder.py``) as it is, on the CPU in float32: the base
block goes in by ``load_state_dict`` of its HF tensors, forward hooks read the stream
(``DecoderLayer`` returns ``(h, residual)``, the stream being ``h + residual``), and a forward stops
once it has what it needs. Memory: the variant in float32 plus one block.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..model.batch import ForwardBatch
from ..model.decoder import DecoderLM
from ..model.kv_cache import PagedKVCache
from ..model.loader import load_model
from .blocks import EMBED, HEAD, Checkpoint, components, tensor_names

_PAGE = 16
"""Tokens per page of the scratch KV cache."""


class _Stop(Exception):
    """Raised by a hook once the forward has produced what is wanted."""


def _stream(out: Any) -> torch.Tensor:
    h, residual = out
    return h if residual is None else h + residual


def lens_similarities(
    base_dir: str | Path, variant_dir: str | Path, samples: list[list[int]], asked: set[str]
) -> dict[str, float]:
    """``similarity(c)`` (module docstring) for every component ``c`` in ``asked``."""
    variant = load_model(variant_dir, "cpu", torch.float32)
    cfg = variant.config
    names = tensor_names(cfg)
    base_ck, variant_ck = Checkpoint(base_dir), Checkpoint(variant_dir)
    seqs, page = [], 0
    for s in samples:
        n = -(-len(s) // _PAGE)
        seqs.append((s, 0, list(range(page, page + n)), True))
        page += n
    batch = ForwardBatch.build(seqs, _PAGE, "cpu")
    kv = PagedKVCache(cfg.num_layers, page, _PAGE, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    layers = variant.model.layers

    def stream_at(layer: int | None) -> torch.Tensor:
        """The stream entering layer 0 (None) or leaving ``layer``, stopping the forward there."""
        got: list[torch.Tensor] = []

        def pre(_m: Any, args: tuple[Any, ...]) -> None:
            got.append(_stream(args[:2]))
            raise _Stop

        def post(_m: Any, _args: Any, out: Any) -> None:
            got.append(_stream(out))
            raise _Stop

        hook = layers[0].register_forward_pre_hook(pre) if layer is None else layers[layer].register_forward_hook(post)
        try:
            variant(batch, kv)
        except _Stop:
            pass
        finally:
            hook.remove()
        return got[0]

    def lens(s: torch.Tensor, model: DecoderLM = variant) -> torch.Tensor:
        return torch.softmax(model.lm_head(model.model.norm(s)).float(), dim=-1)

    def swapped(c: str, ck: Checkpoint) -> None:
        variant.load_state_dict({n: t.float() for n, t in ck.tensors(names[c])}, strict=False)

    out: dict[str, float] = {}
    with torch.no_grad():
        final = stream_at(cfg.num_layers - 1)
        for c in components(cfg.num_layers):
            if c not in asked:
                continue
            if c == HEAD:
                own = lens(final)
                swapped(c, base_ck)
                other = lens(final)
            else:
                at = None if c == EMBED else int(c.split(".")[1])
                own = lens(stream_at(at))
                swapped(c, base_ck)
                other = lens(stream_at(at))
            swapped(c, variant_ck)
            out[c] = float(F.cosine_similarity(own, other, dim=-1).mean())
    return out
