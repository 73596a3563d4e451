"""``ForwardBatch``: one step's ragged batch, flattened, as the model consumes it.

Sequences are laid end to end in token order (no padding on the token axis)::

    seq 0: 5 prompt tokens (prefill) | seq 1: 1 token (decode) | seq 2: 3 tokens (chunk)
    input_ids       [t t t t t | t | t t t]                      T = 9
    query_start_loc [0, 5, 6, 9]                                 B + 1
    positions       [0 1 2 3 4 | 17 | 8 9 10]                    num_computed_before + i
    seq_lens        [5, 18, 11]                                  context after this step
    slot_mapping    block_table[pos // bs] * bs + pos % bs       where each token's K/V goes
    logits_indices  rows whose logits are wanted (last row of each sampling sequence)

The executor builds one per step (``ForwardBatch.build``); tests and benchmarks use the same builder.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

STAGING_BYTES = 8 << 20
"""Pinned host memory that small host tensors reach the device through (``_Staging``); a step's
inputs take a few KB to a few hundred KB."""
STAGED_MAX = STAGING_BYTES // 8
"""Larger host tensors are pinned on their own (an adapter's host copy already is)."""


class _Staging:
    """One pinned host buffer, allocated once, that small host tensors are copied through on their way
    to the device, so the thread that launches steps never allocates pinned memory per step.

    Pinning memory is a slow driver call that also stalls the other threads' copies and launches
    while it runs (``bench/pinned_alloc_contention.py``, and why the host tiers' copies come from a
    ``PinnedArena`` pinned at start-up): a step must not pin its inputs one by one.

    The buffer is used in two halves: filling one, then the other. Leaving a half records an event
    behind the copies made from it; a half is reused only once its event has completed (long done
    in practice: a half holds many steps' inputs). The fence covers the copies queued before a half
    is left, so every copy from a staged tensor must be queued, on the current stream, before the
    next ``stage`` call: the worker's main thread stages and copies at once, on its one stream (the
    lock only keeps the offsets consistent).
    """

    def __init__(self) -> None:
        self.buf = torch.empty(STAGING_BYTES, dtype=torch.uint8, pin_memory=True)
        self.half = STAGING_BYTES // 2
        self.cur = 0
        """The half being filled."""
        self.off = 0
        """Next free byte in it (256-aligned)."""
        self.fence: list[torch.cuda.Event | None] = [None, None]
        """Per half: the event recorded when it was last left, waited for before it is refilled."""
        self.lock = threading.Lock()

    def stage(self, host: torch.Tensor) -> torch.Tensor:
        """A pinned copy of ``host`` (at most ``STAGED_MAX`` bytes) in the buffer, valid until the
        copies queued from it have run."""
        n = host.numel() * host.element_size()
        with self.lock:
            if self.off + n > self.half:
                left = torch.cuda.Event()
                left.record()
                self.fence[self.cur] = left
                self.cur, self.off = 1 - self.cur, 0
                fence, self.fence[self.cur] = self.fence[self.cur], None
                if fence is not None:
                    fence.synchronize()
            start = self.cur * self.half + self.off
            self.off += (n + 255) // 256 * 256
        staged = self.buf[start : start + n].view(host.dtype).view(host.shape)
        staged.copy_(host)
        return staged


_staging: _Staging | None = None
"""The process's staging buffer (a worker drives one device from one stream), made on first use."""
_staging_lock = threading.Lock()


def _pinned(host: torch.Tensor) -> torch.Tensor:
    """``host`` in pinned memory: itself if pinned, a staged copy if small (``_Staging``), else a
    newly pinned copy."""
    n = host.numel() * host.element_size()
    if n <= STAGED_MAX and not torch.cuda.is_current_stream_capturing():
        global _staging
        if _staging is None:
            with _staging_lock:
                if _staging is None:
                    _staging = _Staging()
        return _staging.stage(host)
    return host if host.is_pinned() else host.pin_memory()


def to_device(data: list, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A tensor of host ``data`` on ``device`` without waiting for the device's queued work
    (``host_to_device`` of ``torch.tensor(data, dtype=dtype)``)."""
    return host_to_device(torch.tensor(data, dtype=dtype), device)


def host_to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Host tensor ``host`` on ``device`` without waiting for the device's queued work.

    ``host.to(cuda)`` from pageable memory copies synchronously, which waits for every kernel
    already queued: a step (or an adapter placement) done that way could not be launched while the
    previous step still runs. The copy goes from pinned memory (small tensors through a pinned
    staging buffer allocated once, ``_Staging``; large ones pinned as they are), so it is
    asynchronous and ``host`` may change or go away afterwards. On the CPU, ``host`` itself.
    """
    if torch.device(device).type == "cpu":
        return host
    return _pinned(host).to(device, non_blocking=True)


def copy_from_host(dst: torch.Tensor, host: torch.Tensor) -> None:
    """``dst.copy_(host)`` into an existing device buffer (a CUDA graph's static input, a static
    table) without waiting for the device's queued work, for the reason ``host_to_device`` gives:
    the copy goes from pinned memory."""
    if dst.device.type != "cpu":
        host = _pinned(host)
    dst.copy_(host, non_blocking=True)


def scratch_sequences(
    lengths: list[tuple[int, int]], block_size: int
) -> tuple[list[tuple[list[int], int, list[int], bool]], int]:
    """``ForwardBatch.build`` sequences for forward passes whose results are thrown away (start-up
    profiling and warm-up): sequence i schedules ``lengths[i][0]`` tokens (id 0) after
    ``lengths[i][1]`` computed ones, on its own pages, numbered from 0 in sequence order; every row
    wants logits. Returns the sequences and how many pages they take."""
    seqs, first = [], 0
    for tokens, computed in lengths:
        pages = -(-(computed + tokens) // block_size)
        seqs.append(([0] * tokens, computed, list(range(first, first + pages)), True))
        first += pages
    return seqs, first


@dataclass
class ForwardBatch:
    """Flattened ragged batch of one forward step (see the module docstring for the layout)."""

    input_ids: torch.Tensor
    """LongTensor [T]: every scheduled token, sequence after sequence."""
    positions: torch.Tensor
    """LongTensor [T]: absolute position of each token in its sequence (RoPE, causal mask)."""
    query_start_loc: torch.Tensor
    """IntTensor [B+1]: cumulative tokens per sequence; sequence b owns rows [qsl[b], qsl[b+1])."""
    seq_lens: torch.Tensor
    """IntTensor [B]: context length of each sequence after this step (computed + scheduled)."""
    block_tables: torch.Tensor
    """IntTensor [B, max_blocks]: page ids per sequence in position order, padded with 0."""
    slot_mapping: torch.Tensor
    """LongTensor [T]: flat KV slot (page * block_size + offset) each token's K/V is written to."""
    logits_indices: torch.Tensor
    """LongTensor [S]: rows of the T tokens whose logits the forward returns, in this order."""
    max_seq_len: int
    """max(seq_lens) as a Python int: width of the gathered context (no device sync needed)."""
    max_query_len: int
    """Most tokens any one sequence has this step: height of the padded query block."""
    attn_tiles: torch.Tensor | None = None
    """IntTensor [N, 2] or None: the (sequence, query tile) of every program of the Triton prefill
    attention (``kernels.paged_attention.prefill_tiles``; rows of sequence -1 idle), a CUDA graph's
    fixed grid (``worker/mixed_graphs.py``); None: the grid follows ``max_query_len``. The
    reference attention ignores it."""
    single_rows: bool = True
    """Whether some sequence may have one token this step (the Triton attention then computes those
    rows with its decode kernel); False only when none has (``build`` knows)."""
    attn_tile_count: torch.Tensor | None = None
    """IntTensor [1] or None: how many rows of ``attn_tiles`` are real ones, first (None: all)."""
    host_q_lens: tuple[int, ...] | None = None
    """Tokens per sequence this step, on the host (``build`` knows them; None: unknown): the Triton
    attention builds its tile table from them once per forward when ``attn_tiles`` is None."""

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @classmethod
    def build(
        cls,
        seqs: list[tuple[list[int], int, list[int], bool]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> ForwardBatch:
        """Build from ``(token_ids_this_step, num_computed_before, block_table, wants_logits)`` per sequence.

        ``block_table`` lists the sequence's pages in position order and must cover
        ``num_computed_before + len(token_ids_this_step)`` tokens.
        """
        if not seqs:
            raise ValueError("ForwardBatch.build: empty batch")
        if block_size < 1:
            raise ValueError(f"ForwardBatch.build: block_size must be >= 1, got {block_size}")
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        qsl = [0]
        seq_lens: list[int] = []
        logits_idx: list[int] = []
        max_blocks = 1
        for i, (tokens, computed, table, wants_logits) in enumerate(seqs):
            n = len(tokens)
            if n == 0:
                raise ValueError(f"ForwardBatch.build: sequence {i} schedules no tokens")
            if computed < 0:
                raise ValueError(f"ForwardBatch.build: sequence {i} has num_computed_before={computed} < 0")
            total = computed + n
            need = -(-total // block_size)
            if len(table) < need:
                raise ValueError(
                    f"ForwardBatch.build: sequence {i} needs {need} pages for {total} tokens "
                    f"(block_size {block_size}) but its block table has {len(table)}"
                )
            input_ids.extend(tokens)
            for pos in range(computed, total):
                positions.append(pos)
                slots.append(table[pos // block_size] * block_size + pos % block_size)
            qsl.append(qsl[-1] + n)
            seq_lens.append(total)
            if wants_logits:
                logits_idx.append(qsl[-1] - 1)
            max_blocks = max(max_blocks, len(table))
        tables = [list(t) + [0] * (max_blocks - len(t)) for _, _, t, _ in seqs]
        return cls(
            input_ids=to_device(input_ids, torch.long, device),
            positions=to_device(positions, torch.long, device),
            query_start_loc=to_device(qsl, torch.int32, device),
            seq_lens=to_device(seq_lens, torch.int32, device),
            block_tables=to_device(tables, torch.int32, device),
            slot_mapping=to_device(slots, torch.long, device),
            logits_indices=to_device(logits_idx, torch.long, device),
            max_seq_len=max(seq_lens),
            max_query_len=max(qsl[i + 1] - qsl[i] for i in range(len(seqs))),
            single_rows=any(qsl[i + 1] - qsl[i] == 1 for i in range(len(seqs))),
            host_q_lens=tuple(qsl[i + 1] - qsl[i] for i in range(len(seqs))),
        )
