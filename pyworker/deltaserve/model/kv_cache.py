"""The paged KV cache: one pre-allocated pool of fixed-size pages per layer.

The worker holds the tensor; the router does the accounting (which page belongs to which
sequence) and sends page ids in every step's block tables. Layout, one allocation::

    kv: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
         layer ----^  ^-- 0 = K, 1 = V
    k[l] = kv[l, 0]   v[l] = kv[l, 1]          (views, shape [num_blocks, block_size, H_kv, D])
    flat slot of (block b, offset o) = b * block_size + o

The pool is zero-initialised: padded block-table entries point at page 0, and attention relies on
those gathered values being finite (masked with weight exactly 0; 0 * NaN would be NaN).
"""

from __future__ import annotations

import torch

from .arch import ModelConfig


class PagedKVCache:
    """All layers' K and V pages, in one tensor."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"PagedKVCache needs num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_layers = num_layers
        """Leading dimension; one (K, V) pair per decoder layer."""
        self.num_blocks = num_blocks
        """Pages in the pool; page ids in block tables are < num_blocks."""
        self.block_size = block_size
        """Tokens per page."""
        self.num_kv_heads = num_kv_heads
        """KV heads per token."""
        self.head_dim = head_dim
        """Width of each head."""
        self.dtype = dtype
        """Storage dtype (normally the model's dtype)."""
        self.kv = torch.zeros(
            (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim), dtype=dtype, device=device
        )
        """The whole pool, ``[L, 2, num_blocks, block_size, H_kv, D]``."""
        self.k = [self.kv[layer, 0] for layer in range(num_layers)]
        """Per-layer K views, ``[num_blocks, block_size, H_kv, D]``."""
        self.v = [self.kv[layer, 1] for layer in range(num_layers)]
        """Per-layer V views, ``[num_blocks, block_size, H_kv, D]``."""

    @property
    def device(self) -> torch.device:
        return self.kv.device

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes one page costs across all layers, K and V."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return num_layers * 2 * block_size * num_kv_heads * head_dim * itemsize

    @classmethod
    def for_budget(
        cls,
        cfg: ModelConfig,
        block_size: int,
        budget_bytes: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> PagedKVCache:
        """As many pages as fit in ``budget_bytes`` (error if not even one does)."""
        per_block = cls.bytes_per_block(cfg.num_layers, block_size, cfg.num_kv_heads, cfg.head_dim, dtype)
        num_blocks = int(budget_bytes) // per_block
        if num_blocks < 1:
            raise ValueError(
                f"KV cache budget {budget_bytes} bytes is smaller than one page ({per_block} bytes "
                f"for block_size={block_size}, {cfg.num_layers} layers, {cfg.num_kv_heads} kv heads, "
                f"head_dim={cfg.head_dim}, {dtype})"
            )
        return cls(cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, dtype, device)

    def __repr__(self) -> str:
        return (
            f"PagedKVCache(layers={self.num_layers}, blocks={self.num_blocks}, block_size={self.block_size}, "
            f"kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, dtype={self.dtype}, device={self.device})"
        )
