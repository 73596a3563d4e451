"""The model: one generic decoder for the Llama family over a paged KV cache.

Layout (the data flow of one step):

- ``arch``       ``ARCH_TABLE`` (what differs between families) and ``ModelConfig`` (config.json)
- ``loader``     HF safetensors directory -> ``DecoderLM`` (``load_model``); ``random_model`` for benches
- ``kv_cache``   ``PagedKVCache``: the page pool ``[L, 2, num_blocks, block_size, H_kv, D]``
- ``batch``      ``ForwardBatch``: one step's ragged batch, flattened, plus its builder
- ``attention``  ``write_kv`` and ``paged_attention_ref``, the reference every kernel is tested against
- ``decoder``    ``DecoderLM.forward(batch, kv) -> logits`` for the rows that sample
"""

from .arch import ARCH_TABLE, ArchSpec, ModelConfig
from .attention import paged_attention_ref, write_kv
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
