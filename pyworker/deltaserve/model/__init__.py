"""The model: one generic decoder (Llama, Mistral, Qwen2/3, Gemma 2/3, Phi-3) over a paged KV cache.

Layout (the data flow of one step):

- ``arch``       ``ARCH_TABLE`` (what differs between families) and ``ModelConfig`` (config.json)
- ``loader``     HF safetensors directory -> ``DecoderLM`` (``load_model``); ``random_model`` for benches
- ``kv_cache``   ``PagedKVCache``: the page pool ``[L, 2, num_blocks, block_size, H_kv, D]``
- ``batch``      ``ForwardBatch``: one step's ragged batch, flattened, plus its builder
- ``rope``       RoPE tables per kind (plain / scaled, Gemma 3's local table, LongRoPE's short | long rows)
- ``norm``       ``RMSNorm`` in Llama's and Gemma's (``1 + weight``) conventions
- ``attention``  ``paged_attention_ref`` (per-layer window, soft-cap), the reference
                 every kernel is tested against; ``write_kv`` (the cache store) is ``kernels.rope``'s
- ``decoder``    ``DecoderLM.forward(batch, kv) -> logits`` for the rows that sample
"""

from ..kernels.rope import write_kv
from .arch import ARCH_TABLE, ArchSpec, ModelConfig
from .attention import paged_attention_ref
from .batch import ForwardBatch
from .decoder import DecoderLM
from .kv_cache import PagedKVCache
from .loader import load_model, random_model

__all__ = [
    "ARCH_TABLE",
    "ArchSpec",
    "DecoderLM",
    "ForwardBatch",
    "ModelConfig",
    "PagedKVCache",
    "load_model",
    "paged_attention_ref",
    "random_model",
    "write_kv",
]
